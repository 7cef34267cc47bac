"""Per-channel BatchNorm arithmetic of the fused training blocks (small host-side tensors, fp32).

The kernels reduce a batch to per-share partial statistics; everything here works on those partials
and on per-channel vectors, never on a whole activation. Notation (training mode, M = N x H x W
pixels per channel): a BatchNorm normalises v with the batch mean m and the biased variance s^2,

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
moments do not cancel when |mean| >> std, which sums of squares would. All sums here run over fixed
shapes in a fixed order (torch reductions), so the results do not depend on scheduling.
"""

from __future__ import annotations

import torch


def merge_moments(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chan's merge of per-share statistics: count (S,), mean (S, C), m2 (S, C) or (S, C, C) centred
    second moments -> (mean (C,), biased variance (C,) or covariance (C, C)) over all rows."""
    n = count.sum()
    w = (count / n)[:, None]
    total_mean = (w * mean).sum(0)
    d = mean - total_mean
    if m2.dim() == 2:
        spread = (count[:, None] * d * d).sum(0)
    else:
        spread = (d * count[:, None]).T @ d
    return total_mean, (m2.sum(0) + spread) / n


def share_counts(rows: int, rows_per_share: int, shares: int, device) -> torch.Tensor:
    """Rows of each share (the last one may be short), as fp32, without a device sync."""
    count = torch.full((shares,), float(rows_per_share), dtype=torch.float32, device=device)
    count[-1] = rows - rows_per_share * (shares - 1)
    return count


def affine(gamma: torch.Tensor, beta: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float):
    """(r, k, t): 1 / sqrt(var + eps), gamma r, beta - mean k."""
    r = torch.rsqrt(var + eps)
    k = gamma * r
    return r, k, beta - mean * k


def linear_moments(mean_in: torch.Tensor, cov_in: torch.Tensor, w: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance per output channel of z = W v from the input's mean and covariance:
    m_z = W m_v, s_z^2 = diag(W Cov(v) W^T). No pass over z."""
    return w @ mean_in, ((w @ cov_in) * w).sum(1)


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
