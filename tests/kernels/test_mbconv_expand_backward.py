"""The expand passes of the fused MBConv training backward (kernels/mbconv/expand_backward.py) against their
PyTorch specification (kernels/mbconv/backward_reference.py) computed in fp64 from the same inputs, and the
chain of both passes against autograd of the layers, in the interpreter at the model's widths on small maps,
with small steps (``small_tiles``) so that every loop runs more than once: pixel splits of two 16-pixel tiles
(the last split and tile short), the merge's loop over the splits, the dx pass's hidden loop in
32-channel steps over 16-pixel tiles, hidden chunks of 256 channels (R = 1024: 4 chunks; R = 640: 3, the
last one half masked); C = 160 pads the channel tile to 256.

Tolerances, relative to each tensor's largest value. fp32: both sides accumulate in fp32 against fp64
and differ only in summation order (over <= 192 pixels, C = 256 products per dot) and, for dW_exp and
dgamma, in the Gram identity's differences (observed <= 2.4e-7): 1e-5. fp16: the inputs are fp16 values on
both sides, the products exact in the fp32 accumulators; dv is rounded to fp16 for D and sum dv (the
tensor cores' operand), one rounding of u = 2^-11 = 4.9e-4 per term, averaging over the pixels in the
sums (dW_exp, dgamma, dbeta, u and w observed <= 2.7e-4); the outputs written in fp16 (h, dx) carry one
rounding, dx also de's through K = R products (observed <= 4.1e-4): 1e-3.

Planted bugs checked to fail: the pixel-tile offset dropped in the expand kernel (every tile reads the
split's first: fails all expand tests), the hidden-step offset dropped in the dx pass (the dx and chain
tests), sum dv keeping only the last tile, the merge skipping the last split, dgamma without its mu_e sum
dv term (each: the weights and chain tests), dW_exp's P (W_exp mean(x) - mu_e) mean(x)^T term dropped (the
weights tests), the bias beta dropped (h, weights, dx).
"""

from __future__ import annotations

import pytest
import torch
from convfirstnet.kernels.mbconv import backward_reference as ref

F32, F16 = torch.float32, torch.float16


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def small_tiles(monkeypatch):
    """Steps small enough that every loop runs more than once on these maps (module docstring)."""
    from convfirstnet.kernels.mbconv import expand_backward as eb

    monkeypatch.setattr(eb, "TILES", {key: (256, 16, 8, 1) for key in eb.TILES})
    monkeypatch.setattr(eb, "DX_TILES", {key: (16, 32, 4) for key in eb.DX_TILES})
    monkeypatch.setattr(eb, "FINALIZE", (16, 4))


# (N, C, H, W, dtype, gamma/beta dtype): Small's widths in fp16 (BN_e's gamma, beta in fp16, as the layer's
# own weights) and fp32, an odd width (C = 160, R = 640) on a 5x5 map (P = 75: ragged tiles and splits)
SHAPES = [(3, 256, 8, 8, F16, F16), (3, 256, 8, 8, F32, F32), (3, 160, 5, 5, F16, F32)]


def _id(s: tuple) -> str:
    return f"n{s[0]}-c{s[1]}-{s[2]}x{s[3]}-{str(s[4])[6:]}"


def _inputs(shape: tuple, seed: int = 0) -> dict:
    """x, W_exp, BN_e's batch statistics of z = x W^T (mean shifted, so e_hat is not centred), gamma, beta,
    dh."""
    n, c, h, w, dt, gdt = shape
    r, p = 4 * c, n * h * w
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(p, c, generator=gen) + 0.5).to(dt)
    w_exp = (torch.randn(r, c, generator=gen) / c**0.5).to(dt)
    z = x.double() @ w_exp.double().t()
    mean = (z.mean(0) + 0.2 * torch.randn(r, generator=gen, dtype=torch.float64)).float()
    rstd = (1 / (z.var(0) + 1e-5).sqrt()).float()
    gamma = (torch.rand(r, generator=gen) + 0.5).to(gdt)
    beta = (0.5 * torch.randn(r, generator=gen)).to(gdt)
    dh = torch.randn(p, r, generator=gen).to(dt)
    return {"x": x, "w_exp": w_exp, "mean_e": mean, "rstd_e": rstd, "gamma_e": gamma, "beta_e": beta,
            "dh": dh}


def _f64(d: dict) -> dict:
    return {k: v.double() for k, v in d.items()}


def _tol(dt: torch.dtype) -> float:
    return 1e-5 if dt == F32 else 1e-3


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_expand_hidden(interpreter_backend, small_tiles, shape):
    from convfirstnet.kernels.mbconv.expand_backward import expand_hidden

    a = _inputs(shape)
    a.pop("dh")
    h = expand_hidden(**a)
    want = ref.expand_hidden_reference(**_f64(a))
    assert h.dtype == shape[4] and h.shape == want.shape
    assert _rel(h, want) <= _tol(shape[4]), _rel(h, want)


def _moments(x: torch.Tensor, w_exp: torch.Tensor) -> dict:
    """x's mean and W_exp G, G x's centred Gram matrix (the forward's x_moments and bn_e_stats), fp32 from
    fp64."""
    mean, wg = ref.x_moments_reference(x.double(), w_exp)
    return {"mean_x": mean.float(), "wg_x": wg.float()}


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_bn_e_weights(interpreter_backend, small_tiles, shape):
    """dW_exp, dgamma_e, dbeta_e and the dx pass's (u, w), formed from D = dv^T x, sum dv and x's moments,
    against the exact form (de^T x from the unrounded de)."""
    from convfirstnet.kernels.mbconv.expand_backward import bn_e_weights

    a = _inputs(shape, 1)
    got = bn_e_weights(**a, **_moments(a["x"], a["w_exp"]))
    want = ref.bn_e_weights_reference(**_f64(a))
    for name, g, w in zip(("dW_exp", "dgamma", "dbeta", "uw"), got, want):
        assert g.dtype == F32 and g.shape == w.shape and g.is_contiguous(), name
        assert _rel(g, w) <= _tol(shape[4]), (name, _rel(g, w))
    ptrs = {t.untyped_storage().data_ptr() for t in got[:3]}
    assert len(ptrs) == 3  # the op's outputs: tensors of their own


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "none"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_bn_e_dx(interpreter_backend, small_tiles, shape, residual):
    """dx given the reference's (u, w): de recomputed per tile and rounded as the reference rounds it."""
    from convfirstnet.kernels.mbconv.expand_backward import bn_e_dx

    a = _inputs(shape, 3)
    uw = ref.bn_e_weights_reference(**_f64(a))[3]
    res = torch.randn(a["x"].shape, generator=torch.Generator().manual_seed(7)).to(shape[4])
    res = res if residual else None
    dx = bn_e_dx(**a, uw=uw.float(), residual=res)
    want = ref.bn_e_dx_reference(**_f64(a), uw=uw, residual=None if res is None else res.double())
    assert dx.dtype == shape[4] and dx.shape == want.shape
    assert _rel(dx, want) <= _tol(shape[4]), _rel(dx, want)


@pytest.mark.parametrize("shape", SHAPES[::2], ids=_id)
def test_bn_e_chain(interpreter_backend, small_tiles, shape):
    """The two passes as mbconv_fused_backward chains them (the weights pass's (u, w) into the dx pass, with
    the residual) against the layer-wise backward of BN_e and the expand: autograd through z = x W^T,
    BatchNorm with the given statistics and SiLU, in fp64. fp16: dx carries de's rounding through K = R
    products and one rounding of its own (observed <= 4e-4): 1e-3."""
    from convfirstnet.kernels.mbconv import expand_backward as eb

    a = _inputs(shape, 4)
    res = torch.randn(a["x"].shape, generator=torch.Generator().manual_seed(5)).to(shape[4])
    f = _f64(a)
    x, w, g, b = (f[k].clone().requires_grad_() for k in ("x", "w_exp", "gamma_e", "beta_e"))
    z = x @ w.t()
    mean, var = z.mean(0), z.var(0, unbiased=False)  # the batch's statistics, as BatchNorm in training
    v = g * (z - mean) / (var + 1e-5).sqrt() + b
    want = torch.autograd.grad(torch.nn.functional.silu(v), (x, w, g, b), f["dh"])
    a = dict(a, mean_e=mean.detach().float(), rstd_e=(1 / (var.detach() + 1e-5).sqrt()).float())
    dw, dgamma, dbeta, uw = eb.bn_e_weights(**a, **_moments(a["x"], a["w_exp"]))
    dx = eb.bn_e_dx(**a, uw=uw, residual=res)
    for got, w_ in ((dx, want[0] + res.double()), (dw, want[1]), (dgamma, want[2]), (dbeta, want[3])):
        assert _rel(got, w_) <= _tol(shape[4]), _rel(got, w_)


def test_bad_input_raises_before_launch(interpreter_backend):
    """Shapes, dtypes and layouts are checked first, with the argument named."""
    from convfirstnet.kernels.mbconv import expand_backward as eb

    a = _inputs((1, 32, 4, 4, F32, F32))
    dh = a.pop("dh")
    mom = _moments(a["x"], a["w_exp"])
    mean_x, wg_x = mom["mean_x"], mom["wg_x"]
    uw = torch.zeros(2, a["w_exp"].shape[0])
    cases = [
        (eb.expand_hidden, dict(a, x=a["x"].t().contiguous().t()), "x must be contiguous"),
        (eb.expand_hidden, dict(a, w_exp=a["w_exp"].half()), "w_exp has dtype"),
        (eb.expand_hidden, dict(a, mean_e=a["mean_e"][:-1]), "mean_e has shape"),
        (eb.expand_hidden, dict(a, rstd_e=a["rstd_e"].double()), "rstd_e has dtype"),
        (eb.expand_hidden, dict(a, x=a["x"][None]), "x must be a 2-D"),
        (eb.bn_e_weights, dict(a, dh=dh[:, :-1], mean_x=mean_x, wg_x=wg_x), "dh has shape"),
        (eb.bn_e_weights, dict(a, dh=dh, mean_x=mean_x.half(), wg_x=wg_x), "mean_x has dtype"),
        (eb.bn_e_weights, dict(a, dh=dh, mean_x=mean_x, wg_x=wg_x[:, :-1]), "wg_x has shape"),
        (eb.bn_e_dx, dict(a, dh=dh, uw=uw, residual=a["x"][:, :-1]), "residual has shape"),
        (eb.bn_e_dx, dict(a, dh=dh, uw=uw.t(), residual=None), "uw has shape"),
        (eb.bn_e_dx, dict(a, dh=dh, uw=uw.half(), residual=None), "uw has dtype"),
        (eb.bn_e_dx, {"x": torch.zeros(16, 320), "w_exp": torch.zeros(8, 320), "dh": torch.zeros(16, 8),
                      "uw": torch.zeros(2, 8), "residual": None,
                      **{k: torch.ones(8) for k in ("mean_e", "rstd_e", "gamma_e", "beta_e")}},
         "at most 256"),
    ]
    for fn, kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn(**kwargs)


# ------------------------------------------------------------------------------------------------ sm_90


def record_expand_backward(side: int, n: int = 128, dtype=torch.float16) -> list:
    """The launches of the three passes at Small's stage-4/5 widths (C = 256, R = 1024) on meta tensors."""
    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels.mbconv import expand_backward as eb

    p, c, r = n * side * side, 256, 1024

    def t(*shape, dt=dtype):
        return torch.empty(*shape, device="meta", dtype=dt)

    x, w, dh = t(p, c), t(r, c), t(p, r)
    stats = [t(r, dt=F32) for _ in range(4)]
    with recording(sms=132, l2_bytes=50 * 2**20) as rec:
        eb.expand_hidden(x, w, *stats)
        uw = eb.bn_e_weights(x, w, *stats, dh, t(c, dt=F32), t(r, c, dt=F32))[3]
        eb.bn_e_dx(x, w, *stats, dh, uw, x)
    return rec.launches


@pytest.mark.compile
def test_small_expand_backward_compiles_for_sm90():
    """The launches at batch 128, 16x16 and 8x8 (hidden; weights pass, merge, finalize; dx) compile for sm_90
    within shared memory, no spill code in their loops, the pixel passes' dots on wgmma, enough programs for
    the 132 SMs (the merge: 64 of 16 hidden rows); the fp32 variants within shared memory. (Compiled with
    Triton 3.8, fp16: h 128 registers and 136 KiB of shared memory (3 stages, one program per SM); the
    weights pass 203 registers (3 stages, one program per SM), the merge 135, dx 253 (two programs per SM),
    all without stack.) The weights pass takes more than 200 registers: EXPAND_MAXNREG, without which ptxas
    gave it 171 and the z dot's loads waited in sequence (dropping the limit is the planted bug)."""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    from .test_mbconv import SHARED_LIMIT, _spills_in_loops

    variants = {}
    for side in (16, 8):
        launches = record_expand_backward(side)
        names = [lc.kernel.fn.__name__ if hasattr(lc.kernel, "fn") else lc.kernel.__name__ for lc in launches]
        assert names == ["_expand_kernel", "_expand_kernel", "_bn_e_finalize_kernel", "_expand_dx_kernel"]
        for lc, name in zip(launches, names):
            programs = 1
            for g in lc.grid:
                programs *= g
            assert programs >= (64 if name == "_bn_e_finalize_kernel" else 128), (name, lc.grid)
            v = variant_of(lc, 90)
            variants.setdefault(v.key, v)
    fp32 = {}  # fp32 (3xTF32, tiles that spill: module docstring) must still fit the shared memory
    for lc in record_expand_backward(16, dtype=F32):
        v = variant_of(lc, 90)
        fp32.setdefault(v.key, v)
    problems = []
    for v, c in zip(fp32.values(), compile_variants(list(fp32.values()))):
        if c.shared > SHARED_LIMIT[90]:
            problems.append(f"fp32 {v.name} {v.meta}: {c.shared} B shared")
    want = {"_bn_e_finalize_kernel": "none"}
    for v, c in zip(variants.values(), compile_variants(list(variants.values()))):
        where = f"{v.name} {v.meta}"
        if c.shared > SHARED_LIMIT[90] or _spills_in_loops(c) or c.mma_kind != want.get(v.name, "wgmma"):
            problems.append(f"{where}: {c.shared} B shared, {_spills_in_loops(c)} spills in loops, "
                            f"{c.mma_kind}")
        if v.name == "_expand_kernel" and v.meta["MODE"] == 1 and c.regs <= 200:
            problems.append(f"{where}: {c.regs} registers, the register limit not applied")
    assert not problems, "\n".join(problems)
