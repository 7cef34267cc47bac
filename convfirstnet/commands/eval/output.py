"""What ``convfirstnet eval`` writes: results files (timm ``validate.py``'s CSV / JSON), per-image
predictions and the table of several models."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

import torch

from .jobs import Job
from .loop import Counts


def versions() -> dict[str, str | None]:
    """The versions a result was measured with."""
    import convfirstnet

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "convfirstnet": convfirstnet.__version__}


def job_results(
    job: Job,
    args: argparse.Namespace,
    counts: Counts,
    data_config: dict[str, Any],
    param_count: int,
    elapsed: float,
    device: torch.device,
    world_size: int,
) -> dict[str, Any]:
    """One model's results under timm ``validate.py``'s names, and what identifies the run."""
    from convfirstnet.weights import sha256_file

    h, w = data_config["input_size"][1:]
    top1, top5 = 100.0 * counts.top1 / counts.images, 100.0 * counts.top5 / counts.images
    results: dict[str, Any] = {
        "model": job.name,
        "top1": top1,
        "top1_err": 100.0 - top1,
        "top5": top5,
        "top5_err": 100.0 - top5,
        "loss": counts.loss / counts.images,
    }
    if job.real is not None:
        real1 = 100.0 * counts.real_top1 / max(counts.real_images, 1)
        real5 = 100.0 * counts.real_top5 / max(counts.real_images, 1)
        results.update(
            real_top1=real1,
            real_top1_err=100.0 - real1,
            real_top5=real5,
            real_top5_err=100.0 - real5,
            real_num_images=counts.real_images,
        )
    results.update(
        {
            "top1_correct": counts.top1,
            "top5_correct": counts.top5,
            "num_images": counts.images,
            "num_classes": getattr(job.model, "num_classes", None),
            "labels": job.mapping_how,
            "checkpoint": str(job.path),
            "checkpoint_sha256": sha256_file(job.path),
            "ema": job.ema,
            "img_size": h if h == w else [h, w],
            "crop_pct": data_config["crop_pct"],
            "crop_mode": data_config.get("crop_mode"),
            "interpolation": data_config["interpolation"],
            "dtype": args.dtype,
            "device": device.type,
            "world_size": world_size,
            "batch_size": args.batch_size,
            "fused": not args.no_fuse,
            "compiled": bool(args.compile),
            "param_count": round(param_count / 1e6, 3),
            "img_per_sec": round(counts.images / elapsed, 2),
            **versions(),
        }
    )
    return results


def print_results(results: dict[str, Any]) -> None:
    """The summary lines timm's ``validate.py`` prints (`` * Acc@1 ...``), and the run's settings."""
    r = results
    top1, top5 = r["top1"], r["top5"]
    lines = [
        f" * Acc@1 {top1:.3f} ({100 - top1:.3f}) Acc@5 {top5:.3f} ({100 - top5:.3f})",
    ]
    if "real_top1" in r:
        lines.append(
            f" * ReaL Acc@1 {r['real_top1']:.3f} ({r['real_top1_err']:.3f}) "
            f"Acc@5 {r['real_top5']:.3f} ({r['real_top5_err']:.3f}), "
            f"{r['real_num_images']} images with ReaL labels"
        )
    lines.append(
        f" * {r['model']}: {r['num_images']} images, loss {r['loss']:.4f}, "
        f"{r['img_per_sec']:.1f} img/s "
        f"({'fused' if r['fused'] else 'unfused'}, {'compiled' if r['compiled'] else 'eager'}, "
        f"{r['dtype']}, {r['device']} x{r['world_size']}, {r['img_size']}px crop_pct "
        f"{r['crop_pct']} {r['interpolation']})"
    )
    print("\n".join(lines), flush=True)


def write_results(path: Path, results: dict[str, Any] | list[dict[str, Any]], fmt: str) -> None:
    """timm ``validate.py``'s results file: JSON (the dict, or a list for several models) or CSV (a header
    and one row per model)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        path.write_text(json.dumps(results, indent=2) + "\n")
        return
    rows = results if isinstance(results, list) else [results]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_predictions(path: Path, dataset, predictions: torch.Tensor) -> None:
    """One CSV row per image in dataset order: index, file (relative to the data folder), label, top-k."""
    from torch.utils.data import Subset

    base, indices = (dataset.dataset, dataset.indices) if isinstance(dataset, Subset) else (dataset, None)
    files = base.filenames()
    samples = base.reader.samples
    order = list(indices) if indices is not None else range(len(base))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["index", "file", "label", *(f"pred{i + 1}" for i in range(predictions.shape[1]))])
        for row, i in enumerate(order):
            writer.writerow([i, files[i], samples[i][1], *predictions[row].tolist()])


def write_outputs(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    payload: dict[str, Any] | list[dict[str, Any]] = results[0] if len(results) == 1 else results
    if args.results_json is not None:
        write_results(args.results_json, payload, "json")
    if args.results_file is not None:
        fmt = args.results_format or ("json" if args.results_file.suffix.lower() == ".json" else "csv")
        write_results(args.results_file, payload, fmt)
    if len(results) > 1:
        print("| model | top-1 | top-5 | loss | images | checkpoint |\n|---|---:|---:|---:|---:|---|")
        for r in results:
            print(
                f"| {r['model']} | {r['top1']:.3f} | {r['top5']:.3f} | {r['loss']:.4f} | {r['num_images']} "
                f"| {r['checkpoint']} |"
            )
