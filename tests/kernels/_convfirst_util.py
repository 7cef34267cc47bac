"""Shared helpers of the stem / ConvFirst kernel tests.

Strided NaN-banded inputs (both), and compiling the stem's shipped kernel configurations for GPU
targets (the ConvFirst test compiles the launches its launcher records, through
convfirstnet.analysis.compiled).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


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
    """Every (kernel, constexprs, launch options) the stem launcher can pick for model shapes."""
    if block == "stem":
        from convfirstnet.kernels.stem import kernel as S

        return [
            dict(name=f"stem_c{cfg.c_pad}", kernel=S._stem_kernel, num_warps=cfg.num_warps, num_stages=2,
                 constexprs=dict(C_IN=cfg.c_in, C_PAD=cfg.c_pad, BLOCK_M=cfg.block_m),
                 dtypes=[torch.float16, torch.bfloat16, torch.float32])
            for cfg in S.shipped_configs()
        ]
    raise ValueError(f"no hand-listed variants for {block!r}: the ConvFirst compile test records the launcher's "
                     "own launches (tests/kernels/test_convfirst.py)")


def _compile_all(block: str, archs: list[int]) -> list[dict]:
    rows = []
    for v in shipped_variants(block):
        for dtype in v.get("dtypes", [v.get("dtype")]):
            for arch in archs:
                row = dict(name=v["name"], dtype=str(dtype).replace("torch.", ""), arch=arch)
                try:
                    c = compile_for_gpu(
                        v["kernel"], dtype, v["constexprs"], arch, v["num_warps"], v["num_stages"]
                    )
                    row.update(ok=True, shared=int(c.metadata.shared))
                except Exception as e:  # noqa: BLE001  (reported per variant by the test)
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
                rows.append(row)
    return rows


def compile_all_in_subprocess(block: str, archs=(90, 80)) -> list[dict]:
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
    # one child per architecture, run concurrently (the compiles are single-threaded)
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.kernels._convfirst_util", block, str(arch)], env=env,
                         cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for arch in archs
    ]
    rows = []
    for proc in procs:
        out, err = proc.communicate(timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"compile subprocess failed ({proc.returncode}):\n{err[-4000:]}")
        rows += json.loads(out.strip().splitlines()[-1])
    return rows


if __name__ == "__main__":
    import json

    _block, _archs = sys.argv[1], [int(a) for a in sys.argv[2].split(",")]
    print(json.dumps(_compile_all(_block, _archs)))
