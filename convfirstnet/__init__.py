"""ConvFirstNet image classifiers (Lavin 2024) with block-fusion Triton kernels.

    import convfirstnet
    model = convfirstnet.small(pretrained=True)           # fused inference form, eval mode
    model = timm.create_model("convfirstnet_small")       # training form (BatchNorm), random init
    fused = convfirstnet.fuse(model)                      # BatchNorm folded, NHWC, one op per block
"""

from ._kernels_path import ensure_kernels_package

ensure_kernels_package()

from . import kernels  # noqa: E402,F401  (registers torch.ops.convfirstnet.*)

__version__ = "0.1.0"

from .factory import create_model, fuse, list_models, nano, pico, small, tiny  # noqa: E402
from .model import SIZES, ConvFirstNet  # noqa: E402  (importing registers the models with timm)
from .weights import CheckpointError, WeightsNotFoundError  # noqa: E402

__all__ = [
    "ConvFirstNet", "SIZES", "CheckpointError", "WeightsNotFoundError",
    "create_model", "fuse", "list_models", "pico", "nano", "tiny", "small",
]
