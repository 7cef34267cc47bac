"""torch.ops.convfirstnet.gconv3x3 (+ _dgrad, _wgrad) and GroupConv3x3: the Triton kernels (interpreter on
CPU) against autograd of F.conv2d, the autograd registration, torch.compile, bad input, compiled code.

Run: pytest tests/kernels/test_gconv.py --durations=10

Coverage of the kernels' loops and masks (kernels/gconv/kernel.py): the shapes below run at the model's
channel widths (16 ... 1024: channel blocks of G = 2, 4 and 8 groups, one to sixteen blocks per
program column, masked groups at 24 and 72), maps of up to six tiles per image with partial tiles
(odd sizes, masked rows and columns), stride 1 and 2 (the stride-2 dgrad's four parity classes with
odd input sizes, whose last row / column of classes falls outside the map). The forward's tap loop
always runs five steps. Under the interpreter a wgrad share is two tiles and the reduction adds two
shares per step (launcher.INTERPRETER_*), so the fp32 cases run the share loop twice and the reduction
over 2-15 shares; test_wgrad_default_shares runs the GPU's share rule.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from convfirstnet.kernels.gconv import launcher as L
from convfirstnet.kernels.gconv.reference import (
    gconv3x3_dgrad_reference,
    gconv3x3_reference,
    gconv3x3_wgrad_reference,
)

from convfirstnet.gconv import GroupConv3x3

from ..conftest import cuda
from ._traced import trace_graphs

OPS = torch.ops.convfirstnet
CL = torch.channels_last

# Tolerances from rounding. Every output element is a sum of K products: K = 72 (9 taps x 8 channels) for
# the forward, at most 72 for dgrad, K = N x H' x W' for wgrad. The kernels' inputs are the reference's
# inputs (the same rounded values), their products are exact in fp32 (16-bit x 16-bit products fit in
# 24 bits; fp32 operands in the interpreter are multiplied in fp32), and sums run in fp32 in some order.
# Any order obeys |fl(sum) - sum| <= K u32 sum|terms| (u32 = 2^-24), and a 16-bit output adds one
# rounding, u_out |ref|. So the check is, element-wise against the fp64 reference,
#     |out - ref| <= U_OUT[dtype] |ref| + K ACC[device] sum|terms|
# with sum|terms| from the same reference applied to |x|, |w|, |dy|. On a GPU the fp32 dots are 3xTF32
# (each product to ~2^-22 relative: 4 u32) and the tensor cores may truncate their fp32 partial sums:
# ACC["cuda"] allows 4x. A dropped tap, channel block, tile or share changes an output by a whole term
# (~sum|terms| / K, far above K u32 sum|terms|), so these bounds still catch every bug below.
U_OUT = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
ACC = {"cpu": 2.0**-24, "cuda": 4 * 2.0**-24}


def assert_bounded(out, ref, abs_ref, k_terms, what=""):
    """out within the rounding bound of the fp64 reference (module docstring)."""
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    err = (out.double() - ref).abs()
    bound = U_OUT[out.dtype] * ref.abs() + k_terms * ACC[out.device.type] * abs_ref + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the rounding bound (max |err| {err.max().item():.3g})"


def make_case(n, c, h, w, stride, dtype, device="cpu", seed=0, w_dtype=None):
    """x ~ N(0, 1) channels-last, weights fan-in scaled (unit gain), dy ~ N(0, 1) channels-last."""
    g = torch.Generator().manual_seed(seed)
    ho, wo = -(-h // stride), -(-w // stride)
    x = torch.randn(n, c, h, w, generator=g).to(device, dtype).contiguous(memory_format=CL)
    wt = (torch.randn(c, 8, 3, 3, generator=g) / 72**0.5).to(device, w_dtype or dtype)
    dy = torch.randn(n, c, ho, wo, generator=g).to(device, dtype).contiguous(memory_format=CL)
    return x, wt, dy


def reference_grads(x, wt, dy, stride):
    """y, dx, dw by autograd of F.conv2d in fp64 on the same (rounded) values, and the same maps of the
    absolute values (sum|terms| per element)."""

    def run(xx, ww, gg):
        xx = xx.detach().double().requires_grad_()
        ww = ww.detach().to(x.dtype).double().requires_grad_()  # an fp32 weight is rounded like autocast's
        y = F.conv2d(xx, ww, stride=stride, padding=1, groups=x.shape[1] // 8)
        y.backward(gg.double())
        return y.detach(), xx.grad, ww.grad

    return run(x, wt, dy), run(x.abs(), wt.abs(), dy.abs())


def check_all(x, wt, dy, stride, deterministic=True):
    """Forward, dgrad and wgrad through the ops against autograd of F.conv2d."""
    n, c, h, w = x.shape
    y = OPS.gconv3x3(x, wt, stride)
    dx = OPS.gconv3x3_dgrad(dy, wt, h, w, stride)
    dw = OPS.gconv3x3_wgrad(dy, x, wt.dtype, stride, deterministic)
    (y_ref, dx_ref, dw_ref), (y_abs, dx_abs, dw_abs) = reference_grads(x, wt, dy, stride)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == wt.dtype
    assert y.is_contiguous(memory_format=CL) and dx.is_contiguous(memory_format=CL)
    assert_bounded(y, y_ref, y_abs, 72, "forward")
    assert_bounded(dx, dx_ref, dx_abs, 72, "dgrad")
    assert_bounded(dw, dw_ref, dw_abs, max(1, n * dy.shape[2] * dy.shape[3]), "wgrad")
    if stride == 1 and x.is_cuda:  # the fused backward too (its interpreter tests: test_backward_*)
        dx2, dw2 = OPS.gconv3x3_backward(dy, x, wt, deterministic)
        assert dx2.dtype == x.dtype and dw2.dtype == wt.dtype
        assert_bounded(dx2, dx_ref, dx_abs, 72, "fused backward dx")
        assert_bounded(dw2, dw_ref, dw_abs, max(1, n * dy.shape[2] * dy.shape[3]), "fused backward dw")
    return y, dx, dw


@pytest.mark.parametrize("stride", [1, 2])
def test_reference_is_autograd_of_conv2d(stride):
    """reference.py (what the ops run on CPU and the kernels are specified by) against autograd."""
    x, wt, dy = make_case(2, 24, 9, 8, stride, torch.float64)
    (y, dx, dw), _ = reference_grads(x, wt, dy, stride)
    torch.testing.assert_close(gconv3x3_reference(x, wt, stride), y)
    torch.testing.assert_close(gconv3x3_dgrad_reference(dy, wt, 9, 8, stride), dx)
    torch.testing.assert_close(gconv3x3_wgrad_reference(dy, x, stride, torch.float64), dw)


# (N, C, H, W, stride). Channel blocks (launcher.groups_per_program) and tiles (fp32 / fp16):
# G = 8: 4x8 / 8x8 pixels; G = 4: 8x8 / 8x16; G = 2: 8x16 / 16x16 (wgrad in fp32: 16-32 pixels). Most maps
# span 2-6 tiles per image with partial ones; 24 and 72 channels leave masked groups in their last block.
SHAPES = [
    pytest.param(2, 16, 19, 21, 1, id="c16-G2-2x19x21"),
    pytest.param(1, 24, 10, 35, 1, id="c24-G4-masked-10x35"),
    pytest.param(1, 48, 17, 20, 1, id="c48-G2x3-17x20"),
    pytest.param(1, 72, 13, 12, 2, id="c72-G4x3-masked-s2-13x12"),
    pytest.param(1, 96, 21, 19, 2, id="c96-G4x3-s2-21x19"),
    pytest.param(1, 64, 17, 19, 2, id="c64-G8-s2-17x19"),
    pytest.param(1, 256, 9, 11, 1, id="c256-G8x4-9x11"),
    pytest.param(2, 512, 5, 7, 2, id="c512-G8x8-s2-5x7-one-tile"),
    pytest.param(1, 1024, 4, 9, 1, id="c1024-G8x16-4x9"),
]


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES)
def test_fp32_matches_autograd(interpreter_backend, n, c, h, w, stride):
    check_all(*make_case(n, c, h, w, stride, torch.float32), stride)


@pytest.mark.parametrize("n,c,h,w,stride", [SHAPES[0], SHAPES[1], SHAPES[4], SHAPES[6]])
def test_fp16_matches_autograd(interpreter_backend, n, c, h, w, stride):
    check_all(*make_case(n, c, h, w, stride, torch.float16), stride)


def test_fp16_wgrad_whole_groups_of_four_take_the_forward_tiles(interpreter_backend):
    """Wgrad at stride 1 where C is whole groups of G = 4 (ConvFirst's 32 and 96 channels) tiles as the
    forward kernel does, 16 x 16 pixels (stride 2 and masked groups keep 8 x 16): 2 x 2 tiles an image,
    the last row and column partial, shares of two tiles, against autograd."""
    assert (L.wgrad_tile_config(2, 32, 20, 19, torch.float16).tile_h,
            L.wgrad_tile_config(2, 32, 20, 19, torch.float16, 2).tile_h,
            L.wgrad_tile_config(2, 24, 20, 19, torch.float16).tile_h) == (16, 8, 8)
    check_all(*make_case(2, 32, 20, 19, 1, torch.float16), 1)


def assert_moment_rows(y, parts, shift, rows):
    """Row i of ``parts`` holds the sums of y - shift and of its square over y's pixels i rows ... (i + 1)
    rows - 1, per channel, within 1e-5 of the rows' largest sum of squares (fp64 reference)."""
    u = y.permute(0, 2, 3, 1).reshape(-1, rows, y.shape[1]).double() - shift.double()
    for k, want in enumerate((u.sum(1), u.square().sum(1))):
        err = (parts[:, k].double() - want).abs().max() / u.square().sum(1).abs().max()
        assert err <= 1e-5, (k, err.item())


@pytest.mark.parametrize("n,c,side,dtype", [(4, 1024, 8, torch.float16), (4, 96, 8, torch.float32),
                                              (4, 72, 16, torch.float16)])
def test_forward_with_moments(interpreter_backend, n, c, side, dtype):
    """The forward with a following BatchNorm's moments (MBConv training, kernels/mbconv/moments.py): y is
    the plain forward's bit for bit; row i holds the sums of y - shift and of its square over program i's
    pixels (tiles 2i and 2i + 1 under the interpreter: the tile loop runs twice), per channel, from y as
    stored. 1024 channels on 8x8: 8 channel blocks of G = 16; 96: 3 of G = 4 in fp32; 72: masked groups
    (G = 4, the last block one group wide) on 16x16 maps of one tile each. fp32 sums of <= 512 terms per
    lane: within 1e-5 of each row's largest sum of squares; a dropped tile or shift moves a
    row by a whole term (a dropped tile of the sums fails every case)."""
    gen = torch.Generator().manual_seed(3)
    mean = 2 + torch.randn(c, generator=gen)
    x = (torch.randn(n, c, side, side, generator=gen) + 0.5).to(dtype).contiguous(memory_format=CL)
    w = torch.randn(c, 8, 3, 3, generator=gen) / 72**0.5
    shift = mean + 0.3 * torch.randn(c, generator=gen)
    rows = L.moments_rows(n, c, side, side, dtype, interpreter=True)
    assert rows is not None
    y, parts = L.gconv3x3_moments_triton(x, w, shift)
    assert torch.equal(y, L.gconv3x3_triton(x, w, 1))
    assert parts.shape == (n * side * side // rows, 2, c) and parts.shape[0] > 1
    assert_moment_rows(y, parts, shift, rows)
    assert L.moments_rows(n, c, 7, 7, dtype, interpreter=True) is None  # masked pixels: not taken
    with pytest.raises(ValueError, match="exactly"):
        L.gconv3x3_moments_triton(x[:, :, :7, :7], w, shift)


def silu_pool_reference(x, w, bias, tile_h, tile_w):
    """fp64: y = SiLU(conv(x) + bias) (N, C, H, W), the bound's scale |conv|(|x|, |w|) + |bias| (SiLU is
    1.1-Lipschitz), each TH x TW tile's sums of y and of |y| (tiles numbered image by image, row-major)."""
    y = F.silu(gconv3x3_reference(x.double(), w.double(), 1) + bias.double()[None, :, None, None])
    scale = (gconv3x3_reference(x.double().abs(), w.double().abs(), 1)
             + bias.double().abs()[None, :, None, None])
    n, c, h, wd = y.shape
    th, tw = math.ceil(h / tile_h), math.ceil(wd / tile_w)

    def tile_sums(t):
        t = F.pad(t, (0, tw * tile_w - wd, 0, th * tile_h - h))
        return t.reshape(n, c, th, tile_h, tw, tile_w).sum((3, 5)).permute(0, 2, 3, 1).reshape(n * th * tw, c)

    return y, scale, tile_sums(y), tile_sums(y.abs()), th * tw


@pytest.mark.parametrize("n,c,h,w,dtype", [(4, 1024, 8, 8, torch.float16), (2, 72, 9, 10, torch.float16),
                                           (3, 96, 16, 16, torch.float32)])
def test_forward_with_silu_pool(interpreter_backend, n, c, h, w, dtype):
    """The forward with bias + SiLU (BIAS_SILU) and each tile's pool (POOL) (the folded MBConv's conv,
    kernels/mbconv/staged.py) against fp64. 1024 channels on 8x8: 8 channel blocks of G = 16, two tiles per
    program (the interpreter's TPP); 72 on a 9x10 map: masked groups and tiles with pixels outside the map,
    which the pool must skip (there the conv reads zeros, and SiLU(bias) is not 0); 96 in fp32. y: the
    forward's bound (the conv's K = 72 sums) through SiLU, plus 1e-6 of the scale for SiLU's own fp32
    evaluation; pools: fp32 sums of at most 256 terms, within 1e-5 of the tile's sum of |y|. A dropped
    bias, a pooled masked pixel or a pool row off by one tile fail by far more."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(n, c, h, w, generator=gen).to(dtype).contiguous(memory_format=CL)
    wt = (torch.randn(c, 8, 3, 3, generator=gen) / 72**0.5).to(dtype)
    bias = 0.5 * torch.randn(c, generator=gen)
    y, pools, tiles = L.gconv3x3_silu_triton(x, wt, bias, 0, True)
    cfg = L.fwd_tile_config(c, h, w, dtype)
    ref, scale, want, want_abs, per_image = silu_pool_reference(x, wt, bias, cfg.tile_h, cfg.tile_w)
    assert tiles == per_image and pools.shape == (n * tiles, c) and y.is_contiguous(memory_format=CL)
    err = (y.double() - ref).abs()
    bound = U_OUT[dtype] * ref.abs() + (1.1 * 72 * ACC["cpu"] + 1e-6) * scale
    assert (err <= bound).all(), (err - bound).max().item()
    perr = (pools.double() - want).abs() - 1e-5 * want_abs
    assert (perr <= 0).all(), perr.max().item()
    y_only, none, _ = L.gconv3x3_silu_triton(x, wt, bias, 0, False)  # the stride-2 blocks' form: no pools
    assert none is None and torch.equal(y_only, y)
    with pytest.raises(ValueError, match="bias"):
        L.gconv3x3_silu_triton(x, wt, bias[1:], 0, True)


def test_fp32_weight_with_fp16_activations(interpreter_backend):
    """Autocast's form: fp32 master weight, fp16 activations. The kernels round the weight to fp16 as
    they load it (the reference does the same) and return dw in fp32, summed in fp32."""
    x, wt, dy = make_case(1, 32, 13, 11, 1, torch.float16, w_dtype=torch.float32)
    _, _, dw = check_all(x, wt, dy, 1)
    assert dw.dtype == torch.float32


def test_wgrad_is_deterministic_and_atomics_agree(interpreter_backend):
    """Two identical calls give bitwise-equal gradients; the atomic option gives the same values to
    rounding (its order is not fixed)."""
    x, wt, dy = make_case(2, 32, 15, 17, 2, torch.float32)
    a = OPS.gconv3x3_wgrad(dy, x, torch.float32, 2)
    b = OPS.gconv3x3_wgrad(dy, x, torch.float32, 2)
    assert torch.equal(a, b)
    (_, _, dw_ref), (_, _, dw_abs) = reference_grads(x, wt, dy, 2)
    atomic = OPS.gconv3x3_wgrad(dy, x, torch.float32, 2, False)
    assert_bounded(atomic, dw_ref, dw_abs, 2 * 8 * 9, "wgrad (atomics)")


def test_wgrad_default_shares(interpreter_backend, monkeypatch):
    """The GPU's share rule (at least MIN_SHARE_PIXELS pixels per share), lowered so that this map makes
    several shares of several tiles, and the GPU's reduction step of 64 shares."""
    monkeypatch.setattr(L, "INTERPRETER_SHARE_TILES", 0)
    monkeypatch.setattr(L, "INTERPRETER_REDUCE_SB", L.REDUCE_SB)
    monkeypatch.setattr(L, "MIN_SHARE_PIXELS", 3 * 64)
    monkeypatch.setattr(L, "WGRAD_MIN_PROGRAMS", 1)  # G = 8 (its 5 programs would take G = 4)
    x, wt, dy = make_case(3, 64, 17, 16, 1, torch.float32)
    cfg = L.tile_config(64, 17, 16, torch.float32, wgrad=True)
    assert L.wgrad_tile_config(3, 64, 17, 16, torch.float32) == cfg
    tiles = 3 * math.ceil(17 / cfg.tile_h) * math.ceil(16 / cfg.tile_w)
    assert (tiles, cfg.block_m) == (54, 16)
    assert L.wgrad_shares(tiles, 1, cfg.block_m) == (12, 5)  # >= 192 pixels a share: 4 of 12 tiles, 1 of 6
    (_, _, dw_ref), (_, _, dw_abs) = reference_grads(x, wt, dy, 1)
    assert_bounded(OPS.gconv3x3_wgrad(dy, x, torch.float32, 1), dw_ref, dw_abs, 3 * 17 * 16, "wgrad")


def test_batch_zero_and_one(interpreter_backend):
    for stride in (1, 2):
        x, wt, dy = make_case(0, 16, 9, 7, stride, torch.float32)
        y = OPS.gconv3x3(x, wt, stride)
        assert y.shape == (0, 16, -(-9 // stride), -(-7 // stride))
        assert OPS.gconv3x3_dgrad(dy, wt, 9, 7, stride).shape == x.shape
        assert torch.equal(OPS.gconv3x3_wgrad(dy, x, torch.float32, stride), torch.zeros_like(wt))
        check_all(*make_case(1, 16, 9, 7, stride, torch.float32), stride)


def nan_banded(x: torch.Tensor) -> torch.Tensor:
    """x as a channels-last view into a larger NaN-filled buffer whose strides and offset stay multiples
    of 8 (so the kernels read it in place): a missing mask reads NaN and the check fails loudly."""
    n, c, h, w = x.shape
    big = torch.full((n + 1, c + 16, h + 2, w + 3), float("nan"), dtype=x.dtype)
    view = big.contiguous(memory_format=torch.channels_last)[:n, 8 : c + 8, 1 : h + 1, 2 : w + 2]
    view.copy_(x)
    return view


@pytest.mark.parametrize("stride", [1, 2])
def test_strided_views_are_read_in_place_and_masked(interpreter_backend, stride):
    x, wt, dy = make_case(2, 32, 11, 13, stride, torch.float32)
    xv, dyv = nan_banded(x), nan_banded(dy)
    assert L.reads_in_place(xv) and L.reads_in_place(dyv) and not xv.is_contiguous(memory_format=CL)
    wv = wt.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)  # tap-major, as the fused blocks store it
    check_all(xv, wv, dyv, stride)


def test_nchw_inputs_are_converted(interpreter_backend):
    """Layouts the kernels cannot read in place (NCHW, odd channel offsets) are copied to channels-last
    once by the launcher; the results are the same."""
    x, wt, dy = make_case(1, 16, 9, 10, 2, torch.float32)
    assert not L.reads_in_place(x.contiguous())
    check_all(x.contiguous(), wt, dy.contiguous(), 2)


# ------------------------------------------------------------------------------------------------
# Bad input: one clear error before any launch
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(L, "launch", fail)


def test_bad_input_refused_before_launch(interpreter_backend, no_launch):
    x, wt, dy = make_case(1, 16, 5, 5, 1, torch.float32)
    cases = [
        (ValueError, "group width 4", lambda: OPS.gconv3x3(x, torch.randn(16, 4, 3, 3), 1)),
        (ValueError, "kernel size 5x5", lambda: OPS.gconv3x3(x, torch.randn(16, 8, 5, 5), 1)),
        (ValueError, "multiple of 8", lambda: OPS.gconv3x3(torch.randn(1, 12, 5, 5), torch.randn(12, 8, 3, 3),
                                                           1)),
        (ValueError, "stride must be 1 or 2", lambda: OPS.gconv3x3(x, wt, 3)),
        (ValueError, "4-D", lambda: OPS.gconv3x3(x[0], wt, 1)),
        (TypeError, "dtype", lambda: OPS.gconv3x3(x.to(torch.int32), wt, 1)),
        (TypeError, "weight dtype", lambda: OPS.gconv3x3(x, wt.half(), 1)),
        (TypeError, "do not run torch.float64", lambda: OPS.gconv3x3(x.double(), wt.double(), 1)),
        (TypeError, "bfloat16 through the Triton interpreter",
         lambda: OPS.gconv3x3(x.bfloat16(), wt.bfloat16(), 1)),
        (ValueError, "does not match a 6x5 input", lambda: OPS.gconv3x3_dgrad(dy, wt, 6, 5, 1)),
        (ValueError, "does not match x", lambda: OPS.gconv3x3_wgrad(dy, x, torch.float32, 2)),
        (TypeError, "same dtype", lambda: OPS.gconv3x3_wgrad(dy.half(), x, torch.float32, 1)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


def test_bf16_refused_in_interpreter(interpreter_backend):
    x, wt, dy = make_case(1, 16, 5, 5, 1, torch.float32)
    with pytest.raises(TypeError, match="bfloat16 through the Triton interpreter"):
        OPS.gconv3x3_wgrad(dy.bfloat16(), x.bfloat16(), torch.float32, 1)


# ------------------------------------------------------------------------------------------------
# The fused stride-1 backward (gconv3x3_backward): dgrad and wgrad from one read of dy
# ------------------------------------------------------------------------------------------------


def check_backward(x, wt, dy, deterministic=True):
    """gconv3x3_backward against autograd of F.conv2d: dx as dgrad's bound (K = 72), dw as wgrad's
    (K = N x H x W)."""
    n, c, h, w = x.shape
    dx, dw = OPS.gconv3x3_backward(dy, x, wt, deterministic)
    (_, dx_ref, dw_ref), (_, dx_abs, dw_abs) = reference_grads(x, wt, dy, 1)
    assert dx.dtype == x.dtype and dw.dtype == wt.dtype and dx.is_contiguous(memory_format=CL)
    assert_bounded(dx, dx_ref, dx_abs, 72, "backward dx")
    assert_bounded(dw, dw_ref, dw_abs, n * h * w, "backward dw")
    return dx, dw


# (N, C, H, W, dtype, weight dtype) at the MBConv widths (384, 1024; fp32 master weights with fp16 as under
# autocast) and odd ones whose last channel block has masked groups (40: G = 2, 3 blocks; 200: G = 4, 7
# blocks), and a 7 x 7 map's G = 16 blocks of 128 channels. Under the interpreter a share is 2 tiles:
# each case has 2-6 shares of 2 tiles (the tile loop and the reduction's share loop run more than once).
BACKWARD_SHAPES = [
    pytest.param(2, 384, 5, 6, torch.float32, None, id="c384-fp32-2x5x6"),
    pytest.param(3, 40, 7, 10, torch.float32, None, id="c40-masked-fp32-3x7x10"),
    pytest.param(2, 200, 9, 19, torch.float16, None, id="c200-masked-fp16-2x9x19"),
    pytest.param(2, 1024, 9, 17, torch.float16, torch.float32, id="c1024-fp16-w32-2x9x17"),
    pytest.param(4, 1024, 7, 7, torch.float16, torch.float32, id="c1024-g16-fp16-w32-4x7x7"),
]


@pytest.mark.parametrize("n,c,h,w,dtype,w_dtype", BACKWARD_SHAPES)
def test_backward_matches_autograd(interpreter_backend, n, c, h, w, dtype, w_dtype):
    cfg, per_share, shares = L.backward_config(n, c, h, w, dtype, interpreter=True)
    assert per_share == 2 and shares >= 2, (cfg, per_share, shares)
    assert (c % cfg.channels != 0) == (c in (40, 200))
    assert (cfg.g == 16) == (c == 1024 and h == 7)  # the small map's blocks: two groups a warp
    check_backward(*make_case(n, c, h, w, 1, dtype, w_dtype=w_dtype))


# Each load order of the tap pairs besides the one the other tests run (launcher.tap_order(), the
# conflict-free order of the installed Triton; kernel.py load_tap_pair, load_tap_pair_weights): forward,
# dgrad and wgrad at both strides (G = 4 with a masked group, G = 8) on partial tiles, fp16 activations
# with fp32 weights (the permuted weight load of order 1 rounds them as it loads), and the fused backward.
@pytest.mark.parametrize("taps", sorted({0, 1, 2} - {L.tap_order()}))
@pytest.mark.parametrize("n,c,h,w,stride", [SHAPES[1], SHAPES[5]])
def test_tap_orders_match_autograd(interpreter_backend, monkeypatch, taps, n, c, h, w, stride):
    monkeypatch.setattr(L, "TAP_ORDER", taps)
    check_all(*make_case(n, c, h, w, stride, torch.float16, w_dtype=torch.float32), stride)
    if stride == 1:
        check_backward(*make_case(2, 200, 9, 19, 1, torch.float16, w_dtype=torch.float32))


def test_backward_residual_is_added_before_the_store(interpreter_backend):
    """The fused backward's residual (the ConvFirst training blocks' dx = dout + dgrad(da)): in fp32 the
    kernel adds it to the same fp32 dgrad sum it stores without one, so dx is exactly dx + residual; dw is
    untouched. At 64 channels (G = 8, 8 x 16 tiles) on 2 x 17 x 19 maps: partial tiles, 2-tile shares."""
    x, wt, dy = make_case(2, 64, 17, 19, 1, torch.float32)
    res = torch.randn_like(x).contiguous(memory_format=CL)
    dx, dw = L.gconv3x3_backward_triton(dy, wt, x, wt.dtype)
    dx_r, dw_r = L.gconv3x3_backward_triton(dy, wt, x, wt.dtype, residual=res)
    assert torch.equal(dx_r, dx + res) and torch.equal(dw_r, dw)
    assert not torch.equal(dx_r, dx)


def test_backward_is_deterministic_and_atomics_agree(interpreter_backend):
    """Two identical calls give bitwise-equal dx and dw; the atomic option gives dw to rounding."""
    x, wt, dy = make_case(2, 64, 9, 11, 1, torch.float32)
    dx_a, dw_a = OPS.gconv3x3_backward(dy, x, wt)
    dx_b, dw_b = OPS.gconv3x3_backward(dy, x, wt)
    assert torch.equal(dx_a, dx_b) and torch.equal(dw_a, dw_b)
    check_backward(x, wt, dy, deterministic=False)


def test_backward_gpu_shares(interpreter_backend, monkeypatch):
    """The GPU's share rule (launcher.backward_config), lowered so that this map takes the short shares
    of a grid under one wave: several shares of several tiles and a shorter last one, reduced 64 at a
    time."""
    monkeypatch.setattr(L, "INTERPRETER_SHARE_TILES", 0)
    monkeypatch.setattr(L, "INTERPRETER_REDUCE_SB", L.REDUCE_SB)
    monkeypatch.setattr(L, "BACKWARD_PROGRAMS", {8: 4, 4: 4, 2: 4})
    monkeypatch.setattr(L, "BACKWARD_MIN_SHARE_PIXELS", 16)
    cfg, per_share, shares = L.backward_config(3, 64, 17, 16, torch.float32, interpreter=True)
    tiles = 3 * math.ceil(17 / cfg.tile_h) * math.ceil(16 / cfg.tile_w)
    cblocks = 64 // cfg.channels
    assert shares * cblocks <= 4 and per_share > 1 and tiles % per_share != 0, (cfg, tiles, per_share, shares)
    check_backward(*make_case(3, 64, 17, 16, 1, torch.float32))


def test_backward_grids_at_the_model_shapes():
    """launcher.backward_config at the MBConv convs of Small (batch 128, fp16): wgrad's G, tiles of
    FWD_TILE_ELEMS (128 pixels at G = 8 and G = 4, capped at 128 at G = 2: 256 spilled) and shares where
    they fill a wave (16 x 16: 32 shares of 8 tiles x 16 blocks; two waves at G = 4), shorter shares where
    they do not. 8 x 8
    and 7 x 7, whose 64-pixel tiles the map caps: on sm_90 G = 16, 16 shares of 8 tiles x 8 blocks (one
    program per SM), below it wgrad's G = 4, 22 shares of 6 tiles x 32 blocks."""
    got = {}
    for c, side in ((1024, 16), (1024, 14), (1024, 8), (1024, 7), (384, 32), (768, 16), (72, 28), (48, 28)):
        cfg, per_share, shares = L.backward_config(128, c, side, side, torch.float16)
        got[(c, side)] = (cfg.g, cfg.block_m, per_share, shares, cfg.num_warps)
    assert got == {(1024, 16): (8, 128, 8, 32, 8), (1024, 14): (8, 128, 8, 32, 8),
                   (1024, 8): (16, 64, 8, 16, 8), (1024, 7): (16, 64, 8, 16, 8),
                   (384, 32): (8, 128, 8, 128, 8), (768, 16): (8, 128, 8, 32, 8),
                   (72, 28): (4, 128, 4, 256, 4), (48, 28): (2, 128, 5, 205, 2)}
    for side in (8, 7):
        cfg, per_share, shares = L.backward_config(128, 1024, side, side, torch.float16, arch=80)
        assert (cfg.g, cfg.block_m, per_share, shares, cfg.num_warps) == (4, 64, 6, 22, 4)


def test_backward_bad_input_refused_before_launch(interpreter_backend, no_launch):
    x, wt, dy = make_case(1, 16, 5, 5, 1, torch.float32)
    cases = [
        (ValueError, "does not match x", lambda: OPS.gconv3x3_backward(dy[:, :, :3], x, wt)),
        (TypeError, "same dtype", lambda: OPS.gconv3x3_backward(dy.half(), x, wt)),
        (ValueError, "group width 4", lambda: OPS.gconv3x3_backward(dy, x, torch.randn(16, 4, 3, 3))),
        (ValueError, "8 output channels", lambda: OPS.gconv3x3_backward(dy, x, torch.randn(8, 8, 3, 3))),
        (TypeError, "weight dtype", lambda: OPS.gconv3x3_backward(dy, x, wt.half())),
        (ValueError, "multiple of 8", lambda: OPS.gconv3x3_backward(dy[:, :12], x[:, :12], wt[:12])),
        (TypeError, "bfloat16 through the Triton interpreter",
         lambda: OPS.gconv3x3_backward(dy.bfloat16(), x.bfloat16(), wt)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


def test_backward_opcheck_and_gradients(reference_backend):
    """Registration (fake tensors, autograd) and the fused op's own backward, twice differentiated; the
    stride-1 forward's backward takes it when both gradients are asked for."""
    x, wt, dy = make_case(2, 16, 7, 9, 1, torch.float32)
    args = (dy.requires_grad_(), x.requires_grad_(), wt.requires_grad_())
    torch.library.opcheck(OPS.gconv3x3_backward, args)
    args = [torch.randn(1, 8, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    args.append(torch.randn(8, 8, 3, 3, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda *a: OPS.gconv3x3_backward(*a), args, fast_mode=True)
    assert torch.autograd.gradgradcheck(lambda *a: OPS.gconv3x3_backward(*a), args, fast_mode=True)


# ------------------------------------------------------------------------------------------------
# The drop-in module
# ------------------------------------------------------------------------------------------------


def test_module_is_the_conv_it_replaces():
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, 2, 1, groups=4, bias=False)
    torch.manual_seed(0)
    gc = GroupConv3x3(32, 2)
    assert isinstance(gc, nn.Conv2d) and gc.groups == 4 and gc.bias is None
    assert list(gc.state_dict()) == list(conv.state_dict()) == ["weight"]
    assert torch.equal(gc.weight, conv.weight)  # nn.Conv2d's initialisation
    swapped = GroupConv3x3.from_conv(conv)
    assert swapped.weight is conv.weight and swapped.stride == (2, 2)
    x = torch.randn(2, 32, 9, 8).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(swapped(x), conv(x), atol=1e-5, rtol=1e-5)


def test_model_switch_keeps_state_dict(monkeypatch):
    """The training form with every grouped conv swapped for GroupConv3x3 (the one-line switch in
    blocks._gconv3x3): the same state_dict keys and the same outputs and gradients."""
    from convfirstnet import blocks
    from convfirstnet.model import SIZES, ConvFirstNet

    size = SIZES["pico"]
    stages = [*size.stages[:3], dataclasses.replace(size.stages[3], depth=2)]  # ConvFirst and MBConv
    torch.manual_seed(0)
    ref = ConvFirstNet(size.stem, stages, num_classes=10)
    monkeypatch.setattr(blocks, "_gconv3x3", lambda c, stride=1: GroupConv3x3(c, stride))
    model = ConvFirstNet(size.stem, stages, num_classes=10)
    n_grouped = sum(isinstance(m, nn.Conv2d) and m.groups > 1 for m in ref.modules())
    assert n_grouped == 1 + 2 + 3 + 2
    assert sum(isinstance(m, GroupConv3x3) for m in model.modules()) == n_grouped
    assert list(model.state_dict()) == list(ref.state_dict())
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 64, 64)
    out, out_ref = model(x), ref(x)
    torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=1e-4)
    out.sum().backward()
    out_ref.sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_module_refuses_under_triton(triton_backend):
    gc = GroupConv3x3(16)
    x = torch.randn(1, 16, 6, 6)
    with pytest.raises(ValueError, match="not channels-last"):
        gc(x)  # NCHW
    with pytest.raises(TypeError, match="dtype torch.float64"):
        gc.double()(x.double().contiguous(memory_format=torch.channels_last))
    with pytest.raises(ValueError, match="group width 4"):
        GroupConv3x3.from_conv(nn.Conv2d(16, 16, 3, 1, 1, groups=4, bias=False))
    with pytest.raises(ValueError, match="kernel size"):
        GroupConv3x3.from_conv(nn.Conv2d(16, 16, 5, 1, 2, groups=2, bias=False))


def test_from_conv_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")
    conv = nn.Conv2d(16, 16, 3, 1, 1, groups=2, bias=True)
    with pytest.warns(UserWarning, match="bias"):
        assert GroupConv3x3.from_conv(conv) is conv
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GroupConv3x3.from_conv(conv) is conv  # the same problem warns once


def test_module_interpreter_matches_conv(interpreter_backend):
    conv = nn.Conv2d(32, 32, 3, 1, 1, groups=4, bias=False)
    gc = GroupConv3x3.from_conv(conv)
    x = torch.randn(2, 32, 9, 11).contiguous(memory_format=torch.channels_last).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    gc(x).square().sum().backward()
    g_w = conv.weight.grad.clone()
    conv.weight.grad = None
    conv(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g_w, conv.weight.grad, atol=1e-3, rtol=1e-4)


def test_compiled_training_step_cpu():
    """torch.compile(fullgraph=True) of a small net of GroupConv3x3 layers (the op's reference branch on
    CPU), forward + backward (dgrad and wgrad ops in the backward graph) + an SGD step: the same losses
    and parameters as the same net of nn.Conv2d in eager mode."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(GroupConv3x3(16), nn.BatchNorm2d(16), nn.ReLU(), GroupConv3x3(16, 2))
    ref = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 16, 3, 2, 1, groups=2, bias=False))
    ref.load_state_dict(net.state_dict())
    compiled = torch.compile(net, fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, ref)]
    x = torch.randn(2, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    for _ in range(2):
        losses = []
        for model, opt in zip((compiled, ref), opts):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-5)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Registration: opcheck, gradients of gradients, the traced Triton branch
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stride", [1, 2])
def test_opcheck(reference_backend, stride):
    x, wt, dy = make_case(2, 16, 7, 9, stride, torch.float32)
    x.requires_grad_()
    wt.requires_grad_()
    torch.library.opcheck(OPS.gconv3x3, (x, wt, stride))
    torch.library.opcheck(OPS.gconv3x3, (x, wt, stride, False))
    torch.library.opcheck(OPS.gconv3x3_dgrad, (dy, wt, 7, 9, stride))
    torch.library.opcheck(OPS.gconv3x3_wgrad, (dy, x.detach(), torch.float32, stride))


@pytest.mark.parametrize("stride", [1, 2])
def test_gradcheck_and_double_backward(reference_backend, stride):
    x = torch.randn(1, 8, 5, 4, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(8, 8, 3, 3, dtype=torch.float64, requires_grad=True)

    def f(a, b):
        return OPS.gconv3x3(a, b, stride)

    assert torch.autograd.gradcheck(f, (x, wt), fast_mode=True)
    assert torch.autograd.gradgradcheck(f, (x, wt), fast_mode=True)


_TRACED_BODY = """
for stride in (1, 2):
    x = torch.randn(2, 16, 9, 7).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(16, 8, 3, 3).requires_grad_()
    backend = aot_autograd(fw_compiler=capture(f"forward s{stride}"),
                           bw_compiler=capture(f"backward s{stride}"))
    f = torch.compile(lambda x, w: torch.ops.convfirstnet.gconv3x3(x, w, stride), fullgraph=True,
                      backend=backend)
    f(x, w).sum().backward()
"""


@pytest.mark.subprocess
def test_torch_compile_traces_triton_branch():
    """torch.compile(fullgraph=True) of forward + backward through the Triton branch (real JITFunctions,
    in a subprocess without the interpreter): the forward kernel in the forward graph; in the backward
    graph the fused backward and its reduction (stride 1) or dgrad and the two wgrad launches (stride 2),
    as user-defined Triton kernels (what Inductor receives on a GPU), with no copies of the inputs (torch's
    analysis finds that only the outputs are written)."""
    pytest.importorskip("triton")
    graphs = trace_graphs(_TRACED_BODY)
    assert len(graphs) == 4, list(graphs)
    for name, targets in graphs.items():
        # the backward: the fused dgrad + wgrad and its reduction at stride 1, dgrad, wgrad, reduction at 2
        launches = {"forward s1": 1, "forward s2": 1, "backward s1": 2, "backward s2": 3}[name]
        assert targets.count("triton_kernel_wrapper_functional") == launches, (name, targets)
        assert not any("clone" in t or "copy" in t for t in targets), (name, targets)


# ------------------------------------------------------------------------------------------------
# Tables and cost declarations
# ------------------------------------------------------------------------------------------------


def test_model_shapes_table_matches_the_models():
    import timm

    for name, shapes in L.MODEL_SHAPES.items():
        model = timm.create_model(f"convfirstnet_{name}").to("meta")
        seen = set()
        for m in model.modules():
            if isinstance(m, nn.Conv2d) and m.groups > 1:
                m.register_forward_hook(lambda mod, inp, out: seen.add((mod.in_channels, inp[0].shape[2],
                                                                        mod.stride[0], mod.groups)))
        model(torch.empty(1, 3, 224, 224, device="meta"))
        assert seen == {(c, hw, 1, c // 8) for c, hw in shapes}, name


def test_channel_blocks_of_the_model_widths():
    """G per width (launcher.groups_per_program): exact blocks where the width allows a cheap one, masked
    groups for 24 (3 of 4) and 72 (9 of 12)."""
    widths = sorted({c for shapes in L.MODEL_SHAPES.values() for c, _ in shapes})
    expect = {16: 2, 24: 4, 32: 4, 48: 2, 72: 4, 96: 4, 288: 4}
    assert {c: L.groups_per_program(c) for c in widths} == {c: expect.get(c, 8) for c in widths}


def _record(kind, n, c, h, w, stride, dtype=torch.float16, deterministic=True, sms=None):
    from convfirstnet.kernels._cost import recording

    ho, wo = -(-h // stride), -(-w // stride)
    x = torch.empty(n, c, h, w, device="meta", dtype=dtype).contiguous(memory_format=torch.channels_last)
    wt = torch.empty(c, 8, 3, 3, device="meta", dtype=dtype)
    dy = torch.empty(n, c, ho, wo, device="meta", dtype=dtype).contiguous(memory_format=torch.channels_last)
    with recording(sms=sms) as rec:
        if kind == "forward":
            OPS.gconv3x3(x, wt, stride)
        elif kind == "dgrad":
            OPS.gconv3x3_dgrad(dy, wt, h, w, stride)
        elif kind == "wgrad":
            OPS.gconv3x3_wgrad(dy, x, dtype, stride, deterministic)
        else:  # with fp32 master weights, as the MBConv blocks' training backward under autocast
            assert stride == 1
            OPS.gconv3x3_backward(dy, x, wt.float(), deterministic)
    return rec.launches


@pytest.mark.parametrize("kind", ["forward", "dgrad", "wgrad"])
@pytest.mark.parametrize("stride", [1, 2])
def test_cost_declarations(kind, stride):
    """Small's widest layer (1024 channels, 14 x 14, batch 128) and its stage-1 layer (32 at 112 x 112):
    72 useful MACs per output element, 10/9 of them issued plus the masked rows of partial tiles, x
    and y (or dy) once in DRAM, fp32 partials for wgrad."""
    for c, hw in ((1024, 14), (32, 112)):
        launches = _record(kind, 128, c, hw, hw, stride)
        ho = -(-hw // stride)
        outputs = 128 * c * ho * ho
        cost = launches[0].cost
        assert cost.useful_macs == 72 * outputs
        assert 10 / 9 <= cost.mma_macs / cost.useful_macs < 10 / 9 * 1.7
        assert cost.dram_bytes >= 2 * 128 * c * (hw * hw + ho * ho)
        # L1: the halo window of each tile once (taps re-read it from L1), wgrad's dy tile, the weights
        if kind == "wgrad":
            cfg = L.wgrad_tile_config(128, c, ho, ho, torch.float16, stride)
        elif kind == "forward" or stride == 1:  # the forward kernel's tiles
            cfg = L.fwd_tile_config(c, ho, ho, torch.float16)
        else:
            cfg = L.tile_config(c, ho, ho, torch.float16)
        assert (launches[0].meta["G"], launches[0].meta["TH"], launches[0].meta["TW"]) == \
            (cfg.g, cfg.tile_h, cfg.tile_w)
        ch, bm = cfg.channels, cfg.block_m
        rows = ((cfg.tile_h - 1) * stride + 3, (cfg.tile_w - 1) * stride + 3)
        if kind == "dgrad":  # stride 1: the forward's window over dy; stride 2: dy windows of positions
            rows = (cfg.tile_h + 2, cfg.tile_w + 2) if stride == 1 else (cfg.tile_h + 1, cfg.tile_w + 1)
        window = 2 * ch * rows[0] * rows[1]
        if kind == "wgrad":
            per_share = launches[0].args[9]
            assert cost.l1_working_set_bytes == window + 2 * ch * bm
            assert cost.l1_unique_bytes_per_program == per_share * (window + 2 * ch * bm)
        elif kind == "dgrad" and stride == 2:
            assert cost.l1_working_set_bytes == cost.l1_unique_bytes_per_program == window + 2 * ch * 72
        else:  # TPP tiles per program, their windows one after another, the weights once
            tpp = launches[0].meta["TPP"]
            assert tpp == L.tiles_per_program(128, c, ho, ho, cfg) and tpp in (1, 2, 4, 8)
            tiles = 128 * -(-ho // cfg.tile_h) * -(-ho // cfg.tile_w)
            least = L.FWD_MIN_PROGRAMS_G16 if cfg.g == 16 else L.FWD_MIN_PROGRAMS
            assert launches[0].grid[0] * tpp == tiles and launches[0].grid[0] * launches[0].grid[1] >= least
            assert cost.loops[0].name == "tiles" and cost.loops[0].trips == tpp
            assert cost.l1_working_set_bytes == window + 2 * ch * 72
            assert cost.l1_unique_bytes_per_program == tpp * window + 2 * ch * 72
        if kind == "wgrad":
            shares, cblocks = launches[0].grid
            assert cost.dram_bytes == 2 * 128 * c * (hw * hw + ho * ho) + 4 * shares * c * 72
            assert launches[1].cost.dram_bytes == 4 * shares * c * 72 + 2 * c * 72
            assert shares * cblocks <= L.WGRAD_PROGRAMS + cblocks


def test_backward_cost_declaration():
    """The fused backward at Small's 16 x 16 and 8 x 8 MBConv convs (1024 channels, batch 128): dy, x and
    dx once in DRAM (dy once where dgrad and wgrad read it twice), the (fp32) weights once, the partials once
    (then wgrad's reduction); 2 x 72 useful MACs per element, 10/9 of them issued plus masked rows; L1: a
    tile's halo window of dy, its x (read once) and the weights."""
    for side in (16, 8):
        launches = _record("backward", 128, 1024, side, side, 1)
        names = [lc.kernel.fn.__name__ for lc in launches]
        assert names == ["_gconv_backward_kernel", "_wgrad_reduce_kernel"]
        cost, meta = launches[0].cost, launches[0].meta
        cfg, per_share, shares = L.backward_config(128, 1024, side, side, torch.float16)
        assert launches[0].grid == (shares, 1024 // cfg.channels) and launches[0].args[10] == per_share
        assert (meta["G"], meta["TH"] * meta["TW"]) == (cfg.g, cfg.block_m)
        elems = 128 * 1024 * side * side
        assert cost.useful_macs == 2 * 72 * elems
        assert 10 / 9 <= cost.mma_macs / cost.useful_macs < 10 / 9 * 1.7
        assert cost.dram_bytes == 3 * 2 * elems + 4 * 1024 * 72 + 4 * shares * 1024 * 72  # fp32 weights
        window = 2 * cfg.channels * (cfg.tile_h + 2) * (cfg.tile_w + 2)
        tile = window + 2 * cfg.channels * cfg.block_m  # dy's halo window, x's tile
        assert cost.l1_working_set_bytes == tile + 4 * cfg.channels * 72
        assert cost.l1_unique_bytes_per_program == per_share * tile + 4 * cfg.channels * 72
        assert launches[1].cost.dram_bytes == 4 * shares * 1024 * 72 + 4 * 1024 * 72  # dw in fp32


def test_wgrad_takes_half_the_channel_block_where_programs_are_few():
    """launcher.wgrad_tile_config: G = 4 for G = 8 where G = 8's full shares make fewer programs than an
    H100 has SMs (Small's 8 x 8 and 7 x 7 stages at batch 128: 8 shares x 16 channel blocks; 64 channels at
    28 x 28: 128 x 1), twice the programs over as many pixels per share; G = 8 where the grid fills the GPU
    (16 x 16: 32 x 16) or where the shares are short (a small batch)."""
    grids = {}
    for n, c, side in ((128, 1024, 8), (128, 1024, 7), (128, 64, 28), (128, 1024, 16), (2, 1024, 8)):
        lc = _record("wgrad", n, c, side, side, 1)[0]
        grids[(n, c, side)] = (lc.meta["G"], lc.grid, lc.args[9] * lc.meta["TH"] * lc.meta["TW"])
    assert grids == {(128, 1024, 8): (4, (8, 32), 1024), (128, 1024, 7): (4, (8, 32), 1024),
                     (128, 64, 28): (4, (128, 2), 1024), (128, 1024, 16): (8, (32, 16), 1024),
                     (2, 1024, 8): (8, (1, 16), 128)}


def test_wgrad_with_half_the_channel_block(interpreter_backend):
    """A map whose G = 8 grid is one program of a full share (16 tiles of 8 x 8 at fp16) runs G = 4 (two
    channel blocks) against autograd."""
    x, wt, dy = make_case(16, 64, 8, 8, 1, torch.float16)
    assert L.wgrad_tile_config(16, 64, 8, 8, torch.float16).g == 4
    (_, _, dw_ref), (_, _, dw_abs) = reference_grads(x, wt, dy, 1)
    assert_bounded(OPS.gconv3x3_wgrad(dy, x, torch.float16, 1), dw_ref, dw_abs, 16 * 64, "wgrad")


def test_deterministic_shares_do_not_depend_on_the_device():
    """The share count (hence the reduction order and dw's bits) is a function of the shapes only."""
    a = _record("wgrad", 128, 256, 28, 28, 1)  # an H100 (132 SMs)
    b = _record("wgrad", 128, 256, 28, 28, 1, sms=108)  # an A100
    assert a[0].grid == b[0].grid and a[0].args[9] == b[0].args[9]  # shares, tiles per share


# ------------------------------------------------------------------------------------------------
# Compiled for the GPU (no GPU needed): a sample of the shipped variants, sm_90 and sm_80
# ------------------------------------------------------------------------------------------------

# (kind, N, C, H, W, stride, dtype, arch): Small's widest layer (G = 8; G = 16 on its 8 x 8 and 7 x 7
# maps), Tiny's 72-channel layer (G = 1),
# the stride-2 dgrad and the wgrad pair in bf16 / fp32, on both targets, Small's 8 x 8 wgrad (G = 4), and
# the fused backward (fp32 master weights) at Small's 16 x 16 (G = 8) and 8 x 8 (G = 4) MBConv convs and
# in fp32 at G = 2.
COMPILE_SAMPLE = [
    ("forward", 128, 1024, 14, 14, 1, torch.float16, 90),
    ("forward", 128, 1024, 8, 8, 1, torch.float16, 80),
    ("dgrad", 128, 1024, 7, 7, 1, torch.bfloat16, 90),
    ("dgrad", 128, 72, 28, 28, 1, torch.float16, 80),
    ("dgrad", 128, 256, 28, 28, 2, torch.bfloat16, 90),
    ("wgrad", 128, 32, 112, 112, 1, torch.float16, 90),
    ("wgrad", 128, 96, 28, 28, 2, torch.float32, 80),
    ("wgrad", 128, 1024, 8, 8, 1, torch.float16, 90),
    ("backward", 128, 1024, 16, 16, 1, torch.float16, 90),
    ("backward", 128, 1024, 8, 8, 1, torch.bfloat16, 90),
    ("backward", 128, 48, 28, 28, 1, torch.float32, 80),
]


@pytest.fixture(scope="module")
def compiled_sample():
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    rows = []
    for kind, n, c, h, w, stride, dtype, arch in COMPILE_SAMPLE:
        for launch in _record(kind, n, c, h, w, stride, dtype):
            rows.append(((kind, c, stride, dtype, arch), launch, variant_of(launch, arch)))
    compiled = compile_variants([v for _, _, v in rows])
    return [(what, launch, comp) for (what, launch, _), comp in zip(rows, compiled)]


@pytest.mark.compile
@pytest.mark.slow
def test_sample_compiles_without_spills(compiled_sample):
    from convfirstnet.analysis.compiled import weigh
    from convfirstnet.analysis.hardware import hardware
    from convfirstnet.analysis.targets import target
    from tests.kernels._recorded import SMEM_LIMIT

    for what, launch, comp in compiled_sample:
        name = f"{comp.variant.name} {what}"
        assert comp.stack == 0, f"{name}: {comp.stack} B of stack (register spills)"
        assert comp.shared <= SMEM_LIMIT[comp.variant.arch], f"{name}: {comp.shared} B of shared memory"
        insns, loops = comp.listing()
        per_program = launch.cost.mma_macs / math.prod(launch.grid)
        if "wgrad_kernel" in comp.variant.name or "backward_kernel" in comp.variant.name:  # a full share
            at = 9 if "backward_kernel" in comp.variant.name else 8  # the backward's residual pointer
            tiles, per_share = launch.args[at], launch.args[at + 1]
            per_program = launch.cost.mma_macs / (tiles * launch.grid[1]) * per_share
        # the declared loops are the compiled loops, and the weighted tensor-core instructions issue
        # exactly the declared MACs
        w = weigh(insns, loops, launch.cost.loops, num_warps=comp.num_warps, mma_macs_per_program=per_program,
                  what=name)
        assert w.tensor_macs == pytest.approx(per_program), name
        opcodes = {i.opcode for i in insns}
        if "reduce" not in comp.variant.name:
            # the two-tap dots are batched mma.sync; the tap windows are plain L1-allocating loads
            assert comp.mma_kind == "mma.sync", name
            assert "LDG.E.128" in opcodes, name
            assert not any(op.startswith("LDGSTS") for op in opcodes), name
            # the declared L1 working set (one tile's halo window, wgrad's dy tile, the weights) fits in
            # the L1 that the resident programs' compiled shared memory leaves (the report's rule for
            # counting the taps' re-reads as L1 hits; sm_90, the training report's target; elsewhere the
            # report counts every requested byte when it does not fit)
            if comp.variant.arch != 90:
                continue
            t = target(comp.variant.arch)
            occ = t.occupancy(comp.num_warps, comp.regs, comp.shared)
            l1 = hardware(comp.variant.arch).l1_bytes(occ * (comp.shared + t.smem_reserved_per_block))
            assert 0 < launch.cost.l1_working_set_bytes <= l1 / occ, (
                f"{name}: L1 working set {launch.cost.l1_working_set_bytes} B, {l1} B of L1 for {occ} "
                "programs")


@pytest.mark.compile
@pytest.mark.slow
def test_forward_register_limit(compiled_sample):
    """launcher.FWD_MAXNREG: the plain forward at Small's 1024-channel 14x14 map (sm_90, fp16) compiles to
    at least 240 registers a thread, no stack. Left to ptxas (Triton 3.8) it took 167 for three programs
    per SM, and its loads waited in sequence (the launcher's comment); dropping the limit is the planted
    bug."""
    checked = 0
    for (kind, c, _, dtype, arch), _, comp in compiled_sample:
        if kind == "forward" and arch == 90:
            assert comp.regs >= 240 and comp.stack == 0, (c, dtype, comp.regs, comp.stack)
            checked += 1
    assert checked == 1


@pytest.mark.compile
@pytest.mark.slow
def test_backward_weights_loaded_before_the_tile_loop(compiled_sample):
    """kernel.py: the fused backward (16-bit, G >= 4) loads dgrad's weights once per program, before its
    tile loop. Its fp32 master weights are the kernel's only 4-byte global loads (LDG.E; the tap windows
    and dy are LDG.E.128): all of them come before the loop, none inside. The per-tile reload that was
    shipped before (20 LDG.E inside the loop at 1024 channels) is the planted bug. The fp32 (3xTF32) form
    at G = 2 still reloads per tile (kept, its weights spilled)."""
    checked = 0
    for (kind, c, _, dtype, _), _, comp in compiled_sample:
        if kind != "backward" or "reduce" in comp.variant.name:
            continue
        insns, loops = comp.listing()
        assert len(loops) == 1, comp.variant.meta  # the share's tile loop
        w_loads = [i for i, ins in enumerate(insns) if ins.opcode == "LDG.E"]
        inside = [i for i in w_loads if loops[0].start <= i <= loops[0].end]
        before = [i for i in w_loads if i < loops[0].start]
        if dtype == torch.float32:
            assert inside, "fp32: per-tile weight loads expected"
            continue
        assert before and not inside, (c, dtype, len(before), len(inside))
        checked += 1
    assert checked == 2


@pytest.mark.compile
@pytest.mark.slow
def test_backward_reads_dy_windows_once(compiled_sample):
    """kernel.py ``backward_pair_step``: per tile the fused backward loads dy's five tap pairs once, for
    dgrad and wgrad alike, and x's tile once (never x's windows): 10 + 1 sixteen-byte vectors per
    (group, pixel) of the tile, each thread's share an LDG.E.128 of the tile loop. The form shipped before
    (x's five pairs loaded again for wgrad, dy's tile besides) took 21; loading a pair twice is the
    planted bug."""
    checked = 0
    for (kind, c, _, dtype, _), _, comp in compiled_sample:
        if kind != "backward" or "reduce" in comp.variant.name or dtype == torch.float32:
            continue
        insns, loops = comp.listing()
        assert len(loops) == 1, comp.variant.meta  # the share's tile loop
        vectors = [i for i, ins in enumerate(insns) if ins.opcode == "LDG.E.128"
                   and loops[0].start <= i <= loops[0].end]
        meta = comp.variant.meta
        per_thread = 11 * meta["G"] * meta["TH"] * meta["TW"] // (32 * comp.num_warps)
        assert len(vectors) == per_thread, (c, dtype, len(vectors), per_thread)
        checked += 1
    assert checked == 2


@pytest.mark.compile
def test_tap_pair_copies_conflict_free_order():
    """launcher.tap_order() (``conflict_free_tap_order()`` unless TAP_ORDER forces one): the forward, the
    fused stride-1 backward (fp32 master weights) and the stride-2 dgrad at Small's 1024-channel 16x16
    training map (fp16, sm_90) copy their tap pairs to shared memory and read them back without bank
    conflicts (every 16-byte store and ldmatrix.x4 of warp 0 at 32 lanes' bytes / 128), while order 0,
    compiled in the same run, takes at least 1.5x those wavefronts over the three (4.6x on Triton 3.8, 2.1x
    on 3.6). Order 0 failing the first check is the planted bug."""
    from convfirstnet.analysis.compiled import variant_of
    from convfirstnet.kernels._launch import conflict_free_tap_order

    from ._asm import compile_asm, tap_copy_wavefronts

    assert L.tap_order() == conflict_free_tap_order()  # what the model's training kernels compile with
    variants = [variant_of(lc, 90) for kind, s in (("forward", 1), ("backward", 1), ("dgrad", 2))
                for lc in _record(kind, 128, 1024, 16, 16, s)]
    variants = [v for v in variants if "reduce" not in v.name]
    assert [v.name for v in variants] == ["_gconv_fwd_kernel", "_gconv_backward_kernel",
                                          "_gconv_dgrad_s2_kernel"]

    def with_taps(v, taps):
        names = [n for n, _ in v.signature]
        return dataclasses.replace(v, constexprs=tuple((p, taps if names[p[0]] == "TAPS" else x)
                                                       for p, x in v.constexprs))

    free = compile_asm([with_taps(v, conflict_free_tap_order()) for v in variants])
    shipped_before = compile_asm([with_taps(v, 0) for v in variants])
    total0 = ideal0 = 0
    for v, a, a0 in zip(variants, free, shipped_before):
        wf, ideal = tap_copy_wavefronts(a["ptx"])
        assert ideal > 0 and wf == ideal, f"{v.name}: {wf} wavefronts, {ideal} conflict-free"
        wf0, i0 = tap_copy_wavefronts(a0["ptx"])
        assert i0 == ideal, (v.name, i0, ideal)
        total0, ideal0 = total0 + wf0, ideal0 + i0
    assert total0 >= 1.5 * ideal0, (total0, ideal0)


# ------------------------------------------------------------------------------------------------
# GPU only (skipped without CUDA): fp16 / bf16 / fp32 against the fp32 reference at the model's shapes
# ------------------------------------------------------------------------------------------------


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("model", list(L.MODEL_SHAPES))
def test_model_shapes_gpu(triton_backend, monkeypatch, model, dtype):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    for c, hw in L.MODEL_SHAPES[model]:
        for n, side, stride in ((128 if c <= 256 else 32, hw, 1), (8, hw + 1, 2)):
            check_all(*make_case(n, c, side, side, stride, dtype, "cuda"), stride)


@cuda
@pytest.mark.gpu
def test_wgrad_bitwise_deterministic_gpu(triton_backend):
    x, wt, dy = make_case(128, 64, 56, 56, 1, torch.float16, "cuda")
    a = OPS.gconv3x3_wgrad(dy, x, torch.float32, 1)
    b = OPS.gconv3x3_wgrad(dy, x, torch.float32, 1)
    assert torch.equal(a, b)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("c,side", [(1024, 16), (1024, 8), (384, 32)])
def test_forward_with_moments_gpu(triton_backend, c, side):
    """Compiled for the GPU, the MOMENTS variant of the forward stores the plain forward's y bit for bit
    (the MBConv backward recomputes u with the plain forward), and its moment rows match fp64 sums of y."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, c, side, side, generator=gen).half().cuda().contiguous(memory_format=CL)
    w = (torch.randn(c, 8, 3, 3, generator=gen) / 72**0.5).cuda()
    shift = (0.1 * torch.randn(c, generator=gen)).cuda()
    rows = L.moments_rows(16, c, side, side, torch.float16)
    y, parts = L.gconv3x3_moments_triton(x, w, shift)
    assert torch.equal(y, L.gconv3x3_triton(x, w, 1))
    assert_moment_rows(y, parts, shift, rows)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("c,side", [(1024, 16), (1024, 8), (384, 32)])
def test_forward_with_silu_pool_gpu(triton_backend, c, side):
    """Compiled for the GPU (SiLU in its inline-asm form, ~2e-6 relative error), the BIAS_SILU + POOL
    forward at the staged MBConv blocks' shapes against fp64: y within the fp16 rounding plus the conv's
    fp32 sums (ACC["cuda"]) and 1e-5 of the scale; the pools within 1e-5 of each tile's sum of |y|."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(16, c, side, side, generator=gen).half().contiguous(memory_format=CL)
    wt = (torch.randn(c, 8, 3, 3, generator=gen) / 72**0.5).half()
    bias = 0.5 * torch.randn(c, generator=gen)
    y, pools, tiles = L.gconv3x3_silu_triton(x.cuda(), wt.cuda(), bias.cuda(), 1, True)
    cfg = L.fwd_tile_config(c, side, side, torch.float16)
    ref, scale, want, want_abs, per_image = silu_pool_reference(x, wt, bias, cfg.tile_h, cfg.tile_w)
    assert tiles == per_image
    err = (y.cpu().double() - ref).abs()
    bound = U_OUT[torch.float16] * ref.abs() + (1.1 * 72 * ACC["cuda"] + 1e-5) * scale
    assert (err <= bound).all(), (err - bound).max().item()
    assert ((pools.cpu().double() - want).abs() <= 1e-5 * want_abs + 1e-6).all()


@cuda
@pytest.mark.gpu
def test_module_training_step_gpu(triton_backend):
    """Autocast fp16, channels-last, torch.compile(fullgraph=True): the same loss and gradients as the
    same net of nn.Conv2d (cuDNN)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(GroupConv3x3(64), nn.BatchNorm2d(64), nn.ReLU(), GroupConv3x3(64, 2)).cuda()
    ref = nn.Sequential(nn.Conv2d(64, 64, 3, 1, 1, groups=8, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                        nn.Conv2d(64, 64, 3, 2, 1, groups=8, bias=False)).cuda()
    ref.load_state_dict(net.state_dict())
    net, ref = (m.to(memory_format=torch.channels_last) for m in (net, ref))
    x = torch.randn(32, 64, 56, 56, device="cuda").contiguous(memory_format=torch.channels_last)
    compiled = torch.compile(net, fullgraph=True)
    with torch.autocast("cuda", torch.float16):
        loss = compiled(x).float().square().mean()
        loss_ref = ref(x).float().square().mean()
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, atol=1e-3, rtol=2e-3)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, atol=1e-3, rtol=1e-2)


@cuda
@pytest.mark.gpu
def test_module_auto_fallback_warns_once_gpu(monkeypatch):
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")
    gc = GroupConv3x3(16).cuda()
    x = torch.randn(2, 16, 8, 8, device="cuda")  # NCHW
    with pytest.warns(UserWarning, match="not channels-last"):
        y = gc(x)
    torch.testing.assert_close(y, F.conv2d(x, gc.weight, padding=1, groups=2))
