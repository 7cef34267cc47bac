"""``torch.ops.convfirstnet.convfirst``: checks, then the Triton kernel or the reference."""

import torch

from .._launch import (
    GROUP_WIDTH,
    HAS_TRITON,
    check_activation,
    check_shape,
    check_spatial,
    check_weights,
    define_op,
    use_triton,
)
from .reference import convfirst_reference

if HAS_TRITON:
    from .launcher import check_supported, convfirst_triton
    from .staged import convfirst_staged, staged


@define_op("convfirstnet::convfirst")
def convfirst(
    x: torch.Tensor,
    w_conv: torch.Tensor,
    b_conv: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    stride: int,
) -> torch.Tensor:
    """One ConvFirst block (stride 1 or 2) on folded weights; NHWC out. See reference.py."""
    c = w_conv.shape[0]
    r, k = w1.shape[0], w2.shape[0]
    c1 = c if stride == 1 else 2 * c
    check_activation("convfirst", x, c)
    check_spatial("convfirst", x, stride)
    check_shape("convfirst", "w_conv", w_conv, (c, GROUP_WIDTH, 3, 3))
    check_shape("convfirst", "b_conv", b_conv, (c,))
    check_shape("convfirst", "w1", w1, (r, c1))
    check_shape("convfirst", "b1", b1, (r,))
    check_shape("convfirst", "w2", w2, (k, r))
    check_shape("convfirst", "b2", b2, (k,))
    if stride == 1 and k != c:
        raise ValueError(f"convfirstnet.convfirst: a stride-1 block is C -> C with a residual, got {c} -> {k}")
    check_weights("convfirst", x, dict(w_conv=w_conv, b_conv=b_conv, w1=w1, b1=b1, w2=w2, b2=b2))
    if use_triton(x):
        check_supported(x, c, k, stride)
        if staged(x, stride):
            return convfirst_staged(x, w_conv, b_conv, w1, b1, w2, b2)
        return convfirst_triton(x, w_conv, b_conv, w1, b1, w2, b2, stride)
    return convfirst_reference(x, w_conv, b_conv, w1, b1, w2, b2, stride)


# Autograd: the backward recomputes the block through its reference (cost in kernels/_autograd.py).
from .._autograd import register_reference_autograd  # noqa: E402

register_reference_autograd("convfirstnet::convfirst", convfirst_reference)
