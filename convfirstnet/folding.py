"""BatchNorm folding: ``W' = W * g / sqrt(v + eps)``, ``b' = beta + (b - m) * g / sqrt(v + eps)``.

Folded in fp64 and cast back to the conv weight's dtype, so an fp16/bf16 model folds as accurately as
an fp32 one.
"""

import torch
import torch.nn as nn


@torch.no_grad()
def fold_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of ``bn(conv(x))`` (eval-mode BN) as one conv."""
    dtype = conv.weight.dtype
    scale = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
    w = conv.weight.double() * scale.reshape(-1, 1, 1, 1)
    b = conv.bias.double() if conv.bias is not None else torch.zeros_like(bn.running_mean, dtype=torch.float64)
    b = bn.bias.double() + (b - bn.running_mean.double()) * scale
    return w.to(dtype), b.to(dtype)
