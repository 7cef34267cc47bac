"""The forward of ``mbconv_recompute_train`` through the fused MBConv kernels (kernels/mbconv), with the
three BatchNorms normalising by the batch's statistics, folded into the kernels' weights per step:

    BN_e (after the expand, R channels): mean and variance of z = W_exp x follow from the mean and the
         C x C covariance of the narrow x (torch: x centred in its dtype, one C x C product with fp32
         accumulation): mean_z = W mean_x, var_z = diag(W cov W^T). No pass over a wide tensor.
    BN_d (after the grouped conv, before SiLU and, for stride 2, the BlurPool): one moments launch of the
         hidden kernel (kernels/mbconv/moments.py: per-image sums of u - shift and its square, merged in
         a fixed order), shift = BN_d's running mean.
    BN_p (after the projection, K channels): the launch pair with BN_e and BN_d folded writes the
         projection without bias and residual; torch's training-mode BatchNorm on that narrow output
         (statistics, normalise, running update), then drop-path and the residual, as the layer-wise
         forward does them.

Running statistics: BN_e's and BN_d's updated here by nn.BatchNorm2d's rule (running = (1 - f) running +
f batch, the unbiased variance), BN_p's by ``torch.native_batch_norm`` (the same rule): the same update as
the layer-wise forward, in place on the op's copies. The backward is unchanged (mbconv_recompute.py
recomputes the layer-wise forward). Numerics: the fused form rounds where the kernels round (h, g, the
gate, the projection, the folded weights and biases in x's dtype) instead of after each layer, so it
matches the layer-wise forward within the rounding of x's dtype (tests/kernels/test_mbconv_fused_forward.py).

Selected where the MBConv kernels run (``kernels._launch.use_triton``: CUDA, or the interpreter and the
cost recording), for 16-bit data on CUDA (fp16 and fp32 in the interpreter), within the kernels' limits
(``launcher.check_supported``), and for more than one value per channel; otherwise the layer-wise forward.
"""

from __future__ import annotations

import contextlib

import torch

from .kernels._launch import HAS_TRITON, use_triton

T = torch.Tensor
CUDA_DTYPES = (torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float16, torch.float32)


def selected(x: T, w_exp: T, w_proj: T, stride: int) -> bool:
    """Whether the op's forward takes the fused kernels for ``x`` (module docstring), decided before any
    launch."""
    if not HAS_TRITON or x.dim() != 4 or not use_triton(x):
        return False
    from .kernels.mbconv.launcher import check_supported

    n, c, h, w = x.shape
    r, k = w_exp.shape[0], w_proj.shape[0]
    if x.dtype not in (CUDA_DTYPES if x.device.type == "cuda" else INTERPRETER_DTYPES):
        return False
    if n * h * w < 2 or (stride == 1 and k != c) or stride not in (1, 2):
        return False
    try:
        check_supported(x, c, r, k)
    except (ValueError, NotImplementedError):
        return False
    return True


def expand_statistics(x: T, w: T) -> tuple[T, T]:
    """(mean, biased variance) per output channel of the 1x1 conv ``w`` (R, C) applied to ``x``, fp32,
    from x's mean and covariance: x centred in its own dtype at its fp32 mean rounded to that dtype,
    then X_c^T X_c accumulated in fp32, less the outer product of the rounding of the mean (the centred
    columns' own mean), so that no cancellation of size mean^2 / variance enters the covariance."""
    n, c, h, wd = x.shape
    pixels = n * h * wd
    xm = x.permute(0, 2, 3, 1).reshape(pixels, c)  # a view for channels-last x
    mean = xm.mean(0, dtype=torch.float32)
    centre = mean.to(x.dtype)
    xc = xm - centre
    if x.device.type != "cpu" and x.dtype != torch.float32:
        gram = torch.mm(xc.t(), xc, out_dtype=torch.float32)  # tensor cores, fp32 accumulation and result
    else:
        gram = xc.t().float() @ xc.float()
    d = mean - centre.float()
    cov = gram / pixels - torch.outer(d, d)
    return w @ mean, ((w @ cov) * w).sum(1).clamp_min(0.0)


def _update(running_mean: T, running_var: T, mean: T, var: T, count: int, f: float) -> None:
    """nn.BatchNorm2d's running update (unbiased variance over ``count`` values), in place."""
    running_mean.mul_(1.0 - f).add_(mean.to(running_mean.dtype), alpha=f)
    running_var.mul_(1.0 - f).add_((var * (count / (count - 1))).to(running_var.dtype), alpha=f)


def _fold(gamma: T, beta: T, mean: T, var: T, eps: float) -> tuple[T, T]:
    """(scale, shift) of a training-mode BatchNorm with these batch statistics, fp32."""
    scale = gamma.float() * torch.rsqrt(var + eps)
    return scale, beta.float() - mean * scale


def forward(x: T, w_exp: T, gamma_e: T, beta_e: T, w_dw: T, gamma_d: T, beta_d: T, w_se1: T, b_se1: T,
            w_se2: T, b_se2: T, w_proj: T, gamma_p: T, beta_p: T, running: tuple[T, ...], drop_scale: T,
            stride: int, factors: tuple[float, float, float], eps: float) -> T:
    """The block's training forward output; ``running`` (the six running statistics, the op's copies)
    updated in place. Weights in the module's shapes; ``factors``: each BatchNorm's update factor.
    Autocast, which stays on inside a custom op's body, is turned off: every dtype here is chosen."""
    dev = x.device.type
    with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else contextlib.nullcontext():
        return _forward(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj,
                        gamma_p, beta_p, running, drop_scale, stride, factors, eps)


def _forward(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p,
             beta_p, running, drop_scale, stride, factors, eps):
    from .kernels.mbconv.moments import mbconv_unnormalised, merge_moments, moment_partials

    dt = x.dtype
    n, c, h, w = x.shape
    r, k, s = w_exp.shape[0], w_proj.shape[0], w_se1.shape[0]
    rm_e, rv_e, rm_d, rv_d, rm_p, rv_p = running
    we = w_exp.reshape(r, c).to(dt).float()  # the weights as the layer-wise form rounds them
    w_se1, w_se2, w_proj = w_se1.reshape(s, r).to(dt), w_se2.reshape(r, s).to(dt), w_proj.reshape(k, r).to(dt)
    b_se1, b_se2 = b_se1.to(dt), b_se2.to(dt)

    mean_e, var_e = expand_statistics(x, we)
    scale_e, shift_e = _fold(gamma_e, beta_e, mean_e, var_e, eps)
    w_exp_f, b_exp_f = (we * scale_e[:, None]).to(dt), shift_e.to(dt)

    w_dw = w_dw.to(dt)
    shift = rm_d.float().clone()  # before its update
    parts = moment_partials(x, w_exp_f, b_exp_f, w_dw, shift, w_se1, k, stride)
    mean_d, var_d = merge_moments(parts, h * w, shift)
    scale_d, shift_d = _fold(gamma_d, beta_d, mean_d, var_d, eps)
    w_dw_f, b_dw_f = (w_dw.float() * scale_d[:, None, None, None]).to(dt), shift_d.to(dt)

    _update(rm_e, rv_e, mean_e, var_e, n * h * w, factors[0])
    _update(rm_d, rv_d, mean_d, var_d, n * h * w, factors[1])

    o = mbconv_unnormalised(x, w_exp_f, b_exp_f, w_dw_f, b_dw_f, w_se1, b_se1, w_se2, b_se2, w_proj,
                            torch.zeros(k, device=x.device, dtype=dt), stride)
    ob = torch.native_batch_norm(o, gamma_p, beta_p, rm_p, rv_p, True, factors[2], eps)[0]
    return x + ob * drop_scale.to(dt)[:, None, None, None] if stride == 1 else ob
