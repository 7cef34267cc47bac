"""``convfirstnet waterline``: the waterline model of ``convfirstnet.analysis.waterline`` as tables
(Markdown), JSON and plots (paper Fig. 15, 16 and 1(d)/17(d)).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from convfirstnet.analysis.devices import DEVICE_KEYS, DeviceSpec, device_by_key
from convfirstnet.analysis.paper import PAPER_BATCH, TABLE4
from convfirstnet.analysis.report import static_latencies
from convfirstnet.analysis.waterline import (
    Analysis,
    Kernel,
    analyze,
    block_wells,
    c_max_at,
    measured_latencies,
    summarize,
)

from ._cli import ArgumentParser, ToolError, run_reporting


# ---------------------------------------------------------------------------------------- markdown
def summary_table(a: Analysis) -> str:
    d = a.device
    lines = [
        f"Waterline, {a.model} @ {a.resolution}x{a.resolution}, batch {a.batch}, "
        f"{a.elem_bytes} bytes/element, "
        f"{d.name}: {d.peak_tflops:g} TFLOP/s, {d.bandwidth_tbs:g} TB/s, op:byte {d.op_byte:.0f}. "
        f"MACs/image {a.macs_per_image / 1e9:.3f} G (= count_macs).",
        "",
        "| execution | kernels | GOPs | DRAM GB | mediant OP/B | min latency ms | max efficiency (waterline) "
        "| roofline estimate | time memory-bound | img/s bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, s in a.summaries.items():
        lines.append(
            f"| {label} | {s.kernels} | {s.gops:.1f} | {s.dram_gb:.2f} | {s.mediant_intensity:.0f} "
            f"| {s.t_min_ms:.3f} "
            f"| {100 * s.c_max:.1f} % | {100 * s.roofline_c_max:.1f} % | {100 * s.memory_bound_time:.0f} % "
            f"| {s.img_per_s_bound:,.0f} |"
        )
    ideal_ms = 2 * a.macs_per_image * a.batch / (d.peak_tflops * 1e12) * 1e3
    lines.append("")
    lines.append(f"Ideal latency (all operations at peak): {ideal_ms:.3f} ms per batch of {a.batch}.")
    return "\n".join(lines)


def stage_table(a: Analysis) -> str:
    stages: list[str] = []
    for k in a.layerwise:
        if k.stage not in stages:
            stages.append(k.stage)
    lines = [
        "| stage | GOPs | layer-wise: kernels | DRAM GB | min ms "
        "| block-fusion: kernels | DRAM GB | min ms | OP/B (fused) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for st in stages:
        lk = [k for k in a.layerwise if k.stage == st]
        fk = [k for k in a.fused if k.stage == st]
        ops = sum(k.ops for k in fk)
        fb = sum(k.bytes for k in fk)
        lines.append(
            f"| {st} | {ops / 1e9:.1f} | {len(lk)} | {sum(k.bytes for k in lk) / 1e9:.3f} "
            f"| {sum(k.t_min(a.device) for k in lk) * 1e3:.3f} | {len(fk)} | {fb / 1e9:.3f} "
            f"| {sum(k.t_min(a.device) for k in fk) * 1e3:.3f} | {ops / fb:.0f} |"
        )
    return "\n".join(lines)


def kernel_table(kernels: Sequence[Kernel], dev: DeviceSpec) -> str:
    lines = [
        "| kernel | kind | MOPs | DRAM MB | OP/B | min µs | bound |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for k in kernels:
        bound = "memory" if k.memory_bound(dev) else "compute"
        lines.append(
            f"| {k.name} | {k.kind} | {k.ops / 1e6:.1f} | {k.bytes / 1e6:.2f} | {k.intensity:.1f} "
            f"| {k.t_min(dev) * 1e6:.1f} | {bound} |"
        )
    return "\n".join(lines)


def wells_table(rows: Sequence[dict], dev: DeviceSpec) -> str:
    lines = [
        f"Single stride-1 blocks, batch {PAPER_BATCH}, {dev.name} (op:byte {dev.op_byte:.0f}); the paper's "
        "Fig. 8 and 12 use the A5000 at its benchmark clocks (`--device a5000-paper`).",
        "",
        "| block | C | t | HxW | layer-wise min µs | block-fusion min µs | bound speed-up | fused OP/B "
        "| fused max eff. | paper measured speed-up (A5000) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['block']} | {r['channels']} | {r['expansion']} | {r['size']}x{r['size']} "
            f"| {r['layerwise_us']:.0f} "
            f"| {r['fused_us']:.0f} | {r['bound_speedup']:.1f}x | {r['fused_intensity']:.0f} "
            f"| {100 * r['fused_c_max']:.0f} % | {r['paper_measured_speedup']:.1f}x |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- plots
_COLORS = {
    "conv": "#8c564b",
    "pointwise": "#1f77b4",
    "grouped": "#ff7f0e",
    "pool/cat/multiply": "#7f7f7f",
    "linear": "#9467bd",
    "convfirst-fused": "#2ca02c",
    "mbconv-fused": "#d62728",
    "stem-fused": "#8c564b",
    "head-fused": "#e377c2",  # not the classifier's colour: both are in the block-fusion panel
}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ToolError("plots need matplotlib: pip install 'convfirstnet[plot]'") from e
    return plt


def plot_waterline(a: Analysis, path: str | Path) -> Path:
    """Paper Fig. 15 (two waterline panels: layer-wise and block-fusion) plus Fig. 16 (max efficiency
    vs processor op:byte, waterline and roofline).

    Each kernel is a bar as wide as its minimum latency and as high as its operational intensity; both
    panels share the latency axis (so their widths compare), each has its own intensity axis, and the
    legends sit outside the axes, beside the bars they explain.
    """
    plt = _pyplot()
    dev = a.device
    fig = plt.figure(figsize=(12, 10.5))
    grid = fig.add_gridspec(3, 1, height_ratios=[1, 1, 0.9], hspace=0.55)
    t_max = max(sum(k.t_min(dev) for k in ks) for ks in (a.layerwise, a.fused)) * 1e3
    waterline_color = "#17becf"
    for i, (label, ks) in enumerate((("layer-wise", a.layerwise), ("block-fusion", a.fused))):
        ax = fig.add_subplot(grid[i])
        ymax = 1.15 * max(dev.op_byte, max(k.intensity for k in ks))
        x = 0.0
        seen = set()
        for k in ks:
            w = k.t_min(dev) * 1e3
            ax.bar(
                x,
                k.intensity,
                width=w,
                align="edge",
                color=_COLORS.get(k.kind, "k"),
                edgecolor="white",
                linewidth=0.2,
                label=k.kind if k.kind not in seen else None,
            )
            seen.add(k.kind)
            x += w
        ax.axhline(
            dev.op_byte, color=waterline_color, lw=2, label=f"waterline: {dev.name} op:byte {dev.op_byte:.0f}"
        )
        ax.text(
            t_max, dev.op_byte, f"op:byte {dev.op_byte:.0f}", ha="right", va="bottom", color=waterline_color
        )
        s = summarize(ks, dev, a.batch)
        ax.set_title(
            f"{a.model}, {label}: min latency {s.t_min_ms:.2f} ms, max efficiency {100 * s.c_max:.0f} %"
            f" (batch {a.batch}, {a.resolution}px)"
        )
        ax.set_xlim(0, t_max * 1.01)
        ax.set_ylim(0, ymax)
        ax.set_ylabel("operational intensity [OP/B]")
        ax.set_xlabel("minimum attainable latency [ms]")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax = fig.add_subplot(grid[2])
    ratios = [r for r in range(10, 801, 10)]
    for label, ks, color in (("layer-wise", a.layerwise, "#1f77b4"), ("block-fusion", a.fused, "#2ca02c")):
        w, r = zip(*(c_max_at(ks, q) for q in ratios), strict=True)
        ax.plot(ratios, [100 * v for v in w], color=color, label=f"{label}: waterline")
        ax.plot(ratios, [100 * v for v in r], color=color, ls="--", label=f"{label}: roofline (mediant)")
    ax.axvline(dev.op_byte, color=waterline_color, lw=1.5, label=f"{dev.name}: op:byte {dev.op_byte:.0f}")
    ax.set_title(f"{a.model}: maximum efficiency vs processor op:byte (peak / DRAM bandwidth)")
    ax.set_xlabel("processor op:byte [OP/B]")
    ax.set_ylabel("max efficiency [%]")
    ax.set_xlim(0, ratios[-1])
    ax.set_ylim(0, 105)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_efficiency_gap(
    analyses: Sequence[Analysis], path: str | Path, measured: dict[str, dict] | None = None,
    static: dict[str, float] | None = None,
) -> Path:
    """Paper Fig. 1(d)/17(d): accuracy vs ideal latency, waterline minimum latencies and (when
    benchmark records exist) measured latency, log latency axis; gaps labelled with efficiency."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    dev = analyses[0].device
    series: dict[str, list] = {"ideal": [], "layer-wise bound": [], "block-fusion bound": [], "measured": []}
    for a in analyses:
        acc = TABLE4[a.model].top1
        ideal = 2 * a.macs_per_image * a.batch / (dev.peak_tflops * 1e12) * 1e3
        s = a.summaries
        series["ideal"].append((ideal, acc, a.model))
        series["layer-wise bound"].append((s["layer-wise"].t_min_ms, acc, a.model))
        series["block-fusion bound"].append((s["block-fusion"].t_min_ms, acc, a.model))
        m = (measured or {}).get(a.model)
        if m:
            series["measured"].append((m["ms_per_batch"], acc, a.model))
            eff = ideal / m["ms_per_batch"]
            ax.plot([ideal, m["ms_per_batch"]], [acc, acc], color="0.6", lw=1)
            ax.annotate(
                f"{100 * eff:.0f} %",
                (m["ms_per_batch"], acc),
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=8,
            )
    styles = {
        "ideal": ("o", "k"),
        "layer-wise bound": ("v", "#1f77b4"),
        "block-fusion bound": ("^", "#2ca02c"),
        "measured": ("s", "#d62728"),
    }
    for label, pts in series.items():
        if pts:
            mk, col = styles[label]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mk, color=col, label=label)
    # predicted ms per model from `convfirstnet kernels` reports (analysis.report.static_latencies)
    static_pts = [(static[a.model], TABLE4[a.model].top1) for a in analyses if a.model in (static or {})]
    if static_pts:
        ax.plot(*zip(*static_pts, strict=True), marker="x", color="#8c564b", ls="--",
                label="fused kernels as compiled (static estimate)")
    if dev.key.startswith("a5000") and analyses[0].batch == PAPER_BATCH:
        # the paper's own measurement (Table 4), on the paper's device
        pts = [(PAPER_BATCH / TABLE4[a.model].img_per_s * 1e3, TABLE4[a.model].top1) for a in analyses]
        ax.plot(
            *zip(*pts, strict=True), marker="D", color="#ff7f0e", ls=":", label="paper Table 4 (A5000, fused)"
        )
    for t, acc, name in series["ideal"]:
        ax.annotate(
            name.removeprefix("convfirstnet_"),
            (t, acc),
            textcoords="offset points",
            xytext=(-6, 6),
            fontsize=8,
            ha="right",
        )
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    # ticks at 1, 2, 5 x 10^k: a log axis spanning less than two decades gets several labels, not just "1"
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.08, y=0.08)
    ax.set_xlabel(f"latency per batch of {analyses[0].batch} [ms] ({dev.name}, {dev.peak_tflops:g} TFLOP/s)")
    ax.set_ylabel("ImageNet top-1 [%] (paper)")
    note = "" if series["measured"] else " - no measured records for this device yet"
    ax.set_title(f"Efficiency gap: ConvFirstNet{note}")
    ax.legend(fontsize=8, loc="lower right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="convfirstnet waterline",
        description="Waterline analysis (paper Sections 4-5): minimum latency and maximum efficiency of "
        "layer-wise vs block-fusion execution on a device.",
    )
    p.add_argument(
        "model", nargs="?", default=None, help="pico|nano|tiny|small (or convfirstnet_*); omit with --blocks"
    )
    p.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICE_KEYS)} (default h100)")
    p.add_argument("--batch", type=int, default=PAPER_BATCH, help="batch size (default 128, as the paper)")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument(
        "--bytes", type=int, default=2, dest="elem_bytes", help="bytes per element (2 = fp16/bf16)"
    )
    p.add_argument("--kernels", action="store_true", help="also print every kernel (both executions)")
    p.add_argument(
        "--blocks",
        choices=("convfirst", "mbconv", "all"),
        default=None,
        help="single blocks of the paper's Table 1/2 configurations (Fig. 8 and 12)",
    )
    p.add_argument("--plot", default=None, help="waterline PNG (layer-wise, block-fusion, op:byte sweep)")
    p.add_argument("--gap-plot", default=None, help="efficiency-gap PNG over the four sizes")
    p.add_argument(
        "--records",
        default="benchmarks/results",
        help="benchmark records for measured latency in --gap-plot (default benchmarks/results)",
    )
    p.add_argument(
        "--static-records",
        default="benchmarks/static",
        help="static cost reports (`convfirstnet kernels --json`) for --gap-plot: a folder of them or one "
        "file (default benchmarks/static); the newest report per model for this device, batch and bytes "
        "is drawn",
    )
    p.add_argument("--json", default=None, help="write the numbers as JSON here")
    p.add_argument("--markdown", default=None, help="also write the printed tables to this file")
    return p


def _analysis_json(a: Analysis) -> dict:
    return dict(
        model=a.model,
        device=asdict(a.device),
        batch=a.batch,
        resolution=a.resolution,
        elem_bytes=a.elem_bytes,
        macs_per_image=a.macs_per_image,
        summary={k: asdict(v) for k, v in a.summaries.items()},
        layerwise=[dict(asdict(k), t_min_us=k.t_min(a.device) * 1e6) for k in a.layerwise],
        fused=[dict(asdict(k), t_min_us=k.t_min(a.device) * 1e6) for k in a.fused],
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return run_reporting("convfirstnet waterline", lambda: run(args))


def run(args: argparse.Namespace) -> int:
    import convfirstnet  # noqa: F401
    from convfirstnet.registry import canonical_name
    from convfirstnet.model import MIN_INPUT_SIZE

    dev = device_by_key(args.device)  # ValueError naming the known devices
    if args.model is None and args.blocks is None and args.gap_plot is None:
        raise ToolError("give a MODEL, --blocks or --gap-plot")
    if args.model is not None:
        canonical_name(args.model)  # the block structure is known for ConvFirstNet only
    if args.batch < 1 or args.elem_bytes < 1:
        raise ToolError("--batch and --bytes must be at least 1")
    if args.resolution < MIN_INPUT_SIZE:
        raise ToolError(f"--resolution {args.resolution}: ConvFirstNet needs at least {MIN_INPUT_SIZE}")
    if args.plot and args.model is None:
        raise ToolError("--plot draws one model: give a MODEL (--gap-plot draws all four)")
    if args.plot or args.gap_plot:
        _pyplot()  # matplotlib missing: an error before anything is printed or written
    out: dict = {}
    text: list[str] = []
    if args.blocks:
        rows = block_wells(dev, args.blocks, args.batch, args.elem_bytes)
        text += [wells_table(rows, dev), ""]
        out["blocks"] = rows
    if args.model:
        a = analyze(args.model, dev, args.batch, args.resolution, args.elem_bytes)
        text += [summary_table(a), "", stage_table(a)]
        if args.kernels:
            for label, ks in (("layer-wise", a.layerwise), ("block-fusion", a.fused)):
                text += ["", f"{label} kernels:", "", kernel_table(ks, dev)]
        out["model"] = _analysis_json(a)
    print("\n".join(text))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(text).rstrip() + "\n")
    if args.model and args.plot:
        print(f"\nplot: {plot_waterline(a, args.plot)}")
    if args.gap_plot:
        analyses = [
            analyze(n, dev, args.batch, 256, args.elem_bytes) for n in ("pico", "nano", "tiny", "small")
        ]
        measured = measured_latencies(args.records, dev, args.batch) if Path(args.records).is_dir() else {}
        print(f"\nmeasured latencies used: {measured or 'none (no matching benchmark records)'}")
        reports = static_latencies(args.static_records, dev.key, args.batch, 256, args.elem_bytes)
        used = {m: f"{r['predicted_ms']:.3f} ms ({r['file']})" for m, r in reports.items()}
        print(f"static estimates used: {used or 'none (no matching static cost reports)'}")
        static = {m: r["predicted_ms"] for m, r in reports.items()}
        print(f"plot: {plot_efficiency_gap(analyses, args.gap_plot, measured, static=static)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
