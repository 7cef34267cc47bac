"""Entry points: ``create_model``, ``list_models``, ``fuse`` and one function per size."""

from __future__ import annotations

import os
from typing import Any

import timm
import torch.nn as nn

from .blocks import ConvFirst, FusedBlock, Head, MBConv, Stem
from .model import ConvFirstNet

FUSABLE = (Stem, ConvFirst, MBConv, Head, FusedBlock)  # training blocks, and fused ones (fuse is idempotent)
from .registry import canonical_name, list_models  # noqa: F401  (list_models: part of the entry points)


def fuse(model: nn.Module) -> nn.Module:
    """Inference form: a copy with BatchNorm folded into the convolutions (in fp64, cast back) and
    every block replaced by one ``torch.ops.convfirstnet`` op on NHWC activations, in eval mode.

    Equivalent to ``timm.utils.reparameterize_model(model)`` (each block's ``fuse()``) plus ``eval()``.
    ``model`` is a ConvFirstNet, or a module built from its blocks (a stage, a block); anything else
    (which ``reparameterize_model`` would return unchanged) raises a ``TypeError``.
    """
    from timm.utils import reparameterize_model

    if not isinstance(model, nn.Module) or not any(isinstance(m, FUSABLE) for m in model.modules()):
        raise TypeError(
            f"convfirstnet.fuse takes a ConvFirstNet (or a module built from its blocks), got "
            f"{type(model).__module__}.{type(model).__qualname__}, which has no ConvFirstNet block to fuse"
        )

    return reparameterize_model(model).eval()


_fuse = fuse  # create_model's `fuse` argument shadows the function


def create_model(
    name: str,
    pretrained: bool = False,
    checkpoint_path: str | os.PathLike | None = None,
    fuse: bool | None = None,
    **kwargs: Any,
) -> ConvFirstNet:
    """Build a ConvFirstNet by name (``"small"`` or ``"convfirstnet_small"``).

    Returns, with ``pretrained=True``: the **fused inference form in eval mode** (BatchNorm folded, one
    op per block); ``fuse=False`` keeps the training form (BatchNorm, train mode) for fine-tuning.
    ``checkpoint_path`` alone loads that file into the training form (train mode). Without weights: the
    training form, randomly initialised. (``timm.create_model(name, pretrained=True)`` loads the same
    weights the same way but returns the training form in train mode, timm's convention.)

    The weights are loaded by timm's own path, ``timm.create_model(name, pretrained=True)``, whose
    lookup (``convfirstnet.model._create``) takes ``checkpoint_path`` as the ``pretrained_cfg_overlay``
    file, else the resolution order of ``convfirstnet.weights``. Other keyword arguments
    (``num_classes``, ``in_chans``, ``drop_rate``, ``drop_path_rate``) go to the model.

    With weights, the model has the checkpoint's class count unless ``num_classes`` is given; a
    different ``num_classes`` (fine-tuning) keeps a freshly initialised classifier and warns. Everything
    else must fit exactly (:class:`convfirstnet.CheckpointError` otherwise).
    """
    key = canonical_name(name)
    if checkpoint_path is not None:
        overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
        overlay["file"] = os.fspath(checkpoint_path)
        kwargs["pretrained_cfg_overlay"] = overlay
    model = timm.create_model(key, pretrained=pretrained or checkpoint_path is not None, **kwargs)
    if fuse if fuse is not None else pretrained:
        return _fuse(model)
    return model


def pico(pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """ConvFirstNet-Pico: 5.9 M params, 0.86 GMACs at 256x256 (paper: 79.9 % ImageNet top-1)."""
    return create_model("convfirstnet_pico", pretrained, **kwargs)


def nano(pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """ConvFirstNet-Nano: 10.1 M params, 1.82 GMACs at 256x256 (paper: 81.8 % top-1)."""
    return create_model("convfirstnet_nano", pretrained, **kwargs)


def tiny(pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """ConvFirstNet-Tiny: 17.2 M params, 3.23 GMACs at 256x256 (paper: 82.8 % top-1)."""
    return create_model("convfirstnet_tiny", pretrained, **kwargs)


def small(pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """ConvFirstNet-Small: 28.5 M params, 5.50 GMACs at 256x256 (paper: 83.3 % top-1)."""
    return create_model("convfirstnet_small", pretrained, **kwargs)
