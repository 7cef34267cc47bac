"""The forward of mbconv_recompute_train through the fused MBConv kernels
(convfirstnet/mbconv_fused_forward.py, kernels/mbconv/moments.py), in the interpreter at the model's
widths on small maps: every loop of the kernels runs more than once (pixel steps and channel blocks of the
moments launch, exact and masked; BN_d's statistics' row steps; the narrow passes' splits; both strides).

* BN_d's moments launch against fp64 torch on a conv output u: the per-image sums of u - shift and of its
  square; then BN_d's statistics launch (factor 1): running mean and variance = the batch mean and
  unbiased variance, and the batch mean and rstd the kernels normalise by.
* The narrow passes (kernels/mbconv/narrow.py) against fp64 torch, with small steps (``small_tiles``) so
  that there are several pixel splits and merge steps: x's mean and centred Gram matrix (C = 256: two
  Gram blocks, the lower one read transposed; C = 96 padded), BN_p + drop-path + residual with the running
  statistics (and without the residual, as at stride 2).
* The whole forward (output and the six running statistics) against the layer-wise training forward
  (mbconv_recompute._layers, the same op with the kernels off); BN_e's statistics launch is checked
  through it and on its own.
* The launches fused Small's training forward adds, compiled for sm_90 (``compile``), and a GPU check.

Tolerances. fp32: both sides accumulate in fp32 and differ in summation order (over <= 81 pixels per
image, R <= 512 channels, the C x C Gram matrix against a pass over e, BN_d's sums per conv program or
per image against one reduction): ~1e-7 relative to each tensor's maximum; compared within 1e-5.
fp16: the kernels round h, u, g, the gate and the projection to fp16 (u = 2^-11 = 4.9e-4 each), so the
output carries a few u against the fp64 forward (observed 7e-4 of its maximum): 3e-3; the running
statistics come from fp32 sums of those values (observed <= 3e-5): 2e-4. Planted bugs checked to fail (each
fails 3 to 7 of these tests): the moments launch's pixel-step offset dropped (every step reads the first 32
pixels), the biased variance in the running update, a wrong divisor in the merge (N P - 1 for N P), the last
tile of images skipped in the merge's second pass, the Gram step offset dropped in BN_e's statistics; each
changes a compared tensor by >= 5e-4 of its maximum. The narrow passes' own tolerances are stated at their
tests; planted there (each fails 5 to 7 of the narrow and forward tests): the last split skipped in the Gram
merge or in BN_p's merge, the biased variance in BN_p's running update, the drop-path scale dropped, M - 1 for
M in BN_p's variance or x's mean, the split's rank-1 correction dropped from its Gram block. """

from __future__ import annotations

import pytest
import torch

from convfirstnet import mbconv_fused_forward
from convfirstnet.blocks import MBConv

from .._models import randomize_bn

CL = torch.channels_last
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 2e-4)}  # (output, running statistics)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ moments

# (N, R, H, W, dtype): the conv output u of Small's and Nano's MBConv widths (R = 4C: 4 and 5 channel
# blocks of 128), 8x8 (two pixel steps of 32) and 9x9 (three, the last masked)
MOMENT_SHAPES = [(3, 512, 8, 8, torch.float32), (3, 640, 9, 9, torch.float16), (2, 512, 9, 9, torch.float16)]


@pytest.fixture
def small_fold_steps(monkeypatch):
    """BN_d's statistics' row loop in steps of 2 rows (of 128), and the stride-1 BN_d pass in steps of 512
    elements (8 or 16 pixels, of 64 or 81), so that they run more than once here."""
    from convfirstnet.kernels.mbconv import moments

    monkeypatch.setattr(moments, "STATS_IMAGES", 2)
    monkeypatch.setattr(moments, "BNS_ELEMS", 512)


@pytest.mark.parametrize("shape", MOMENT_SHAPES, ids=lambda s: f"n{s[0]}-r{s[1]}-{s[2]}x{s[3]}-"
                         f"{str(s[4])[6:]}")
def test_moments_and_statistics_of_the_conv_output(interpreter_backend, small_fold_steps, shape):
    """The moment rows of the conv output u (per image: sums of u - shift and of its square, fp32), then
    BN_d's statistics launch with factor 1: the batch mean and rstd = 1 / sqrt(var + eps), and the running
    mean and variance then the batch mean and unbiased variance. u has a channel mean of ~3 against a spread
    of 1, as BN_d's input can: the shift (the running mean) keeps the sums of squares from cancelling."""
    from convfirstnet.kernels.mbconv.moments import bn_d_stats, conv_moments

    n, r, h, w, dt = shape
    gen = torch.Generator().manual_seed(0)
    mean = 3 + torch.randn(r, generator=gen)
    u = (torch.randn(n, h * w, r, generator=gen) * (0.5 + torch.rand(r, generator=gen)) + mean).to(dt)
    shift = mean + 0.2 * torch.randn(r, generator=gen)
    parts = conv_moments(u, shift)
    assert parts.shape == (n, 2, r) and parts.dtype == torch.float32
    us = u.double() - shift.double()
    # fp32 sums of <= 81 values per lane and image: ~1e-7 relative
    assert _rel(parts[:, 0].double(), us.sum(1)) <= 1e-5
    assert _rel(parts[:, 1].double(), us.square().sum(1)) <= 1e-5
    rm, rv = shift.clone(), torch.ones(r)
    st = bn_d_stats(parts, rm, rv, 1.0, 1e-5, h * w)
    var_ref, mean_ref = torch.var_mean(u.double(), (0, 1), unbiased=False)
    count = n * h * w
    assert _rel(rm, mean_ref) <= 1e-5 and _rel(rv, var_ref * count / (count - 1)) <= 1e-5
    assert st.shape == (2, r) and st.dtype == torch.float32
    assert _rel(st[0], mean_ref) <= 1e-5 and _rel(st[1], (var_ref + 1e-5).rsqrt()) <= 1e-5


def test_conv_moments_refuses_a_strided_u():
    from convfirstnet.kernels.mbconv.moments import conv_moments

    u = torch.zeros(2, 16, 64)
    with pytest.raises(ValueError, match="contiguous"):
        conv_moments(u.transpose(1, 2).contiguous().transpose(1, 2), torch.zeros(64))
    with pytest.raises(ValueError, match="shift"):
        conv_moments(u, torch.zeros(32))


@pytest.mark.parametrize("dt", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_bn_e_stats(interpreter_backend, dt):
    """BN_e's statistics from x's mean and centred Gram matrix against fp64 (factor 1: the running mean and
    variance become the batch mean and unbiased variance of z = W x), the batch mean and rstd, and W G.
    C = 128: the Gram steps run 4 times; R = 40: the last program of 16 rows masked. fp16 takes the split
    product W G_hi + W G_lo (TF32 on a GPU, exact fp32 here): the statistics within 1e-5 (observed 1.5e-7;
    G_hi alone, G with its low 13 bits cleared, misses by 4e-4); fp32 the ieee dot."""
    from convfirstnet.kernels.mbconv.moments import bn_e_stats

    c, r, m = 128, 40, 300
    gen = torch.Generator().manual_seed(3)
    x = 0.7 * torch.randn(m, c, generator=gen, dtype=torch.float64) + 2.0
    x = x + 0.3 * x[:, :1]  # correlated channels
    w = (torch.randn(r, c, generator=gen) / c**0.5).to(dt)
    mean_x = x.mean(0)
    gram = (x - mean_x).t() @ (x - mean_x)
    rm, rv = torch.zeros(r), torch.ones(r)
    wg = torch.empty(r, c)
    st = bn_e_stats(w, mean_x.float(), mean_x.float(), gram.float(), rm, rv, 1.0, 1e-5, m, wg=wg)
    z = x @ w.double().t()
    var_ref, mean_ref = torch.var_mean(z, 0, unbiased=False)
    assert _rel(rm, mean_ref) <= 1e-5 and _rel(rv, var_ref * m / (m - 1)) <= 1e-5
    assert _rel(st[0], mean_ref) <= 1e-5 and _rel(st[1], (var_ref + 1e-5).rsqrt()) <= 1e-5
    assert _rel(wg, w.double() @ gram) <= 1e-5


# ------------------------------------------------------------------------------------------------ narrow


@pytest.fixture
def small_tiles(monkeypatch):
    """The narrow passes' steps at 16 pixels (of 64) and the merges' at 2 splits (of 32, 64 and 128), so
    that on these maps there are several pixel splits of 2 tiles (the last one short and masked) and every
    loop runs more than once."""
    from convfirstnet.kernels.mbconv import narrow

    for name in ("GRAM_PIXELS", "STAT_PIXELS", "APPLY_PIXELS"):
        monkeypatch.setattr(narrow, name, 16)
    for name in ("MERGE_SPLITS", "STAT_SPLITS", "BN_MERGE_SPLITS"):
        monkeypatch.setattr(narrow, name, 2)


# (N, C, H, W, dtype): C = 256 two Gram blocks of 128 (three computed, the lower one read transposed in the
# merge) over 8 splits (243 pixels, the last split 19); C = 96 one block padded to 128; fp16 with a mean of
# 3 against a spread of 0.5 (the shift keeps mean^2 out of the Gram sums); the C = 96 case's x in NCHW
NARROW_SHAPES = [(3, 256, 9, 9, torch.float32), (2, 96, 9, 9, torch.float32), (3, 256, 8, 8, torch.float16)]


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1]).double()


def _narrow_id(s: tuple) -> str:
    return f"n{s[0]}-c{s[1]}-{s[2]}x{s[3]}-{str(s[4])[6:]}"


@pytest.mark.parametrize("shape", NARROW_SHAPES, ids=_narrow_id)
def test_x_moments(interpreter_backend, small_tiles, shape):
    """x's mean and centred Gram matrix (narrow.x_moments) against fp64 torch. fp32: ieee dot, only the
    summation order differs (observed <= 2e-7 of the maximum): 1e-5. fp16: x - shift is rounded to fp16
    for the tensor-core product (unit roundoff u = 2^-11, where x is far below the shift), so each
    product carries up to 2u (observed 6e-5 of the maximum): 1e-3; the mean from fp32 sums: 1e-5."""
    from convfirstnet.kernels.mbconv.narrow import x_moments

    n, c, h, w, dt = shape
    gen = torch.Generator().manual_seed(2)
    x = (0.5 * torch.randn(n, c, h, w, generator=gen) + 3.0).to(dt)
    x = x.contiguous(memory_format=CL) if c != 96 else x
    mean, gram = x_moments(x)
    xm = _nhwc(x)
    xc = xm - xm.mean(0)
    assert mean.dtype == gram.dtype == torch.float32
    assert _rel(mean, xm.mean(0)) <= 1e-5, _rel(mean, xm.mean(0))
    tol = 1e-5 if dt == torch.float32 else 1e-3
    assert _rel(gram, xc.t() @ xc) <= tol, _rel(gram, xc.t() @ xc)


@pytest.mark.parametrize("shape", NARROW_SHAPES + [(2, 192, 5, 5, torch.float32)], ids=_narrow_id)
def test_bn_residual(interpreter_backend, small_tiles, shape):
    """BN_p (training mode) + drop-path + residual (narrow.bn_residual; the last shape without residual, as
    at stride 2) against fp64 torch: the output and the running statistics (factor 0.3, unbiased
    variance). fp32: summation order only (observed ~1e-7): 1e-5; fp16: the output rounded to fp16 once
    (2^-11 of the largest value): 1e-3, the running statistics (fp32 sums of fp16 data): 1e-5."""
    from convfirstnet.kernels.mbconv.narrow import bn_residual

    n, k, h, w, dt = shape
    residual = k != 192
    gen = torch.Generator().manual_seed(3)
    o = (torch.randn(n, k, h, w, generator=gen) + 2.0).to(dt).contiguous(memory_format=CL)
    x = torch.randn(n, k, h, w, generator=gen).to(dt)
    x = x.contiguous(memory_format=CL) if k != 96 else x  # NCHW x read through its strides
    gamma, beta = torch.rand(k, generator=gen) + 0.5, 0.3 * torch.randn(k, generator=gen)
    rm, rv = 0.2 * torch.randn(k, generator=gen), torch.rand(k, generator=gen) + 0.5
    drop = torch.tensor([0.0, 1.25, 1.25])[:n]
    var, mean = torch.var_mean(o.double(), (0, 2, 3), unbiased=False)
    want = (o.double() - mean[:, None, None]) * (gamma.double() / (var + 1e-5).sqrt())[:, None, None] \
        + beta.double()[:, None, None]
    if residual:
        want = x.double() + drop.double()[:, None, None, None] * want
    count = n * h * w
    want_rm, want_rv = 0.7 * rm.double() + 0.3 * mean, 0.7 * rv.double() + 0.3 * var * count / (count - 1)
    got = bn_residual(o, x if residual else None, drop, gamma, beta, rm, rv, 0.3, 1e-5)
    assert got.data_ptr() == o.data_ptr() and got.dtype == dt
    assert _rel(got, want) <= (1e-5 if dt == torch.float32 else 1e-3), _rel(got, want)
    assert _rel(rm, want_rm) <= 1e-5 and _rel(rv, want_rv) <= 1e-5, (_rel(rm, want_rm), _rel(rv, want_rv))


# ------------------------------------------------------------------------------------------------ forward


def _block(c: int, k: int, stride: int) -> MBConv:
    torch.manual_seed(0)
    block = MBConv(c, k, stride).train()
    return randomize_bn(block, 0)


def _op_args(block: MBConv, x: torch.Tensor, drop: torch.Tensor, dtype: torch.dtype) -> tuple:
    """mbconv_recompute_train's arguments: momenta 0.1, None (factor 1 / 3: three batches counted), 0.3."""
    bns = (block.bn_expand, block.bn_dw, block.bn_project)
    se = block.se
    cast = (lambda t: t.double()) if dtype == torch.float64 else (lambda t: t)
    return (x, *(cast(t) for t in (block.conv_expand.weight, bns[0].weight, bns[0].bias, block.conv_dw.weight,
                                   bns[1].weight, bns[1].bias, se.fc1.weight, se.fc1.bias, se.fc2.weight,
                                   se.fc2.bias, block.conv_project.weight, bns[2].weight, bns[2].bias)),
            *(cast(t.detach().clone()) for bn in bns for t in (bn.running_mean, bn.running_var)), cast(drop),
            block.stride, [0.1, -1.0, 0.3], 1e-5, [torch.tensor(3)] * 3)


# (N, C, K, H, W, stride, dtype): stride 1 with drop-path (one image dropped, two kept and scaled) and the
# RESIDENT fp16 path; stride 2 on an odd map (masked tiles, BlurPool's reflection) and fp16 on an even one
FORWARD_SHAPES = [(3, 128, 128, 8, 8, 1, torch.float32), (2, 96, 192, 9, 9, 2, torch.float32),
                  (3, 128, 128, 8, 8, 1, torch.float16), (3, 32, 64, 8, 8, 2, torch.float16)]


@pytest.mark.parametrize("shape", FORWARD_SHAPES,
                         ids=lambda s: f"n{s[0]}-c{s[1]}-k{s[2]}-{s[3]}x{s[4]}-s{s[5]}-{str(s[6])[6:]}")
def test_forward_matches_the_layerwise_training_forward(interpreter_backend, small_fold_steps, small_tiles,
                                                        monkeypatch, shape):
    n, c, k, h, w, stride, dt = shape
    block = _block(c, k, stride)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(n, c, h, w, generator=gen) + 0.5).to(dt).contiguous(memory_format=CL)
    drop = torch.tensor([0.0, 1.25, 1.25])[:n] if stride == 1 else torch.ones(n)
    calls = []
    real = mbconv_fused_forward.forward
    monkeypatch.setattr(mbconv_fused_forward, "forward", lambda *a: calls.append(1) or real(*a))
    got = torch.ops.convfirstnet.mbconv_recompute_train(*_op_args(block, x, drop, dt))
    assert calls == [1]  # the fused kernels ran the forward
    # the layer-wise training forward: fp32 as the kernels' input, fp64 for the 16-bit case
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "reference")
    ref_dt = torch.float64 if dt == torch.float16 else dt
    want = torch.ops.convfirstnet.mbconv_recompute_train(*_op_args(block, x.to(ref_dt), drop, ref_dt))
    assert calls == [1] and got[0].dtype == dt and got[0].shape == want[0].shape
    tol_out, tol_run = TOL[dt]
    assert _rel(got[0], want[0]) <= tol_out, f"output: {_rel(got[0], want[0]):.3g}"
    names = ("mean_e", "var_e", "mean_d", "var_d", "mean_p", "var_p")
    for name, g, r in zip(names, got[1:], want[1:]):
        assert _rel(g, r) <= tol_run, f"running {name}: {_rel(g, r):.3g}"


def test_selection(triton_backend, monkeypatch):
    """The fused forward only where the kernels run, in their dtypes and limits, with more than one value
    per channel; the layer-wise forward otherwise."""
    block = _block(32, 32, 1)
    w_exp, w_proj = block.conv_expand.weight, block.conv_project.weight

    def picks(x, stride=1, w_proj=w_proj):
        return mbconv_fused_forward.selected(x.contiguous(memory_format=CL), w_exp, w_proj, stride)

    x = torch.randn(2, 32, 4, 4)
    if torch.cuda.is_available():
        pytest.skip("the interpreter's selection (CPU tensors)")
    assert picks(x) and picks(x.half())
    assert not picks(x.bfloat16())  # the interpreter's bf16 dot is wrong (launcher.check_supported)
    assert not picks(x[:1, :, :1, :1])  # one value per channel
    assert not picks(x, 1, torch.randn(64, 128, 1, 1))  # stride 1 must be C -> C
    wide = torch.randn(1, 320, 2, 2)
    assert not mbconv_fused_forward.selected(wide, torch.randn(1280, 320, 1, 1), torch.randn(320, 1280, 1, 1),
                                             1)  # C past the kernels' 256
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")  # auto: CPU tensors take the layers
    assert not picks(x)


# ------------------------------------------------------------------------------------------------ sm_90

# fused Small's MBConv shapes at 256x256 (C, K, stride, map): stage 4's first block, stage 4, stage 5's
# first block, stage 5
SMALL_SHAPES = [(96, 256, 2, 32), (256, 256, 1, 16), (256, 256, 2, 16), (256, 256, 1, 8)]


def record_forward(c: int, k: int, stride: int, side: int, n: int = 128, dtype=torch.float16) -> list:
    """The launches of the fused training forward of one block on meta tensors (the cost recording)."""
    from convfirstnet.kernels._cost import recording

    block = _block(c, k, stride).to("meta")
    x = torch.empty(n, c, side, side, device="meta", dtype=dtype).contiguous(memory_format=CL)
    args = _op_args(block, x, torch.ones(n, device="meta"), dtype)
    with recording() as rec:
        assert mbconv_fused_forward.selected(x, args[1], args[11], stride)
        mbconv_fused_forward.forward(*args[:14], tuple(args[14:20]), args[20], stride, (0.1,) * 3, 1e-5)
    return rec.launches


FORWARD_LAUNCHES = ("_gram_partials_kernel", "_gram_merge_kernel", "_bn_e_stats_kernel", "_expand_kernel",
                    "_gconv_fwd_kernel", "_bn_d_stats_kernel", "_bn_silu_pool_kernel", "_se_gates_kernel",
                    "_mbconv_project_kernel", "_channel_partials_kernel", "_bn_merge_kernel",
                    "_bn_apply_kernel")


@pytest.mark.compile
def test_small_training_forward_compiles_for_sm90():
    """The launches of fused Small's MBConv training forward (x's Gram partials and merge, BN_e's statistics,
    h by the expand kernel, u and BN_d's moments by the group-width-8 conv, BN_d's statistics, the BN_d pass
    (stride 2: with the blur) and the SE gates, the projection without residual, BN_p's statistics, merge and
    apply) compile for sm_90 within shared memory, with no spill code in their inner loops, the expand and
    projection dots on wgmma and the grouped conv on mma.sync, the Gram product on wgmma (its pixel sums,
    one-hot dots of
    M = 16, partly on mma.sync), BN_e's split-TF32 W G on mma.sync, and no stack anywhere.
    (Compiled, Triton 3.8: the expand 101-128 registers, the conv with the moments 126-254, the BN_d pass
    64-128, the SE gates 72-209, the Gram partials 175-177 at 8 warps, BN_e's statistics 80-116 at 8.)"""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    from .test_mbconv import SHARED_LIMIT

    variants = {}
    for shape in SMALL_SHAPES:
        launches = record_forward(*shape)
        assert tuple(lc.kernel.fn.__name__ for lc in launches) == FORWARD_LAUNCHES
        assert launches[4].args[2].shape[1] == 4 * shape[0]  # the conv (its output y) at the hidden width
        assert launches[4].meta["MOMENTS"] is True  # Small's maps: tiles cover them exactly
        assert launches[6].meta["STRIDE"] == shape[2]
        assert launches[8].meta["RESIDUAL"] is False and launches[11].meta["RESIDUAL"] is (shape[2] == 1)
        for lc in launches:
            v = variant_of(lc, 90)
            variants.setdefault(v.key, v)
    problems = []
    expected = {"_expand_kernel": "wgmma", "_gconv_fwd_kernel": "mma.sync", "_mbconv_project_kernel": "wgmma",
                "_gram_partials_kernel": "wgmma+mma.sync", "_bn_e_stats_kernel": "mma.sync"}
    for v, c in zip(variants.values(), compile_variants(list(variants.values()))):
        if c.stack or c.shared > SHARED_LIMIT[90] or c.mma_kind != expected.get(v.name, c.mma_kind):
            problems.append(f"{v.name}: {c.stack} B of stack, {c.shared} B shared, {c.mma_kind}")
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("c,k,stride,side", SMALL_SHAPES)
def test_small_forward_on_gpu(monkeypatch, dtype, c, k, stride, side):
    """Fused Small's MBConv shapes, batch 16, through the compiled kernels: the output and the running
    statistics against the layer-wise training forward in fp32 on the same 16-bit input, within a few
    units of the dtype's rounding (norm errors; fp16 2^-11, bf16 2^-8)."""
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")
    block = _block(c, k, stride).cuda()
    x = (torch.randn(16, c, side, side, device="cuda") + 0.5).to(dtype).contiguous(memory_format=CL)
    drop = torch.ones(16, device="cuda")
    calls = []
    real = mbconv_fused_forward.forward
    monkeypatch.setattr(mbconv_fused_forward, "forward", lambda *a: calls.append(1) or real(*a))
    got = torch.ops.convfirstnet.mbconv_recompute_train(*_op_args(block, x, drop, dtype))
    assert calls == [1]
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "reference")
    want = torch.ops.convfirstnet.mbconv_recompute_train(*_op_args(block, x.float(), drop, torch.float32))
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    for i, (g, r) in enumerate(zip(got, want)):
        err = ((g.double() - r.double()).norm() / r.double().norm()).item()
        assert err <= tol, f"output {i}: {err:.3g}"
