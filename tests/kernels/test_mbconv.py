"""torch.ops.convfirstnet.mbconv: the Triton kernels (interpreter on CPU) against the PyTorch reference.

Interpreter tests run at the model widths (C = 128 ... 256, R = 4C) on small maps, so that every
loop of the kernels runs more than once: work items over 3 programs, hidden chunks per item (chunk
groups of RESIDENT items), images per item, pixel tiles (maps of more than 64 pixels, exact and
masked tilings), the SE partials (one per chunk), the projection's R steps and both output
accumulators (K > 128), tiles of one image and of two images.
Narrow blocks (C = 48 ... 96) cover the padded and masked channel paths. Compile tests build every
launch configuration the four fused models make (any input size) for sm_90 and sm_80 and read the
compiled code: no spills, shared memory within the limit, the SiLU fast path, and the order of
scratch stores, barriers and loads.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from convfirstnet.kernels._blurpool import blurpool_reference
from convfirstnet.kernels.mbconv.launcher import tap_order
from convfirstnet.kernels.mbconv.reference import mbconv_layerwise, mbconv_reference

from ..conftest import FULL_MATRIX, cuda
from ._asm import compile_asm, tap_copy_wavefronts
from ._convfirst_util import nan_banded
from ._traced import trace_triton_branch

# dtype -> (atol, rtol) against the fp32 reference, for outputs of magnitude ~1-5 (unit-variance
# input plus residual, fan-in scaled weights).
# fp32: kernel and reference both accumulate in fp32 and differ in summation order over <= C, 72,
#   R terms (~1e-6 relative); GPU dots are 3xTF32 (~fp32). 3e-5 leaves room for FMA contraction;
#   a dropped loop offset or a wrong divisor shows up as 1e-3 ... 1.
# fp16: the kernel rounds h, g, the gate and the gated g to fp16 (unit roundoff u = 2^-11 = 4.9e-4
#   each) and the output once more. Each rounding of a dot operand perturbs the dot by ~u times its
#   result (random-sign errors over K terms grow like sqrt(K), as the result does), so the chain
#   h -> conv -> g -> gated g -> projection carries ~sqrt(4) u ~ 1e-3 relative error on the
#   projected part, and the output rounding adds up to u |out|. Measured at these shapes: max
#   |err| 1.3e-3 at |out| <= 5 (1.2e-3 before this kernel at C = 24). atol 2.5e-3 + rtol 2.5e-3 is
#   ~5 u at |out| = 1; the planted bugs below give errors >= 1e-2.
# bf16 (GPU only; the interpreter's bf16 dot is wrong): u = 2^-8, 8x fp16: 2e-2.
TOL = {
    torch.float32: (3e-5, 3e-5),
    torch.float16: (2.5e-3, 2.5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.fixture(scope="module", autouse=True)
def hidden_kernel_path():
    """This module tests the hidden kernel at every map size (launcher.STAGED = False); the tests of the
    staged launches, which the op takes by default, set STAGED themselves."""
    from convfirstnet.kernels.mbconv import launcher

    saved, launcher.STAGED = launcher.STAGED, False
    yield
    launcher.STAGED = saved


def make_block(n, c, h, w, stride, k=None, dtype=torch.float32, device="cpu", seed=0):
    """Input and folded weights: unit-variance x, weights ~ N(0, 1/fan_in), except the SE weights,
    scaled so that the gates spread over (0, 1) instead of all sitting near 0.5 (a wrong SE then
    shows; see test_gates_vary)."""
    k = c if k is None else k
    r, s = 4 * c, max(1, c // 4)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, fan_in=1, scale=1.0):
        t = torch.randn(*shape, generator=gen) * (scale / fan_in**0.5)
        return t.to(device=device, dtype=dtype)

    x = rnd(n, c, h, w).contiguous(memory_format=torch.channels_last)
    weights = (
        rnd(r, c, fan_in=c), rnd(r, scale=0.1),
        rnd(r, 8, 3, 3, fan_in=72), rnd(r, scale=0.1),
        rnd(s, r, fan_in=r, scale=40.0), rnd(s, scale=0.5),
        rnd(r, s, fan_in=s, scale=3.0), rnd(r, scale=1.0),
        rnd(k, r, fan_in=r), rnd(k, scale=0.1),
    )
    return x, weights


def reference(x, weights, stride):
    """The op's specification in fp32 (weights upcast), fp32 result."""
    return mbconv_reference(x.float(), *(t.float() for t in weights), stride)


def reference_gates(x, weights, stride):
    w_exp, b_exp, w_conv, b_conv, w1, b1, w2, b2 = (t.float() for t in weights[:8])
    h = F.silu(F.conv2d(x.float(), w_exp[:, :, None, None], b_exp))
    g = F.silu(F.conv2d(h, w_conv, b_conv, padding=1, groups=h.shape[1] // 8))
    if stride == 2:
        g = blurpool_reference(g)
    z = F.relu(g.mean(dim=(2, 3)) @ w1.T + b1)
    return torch.sigmoid(z @ w2.T + b2)


def check(x, weights, stride):
    out = torch.ops.convfirstnet.mbconv(x, *weights, stride)
    ref = reference(x, weights, stride)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    return out


# (N, C, K, H, W, stride, dtype): model widths on small maps, then the narrow channel counts.
SHAPES = [
    (3, 128, 128, 8, 8, 1, torch.float16),  # exact 8x8 tiles; 3 images per item, 8 chunks over 3 programs
    (2, 256, 256, 16, 8, 1, torch.float32),  # 16 chunks, two exact tiles per image, both accumulators
    (2, 160, 160, 9, 10, 1, torch.float16),  # masked tiles (3 per image), K = 160: partial 2nd accumulator
    (2, 192, 192, 1, 1, 1, torch.float32),  # 1x1 map: one real pixel per tile
    (2, 128, 128, 16, 16, 2, torch.float16),  # exact stride 2: 4 conv tiles, one blur tile
    (1, 96, 256, 11, 9, 2, torch.float32),  # odd map (reflect at every side), C = 96 padded to 128
    (2, 72, 192, 7, 7, 2, torch.float16),  # R = 288: a half-masked chunk; C = 72 padded
    (1, 48, 128, 2, 2, 2, torch.float32),  # smallest stride-2 map: 1x1 output
    (1, 64, 64, 17, 16, 1, torch.float16),  # 272 pixels: 16-bit data on the tiled (not RESIDENT) path
    (12, 128, 128, 8, 8, 1, torch.float16),  # 3 items of 4 images x all 8 chunks; 2 images per tile
]


def _id(shape):
    n, c, k, h, w, stride, dtype = shape
    return f"n{n}-c{c}-k{k}-{h}x{w}-s{stride}-{str(dtype)[6:]}"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_matches_reference(interpreter_backend, shape):
    n, c, k, h, w, stride, dtype = shape
    x, weights = make_block(n, c, h, w, stride, k=k, dtype=dtype)
    check(x, weights, stride)


# The staged launches (staged.py mbconv_staged_triton: the expand, the group-width-8 conv with bias and
# SiLU (stride 1: and the pool), stride 2: the BlurPool pass, the SE gates, the projection) on the same
# shapes: the same tolerances, as they round where the hidden kernel rounds (h, g, the gate, the output),
# in the same dtype.
STAGED_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[4], SHAPES[5], SHAPES[6], SHAPES[8],
                 (2, 256, 256, 16, 16, 1, torch.float16)]


@pytest.mark.parametrize("shape", STAGED_SHAPES, ids=_id)
def test_staged_matches_reference(interpreter_backend, monkeypatch, shape):
    from convfirstnet.kernels.mbconv import launcher

    monkeypatch.setattr(launcher, "STAGED", True)
    n, c, k, h, w, stride, dtype = shape
    x, weights = make_block(n, c, h, w, stride, k=k, dtype=dtype, seed=3)
    check(x, weights, stride)


@pytest.mark.parametrize("hw, stride", [(1, 1), (8, 1), (16, 1), (16, 2), (27, 2), (32, 2)])
def test_staged_unless_forced(monkeypatch, hw, stride):
    """Unforced (STAGED None), the op takes the staged launches at every map and stride (both measures of
    the cost report rank them faster at the four models' shapes, launcher.py). The conv's epilogue adds
    the bias and SiLU (BIAS_SILU); stride 1: it also pools (POOL), and the gates come from the pools;
    stride 2: the BN_d pass only blurs and pools (ACTIVATED). Forced off: the hidden kernel."""
    pytest.importorskip("triton")
    from convfirstnet.kernels.mbconv import launcher

    monkeypatch.setattr(launcher, "STAGED", None)
    launches, _ = _record(128, 128, 128, hw, hw, stride)
    names = [lc.kernel.fn.__name__ for lc in launches]
    if stride == 1:
        assert names == ["_expand_kernel", "_gconv_fwd_kernel", "_se_pool_gates_kernel",
                         "_mbconv_project_kernel"]
    else:
        assert names == ["_expand_kernel", "_gconv_fwd_kernel", "_bn_silu_pool_kernel", "_se_gates_kernel",
                         "_mbconv_project_kernel"]
        assert launches[2].meta["ACTIVATED"] is True
    conv = launches[1].meta
    assert conv["BIAS_SILU"] is True and conv["POOL"] is (stride == 1) and conv["STRIDE"] == 1
    assert launches[-1].meta["GATE"] is True and launches[-1].meta["RESIDUAL"] is (stride == 1)
    monkeypatch.setattr(launcher, "STAGED", False)
    launches, _ = _record(128, 128, 128, hw, hw, stride)
    assert [lc.kernel.fn.__name__ for lc in launches] == ["_mbconv_hidden_kernel", "_mbconv_project_kernel"]


def test_staged_builds_no_constant_tensors():
    """The staged forward (both strides) creates no tensor of constants: on a GPU each would be a fill
    kernel between the Triton launches (the expand's folded form reads b_exp alone; the stride-2 BlurPool
    pass reads no BatchNorm vectors)."""
    pytest.importorskip("triton")
    from torch.utils._python_dispatch import TorchDispatchMode

    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels.mbconv.staged import mbconv_staged_triton

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    for stride in (1, 2):
        _, weights = make_block(1, 128, 1, 1, stride, k=128)
        x = torch.empty(8, 128, 16, 16, device="meta", dtype=torch.float16).contiguous(
            memory_format=torch.channels_last)
        weights = [t.to(device="meta", dtype=torch.float16) for t in weights]
        with recording() as rec, Ops() as ops:
            mbconv_staged_triton(x, *weights, stride)
        assert rec.launches[0].kernel.fn.__name__ == "_expand_kernel"
        fills = [n for n in ops.names if n.startswith(("fill", "zero", "ones", "full", "scalar_tensor"))]
        assert not fills, (stride, fills)


def test_staged_falls_back_past_32_bit_offsets(monkeypatch):
    """Unforced, a batch whose expand output (P, R) passes 2^31 elements takes the hidden kernel (any batch)
    instead of the staged launches, whose expand kernel takes 32-bit offsets: batch 5462 at 32x32, R = 384."""
    pytest.importorskip("triton")
    from convfirstnet.kernels.mbconv import launcher

    monkeypatch.setattr(launcher, "STAGED", None)
    for n, staged in ((5461, True), (5462, False)):
        launches, _ = _record(n, 96, 256, 32, 32, 2)
        assert (launches[0].kernel.fn.__name__ == "_expand_kernel") is staged, n


@pytest.mark.parametrize("n, tiles, r, s", [(3, 20, 640, 40), (2, 1, 1024, 64)])
def test_se_pool_gates(interpreter_backend, n, tiles, r, s):
    """The stride-1 staged block's SE gates from the conv tiles' pools against fp64: 20 tiles an image run
    the pool-row loop three times (8 rows a step), R = 640 the channel loop three (256 a step, the last
    half masked), S = 40 a masked SE width (Nano's); 1 tile an image at Small's R and S. fp16 gates:
    2^-11 relative from the rounding, 2e-5 absolute for the fp32 sums of <= 1024 terms. A wrong divisor,
    a skipped row or channel step, or a dropped bias moves the gates by far more."""
    from convfirstnet.kernels.mbconv.staged import se_pool_gates

    gen = torch.Generator().manual_seed(4)
    pixels = 256
    pools = torch.randn(n * tiles, r, generator=gen) * (pixels / tiles) ** 0.5 + 0.2 * pixels / tiles
    w1 = torch.randn(s, r, generator=gen) * (6.0 / r**0.5)
    b1 = 0.5 * torch.randn(s, generator=gen)
    w2 = torch.randn(r, s, generator=gen) * (3.0 / s**0.5)
    b2 = torch.randn(r, generator=gen)
    w1h, b1h, w2h, b2h = (t.half() for t in (w1, b1, w2, b2))
    gates = se_pool_gates(pools, tiles, pixels, w1h, b1h, w2h, b2h, torch.float16, 0)
    mean = pools.double().reshape(n, tiles, r).sum(1) / pixels
    z = F.relu(mean @ w1h.double().T + b1h.double())
    want = torch.sigmoid(z @ w2h.double().T + b2h.double())
    assert gates.shape == (n, r) and gates.dtype == torch.float16
    assert 0.05 < want.std().item()  # gates spread over (0, 1)
    torch.testing.assert_close(gates.double(), want, atol=2e-5, rtol=2.0**-11)


# Each load order of the conv's tap pairs besides the one the other tests run (launcher.tap_order(), the
# conflict-free order of the installed Triton; kernel.py _conv_pair_h): stride 1 with two pixel
# sub-tiles per group on masked tiles, exact stride 2, and Small's 16x16 width (C = 256).
TAP_SHAPES = [SHAPES[2], SHAPES[4], (1, 256, 256, 16, 16, 1, torch.float16)]


@pytest.mark.parametrize("taps", sorted({0, 1, 2} - {tap_order()}))
@pytest.mark.parametrize("shape", TAP_SHAPES, ids=_id)
def test_tap_orders_match_reference(interpreter_backend, monkeypatch, taps, shape):
    from convfirstnet.kernels.mbconv import launcher

    monkeypatch.setattr(launcher, "TAP_ORDER", taps)
    n, c, k, h, w, stride, dtype = shape
    x, weights = make_block(n, c, h, w, stride, k=k, dtype=dtype)
    check(x, weights, stride)


# Fused Small's widths on the tiled configurations an A100 gets (launcher: 8-warp programs below sm_90):
# 128-pixel expand tiles (two per 16x16 image), 64-pixel ones (stride 2), items of four 8x8 images
# (six images: a full item and a partial one), 16-channel chunks with 128-pixel expand tiles (32x32
# stride 2, C = 96 padded to 128), every chunk loop and tile loop running more than once.
SM80_SHAPES = [
    (2, 256, 16, 1, 64, 128, 1),
    (6, 256, 8, 1, 64, 64, 4),
    (1, 256, 16, 2, 64, 64, 1),
    (1, 96, 32, 2, 16, 128, 1),
]


@pytest.mark.parametrize("n, c, hw, stride, rb, em, images", SM80_SHAPES,
                         ids=[f"n{s[0]}-c{s[1]}-{s[2]}x{s[2]}-s{s[3]}" for s in SM80_SHAPES])
def test_matches_reference_sm80_tiling(interpreter_backend, monkeypatch, n, c, hw, stride, rb, em, images):
    from convfirstnet.kernels._launch import GPUInfo
    from convfirstnet.kernels.mbconv import launcher

    a100 = GPUInfo(launcher.INTERPRETER_PROGRAMS, launcher.INTERPRETER_L2, 163 * 1024, 80)
    monkeypatch.setattr(launcher, "target_info", lambda device: a100)
    geo = launcher.mbconv_config(c, 4 * c, c, hw, hw, stride, n=n, dtype=torch.float16, device="cpu")
    assert (geo.resident, geo.hidden_warps, geo.rb, geo.em, geo.ib) == (False, 8, rb, em, images)
    x, weights = make_block(n, c, hw, hw, stride, dtype=torch.float16, seed=7)
    check(x, weights, stride)


# (N, C, K, H, W, stride): Small's widths (R = 1024, S = 64), stride 2 on an odd map (reflect padding
# at every side), and Pico's stride-2 block C = 48 -> K = 128.
LAYERWISE_SHAPES = [(2, 256, 256, 16, 16, 1), (2, 256, 256, 9, 7, 2), (2, 48, 128, 12, 12, 2)]


@pytest.mark.parametrize("n, c, k, h, w, stride", LAYERWISE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_layerwise_form_matches_reference(n, c, k, h, w, stride, dtype):
    """mbconv_layerwise (what FusedMBConv compiles where the fused kernels are slower) against the
    fp32 specification, within the kernel's tolerances (TOL). fp32: the same layers, so at most
    summation order. fp16: each layer's output rounded to fp16, as the kernel rounds h, g, the gate and
    the gated g (TOL's note), plus the pool and the projection; measured max 5.8e-4 at |out| <= 4.5.
    A dropped SE bias is off by 0.1."""
    x, weights = make_block(n, c, h, w, stride, k=k, dtype=dtype)
    out = mbconv_layerwise(x, *weights, stride)
    ref = reference(x, weights, stride)
    assert out.shape == ref.shape and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


def test_gates_vary():
    """The test weights make the SE gates spread (a missing or wrong gate changes the output)."""
    x, weights = make_block(2, 128, 8, 8, 1)
    gates = reference_gates(x, weights, 1)
    assert gates.std() > 0.15 and gates.min() < 0.1 and gates.max() > 0.9


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("stride", [1, 2])
def test_strided_inputs(interpreter_backend, stride, memory_format):
    """x as a view into a NaN-filled buffer (padded strides in both layouts): a missing mask or a
    wrong stride reads NaN. Model width, maps larger than a tile."""
    x, weights = make_block(2, 128, 9, 11, stride, k=128, dtype=torch.float32, seed=1)
    view = nan_banded(x, memory_format)
    assert not view.is_contiguous() and not view.is_contiguous(memory_format=torch.channels_last)
    assert torch.isfinite(check(view, weights, stride)).all()


@pytest.mark.parametrize("stride", [1, 2])
def test_nchw_dense_input(interpreter_backend, stride):
    """Contiguous NCHW: dense pixel rows (the exact-tile path) with a channel stride of H * W."""
    x, weights = make_block(1, 128, 16, 8 if stride == 1 else 16, stride, seed=2)
    check(x.contiguous(), weights, stride)


def test_strided_weights(interpreter_backend):
    """Weights and biases as strided views (every other element of a NaN-interleaved buffer); the
    grouped-conv weight also tap-major as fuse() stores it."""
    from convfirstnet.blocks import tap_major

    x, weights = make_block(1, 128, 5, 6, 1, seed=4)
    strided = [torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0] for t in weights]
    assert not any(t.is_contiguous() for t in strided)
    assert torch.isfinite(check(x, strided, 1)).all()
    weights = list(weights)
    weights[2] = tap_major(weights[2])
    assert weights[2].stride(0) == 1
    check(x, weights, 1)


@pytest.mark.parametrize("stride", [1, 2])
def test_batch_zero_and_one(interpreter_backend, stride):
    k = 128 if stride == 1 else 160
    x, weights = make_block(0, 128, 4, 6, stride, k=k)
    out = torch.ops.convfirstnet.mbconv(x, *weights, stride)
    assert out.shape == ((0, k, 4, 6) if stride == 1 else (0, k, 2, 3))
    assert out.is_contiguous(memory_format=torch.channels_last)
    x, weights = make_block(1, 128, 4, 6, stride, k=k, dtype=torch.float16, seed=5)
    check(x, weights, stride)


@pytest.mark.parametrize("programs", [1, 2])
def test_small_stage4_block(interpreter_backend, monkeypatch, programs):
    """Fused Small's 16x16 stride-1 block at its widths (C = 256, R = 1024, fp16), configured as on the
    H100: RESIDENT items of one image holding all 16 chunks, four 64-pixel conv tiles per chunk, two
    projection tiles per image. With one program it walks both images' items, so the item, chunk, conv
    tile and R step loops all run more than once; with two, each program takes one item (ONE, as at batch
    128 on the H100: the item loop compiled to one trip). Tolerance: TOL (fp16), as for the other shapes."""
    from convfirstnet.kernels.mbconv import launcher

    monkeypatch.setattr(launcher, "INTERPRETER_PROGRAMS", programs)
    geo = launcher.mbconv_config(256, 1024, 256, 16, 16, 1, n=2, device="cpu")
    assert (geo.resident, geo.ib, geo.chunks_per_group, geo.nchunk, geo.cm, geo.tiles, geo.items,
            geo.programs, geo.tpi, geo.gate, geo.one_item) == (True, 1, 16, 16, 64, 4, 2, programs, 2, True,
                                                               programs == 2)
    x, weights = make_block(2, 256, 16, 16, 1, dtype=torch.float16, seed=7)
    check(x, weights, 1)


def test_output_independent_of_program_count(interpreter_backend, monkeypatch):
    """Bit-reproducible: every reduction runs in a fixed order, so the result does not depend on how
    the work items are spread over programs (1 or 5 persistent programs here)."""
    from convfirstnet.kernels.mbconv import launcher

    x, weights = make_block(3, 128, 8, 8, 1, dtype=torch.float16, seed=6)
    outs = []
    for programs in (1, 5):
        monkeypatch.setattr(launcher, "INTERPRETER_PROGRAMS", programs)
        outs.append(torch.ops.convfirstnet.mbconv(x, *weights, 1))
    assert torch.equal(outs[0], outs[1])


def test_mean_slots_do_not_overlap(interpreter_backend, monkeypatch):
    """Each persistent program writes its whole fp32 mean slot (8x8: a row per conv sub-tile) and no
    other program's: filled with NaN before the launch, no element of the (programs, mean_slot) buffer is
    left unwritten. With slots addressed one row apart they overlapped: a race between programs on the
    GPU that the interpreter, which runs the programs one after another, does not show in the output."""
    from convfirstnet.kernels.mbconv import launcher

    slots = []
    real_launch = launcher.launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel is launcher._mbconv_hidden_kernel:
            args[10].fill_(float("nan"))  # mslot
            slots.append(args[10])
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launcher, "launch", spy)
    monkeypatch.setattr(launcher, "HIDDEN_WARPS", 16)  # 16 warps split the 8x8 conv batch in two sub-tiles
    x, weights = make_block(3, 128, 8, 8, 1, dtype=torch.float16, seed=7)
    check(x, weights, 1)
    (ms,) = slots
    assert ms.shape[1] == 2 * 64  # two sub-tile rows of 64 channels per program
    assert not ms.isnan().any(), f"unwritten mean-slot elements: {ms.isnan().sum().item()} of {ms.numel()}"


def test_invalid_input_raises_before_launch(interpreter_backend):
    x, weights = make_block(1, 16, 4, 4, 1)
    with pytest.raises(ValueError, match="stride"):
        torch.ops.convfirstnet.mbconv(x, *weights, 3)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.convfirstnet.mbconv(x.half(), *weights, 1)
    with pytest.raises(ValueError, match="2x2"):
        torch.ops.convfirstnet.mbconv(x[:, :, :1], *weights, 2)
    with pytest.raises(ValueError, match="C -> C"):
        wide = list(weights)
        wide[8], wide[9] = torch.zeros(24, 64), torch.zeros(24)
        torch.ops.convfirstnet.mbconv(x, *wide, 1)
    x, weights = make_block(1, 264, 2, 2, 2)
    with pytest.raises(ValueError, match="up to 256 input channels"):
        torch.ops.convfirstnet.mbconv(x, *weights, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only guard")
def test_bf16_refused_in_interpreter(interpreter_backend):
    x, weights = make_block(1, 16, 4, 4, 1, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="interpreter"):
        torch.ops.convfirstnet.mbconv(x, *weights, 1)


def test_torch_compile_fullgraph_reference_on_cpu(reference_backend):
    """On CPU, torch.compile traces the op's reference branch in one graph. The Triton branch
    cannot be compiled *in the interpreter*: with TRITON_INTERPRET=1 ``@triton.jit`` returns an
    InterpretedFunction, ``wrap_triton`` hands it back unwrapped, and dynamo's fake-tensor run then
    launches it on FakeTensors ("Cannot access data pointer"). test_torch_compile_traces_triton_branch
    traces it with real JITFunctions instead; running it compiled needs a GPU."""
    x, weights = make_block(1, 16, 3, 5, 1, seed=3)

    def block(t):
        return torch.ops.convfirstnet.mbconv(t, *weights, 1)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-5)


@pytest.mark.subprocess
def test_torch_compile_traces_triton_branch():
    """One graph (fullgraph=True) holding the user-defined kernels of the staged stride-2 block (the
    expand, the conv, the BlurPool pass, the gates, the projection; the traced subprocess takes the
    default path). Inductor receives them as triton_kernel_wrapper_functional nodes."""
    pytest.importorskip("triton")
    targets = trace_triton_branch("mbconv", [2, 16, 24, 5, 7, 2])
    assert targets.count("triton_kernel_wrapper_functional") == 5, targets


# ---------------------------------------------------------------------------------------------
# Launch records on meta tensors: grid limits, cost declarations
# ---------------------------------------------------------------------------------------------


def _record(n, c, k, h, w, stride, dtype=torch.float16):
    from convfirstnet.kernels._cost import recording

    x, weights = make_block(1, c, 1, 1, stride, k=k)
    x = torch.empty(n, c, h, w, device="meta", dtype=dtype).contiguous(memory_format=torch.channels_last)
    weights = [t.to(device="meta", dtype=dtype) for t in weights]
    with recording() as rec:
        out = torch.ops.convfirstnet.mbconv(x, *weights, stride)
    return rec.launches, out


@pytest.mark.parametrize("stride", [1, 2])
def test_batch_past_the_grid_y_limit(stride):
    """Batch 100,000 (past 65535, the grid.y/z limit): the batch lives in grid.x, the hidden kernel
    is persistent (its grid is the number of resident programs), and the
    output has the right shape."""
    pytest.importorskip("triton")
    launches, out = _record(100_000, 256, 256, 8, 8, stride)
    assert out.shape == (100_000, 256, 8 // stride, 8 // stride)
    hidden, project = launches[0::2], launches[1::2]
    assert hidden[0].grid == (132,) and all(lc.grid[0] <= 132 for lc in hidden)
    # every image has its projection tiles (tiles of two images: maps of at most 64 pixels)
    assert sum(lc.grid[0] for lc in project) * 2 >= 100_000
    assert all(lc.grid[0] <= 2**31 - 1 and all(g <= 65535 for g in lc.grid[1:]) for lc in project)


@pytest.mark.parametrize("stride,c,k,hw,max_waste", [
    (1, 256, 256, 16, 1.05), (1, 256, 256, 8, 1.05), (2, 96, 256, 32, 1.2), (2, 256, 256, 16, 1.05),
    (1, 160, 160, 7, 2.5),  # Nano at 224x224: C and K padded to 256, 49 of 64 tile rows real
])
def test_cost_declarations_add_up(stride, c, k, hw, max_waste):
    """The launches' useful MACs sum to the training-form block's count (expand, grouped conv,
    BlurPool, SE, projection); the issued tensor-core MACs are at least the dots' share of it and
    at most ``max_waste`` times it (Small's shapes: the conv's tenth tap, C = 96 padded to 128);
    the declared DRAM traffic covers x, g written once and the output, and g's read is declared as
    DRAM or (when it stays in L2) L2 traffic."""
    pytest.importorskip("triton")
    from convfirstnet.blocks import MBConv
    from convfirstnet.profile import count_macs

    n = 4
    launches, _ = _record(n, c, k, hw, hw, stride)
    costs = [lc.cost for lc in launches]
    assert all(cst is not None for cst in costs)
    block = MBConv(c, k, stride)
    assert sum(cst.useful_macs for cst in costs) == n * count_macs(block, (c, hw, hw))
    r, ohw = 4 * c, (hw // stride) ** 2
    dots = n * (hw * hw * (c * r + 72 * r) + ohw * r * k)
    assert dots <= sum(cst.mma_macs for cst in costs) <= max_waste * dots
    g_bytes = n * ohw * r * 2
    assert sum(cst.dram_bytes for cst in costs) >= g_bytes + n * c * hw * hw * 2 + n * k * ohw * 2
    assert costs[1].dram_bytes + costs[1].l2_bytes >= g_bytes and costs[1].l2_footprint_bytes in (0, g_bytes)


@pytest.mark.parametrize("stride,c,hw,resident,images,groups,g_in_l2", [
    (1, 256, 16, True, 1, 1, False),  # stage 4: one image per item, x read once for its 16 chunks
    (2, 256, 16, True, 1, 1, True),  # stage 5 stride 2: 32 chunks of 32 (the slot must stay in L1)
    (1, 256, 8, True, 4, 4, True),  # stage 5: 4 images per item, 4 groups of 4 chunks
    (2, 96, 32, False, 1, 1, False),  # stage 4 stride 2: a 1024-pixel map is tiled, one chunk per item
])
def test_work_items_of_small(stride, c, hw, resident, images, groups, g_in_l2):
    """Fused Small at batch 128 on the recorded H100 (132 SMs, 50 MB L2): one launch pair per block;
    the hidden kernel's persistent programs (at most one per SM) cover every (image, chunk) once; g is
    read from L2 where it fits beside the scratch in L2_SHARE of the L2; the projection's tiles cover
    the batch."""
    triton = pytest.importorskip("triton")
    from convfirstnet.kernels._launch import DEFAULT_L2_BYTES, DEFAULT_SMS
    from convfirstnet.kernels.mbconv import launcher

    n, k = 128, 256
    (hidden, project), _ = _record(n, c, k, hw, hw, stride)
    geo = launcher.mbconv_config(c, 4 * c, k, hw, hw, stride, n=n)
    assert (geo.resident, geo.ib, geo.nchunk // geo.chunks_per_group, geo.g_in_l2) == (
        resident, images, groups if resident else geo.nchunk, g_in_l2)
    assert hidden.grid == (geo.programs,) and geo.programs <= DEFAULT_SMS
    assert geo.items == triton.cdiv(n, geo.ib) * geo.groups
    assert geo.chunks_per_group * geo.groups >= geo.nchunk > geo.chunks_per_group * (geo.groups - 1)
    assert ("g read from L2" in project.cost.note) == g_in_l2
    if g_in_l2:
        scratch = geo.programs * hidden.cost.scratch_bytes_per_program
        assert project.cost.l2_footprint_bytes + scratch <= launcher.L2_SHARE * DEFAULT_L2_BYTES
    assert geo.slot * 2 <= (launcher.SLOT_L1_RESIDENT if resident else launcher.SLOT_L1_TILED)
    assert project.grid[0] == triton.cdiv(n, geo.ipt) * geo.tpi


def test_programs_follow_the_target():
    """Recorded for an A100 (108 SMs, 40 MB L2, 163 KB of shared memory per program; the sm_80
    report) instead of the default H100, the hidden kernel runs at most 108 programs, on tiles."""
    pytest.importorskip("triton")
    from convfirstnet.kernels._cost import recording

    x, weights = make_block(1, 256, 1, 1, 1)
    x = torch.empty(128, 256, 16, 16, device="meta", dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    weights = [t.to(device="meta", dtype=torch.float16) for t in weights]
    with recording(sms=108, l2_bytes=40 * 1024**2, shared_per_block=163 * 1024, arch=80) as rec:
        torch.ops.convfirstnet.mbconv(x, *weights, 1)
    assert rec.launches[0].grid == (108,)
    assert rec.launches[0].meta["RESIDENT"] is False  # a [256, 256] x tile does not fit in 163 KB
    with recording() as rec:
        torch.ops.convfirstnet.mbconv(x, *weights, 1)
    assert rec.launches[0].grid == (128,)  # one item per image on 132 SMs


# ---------------------------------------------------------------------------------------------
# GPU compiler: every configuration the fused models launch, for Hopper and Ampere, without a GPU
# ---------------------------------------------------------------------------------------------
# The launches are recorded on meta tensors through the real launcher and bound with Triton's own
# binder (convfirstnet.analysis.compiled), so what is compiled is what a GPU launch compiles.
# Compiles run in worker processes without the interpreter (~3-15 s per variant on 2 cores; the
# Triton cache makes reruns fast).

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}  # max dynamic shared memory per block (bytes)
# Input sizes whose MBConv maps cover every tiling the launcher picks: 256 -> 32/16/8 (exact
# tiles), 224 -> 28/14/7, 512 -> 64/32/16 (64-wide tiles), 32 -> 4/2/1 (the smallest maps).
MODEL_INPUTS = (256, 224, 512, 32)


# The default compile sample (about 3 minutes on 2 cores with a cold Triton cache): fused Small's fp16
# variants at 256x256 for sm_90 and sm_80 (both strides, RESIDENT and tiled, one- and two-image
# projection tiles), plus the widest bf16 and fp32 variant (largest CP, then RB and BH: the most shared
# memory and registers) of each kernel and arch. CONVFIRSTNET_FULL_MATRIX=1 compiles every variant the
# four models launch at MODEL_INPUTS in the three dtypes (656, about 40 minutes).


SMALL_SCRATCH = {}  # fused Small's variant key -> the L1 working set its launch declares


def _variant_class(v):
    """(kernel, arch, the data's pointer type: its first pointer argument's)."""
    return v.name, v.arch, next(t for _, t in v.signature if t.startswith("*"))


def _shipped_variants():
    """Distinct (kernel, signature, constexprs, options) of the MBConv launches of the four fused
    models at MODEL_INPUTS, per dtype and arch: fp16 for both archs; bf16 and fp32 (3xTF32 dots, the
    largest shared memory) for sm_90 and sm_80 at 256x256 by default, everywhere with
    CONVFIRSTNET_FULL_MATRIX=1. By default the sample described above (fused Small's fp16 keys, the
    configuration the performance targets are set for, are returned too)."""
    from convfirstnet.kernels._cost import recording

    import convfirstnet
    from convfirstnet.analysis.compiled import variant_of
    from convfirstnet.analysis.targets import target
    from convfirstnet.blocks import FusedMBConv

    found, small = {}, set()
    for name in ("small", "pico", "nano", "tiny"):
        fused = convfirstnet.fuse(convfirstnet.create_model(name))
        blocks = [m for m in fused.modules() if isinstance(m, FusedMBConv)]
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for size in MODEL_INPUTS if (dtype == torch.float16 or FULL_MATRIX) else (256,):
                for arch in (90, 80):  # each launch as the launcher sizes it for that GPU
                    t = target(arch)
                    c0 = blocks[0].w_exp.shape[1]
                    x = torch.empty(2, c0, size // 8, size // 8, device="meta", dtype=dtype)
                    with recording(sms=t.sms, l2_bytes=t.l2_bytes, shared_per_block=t.smem_per_block,
                                   arch=t.arch) as rec:
                        for m in blocks:  # blocks in order: each one's output feeds the next
                            m = m.to(device="meta", dtype=dtype)
                            x = m(x.contiguous(memory_format=torch.channels_last))
                    for launch in rec.launches:
                        v = variant_of(launch, arch)
                        found.setdefault(v.key, v)
                        if name == "small" and dtype == torch.float16 and size == 256:
                            small.add(v.key)
                            SMALL_SCRATCH[v.key] = launch.cost.l1_working_set_bytes
    # the launches fused Small takes at 256x256 by default: the staged ones
    from convfirstnet.kernels.mbconv import launcher

    fused = convfirstnet.fuse(convfirstnet.create_model("small"))
    blocks = [m.to(device="meta", dtype=torch.float16) for m in fused.modules() if isinstance(m, FusedMBConv)]
    launcher.STAGED = None
    try:
        for arch in (90, 80):
            t = target(arch)
            x = torch.empty(2, blocks[0].w_exp.shape[1], 32, 32, device="meta", dtype=torch.float16)
            with recording(sms=t.sms, l2_bytes=t.l2_bytes, shared_per_block=t.smem_per_block,
                           arch=t.arch) as rec:
                for m in blocks:
                    x = m(x.contiguous(memory_format=torch.channels_last))
            for launch in rec.launches:
                v = variant_of(launch, arch)
                small.add(found.setdefault(v.key, v).key)
    finally:
        launcher.STAGED = False
    if FULL_MATRIX:
        return list(found.values()), small
    widest = {}
    for key, v in found.items():
        c = _variant_class(v)
        size = (v.meta.get("CP", 0), v.meta.get("RB", 0), v.meta.get("BH", 0))
        if c[2] != "*fp16" and (c not in widest or size > widest[c][0]):
            widest[c] = (size, v)
    keep = {v.key: v for _, v in widest.values()}
    keep.update({k: found[k] for k in small})
    return list(keep.values()), small


def _spills_in_loops(compiled) -> int:
    """Local-memory (spill) instructions of the SASS inside a loop nested in another loop (the hidden
    kernel's chunk and tile loops, the projection's R loop is not nested: any loop there)."""
    insns, loops = compiled.listing()
    inside = set()

    def mark(lps, depth):
        for lp in lps:
            if depth >= (1 if compiled.variant.name == "_mbconv_hidden_kernel" else 0):
                inside.update(range(lp.start, lp.end + 1))
            mark(lp.children, depth + 1)

    mark(loops, 0)
    return sum(1 for i in inside if insns[i].family in ("LDL", "STL"))


@pytest.fixture(scope="module")
def mbconv_compiled():
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants

    variants, small = _shipped_variants()
    return [(v, c, v.key in small) for v, c in zip(variants, compile_variants(variants))]


@pytest.mark.compile
def test_shipped_variants_compile_without_spills(mbconv_compiled):
    """Every variant compiles for its target and fits in shared memory; on sm_90 the expand and
    projection dots are wgmma (HGMMA) and the grouped conv mma.sync. Fused Small's fp16 variants (at
    256x256, sm_90 and sm_80) have no spill code in their inner loops (chunks, tiles, R steps); the
    RESIDENT hidden kernels (8 warps, up to 255 registers) may keep 8-16 B of stack (at batch 128 the
    16x16 stride-2 one: 8 B), stored and reloaded outside the chunk loop (the static cost report lists them; batch 128's stride-1 variants:
    test_small_batch128_stride1_without_stack). Other widths and map sizes are not yet held to the
    register budget: fp32 variants (3xTF32 holds each operand as two parts) spill up to ~1.5 KB."""
    assert len({v.meta["STRIDE"] for v, _, _ in mbconv_compiled if "STRIDE" in v.meta}) == 2
    assert {v.meta["RESIDENT"] for v, _, _ in mbconv_compiled if "RESIDENT" in v.meta} == {True, False}
    assert sum(small for _, _, small in mbconv_compiled) >= 8  # hidden + projection, 4 shapes, sm_90
    problems = []
    for v, c, small in mbconv_compiled:
        where = f"{v.name} sm_{v.arch} {_variant_class(v)[2]} {v.meta}"
        if c.shared > SHARED_LIMIT[v.arch]:
            problems.append(f"{where}: {c.shared} B of shared memory")
        if small and _spills_in_loops(c):
            problems.append(f"{where}: {_spills_in_loops(c)} spill instructions in loops ({c.stack} B stack)")
        if v.arch == 90:
            expected = {"_mbconv_hidden_kernel": "wgmma+mma.sync", "_gconv_fwd_kernel": "mma.sync"}.get(
                v.name, "wgmma" if v.name in ("_mbconv_project_kernel", "_expand_kernel") else c.mma_kind)
            if c.mma_kind != expected:
                problems.append(f"{where}: {c.mma_kind}, expected {expected}")
    assert not problems, "\n".join(problems)


@pytest.mark.compile
def test_small_batch128_stride1_without_stack():
    """Fused Small's 16x16 stride-1 blocks at batch 128 on the H100 (the report's configuration): one
    work item per program (ONE), so the hidden kernel (8 warps, GATE) keeps neither the item loop's
    counter nor the program count across the chunk loop and compiles for sm_90 with no stack (Triton 3.8:
    180 registers). At 16 warps, at the 128-register limit, with the item loop kept (ONE off) it held
    16 B of stack."""
    pytest.importorskip("triton")
    from convfirstnet.kernels._cost import recording

    import convfirstnet
    from convfirstnet.analysis.compiled import compile_variants, variant_of
    from convfirstnet.analysis.targets import target

    block = convfirstnet.fuse(convfirstnet.create_model("small")).stages[3][1].to(device="meta",
                                                                                   dtype=torch.float16)
    t = target(90)
    x = torch.empty(128, 256, 16, 16, device="meta", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last)
    with recording(sms=t.sms, l2_bytes=t.l2_bytes, shared_per_block=t.smem_per_block, arch=t.arch) as rec:
        block(x)
    variants = [variant_of(lc, 90) for lc in rec.launches if lc.kernel.fn.__name__ == "_mbconv_hidden_kernel"]
    assert [(v.meta["ONE"], v.meta["GATE"], v.meta["num_warps"]) for v in variants] == [(True, True, 8)]
    (c,) = compile_variants(variants)
    assert c.stack == 0 and c.regs <= 255, f"{c.regs} registers, {c.stack} B stack"


@pytest.mark.compile
def test_staged_gate_launches_without_stack(monkeypatch):
    """The staged blocks' gate launches at Nano's and Small's stage-5 widths (batch 128, fp16, sm_90): the
    SE gates from the pools (stride 1) and from the BlurPool pass's partials (stride 2) compile with no
    stack. At Nano's R = 640, S = 40 in 512-row gate steps both took 255 registers and spilled 488-512 B;
    ``launcher.gate_rows`` gives them 128-row steps."""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of
    from convfirstnet.kernels.mbconv import launcher

    monkeypatch.setattr(launcher, "STAGED", True)
    variants = []
    for c, hw, stride in ((160, 8, 1), (160, 16, 2), (256, 8, 1), (256, 16, 2)):
        launches, _ = _record(128, c, c, hw, hw, stride)
        variants += [variant_of(lc, 90) for lc in launches if "gates" in lc.kernel.fn.__name__]
    assert [v.meta["GB"] for v in variants] == [128, 128, 512, 512]
    stacks = {(v.name, v.meta["GB"]): c.stack for v, c in zip(variants, compile_variants(variants))}
    assert not any(stacks.values()), stacks


@pytest.fixture(scope="module")
def small_asm():
    """PTX and TTGIR of the stage-4 launches of fused Small at 256x256 (stride 1, fp16 and fp32;
    stride 2, fp16) for sm_90."""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import variant_of

    picked = []
    for c, k, hw, stride, dtype in ((256, 256, 16, 1, torch.float16), (256, 256, 16, 1, torch.float32),
                                    (96, 256, 32, 2, torch.float16)):
        launches, _ = _record(128, c, k, hw, hw, stride, dtype)
        picked += [(stride, dtype, variant_of(lc, 90)) for lc in launches[:2]]  # the first slice's pair
    asm = compile_asm([p[2] for p in picked])
    return [(stride, dtype, v, a) for (stride, dtype, v), a in zip(picked, asm)]


@pytest.mark.compile
def test_scratch_loads_follow_the_barrier(small_asm):
    """The scratch read-after-write is ordered by bar.sync only while the scratch loads are plain
    loads: the hidden kernel must contain no cp.async (which the pipeliner would issue ahead of the
    barrier) and must synchronise (bar.sync) between writing and reading its scratch. The projection
    has no scratch: its loads of g, W_proj and W_se2 are pipelined copies (cp.async, L2 only, as its
    cost declaration counts them)."""
    for stride, dtype, v, asm in small_asm:
        ptx = asm["ptx"]
        if v.name == "_mbconv_hidden_kernel":
            assert "cp.async" not in ptx, f"stride {stride}: scratch loads pipelined with cp.async"
            assert ptx.count("bar.sync") >= (3 if stride == 1 else 4)
        else:
            assert "cp.async.cg" in ptx or "cp.async.ca" in ptx


@pytest.mark.compile
def test_gate_loads_are_plain_loads(small_asm):
    """GATE (fused Small's 16x16 stride 1 at batch 128): the projection reads the gates with 2-byte
    ld.global (L1-allocating, as its cost declaration counts them), while g and W_proj stay pipelined
    cp.async copies."""
    gated = [asm["ptx"] for _, _, v, asm in small_asm if v.name == "_mbconv_project_kernel" and v.meta.get("GATE")]
    assert gated
    for ptx in gated:
        assert "ld.global.b16" in ptx and "cp.async.cg" in ptx


@pytest.mark.compile
def test_scratch_slot_fits_the_l1_left(mbconv_compiled):
    """The hidden kernel's scratch slot stays in L1 (what its cost declaration claims, and why the
    launcher halves RB for stride 2, and picks 8-warp programs and their expand tiles on sm_80): for
    fused Small on sm_90 and sm_80 (one program per SM) the L1 that the compiled shared memory leaves
    (256 KB, or 192 KB on an A100, minus the smallest carve-out that holds it) is at least the declared
    working set (the slot and the means)."""
    from convfirstnet.analysis.hardware import hardware
    from convfirstnet.analysis.targets import target

    checked = 0
    for v, c, small in mbconv_compiled:
        if small and v.name == "_mbconv_hidden_kernel":
            l1 = hardware(v.arch).l1_bytes(c.shared + target(v.arch).smem_reserved_per_block)
            assert SMALL_SCRATCH[v.key] <= l1, (v.arch, v.meta, c.shared, SMALL_SCRATCH[v.key], l1)
            checked += 1
    assert checked == 8  # 32x32 stride 2 (tiled), 16x16 both strides, 8x8; sm_90 and sm_80


@pytest.mark.compile
def test_x_tile_resident_in_shared_memory(small_asm):
    """RESIDENT items (Small's 16x16 stride-1 block here) read x once per item: the x tile's copy into
    shared memory (``ttg.local_alloc`` of the [256, C] tile) sits before the chunk loop that holds the
    expand wgmma, and no global load of the chunk loop has the x tile's shape."""
    checked = 0
    for stride, dtype, v, asm in small_asm:
        if v.name != "_mbconv_hidden_kernel" or not v.meta.get("RESIDENT"):
            continue
        lines = asm["ttgir"].splitlines()
        shape = f"tensor<256x{v.meta['CP']}x"
        alloc = [i for i, line in enumerate(lines) if "ttg.local_alloc" in line and shape in line]
        tile = f"memdesc<256x{v.meta['CP']}x"
        dots = [i for i, line in enumerate(lines) if "warp_group_dot " in line and tile in line]
        assert alloc and dots, "x tile or expand wgmma not found"
        # the last loop opened before the expand dot (the dot comes before the chunk loop's inner loops)
        chunk_loop = max(i for i, line in enumerate(lines[:dots[0]]) if "scf.for" in line)
        assert max(alloc) < chunk_loop, "the x tile is copied to shared memory inside the chunk loop"
        body = lines[chunk_loop:dots[0]]
        assert not any("tt.load" in line and shape in line for line in body), "x loaded inside the chunk loop"
        checked += 1
    assert checked >= 1




@pytest.mark.compile
def test_tap_pair_copies_conflict_free_order(small_asm):
    """launcher.conflict_free_tap_order() (what the kernels compile with: launcher.tap_order()): fused
    Small's 16x16 hidden kernel (fp16, sm_90) compiled with it copies the tap pairs to shared memory and
    reads them back without bank conflicts (every 16-byte store and ldmatrix.x4 of warp 0 at 32 lanes'
    bytes / 128), while order 0, compiled in the same run, takes at least 1.5x those wavefronts (4x on its
    stores: the conflicts Nsight Compute measured when it shipped, launcher.TAP_ORDER). Order 0 failing
    the first check is the planted bug."""
    from dataclasses import replace

    from convfirstnet.kernels.mbconv.launcher import conflict_free_tap_order

    (v,) = [v for stride, dtype, v, _ in small_asm
            if v.name == "_mbconv_hidden_kernel" and stride == 1 and dtype == torch.float16]
    assert v.meta["TAPS"] == conflict_free_tap_order()  # the order the model's kernels compile with
    names = [n for n, _ in v.signature]

    def with_taps(taps):
        return replace(v, constexprs=tuple((p, taps if names[p[0]] == "TAPS" else x)
                                           for p, x in v.constexprs))

    free, shipped = compile_asm([with_taps(conflict_free_tap_order()), with_taps(0)])
    wf, ideal = tap_copy_wavefronts(free["ptx"])
    assert ideal > 0 and wf == ideal, f"order {conflict_free_tap_order()}: {wf} wavefronts, {ideal} ideal"
    wf0, ideal0 = tap_copy_wavefronts(shipped["ptx"])
    assert ideal0 == ideal and wf0 >= 1.5 * ideal0, (wf0, ideal0)


@pytest.mark.compile
def test_conv_tap_pairs_loaded_ahead(small_asm):
    """AHEAD (the launcher's ``pairs_ahead``, on for fused Small's blocks): in the hidden kernel's conv
    tile loop, as the TTGIR leaves it after Triton's passes, the first two tap pairs are loaded before
    the first batched conv dot and each later pair before the dot ahead of its own, so that two slot
    loads are in flight while a dot runs (the static model's exposed waits of the 16x16 block fall by
    about 30 % with it: kernels/mbconv/launcher.py)."""
    checked = 0
    for stride, dtype, v, asm in small_asm:
        if v.name != "_mbconv_hidden_kernel" or dtype == torch.float32:
            continue
        lines = asm["ttgir"].splitlines()
        conv = [i for i, line in enumerate(lines) if " tt.dot " in line and "x16x8xf16" in line]
        assert len(conv) == 5, f"stride {stride}: {len(conv)} batched conv dots"
        loop = max(i for i, line in enumerate(lines[:conv[0]]) if "scf.for" in line)
        order = ["dot" if " tt.dot " in line else "load" for line in lines[loop:conv[-1] + 1]
                 if " tt.dot " in line or ("tt.load" in line and "x16x!tt.ptr<f16>" in line)]
        ahead = ["load", "load", "dot", "load", "dot", "load", "dot", "load", "dot", "dot"]
        assert order == ahead, (stride, order)
        checked += 1
    assert checked == 2  # 16x16 stride 1, 32x32 stride 2


@pytest.mark.compile
def test_silu_fast_path_only_for_half_precision(small_asm):
    """fp16 (and bf16) kernels compute SiLU (hidden kernel) and the SE sigmoid (projection) through
    kernels/_activations.py's inline-asm form (ex2.approx and rcp.approx, GPU only; the interpreter
    runs the plain formula); fp32 keeps tl.exp2 and a division. tanh.approx (whose cancellation
    test_activations.py measures) is in none of them. With GATE (Small's 16x16 stride 1 at batch 128)
    the SE sigmoid runs at the end of the hidden kernel and the projection has no activation."""
    names = set()
    for _, dtype, v, asm in small_asm:
        names.add(v.name)
        fast = dtype != torch.float32 and not (v.name == "_mbconv_project_kernel" and v.meta.get("GATE"))
        assert ("rcp.approx.ftz.f32" in asm["ptx"]) == fast, (v.name, dtype)
        assert "tanh.approx" not in asm["ptx"], (v.name, dtype)
    assert names == {"_mbconv_hidden_kernel", "_mbconv_project_kernel"}


# ---------------------------------------------------------------------------------------------
# Compiling arbitrary cases in subprocesses (also used by the head tests)
# ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
results = []
for case in json.load(sys.stdin):
    fn = getattr(importlib.import_module(case["module"]), case["kernel"])
    meta = dict(case["meta"])
    num_warps = meta.pop("num_warps", 4)
    signature = {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = "*fp32" if p.name in case["fp32_pointers"] else TYPES[case["dtype"]]
        else:
            signature[p.name] = "i32"
    try:
        compiled = triton.compile(ASTSource(fn, signature, meta), target=GPUTarget("cuda", case["arch"], 32),
                                  options={"num_warps": num_warps})
        results.append(compiled.metadata.shared)
    except Exception as exc:  # reported by the test that owns the case
        results.append(f"{type(exc).__name__}: {exc}")
json.dump(results, sys.stdout)
"""


def compile_for_gpu(cases, workers=2):
    """Compile ``cases`` (dicts: module, kernel, meta, dtype name, arch, fp32_pointers) for CUDA
    targets in ``workers`` subprocesses; returns shared-memory bytes or an error string per case."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    chunks = [cases[i::workers] for i in range(workers)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, text=True)
        for chunk in chunks if chunk
    ]
    outputs = [p.communicate(json.dumps(chunk)) for p, chunk in zip(procs, chunks)]
    results = [None] * len(cases)
    for w, ((stdout, stderr), proc) in enumerate(zip(outputs, procs)):
        assert proc.returncode == 0, stderr[-3000:]
        for j, r in enumerate(json.loads(stdout)):
            results[w + j * workers] = r
    return results


# ---------------------------------------------------------------------------------------------
# GPU only: the paper's shapes (batch 128, 32x32, 16x16 and 8x8, C 48 ... 256)
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [  # (N, C, K, H, W, stride)
    (128, 128, 128, 16, 16, 1),
    (128, 256, 256, 8, 8, 1),
    (128, 192, 192, 16, 16, 1),
    (128, 48, 128, 32, 32, 2),
    (128, 96, 256, 32, 32, 2),
    (128, 256, 256, 16, 16, 2),
    (128, 160, 160, 14, 14, 1),
    (256, 160, 160, 1, 1, 1),
]


@pytest.fixture
def exact_fp32(monkeypatch):
    """An fp32 reference computed in fp32: without this, cuDNN and cuBLAS use TF32 on Ampere and
    later, and the reference itself is off by more than the fp32 tolerance."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_paper_shapes_on_gpu(triton_backend, exact_fp32, shape, dtype):
    n, c, k, h, w, stride = shape
    x, weights = make_block(n, c, h, w, stride, k=k, dtype=dtype, device="cuda")
    check(x, weights, stride)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [GPU_SHAPES[4], GPU_SHAPES[0], GPU_SHAPES[1], GPU_SHAPES[6]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_staged_paper_shapes_on_gpu(triton_backend, monkeypatch, shape, dtype):
    """The staged launches (the op's default, forced here against the module's hidden-kernel fixture) at
    the paper's shapes, same tolerances (fp32 through them: the interpreter tests)."""
    from convfirstnet.kernels.mbconv import launcher

    monkeypatch.setattr(launcher, "STAGED", True)
    n, c, k, h, w, stride = shape
    x, weights = make_block(n, c, h, w, stride, k=k, dtype=dtype, device="cuda")
    check(x, weights, stride)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("stride", [1, 2])
def test_bitwise_deterministic_on_gpu(triton_backend, stride):
    """No atomics in any reduction: two runs give the same bits."""
    x, weights = make_block(64, 256, 16, 16, stride, dtype=torch.float16, device="cuda")
    first = torch.ops.convfirstnet.mbconv(x, *weights, stride)
    assert torch.equal(first, torch.ops.convfirstnet.mbconv(x, *weights, stride))


@cuda
@pytest.mark.gpu
def test_cuda_graph_replays_new_input(triton_backend):
    """Capture, write new data into the captured input, replay: the graph computes the new input's
    output, bit for bit as eager does (all scratch is allocated inside the op, so the graph owns it)."""
    x, weights = make_block(8, 128, 16, 16, 1, dtype=torch.float16, device="cuda")
    torch.ops.convfirstnet.mbconv(x, *weights, 1)  # warm-up compiles the kernels
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.convfirstnet.mbconv(static_x, *weights, 1)
    x2, _ = make_block(8, 128, 16, 16, 1, dtype=torch.float16, device="cuda", seed=9)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, torch.ops.convfirstnet.mbconv(x2, *weights, 1))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("stride", [1, 2])
def test_torch_compile_fullgraph_on_gpu(triton_backend, stride):
    """The compiled graph launches the same kernels on the same inputs: exactly eager's output."""
    x, weights = make_block(16, 128, 16, 16, stride, dtype=torch.float16, device="cuda")

    def block(t):
        return torch.ops.convfirstnet.mbconv(t, *weights, stride)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    assert torch.equal(compiled(x), block(x))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("path, layers", [("auto", False), ("layer-wise", True)])
def test_compiled_fused_block_on_gpu(triton_backend, path, layers):
    """torch.compile of a FusedMBConv on CUDA (Small's 16x16 width): with compiled_path auto the mbconv
    op in the graph, with layer-wise its layers (no op); both within the kernel's fp16 tolerance of the
    fp32 specification."""
    from collections import Counter

    from convfirstnet.blocks import FusedMBConv

    x, weights = make_block(16, 128, 16, 16, 1, dtype=torch.float16, device="cuda")
    block = FusedMBConv(*weights, stride=1).cuda()
    block.compiled_path = path
    assert block.compiles_layers(x) == layers
    seen = Counter()

    def capture(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(block, backend=capture, fullgraph=True)(x)
        assert (seen["convfirstnet.mbconv"] == 0) == layers
        torch._dynamo.reset()
        out = torch.compile(block, fullgraph=True)(x)
    atol, rtol = TOL[torch.float16]
    torch.testing.assert_close(out.float(), reference(x, weights, 1), atol=atol, rtol=rtol)


def test_interpreter_is_on_without_cuda():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
