"""``convfirstnet eval``: check everything, then evaluate each model and write the results."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .._cli import default_workers, run_reporting
from .data import build_loader, class_folders, has_images, resolve_data_root
from .jobs import Job, prepare_jobs
from .loop import all_reduce_counts, evaluate, gather_predictions, init_distributed, shard_size
from .options import DTYPES, WORKERS, EvalError, build_parser, check_args
from .output import job_results, print_results, write_outputs, write_predictions


def _sync(device: torch.device) -> None:  # before reading a clock
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Evaluate every model of ``args``; the results, one dict per model (all ranks hold them)."""
    check_args(args)
    root = resolve_data_root(args.data)
    classes = class_folders(root)
    if not classes:
        raise EvalError(
            f"no class folders in {str(root)!r} (expected an ImageFolder tree: one folder per class)"
        )
    if not has_images(root, classes):
        raise EvalError(f"no images in the class folders of {str(root)!r}")
    jobs = prepare_jobs(args, root, classes)
    workers = args.workers if args.workers is not None else default_workers(WORKERS)

    rank, world_size, device = init_distributed(args.device)
    results = []
    try:
        for job in jobs:
            results.append(evaluate_job(job, args, root, classes, workers, rank, world_size, device))
    finally:
        if world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank == 0:
        write_outputs(args, results)
    return results


def evaluate_job(
    job: Job,
    args: argparse.Namespace,
    root: Path,
    classes: list[str],
    workers: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """Evaluate one model on this process's share of the images (fused unless --no-fuse, warmed up,
    then timed); its results, printed by rank 0."""
    import convfirstnet
    from timm.data import resolve_data_config

    name, model, num_images = job.name, job.model, len(job.dataset)
    if rank == 0:
        hint = " (--use-ema takes the EMA weights)" if job.ema is False and "EMA" in job.weights else ""
        print(f"{name}: {job.path}, {job.weights}{hint}; labels: {job.mapping_how}", flush=True)
    overrides = {"img_size": args.img_size, "crop_pct": args.crop_pct, "interpolation": args.interpolation}
    data_config = resolve_data_config(
        {k: v for k, v in overrides.items() if v is not None}, model=model, use_test_size=True
    )
    param_count = sum(p.numel() for p in model.parameters())
    dtype = DTYPES[args.dtype]
    if not args.no_fuse:
        model = convfirstnet.fuse(model)  # folds BatchNorm in fp64 from the fp32 weights, then cast
    model = model.to(device=device, dtype=dtype).eval()
    if args.no_fuse:  # cuDNN's NHWC path; the fused blocks already run NHWC on their own weights
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model)
    loader = build_loader(job.dataset, data_config, args.batch_size, workers, device, rank, world_size)

    # Warm-up (compilation, autotuning, allocator) outside the timed loop, as timm's validate.py does.
    # A compiled model gets every batch padded to the full batch size: one shape, one compilation.
    pad_to = args.batch_size if args.compile else None
    with torch.no_grad():
        x = torch.zeros(
            (pad_to or min(args.batch_size, num_images), *data_config["input_size"]), device=device
        )
        model(x.to(dtype).contiguous(memory_format=torch.channels_last))
    _sync(device)
    _barrier(world_size)

    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=num_images, desc=f"eval {name}", unit="img", mininterval=1.0, file=sys.stderr)
    real = job.real[rank::world_size] if job.real is not None else None
    start = time.perf_counter()
    local = evaluate(
        model,
        loader,
        shard_size(num_images, rank, world_size),
        dtype,
        progress,
        world_size,
        pad_to,
        real=real,
        keep_predictions=args.predictions_file is not None,
    )
    _sync(device)
    counts = all_reduce_counts(local, device, world_size)
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    predictions = None
    if args.predictions_file is not None:
        predictions = gather_predictions(local.predictions, rank, world_size, num_images)
    if counts.images != num_images:
        raise RuntimeError(f"counted {counts.images} images, the dataset has {num_images}")

    results = job_results(job, args, counts, data_config, param_count, elapsed, device, world_size)
    if rank == 0:
        print_results(results)
        if predictions is not None:
            write_predictions(args.predictions_file, job.dataset, predictions)
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> int:
        run(args)
        return 0

    return run_reporting("convfirstnet eval", go)
