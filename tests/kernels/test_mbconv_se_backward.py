"""The SE step of the fused MBConv training backward (kernels/mbconv/se_backward.py: se_backward) against
its specification (backward_reference.se_backward_reference) computed in fp64 on the same inputs, in the
interpreter, at the model's widths: Small's R = 1024, S = 64 and the odd widths R = 640, S = 40 and
R = 384, S = 24 (S padded to 64 and 32: masked columns, a half-masked last column tile), and Tiny's
R = 288, S = 18 (a half-masked last channel chunk of 64 or 128), with weights in fp32 and fp16, as
(S, R) and (S, R, 1, 1).
``small_steps`` (16 images per step of a weight tile) makes the image loop run 3 times on 37 images
(ragged last step) and twice on 20.

Tolerance: 1e-5 relative to each output's maximum. Everything is fp32 on both sides (the fp16 weights are
upcast exactly), so only the order of the fp32 sums differs (the partials over channel chunks, the dots'
accumulation), plus exp2 and a division against torch's sigmoid: observed <= 3.2e-7.
Planted bugs checked to fail (each in 4 of 4 shapes): the ReLU mask dropped from the weight tiles' ds
(dW_se1, db_se1) and from the dpix tiles' (dpix), the first image step skipped in the weight-gradient
reduction (all four weight gradients), the last chunk's partials skipped (all six outputs), the division
by HW dropped from dpix.
"""

from __future__ import annotations

import pytest
import torch

# (N, R, S, weight dtype, 4-D weights)
SHAPES = [(37, 1024, 64, torch.float32, True), (20, 640, 40, torch.float16, False),
          (37, 384, 24, torch.float32, False), (20, 288, 18, torch.float16, True)]
NAMES = ("gate", "dpix", "dw_se1", "db_se1", "dw_se2", "db_se2")


def _id(s: tuple) -> str:
    return f"n{s[0]}-r{s[1]}-s{s[2]}-{str(s[3])[6:]}" + ("-4d" if s[4] else "")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def small_steps(monkeypatch):
    from convfirstnet.kernels.mbconv import se_backward

    monkeypatch.setattr(se_backward, "NW", 16)


def _inputs(shape, hw: int = 25):
    """gsum as sums of SiLU outputs over hw pixels, dgate, the SE weights at a 1/sqrt(fan-in) scale and
    biases of a spread that puts about half of s below 0 (so the ReLU mask matters)."""
    n, r, s, wdt, four = shape
    gen = torch.Generator().manual_seed(3)
    gsum = hw * (torch.rand(n, r, generator=gen) - 0.2)
    dgate = torch.randn(n, r, generator=gen)
    w1 = torch.randn(s, r, generator=gen) / r**0.5
    w2 = torch.randn(r, s, generator=gen) / s**0.5
    b1, b2 = 0.5 * torch.randn(s, generator=gen), 0.5 * torch.randn(r, generator=gen)
    if four:
        w1, w2 = w1.reshape(s, r, 1, 1), w2.reshape(r, s, 1, 1)
    return (gsum, dgate, *(t.to(wdt) for t in (w1, b1, w2, b2)), hw)


@pytest.mark.parametrize("rc", [64, 128], ids=["rc64", "rc128"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_se_backward(interpreter_backend, small_steps, monkeypatch, shape, rc):
    """Channel chunks of 64 (sm_90) and of 128 (below: RC_SM80)."""
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv import se_backward as module
    from convfirstnet.kernels.mbconv.se_backward import se_backward

    monkeypatch.setattr(module, "RC", rc)

    args = _inputs(shape)
    got = se_backward(*args)
    want = ref.se_backward_reference(*(a.double() if isinstance(a, torch.Tensor) else a for a in args))
    s = args[3].double() + (args[0].double() / args[6]) @ args[2].double().reshape(shape[2], -1).t()
    assert 0.2 < (s > 0).double().mean() < 0.8  # the mask matters
    bad = []
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape and g.is_contiguous(), name
        if _rel(g, w) > 1e-5:
            bad.append(f"{name}: {_rel(g, w):.2e}")
    assert not bad, bad
    ptrs = {g.untyped_storage().data_ptr() for g in got}
    assert len(ptrs) == len(got)  # each output in memory of its own (the op returns them as they are)


def test_se_backward_is_deterministic(interpreter_backend, small_steps):
    from convfirstnet.kernels.mbconv.se_backward import se_backward

    args = _inputs(SHAPES[2])
    for a, b in zip(se_backward(*args), se_backward(*args)):
        assert torch.equal(a, b)


def test_se_backward_rejects_bad_input(interpreter_backend):
    from convfirstnet.kernels.mbconv.se_backward import se_backward

    gsum, dgate, w1, b1, w2, b2, hw = _inputs((4, 64, 16, torch.float32, False))
    cases = [((gsum.half(), dgate, w1, b1, w2, b2, hw), "gsum"),
             ((gsum, dgate[:, :32], w1, b1, w2, b2, hw), "dgate"),
             ((gsum, dgate, w1, b1, w2.t(), b2, hw), "w_se2"),
             ((gsum, dgate, w1, b1[:8], w2, b2, hw), "b_se1"),
             ((gsum, dgate, w1, b1, w2, b2, 0), "hw")]
    for args, what in cases:
        with pytest.raises(ValueError, match=what):
            se_backward(*args)


# ------------------------------------------------------------------------------------------------ sm_90


def record(n: int, r: int, s: int, wdt=torch.float32) -> list:
    """The launches at batch n on meta tensors (the same at every map size: HW is a runtime value)."""
    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels.mbconv.se_backward import se_backward

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    with recording(sms=132, l2_bytes=50 * 2**20) as rec:
        se_backward(t(n, r), t(n, r), t(s, r, 1, 1, dtype=wdt), t(s, dtype=wdt), t(r, s, 1, 1, dtype=wdt),
                    t(r, dtype=wdt), 256)
    return rec.launches


@pytest.mark.compile
def test_small_se_backward_compiles_for_sm90():
    """The three launches at Small's widths (batch 128; fp32 master weights and fp16 weights) and at
    R = 640, S = 40 compile for sm_90 and sm_80 within shared memory, with no stack at all and the
    products on the FMA pipe (fp32). (Compiled for sm_90 at Small: 37 / 128 / 173 registers, the grad
    kernel's 104 KB of shared memory: the layout changes of its fp32 dots, 208 KB at 64 images per step.)"""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of
    from convfirstnet.analysis.launches import kernel_name

    from .test_mbconv import SHARED_LIMIT

    variants, problems = {}, []
    for r, s, wdt in ((1024, 64, torch.float32), (1024, 64, torch.float16), (640, 40, torch.float32)):
        launches = record(128, r, s, wdt)
        names = [kernel_name(lc).rsplit(".", 1)[1] for lc in launches]
        assert names == ["_s_partials_kernel", "_gate_kernel", "_grad_kernel"]
        for lc in launches:
            for arch in (90, 80):
                v = variant_of(lc, arch)
                variants.setdefault(v.key, (arch, v))
    archs = [a for a, _ in variants.values()]
    compiled = compile_variants([v for _, v in variants.values()])
    for arch, (_, v), c in zip(archs, variants.values(), compiled):
        if c.shared > SHARED_LIMIT[arch] or c.stack or c.mma_kind != "none":
            problems.append(f"sm_{arch} {v.name} {v.meta}: {c.regs} registers, {c.shared} B shared, "
                            f"{c.stack} B stack, {c.mma_kind}")
    assert not problems, "\n".join(problems)
