"""The output folder: which files a run writes there (and an earlier run's, refused or removed), the
saved arguments, ``log.jsonl`` and ``summary.csv``."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

from .checkpoints import CHECKPOINT_NAME
from .options import TrainError

RUN_FILES = ("args.yaml", "log.jsonl", "summary.csv")  # what a run writes before its first checkpoint


def run_files(output: Path, name: str) -> list[Path]:
    """The files of an earlier run in ``output``: exactly the names this command writes there (the run
    files, the checkpoints and ``<name>.safetensors``), nothing else."""
    if not output.is_dir():
        return []
    ours = (*RUN_FILES, f"{name}.safetensors")
    found = [p for p in output.iterdir() if p.name in ours or CHECKPOINT_NAME.fullmatch(p.name)]
    return sorted(p for p in found if p.is_file())


def check_output(args: argparse.Namespace, output: Path, name: str) -> None:
    """An --output folder holding an earlier run is continued (--resume) or started over (--overwrite),
    never silently written over."""
    if args.resume and args.overwrite:
        raise TrainError("give --resume or --overwrite, not both")
    if output.exists() and not output.is_dir():
        raise TrainError(f"--output {str(output)!r} is not a folder")
    found = [] if args.resume or args.overwrite else run_files(output, name)
    if found:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise TrainError(
            f"--output {str(output)!r} holds an earlier run ({names}): continue it with --resume auto, "
            "or start over with --overwrite (removes those files)"
        )


def plain_args(d: dict[str, Any]) -> dict[str, Any]:
    """Plain types only (paths as text), so that checkpoints holding the args load with
    ``torch.load(weights_only=True)``."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def append_log(path: Path, record: dict[str, Any]) -> None:
    """One JSON record per line of ``log.jsonl``."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def summary_columns(ema: bool) -> list[str]:
    """timm's summary.csv columns (``update_summary``), with the EMA's validation beside the raw model's."""
    columns = ["epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5"]
    if ema:
        columns += ["eval_ema_loss", "eval_ema_top1", "eval_ema_top5"]
    return columns + ["lr"]


def write_summary(path: Path, row: dict[str, Any], columns: list[str]) -> None:
    """Append one epoch to ``summary.csv``. The columns are fixed (cells of epochs without validation stay
    empty), unlike timm's ``update_summary``, whose rows shift when an epoch has no eval metrics. A file
    from an earlier run keeps its header."""
    if path.is_file() and path.stat().st_size:
        with open(path, newline="") as f:
            columns = next(csv.reader(f), columns)
        header = False
    else:
        header = True
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="", extrasaction="ignore")
        if header:
            writer.writeheader()
        writer.writerow(row)


def write_args(args: argparse.Namespace, output: Path) -> None:
    """``args.yaml``: the arguments, as timm's ``train.py`` saves them."""
    import yaml

    (output / "args.yaml").write_text(yaml.safe_dump(plain_args(vars(args)), default_flow_style=False))
