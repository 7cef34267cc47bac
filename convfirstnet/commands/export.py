"""``convfirstnet export``: a named model to a deployment file (:mod:`convfirstnet.export`).

    convfirstnet export --model pico --checkpoint pico.safetensors --format pt2    # -> convfirstnet_pico.pt2
    convfirstnet export --model pico --checkpoint pico.safetensors --format onnx   # -> convfirstnet_pico.onnx

Errors (a missing weight file, a bad option value, a failed check) print one ``convfirstnet export: error:``
line and exit with status 1 (a malformed command line prints the usage line before it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from convfirstnet.blocks import MIN_INPUT_SIZE
from convfirstnet.export import (
    CHECK_BATCH,
    DTYPES,
    FORMATS,
    MIN_DYNAMIC_SIZE,
    ExportError,
    dynamic_size,
    export_onnx,
    export_pt2,
    pt2_check_size,
)
from convfirstnet.factory import create_model
from convfirstnet.registry import canonical_name
from convfirstnet.weights import WeightsNotFoundError

from ._cli import ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="convfirstnet export",
        description="Export a ConvFirstNet for deployment: pt2 (torch.export of the fused form, the "
        "convfirstnet ops kept; NVIDIA GPUs through PyTorch) or onnx (BatchNorm-folded layer-wise form, "
        "standard ONNX operators; other runtimes). The file is loaded back and checked against PyTorch.",
    )
    p.add_argument("--model", required=True, help="pico, nano, tiny, small or convfirstnet_<size>")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--checkpoint", default=None, help="weight file (default: the pretrained=True lookup)")
    p.add_argument("--random-weights", action="store_true", help="export randomly initialised weights")
    p.add_argument("--output", default=None, help="default: ./<model name>.<format>")
    p.add_argument(
        "--img-size",
        type=int,
        default=None,
        help="input size to trace at (default: the pretrained_cfg's, 256); pt2 keeps height and width "
        f"dynamic from {MIN_DYNAMIC_SIZE} up, onnx fixes them",
    )
    p.add_argument("--device", default="cpu", help="pt2: device to export on and for (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="pt2: model dtype (onnx: fp32)")
    p.add_argument("--opset", type=int, default=None, help="onnx: opset version (default: the exporter's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(run(args))
    except (ExportError, ValueError, TypeError, RuntimeError, FileNotFoundError) as e:
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"convfirstnet export: error: {message}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> str:
    name = canonical_name(args.model)
    if args.checkpoint and args.random_weights:
        raise ValueError("--checkpoint and --random-weights exclude each other")
    if args.format == "onnx" and args.dtype != "float32":
        raise ValueError("--dtype: the ONNX export is float32 (convert it with ONNX tools afterwards)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}, but no CUDA device is available")
    if args.random_weights:
        model = create_model(name)
    else:
        try:
            model = create_model(name, pretrained=True, checkpoint_path=args.checkpoint, fuse=False)
        except WeightsNotFoundError as e:
            if args.checkpoint:
                raise
            raise ExportError(f"{e} Or pass --checkpoint PATH (--random-weights for random weights).") from e
    img_size = args.img_size or model.pretrained_cfg["input_size"][-1]
    if img_size < MIN_INPUT_SIZE:
        raise ValueError(f"--img-size {img_size}: ConvFirstNet needs at least {MIN_INPUT_SIZE}")
    output = Path(args.output or f"{name}.{args.format}")
    weights = "random weights" if args.random_weights else f"weights {args.checkpoint or 'from the lookup'}"
    c = model.in_chans
    if args.format == "pt2":
        err = export_pt2(model, output, img_size=img_size, device=args.device, dtype=DTYPES[args.dtype])
        what = f"fused form, torch.export, {args.device} {args.dtype}"
        if dynamic_size(img_size):
            shape = f"(batch, {c}, height, width), height and width >= {MIN_DYNAMIC_SIZE}"
            shape += f", traced at {img_size}"
        else:
            shape = f"(batch, {c}, {img_size}, {img_size}), dynamic batch, fixed size"
            shape += f" (dynamic from --img-size {MIN_DYNAMIC_SIZE} up)"
        h, w = pt2_check_size(img_size)
        check = f"torch.export.load at batch {CHECK_BATCH}, {h}x{w}"
    else:
        err = export_onnx(model, output, img_size=img_size, opset=args.opset)
        what = "BatchNorm-folded layer-wise form, ONNX, float32"
        shape = f"(batch, {c}, {img_size}, {img_size}), dynamic batch"
        check = f"onnxruntime (CPU) at batch {CHECK_BATCH}"
        data = output.with_name(output.name + ".data")  # ONNX external data: the exporter puts weights here
        if data.is_file():
            what += f"; the weights in {data}, which must stay beside it"
    return (
        f"wrote {output} ({name}, {weights}; {what}; input {shape})\n"
        f"checked with {check}: max relative error vs PyTorch {err:.2e}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
