"""Timing and statistics for ``convfirstnet bench`` and the default ``convfirstnet`` job.

GPU work is timed with one pair of CUDA events per iteration (device time, launch overhead included
when the host cannot run ahead); CPU work with ``time.perf_counter``. Statistics are over the timed
iterations only; warm-up iterations (compilation, autotuning, allocator growth) are discarded.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch


# ------------------------------------------------------------------------------------ statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Percentile ``q`` in [0, 100] with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(times_ms: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90, mean, min, max and count of per-iteration times (milliseconds)."""
    if not times_ms:
        raise ValueError("no timed iterations")
    return dict(
        median=percentile(times_ms, 50),
        p10=percentile(times_ms, 10),
        p90=percentile(times_ms, 90),
        mean=sum(times_ms) / len(times_ms),
        min=min(times_ms),
        max=max(times_ms),
        n=len(times_ms),
    )


def throughput(batch: int, ms_per_batch: float, macs_per_image: int, peak_tflops: float | None) -> dict:
    """Images/s, achieved TFLOP/s (2 x MACs x img/s) and % of ``peak_tflops`` (None when unknown)."""
    img_s = batch / (ms_per_batch / 1e3)
    tflops = 2 * macs_per_image * img_s / 1e12
    pct = 100 * tflops / peak_tflops if peak_tflops else None
    return dict(img_per_s=img_s, tflops=tflops, pct_peak=pct)


# ----------------------------------------------------------------------------------------- timers
def time_iterations(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Run ``fn`` ``warmup`` times untimed, then ``iters`` times; per-iteration milliseconds."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends, strict=True):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype, size: int | None = None, iters: int = 20
) -> dict:
    """Achieved dense matmul TFLOP/s (best of a few square sizes): an empirical peak for this device.

    On GPU the sizes are large enough to be compute bound; the result is what cuBLAS reaches at the
    current clocks, usually 60-90 % of the datasheet figure.
    """
    sizes = [size] if size else ([4096, 8192] if device.type == "cuda" else [512])
    best = None
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        with torch.no_grad():
            times = time_iterations(lambda a=a, b=b: torch.mm(a, b), device, warmup=3, iters=iters)
        med = summarize(times)["median"]
        tflops = 2 * n**3 / (med / 1e3) / 1e12
        if best is None or tflops > best["tflops"]:
            best = dict(tflops=tflops, size=n, dtype=str(dtype).removeprefix("torch."), median_ms=med)
        del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return best
