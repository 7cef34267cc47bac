"""Shared pieces of every fused-block op: the backend switch, input checks, op registration.

The backend is chosen per call from ``CONVFIRSTNET_KERNELS`` (read here and nowhere else; set for a
stretch of code with ``selected_backend``):

* ``auto`` (default): Triton kernels for CUDA tensors, the PyTorch reference otherwise;
* ``triton``: always the Triton kernels (on CPU tensors this needs ``TRITON_INTERPRET=1``);
* ``reference``: always the PyTorch reference (any device).

float64 tensors always take the reference (the kernels run fp32, fp16 and bf16 only).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import _carveout
from ._cost import KernelCost, active_recording

try:  # triton is a Linux-only dependency; without it every op runs its reference.
    import triton  # noqa: F401
    from torch.library import triton_op, wrap_triton

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton_op = wrap_triton = None
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "reference")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the Triton kernels run
REFERENCE_DTYPES = (torch.float64,)  # runs the PyTorch reference only (gradient checks, numerics)
GROUP_WIDTH = 8  # every grouped 3x3 conv of ConvFirstNet has 8 channels per group (SPEC 1)
# ``maxnreg`` for the launches that take it (each says why): without a limit ptxas may keep registers
# low for more resident programs and serialize loads to do so; with it, register pressure alone decides.
# A launch option like num_warps, passed through to triton.compile by torch.compile's Inductor from torch
# 2.14 (pytorch PR 187028: backend options of user-defined kernels); earlier releases can drop it there,
# which only changes the compiled schedule, not the results.
MAXNREG = 255


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton's is a constexpr function whose Python call costs ~1.5 us
    (Triton 3.6-3.8), and the launchers size a training step's ~1,300 launches with thousands of them."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (see ``cdiv``): the smallest power of two >= n (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def backend() -> str:
    name = os.environ.get("CONVFIRSTNET_KERNELS", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"CONVFIRSTNET_KERNELS={name!r}: expected one of {', '.join(BACKENDS)}")
    return name


@contextlib.contextmanager
def selected_backend(name: str):
    """``CONVFIRSTNET_KERNELS`` set to ``name`` (one of ``BACKENDS``) for the duration, restored (or
    unset again) afterwards: the switch is read per call, so it holds for every op called inside."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}")
    saved = os.environ.get("CONVFIRSTNET_KERNELS")
    os.environ["CONVFIRSTNET_KERNELS"] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CONVFIRSTNET_KERNELS", None)
        else:
            os.environ["CONVFIRSTNET_KERNELS"] = saved


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(x: torch.Tensor) -> bool:
    """True when this call must run the Triton kernel (decided before any launch)."""
    if active_recording() is not None:  # the static cost report records every op's Triton launches
        return HAS_TRITON
    name = backend()
    if name == "reference":
        return False
    if x.dtype in REFERENCE_DTYPES:
        if name == "triton":
            raise TypeError(f"CONVFIRSTNET_KERNELS=triton: the Triton kernels do not run {x.dtype}")
        return False
    if name == "auto":
        return HAS_TRITON and x.device.type == "cuda"
    if not HAS_TRITON:
        raise RuntimeError("CONVFIRSTNET_KERNELS=triton but triton is not installed")
    if x.device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"CONVFIRSTNET_KERNELS=triton with a {x.device.type} tensor needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before importing convfirstnet"
        )
    if x.device.type != "cuda" and (problem := interpreter_problem()):
        raise RuntimeError(f"CONVFIRSTNET_KERNELS=triton with a {x.device.type} tensor: {problem}")
    return True


@functools.cache
def triton_before(major: int, minor: int) -> bool:
    """Whether the installed Triton is older than ``major.minor`` (layouts, and so the kernels' choices
    that depend on them, changed between 3.6 and 3.8). Cached for the launchers' hot path;
    ``interpreter_problem`` reads the version itself (its test swaps it)."""
    import triton
    from torch.torch_version import TorchVersion

    return TorchVersion(triton.__version__) < (major, minor)


def conflict_free_tap_order() -> int:
    """The tap-pair load order (the conv kernels' TAPS) whose copies to shared memory compile without
    bank conflicts with the installed Triton: 1 before 3.7, else 2 (the MBConv hidden kernel's and the
    group-width-8 conv's; the ConvFirst kernel refines it per conv batch). Checked on the compiled PTX by
    tests/kernels/test_mbconv.py and test_gconv.py."""
    return 1 if triton_before(3, 7) else 2


def _forced_tap_order() -> int | None:
    value = os.environ.get("CONVFIRSTNET_TAP_ORDER", "").strip()
    if value not in ("", "0", "1", "2"):
        raise ValueError(f"CONVFIRSTNET_TAP_ORDER={value!r}: expected 0, 1 or 2 (or unset)")
    return int(value) if value else None


# CONVFIRSTNET_TAP_ORDER=0, 1 or 2 forces the tap-pair load order of every conv kernel (MBConv hidden,
# ConvFirst stride 1, group-width-8 conv: each launcher's TAP_ORDER); unset, each takes its conflict-free
# order for the installed Triton
FORCED_TAP_ORDER = _forced_tap_order()


@functools.cache
def interpreter_problem() -> str | None:
    """Why this Triton's interpreter cannot run the kernels, or None. Up to Triton 3.6 the interpreter
    turns a runtime loop bound into a Python int with ``int()`` of a one-element array, which NumPy 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"; triton-lang/triton issue
    9171, fixed in Triton 3.7): every kernel with a runtime loop fails there."""
    import numpy
    import triton
    from torch.torch_version import TorchVersion

    if TorchVersion(triton.__version__) < (3, 7) and TorchVersion(numpy.__version__) >= (2, 4):
        return (f"the interpreter of Triton {triton.__version__} fails with NumPy {numpy.__version__} "
                "(int() of a one-element array in its loops); install 'numpy<2.4' or Triton >= 3.7")
    return None


def check_activation(op: str, x: torch.Tensor, channels: int, *, name: str = "x") -> None:
    """Rank, channel count and dtype of an NCHW/NHWC activation, with the op named in the error."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"convfirstnet.{op}: {name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(
            f"convfirstnet.{op}: {name} must be a 4-D (N, C, H, W) tensor, got shape {tuple(x.shape)}"
        )
    if x.shape[1] != channels:
        raise ValueError(
            f"convfirstnet.{op}: {name} has {x.shape[1]} channels, the block expects {channels} "
            f"(shape {tuple(x.shape)})"
        )
    if x.dtype not in FLOAT_DTYPES + REFERENCE_DTYPES:
        raise TypeError(
            f"convfirstnet.{op}: {name} has dtype {x.dtype}; expected float32, float16 or bfloat16 "
            "(float64 runs the PyTorch reference)"
        )


def check_weights(op: str, x: torch.Tensor, weights: dict[str, torch.Tensor]) -> None:
    """Every weight on the activation's device and in its dtype (a mix would be a silent upcast)."""
    for wname, w in weights.items():
        if w.device != x.device:
            raise ValueError(
                f"convfirstnet.{op}: input is on {x.device} but weight {wname} is on {w.device}; "
                "move the model and the input to the same device"
            )
        if w.dtype != x.dtype:
            raise TypeError(
                f"convfirstnet.{op}: input dtype {x.dtype} differs from weight {wname} dtype {w.dtype}; "
                "cast the input (or use torch.autocast)"
            )


def check_shape(op: str, wname: str, w: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"convfirstnet.{op}: weight {wname} has shape {tuple(w.shape)}, expected {tuple(shape)}")


def check_spatial(op: str, x: torch.Tensor, stride: int) -> None:
    if stride not in (1, 2):
        raise ValueError(f"convfirstnet.{op}: stride must be 1 or 2, got {stride}")
    if stride == 2 and x.numel() > 0 and min(x.shape[2], x.shape[3]) < 2:
        raise ValueError(
            f"convfirstnet.{op}: a stride-2 block needs a feature map of at least 2x2 (BlurPool reflects "
            f"one pixel), got {x.shape[2]}x{x.shape[3]}; use an input image of at least 32x32"
        )


def define_op(qualname: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as ``torch.ops.<qualname>``.

    With triton installed this is a ``torch.library.triton_op``: its body branches on the device, so
    torch.compile traces the reference on CPU and sees the Triton launch as a user-defined kernel on
    GPU (KERNEL-NOTES: ``register_kernel("cpu")`` on a triton_op would break compile on CPU). Without
    triton it is a ``custom_op`` whose body is the reference; the reference works on meta tensors too,
    so it doubles as the fake implementation.
    """

    def register(fn: Callable) -> Callable:
        if HAS_TRITON:
            return triton_op(qualname, fn, mutates_args=())
        op = torch.library.custom_op(qualname, fn, mutates_args=())
        op.register_fake(fn)
        return op

    return register


# The GPU a launch is sized for when it runs on no CUDA device (meta tensors of a cost recording
# without a target, or CPU tensors): an H100 SXM.
DEFAULT_SMS = 132
DEFAULT_L2_BYTES = 50 * 1024 * 1024
DEFAULT_SHARED_PER_BLOCK = 227 * 1024
DEFAULT_ARCH = 90


@dataclass(frozen=True)
class GPUInfo:
    """What launchers size their grids and tiles by."""

    sms: int
    l2_bytes: int
    shared_per_block: int  # opt-in maximum of shared memory per program
    arch: int  # compute capability as 10 major + minor (90: Hopper)


def device_info(device: torch.device) -> GPUInfo:
    """The GPU that a launch on ``device`` runs on: the CUDA device's own figures; for meta tensors the
    active cost recording's target (``recording(sms=..., l2_bytes=..., shared_per_block=..., arch=...)``);
    else an H100 SXM (DEFAULT_*)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return GPUInfo(props.multi_processor_count, props.L2_cache_size,
                       getattr(props, "shared_memory_per_block_optin", DEFAULT_SHARED_PER_BLOCK),
                       10 * props.major + props.minor)
    rec = active_recording()
    if rec is not None and device.type == "meta":
        return GPUInfo(rec.sms or DEFAULT_SMS, rec.l2_bytes or DEFAULT_L2_BYTES,
                       rec.shared_per_block or DEFAULT_SHARED_PER_BLOCK, rec.arch or DEFAULT_ARCH)
    return GPUInfo(DEFAULT_SMS, DEFAULT_L2_BYTES, DEFAULT_SHARED_PER_BLOCK, DEFAULT_ARCH)


def launchable(kernel, args: Sequence = ()):
    """``wrap_triton(kernel)`` while torch.compile traces the launch (a tensor in ``args`` is a FakeTensor
    or FunctionalTensor), so that its graph sees a user-defined Triton kernel; the kernel itself for plain
    tensors (eager, or a custom op's body): wrap_triton's HOP dispatch is on by default outside a
    triton_op and costs ~0.2-1 ms of host time per launch, which made a step of the fused training ops
    host-bound on a GPU.

    Under the interpreter (TRITON_INTERPRET=1 when the kernel was decorated) ``@triton.jit`` gives an
    ``InterpretedFunction``, which torch < 2.15 refuses to wrap: it is launched as it is.
    """
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, (JITFunction, Autotuner)) and _traced(args):
        return wrap_triton(kernel)
    return kernel


def launch(kernel, grid, *args, cost: Callable[[], KernelCost] | None = None, **meta) -> None:
    """Launch ``kernel[grid](*args, **meta)``; while a cost recording is active, record it instead.

    ``cost`` builds the launch's :class:`~convfirstnet.kernels._cost.KernelCost` from the launcher's own
    values; it is called only when recording (see ``_cost.py``).
    """
    rec = active_recording()
    if rec is not None:
        rec.add(kernel, grid, args, meta, cost)
        return
    compiled = launchable(kernel, args)[grid](*args, **meta)
    if _carveout.POLICY != "triton" or _carveout._DONE:  # the L1 / shared split (kernels/_carveout.py)
        _carveout.apply(compiled, next(a.device for a in args if isinstance(a, torch.Tensor)))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _traced(args: Sequence) -> bool:
    """A tensor argument of a subclass (FakeTensor, FunctionalTensor): torch.compile is tracing the
    launch, which must then go through wrap_triton so that the graph sees the kernel."""
    return any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN for a in args)
