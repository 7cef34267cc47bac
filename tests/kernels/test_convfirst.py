"""torch.ops.convfirstnet.convfirst: Triton kernels (interpreter on CPU) against the fp32 reference.

Run: pytest tests/kernels/test_convfirst.py --durations=10
(conftest sets TRITON_INTERPRET=1 when there is no CUDA device; `triton_backend` selects the kernels.)
"""

import pytest
import torch
from convfirstnet.kernels.convfirst import kernel as K
from convfirstnet.kernels.convfirst.reference import convfirst_reference

from tests.kernels._convfirst_util import SMEM_LIMIT, compile_all_in_subprocess, nan_banded

# dtype -> (atol, rtol) for outputs of O(1-5) magnitude (x ~ N(0, 1), fan-in scaled weights).
# fp32: the interpreter's dots are exact fp32; GPU dots use 3xTF32 (products split into tf32
#   hi + lo parts, relative error per product ~2^-22). Summation order differs from the reference over
#   at most 9*8 + 2C + R < 800 terms of O(1): a linear worst case of 800 * 2^-22 ~ 2e-4, a random
#   walk ~1e-5. So atol 2e-4, rtol 2e-5 (interpreter errors observed: < 1e-6).
# fp16: both sides see the same fp16 inputs; the kernel additionally rounds y (conv output) and the
#   hidden tile to fp16 before their dots (unit roundoff 2^-11 = 4.9e-4, propagated through
#   unit-gain fan-in scaled layers) and the output is rounded to fp16 (half an ulp = 2e-3 at 4).
#   Observed max error ~2e-3 at |out| ~ 4; atol 5e-3 + rtol 5e-3 allows ~6 ulp at |out| = 4.
# bf16: the same three roundings with unit roundoff 2^-8 (8x fp16): atol 4e-2, rtol 2e-2.
TOL = {
    torch.float32: (2e-4, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (4e-2, 2e-2),
}
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 dots are wrong in the interpreter)"
)
ALL_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)


def make_block(c, r, k, stride, dtype, device="cpu", seed=0):
    """Folded-BN-like weights: fan-in scaled (unit gain), small biases."""
    g = torch.Generator().manual_seed(seed)
    c1 = c if stride == 1 else 2 * c

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    return dict(
        w_conv=rnd(c, 8, 3, 3, scale=72 ** -0.5), b_conv=rnd(c, scale=0.1),
        w1=rnd(r, c1, scale=c1 ** -0.5), b1=rnd(r, scale=0.1),
        w2=rnd(k, r, scale=(r / 2) ** -0.5), b2=rnd(k, scale=0.1),  # ReLU halves the variance
    )


def make_input(n, c, h, w, dtype, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, w, generator=g).to(device=device, dtype=dtype)


def run_and_check(x, p, stride):
    out = torch.ops.convfirstnet.convfirst(x, *p.values(), stride)
    ref = convfirst_reference(x, *p.values(), stride)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out


# (N, C, H, W, R, K, stride): odd sizes, a tile border inside the map (BLOCK_M = 128 for C <= 32,
# 64 above), padded channel counts (24 -> 32, 48 -> 64, 72 -> 128), a hidden width that is not a
# multiple of BLOCK_H = 64 (72, 144, 432), reflection on both borders (odd and even H, W).
SHAPES = [
    pytest.param(1, 16, 7, 7, 48, 16, 1, id="s1-c16-7x7"),
    pytest.param(2, 16, 9, 10, 48, 16, 1, id="s1-c16-2x9x10-two-tiles"),
    pytest.param(1, 24, 13, 17, 72, 24, 1, id="s1-c24-13x17"),
    pytest.param(1, 72, 5, 6, 432, 72, 1, id="s1-c72-t6"),
    pytest.param(3, 16, 13, 17, 96, 32, 2, id="s2-c16-k32-3x13x17-two-tiles"),
    pytest.param(1, 24, 7, 9, 144, 48, 2, id="s2-c24-k48-7x9"),
    pytest.param(1, 48, 6, 8, 288, 72, 2, id="s2-c48-k72-6x8"),
    pytest.param(2, 16, 2, 3, 96, 32, 2, id="s2-c16-smallest-map"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,c,h,w,r,k,stride", SHAPES)
def test_matches_reference(interpreter_backend, n, c, h, w, r, k, stride, dtype):
    x = make_input(n, c, h, w, dtype).contiguous(memory_format=torch.channels_last)
    run_and_check(x, make_block(c, r, k, stride, dtype), stride)


@pytest.mark.parametrize(
    "memory_format", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"]
)
@pytest.mark.parametrize("stride,k", [(1, 24), (2, 48)], ids=["s1", "s2"])
def test_strided_inputs_and_masks(interpreter_backend, stride, k, memory_format):
    """Non-contiguous views (NCHW or NHWC strides) inside a NaN-filled buffer: any unmasked read
    outside the tensor or any stride mistake shows up as NaN or a mismatch."""
    x = nan_banded(make_input(2, 24, 7, 9, torch.float32), memory_format)
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    out = run_and_check(x, make_block(24, 6 * 24, k, stride, torch.float32), stride)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("stride,k", [(1, 16), (2, 32)], ids=["s1", "s2"])
def test_batch_zero_returns_empty(interpreter_backend, stride, k):
    x = torch.empty(0, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    out = torch.ops.convfirstnet.convfirst(x, *make_block(16, 48, k, stride, torch.float32).values(), stride)
    ho = 9 if stride == 1 else 5
    assert out.shape == (0, k, ho, ho) and out.is_contiguous(memory_format=torch.channels_last)


def test_rejects_unsupported_before_launch(interpreter_backend):
    x = make_input(1, 12, 5, 5, torch.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        torch.ops.convfirstnet.convfirst(x, *make_block(12, 36, 12, 1, torch.float32).values(), 1)
    x = make_input(1, 136, 5, 5, torch.float32)
    with pytest.raises(ValueError, match="at most 128"):
        torch.ops.convfirstnet.convfirst(x, *make_block(136, 136, 136, 1, torch.float32).values(), 1)
    x = make_input(1, 16, 5, 5, torch.float32)
    with pytest.raises(ValueError, match="stride must be 1 or 2"):
        torch.ops.convfirstnet.convfirst(x, *make_block(16, 48, 16, 1, torch.float32).values(), 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only guard")
def test_bf16_refused_in_interpreter(interpreter_backend):
    x = make_input(1, 16, 5, 5, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="interpreter"):
        torch.ops.convfirstnet.convfirst(x, *make_block(16, 48, 16, 1, torch.bfloat16).values(), 1)


def test_config_table_covers_model_shapes():
    for c, r, k, stride in K.MODEL_SHAPES:
        cfg = K.convfirst_config(c, k, stride)
        assert cfg.c_pad >= c and cfg.k_pad >= k and cfg.c_pad >= 16 and cfg.k_pad >= 16
        assert cfg.block_m in (64, 128) and cfg.block_h == 64 and cfg.num_warps in (4, 8)
        assert r % 8 == 0  # masked tail of the hidden loop is exercised separately (SHAPES)
    assert {cfg.stride for cfg in K.shipped_configs()} == {1, 2}


def _two_blocks(device):
    p = make_block(16, 48, 16, 1, torch.float32, device)
    p2 = make_block(16, 96, 32, 2, torch.float32, device)

    def f(x):
        y = torch.ops.convfirstnet.convfirst(x, *p.values(), 1)
        return torch.ops.convfirstnet.convfirst(y, *p2.values(), 2)

    def ref(x):
        return convfirst_reference(convfirst_reference(x, *p.values(), 1), *p2.values(), 2)

    return f, ref


def test_torch_compile_fullgraph_cpu(reference_backend):
    """On CPU torch.compile traces the op's reference branch in one graph.

    The Triton branch cannot be compiled on CPU: under TRITON_INTERPRET the kernel is an interpreted
    function, which wrap_triton runs eagerly on fake tensors while tracing ("Cannot access data
    pointer of Tensor"), so the traced Triton path is checked on a GPU (test below)."""
    torch._dynamo.reset()
    f, ref = _two_blocks("cpu")
    x = make_input(1, 16, 7, 7, torch.float32).contiguous(memory_format=torch.channels_last)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, ref(x), atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


@needs_cuda
@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu(triton_backend, monkeypatch):
    """Inductor sees the launches as user-defined Triton kernels: one graph, same result as eager."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch._dynamo.reset()
    f, ref = _two_blocks("cuda")
    x = make_input(2, 16, 33, 31, torch.float32, "cuda").contiguous(memory_format=torch.channels_last)
    out = torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(out, f(x), atol=0, rtol=0)
    torch.testing.assert_close(out, ref(x), atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


# ------------------------------------------------------------------------------------------------
# Every shipped kernel configuration compiles for the GPU (errors only ptxas / the GPU frontend
# report, e.g. K < 16 dots) and fits in shared memory. Runs on CPU.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_builds():
    return compile_all_in_subprocess("convfirst")


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 80], ids=["sm90", "sm80"])
def test_shipped_configs_compile_for_gpu(gpu_builds, arch):
    rows = [row for row in gpu_builds if row["arch"] == arch]
    assert len(rows) == sum(len(K.shipped_configs(d)) for d in K.DTYPES)
    failed = [f"{r['name']} {r['dtype']}: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    too_big = [f"{r['name']} {r['dtype']}: {r['shared']} B" for r in rows if r["shared"] > SMEM_LIMIT[arch]]
    assert not too_big, f"shared memory over {SMEM_LIMIT[arch]} B on sm_{arch}: {too_big}"


# ------------------------------------------------------------------------------------------------
# GPU only (skipped without CUDA): bf16, and the paper's shapes (batch 128) vs the fp32 reference.
# ------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,c,h,w,r,k,stride", SHAPES)
def test_bf16_matches_reference_gpu(triton_backend, monkeypatch, n, c, h, w, r, k, stride):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x = make_input(n, c, h, w, torch.bfloat16, "cuda").contiguous(memory_format=torch.channels_last)
    run_and_check(x, make_block(c, r, k, stride, torch.bfloat16, "cuda"), stride)


@needs_cuda
@pytest.mark.gpu
@ALL_DTYPES
@pytest.mark.parametrize("c,r,k,stride,hw", [
    # the paper's Table 1 shapes (batch 128) and the stride-2 blocks of Pico..Small at their resolutions
    (16, 48, 16, 1, 128), (32, 96, 32, 1, 128), (32, 192, 32, 1, 64), (48, 288, 48, 1, 64),
    (64, 384, 64, 1, 64), (48, 288, 48, 1, 32), (64, 384, 64, 1, 32), (96, 576, 96, 1, 32),
    (72, 432, 72, 1, 32), (24, 72, 24, 1, 128),
    (16, 96, 32, 2, 128), (24, 144, 48, 2, 128), (32, 192, 64, 2, 128),
    (32, 192, 48, 2, 64), (48, 288, 64, 2, 64), (48, 288, 72, 2, 64), (64, 384, 96, 2, 64),
])
def test_paper_shapes_gpu(triton_backend, monkeypatch, c, r, k, stride, hw, dtype):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # an exact fp32 reference
    x = make_input(128, c, hw, hw, dtype, "cuda").contiguous(memory_format=torch.channels_last)
    p = make_block(c, r, k, stride, dtype, "cuda")
    out = torch.ops.convfirstnet.convfirst(x, *p.values(), stride)
    # the fp32 reference on the dtype's inputs (the same rounded values the kernel sees)
    ref = convfirst_reference(x.float(), *(t.float() for t in p.values()), stride)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
