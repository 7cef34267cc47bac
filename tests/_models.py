"""Shared test helpers: models with non-trivial BatchNorm statistics."""

import torch
import torch.nn as nn

import convfirstnet


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm non-trivial statistics and affine parameters, so folding is really tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) - 0.5)
    return model


def trained_like(name: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return randomize_bn(convfirstnet.create_model(name, **kwargs), seed).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
