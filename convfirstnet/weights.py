"""Pretrained weights: where they are looked up, how they are read, checked and loaded.

A weight file is a safetensors file holding the *training-form* state dict (BatchNorm included),
with metadata ``architecture`` naming the model. Resolution order for ``<name>`` (e.g.
``convfirstnet_small``):

1. an explicit ``checkpoint_path``;
2. ``$CONVFIRSTNET_WEIGHTS_DIR/<name>.safetensors``;
3. ``weights/<name>.safetensors`` of a source checkout;
4. the cache, ``$CONVFIRSTNET_CACHE`` or ``~/.cache/convfirstnet``;
5. a URL listed in ``weights/manifest.json``, downloaded into the cache and verified by sha256.

timm training checkpoints (``.pth`` / ``.pth.tar``: ``state_dict_ema`` preferred over ``state_dict``,
``module.`` prefixes) load too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .registry import SIZES

SOURCE_WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
SOURCE_MANIFEST = SOURCE_WEIGHTS_DIR / "manifest.json"  # fixed at import: the lookup dir may be redirected
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
PRODUCE_HINT = (
    "No ConvFirstNet ImageNet weights are published yet. Produce a weight file with "
    "`convfirstnet train` (scripts/train_imagenet.py) and `convfirstnet convert`, then pass "
    "checkpoint_path=..., or place it as <name>.safetensors in $CONVFIRSTNET_WEIGHTS_DIR "
    "(see weights/README.md)."
)


class WeightsNotFoundError(FileNotFoundError):
    """No weight file for a model in any of the searched places."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not fit the model."""


# ------------------------------------------------------------------------------------ resolution
def cache_dir() -> Path:
    return Path(os.environ.get("CONVFIRSTNET_CACHE") or Path.home() / ".cache" / "convfirstnet")


def manifest() -> dict[str, Any]:
    """``weights/manifest.json``: the source checkout's copy, else the one installed with the package."""
    if SOURCE_MANIFEST.is_file():
        text = SOURCE_MANIFEST.read_text()
    else:
        from importlib.resources import files

        text = files("convfirstnet.weights_manifest").joinpath("manifest.json").read_text()
    return json.loads(text)


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
    candidates += [SOURCE_WEIGHTS_DIR / filename, cache_dir() / filename]
    for path in candidates:
        if path.is_file():
            return path
    entry = manifest().get("models", {}).get(name)
    if entry and entry.get("url"):
        return download(entry["url"], cache_dir() / entry.get("file", filename), entry["sha256"])
    searched = "\n  ".join(str(p) for p in candidates)
    raise WeightsNotFoundError(
        f"no weights for {name}. Searched:\n  {searched}\n  weights/manifest.json (no entry for {name})\n"
        + PRODUCE_HINT
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


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State dict and metadata of a safetensors file or a timm training checkpoint.

    For ``.pth``/``.pth.tar`` the EMA weights are preferred (timm's ``load_state_dict``), loaded with
    ``weights_only=True`` (timm's saved ``args`` Namespace allowed).
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = f.metadata() or {}
                state_dict = {k: f.get_tensor(k) for k in f.keys()}
        else:
            from timm.models import load_state_dict

            with torch.serialization.safe_globals([argparse.Namespace]):
                state_dict = load_state_dict(str(path), use_ema=True, weights_only=True)
            metadata = {}
    except (WeightsNotFoundError, CheckpointError):
        raise
    except Exception as e:  # safetensors, pickle and zip errors all mean "not a readable checkpoint"
        raise CheckpointError(f"cannot read checkpoint {str(path)!r} ({type(e).__name__}: {e})") from e
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise CheckpointError(f"checkpoint {str(path)!r} does not hold a state dict of tensors")
    return clean_state_dict(state_dict), metadata


def checkpoint_num_classes(path: str | os.PathLike) -> int | None:
    """The class count of a checkpoint's classifier: the ``num_classes`` metadata of a weight file, else
    the rows of ``classifier.weight`` (timm ``.pth`` files), 0 for a checkpoint without a classifier, None
    when there is no way to tell. A safetensors file is not read in full for this.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
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
        state_dict, _ = read_checkpoint(path)
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


def load_weights(model: nn.Module, path: str | os.PathLike, *, name: str | None = None) -> None:
    """Load a training-form checkpoint into a training-form ConvFirstNet, strictly.

    Two adaptations, as timm makes for pretrained weights: a model built for another ``num_classes``
    than the checkpoint's keeps its own classifier (a fresh model's: its initialisation), with a
    ``UserWarning`` saying so (none for ``num_classes=0``, which asks for no classifier); a stem for
    ``in_chans`` != the checkpoint's is adapted with timm's ``adapt_input_conv``. Anything else that does
    not fit raises :class:`CheckpointError` naming the keys. The entry points take the class count from
    the checkpoint when the caller does not give one (:func:`checkpoint_num_classes`), so a
    fine-tuned file loads whole.
    """
    from timm.models import adapt_input_conv

    state_dict, metadata = read_checkpoint(path)
    arch = metadata.get("architecture")
    if name is None:
        name = getattr(model, "pretrained_cfg", {}).get("architecture")
    if arch and name and arch != name:
        raise CheckpointError(f"checkpoint {str(path)!r} is for {arch}, not {name}")
    model_sd = model.state_dict()
    ckpt_classes = state_dict["classifier.weight"].shape[0] if "classifier.weight" in state_dict else None
    resized = False
    for key in ("classifier.weight", "classifier.bias"):
        if key in state_dict and (key not in model_sd or model_sd[key].shape != state_dict[key].shape):
            if key in model_sd:
                state_dict[key] = model_sd[key]  # another num_classes: keep the model's classifier
                resized = True
            else:
                del state_dict[key]  # num_classes=0
    stem = "stem.conv.weight"
    if stem in state_dict and stem in model_sd and state_dict[stem].shape[1] != model_sd[stem].shape[1]:
        state_dict[stem] = adapt_input_conv(model_sd[stem].shape[1], state_dict[stem])
    problem = _describe_mismatch(model_sd, state_dict)
    if problem:
        what = f"{name} " if name else ""
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the {what}model"
            + (f" (it says it is {arch})" if arch else "")
            + f": {problem}"
        )
    model.load_state_dict(state_dict, strict=True)
    if resized:
        warnings.warn(
            f"checkpoint {str(path)!r} has a {ckpt_classes}-class classifier but the model has "
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
