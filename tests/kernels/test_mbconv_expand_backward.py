"""The expand passes of the fused MBConv training backward (kernels/mbconv/expand_backward.py) against their
PyTorch specification (kernels/mbconv/backward_reference.py) computed in fp64 from the same inputs, in the
interpreter at the model's widths on small maps, with small steps (``small_tiles``) so that every loop runs
more than once: pixel splits of two 16-pixel tiles (the last split and tile short), the split merge in
steps of 2 splits, expand_dgrad's K loop in 32-channel steps, hidden chunks of 256 channels (R = 1024:
4 chunks; R = 640: 3, the last one half masked); C = 160 pads the channel tile to 256.

Tolerances, relative to each tensor's largest value. fp32: both sides accumulate in fp32 against fp64
and differ only in summation order (over <= 192 pixels, C = 256 products per dot): observed <= 5e-7,
compared within 1e-5. fp16: the inputs are fp16 values on both sides, the products exact in the fp32
accumulators, so the fp32 outputs (BN_e's sums, dW_exp from the kernel's own de) keep 1e-5; the
outputs written in fp16 (h, de, dx) carry one rounding, u = 2^-11 = 4.9e-4 of their value (observed
<= 4e-4): 1e-3. dW_exp against the reference's own de adds the elements where the two de round to
neighbouring fp16 values (observed 2.6e-4): 1e-3.

Planted bugs checked to fail: the pixel-tile offset dropped in the expand kernel (every tile reads the
split's first: fails all expand tests), the last split skipped by the merge (the sums and dW_exp
tests), P - 1 for P in de's mean terms (the de test), the K-step offset dropped in expand_dgrad (the
dgrad tests), the bias beta dropped (h, sums, de), rstd dropped from de's e_hat term (the de test), the
last split dropped where two programs share an SM (the paired h test).
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
    monkeypatch.setattr(eb, "DGRAD_TILES", {key: (32, 32, 8) for key in eb.DGRAD_TILES})
    monkeypatch.setattr(eb, "SUM_SPLITS", 2)
    monkeypatch.setattr(eb, "SUM_COLUMNS", 8192)


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


def test_expand_hidden_paired(interpreter_backend, small_tiles, monkeypatch):
    """The launch of two programs per SM (one pipeline stage, a register cap: taken at Small's 16x16) at
    any map size: the same h."""
    from convfirstnet.kernels.mbconv import expand_backward as eb

    monkeypatch.setattr(eb, "PAIRED_MIN_TILES", 0)
    shape = SHAPES[0]
    a = _inputs(shape, 6)
    a.pop("dh")
    assert eb._expand_splits(eb.MODE_H, a["x"], a["w_exp"].shape[0])[2]
    h = eb.expand_hidden(**a)
    want = ref.expand_hidden_reference(**_f64(a))
    assert _rel(h, want) <= _tol(shape[4]), _rel(h, want)


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_bn_e_sums(interpreter_backend, small_tiles, shape):
    from convfirstnet.kernels.mbconv.expand_backward import bn_e_sums

    a = _inputs(shape, 1)
    got = bn_e_sums(**a)
    want = ref.bn_e_sums_reference(**_f64(a))
    for g, w in zip(got, want):
        assert g.dtype == F32 and g.shape == w.shape and g.is_contiguous()
        assert _rel(g, w) <= 1e-5, _rel(g, w)
    assert got[0].untyped_storage().data_ptr() != got[1].untyped_storage().data_ptr()  # the op's two outputs


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_bn_e_backward(interpreter_backend, small_tiles, shape):
    """de and dW_exp, given the reference's sums; dW_exp also against de^T x from the kernel's own de."""
    from convfirstnet.kernels.mbconv.expand_backward import bn_e_backward

    a = _inputs(shape, 2)
    sums = ref.bn_e_sums_reference(**_f64(a))
    de, dw = bn_e_backward(**a, sum_dv=sums[0].float(), sum_dv_ehat=sums[1].float())
    want_de, want_dw = ref.bn_e_backward_reference(**_f64(a), sum_dv=sums[0], sum_dv_ehat=sums[1])
    assert de.dtype == shape[4] and dw.dtype == F32 and dw.shape == want_dw.shape and dw.is_contiguous()
    assert _rel(de, want_de) <= _tol(shape[4]), _rel(de, want_de)
    assert _rel(dw, want_dw) <= _tol(shape[4]), _rel(dw, want_dw)
    own = de.double().t() @ a["x"].double()
    assert _rel(dw, own) <= 1e-5, _rel(dw, own)


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "none"])
@pytest.mark.parametrize("shape", SHAPES[::2], ids=_id)
def test_expand_dgrad(interpreter_backend, small_tiles, shape, residual):
    from convfirstnet.kernels.mbconv.expand_backward import expand_dgrad

    n, c, h, w, dt, _ = shape
    gen = torch.Generator().manual_seed(3)
    p, r = n * h * w, 4 * c
    de = torch.randn(p, r, generator=gen).to(dt)
    w_exp = (torch.randn(r, c, generator=gen) / r**0.5).to(dt)
    res = torch.randn(p, c, generator=gen).to(dt) if residual else None
    dx = expand_dgrad(de, w_exp, res)
    want = ref.expand_dgrad_reference(de.double(), w_exp.double(), None if res is None else res.double())
    assert dx.dtype == dt and dx.shape == want.shape
    assert _rel(dx, want) <= _tol(dt), _rel(dx, want)


@pytest.mark.parametrize("shape", SHAPES[::2], ids=_id)
def test_bn_e_chain(interpreter_backend, small_tiles, shape):
    """The three passes as mbconv_fused_backward chains them (the kernel's sums into bn_e_backward, its de
    into expand_dgrad with the residual) against the reference chain: de, dW_exp and dx. fp16: de and dx
    rounded once each, dx also carries de's rounding through K = R products (observed <= 4e-4): 1e-3."""
    from convfirstnet.kernels.mbconv import expand_backward as eb

    a = _inputs(shape, 4)
    res = torch.randn(a["x"].shape, generator=torch.Generator().manual_seed(5)).to(shape[4])
    sums = eb.bn_e_sums(**a)
    de, dw = eb.bn_e_backward(**a, sum_dv=sums[0], sum_dv_ehat=sums[1])
    dx = eb.expand_dgrad(de, a["w_exp"], res)
    f = _f64(a)
    want_sums = ref.bn_e_sums_reference(**f)
    want_de, want_dw = ref.bn_e_backward_reference(**f, sum_dv=want_sums[0], sum_dv_ehat=want_sums[1])
    want_dx = ref.expand_dgrad_reference(want_de, f["w_exp"], res.double())
    for got, want in ((de, want_de), (dw, want_dw), (dx, want_dx)):
        assert _rel(got, want) <= _tol(shape[4]), _rel(got, want)


def test_bad_input_raises_before_launch(interpreter_backend):
    """Shapes, dtypes and layouts are checked first, with the argument named."""
    from convfirstnet.kernels.mbconv import expand_backward as eb

    a = _inputs((1, 32, 4, 4, F32, F32))
    dh = a.pop("dh")
    cases = [
        (eb.expand_hidden, dict(a, x=a["x"].t().contiguous().t()), "x must be contiguous"),
        (eb.expand_hidden, dict(a, w_exp=a["w_exp"].half()), "w_exp has dtype"),
        (eb.expand_hidden, dict(a, mean_e=a["mean_e"][:-1]), "mean_e has shape"),
        (eb.expand_hidden, dict(a, rstd_e=a["rstd_e"].double()), "rstd_e has dtype"),
        (eb.expand_hidden, dict(a, x=a["x"][None]), "x must be a 2-D"),
        (eb.bn_e_sums, dict(a, dh=dh[:, :-1]), "dh has shape"),
        (eb.bn_e_backward, dict(a, dh=dh, sum_dv=a["mean_e"], sum_dv_ehat=a["mean_e"].half()), "sum_dv_ehat"),
        (eb.expand_dgrad, {"de": dh, "w_exp": a["w_exp"], "residual": a["x"][:, :-1]}, "residual has shape"),
        (eb.expand_dgrad, {"de": dh, "w_exp": a["w_exp"].t(), "residual": None}, "w_exp has shape"),
        (eb.expand_dgrad, {"de": dh[:, :8].contiguous(), "w_exp": torch.zeros(8, 320), "residual": None},
         "at most 256"),
    ]
    for fn, kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn(**kwargs)


# ------------------------------------------------------------------------------------------------ sm_90


def record_expand_backward(side: int, n: int = 128, dtype=torch.float16) -> list:
    """The launches of the four passes at Small's stage-4/5 widths (C = 256, R = 1024) on meta tensors."""
    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels.mbconv import expand_backward as eb

    p, c, r = n * side * side, 256, 1024

    def t(*shape, dt=dtype):
        return torch.empty(*shape, device="meta", dtype=dt)

    x, w, dh = t(p, c), t(r, c), t(p, r)
    stats = [t(r, dt=F32) for _ in range(4)]
    with recording(sms=132, l2_bytes=50 * 2**20) as rec:
        eb.expand_hidden(x, w, *stats)
        sums = eb.bn_e_sums(x, w, *stats, dh)
        de, _ = eb.bn_e_backward(x, w, *stats, dh, *sums)
        eb.expand_dgrad(de, w, x)
    return rec.launches


@pytest.mark.compile
def test_small_expand_backward_compiles_for_sm90():
    """The launches at batch 128, 16x16 and 8x8 (hidden, sums + merge, de + merge, dgrad) compile for sm_90
    within shared memory, no spill code in their loops, the expand and dgrad dots on wgmma, enough programs
    for the 132 SMs (expand_dgrad at 8x8: 64), h two programs per SM at 16x16 (8 x 32 programs, one stage, 128
    registers at most) and one at 8x8; the fp32 variants within shared memory. (Compiled with Triton 3.8,
    fp16: h 127 registers and 96 KiB of shared memory at 16x16, 127 and 176 KiB at 8x8; sums 128 (16
    warps), de 255, all without stack; shared memory 176 (sums) / 208 (de) KiB; expand_dgrad 244
    registers, 72 KiB.)"""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    from .test_mbconv import SHARED_LIMIT, _spills_in_loops

    variants = {}
    for side in (16, 8):
        launches = record_expand_backward(side)
        names = [lc.kernel.fn.__name__ if hasattr(lc.kernel, "fn") else lc.kernel.__name__ for lc in launches]
        assert names == ["_expand_kernel", "_expand_kernel", "_wgrad_reduce_kernel", "_expand_kernel",
                         "_wgrad_reduce_kernel", "_dgrad_kernel"]
        h = launches[0]
        paired = (h.grid, h.meta["num_stages"], h.meta.get("maxnreg"))
        assert paired == (((8, 32), 1, 128) if side == 16 else ((8, 16), 3, None)), (side, paired)
        for lc, name in zip(launches, names):
            if name != "_wgrad_reduce_kernel":
                programs = 1
                for g in lc.grid:
                    programs *= g
                # expand_dgrad at 8x8: 64 programs of 128 pixels (DGRAD_TILES: smaller re-read W_exp more)
                assert programs >= (64 if name == "_dgrad_kernel" and side == 8 else 128), (name, lc.grid)
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
    for v, c in zip(variants.values(), compile_variants(list(variants.values()))):
        where = f"{v.name} {v.meta}"
        want = "none" if v.name == "_wgrad_reduce_kernel" else "wgmma"
        if c.shared > SHARED_LIMIT[90] or _spills_in_loops(c) or c.mma_kind != want:
            problems.append(f"{where}: {c.shared} B shared, {_spills_in_loops(c)} spills in loops, "
                            f"{c.mma_kind}")
    assert not problems, "\n".join(problems)
