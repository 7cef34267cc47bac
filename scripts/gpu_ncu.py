"""Hardware counters of one fused forward pass, kernel by kernel and block by block (Nsight Compute):
``python scripts/gpu_ncu.py [--model small] --out DIR``.

The static cost report (``convfirstnet kernels``) estimates each launch from its compiled code; the
GPU runs time whole blocks. Where the two disagree (the 16x16 MBConv hidden kernel measured nearly
the same time at 4, 8 and 16 warps and at 32 or 64 channels per chunk, where the model's terms moved
2x), the counters say which resource the kernel really waits on. One run:

1. a child process builds the fused model (batch 128, 256x256, fp16 by default), runs two forward
   passes (Triton compiles, autotuning) and then one forward pass between ``cudaProfilerStart`` and
   ``cudaProfilerStop``; ``ncu --profile-from-start off --set full --clock-control none`` (the clocks
   left as the driver runs them) profiles each of its launches;
2. the launches are attributed to blocks in order: the same model's launches are recorded on the meta
   device (``convfirstnet.analysis.report.record_launches``, the static report's own recording), and
   the n-th profiled kernel must carry the n-th recorded kernel's name;
3. ``DIR/ncu_raw.csv.gz``: every metric of every launch (``ncu --import ... --page raw --csv``);
   ``DIR/ncu_summary.json``: per launch a chosen set (time, clock, DRAM and L2 bytes, L1 hit rate,
   shared-memory wavefronts and bank conflicts, occupancy, tensor pipes, issue activity, warp stall
   reasons per issued instruction) with its block, and the time summed per block.

Without a GPU or without ``ncu`` it prints what it would run and exits 0.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, IMG, DTYPE = 128, 256, "float16"
LSU_WAVEFRONTS = "SM_A.TriageCompute.l1tex__data_pipe_lsu_wavefronts.avg"  # per SM (one L1 each)
# metrics kept per launch in the summary (the CSV keeps them all); warp stalls by prefix
KEEP = (
    "gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "sm__cycles_elapsed.max",
    "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum",
    "lts__t_sectors_srcunit_tex_op_read.sum", "lts__t_sectors_srcunit_tex_op_write.sum",
    "lts__t_sector_hit_rate.pct", "l1tex__t_sector_hit_rate.pct", "l1tex__t_bytes.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    # the L1/shared data pipe, all its wavefronts (per SM) and how busy it was: the report's "lsu" term
    LSU_WAVEFRONTS,
    "l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
    "smsp__average_warp_latency_per_inst_issued.ratio", "launch__registers_per_thread",
    "launch__shared_mem_per_block", "launch__shared_mem_config_size", "launch__func_cache_config",
    "launch__grid_size", "launch__block_size",
    "launch__waves_per_multiprocessor", "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
)
STALLS = "smsp__average_warps_issue_stalled_"  # + reason + "_per_issue_active.ratio": stalled warps per issue


def plan(args) -> list[str]:
    return [
        "1. ncu --profile-from-start off --set full --clock-control none on one fused forward of "
        f"{args.model}, batch {args.batch}, {args.img}x{args.img}, {args.dtype} (after two warm-up passes)",
        "2. launches attributed to blocks by the meta-device recording of the same model (names checked "
        "in order)",
        f"3. {args.out}/ncu_raw.csv.gz (every metric) and {args.out}/ncu_summary.json (chosen metrics, "
        "per block)",
    ]


# ------------------------------------------------------------------------------------------ child
def child(args) -> None:
    """The profiled process: warm-up outside the profiled range, then one forward inside it."""
    import torch

    from convfirstnet.factory import create_model, fuse

    dtype = getattr(torch, args.dtype)
    model = fuse(create_model(args.model)).to("cuda", dtype).eval()
    x = torch.randn(args.batch, 3, args.img, args.img, device="cuda", dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(2):
            model(x)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        model(x)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def recorded_launches(model_name: str, batch: int, img: int, dtype_name: str) -> list[dict]:
    """The fused model's launches in order, each with its block path and kernel name (meta device)."""
    import torch

    from convfirstnet.analysis.launches import kernel_name
    from convfirstnet.analysis.report import record_launches
    from convfirstnet.factory import create_model, fuse

    dtype = getattr(torch, dtype_name)
    fused = fuse(create_model(model_name)).to(dtype).to("meta")
    launches = record_launches(fused, torch.empty(batch, 3, img, img, device="meta", dtype=dtype))
    # block and kernel named as the static report names them (compare() checks them against it)
    return [dict(block=ln.block or "", kernel=kernel_name(ln).rsplit(".", 1)[-1], grid=list(ln.grid))
            for ln in launches]


# ------------------------------------------------------------------------------------------ parse
def _number(text: str):
    t = text.replace(",", "").strip()
    try:
        return float(t)
    except ValueError:
        return text


def parse_raw(text: str) -> list[dict]:
    """ncu's ``--page raw --csv``: a header row, a units row, then one row per launch. Returns one dict
    per launch: ``name``, ``units`` (metric -> unit) and ``metrics`` (metric -> number or text)."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    header = rows[start]
    units = dict(zip(header, rows[start + 1]))  # one units row for every launch: shared, not copied
    out = []
    for r in rows[start + 2:]:
        if len(r) != len(header):
            continue
        d = dict(zip(header, r))
        out.append(dict(name=d.get("Kernel Name", ""), metrics={k: _number(v) for k, v in d.items()},
                        units=units))
    return out


TIME_SCALE_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def duration_us(launch: dict, units: dict) -> float | None:
    """A profiled launch's ``gpu__time_duration.sum`` in microseconds (ncu prints ns, us or ms)."""
    value = launch["metrics"].get("gpu__time_duration.sum")
    scale = TIME_SCALE_US.get(units.get("gpu__time_duration.sum", ""))
    return value * scale if isinstance(value, float) and scale else None


def summarize(profiled: list[dict], recorded: list[dict]) -> dict:
    """Per launch the KEEP metrics with its block; the time summed per block. The n-th recorded launch
    must be the next profiled kernel whose name contains its name; a profiled kernel that is no
    recorded kernel at all (a library kernel, such as cuBLAS for a ``nn.Linear``) goes to the block
    before it, marked ``extra``; any other disagreement stops the attribution (the record says where)."""
    names = {r["kernel"] for r in recorded}
    launches, mismatch, j, block, units = [], None, 0, None, {}
    for i, p in enumerate(profiled):
        extra = False
        if mismatch is None:
            if j < len(recorded) and recorded[j]["kernel"] in p["name"]:
                block = recorded[j]["block"]
                j += 1
            elif not any(n in p["name"] for n in names):
                extra = True
            else:
                mismatch = dict(index=i, profiled=p["name"],
                                recorded=recorded[j]["kernel"] if j < len(recorded) else None)
        kept = {k: v for k, v in p["metrics"].items() if k in KEEP or k.startswith(STALLS)}
        units.update((k, p["units"].get(k, "")) for k in kept)
        launches.append(dict(index=i, kernel=p["name"], block=None if mismatch else block, extra=extra,
                             metrics=kept))
    per_block: dict[str, dict] = {}
    for ln in launches:
        us = duration_us(ln, units)
        if us is not None:
            b = per_block.setdefault(ln["block"] or "(unattributed)", dict(us=0.0, launches=0))
            b["us"] += us
            b["launches"] += 1
    return dict(units=units, launches=launches, per_block=per_block, attribution_mismatch=mismatch,
                recorded_launches=len(recorded), profiled_launches=len(profiled))


# ------------------------------------------------------------------------------------ comparison
def _metric(launch: dict, name: str) -> float:
    v = launch["metrics"].get(name)
    return v if isinstance(v, float) else float("nan")


def _mb(launch: dict, units: dict, name: str) -> float:
    """A byte count in MB whatever unit ncu printed it in."""
    scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}.get(units.get(name, ""), float("nan"))
    return _metric(launch, name) * scale


def measured_row(launch: dict, units: dict) -> dict:
    """The figures of one profiled launch that the static report also estimates, and what it waited on."""
    stalls = {k.split("stalled_")[1].split("_per_issue")[0]: v for k, v in launch["metrics"].items()
              if k.startswith(STALLS) and isinstance(v, float)
              and k.split("stalled_")[1].split("_per_issue")[0] not in ("selected", "not_selected")}
    return dict(
        us=duration_us(launch, units), clock_ghz=_metric(launch, "sm__cycles_elapsed.avg.per_second"),
        dram_mb=_mb(launch, units, "dram__bytes_read.sum") + _mb(launch, units, "dram__bytes_write.sum"),
        l2_mb=32e-6 * (_metric(launch, "lts__t_sectors_srcunit_tex_op_read.sum")
                       + _metric(launch, "lts__t_sectors_srcunit_tex_op_write.sum")),
        l1_hit_pct=_metric(launch, "l1tex__t_sector_hit_rate.pct"),
        shared_wavefronts_m=_metric(launch, "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum") / 1e6,
        lsu_wavefronts_k_per_sm=_metric(launch, LSU_WAVEFRONTS) / 1e3,
        lsu_pct=_metric(launch, "l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed"),
        shared_conflict_pct=100 * _metric(launch, "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum")
        / max(_metric(launch, "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"), 1.0),
        issue_pct=_metric(launch, "smsp__issue_active.avg.pct_of_peak_sustained_active"),
        warps_pct=_metric(launch, "sm__warps_active.avg.pct_of_peak_sustained_active"),
        stalls=dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:3]))


def compare(summary: dict, report: dict) -> list[dict]:
    """Profiled launches against the static report's (same order: both record the same forward pass),
    grouped by the report's compiled variant and grid: measured (mean over the group's launches) beside
    predicted. Library kernels (``extra``) have no prediction and are left out."""
    ours = [ln for ln in summary["launches"] if not ln.get("extra")]
    groups: dict[tuple, dict] = {}
    for ln, pred in zip(ours, report["launches"]):
        short = pred["kernel"].rsplit(".", 1)[-1]
        if short not in ln["kernel"] or ln["block"] != pred["block"]:
            raise ValueError(f"launch {ln['index']}: profiled {ln['kernel']} in {ln['block']}, "
                             f"report {short} in {pred['block']}")
        g = groups.setdefault((pred["variant"], tuple(pred["grid"])), dict(
            kernel=short, blocks=[], predicted_us=pred["predicted_us"], bound=pred["bound"],
            dram_mb_predicted=pred["dram_bytes"] / 1e6, l2_mb_predicted=pred["l2_bytes"]["high"] / 1e6,
            l1_fits=pred.get("l1_fits"), shared_wavefronts_m_predicted=_shared_predicted(pred),
            lsu_wavefronts_k_per_sm_predicted=_lsu_predicted(pred, report["target"]["sms"]), rows=[]))
        g["blocks"].append(pred["block"])
        g["rows"].append(measured_row(ln, summary["units"]))
    out = []
    for g in groups.values():
        rows = g.pop("rows")
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k != "stalls"}
        out.append(dict(g, count=len(rows), measured=dict(mean, stalls=rows[0]["stalls"])))
    return out


def _opt(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or x != x else fmt.format(x)


def _shared_predicted(pred: dict) -> float | None:
    """The report's shared-memory wavefronts of a launch (with the store conflicts it counts), millions."""
    t = pred.get("traffic_per_program") or {}
    if "shared_wavefronts" not in t:
        return None  # a report from before they were counted
    return (t["shared_wavefronts"] + t["shared_conflict_wavefronts"]) * pred["programs"] / 1e6


def _lsu_predicted(pred: dict, sms: int) -> float | None:
    """The report's L1/shared data-pipe wavefronts per SM of a launch (the busiest SM's), thousands."""
    t = pred.get("traffic_per_program") or {}
    if "lsu_wavefronts" not in t:
        return None  # a report from before they were counted
    return t["lsu_wavefronts"] * math.ceil(pred["programs"] / sms) / 1e3


def compare_markdown(rows: list[dict], device: str) -> str:
    lines = [
        f"Measured with Nsight Compute on {device} (clocks as the driver ran them; one forward pass, each "
        "launch replayed per counter pass) against the static report's per-launch estimate (sm_90, same "
        "shapes). L2 MB: bytes between the SMs and L2 (sectors from the L1/TEX unit, read + write); shared "
        "wavefronts: the L1/shared data pipe's shared-memory wavefronts, predicted from the weighted SASS "
        "with the store conflicts of the variant's largest register -> shared copy of each width and the "
        "ldmatrix conflicts of its PTX; L1 pipe: all wavefronts of the L1/shared data pipe per SM (shared, "
        "global, local; one per cycle at peak), measured (% of the peak over the launch) / predicted for the "
        "busiest SM; stalls: warps stalled per issued instruction, the three largest (`selected` left out).",
        "",
        "| kernel | blocks | n | predicted us (bound) | measured us | GHz | DRAM MB meas / pred "
        "| L2 MB meas / pred | L1 hit % | shared wavefronts M meas / pred | shared bank conflicts % "
        "| L1 pipe K/SM meas (busy %) / pred | issue active % | warps active % | top stalls per issue |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        m, p = r["measured"], r["predicted_us"]
        blocks = r["blocks"][0] + (f" ... {r['blocks'][-1]}" if len(r["blocks"]) > 1 else "")
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in m["stalls"].items())
        lines.append(
            f"| `{r['kernel']}` | {blocks} | {r['count']} | {p['low']:.0f}-{p['high']:.0f} ({r['bound']}) "
            f"| {m['us']:.1f} | {m['clock_ghz']:.2f} | {m['dram_mb']:.0f} / {r['dram_mb_predicted']:.0f} "
            f"| {m['l2_mb']:.0f} / {r['l2_mb_predicted']:.0f} | {m['l1_hit_pct']:.0f} "
            f"| {m['shared_wavefronts_m']:.1f} / {_opt(r['shared_wavefronts_m_predicted'])} "
            f"| {m['shared_conflict_pct']:.0f} "
            f"| {_opt(m['lsu_wavefronts_k_per_sm'])} ({_opt(m['lsu_pct'], '{:.0f}')}) / "
            f"{_opt(r['lsu_wavefronts_k_per_sm_predicted'])} "
            f"| {m['issue_pct']:.0f} | {m['warps_pct']:.0f} | {stalls} |")
    return "\n".join(lines) + "\n"


def dumps(summary: dict) -> str:
    """The summary as JSON, one line per launch (a record of a few hundred KB that diffs by launch)."""
    head = {k: v for k, v in summary.items() if k != "launches"}
    body = ",\n".join(json.dumps(ln) for ln in summary["launches"])
    return json.dumps(head, indent=1)[:-2] + ',\n "launches": [\n' + body + "\n]}\n"


# ------------------------------------------------------------------------------------------ parent
def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = out / "ncu_forward"
    env = dict(os.environ, CONVFIRSTNET_L1_CARVEOUT=args.l1_carveout)
    cmd = [args.ncu, "--profile-from-start", "off", "--set", "full", "--clock-control", "none",
           "--target-processes", "all", "--export", str(rep), "--force-overwrite",
           sys.executable, str(Path(__file__).resolve()), "--_child", "--model", args.model,
           "--batch", str(args.batch), "--img", str(args.img), "--dtype", args.dtype]
    print("[gpu_ncu] " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # ncu stopped: whatever it wrote is lost, say so
        stdout, stderr, rc = str(e.stdout or ""), str(e.stderr or ""), f"timeout ({args.timeout:.0f} s)"
    prof_s = time.perf_counter() - t0
    (out / "ncu_stdout.log").write_text(stdout[-20000:] + "\n--- stderr ---\n" + stderr[-20000:])
    print(f"[gpu_ncu] ncu exited {rc} after {prof_s:.0f} s", flush=True)
    report = rep.with_suffix(".ncu-rep")
    if not report.exists():
        print("[gpu_ncu] no report written; see ncu_stdout.log", flush=True)
        return 1
    raw = subprocess.run([args.ncu, "--import", str(report), "--page", "raw", "--csv"], capture_output=True,
                         text=True, timeout=300)
    with gzip.open(out / "ncu_raw.csv.gz", "wt") as f:
        f.write(raw.stdout)
    profiled = parse_raw(raw.stdout)
    recorded = recorded_launches(args.model, args.batch, args.img, args.dtype)
    summary = summarize(profiled, recorded)
    import torch
    import triton

    version = subprocess.run([args.ncu, "--version"], capture_output=True, text=True).stdout.strip()
    summary.update(
        command=" ".join(["python", "scripts/gpu_ncu.py", *sys.argv[1:]]),
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), device=torch.cuda.get_device_name(0),
        software=dict(torch=torch.__version__, triton=triton.__version__,
                      ncu=version.splitlines()[-1] if version else ""),
        settings=dict(model=args.model, batch=args.batch, img=args.img, dtype=args.dtype, set="full",
                      clock_control="none", l1_carveout=args.l1_carveout), profile_s=round(prof_s, 1))
    (out / "ncu_summary.json").write_text(dumps(summary))
    for block, b in sorted(summary["per_block"].items(), key=lambda kv: -kv[1]["us"]):
        print(f"  {block:20s} {b['launches']:4d} launches {b['us']:10.1f} us", flush=True)
    if summary["attribution_mismatch"]:
        print(f"[gpu_ncu] attribution stopped: {summary['attribution_mismatch']}", flush=True)
    if not args.keep_report:
        report.unlink()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--img", type=int, default=IMG)
    p.add_argument("--dtype", default=DTYPE, choices=("float16", "bfloat16", "float32"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ncu"))
    p.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    p.add_argument("--timeout", type=float, default=400, help="seconds for the profiled run")
    p.add_argument("--keep-report", action="store_true", help="keep the .ncu-rep file")
    p.add_argument("--l1-carveout", default="fit", choices=("triton", "fit"),
                   help="the kernels' L1 / shared split (kernels/_carveout.py; default: fit, as shipped)")
    p.add_argument("--compare", metavar="SUMMARY", help="no profiling: compare a recorded ncu_summary.json "
                   "with the static report given by --report (runs without a GPU)")
    p.add_argument("--report", metavar="JSON", help="with --compare: a `convfirstnet kernels --json` report")
    p.add_argument("--markdown", metavar="PATH", help="with --compare: write the table there too")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args._child:
        child(args)
        return 0
    if args.compare:
        if not args.report:
            raise SystemExit("gpu_ncu: --compare needs --report (a `convfirstnet kernels --json` file)")
        summary = json.loads(Path(args.compare).read_text())
        report = json.loads(Path(args.report).read_text())
        text = compare_markdown(compare(summary, report), summary["device"])
        print(text, end="")
        if args.markdown:
            Path(args.markdown).write_text(text)
        return 0
    import torch

    if not torch.cuda.is_available() or shutil.which(args.ncu) is None:
        why = "no GPU" if not torch.cuda.is_available() else f"no {args.ncu}"
        print(f"[gpu_ncu] {why}: would run\n  " + "\n  ".join(plan(args)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
