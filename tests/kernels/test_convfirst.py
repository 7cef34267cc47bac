"""torch.ops.convfirstnet.convfirst: Triton kernels (interpreter on CPU) against the fp32 reference.

Run: pytest tests/kernels/test_convfirst.py --durations=10
(conftest sets TRITON_INTERPRET=1 when there is no CUDA device; `triton_backend` selects the kernels.)

Coverage of the kernels' loops and masks (kernel.py header): the interpreter cases run at the model's
channel widths (C = 16 ... 96, R = 3C or 6C), so every hidden-chunk loop runs 2-18 times, the stride-1
conv runs one or two channel parts (96 = 64 + 32, 48 = 32 + 16, 72 -> 64 + 16 masked), the stride-2
blur/conv one, two or four channel parts, and the output one or two parts (K = 96, 72, 48); maps are
larger than one tile (several tiles per image, partial tiles) with odd and even sizes (BlurPool's
reflection at the bottom/right border only exists for odd sizes).
"""

import math

import pytest
import torch
from convfirstnet.kernels.convfirst import launcher as K
from convfirstnet.kernels.convfirst.reference import convfirst_reference

from convfirstnet.blocks import ConvFirst, FusedConvFirst, tap_major
from tests.kernels._convfirst_util import nan_banded
from tests.kernels._recorded import SMEM_LIMIT

# dtype -> (atol, rtol), derived from rounding for outputs of O(1-5) magnitude (x ~ N(0, 1), fan-in
# scaled weights, unit-gain layers).
# fp32: the interpreter computes dots in fp32 (GPU: 3xTF32, products to ~2^-22); the summation order
#   differs from the reference over at most 72 + 2C + R < 1000 terms of O(1): a linear worst case of
#   1000 * 2^-23 ~ 1.2e-4, a random walk ~4e-6 (observed < 2e-6). atol 1e-4, rtol 1e-5.
# fp16: unit roundoff u = 2^-11 ~ 4.9e-4. The kernel rounds to fp16 where a layer-wise fp16 network
#   rounds: the conv output y (stride 2: the blurred inputs of the nine conv taps and blur(y)), the
#   hidden activation, the output. Stride 2 blurs in fp16x2 arithmetic: with power-of-two weights only
#   the additions round, 4 roundings of O(1) values, |err| <= 4u |x| ~ 2e-3 per blurred value, averaged
#   by the 72-term conv and the C-term expand. Each rounding feeds a unit-gain layer whose fan-in
#   averages independent errors, so the output error stays ~ a few u * |out| plus half an ulp of the
#   fp16 output (2e-3 at |out| in [4, 8)). Observed max |err| 3.9e-3 at |out| ~ 5 (1 ulp);
#   atol 4e-3 + rtol 2e-3 allows 2 ulp at |out| = 4 and is 5x tighter than one missing hidden chunk.
# bf16 (GPU only): the same roundings with u = 2^-8 (8x fp16); the stride-2 blur runs in fp32.
TOL = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (4e-3, 2e-3),
    torch.bfloat16: (3e-2, 1.6e-2),
}
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 dots are wrong in the interpreter)"
)
ALL_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)


def make_block(c, r, k, stride, dtype, device="cpu", seed=0, layout="tap-major"):
    """Folded-BN-like weights: fan-in scaled (unit gain), small biases. `layout`: how w_conv is stored
    ("tap-major" as FusedConvFirst stores it, or "contiguous")."""
    g = torch.Generator().manual_seed(seed)
    c1 = c if stride == 1 else 2 * c

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    w_conv = rnd(c, 8, 3, 3, scale=72 ** -0.5)
    return dict(
        w_conv=tap_major(w_conv) if layout == "tap-major" else w_conv, b_conv=rnd(c, scale=0.1),
        w1=rnd(r, c1, scale=c1 ** -0.5), b1=rnd(r, scale=0.1),
        w2=rnd(k, r, scale=(r / 2) ** -0.5), b2=rnd(k, scale=0.1),  # ReLU halves the variance
    )


def make_input(n, c, h, w, dtype, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, w, generator=g).to(device=device, dtype=dtype)


def run_and_check(x, p, stride):
    out = torch.ops.convfirstnet.convfirst(x, *p.values(), stride)
    ref = convfirst_reference(x, *p.values(), stride)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out


# (N, C, H, W, R, K, stride). Stride-1 tiles are 16 x 16 pixels, stride-2 tiles 8 x 8 (C <= 32) or
# 8 x 16 output pixels (C = 48, 64): the maps below span 2-4 tiles per image with partial tiles.
SHAPES = [
    # stride 1, stage-1 widths (t = 3) and the model's t = 6 widths
    pytest.param(2, 32, 17, 18, 96, 32, 1, id="s1-c32-t3-2x17x18"),
    pytest.param(1, 16, 35, 9, 48, 16, 1, id="s1-c16-t3-35x9-three-tile-rows"),
    pytest.param(1, 24, 9, 17, 72, 24, 1, id="s1-c24-t3-pad32"),
    pytest.param(1, 64, 17, 7, 384, 64, 1, id="s1-c64-t6-17x7"),
    pytest.param(1, 96, 7, 17, 576, 96, 1, id="s1-c96-t6-parts64+32"),
    pytest.param(1, 48, 9, 17, 288, 48, 1, id="s1-c48-t6-parts32+16"),
    pytest.param(1, 72, 6, 17, 432, 72, 1, id="s1-c72-t6-parts64+16"),
    # stride 2, every model shape: odd and even sizes, one, two (24 -> 32) or four channel parts
    pytest.param(2, 32, 19, 18, 192, 64, 2, id="s2-c32-k64-2x19x18"),
    pytest.param(1, 64, 18, 35, 384, 96, 2, id="s2-c64-k96-4parts-18x35"),
    pytest.param(1, 16, 17, 20, 96, 32, 2, id="s2-c16-k32-17x20"),
    pytest.param(1, 24, 20, 17, 144, 48, 2, id="s2-c24-k48-pad32"),
    pytest.param(1, 32, 9, 10, 192, 48, 2, id="s2-c32-k48"),
    pytest.param(1, 48, 17, 19, 288, 64, 2, id="s2-c48-k64"),
    pytest.param(1, 48, 10, 9, 288, 72, 2, id="s2-c48-k72"),
    pytest.param(2, 16, 2, 3, 96, 32, 2, id="s2-c16-smallest-map-2x3"),
    pytest.param(1, 16, 3, 2, 96, 32, 2, id="s2-c16-3x2"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,c,h,w,r,k,stride", SHAPES)
def test_matches_reference(interpreter_backend, n, c, h, w, r, k, stride, dtype):
    x = make_input(n, c, h, w, dtype).contiguous(memory_format=torch.channels_last)
    run_and_check(x, make_block(c, r, k, stride, dtype), stride)


@pytest.mark.parametrize("stride,k", [(1, 16), (2, 32)], ids=["s1", "s2"])
def test_batch_one_and_contiguous_weights(interpreter_backend, stride, k):
    """Batch 1, a map smaller than one tile, and w_conv in the default (C, 8, 3, 3) layout."""
    x = make_input(1, 16, 5, 7, torch.float32).contiguous(memory_format=torch.channels_last)
    p = make_block(16, 96, k, stride, torch.float32, layout="contiguous")
    assert p["w_conv"].is_contiguous()
    run_and_check(x, p, stride)


@pytest.mark.parametrize(
    "memory_format", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"]
)
@pytest.mark.parametrize("stride,k", [(1, 24), (2, 48)], ids=["s1", "s2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_strided_inputs_and_masks(interpreter_backend, stride, k, memory_format, dtype):
    """Non-contiguous views (NCHW or NHWC strides) inside a NaN-filled buffer: any unmasked read
    outside the tensor or any stride mistake shows up as NaN or a mismatch."""
    x = nan_banded(make_input(2, 24, 9, 11, dtype), memory_format)
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    out = run_and_check(x, make_block(24, 6 * 24, k, stride, dtype), stride)
    assert torch.isfinite(out).all()


def test_channels_last_views_are_read_in_place(interpreter_backend):
    """A channels-last view whose strides are multiples of 8 (here: a crop) is read through its
    strides, no copy; reading it at a wrong offset would read the cropped-away NaNs."""
    big = torch.full((2, 16, 12, 13), float("nan")).contiguous(memory_format=torch.channels_last)
    x = big[:, :, 2:11, 3:12]
    x.copy_(make_input(2, 16, 9, 9, torch.float32))
    assert K._vector_strides(x) is x
    for stride, k in ((1, 16), (2, 32)):
        run_and_check(x, make_block(16, 48, k, stride, torch.float32), stride)


@pytest.mark.parametrize("stride,k", [(1, 16), (2, 32)], ids=["s1", "s2"])
def test_batch_zero_returns_empty(interpreter_backend, stride, k):
    x = torch.empty(0, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    out = torch.ops.convfirstnet.convfirst(x, *make_block(16, 48, k, stride, torch.float32).values(), stride)
    ho = 9 if stride == 1 else 5
    assert out.shape == (0, k, ho, ho) and out.is_contiguous(memory_format=torch.channels_last)


def test_fused_block_matches_training_block(interpreter_backend):
    """ConvFirst.fuse() folds BatchNorm and stores w_conv tap-major; the kernels read it through its
    strides and agree with the training-form block (eval mode)."""
    torch.manual_seed(0)
    for stride, c, k in ((1, 32, 32), (2, 32, 64)):
        block = ConvFirst(c, k, stride, expansion=3 if stride == 1 else 6).eval()
        for bn in (block.bn_dw, block.bn_expand, block.bn_project):  # BatchNorms that do something
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.2, 0.2)
        fused = block.fuse()
        assert isinstance(fused, FusedConvFirst)
        assert fused.w_conv.shape == (c, 8, 3, 3) and fused.w_conv.stride() == (1, c, 24 * c, 8 * c)
        x = make_input(2, c, 11, 10, torch.float32).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), block(x), atol=1e-4, rtol=1e-4)
        half = fused.half()  # Module.half() keeps the tap-major layout
        assert half.w_conv.stride() == (1, c, 24 * c, 8 * c)


def test_rejects_unsupported_before_launch(interpreter_backend, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(K, "launch", no_launch)
    x = make_input(1, 12, 5, 5, torch.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        torch.ops.convfirstnet.convfirst(x, *make_block(12, 36, 12, 1, torch.float32).values(), 1)
    x = make_input(1, 136, 5, 5, torch.float32)
    with pytest.raises(ValueError, match="at most 128"):
        torch.ops.convfirstnet.convfirst(x, *make_block(136, 136, 136, 1, torch.float32).values(), 1)
    x = make_input(1, 72, 5, 5, torch.float32)
    with pytest.raises(ValueError, match="at most 64 input channels"):
        torch.ops.convfirstnet.convfirst(x, *make_block(72, 144, 96, 2, torch.float32).values(), 2)
    x = make_input(1, 16, 5, 5, torch.float32)
    with pytest.raises(ValueError, match="stride must be 1 or 2"):
        torch.ops.convfirstnet.convfirst(x, *make_block(16, 48, 16, 1, torch.float32).values(), 3)
    with pytest.raises(ValueError, match="at least 2x2"):
        torch.ops.convfirstnet.convfirst(make_input(1, 16, 1, 5, torch.float32),
                                         *make_block(16, 96, 32, 2, torch.float32).values(), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only guard")
def test_bf16_refused_in_interpreter(interpreter_backend):
    x = make_input(1, 16, 5, 5, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="interpreter"):
        torch.ops.convfirstnet.convfirst(x, *make_block(16, 48, 16, 1, torch.bfloat16).values(), 1)


# ------------------------------------------------------------------------------------------------
# Tile table and cost declarations (no kernel runs)
# ------------------------------------------------------------------------------------------------


def test_config_table_covers_model_shapes():
    for c, r, k, stride in K.MODEL_SHAPES:
        cfg = K.convfirst_config(c, k, stride, r=r)
        assert sum(cfg.k_parts) >= k and all(p == 0 or p & (p - 1) == 0 for p in cfg.k_parts)
        assert cfg.block_h in (16, 32, 64) and cfg.num_warps in (4, 8)
        # the hidden loop pads R by at most 1/8
        assert math.ceil(r / cfg.block_h) * cfg.block_h - r <= r // 8
        if stride == 1:
            assert cfg.c_parts == cfg.k_parts and sum(cfg.c_parts) == -(-c // 16) * 16
        else:
            cp, cp2 = cfg.c_parts
            assert cp >= c and cp % cp2 == 0 and cp // cp2 in (1, 2, 4)
    assert {cfg.stride for cfg in K.shipped_configs()} == {1, 2}
    # no padding of C = 96 to 128 (the model's widest stride-1 block)
    assert K.channel_parts(96) == (64, 32) and K.channel_parts(48) == (32, 16)


@pytest.mark.parametrize("c,r,k,stride,hw", [(32, 96, 32, 1, 20), (96, 576, 96, 1, 9), (32, 192, 64, 2, 21),
                                              (64, 384, 96, 2, 18)])
def test_cost_declaration(c, r, k, stride, hw):
    """useful_macs is the block's paper count (profile.count_macs of the training block), the DRAM
    bytes are one read of x and one write of out (plus weights), and issued MACs follow the tiles."""
    from convfirstnet.kernels._cost import recording

    from convfirstnet.profile import count_macs

    n = 3
    block = ConvFirst(c, k, stride, expansion=r // c)
    with recording() as rec:
        x = torch.empty(n, c, hw, hw, device="meta", dtype=torch.float16).contiguous(
            memory_format=torch.channels_last)
        block.fuse().half().to("meta")(x)
    (launch,) = rec.launches
    cost = launch.cost
    assert cost.useful_macs == n * count_macs(block, (c, hw, hw))
    cfg = K.convfirst_config(c, k, stride, torch.float16, r)
    ho = hw if stride == 1 else (hw + 1) // 2
    weights = 9 * 8 * c + c + r * (c if stride == 1 else 2 * c) + r + k * r + k
    assert cost.dram_bytes == 2 * (n * c * hw * hw + n * k * ho * ho + weights)
    assert launch.grid == (n * math.ceil(ho / cfg.tile_h) * math.ceil(ho / cfg.tile_w),)
    assert cost.mma_macs >= cost.useful_macs * (0.4 if stride == 2 else 1.0)  # stride 2 blurs first
    assert cost.loops[-1].name == "hidden" and cost.loops[-1].trips == math.ceil(r / cfg.block_h)


def test_large_batch_uses_one_grid_dimension():
    """The grid is 1-D (N x tiles programs, limit 2^31 - 1), so batches past 65535 launch."""
    from convfirstnet.kernels._cost import recording

    n = 70_000
    x = torch.empty(n, 16, 8, 8, device="meta", dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    p = make_block(16, 48, 16, 1, torch.float16, device="meta")
    with recording() as rec:
        torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
    assert len(rec.launches[0].grid) == 1 and rec.launches[0].grid[0] == n


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------


def _two_blocks(device):
    p = make_block(16, 48, 16, 1, torch.float32, device)
    p2 = make_block(16, 96, 32, 2, torch.float32, device)

    def f(x):
        y = torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
        return torch.ops.convfirstnet.convfirst(y, *p2.values(), 2)

    def ref(x):
        return convfirst_reference(convfirst_reference(x, *p.values(), 1), *p2.values(), 2)

    return f, ref


def test_torch_compile_fullgraph_cpu(reference_backend):
    """On CPU torch.compile traces the op's reference branch in one graph.

    The Triton branch cannot be compiled on CPU: under TRITON_INTERPRET the kernel is an interpreted
    function, which wrap_triton runs eagerly on fake tensors while tracing ("Cannot access data
    pointer of Tensor"), so the traced Triton path is checked on a GPU (test below)."""
    torch._dynamo.reset()
    f, ref = _two_blocks("cpu")
    x = make_input(1, 16, 7, 7, torch.float32).contiguous(memory_format=torch.channels_last)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, ref(x), atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


# ------------------------------------------------------------------------------------------------
# Every shipped configuration compiles for the GPU (sm_90 and sm_80, every dtype), from the launches
# the launcher really makes at the model's shapes. Runs on CPU (worker processes, no interpreter).
# ------------------------------------------------------------------------------------------------


def _model_launches():
    """One recorded launch per (model shape, dtype), at the map size the model runs it (256 x 256 input)."""
    from convfirstnet.kernels._cost import recording

    size = {(16, 48): 128, (24, 72): 128, (32, 96): 128, (32, 192): 64, (48, 288): 64, (64, 384): 64,
            (72, 432): 32, (96, 576): 32}
    out = []
    for dtype in K.DTYPES:
        for c, r, k, stride in K.MODEL_SHAPES:
            hw = size[(c, r)] if stride == 1 else (128 if c <= 24 else 64)
            p = make_block(c, r, k, stride, dtype, device="meta")
            x = torch.empty(128, c, hw, hw, device="meta", dtype=dtype).contiguous(
                memory_format=torch.channels_last)
            with recording() as rec:
                torch.ops.convfirstnet.convfirst(x, *p.values(), stride)
            out.append(((c, r, k, stride, dtype), rec.launches[0]))
    return out


@pytest.fixture(scope="module")
def gpu_builds():
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    launches = _model_launches()
    variants = {}
    for arch in (90, 80):
        for shape, launch in launches:
            v = variant_of(launch, arch)
            variants.setdefault(v.key, (v, shape, launch))
    rows = list(variants.values())
    compiled = compile_variants([v for v, _, _ in rows])
    return [(v, shape, launch, c) for (v, shape, launch), c in zip(rows, compiled)]


@pytest.mark.slow
def test_shipped_configs_compile_for_gpu(gpu_builds):
    from convfirstnet.analysis.compiled import weighted_counts

    dtypes = {shape[4] for _, shape, _, _ in gpu_builds}
    assert dtypes == set(K.DTYPES) and {v.arch for v, _, _, _ in gpu_builds} == {90, 80}
    for v, (c, r, k, stride, dtype), launch, comp in gpu_builds:
        what = f"C={c} R={r} K={k} stride {stride} {dtype} sm_{v.arch}"
        assert comp.shared <= SMEM_LIMIT[v.arch], f"{what}: {comp.shared} B of shared memory"
        # the loops the launcher declares are the loops of the compiled code (the cost report's input);
        # checked for fp16, the report's default: bf16/fp32 stride-2 variants loop over tap rows per
        # channel part (equal trip counts), and when ptxas unrolls one of them the matching is ambiguous
        insns, loops = comp.listing()
        if dtype == torch.float16:
            weighted_counts(insns, loops, launch.cost.loops, what)
        if v.arch == 90 and dtype == torch.float16:  # the performance targets (issue 10)
            assert comp.stack == 0, f"{what}: {comp.stack} B of stack (register spills)"
            assert comp.ptx_wgmma > 0, f"{what}: the FFN dots must compile to wgmma"
        opcodes = {i.opcode for i in insns}
        if dtype != torch.float32:
            # bias + ReLU + pack through cvt.rn.relu (the inline-asm path the interpreter cannot run)
            assert any(op.startswith("F2FP") and "RELU" in op for op in opcodes), what
        if stride == 1 and c % 16 == 0:
            # the conv taps are cached in L1 (cp.async.ca, not the L1-bypassing .cg) ... (C = 24, Pico's
            # stage 1, is one 32-channel part whose masked tail does not vectorize: 2-byte tap loads)
            tap_loads = [op for op in opcodes if op.startswith("LDGSTS") and "BYPASS" not in op]
            assert tap_loads, f"{what}: no L1-allocating async copies for the conv taps"
        elif stride == 2:
            # ... and the stride-2 window is read with plain (L1-cached) loads
            assert any(op.startswith("LDG.E") for op in opcodes), what


# ------------------------------------------------------------------------------------------------
# GPU only (skipped without CUDA): bf16, the paper's shapes (batch 128) vs the fp32 reference,
# torch.compile and CUDA graphs.
# ------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu(triton_backend, monkeypatch):
    """Inductor sees the launches as user-defined Triton kernels: one graph, same result as eager."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch._dynamo.reset()
    f, ref = _two_blocks("cuda")
    x = make_input(2, 16, 33, 31, torch.float32, "cuda").contiguous(memory_format=torch.channels_last)
    out = torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(out, f(x), atol=0, rtol=0)
    torch.testing.assert_close(out, ref(x), atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("stride,k", [(1, 32), (2, 64)], ids=["s1", "s2"])
def test_cuda_graph_replay_gpu(triton_backend, stride, k):
    """A captured launch replays on new input data and gives exactly the eager result."""
    p = make_block(32, 6 * 32, k, stride, torch.float16, "cuda")
    x = make_input(4, 32, 33, 30, torch.float16, "cuda").contiguous(memory_format=torch.channels_last)
    torch.ops.convfirstnet.convfirst(x, *p.values(), stride)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.convfirstnet.convfirst(x, *p.values(), stride)
    x.copy_(make_input(4, 32, 33, 30, torch.float16, "cuda", seed=7))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.ops.convfirstnet.convfirst(x, *p.values(), stride), atol=0, rtol=0)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,c,h,w,r,k,stride", SHAPES)
def test_bf16_matches_reference_gpu(triton_backend, monkeypatch, n, c, h, w, r, k, stride):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x = make_input(n, c, h, w, torch.bfloat16, "cuda").contiguous(memory_format=torch.channels_last)
    run_and_check(x, make_block(c, r, k, stride, torch.bfloat16, "cuda"), stride)


@needs_cuda
@pytest.mark.gpu
@ALL_DTYPES
@pytest.mark.parametrize("c,r,k,stride,hw", [
    # the paper's Table 1 shapes (batch 128) and the stride-2 blocks of Pico..Small at their resolutions
    (16, 48, 16, 1, 128), (32, 96, 32, 1, 128), (32, 192, 32, 1, 64), (48, 288, 48, 1, 64),
    (64, 384, 64, 1, 64), (48, 288, 48, 1, 32), (64, 384, 64, 1, 32), (96, 576, 96, 1, 32),
    (72, 432, 72, 1, 32), (24, 72, 24, 1, 128),
    (16, 96, 32, 2, 128), (24, 144, 48, 2, 128), (32, 192, 64, 2, 128),
    (32, 192, 48, 2, 64), (48, 288, 64, 2, 64), (48, 288, 72, 2, 64), (64, 384, 96, 2, 64),
])
def test_paper_shapes_gpu(triton_backend, monkeypatch, c, r, k, stride, hw, dtype):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # an exact fp32 reference
    x = make_input(128, c, hw, hw, dtype, "cuda").contiguous(memory_format=torch.channels_last)
    p = make_block(c, r, k, stride, dtype, "cuda")
    out = torch.ops.convfirstnet.convfirst(x, *p.values(), stride)
    # the fp32 reference on the dtype's inputs (the same rounded values the kernel sees)
    ref = convfirst_reference(x.float(), *(t.float() for t in p.values()), stride)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
