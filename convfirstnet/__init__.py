"""ConvFirstNet image classifiers (Lavin 2024) with block-fusion Triton kernels.

    import convfirstnet
    model = convfirstnet.small(pretrained=True)           # fused inference form, eval mode
    model = timm.create_model("convfirstnet_small")       # training form (BatchNorm), random init
    fused = convfirstnet.fuse(model)                      # BatchNorm folded, NHWC, one op per block
"""

try:
    from . import kernels  # noqa: F401  (registers torch.ops.convfirstnet.*)
except ImportError as e:  # the top-level kernels/ folder ships as convfirstnet.kernels (pyproject.toml)
    if e.name not in ("convfirstnet", "convfirstnet.kernels"):  # not found, rather than failing inside
        raise
    raise ImportError(
        "convfirstnet.kernels is missing: install the package (`pip install -e .` in a source checkout) "
        "instead of putting the checkout on the path"
    ) from e

__version__ = "0.1.0"

from .factory import create_model, fuse, nano, pico, small, tiny  # noqa: E402
from .model import ConvFirstNet  # noqa: E402  (importing registers the models with timm)
from .registry import SIZES, canonical_name, list_models  # noqa: E402
from .weights import CheckpointError, WeightsNotFoundError  # noqa: E402

__all__ = [
    "ConvFirstNet", "SIZES", "CheckpointError", "WeightsNotFoundError",
    "canonical_name", "create_model", "fuse", "list_models", "pico", "nano", "tiny", "small",
]
