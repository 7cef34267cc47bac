"""torch.ops.convfirstnet.mbconv: Triton kernels (interpreter on CPU) against the PyTorch reference.

Shapes are small on purpose (the interpreter costs ~0.4 ms per program instance) but cross every
mask: maps smaller than a tile (1x1, 2x3), odd maps crossing tile borders (9x10 for the 8x8 tile of
stride 1, 11x9 -> 6x5 for the 4x4 tile of stride 2), channel counts that are not a power of two
(C = 24: R = 96 is three hidden chunks; K = 24 masks output columns), batch 0 and 1. C = 16 / 24
keep the tests fast; the real channel counts (48 ... 256) are covered by the sm_90 / sm_80
compile test and by the GPU tests.
"""

import os

import pytest
import torch
from convfirstnet.kernels.mbconv.reference import mbconv_reference

from ..conftest import cuda

# dtype -> (atol, rtol) for outputs of magnitude ~1 (unit-variance input + residual, fan-in scaled
# weights). fp32: kernel and reference both accumulate in fp32 and differ only in summation order
# over <= 9*8 + R terms (~1e-6 relative; GPU dots are 3xTF32, ~fp32); 1e-4 leaves room for FMA
# contraction, while an indexing error shows up as O(0.1).
# fp16: the kernel rounds h and the gated g to fp16 before the tensor-core dots (unit roundoff
# 4.9e-4) and the output to fp16 (half an ulp is 2e-3 at |out| = 4). Measured at these shapes:
# max error 1e-3 (stride 1, |out| <= 4.2), 2.4e-4 (stride 2, |out| <= 0.4). The GPU shapes have
# 8-16x the hidden width (R up to 1024) and the rounding error grows ~sqrt(R), hence 1e-2.
# bf16 (GPU only): 8x coarser mantissa than fp16 (unit roundoff 3.9e-3): 6e-2.
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 6e-2),
}


def make_block(n, c, h, w, stride, k=None, dtype=torch.float32, device="cpu", seed=0):
    """Input and folded weights with realistic scales: unit-variance x, weights ~ N(0, 1/fan_in)."""
    k = c if k is None else k
    r, s = 4 * c, max(1, c // 4)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, fan_in=1, scale=1.0):
        t = torch.randn(*shape, generator=gen) * (scale / fan_in**0.5)
        return t.to(device=device, dtype=dtype)

    x = rnd(n, c, h, w).contiguous(memory_format=torch.channels_last)
    weights = (
        rnd(r, c, fan_in=c), rnd(r, scale=0.1),
        rnd(r, 8, 3, 3, fan_in=72), rnd(r, scale=0.1),
        rnd(s, r, fan_in=r), rnd(s, scale=0.1),
        rnd(r, s, fan_in=s), rnd(r, scale=0.1),
        rnd(k, r, fan_in=r), rnd(k, scale=0.1),
    )
    return x, weights


def check(x, weights, stride):
    out = torch.ops.convfirstnet.mbconv(x, *weights, stride)
    ref = mbconv_reference(x, *weights, stride)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    return out


SHAPES_STRIDE1 = [  # (N, C, H, W)
    (1, 16, 1, 1),  # smaller than the 8x8 tile: every halo pixel is padding
    (2, 16, 5, 7),  # odd map inside one tile, two images
    (1, 16, 9, 10),  # crosses the tile border in both directions (4 tiles)
    (1, 24, 3, 3),  # R = 96: three hidden chunks; K = 24 masks output columns
]
SHAPES_STRIDE2 = [  # (N, C, K, H, W)
    (1, 16, 16, 2, 3),  # smallest legal map: 1x2 output, reflection on every side
    (1, 16, 16, 2, 2),  # 1x1 output
    (2, 16, 24, 5, 7),  # odd map, C -> K widening, 3x4 output
    (1, 16, 16, 11, 9),  # 6x5 output crosses the 4x4 tile borders (2x2 tiles)
]


@pytest.mark.parametrize("shape", SHAPES_STRIDE1, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_stride1_matches_reference(interpreter_backend, shape, dtype):
    x, weights = make_block(*shape, stride=1, dtype=dtype)
    check(x, weights, 1)


@pytest.mark.parametrize("shape", SHAPES_STRIDE2, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_stride2_matches_reference(interpreter_backend, shape, dtype):
    n, c, k, h, w = shape
    x, weights = make_block(n, c, h, w, stride=2, k=k, dtype=dtype)
    check(x, weights, 2)


@pytest.mark.parametrize("stride", [1, 2])
def test_nchw_contiguous_input(interpreter_backend, stride):
    x, weights = make_block(2, 16, 5, 6, stride=stride, seed=1)
    check(x.contiguous(), weights, stride)


@pytest.mark.parametrize("stride", [1, 2])
def test_strided_weights(interpreter_backend, stride):
    """Weights and biases as strided views (every other element): the launcher must honour strides."""
    x, weights = make_block(1, 16, 5, 6, stride=stride, seed=4)
    strided = tuple(torch.stack([w, torch.full_like(w, float("nan"))], dim=-1)[..., 0] for w in weights)
    assert not any(w.is_contiguous() for w in strided)
    check(x, strided, stride)


@pytest.mark.parametrize("stride", [1, 2])
def test_no_reads_outside_the_view(interpreter_backend, stride):
    """A view inside a NaN-filled buffer: any unmasked load of a neighbour pixel, channel or image
    would poison the output (the interpreter does not fault on out-of-bounds reads)."""
    x, weights = make_block(1, 16, 5, 7, stride=stride, seed=2)
    big = torch.full((3, 20, 9, 11), float("nan")).contiguous(memory_format=torch.channels_last)
    view = big[1:2, 2:18, 2:7, 2:9]
    view.copy_(x)
    out = check(view, weights, stride)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("stride", [1, 2])
def test_batch_zero_returns_empty(interpreter_backend, stride):
    x, weights = make_block(0, 16, 4, 6, stride=stride, k=24 if stride == 2 else 16)
    out = torch.ops.convfirstnet.mbconv(x, *weights, stride)
    assert out.shape == ((0, 16, 4, 6) if stride == 1 else (0, 24, 2, 3))
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_invalid_input_raises_before_launch(interpreter_backend):
    x, weights = make_block(1, 16, 4, 4, stride=1)
    with pytest.raises(ValueError, match="stride"):
        torch.ops.convfirstnet.mbconv(x, *weights, 3)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.convfirstnet.mbconv(x.half(), *weights, 1)
    with pytest.raises(ValueError, match="2x2"):
        torch.ops.convfirstnet.mbconv(x[:, :, :1], *weights, 2)
    wide = list(weights)
    wide[8], wide[9] = torch.zeros(264, 64), torch.zeros(264)
    with pytest.raises(ValueError, match="up to 256 output channels"):
        torch.ops.convfirstnet.mbconv(x, *wide, 2)


def test_config_table_is_exposed():
    from convfirstnet.kernels.mbconv.kernel import mbconv_config, shipped_variants

    cfg = mbconv_config(128, 512, 128, 16, 16, 1)
    assert (cfg.tile_h, cfg.tile_w, cfg.block_k) == (8, 8, 128)
    assert cfg.block_h >= (cfg.g_h + 2) * (cfg.g_w + 2)
    cfg2 = mbconv_config(48, 192, 128, 32, 32, 2)
    assert cfg2.block_g >= cfg2.g_h * cfg2.g_w and cfg2.block_h >= (cfg2.g_h + 2) * (cfg2.g_w + 2)
    assert len(shipped_variants()) == 7


def test_torch_compile_fullgraph_reference_on_cpu(reference_backend):
    """On CPU, torch.compile traces the op's reference branch in one graph. The Triton branch
    cannot be compiled *in the interpreter*: with TRITON_INTERPRET=1 ``@triton.jit`` returns an
    InterpretedFunction, ``wrap_triton`` hands it back unwrapped, and dynamo's fake-tensor run then
    launches it on FakeTensors ("Cannot access data pointer"). test_torch_compile_traces_triton_branch
    traces it with real JITFunctions instead; running it compiled needs a GPU."""
    x, weights = make_block(1, 16, 3, 5, stride=1, seed=3)

    def block(t):
        return torch.ops.convfirstnet.mbconv(t, *weights, 1)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-5)


_TRACE_SCRIPT = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
import convfirstnet.kernels  # noqa: F401  (kernels decorated as JITFunctions: no interpreter)
from torch._dynamo.backends.common import aot_autograd

os.environ["TRITON_INTERPRET"] = "1"  # only so that use_triton() takes the Triton branch on CPU
os.environ["CONVFIRSTNET_KERNELS"] = "triton"
op, args = sys.argv[1], json.loads(sys.argv[2])
graphs = []

class Captured(Exception):
    pass

def capture(gm, example_inputs):
    graphs.append(gm)
    def run(*a):
        raise Captured  # the graph would launch CUDA kernels: stop after tracing
    return run

if op == "mbconv":
    n, c, k, h, w, stride = args
    r, s = 4 * c, c // 4
    shapes = [(r, c), (r,), (r, 8, 3, 3), (r,), (s, r), (s,), (r, s), (r,), (k, r), (k,)]
    ws = [torch.randn(*shape) for shape in shapes]
    fn = lambda t: torch.ops.convfirstnet.mbconv(t, *ws, stride)
else:
    n, c, h, w, f = args
    wt, b = torch.randn(f, c), torch.randn(f)
    fn = lambda t: torch.ops.convfirstnet.head(t, wt, b)
x = torch.randn(n, c, h, w).contiguous(memory_format=torch.channels_last)
compiled = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=capture))
try:
    compiled(x)
except Captured:
    pass
print(json.dumps([str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]))
"""


def trace_triton_branch(op, args):
    """torch.compile(fullgraph=True) of the op's Triton branch on CPU, in a subprocess whose kernels
    are real JITFunctions; returns the call targets of the captured forward graph."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT, op, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_compile_traces_triton_branch():
    """One graph (fullgraph=True) holding the three user-defined kernels: pass 1, SE, pass 2.
    Inductor receives them as triton_kernel_wrapper_functional nodes."""
    pytest.importorskip("triton")
    targets = trace_triton_branch("mbconv", [2, 16, 24, 5, 7, 2])
    assert targets.count("triton_kernel_wrapper_functional") == 3, targets


# ---------------------------------------------------------------------------------------------
# GPU compiler: every shipped variant for Hopper and Ampere, without a GPU
# ---------------------------------------------------------------------------------------------
# triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32)) runs the real GPU pipeline
# (TTIR -> TTGIR -> LLVM -> PTX -> ptxas cubin) on CPU and reports the shared memory a launch needs.
# It runs in subprocesses: with TRITON_INTERPRET=1 (set by conftest) this process's triton.language
# is patched for the interpreter and cannot drive the GPU code generator. Two workers share the
# cases; the Triton cache makes reruns fast. Uncached, one variant takes ~2-12 s (fp16/bf16) and
# ~10-35 s (fp32, 3xTF32 dots) on a 2-core machine.

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}  # max dynamic shared memory per block (bytes)
FULL_MATRIX = os.environ.get("CONVFIRSTNET_COMPILE_ALL", "0") not in ("", "0")

_COMPILE_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
results = []
for case in json.load(sys.stdin):
    fn = getattr(importlib.import_module(case["module"]), case["kernel"])
    meta = dict(case["meta"])
    num_warps = meta.pop("num_warps", 4)
    signature = {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = "*fp32" if p.name in case["fp32_pointers"] else TYPES[case["dtype"]]
        else:
            signature[p.name] = "i32"
    try:
        compiled = triton.compile(ASTSource(fn, signature, meta), target=GPUTarget("cuda", case["arch"], 32),
                                  options={"num_warps": num_warps})
        results.append(compiled.metadata.shared)
    except Exception as exc:  # reported by the test that owns the case
        results.append(f"{type(exc).__name__}: {exc}")
json.dump(results, sys.stdout)
"""


def compile_for_gpu(cases, workers=2):
    """Compile ``cases`` (dicts: module, kernel, meta, dtype name, arch, fp32_pointers) for CUDA
    targets in ``workers`` subprocesses; returns shared-memory bytes or an error string per case."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    chunks = [cases[i::workers] for i in range(workers)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, text=True)
        for chunk in chunks if chunk
    ]
    outputs = [p.communicate(json.dumps(chunk)) for p, chunk in zip(procs, chunks)]
    results = [None] * len(cases)
    for w, ((stdout, stderr), proc) in enumerate(zip(outputs, procs)):
        assert proc.returncode == 0, stderr[-3000:]
        for j, r in enumerate(json.loads(stdout)):
            results[w + j * workers] = r
    return results


def _variant_id(meta):
    return f"s{meta['STRIDE']}-pass{meta['PASS']}-K{meta['BLOCK_K']}-w{meta['num_warps']}"


def _mbconv_cases():
    try:
        from convfirstnet.kernels.mbconv.kernel import shipped_variants
    except ImportError:  # triton missing: nothing to compile
        return []
    variants = shipped_variants()
    # fp16: every variant for both targets. bf16 has fp16's tiles and shared memory (same element
    # size) and differs only in the MMA instruction type; fp32 (3xTF32 dots) needs the same 80 KB
    # of shared memory in every variant (measured), against the tighter 163 KB of sm_80. The
    # default run compiles the largest-accumulator variants in bf16 for sm_90 and in fp32 for
    # sm_80; CONVFIRSTNET_COMPILE_ALL=1 compiles every (variant, dtype, arch), ~8 min on 2 cores.
    cases = []
    for meta in variants:
        largest = meta["PASS"] == 2 and meta["BLOCK_K"] == 256
        for dtype in ("float16", "bfloat16", "float32"):
            for arch in (90, 80):
                extra = largest and (dtype, arch) in (("bfloat16", 90), ("float32", 80))
                if dtype == "float16" or FULL_MATRIX or extra:
                    cases.append(dict(module="convfirstnet.kernels.mbconv.kernel", kernel="_mbconv_kernel",
                                      meta=dict(meta, PREC="tf32x3" if dtype == "float32" else "tf32"),
                                      dtype=dtype, arch=arch, fp32_pointers=["part_ptr", "gate_ptr"]))
    for block_s in (16, 32, 64):  # S = C/4 = 12 ... 64
        for dtype in ("float16", "bfloat16", "float32"):
            for arch in (90, 80):
                if not (dtype == "float16" or FULL_MATRIX or (block_s == 64 and arch == 90)):
                    continue
                cases.append(dict(module="convfirstnet.kernels.mbconv.kernel", kernel="_se_kernel",
                                  meta=dict(BLOCK_S=block_s, BLOCK_RS=128), dtype=dtype, arch=arch,
                                  fp32_pointers=["part_ptr", "gate_ptr"]))
    return cases


MBCONV_CASES = _mbconv_cases()


def _case_id(case):
    meta = case["meta"]
    name = _variant_id(meta) if "PASS" in meta else f"se-S{meta['BLOCK_S']}"
    return f"{name}-{case['dtype']}-sm{case['arch']}"


@pytest.fixture(scope="module")
def mbconv_compiled():
    pytest.importorskip("triton")
    return dict(zip(map(_case_id, MBCONV_CASES), compile_for_gpu(MBCONV_CASES)))


@pytest.mark.parametrize("case", MBCONV_CASES, ids=_case_id)
def test_compiles_for_gpu(mbconv_compiled, case):
    shared = mbconv_compiled[_case_id(case)]
    assert isinstance(shared, int), shared
    assert shared <= SHARED_LIMIT[case["arch"]], f"{shared} B of shared memory on sm_{case['arch']}"


# ---------------------------------------------------------------------------------------------
# GPU only: the paper's shapes (batch 128, 16x16 and 8x8, C 128 ... 256) in fp16 / bf16
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [  # (N, C, K, H, W, stride)
    (128, 128, 128, 16, 16, 1),
    (128, 256, 256, 8, 8, 1),
    (128, 192, 192, 16, 16, 1),
    (128, 48, 128, 32, 32, 2),
    (128, 128, 128, 16, 16, 2),
    (128, 256, 256, 16, 16, 2),
    (256, 160, 160, 1, 1, 1),
]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_paper_shapes_on_gpu(triton_backend, shape, dtype):
    n, c, k, h, w, stride = shape
    x, weights = make_block(n, c, h, w, stride=stride, k=k, dtype=dtype, device="cuda")
    check(x, weights, stride)


@cuda
@pytest.mark.gpu
def test_bitwise_deterministic_on_gpu(triton_backend):
    """Pooled sums are per-tile partials reduced in a fixed order (no atomics)."""
    x, weights = make_block(64, 128, 16, 16, stride=1, dtype=torch.float16, device="cuda")
    first = torch.ops.convfirstnet.mbconv(x, *weights, 1)
    assert torch.equal(first, torch.ops.convfirstnet.mbconv(x, *weights, 1))


@cuda
@pytest.mark.gpu
def test_cuda_graph_capture(triton_backend):
    x, weights = make_block(8, 128, 16, 16, stride=1, dtype=torch.float16, device="cuda")
    eager = torch.ops.convfirstnet.mbconv(x, *weights, 1)  # warm-up compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.convfirstnet.mbconv(x, *weights, 1)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=1e-2, rtol=1e-2)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("stride", [1, 2])
def test_torch_compile_fullgraph_on_gpu(triton_backend, stride):
    x, weights = make_block(16, 128, 16, 16, stride=stride, dtype=torch.float16, device="cuda")

    def block(t):
        return torch.ops.convfirstnet.mbconv(t, *weights, stride)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(x), block(x), atol=1e-2, rtol=1e-2)


def test_interpreter_is_on_without_cuda():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
