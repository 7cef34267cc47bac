"""Group-width-8 3x3 convolution (padding 1, stride 1 or 2, no bias) and its two gradients: the
specification of the Triton kernels.

    x:  (N, C, H, W)        any memory format; C a multiple of 8, groups = C / 8
    w:  (C, 8, 3, 3)        w[co, k, kh, kw] acts on input channel 8 (co // 8) + k
    y:  (N, C, H', W')      H' = ceil(H / stride), W' = ceil(W / stride)

    y[n, co, oh, ow]  = sum_{k, kh, kw} w[co, k, kh, kw] x[n, 8 (co // 8) + k, s oh + kh - 1, s ow + kw - 1]
    dgrad: dx = dL/dx = conv_transpose(dy, w)           (N, C, H, W)
    wgrad: dw = dL/dw = sum_{n, oh, ow} dy[n, co, oh, ow] x[n, 8 (co // 8) + k, s oh + kh - 1, s ow + kw - 1]
    backward (stride 1): (dx, dw), both from one dy

Computed in fp32 (fp64 for fp64 input); activations are returned in the input's dtype in NHWC memory,
the weight gradient in ``out_dtype``. An fp32 weight with 16-bit activations (autocast's master
weights) is first rounded to the activations' dtype, as autocast's cast would.
"""

import torch
import torch.nn.functional as F

from .._launch import GROUP_WIDTH


def _dt(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def gconv3x3_reference(x: torch.Tensor, w: torch.Tensor, stride: int) -> torch.Tensor:
    dt = _dt(x)
    y = F.conv2d(x.to(dt), w.to(x.dtype).to(dt), stride=stride, padding=1, groups=x.shape[1] // GROUP_WIDTH)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last)


def gconv3x3_dgrad_reference(dy: torch.Tensor, w: torch.Tensor, h: int, w_in: int, stride: int
                             ) -> torch.Tensor:
    n, c = dy.shape[:2]
    dt = _dt(dy)
    dx = torch.nn.grad.conv2d_input((n, c, h, w_in), w.to(dy.dtype).to(dt), dy.to(dt), stride=stride,
                                    padding=1, groups=c // GROUP_WIDTH)
    return dx.to(dy.dtype).contiguous(memory_format=torch.channels_last)


def gconv3x3_wgrad_reference(dy: torch.Tensor, x: torch.Tensor, stride: int, out_dtype: torch.dtype
                             ) -> torch.Tensor:
    c = x.shape[1]
    dt = torch.promote_types(_dt(x), _dt(dy))
    dw = torch.nn.grad.conv2d_weight(x.to(dt), (c, GROUP_WIDTH, 3, 3), dy.to(dt), stride=stride, padding=1,
                                     groups=c // GROUP_WIDTH)
    return dw.to(out_dtype)


def gconv3x3_backward_reference(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of a stride-1 conv: (dgrad, wgrad in w's dtype)."""
    return (gconv3x3_dgrad_reference(dy, w, x.shape[2], x.shape[3], 1),
            gconv3x3_wgrad_reference(dy, x, 1, w.dtype))
