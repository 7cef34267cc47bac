"""The stride-2 passes over g given (kernels/mbconv/gate_backward.py: gate_pool, gate_grad, the kernel's
GIVEN variant) against their specification (backward_reference.py) computed in fp64 on the same inputs,
in the interpreter at the stride-2 blocks' widths on small maps, with ``small_tiles`` (16-pixel tiles, one
group per merge step) so that every loop runs more than once: tiles of an image (4 at 8x8 and 7x7, the
last of 7x7 ragged; 2 at 5x5, ragged), images of a group (2, then a group of 1), channel chunks (R = 768,
384: 6 / 12 in fp16, 24 / 48 in fp32; R = 160: a tail chunk of 32), the merge over the groups; and each
of the kernel's mask variants (EVEN_HW, EVEN_CK; K = 192 and 48 padded to 256 and 64).

Tolerances (relative to each tensor's maximum). fp32: both sides sum the same fp32 products in another
order: compared within 1e-5. fp16: g, do and W_proj are exact in the reference's fp64 and dq's products
of fp16 operands are exact in fp32, so gate_pool's sums keep 1e-5; dg is rounded once to fp16 (<= 2^-11
of an element): 1e-3; dW_proj's second operand g gate is rounded to fp16 for the tensor cores: 1e-3.
bf16 only compiles here (the interpreter's bf16 tl.dot is wrong: KERNEL-NOTES.md).
Planted bugs checked to fail: dpix dropped from dg (4 of 4 gate_grad cases fail), gate dropped from
dW_proj's q (4 of 4), the last image of a group skipped in gate_pool's sums (4 of 4).
"""

from __future__ import annotations

import pytest
import torch

from ..conftest import sampled
from .test_mbconv_gate_backward import _rel, small_tiles  # noqa: F401 (a fixture)

# (N, R, K, HO, WO, dtype): the mask variants at stride-2 widths (R = 768 as Tiny's stages.4.0, R = 384 as
# Small's stages.3.0 with K = 192 padded to 256) and a tail chunk: no masks (8x8), pixel masks only (7x7),
# channel masks only (K = 192), both (R = 160: 128 + 32 and 64 + 64 + 32 channels, K = 48 on 5x5)
SHAPES = [(3, 768, 256, 8, 8, torch.float16), (3, 768, 256, 7, 7, torch.float32),
          (3, 384, 192, 8, 8, torch.float32), (3, 160, 48, 5, 5, torch.float16)]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 1e-3)}


def _id(s: tuple) -> str:
    return f"n{s[0]}-r{s[1]}-k{s[2]}-{s[3]}x{s[4]}-{str(s[5])[6:]}"


def _inputs(shape):
    """g (a SiLU output: mostly positive, a mean that the sums over an image build up), do, W_proj in the
    dtype; gate, dpix (N, R) fp32."""
    n, r, k, h, w, dt = shape
    p = n * h * w
    gen = torch.Generator().manual_seed(7)
    g = torch.nn.functional.silu(torch.randn(p, r, generator=gen) + torch.randn(r, generator=gen)).to(dt)
    do = (0.5 * torch.randn(p, k, generator=gen)).to(dt)
    w_proj = (torch.randn(k, r, generator=gen) / r**0.5).to(dt)
    gate = torch.rand(n, r, generator=gen)
    dpix = 0.05 * torch.randn(n, r, generator=gen)
    return g, do, w_proj, gate, dpix, n


def _f64(args):
    return [a.double() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_gate_pool(interpreter_backend, small_tiles, shape):  # noqa: F811
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv.gate_backward import gate_pool

    g, do, w_proj, _, _, n = _inputs(shape)
    got = gate_pool(g, do, w_proj, n)
    want = ref.gate_pool_reference(*_f64((g, do, w_proj)), n)
    tol = TOL[shape[5]][0]
    for name, x, y in zip(("dgate", "gsum"), got, want):
        assert x.dtype == torch.float32 and x.shape == (n, shape[1]) and x.is_contiguous(), name
        assert _rel(x, y) <= tol, f"{name}: {_rel(x, y):.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_gate_grad(interpreter_backend, small_tiles, shape):  # noqa: F811
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv.gate_backward import gate_grad

    args = _inputs(shape)
    g = args[0]
    dg, dw = gate_grad(*args)
    want_dg, want_dw = ref.gate_grad_reference(*_f64(args))
    assert dg.dtype == g.dtype and dg.shape == g.shape and dg.is_contiguous()
    assert dw.dtype == torch.float32 and dw.shape == want_dw.shape and dw.is_contiguous()
    tol = TOL[shape[5]][1]
    assert _rel(dg, want_dg) <= tol, f"dg: {_rel(dg, want_dg):.3g}"
    assert _rel(dw, want_dw) <= tol, f"dW_proj: {_rel(dw, want_dw):.3g}"


def test_bad_input_raises_before_any_launch(triton_backend):
    """One ValueError line each, nothing launched (meta tensors: a launch would fail otherwise)."""
    from convfirstnet.kernels.mbconv.gate_backward import gate_grad, gate_pool

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    h = torch.float16
    g, do, w = t(50, 64, dtype=h), t(50, 16, dtype=h), t(16, 64, dtype=h)
    gate, dpix = t(2, 64), t(2, 64)
    cases = [
        lambda: gate_pool(g, do, w, 3),  # 50 pixels are not 3 equal images
        lambda: gate_pool(g, do[:40], w, 2),  # do's rows
        lambda: gate_pool(g, do.float(), w, 2),  # do in another dtype
        lambda: gate_pool(g.to(torch.int32), do, w, 2),  # g not floating point
        lambda: gate_pool(t(64, 50, dtype=h).t(), do, w, 2),  # g not row-major
        lambda: gate_grad(g, do, t(16, 32, dtype=h), gate, dpix, 2),  # W_proj's shape
        lambda: gate_grad(g, do, w, t(3, 64), dpix, 2),  # gate not (N, R)
        lambda: gate_grad(g, do, w, gate, t(2, 64, dtype=h), 2),  # dpix not fp32
        lambda: gate_grad(g, do, w, gate, t(64, 2).t(), 2),  # dpix not row-major
        lambda: gate_grad(g, do, w, gate, torch.empty(2, 64), 2),  # dpix on another device
    ]
    for case in cases:
        with pytest.raises(ValueError, match="gate_backward.gate_"):
            case()


# ------------------------------------------------------------------------------------------------ sm_90

# (g's side, R, K): the stride-2 blocks' g at Small's 256-pixel input (stages.3.0 16x16, R = 384;
# stages.4.0 8x8, R = 1024) and at the 224-pixel training size (14x14, 7x7: pixel masks)
SMALL = [(16, 384, 256), (8, 1024, 256), (14, 384, 256), (7, 1024, 256)]


def record_small(side: int, r: int, k: int, n: int = 128, dtype=torch.float16) -> list:
    """The launches of gate_pool and gate_grad at fused Small's shapes on meta tensors."""
    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels.mbconv.gate_backward import gate_grad, gate_pool

    p = n * side * side

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    g, do, w = t(p, r, dtype=dtype), t(p, k, dtype=dtype), t(k, r, dtype=dtype)
    with recording(sms=132, l2_bytes=50 * 2**20) as rec:
        gate_pool(g, do, w, n)
        gate_grad(g, do, w, t(n, r), t(n, r), n)
    return rec.launches


# fp16 at the four shapes; bf16 (the same code but for the operands' type) at 16x16 and 7x7 unless the full
# matrix is asked for
CASES = sampled([(s, dt) for dt in (torch.float16, torch.bfloat16) for s in SMALL],
                lambda c: c[1] == torch.float16 or c[0][0] in (16, 7))


@pytest.mark.compile
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][0]}x{c[0][0]}-r{c[0][1]}-{str(c[1])[6:]}")
def test_small_gate_given_compiles_for_sm90(case):
    """gate_pool and gate_grad at the stride-2 blocks' shapes, batch 128, compile for sm_90 within shared
    memory, with no spill code in their loops (and no stack at all), the dots on wgmma; each pass's grid
    fills the 132 SMs (at least 128 programs). (Compiled, fp16: gate_pool 94 / 95 / 94 / 94 registers at
    16x16 / 8x8 / 14x14 / 7x7, gate_grad 151 / 163 / 156 / 165; bf16 94 / 95 / 92 / 94 and 154 / 164 / 158 /
    166; shared memory 164 KB and 152.5 KB: the W_proj slice and three do tiles.)"""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of
    from convfirstnet.analysis.launches import kernel_name

    from .test_mbconv import SHARED_LIMIT, _spills_in_loops

    (side, r, k), dtype = case
    launches = record_small(side, r, k, dtype=dtype)
    names = [kernel_name(lc).rsplit(".", 1)[1] for lc in launches]
    assert names == ["_gate_backward_kernel", "_gate_backward_kernel", "_wgrad_reduce_kernel"]
    assert [lc.meta.get("GIVEN") for lc in launches[:2]] == [True, True]
    problems = [f"MODE {lc.meta['MODE']}: grid {lc.grid}" for lc in launches[:2]
                if lc.grid[0] * lc.grid[1] < 128]
    variants = [variant_of(lc, 90) for lc in launches]
    for v, c in zip(variants, compile_variants(variants)):
        want = "wgmma" if v.name == "_gate_backward_kernel" else "none"
        if c.shared > SHARED_LIMIT[90] or c.stack or _spills_in_loops(c) or c.mma_kind != want:
            problems.append(f"{v.name} {v.meta}: {c.shared} B shared, {c.stack} B stack, {c.mma_kind}")
    assert not problems, "\n".join(problems)
