"""ImageNet validation of ConvFirstNets: exact top-1 / top-5, loss, ImageNet-ReaL, and throughput.

    convfirstnet eval --model pico --data /data/imagenet --checkpoint convfirstnet_pico.safetensors
    convfirstnet eval --model all --data /data/imagenet --results-file all.csv
    torchrun --nproc_per_node=8 scripts/eval_imagenet.py --model small --data /data/imagenet

Data: an ImageFolder tree, ``DIR`` itself or its ``val`` / ``validation`` subfolder, one folder per class.
Labels, as timm's ``validate.py`` gives them: with ``--class-map FILE`` (timm's format: a ``.txt`` with
one class name per line, the line number being its index, or a ``.pkl`` dict) the map's indices; else,
when every folder is an ImageNet-1k synset (``n01440764``, ...) and the checkpoint has 1000 classes, the
synset's ImageNet-1k index (``timm.data.ImageNetInfo``), so a subset of the synset folders evaluates as
it is; else the folder's position in timm's sorted order, which needs exactly as many folders as the
checkpoint has classes. Preprocessing is timm's evaluation pipeline from the model's ``pretrained_cfg``
(resize to ``img_size / crop_pct``, center crop, bicubic, ImageNet mean/std, normalised on the device),
so the same weights give the same numbers there.

Weights: a safetensors weight file, or a timm training checkpoint, whose raw weights (``state_dict``)
are taken unless ``--use-ema`` asks for its EMA weights (``state_dict_ema``), as in timm. Without
``--checkpoint`` the weights are looked up as ``pretrained=True`` does.

Counting is exact: integer hit counts and a float64 loss sum, no averaging of per-batch percentages.
Under torchrun each process takes every ``world_size``-th image (``DistributedSampler``, no shuffle);
the sampler pads the shards to equal length by repeating images, and those repeats are skipped, so the
counts and the metrics equal a single process's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._cli import ArgumentParser, ToolError, default_workers, run_reporting

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming")
SPLIT_FOLDERS = ("val", "validation")
TOPK = 5
WORKERS = 4  # at most, per process; fewer on machines with fewer cores
REAL_NAME = "ILSVRC2012_val_{:08d}.JPEG"  # ImageNet-ReaL's labels are listed in this file order


class EvalError(ToolError):
    """A problem with the command's inputs, reported as one line without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="convfirstnet eval",
        description="ImageNet top-1/top-5, loss and throughput of ConvFirstNets (several GPUs: torchrun "
        "--nproc_per_node=N scripts/eval_imagenet.py ...).",
    )
    p.add_argument(
        "-m",
        "--model",
        nargs="+",
        help="pico, nano, tiny, small (or convfirstnet_<size>); several, or 'all' (default: the "
        "architecture the --checkpoint records)",
    )
    p.add_argument(
        "--data",
        "--data-dir",
        dest="data",
        required=True,
        type=Path,
        help="ImageFolder root, or a folder holding val/ or validation/",
    )
    p.add_argument(
        "--checkpoint",
        nargs="+",
        type=Path,
        help="weight file or timm checkpoint, one per model (default: the models' pretrained weights)",
    )
    p.add_argument(
        "--use-ema",
        action="store_true",
        help="take a timm checkpoint's EMA weights (state_dict_ema), as timm",
    )
    p.add_argument(
        "--class-map",
        type=Path,
        help="timm class map: .txt with one class folder name per line (line number = index) or .pkl dict",
    )
    p.add_argument(
        "--real-labels",
        type=Path,
        help="ImageNet-ReaL labels JSON (real.json); also reports ReaL top-1/top-5",
    )
    p.add_argument(
        "-b", "--batch-size", type=int, default=256, help="images per batch and device (default: 256)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument(
        "-j",
        "--workers",
        type=int,
        help=f"data-loading processes per device (default: {WORKERS}, or the cores available if fewer)",
    )
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default="float32", help="model and input dtype (default: float32)"
    )
    p.add_argument("--no-fuse", action="store_true", help="run the training form (BatchNorm, layer by layer)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--limit", type=int, help="evaluate only the first N images (in sorted file order)")
    p.add_argument("--img-size", type=int, help="override the pretrained_cfg input size (square)")
    p.add_argument("--crop-pct", type=float, help="override the pretrained_cfg crop_pct")
    p.add_argument(
        "--interpolation", help=f"override the pretrained_cfg interpolation ({', '.join(INTERPOLATIONS)})"
    )
    p.add_argument(
        "--results-file", type=Path, help="write the results here (CSV or JSON, as timm's validate.py)"
    )
    p.add_argument(
        "--results-format",
        choices=("csv", "json"),
        help="format of --results-file (default: json for a .json file, else csv)",
    )
    p.add_argument("--results-json", type=Path, help="write the results as JSON (--results-file with json)")
    p.add_argument(
        "--predictions-file",
        type=Path,
        help="write each image's label and top-5 class indices as CSV (one model)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ---------------------------------------------------------------------------------------- counting
@dataclass
class Counts:
    top1: int = 0
    top5: int = 0
    images: int = 0
    loss: float = 0.0  # sum of per-image cross-entropy
    real_top1: int = 0
    real_top5: int = 0
    real_images: int = 0  # images with at least one ReaL label
    predictions: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [images, k]


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


def real_hits(pred: torch.Tensor, real: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """ImageNet-ReaL hits of top-k predictions ``pred`` [n, k] against each image's set of real labels, as
    timm's ``RealLabelsImagenet``: (top-1 hits, top-5 hits, images with labels); unlabelled images skipped."""
    top1 = top5 = n = 0
    for row, labels in zip(pred.tolist(), real, strict=True):
        if labels:
            n += 1
            top1 += row[0] in labels
            top5 += any(p in labels for p in row[:TOPK])
    return top1, top5, n


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    num_images: int,
    dtype: torch.dtype = torch.float32,
    progress: Any = None,
    world_size: int = 1,
    pad_to: int | None = None,
    real: Sequence[Sequence[int]] | None = None,
    keep_predictions: bool = False,
) -> Counts:
    """Run ``model`` over ``loader``, counting exactly the first ``num_images`` samples it yields.

    Later samples (a ``DistributedSampler``'s padding) are dropped. ``pad_to``: zero-pad smaller batches
    to this size (and drop the extra outputs), so a compiled model sees one shape and never recompiles.
    ``real``: ImageNet-ReaL label sets of the counted samples, in loader order. ``keep_predictions``:
    return every sample's top-k class indices. ``progress``: a tqdm bar or None.
    """
    correct1 = correct5 = loss = None
    real1 = real5 = real_n = 0
    preds = []
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
        logits = model(images)[:keep].float()
        c1, c5 = topk_hits(logits, target)
        batch_loss = F.cross_entropy(logits, target, reduction="sum").double()
        correct1 = c1 if correct1 is None else correct1 + c1
        correct5 = c5 if correct5 is None else correct5 + c5
        loss = batch_loss if loss is None else loss + batch_loss
        if real is not None or keep_predictions:
            top = logits.topk(min(TOPK, logits.shape[1]), dim=1).indices.cpu()
            if real is not None:
                r1, r5, rn = real_hits(top, real[seen : seen + keep])
                real1, real5, real_n = real1 + r1, real5 + r5, real_n + rn
            if keep_predictions:
                preds.append(top)
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
    return Counts(
        int(correct1 or 0),
        int(correct5 or 0),
        seen,
        float(loss or 0.0),
        real1,
        real5,
        real_n,
        torch.cat(preds) if keep_predictions and preds else None,
    )


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


def has_images(root: Path, classes: list[str]) -> bool:
    """Whether any class folder holds an image file (what timm's folder reader would find)."""
    from timm.data.readers.img_extensions import get_img_extensions

    extensions = get_img_extensions(as_set=True)
    for c in classes:
        for _, _, files in os.walk(root / c, followlinks=True):
            if any(os.path.splitext(f)[1].lower() in extensions for f in files):
                return True
    return False


def imagenet_synsets() -> list[str]:
    """The 1000 ImageNet-1k synsets in class-index order (shipped with timm)."""
    from timm.data import ImageNetInfo

    return list(ImageNetInfo("imagenet-1k").label_names())


def read_class_map(path: Path) -> dict[str, int]:
    """A class map in timm's format: ``.txt`` (one name per line, index = line number) or ``.pkl`` dict."""
    from timm.data.readers.class_map import load_class_map

    if not path.is_file():
        raise EvalError(f"--class-map {str(path)!r} does not exist")
    if path.suffix.lower() not in (".txt", ".pkl"):
        raise EvalError(f"--class-map {str(path)!r}: expected a .txt or .pkl file (timm's class map formats)")
    try:
        mapping = load_class_map(str(path))
    except Exception as e:  # unpickling and decoding errors
        raise EvalError(f"--class-map {str(path)!r} cannot be read ({type(e).__name__}: {e})") from e
    if not all(isinstance(k, str) and isinstance(v, int) for k, v in mapping.items()):
        raise EvalError(f"--class-map {str(path)!r} is not a mapping of class names to integer indices")
    return mapping


def label_map(
    classes: list[str], num_classes: int, class_map: Path | None, root: Path, what: str
) -> tuple[dict[str, int], str]:
    """Class folder -> label index for a checkpoint with ``num_classes`` outputs, and how it was chosen."""
    if class_map is not None:
        mapping = read_class_map(class_map)
        missing = [c for c in classes if c not in mapping]
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise EvalError(
                f"--class-map {str(class_map)!r} has no entry for the class folder(s) "
                f"{', '.join(missing[:5])}{more} of {str(root)!r}"
            )
        bad = [f"{c}: {mapping[c]}" for c in classes if not 0 <= mapping[c] < num_classes]
        if bad:
            raise EvalError(
                f"--class-map {str(class_map)!r} maps {', '.join(bad[:5])} outside the {num_classes} classes "
                f"of {what}"
            )
        return {c: mapping[c] for c in classes}, f"class map {class_map.name}"
    if num_classes == 1000:
        index = {s: i for i, s in enumerate(imagenet_synsets())}
        if all(c in index for c in classes):
            return {c: index[c] for c in classes}, "imagenet-1k synsets"
    if len(classes) == num_classes:
        return {c: i for i, c in enumerate(classes)}, "sorted folders"
    hint = "; map the folders to its classes with --class-map FILE" + (
        " (ImageNet-1k synset folders map by themselves)" if num_classes == 1000 else ""
    )
    raise EvalError(
        f"{str(root)!r} has {len(classes)} class folder{'s' * (len(classes) != 1)}, but {what} "
        f"classifies {num_classes} classes{hint}"
    )


def build_dataset(root: Path, mapping: dict[str, int]):
    """timm ``ImageDataset`` over ``root``, label = ``mapping[class folder]``."""
    from timm.data import create_dataset

    try:
        return create_dataset("", root=str(root), split="validation", search_split=False, class_map=mapping)
    except RuntimeError as e:  # timm: "Found 0 images in subfolders of ..."
        raise EvalError(f"no images in {str(root)!r}: {e}") from e


def read_real_labels(path: Path) -> dict[str, list[int]]:
    """ImageNet-ReaL labels (``real.json``: one list of class indices per validation image, in file-name
    order) by file name, ``ILSVRC2012_val_00000001.JPEG`` first, as timm's ``RealLabelsImagenet``."""
    from ._cli import read_json

    data = read_json(path, "--real-labels")
    if not isinstance(data, list) or not all(
        isinstance(v, list) and all(isinstance(i, int) for i in v) for v in data
    ):
        raise EvalError(
            f"--real-labels {str(path)!r} is not a list of label lists (ImageNet-ReaL's real.json)"
        )
    return {REAL_NAME.format(i + 1): labels for i, labels in enumerate(data)}


def real_label_sets(dataset, real: dict[str, list[int]], path: Path, num_classes: int) -> list[list[int]]:
    """The ReaL label set of every image of ``dataset``, in dataset order."""
    from torch.utils.data import Subset

    if num_classes != 1000:
        raise EvalError(
            f"--real-labels needs a 1000-class (ImageNet-1k) checkpoint, not {num_classes} classes"
        )
    base, indices = (dataset.dataset, dataset.indices) if isinstance(dataset, Subset) else (dataset, None)
    names = base.filenames(basename=True)
    names = [names[i] for i in indices] if indices is not None else list(names)
    missing = [n for n in names if n not in real]
    if missing:
        raise EvalError(
            f"{len(missing)} image(s), e.g. {missing[0]!r}, have no entry in --real-labels {str(path)!r} "
            "(ImageNet-ReaL covers the ImageNet-1k validation files ILSVRC2012_val_*.JPEG)"
        )
    return [real[n] for n in names]


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


# ---------------------------------------------------------------------------------------- models
@dataclass
class Job:
    """One model to evaluate: its weights, labels and data, all checked before any evaluation starts."""

    name: str
    model: nn.Module  # training form, CPU, fp32, the checkpoint's weights
    path: Path
    weights: str  # which weights of the file, e.g. "EMA weights (state_dict_ema)"
    ema: bool | None
    mapping_how: str
    dataset: Any
    real: list[list[int]] | None


def model_names(models: list[str] | None) -> list[str | None]:
    """Canonical names for ``--model`` (``all``: every size); ``[None]`` when not given."""
    import convfirstnet
    from convfirstnet.registry import canonical_name

    if not models:
        return [None]
    names: list[str | None] = []
    for m in models:
        names += convfirstnet.list_models() if m.lower() == "all" else [canonical_name(m)]
    return names


def read_weights(name: str | None, checkpoint: Path | None, use_ema: bool):
    """(canonical name, weight file, checkpoint contents) for a model, checked to fit it."""
    from convfirstnet.weights import WeightsNotFoundError, read_checkpoint, resolve_architecture, resolve_weights

    if checkpoint is None:
        try:
            path = resolve_weights(name)
        except WeightsNotFoundError as e:
            raise EvalError(f"{e} Or pass --checkpoint PATH.") from e
    else:
        path = checkpoint
    ckpt = read_checkpoint(path, use_ema=use_ema)
    return resolve_architecture(ckpt, name), path, ckpt


def prepare_jobs(args: argparse.Namespace, root: Path, classes: list[str]) -> list[Job]:
    import convfirstnet
    from convfirstnet.weights import load_checkpoint
    from torch.utils.data import Subset

    names = model_names(args.model)
    checkpoints: list[Path | None] = list(args.checkpoint or [])
    if names == [None]:
        if not checkpoints:
            raise EvalError("give --model (or 'all'), --checkpoint, or both")
        names = [None] * len(checkpoints)
    elif checkpoints and len(checkpoints) != len(names):
        raise EvalError(
            f"{len(names)} model(s) but {len(checkpoints)} --checkpoint file(s): give one per model, "
            "or none to look each model's weights up"
        )
    if args.predictions_file is not None and len(names) > 1:
        raise EvalError("--predictions-file takes one model")
    real_by_name = read_real_labels(args.real_labels) if args.real_labels is not None else None

    jobs, datasets = [], {}
    for name, checkpoint in zip(names, checkpoints or [None] * len(names), strict=True):
        name, path, ckpt = read_weights(name, checkpoint, args.use_ema)
        num_classes = ckpt.num_classes
        if num_classes is None:
            raise EvalError(
                f"checkpoint {str(path)!r} has no classifier (classifier.weight); it cannot be evaluated"
            )
        what = f"the {name} checkpoint {str(path)!r}"
        mapping, how = label_map(classes, num_classes, args.class_map, root, what)
        key = tuple(sorted(mapping.items()))
        if key not in datasets:
            dataset = build_dataset(root, mapping)
            if args.limit is not None and args.limit < len(dataset):
                dataset = Subset(dataset, range(args.limit))
            datasets[key] = dataset
        dataset = datasets[key]
        real = None
        if real_by_name is not None:
            real = real_label_sets(dataset, real_by_name, args.real_labels, num_classes)
        model = convfirstnet.create_model(name, num_classes=num_classes)
        load_checkpoint(model, ckpt, name)
        jobs.append(Job(name, model.eval(), path, ckpt.describe(), ckpt.ema, how, dataset, real))
    return jobs


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

    ints = torch.tensor(
        [counts.top1, counts.top5, counts.images, counts.real_top1, counts.real_top5, counts.real_images],
        dtype=torch.int64,
        device=device,
    )
    loss = torch.tensor([counts.loss], dtype=torch.float64, device=device)
    dist.all_reduce(ints)
    dist.all_reduce(loss)
    t1, t5, n, r1, r5, rn = (int(v) for v in ints.tolist())
    return Counts(t1, t5, n, float(loss.item()), r1, r5, rn)


def gather_predictions(
    local: torch.Tensor | None, rank: int, world_size: int, num_images: int
) -> torch.Tensor | None:
    """Every image's predictions in dataset order (on rank 0), from each rank's shard: rank, rank + W, ..."""
    if world_size == 1:
        return local
    import torch.distributed as dist

    shards: list[Any] = [None] * world_size
    dist.all_gather_object(shards, local.tolist() if local is not None else [])
    if rank != 0:
        return None
    k = next((len(s[0]) for s in shards if s), TOPK)
    out = torch.empty(num_images, k, dtype=torch.int64)
    for r, shard in enumerate(shards):
        if shard:
            out[r::world_size] = torch.tensor(shard, dtype=torch.int64)
    return out


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


def check_args(args: argparse.Namespace) -> None:
    from convfirstnet.model import MIN_INPUT_SIZE

    if args.batch_size < 1:
        raise EvalError("--batch-size must be at least 1")
    if args.workers is not None and args.workers < 0:
        raise EvalError("--workers must be at least 0")
    if args.limit is not None and args.limit < 1:
        raise EvalError("--limit must be at least 1")
    if args.img_size is not None and args.img_size < MIN_INPUT_SIZE:
        raise EvalError(f"--img-size {args.img_size}: ConvFirstNet needs at least {MIN_INPUT_SIZE}")
    if args.crop_pct is not None and not 0 < args.crop_pct <= 1:
        raise EvalError("--crop-pct must be in (0, 1]")
    if args.interpolation is not None and args.interpolation not in INTERPOLATIONS:
        raise EvalError(f"--interpolation {args.interpolation!r}: choose one of {', '.join(INTERPOLATIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise EvalError("--device cuda, but no CUDA device is available")
    if args.results_file is not None and args.results_json is not None:
        raise EvalError("give --results-file or --results-json, not both")
    if args.class_map is not None and not args.class_map.is_file():
        raise EvalError(f"--class-map {str(args.class_map)!r} does not exist")


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
    import convfirstnet
    from convfirstnet.weights import sha256_file
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

    h, w = data_config["input_size"][1:]
    top1, top5 = 100.0 * counts.top1 / counts.images, 100.0 * counts.top5 / counts.images
    results: dict[str, Any] = {
        "model": name,
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
            **_versions(),
        }
    )
    if rank == 0:
        lines = [
            f" * Acc@1 {top1:.3f} ({100 - top1:.3f}) Acc@5 {top5:.3f} ({100 - top5:.3f})",
        ]
        if job.real is not None:
            lines.append(
                f" * ReaL Acc@1 {results['real_top1']:.3f} ({results['real_top1_err']:.3f}) "
                f"Acc@5 {results['real_top5']:.3f} ({results['real_top5_err']:.3f}), "
                f"{counts.real_images} images with ReaL labels"
            )
        lines.append(
            f" * {name}: {counts.images} images, loss {results['loss']:.4f}, "
            f"{results['img_per_sec']:.1f} img/s "
            f"({'fused' if results['fused'] else 'unfused'}, {'compiled' if args.compile else 'eager'}, "
            f"{args.dtype}, {device.type} x{world_size}, {results['img_size']}px crop_pct "
            f"{results['crop_pct']} {results['interpolation']})"
        )
        print("\n".join(lines), flush=True)
        if predictions is not None:
            write_predictions(args.predictions_file, job.dataset, predictions)
    return results


# ---------------------------------------------------------------------------------------- outputs
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> int:
        run(args)
        return 0

    return run_reporting("convfirstnet eval", go)
