"""torch.ops.convfirstnet.head: Triton kernel (interpreter on CPU) against the PyTorch reference.

Shapes cross the masks: F = 200 (a partial 128-feature block), 81 pixels (two 64-pixel blocks with
a 17-pixel tail), 1x1 maps, C = 24 (a partial 32-channel K step), batch 0 and 1.
"""

import pytest
import torch
from convfirstnet.kernels.head.reference import head_reference

from ..conftest import cuda
from .test_mbconv import SHARED_LIMIT, compile_for_gpu, trace_triton_branch

# dtype -> (atol, rtol). The output is a mean of SiLU values of magnitude ~0.3-1. fp32: same
# fp32 math in another summation order over C <= 256 products and H*W <= 4096 pixels (~1e-6
# relative); 1e-4 leaves room for GPU FMA contraction. fp16: operands are the same fp16 values,
# accumulation is fp32, so the error is the fp16 rounding of the stored mean (4.9e-4 relative)
# plus summation order (measured: max 2.4e-4 at |out| <= 0.65): 2e-3. bf16 (GPU only): 8x
# coarser rounding of the output: 1.6e-2.
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def make_head(n, c, h, w, f=1280, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen).to(device=device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(f, c, generator=gen) / c**0.5).to(device=device, dtype=dtype)
    bias = (torch.randn(f, generator=gen) * 0.1).to(device=device, dtype=dtype)
    return x, weight, bias


def check(x, weight, bias):
    out = torch.ops.convfirstnet.head(x, weight, bias)
    ref = head_reference(x, weight, bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    return out


SHAPES = [  # (N, C, H, W, F)
    (1, 16, 1, 1, 200),  # one pixel; F = 200 masks half of the second feature block
    (2, 48, 5, 7, 1280),  # the real F, odd map
    (1, 24, 9, 9, 128),  # 81 pixels: two pixel blocks; C = 24 masks the K step
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_matches_reference(interpreter_backend, shape, dtype):
    n, c, h, w, f = shape
    check(*make_head(n, c, h, w, f, dtype=dtype))


def test_nchw_input_and_no_reads_outside_the_view(interpreter_backend):
    x, weight, bias = make_head(1, 16, 5, 7, 256)
    check(x.contiguous(), weight, bias)
    big = torch.full((3, 20, 7, 9), float("nan"))  # NCHW buffer: the view is neither layout
    view = big[1:2, 2:18, 1:6, 1:8]
    view.copy_(x)
    assert torch.isfinite(check(view, weight, bias)).all()


def test_strided_weight_and_bias(interpreter_backend):
    x, weight, bias = make_head(1, 16, 5, 7, 256)
    # every other element of a NaN-interleaved buffer: unit strides would read the NaNs
    weight, bias = (torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0] for t in (weight, bias))
    assert torch.isfinite(check(x, weight, bias)).all()


def test_batch_zero_returns_empty(interpreter_backend):
    x, weight, bias = make_head(0, 16, 4, 4, 256)
    out = torch.ops.convfirstnet.head(x, weight, bias)
    assert out.shape == (0, 256) and out.dtype == x.dtype


def test_invalid_input_raises(interpreter_backend):
    x, weight, bias = make_head(1, 16, 4, 4, 256)
    with pytest.raises(ValueError, match="channels"):
        torch.ops.convfirstnet.head(x[:, :8], weight, bias)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.convfirstnet.head(x.half(), weight, bias)


def test_torch_compile_traces_triton_branch():
    """torch.compile(fullgraph=True) captures the head as one user-defined kernel (CPU trace; see
    test_mbconv.test_torch_compile_fullgraph_reference_on_cpu for why not in the interpreter)."""
    pytest.importorskip("triton")
    targets = trace_triton_branch("head", [2, 16, 5, 7, 200])
    assert targets.count("triton_kernel_wrapper_functional") == 1, targets


def _head_cases():
    try:
        from convfirstnet.kernels.head.kernel import shipped_variants
    except ImportError:  # triton missing: nothing to compile
        return []
    return [
        dict(module="convfirstnet.kernels.head.kernel", kernel="_head_kernel",
             meta=dict(meta, PREC="tf32x3" if dtype == "float32" else "tf32"), dtype=dtype, arch=arch,
             fp32_pointers=[])
        for meta in shipped_variants()
        for dtype in ("float16", "bfloat16", "float32")
        for arch in (90, 80)
    ]


HEAD_CASES = _head_cases()


def _case_id(case):
    m = case["meta"]
    variant = f"P{m['BLOCK_P']}-F{m['BLOCK_F']}-C{m['BLOCK_C']}-w{m['num_warps']}"
    return f"{variant}-{case['dtype']}-sm{case['arch']}"


@pytest.fixture(scope="module")
def head_compiled():
    pytest.importorskip("triton")
    return dict(zip(map(_case_id, HEAD_CASES), compile_for_gpu(HEAD_CASES)))


@pytest.mark.parametrize("case", HEAD_CASES, ids=_case_id)
def test_compiles_for_gpu(head_compiled, case):
    """Every shipped head variant compiles for sm_90 and sm_80 and fits in shared memory."""
    shared = head_compiled[_case_id(case)]
    assert isinstance(shared, int), shared
    assert shared <= SHARED_LIMIT[case["arch"]], f"{shared} B of shared memory on sm_{case['arch']}"


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(128, 128, 8, 8), (128, 256, 8, 8), (256, 192, 16, 16), (3, 160, 1, 1)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_paper_shapes_on_gpu(triton_backend, shape, dtype):
    check(*make_head(*shape, dtype=dtype, device="cuda"))


@cuda
@pytest.mark.gpu
def test_torch_compile_fullgraph_on_gpu(triton_backend):
    x, weight, bias = make_head(16, 256, 8, 8, dtype=torch.float16, device="cuda")

    def head(t):
        return torch.ops.convfirstnet.head(t, weight, bias)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(head, fullgraph=True)(x), head(x), atol=2e-3, rtol=2e-3)
