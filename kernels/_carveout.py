"""How much of an SM's unified L1 / shared memory a kernel leaves to L1 (the carve-out).

Triton's loader gives every kernel that asks for more than 48 KB of shared memory the largest shared
carve-out: ``cuFuncSetCacheConfig(fun, CU_FUNC_CACHE_PREFER_SHARED)`` in Triton 3.6's
``backends/nvidia/driver.c`` (3.8 first tries an "oversized shared memory" mode, whose comment says it
sets L1 to 8 KB). Measured on an H200 (Triton 3.6, Nsight Compute's ``launch__shared_mem_config_size``
and ``launch__func_cache_config``, every launch of fused Small:
``benchmarks/results/ncu/20261126T150000Z_h200_float16_small_ncu.json``): all 85 launches with more than
48 KB ran with 228 KB of shared memory, **28 KB of L1**, whatever they use; the two with less (stem,
first ConvFirst stage) ran with 132 KB (124 KB of L1), more than their programs need. The MBConv hidden
kernels, for one, use 170 KB and keep a 41 KB scratch slot they read ten times per write: it cannot
stay in 28 KB (measured L1 hit rate 56-67 %).

``POLICY = "fit"`` (the default; environment ``CONVFIRSTNET_L1_CARVEOUT=fit``, ``triton`` leaves
Triton's choice) sets, after the first launch of each compiled kernel, the preferred carve-out
(``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``, a percentage of the largest) to the smallest that
holds the shared memory of the programs an SM can keep resident, so the rest is L1 (60 KB for the MBConv
hidden kernels). It is a hint the driver may override, and it applies to launches through
``kernels._launch.launch`` (not to kernels that ``torch.compile`` launches itself). Timed on an H200
(Triton 3.6, batch 128, fp16, CUDA graphs): fused Small 13.68 against 14.16 ms with the tap order of
then (``scripts/gpu_check.py``, benchmarks/results/20261127T002434Z_*), 11.79-11.84 against 12.21-12.25
with the conflict-free one, and each MBConv block 2-4 % faster (benchmarks/results/variants/20261127T00*).
``convfirstnet.analysis`` models both (``carveout_bytes``).
"""

from __future__ import annotations

import ctypes
import math
import os
import warnings

POLICIES = ("triton", "fit")
POLICY = os.environ.get("CONVFIRSTNET_L1_CARVEOUT", "fit").strip().lower() or "fit"
if POLICY not in POLICIES:
    raise ValueError(f"CONVFIRSTNET_L1_CARVEOUT={POLICY!r}: expected one of {', '.join(POLICIES)}")

TRITON_PREFER_SHARED_ABOVE = 48 * 1024  # Triton's loader: more dynamic shared memory than this
RESERVED_PER_BLOCK = 1024  # shared memory the driver reserves per resident program (sm_80, sm_90)
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # cuda.h, CUfunction_attribute
_DONE: dict[int, str] = {}  # CUfunction handle -> the policy last set on it (none: Triton's choice)


def smallest_carveout(need: int, carveouts_kb: tuple[int, ...]) -> int | None:
    """Bytes of the smallest shared-memory carve-out that holds ``need`` bytes (None: none does)."""
    return next((kb * 1024 for kb in carveouts_kb if kb * 1024 >= need), None)


def resident_programs(shared: int, num_warps: int, regs: int, *, max_shared: int, regs_per_sm: int = 65536,
                      threads_per_sm: int = 2048, blocks_per_sm: int = 32) -> int:
    """Programs of a kernel one SM can hold at once: the fewest allowed by shared memory (at the largest
    carve-out), registers (allocated per warp in units of 256), threads and the block limit."""
    by_shared = max_shared // (shared + RESERVED_PER_BLOCK) if shared else blocks_per_sm
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_shared, by_regs, by_threads, blocks_per_sm))


def carveout_bytes(shared: int, programs: int, carveouts_kb: tuple[int, ...], policy: str = "triton") -> int:
    """Shared memory per SM the driver configures for a kernel with ``shared`` bytes per program and
    ``programs`` resident per SM, under ``policy``. ``triton``: the largest carve-out above Triton's 48 KB
    threshold (CU_FUNC_CACHE_PREFER_SHARED), else the larger of what the programs need and 132 KB (what
    the driver chose for both such kernels measured, module docstring). ``fit``: the smallest carve-out
    that holds the programs (above the threshold; below it the same as ``triton``)."""
    largest = carveouts_kb[-1] * 1024
    fit = smallest_carveout(programs * (shared + RESERVED_PER_BLOCK) if shared else 0, carveouts_kb)
    fit = largest if fit is None else fit
    if shared > TRITON_PREFER_SHARED_ABOVE:
        return fit if policy == "fit" else largest
    return max(fit, min(132 * 1024, largest))


def fit_percent(shared: int, programs: int, max_shared: int) -> int:
    """The preferred carve-out, in percent of ``max_shared``, that holds ``programs`` programs of
    ``shared`` bytes (the driver rounds it up to a configuration it has)."""
    return min(100, math.ceil(100 * programs * (shared + RESERVED_PER_BLOCK) / max_shared))


def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def apply(compiled, device) -> None:
    """Set the preferred carve-out of ``compiled`` (a Triton CompiledKernel just launched on ``device``)
    to what POLICY asks, once per kernel and policy: ``fit`` the smallest that holds its programs,
    ``triton`` (only on a kernel ``fit`` was set on before) back to the largest, Triton's PREFER_SHARED.
    Kernels at or below Triton's 48 KB threshold are left alone."""
    shared = int(getattr(getattr(compiled, "metadata", None), "shared", 0) or 0)
    handle = getattr(compiled, "function", None)
    if shared <= TRITON_PREFER_SHARED_ABOVE or not handle or _DONE.get(handle, "triton") == POLICY:
        return
    import torch

    props = torch.cuda.get_device_properties(device)
    max_shared = props.shared_memory_per_multiprocessor
    warps, regs = int(compiled.metadata.num_warps), int(getattr(compiled, "n_regs", 0))
    programs = resident_programs(shared, warps, regs, max_shared=max_shared)
    pct = fit_percent(shared, programs, max_shared) if POLICY == "fit" else 100
    _DONE[handle] = POLICY
    rc = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(handle),
                                       CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, ctypes.c_int(pct))
    if rc != 0:
        warnings.warn(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, {pct}) returned {rc}; "
                      "the kernel keeps Triton's carve-out", RuntimeWarning, stacklevel=2)
