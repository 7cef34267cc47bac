"""The stride-1 ConvFirst block as the conv + FFN launches (kernels/convfirst/staged.py), the shipped form of
16-bit stride-1 blocks: the Triton kernels (interpreter on CPU) against the fp64 reference.

Coverage of the FFN kernel's loops: the interpreter runs INTERPRETER_SMS x 2 persistent programs, so
maps of 3-5 row tiles run each program's tile loop 2-3 times; the hidden chunks are all resident (C <= 64,
16-bit), all streamed (C = 72, 96, and every fp32 width: a runtime loop of 7-18 trips), in one channel
part or two (96 = 64 + 32, 48 = 32 + 16, 72 -> 64 + 16 masked), with a masked last chunk (R = 72, 432)
and masked last rows (M not a multiple of the tile).
"""

import math

import pytest
import torch
from convfirstnet.kernels.convfirst import launcher as K
from convfirstnet.kernels.convfirst import staged as S
from convfirstnet.kernels.convfirst.reference import convfirst_reference

from convfirstnet.kernels._cost import recording
from tests.kernels._traced import trace_triton_branch
from tests.kernels.test_convfirst import TOL, make_block, make_input, needs_cuda

# (N, C, H, W, R): stride-1 blocks at the model's widths and expansions
SHAPES = [
    pytest.param(2, 32, 17, 18, 96, id="c32-t3-612rows"),
    pytest.param(1, 16, 35, 9, 48, id="c16-t3-pad16"),
    pytest.param(2, 24, 9, 17, 72, id="c24-t3-pad32-masked-chunk"),
    pytest.param(2, 64, 17, 9, 384, id="c64-t6"),
    pytest.param(2, 96, 13, 11, 576, id="c96-t6-parts64+32"),
    pytest.param(2, 48, 9, 17, 288, id="c48-t6-parts32+16"),
    pytest.param(2, 72, 9, 17, 432, id="c72-t6-parts64+16"),
]


@pytest.fixture
def staged_on(monkeypatch):
    """The staged launches for every dtype (shipped: 16-bit only; fp32 runs the fused kernel)."""
    monkeypatch.setattr(K, "STAGED", True)


def _check(n, c, h, w, r, dtype, layout="tap-major"):
    x = make_input(n, c, h, w, dtype).contiguous(memory_format=torch.channels_last)
    p = make_block(c, r, c, 1, dtype, layout=layout)
    out = torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
    ref = convfirst_reference(x.double(), *(t.double() for t in p.values()), 1)
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def test_cases_run_every_loop_more_than_once():
    """Each case runs its programs' tile loop at least twice, and between them the hidden chunks are
    resident and streamed (several trips), in one and two channel parts (checked on the configs)."""
    kinds = set()
    for p in SHAPES:
        n, c, h, w, r = p.values
        for dtype in (torch.float16, torch.float32):
            cfg = S.ffn_config(c, r, dtype)
            tiles = math.ceil(n * h * w / cfg.block_m)
            programs = K.programs_for(cfg, tiles, torch.device("cpu"))
            assert math.ceil(tiles / programs) >= 2, (p.id, dtype)
            streamed = cfg.chunks - cfg.resident
            kind = "resident" if streamed == 0 else "streamed" if streamed > 1 else "?"
            kinds.add((kind, cfg.parts[1] > 0))
    assert kinds == {("resident", False), ("resident", True), ("streamed", False), ("streamed", True)}


@pytest.mark.parametrize("n,c,h,w,r", SHAPES)
def test_matches_reference_fp16(interpreter_backend, n, c, h, w, r):
    """The shipped path (STAGED None) of a 16-bit stride-1 block."""
    assert S.staged(torch.empty(1, c, 1, 1, dtype=torch.float16), 1)
    _check(n, c, h, w, r, torch.float16)


@pytest.mark.parametrize("n,c,h,w,r", SHAPES)
def test_matches_reference_fp32(interpreter_backend, staged_on, n, c, h, w, r):
    _check(n, c, h, w, r, torch.float32)


def test_contiguous_weights_and_strided_input(interpreter_backend):
    """Conv weights in their contiguous layout; an NCHW input (copied to channels-last once)."""
    _check(2, 32, 17, 18, 96, torch.float16, layout="contiguous")
    x = make_input(1, 48, 9, 17, torch.float16)  # NCHW
    p = make_block(48, 288, 48, 1, torch.float16)
    out = torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
    ref = convfirst_reference(x.double(), *(t.double() for t in p.values()), 1)
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float16][0], rtol=TOL[torch.float16][1])


def test_batch_zero_returns_empty(interpreter_backend):
    x = make_input(0, 32, 9, 9, torch.float16).contiguous(memory_format=torch.channels_last)
    out = torch.ops.convfirstnet.convfirst(x, *make_block(32, 96, 32, 1, torch.float16).values(), 1)
    assert out.shape == (0, 32, 9, 9) and out.is_contiguous(memory_format=torch.channels_last)


def test_launches_and_forms(monkeypatch):
    """16-bit stride 1 on sm_90: the conv then the FFN; fp32, stride 2 and sm_80: the fused kernel; STAGED
    forces either."""
    def kernels(dtype, stride=1, arch=90):
        c, k = (32, 32) if stride == 1 else (32, 64)
        x = torch.empty(4, c, 16, 16, device="meta", dtype=dtype).contiguous(
            memory_format=torch.channels_last)
        p = make_block(c, 6 * c, k, stride, dtype, device="meta")
        with recording(arch=arch) as rec:
            torch.ops.convfirstnet.convfirst(x, *p.values(), stride)
        return [lc.kernel.fn.__name__ for lc in rec.launches]

    assert kernels(torch.float16) == kernels(torch.bfloat16) == ["_gconv_fwd_kernel", "_convfirst_ffn_kernel"]
    assert kernels(torch.float32) == ["_convfirst_s1_kernel"]
    assert kernels(torch.float16, 2) == ["_convfirst_s2_kernel"]
    assert kernels(torch.float16, arch=80) == ["_convfirst_s1_kernel"]
    monkeypatch.setattr(K, "STAGED", False)
    assert kernels(torch.float16) == ["_convfirst_s1_kernel"]
    monkeypatch.setattr(K, "STAGED", True)
    staged = ["_gconv_fwd_kernel", "_convfirst_ffn_kernel"]
    assert kernels(torch.float32) == kernels(torch.float16, arch=80) == staged
    assert kernels(torch.float16, 2) == ["_convfirst_s2_kernel"]


@pytest.mark.parametrize("c,r,hw", [(32, 96, 128), (64, 384, 64), (96, 576, 32)])
def test_ffn_cost_declaration(c, r, hw):
    """useful MACs are the two 1x1 layers'; DRAM is one read of a and x, one write of out and the weights
    once; issued MACs and the loops follow the busiest persistent program's tiles and streamed chunks."""
    n = 128
    x = torch.empty(n, c, hw, hw, device="meta", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last)
    p = make_block(c, r, c, 1, torch.float16, device="meta")
    with recording() as rec:
        torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
    conv, ffn = rec.launches
    cfg = S.ffn_config(c, r, torch.float16)
    m = n * hw * hw
    cost = ffn.cost
    assert cost.useful_macs == 2 * m * c * r
    assert cost.dram_bytes == 2 * (3 * m * c + 2 * c * r + r + 2 * c)
    (programs,) = ffn.grid
    tiles = math.ceil(m / cfg.block_m)
    trips = math.ceil(tiles / programs)
    assert programs <= 132 * cfg.programs_per_sm and math.ceil(tiles / trips) == programs
    # issued: padded rows of the last tile, the channel parts' and the last chunk's padding (at most 1/8)
    assert cost.useful_macs <= cost.mma_macs <= 1.5 * cost.useful_macs * tiles * cfg.block_m / m
    (loop,) = cost.loops
    assert loop.name == "tiles" and loop.trips == trips
    assert [(lp.name, lp.trips) for lp in loop.body] == ([("streamed", cfg.chunks)] if c == 96 else [])
    # the conv launch is the plain group-width-8 forward: no bias, no epilogue
    assert conv.meta["BIAS_SILU"] is False and conv.meta["POOL"] is False and conv.meta["STRIDE"] == 1


@pytest.mark.subprocess
def test_torch_compile_traces_both_launches():
    """torch.compile(fullgraph=True) captures the conv and the FFN as two user-defined kernels."""
    pytest.importorskip("triton")
    targets = trace_triton_branch("convfirst", [2, 64, 384, 64, 9, 11, 1, "float16"])
    assert targets.count("triton_kernel_wrapper_functional") == 2, targets


@pytest.mark.compile
def test_small_ffn_variants_compile_as_declared():
    """Small's three stride-1 FFN variants at batch 128, 256 x 256 (fp16, sm_90), as the launcher makes
    them: no stack, the dots on wgmma, the programs per SM fit, the declared loops are the compiled ones;
    cp.async (the pipelined a and x rows) exactly where every chunk is resident, and otherwise the streamed
    chunks' weights alone skip L1 (ld.global.cg). Resident chunks (C = 32, 64) are loaded and stored to
    shared memory once, before the tile loop; per tile the loads are at most the a and x rows, b_conv, b2
    and the streamed chunks' b1 (the docstring's "resident" and the declaration's L1 bytes), and the
    declared L1 working set (the biases, which every tile re-reads)
    fits beside the compiled shared memory."""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of, weigh, weighted_counts
    from convfirstnet.analysis.hardware import hardware
    from convfirstnet.analysis.targets import target

    from tests.kernels.test_convfirst import _bytes, _shared_stores

    t = target(90)
    cases = []
    for c, r, hw in ((32, 96, 128), (64, 384, 64), (96, 576, 32)):
        x = torch.empty(128, c, hw, hw, device="meta", dtype=torch.float16).contiguous(
            memory_format=torch.channels_last)
        p = make_block(c, r, c, 1, torch.float16, device="meta")
        with recording(sms=t.sms, l2_bytes=t.l2_bytes, shared_per_block=t.smem_per_block, arch=t.arch) as rec:
            torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
        cases.append((c, r, rec.launches[1]))
    variants = [variant_of(lc, 90) for _, _, lc in cases]
    assert len({v.key for v in variants}) == 3
    for (c, r, launch), comp in zip(cases, compile_variants(variants)):
        cfg = S.ffn_config(c, r, torch.float16)
        what, nw = f"C={c} R={r}", comp.num_warps
        assert comp.stack == 0, f"{what}: {comp.stack} B of stack"
        assert comp.mma_kind == "wgmma", f"{what}: {comp.mma_kind}"
        assert t.occupancy(nw, comp.regs, comp.shared) >= cfg.programs_per_sm, what
        insns, loops = comp.listing()
        weighted_counts(insns, loops, launch.cost.loops, what)
        opcodes = {i.opcode for i in insns}
        pipelined = any(op.startswith("LDGSTS") for op in opcodes)
        assert pipelined == (cfg.stages > 1) == (cfg.resident == cfg.chunks), what
        strong = [op for op in opcodes if op.startswith("LDG") and "STRONG" in op]
        assert bool(strong) == (cfg.resident < cfg.chunks) and all(op.endswith("STRONG.GPU") for op in strong)
        resident = min(r, cfg.resident * cfg.block_h) * 2 * c * 2
        start = loops[0].start
        assert _bytes(insns, 0, start, nw, {"load_l1"}) >= resident, what
        assert _shared_stores(insns, 0, start, nw) >= resident, what
        w = weigh(insns, loops, launch.cost.loops, num_warps=nw)
        trips = launch.cost.loops[0].trips
        # (pipelined, the a and x rows skip L1; streamed, the chunks' weights do)
        rows = {"load_l1", "load_bypass"} if pipelined else {"load_l1"}
        body = _bytes(insns, start, loops[0].end + 1, nw, rows, w.weights) / trips
        # a and x rows; per thread one 16-byte vector of b_conv and of b2 per channel part, and the streamed
        # chunks' b1 at the BH / 4 columns of each that a thread's wgmma accumulator holds (the resident
        # chunks' b1 is loaded before the tile loop)
        parts = 1 + (cfg.parts[1] > 0)
        streamed = cfg.chunks - cfg.resident
        per_tile = 2 * cfg.block_m * sum(cfg.parts) * 2 + 32 * nw * (2 * 16 * parts
                                                                    + streamed * cfg.block_h // 2)
        assert body <= per_tile, f"{what}: {body} B requested per tile, over the {per_tile} B bound"
        if resident:  # a re-read of the resident weights would not fit in the bound's slack
            assert per_tile - body < resident, what
        l1 = hardware(90).l1_bytes(cfg.programs_per_sm * (comp.shared + t.smem_reserved_per_block))
        assert launch.cost.l1_working_set_bytes <= l1 / cfg.programs_per_sm, what


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("c,r,hw", [(16, 48, 128), (32, 96, 128), (32, 192, 64), (64, 384, 64), (96, 576, 32),
                                    (48, 288, 32), (72, 432, 32), (24, 72, 128)])
def test_paper_shapes_gpu(triton_backend, monkeypatch, c, r, hw, dtype):
    """The model's stride-1 shapes at batch 128 on the GPU, the shipped staged launches, against the fp32
    reference on the same rounded inputs."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x = make_input(128, c, hw, hw, dtype, device="cuda").contiguous(memory_format=torch.channels_last)
    p = make_block(c, r, c, 1, dtype, device="cuda")
    out = torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
    ref = convfirst_reference(x.float(), *(t.float() for t in p.values()), 1)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
