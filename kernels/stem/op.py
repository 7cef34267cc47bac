"""``torch.ops.convfirstnet.stem``: checks, then the Triton kernel or the reference."""

import torch

from .._launch import HAS_TRITON, check_activation, check_shape, check_weights, define_op, use_triton
from .reference import stem_reference

if HAS_TRITON:
    from .launcher import check_launchable, check_supported, stem_triton


@define_op("convfirstnet::stem")
def stem(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ReLU(conv3x3_s2(x) + b) with folded BatchNorm; NCHW or NHWC in, NHWC out. See reference.py."""
    c_out, c_in = w.shape[0], w.shape[1]
    check_activation("stem", x, c_in)
    check_shape("stem", "w", w, (c_out, c_in, 3, 3))
    check_shape("stem", "b", b, (c_out,))
    check_weights("stem", x, {"w": w, "b": b})
    if use_triton(x):
        check_supported(c_in, c_out)
        check_launchable(x, c_out)
        return stem_triton(x, w, b)
    return stem_reference(x, w, b)


# Autograd: the backward recomputes the block through its reference (cost in kernels/_autograd.py).
from .._autograd import register_reference_autograd  # noqa: E402

register_reference_autograd("convfirstnet::stem", stem_reference)
