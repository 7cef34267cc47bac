"""The passes of the fused MBConv training backward over d (kernels/mbconv/gate_backward.py: dgate_pool,
bn_d_sums, bn_d_backward) against their specification (backward_reference.py) computed in fp64 on the
same inputs, in the interpreter at the model's widths on small maps, with small steps (``small_tiles``:
16-pixel tiles, one group per merge step, two images per bn_d_sums step) so that every loop runs more
than once: tiles of an image (4 at 8x8; 2 at 5x5, the second ragged), images of a group (2, then a group
of 1), channel chunks (at R = 1024: 8 or 16 in fp16, 32 or 64 in fp32; a masked last chunk at R = 192),
the merge over the groups, bn_d_sums' steps over the images (2, then 1); and each of the kernel's mask
variants (EVEN_HW, EVEN_CK). bn_d_sums' per-image decomposition itself is checked against the sums over
the pixels as BN_d's backward defines them (fp64, 1e-12).

Tolerances (relative to each tensor's maximum). fp32: both sides sum the same fp32 products in another
order (and exp2 against torch's sigmoid): observed <= 6e-7, compared within 1e-5. fp16: dq is a product
of fp16 operands accumulated in fp32 as the reference does (exact products), so dgate_pool's six sums and
bn_d_sums keep 1e-5 (observed <= 5.4e-7); dW_proj's second operand g gate is rounded to fp16 for the
tensor cores (u = 2^-11 each; observed <= 2.9e-4): 1e-3; dd is rounded to fp16 once (<= 2^-11 of an
element; observed <= 4.1e-4): 1e-3.
Planted bugs checked to fail: s' dropped from sum dq s' u_hat (4 of 4 dgate_pool cases fail), from sum
dq s' (4), from sum s' u_hat (4); s' left unmasked on an image's ragged last tile (the 2 ragged cases);
sum s' not restarted at the next image (4); bn_d_sums skipping the last image (4 of 4) or reading
sum s' for sum s' u_hat (4); the merge skipping the last group's dW_proj partial (4); gate dropped from
dW_proj's q (4). Earlier: the tile offset within an image dropped, the group's first image dropped, P - 1
for P in bn_d_backward's divisor.
"""

from __future__ import annotations

import pytest
import torch

# (N, C, H, W, dtype, gamma/beta in x's dtype), the four mask variants: Small's widths (K = C = 256,
# R = 1024) on 8x8 (no masks) and on a ragged 5x5 map (pixel masks only: the 224-pixel input's 14x14 and 7x7
# on the GPU); Nano's K = 160 (padded to 256: channel masks only); R = 192 (a half-masked chunk of 128 and
# K = 48 padded to 64) on 5x5 with 16-bit BatchNorm weights (both masks)
SHAPES = [(3, 256, 8, 8, torch.float32, False), (3, 256, 5, 5, torch.float16, False),
          (3, 160, 8, 8, torch.float32, False), (3, 48, 5, 5, torch.float16, True)]


def _id(s: tuple) -> str:
    return f"n{s[0]}-c{s[1]}-{s[2]}x{s[3]}-{str(s[4])[6:]}" + ("-w16" if s[5] else "")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def small_tiles(monkeypatch):
    from convfirstnet.kernels.mbconv import gate_backward

    monkeypatch.setattr(gate_backward, "BM", 16)
    monkeypatch.setattr(gate_backward, "MERGE_GROUPS", 1)
    monkeypatch.setattr(gate_backward, "SUMS_IMAGES", 2)
    monkeypatch.setattr(gate_backward, "SUMS_BLOCK", 128)


def _inputs(shape):
    """d with a per-channel mean of a few spreads (BN_d's statistics taken from it), do, W_proj, the
    per-image gate and dpix; all of x's dtype except the statistics and the (N, R) vectors (fp32)."""
    n, c, h, w, dt, w16 = shape
    r, k, p = 4 * c, c, n * h * w
    gen = torch.Generator().manual_seed(5)
    d, mean, rstd, gamma, beta = bn_d_inputs(gen, p, r, dt, w16)
    do = (0.5 * torch.randn(p, k, generator=gen)).to(dt)
    w_proj = (torch.randn(k, r, generator=gen) / r**0.5).to(dt)
    gate = torch.rand(n, r, generator=gen)
    dpix = 0.05 * torch.randn(n, r, generator=gen)
    return d, mean, rstd, gamma, beta, do, w_proj, gate, dpix, n


def bn_d_inputs(gen: torch.Generator, p: int, r: int, dt: torch.dtype, w16: bool):
    """(d, mean, rstd, gamma, beta): d (P, R) in dt with a per-channel mean of a few spreads, BN_d's batch
    statistics taken from it (fp32), its weights (fp32, or dt where ``w16``)."""
    d = (torch.randn(p, r, generator=gen) * (torch.rand(r, generator=gen) + 0.5)
         + 2.0 * torch.randn(r, generator=gen)).to(dt)
    var, mean = torch.var_mean(d.double(), 0, unbiased=False)
    rstd = (var + 1e-5).rsqrt().float()
    gamma = torch.rand(r, generator=gen) + 0.5
    beta = 0.5 * torch.randn(r, generator=gen)
    if w16:
        gamma, beta = gamma.to(dt), beta.to(dt)
    return d, mean.float(), rstd, gamma, beta


def _f64(args):
    return [a.double() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_dgate_pool(interpreter_backend, small_tiles, shape):
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv.gate_backward import dgate_pool

    d, mean, rstd, gamma, beta, do, w_proj, _, _, n = _inputs(shape)
    got = dgate_pool(d, mean, rstd, gamma, beta, do, w_proj, n)
    want = ref.dgate_pool_reference(*_f64((d, mean, rstd, gamma, beta, do, w_proj)), n)
    r = d.shape[1]
    assert [t.shape for t in got] == [(n, r), (n, r), (4, n, r)]
    names = ("dgate", "gsum", "sum dq s'", "sum s'", "sum dq s' u_hat", "sum s' u_hat")
    for name, g, w in zip(names, [*got[:2], *got[2]], [*want[:2], *want[2]]):
        assert g.dtype == torch.float32 and g.is_contiguous(), name
        assert _rel(g, w) <= 1e-5, f"{name}: {_rel(g, w):.3g}"


def test_bn_d_sums_reference_is_the_sum_over_pixels():
    """The per-image decomposition is BN_d's backward sums over all pixels as defined: sum dy and
    sum dy u_hat, dy = (dq gate_n + dpix_n) SiLU'(v_d), in fp64 (equal but for the summation order)."""
    from convfirstnet.kernels.mbconv import backward_reference as ref

    args = _f64(_inputs(SHAPES[1]))
    d, mean, rstd, gamma, beta, do, w_proj, gate, dpix, n = args
    parts = ref.dgate_pool_reference(d, mean, rstd, gamma, beta, do, w_proj, n)[2]
    got = ref.bn_d_sums_reference(parts, gate, dpix)
    u_hat, _, dy = ref._dy(*args)
    for g, w in zip(got, (dy.sum(0), (dy * u_hat).sum(0))):
        assert _rel(g, w) <= 1e-12, _rel(g, w)


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_bn_d_sums(interpreter_backend, small_tiles, shape):
    """From the parts as dgate_pool writes them (in fp32, the fp64 reference's rounded)."""
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv.gate_backward import bn_d_sums

    d, mean, rstd, gamma, beta, do, w_proj, gate, dpix, n = _inputs(shape)
    parts = ref.dgate_pool_reference(*_f64((d, mean, rstd, gamma, beta, do, w_proj)), n)[2].float()
    got = bn_d_sums(parts, gate, dpix)
    want = ref.bn_d_sums_reference(*_f64((parts, gate, dpix)))
    for name, g, w in zip(("sum dy", "sum dy u_hat"), got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape and g.is_contiguous(), name
        assert _rel(g, w) <= 1e-5, f"{name}: {_rel(g, w):.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_bn_d_backward(interpreter_backend, small_tiles, shape):
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv.gate_backward import bn_d_backward

    args = _inputs(shape)
    d, mean, rstd, gamma, beta, do, w_proj, gate, dpix, n = _f64(args)
    parts = ref.dgate_pool_reference(d, mean, rstd, gamma, beta, do, w_proj, n)[2]
    sum_dy, sum_dyu = ref.bn_d_sums_reference(parts, gate, dpix)
    dd, dw = bn_d_backward(*args[:-1], sum_dy.float(), sum_dyu.float(), n)
    want_dd, want_dw = ref.bn_d_backward_reference(*_f64(args[:-1]), sum_dy, sum_dyu, n)
    assert dd.dtype == args[0].dtype and dd.shape == args[0].shape
    assert dw.dtype == torch.float32 and dw.shape == want_dw.shape and dw.is_contiguous()
    tol = 1e-5 if shape[4] == torch.float32 else 1e-3
    assert _rel(dd, want_dd) <= tol, f"dd: {_rel(dd, want_dd):.3g}"
    assert _rel(dw, want_dw) <= tol, f"dW_proj: {_rel(dw, want_dw):.3g}"


def test_bad_input_raises_before_any_launch(triton_backend):
    """Shapes, dtypes and layouts the kernels cannot take: one ValueError line each, nothing launched
    (meta tensors: a launch would fail otherwise)."""
    from convfirstnet.kernels.mbconv.gate_backward import bn_d_backward, bn_d_sums, dgate_pool

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    h = torch.float16
    d, do, w = t(50, 64, dtype=h), t(50, 16, dtype=h), t(16, 64, dtype=h)
    v = [t(64) for _ in range(4)]
    gate, dpix = t(2, 64), t(2, 64)
    cases = [
        lambda: dgate_pool(d, *v, do, w, 3),  # 50 pixels are not 3 equal images
        lambda: dgate_pool(d, *v, do.float(), w, 2),  # do in another dtype
        lambda: dgate_pool(d, *v, do, t(16, 32, dtype=h), 2),  # W_proj's shape
        lambda: dgate_pool(d, t(64, dtype=h), *v[1:], do, w, 2),  # a 16-bit statistic
        lambda: dgate_pool(t(64, 50, dtype=h).t(), *v, do, w, 2),  # d not row-major
        lambda: bn_d_sums(t(4, 2, 64), t(3, 64), dpix),  # gate not (N, R)
        lambda: bn_d_sums(t(3, 2, 64), gate, dpix),  # three parts
        lambda: bn_d_sums(t(4, 2, 64), gate, t(64, 2).t()),  # dpix not row-major
        lambda: bn_d_backward(d, *v, do, w, gate, dpix, t(64), t(32), 2),  # sum dy u_hat's shape
    ]
    for case in cases:
        with pytest.raises(ValueError, match="gate_backward"):
            case()


# ------------------------------------------------------------------------------------------------ sm_90


def record_small(side: int, n: int = 128, c: int = 256, dtype=torch.float16) -> list:
    """The launches of the three passes at fused Small's shapes on meta tensors."""
    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels.mbconv.gate_backward import bn_d_backward, bn_d_sums, dgate_pool

    r, p = 4 * c, n * side * side

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    d, do, w = t(p, r, dtype=dtype), t(p, c, dtype=dtype), t(c, r, dtype=dtype)
    v = [t(r) for _ in range(4)]
    with recording(sms=132, l2_bytes=50 * 2**20) as rec:
        parts = dgate_pool(d, *v, do, w, n)[2]
        sum_dy, sum_dyu = bn_d_sums(parts, t(n, r), t(n, r))
        bn_d_backward(d, *v, do, w, t(n, r), t(n, r), sum_dy, sum_dyu, n)
    return rec.launches


@pytest.mark.compile
def test_small_gate_backward_compiles_for_sm90():
    """The four launches at fused Small's 16x16 and 8x8 maps (256-pixel input) and 14x14 and 7x7 (224, the
    training size: pixel masks), batch 128, fp16, compile for sm_90 within shared memory, with no spill code
    in their loops (and no stack at all), the dots on wgmma; each pass's grid fills the 132 SMs (at least
    128 programs). (Compiled: dgate_pool 211 / 224 / 222 / 226 registers at 16x16 / 8x8 / 14x14 / 7x7,
    bn_d_backward 244 / 246 / 245 / 249, bn_d_sums 32, the merge 61; shared memory 192 KB, 152.5 KB for
    bn_d_backward: the W_proj slice and three do tiles.)"""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of
    from convfirstnet.analysis.launches import kernel_name

    from .test_mbconv import SHARED_LIMIT, _spills_in_loops

    variants, problems = {}, []
    for side in (16, 8, 14, 7):  # 256-pixel input (inference size) and 224 (training: ragged tiles)
        launches = record_small(side)
        names = [kernel_name(lc).rsplit(".", 1)[1] for lc in launches]
        assert names == ["_gate_backward_kernel", "_sums_kernel", "_gate_backward_kernel",
                         "_wgrad_reduce_kernel"]
        for lc in launches:
            if "MODE" in lc.meta and lc.grid[0] * lc.grid[1] < 128:
                problems.append(f"MODE {lc.meta['MODE']} at {side}x{side}: grid {lc.grid}")
            v = variant_of(lc, 90)
            variants.setdefault(v.key, v)
    for v, c in zip(variants.values(), compile_variants(list(variants.values()))):
        where = f"{v.name} {v.meta}"
        want = "wgmma" if v.name == "_gate_backward_kernel" else "none"
        if c.shared > SHARED_LIMIT[90] or c.stack or _spills_in_loops(c) or c.mma_kind != want:
            problems.append(f"{where}: {c.shared} B shared, {c.stack} B stack, {c.mma_kind}")
    assert not problems, "\n".join(problems)


@pytest.mark.compile
def test_fp32_launches_fit_in_shared_memory():
    """fp32 data (a fallback: smaller channel chunks, tf32x3 dots) compiles for sm_90 within shared memory
    at Small's 16x16 maps, so that its launches start (64-channel chunks took 256-320 KB)."""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    from .test_mbconv import SHARED_LIMIT

    variants = {v.key: v for v in (variant_of(lc, 90) for lc in record_small(16, dtype=torch.float32))}
    shared = [c.shared for c in compile_variants(list(variants.values()))]
    assert max(shared) <= SHARED_LIMIT[90], shared
