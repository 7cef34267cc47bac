"""torch.ops.convfirstnet.convfirst: Triton kernels (interpreter on CPU) against the fp32 reference.

Run: pytest tests/kernels/test_convfirst.py --durations=10
(conftest sets TRITON_INTERPRET=1 when there is no CUDA device; `triton_backend` selects the kernels.)

Coverage of the kernels' loops and masks (kernel.py header): the interpreter cases run at the model's
channel widths (C = 16 ... 96, R = 3C or 6C), so every hidden-chunk loop runs 2-18 times, the stride-1
conv runs one or two channel parts (96 = 64 + 32, 48 = 32 + 16, 72 -> 64 + 16 masked), the stride-2
blur/conv one, two or four channel parts, and the output one or two parts (K = 96, 72, 48); maps are
larger than one tile (several tiles per image, partial tiles) with odd and even sizes (BlurPool's
reflection at the bottom/right border only exists for odd sizes).

Every test here is of the fused kernels: 16-bit stride-1 blocks run them only when forced
(``launcher.STAGED = False``, set for the whole module); their shipped conv + FFN launches are
test_convfirst_staged.py's.
"""

import math
import os

import pytest
import torch
from convfirstnet.kernels.convfirst import launcher as K
from convfirstnet.kernels.convfirst.reference import convfirst_reference

from convfirstnet.blocks import ConvFirst, FusedConvFirst, tap_major
from convfirstnet.kernels._cost import recording
from tests.kernels._convfirst_util import nan_banded
from tests.kernels._recorded import SMEM_LIMIT
from tests.kernels._traced import trace_triton_branch

from ..conftest import sampled

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


@pytest.fixture(autouse=True, scope="module")
def fused_stride1():
    """The fused stride-1 kernel for every test of this module (module scope: before gpu_builds)."""
    saved, K.STAGED = K.STAGED, False
    yield
    K.STAGED = saved


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
    # not a model shape: R = 18C does not fit the resident budget, a prefix of its chunks does
    pytest.param(1, 64, 9, 17, 1152, 64, 1, id="s1-c64-t18-resident-prefix"),
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


def test_interpreter_cases_run_every_loop_more_than_once():
    """The SHAPES cases drive each persistent tile loop through several tiles (the interpreter runs
    INTERPRETER_SMS x programs_per_sm programs), with every hidden chunk resident, none, and a prefix,
    so that the streamed loop runs several trips too; checked on the configs, no kernel runs."""
    tile_trips, resident, cached = [], set(), set()
    for p in SHAPES:
        n, c, h, w, r, k, stride = p.values
        for dtype in (torch.float32, torch.float16):
            cfg = K.convfirst_config(c, k, stride, dtype, r)
            ho, wo = (h, w) if stride == 1 else ((h + 1) // 2, (w + 1) // 2)
            tiles = n * math.ceil(ho / cfg.tile_h) * math.ceil(wo / cfg.tile_w)
            tile_trips.append(math.ceil(tiles / K.programs_for(cfg, tiles, torch.device("cpu"))))
            if cfg.resident == cfg.chunks:
                resident.add((stride, "all"))
            elif tile_trips[-1] > 1 and cfg.chunks - cfg.resident > 1:
                resident.add((stride, "none" if cfg.resident == 0 else "prefix"))
            streamed = cfg.chunks - cfg.resident - cfg.cached
            if tile_trips[-1] > 1 and cfg.cached > 1 and streamed > 1:
                cached.add((c, cfg.conv_sub, cfg.residual_late, cfg.split_base))
    assert sum(t > 1 for t in tile_trips) >= 2 * len(tile_trips) // 3  # the rest: maps of one tile
    assert resident == {(s, kind) for s in (1, 2) for kind in ("all", "none", "prefix")}
    # the L1-cached loop and the streamed loop after it, both several trips, with the wide layout (conv
    # dots of 32 channels: two for the 64-channel part, the 16-channel part in M slices; residual last)
    assert {(72, 32, True, True), (96, 32, True, True)} <= cached


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,c,h,w,r,k,stride", SHAPES)
def test_matches_reference(interpreter_backend, n, c, h, w, r, k, stride, dtype):
    x = make_input(n, c, h, w, dtype).contiguous(memory_format=torch.channels_last)
    run_and_check(x, make_block(c, r, k, stride, dtype), stride)


# The stride-1 conv's two tap-pair load orders forced (launcher.TAP_ORDER; the shipped None takes per
# config the conflict-free one, launcher.tap_order(), which the other tests run; kernel.py _tap_pair):
# two images of partial tiles, one conv dot of 64 channels, the 32-channel conv dots of the wide layout
# (parts 64 + 32) and parts 32 + 16.
TAP_SHAPES = [p for p in SHAPES if p.id in ("s1-c32-t3-2x17x18", "s1-c64-t6-17x7", "s1-c96-t6-parts64+32",
                                            "s1-c48-t6-parts32+16")]


@pytest.mark.parametrize("taps", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,c,h,w,r,k,stride", TAP_SHAPES)
def test_tap_orders_match_reference(interpreter_backend, monkeypatch, n, c, h, w, r, k, stride, dtype, taps):
    monkeypatch.setattr(K, "TAP_ORDER", taps)
    x = make_input(n, c, h, w, dtype).contiguous(memory_format=torch.channels_last)
    run_and_check(x, make_block(c, r, k, stride, dtype), stride)


@pytest.mark.compile
def test_tap_pair_copies_conflict_free_order(monkeypatch):
    """launcher.tap_order() (the shipped TAP_ORDER None: conflict_free_tap_order() per config): fused
    Small's stage-2 stride-1 kernel (C = 64, fp16, sm_90) compiled with it copies the conv's tap pairs to
    shared memory and reads them back without bank conflicts (every 16-byte store and ldmatrix.x4 of warp
    0 at 32 lanes' bytes / 128), while order 0, shipped before, takes at least 1.5x those wavefronts (4x on
    its stores with Triton 3.6 and 3.8: the conflicts Nsight Compute measured). Order 0 put in the
    conflict-free order's place fails the first check."""
    from dataclasses import replace

    from convfirstnet.analysis.compiled import variant_of

    from ._asm import compile_asm, tap_copy_wavefronts

    v = variant_of(_record((64, 384, 64, 1), torch.float16), 90)
    cfg = K.convfirst_config(64, 64, 1, torch.float16, 384, 90)
    names = [n for n, _ in v.signature]

    def with_taps(taps):
        return replace(v, constexprs=tuple((p, taps if names[p[0]] == "TAPS" else x)
                                           for p, x in v.constexprs))

    assert K.TAP_ORDER is None or K.TAP_ORDER == int(os.environ.get("CONVFIRSTNET_TAP_ORDER", -1))
    monkeypatch.setattr(K, "TAP_ORDER", None)
    free_order = K.tap_order(cfg)  # 8 warps, one conv dot of 8 groups: batch 8
    free, shipped = compile_asm([with_taps(free_order), with_taps(0)])
    wf, ideal = tap_copy_wavefronts(free["ptx"])
    assert free_order == 1 and ideal > 0 and wf == ideal, (free_order, wf, ideal)
    wf0, ideal0 = tap_copy_wavefronts(shipped["ptx"])
    assert ideal0 == ideal and wf0 >= 1.5 * ideal0, (wf0, ideal0)


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
    for dtype in K.DTYPES:
        for c, r, k, stride in K.MODEL_SHAPES:
            cfg = K.convfirst_config(c, k, stride, dtype, r=r)
            assert sum(cfg.k_parts) >= k and all(p == 0 or p & (p - 1) == 0 for p in cfg.k_parts)
            assert cfg.block_h in (16, 32, 64) and cfg.num_warps in (4, 8) and cfg.num_stages == 1
            # the hidden loop pads R by at most 1/8
            assert math.ceil(r / cfg.block_h) * cfg.block_h - r <= r // 8
            # persistent programs; the resident chunks are a prefix of the hidden chunks
            assert cfg.programs_per_sm >= 1 and 0 <= cfg.resident <= cfg.chunks
            if stride == 1:
                assert cfg.c_parts == cfg.k_parts and sum(cfg.c_parts) == -(-c // 16) * 16
            else:
                cp, cp2 = cfg.c_parts
                assert cp >= c and cp % cp2 == 0 and cp // cp2 in (1, 2, 4)
    assert {cfg.stride for cfg in K.shipped_configs()} == {1, 2}
    # no padding of C = 96 to 128 (the model's widest stride-1 block)
    assert K.channel_parts(96) == (64, 32) and K.channel_parts(48) == (32, 16)


def test_persistent_programs():
    """As few programs as keep the busiest one at ceil(tiles / (SMs x programs per SM)) tiles."""
    cfg = K.convfirst_config(32, 32, 1, torch.float16, 96)
    meta = torch.device("meta")
    for sms, tiles in ((132, 8192), (132, 5), (100, 1000), (108, 4096)):
        with recording(sms=sms):
            programs = K.programs_for(cfg, tiles, meta)
        trips = math.ceil(tiles / (sms * cfg.programs_per_sm))
        assert programs <= min(tiles, sms * cfg.programs_per_sm)
        assert math.ceil(tiles / programs) == trips and math.ceil(tiles / (programs - 1 or 1)) > trips or programs == 1


@pytest.mark.parametrize("c,r,k,stride,hw", [(32, 96, 32, 1, 20), (96, 576, 96, 1, 9), (32, 192, 64, 2, 21),
                                              (64, 384, 96, 2, 18)])
def test_cost_declaration(c, r, k, stride, hw):
    """useful_macs is the block's paper count (profile.count_macs of the training block), the DRAM
    bytes are one read of x and one write of out (plus weights), and issued MACs follow the tiles of
    the busiest persistent program."""
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
    tiles = n * math.ceil(ho / cfg.tile_h) * math.ceil(ho / cfg.tile_w)
    (programs,) = launch.grid
    trips = math.ceil(tiles / programs)
    assert programs <= tiles and math.ceil(tiles / trips) == programs
    assert cost.mma_macs >= cost.useful_macs * (0.4 if stride == 2 else 1.0)  # stride 2 blurs first
    (tile_loop,) = cost.loops
    assert tile_loop.name == "tiles" and tile_loop.trips == trips
    chunk_loops = {lp.name: lp.trips for lp in tile_loop.body if lp.name in ("cached", "streamed")}
    left = cfg.chunks - cfg.resident
    assert chunk_loops == {name: t for name, t in (("cached", cfg.cached), ("streamed", left - cfg.cached)) if t}
    # the L1 working set is one tile's halo window plus the conv weights, the biases and the cached chunks'
    # weights (each hidden channel: a row of W1 and a column of W2)
    halo = (cfg.tile_h + 2) * (cfg.tile_w + 2) if stride == 1 else (2 * cfg.tile_h + 3) * (2 * cfg.tile_w + 3)
    cached = cfg.cached * cfg.block_h * ((c if stride == 1 else 2 * c) + k)
    assert cost.l1_working_set_bytes == 2 * (halo * c + 72 * c + c + r + k + cached)
    assert cost.l1_unique_bytes_per_program == 2 * (trips * halo * c + 72 * c + c + r + k + cached)


def test_large_batch_uses_one_grid_dimension():
    """The grid is 1-D and the tiles are numbered in one int32 index (limit 2^31 - 1): batches past 65535
    launch."""
    n = 70_000
    x = torch.empty(n, 16, 8, 8, device="meta", dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    p = make_block(16, 48, 16, 1, torch.float16, device="meta")
    with recording() as rec:
        torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
    (launch,) = rec.launches
    assert len(launch.grid) == 1 and launch.args[10] == n  # TILES: one 8 x 8 map, one tile per image


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


@pytest.mark.subprocess
@pytest.mark.parametrize("stride", [1, 2])
def test_torch_compile_traces_triton_branch(stride):
    """torch.compile(fullgraph=True) captures the persistent ConvFirst kernel as one user-defined kernel:
    Inductor's analysis of what it reads and writes follows its TTIR (resident weights, streamed chunks)."""
    pytest.importorskip("triton")
    c, r, k = (64, 384, 64) if stride == 1 else (32, 192, 64)
    targets = trace_triton_branch("convfirst", [2, c, r, k, 9, 11, stride])
    assert targets.count("triton_kernel_wrapper_functional") == 1, targets


# ------------------------------------------------------------------------------------------------
# The shipped configurations compile for the GPU, from the launches the launcher really makes at the
# model's shapes, and the compiled code is what kernel.py's header says (runs on CPU: worker processes,
# no interpreter). Sampled by default: every fp16 variant of ConvFirstNet-Small on sm_90 (what the cost
# report reads) and one variant of each other dtype / arch; every model shape, dtype and arch with
#     CONVFIRSTNET_FULL_MATRIX=1 python -m pytest tests/kernels/test_convfirst.py -m compile
# ------------------------------------------------------------------------------------------------

MAP = {(16, 48): 128, (24, 72): 128, (32, 96): 128, (32, 192): 64, (48, 288): 64, (64, 384): 64,
       (72, 432): 32, (96, 576): 32}  # stride-1 map sizes at a 256 x 256 input
SMALL = ((32, 96, 32, 1), (32, 192, 64, 2), (64, 384, 64, 1), (64, 384, 96, 2), (96, 576, 96, 1))
SAMPLE = [(shape, torch.float16, 90) for shape in SMALL] + [
    ((64, 384, 96, 2), torch.bfloat16, 90),  # the tap-row loop of the 16-bit non-fp16 blur
    ((32, 96, 32, 1), torch.float32, 90),  # 3xTF32
    ((96, 576, 96, 1), torch.float16, 80),  # mma.sync only, streamed chunks
]


def _cases():
    every = [(shape, dtype, arch) for arch in (90, 80) for dtype in K.DTYPES for shape in K.MODEL_SHAPES]
    return sampled(every, lambda case: case in SAMPLE)


def _record(shape, dtype, arch=90):
    c, r, k, stride = shape
    hw = MAP[(c, r)] if stride == 1 else (128 if c <= 24 else 64)
    p = make_block(c, r, k, stride, dtype, device="meta")
    x = torch.empty(128, c, hw, hw, device="meta", dtype=dtype).contiguous(memory_format=torch.channels_last)
    with recording(arch=arch) as rec:  # the launcher's tiles for that GPU
        torch.ops.convfirstnet.convfirst(x, *p.values(), stride)
    return rec.launches[0]


@pytest.fixture(scope="module")
def gpu_builds():
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    variants = {}
    for shape, dtype, arch in _cases():
        launch = _record(shape, dtype, arch)
        v = variant_of(launch, arch)
        variants.setdefault(v.key, (v, shape, dtype, launch))
    rows = list(variants.values())
    compiled = compile_variants([v for v, _, _, _ in rows])
    return [(*row, c) for row, c in zip(rows, compiled)]


def _bytes(insns, lo, hi, num_warps, kinds, weights=None):
    """Bytes the warps of one program request by the global memory instructions insns[lo:hi] of the given
    kinds (``analysis.sass.memory_op``; "load_l1": L1-allocating loads, "load_bypass": loads that skip L1),
    each executed weights[i] times (default once)."""
    from convfirstnet.analysis import sass

    total = 0
    for i in range(lo, hi):
        op = sass.memory_op(insns[i].opcode)
        if op is None or op.space != "global":
            continue
        kind = op.kind if op.kind != "load" else ("load_l1" if op.l1 else "load_bypass")
        if kind in kinds:
            total += op.bytes_per_lane * 32 * num_warps * (1 if weights is None else weights[i])
    return total


def _shared_stores(insns, lo, hi, num_warps):
    """Bytes the warps of one program store to shared memory by insns[lo:hi] (STS of 1-16 bytes per lane;
    STSM.16.M88 stores one 8 x 8 matrix of 16-bit values per 4 bytes a lane provides, .2 / .4 two / four)."""
    width = {"128": 16, "64": 8, "U16": 2, "U8": 1}
    total = 0
    for ins in insns[lo:hi]:
        parts = ins.opcode.split(".")
        if ins.family == "STS":
            lane = next((width[p] for p in parts[1:] if p in width), 4)
        elif ins.family == "STSM":
            lane = 4 * (int(parts[-1]) if parts[-1] in ("2", "4") else 1)
        else:
            continue
        total += lane * 32 * num_warps
    return total


@pytest.mark.slow
@pytest.mark.compile
def test_shipped_configs_compile_for_gpu(gpu_builds):
    from convfirstnet.analysis.compiled import weigh, weighted_counts
    from convfirstnet.analysis.hardware import hardware
    from convfirstnet.analysis.targets import target

    for v, (c, r, k, stride), dtype, launch, comp in gpu_builds:
        what = f"C={c} R={r} K={k} stride {stride} {dtype} sm_{v.arch}"
        cfg = K.convfirst_config(c, k, stride, dtype, r, v.arch)
        eb = dtype.itemsize
        assert comp.shared <= SMEM_LIMIT[v.arch], f"{what}: {comp.shared} B of shared memory"
        if v.arch == 90 and dtype != torch.float32:  # the performance targets (issue 18); the fp32
            # checking path and sm_80 are not held to them (3xTF32 spills up to 2 KB, as before this design)
            assert comp.stack == 0, f"{what}: {comp.stack} B of stack (register spills)"
        # the persistent programs of a launch are resident together
        occupancy = target(v.arch).occupancy(comp.num_warps, comp.regs, comp.shared)
        assert occupancy >= cfg.programs_per_sm, f"{what}: {occupancy} programs per SM fit"
        insns, loops = comp.listing()
        # the loops the launcher declares are the loops of the compiled code (the cost report's input);
        # checked for fp16, the report's default: the bf16/fp32 stride-2 variants loop over tap rows per
        # channel part (equal trip counts), and when ptxas unrolls one of them the matching is ambiguous
        if dtype == torch.float16:
            weighted_counts(insns, loops, launch.cost.loops, what)
        if v.arch == 90:
            assert comp.ptx_wgmma > 0, f"{what}: the FFN dots must compile to wgmma"
        opcodes = {i.opcode for i in insns}
        if dtype != torch.float32:
            # bias + ReLU + pack through cvt.rn.relu (the inline-asm path the interpreter cannot run)
            assert any(op.startswith("F2FP") and "RELU" in op for op in opcodes), what
        # L1: no cp.async at all (a pipelined 16-byte copy would be cp.async.cg, which skips L1): the conv
        # windows, residual, conv weights and biases are plain ld.global, allocated in L1 (LDG without
        # .STRONG), where the overlapping windows of a tile are re-read; the streamed hidden chunks'
        # weights alone skip L1 (ld.global.cg: LDG.E...STRONG.GPU), as the cost declaration counts them
        assert not any(op.startswith("LDGSTS") for op in opcodes), f"{what}: cp.async in the listing"
        assert any(op.startswith("LDG.E.128") and "STRONG" not in op for op in opcodes), what
        strong = [op for op in opcodes if op.startswith("LDG") and "STRONG" in op]
        assert bool(strong) == (cfg.resident + cfg.cached < cfg.chunks), f"{what}: L2-only loads {strong}"
        assert all(op.endswith("STRONG.GPU") for op in strong), what
        # the declared L1 working set (halo tile, conv weights, biases, cached chunks) fits in the L1 that
        # the compiled shared memory leaves (the report's rule for counting L1 re-reads as hits); sm_90 and
        # 16-bit, what the targets hold (the fp32 checking path's 3xTF32 tiles do not fit beside two programs)
        if v.arch == 90 and dtype != torch.float32:
            t = target(v.arch)
            l1 = hardware(v.arch).l1_bytes(cfg.programs_per_sm * (comp.shared + t.smem_reserved_per_block))
            assert launch.cost.l1_working_set_bytes <= l1 / cfg.programs_per_sm, (
                f"{what}: L1 working set {launch.cost.l1_working_set_bytes} B, {l1} B of L1 beside "
                f"{comp.shared} B of shared memory")
        # resident: the weights of the first `resident` hidden chunks are loaded from global memory and
        # stored to shared memory before the tile loop (the outermost loop), once per program
        c1 = -(-c // 16) * 16 if stride == 1 else 2 * cfg.c_parts[1] * -(-c // cfg.c_parts[1])
        # (their unpadded bytes: masked rows and columns of a part are not fetched)
        resident = min(r, cfg.resident * cfg.block_h) * ((c if stride == 1 else 2 * c) + k) * eb
        start = loops[0].start
        assert _bytes(insns, 0, start, comp.num_warps, {"load_l1"}) >= resident, what
        assert _shared_stores(insns, 0, start, comp.num_warps) >= resident, what
        # ... and not again per tile: the L1-allocating loads of one trip request at most the tile's
        # windows (ten two-tap slots of each channel part; stride 2: the 25 window vectors of each part)
        # and residual, and the conv weights (stride 2: nine block-diagonal [CP2, CP2] tiles per part) and
        # biases once per warp (each warp loads the operands of its own rows) (fp16, whose loops are
        # matched)
        if dtype == torch.float16:
            w = weigh(insns, loops, launch.cost.loops, num_warps=comp.num_warps)
            trips = launch.cost.loops[0].trips
            body = _bytes(insns, start, loops[0].end + 1, comp.num_warps, {"load_l1"}, w.weights) / trips
            m, kw, nw = cfg.block_m, sum(cfg.k_parts), comp.num_warps
            if stride == 1:
                per_tile = (10 * m * c1 + m * kw + nw * (80 * c1 + c1 + kw)) * eb
            else:
                per_tile = (25 * m * c1 // 2 + nw * (9 * cfg.c_parts[1] * c1 // 2 + c1 // 2 + kw)) * eb
            per_tile += cfg.chunks * 32 * nw * 4  # b1: at most one 4-byte vector per chunk and thread
            # the cached chunks' weights, loaded per tile through L1 (unpadded: masked columns are not fetched)
            per_tile += max(0, min(cfg.cached * cfg.block_h, r - cfg.resident * cfg.block_h)) * (
                (c if stride == 1 else 2 * c) + k) * eb
            assert body <= per_tile, f"{what}: {body} B requested per tile, over the {per_tile} B bound"
            # the bound can tell a re-read where its slack is below the resident bytes: Small's stride-1
            # variants (Pico's 3 KB of stage-1 weights hide in the slack of the per-warp broadcasts)
            if stride == 1 and (c, r, k, stride) in SMALL and resident:
                assert per_tile - body < resident, f"{what}: the bound would not see a re-read"


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
