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
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

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
            raise WeightsNotFoundError(f"checkpoint_path {str(path)!r} does not exist or is not a file")
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

    A classifier of another size (``num_classes`` != the checkpoint's) is left at its initialisation, and
    a stem for ``in_chans`` != 3 is adapted with timm's ``adapt_input_conv``, as timm does for
    pretrained weights. Anything else that does not fit raises :class:`CheckpointError` naming the keys.
    """
    from timm.models import adapt_input_conv

    state_dict, metadata = read_checkpoint(path)
    arch = metadata.get("architecture")
    if name is None:
        name = getattr(model, "pretrained_cfg", {}).get("architecture")
    if arch and name and arch != name:
        raise CheckpointError(f"checkpoint {str(path)!r} is for {arch}, not {name}")
    model_sd = model.state_dict()
    for key in ("classifier.weight", "classifier.bias"):
        if key in state_dict and (key not in model_sd or model_sd[key].shape != state_dict[key].shape):
            if key in model_sd:
                state_dict[key] = model_sd[key]  # another num_classes: keep the new classifier's init
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
