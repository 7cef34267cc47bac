"""Convert a training checkpoint into a ConvFirstNet weight file (safetensors + metadata).

    convfirstnet convert --model pico --checkpoint output/train/.../model_best.pth.tar \\
        --output weights/convfirstnet_pico.safetensors

Input: a timm training checkpoint (``.pth`` / ``.pth.tar``; EMA weights preferred, ``module.`` and
``_orig_mod.`` prefixes stripped), a safetensors file or a plain state-dict file, or (from Python) a state
dict in memory. Output: a safetensors file holding the training-form state dict (BatchNorm included),
with metadata ``architecture``, ``source``, ``created`` (UTC, ISO 8601), ``tensors_sha256`` (see
:func:`convfirstnet.weights.tensors_sha256`), ``convfirstnet_version``, ``num_classes``.

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

VERIFY_BATCH, VERIFY_SIZE = 2, 64  # small and fast; above the 32x32 minimum input
STATE_DICT_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")  # timm's preference order


def _in_memory_state_dict(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A state dict from a dict in memory: a timm checkpoint dict (EMA preferred) or a state dict."""
    from convfirstnet.weights import CheckpointError, clean_state_dict

    for key in STATE_DICT_KEYS:
        if isinstance(checkpoint.get(key), Mapping):
            checkpoint = checkpoint[key]
            break
    if not all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        raise CheckpointError("the checkpoint given in memory is not a state dict of tensors")
    return clean_state_dict(dict(checkpoint))


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
    model: str,
    source: str = "",
) -> dict[str, Any]:
    """Write ``checkpoint`` as a verified safetensors weight file at ``output``; return its manifest entry.

    ``checkpoint``: a path (timm ``.pth``/``.pth.tar``, safetensors, plain state dict) or a state dict /
    timm checkpoint dict in memory. ``model``: ``"pico"`` or ``"convfirstnet_pico"`` etc. ``source``: free
    text recorded in the metadata and the entry (default: the checkpoint's file name).

    Raises :class:`convfirstnet.CheckpointError` if the weights do not fit the model or the written file
    does not reproduce them, :class:`convfirstnet.WeightsNotFoundError` for a missing input file,
    ``ValueError`` for an unknown model name.
    """
    import convfirstnet
    from convfirstnet.factory import _canonical
    from convfirstnet.weights import (
        CheckpointError,
        _describe_mismatch,
        load_weights,
        read_checkpoint,
        save_weights,
        sha256_file,
        tensors_sha256,
    )

    name = _canonical(model)
    output = Path(output)
    if output.suffix != ".safetensors":
        raise ValueError(f"output {str(output)!r} must end in .safetensors")
    if isinstance(checkpoint, Mapping):
        state_dict, in_meta = _in_memory_state_dict(checkpoint), {}
        where = "the checkpoint given in memory"
    else:
        state_dict, in_meta = read_checkpoint(checkpoint)
        where = f"checkpoint {str(checkpoint)!r}"
        source = source or Path(checkpoint).name
    if in_meta.get("architecture") and in_meta["architecture"] != name:
        raise CheckpointError(f"{where} is for {in_meta['architecture']}, not {name}")

    original = _build(name, state_dict)
    problem = _describe_mismatch(original.state_dict(), state_dict)
    if problem:
        raise CheckpointError(f"{where} does not fit {name}: {problem}")
    original.load_state_dict(state_dict, strict=True)

    metadata = {
        "format": "pt",
        "architecture": name,
        "source": source,
        "created": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "tensors_sha256": tensors_sha256(state_dict),
        "convfirstnet_version": convfirstnet.__version__,
        "num_classes": str(getattr(original, "num_classes", "")),
    }
    tmp = output.with_name(output.stem + ".part.safetensors")  # read_checkpoint goes by the suffix
    try:
        save_weights(state_dict, tmp, metadata)
        # Verify through the package's own loader, as a user would load the file.
        loaded_sd, loaded_meta = read_checkpoint(tmp)
        if tensors_sha256(loaded_sd) != metadata["tensors_sha256"] or loaded_meta != metadata:
            raise CheckpointError(f"{str(output)!r}: the written file does not hold the converted weights")
        fresh = _build(name, loaded_sd)
        load_weights(fresh, tmp, name=name)
        x = torch.randn(
            VERIFY_BATCH, fresh.in_chans, VERIFY_SIZE, VERIFY_SIZE, generator=torch.Generator().manual_seed(0)
        )
        if not torch.equal(_output(fresh, x), _output(original, x)):
            raise CheckpointError(
                f"{str(output)!r}: the written weights do not reproduce the checkpoint's outputs"
            )
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)

    return {
        "name": name,
        "file": output.name,
        "url": None,
        "sha256": sha256_file(output),
        "source": source,
        "top1": None,
        "note": "top1: measure with convfirstnet eval",
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convfirstnet convert",
        description="Convert a training checkpoint into a verified ConvFirstNet safetensors weight file; "
        "print its weights/manifest.json entry. Paths go as options or as positionals: "
        "`convert --model pico --checkpoint IN --output OUT` or `convert IN OUT --model pico`.",
    )
    p.add_argument("checkpoint_arg", nargs="?", metavar="CHECKPOINT", help="same as --checkpoint")
    p.add_argument("output_arg", nargs="?", metavar="OUTPUT", help="same as --output")
    p.add_argument("--model", required=True, help="model name, e.g. pico or convfirstnet_pico")
    p.add_argument("--checkpoint", help="timm .pth/.pth.tar (EMA preferred), safetensors or state-dict file")
    p.add_argument("--output", help="weight file to write (default: ./<model name>.safetensors)")
    p.add_argument(
        "--source", default="", help="provenance recorded in the file (default: checkpoint file name)"
    )
    return p


def _pick(p: argparse.ArgumentParser, what: str, option: str | None, positional: str | None) -> str | None:
    if option is not None and positional is not None and option != positional:
        p.error(f"{what} given twice: {positional!r} and --{what} {option!r}")
    return option if option is not None else positional


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    checkpoint = _pick(p, "checkpoint", args.checkpoint, args.checkpoint_arg)
    output = _pick(p, "output", args.output, args.output_arg)
    if checkpoint is None:
        p.error("a checkpoint is required (--checkpoint PATH)")
    from convfirstnet.factory import _canonical
    from convfirstnet.weights import CheckpointError, WeightsNotFoundError

    try:
        output = output if output is not None else f"{_canonical(args.model)}.safetensors"
        entry = convert_checkpoint(checkpoint, output, args.model, args.source)
    except (CheckpointError, WeightsNotFoundError, ValueError, OSError) as e:
        print(f"convfirstnet convert: error: {_one_line(e)}", file=sys.stderr)
        return 1
    print(json.dumps(entry, indent=2))
    return 0
