"""An MBConv + SE block (folded weights, inference) as staged launches instead of the hidden kernel, on the
maps where launcher.staged takes them (launcher.py: why and where): the training forward's kernels, h and u
through DRAM."""

from __future__ import annotations

import torch

from ..gconv.launcher import gconv3x3_triton
from . import launcher
from .expand_backward import expand_forward, offsets_fit
from .moments import mbconv_from_conv_output


def staged(x: torch.Tensor, r: int) -> bool:
    """Whether the block runs as staged launches rather than the hidden kernel (``launcher.STAGED``; None:
    on maps of ``launcher.STAGED_MIN_PIXELS`` pixels and more, launcher.py's docstring, while the expand's
    operands take its 32-bit offsets; past that the hidden kernel, which takes any batch)."""
    if launcher.STAGED is not None:
        return launcher.STAGED
    n, c, h, w = x.shape
    return h * w >= launcher.STAGED_MIN_PIXELS and offsets_fit(n * h * w, c, r)


def mbconv_staged_triton(x: torch.Tensor, w_exp: torch.Tensor, b_exp: torch.Tensor, w_conv: torch.Tensor,
                         b_conv: torch.Tensor, w_se1: torch.Tensor, b_se1: torch.Tensor, w_se2: torch.Tensor,
                         b_se2: torch.Tensor, w_proj: torch.Tensor, b_proj: torch.Tensor,
                         stride: int) -> torch.Tensor:
    """The block as the training forward's launches with the folded weights: h = SiLU(x W_exp^T + b_exp)
    by the expand kernel (expand_backward.expand_forward), u = gconv3x3(h) by the group-width-8 conv
    (kernels/gconv), then moments.mbconv_from_conv_output: SiLU(u + b_conv) (stride 2: BlurPool) with the
    pool, the SE gates, the projection (+ the residual at stride 1). h and u go through DRAM."""
    n, c, h, w = x.shape
    r = w_exp.shape[0]
    f32 = dict(device=x.device, dtype=torch.float32)
    zeros, ones = torch.zeros((r,), **f32), torch.ones((r,), **f32)
    x2 = x.permute(0, 2, 3, 1).reshape(n * h * w, c)
    hid = expand_forward(x2, w_exp.contiguous(), zeros, ones, ones, b_exp.contiguous())
    u4 = gconv3x3_triton(hid.view(n, h, w, r).permute(0, 3, 1, 2), w_conv, 1)
    del hid
    u = u4.permute(0, 2, 3, 1).reshape(n, h * w, r)
    return mbconv_from_conv_output(u, x, torch.stack((zeros, ones)), ones, b_conv.contiguous(), w_se1, b_se1,
                                   w_se2, b_se2, w_proj, b_proj, stride, residual=stride == 1)
