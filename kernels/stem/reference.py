"""Stem (paper stage 0): dense 3x3 conv, stride 2, padding 1, 3 -> C0, BatchNorm folded, ReLU.

    x: (N, 3, H, W), NCHW or NHWC memory     w: (C0, 3, 3, 3)     b: (C0,)
    out = ReLU(conv2d(x, w, b, stride=2, padding=1))        (N, C0, ceil(H/2), ceil(W/2)), NHWC memory

Computed in fp32 (fp64 for fp64 input) and returned in x's dtype (the kernels accumulate in fp32 too).
"""

import torch
import torch.nn.functional as F


def stem_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dt = torch.promote_types(x.dtype, torch.float32)
    y = F.relu(F.conv2d(x.to(dt), w.to(dt), b.to(dt), stride=2, padding=1))
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last)
