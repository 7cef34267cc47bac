"""Compile the launches a launcher really makes, without a GPU, and the static bounds of one launch.

``record`` runs an op on meta tensors inside ``kernels._cost.recording()``: the launcher computes its
grid, constexprs and cost declaration exactly as for a GPU launch, and the launch is recorded instead
of run. ``compile_launches`` binds each recording for sm_90 / sm_80 with Triton's own binder and
compiles the distinct variants in worker processes (no interpreter there). ``bounds`` applies the
static cost model of the cost report to one launch: tensor cores, DRAM, instruction issue.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from convfirstnet.analysis.compiled import Compiled, compile_variants, variant_of, weighted_counts
from convfirstnet.analysis.targets import target
from convfirstnet.kernels._cost import Launch, recording

# Shared memory per block usable by a kernel (opt-in maximum): H100 227 KB, A100 163 KB.
SMEM_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


def record(fn: Callable[[], object]) -> list[Launch]:
    """The launches ``fn`` makes (call ops on meta tensors inside it)."""
    with recording() as rec:
        fn()
    return rec.launches


def compile_launches(
    launches: Sequence[Launch], archs: Sequence[int] = (90, 80)
) -> dict[tuple[int, int], Compiled]:
    """{(index of the launch, arch): compiled variant}; identical variants are compiled once."""
    keys, unique = {}, {}
    for i, launch in enumerate(launches):
        for arch in archs:
            v = variant_of(launch, arch)
            unique.setdefault(v.key, v)
            keys[(i, arch)] = v.key
    order = list(unique)
    done = dict(zip(order, compile_variants([unique[k] for k in order])))
    return {ik: done[key] for ik, key in keys.items()}


def bounds(launch: Launch, compiled: Compiled) -> dict:
    """Seconds for the launch's tensor-core work, its DRAM bytes and its issued instructions on the
    compiled variant's target (programs rounded up to whole waves of one program per SM)."""
    t = target(compiled.variant.arch)
    insns, loops = compiled.listing()
    counts, _ = weighted_counts(insns, loops, launch.cost.loops, compiled.variant.name)
    per_warp = sum(counts.values())
    programs = math.prod(launch.grid)
    waves = math.ceil(programs / t.sms) * t.sms / programs
    dev = t.device
    return dict(
        per_warp=per_warp,
        counts=counts,
        tensor=waves * launch.cost.mma_macs * 2 / (dev.peak_tflops * 1e12),
        dram=launch.cost.dram_bytes / (dev.bandwidth_tbs * 1e12),
        issue=waves * programs * compiled.num_warps * per_warp / (t.issue_per_clock_sm * t.sms * t.clock_hz),
    )
