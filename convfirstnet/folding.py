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


def fold_batchnorm(model: nn.Module) -> nn.Module:
    """A copy of a training-form model with every conv + BatchNorm pair folded into the conv (BN ->
    Identity), everything else unchanged: plain PyTorch layers, no custom ops.

    This is the fair layer-by-layer baseline (what torch.compile/Inductor gets in the benchmarks):
    Inductor folds BN on its own only with ``torch._inductor.config.freezing``. Blocks list their pairs
    in ``conv_bn_pairs``.
    """
    import copy

    folded = copy.deepcopy(model).eval()
    for module in folded.modules():
        for conv_name, bn_name in getattr(module, "conv_bn_pairs", ()):
            conv, bn = getattr(module, conv_name), getattr(module, bn_name)
            if not isinstance(bn, nn.BatchNorm2d):
                continue
            w, b = fold_conv_bn(conv, bn)
            conv.weight = nn.Parameter(w, requires_grad=False)
            conv.bias = nn.Parameter(b, requires_grad=False)
            setattr(module, bn_name, nn.Identity())
    return folded
