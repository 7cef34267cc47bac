"""The command line of ``convfirstnet train``: flags, the recipe's defaults (paper 6.3) and value checks."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .._cli import ArgumentParser, ToolError

LR_BASE, LR_BASE_SIZE = 0.128, 2048  # paper 6.3: lr 0.128 at a global batch of 2048 (8 x 256)
WORKERS = 8  # data-loading processes per training process, at most; fewer on machines with fewer cores


class TrainError(ToolError):
    """A problem with the command's inputs, reported as one line without a traceback."""


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
        "--kernels",
        choices=("triton", "torch"),
        help="triton: the ConvFirst blocks run fused training kernels (Triton forward and backward, the "
        "wide activation recomputed), the MBConv + SE blocks their layers with only the block input stored "
        "(the wide activations recomputed in the backward), the stem and head their layers; torch: every "
        "layer in PyTorch (default: torch; on an H200 triton measured slower launched from Python, faster "
        "captured in a CUDA graph: use it with --cuda-graph, docs/train.md). The "
        "checkpoints are the same either way",
    )
    g.add_argument(
        "--cuda-graph",
        action="store_true",
        help="capture the forward and backward of a step once in a CUDA graph and replay it per batch (after "
        "3 eager warm-up steps; the optimizer, GradScaler and EMA run outside it): removes the host's work "
        "per kernel launch, which bounds the step of --kernels triton. CUDA; with several processes the "
        "gradients are averaged after each replay instead of by DDP's hooks",
    )
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
