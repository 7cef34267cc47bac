"""Head (paper Table 3): 1x1 conv C -> 1280 (BatchNorm folded), SiLU, global average pool.

    x: (N, C, H, W)     w: (F, C)     b: (F,)          F = 1280
    out = mean_hw(SiLU(W x + b))                         (N, F)

The classifier (dropout, Linear) stays a plain module after this op. Computed in fp32 (fp64 for fp64
input) and returned in x's dtype.
"""

import torch
import torch.nn.functional as F


def head_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dt = torch.promote_types(x.dtype, torch.float32)
    y = F.silu(F.conv2d(x.to(dt), w.to(dt)[:, :, None, None], b.to(dt)))
    return y.mean(dim=(2, 3)).to(x.dtype)
