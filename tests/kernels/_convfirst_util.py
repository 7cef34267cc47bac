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


def shipped_variants(block: str) -> list[dict]:
    """Every (kernel, constexprs, launch options) the launcher of `block` can pick for model shapes."""
    kernels_package()
    if block == "stem":
        from convfirstnet.kernels.stem import kernel as S

        return [
            dict(name=f"stem_c{cfg.c_pad}", kernel=S._stem_kernel, num_warps=cfg.num_warps, num_stages=2,
                 constexprs=dict(C_IN=cfg.c_in, C_PAD=cfg.c_pad, BLOCK_M=cfg.block_m))
            for cfg in S.shipped_configs()
        ]
    from convfirstnet.kernels.convfirst import kernel as K

    out = []
    for cfg in K.shipped_configs():
        ce = dict(C_PAD=cfg.c_pad, BLOCK_M=cfg.block_m, BLOCK_H=cfg.block_h)
        if cfg.stride == 2:
            ce["K_PAD"] = cfg.k_pad
        out.append(dict(
            name=f"s{cfg.stride}_c{cfg.c_pad}_k{cfg.k_pad}_m{cfg.block_m}_h{cfg.block_h}_w{cfg.num_warps}",
            kernel=K._convfirst_s1_kernel if cfg.stride == 1 else K._convfirst_s2_kernel,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, constexprs=ce, precision=K.precision_for,
        ))
    return out


def _compile_all(block: str, dtypes: list[str], archs: list[int]) -> list[dict]:
    rows = []
    for v in shipped_variants(block):
        for dname in dtypes:
            dtype = getattr(torch, dname)
            ce = dict(v["constexprs"])
            if "precision" in v:
                ce["PRECISION"] = v["precision"](dtype)
            for arch in archs:
                row = dict(name=v["name"], dtype=dname, arch=arch)
                try:
                    c = compile_for_gpu(v["kernel"], dtype, ce, arch, v["num_warps"], v["num_stages"])
                    row.update(ok=True, shared=int(c.metadata.shared))
                except Exception as e:  # reported per variant by the test
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
                rows.append(row)
    return rows


def compile_all_in_subprocess(block: str, dtypes=("float16", "bfloat16", "float32"), archs=(90, 80)) -> list[dict]:
    """Run `_compile_all` in a fresh interpreter with TRITON_INTERPRET=0.

    With TRITON_INTERPRET=1 set at import, @triton.jit yields interpreted functions and triton.compile
    of them fails inside the frontend (seen with triton 3.9), so the GPU compile runs in a child process
    where the kernels are real JITFunctions.
    """
    import json
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="0")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "tests.kernels._convfirst_util", block, ",".join(dtypes), ",".join(map(str, archs))]
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=1200)
    if res.returncode != 0:
        raise RuntimeError(f"compile subprocess failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import json

    _block, _dtypes, _archs = sys.argv[1], sys.argv[2].split(","), [int(a) for a in sys.argv[3].split(",")]
    print(json.dumps(_compile_all(_block, _dtypes, _archs)))
