"""Bind recorded launches for a GPU target, compile each distinct variant once and estimate every launch.

Steps 2 and 3 of the static cost report (``report.py``): :func:`estimate_launches` binds each recorded
:class:`~convfirstnet.kernels._cost.Launch` with Triton's binder (``compiled.variant_of``), compiles the
distinct variants in worker processes, weighs their SASS by the loops each launch declares, reads the
L2 traffic and the latency floor off the SASS (``sass``) and computes each launch's terms
(``estimate.estimate_launch``). The report and the calibration (``calibration.py``) both build on it.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from convfirstnet.kernels._cost import Launch, Loop

from . import compiled as cc
from . import sass
from .estimate import LaunchEstimate, estimate_launch
from .hardware import ENDS, hardware
from .shared import ptx_shared_accesses
from .targets import Target, target as get_target


def kernel_name(launch: Launch) -> str:
    fn = getattr(launch.kernel, "fn", launch.kernel)
    return f"{fn.__module__}.{fn.__name__}"


def check_declarations(launches: Sequence[Launch]) -> None:
    """Every launch must carry a ``KernelCost``: the report never makes one up."""
    missing = sorted(
        {f"{kernel_name(lc)} (from block {lc.block or '<root>'})" for lc in launches if lc.cost is None}
    )
    if missing:
        raise ValueError(
            f"no cost declaration for {', '.join(missing)}: pass cost=lambda: KernelCost(...) to launch() "
            "beside the kernel's launcher (see kernels/_cost.py for the counting rules)"
        )


# ---------------------------------------------------------------------------------------------- report


def _loops_json(loops: Sequence[cc.SassLoop]) -> list[dict]:
    return [
        dict(first=lp.start, last=lp.end, instructions=lp.size, loops=_loops_json(lp.children))
        for lp in loops
    ]


def _declared_key(loops: Sequence[Loop]) -> tuple:
    return tuple((lp.name, lp.trips, _declared_key(lp.body)) for lp in loops)


@dataclass
class Estimates:
    """What :func:`estimate_launches` returns: one row per distinct compiled variant (JSON-able) and one
    :class:`~convfirstnet.analysis.estimate.LaunchEstimate` per launch."""

    target: Target
    variants: list[dict]
    launches: list[LaunchEstimate]
    compiled: list[cc.Compiled]  # per variant, with the SASS listing
    compile_s: float


def estimate_launches(
    launches: Sequence[Launch],
    arch: int | str,
    *,
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
    compiled: dict[str, cc.Compiled] | None = None,
) -> Estimates:
    """Bind every launch for the target, compile each distinct variant once, weight its SASS by the loops
    each launch declares and compute the launch's bounds (steps 2 and 3 of the module docstring).

    ``compiled`` (variant key -> result) lends results of earlier calls in this process: variants found
    there are not compiled again, and the ones compiled here are added to it."""
    say = progress or (lambda line: None)
    check_declarations(launches)
    tgt = get_target(arch)
    keys: dict[str, int] = {}
    variants: list[cc.Variant] = []
    launch_variant: list[int] = []
    for lc in launches:
        v = cc.variant_of(lc, tgt.arch)
        if v.key not in keys:
            keys[v.key] = len(variants)
            variants.append(v)
        launch_variant.append(keys[v.key])
    say(f"compiling {len(variants)} distinct variants for sm_{tgt.arch}")
    t0 = time.perf_counter()

    def on_done(done: int, total: int, c: cc.Compiled) -> None:
        say(
            f"  [{done}/{total}] {c.variant.name} {meta_text(c.variant.meta)}: {c.regs} registers, "
            f"{c.stack} B stack, {c.mma_kind} ({c.compile_s:.1f} s)"
        )

    known = {} if compiled is None else compiled
    todo = [v for v in variants if v.key not in known]
    for v, c in zip(todo, cc.compile_variants(todo, jobs=jobs, progress=on_done)):
        known[v.key] = c
    comps = [known[v.key] for v in variants]
    compile_s = time.perf_counter() - t0
    listings = [c.listing() for c in comps]
    ldsm_conflicts = [ldsm_conflict(c.ptx) for c in comps]
    occupancy = []
    for c in comps:
        occ = tgt.occupancy(c.num_warps, c.regs, c.shared)
        if occ < 1:
            raise ValueError(
                f"{c.variant.name} {meta_text(c.variant.meta)} does not fit on one SM of "
                f"sm_{tgt.arch}: {c.regs} registers x {c.num_warps} warps, {c.shared} B shared memory"
            )
        occupancy.append(occ)

    uses: dict[tuple, dict] = {}  # (variant, declared loops, declared MMA per program) -> weighted SASS
    estimates: list[LaunchEstimate] = []
    for i, (lc, vi) in enumerate(zip(launches, launch_variant)):
        cost = lc.cost
        assert cost is not None  # check_declarations
        programs = math.prod(lc.grid)
        key = (vi, _declared_key(cost.loops), cost.mma_macs / programs)
        if key not in uses:
            insns, loops = listings[vi]
            what = (
                f"kernel {kernel_name(lc)} {meta_text(variants[vi].meta)} launched by block "
                f"{lc.block or '<root>'} (sm_{tgt.arch})"
            )
            w = cc.weigh(
                insns,
                loops,
                cost.loops,
                num_warps=comps[vi].num_warps,
                mma_macs_per_program=cost.mma_macs / programs,
                what=what,
            )
            hw = hardware(tgt.arch)
            controls = [ins.control for ins in insns]
            floor = None
            if all(c is not None for c in controls):
                mac_cycle = {
                    end: hw.tensor_tflops.pick(end) * 1e12 / 2 / (tgt.sms * hw.clock_hz.pick(end))
                    for end in ENDS
                }
                floor = sass.latency_floor(
                    insns,
                    controls,
                    w.weights,
                    loops,
                    l2_latency={end: hw.l2_latency_cycles.pick(end) for end in ENDS},
                    l1_latency={end: hw.l1_latency_cycles.pick(end) for end in ENDS},
                    wgmma_macs_per_cycle=mac_cycle,
                    num_warps=comps[vi].num_warps,
                )
            kinds = cc.tensor_macs_by_kind(w.counts, comps[vi].num_warps)
            uses[key] = dict(
                loops=w.rows,
                insns_per_warp=w.per_warp,
                mix=cc.instruction_mix(w.counts),
                traffic=sass.traffic(insns, w.weights, comps[vi].num_warps,
                                     store_conflict(comps[vi].shared_stores), ldsm_conflicts[vi]),
                latency=floor,
                mma_sync_macs_per_program=kinds["mma.sync"],
                tensor_macs_per_program=w.tensor_macs,
                declared_mma_macs_per_program=key[2],
                loops_unrolled_by_compiler=w.unrolled_away,
                matchings=w.candidates,
                launches=0,
                blocks=[],
            )
        use = uses[key]
        use["launches"] += 1
        if lc.block not in use["blocks"]:
            use["blocks"].append(lc.block)
        estimates.append(
            estimate_launch(
                index=i,
                block=lc.block or "",
                kernel=kernel_name(lc),
                variant=vi,
                grid=lc.grid,
                num_warps=comps[vi].num_warps,
                occupancy=occupancy[vi],
                insns_per_warp=use["insns_per_warp"],
                cost=cost,
                target=tgt,
                tensor_macs_per_program=use["tensor_macs_per_program"],
                mma_sync_macs_per_program=use["mma_sync_macs_per_program"],
                traffic=use["traffic"],
                latency=use["latency"],
                shared_bytes=comps[vi].shared,
            )
        )

    rows = []
    for vi, (c, (insns, loops)) in enumerate(zip(comps, listings)):
        vuses = [_use_json(u) for key, u in uses.items() if key[0] == vi]
        rows.append(
            dict(
                index=vi,
                kernel=f"{c.variant.module}.{c.variant.name}",
                meta=c.variant.meta,
                num_warps=c.num_warps,
                regs=c.regs,
                stack_bytes=c.stack,
                local_bytes=c.local,
                shared_bytes=c.shared,
                programs_per_sm=occupancy[vi],
                mma_kind=c.mma_kind,
                ptx_wgmma=c.ptx_wgmma,
                ptx_mma_sync=c.ptx_mma_sync,
                shared_stores=c.shared_stores,
                sass_instructions=len(insns),
                memory_instructions=memory_ops(insns),
                sass_loops=_loops_json(loops),
                static_mix=cc.instruction_mix(Counter(ins.opcode for ins in insns)),
                compile_s=round(c.compile_s, 2),
                launches=sum(u["launches"] for u in vuses),
                uses=vuses,
                binding=c.variant.to_json(),
            )
        )
    return Estimates(tgt, rows, estimates, comps, compile_s)


def store_conflict(stores: Sequence[dict]) -> dict[int, float]:
    """The conflict factors that the variant's shared stores are taken at, per vector width in bytes (the
    SASS STS of that width): that of the largest register -> shared copy of the width (analysis.shared),
    the one a loop body repeats in the kernels here (the grouped conv's tap pairs, 16-byte vectors; the
    smaller weight copies run once per chunk). A width without a copy in the TTGIR stores conflict-free
    (a tap order whose copy compiles conflict-free leaves the TTGIR no 16-byte copy, and the weights'
    8-byte copy must not price it). Against Nsight Compute on an H200 this puts the 16x16 MBConv hidden
    kernel's store conflicts at 20 M wavefronts per launch, 17.5 M measured."""
    out: dict[int, float] = {}
    for width in sorted({st["vector_bytes"] for st in stores}):
        big = max((st for st in stores if st["vector_bytes"] == width), key=lambda st: math.prod(st["shape"]))
        out[width] = big["wavefronts"] / big["ideal"]
    return out


def ldsm_conflict(ptx: str) -> float:
    """The conflict factor that the variant's ldmatrix reads are taken at: their wavefronts against the
    conflict-free count, summed over every ldmatrix of the PTX as warp 0 runs it
    (analysis.shared.ptx_shared_accesses). Triton 3.8 reads the MBConv conv's tap pairs back at 6x
    (672 / 112 per chunk) in the shipped load order; Triton 3.6 conflict-free, as measured (the shared
    loads of the 16x16 hidden kernel: 2 % conflicts)."""
    acc = [a for a in ptx_shared_accesses(ptx) if a.opcode.startswith("ldmatrix")]
    ideal = sum(a.ideal for a in acc)
    return sum(a.wavefronts for a in acc) / ideal if ideal else 1.0


def _use_json(u: dict) -> dict:
    out = dict(u)
    out["traffic"] = u["traffic"].to_json()
    out["latency"] = u["latency"].to_json() if u["latency"] else None
    return out


def memory_ops(insns: Sequence[cc.Instruction]) -> dict[str, int]:
    """Static count of each global memory instruction form in a listing (the classification of
    ``sass.memory_op``: which loads bypass L1)."""
    out: Counter = Counter()
    for ins in insns:
        op = sass.memory_op(ins.opcode)
        if op is not None:
            out[f"{ins.opcode} ({op.kind}{', L1' if op.kind == 'load' and op.l1 else ''})"] += 1
    return dict(out.most_common())


def meta_text(meta: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in meta.items())


# -------------------------------------------------------------------------------------------- markdown
