"""ConvFirst stride-1 training block (SPEC 1, the training form with BatchNorm): the specification of
the fused training kernels, forward and backward, in plain PyTorch.

    x: (N, C, H, W); w_conv (C, 8, 3, 3); w1 (R, C); w2 (C, R); per-channel gamma_i, beta_i (i = 1, 2, 3)
    a = gconv3x3(x)                          (C)      stored for the backward (narrow)
    y = BN1(a)                               (C)
    z = W1 y,  h = ReLU(BN2(z))              (R)      never stored: recomputed in the backward
    p = W2 h                                 (C)      stored for the backward (narrow)
    out = x + d_n BN3(p)                     (C)      d_n: drop-path scale of image n (0 or 1/keep)

BatchNorm in training mode normalises with the batch mean and biased variance over N x H x W; in eval
mode with the running statistics. Rounding follows a layer-wise network in the activation dtype: a, y,
h and p are rounded to it (they are what the layers would store), the output once, and in the backward
every map a layer would hand to the next (dp, dh, dz, dy, da; dx once); sums and products run in fp32
(fp64 for fp64 input). The backward is written out (kernels/_batchnorm.py gives the
BatchNorm terms), as the Triton kernels compute it:

    dq = d_n dout;         dp = BN3'(dq)            (dgamma3 = sum dq p_hat, dbeta3 = sum dq)
    dW2 = dp^T h;          dh = dp W2
    dzn = dh [zn > 0];     dz = BN2'(dzn)           (dgamma2 = sum dzn z_hat, dbeta2 = sum dzn)
    dW1 = dz^T y;          dy = dz W1
    da = BN1'(dy)                                   (dgamma1 = sum dy a_hat, dbeta1 = sum dy)
    dx = dout + dgrad(da), dw_conv = wgrad(da, x)
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from .._batchnorm import affine, backward_terms
from .._blurpool import blur_filter, blurpool_reference
from ..gconv.reference import gconv3x3_dgrad_reference, gconv3x3_reference, gconv3x3_wgrad_reference


def _rows(t: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    """(N, C, H, W) -> (N H W, C) in ct."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1]).to(ct)


def _image(rows: torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, _, h, w = like.shape
    out = rows.reshape(n, h, w, -1).permute(0, 3, 1, 2).to(dtype)
    return out.contiguous(memory_format=torch.channels_last)


def _stats(v: torch.Tensor):
    mean = v.mean(0)
    return mean, (v - mean).square().mean(0)


def convfirst_s1_train_reference(x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3,
                                 running_mean1, running_var1, running_mean2, running_var2, running_mean3,
                                 running_var3, drop_scale, training: bool, eps: float):
    """Forward: (out, a, p, mean1, var1, mean2, var2, mean3, var3, batch_mean1, batch_cov1).

    mean_i, var_i: the statistics BN_i normalised with (batch, biased, in training; the running ones in
    eval), fp32 (fp64 for fp64 input); batch_mean1 (C,) and batch_cov1 (C, C): the batch mean and biased
    covariance of a in training, which the backward needs for dW1 (zeros in eval)."""
    dt = x.dtype
    ct = torch.promote_types(dt, torch.float32)
    a = gconv3x3_reference(x, w_conv, 1)
    A = _rows(a, ct)
    bmean1 = A.mean(0)
    bcov1 = (A - bmean1).T @ (A - bmean1) / A.shape[0]
    if not training:  # not needed by the eval-mode backward: zeros, as the kernels return
        bmean1, bcov1 = torch.zeros_like(bmean1), torch.zeros_like(bcov1)
    m1, v1 = (bmean1, bcov1.diagonal()) if training else (running_mean1.to(ct), running_var1.to(ct))
    _, k1, t1 = affine(gamma1.to(ct), beta1.to(ct), m1, v1, eps)
    y = (A * k1 + t1).to(dt).to(ct)
    Z = y @ w1.to(dt).to(ct).T
    m2, v2 = _stats(Z) if training else (running_mean2.to(ct), running_var2.to(ct))
    _, k2, t2 = affine(gamma2.to(ct), beta2.to(ct), m2, v2, eps)
    H = torch.relu(Z * k2 + t2).to(dt).to(ct)
    P = (H @ w2.to(dt).to(ct).T).to(dt).to(ct)
    m3, v3 = _stats(P) if training else (running_mean3.to(ct), running_var3.to(ct))
    _, k3, t3 = affine(gamma3.to(ct), beta3.to(ct), m3, v3, eps)
    d = drop_scale.to(ct).repeat_interleave(x.shape[2] * x.shape[3])[:, None]
    out = _rows(x, ct) + d * (P * k3 + t3)
    stats = [s.to(ct).clone() for s in (m1, v1, m2, v2, m3, v3, bmean1, bcov1)]
    return (_image(out, x, dt), a, _image(P, x, dt), *stats)


def convfirst_s1_train_backward_reference(dout, x, a, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2,
                                          gamma3, beta3, mean1, var1, mean2, var2, mean3, var3, batch_mean1,
                                          batch_cov1, drop_scale, training: bool, eps: float):
    """Backward: (dx, dw_conv, dw1, dw2, dgamma1, dbeta1, dgamma2, dbeta2, dgamma3, dbeta3). dx in
    x's dtype, the weight gradients in the weights' dtypes. batch_mean1 / batch_cov1 are not needed here
    (the kernels use them for dW1); they are taken so that both implementations have one signature."""
    dt = x.dtype
    ct = torch.promote_types(dt, torch.float32)
    rows = x.shape[0] * x.shape[2] * x.shape[3]
    A, P = _rows(a, ct), _rows(p, ct)
    r1, k1, t1 = affine(gamma1.to(ct), beta1.to(ct), mean1.to(ct), var1.to(ct), eps)
    r2, k2, t2 = affine(gamma2.to(ct), beta2.to(ct), mean2.to(ct), var2.to(ct), eps)
    r3, k3, _ = affine(gamma3.to(ct), beta3.to(ct), mean3.to(ct), var3.to(ct), eps)
    W1, W2 = w1.to(dt).to(ct), w2.to(dt).to(ct)
    # BN3 and drop-path
    d = drop_scale.to(ct).repeat_interleave(x.shape[2] * x.shape[3])[:, None]
    dq = _rows(dout, ct) * d
    # the FFN, recomputed from a
    y = (A * k1 + t1).to(dt).to(ct)
    dz, dW1, dW2, dgamma2, dbeta2, dgamma3, dbeta3 = _ffn_backward(
        dq, P, y, W1, W2, (k2, t2, r2, mean2), (k3, r3, mean3), rows, training, dt, ct)
    dy = (dz @ W1).to(dt).to(ct)
    dx, dw_conv, dgamma1, dbeta1 = _bn1_conv_backward(dy, A, x, w_conv, (k1, r1, mean1), rows, training,
                                                      dout.to(ct), dt, ct)
    return _grads(dx, dw_conv, dW1, dW2, w1, w2, (dgamma1, dbeta1, dgamma2, dbeta2, dgamma3, dbeta3),
                  (gamma1, beta1, gamma2, beta2, gamma3, beta3))


def _ffn_backward(dq, P, inp, W1, W2, bn2, bn3, rows, training, dt, ct):
    """BN3's and the FFN's backward (h = ReLU(BN2(W1 inp)) recomputed), from dq = dL/dBN3(p) and the
    stored p: (dz, dW1, dW2, dgamma2, dbeta2, dgamma3, dbeta3); dz = dL/dz in the kernels' rounding."""
    (k2, t2, r2, mean2), (k3, r3, mean3) = bn2, bn3
    p_hat = (P - mean3.to(ct)) * r3
    dgamma3, dbeta3 = (dq * p_hat).sum(0), dq.sum(0)
    u3, w3 = backward_terms(dgamma3, dbeta3, k3, r3, rows, training)
    dp = (k3 * dq + u3 + w3 * (P - mean3.to(ct))).to(dt).to(ct)
    Z = inp @ W1.T
    zn = Z * k2 + t2
    H = torch.relu(zn).to(dt).to(ct)
    dW2 = dp.T @ H
    dzn = (dp @ W2).to(dt).to(ct) * (zn > 0)
    z_hat = (Z - mean2.to(ct)) * r2
    dgamma2, dbeta2 = (dzn * z_hat).sum(0), dzn.sum(0)
    u2, wz = backward_terms(dgamma2, dbeta2, k2, r2, rows, training)
    dz = (k2 * dzn + u2 + wz * (Z - mean2.to(ct))).to(dt).to(ct)
    return dz, dz.T @ inp, dW2, dgamma2, dbeta2, dgamma3, dbeta3


def _bn1_conv_backward(dy, A, x, w_conv, bn1, rows, training, skip, dt, ct):
    """BN1's and the grouped conv's backward from dy = dL/dBN1(a): (dx, dw_conv, dgamma1, dbeta1);
    ``skip``: the gradient that reaches x directly (the residual, or the concat's x part)."""
    k1, r1, mean1 = bn1
    a_hat = (A - mean1.to(ct)) * r1
    dgamma1, dbeta1 = (dy * a_hat).sum(0), dy.sum(0)
    u1, wa = backward_terms(dgamma1, dbeta1, k1, r1, rows, training)
    da = _image(k1 * dy + u1 + wa * (A - mean1.to(ct)), x, dt)
    dx = (skip + gconv3x3_dgrad_reference(da, w_conv, x.shape[2], x.shape[3], 1).to(ct)).to(dt)
    return dx, gconv3x3_wgrad_reference(da, x, 1, w_conv.dtype), dgamma1, dbeta1


def _grads(dx, dw_conv, dW1, dW2, w1, w2, vec, params):
    """The backward ops' result: dx channels-last, every gradient in its parameter's dtype."""
    return (dx.contiguous(memory_format=torch.channels_last), dw_conv, dW1.to(w1.dtype), dW2.to(w2.dtype),
            *[v.to(like.dtype) for v, like in zip(vec, params)])


# ------------------------------------------------------------------------------------------------
# Stride 2, C -> K (no residual, no drop-path):
#     a = gconv3x3(x) (full resolution, stored); y = BN1(a); u = BlurPool(cat[x, y]) (2C, stored)
#     z = W1 u, h = ReLU(BN2(z)) (R, recomputed);  p = W2 h (K, stored);  out = BN3(p)
# ------------------------------------------------------------------------------------------------


def blurpool_transpose(du: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The adjoint of ``blurpool_reference`` for an h x w input: the stride-2 transposed blur onto the
    padded map, then the reflected border folded back (padded row 0 is row 1, row h + 1 is row h - 2;
    columns alike)."""
    c, ho, wo = du.shape[1], du.shape[2], du.shape[3]
    g = F.conv_transpose2d(du, blur_filter(c, du.dtype, du.device), stride=2, groups=c,
                           output_padding=(h + 1 - 2 * ho, w + 1 - 2 * wo))
    g[:, :, 2] += g[:, :, 0]
    g[:, :, h - 1] += g[:, :, h + 1]
    g[:, :, :, 2] += g[:, :, :, 0]
    g[:, :, :, w - 1] += g[:, :, :, w + 1]
    return g[:, :, 1 : h + 1, 1 : w + 1]


def convfirst_s2_train_reference(x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3,
                                 running_mean1, running_var1, running_mean2, running_var2, running_mean3,
                                 running_var3, training: bool, eps: float):
    """Forward: (out, a, u, p, mean1, var1, mean2, var2, mean3, var3, batch_mean_u, batch_cov_u); the
    statistics as in the stride-1 block, batch_mean_u / batch_cov_u those of u (training; zeros in eval)."""
    dt = x.dtype
    ct = torch.promote_types(dt, torch.float32)
    a = gconv3x3_reference(x, w_conv, 1)
    A = _rows(a, ct)
    m1, v1 = _stats(A) if training else (running_mean1.to(ct), running_var1.to(ct))
    _, k1, t1 = affine(gamma1.to(ct), beta1.to(ct), m1, v1, eps)
    y = _image(A * k1 + t1, x, dt)
    u = blurpool_reference(torch.cat([x, y], dim=1).to(ct)).to(dt)
    u = u.contiguous(memory_format=torch.channels_last)
    U = _rows(u, ct)
    mean_u = U.mean(0)
    cov_u = (U - mean_u).T @ (U - mean_u) / U.shape[0]
    if not training:
        mean_u, cov_u = torch.zeros_like(mean_u), torch.zeros_like(cov_u)
    Z = U @ w1.to(dt).to(ct).T
    m2, v2 = _stats(Z) if training else (running_mean2.to(ct), running_var2.to(ct))
    _, k2, t2 = affine(gamma2.to(ct), beta2.to(ct), m2, v2, eps)
    H = torch.relu(Z * k2 + t2).to(dt).to(ct)
    P = (H @ w2.to(dt).to(ct).T).to(dt).to(ct)
    m3, v3 = _stats(P) if training else (running_mean3.to(ct), running_var3.to(ct))
    _, k3, t3 = affine(gamma3.to(ct), beta3.to(ct), m3, v3, eps)
    stats = [s.to(ct).clone() for s in (m1, v1, m2, v2, m3, v3, mean_u, cov_u)]
    return (_image(P * k3 + t3, u, dt), a, u, _image(P, u, dt), *stats)


def convfirst_s2_train_backward_reference(dout, x, a, u, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2,
                                          gamma3, beta3, mean1, var1, mean2, var2, mean3, var3, batch_mean_u,
                                          batch_cov_u, training: bool, eps: float):
    """Backward: (dx, dw_conv, dw1, dw2, dgamma1, dbeta1, dgamma2, dbeta2, dgamma3, dbeta3)."""
    dt = x.dtype
    ct = torch.promote_types(dt, torch.float32)
    n, c, h, w = x.shape
    rows, rows_o = n * h * w, u.shape[0] * u.shape[2] * u.shape[3]
    A, U, P = _rows(a, ct), _rows(u, ct), _rows(p, ct)
    r1, k1, _ = affine(gamma1.to(ct), beta1.to(ct), mean1.to(ct), var1.to(ct), eps)
    r2, k2, t2 = affine(gamma2.to(ct), beta2.to(ct), mean2.to(ct), var2.to(ct), eps)
    r3, k3, _ = affine(gamma3.to(ct), beta3.to(ct), mean3.to(ct), var3.to(ct), eps)
    W1, W2 = w1.to(dt).to(ct), w2.to(dt).to(ct)
    dz, dW1, dW2, dgamma2, dbeta2, dgamma3, dbeta3 = _ffn_backward(
        _rows(dout, ct), P, U, W1, W2, (k2, t2, r2, mean2), (k3, r3, mean3), rows_o, training, dt, ct)
    du = _image(dz @ W1, u, dt).to(ct)
    dcat = blurpool_transpose(du, h, w).to(dt).to(ct)
    dxd, dy = dcat[:, :c], _rows(dcat[:, c:], ct)
    dx, dw_conv, dgamma1, dbeta1 = _bn1_conv_backward(dy, A, x, w_conv, (k1, r1, mean1), rows, training, dxd,
                                                      dt, ct)
    return _grads(dx, dw_conv, dW1, dW2, w1, w2, (dgamma1, dbeta1, dgamma2, dbeta2, dgamma3, dbeta3),
                  (gamma1, beta1, gamma2, beta2, gamma3, beta3))
