"""torch.ops.convfirstnet.stem: the Triton kernel (interpreter on CPU) against the fp32 reference.

Run: pytest tests/kernels/test_stem.py --durations=10
"""

import pytest
import torch
from convfirstnet.kernels.stem import kernel as S
from convfirstnet.kernels.stem.reference import stem_reference

from tests.kernels._convfirst_util import SMEM_LIMIT, compile_all_in_subprocess, nan_banded

# dtype -> (atol, rtol). The stem reduces only 27 products in fp32 on both sides, so the kernel and
# the reference differ by summation order (27 * 2^-24 relative) and then, for 16-bit dtypes, by at
# most one ulp of the output dtype when the two fp32 sums straddle a rounding boundary (1 ulp =
# 2^-10 relative in fp16, 2^-7 in bf16). Outputs are O(1-5); rtol = 1 ulp plus a small atol.
# (The stem has no tl.dot, so bf16 is exact in the interpreter too and is tested on CPU.)
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}
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


def run_and_check(x, w, b):
    out = torch.ops.convfirstnet.stem(x, w, b)
    ref = stem_reference(x, w, b)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@MEMORY_FORMATS
@pytest.mark.parametrize("n,h,w,c0", [
    (1, 7, 7, 16),     # odd map, one partial tile
    (2, 13, 17, 24),   # odd H and W, 24 -> 32 padded channels
    (3, 16, 23, 32),   # 3 x 8 x 12 = 288 output pixels: three BLOCK_M = 128 tiles, the last partial
])
def test_matches_reference(interpreter_backend, n, h, w, c0, memory_format, dtype):
    x = make_image(n, h, w, dtype).contiguous(memory_format=memory_format)
    run_and_check(x, *make_stem(c0, dtype))


@MEMORY_FORMATS
def test_strided_view_in_nan_buffer(interpreter_backend, memory_format):
    x = nan_banded(make_image(2, 9, 12, torch.float32), memory_format)
    out = run_and_check(x, *make_stem(16, torch.float32))
    assert torch.isfinite(out).all()


def test_batch_zero_and_one(interpreter_backend):
    w, b = make_stem(16, torch.float32)
    out = torch.ops.convfirstnet.stem(torch.empty(0, 3, 9, 9), w, b)
    assert out.shape == (0, 16, 5, 5) and out.is_contiguous(memory_format=torch.channels_last)
    run_and_check(make_image(1, 1, 2, torch.float32), w, b)  # a 1x2 image: every tap but one masked


def test_rejects_unsupported_before_launch(interpreter_backend):
    w, b = make_stem(136, torch.float32)
    with pytest.raises(ValueError, match="output channels"):
        torch.ops.convfirstnet.stem(make_image(1, 8, 8, torch.float32), w, b)
    w, b = make_stem(16, torch.float32)
    with pytest.raises(ValueError, match="channels"):
        torch.ops.convfirstnet.stem(make_image(1, 8, 8, torch.float32, c_in=4), w, b)


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


@needs_cuda
@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu(triton_backend):
    torch._dynamo.reset()
    w, b = make_stem(24, torch.float16, "cuda")
    x = make_image(2, 65, 47, torch.float16, "cuda")
    fn = lambda t: torch.ops.convfirstnet.stem(t, w, b)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x), fn(x), atol=0, rtol=0)


@pytest.fixture(scope="module")
def gpu_builds():
    return compile_all_in_subprocess("stem")


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 80], ids=["sm90", "sm80"])
def test_shipped_configs_compile_for_gpu(gpu_builds, arch):
    rows = [row for row in gpu_builds if row["arch"] == arch]
    assert len(rows) == 3 * len(S.shipped_configs())
    failed = [f"{r['name']} {r['dtype']}: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert all(r["shared"] <= SMEM_LIMIT[arch] for r in rows), rows


@needs_cuda
@pytest.mark.gpu
@MEMORY_FORMATS
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize("c0", [16, 24, 32])
def test_paper_shape_gpu(triton_backend, monkeypatch, c0, dtype, memory_format):
    """Batch 128 at 256x256 (the paper's inference resolution) vs the fp32 reference."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x = make_image(128, 256, 256, dtype, "cuda").contiguous(memory_format=memory_format)
    w, b = make_stem(c0, dtype, "cuda")
    out = torch.ops.convfirstnet.stem(x, w, b)
    ref = stem_reference(x.float(), w.float(), b.float())
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
