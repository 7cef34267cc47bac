"""ImageNet validation of a ConvFirstNet: exact top-1 / top-5 over every image, and throughput.

    convfirstnet eval --model pico --data /data/imagenet --checkpoint convfirstnet_pico.safetensors
    torchrun --nproc_per_node=8 scripts/eval_imagenet.py --model small --data /data/imagenet

Data: an ImageFolder tree, ``DIR`` itself or its ``val`` / ``validation`` subfolder, one folder per class.
Class indices follow timm's folder order (sorted; digits inside names compare as numbers, which for
ImageNet's ``n01440764``-style synsets is the plain sorted order). Preprocessing is timm's evaluation
pipeline from the model's ``pretrained_cfg`` (resize to ``img_size / crop_pct``, center crop, bicubic,
ImageNet mean/std, normalised on the device), as timm's ``validate.py`` does, so the same weights give
the same numbers there.

Counting is exact: integer hit counts, no averaging of per-batch percentages. Under torchrun each process
takes every ``world_size``-th image (``DistributedSampler``, no shuffle); the sampler pads the shards to
equal length by repeating images, and those repeats are skipped, so the counts and the metrics equal a
single process's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SPLIT_FOLDERS = ("val", "validation")
TOPK = 5


class EvalError(Exception):
    """A problem with the command's inputs, reported as one line without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convfirstnet eval",
        description="ImageNet top-1/top-5 and throughput of a ConvFirstNet (several GPUs: torchrun "
        "--nproc_per_node=N scripts/eval_imagenet.py ...).",
    )
    p.add_argument("--model", required=True, help="pico, nano, tiny, small (or convfirstnet_<size>)")
    p.add_argument(
        "--data", required=True, type=Path, help="ImageFolder root, or a folder holding val/ or validation/"
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="weight file or timm checkpoint (default: the model's pretrained weights)",
    )
    p.add_argument("--batch-size", type=int, default=256, help="images per batch and device (default: 256)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--workers", type=int, default=4, help="data-loading processes per device (default: 4)")
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default="float32", help="model and input dtype (default: float32)"
    )
    p.add_argument("--no-fuse", action="store_true", help="run the training form (BatchNorm, layer by layer)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--limit", type=int, help="evaluate only the first N images (in sorted file order)")
    p.add_argument("--img-size", type=int, help="override the pretrained_cfg input size (square)")
    p.add_argument("--crop-pct", type=float, help="override the pretrained_cfg crop_pct")
    p.add_argument(
        "--interpolation", help="override the pretrained_cfg interpolation (bicubic, bilinear, ...)"
    )
    p.add_argument("--results-json", type=Path, help="write the results to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ---------------------------------------------------------------------------------------- counting
@dataclass
class Counts:
    top1: int = 0
    top5: int = 0
    images: int = 0


def shard_size(num_images: int, rank: int, world_size: int) -> int:
    """Images of ``num_images`` that ``DistributedSampler(shuffle=False)`` gives rank ``rank`` before its
    padding: the sampler deals indices round robin, and padded repeats come last in every shard."""
    return len(range(rank, num_images, world_size))


def topk_hits(logits: torch.Tensor, target: torch.Tensor, k: int = TOPK) -> tuple[torch.Tensor, torch.Tensor]:
    """Number of samples whose label is the top-1 prediction, and among the top ``k`` (int64 tensors).

    With fewer than ``k`` classes, top-k covers all of them (as ``timm.utils.accuracy`` does)."""
    pred = logits.topk(min(k, logits.shape[1]), dim=1).indices
    hit = pred == target.reshape(-1, 1)
    return hit[:, 0].sum(), hit.any(dim=1).sum()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    num_images: int,
    dtype: torch.dtype = torch.float32,
    progress: Any = None,
    world_size: int = 1,
    pad_to: int | None = None,
) -> Counts:
    """Run ``model`` over ``loader``, counting exactly the first ``num_images`` samples it yields.

    Later samples (a ``DistributedSampler``'s padding) are dropped. ``pad_to``: zero-pad smaller batches
    to this size (and drop the extra outputs), so a compiled model sees one shape and never recompiles.
    ``progress``: a tqdm bar or None.
    """
    correct1 = correct5 = None
    seen = 0
    start = last_postfix = time.perf_counter()
    for images, target in loader:
        keep = min(images.shape[0], num_images - seen)
        if keep <= 0:
            break
        images, target = images[:keep], target[:keep]
        if pad_to is not None and keep < pad_to:
            images = torch.cat([images, images.new_zeros((pad_to - keep, *images.shape[1:]))])
        images = images.to(dtype).contiguous(memory_format=torch.channels_last)
        logits = model(images)[:keep]
        c1, c5 = topk_hits(logits, target)
        correct1 = c1 if correct1 is None else correct1 + c1
        correct5 = c5 if correct5 is None else correct5 + c5
        seen += keep
        if progress is not None:
            progress.update(min(keep * world_size, progress.total - progress.n))
            now = time.perf_counter()
            if now - last_postfix < 1.0 and seen < num_images:
                continue  # the running top-1 needs a device sync: at most once a second
            last_postfix, rate = now, seen * world_size / max(now - start, 1e-9)
            progress.set_postfix_str(
                f"top1 {100.0 * int(correct1) / seen:.2f}% {rate:.1f} img/s", refresh=True
            )
    if seen != num_images:
        raise RuntimeError(f"the loader gave {seen} images, expected {num_images}")
    return Counts(int(correct1 or 0), int(correct5 or 0), seen)


# ---------------------------------------------------------------------------------------- data
def resolve_data_root(data: Path) -> Path:
    if not data.exists():
        raise EvalError(f"data directory {str(data)!r} does not exist")
    if not data.is_dir():
        raise EvalError(f"--data {str(data)!r} is not a directory")
    for name in SPLIT_FOLDERS:
        if (data / name).is_dir():
            return data / name
    return data


def class_folders(root: Path) -> list[str]:
    """Class folder names in index order (timm's order: sorted, numbers inside names compared as numbers)."""
    from timm.utils.misc import natural_key

    names = [d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    return sorted(names, key=natural_key)


def build_dataset(root: Path, classes: list[str]):
    """timm ``ImageDataset`` over ``root`` with class index = position in ``classes``."""
    from timm.data import create_dataset

    try:
        return create_dataset(
            "",
            root=str(root),
            split="validation",
            search_split=False,
            class_map={c: i for i, c in enumerate(classes)},
        )
    except RuntimeError as e:  # timm: "Found 0 images in subfolders of ..."
        raise EvalError(f"no images in {str(root)!r}: {e}") from e


def build_loader(
    dataset,
    data_config: dict[str, Any],
    batch_size: int,
    workers: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
):
    """timm's evaluation loader (``create_loader`` with the prefetcher), sharded by a ``DistributedSampler``.

    Images reach the device as uint8 and are normalised there in fp32 (``timm.data.PrefetchLoader``).
    """
    from timm.data import create_transform
    from timm.data.loader import PrefetchLoader, fast_collate
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    base.transform = create_transform(
        data_config["input_size"],
        is_training=False,
        interpolation=data_config["interpolation"],
        mean=data_config["mean"],
        std=data_config["std"],
        crop_pct=data_config["crop_pct"],
        crop_mode=data_config.get("crop_mode"),
        use_prefetcher=True,
    )
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=False) if world_size > 1 else None
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        sampler=sampler,
        num_workers=workers,
        collate_fn=fast_collate,
        pin_memory=device.type == "cuda",
        drop_last=False,
    )
    return PrefetchLoader(
        loader,
        mean=data_config["mean"],
        std=data_config["std"],
        channels=data_config["input_size"][0],
        device=device,
        img_dtype=torch.float32,
    )


# ---------------------------------------------------------------------------------------- model
def build_model(name: str, checkpoint: Path | None) -> tuple[nn.Module, Path]:
    """Training-form model with the checkpoint's weights and classifier size, and the weight file used."""
    import convfirstnet
    from convfirstnet.weights import WeightsNotFoundError, read_checkpoint, resolve_weights

    try:
        path = resolve_weights(name, checkpoint)
    except WeightsNotFoundError as e:
        if checkpoint is not None:
            raise
        raise EvalError(f"{e} Or pass --checkpoint PATH.") from e
    state_dict, _ = read_checkpoint(path)
    weight = state_dict.get("classifier.weight")
    if weight is None or weight.dim() != 2:
        raise EvalError(
            f"checkpoint {str(path)!r} has no classifier (classifier.weight); it cannot be evaluated"
        )
    model = convfirstnet.create_model(name, checkpoint_path=path, num_classes=weight.shape[0])
    return model.eval(), path


# ---------------------------------------------------------------------------------------- distributed
def init_distributed(device_arg: str | None) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment; initialises the process group if > 1."""
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_arg == "cuda" or (device_arg is None and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise EvalError("--device cuda, but no CUDA device is available")
    if use_cuda:
        device = torch.device("cuda", local_rank if world_size > 1 else torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if world_size > 1:
        if use_cuda:
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return rank, world_size, device


def all_reduce_counts(counts: Counts, device: torch.device, world_size: int) -> Counts:
    if world_size == 1:
        return counts
    import torch.distributed as dist

    t = torch.tensor([counts.top1, counts.top5, counts.images], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return Counts(*(int(v) for v in t.tolist()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


# ---------------------------------------------------------------------------------------- run
def _versions() -> dict[str, str | None]:
    import convfirstnet

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "convfirstnet": convfirstnet.__version__}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from timm.data import resolve_data_config

    import convfirstnet
    from convfirstnet.factory import _canonical
    from convfirstnet.model import MIN_INPUT_SIZE
    from convfirstnet.weights import sha256_file

    name = _canonical(args.model)
    if args.batch_size < 1:
        raise EvalError("--batch-size must be at least 1")
    if args.workers < 0:
        raise EvalError("--workers must be at least 0")
    if args.limit is not None and args.limit < 1:
        raise EvalError("--limit must be at least 1")
    if args.img_size is not None and args.img_size < MIN_INPUT_SIZE:
        raise EvalError(f"--img-size {args.img_size}: ConvFirstNet needs at least {MIN_INPUT_SIZE}")
    if args.crop_pct is not None and not 0 < args.crop_pct <= 1:
        raise EvalError("--crop-pct must be in (0, 1]")
    root = resolve_data_root(args.data)
    classes = class_folders(root)
    if not classes:
        raise EvalError(
            f"no class folders in {str(root)!r} (expected an ImageFolder tree: one folder per class)"
        )

    dataset = build_dataset(root, classes)
    model, path = build_model(name, args.checkpoint)
    if len(classes) != model.num_classes:
        raise EvalError(
            f"{str(root)!r} has {len(classes)} class folder{'s' * (len(classes) != 1)}, but the {name} "
            f"checkpoint {str(path)!r} classifies {model.num_classes} classes"
        )
    if args.limit is not None and args.limit < len(dataset):
        from torch.utils.data import Subset

        dataset = Subset(dataset, range(args.limit))
    num_images = len(dataset)

    overrides = {"img_size": args.img_size, "crop_pct": args.crop_pct, "interpolation": args.interpolation}
    data_config = resolve_data_config(
        {k: v for k, v in overrides.items() if v is not None}, model=model, use_test_size=True
    )
    param_count = sum(p.numel() for p in model.parameters())

    rank, world_size, device = init_distributed(args.device)
    try:
        dtype = DTYPES[args.dtype]
        if not args.no_fuse:
            model = convfirstnet.fuse(model)  # folds BatchNorm in fp64 from the fp32 weights, then cast
        model = model.to(device=device, dtype=dtype).eval()
        if args.no_fuse:  # cuDNN's NHWC path; the fused blocks already run NHWC on their own weights
            model = model.to(memory_format=torch.channels_last)
        if args.compile:
            model = torch.compile(model)
        loader = build_loader(dataset, data_config, args.batch_size, args.workers, device, rank, world_size)

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

            progress = tqdm(
                total=num_images, desc=f"eval {name}", unit="img", mininterval=1.0, file=sys.stderr
            )
        start = time.perf_counter()
        local = evaluate(
            model, loader, shard_size(num_images, rank, world_size), dtype, progress, world_size, pad_to
        )
        _sync(device)
        counts = all_reduce_counts(local, device, world_size)
        elapsed = time.perf_counter() - start
        if progress is not None:
            progress.close()
    finally:
        if world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()

    if counts.images != num_images:
        raise RuntimeError(f"counted {counts.images} images, the dataset has {num_images}")
    h, w = data_config["input_size"][1:]
    results = {
        "model": name,
        "checkpoint": str(path),
        "checkpoint_sha256": sha256_file(path),
        "top1": 100.0 * counts.top1 / counts.images,
        "top5": 100.0 * counts.top5 / counts.images,
        "top1_correct": counts.top1,
        "top5_correct": counts.top5,
        "num_images": counts.images,
        "num_classes": len(classes),
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
        **_versions(),
    }
    if rank == 0:
        print(
            f" * Acc@1 {results['top1']:.3f} ({100 - results['top1']:.3f}) "
            f"Acc@5 {results['top5']:.3f} ({100 - results['top5']:.3f})\n"
            f" * {name}: {counts.images} images, {results['img_per_sec']:.1f} img/s "
            f"({'fused' if results['fused'] else 'unfused'}, {'compiled' if args.compile else 'eager'}, "
            f"{args.dtype}, {device.type} x{world_size}, {results['img_size']}px crop_pct "
            f"{results['crop_pct']} {results['interpolation']})"
        )
        if args.results_json is not None:
            args.results_json.parent.mkdir(parents=True, exist_ok=True)
            args.results_json.write_text(json.dumps(results, indent=2) + "\n")
    return results


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from convfirstnet.weights import CheckpointError, WeightsNotFoundError

    try:
        run(args)
    except (EvalError, CheckpointError, WeightsNotFoundError, ValueError) as e:
        print(f"convfirstnet eval: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
