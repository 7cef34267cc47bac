"""BN_p's backward through drop-path (kernels/mbconv/narrow.bn_p_backward: per pixel split the sums of dob and
dob o_hat, their fixed-order merge, the apply pass) against its specification,
backward_reference.bn_p_backward_reference, computed in fp64 from the same inputs.

``small_tiles`` (test_mbconv_fused_forward) steps the pixel loops by 16 rows and the merge by 2 splits, so on
these maps there are several splits of 2 tiles each (the last one short and masked), the merge loop runs
several times and the apply has a ragged last tile. K = 256 is Small's width; K = 96 and 160 pad to 128 and
256 (masked channels). drop holds a 0 and a 1.25 (drop-path: a dropped image and a kept one, rescaled).

Tolerances, relative to each tensor's maximum. fp32: both sides see the same inputs; only the summation
order of dgamma, dbeta (over <= 192 rows) and fp32 against fp64 arithmetic differ (observed ~1e-7): 1e-5.
fp16: do is rounded to fp16 once (u = 2^-11 = 4.9e-4 of its magnitude) after fp32 arithmetic (observed
<= 3.6e-4): 1e-3; dgamma, dbeta are fp32 sums of the same fp16 inputs the reference upcasts (observed
<= 2e-7): 1e-5.
Planted bugs checked to fail: the pixel loop's offset dropped in the partials (every step re-reads the
split's first tile; fails 5 of the 5 shape cases), the last split skipped in the merge (5), drop not applied
to dob in the partials (5), the wrong image's drop in the apply (m % 3 for m // HW; 5), the divisor M - 1
for M in the apply (4: the fp16 8x8 case moves do by less than its 1e-3).
"""

from __future__ import annotations

import pytest
import torch
from convfirstnet.kernels.mbconv.backward_reference import bn_p_backward_reference

from .test_mbconv_fused_forward import _rel, small_tiles  # noqa: F401 (a fixture)

# (N, K, H, W, dtype, gamma and drop in fp32): P = 192 (12 tiles of 16: 6 splits, 3 merge steps) and 75 (a
# ragged last tile and split), K = 96 / 160 masked
SHAPES = [(3, 256, 8, 8, torch.float32, True), (3, 96, 5, 5, torch.float32, False),
          (3, 256, 8, 8, torch.float16, True), (3, 160, 5, 5, torch.float16, False),
          (3, 256, 5, 5, torch.float16, False)]


def _id(s: tuple) -> str:
    return f"n{s[0]}-k{s[1]}-{s[2]}x{s[3]}-{str(s[4])[6:]}-{'fp32' if s[5] else 'xdt'}-params"


def _inputs(n: int, k: int, h: int, w: int, dt: torch.dtype, fp32_params: bool, seed: int = 4):
    gen = torch.Generator().manual_seed(seed)
    m = n * h * w
    dout = torch.randn(m, k, generator=gen).to(dt)
    o = (torch.randn(m, k, generator=gen) + 2.0).to(dt)
    var, mean = torch.var_mean(o.double(), 0, unbiased=False)
    rstd = (var + 1e-5).rsqrt().float()
    gamma = torch.rand(k, generator=gen) + 0.5
    drop = torch.tensor([0.0, 1.25, 1.25])[:n]
    if not fp32_params:
        gamma, drop = gamma.to(dt), drop.to(dt)
    return dout, o, mean.float(), rstd, gamma, drop, n


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_bn_p_backward(interpreter_backend, small_tiles, shape):  # noqa: F811
    from convfirstnet.kernels.mbconv.narrow import bn_p_backward

    args = _inputs(*shape)
    dout, o, mean, rstd, gamma, drop, n = args
    do, dgamma, dbeta = bn_p_backward(*args)
    want = bn_p_backward_reference(dout.double(), o.double(), mean.double(), rstd.double(), gamma.double(),
                                   drop.double(), n)
    assert do.dtype == dout.dtype and do.shape == dout.shape
    for t in (dgamma, dbeta):
        assert t.dtype == torch.float32 and t.shape == (dout.shape[1],) and t.is_contiguous()
    tol = 1e-5 if dout.dtype == torch.float32 else 1e-3
    assert _rel(do, want[0]) <= tol, _rel(do, want[0])
    assert _rel(dgamma, want[1]) <= 1e-5, _rel(dgamma, want[1])
    assert _rel(dbeta, want[2]) <= 1e-5, _rel(dbeta, want[2])
    # no atomics: a second call gives the same bits
    again = bn_p_backward(*args)
    assert all(torch.equal(a, b) for a, b in zip(again, (do, dgamma, dbeta)))


def test_bn_p_backward_rejects_bad_input():
    from convfirstnet.kernels.mbconv.narrow import bn_p_backward

    dout, o, mean, rstd, gamma, drop, n = _inputs(3, 96, 5, 5, torch.float32, True)
    bad = {
        "must be one row-major contiguous": (dout.t(), o.t(), mean, rstd, gamma, drop, n),
        "must share one of": (dout, o.half(), mean, rstd, gamma, drop, n),
        "not 2 images": (dout, o, mean, rstd, gamma, drop[:2], 2),
        "mean_p \\(95,\\)": (dout, o, mean[:95], rstd, gamma, drop, n),
        "rstd_p \\(torch.float16\\)": (dout, o, mean, rstd.half(), gamma, drop, n),
        "drop \\(torch.float64\\)": (dout, o, mean, rstd, gamma, drop.double(), n),
    }
    for match, a in bad.items():
        with pytest.raises(ValueError, match=match):
            bn_p_backward(*a)


def record_bn_p_backward(side: int, n: int = 128, k: int = 256, dtype=torch.float16) -> list:
    """The launches of bn_p_backward at one of Small's stride-1 shapes on meta tensors (cost recording)."""
    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels.mbconv.narrow import bn_p_backward

    meta = {"device": "meta"}
    m = n * side * side
    vec = torch.empty(k, dtype=torch.float32, **meta)
    with recording() as rec:
        rows = (torch.empty(m, k, dtype=dtype, **meta), torch.empty(m, k, dtype=dtype, **meta))
        bn_p_backward(*rows, vec, vec, vec, torch.empty(n, **meta), n)
    return rec.launches


@pytest.mark.compile
def test_small_bn_p_backward_compiles_for_sm90():
    """Small's stride-1 shapes (batch 128, 16x16 and 8x8, K = 256, fp16): the partials, merge and apply
    compile for sm_90 with no stack (no spill code anywhere) and within shared memory. (Compiled, 4 warps:
    the partials 255 registers (two 64 x 256 tiles per step), the merge 40, the apply 168; no stack.)"""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    from .test_mbconv import SHARED_LIMIT

    variants = {}
    for side in (16, 8):
        launches = record_bn_p_backward(side)
        names = [lc.kernel.__name__ for lc in launches]
        assert names == ["_bn_grad_partials_kernel", "_wgrad_reduce_kernel", "_bn_grad_apply_kernel"]
        for lc in launches:
            v = variant_of(lc, 90)
            variants.setdefault(v.key, v)
    problems = [f"{v.name}: {c.stack} B stack, {c.shared} B shared"
                for v, c in zip(variants.values(), compile_variants(list(variants.values())))
                if c.stack or c.shared > SHARED_LIMIT[90]]
    assert not problems, "\n".join(problems)
