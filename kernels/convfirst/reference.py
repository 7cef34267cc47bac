"""ConvFirst block (paper Fig. 6, SPEC 1) on folded weights: the specification of the fused kernel.

    x:      (N, C, H, W)                   any memory format
    w_conv: (C, 8, 3, 3),  b_conv: (C,)    grouped 3x3 conv, group width 8, padding 1
    w1:     (R, C1),       b1: (R,)        1x1 expand, C1 = C (stride 1) or 2C (stride 2)
    w2:     (K, R),        b2: (K,)        1x1 project

    stride 1 (K == C):  y = gconv(x);  out = x + W2 ReLU(W1 y + b1) + b2
    stride 2:           y = gconv(x) at full resolution;  u = BlurPool(cat[x, y]);
                        out = W2 ReLU(W1 u + b1) + b2                       (no residual)

Output: (N, K, H', W') in NHWC memory, H' = H (stride 1) or ceil(H/2). Computed in fp32 (fp64 for fp64
input) and returned in x's dtype.
"""

import torch
import torch.nn.functional as F

from .._blurpool import blurpool_reference
from .._launch import GROUP_WIDTH


def convfirst_reference(
    x: torch.Tensor,
    w_conv: torch.Tensor,
    b_conv: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    stride: int,
) -> torch.Tensor:
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    y = F.conv2d(xf, w_conv.to(dt), b_conv.to(dt), padding=1, groups=x.shape[1] // GROUP_WIDTH)
    u = y if stride == 1 else blurpool_reference(torch.cat([xf, y], dim=1))
    h = F.relu(F.conv2d(u, w1.to(dt)[:, :, None, None], b1.to(dt)))
    out = F.conv2d(h, w2.to(dt)[:, :, None, None], b2.to(dt))
    if stride == 1:
        out = out + xf
    return out.to(x.dtype).contiguous(memory_format=torch.channels_last)
