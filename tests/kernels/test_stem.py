"""torch.ops.convfirstnet.stem: the Triton kernel (interpreter on CPU) against the fp32 reference, and
its compiled form for sm_90 / sm_80.

Interpreter shapes cross every mask and index path of the kernel: odd maps, tiles of several output
rows (BW < 128) with a partial last row block, rows wider than one tile (two column tiles per row),
1x1 and 1x2 images, batch 0 and 1, NCHW, NHWC and strided views (the general-stride path), strided
weights (the non-contiguous weight path), 1 and 4 input channels (one and two im2col tiles).
Run: pytest tests/kernels/test_stem.py --durations=10
"""

import pytest
import torch
from convfirstnet.kernels.stem import launcher as S
from convfirstnet.kernels.stem.reference import stem_reference

from tests.kernels._convfirst_util import nan_banded
from tests.kernels._recorded import SMEM_LIMIT, bounds, compile_launches, record

# dtype -> (atol, rtol). Kernel and reference both form the 27 products exactly in fp32 (fp16/bf16
# products are exact; the interpreter computes fp32 dots exactly; on the GPU fp32 uses 3xTF32, whose
# dropped low x low term is ~2^-21 relative per product) and sum them in different orders: ~27 * 2^-24
# relative, ~1e-6 absolute for outputs of O(1-5). fp32: 1e-5. fp16/bf16: the two fp32 sums then round
# to the same value or to neighbours (one ulp: 2^-10 relative in fp16, 2^-7 in bf16), hence rtol of
# one ulp and an atol far below it. A wrong tap or mask changes outputs by O(0.1).
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-5, 2**-10),
    torch.bfloat16: (1e-5, 2**-7),
}
# On the GPU the tensor cores' fp32 accumulation truncates (Fasi et al., "Numerical behavior of NVIDIA
# tensor cores", 2021): up to one ulp per 8-product K step, 4 steps x 3 tf32x3 passes x 2^-23 x |out|
# <= 5: 7e-6 in fp32; fp16/bf16 outputs then round as above.
GPU_TOL = {**TOL, torch.float32: (3e-5, 1e-5)}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MEMORY_FORMATS = pytest.mark.parametrize(
    "memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"]
)


def make_stem(c0, dtype, device="cpu", c_in=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(c0, c_in, 3, 3, generator=g) * (9 * c_in) ** -0.5
    b = torch.randn(c0, generator=g) * 0.1
    return w.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


def make_image(n, h, w, dtype, device="cpu", c_in=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c_in, h, w, generator=g).to(device=device, dtype=dtype)


def run_and_check(x, w, b, tol=TOL):
    out = torch.ops.convfirstnet.stem(x, w, b)
    ref = stem_reference(x, w, b)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = tol[x.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out


# (N, H, W, C0) -> output HO x WO, tiles (rows x BW) per image, programs
SHAPES = [
    (1, 7, 7, 16),  # 4x4: one 32x4 tile, 28 of its rows masked
    (2, 13, 17, 24),  # 7x9: one 8x16 tile per image, odd H and W; C0 24 padded to 32
    (1, 40, 17, 32),  # 20x9: three 8x16 tiles one below the other (the last one partial), one program
    (2, 11, 260, 32),  # 6x130: 1x128 tiles, two per row; 4 + 2 tile rows per column: 4 programs per image
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@MEMORY_FORMATS
@pytest.mark.parametrize("n,h,w,c0", SHAPES, ids=str)
def test_matches_reference(interpreter_backend, n, h, w, c0, memory_format, dtype):
    """The model widths C0 = 16, 24, 32 (bf16 is checked on the GPU and by the sm_90 / sm_80 compile:
    the interpreter's bf16 tl.dot is wrong)."""
    x = make_image(n, h, w, dtype).contiguous(memory_format=memory_format)
    run_and_check(x, *make_stem(c0, dtype))


@MEMORY_FORMATS
@pytest.mark.parametrize("c_in", [1, 4])
def test_other_input_channels(interpreter_backend, c_in, memory_format):
    """9 taps (one im2col tile, K padded 9 -> 32) and 36 taps (two tiles: taps 32..35 in the second)."""
    x = make_image(2, 11, 9, torch.float32, c_in=c_in).contiguous(memory_format=memory_format)
    run_and_check(x, *make_stem(24, torch.float32, c_in=c_in))


@MEMORY_FORMATS
def test_strided_view_in_nan_buffer(interpreter_backend, memory_format):
    """A view inside a NaN buffer (padded strides: the general-stride path); an unmasked read of a
    neighbouring pixel, channel or image would poison the output."""
    x = nan_banded(make_image(2, 9, 12, torch.float32), memory_format)
    out = run_and_check(x, *make_stem(16, torch.float32))
    assert torch.isfinite(out).all()


def test_strided_weight_and_bias(interpreter_backend):
    """Weights not in (C0, C_IN, 3, 3) contiguous order (the kernel then reads them through their strides)."""
    x = make_image(1, 9, 10, torch.float32)
    w, b = make_stem(32, torch.float32)
    tap_major = w.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # same values, (o, kh, kw, c) memory
    assert not tap_major.is_contiguous()
    run_and_check(x, tap_major, b)
    nan = float("nan")
    # every other element of a NaN-interleaved buffer
    w2, b2 = (torch.stack([t, torch.full_like(t, nan)], dim=-1)[..., 0] for t in (w, b))
    assert torch.isfinite(run_and_check(x, w2, b2)).all()


def test_batch_zero_and_one_and_tiny_images(interpreter_backend):
    w, b = make_stem(16, torch.float32)
    out = torch.ops.convfirstnet.stem(torch.empty(0, 3, 9, 9), w, b)
    assert out.shape == (0, 16, 5, 5) and out.is_contiguous(memory_format=torch.channels_last)
    for h, wd in ((1, 1), (1, 2), (2, 1), (3, 3)):  # every tap but the centre row/column masked
        run_and_check(make_image(1, h, wd, torch.float32), w, b)


def test_rejects_unsupported_before_launch(interpreter_backend):
    w, b = make_stem(136, torch.float32)
    with pytest.raises(ValueError, match="output channels"):
        torch.ops.convfirstnet.stem(make_image(1, 8, 8, torch.float32), w, b)
    w, b = make_stem(16, torch.float32, c_in=17)
    with pytest.raises(ValueError, match="17 -> 16"):
        torch.ops.convfirstnet.stem(make_image(1, 8, 8, torch.float32, c_in=17), w, b)
    w, b = make_stem(16, torch.float32)
    with pytest.raises(ValueError, match="channels"):
        torch.ops.convfirstnet.stem(make_image(1, 8, 8, torch.float32, c_in=4), w, b)


def test_batch_past_the_grid_limit_is_refused():
    """All programs are in grid.x (at most 2^31 - 1): one per 4 tiles of 128 output pixels, so 2^18
    images of 4096x4096 (2048 x 16 tiles each) need 2^31. The op refuses them before any launch
    (checked while recording launches on meta tensors: nothing is allocated even if the check were
    missing)."""
    w, b = (t.to("meta") for t in make_stem(16, torch.float16))
    x = torch.empty(2**18, 3, 4096, 4096, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="grid limit"):
        record(lambda: torch.ops.convfirstnet.stem(x, w, b))
    (launch,) = record(lambda: torch.ops.convfirstnet.stem(x[: 2**18 - 1], w, b))
    assert launch.grid == ((2**18 - 1) * 512 * 16,)


def test_torch_compile_fullgraph_cpu(reference_backend):
    """CPU: the op's reference branch compiles in one graph. (The Triton branch cannot be traced
    under TRITON_INTERPRET: wrap_triton runs interpreted kernels eagerly on fake tensors.)"""
    torch._dynamo.reset()
    w, b = make_stem(16, torch.float32)
    x = make_image(1, 9, 9, torch.float32)

    def f(t):
        return torch.ops.convfirstnet.stem(t, w, b) * 2

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, stem_reference(x, w, b) * 2, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The compiled kernel: every shipped configuration for sm_90 and sm_80, recorded through the launcher
# ---------------------------------------------------------------------------------------------
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _shipped_cases():
    """(name, C0, dtype, layout, contiguous weight) at the model shapes, batch 128 at 256x256 (the cost
    figures): the three widths in fp16 NHWC (the models' path), C0 = 32 in NCHW and in bf16 / fp32 (the
    other layout and dtypes: same tiles), fp32 at C0 = 24 (the most registers), and a strided weight."""
    return [(f"c{c0}-fp16-nhwc", c0, "fp16", "nhwc", True) for _, c0 in S.MODEL_SHAPES] + [
        ("c32-fp16-nchw", 32, "fp16", "nchw", True),
        ("c32-bf16-nhwc", 32, "bf16", "nhwc", True),
        ("c32-fp32-nhwc", 32, "fp32", "nhwc", True),
        ("c24-fp32-nhwc", 24, "fp32", "nhwc", True),
        ("c32-fp16-nhwc-strided-w", 32, "fp16", "nhwc", False),
    ]


SHIPPED = _shipped_cases()


@pytest.fixture(scope="module")
def compiled_stem():
    pytest.importorskip("triton")
    launches = []
    for _, c0, dtype, layout, contiguous_w in SHIPPED:
        w, b = make_stem(c0, DTYPES[dtype], "meta")
        if not contiguous_w:
            w = w.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
        x = torch.empty(128, 3, 256, 256, device="meta", dtype=DTYPES[dtype]).contiguous(memory_format=fmt)
        (launch,) = record(lambda: torch.ops.convfirstnet.stem(x, w, b))
        launches.append(launch)
    return launches, compile_launches(launches)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 80], ids=["sm90", "sm80"])
@pytest.mark.parametrize("case", SHIPPED, ids=[c[0] for c in SHIPPED])
def test_shipped_configs_compile_for_gpu(compiled_stem, case, arch):
    """No spills, shared memory within the target's limit, the dot on tensor cores."""
    launches, compiled = compiled_stem
    c = compiled[(SHIPPED.index(case), arch)]
    assert c.stack == 0, f"{c.stack} B of stack per thread (spills), {c.regs} registers"
    assert c.shared <= SMEM_LIMIT[arch]
    assert c.mma_kind == ("wgmma" if arch == 90 else "mma.sync")
    if case[3] == "nhwc" and case[4]:
        assert c.variant.meta["NHWC"] and c.variant.meta["W_CONTIG"]


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("c0", [c0 for _, c0 in S.MODEL_SHAPES])
def test_issue_estimate_below_dram_bound(compiled_stem, c0):
    """Batch 128, 256x256, fp16, NHWC on sm_90: the kernel is memory bound by design, so the issue
    estimate from its SASS (instructions x programs x warps / 4 per clock on 132 SMs) must stay well
    under the DRAM bound (C0 = 32: ~31 us against 55 us; the previous kernel: ~148 us)."""
    launches, compiled = compiled_stem
    i = next(i for i, c in enumerate(SHIPPED) if c[0] == f"c{c0}-fp16-nhwc")
    t = bounds(launches[i], compiled[(i, 90)])
    assert launches[i].cost.useful_macs == 128 * 128 * 128 * c0 * 27
    assert t["issue"] <= 0.75 * t["dram"], (
        f"{t['per_warp']} instructions per warp: issue {t['issue'] * 1e6:.1f} us, "
        f"DRAM {t['dram'] * 1e6:.1f} us"
    )
    assert t["tensor"] < 0.2 * t["dram"]


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_tf32(monkeypatch):
    """The fp32 reference must be fp32: cuDNN and cuBLAS may use TF32 (10-bit mantissa) otherwise."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@needs_cuda
@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu(triton_backend):
    torch._dynamo.reset()
    w, b = make_stem(24, torch.float16, "cuda")
    x = make_image(2, 65, 47, torch.float16, "cuda")

    def fn(t):
        return torch.ops.convfirstnet.stem(t, w, b)

    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


@needs_cuda
@pytest.mark.gpu
@MEMORY_FORMATS
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize("c0", [16, 24, 32])
def test_paper_shape_gpu(triton_backend, no_tf32, c0, dtype, memory_format):
    """Batch 128 at 256x256 (the paper's inference resolution) vs the fp32 reference."""
    x = make_image(128, 256, 256, dtype, "cuda").contiguous(memory_format=memory_format)
    w, b = make_stem(c0, dtype, "cuda")
    out = torch.ops.convfirstnet.stem(x, w, b)
    ref = stem_reference(x.float(), w.float(), b.float())
    atol, rtol = GPU_TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_odd_shapes_gpu(triton_backend, no_tf32, dtype):
    """The interpreter's shapes on the GPU, bf16 included (and a strided weight)."""
    for n, h, w, c0 in SHAPES:
        for fmt in (torch.contiguous_format, torch.channels_last):
            x = make_image(n, h, w, dtype, "cuda").contiguous(memory_format=fmt)
            run_and_check(x, *make_stem(c0, dtype, "cuda"), tol=GPU_TOL)
    wt, b = make_stem(32, dtype, "cuda")
    tap_major = wt.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    run_and_check(make_image(2, 9, 10, dtype, "cuda"), tap_major, b, tol=GPU_TOL)
