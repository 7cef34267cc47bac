"""The ConvFirstNet sizes and their names: the paper's Table 3 as data, and the public name registry.

The ground floor of the package: it imports nothing of it, and everything that needs a size or a
model name reads it here (``model.py`` builds from ``SIZES``; ``weights.py`` and the commands check
names with ``canonical_name``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Stage:
    block: str  # "convfirst" or "mbconv"
    channels: int
    depth: int
    stride: int
    expansion: int


@dataclass(frozen=True)
class Size:
    stem: int
    stages: tuple[Stage, ...]
    drop_rate: float  # dropout before the classifier (paper 6.3)


# Stage kinds, strides and expansions are the same for every size (paper Table 3).
STAGE_KINDS = (("convfirst", 1, 3), ("convfirst", 2, 6), ("convfirst", 2, 6), ("mbconv", 2, 4), ("mbconv", 2, 4))


def _size(stem: int, channels: Sequence[int], depths: Sequence[int], drop_rate: float) -> Size:
    stages = tuple(Stage(k, c, d, s, t) for (k, s, t), c, d in zip(STAGE_KINDS, channels, depths))
    return Size(stem, stages, drop_rate)


# Paper Table 3: stem channels; output channels and depth of stages 1-5; dropout (paper 6.3).
SIZES: dict[str, Size] = {
    "pico": _size(16, channels=(16, 32, 48, 128, 128), depths=(1, 2, 3, 11, 11), drop_rate=0.2),
    "nano": _size(24, channels=(24, 48, 64, 160, 160), depths=(1, 3, 4, 14, 14), drop_rate=0.3),
    "tiny": _size(24, channels=(24, 48, 72, 192, 192), depths=(2, 5, 6, 18, 18), drop_rate=0.3),
    "small": _size(32, channels=(32, 64, 96, 256, 256), depths=(2, 5, 6, 18, 18), drop_rate=0.3),
}

# The paper's Table 3 / SPEC: parameters (M), GMACs at 256x256 and ImageNet-1k top-1 (%).
PAPER: dict[str, dict[str, float]] = {
    "pico": dict(params_m=5.91, gmacs=0.86, top1=79.858),
    "nano": dict(params_m=10.17, gmacs=1.812, top1=81.834),
    "tiny": dict(params_m=17.24, gmacs=3.227, top1=82.752),
    "small": dict(params_m=28.55, gmacs=5.493, top1=83.312),
}

# The names timm registers (model.py), smallest first.
MODEL_NAMES = tuple(f"convfirstnet_{size}" for size in SIZES)


def list_models() -> list[str]:
    """Registered model names, smallest first: ``convfirstnet_pico`` ... ``convfirstnet_small``."""
    return list(MODEL_NAMES)


def canonical_name(name: str) -> str:
    """The registered name of a model: ``"small"``, ``"convfirstnet_small"``, ``"timm/convfirstnet_small"``
    (any case) all give ``"convfirstnet_small"``. Raises ``ValueError`` naming the models otherwise."""
    key = name.lower().removeprefix("timm/")
    key = key if key.startswith("convfirstnet_") else f"convfirstnet_{key}"
    if key not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODEL_NAMES)}")
    return key
