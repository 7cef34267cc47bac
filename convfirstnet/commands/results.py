"""Results tables (docs/bench.md), generated from the benchmark records in ``benchmarks/results/*.json``.

    python scripts/results_table.py                      # print the Markdown
    python scripts/results_table.py --write docs/bench.md  # replace the text between the markers

Only records from CUDA devices go into the table (``--include-cpu`` adds CPU records, for
checking the tool). For each (device, dtype, model, resolution, batch) and backend the newest record
wins. Nothing in the tables is typed by hand: every figure names the record it came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from ._cli import ArgumentParser
from .bench import NETWORK_BACKENDS

START, END = "<!-- results:start -->", "<!-- results:end -->"
NO_RECORDS = "_No GPU records yet: run `convfirstnet bench` on a GPU and commit the JSON record._"


def load_records(records_dir: str | Path) -> list[tuple[str, dict]]:
    """(file name, record) for every readable record, oldest first."""
    out = []
    for path in sorted(Path(records_dir).glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"[results] skipping {path.name}: {e}", file=sys.stderr)
            continue
        if isinstance(rec, dict) and "results" in rec and "device" in rec:
            out.append((path.name, rec))
    return sorted(out, key=lambda item: item[1].get("date", ""))


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _latest(records: Sequence[tuple[str, dict]], mode: str, key_fn) -> dict:
    """{row key: {backend: (result, record name, record)}}, newer records overwriting older ones."""
    table: dict = {}
    for name, rec in records:
        if rec.get("mode") != mode:
            continue
        for r in rec["results"]:
            if r.get("status") != "ok" or "backend" not in r:
                continue
            table.setdefault(key_fn(rec, r), {})[r["backend"]] = (r, name, rec)
    return table


def _best_fused(by: dict):
    cands = [by[b][0] for b in ("fused", "fused-cudagraph") if b in by]
    return min(cands, key=lambda r: r["ms_per_batch"]) if cands else None


def network_markdown(records: Sequence[tuple[str, dict]]) -> str:
    table = _latest(
        records,
        "network",
        lambda rec, r: (rec["device"]["name"], r["dtype"], r["model"], r["resolution"], r["batch"]),
    )
    if not table:
        return ""
    backends = [b for b in NETWORK_BACKENDS if any(b in by for by in table.values())]
    head = ["device", "dtype", "model", "batch"] + [f"{b} img/s" for b in backends]
    head += ["fused ms/batch", "fused % peak", "fused vs inductor", "records"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---:|" + "---:|" * (len(head) - 5) + "---|"]
    for (dev, dtype, model, res, batch), by in sorted(table.items()):
        cells = [dev, dtype, f"{model.removeprefix('convfirstnet_')}@{res}", str(batch)]
        cells += [f"{by[b][0]['img_per_s']:,.0f}" if b in by else "-" for b in backends]
        fused = _best_fused(by)
        ind = by.get("inductor", (None,))[0]
        cells.append(_ms(fused["ms_per_batch"]) if fused else "-")
        cells.append(_fmt(fused.get("pct_peak"), ".1f") if fused else "-")
        cells.append(f"{ind['ms_per_batch'] / fused['ms_per_batch']:.1f}x" if fused and ind else "-")
        cells.append(", ".join(sorted({f"`{v[1]}`" for v in by.values()})))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def blocks_markdown(records: Sequence[tuple[str, dict]]) -> str:
    table = _latest(
        records,
        "blocks",
        lambda rec, r: (
            rec["device"]["name"],
            r["dtype"],
            r["block"],
            r["channels"],
            r["expansion"],
            r["size"],
            r["batch"],
        ),
    )
    if not table:
        return ""
    head = [
        "device",
        "dtype",
        "block",
        "C",
        "t",
        "HxW",
        "batch",
        "fused ms",
        "inductor ms",
        "speed-up",
        "fused % peak",
        "paper speed-up (A5000)",
        "paper fused % peak",
        "records",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---:|---:|---|---:|" + "---:|" * 6 + "---|"]
    for (dev, dtype, block, c, t, s, batch), by in sorted(table.items()):
        fused = _best_fused(by)
        ind = by.get("inductor", (None,))[0]
        paper = next(iter(by.values()))[0].get("paper", {})
        cells = [
            dev,
            dtype,
            block,
            str(c),
            str(t),
            f"{s}x{s}",
            str(batch),
            _ms(fused["ms_per_batch"]) if fused else "-",
            _ms(ind["ms_per_batch"]) if ind else "-",
            f"{ind['ms_per_batch'] / fused['ms_per_batch']:.1f}x" if fused and ind else "-",
            _fmt(fused.get("pct_peak"), ".1f") if fused else "-",
            f"{paper['speedup']:.1f}x" if "speedup" in paper else "-",
            _fmt(paper.get("fused_pct_peak"), ".1f"),
            ", ".join(sorted({f"`{v[1]}`" for v in by.values()})),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_markdown(records: Sequence[tuple[str, dict]], include_cpu: bool = False) -> str:
    """The results section of docs/bench.md: network and block tables, and where every figure came from."""
    chosen = [(n, r) for n, r in records if include_cpu or r["device"].get("type") == "cuda"]
    parts = [
        "<!-- generated by scripts/results_table.py from benchmarks/results/*.json: do not edit by hand -->"
    ]
    if not chosen:
        parts.append(NO_RECORDS)
        return "\n".join(parts)
    net, blk = network_markdown(chosen), blocks_markdown(chosen)
    if net:
        parts += ["", "**Whole network** (img/s; % of the device's dense fp16/bf16 peak):", "", net]
    if blk:
        parts += ["", "**Block stages** (8 stride-1 blocks; paper Tables 1-2 beside):", "", blk]
    parts += ["", "Records:", ""]
    for name, rec in chosen:
        commit = (rec.get("git") or {}).get("commit") or "unknown"
        dirty = " (uncommitted changes)" if (rec.get("git") or {}).get("dirty") else ""
        sw = rec.get("software", {})
        dev = rec["device"]
        parts.append(
            f"- `{name}`: {dev.get('name')} ({dev.get('type')}), {rec.get('date')}, torch {sw.get('torch')}, "
            f"triton {sw.get('triton')}, commit {commit[:10]}{dirty}; `{rec.get('command')}`"
        )
    return "\n".join(parts)


def write_between_markers(path: str | Path, text: str) -> None:
    """Replace what lies between the results markers in ``path``; both markers must be there."""
    path = Path(path)
    content = path.read_text()
    i, j = content.find(START), content.find(END)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"{path}: needs the markers {START} and {END} (in that order)")
    path.write_text(content[: i + len(START)] + "\n" + text.rstrip() + "\n" + content[j:])


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="convfirstnet results", description=__doc__.splitlines()[0])
    p.add_argument("--records", default="benchmarks/results", help="folder of JSON records")
    p.add_argument(
        "--write", default=None, metavar="FILE.md", help="replace the text between its markers: docs/bench.md"
    )
    p.add_argument("--include-cpu", action="store_true", help="also list CPU records")
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    records = load_records(args.records) if Path(args.records).is_dir() else []
    text = results_markdown(records, args.include_cpu)
    if args.write:
        try:
            write_between_markers(args.write, text)
        except (OSError, ValueError) as e:
            print(f"convfirstnet results: error: {e}", file=sys.stderr)
            return 1
        print(f"wrote {len(records)} record(s) into {args.write}")
    else:
        print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
