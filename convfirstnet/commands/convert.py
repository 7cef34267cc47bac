"""Convert a training checkpoint into a ConvFirstNet weight file (safetensors + metadata).

    convfirstnet convert output/train/.../model_best.pth.tar weights/convfirstnet_pico.safetensors

Input: a timm training checkpoint (``.pth`` / ``.pth.tar``; its EMA weights unless ``--no-ema``,
``module.`` and ``_orig_mod.`` prefixes stripped), a safetensors file or a plain state-dict file, or (from
Python) a state dict in memory. The architecture is ``--model``, else the one the checkpoint records
(safetensors metadata, timm's ``arch`` / ``args.model``), else the size its tensor shapes fit. Output: a
safetensors file holding the training-form state dict (BatchNorm included), with metadata
``architecture``, ``source``, ``created`` (UTC, ISO 8601), ``tensors_sha256`` (see
:func:`convfirstnet.weights.tensors_sha256`), ``convfirstnet_version``, ``num_classes`` and, for a
training checkpoint, ``checkpoint_key`` (``state_dict_ema`` or ``state_dict``: which weights were taken).
An existing output file is replaced only with ``--overwrite``; the new file gets the usual permissions
(umask), not the temporary file's 0600.

The file is verified before it is put in place: loaded back through the package's loader into a fresh
model, whose output on a random input must equal, bit for bit in fp32, the output of a model holding the
original state dict. The command prints the ``weights/manifest.json`` entry for the file; its ``top1``
stays null until measured with ``convfirstnet eval``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from convfirstnet.weights import (
    Checkpoint,
    CheckpointError,
    checkpoint_from_mapping,
    load_checkpoint,
    load_weights,
    read_checkpoint,
    resolve_architecture,
    save_weights,
    sha256_file,
    tensors_sha256,
)

from ._cli import ArgumentParser, CreatedDirs, ToolError, publish, run_reporting

VERIFY_BATCH, VERIFY_SIZE = 2, 64  # small and fast; above the 32x32 minimum input


def _build(name: str, state_dict: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A training-form model whose classifier and stem match the state dict (num_classes, in_chans)."""
    import convfirstnet

    kwargs = {}
    if "classifier.weight" in state_dict:
        kwargs["num_classes"] = state_dict["classifier.weight"].shape[0]
    elif "classifier.bias" not in state_dict:
        kwargs["num_classes"] = 0
    if "stem.conv.weight" in state_dict:
        kwargs["in_chans"] = state_dict["stem.conv.weight"].shape[1]
    return convfirstnet.create_model(name, **kwargs).eval()


@torch.no_grad()
def _output(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.float().eval()(x)


def convert_checkpoint(
    checkpoint: str | os.PathLike | Mapping[str, Any],
    output: str | os.PathLike,
    model: str | None = None,
    source: str = "",
    *,
    use_ema: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``checkpoint`` as a verified safetensors weight file at ``output``; return its manifest entry.

    ``checkpoint``: a path (timm ``.pth``/``.pth.tar``, safetensors, plain state dict) or a state dict /
    timm checkpoint dict in memory. ``model``: ``"pico"`` or ``"convfirstnet_pico"`` etc.; by default the
    architecture the checkpoint records (safetensors metadata, timm's ``arch`` / ``args.model``), else the
    size its tensor shapes fit. ``source``: free text recorded in the metadata and the entry (default: the
    checkpoint's file name). ``use_ema``: take a timm checkpoint's EMA weights when it has them (else its
    raw ``state_dict``). ``overwrite``: replace an existing ``output`` (else it is an error).

    Raises :class:`convfirstnet.CheckpointError` if the weights do not fit the model or the written file
    does not reproduce them, :class:`convfirstnet.WeightsNotFoundError` for a missing input file,
    ``ValueError`` for an unknown model name, ``convfirstnet.commands._cli.ToolError`` for an existing output.
    """
    return convert(checkpoint, output, model, source, use_ema=use_ema, overwrite=overwrite)[0]


def convert(
    checkpoint: str | os.PathLike | Mapping[str, Any],
    output: str | os.PathLike | None,
    model: str | None = None,
    source: str = "",
    *,
    use_ema: bool = True,
    overwrite: bool = False,
) -> tuple[dict[str, Any], Checkpoint]:
    """:func:`convert_checkpoint`, also returning what was read (which weights, which architecture).
    ``output=None``: ``./<model name>.safetensors``."""
    import convfirstnet

    if isinstance(checkpoint, Mapping):
        ckpt = checkpoint_from_mapping(checkpoint, use_ema=use_ema)
    else:
        ckpt = read_checkpoint(checkpoint, use_ema=use_ema)
        source = source or Path(checkpoint).name
    name = resolve_architecture(ckpt, model)
    output = Path(output if output is not None else f"{name}.safetensors")
    if output.suffix != ".safetensors":
        raise ValueError(f"output {str(output)!r} must end in .safetensors")
    if output.exists() and not overwrite:
        raise ToolError(f"{str(output)!r} exists; pass --overwrite to replace it")
    state_dict = ckpt.state_dict

    original = _build(name, state_dict)
    load_checkpoint(original, ckpt, name)

    metadata = {
        "format": "pt",
        "architecture": name,
        "source": source,
        "created": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "tensors_sha256": tensors_sha256(state_dict),
        "convfirstnet_version": convfirstnet.__version__,
        "num_classes": str(getattr(original, "num_classes", "")),
    }
    if ckpt.key is not None:
        metadata["checkpoint_key"] = ckpt.key  # which weights of a training checkpoint: EMA or raw
    dirs = CreatedDirs()
    dirs.make(output.parent)
    tmp = output.with_name(output.stem + ".part.safetensors")
    done = False
    try:
        save_weights(state_dict, tmp, metadata)
        # Verify through the package's own loader, as a user would load the file.
        loaded = read_checkpoint(tmp, use_ema=False)  # a weight file holds one set of weights
        loaded_sd = loaded.state_dict
        if tensors_sha256(loaded_sd) != metadata["tensors_sha256"] or loaded.metadata != metadata:
            raise CheckpointError(f"{str(output)!r}: the written file does not hold the converted weights")
        fresh = _build(name, loaded_sd)
        load_weights(fresh, tmp, name=name, use_ema=False)
        x = torch.randn(
            VERIFY_BATCH, fresh.in_chans, VERIFY_SIZE, VERIFY_SIZE, generator=torch.Generator().manual_seed(0)
        )
        if not torch.equal(_output(fresh, x), _output(original, x)):
            raise CheckpointError(
                f"{str(output)!r}: the written weights do not reproduce the checkpoint's outputs"
            )
        publish(tmp, output, overwrite=overwrite)
        done = True
    finally:
        tmp.unlink(missing_ok=True)
        if not done:
            dirs.remove_empty()

    entry = {
        "name": name,
        "file": output.name,
        "url": None,
        "sha256": sha256_file(output),
        "source": source,
        "top1": None,
        "note": "top1: measure with convfirstnet eval",
    }
    return entry, ckpt


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="convfirstnet convert",
        description="Convert a training checkpoint into a verified ConvFirstNet safetensors weight file; "
        "print its weights/manifest.json entry. Paths go as options or as positionals: "
        "`convert --checkpoint IN --output OUT` or `convert IN OUT`.",
    )
    p.add_argument("checkpoint_arg", nargs="?", metavar="CHECKPOINT", help="same as --checkpoint")
    p.add_argument("output_arg", nargs="?", metavar="OUTPUT", help="same as --output")
    p.add_argument(
        "-m",
        "--model",
        help="model name, e.g. pico or convfirstnet_pico (default: the architecture the checkpoint "
        "records, else the one its tensor shapes fit)",
    )
    p.add_argument("--checkpoint", help="timm .pth/.pth.tar, safetensors or state-dict file")
    p.add_argument("--output", help="weight file to write (default: ./<model name>.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take a timm checkpoint's EMA weights (state_dict_ema) when it has them; --no-ema takes its "
        "raw state_dict (default: --ema)",
    )
    p.add_argument(
        "--source", default="", help="provenance recorded in the file (default: checkpoint file name)"
    )
    return p


def _pick(p: argparse.ArgumentParser, what: str, option: str | None, positional: str | None) -> str | None:
    if option is not None and positional is not None and option != positional:
        p.error(f"{what} given twice: {positional!r} and --{what} {option!r}")
    return option if option is not None else positional


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    checkpoint = _pick(p, "checkpoint", args.checkpoint, args.checkpoint_arg)
    output = _pick(p, "output", args.output, args.output_arg)
    if checkpoint is None:
        p.error("a checkpoint is required (--checkpoint PATH)")

    def go() -> int:
        entry, ckpt = convert(
            checkpoint, output, args.model, args.source, use_ema=args.ema, overwrite=args.overwrite
        )
        how = (
            "--model" if args.model else ("recorded in the file" if ckpt.architecture else "from its shapes")
        )
        print(
            f"convfirstnet convert: {entry['name']} ({how}), {ckpt.describe()} of {checkpoint} -> "
            f"{output or entry['file']}",
            file=sys.stderr,
        )
        print(json.dumps(entry, indent=2))
        return 0

    return run_reporting("convfirstnet convert", go)
