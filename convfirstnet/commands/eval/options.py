"""The command line of ``convfirstnet eval``: flags, defaults and value checks."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .._cli import ArgumentParser, ToolError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming")
WORKERS = 4  # at most, per process; fewer on machines with fewer cores


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
