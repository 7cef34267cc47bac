"""The static cost report of the fused kernels, compiled for a GPU without one (``convfirstnet kernels``,
``convfirstnet/commands/kernels.py``).

What it does, in order:

1. builds the fused model (``convfirstnet.fuse``) on the meta device in the requested dtype and runs
   one forward pass inside ``kernels._cost.recording()``: every op takes its Triton path and each
   ``launch`` is recorded with its arguments and the launcher's ``KernelCost`` declaration instead of
   running. Forward pre-hooks label each launch with the module path of the block that made it
   (``stages.3.0``), so nothing about the model is re-typed here;
2. binds every launch for the target (``compiled.variant_of``) and compiles each distinct variant
   once, in worker processes (``compiled.compile_variants``): registers, stack (spills), shared
   memory, occupancy, MMA instruction kind, SASS;
3. weights each variant's SASS by the loop trips its launches declare (``compiled.weigh``: loops the
   compiler unrolled are recognised, the declared tensor-core MACs decide between matchings that the
   loop structure alone leaves open, and a declaration that does not match the compiled loops is an
   error) and computes the three bounds of every launch (``estimate``): tensor core, DRAM,
   instruction issue;
4. sums them per block, stage and model next to the waterline's layer-wise bound and block-fusion
   ideal of the same blocks (``estimate.aggregate``), and writes JSON and Markdown.

The figures are estimates from compiled code and declared work, not measurements; a GPU benchmark
record of the same kernels wins over them.
"""

from __future__ import annotations

import datetime
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

import convfirstnet
from convfirstnet.factory import fuse
from convfirstnet.kernels._cost import Launch, Loop, recording
from convfirstnet.kernels._launch import HAS_TRITON
from convfirstnet.profile import count_macs

from . import compiled as cc
from .estimate import LaunchEstimate, aggregate, estimate_launch
from .provenance import git_info
from .targets import Target, target as get_target
from .waterline import build_kernels

FORMAT = "convfirstnet-kernels-report/1"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------ recording


def record_launches(model: nn.Module, x: torch.Tensor, target: Target | None = None) -> list[Launch]:
    """Run ``model(x)`` inside ``recording()`` and return its launches, each labelled with the module
    path of the innermost module whose forward was running (forward pre-hooks; the root is "").
    ``target``: the GPU the launchers size their grids and batch slices for (default: theirs, an H100)."""
    labels: list[str | None] = []
    handles = []
    with recording(*((target.sms, target.l2_bytes) if target else ())) as rec:

        def enter(path: str):
            def hook(module, args):
                labels.append(rec.block)
                rec.block = path

            return hook

        def leave(module, args, output):
            rec.block = labels.pop()

        for path, module in model.named_modules():
            if path:
                handles.append(module.register_forward_pre_hook(enter(path)))
                handles.append(module.register_forward_hook(leave, always_call=True))
        rec.block = ""
        try:
            with torch.no_grad():
                model(x)
        finally:
            for h in handles:
                h.remove()
    return rec.launches


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
            f"  [{done}/{total}] {c.variant.name} {_meta_text(c.variant.meta)}: {c.regs} registers, "
            f"{c.stack} B stack, {c.mma_kind} ({c.compile_s:.1f} s)"
        )

    known = {} if compiled is None else compiled
    todo = [v for v in variants if v.key not in known]
    for v, c in zip(todo, cc.compile_variants(todo, jobs=jobs, progress=on_done)):
        known[v.key] = c
    comps = [known[v.key] for v in variants]
    compile_s = time.perf_counter() - t0
    listings = [c.listing() for c in comps]
    occupancy = []
    for c in comps:
        occ = tgt.occupancy(c.num_warps, c.regs, c.shared)
        if occ < 1:
            raise ValueError(
                f"{c.variant.name} {_meta_text(c.variant.meta)} does not fit on one SM of "
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
                f"kernel {kernel_name(lc)} {_meta_text(variants[vi].meta)} launched by block "
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
            uses[key] = dict(
                loops=w.rows,
                insns_per_warp=w.per_warp,
                mix=cc.instruction_mix(w.counts),
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
            )
        )

    rows = []
    for vi, (c, (insns, loops)) in enumerate(zip(comps, listings)):
        vuses = [u for key, u in uses.items() if key[0] == vi]
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
                sass_instructions=len(insns),
                sass_loops=_loops_json(loops),
                static_mix=cc.instruction_mix(Counter(ins.opcode for ins in insns)),
                compile_s=round(c.compile_s, 2),
                launches=sum(u["launches"] for u in vuses),
                uses=vuses,
                binding=c.variant.to_json(),
            )
        )
    return Estimates(tgt, rows, estimates, comps, compile_s)


def build_report(
    model: nn.Module,
    input_size: tuple[int, int, int],
    *,
    batch: int,
    dtype: str = "float16",
    arch: int | str = 90,
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
    name: str | None = None,
) -> dict:
    """The report of a training-form ConvFirstNet (or a stack of its blocks) as a JSON-able dict.

    ``input_size`` is (C, H, W) of one input; ``dtype`` one of ``DTYPES``; ``arch`` a key of
    ``targets.TARGETS`` (``90``, ``"sm_80"``, ...). ``progress`` receives one line per step.
    Raises ``ValueError`` with what to fix for a launch without a declaration, a declaration whose
    loops do not match the SASS or whose useful MACs do not add up to the block's, a variant that
    does not fit on an SM; ``RuntimeError`` for a variant that does not compile.
    """
    import triton

    say = progress or (lambda line: None)
    if dtype not in DTYPES:
        raise ValueError(
            f"dtype {dtype!r}: the report models 16-bit tensor-core operands, use one of {', '.join(DTYPES)}"
        )
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    if not HAS_TRITON:
        raise RuntimeError("the static cost report compiles Triton kernels: install triton (Linux)")
    tgt = get_target(arch)
    torch_dtype = DTYPES[dtype]
    elem_bytes = torch.empty((), dtype=torch_dtype).element_size()

    # 1. record the fused model's launches on meta tensors
    fused = fuse(model).to(torch_dtype).to("meta")  # fuse() works on a copy
    x = torch.empty(batch, *input_size, device="meta", dtype=torch_dtype).contiguous(
        memory_format=torch.channels_last
    )
    launches = record_launches(fused, x, tgt)
    say(f"recorded {len(launches)} launches")

    # 2., 3. compile the distinct variants, weight their SASS, bound each launch
    est = estimate_launches(launches, tgt.arch, jobs=jobs, progress=progress)

    # 4. blocks, stages, model, against the waterline of the same model
    layerwise, fusion = build_kernels(model, input_size, batch, elem_bytes)
    agg = aggregate(est.launches, layerwise, fusion, tgt)
    macs = count_macs(model, input_size)
    if agg["total"]["useful_macs"] != macs * batch:  # the waterline's own invariant; checked, not assumed
        raise AssertionError(
            f"useful MACs {agg['total']['useful_macs']:,} != count_macs {macs:,} x batch {batch}"
        )

    total = agg["total"]
    return dict(
        format=FORMAT,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=name or type(model).__name__,
        batch=batch,
        input_size=list(input_size),
        img_size=input_size[-1],
        dtype=dtype,
        elem_bytes=elem_bytes,
        target=_target_json(tgt),
        versions=dict(
            convfirstnet=convfirstnet.__version__, torch=torch.__version__, triton=triton.__version__
        ),
        git=git_info(),
        count_macs_per_image=macs,
        predicted_ms=total["predicted_ms"],
        layerwise_ms=total["layerwise_ms"],
        fusion_ideal_ms=total["fusion_ideal_ms"],
        predicted_over_layerwise=total["predicted_over_layerwise"],
        launch_count=len(launches),
        variant_count=len(est.variants),
        compile_wall_s=round(est.compile_s, 1),
        total=total,
        stages=agg["stages"],
        blocks=agg["blocks"],
        variants=est.variants,
        launches=[e.to_json() for e in est.launches],
    )


def _target_json(t: Target) -> dict:
    d = t.device
    return dict(
        arch=t.arch,
        name=t.name,
        device_key=d.key,
        device=d.name,
        sms=t.sms,
        clock_ghz=t.clock_hz / 1e9,
        peak_tflops=d.peak_tflops,
        dram_tbs=d.bandwidth_tbs,
        issue_per_clock_sm=t.issue_per_clock_sm,
        tensor_flop_per_clock_sm=t.tensor_flop_per_clock_sm,
        l2_bytes=t.l2_bytes,
    )


def _meta_text(meta: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in meta.items())


# -------------------------------------------------------------------------------------------- markdown


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _issued(row: dict, which: str = "") -> str:
    """Tensor-core MACs over useful MACs: as compiled (``which=""``) or as declared (``"declared_"``)."""
    if row["useful_macs"] and not row[f"{which}mma_macs"]:
        return "no MMA"
    return _ratio(row[f"{which}issued_over_useful" if not which else "declared_over_useful"])


def _mma_check(uses: list[dict]) -> str:
    """Tensor-core MACs per program in the compiled code over the declared ones, per use of a variant."""
    out = []
    for u in uses:
        sass, declared = u["tensor_macs_per_program"], u["declared_mma_macs_per_program"]
        if sass is None:
            out.append("unknown shape")
        elif not declared:
            out.append("-" if not sass else "undeclared")
        else:
            out.append(f"{sass / declared:.2f}")
    return ", ".join(dict.fromkeys(out))


def _mix_text(mix: dict, top: int = 5) -> str:
    total = sum(mix.values()) or 1
    return ", ".join(f"{k} {100 * n / total:.0f}%" for k, n in list(mix.items())[:top])


def _loops_text(rows: list[dict]) -> str:
    return (
        "; ".join(f"{'  ' * r['depth']}{r['name']} x{r['trips']} ({r['instructions']} insns)" for r in rows)
        or "-"
    )


def _table(header: Sequence[str], align: str, rows: Sequence[Sequence]) -> list[str]:
    """Markdown table lines; ``align`` has one character per column: "l" (left) or "r" (right)."""
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(map(str, r)) + " |" for r in (header, rule, *rows)]


def _block_bound(rep: dict, block: dict) -> str:
    """The bound that contributes most to a block's predicted time."""
    own = [rep["launches"][i] for i in block["launch_indices"]]
    if not own:
        return "waterline (not compiled)"
    shares: Counter = Counter()
    for e in own:
        shares[e["bound"]] += e["predicted_us"]
    return shares.most_common(1)[0][0]


def to_markdown(rep: dict) -> str:
    """The report as Markdown: headline, stages, blocks, variants (from the JSON dict, so a saved
    report renders the same)."""
    t = rep["target"]
    lines = [
        f"# Static cost report: {rep['model']}, batch {rep['batch']}, {rep['img_size']}x{rep['img_size']}, "
        f"{rep['dtype']}, sm_{t['arch']}",
        "",
        f"Target {t['name']}: {t['sms']} SMs, {t['clock_ghz']:.2f} GHz, {t['peak_tflops']:g} TFLOP/s dense "
        f"16-bit, {t['dram_tbs']:g} TB/s, {t['issue_per_clock_sm']} warp-instructions/clock/SM. Triton "
        f"{rep['versions']['triton']}, torch {rep['versions']['torch']}. `{rep.get('command', '')}`",
        "",
        "Estimates from the compiled code and the launchers' cost declarations, not measurements: each "
        "bound assumes its unit at peak (tensor core: the MACs the compiled tensor-core instructions issue; "
        "DRAM: the declared minimal bytes; issue: SASS instructions weighted by loop trips); predicted = "
        "the largest per launch, summed. issued/useful counts the compiled tensor-core instructions, "
        "declared/useful the launchers' tile arithmetic. A GPU benchmark record wins over these figures.",
        "",
        f"**Model: predicted {rep['predicted_ms']:.3f} ms per batch, layer-wise bound "
        f"{rep['layerwise_ms']:.3f} ms (ratio {_ratio(rep['predicted_over_layerwise'])}), block-fusion ideal "
        f"{rep['fusion_ideal_ms']:.3f} ms.** {rep['launch_count']} launches, {rep['variant_count']} distinct "
        "variants.",
        "",
        "## Stages",
        "",
    ]
    rows = []
    for s in rep["stages"] + [dict(rep["total"], stage="**model**", blocks=rep["blocks"])]:
        rows.append(
            [
                s["stage"],
                len(s["blocks"]),
                s["launches"],
                f"{s['useful_macs'] / 1e9:.2f}",
                f"{s['mma_macs'] / 1e9:.2f}",
                _issued(s),
                _issued(s, "declared_"),
                f"{s['dram_bytes'] / 1e9:.3f}",
                f"{s['t_tensor_ms']:.3f}",
                f"{s['t_dram_ms']:.3f}",
                f"{s['t_issue_ms']:.3f}",
                f"{s['predicted_ms']:.3f}",
                f"{s['layerwise_ms']:.3f}",
                _ratio(s["predicted_over_layerwise"]),
                f"{s['fusion_ideal_ms']:.3f}",
            ]
        )
    lines += _table(
        [
            "stage",
            "blocks",
            "launches",
            "useful GMAC",
            "issued GMAC",
            "issued/useful",
            "declared/useful",
            "DRAM GB",
            "tensor ms",
            "DRAM ms",
            "issue ms",
            "predicted ms",
            "layer-wise ms",
            "predicted/layer-wise",
            "block-fusion ideal ms",
        ],
        "lrrrrrrrrrrrrrr",
        rows,
    )
    rows = []
    for b in rep["blocks"]:
        rows.append(
            [
                b["path"],
                b["kind"],
                b["stage"],
                b["launches"],
                f"{b['useful_macs'] / 1e9:.3f}",
                _issued(b),
                _issued(b, "declared_"),
                f"{b['dram_bytes'] / 1e6:.2f}",
                f"{1e3 * b['t_tensor_ms']:.1f}",
                f"{1e3 * b['t_dram_ms']:.1f}",
                f"{1e3 * b['t_issue_ms']:.1f}",
                f"{1e3 * b['predicted_ms']:.1f}",
                _block_bound(rep, b),
                f"{1e3 * b['layerwise_ms']:.1f}",
                _ratio(b["predicted_over_layerwise"]),
                f"{1e3 * b['fusion_ideal_ms']:.1f}",
            ]
        )
    lines += ["", "## Blocks", ""] + _table(
        [
            "block",
            "kind",
            "stage",
            "launches",
            "useful GMAC",
            "issued/useful",
            "declared/useful",
            "DRAM MB",
            "tensor µs",
            "DRAM µs",
            "issue µs",
            "predicted µs",
            "bound",
            "layer-wise µs",
            "predicted/layer-wise",
            "block-fusion ideal µs",
        ],
        "lllrrrrrrrrrlrrr",
        rows,
    )
    uncompiled = [b for b in rep["blocks"] if not b["launch_indices"]]
    if uncompiled:
        lines += ["", "; ".join(f"{b['path']}: {b['implemented_by']}" for b in uncompiled) + "."]
    rows = []
    for v in rep["variants"]:
        first = v["uses"][0]
        counts = sorted({u["insns_per_warp"] for u in v["uses"]})
        count = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}-{counts[-1]:,}"
        unrolled = sorted({n for u in v["uses"] for n in u["loops_unrolled_by_compiler"]})
        loops = _loops_text(first["loops"]) + (
            f"; unrolled by the compiler: {', '.join(unrolled)}" if unrolled else ""
        )
        rows.append(
            [
                v["index"],
                v["kernel"].rsplit(".", 1)[-1],
                _meta_text(v["meta"]),
                v["num_warps"],
                v["regs"],
                v["stack_bytes"],
                f"{v['shared_bytes'] / 1024:.1f}",
                v["programs_per_sm"],
                v["mma_kind"],
                _mma_check(v["uses"]),
                f"{v['sass_instructions']:,}",
                v["launches"],
                loops,
                count,
                _mix_text(first["mix"]),
            ]
        )
    lines += ["", "## Variants", ""] + _table(
        [
            "#",
            "kernel",
            "constexprs / options",
            "warps",
            "regs",
            "stack B",
            "shared KB",
            "programs/SM",
            "MMA",
            "MMA MACs compiled/declared",
            "SASS insns",
            "launches",
            "loops (trips, body insns)",
            "insns/warp (weighted)",
            "instruction mix (weighted)",
        ],
        "rllrrrrrlrrrlrl",
        rows,
    )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ reading saved reports


def static_latencies(
    source: str | Path | Sequence[str | Path],
    device_key: str,
    batch: int,
    img_size: int = 256,
    elem_bytes: int = 2,
) -> dict[str, dict]:
    """Predicted ms per model from saved report JSON files (a folder of them, or a list of files) whose
    target is costed as ``device_key`` (``h100`` for sm_90, ``a100`` for sm_80) at this batch, image
    size and element size; the newest report of a model wins. Keys are model names."""
    if isinstance(source, (str, Path)):
        src = Path(source)
        files = sorted(src.glob("*.json")) if src.is_dir() else [src]
    else:
        files = [Path(p) for p in source]
    best: dict[str, dict] = {}
    for path in files:
        try:
            rep = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(rep, dict) or rep.get("format") != FORMAT:
            continue
        if (rep["target"]["device_key"], rep["batch"], rep["img_size"], rep["elem_bytes"]) != (
            device_key,
            batch,
            img_size,
            elem_bytes,
        ):
            continue
        cur = best.get(rep["model"])
        if cur is None or rep["created"] > cur["created"]:
            best[rep["model"]] = dict(
                predicted_ms=rep["predicted_ms"],
                layerwise_ms=rep["layerwise_ms"],
                created=rep["created"],
                file=str(path),
                arch=rep["target"]["arch"],
            )
    return best
