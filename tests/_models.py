"""Shared test helpers: models with non-trivial BatchNorm statistics, and a compiled training step against
eager."""

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


def compiled_step_errors(net: nn.Module, x: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """One training step of ``net`` (the mean square of its output, fp16 autocast on CUDA) under
    torch.compile(fullgraph=True) against the same step of an eager copy: (loss, eager loss, per
    parameter ||grad - eager grad|| / ||eager grad||)."""
    import copy

    torch._dynamo.reset()
    ref = copy.deepcopy(net)
    step = torch.compile(lambda m, x: m(x).float().square().mean(), fullgraph=True)
    with torch.autocast("cuda", torch.float16):
        loss = step(net, x)
        loss_ref = ref(x).float().square().mean()
    loss.backward()
    loss_ref.backward()
    errors = {}
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        got, want = p.grad.double(), q.grad.double()
        errors[name] = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    return loss, loss_ref, errors
