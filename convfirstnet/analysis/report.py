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
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

import convfirstnet
from convfirstnet.factory import fuse
from convfirstnet.kernels._cost import Launch, recording
from convfirstnet.kernels._launch import HAS_TRITON
from convfirstnet.profile import count_macs

from .calibration import BAND_SM90, band_text, calibrated
from .estimate import aggregate
from .hardware import hardware
from .launches import check_declarations, estimate_launches, meta_text
from .provenance import git_info
from .targets import Target, target as get_target
from .waterline import build_kernels

FORMAT = "convfirstnet-kernels-report/2"
FORMATS = ("convfirstnet-kernels-report/1", FORMAT)  # /1: one predicted figure, no L2/latency terms
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------ recording


def record_launches(model: nn.Module, x: torch.Tensor, target: Target | None = None) -> list[Launch]:
    """Run ``model(x)`` inside ``recording()`` and return its launches, each labelled with the module
    path of the innermost module whose forward was running (forward pre-hooks; the root is "").
    ``target``: the GPU the launchers size their grids and batch slices for (default: theirs, an H100)."""
    labels: list[str | None] = []
    handles = []
    gpu = dict(sms=target.sms, l2_bytes=target.l2_bytes, shared_per_block=target.smem_per_block,
               arch=target.arch) if target else {}
    with recording(**gpu) as rec:

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
    try:
        fused = fuse(model).to(torch_dtype).to("meta")  # fuse() works on a copy
        x = torch.empty(batch, *input_size, device="meta", dtype=torch_dtype).contiguous(
            memory_format=torch.channels_last
        )
        launches = record_launches(fused, x, tgt)
    except Exception as e:  # a forward pass that cannot run on meta tensors: the model cannot be recorded
        raise ValueError(
            f"cannot record the kernel launches of {name or type(model).__name__} "
            f"({dtype}, batch {batch}, {input_size[-1]}x{input_size[-1]}): {type(e).__name__}: {e}"
        ) from e
    if not launches:
        raise ValueError(
            f"{name or type(model).__name__} made no Triton kernel launch while recording: the "
            "report covers fused ConvFirstNet blocks (convfirstnet.fuse)"
        )
    check_declarations(launches)
    say(f"recorded {len(launches)} launches")

    # 2., 3. compile the distinct variants, weight their SASS, bound each launch
    est = estimate_launches(launches, tgt.arch, jobs=jobs, progress=progress)

    # 4. blocks, stages, model, against the waterline of the same model
    layerwise, fusion = build_kernels(model, input_size, batch, elem_bytes)
    agg = aggregate(est.launches, layerwise, fusion, tgt)
    variant_of_launch = {e.index: e.variant for e in est.launches}
    for b in agg["blocks"]:  # what the kernel redesign reads per block: spills and the MMA instructions
        vs = sorted({variant_of_launch[i] for i in b["launch_indices"]})
        b["variants"] = vs
        b["stack_bytes"] = max((est.variants[v]["stack_bytes"] for v in vs), default=0)
        b["mma_kinds"] = sorted({k for v in vs for k in est.variants[v]["mma_kind"].split("+")})
    macs = count_macs(model, input_size)
    if agg["total"]["useful_macs"] != macs * batch:  # the waterline's own invariant; checked, not assumed
        raise AssertionError(
            f"useful MACs {agg['total']['useful_macs']:,} != count_macs {macs:,} x batch {batch}"
        )

    total = agg["total"]
    spills = {v["index"]: v["stack_bytes"] for v in est.variants if v["stack_bytes"]}
    calibration = None
    if tgt.arch == 90:  # the band measured on H100 (analysis/calibration.py, benchmarks/calibration)
        calibration = dict(
            band=BAND_SM90,
            text=band_text(BAND_SM90),
            predicted_ms=calibrated(total["predicted_ms"]["low"], total["predicted_ms"]["high"]),
            predicted_stream_ms=calibrated(
                total["predicted_stream_ms"]["low"], total["predicted_stream_ms"]["high"]
            ),
        )
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
        hardware=hardware(tgt.arch).to_json(),
        versions=dict(
            convfirstnet=convfirstnet.__version__, torch=torch.__version__, triton=triton.__version__
        ),
        git=git_info(),
        count_macs_per_image=macs,
        # the low end with CUDA graphs (what a reader of format /1 took as "the" prediction)
        predicted_ms=total["predicted_ms"]["low"],
        predicted_low_ms=total["predicted_ms"]["low"],
        predicted_high_ms=total["predicted_ms"]["high"],
        predicted_stream_low_ms=total["predicted_stream_ms"]["low"],
        predicted_stream_high_ms=total["predicted_stream_ms"]["high"],
        layerwise_ms=total["layerwise_ms"]["low"],
        layerwise_low_ms=total["layerwise_ms"]["low"],
        layerwise_high_ms=total["layerwise_ms"]["high"],
        fusion_ideal_ms=total["fusion_ideal_ms"],
        predicted_over_layerwise=total["predicted_over_layerwise"],
        l2_bytes=total["l2_bytes"],
        dram_bytes=total["dram_bytes"],
        spilling_variants=spills,
        calibration=calibration,
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


def _ratio(v) -> str:
    if isinstance(v, dict):
        v = v.get("high")
    return "-" if v is None else f"{v:.2f}x"


def _band(d: dict, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    """A low/high pair as "low-high" (one figure when both ends agree to the shown precision)."""
    lo, hi = fmt.format(d["low"] * scale), fmt.format(d["high"] * scale)
    return lo if lo == hi else f"{lo}-{hi}"


def _issued(row: dict, which: str = "") -> str:
    """Tensor-core MACs over useful MACs: as compiled (``which=""``) or as declared (``"declared_"``)."""
    if row["useful_macs"] and not row[f"{which}mma_macs"]:
        return "no MMA"
    return _ratio(row[f"{which}issued_over_useful" if not which else "declared_over_useful"])


def _mma_check(uses: list[dict]) -> str:
    """Tensor-core MACs per program in the compiled code over the declared ones, per use of a variant."""
    out = []
    for u in uses:
        sass_macs, declared = u["tensor_macs_per_program"], u["declared_mma_macs_per_program"]
        if sass_macs is None:
            out.append("unknown shape")
        elif not declared:
            out.append("-" if not sass_macs else "undeclared")
        else:
            out.append(f"{sass_macs / declared:.2f}")
    return ", ".join(dict.fromkeys(out))


def _mix_text(mix: dict, top: int = 5) -> str:
    total = sum(mix.values()) or 1
    return ", ".join(f"{k} {100 * n / total:.0f}%" for k, n in list(mix.items())[:top])


def _loops_text(rows: list[dict]) -> str:
    return (
        "; ".join(f"{'  ' * r['depth']}{r['name']} x{r['trips']} ({r['instructions']} insns)" for r in rows)
        or "-"
    )


ZERO = {"low": 0.0, "high": 0.0}  # a term a report from before it existed does not hold


def _table(header: Sequence[str], align: str, rows: Sequence[Sequence]) -> list[str]:
    """Markdown table lines; ``align`` has one character per column: "l" (left) or "r" (right)."""
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(map(str, r)) + " |" for r in (header, rule, *rows)]


def _latency(terms: dict) -> dict:
    return {end: terms["latency"][end] + terms["waits"][end] for end in ("low", "high")}


def _launch_groups(rep: dict) -> list[dict]:
    """Launches that are alike (kernel, variant, grid, declaration): one row each, with their count."""
    groups: dict[tuple, dict] = {}
    for e in rep["launches"]:
        key = (
            e["kernel"],
            e["variant"],
            tuple(e["grid"]),
            e["declaration"]["note"],
            round(e["predicted_us"]["high"], 3),
        )
        g = groups.setdefault(key, dict(e, count=0, blocks=[]))
        g["count"] += 1
        g["blocks"].append(e["block"])
    return list(groups.values())


def _blocks_text(paths: list[str]) -> str:
    uniq = list(dict.fromkeys(paths))
    return uniq[0] if len(uniq) == 1 else f"{uniq[0]} .. {uniq[-1]} ({len(uniq)} blocks)"


def to_markdown(rep: dict) -> str:
    """The report as Markdown: headline, constants, stages, blocks, launches, variants (from the JSON
    dict, so a saved report renders the same)."""
    if rep.get("format") != FORMAT:
        raise ValueError(f"this renders {FORMAT} reports; regenerate the report with `convfirstnet kernels`")
    t = rep["target"]
    tot = rep["total"]
    lines = [
        f"# Static cost report: {rep['model']}, batch {rep['batch']}, {rep['img_size']}x{rep['img_size']}, "
        f"{rep['dtype']}, sm_{t['arch']}",
        "",
        f"Target {t['name']}: {t['sms']} SMs. Triton {rep['versions']['triton']}, torch "
        f"{rep['versions']['torch']}. `{rep.get('command', '')}`",
        "",
        "Estimates from the compiled code and the launchers' cost declarations, not measurements. "
        "Per launch: "
        "max(tensor, DRAM, L2, issue, latency + waits) + launch gap, each term at the fast end of every "
        "constant (low) and at the slow end (high); see `convfirstnet/analysis/estimate.py` for why the "
        "terms "
        "combine so, and `convfirstnet/analysis/hardware.py` for the sources. L2 = bytes between the SMs and "
        "L2, counted from the SASS (loads that bypass L1, stores, L1 loads beyond the declared L1-resident "
        "bytes). latency = the stall cycles of one warp's SASS, waits = its exposed load and wgmma-group "
        "waits, both times the programs an SM slot runs one after another. The layer-wise bound gets the "
        "same constants and launch gaps. A GPU benchmark record wins over these figures.",
        "",
        f"**Model: predicted {_band(tot['predicted_ms'])} ms per batch with CUDA graphs, "
        f"{_band(tot['predicted_stream_ms'])} ms from a stream; layer-wise bound "
        f"{_band(tot['layerwise_ms'])} ms "
        f"(graphs); predicted/layer-wise {_ratio(tot['predicted_over_layerwise'])} (high ends).** "
        f"L2<->SM {_band(tot['l2_bytes'], 1e-9)} GB against {tot['dram_bytes'] / 1e9:.3f} GB of DRAM "
        f"({_ratio(tot['l2_over_dram'])}). {rep['launch_count']} launches, {rep['variant_count']} distinct "
        f"variants; binding terms (high end, ms): "
        + ", ".join(f"{k} {v:.3f}" for k, v in tot["bound_ms"].items())
        + ".",
    ]
    cal = rep.get("calibration")
    if cal:
        lines += [
            "",
            f"**Calibrated: {_band(cal['predicted_ms'])} ms with CUDA graphs, "
            f"{_band(cal['predicted_stream_ms'])} ms from a stream.** {cal['text']}",
        ]
    else:
        lines += ["", f"No calibration for sm_{t['arch']}: the band above is the constants' only."]
    hw = rep.get("hardware", {})
    rows = [
        [k, f"{v['fast']:g}", f"{v['slow']:g}", v["unit"], v["source"]]
        for k, v in hw.items()
        if isinstance(v, dict)
    ]
    if rows:
        lines += ["", "## Constants (fast end for the low prediction, slow end for the high)", ""]
        lines += _table(["constant", "fast", "slow", "unit", "source"], "lrrll", rows)
        lines += [
            "",
            f"mma.sync at {hw['mma_sync_fraction']:g} of the tensor rate; L1 + shared memory "
            f"{hw['l1_shared_bytes'] // 1024} KB per SM"
            + (f"; L1/shared data pipe {hw['lsu_wavefronts_per_clock']:g} wavefront (128 B) per clock per "
               f"SM ({hw['lsu_source']})." if "lsu_wavefronts_per_clock" in hw else "."),
        ]

    def term_cells(row: dict, scale: float, fmt: str) -> list[str]:
        tm = row["terms_ms"]
        return [
            _band(tm["tensor"], scale, fmt),
            _band(tm["dram"], scale, fmt),
            _band(tm["l2"], scale, fmt),
            _band(tm.get("lsu", ZERO), scale, fmt),
            _band(tm["issue"], scale, fmt),
            _band(tm["latency"], scale, fmt),
            _band(tm["waits"], scale, fmt),
            _band(row["launch_gap_ms"], scale, fmt),
        ]

    term_header = ["tensor", "DRAM", "L2", "L1 pipe", "issue", "latency", "waits", "launch gaps"]
    rows = []
    for s in rep["stages"] + [dict(tot, stage="**model**", blocks=rep["blocks"])]:
        rows.append(
            [
                s["stage"],
                len(s["blocks"]),
                s["launches"],
                f"{s['dram_bytes'] / 1e9:.3f}",
                _band(s["l2_bytes"], 1e-9),
                _ratio(s["l2_over_dram"]),
                *term_cells(s, 1, "{:.3f}"),
                _band(s["predicted_ms"]),
                _band(s["predicted_stream_ms"]),
                _band(s["layerwise_ms"]),
                _ratio(s["predicted_over_layerwise"]),
                s["bound"],
            ]
        )
    lines += ["", "## Stages (ms; low-high)", ""] + _table(
        [
            "stage",
            "blocks",
            "launches",
            "DRAM GB",
            "L2 GB",
            "L2/DRAM",
            *term_header,
            "predicted (graphs)",
            "predicted (stream)",
            "layer-wise (graphs)",
            "predicted/layer-wise",
            "binds",
        ],
        "lrrrrr" + "r" * len(term_header) + "rrrrl",
        rows,
    )
    rows = []
    for b in rep["blocks"]:
        rows.append(
            [
                b["path"],
                b["kind"],
                b["launches"],
                f"{b['dram_bytes'] / 1e6:.1f}",
                _band(b["l2_bytes"], 1e-6, "{:.1f}"),
                _ratio(b["l2_over_dram"]),
                *term_cells(b, 1e3, "{:.1f}"),
                _band(b["predicted_ms"], 1e3, "{:.1f}"),
                b["bound"],
                _band(b["layerwise_ms"], 1e3, "{:.1f}"),
                _ratio(b["predicted_over_layerwise"]),
                b.get("stack_bytes", 0),
                "+".join(b.get("mma_kinds", [])) or "-",
            ]
        )
    lines += ["", "## Blocks (µs; low-high)", ""] + _table(
        [
            "block",
            "kind",
            "launches",
            "DRAM MB",
            "L2 MB",
            "L2/DRAM",
            *term_header,
            "predicted (graphs)",
            "binds",
            "layer-wise (graphs)",
            "predicted/layer-wise",
            "stack B",
            "MMA",
        ],
        "llrrrr" + "r" * len(term_header) + "rlrrrl",
        rows,
    )
    uncompiled = [b for b in rep["blocks"] if not b["launch_indices"]]
    if uncompiled:
        lines += ["", "; ".join(f"{b['path']}: {b['implemented_by']}" for b in uncompiled) + "."]
    rows = []
    for g in _launch_groups(rep):
        tu = g["terms_us"]
        tr = g["traffic_per_program"] or {}
        lat = g["latency_per_warp"] or {}
        rows.append(
            [
                _blocks_text(g["blocks"]),
                g["count"],
                g["kernel"].rsplit(".", 1)[-1],
                g["variant"],
                "x".join(map(str, g["grid"])),
                g["programs_per_sm"],
                f"{g['warps_per_scheduler']:g}",
                g["rounds"],
                " / ".join(f"{tr.get(k, 0) / 1e3:.0f}" for k in ("load_bypass", "load_l1", "store")),
                {None: "-", True: "yes", False: "no"}[g["l1_fits"]],
                "-" if g.get("l1_configured_bytes") is None else f"{g['l1_configured_bytes'] // 1024}",
                _band({k: v / 1e6 for k, v in g["l2_bytes"].items()}, 1, "{:.1f}"),
                f"{g['dram_bytes'] / 1e6:.1f}",
                f"{lat.get('stall_cycles', 0):,.0f}",
                f"{lat.get('l2_waits', 0):,}",
                _band(tu["tensor"], 1, "{:.1f}"),
                _band(tu["dram"], 1, "{:.1f}"),
                _band(tu["l2"], 1, "{:.1f}"),
                _band(tu.get("lsu", ZERO), 1, "{:.1f}"),
                _band(tu["issue"], 1, "{:.1f}"),
                _band(tu["latency"], 1, "{:.1f}"),
                _band(tu["waits"], 1, "{:.1f}"),
                _band({k: v / 1e6 for k, v in g["predicted_us"].items()}, 1e6, "{:.1f}"),
                g["bound"],
                g["declaration"]["note"] or "-",
            ]
        )
    lines += [
        "",
        "## Launches (alike launches grouped; µs per launch, low-high)",
        "",
        "KB per program: loads that bypass L1 / L1-allocating loads / stores, as requested by the SASS. "
        "L1 fits: the declared L1-resident bytes fit in the L1 that the smallest carve-out holding the "
        "shared memory leaves, the L1 the kernels were designed for (then those loads count as the "
        "declared bytes); L1 KB: what the driver configures under the package's carve-out policy "
        "(kernels/_carveout.py; Triton's default leaves 28 KB above 48 KB of shared memory). Stall "
        "cycles and L2 waits (loads waited on sooner than an L2 hit returns) per warp.",
        "",
    ]
    lines += _table(
        [
            "blocks",
            "n",
            "kernel",
            "variant",
            "grid",
            "programs/SM",
            "warps/scheduler",
            "rounds",
            "KB/program (bypass / L1 / store)",
            "L1 fits",
            "L1 KB",
            "L2 MB",
            "DRAM MB",
            "stall cycles/warp",
            "L2 waits/warp",
            "tensor",
            "DRAM",
            "L2",
            "L1 pipe",
            "issue",
            "latency",
            "waits",
            "predicted",
            "binds",
            "note",
        ],
        "lrlrlrrrrlrrrrrrrrrrrrrll",
        rows,
    )
    rows = []
    for v in rep["variants"]:
        first = v["uses"][0]
        counts = sorted({u["insns_per_warp"] for u in v["uses"]})
        count = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}-{counts[-1]:,}"
        unrolled = sorted({n for u in v["uses"] for n in u["loops_unrolled_by_compiler"]})
        loops = _loops_text(first["loops"]) + (
            f"; unrolled by the compiler: {', '.join(unrolled)}" if unrolled else ""
        )
        mem = "; ".join(f"{k} x{n}" for k, n in v.get("memory_instructions", {}).items())
        rows.append(
            [
                v["index"],
                v["kernel"].rsplit(".", 1)[-1],
                meta_text(v["meta"]),
                v["num_warps"],
                v["regs"],
                v["stack_bytes"],
                f"{v['shared_bytes'] / 1024:.1f}",
                _stores_text(v.get("shared_stores")),
                v["programs_per_sm"],
                v["mma_kind"],
                _mma_check(v["uses"]),
                f"{v['sass_instructions']:,}",
                v["launches"],
                loops,
                count,
                _mix_text(first["mix"]),
                mem or "-",
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
            "shared stores: wavefronts / ideal",
            "programs/SM",
            "MMA",
            "MMA MACs compiled/declared",
            "SASS insns",
            "launches",
            "loops (trips, body insns)",
            "insns/warp (weighted)",
            "instruction mix (weighted)",
            "global memory instructions (static)",
        ],
        "rllrrrrlrlrrrlrll",
        rows,
    )
    lines += ["", "Shared stores: each copy of a register tile into a swizzled shared buffer in the TTGIR "
              "(its shape), and the wavefronts the first store of a warp takes against 32 lanes' bytes "
              "/ 128 (convfirstnet.analysis.shared: bank conflicts from the two layouts)."]
    return "\n".join(lines) + "\n"


def _stores_text(stores) -> str:
    if not stores:
        return "-"
    return "; ".join(f"{'x'.join(map(str, st['shape']))}: {st['wavefronts']}/{st['ideal']}" for st in stores)


# ---------------------------------------------------------------------------------------- diagnosis

# Issue 18's targets for the kernel redesign (fused Small, fp16, sm_90, batch 128)
TARGETS_MODEL_HIGH_MS = 2.5
TARGETS_STAGE_OVER_LAYERWISE = 0.5
TARGETS_L2_OVER_DRAM = 2.5


def design_floor_ms(rep: dict) -> tuple[float, float]:
    """What the recorded launches cost at least, high end, CUDA graphs: each launch at the larger of its
    tensor and DRAM terms (then also L2) plus its launch gap; latency, issue and waits fully hidden."""
    floor = floor_l2 = 0.0
    for launch in rep["launches"]:
        t = {k: launch["terms_us"][k]["high"] for k in ("tensor", "dram", "l2")}
        gap = launch["launch_gap_us"]["graph"]["high"]
        floor += max(t["tensor"], t["dram"]) + gap
        floor_l2 += max(t.values()) + gap
    return floor / 1e3, floor_l2 / 1e3


def diagnosis(rep: dict) -> str:
    """Per block what binds and by how much each redesign target is missed (Markdown), from a report."""
    tot = rep["total"]
    variants = rep["variants"]
    lines = [
        f"# What binds, per block: {rep['model']}, batch {rep['batch']}, {rep['dtype']}, "
        f"sm_{rep['target']['arch']}",
        "",
        f"From `{rep.get('command', '')}` (Triton {rep['versions']['triton']}); the full report is beside "
        "this file. Times in µs, low-high (constants at their fast and slow ends, CUDA graphs); binds = the "
        "largest term at the high end; L2/DRAM = L2<->SM bytes (high end) over declared DRAM bytes; wgmma = "
        "share of the block's tensor-core MACs on wgmma (the rest is mma.sync: the grouped 3x3 conv's "
        "batched "
        "two-tap dots); stack = the largest spill of its variants.",
        "",
        "| block | kind | predicted | layer-wise | predicted/layer-wise | binds | terms at the high end (µs) "
        "| L2 MB | DRAM MB | L2/DRAM | stack B | wgmma |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b in rep["blocks"]:
        tm = b["terms_ms"]
        terms = ", ".join(
            f"{t} {1e3 * tm[t]['high']:.0f}"
            for t in ("tensor", "dram", "l2", "lsu", "issue", "latency", "waits") if t in tm
        )
        wg = 1 - b["mma_sync_macs"] / b["mma_macs"] if b["mma_macs"] else None
        lines.append(
            f"| {b['path']} | {b['kind']} | {_band(b['predicted_ms'], 1e3, '{:.1f}')} "
            f"| {_band(b['layerwise_ms'], 1e3, '{:.1f}')} | {_ratio(b['predicted_over_layerwise'])} "
            f"| {b['bound']} "
            f"| {terms} | {b['l2_bytes']['high'] / 1e6:.0f} | {b['dram_bytes'] / 1e6:.0f} "
            f"| {_ratio(b['l2_over_dram'])} | {b.get('stack_bytes', 0)} "
            f"| {'-' if wg is None else f'{100 * wg:.0f}%'} |"
        )
    lines += [
        "",
        "## Stages",
        "",
        "| stage | predicted ms | layer-wise ms | predicted/layer-wise (low, high) | binds | L2/DRAM |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for s in rep["stages"] + [dict(tot, stage="**model**")]:
        r = s["predicted_over_layerwise"]
        lines.append(
            f"| {s['stage']} | {_band(s['predicted_ms'])} | {_band(s['layerwise_ms'])} "
            f"| {r['low']:.2f}, {r['high']:.2f} | {s['bound']} | {_ratio(s['l2_over_dram'])} |"
        )
    # the targets (issue 18 item 3)
    high = tot["predicted_ms"]["high"]
    stage_miss = [
        s for s in rep["stages"] if s["predicted_over_layerwise"]["high"] > TARGETS_STAGE_OVER_LAYERWISE
    ]
    l2_miss = [
        b for b in rep["blocks"] if b["launch_indices"] and (b["l2_over_dram"] or 0) > TARGETS_L2_OVER_DRAM
    ]
    spills = [v for v in variants if v["stack_bytes"]]
    sync = [v for v in variants if v["mma_kind"] != "wgmma" and v["mma_kind"] != "none"]
    worst_l2 = max(l2_miss, key=lambda b: b["l2_over_dram"], default=None)
    floor, floor_l2 = design_floor_ms(rep)
    lines += [
        "",
        "## The redesign targets (issue 18 item 3), as this report predicts them",
        "",
        f"* model high end <= {TARGETS_MODEL_HIGH_MS} ms: {high:.3f} ms, "
        + ("met." if high <= TARGETS_MODEL_HIGH_MS else f"missed by {high / TARGETS_MODEL_HIGH_MS:.2f}x."),
        f"  The floor of these launches (each at max(tensor, DRAM) at the high end, plus its launch gap): "
        f"{floor:.3f} ms; with L2 too: {floor_l2:.3f} ms"
        + (
            ". The target lies below the floor: it needs fewer DRAM bytes or tensor MACs (another design), "
            "not only hidden latency."
            if floor > TARGETS_MODEL_HIGH_MS
            else "."
        ),
        f"* every stage <= {TARGETS_STAGE_OVER_LAYERWISE}x its layer-wise bound (high ends): "
        + (
            "met."
            if not stage_miss
            else "missed by "
            + ", ".join(f"{s['stage']} ({s['predicted_over_layerwise']['high']:.2f}x)" for s in stage_miss)
            + "."
        ),
        f"* L2 bytes <= {TARGETS_L2_OVER_DRAM}x DRAM bytes for every block: "
        + (
            "met."
            if not l2_miss
            else f"missed by {len(l2_miss)} of "
            f"{sum(1 for b in rep['blocks'] if b['launch_indices'])} blocks (worst {worst_l2['path']}, "
            f"{worst_l2['l2_over_dram']:.1f}x)."
        ),
        "* no spills: "
        + (
            "met."
            if not spills
            else "missed by "
            + ", ".join(f"variant {v['index']} ({v['stack_bytes']} B)" for v in spills)
            + "."
        ),
        "* large dots on wgmma: the 1x1 layers (expand, FFN, projection, stem, head) compile to wgmma; "
        "variants "
        "that also issue mma.sync: "
        + (", ".join(f"{v['index']} ({v['kernel'].rsplit('.', 1)[-1]})" for v in sync) or "none")
        + " (the grouped 3x3 conv's batched dots).",
        "",
    ]
    return "\n".join(lines)


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
        if not isinstance(rep, dict) or rep.get("format") not in FORMATS:
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
                predicted_low_ms=rep.get("predicted_low_ms", rep["predicted_ms"]),
                predicted_high_ms=rep.get("predicted_high_ms", rep["predicted_ms"]),
                layerwise_ms=rep["layerwise_ms"],
                created=rep["created"],
                file=str(path),
                arch=rep["target"]["arch"],
            )
    return best
