"""The stride-2 passes of the fused MBConv training backward through BlurPool
(kernels/mbconv/blur_backward.py: blur_gate_input, blur_bn_d_sums, blur_bn_d_backward) against their
specification (backward_reference.py) computed in fp64 on the same inputs, in the interpreter at the
model's widths on small maps, with small steps (``small_tiles``: 4-pixel tiles, 128-channel chunks (g's
64), two tiles per program, two groups per merge step) so that every loop runs more than once: the tiles
of a program (2; 1 in a last group where the tiles are odd), the groups (3-5 for g, 12-16 for the BN_d
passes; 1 and 5 at 3x2), their merge (3-8 steps of two), the tiles of an image row in the BN_d passes (2,
the second masked at W = 5, 6, 7), the channel chunks (3 or 6 at R = 384 / 768, g's 6 or 12; R = 160
and g's R = 96: a 32-channel tail). Maps: 8x8 -> 4x4 and 6x6 -> 3x3 (even), 7x5 -> 4x3 and 5x7 -> 3x4
(odd: H and W reflected onto H - 2, W - 2), 3x2 -> 2x1 (a pixel that both edges' reflections reach:
i = 1 = H - 2).

Tolerances (relative to each tensor's maximum). fp32: both sides sum the same products in another order
(and exp2 against torch's sigmoid): observed <= 3.7e-7, compared within 1e-5. 16-bit data: d and dg are
exact in fp32, so the sums keep 1e-5 (observed <= 2.5e-7); g and dd are rounded once to the data type:
fp16 <= 2^-11 of an element (observed <= 3.9e-4): 1e-3; bf16: the interpreter converts fp32 to bf16 by
truncation (1.0 + 2^-8 + 2^-12 -> 1.0, where round-to-nearest gives 1.0078125), <= 2^-7 of an element
(observed <= 4.0e-3): 8e-3.
Planted bugs checked by hand to fail: listed in the commit message that added this file.
"""

from __future__ import annotations

import pytest
import torch

from .test_mbconv_gate_backward import bn_d_inputs

# (N, H, W, R, dtype, gamma/beta in the data's dtype)
SHAPES = [(2, 8, 8, 384, torch.float32, False), (2, 6, 6, 768, torch.float16, False),
          (2, 7, 5, 160, torch.float16, True), (3, 5, 7, 96, torch.float32, False),
          (2, 6, 6, 384, torch.bfloat16, False), (3, 3, 2, 96, torch.float32, False)]
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _id(s: tuple) -> str:
    return f"n{s[0]}-{s[1]}x{s[2]}-r{s[3]}-{str(s[4])[6:]}" + ("-w16" if s[5] else "")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def small_tiles(monkeypatch, one_thread):
    """(and one intra-op thread: the fp64 reference's depth-wise conv and its vjp took 1-20 s a case with
    two threads on two busy cores, 0.01 s with one)"""
    from convfirstnet.kernels.mbconv import blur_backward

    monkeypatch.setattr(blur_backward, "BM", 4)
    monkeypatch.setattr(blur_backward, "RB", 128)
    monkeypatch.setattr(blur_backward, "RB_GATE", 64)
    monkeypatch.setattr(blur_backward, "MIN_TILES", 2)
    monkeypatch.setattr(blur_backward, "MERGE_GROUPS", 2)


def _inputs(shape):
    """d with a per-channel mean of a few spreads (BN_d's statistics taken from it), BN_d's weights, dg at
    half resolution; the statistics fp32."""
    n, h, w, r, dt, w16 = shape
    p, mo = n * h * w, n * ((h + 1) // 2) * ((w + 1) // 2)
    gen = torch.Generator().manual_seed(7)
    d, mean, rstd, gamma, beta = bn_d_inputs(gen, p, r, dt, w16)
    dg = (0.5 * torch.randn(mo, r, generator=gen)).to(dt)
    return dg, d, mean, rstd, gamma, beta


def _f64(args):
    return [a.double() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_blur_gate_input(interpreter_backend, small_tiles, shape):
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv.blur_backward import blur_gate_input

    n, h, w = shape[:3]
    _, d, mean, rstd, gamma, beta = _inputs(shape)
    g = blur_gate_input(d, mean, rstd, gamma, beta, n, h, w)
    want = ref.blur_gate_input_reference(*_f64((d, mean, rstd, gamma, beta)), n, h, w)
    assert g.dtype == d.dtype and g.shape == want.shape and g.is_contiguous()
    assert _rel(g, want) <= TOL[d.dtype], f"g: {_rel(g, want):.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_blur_bn_d_sums(interpreter_backend, small_tiles, shape):
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv.blur_backward import blur_bn_d_sums

    n, h, w = shape[:3]
    args = _inputs(shape)
    got = blur_bn_d_sums(*args, n, h, w)
    want = ref.blur_bn_d_sums_reference(*_f64(args), n, h, w)
    for name, g, wt in zip(("sum dy", "sum dy u_hat"), got, want):
        assert g.dtype == torch.float32 and g.shape == wt.shape and g.is_contiguous(), name
        assert _rel(g, wt) <= 1e-5, f"{name}: {_rel(g, wt):.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_blur_bn_d_backward(interpreter_backend, small_tiles, shape):
    """From the reference's sums (fp64, rounded to fp32 as blur_bn_d_sums returns them)."""
    from convfirstnet.kernels.mbconv import backward_reference as ref
    from convfirstnet.kernels.mbconv.blur_backward import blur_bn_d_backward

    n, h, w = shape[:3]
    args = _inputs(shape)
    sum_dy, sum_dyu = ref.blur_bn_d_sums_reference(*_f64(args), n, h, w)
    dd = blur_bn_d_backward(*args, sum_dy.float(), sum_dyu.float(), n, h, w)
    want = ref.blur_bn_d_backward_reference(*_f64(args), sum_dy, sum_dyu, n, h, w)
    assert dd.dtype == args[1].dtype and dd.shape == args[1].shape and dd.is_contiguous()
    assert _rel(dd, want) <= TOL[dd.dtype], f"dd: {_rel(dd, want):.3g}"


def test_transpose_weights_are_the_reflect_gather(interpreter_backend, monkeypatch):
    """_transpose_weights' closed form against the sums over the taps that read each pixel after the
    reflection (reflect's rule: -1 -> 1, H -> H - 2), for every pixel of every size H = 2 ... 40."""
    import triton
    import triton.language as tl
    from convfirstnet.kernels.mbconv.blur_backward import _transpose_weights

    monkeypatch.setitem(globals(), "_transpose_weights", _transpose_weights)  # the interpreter's globals

    @triton.jit
    def weights(out_ptr, H: tl.constexpr):
        i = tl.arange(0, 64)
        w0, w1 = _transpose_weights(i, H)
        tl.store(out_ptr + i, w0, mask=i < H)
        tl.store(out_ptr + 64 + i, w1, mask=i < H)

    def reflect(i, h):
        i = -i if i < 0 else i
        return 2 * h - 2 - i if i >= h else i

    for h in range(2, 41):
        got = torch.zeros(2, 64)
        weights[(1,)](got, H=h)
        want = torch.zeros(2, 64)
        for i in range(h):
            for e in range(2):
                oh = i // 2 + e
                if oh < (h + 1) // 2:
                    want[e, i] = sum((1, 2, 1)[dh] / 4 for dh in range(3) if reflect(2 * oh + dh - 1, h) == i)
        assert torch.equal(got, want), h


def test_bad_input_raises_before_any_launch(triton_backend):
    """Shapes, dtypes and layouts the kernels cannot take: one ValueError line each, nothing launched
    (meta tensors: a launch would fail otherwise)."""
    from convfirstnet.kernels.mbconv.blur_backward import blur_bn_d_backward, blur_bn_d_sums, blur_gate_input

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    f16 = torch.float16
    d, dg = t(2 * 7 * 5, 64, dtype=f16), t(2 * 4 * 3, 64, dtype=f16)
    v = [t(64) for _ in range(4)]
    cases = [
        lambda: blur_gate_input(d, *v, 3, 7, 5),  # 70 pixels are not 3 images of 7 x 5
        lambda: blur_gate_input(t(2, 64, dtype=f16), *v, 2, 1, 1),  # 1 x 1 maps: no reflect padding
        lambda: blur_gate_input(d.to(torch.int32), *v, 2, 7, 5),  # an integer map
        lambda: blur_gate_input(d, t(64, dtype=f16), *v[1:], 2, 7, 5),  # a 16-bit statistic
        lambda: blur_gate_input(d, *v[:2], t(32), v[3], 2, 7, 5),  # gamma's shape
        lambda: blur_gate_input(t(64, 70, dtype=f16).t(), *v, 2, 7, 5),  # d not row-major
        lambda: blur_bn_d_sums(t(2 * 4 * 4, 64, dtype=f16), d, *v, 2, 7, 5),  # dg not at ceil(H / 2)
        lambda: blur_bn_d_sums(dg.float(), d, *v, 2, 7, 5),  # dg in another dtype
        lambda: blur_bn_d_backward(dg, d, *v, t(64), t(32), 2, 7, 5),  # sum dy u_hat's shape
        lambda: blur_bn_d_backward(dg, d, *v, t(64), t(64, dtype=f16), 2, 7, 5),  # a 16-bit sum
    ]
    for case in cases:
        with pytest.raises(ValueError, match="blur_backward"):
            case()


# ------------------------------------------------------------------------------------------------ sm_90


SMALL_256 = ((32, 384), (16, 1024))  # (side of d, R) of stages.3.0 and stages.4.0 at a 256 x 256 input
SMALL_224 = ((28, 384), (14, 1024))  # at 224 x 224, the training size (row tiles of 16 + 12 pixels)


def record_small(dtype=torch.float16, blocks=SMALL_256) -> list:
    """The launches of the three passes at fused Small's stride-2 blocks on meta tensors, batch 128."""
    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels.mbconv.blur_backward import blur_bn_d_backward, blur_bn_d_sums, blur_gate_input

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    launches = []
    for side, r in blocks:
        n = 128
        d, dg = t(n * side * side, r, dtype=dtype), t(n * side * side // 4, r, dtype=dtype)
        v = [t(r) for _ in range(4)]
        with recording(sms=132, l2_bytes=50 * 2**20) as rec:
            blur_gate_input(d, *v, n, side, side)
            sums = blur_bn_d_sums(dg, d, *v, n, side, side)
            blur_bn_d_backward(dg, d, *v, *sums, n, side, side)
        launches += rec.launches
    return launches


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_small_blur_backward_compiles_for_sm90(dtype):
    """Every launch at Small's two stride-2 blocks (256 x 256 input; fp16 also at 224 x 224) compiles for
    sm_90 with no stack (no spills, no local memory), each pass's grid fills the 132 SMs; the stencil
    kernels' tile loops are pipelined: their taps and tiles load as 16-byte cp.async that bypasses L1
    (LDGSTS.E.BYPASS.128, which the cost declarations count in full as L2 traffic: no L1 working set
    declared), and their stores are 16-byte. (Compiled, fp16 and bf16 alike: _blur_gate_kernel 64
    registers, _blur_bn_d_kernel MODE 0 128, MODE 1 96, the merge 64; 36-41 KB of shared memory.)"""
    pytest.importorskip("triton")
    from convfirstnet.analysis.compiled import compile_variants, variant_of
    from convfirstnet.analysis.launches import kernel_name

    blocks = SMALL_256 + (SMALL_224 if dtype == torch.float16 else ())
    launches = record_small(dtype, blocks)
    names = [kernel_name(lc).rsplit(".", 1)[1] for lc in launches]
    assert names == ["_blur_gate_kernel", "_blur_bn_d_kernel", "_wgrad_reduce_kernel",
                     "_blur_bn_d_kernel"] * len(blocks)
    variants, first, problems = {}, {}, []
    for lc in launches:
        if lc.kernel is not launches[2].kernel and lc.grid[0] * lc.grid[1] < 132:
            problems.append(f"{kernel_name(lc)}: grid {lc.grid}")
        v = variant_of(lc, 90)
        variants.setdefault(v.key, v)
        first.setdefault(v.key, lc)
    for comp in compile_variants(list(variants.values())):
        where = f"{comp.variant.name} {dict(comp.variant.meta)}"
        if comp.stack:
            problems.append(f"{where}: {comp.stack} B stack")
        opcodes = {i.opcode for i in comp.listing()[0]}
        if any(op.startswith(("LDL", "STL")) for op in opcodes):
            problems.append(f"{where}: local memory")
        if comp.variant.name != "_wgrad_reduce_kernel":
            cost = first[comp.variant.key].cost
            loads = {op for op in opcodes if op.startswith("LDG")}
            if "LDGSTS.E.BYPASS.128" not in loads:
                problems.append(f"{where}: loads {sorted(loads)}")
            if cost.l1_working_set_bytes or cost.l1_unique_bytes_per_program:
                problems.append(f"{where}: an L1 working set declared for loads that bypass L1")
            if "STG.E.128" not in opcodes and comp.variant.meta.get("MODE") != 0:
                problems.append(f"{where}: no 16-byte stores")
    assert not problems, "\n".join(problems)
