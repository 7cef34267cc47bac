"""Shared helpers of the stem / ConvFirst kernel tests.

`kernels_package()` imports ``convfirstnet.kernels`` (which registers ``torch.ops.convfirstnet.*``).
The kernel tests need only that folder, so when the model package around it cannot be imported
(e.g. while its modules are being written) the folder is loaded under the same name, the way
``convfirstnet/_kernels_path.py`` does for an uninstalled checkout.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def kernels_package():
    try:
        return importlib.import_module("convfirstnet.kernels")
    except ImportError:
        pass
    if "convfirstnet.kernels" in sys.modules:
        return sys.modules["convfirstnet.kernels"]
    spec = importlib.util.spec_from_file_location(
        "convfirstnet.kernels", KERNELS_DIR / "__init__.py", submodule_search_locations=[str(KERNELS_DIR)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["convfirstnet.kernels"] = module
    spec.loader.exec_module(module)
    return module


def nan_banded(x: torch.Tensor, memory_format=torch.channels_last) -> torch.Tensor:
    """`x` as a strided view into a larger NaN-filled buffer in the given memory format.

    The interpreter reads out-of-bounds addresses without complaint, so a missing mask would read
    neighbouring memory: here that memory is NaN and the output check fails loudly. The view keeps
    x's logical shape but has padded strides (non-contiguous), so stride handling is exercised too.
    """
    n, c, h, w = x.shape
    big = torch.full((n + 1, c + 3, h + 2, w + 3), float("nan"), dtype=x.dtype)
    big = big.contiguous(memory_format=memory_format)
    view = big[:n, 1 : c + 1, 1 : h + 1, 2 : w + 2]
    view.copy_(x)
    return view


# ------------------------------------------------------------------------------------------------
# Compiling kernels for a GPU target on a machine without one
# ------------------------------------------------------------------------------------------------

# Shared memory per block usable by a kernel (opt-in maximum): H100 227 KB, A100 163 KB.
SMEM_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def compile_for_gpu(kernel, dtype: torch.dtype, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    """Compile a @triton.jit kernel for sm_<arch> with ptxas, no GPU needed; returns the compiled kernel.

    Pointer arguments (names ending in ``_ptr``) get ``dtype``; every other runtime argument (sizes,
    strides) is i32, the general case (a GPU launch may also specialise ints equal to 1 or divisible
    by 16; those variants only add alignment facts). Under TRITON_INTERPRET the decorator returns an
    interpreted function, so the Python function is re-wrapped in a JITFunction here.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + TRITON_DTYPE[dtype]
        else:
            sig[name] = "i32"
    src = ASTSource(fn, sig, constexprs)
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
