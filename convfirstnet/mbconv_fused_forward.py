"""The forward of ``mbconv_recompute_train`` through the fused MBConv kernels (kernels/mbconv), with the
three BatchNorms normalising by the batch's statistics (kernels/mbconv/moments.py):

    BN_e (after the expand, R channels): mean and variance of z = W_exp x follow from the mean and the
         C x C covariance of the narrow x (kernels/mbconv/narrow.py ``x_moments``: one read of x, Gram
         blocks per pixel split centred at a shift, fp32 accumulation, merged by Chan's rule in a second
         launch): mean_z = W mean_x, var_z = diag(W cov W^T), in one small launch. No pass over a wide
         tensor for the statistics; then h = SiLU(BN_e(W_exp x)) by the expand kernel
         (expand_backward.py ``expand_forward``) and u = gconv3x3(h) by the group-width-8 conv
         (kernels/gconv): the launches the backward recomputes them with, so its d is this u bit for bit.
    BN_d (after the grouped conv, before SiLU and, for stride 2, the BlurPool): the sums of u - shift
         and its square (shift = BN_d's running mean), per conv program as the conv stores u where its
         tiles cover the map exactly, else per image by one pass over u; merged in a fixed order by the
         statistics launch; one pass applies BN_d + SiLU (+ BlurPool) to u, with the pool and the
         SE partials; a small launch computes the gates.
    BN_p (after the projection, K channels): the projection kernel writes W_proj (g * gate) without
         bias and residual; then (narrow.py ``bn_residual``) its per-channel
         statistics per pixel split, their merge (Chan's rule; scale, bias and the running update) and
         one pass that normalises, applies drop-path and adds the residual, over the projection.

Running statistics: BN_e's and BN_d's updated by their statistics launches, BN_p's by its merge launch, all
with nn.BatchNorm2d's rule (running = (1 - f) running + f batch, the unbiased variance): the same update as
the layer-wise forward, in place on the op's copies. The backward (mbconv_fused_backward.py, where selected)
recomputes h and u from x with the same expand and conv. Numerics: the fused form rounds where the kernels
round (h, u, g, the gate, the projection, x centred for the Gram product) instead of after each layer, so it
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


def stats_size(c: int, r: int, k: int) -> int:
    """Values in ``stats``, the flat fp32 tensor the op's forward returns for its backward: each BatchNorm's
    batch mean and rstd (4 R + 2 K), then x's mean (C) and W_exp G (R C), G x's centred Gram matrix."""
    return 4 * r + 2 * k + c + r * c


def stats_rows(stats: T, r: int, k: int) -> tuple[T, T, T]:
    """The (2, R), (2, R), (2, K) views (mean; rstd) of BN_e, BN_d and BN_p in ``stats``."""
    return stats[:2 * r].view(2, r), stats[2 * r:4 * r].view(2, r), stats[4 * r:4 * r + 2 * k].view(2, k)


def x_rows(stats: T, c: int, r: int, k: int) -> tuple[T, T]:
    """x's mean (C,) and W_exp G (R, C) in ``stats`` (W_exp rounded to x's dtype, G x's centred Gram matrix,
    summed over the batch's pixels): BN_e's backward forms dW_exp from them
    (kernels/mbconv/expand_backward.bn_e_weights)."""
    o = 4 * r + 2 * k
    return stats[o:o + c], stats[o + c:o + c + r * c].view(r, c)


def selected(x: T, w_exp: T, w_proj: T, stride: int) -> bool:
    """Whether the op's forward takes the fused kernels for ``x`` (module docstring), decided before any
    launch."""
    if not HAS_TRITON or x.dim() != 4 or not use_triton(x):
        return False
    from .kernels.mbconv.launcher import check_supported

    n, c, h, w = x.shape
    r, k = w_exp.shape[0], w_proj.shape[0]
    if x.dtype not in (INTERPRETER_DTYPES if x.device.type == "cpu" else CUDA_DTYPES):  # meta: the report
        return False
    if n * h * w < 2 or (stride == 1 and k != c) or stride not in (1, 2):
        return False
    try:
        check_supported(x, c, r, k)
    except (ValueError, NotImplementedError):
        return False
    return True


def forward(x: T, w_exp: T, gamma_e: T, beta_e: T, w_dw: T, gamma_d: T, beta_d: T, w_se1: T, b_se1: T,
            w_se2: T, b_se2: T, w_proj: T, gamma_p: T, beta_p: T, running: tuple[T, ...], drop_scale: T,
            stride: int, factors: tuple[float, float, float], eps: float, stats: T | None = None
            ) -> tuple[T, T]:
    """(the block's training forward output, its projection before BN_p, o); ``running`` (the six running
    statistics, the op's copies) updated in place; ``stats`` (``stats_size``), when given, receives each
    BatchNorm's batch mean and rstd, which the backward normalises by, and x's moments. Weights in the
    module's shapes; ``factors``: each BatchNorm's update factor.
    Autocast, which stays on inside a custom op's body, is turned off: every dtype here is chosen."""
    dev = x.device.type
    with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else contextlib.nullcontext():
        return _forward(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj,
                        gamma_p, beta_p, running, drop_scale, stride, factors, eps, stats)


def _forward(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p,
             beta_p, running, drop_scale, stride, factors, eps, stats):
    from .kernels.gconv.launcher import gconv3x3_moments_triton, moments_rows
    from .kernels.mbconv.expand_backward import expand_forward
    from .kernels.mbconv.moments import bn_d_stats, bn_e_stats, conv_moments, mbconv_from_conv_output
    from .kernels.mbconv.narrow import bn_residual, x_moments

    dt = x.dtype
    n, c, h, w = x.shape
    r, k, s = w_exp.shape[0], w_proj.shape[0], w_se1.shape[0]
    rm_e, rv_e, rm_d, rv_d, rm_p, rv_p = running
    # the SE, projection and expand weights in x's dtype by one copy (autocast keeps them in fp32), and the
    # projection's zero bias (BN_p follows) after them
    parts = (w_se1, w_se2, w_proj, b_se1, b_se2, w_exp)
    sizes = [t.numel() for t in parts]
    buf = torch.empty(sum(sizes) + k, device=x.device, dtype=dt)
    torch.cat([t.detach().reshape(-1) for t in parts], out=buf[:sum(sizes)])
    zero_bias = buf[sum(sizes):].zero_()
    w_se1, w_se2, w_proj, b_se1, b_se2, w_exp_x = buf[:sum(sizes)].split(sizes)
    w_se1, w_se2, w_proj, w_exp_x = w_se1.view(s, r), w_se2.view(r, s), w_proj.view(k, r), w_exp_x.view(r, c)
    # BN_e's batch statistics from x's moments (one launch, running statistics updated)
    rows = (None,) * 3 if stats is None else stats_rows(stats, r, k)
    mean_x, wg = (None, None) if stats is None else x_rows(stats, c, r, k)
    mean_x, gram = x_moments(x, mean_x)
    # h = SiLU(BN_e(W_exp x)) and the conv's output u = gconv3x3(h) (kernels/gconv), as the backward
    # recomputes them (the same launches: its d is this u bit for bit); BN_d's moment rows from u (shifted
    # by BN_d's running mean), its statistics (which update that mean), then one pass applies BN_d + SiLU
    # (+ BlurPool) to u
    st_e = bn_e_stats(w_exp_x, mean_x, mean_x, gram, rm_e, rv_e, factors[0], eps, n * h * w, rows[0], wg)
    x2 = x.permute(0, 2, 3, 1).reshape(n * h * w, c)
    hid = expand_forward(x2, w_exp_x, st_e[0], st_e[1], gamma_e, beta_e)
    hid4 = hid.view(n, h, w, r).permute(0, 3, 1, 2)
    pixels = moments_rows(n, r, h, w, dt, x.device.type == "cpu")
    if pixels is not None:  # the conv's programs sum BN_d's moments over their tiles as they store u
        u4, moments = gconv3x3_moments_triton(hid4, w_dw, rm_d)
    else:
        u4 = torch.ops.convfirstnet.gconv3x3(hid4, w_dw, 1, True)
    del hid, hid4
    u = u4.permute(0, 2, 3, 1).reshape(n, h * w, r)
    if pixels is None:  # tiles with masked pixels: one pass over u, per image
        moments, pixels = conv_moments(u, rm_d), h * w
    st_d = bn_d_stats(moments, rm_d, rv_d, factors[1], eps, pixels, rows[1])
    o = mbconv_from_conv_output(u, x, st_d, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, zero_bias,
                                stride)
    del u
    # BN_p, drop-path and the residual, over o (its running statistics updated)
    out = bn_residual(o, x if stride == 1 else None, drop_scale, gamma_p, beta_p, rm_p, rv_p, factors[2], eps,
                      rows[2], keep_o=True)
    return out, o
