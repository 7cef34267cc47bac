"""Pretrained weights: where they are looked up, how they are read, checked and loaded.

A weight file is a safetensors file holding the *training-form* state dict (BatchNorm included),
with metadata ``architecture`` naming the model. Resolution order for ``<name>`` (e.g.
``convfirstnet_small``):

1. an explicit ``checkpoint_path``;
2. ``$CONVFIRSTNET_WEIGHTS_DIR/<name>.safetensors``;
3. ``weights/<name>.safetensors`` of a source checkout (a wheel install has no such folder);
4. the cache, ``$CONVFIRSTNET_CACHE`` or ``~/.cache/convfirstnet``;
5. a URL listed in the weight manifest (:func:`manifest_path`), downloaded into the cache and verified
   by sha256.

timm training checkpoints (``.pth`` / ``.pth.tar``, ``module.`` prefixes) load too. One reader,
:func:`read_checkpoint`, reads every format; its ``use_ema`` says which weights of a training checkpoint
to take and every caller states it: the model API (``pretrained=True``, ``checkpoint_path``) takes the
EMA weights first, as timm's ``load_checkpoint``; ``convfirstnet eval`` the raw ones unless
``--use-ema``, as timm's ``validate.py``; ``convfirstnet convert`` the EMA ones unless ``--no-ema``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .paths import source_checkout
from .registry import SIZES, canonical_name

_CHECKOUT = source_checkout()
# weights/ of a source checkout (None for a wheel install, which ships only the manifest)
SOURCE_WEIGHTS_DIR: Path | None = _CHECKOUT / "weights" if _CHECKOUT is not None else None
# fixed at import (the lookup dir may be redirected): the checkout's manifest, else the installed copy
SOURCE_MANIFEST: Path | None = SOURCE_WEIGHTS_DIR / "manifest.json" if SOURCE_WEIGHTS_DIR else None
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
DOCS = "docs/weights.md in the convfirstnet source repository"


class WeightsNotFoundError(FileNotFoundError):
    """No weight file for a model in any of the searched places."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not fit the model."""


# ------------------------------------------------------------------------------------ resolution
def cache_dir() -> Path:
    return Path(os.environ.get("CONVFIRSTNET_CACHE") or Path.home() / ".cache" / "convfirstnet")


def manifest_path() -> Path:
    """The weight manifest read by :func:`manifest`: the source checkout's ``weights/manifest.json``, else
    the copy installed with the package (``convfirstnet/weights_manifest/manifest.json``)."""
    if SOURCE_MANIFEST is not None and SOURCE_MANIFEST.is_file():
        return SOURCE_MANIFEST
    from importlib.resources import files

    return Path(str(files("convfirstnet.weights_manifest").joinpath("manifest.json")))


def manifest() -> dict[str, Any]:
    """The weight manifest (:func:`manifest_path`)."""
    return json.loads(manifest_path().read_text())


def resolve_weights(name: str, checkpoint_path: str | os.PathLike | None = None) -> Path:
    """Path of the weight file for ``name`` (see the module docstring for the order)."""
    if checkpoint_path is not None:
        path = Path(checkpoint_path).expanduser()
        if not path.is_file():
            raise WeightsNotFoundError(f"weight file {str(path)!r} does not exist or is not a file")
        return path
    filename = f"{name}.safetensors"
    candidates = []
    if os.environ.get("CONVFIRSTNET_WEIGHTS_DIR"):
        candidates.append(Path(os.environ["CONVFIRSTNET_WEIGHTS_DIR"]).expanduser() / filename)
    if SOURCE_WEIGHTS_DIR is not None:
        candidates.append(SOURCE_WEIGHTS_DIR / filename)
    candidates.append(cache_dir() / filename)
    for path in candidates:
        if path.is_file():
            return path
    entry = manifest().get("models", {}).get(name)
    if entry and entry.get("url"):
        return download(entry["url"], cache_dir() / entry.get("file", filename), entry["sha256"])
    searched = [str(p) for p in candidates]
    if not os.environ.get("CONVFIRSTNET_WEIGHTS_DIR"):
        searched.insert(0, "$CONVFIRSTNET_WEIGHTS_DIR (not set)")
    searched.append(f"the weight manifest {manifest_path()} (no entry for {name})")
    raise WeightsNotFoundError(
        f"no weights for {name}. Searched:\n  " + "\n  ".join(searched) + "\n"
        "No ConvFirstNet ImageNet weights are published yet. Produce a weight file with `convfirstnet train` "
        "or `convfirstnet convert`, then pass checkpoint_path=... (--checkpoint on the command line), or put "
        f"it as {filename} in $CONVFIRSTNET_WEIGHTS_DIR or {cache_dir()}. See {DOCS}."
    )


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(url: str, dst: Path, sha256: str) -> Path:
    """Download ``url`` to ``dst`` (atomically, via torch.hub) and verify its full sha256."""
    if dst.is_file() and sha256_file(dst) == sha256:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(dst.suffix + ".part")
    torch.hub.download_url_to_file(url, str(tmp), hash_prefix=None, progress=True)
    actual = sha256_file(tmp)
    if actual != sha256:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"download of {url} has sha256 {actual}, the manifest says {sha256}")
    tmp.replace(dst)
    return dst


MANIFEST_KEYS = ("file", "url", "sha256", "source", "top1")


def verify_manifest(data: dict[str, Any] | None = None, *, fetch: bool = False) -> list[str]:
    """Problems with a manifest (default: the shipped ``weights/manifest.json``), one line each; empty if
    none. Every entry must name a registered model and have ``MANIFEST_KEYS``, a 64-hex ``sha256`` and a
    ``url``; its file must exist and have that sha256. The file is read from a ``file://`` URL, else from
    the cache (``cache_dir()/<file>``); a remote URL with no cached copy is downloaded with ``fetch=True``
    (the download checks the sha256) and not checked otherwise.
    """
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    data = manifest() if data is None else data
    problems = []
    for name, entry in (data.get("models") or {}).items():
        if name.removeprefix("convfirstnet_") not in SIZES or not name.startswith("convfirstnet_"):
            problems.append(f"{name}: not a registered model")
        missing = [k for k in MANIFEST_KEYS if k not in entry]
        if missing:
            problems.append(f"{name}: missing {', '.join(missing)}")
            continue
        digest, url = str(entry["sha256"]), entry["url"]
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            problems.append(f"{name}: sha256 {digest!r} is not 64 lowercase hex digits")
            continue
        if not url:
            problems.append(f"{name}: no url (list a file only once it is published)")
            continue
        parsed = urlparse(url)
        if parsed.scheme == "file":
            path = Path(url2pathname(parsed.path))
        elif (cache_dir() / entry["file"]).is_file():
            path = cache_dir() / entry["file"]
        elif fetch:
            try:
                download(url, cache_dir() / entry["file"], digest)
            except Exception as e:  # unreachable URL or sha256 mismatch
                problems.append(f"{name}: {url}: {type(e).__name__}: {e}")
            continue
        else:
            continue
        if not path.is_file():
            problems.append(f"{name}: {path} does not exist")
        elif sha256_file(path) != digest:
            problems.append(f"{name}: {path} has sha256 {sha256_file(path)}, the manifest says {digest}")
    return problems


# ------------------------------------------------------------------------------------ reading
def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip DistributedDataParallel (``module.``) and torch.compile (``_orig_mod.``) prefixes."""
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        out[key] = value
    return out


EMA_KEYS = ("state_dict_ema", "model_ema")  # timm's key order, as its load_state_dict(use_ema=True)
RAW_KEYS = ("state_dict", "model")


@dataclass
class Checkpoint:
    """What :func:`read_checkpoint` read: the state dict, and which weights of the file they are."""

    state_dict: dict[str, torch.Tensor]
    path: Path | None = None
    key: str | None = None  # where the weights came from: "state_dict_ema", "state_dict", ...; None: the file
    has_ema: bool = False  # the file holds EMA weights (taken or not)
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors metadata
    architecture: str | None = None  # registered name the file records, if any

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

    @property
    def where(self) -> str:
        return f"checkpoint {str(self.path)!r}" if self.path is not None else "the checkpoint given in memory"


def file_format(path: str | os.PathLike) -> str:
    """``"torch"`` (zip archive or legacy pickle from ``torch.save``), ``"safetensors"`` or ``"unknown"``,
    from the first bytes, whatever the file is called."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":  # zip archive; pickle protocol 2+
        return "torch"
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if 0 < header_len < 100_000_000 and head[8:9] == b"{":
            return "safetensors"
    return "unknown"


def _registered_or_none(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    try:
        return canonical_name(name)
    except ValueError:
        return None


def read_checkpoint(path: str | os.PathLike, *, use_ema: bool) -> Checkpoint:
    """The weights of a weight file (safetensors), a timm training checkpoint or a state-dict file.

    ``use_ema`` says which weights of a timm training checkpoint to take; it has no default, so that
    every caller states it: True takes the EMA weights when the file holds them (``state_dict_ema``,
    ``model_ema``, then ``state_dict``, ``model``: timm's order, as its ``load_checkpoint``), False the raw
    ones (``state_dict``, ``model``: as timm's ``validate.py`` without ``--use-ema``). A weight file or a
    plain state dict holds one set of weights. ``.pth`` files load with ``weights_only=True`` (timm's
    saved ``args`` Namespace allowed); ``module.`` and ``_orig_mod.`` prefixes are stripped. Files are
    recognised by their first bytes (:func:`file_format`).

    Raises :class:`WeightsNotFoundError` for a missing file and :class:`CheckpointError` for one that is
    not a checkpoint or holds no state dict of tensors.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise WeightsNotFoundError(f"checkpoint {str(path)!r} does not exist or is not a file")
    kind = file_format(path)
    if kind == "unknown":
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint: neither a PyTorch file (torch.save) nor a safetensors file"
        )
    try:
        if kind == "safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = f.metadata() or {}
                data = {k: f.get_tensor(k) for k in f.keys()}
        else:
            with torch.serialization.safe_globals([argparse.Namespace]):
                data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors, pickle, zip and "weights_only" errors: not a readable checkpoint
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read checkpoint {str(path)!r} ({type(e).__name__}: {msg})") from e
    if kind == "safetensors":
        ckpt = checkpoint_from_mapping(data, use_ema=use_ema, path=path)
        ckpt.metadata = metadata
        ckpt.architecture = _registered_or_none(metadata.get("architecture"))
        return ckpt
    return checkpoint_from_mapping(data, use_ema=use_ema, path=path)


def checkpoint_from_mapping(data: Any, *, use_ema: bool, path: Path | None = None) -> Checkpoint:
    """A :class:`Checkpoint` from a loaded timm checkpoint dict or a state dict (``use_ema``: as
    :func:`read_checkpoint`)."""
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
        arch = _registered_or_none(data.get("arch")) or _registered_or_none(getattr(args, "model", None))
    return Checkpoint(clean_state_dict(dict(state_dict)), path, key, has_ema, {}, arch)


def infer_architecture(state_dict: Mapping[str, torch.Tensor]) -> str | None:
    """The ConvFirstNet size whose stem width and stage depths the state dict has (None if none)."""
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
    if model is not None:
        name = canonical_name(model)
        if ckpt.metadata.get("architecture") and ckpt.architecture != name:
            raise CheckpointError(f"{ckpt.where} is for {ckpt.metadata['architecture']}, not {name}")
        return name
    if ckpt.architecture is not None:
        return ckpt.architecture
    inferred = infer_architecture(ckpt.state_dict)
    if inferred is None:
        raise CheckpointError(
            f"{ckpt.where} records no architecture and its shapes fit no ConvFirstNet size; pass --model"
        )
    return inferred


def checkpoint_num_classes(path: str | os.PathLike) -> int | None:
    """The class count of a checkpoint's classifier: the ``num_classes`` metadata of a weight file, else
    the rows of ``classifier.weight`` (timm ``.pth`` files), 0 for a checkpoint without a classifier, None
    when there is no way to tell. A safetensors file is not read in full for this.
    """
    path = Path(path)
    if path.is_file() and file_format(path) == "safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = (f.metadata() or {}).get("num_classes", "")
                keys = set(f.keys())
                has_classifier = "classifier.weight" in keys
                rows = f.get_slice("classifier.weight").get_shape()[0] if has_classifier else None
        except Exception as e:
            raise CheckpointError(f"cannot read checkpoint {str(path)!r} ({type(e).__name__}: {e})") from e
        if meta.strip().isdigit():
            if rows is not None and rows != int(meta):
                raise CheckpointError(
                    f"checkpoint {str(path)!r} says num_classes={meta} but its classifier.weight has "
                    f"{rows} rows"
                )
            return int(meta)
    else:
        state_dict = read_checkpoint(path, use_ema=True).state_dict  # the class count is the same in both
        keys = set(state_dict)
        rows = state_dict["classifier.weight"].shape[0] if "classifier.weight" in keys else None
    if rows is not None:
        return int(rows)
    return 0 if "classifier.bias" not in keys else None


def save_weights(state_dict: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """Write a weight file: contiguous CPU tensors, string metadata (``architecture`` required)."""
    from safetensors.torch import save_file

    if "architecture" not in metadata:
        raise ValueError("weight-file metadata must name the architecture")
    tensors = {k: v.detach().cpu().contiguous() for k, v in clean_state_dict(state_dict).items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={k: str(v) for k, v in metadata.items()})


# ------------------------------------------------------------------------------------ loading
def _describe_mismatch(model_sd: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], limit: int = 8) -> str:
    missing = [k for k in model_sd if k not in sd]
    unexpected = [k for k in sd if k not in model_sd]
    shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(v.shape)}"
        for k, v in model_sd.items()
        if k in sd and sd[k].shape != v.shape
    ]
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)):
        if items:
            more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
            parts.append(f"{len(items)} {label}: " + ", ".join(items[:limit]) + more)
    return "; ".join(parts)


def load_checkpoint(
    model: nn.Module,
    ckpt: Checkpoint,
    name: str | None = None,
    *,
    new_classifier_ok: bool = False,
    adapt_in_chans: bool = False,
) -> list[str]:
    """Load ``ckpt`` (:func:`read_checkpoint`) into a training-form ConvFirstNet, strictly.

    ``new_classifier_ok``: a classifier of another size than the model's (fine-tuning to a new
    ``num_classes``) keeps the model's own, its initialisation; for a model built without one
    (``num_classes=0``) the checkpoint's is dropped. ``adapt_in_chans``: a stem for another ``in_chans``
    is adapted with timm's ``adapt_input_conv``. Anything else that does not fit raises
    :class:`CheckpointError` naming the keys. Returns the keys left at the model's initialisation.
    """
    from timm.models import adapt_input_conv

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
    stem = "stem.conv.weight"
    if adapt_in_chans and stem in state_dict and stem in model_sd:
        if state_dict[stem].shape[1] != model_sd[stem].shape[1]:
            state_dict[stem] = adapt_input_conv(model_sd[stem].shape[1], state_dict[stem])
    problem = _describe_mismatch(model_sd, state_dict)
    if problem:
        said = f" (it says it is {ckpt.architecture})" if ckpt.architecture else ""
        raise CheckpointError(f"{ckpt.where} does not fit {name or 'the model'}{said}: {problem}")
    model.load_state_dict(state_dict, strict=True)
    return kept


def load_weights(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    name: str | None = None,
    use_ema: bool = True,
    strict: bool = False,
) -> None:
    """Load a weight file or checkpoint into a training-form ConvFirstNet: the loader behind
    ``pretrained=True`` and ``checkpoint_path`` (``ConvFirstNet.load_pretrained``).

    ``use_ema`` (:func:`read_checkpoint`): a timm training checkpoint's EMA weights when it holds them,
    as timm's ``load_checkpoint``. A checkpoint recorded for another model is refused. Two adaptations,
    as timm makes for pretrained weights: a model built for another ``num_classes`` than the
    checkpoint's keeps its own classifier (a fresh model's: its initialisation), with a ``UserWarning``
    saying so (none for ``num_classes=0``, which asks for no classifier); a stem for ``in_chans`` != the
    checkpoint's is adapted with timm's ``adapt_input_conv``. Anything else that does not fit raises
    :class:`CheckpointError` naming the keys. The entry points take the class count from the checkpoint
    when the caller does not give one (:func:`checkpoint_num_classes`), so a fine-tuned file loads whole.
    ``strict=True`` makes neither adaptation: every tensor must fit, as timm's ``load_checkpoint`` (what
    ``timm.create_model(..., checkpoint_path=F)`` asks for).
    """
    ckpt = read_checkpoint(path, use_ema=use_ema)
    if name is None:
        name = getattr(model, "pretrained_cfg", {}).get("architecture")
    recorded = ckpt.metadata.get("architecture")
    if recorded and name and recorded != name:
        raise CheckpointError(f"{ckpt.where} is for {recorded}, not {name}")
    kept = load_checkpoint(model, ckpt, name, new_classifier_ok=not strict, adapt_in_chans=not strict)
    if kept:
        warnings.warn(
            f"{ckpt.where} has a {ckpt.num_classes}-class classifier but the model has "
            f"num_classes={getattr(model, 'num_classes', '?')}: the classifier is not loaded and keeps the "
            "model's initialisation (fine-tuning); leave num_classes unset to load the checkpoint's",
            UserWarning,
            stacklevel=2,
        )


# ------------------------------------------------------------------------------------ fingerprints
def tensors_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """Fingerprint of a state dict's contents, independent of the file format that holds it.

    sha256 over the tensors in sorted key order; for each: the key (UTF-8), NUL, the dtype (e.g.
    ``torch.float32``), NUL, the shape (``64,3,3,3``; empty for a scalar), NUL, then the raw bytes of the
    contiguous CPU tensor (native little-endian layout, as safetensors stores them). The same weights
    give the same value whether read from a ``.pth`` or a ``.safetensors`` file.
    """
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().cpu().contiguous()
        header = f"{key}\0{t.dtype}\0{','.join(str(s) for s in t.shape)}\0"
        h.update(header.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
