"""The passes of the fused MBConv + SE training backward (stride 1), in PyTorch: the specification of the
Triton launches in gate_backward.py, se_backward.py, expand_backward.py and narrow.py (``bn_p_backward``),
and their twin in the tests. convfirstnet/mbconv_fused_backward.py chains them.

Every activation is a 2-D row-major view of an NHWC tensor: (P, channels), P = N H W pixels, image n in
rows n HW ... (n + 1) HW - 1. The training forward, with each BatchNorm's batch statistics (mean mu, rstd
rho = 1 / sqrt(var + eps)) saved by the forward:

    z = x W_exp^T            e_hat = (z - mu_e) rho_e       v_e = gamma_e e_hat + beta_e   h = SiLU(v_e)
    d = gconv3x3(h)          u_hat = (d - mu_d) rho_d       v_d = gamma_d u_hat + beta_d   g = SiLU(v_d)
    p = mean_hw(g)           gate = sigmoid(W_se2 ReLU(W_se1 p + b_se1) + b_se2)           (N, R)
    o = (g gate) W_proj^T    o_hat = (o - mu_p) rho_p       out = x + drop_n (gamma_p o_hat + beta_p)

and the backward, pass by pass (each BatchNorm's backward: dz = gamma rho (dy - mean(dy) - y_hat
mean(dy y_hat)), dgamma = sum dy y_hat, dbeta = sum dy; SiLU'(v) = s (1 + v (1 - s)), s = sigmoid(v)):

    bn_p_backward:   dob = drop_n dout;  do, dgamma_p, dbeta_p                     (narrow)
    dgate_pool:      dq = do W_proj;  dgate[n] = sum_hw dq g;  gsum[n] = sum_hw g  (per image, per channel)
                     and BN_d's backward sums per image (s' = SiLU'(v_d)): sum_hw dq s', sum_hw s',
                     sum_hw dq s' u_hat, sum_hw s' u_hat
    se_backward:     pool = gsum / HW, s = W_se1 pool + b_se1, gate; dt = dgate gate (1 - gate);  dW_se2,
                     db_se2;  ds = (dt W_se2) [s > 0];  dW_se1, db_se1;  dpix = ds W_se1 / HW   (N, R)
    bn_d_sums:       dy = (dq gate_n + dpix_n) s', gate and dpix constant over an image, so
                     sum dy = sum_n (gate_n sum_hw dq s' + dpix_n sum_hw s'), sum dy u_hat likewise
    bn_d_backward:   dd = gamma_d rho_d (dy - sum dy / P - u_hat sum(dy u_hat) / P);  dW_proj = do^T (g gate)
    (gconv3x3_dgrad, gconv3x3_wgrad: dh, dW_conv)
    expand_hidden:   h (for the conv's recompute and its wgrad)
    bn_e_weights:    dv = dh SiLU'(v_e);  sum dv, sum dv e_hat;  dW_exp = de^T x with
                     de = gamma_e rho_e (dv - sum dv / P - e_hat sum(dv e_hat) / P)
    bn_e_dx:         dx = de W_exp (+ dout, the residual)

Stride 2 (g = BlurPool(SiLU(v_d)), the conv and BN_d at the input's H x W, g and everything after it at
HO x WO = ceil(H / 2) x ceil(W / 2), no residual, no drop-path): the SE sums and dW_proj need g itself,
and BN_d's dy = Blur^T(dg) s' mixes neighbouring pixels, so the per-image parts above do not apply:

    blur_gate_input:  g = BlurPool(SiLU(v_d)) from d                                  (N HO WO, R)
    gate_pool:        dq = do W_proj;  dgate[n] = sum_hw dq g;  gsum[n] = sum_hw g    (per image)
    (se_backward as above, HW = HO WO)
    gate_grad:        dg = dq gate_n + dpix_n (rounded once);  dW_proj = do^T (g gate)
    blur_bn_d_sums:   dy = Blur^T(dg) s';  sum dy, sum dy u_hat                       (R,)
    blur_bn_d_backward: dd = gamma_d rho_d (dy - sum dy / P - u_hat sum(dy u_hat) / P), P = N H W

then the conv's dgrad and wgrad, BN_e's passes and dx = de W_exp as for stride 1, without the residual.

Computed in fp32 (fp64 for fp64 input); the tensors the kernels write in the input dtype (h, g, dg, dd,
de, do, dx) are returned in it.
"""

from __future__ import annotations

import torch

from .._blurpool import blurpool_reference

T = torch.Tensor


def _f(t: T) -> T:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def silu_grad(v: T) -> T:
    """d SiLU(v) / dv."""
    s = torch.sigmoid(v)
    return s * (1 + v * (1 - s))


def _images(t: T, n: int) -> T:
    return t.reshape(n, -1, t.shape[-1])


def bn_p_backward_reference(dout: T, o: T, mean_p: T, rstd_p: T, gamma_p: T, drop: T, n: int
                            ) -> tuple[T, T, T]:
    """(do in dout's dtype, dgamma_p, dbeta_p (fp32)); ``drop``: the per-image drop-path scale (N,)."""
    dob = _images(_f(dout), n) * _f(drop)[:, None, None]
    dob = dob.reshape(dout.shape)
    o_hat = (_f(o) - mean_p) * rstd_p
    m = dout.shape[0]
    dbeta, dgamma = dob.sum(0), (dob * o_hat).sum(0)
    do = _f(gamma_p) * rstd_p * (dob - dbeta / m - o_hat * dgamma / m)
    return do.to(dout.dtype), dgamma, dbeta


def _g(d: T, mean_d: T, rstd_d: T, gamma_d: T, beta_d: T) -> tuple[T, T, T]:
    u_hat = (_f(d) - mean_d) * rstd_d
    v = _f(gamma_d) * u_hat + _f(beta_d)
    return u_hat, v, torch.nn.functional.silu(v)


def dgate_pool_reference(d: T, mean_d: T, rstd_d: T, gamma_d: T, beta_d: T, do: T, w_proj: T, n: int
                         ) -> tuple[T, T, T]:
    """(dgate, gsum, parts), fp32: per image, sum over its pixels of dq g and of g, (N, R) each; ``parts``
    (4, N, R), per image the sums over its pixels of dq s', s', dq s' u_hat and s' u_hat (s' = SiLU'(v_d)),
    from which bn_d_sums forms BN_d's backward sums once the SE backward has given gate and dpix."""
    u_hat, v, g = _g(d, mean_d, rstd_d, gamma_d, beta_d)
    dq = _f(do) @ _f(w_proj)
    s1 = silu_grad(v)
    parts = torch.stack([_images(t, n).sum(1) for t in (dq * s1, s1, dq * s1 * u_hat, s1 * u_hat)])
    return _images(dq * g, n).sum(1), _images(g, n).sum(1), parts


def se_backward_reference(gsum: T, dgate: T, w_se1: T, b_se1: T, w_se2: T, b_se2: T, hw: int
                          ) -> tuple[T, T, T, T, T, T]:
    """(gate, dpix (N, R), dW_se1, db_se1 (S,), dW_se2, db_se2 (R,)), fp32 (fp64 for fp64 gsum), the weight
    gradients in the weights' shapes ((S, R) or (S, R, 1, 1); (R, S) or (R, S, 1, 1)); weights in any float
    dtype (computed in gsum's)."""
    pool = _f(gsum) / hw
    w1, b1, w2, b2 = (t.to(pool.dtype) for t in (w_se1, b_se1, w_se2, b_se2))
    w1, w2 = w1.reshape(w1.shape[0], -1), w2.reshape(w2.shape[0], -1)
    s = torch.addmm(b1, pool, w1.t())
    act = torch.relu(s)
    gate = torch.sigmoid(torch.addmm(b2, act, w2.t()))
    dt = _f(dgate) * gate * (1 - gate)
    ds = (dt @ w2) * (s > 0)
    dpix = (ds @ w1) / hw
    return (gate, dpix, (ds.t() @ pool).reshape(w_se1.shape), ds.sum(0), (dt.t() @ act).reshape(w_se2.shape),
            dt.sum(0))


def _dy(d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, gate, dpix, n):
    u_hat, v, g = _g(d, mean_d, rstd_d, gamma_d, beta_d)
    dq = _f(do) @ _f(w_proj)
    dg = _images(dq, n) * gate[:, None, :] + dpix[:, None, :]
    return u_hat, g, dg.reshape(dq.shape) * silu_grad(v)


def bn_d_sums_reference(parts: T, gate: T, dpix: T) -> tuple[T, T]:
    """(sum dy, sum dy u_hat), (R,) fp32, over all pixels, from dgate_pool's per-image ``parts`` (4, N, R):
    dy = (dq gate_n + dpix_n) s' with gate_n, dpix_n ((N, R) fp32) constant over image n."""
    return (gate * parts[0] + dpix * parts[1]).sum(0), (gate * parts[2] + dpix * parts[3]).sum(0)


def bn_d_backward_reference(d: T, mean_d: T, rstd_d: T, gamma_d: T, beta_d: T, do: T, w_proj: T, gate: T,
                            dpix: T, sum_dy: T, sum_dy_uhat: T, n: int) -> tuple[T, T]:
    """(dd (P, R) in d's dtype, dW_proj (K, R) fp32)."""
    u_hat, g, dy = _dy(d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, gate, dpix, n)
    m = d.shape[0]
    dd = _f(gamma_d) * rstd_d * (dy - sum_dy / m - u_hat * sum_dy_uhat / m)
    q = (_images(g, n) * gate[:, None, :]).reshape(g.shape)
    return dd.to(d.dtype), _f(do).t() @ q


def _v_e(x: T, w_exp: T, mean_e: T, rstd_e: T, gamma_e: T, beta_e: T) -> tuple[T, T]:
    e_hat = (_f(x) @ _f(w_exp).t() - mean_e) * rstd_e
    return e_hat, _f(gamma_e) * e_hat + _f(beta_e)


def expand_hidden_reference(x: T, w_exp: T, mean_e: T, rstd_e: T, gamma_e: T, beta_e: T) -> T:
    """h (P, R) in x's dtype."""
    return torch.nn.functional.silu(_v_e(x, w_exp, mean_e, rstd_e, gamma_e, beta_e)[1]).to(x.dtype)


def x_moments_reference(x: T, w_exp: T) -> tuple[T, T]:
    """(x's mean (C,), W_exp G (R, C)), G = the sum over x's rows of (x - mean)(x - mean)^T, in x's dtype,
    for x (P, C) rows: what the forward saves for BN_e's backward (``bn_e_weights``' mean_x, wg_x)."""
    mean = x.mean(0)
    xc = x - mean
    return mean, w_exp.to(x.dtype) @ (xc.t() @ xc)


def bn_e_weights_reference(x: T, w_exp: T, mean_e: T, rstd_e: T, gamma_e: T, beta_e: T, dh: T,
                           mean_x: T | None = None, wg_x: T | None = None) -> tuple[T, T, T, T]:
    """(dW_exp = de^T x (R, C), dgamma_e = sum dv e_hat, dbeta_e = sum dv (R,), uw (2, R)), fp32 (fp64 for
    fp64 input), with de = gamma_e rho_e (dv - sum dv / P - e_hat sum(dv e_hat) / P)
    = k dv + u + w (z - mu_e): k = gamma_e rho_e, u = -k sum dv / P, w = -k rho_e sum(dv e_hat) / P.
    x's mean and W_exp G (``mean_x``, ``wg_x``), from which the kernels form dW_exp, are not needed here:
    de^T x directly."""
    e_hat, v = _v_e(x, w_exp, mean_e, rstd_e, gamma_e, beta_e)
    dv = _f(dh) * silu_grad(v)
    m = x.shape[0]
    sum_dv, sum_dve = dv.sum(0), (dv * e_hat).sum(0)
    k = _f(gamma_e) * rstd_e
    de = k * (dv - sum_dv / m - e_hat * sum_dve / m)
    return de.t() @ _f(x), sum_dve, sum_dv, torch.stack([-k * sum_dv / m, -k * rstd_e * sum_dve / m])


def bn_e_dx_reference(x: T, w_exp: T, mean_e: T, rstd_e: T, gamma_e: T, beta_e: T, dh: T, uw: T,
                      residual: T | None) -> T:
    """dx = de W_exp (+ residual), (P, C) in x's dtype, de = k dv + u + w (z - mu_e) rounded to x's dtype
    (as a layer-wise backward rounds it)."""
    e_hat, v = _v_e(x, w_exp, mean_e, rstd_e, gamma_e, beta_e)
    dv = _f(dh) * silu_grad(v)
    de = _f(gamma_e) * rstd_e * dv + uw[0] + uw[1] * e_hat / rstd_e
    dx = _f(de.to(x.dtype)) @ _f(w_exp)
    if residual is not None:
        dx = dx + _f(residual)
    return dx.to(x.dtype)


# ---- stride 2 ----------------------------------------------------------------------------------


def blur_rows(t: T, n: int, h: int, w: int) -> T:
    """BlurPool (timm's BlurPool2d semantics, _blurpool.py) of (N H W, C) rows -> (N HO WO, C) rows."""
    x = t.reshape(n, h, w, t.shape[1]).permute(0, 3, 1, 2)
    return blurpool_reference(x).permute(0, 2, 3, 1).reshape(-1, t.shape[1])


def blur_transpose_rows(dg: T, n: int, h: int, w: int) -> T:
    """The adjoint of ``blur_rows`` (BlurPool is linear: its vjp), (N HO WO, C) -> (N H W, C)."""
    z = torch.zeros((n * h * w, dg.shape[1]), dtype=dg.dtype, device=dg.device, requires_grad=True)
    with torch.enable_grad():
        (dz,) = torch.autograd.grad(blur_rows(z, n, h, w), z, dg)
    return dz


def blur_gate_input_reference(d: T, mean_d: T, rstd_d: T, gamma_d: T, beta_d: T, n: int, h: int, w: int) -> T:
    """g = BlurPool(SiLU(v_d)) (N HO WO, R) in d's dtype, from d (N H W, R)."""
    return blur_rows(_g(d, mean_d, rstd_d, gamma_d, beta_d)[2], n, h, w).to(d.dtype)


def gate_pool_reference(g: T, do: T, w_proj: T, n: int) -> tuple[T, T]:
    """(dgate, gsum) (N, R) fp32: per image, the sums over its pixels of dq g and of g (dq = do W_proj)."""
    dq = _f(do) @ _f(w_proj)
    return _images(dq * _f(g), n).sum(1), _images(_f(g), n).sum(1)


def gate_grad_reference(g: T, do: T, w_proj: T, gate: T, dpix: T, n: int) -> tuple[T, T]:
    """(dg = dq gate_n + dpix_n (P, R) in g's dtype, dW_proj = do^T (g gate) (K, R) fp32)."""
    dq = _f(do) @ _f(w_proj)
    dg = (_images(dq, n) * gate[:, None, :] + dpix[:, None, :]).reshape(dq.shape)
    q = (_images(_f(g), n) * gate[:, None, :]).reshape(dq.shape)
    return dg.to(g.dtype), _f(do).t() @ q


def _blur_dy(dg, d, mean_d, rstd_d, gamma_d, beta_d, n, h, w):
    u_hat, v, _ = _g(d, mean_d, rstd_d, gamma_d, beta_d)
    return u_hat, blur_transpose_rows(_f(dg), n, h, w) * silu_grad(v)


def blur_bn_d_sums_reference(dg: T, d: T, mean_d: T, rstd_d: T, gamma_d: T, beta_d: T, n: int, h: int, w: int
                             ) -> tuple[T, T]:
    """(sum dy, sum dy u_hat) (R,) fp32 over the N H W pixels of d, dy = Blur^T(dg) SiLU'(v_d)."""
    u_hat, dy = _blur_dy(dg, d, mean_d, rstd_d, gamma_d, beta_d, n, h, w)
    return dy.sum(0), (dy * u_hat).sum(0)


def blur_bn_d_backward_reference(dg: T, d: T, mean_d: T, rstd_d: T, gamma_d: T, beta_d: T, sum_dy: T,
                                 sum_dy_uhat: T, n: int, h: int, w: int) -> T:
    """dd (N H W, R) in d's dtype: BN_d's backward of dy = Blur^T(dg) SiLU'(v_d)."""
    u_hat, dy = _blur_dy(dg, d, mean_d, rstd_d, gamma_d, beta_d, n, h, w)
    m = d.shape[0]
    return (_f(gamma_d) * rstd_d * (dy - sum_dy / m - u_hat * sum_dy_uhat / m)).to(d.dtype)
