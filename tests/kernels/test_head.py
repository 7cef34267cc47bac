"""torch.ops.convfirstnet.head: Triton kernel (interpreter on CPU) against the PyTorch reference, and its
compiled form for sm_90 / sm_80.

Interpreter shapes run at the model widths C = 128 ... 256 with every loop of the kernel taken more
than once: the image loop (the SM count is patched down so that each program walks several images),
the pixel loop (81 pixels: two 64-pixel blocks, 47 padded pixels), both K parts (C = 160, 192, 256);
and cross every mask: F = 200 (a partial feature block), 1x1 and 5x7 maps (padded pixel blocks),
C = 24 and 200 (masked K parts), C = 288 and fp32 (the K loop), NCHW, NHWC and strided views,
strided weights, batch 0 and 1.
"""

import pytest
import torch
from convfirstnet.kernels._launch import DEFAULT_SMS
from convfirstnet.kernels.head import launcher as K
from convfirstnet.kernels.head.reference import head_reference

from ..conftest import cuda
from ._recorded import SMEM_LIMIT, bounds, compile_launches, record
from ._traced import trace_triton_branch

# dtype -> (atol, rtol) on the interpreter (exact SiLU formula). The output is a mean of SiLU values,
# |out| <= ~1. fp32: the same fp32 math in another order (C <= 256 products, <= 81 pixels) plus the
# kernel's SiLU as y / (1 + 2^(-y log2 e)) (a few ulp): ~1e-6 absolute; 2e-5 leaves room. fp16:
# identical fp16 operands, fp32
# accumulation, so the two fp32 means agree to ~1e-6 and their fp16 roundings to one ulp (2^-10
# relative). A dropped offset or a wrong divisor changes outputs by 1e-2 ... 1 (tried; see the notes
# in the kernel tests of this folder), the padded-pixel correction by ~SiLU(b) / (H*W) ~ 1e-3.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-5, 2**-10),
}
# On the GPU the tensor cores' fp32 accumulation truncates (measured on V100 ... A100: Fasi et al.,
# "Numerical behavior of NVIDIA tensor cores", 2021), up to one ulp per 8-product step: 32 steps x 2^-23
# at C = 256, ~2e-5 on |y| <= ~5, and tf32x3 (fp32) three times that, ~1.1e-5 |y|; the SiLU
# (kernels/_activations.py: ex2.approx and rcp.approx for fp16/bf16) adds ~2e-6 relative. SiLU' <= 1.1,
# so a mean over pixels is off by < 1e-4: atol 1e-4. fp16/bf16 round the output (rtol 2^-10 / 2^-7).
GPU_TOL = {
    torch.float32: (1e-4, 2e-5),
    torch.float16: (1e-4, 2**-10),
    torch.bfloat16: (1e-4, 2**-7),
}


def make_head(n, c, h, w, f=1280, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen).to(device=device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(f, c, generator=gen) / c**0.5).to(device=device, dtype=dtype)
    bias = (torch.randn(f, generator=gen) * 0.1).to(device=device, dtype=dtype)
    return x, weight, bias


def check(x, weight, bias, tol=TOL):
    out = torch.ops.convfirstnet.head(x, weight, bias)
    ref = head_reference(x, weight, bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    atol, rtol = tol[x.dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    return out


@pytest.fixture
def few_sms(monkeypatch):
    """Pretend the device has 10 SMs: 20 programs, i.e. 2 image groups of the 10 fp16 feature blocks
    (1 group of the 20 fp32 ones), so each program walks several images."""
    monkeypatch.setattr(K, "sm_count", lambda device: 10)


MODEL_SHAPES = [  # (N, C, H, W, F)
    (3, 256, 9, 9, 1280),  # K = 128 + 128; 81 pixels: two blocks; 2 + 1 images per program (fp16)
    (3, 160, 5, 7, 1280),  # K = 128 + 32; 35 pixels in a 64-pixel block
    (2, 192, 8, 8, 200),  # K = 128 + 64; the 8x8 map of 256x256 input; F = 200: a partial feature block
    (4, 128, 1, 1, 1280),  # K = 128; one pixel in a 16-pixel block
]


@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_model_widths_match_reference(interpreter_backend, few_sms, shape, dtype):
    n, c, h, w, f = shape
    check(*make_head(n, c, h, w, f, dtype=dtype))


@pytest.mark.parametrize("shape", MODEL_SHAPES[:3], ids=str)
def test_loop_without_prefetch(interpreter_backend, few_sms, monkeypatch, shape):
    """The sm_80 form of the resident loop (each step loads its own x tile; sm_90 loads it one step
    ahead, which the other tests run): several images per program, two pixel blocks at 9x9."""
    from convfirstnet.kernels._launch import GPUInfo

    monkeypatch.setattr(K, "device_info", lambda device: GPUInfo(10, 40 << 20, 163 << 10, 80))
    assert K.head_config(256, 81, torch.float16, 80).prefetch == 0
    check(*make_head(*shape, dtype=torch.float16))


@pytest.mark.parametrize("c", [24, 200])
def test_masked_k_parts(interpreter_backend, c):
    """C that the two power-of-two K parts do not cover exactly: 24 = 16 + 16 (8 masked),
    200 = 128 + 128 (56 masked)."""
    assert sum(K.split_k(c)) > c
    check(*make_head(2, c, 3, 3, 256))


def test_nchw_input_and_no_reads_outside_the_view(interpreter_backend):
    x, weight, bias = make_head(2, 160, 5, 7, 256)
    check(x.contiguous(), weight, bias)  # NCHW: pixels uniformly strided (stride 1), channel stride H*W
    # NHWC buffer with 3 more NaN channels per pixel and a NaN image: the kernel reads the view through
    # its strides (pixel stride 163); any read of a neighbouring channel or image poisons the output
    big = torch.full((3, 163, 5, 7), float("nan")).contiguous(memory_format=torch.channels_last)
    view = big[1:3, 2:162]
    view.copy_(x)
    assert K.pixel_stride(view) == 163
    assert torch.isfinite(check(view, weight, bias)).all()
    big = torch.full((3, 170, 7, 9), float("nan"))  # NCHW buffer: pixels not uniformly strided
    view = big[1:3, 2:162, 1:6, 1:8]
    view.copy_(x)
    assert K.pixel_stride(view) is None  # the launcher copies it to NHWC first
    assert torch.isfinite(check(view, weight, bias)).all()


def test_strided_weight_and_bias(interpreter_backend):
    x, weight, bias = make_head(1, 192, 5, 7, 256)
    # every other element of a NaN-interleaved buffer: unit strides would read the NaNs
    nan = float("nan")
    weight, bias = (torch.stack([t, torch.full_like(t, nan)], dim=-1)[..., 0] for t in (weight, bias))
    assert torch.isfinite(check(x, weight, bias)).all()


def test_batch_zero_and_one(interpreter_backend):
    x, weight, bias = make_head(0, 128, 4, 4, 256)
    out = torch.ops.convfirstnet.head(x, weight, bias)
    assert out.shape == (0, 256) and out.dtype == x.dtype
    check(*make_head(1, 128, 3, 2, 256))


def test_invalid_input_raises(interpreter_backend):
    x, weight, bias = make_head(1, 16, 4, 4, 256)
    with pytest.raises(ValueError, match="channels"):
        torch.ops.convfirstnet.head(x[:, :8], weight, bias)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.convfirstnet.head(x.half(), weight, bias)
    with pytest.raises(ValueError, match="shape"):
        torch.ops.convfirstnet.head(x, weight, bias[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_channels_past_the_resident_slice(interpreter_backend, few_sms, dtype):
    """C = 288 > 256: the K loop instead of the resident slice (64-channel steps, the last one a
    partial 32; fp32 always takes this path, in 32-channel steps)."""
    cfg = K.head_config(288, 9, dtype)
    assert not cfg.w_resident and 288 % cfg.block_k != 0 or dtype == torch.float32
    check(*make_head(3, 288, 3, 3, 300, dtype=dtype))


def test_grid_does_not_grow_with_the_batch():
    """The batch is walked inside the programs (images g, g + G, ...): any batch is one launch of at
    most 2 programs per SM, all in grid.x (the old grid put the batch in grid.y, limit 65535)."""
    w = torch.empty(1280, 256, device="meta", dtype=torch.half)
    b = torch.empty(1280, device="meta", dtype=torch.half)
    for n in (1, 7, 128, 100_000):
        x = torch.empty(n, 256, 8, 8, device="meta", dtype=torch.half)
        x = x.contiguous(memory_format=torch.channels_last)
        (launch,) = record(lambda: torch.ops.convfirstnet.head(x, w, b))
        groups = K.image_groups(n, 10, DEFAULT_SMS)
        assert launch.grid == (10 * groups,) and groups == min(n, 2 * DEFAULT_SMS // 10)
        # images per program, one 64-pixel block each; the last outside the loop (launcher.head_cost)
        assert launch.cost.loops[0].trips == -(-n // groups) - 1
        assert launch.cost.useful_macs == n * 64 * 256 * 1280


def test_split_k():
    assert [K.split_k(c) for c in K.SUPPORTED_C] == [(128, 0), (128, 32), (128, 64), (128, 128)]
    assert K.split_k(16) == (16, 0) and K.split_k(8) == (16, 0) and K.split_k(48) == (32, 16)


@pytest.mark.subprocess
def test_torch_compile_traces_triton_branch():
    """torch.compile(fullgraph=True) captures the head as one user-defined kernel (CPU trace; see
    test_mbconv.test_torch_compile_fullgraph_reference_on_cpu for why not in the interpreter)."""
    pytest.importorskip("triton")
    targets = trace_triton_branch("head", [2, 16, 5, 7, 200])
    assert targets.count("triton_kernel_wrapper_functional") == 1, targets


# ---------------------------------------------------------------------------------------------
# The compiled kernel, recorded through the launcher (batch 128: the model's shapes at 256x256)
# ---------------------------------------------------------------------------------------------
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (name, C, map side, dtype): every model width at 8x8 in fp16 (the resident weight slice); bf16 at the
# widest; the 16- and 32-pixel blocks (1x1 and 5x5 maps); the K loop: fp32 (tf32x3) at two widths and
# a 16-bit C = 320 past the resident slice.
SHIPPED = [(f"c{c}-8x8-fp16", c, 8, "fp16") for c in K.SUPPORTED_C] + [
    ("c256-8x8-bf16", 256, 8, "bf16"),
    ("c256-1x1-fp16", 256, 1, "fp16"),
    ("c256-5x5-fp16", 256, 5, "fp16"),
    ("c256-8x8-fp32", 256, 8, "fp32"),
    ("c160-8x8-fp32", 160, 8, "fp32"),
    ("c320-8x8-fp16", 320, 8, "fp16"),
]


@pytest.fixture(scope="module")
def compiled_head():
    pytest.importorskip("triton")
    launches = []
    for _, c, side, dtype in SHIPPED:
        dt = DTYPES[dtype]
        x = torch.empty(128, c, side, side, device="meta", dtype=dt)
        x = x.contiguous(memory_format=torch.channels_last)
        w, b = torch.empty(1280, c, device="meta", dtype=dt), torch.empty(1280, device="meta", dtype=dt)
        (launch,) = record(lambda: torch.ops.convfirstnet.head(x, w, b))
        launches.append(launch)
    return launches, compile_launches(launches)


def _case(compiled_head, case, arch):
    launches, compiled = compiled_head
    i = SHIPPED.index(case)
    return launches[i], compiled[(i, arch)]


@pytest.mark.compile
@pytest.mark.parametrize("arch", [90, 80], ids=["sm90", "sm80"])
@pytest.mark.parametrize("case", SHIPPED, ids=[c[0] for c in SHIPPED])
def test_compiles_for_gpu(compiled_head, case, arch):
    """No spills, shared memory within the target's limit, wgmma on sm_90; SiLU through
    kernels/_activations.py's PTX block (ex2.approx and rcp.approx, the path the interpreter cannot run)
    for 16-bit inputs, tl.exp2 and a division for fp32, tanh.approx nowhere; the loops the launcher
    declares are the loops of the SASS."""
    launch, c = _case(compiled_head, case, arch)
    assert c.stack == 0, f"{c.stack} B of stack per thread (spills), {c.regs} registers"
    assert c.shared <= SMEM_LIMIT[arch], f"{c.shared} B of shared memory on sm_{arch}"
    assert c.mma_kind == ("wgmma" if arch == 90 else "mma.sync")
    assert c.variant.meta["FAST_SILU"] == (case[3] != "fp32")
    assert c.variant.meta["W_RESIDENT"] == (case[3] != "fp32" and case[1] <= 256)
    assert ("rcp.approx.ftz.f32" in c.ptx) == (case[3] != "fp32")
    assert "tanh.approx" not in c.ptx
    bounds(launch, c)  # raises if the declared loops do not match the SASS loop tree


_LDG_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def _ldg_bytes(ins) -> int:
    """Bytes one thread loads with a global-load instruction (LDG.E[.width])."""
    parts = ins.opcode.split(".")
    return next((_LDG_BYTES[p] for p in parts[1:] if p in _LDG_BYTES), 4)


@pytest.mark.compile
def test_weight_slice_is_loaded_once_per_program(compiled_head):
    """The [128, 256] weight slice (64 KB) is loaded before the image loop and stays on chip; inside the
    loop each thread loads only its share of the image's x tile (256 x 64 fp16 = 32 KB)."""
    launch, c = _case(compiled_head, SHIPPED[3], 90)  # C = 256, fp16
    insns, loops = c.listing()
    (outer,) = loops  # the image loop (the pixel loop, one trip at 8x8, may be folded into it)
    inside = sum(_ldg_bytes(i) for i in insns[outer.start : outer.end + 1] if i.family == "LDG")
    before = sum(_ldg_bytes(i) for i in insns[: outer.start] if i.family == "LDG")
    threads = 32 * c.num_warps
    assert inside * threads == 256 * 64 * 2
    assert before * threads >= 128 * 256 * 2


@pytest.mark.compile
def test_tensor_core_bound_at_batch_128(compiled_head):
    """Small's head at batch 128 (C = 256, 8x8, fp16, sm_90): issued MMA work equals the useful MACs,
    and neither the instructions nor DRAM cost more time than the tensor cores (~5.5 us; the layer-wise
    bound is ~14 us; the previous kernel's issue estimate was 12.9 us). The declared loops match the SASS."""
    launch, c = _case(compiled_head, SHIPPED[3], 90)
    assert launch.cost.mma_macs == launch.cost.useful_macs == 128 * 64 * 256 * 1280
    t = bounds(launch, c)
    assert t["issue"] <= t["tensor"] and t["dram"] <= t["tensor"], (
        f"tensor {t['tensor'] * 1e6:.2f} us, DRAM {t['dram'] * 1e6:.2f} us, issue {t['issue'] * 1e6:.2f} us "
        f"({t['per_warp']} instructions per warp)"
    )


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_tf32(monkeypatch):
    """The fp32 reference must be fp32: cuDNN (the reference's 1x1 conv) and cuBLAS may use TF32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(128, 128, 8, 8), (128, 256, 8, 8), (256, 192, 16, 16), (3, 160, 1, 1), (5, 256, 9, 9)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_paper_shapes_on_gpu(triton_backend, no_tf32, shape, dtype):
    check(*make_head(*shape, dtype=dtype, device="cuda"), tol=GPU_TOL)


@cuda
@pytest.mark.gpu
def test_batch_past_old_grid_limit_on_gpu(triton_backend, no_tf32):
    """70,000 images (more than grid.y's 65,535) in one launch; deterministic."""
    x, weight, bias = make_head(70_000, 128, 1, 1, 256, dtype=torch.float16, device="cuda")
    out = check(x, weight, bias, tol=GPU_TOL)
    assert torch.equal(out, torch.ops.convfirstnet.head(x, weight, bias))


@cuda
@pytest.mark.gpu
def test_torch_compile_fullgraph_on_gpu(triton_backend):
    x, weight, bias = make_head(16, 256, 8, 8, dtype=torch.float16, device="cuda")

    def head(t):
        return torch.ops.convfirstnet.head(t, weight, bias)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(head, fullgraph=True)(x), head(x))
