"""BlurPool (Zhang 2019, "Triangle-3") as a function, for the references of the stride-2 blocks.

Same semantics as ``timm.layers.BlurPool2d(channels, filt_size=3, stride=2)`` (tests check it):
depth-wise filter [1, 2, 1] (x) [1, 2, 1] / 16, stride 2, reflect padding of one pixel, so an
H x W map becomes ceil(H/2) x ceil(W/2).
"""

import torch
import torch.nn.functional as F


def blur_filter(channels: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # [1, 2, 1] made on the device: torch.tensor((1.0, 2.0, 1.0), device=...) copies from host memory,
    # which a CUDA graph capture refuses (the fp32 MBConv recompute's stride-2 blocks build it every step)
    f = 2.0 - (torch.arange(3, dtype=dtype, device=device) - 1.0).abs()
    f2 = (f[:, None] * f[None, :]) / 16.0
    return f2.expand(channels, 1, 3, 3)


def blurpool_reference(x: torch.Tensor) -> torch.Tensor:
    x = F.pad(x, (1, 1, 1, 1), mode="reflect")
    return F.conv2d(x, blur_filter(x.shape[1], x.dtype, x.device), stride=2, groups=x.shape[1])
