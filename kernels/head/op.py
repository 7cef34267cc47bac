"""``torch.ops.convfirstnet.head``: checks, then the Triton kernel or the reference."""

import torch

from .._launch import HAS_TRITON, check_activation, check_shape, check_weights, define_op, use_triton
from .reference import head_reference

if HAS_TRITON:
    from .launcher import head_triton


@define_op("convfirstnet::head")
def head(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mean_hw(SiLU(1x1 conv(x))) with folded BatchNorm: (N, C, H, W) -> (N, F). See reference.py."""
    f, c = w.shape
    check_activation("head", x, c)
    check_shape("head", "b", b, (f,))
    check_weights("head", x, {"w": w, "b": b})
    if use_triton(x):
        return head_triton(x, w, b)
    return head_reference(x, w, b)


# Autograd: the backward recomputes the block through its reference (cost in kernels/_autograd.py).
from .._autograd import register_reference_autograd  # noqa: E402

register_reference_autograd("convfirstnet::head", head_reference)
