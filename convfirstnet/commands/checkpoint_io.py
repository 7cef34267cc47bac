"""Reading checkpoints for the commands: which weights (EMA or raw), which architecture, how many classes.

``convfirstnet.weights.read_checkpoint`` always prefers a timm checkpoint's EMA weights. The commands let
the user choose (``eval --use-ema`` as timm's ``validate.py``; ``convert --no-ema``) and say which weights
they took, so they read timm checkpoints here, with timm's key order:

    use_ema:  state_dict_ema, model_ema, state_dict, model, the file itself
    raw:      state_dict, model, the file itself

Files are recognised by their first bytes (a ``torch.save`` zip archive or legacy pickle, or a
safetensors header), so a file that is neither is reported as such instead of as a pickle error.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

EMA_KEYS = ("state_dict_ema", "model_ema")
RAW_KEYS = ("state_dict", "model")


@dataclass
class Checkpoint:
    state_dict: dict[str, torch.Tensor]
    path: Path | None = None
    key: str | None = None  # where the weights came from: "state_dict_ema", "state_dict", ...; None: the file
    has_ema: bool = False  # the file holds EMA weights (taken or not)
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors metadata
    architecture: str | None = None  # canonical name recorded in the file, if any

    @property
    def ema(self) -> bool | None:
        """True: EMA weights were taken; False: the raw weights of a checkpoint that names them; None:
        a weight file or plain state dict, which does not say."""
        if self.key in EMA_KEYS:
            return True
        if self.key in RAW_KEYS:
            return False
        return None

    def describe(self) -> str:
        """E.g. ``EMA weights (state_dict_ema)``, for messages."""
        if self.ema is True:
            return f"EMA weights ({self.key})"
        if self.ema is False:
            return f"raw weights ({self.key})" + (", the file also holds EMA weights" if self.has_ema else "")
        return "the file's weights"

    @property
    def num_classes(self) -> int | None:
        w = self.state_dict.get("classifier.weight")
        return int(w.shape[0]) if w is not None and w.dim() == 2 else None


def file_format(path: Path) -> str:
    """``"torch"`` (zip archive or legacy pickle from ``torch.save``), ``"safetensors"`` or ``"unknown"``."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":  # zip archive; pickle protocol 2+
        return "torch"
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if 0 < header_len < 100_000_000 and head[8:9] == b"{":
            return "safetensors"
    return "unknown"


def _canonical_or_none(name: Any) -> str | None:
    from convfirstnet.registry import canonical_name

    if not isinstance(name, str):
        return None
    try:
        return canonical_name(name)
    except ValueError:
        return None


def read(path: str | os.PathLike, use_ema: bool = True) -> Checkpoint:
    """The weights of a weight file, timm training checkpoint or state-dict file (see module docstring).

    Raises ``WeightsNotFoundError`` for a missing file and ``CheckpointError`` for one that is not a
    checkpoint or holds no state dict of tensors.
    """
    from convfirstnet.weights import CheckpointError, WeightsNotFoundError, read_checkpoint

    path = Path(path).expanduser()
    if not path.is_file():
        raise WeightsNotFoundError(f"checkpoint {str(path)!r} does not exist or is not a file")
    kind = file_format(path)
    if kind == "unknown":
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint: neither a PyTorch file (torch.save) nor a safetensors file"
        )
    if kind == "safetensors":
        state_dict, metadata = read_checkpoint(path)
        return Checkpoint(
            state_dict, path, None, False, metadata, _canonical_or_none(metadata.get("architecture"))
        )
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and "weights_only" errors all mean "not a readable checkpoint"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read checkpoint {str(path)!r} ({type(e).__name__}: {msg})") from e
    return from_mapping(data, use_ema, path)


def from_mapping(data: Any, use_ema: bool = True, path: Path | None = None) -> Checkpoint:
    """A :class:`Checkpoint` from a loaded timm checkpoint dict or a state dict."""
    from convfirstnet.weights import CheckpointError, clean_state_dict

    where = f"checkpoint {str(path)!r}" if path is not None else "the checkpoint given in memory"
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{where} does not hold a state dict (it holds a {type(data).__name__})")
    has_ema = any(isinstance(data.get(k), Mapping) for k in EMA_KEYS)
    order = (EMA_KEYS if use_ema else ()) + RAW_KEYS
    key = next((k for k in order if isinstance(data.get(k), Mapping)), None)
    state_dict = data[key] if key is not None else data
    if not state_dict or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise CheckpointError(f"{where} does not hold a state dict of tensors")
    arch = None
    if key is not None:  # a timm training checkpoint: CheckpointSaver records args.model as "arch"
        args = data.get("args")
        arch = _canonical_or_none(data.get("arch")) or _canonical_or_none(getattr(args, "model", None))
    return Checkpoint(clean_state_dict(dict(state_dict)), path, key, has_ema, {}, arch)


def infer_architecture(state_dict: Mapping[str, torch.Tensor]) -> str | None:
    """The ConvFirstNet size whose stem width and stage depths the state dict has (None if none)."""
    from convfirstnet.registry import SIZES

    stem = state_dict.get("stem.conv.weight")
    if stem is None or stem.dim() != 4:
        return None
    depths: dict[int, set[int]] = {}
    for key in state_dict:
        parts = key.split(".")
        if len(parts) > 3 and parts[0] == "stages" and parts[1].isdigit() and parts[2].isdigit():
            depths.setdefault(int(parts[1]), set()).add(int(parts[2]))
    found = tuple(len(depths.get(i, ())) for i in range(max(depths, default=-1) + 1))
    for size, spec in SIZES.items():
        channels_ok = all(
            (w := state_dict.get(f"stages.{i}.{st.depth - 1}.conv_project.weight")) is not None
            and w.shape[0] == st.channels
            for i, st in enumerate(spec.stages)
        )
        if spec.stem == stem.shape[0] and found == tuple(s.depth for s in spec.stages) and channels_ok:
            return f"convfirstnet_{size}"
    return None


def resolve_architecture(ckpt: Checkpoint, model: str | None) -> str:
    """The model to build for ``ckpt``: ``model`` when given (it must agree with what the file records),
    else the architecture recorded in the file, else the one its tensor shapes fit."""
    from convfirstnet.registry import canonical_name
    from convfirstnet.weights import CheckpointError

    where = f"checkpoint {str(ckpt.path)!r}" if ckpt.path is not None else "the checkpoint given in memory"
    if model is not None:
        name = canonical_name(model)
        if ckpt.metadata.get("architecture") and ckpt.architecture != name:
            raise CheckpointError(f"{where} is for {ckpt.metadata['architecture']}, not {name}")
        return name
    if ckpt.architecture is not None:
        return ckpt.architecture
    inferred = infer_architecture(ckpt.state_dict)
    if inferred is None:
        raise CheckpointError(
            f"{where} records no architecture and its shapes fit no ConvFirstNet size; pass --model"
        )
    return inferred


def load_into(
    model: torch.nn.Module, ckpt: Checkpoint, name: str, new_classifier_ok: bool = False
) -> list[str]:
    """Load ``ckpt`` into a training-form ``model`` strictly, with the package's error messages.

    ``new_classifier_ok``: a classifier of another size (fine-tuning to a new ``num_classes``) keeps the
    model's initialisation instead of failing. Returns the keys left at their initialisation.
    """
    from convfirstnet.weights import CheckpointError, _describe_mismatch

    where = f"checkpoint {str(ckpt.path)!r}" if ckpt.path is not None else "the checkpoint given in memory"
    state_dict = dict(ckpt.state_dict)
    model_sd = model.state_dict()
    kept = []
    if new_classifier_ok:
        for key in ("classifier.weight", "classifier.bias"):
            if key in state_dict and (key not in model_sd or model_sd[key].shape != state_dict[key].shape):
                del state_dict[key]
                if key in model_sd:
                    state_dict[key] = model_sd[key]
                    kept.append(key)
    problem = _describe_mismatch(model_sd, state_dict)
    if problem:
        said = f" (it says it is {ckpt.architecture})" if ckpt.architecture else ""
        raise CheckpointError(f"{where} does not fit {name}{said}: {problem}")
    model.load_state_dict(state_dict, strict=True)
    return kept


def read_json(path: str | os.PathLike, what: str) -> Any:
    from ._cli import ToolError

    path = Path(path)
    if not path.is_file():
        raise ToolError(f"{what} {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolError(f"{what} {str(path)!r} is not JSON ({e})") from e
