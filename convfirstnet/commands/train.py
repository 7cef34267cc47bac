"""Train a ConvFirstNet with the paper's ImageNet recipe (Section 6.3), built from timm's components.

    torchrun --nproc_per_node 8 scripts/train_imagenet.py --model pico --data /data/imagenet --output out/pico
    convfirstnet train --model pico --data /data/imagenet --output out/pico --resume auto   # after a stop

Recipe defaults (paper 6.3, which trained with timm on 8 GPUs x 256 images), flags in brackets:

- 600 epochs [--epochs]; global batch 2048 at lr 0.128, the lr scaled linearly with the global batch
  [--batch-size per process, --lr-base, --lr absolute];
- 3 warm-up epochs [--warmup-epochs], then step decay 0.97 every 2.4 epochs (timm ``step`` scheduler,
  stepped per update) [--decay-epochs, --decay-rate];
- RMSprop with TensorFlow-style epsilon (timm ``rmsproptf``), momentum 0.9, weight decay 1e-5
  [--opt, --momentum, --weight-decay];
- dropout 0.2 Pico / 0.3 others (``SIZES[size].drop_rate``) [--drop], drop-path 0.2 [--drop-path];
- RandAugment ``rand-m9-mstd0.5`` [--aa], random erasing 0.2 in "pixel" mode [--reprob, --remode];
  ``--aug none`` turns all augmentation off;
- EMA of the weights, timm ``ModelEmaV3`` with decay 0.9999 [--ema-decay, --no-ema];
- fp16 autocast + GradScaler on CUDA [--no-amp], channels-last [--no-channels-last];
- training at 224x224 [--img-size], evaluation at the model's ``pretrained_cfg`` size, 256 with
  crop_pct 0.95 [--val-img-size].

Not stated by the paper, taken from timm's EfficientNet recipe (which the paper says inspired its
settings): ``--opt-eps 1e-3``, ``--smoothing 0.1`` (timm ``train.py``'s default), ``--warmup-lr 1e-6``.

Mixup / CutMix: timm's ``Mixup`` with ``SoftTargetCrossEntropy``, off by default (the paper's recipe has
none) [--mixup, --cutmix, --cutmix-minmax, --mixup-prob, --mixup-switch-prob, --mixup-mode,
--mixup-off-epoch], the flags of timm's ``train.py``.

Fine-tuning: ``--pretrained`` (the model's weights, looked up as ``pretrained=True`` does) or
``--initial-checkpoint PATH`` (a weight file or timm checkpoint, EMA weights preferred as in timm), with
``--num-classes`` (default: the training folder's class count); a classifier of another size starts
from its initialisation.

Data: an ImageFolder tree with ``train/`` and ``val/`` (or ``validation/``) class folders (timm
``create_dataset``; ``--train-split`` / ``--val-split`` name other folders). Both must exist: a folder
without them is refused rather than trained and validated on the same images. Several GPUs or nodes:
``torchrun`` (DDP; nccl on CUDA, gloo on CPU).

Output folder: ``last.pth.tar`` (every epoch), ``checkpoint-<epoch>.pth.tar`` (best few by top-1),
``recovery-<epoch>-<step>.pth.tar`` (every ``--recovery-interval`` steps and when ``--max-steps`` stops
the run; removed at the next epoch checkpoint), ``summary.csv`` (timm's columns: ``epoch, train_loss,
eval_loss, eval_top1, eval_top5``, the EMA's ``eval_ema_loss, eval_ema_top1, eval_ema_top5``, ``lr``; one
row per epoch), ``log.jsonl`` (loss, lr, img/s, validation metrics), ``args.yaml`` (as timm's), and at
the end ``<model_name>.safetensors``: the EMA weights, written by ``convert_checkpoint`` and ready for
``create_model(name, pretrained=True)`` via ``$CONVFIRSTNET_WEIGHTS_DIR``. A checkpoint holds the model, EMA, optimizer, GradScaler and scheduler
states and the position (epoch, step in the epoch, global step); ``--resume auto`` continues from the
most advanced one, mid-epoch included, with the same sample order. Every input is checked before the
output folder is created; a run that fails before its first checkpoint removes what it created. An
output folder that holds an earlier run (any of the files above) is refused unless ``--resume`` continues
it or ``--overwrite`` starts over, which first removes exactly those files (other files stay).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ._cli import ArgumentParser, CreatedDirs, ToolError, default_workers, run_reporting


class TrainError(ToolError):
    """A problem with the command's inputs, reported as one line without a traceback."""


LR_BASE, LR_BASE_SIZE = 0.128, 2048  # paper 6.3: lr 0.128 at a global batch of 2048 (8 x 256)
CHECKPOINT_EXT = ".pth.tar"  # timm CheckpointSaver's extension
WORKERS = 8  # data-loading processes per training process, at most; fewer on machines with fewer cores
RUN_FILES = ("args.yaml", "log.jsonl", "summary.csv")  # what a run writes before its first checkpoint
# The checkpoints a run writes: timm CheckpointSaver's last, model_best, checkpoint-<epoch>,
# recovery-<epoch>-<step> and the temporary files it renames from.
CHECKPOINT_NAME = re.compile(r"(last|model_best|tmp|recovery_tmp|checkpoint-\d+|recovery-\d+-\d+)\.pth\.tar")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="convfirstnet train",
        description="Train a ConvFirstNet with the paper's ImageNet recipe (timm components). Several GPUs: "
        "torchrun --nproc_per_node=N scripts/train_imagenet.py ...",
    )
    p.add_argument("-m", "--model", required=True, help="pico, nano, tiny, small (or convfirstnet_<size>)")
    p.add_argument(
        "--data",
        "--data-dir",
        dest="data",
        required=True,
        type=Path,
        help="folder with train/ and val/ (ImageFolder layout)",
    )
    p.add_argument("--train-split", default="train", help="training folder under --data (default: train)")
    p.add_argument(
        "--val-split",
        default="validation",
        help="validation folder under --data (default: validation, or val/valid/eval as timm finds them)",
    )
    p.add_argument("--output", type=Path, help="output folder (default: output/train/<model_name>)")
    p.add_argument("--num-classes", type=int, help="default: the number of class folders in the train split")
    g = p.add_argument_group("fine-tuning")
    g.add_argument(
        "--pretrained",
        action="store_true",
        help="start from the model's weights (looked up as pretrained=True does)",
    )
    g.add_argument(
        "--initial-checkpoint",
        type=Path,
        help="start from this weight file or timm checkpoint (EMA weights preferred, as timm)",
    )
    g = p.add_argument_group("schedule and optimizer")
    g.add_argument("--epochs", type=int, default=600)
    g.add_argument(
        "-b", "--batch-size", type=int, default=256, help="per process; global = batch x world size"
    )
    g.add_argument(
        "--lr", type=float, help="absolute learning rate (default: --lr-base scaled to the global batch)"
    )
    g.add_argument("--lr-base", type=float, default=LR_BASE, help=f"lr at a global batch of {LR_BASE_SIZE}")
    g.add_argument("--warmup-epochs", type=int, default=3)
    g.add_argument("--warmup-lr", type=float, default=1e-6)
    g.add_argument("--decay-epochs", type=float, default=2.4)
    g.add_argument("--decay-rate", type=float, default=0.97)
    g.add_argument("--opt", default="rmsproptf", help="timm optimizer name")
    g.add_argument("--opt-eps", type=float, default=1e-3)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=1e-5)
    g.add_argument("--clip-grad", type=float, help="gradient-norm clipping (off by default)")
    g.add_argument("--smoothing", type=float, default=0.1, help="label smoothing")
    g = p.add_argument_group("regularization and augmentation")
    g.add_argument("--drop", type=float, help="dropout before the classifier (default: 0.2 Pico, 0.3 others)")
    g.add_argument("--drop-path", type=float, default=0.2)
    g.add_argument(
        "--aug",
        choices=("recipe", "none"),
        default="recipe",
        help="none: resize + center crop only, no RandAugment, flips, erasing",
    )
    g.add_argument("--aa", default="rand-m9-mstd0.5", help="timm auto-augment string ('' for none)")
    g.add_argument("--reprob", type=float, default=0.2, help="random-erasing probability")
    g.add_argument("--remode", default="pixel", help="random-erasing mode")
    g.add_argument("--mixup", type=float, default=0.0, help="mixup alpha, on if > 0 (default: 0, off)")
    g.add_argument("--cutmix", type=float, default=0.0, help="cutmix alpha, on if > 0 (default: 0, off)")
    g.add_argument(
        "--cutmix-minmax",
        type=float,
        nargs=2,
        default=None,
        help="cutmix min/max area ratio (turns cutmix on)",
    )
    g.add_argument("--mixup-prob", type=float, default=1.0, help="probability of mixup or cutmix per batch")
    g.add_argument(
        "--mixup-switch-prob", type=float, default=0.5, help="probability of cutmix when both are on"
    )
    g.add_argument("--mixup-mode", choices=("batch", "pair", "elem"), default="batch")
    g.add_argument("--mixup-off-epoch", type=int, default=0, help="turn mixup off from this epoch (0: never)")
    g.add_argument("--ema", action=argparse.BooleanOptionalAction, default=True, help="EMA of the weights")
    g.add_argument("--ema-decay", type=float, default=0.9999)
    g.add_argument("--ema-warmup", action="store_true", help="ModelEmaV3 decay warm-up (for short runs)")
    g = p.add_argument_group("resolution, device, precision")
    g.add_argument("--img-size", type=int, default=224, help="training size")
    g.add_argument(
        "--val-img-size", type=int, help="evaluation size (default: the model's pretrained_cfg, 256)"
    )
    g.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    g.add_argument(
        "--amp",
        action=argparse.BooleanOptionalAction,
        help="fp16 autocast + GradScaler (default: on with CUDA)",
    )
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "-j",
        "--workers",
        type=int,
        help=f"data-loading processes per training process (default: {WORKERS}, or the cores available "
        "if fewer)",
    )
    g.add_argument("--seed", type=int, default=42)
    g = p.add_argument_group("checkpoints, validation, logging")
    g.add_argument("--resume", default="", help="'auto' (the most advanced checkpoint in --output) or a path")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an --output folder that holds an earlier run: its run files are removed "
        "first (args.yaml, log.jsonl, summary.csv, *.pth.tar checkpoints, the model's weight file)",
    )
    g.add_argument(
        "--max-steps",
        type=int,
        help="stop after this many optimizer steps in all (a later --resume continues)",
    )
    g.add_argument(
        "--recovery-interval", type=int, default=0, help="also checkpoint every N steps (0: epoch ends only)"
    )
    g.add_argument("--checkpoint-hist", type=int, default=3, help="best epoch checkpoints kept")
    g.add_argument("--val-interval", type=int, default=1, help="validate every N epochs (and after the last)")
    g.add_argument("--log-interval", type=int, default=50, help="steps between log.jsonl records")
    g.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, help="progress bar (default: on a terminal)"
    )
    g.add_argument(
        "--no-weights", action="store_true", help="do not write <model_name>.safetensors at the end"
    )
    return p


def recipe_lr(global_batch: int, lr_base: float = LR_BASE) -> float:
    """The paper's learning rate scaled linearly to ``global_batch`` (0.128 at 2048)."""
    return lr_base * global_batch / LR_BASE_SIZE


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (order fixed by seed + epoch) that can start an epoch after its first steps.

    ``skip`` samples of this rank's shard are dropped, so a run resumed mid-epoch sees exactly the batches
    the interrupted run had not reached, without loading the others.
    """

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


class TrainState:
    """Checkpoint contents beyond timm's defaults, given to ``CheckpointSaver`` through its ``task`` hook.

    The saver stores what this returns next to the optimizer, GradScaler, args and epoch: the model and EMA
    state dicts (under timm's keys), the scheduler state and ``position``, where training continues.
    """

    def __init__(self, model: nn.Module, model_ema: nn.Module | None, scheduler: Any):
        self.model, self.model_ema, self.scheduler = model, model_ema, scheduler
        self.epoch = self.step_in_epoch = self.global_step = 0

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step}

    def get_checkpoint_state(self, ema: bool = False, unwrap_fn=None) -> dict[str, Any]:
        from timm.utils import get_state_dict, unwrap_model

        unwrap_fn = unwrap_fn or unwrap_model
        if ema:
            return (
                {}
                if self.model_ema is None
                else {"state_dict_ema": get_state_dict(self.model_ema, unwrap_fn)}
            )
        return {
            "state_dict": get_state_dict(self.model, unwrap_fn),
            "scheduler": self.scheduler.state_dict(),
            "position": self.position(),
        }


def checkpoint_position(path: Path) -> dict[str, int] | None:
    """``position`` of a checkpoint written by this script (None for another file)."""
    from timm.utils import load_checkpoint_metadata

    try:
        meta = load_checkpoint_metadata(str(path))
    except Exception:  # unreadable or partial file: not a candidate
        return None
    return meta.get("position") if isinstance(meta, dict) else None


def find_resume(resume: str, output: Path) -> Path | None:
    """The checkpoint to resume from: a path, or for 'auto' the most advanced one in ``output``."""
    if not resume:
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_file():
            raise TrainError(f"--resume {resume!r} does not exist")
        return path
    best, best_key = None, None
    for path in output.glob(f"*{CHECKPOINT_EXT}"):
        if not (path.name == "last" + CHECKPOINT_EXT or path.name.startswith("recovery-")):
            continue
        pos = checkpoint_position(path)
        if pos is None:
            continue
        key = (pos["global_step"], path.name == "last" + CHECKPOINT_EXT)  # a tie goes to the epoch checkpoint
        if best_key is None or key > best_key:
            best, best_key = path, key
    return best


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


def train_transforms(args: argparse.Namespace, data_cfg: dict[str, Any]):
    from timm.data import create_transform

    no_aug = args.aug == "none"
    return create_transform(
        args.img_size,
        is_training=True,
        no_aug=no_aug,
        auto_augment=(args.aa or None) if not no_aug else None,
        re_prob=args.reprob if not no_aug else 0.0,
        re_mode=args.remode,
        interpolation="random" if not no_aug else data_cfg["interpolation"],
        mean=data_cfg["mean"],
        std=data_cfg["std"],
    )


def eval_transforms(data_cfg: dict[str, Any]):
    from timm.data import create_transform

    return create_transform(
        data_cfg["input_size"],
        is_training=False,
        interpolation=data_cfg["interpolation"],
        mean=data_cfg["mean"],
        std=data_cfg["std"],
        crop_pct=data_cfg["crop_pct"],
    )


@torch.no_grad()
def validate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    autocast,
    channels_last: bool,
    distributed: bool,
) -> dict[str, float]:
    """Loss (cross-entropy, no smoothing, as timm's validation), top-1 and top-5 in percent over the whole
    split: exact sums over images and processes."""
    model.eval()
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # top-1 hits, top-5 hits, images
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with autocast():
            logits = model(images)
        logits = logits.float()
        loss_sum += nn.functional.cross_entropy(logits, target, reduction="sum").double()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hit = top == target[:, None]
        counts[0] += hit[:, 0].sum()
        counts[1] += hit.any(dim=1).sum()
        counts[2] += target.numel()
    if distributed:
        torch.distributed.all_reduce(counts)
        torch.distributed.all_reduce(loss_sum)
    top1, top5, total = counts.tolist()
    total = max(total, 1)
    return {"loss": loss_sum.item() / total, "top1": 100.0 * top1 / total, "top5": 100.0 * top5 / total}


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def _log(path: Path, record: dict[str, Any]) -> None:
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


def split_folder(data: Path, split: str) -> Path | None:
    """``data/<split>``, or for timm's synonyms (validation: val, valid, eval, ...) the one that exists;
    None when there is none (timm would then silently use ``data`` itself)."""
    from timm.data.dataset_factory import _EVAL_SYNONYM, _TRAIN_SYNONYM

    candidates = [split]
    for synonyms in (_TRAIN_SYNONYM, _EVAL_SYNONYM):
        if split in synonyms:
            candidates += [s for s in synonyms if s != split]
    return next((data / c for c in candidates if (data / c).is_dir()), None)


def check_args(args: argparse.Namespace) -> None:
    """Value checks of the command line, before anything is loaded or created."""
    from convfirstnet.model import MIN_INPUT_SIZE

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise TrainError(message)

    for flag, value in (
        ("--epochs", args.epochs),
        ("--batch-size", args.batch_size),
        ("--val-interval", args.val_interval),
        ("--log-interval", args.log_interval),
        ("--checkpoint-hist", args.checkpoint_hist),
    ):
        need(value >= 1, f"{flag} must be at least 1, not {value}")
    for flag, value in (("--max-steps", args.max_steps), ("--num-classes", args.num_classes)):
        need(value is None or value >= 1, f"{flag} must be at least 1, not {value}")
    for flag, value in (("--img-size", args.img_size), ("--val-img-size", args.val_img_size)):
        need(
            value is None or value >= MIN_INPUT_SIZE,
            f"{flag} {value}: ConvFirstNet needs at least {MIN_INPUT_SIZE}x{MIN_INPUT_SIZE} inputs",
        )
    need(args.workers is None or args.workers >= 0, "--workers must be at least 0")
    need(args.recovery_interval >= 0, "--recovery-interval must be at least 0")
    need(args.lr is None or args.lr > 0, "--lr must be positive")
    need(args.lr_base > 0, "--lr-base must be positive")
    need(args.warmup_epochs >= 0, "--warmup-epochs must be at least 0")
    need(args.decay_epochs > 0, "--decay-epochs must be positive")
    need(0 <= args.ema_decay < 1, "--ema-decay must be in [0, 1)")
    for flag, value in (
        ("--drop", args.drop),
        ("--drop-path", args.drop_path),
        ("--smoothing", args.smoothing),
    ):
        need(value is None or 0 <= value < 1, f"{flag} must be in [0, 1)")
    for flag, value in (
        ("--reprob", args.reprob),
        ("--mixup-prob", args.mixup_prob),
        ("--mixup-switch-prob", args.mixup_switch_prob),
    ):
        need(0 <= value <= 1, f"{flag} must be in [0, 1]")
    need(args.mixup >= 0 and args.cutmix >= 0, "--mixup and --cutmix must be at least 0")
    need(args.mixup_off_epoch >= 0, "--mixup-off-epoch must be at least 0")
    if mixup_active(args):
        need(args.batch_size % 2 == 0, f"mixup/cutmix need an even --batch-size, not {args.batch_size}")
    need(
        not (args.pretrained and args.initial_checkpoint),
        "give --pretrained or --initial-checkpoint, not both",
    )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda, but no CUDA device is available")


def mixup_active(args: argparse.Namespace) -> bool:
    return args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None


def initial_weights(args: argparse.Namespace, name: str):
    """The checkpoint to start from (``--pretrained`` / ``--initial-checkpoint``), checked; or None."""
    from convfirstnet.weights import WeightsNotFoundError, read_checkpoint, resolve_architecture, resolve_weights

    if args.pretrained:
        try:
            path = resolve_weights(name)
        except WeightsNotFoundError as e:
            raise TrainError(f"--pretrained: {e} Or start from a file with --initial-checkpoint PATH.") from e
    elif args.initial_checkpoint is not None:
        path = args.initial_checkpoint
    else:
        return None
    ckpt = read_checkpoint(path, use_ema=True)  # timm's load_checkpoint prefers EMA weights too
    resolve_architecture(ckpt, name)  # a file recorded as another size is an error
    return ckpt


def check_resume_file(path: Path) -> None:
    """A ``--resume`` path must be a training checkpoint (one line instead of a pickle error)."""
    from timm.utils import load_checkpoint_metadata

    from convfirstnet.weights import file_format

    if file_format(path) != "torch":
        raise TrainError(f"--resume {str(path)!r} is not a training checkpoint (torch.save file)")
    try:
        meta = load_checkpoint_metadata(str(path))
    except Exception as e:  # pickle, zip and weights_only errors
        raise TrainError(f"--resume {str(path)!r} cannot be read ({type(e).__name__})") from e
    if not isinstance(meta, dict) or "state_dict" not in meta or "optimizer" not in meta:
        raise TrainError(
            f"--resume {str(path)!r} is not a training checkpoint (no state_dict and optimizer); to start "
            "from its weights use --initial-checkpoint"
        )


@dataclass
class Run:
    """Everything a training run needs, built and checked by :func:`prepare` before the output exists."""

    name: str
    output: Path
    resume_path: Path | None
    device: torch.device
    rank: int
    world_size: int
    distributed: bool
    use_amp: bool
    num_classes: int
    drop: float
    lr: float
    model: nn.Module
    model_ema: nn.Module | None
    optimizer: Any
    loss_scaler: Any
    scheduler: Any
    num_epochs: int
    steps_per_epoch: int
    sampler: ResumableSampler
    train_loader: DataLoader
    val_loader: DataLoader
    num_train_images: int
    mixup_fn: Any
    start: str  # where the weights came from: "random init", or the initial checkpoint

    @property
    def primary(self) -> bool:
        return self.rank == 0

    @property
    def global_batch(self) -> int:
        return self.sampler.num_replicas * self.train_loader.batch_size


def prepare(args: argparse.Namespace) -> Run:
    """Check every input and build the run: data, model (and its initial weights), optimizer, schedule."""
    import timm
    from timm.data import Mixup, create_dataset, resolve_data_config
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3, NativeScaler, random_seed
    from timm.utils.distributed import init_distributed_device_so

    import convfirstnet  # noqa: F401  (registers the models with timm)
    from convfirstnet.registry import SIZES, canonical_name
    from convfirstnet.weights import load_checkpoint

    name = canonical_name(args.model)
    check_args(args)
    output = args.output or Path("output") / "train" / name
    check_output(args, output, name)
    if not args.data.is_dir():
        raise TrainError(f"--data {str(args.data)!r} is not a directory")
    train_dir = split_folder(args.data, args.train_split)
    val_dir = split_folder(args.data, args.val_split)
    if train_dir is None or val_dir is None:
        which = args.train_split if train_dir is None else args.val_split
        raise TrainError(
            f"--data {str(args.data)!r} has no {which}/ folder: expected DIR/{args.train_split}/<class>/... "
            f"and DIR/{args.val_split}/<class>/... (or val/), so that training and validation images differ"
        )
    if train_dir.resolve() == val_dir.resolve():
        raise TrainError(f"--train-split and --val-split are the same folder {str(train_dir)!r}")
    init_ckpt = initial_weights(args, name)
    resume_path = find_resume(args.resume, output)
    if resume_path is not None and args.resume != "auto":
        check_resume_file(resume_path)

    dist_info = init_distributed_device_so(
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(dist_info["device"])
    rank, world_size = dist_info["global_rank"], dist_info["world_size"]
    use_amp = device.type == "cuda" if args.amp is None else args.amp
    if use_amp and device.type != "cuda":
        raise TrainError("--amp (fp16 + GradScaler) needs CUDA; use --no-amp on CPU")
    workers = args.workers if args.workers is not None else default_workers(WORKERS)
    random_seed(args.seed, rank)

    # data: the validation folder is labelled with the training folder's classes
    try:
        train_set = create_dataset(
            "", root=str(train_dir), split=args.train_split, search_split=False, is_training=True
        )
    except RuntimeError as e:  # timm: "Found 0 images in subfolders of ..."
        raise TrainError(f"no training images in {str(train_dir)!r}: {e}") from e
    class_to_idx = dict(train_set.reader.class_to_idx)
    val_classes = sorted(d.name for d in val_dir.iterdir() if d.is_dir() and not d.name.startswith("."))
    unknown = [c for c in val_classes if c not in class_to_idx]
    if unknown:
        raise TrainError(
            f"{str(val_dir)!r} has class folder(s) {', '.join(unknown[:5])} that {str(train_dir)!r} has not"
        )
    try:
        val_set = create_dataset(
            "", root=str(val_dir), split=args.val_split, search_split=False, class_map=class_to_idx
        )
    except RuntimeError as e:
        raise TrainError(f"no validation images in {str(val_dir)!r}: {e}") from e
    num_classes = args.num_classes or len(class_to_idx)
    if num_classes < len(class_to_idx):
        raise TrainError(f"--num-classes {num_classes} is less than the {len(class_to_idx)} training classes")

    # model and its initial weights
    size = name.removeprefix("convfirstnet_")
    drop = SIZES[size].drop_rate if args.drop is None else args.drop
    model = timm.create_model(name, num_classes=num_classes, drop_rate=drop, drop_path_rate=args.drop_path)
    start = "random init"
    if init_ckpt is not None:
        kept = load_checkpoint(model, init_ckpt, name, new_classifier_ok=True)
        start = f"{init_ckpt.path}, {init_ckpt.describe()}"
        if kept:
            start += f"; new {num_classes}-class classifier (the checkpoint has {init_ckpt.num_classes})"
    data_cfg = resolve_data_config(model=model)
    if args.val_img_size:
        data_cfg["input_size"] = (3, args.val_img_size, args.val_img_size)
    try:
        train_set.transform = train_transforms(args, data_cfg)
    except (ValueError, AssertionError, KeyError) as e:  # e.g. an --aa string timm cannot parse
        raise TrainError(f"augmentation settings (--aa {args.aa!r}, --remode {args.remode!r}): {e}") from e
    val_set.transform = eval_transforms(data_cfg)
    model.to(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if args.channels_last:
        model.to(memory_format=torch.channels_last)

    # optimizer, schedule, EMA, loaders
    lr = args.lr if args.lr is not None else recipe_lr(args.batch_size * world_size, args.lr_base)
    try:
        optimizer = create_optimizer_v2(
            model,
            opt=args.opt,
            lr=lr,
            weight_decay=args.weight_decay,
            momentum=args.momentum,
            eps=args.opt_eps,
        )
    except (ValueError, AssertionError, KeyError) as e:  # unknown optimizer name
        raise TrainError(f"--opt {args.opt!r}: {e}") from e
    loss_scaler = NativeScaler(device="cuda") if use_amp else None
    model_ema = ModelEmaV3(model, decay=args.ema_decay, use_warmup=args.ema_warmup) if args.ema else None

    sampler = ResumableSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    steps_per_epoch = sampler.num_samples // args.batch_size
    if steps_per_epoch == 0:
        raise TrainError(
            f"{len(train_set)} training images per process are fewer than one batch ({args.batch_size})"
        )
    loader_kw = dict(num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0)
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, **loader_kw
    )
    val_loader = DataLoader(
        Subset(val_set, range(rank, len(val_set), world_size)),
        batch_size=args.batch_size,
        shuffle=False,
        **loader_kw,
    )
    mixup_fn = None
    if mixup_active(args):
        mixup_fn = Mixup(
            mixup_alpha=args.mixup,
            cutmix_alpha=args.cutmix,
            cutmix_minmax=args.cutmix_minmax,
            prob=args.mixup_prob,
            switch_prob=args.mixup_switch_prob,
            mode=args.mixup_mode,
            label_smoothing=args.smoothing,
            num_classes=num_classes,
        )
    scheduler, num_epochs = create_scheduler_v2(
        optimizer,
        sched="step",
        num_epochs=args.epochs,
        decay_epochs=args.decay_epochs,
        decay_rate=args.decay_rate,
        warmup_epochs=args.warmup_epochs,
        warmup_lr=args.warmup_lr,
        step_on_epochs=False,
        updates_per_epoch=steps_per_epoch,
    )
    return Run(
        name,
        output,
        resume_path,
        device,
        rank,
        world_size,
        dist_info["distributed"],
        use_amp,
        num_classes,
        drop,
        lr,
        model,
        model_ema,
        optimizer,
        loss_scaler,
        scheduler,
        num_epochs,
        steps_per_epoch,
        sampler,
        train_loader,
        val_loader,
        len(train_set),
        mixup_fn,
        start,
    )


def train(args: argparse.Namespace) -> int:
    """Train; the output folder is created only after every input was checked, and a run that fails
    before its first checkpoint removes the files and folders it created."""
    run = prepare(args)
    dirs, created = CreatedDirs(), set()
    if run.primary and args.overwrite:
        removed = run_files(run.output, run.name)
        for p in removed:
            p.unlink()
        if removed:
            print(f"--overwrite: removed {len(removed)} file(s) of an earlier run from {run.output}",
                  flush=True)
    if run.primary:
        dirs.make(run.output)
        created = {f for f in RUN_FILES if not (run.output / f).exists()}
    try:
        return run_training(args, run)
    except BaseException:
        if run.primary and not any(run.output.glob(f"*{CHECKPOINT_EXT}")):
            for f in created:  # nothing to resume from: remove what this run wrote, and its folders
                (run.output / f).unlink(missing_ok=True)
            dirs.remove_empty()
        raise


def run_training(args: argparse.Namespace, run: Run) -> int:
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from timm.models import load_checkpoint, resume_checkpoint
    from timm.utils import (
        AverageMeter,
        CheckpointSaver,
        distribute_bn,
        load_checkpoint_metadata,
        reduce_tensor,
    )
    from tqdm import tqdm

    name, output, device, primary, distributed = (
        run.name,
        run.output,
        run.device,
        run.primary,
        run.distributed,
    )
    model, model_ema, optimizer, scheduler = run.model, run.model_ema, run.optimizer, run.scheduler
    sampler, steps_per_epoch, num_epochs, world_size = (
        run.sampler,
        run.steps_per_epoch,
        run.num_epochs,
        run.world_size,
    )
    state = TrainState(model, model_ema, scheduler)

    # resume -------------------------------------------------------------------------------------
    resume_path = run.resume_path
    if resume_path is not None:
        resume_checkpoint(model, str(resume_path), optimizer, run.loss_scaler, log_info=False)
        if model_ema is not None:
            load_checkpoint(model_ema.module, str(resume_path), use_ema=True)
        meta = load_checkpoint_metadata(str(resume_path))
        if "scheduler" in meta:
            scheduler.load_state_dict(meta["scheduler"])
        pos = meta.get("position") or {
            "epoch": meta.get("epoch", -1) + 1,
            "step_in_epoch": 0,
            "global_step": (meta.get("epoch", -1) + 1) * steps_per_epoch,
        }
        state.epoch, state.step_in_epoch, state.global_step = (
            pos["epoch"],
            pos["step_in_epoch"],
            pos["global_step"],
        )
        if primary:
            print(
                f"resumed from {resume_path}: epoch {state.epoch}, step {state.step_in_epoch} of "
                f"{steps_per_epoch}, global step {state.global_step}",
                flush=True,
            )
    elif args.resume == "auto" and primary:
        print(f"--resume auto: no checkpoint in {output}, starting from scratch", flush=True)
    scheduler.step_update(num_updates=state.global_step)

    saver = None
    columns = summary_columns(model_ema is not None)
    if primary:
        # Plain types only in the saved args, so the checkpoints load with torch.load(weights_only=True).
        saved_args = argparse.Namespace(**_plain(vars(args)))
        saver = CheckpointSaver(
            model,
            optimizer,
            args=saved_args,
            model_ema=model_ema,
            amp_scaler=run.loss_scaler,
            checkpoint_dir=str(output),
            recovery_dir=str(output),
            max_history=args.checkpoint_hist,
            task=state,
        )
        last = output / ("last" + CHECKPOINT_EXT)
        if resume_path is not None and last.is_file():
            saver.load_state_dict_from_checkpoint(str(last))
        import yaml

        (output / "args.yaml").write_text(yaml.safe_dump(_plain(vars(args)), default_flow_style=False))
        print(
            f"{name}: {run.num_classes} classes, {run.num_train_images} training images, {world_size} "
            f"process(es) on {device.type}, global batch {run.global_batch}, lr {run.lr:g}, "
            f"{steps_per_epoch} "
            f"steps/epoch, {num_epochs} epochs, dropout {run.drop:g}, drop-path {args.drop_path:g}, "
            f"amp {run.use_amp}, mixup {'on' if run.mixup_fn else 'off'}, weights from {run.start}, "
            f"output {output}",
            flush=True,
        )

    train_model = model
    if distributed:
        train_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if run.mixup_fn is not None:  # label smoothing is part of the mixed targets
        train_loss_fn = SoftTargetCrossEntropy()
    elif args.smoothing > 0:
        train_loss_fn = LabelSmoothingCrossEntropy(args.smoothing)
    else:
        train_loss_fn = nn.CrossEntropyLoss()

    def autocast():
        return torch.autocast("cuda", dtype=torch.float16) if run.use_amp else nullcontext()

    log_path = output / "log.jsonl"
    show_progress = primary and (sys.stderr.isatty() if args.progress is None else args.progress)
    stopped = False

    # train --------------------------------------------------------------------------------------
    for epoch in range(state.epoch, num_epochs):
        first_step = state.step_in_epoch if epoch == state.epoch else 0
        sampler.set_epoch(epoch)
        sampler.skip = first_step * args.batch_size
        state.epoch, state.step_in_epoch = epoch, first_step
        if run.mixup_fn is not None and args.mixup_off_epoch and epoch >= args.mixup_off_epoch:
            run.mixup_fn.mixup_enabled = False
        train_model.train()
        loss_meter = AverageMeter()
        window_loss, window_steps, window_start = torch.zeros((), device=device), 0, time.perf_counter()
        bar = tqdm(
            total=steps_per_epoch,
            initial=first_step,
            desc=f"epoch {epoch}",
            disable=not show_progress,
            dynamic_ncols=True,
        )
        for images, target in run.train_loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            if run.mixup_fn is not None:
                images, target = run.mixup_fn(images, target)
            if args.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with autocast():
                loss = train_loss_fn(train_model(images), target)
            optimizer.zero_grad(set_to_none=True)
            if run.loss_scaler is not None:
                run.loss_scaler(
                    loss, optimizer, clip_grad=args.clip_grad or None, parameters=model.parameters()
                )
            else:
                loss.backward()
                if args.clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()
            state.global_step += 1
            state.step_in_epoch += 1
            if model_ema is not None:
                model_ema.update(model, step=state.global_step)
            scheduler.step_update(num_updates=state.global_step)
            window_loss += loss.detach()
            window_steps += 1
            bar.update(1)

            at_end = state.step_in_epoch == steps_per_epoch
            if window_steps == args.log_interval or at_end:
                mean_loss = window_loss / window_steps
                if distributed:
                    mean_loss = reduce_tensor(mean_loss, world_size)
                mean_loss = mean_loss.item()
                elapsed = time.perf_counter() - window_start
                lr_now = optimizer.param_groups[0]["lr"]
                loss_meter.update(mean_loss, window_steps)
                record = dict(
                    kind="train",
                    epoch=epoch,
                    step=state.step_in_epoch,
                    global_step=state.global_step,
                    loss=mean_loss,
                    lr=lr_now,
                    img_per_s=window_steps * run.global_batch / elapsed,
                )
                if primary:
                    _log(log_path, record)
                    bar.set_postfix(
                        loss=f"{mean_loss:.4f}",
                        lr=f"{lr_now:.3g}",
                        img_s=f"{record['img_per_s']:.0f}",
                        refresh=False,
                    )
                window_loss.zero_()
                window_steps, window_start = 0, time.perf_counter()
            if (
                primary
                and args.recovery_interval
                and state.global_step % args.recovery_interval == 0
                and not at_end
            ):
                saver.save_recovery(epoch, batch_idx=state.step_in_epoch)
            if args.max_steps and state.global_step >= args.max_steps:
                stopped = True
                break
        bar.close()

        if state.step_in_epoch < steps_per_epoch:  # stopped mid-epoch by --max-steps
            if primary:
                saver.save_recovery(epoch, batch_idx=state.step_in_epoch)
                print(
                    f"stopped at --max-steps {args.max_steps} (epoch {epoch}, step {state.step_in_epoch}); "
                    f"continue with --resume auto",
                    flush=True,
                )
            break

        # end of epoch: validate, log, checkpoint ------------------------------------------------------
        if distributed:
            distribute_bn(model, world_size, reduce=True)
        evals: dict[str, dict[str, float]] = {}  # "": the model, "ema_": its EMA; each loss, top1, top5
        if (epoch + 1) % args.val_interval == 0 or epoch + 1 == num_epochs or stopped:
            evals[""] = validate(model, run.val_loader, device, autocast, args.channels_last, distributed)
            if model_ema is not None:
                evals["ema_"] = validate(
                    model_ema.module, run.val_loader, device, autocast, args.channels_last, distributed
                )
        state.epoch, state.step_in_epoch = epoch + 1, 0
        if primary:
            lr_now = sum(g["lr"] for g in optimizer.param_groups) / len(optimizer.param_groups)
            logged = {
                f"{who}{'val_loss' if k == 'loss' else k}": v
                for who, m in evals.items()
                for k, v in m.items()
            }
            _log(
                log_path,
                dict(
                    kind="epoch",
                    epoch=epoch,
                    global_step=state.global_step,
                    loss=loss_meter.avg,
                    lr=lr_now,
                    **logged,
                ),
            )
            summary = {f"eval_{who}{k}": v for who, m in evals.items() for k, v in m.items()}
            write_summary(
                output / "summary.csv",
                {"epoch": epoch, "train_loss": loss_meter.avg, **summary, "lr": lr_now},
                columns,
            )
            shown = ", ".join(f"{k} {v:.2f}" for k, v in logged.items() if "top" in k)
            print(
                f"epoch {epoch}: loss {loss_meter.avg:.4f}, lr {lr_now:.3g}"
                + (f", {shown}" if shown else ""),
                flush=True,
            )
            saver.save_checkpoint(epoch, metric=logged.get("ema_top1", logged.get("top1")))
            for stale in output.glob(f"recovery-*{CHECKPOINT_EXT}"):  # all older than this epoch's checkpoint
                stale.unlink(missing_ok=True)
        if stopped:
            if primary and epoch + 1 < num_epochs:
                print(
                    f"stopped at --max-steps {args.max_steps} (end of epoch {epoch}); "
                    "continue with --resume auto",
                    flush=True,
                )
            break

    completed = state.epoch >= num_epochs
    if completed and primary and not args.no_weights:
        write_weights(output / ("last" + CHECKPOINT_EXT), output / f"{name}.safetensors", name, args.ema)
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def write_weights(checkpoint: Path, path: Path, name: str, ema: bool = True) -> dict[str, Any]:
    """The checkpoint's EMA weights (the raw weights of a run without EMA) as a verified weight file, by
    ``convert_checkpoint`` (replacing the file of an earlier run in the same folder); prints and returns
    the ``weights/manifest.json`` entry."""
    from .convert import convert_checkpoint

    which = "EMA weights" if ema else "weights"
    entry = convert_checkpoint(
        checkpoint, path, name, source=f"convfirstnet train, {which} of {checkpoint.name}", overwrite=True
    )
    print(
        f'wrote {path}\nmanifest entry (weights/manifest.json, "models"):\n'
        + json.dumps({entry["name"]: entry}, indent=2),
        flush=True,
    )
    return entry


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting("convfirstnet train", lambda: train(args))


if __name__ == "__main__":
    raise SystemExit(main())
