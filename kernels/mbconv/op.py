"""``torch.ops.convfirstnet.mbconv``: checks, then the Triton kernels or the reference."""

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
from .reference import mbconv_reference

if HAS_TRITON:
    from .launcher import check_supported, mbconv_triton
    from .staged import mbconv_staged_triton, staged


def check_mbconv(
    x: torch.Tensor,
    w_exp: torch.Tensor,
    b_exp: torch.Tensor,
    w_conv: torch.Tensor,
    b_conv: torch.Tensor,
    w_se1: torch.Tensor,
    b_se1: torch.Tensor,
    w_se2: torch.Tensor,
    b_se2: torch.Tensor,
    w_proj: torch.Tensor,
    b_proj: torch.Tensor,
    stride: int,
) -> None:
    """The op's input checks (also run by the layer-wise form that FusedMBConv compiles instead)."""
    r, c = w_exp.shape
    s, k = w_se1.shape[0], w_proj.shape[0]
    check_activation("mbconv", x, c)
    check_spatial("mbconv", x, stride)
    check_shape("mbconv", "b_exp", b_exp, (r,))
    check_shape("mbconv", "w_conv", w_conv, (r, GROUP_WIDTH, 3, 3))
    check_shape("mbconv", "b_conv", b_conv, (r,))
    check_shape("mbconv", "w_se1", w_se1, (s, r))
    check_shape("mbconv", "b_se1", b_se1, (s,))
    check_shape("mbconv", "w_se2", w_se2, (r, s))
    check_shape("mbconv", "b_se2", b_se2, (r,))
    check_shape("mbconv", "w_proj", w_proj, (k, r))
    check_shape("mbconv", "b_proj", b_proj, (k,))
    if stride == 1 and k != c:
        raise ValueError(f"convfirstnet.mbconv: a stride-1 block is C -> C with a residual, got {c} -> {k}")
    check_weights(
        "mbconv",
        x,
        dict(w_exp=w_exp, b_exp=b_exp, w_conv=w_conv, b_conv=b_conv, w_se1=w_se1, b_se1=b_se1,
             w_se2=w_se2, b_se2=b_se2, w_proj=w_proj, b_proj=b_proj),
    )


@define_op("convfirstnet::mbconv")
def mbconv(
    x: torch.Tensor,
    w_exp: torch.Tensor,
    b_exp: torch.Tensor,
    w_conv: torch.Tensor,
    b_conv: torch.Tensor,
    w_se1: torch.Tensor,
    b_se1: torch.Tensor,
    w_se2: torch.Tensor,
    b_se2: torch.Tensor,
    w_proj: torch.Tensor,
    b_proj: torch.Tensor,
    stride: int,
) -> torch.Tensor:
    """One MBConv + SE block (stride 1 or 2) on folded weights; NHWC out. See reference.py."""
    check_mbconv(x, w_exp, b_exp, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj, stride)
    r, c = w_exp.shape
    k = w_proj.shape[0]
    if use_triton(x):
        check_supported(x, c, r, k)
        run = mbconv_staged_triton if x.shape[0] > 0 and staged(x, r) else mbconv_triton
        return run(x, w_exp, b_exp, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj, stride)
    return mbconv_reference(x, w_exp, b_exp, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj, stride)


# Autograd: the backward recomputes the block through its reference (cost in kernels/_autograd.py).
from .._autograd import register_reference_autograd  # noqa: E402

register_reference_autograd("convfirstnet::mbconv", mbconv_reference)
