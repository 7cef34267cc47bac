"""Per-channel BatchNorm arithmetic of the fused training blocks: the formulas, with the host-side forms
the references and the PyTorch fallback use (the Triton path runs them in
kernels/convfirst_train/finalize.py, on per-share partial statistics). Notation (training mode,
M = N x H x W pixels per channel): a BatchNorm normalises v with the batch mean m and the biased variance s^2,

    v_hat = (v - m) r,   r = 1 / sqrt(s^2 + eps),   out = gamma v_hat + beta = k v + t,
    k = gamma r,  t = beta - m k

and its backward (dout -> dv) is

    dgamma = sum dout v_hat,   dbeta = sum dout,
    dv = k (dout - (dbeta + v_hat dgamma) / M)  =  k dout + u + w (v - m),
    u = -k dbeta / M,   w = -k r dgamma / M.

In eval mode m and s^2 are the running statistics and the batch terms vanish (u = w = 0). The
running statistics are updated as ``nn.BatchNorm2d`` does: ``(1 - f) running + f batch`` with the
*unbiased* variance (s^2 M / (M - 1)), f = momentum, or 1 / num_batches_tracked when momentum is None.

Partial statistics are merged with Chan et al.'s pairwise formula (count n_i, mean m_i, centred second
moment S_i per share): m = sum n_i m_i / n, S = sum S_i + sum n_i (m_i - m)(m_i - m)^T. Centred
moments do not cancel when |mean| >> std, which sums of squares would. The finalize kernels merge in a
fixed order, so the results do not depend on scheduling.
"""

from __future__ import annotations

import torch


def affine(gamma: torch.Tensor, beta: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float):
    """(r, k, t): 1 / sqrt(var + eps), gamma r, beta - mean k."""
    r = torch.rsqrt(var + eps)
    k = gamma * r
    return r, k, beta - mean * k


def backward_terms(dgamma: torch.Tensor, dbeta: torch.Tensor, k: torch.Tensor, r: torch.Tensor, rows: int,
                   training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, w) of dv = k dout + u + w (v - m) (module docstring); zero in eval mode."""
    if not training:
        return torch.zeros_like(k), torch.zeros_like(k)
    return dbeta * (-1.0 / rows) * k, dgamma * (-1.0 / rows) * k * r


def update_running(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor,
                   var: torch.Tensor, rows: int, factor: float | torch.Tensor) -> None:
    """nn.BatchNorm2d's update, in place: the unbiased batch variance (var M / (M - 1)). ``factor``: the
    momentum, or a 0-d tensor (1 / num_batches_tracked when momentum is None)."""
    unbiased = var * (rows / max(rows - 1, 1))
    # running + f (batch - running) = (1 - f) running + f batch, one kernel each
    running_mean.lerp_(mean.to(running_mean.dtype), factor)
    running_var.lerp_(unbiased.to(running_var.dtype), factor)
