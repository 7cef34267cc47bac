"""The backward of ``mbconv_recompute_train``, pass by pass over the block's narrow
input (kernels/mbconv/backward_reference.py states each pass): no wide activation is kept from the
forward; the forward saves x, its projection output o (narrow), the three BatchNorms' batch mean and rstd
and x's mean and W_exp G (G x's centred Gram matrix). The wide tensors of the backward (h, d, dd, dh)
live from one launch to the next.

    do                 BN_p's backward (narrow)
    h, d               h from x (expand, BN_e, SiLU), d = gconv3x3(h)
    dgate, gsum, parts one pass over d: per image, sum dq g, sum g and BN_d's backward sums' parts (dq =
                       do W_proj recomputed)
    SE                 gate from gsum / HW, its backward on (N, R) vectors (se_backward: three small launches)
    BN_d sums          from the parts, gate and dpix ((N, R) -> (R,))
    dd, dW_proj        one pass over d, dd written
    dh, dW_conv        the group-width-8 conv's dgrad and wgrad (torch.ops.convfirstnet)
    BN_e weights       one pass over dh (z = x W_exp^T recomputed): D = dv^T x and sum dv; then BN_e's
                       dgamma, dbeta and dW_exp from D, x's mean and W_exp G (one merge launch)
    dx                 one pass over dh: de recomputed per pixel tile, dx = de W_exp + dout (the residual);
                       de is never written

Stride 2 (g = BlurPool(SiLU(v_d)), no residual): h, d, dd and dh at the input's resolution, g, dg and
do at half of it. After d, one pass recomputes g from d (``blur_gate_input``); the SE sums and dW_proj run
on g (``gate_pool``, ``gate_grad``, which writes dg); BN_d's sums and dd come from two passes over d that
recompute dy = Blur^T(dg) SiLU'(v_d) (``blur_bn_d_sums``, ``blur_bn_d_backward``); the rest as above.

Every reduction runs in a fixed order (no atomics): two identical steps give equal gradients.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import mbconv_fused_forward
from .kernels.mbconv import backward_reference as ref
from .mbconv_fused_forward import stats_rows, x_rows

T = torch.Tensor


def _passes(triton: bool) -> dict:
    """The implementation of each pass: the Triton launches, or their PyTorch twins."""
    names = ("bn_p_backward", "dgate_pool", "se_backward", "bn_d_sums", "bn_d_backward", "expand_hidden",
             "bn_e_weights", "bn_e_dx", "blur_gate_input", "gate_pool", "gate_grad",
             "blur_bn_d_sums", "blur_bn_d_backward")
    if not triton:
        return {k: getattr(ref, k + "_reference") for k in names}
    from .kernels.mbconv import blur_backward, expand_backward, gate_backward, narrow, se_backward

    mods = (narrow, gate_backward, se_backward, gate_backward, gate_backward, expand_backward,
            expand_backward, expand_backward, blur_backward, gate_backward, gate_backward,
            blur_backward, blur_backward)
    return {k: getattr(m, k) for k, m in zip(names, mods)}


def _rows(t: T) -> T:
    """(N, C, H, W) channels-last -> its (P, C) row view."""
    n, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(n * h * w, c)


def _nchw(t: T, n: int, h: int, w: int) -> T:
    """(P, C) rows -> the (N, C, H, W) channels-last view."""
    return t.view(n, h, w, t.shape[1]).permute(0, 3, 1, 2)


def selected(x: T, w_exp: T, w_proj: T, stride: int) -> bool:
    """Whether a block's backward takes the fused passes: where its forward takes the fused kernels
    (mbconv_fused_forward.selected) and its wide tensors take 32-bit offsets, decided before any launch."""
    if stride not in (1, 2) or not mbconv_fused_forward.selected(x, w_exp, w_proj, stride):
        return False
    n, c, h, w = x.shape
    return n * h * w * max(w_exp.shape[0], c) < 2**31


def backward(grad_out: T, x: T, w_exp: T, gamma_e: T, beta_e: T, w_dw: T, gamma_d: T, beta_d: T, w_se1: T,
             b_se1: T, w_se2: T, b_se2: T, w_proj: T, gamma_p: T, beta_p: T, o: T, stats: T, drop_scale: T,
             stride: int, triton: bool) -> tuple[T, ...]:
    """The gradients of x and of the 13 weights (the op's input order) of a block of ``stride``; ``stats``:
    the forward's batch statistics (mbconv_fused_forward.stats_rows). Autocast is off inside (as in the
    forward): every dtype here is chosen."""
    dev = x.device.type
    with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else contextlib.nullcontext():
        return _backward(grad_out, x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2,
                         b_se2, w_proj, gamma_p, beta_p, o, stats, drop_scale, stride, triton)


def _backward(grad_out, x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj,
              gamma_p, beta_p, o, stats, drop_scale, stride, triton):
    p = _passes(triton)
    dt = x.dtype
    n, c, hh, ww = x.shape
    r, k = w_exp.shape[0], w_proj.shape[0]
    hw = hh * ww
    (mean_e, rstd_e), (mean_d, rstd_d), (mean_p, rstd_p) = stats_rows(stats, r, k)
    cl = torch.channels_last
    x2 = _rows(x.contiguous(memory_format=cl))
    dout = _rows(grad_out.to(dt).contiguous(memory_format=cl))
    wexp = w_exp.reshape(r, c).to(dt)
    wproj = w_proj.reshape(k, r).to(dt)
    if stride == 2:  # no drop-path (no residual)
        drop_scale = torch.ones((n,), device=x.device, dtype=torch.float32)
    do, dgamma_p, dbeta_p = p["bn_p_backward"](dout, _rows(o.contiguous(memory_format=cl)), mean_p, rstd_p,
                                               gamma_p, drop_scale, n)
    h = p["expand_hidden"](x2, wexp, mean_e, rstd_e, gamma_e, beta_e)
    h4 = _nchw(h, n, hh, ww)
    d = _rows(torch.ops.convfirstnet.gconv3x3(h4, w_dw, 1, True)) if triton else _rows(
        F.conv2d(h4, w_dw.to(dt), None, 1, 1, 1, r // 8).contiguous(memory_format=cl))
    bn_d = (mean_d, rstd_d, gamma_d, beta_d)
    if stride == 1:
        # the SE and BN_d: one pass over d for the per-image sums, the SE backward on (N, R) vectors (fp32)
        dgate, gsum, parts = p["dgate_pool"](d, *bn_d, do, wproj, n)
        gate, dpix, dw_se1, db_se1, dw_se2, db_se2 = p["se_backward"](gsum, dgate, w_se1, b_se1, w_se2, b_se2,
                                                                      hw)
        sum_dy, sum_dyu = p["bn_d_sums"](parts, gate, dpix)
        dd, dw_proj = p["bn_d_backward"](d, *bn_d, do, wproj, gate, dpix, sum_dy, sum_dyu, n)
    else:
        # the SE on g = BlurPool(SiLU(v_d)) (half resolution), BN_d's backward through BlurPool's transpose
        g = p["blur_gate_input"](d, *bn_d, n, hh, ww)
        dgate, gsum = p["gate_pool"](g, do, wproj, n)
        gate, dpix, dw_se1, db_se1, dw_se2, db_se2 = p["se_backward"](gsum, dgate, w_se1, b_se1, w_se2, b_se2,
                                                                      g.shape[0] // n)
        dg, dw_proj = p["gate_grad"](g, do, wproj, gate, dpix, n)
        del g
        sum_dy, sum_dyu = p["blur_bn_d_sums"](dg, d, *bn_d, n, hh, ww)
        dd = p["blur_bn_d_backward"](dg, d, *bn_d, sum_dy, sum_dyu, n, hh, ww)
        del dg
    del d
    dd4 = _nchw(dd, n, hh, ww)
    if triton:
        dh4, dw_dw = torch.ops.convfirstnet.gconv3x3_backward(dd4, h4, w_dw, True)  # dd read once
        dh = _rows(dh4)
    else:
        one = [1, 1]
        dh4, dw_dw, _ = torch.ops.aten.convolution_backward(dd4, h4, w_dw.to(dt), None, one, one, one, False,
                                                            [0, 0], r // 8, [True, True, False])
        dh = _rows(dh4.contiguous(memory_format=cl))
    del dd, dd4, h, h4
    bn_e = (x2, wexp, mean_e, rstd_e, gamma_e, beta_e, dh)
    dw_exp, sum_dve, sum_dv, uw = p["bn_e_weights"](*bn_e, *x_rows(stats, c, r, k))
    dx = p["bn_e_dx"](*bn_e, uw, dout if stride == 1 else None)
    del dh
    grads = (_nchw(dx, n, hh, ww), dw_exp.reshape(w_exp.shape), sum_dve, sum_dv, dw_dw, sum_dyu, sum_dy,
             dw_se1.reshape(w_se1.shape), db_se1, dw_se2.reshape(w_se2.shape), db_se2,
             dw_proj.reshape(w_proj.shape), dgamma_p, dbeta_p)
    params = (x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p,
              beta_p)
    # every pass returns tensors of their own: a custom op's outputs may not share memory
    return tuple(g.to(q.dtype) for g, q in zip(grads, params))
