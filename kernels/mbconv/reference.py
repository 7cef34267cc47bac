"""MBConv block with Squeeze-Excite (paper Fig. 9, SPEC 1) on folded weights: the kernel's specification.

    x:       (N, C, H, W)                 any memory format
    w_exp:   (R, C),       b_exp: (R,)    1x1 expand, R = 4C
    w_conv:  (R, 8, 3, 3), b_conv: (R,)   grouped 3x3 conv, group width 8, padding 1
    w_se1:   (S, R),       b_se1: (S,)    SE reduce, S = C/4 (block input channels)
    w_se2:   (R, S),       b_se2: (R,)    SE expand
    w_proj:  (K, R),       b_proj: (K,)   1x1 project

    h = SiLU(W_exp x + b_exp);  g = SiLU(gconv(h));  if stride 2: g = BlurPool(g)
    s = g * sigmoid(W_se2 ReLU(W_se1 mean_hw(g) + b_se1) + b_se2)
    out = W_proj s + b_proj  (+ x when stride 1, K == C)

Output: (N, K, H', W') in NHWC memory, H' = H (stride 1) or ceil(H/2). Computed in fp32 (fp64 for fp64
input) and returned in x's dtype.
"""

import torch
import torch.nn.functional as F

from .._blurpool import blurpool_reference
from .._launch import GROUP_WIDTH


def _conv1x1(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w.to(x.dtype)[:, :, None, None], b.to(x.dtype))


def mbconv_reference(
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
    # the layers in fp32 (fp64 for fp64 input): the same ops in the same order as mbconv_layerwise
    dt = torch.promote_types(x.dtype, torch.float32)
    out = mbconv_layerwise(x.to(dt), w_exp, b_exp, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj,
                           stride)
    return out.to(x.dtype).contiguous(memory_format=torch.channels_last)


def mbconv_layerwise(
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
    """The same block layer by layer in x's dtype, as the BatchNorm-folded training form computes it
    (``convfirstnet.folding.fold_batchnorm``: convolutions with the folded bias, timm's SEModule and
    BlurPool2d): what torch.compile turns into its own kernels where ``FusedMBConv`` compiles the layers
    instead of the fused op (convfirstnet/blocks.py). mbconv_reference runs it in fp32; 16-bit data here
    rounds each layer's output to its dtype, as the layer-wise model does."""
    h = F.silu(_conv1x1(x, w_exp, b_exp))
    groups = h.shape[1] // GROUP_WIDTH
    g = F.silu(F.conv2d(h, w_conv.to(x.dtype), b_conv.to(x.dtype), padding=1, groups=groups))
    if stride == 2:
        g = blurpool_reference(g)
    squeeze = g.mean(dim=(2, 3), keepdim=True)
    gate = torch.sigmoid(_conv1x1(F.relu(_conv1x1(squeeze, w_se1, b_se1)), w_se2, b_se2))
    out = _conv1x1(g * gate, w_proj, b_proj)
    if stride == 1:
        out = out + x
    return out.contiguous(memory_format=torch.channels_last)
