"""Host side of the ConvFirst stride-1 training kernels (kernel.py): tiles, the per-channel arithmetic
between launches (kernels/_batchnorm.py), launches with their cost declarations.

Every function here assumes the op's checks passed (op.py). x and dout are read as contiguous NHWC
(copied once if they are not); a, p, dy, da and the outputs are contiguous NHWC.

Tiles (``train_config``)
------------------------
* CP: the channels padded to a power of two >= 16 (tl.dot); BM = 128 rows (64 for fp32, whose 3xTF32
  operands take three times the registers); BH = 32 hidden channels per chunk; the forward FFN on 4
  warps, the input pass on 4 up to CP = 32 and 8 above (train_config says why).
* The weights pass (two [CP, BH] fp32 accumulators live across its tile loop): 8 warps, 128 x 32
  tiles, three pipeline stages (train_config says why).
* Shares (reductions in a fixed order, never depending on the device): the moments pass and the
  output-gradient sums use at least MIN_SHARE_ROWS rows per share and at most SHARES programs; the
  weights pass uses at most WEIGHT_PROGRAMS programs (shares x hidden chunks) and keeps its fp32
  partials (2 C R floats per share) under PARTIAL_SHARE of the bytes it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .._batchnorm import affine, backward_terms, linear_moments, merge_moments, share_counts
from .._cost import KernelCost, Loop
from .._launch import launch
from ..gconv.launcher import gconv3x3_dgrad_triton, gconv3x3_triton, gconv3x3_wgrad_triton
from .kernel import (
    _bn_input_grad_kernel,
    _ffn_bwd_input_kernel,
    _ffn_bwd_weights_kernel,
    _blur_bwd_kernel,
    _blur_cat_kernel,
    _ffn_fwd_kernel,
    _prep_kernel,
    _moments_kernel,
    _out_sums_kernel,
    _residual_kernel,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# rows per share of the moments and sums passes at least; 4096 left Small's 32 x 32 maps with 32 programs
# (latency bound: 53 -> 15 us for the C = 96 moments)
MIN_SHARE_ROWS = 1024
SHARES = 512  # programs of the moments and sums passes at most (about 4 per SM of an H100)
WEIGHT_PROGRAMS = 1024  # shares x hidden chunks of the weights pass at most
PARTIAL_SHARE = 0.1  # weights pass: fp32 partials at most this share of its bytes read
ELEMENTWISE_ELEMS = 4096  # elements per program of the elementwise passes (32 per thread, 4 warps)
# Under the interpreter (CPU tensors) shares of two tiles, so that small test maps run every share
# loop more than once (the same code as the GPU's, other sizes).
INTERPRETER_SHARE_TILES = 2


@dataclass(frozen=True)
class TrainConfig:
    cp_in: int  # FFN input channels padded to a power of two
    cp_out: int  # FFN output channels padded to a power of two
    block_m: int  # rows per tile
    block_h: int  # hidden channels per chunk
    block_m_weights: int  # rows per tile of the weights pass
    block_h_weights: int  # hidden channels per program of the weights pass
    stages_weights: int  # software pipelining of the weights pass's tile loop
    num_warps: int  # the input pass
    num_warps_fwd: int  # the forward FFN pass
    precision: str


def _pow2(c: int) -> int:
    return max(16, triton.next_power_of_2(c))


def train_config(c_in: int, c_out: int, r: int, dtype: torch.dtype) -> TrainConfig:
    """Tiles of the FFN passes for c_in -> r -> c_out channels (stride 1: c_in = c_out = C; stride 2:
    2C -> 6C -> K)."""
    cpi, cpo = _pow2(c_in), _pow2(c_out)
    cp = max(cpi, cpo)
    fp32 = dtype == torch.float32
    bm = 64 if fp32 else 128
    # 32 hidden channels per chunk, the forward on 4 warps (static estimates of Small's blocks, batch 128,
    # sm_90: BH 64 -> 32 took the input pass at C = 64 from 234 to 174 us (two programs per SM instead
    # of one) and at C = 32 from 217 to 201; the forward on 4 warps at C = 96 from 105 to 63 us)
    bh = min(32, max(16, triton.next_power_of_2(r)))
    # weights pass: 128 rows x 32 hidden channels, 8 warps, three pipeline stages for every CP (sm_90,
    # fp16: 150-230 registers, no stack, up to 217 KB of shared memory at CP = 128). Chosen by the
    # static estimate of Small's stride-1 blocks at batch 128: 64 x 32 and 1-2 stages were latency
    # bound (C = 64: 566-617 us against 264 us), 128 x 64 spilled, 256 x 32 was slower (397 us).
    bmw, bhw, stages = (64, 16, 2) if fp32 else (128, 32, 3)
    return TrainConfig(cpi, cpo, bm, bh, bmw, min(bhw, bh), stages, 4 if cp <= 32 else 8, 4,
                       "tf32x3" if fp32 else "tf32")


def shares_of(tiles: int, block_m: int, interpreter: bool, cap: int = SHARES) -> tuple[int, int]:
    """(tiles per share, shares) of the moments and sums passes."""
    if interpreter:
        per = INTERPRETER_SHARE_TILES
    else:
        per = max(triton.cdiv(MIN_SHARE_ROWS, block_m), triton.cdiv(tiles, cap))
    per = min(per, max(1, tiles))
    return per, triton.cdiv(tiles, per)


def weight_shares(tiles: int, chunks: int, c_in: int, c_out: int, r: int, cfg: TrainConfig, eb: int,
                  interpreter: bool) -> tuple[int, int]:
    """(tiles per share, shares) of the weights pass: at most WEIGHT_PROGRAMS programs and partials of
    at most PARTIAL_SHARE of the bytes it reads (y and dp per row, per chunk)."""
    if interpreter:
        return shares_of(tiles, cfg.block_m_weights, True)
    rows = tiles * cfg.block_m_weights
    budget = int(PARTIAL_SHARE * (c_in + c_out) * eb * rows * chunks / (4 * (c_in + c_out) * r)) if r else 1
    shares = max(1, min(tiles, WEIGHT_PROGRAMS // chunks, budget))
    per = triton.cdiv(tiles, shares)
    return per, triton.cdiv(tiles, per)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous NHWC tensor (copied once if it is not)."""
    return t.contiguous(memory_format=torch.channels_last)


def _pair(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two per-channel sums of (shares, 2, C) partials, each summed over the shares in a fixed order
    (two separate tensors: op outputs must not alias)."""
    return part[:, 0].sum(0), part[:, 1].sum(0)


def _owned(tensors, inputs) -> list[torch.Tensor]:
    """The op's outputs must not alias its inputs or each other: clone only those that would (a running
    statistic returned as it is, a mean returned twice, a covariance's diagonal view)."""
    seen = {id(t) for t in inputs}
    out = []
    for t in tensors:
        if id(t) in seen or t._base is not None:
            t = t.clone()
        seen.add(id(t))
        out.append(t)
    return out


def _map(n: int, c: int, h: int, w: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty((n, c, h, w), dtype=like.dtype, device=like.device, memory_format=torch.channels_last)


def _elementwise_rows(c: int) -> int:
    return ELEMENTWISE_ELEMS // _pow2(c)


# ------------------------------------------------------------------------------------------------
# Pieces shared by the stride-1 and stride-2 blocks
# ------------------------------------------------------------------------------------------------


def moments_triton(a: torch.Tensor, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch mean (C,) and biased covariance (C, C) of a contiguous NHWC map, fp32."""
    n, c, h, w = a.shape
    m = n * h * w
    tiles = triton.cdiv(m, cfg.block_m)
    per, shares = shares_of(tiles, cfg.block_m, a.device.type == "cpu")
    mean = torch.empty((shares, c), dtype=torch.float32, device=a.device)
    m2 = torch.empty((shares, c, c), dtype=torch.float32, device=a.device)
    launch(_moments_kernel, (shares,), a, mean, m2, m, tiles, per, C=c, CP=_pow2(c), BM=cfg.block_m,
           PRECISION=cfg.precision, num_warps=4 if _pow2(c) <= 32 else 8,
           cost=lambda: moments_cost(cfg, m, c, a.element_size(), shares, per))
    return merge_moments(share_counts(m, per * cfg.block_m, shares, a.device), mean, m2)


def ffn_forward(inp, k_in, t_in, w1d, w2d, k2, t2, cfg: TrainConfig, training: bool):
    """p = W2 ReLU(BN2(W1 (k_in inp + t_in))) and p's batch mean and variance (zeros in eval)."""
    n, ci, h, w = inp.shape
    r, co = w1d.shape[0], w2d.shape[0]
    m = n * h * w
    f32 = dict(dtype=torch.float32, device=inp.device)
    p = _map(n, co, h, w, inp)
    tiles = triton.cdiv(m, cfg.block_m)
    pmean = torch.empty((tiles, co), **f32)
    pm2 = torch.empty((tiles, co), **f32)
    launch(_ffn_fwd_kernel, (tiles,), inp, w1d, w2d, p, k_in, t_in, k2, t2, pmean, pm2, m, r, CI=ci,
           CPI=cfg.cp_in, CO=co, CPO=cfg.cp_out, BM=cfg.block_m, BH=cfg.block_h, PRECISION=cfg.precision,
           num_warps=cfg.num_warps_fwd, cost=lambda: ffn_fwd_cost(cfg, m, ci, co, r, inp.element_size()))
    if not training:
        return p, None, None
    return (p, *merge_moments(share_counts(m, cfg.block_m, tiles, inp.device), pmean, pm2))


def out_grad(dout, p, drop, mean3, r3, k3, hw: int, cfg: TrainConfig, training: bool):
    """BN3's backward (with drop-path): (dbeta3, dgamma3, w3, c3) of dp = k3 dq + w3 p + c3."""
    n, co, h, w = p.shape
    m = n * h * w
    tiles = triton.cdiv(m, cfg.block_m)
    per, shares = shares_of(tiles, cfg.block_m, p.device.type == "cpu")
    part = torch.empty((shares, 2, co), dtype=torch.float32, device=p.device)
    launch(_out_sums_kernel, (shares,), dout, p, drop, mean3, r3, part, m, hw, tiles, per, C=co,
           CP=cfg.cp_out,
           BM=cfg.block_m, num_warps=4 if cfg.cp_out <= 32 else 8,
           cost=lambda: sums_cost(cfg, m, co, p.element_size(), shares, per))
    dbeta3, dgamma3 = _pair(part)
    u3, w3 = backward_terms(dgamma3, dbeta3, k3, r3, m, training)
    return dbeta3, dgamma3, w3, u3 - w3 * mean3  # c3: w3 is the small batch term, so no cancellation


def ffn_backward(y, dp, a, w1d, w2d, k2, t2, mean2, r2, mean_in, cov_in, mean1, r1, cfg: TrainConfig,
                 training: bool):
    """The FFN's backward from its input y (M, CI) and dp (M, CO): dW1, dW2, BN2's (dgamma2, dbeta2), dy
    and (a given: the stride-1 block, whose FFN input is BN1's output) BN1's per-tile sums.

    mean_in, cov_in: the batch mean and covariance of y (training), for dW1 = k2 G + u2 sum(y)^T +
    w2 (z - m2)^T y with (z - m2)^T y = M W1 Cov(y) + M (W1 mean(y) - m2) mean(y)^T (kernel.py)."""
    n, ci, h, w = y.shape
    r, co = w1d.shape[0], w2d.shape[0]
    m = n * h * w
    eb = y.element_size()
    f32 = dict(dtype=torch.float32, device=y.device)
    interpreter = y.device.type == "cpu"
    chunks = triton.cdiv(r, cfg.block_h_weights)
    wtiles = triton.cdiv(m, cfg.block_m_weights)
    per, shares = weight_shares(wtiles, chunks, ci, co, r, cfg, eb, interpreter)
    dw2_part = torch.empty((shares, co, r), **f32)
    g_part = torch.empty((shares, r, ci), **f32)
    sums = torch.empty((shares, 2, r), **f32)
    launch(_ffn_bwd_weights_kernel, (shares, chunks), y, dp, w1d, w2d, k2, t2, mean2, r2, dw2_part, g_part,
           sums, m, r, wtiles, per, CI=ci, CPI=cfg.cp_in, CO=co, CPO=cfg.cp_out, BM=cfg.block_m_weights,
           BH=cfg.block_h_weights, PRECISION=cfg.precision, num_warps=8, num_stages=cfg.stages_weights,
           cost=lambda: ffn_bwd_weights_cost(cfg, m, ci, co, r, eb, shares, per, chunks))
    dbeta2, dgamma2 = _pair(sums)
    u2, w2v = backward_terms(dgamma2, dbeta2, k2, r2, m, training)
    dw2 = dw2_part.sum(0)
    dw1 = k2[:, None] * g_part.sum(0)
    if training:
        w1f = w1d.float()
        zty = m * (w1f @ cov_in) + m * torch.outer(w1f @ mean_in - mean2, mean_in)
        dw1 = dw1 + m * torch.outer(u2, mean_in) + w2v[:, None] * zty
    dy = _map(n, ci, h, w, y)
    tiles = triton.cdiv(m, cfg.block_m)
    bn_sums = a is not None
    part1 = torch.empty((tiles, 2, ci) if bn_sums else (1,), **f32)
    launch(_ffn_bwd_input_kernel, (tiles,), y, dp, a if bn_sums else y, w1d, w2d, dy,
           mean1 if bn_sums else k2, r1 if bn_sums else k2, k2, t2, mean2, u2, w2v, part1, m, r, CI=ci,
           CPI=cfg.cp_in, CO=co, CPO=cfg.cp_out, BM=cfg.block_m, BH=cfg.block_h, PRECISION=cfg.precision,
           BN_SUMS=bn_sums, num_warps=cfg.num_warps,
           cost=lambda: ffn_bwd_input_cost(cfg, m, ci, co, r, eb, bn_sums))
    return dw1, dw2, dgamma2, dbeta2, dy, (part1 if bn_sums else None)


def bn_input_grad(dy, a, k1, u1, w1v, mean1) -> torch.Tensor:
    n, c, h, w = a.shape
    m = n * h * w
    da = _map(n, c, h, w, a)
    rows = _elementwise_rows(c)
    launch(_bn_input_grad_kernel, (triton.cdiv(m, rows),), dy, a, da, k1, u1, w1v, mean1, m, C=c, CP=_pow2(c),
           BM=rows, num_warps=4, cost=lambda: elementwise_cost("bn1 input grad", m, c, a.element_size(), 3))
    return da


def _grads(dw_conv, dw1, dw2, vecs, params):
    w1, w2 = params[:2]
    vecs = [v.to(like.dtype) for v, like in zip(vecs, params[2:])]
    return (dw_conv, dw1.to(w1.dtype), dw2.to(w2.dtype), *vecs)


# ------------------------------------------------------------------------------------------------
# Stride 1
# ------------------------------------------------------------------------------------------------


def convfirst_s1_train_triton(x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3,
                              running_mean1, running_var1, running_mean2, running_var2, running_mean3,
                              running_var3, drop_scale, training: bool, eps: float):
    """Forward; returns what reference.convfirst_s1_train_reference returns."""
    n, c, h, w = x.shape
    r = w1.shape[0]
    m = n * h * w
    dt = x.dtype
    cfg = train_config(c, c, r, dt)
    f32 = dict(dtype=torch.float32, device=x.device)
    x = _flat(x)
    a = gconv3x3_triton(x, w_conv, 1)
    if training:
        bmean1, bcov1 = moments_triton(a, cfg)
        m1, v1 = bmean1, bcov1.diagonal()
    else:
        bmean1, bcov1 = torch.zeros(c, **f32), torch.zeros((c, c), **f32)
        m1, v1 = running_mean1.float(), running_var1.float()
    _, k1, t1 = affine(gamma1.float(), beta1.float(), m1, v1, eps)
    w1d, w2d = w1.to(dt).contiguous(), w2.to(dt).contiguous()
    if training:
        # y = k1 a + t1: mean(y) = beta1 and Cov(y) = k1 Cov(a) k1; z = W1 y
        m2, v2 = linear_moments(beta1.float(), k1[:, None] * bcov1 * k1[None, :], w1d.float())
    else:
        m2, v2 = running_mean2.float(), running_var2.float()
    _, k2, t2 = affine(gamma2.float(), beta2.float(), m2, v2, eps)
    p, m3, v3 = ffn_forward(a, k1, t1, w1d, w2d, k2, t2, cfg, training)
    if not training:
        m3, v3 = running_mean3.float(), running_var3.float()
    _, k3, t3 = affine(gamma3.float(), beta3.float(), m3, v3, eps)
    out = _map(n, c, h, w, x)
    rows = _elementwise_rows(c)
    launch(_residual_kernel, (triton.cdiv(m, rows),), x, p, out, drop_scale.float().contiguous(), k3, t3, m,
           h * w, C=c, CP=cfg.cp_out, BM=rows, RESIDUAL=True, num_warps=4,
           cost=lambda: elementwise_cost("residual", m, c, x.element_size(), 3))
    stats = _owned((m1, v1, m2, v2, m3, v3, bmean1, bcov1), (running_mean1, running_var1, running_mean2,
                                                            running_var2, running_mean3, running_var3))
    return (out, a, p, *stats)


def convfirst_s1_train_backward_triton(dout, x, a, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3,
                                       beta3, mean1, var1, mean2, var2, mean3, var3, batch_mean1, batch_cov1,
                                       drop_scale, training: bool, eps: float):
    """Backward; returns what reference.convfirst_s1_train_backward_reference returns."""
    n, c, h, w = x.shape
    r = w1.shape[0]
    m = n * h * w
    dt = x.dtype
    eb = x.element_size()
    cfg = train_config(c, c, r, dt)
    x, dout = _flat(x), _flat(dout.to(dt))
    r1, k1, t1 = affine(gamma1.float(), beta1.float(), mean1, var1, eps)
    r2, k2, t2 = affine(gamma2.float(), beta2.float(), mean2, var2, eps)
    r3, k3, _ = affine(gamma3.float(), beta3.float(), mean3, var3, eps)
    w1d, w2d = w1.to(dt).contiguous(), w2.to(dt).contiguous()
    drop = drop_scale.float().contiguous()
    dbeta3, dgamma3, w3, c3 = out_grad(dout, p, drop, mean3, r3, k3, h * w, cfg, training)
    # y and dp, once, in the activation dtype
    y, dp = _map(n, c, h, w, a), _map(n, c, h, w, a)
    rows = _elementwise_rows(c)
    launch(_prep_kernel, (triton.cdiv(m, rows),), a, dout, p, drop, y, dp, k1, t1, k3, w3, c3, m, h * w, C=c,
           CP=cfg.cp_out, BM=rows, WRITE_Y=True, num_warps=4,
           cost=lambda: elementwise_cost("y and dp", m, c, eb, 5))
    mean_y = k1 * (batch_mean1 - mean1) + beta1.float()
    cov_y = k1[:, None] * batch_cov1 * k1[None, :]
    dw1, dw2, dgamma2, dbeta2, dy, part1 = ffn_backward(y, dp, a, w1d, w2d, k2, t2, mean2, r2, mean_y, cov_y,
                                                        mean1, r1, cfg, training)
    dbeta1, dgamma1 = _pair(part1)
    u1, w1v = backward_terms(dgamma1, dbeta1, k1, r1, m, training)
    da = bn_input_grad(dy, a, k1, u1, w1v, mean1)
    # the grouped conv
    dx = gconv3x3_dgrad_triton(da, w_conv, h, w, 1, residual=dout)
    dw_conv = gconv3x3_wgrad_triton(da, x, 1, w_conv.dtype)
    return (dx, *_grads(dw_conv, dw1, dw2, (dgamma1, dbeta1, dgamma2, dbeta2, dgamma3, dbeta3),
                        (w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3)))


# ------------------------------------------------------------------------------------------------
# Stride 2
# ------------------------------------------------------------------------------------------------


def convfirst_s2_train_triton(x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3,
                              running_mean1, running_var1, running_mean2, running_var2, running_mean3,
                              running_var3, training: bool, eps: float):
    """Forward; returns what reference.convfirst_s2_train_reference returns."""
    n, c, h, w = x.shape
    r, k = w1.shape[0], w2.shape[0]
    ho, wo = (h + 1) // 2, (w + 1) // 2
    m, mo = n * h * w, n * ho * wo
    dt = x.dtype
    cfg = train_config(2 * c, k, r, dt)
    f32 = dict(dtype=torch.float32, device=x.device)
    x = _flat(x)
    a = gconv3x3_triton(x, w_conv, 1)
    if training:
        m1, cov1 = moments_triton(a, cfg)
        v1 = cov1.diagonal()
    else:
        m1, v1 = running_mean1.float(), running_var1.float()
    _, k1, t1 = affine(gamma1.float(), beta1.float(), m1, v1, eps)
    u = _map(n, 2 * c, ho, wo, x)
    rows = _elementwise_rows(c)
    launch(_blur_cat_kernel, (triton.cdiv(mo, rows),), x, a, u, k1, t1, mo, h, w, ho, wo, C=c, CP=_pow2(c),
           BM=rows, num_warps=4, cost=lambda: blur_cost("blur(cat[x, BN1(a)])", n, c, h, w, x.element_size()))
    w1d, w2d = w1.to(dt).contiguous(), w2.to(dt).contiguous()
    if training:
        mean_u, cov_u = moments_triton(u, cfg)
        m2, v2 = linear_moments(mean_u, cov_u, w1d.float())
    else:
        mean_u, cov_u = torch.zeros(2 * c, **f32), torch.zeros((2 * c, 2 * c), **f32)
        m2, v2 = running_mean2.float(), running_var2.float()
    _, k2, t2 = affine(gamma2.float(), beta2.float(), m2, v2, eps)
    ones, zeros = torch.ones(2 * c, **f32), torch.zeros(2 * c, **f32)
    p, m3, v3 = ffn_forward(u, ones, zeros, w1d, w2d, k2, t2, cfg, training)
    if not training:
        m3, v3 = running_mean3.float(), running_var3.float()
    _, k3, t3 = affine(gamma3.float(), beta3.float(), m3, v3, eps)
    out = _map(n, k, ho, wo, x)
    rows = _elementwise_rows(k)
    launch(_residual_kernel, (triton.cdiv(mo, rows),), p, p, out, k3, k3, t3, mo, ho * wo, C=k, CP=cfg.cp_out,
           BM=rows, RESIDUAL=False, num_warps=4,
           cost=lambda: elementwise_cost("BN3", mo, k, x.element_size(), 2))
    stats = _owned((m1, v1, m2, v2, m3, v3, mean_u, cov_u), (running_mean1, running_var1, running_mean2,
                                                             running_var2, running_mean3, running_var3))
    return (out, a, u, p, *stats)


def convfirst_s2_train_backward_triton(dout, x, a, u, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3,
                                       beta3, mean1, var1, mean2, var2, mean3, var3, batch_mean_u,
                                       batch_cov_u, training: bool, eps: float):
    """Backward; returns what reference.convfirst_s2_train_backward_reference returns."""
    n, c, h, w = x.shape
    r, k = w1.shape[0], w2.shape[0]
    ho, wo = (h + 1) // 2, (w + 1) // 2
    m = n * h * w
    dt = x.dtype
    cfg = train_config(2 * c, k, r, dt)
    f32 = dict(dtype=torch.float32, device=x.device)
    x, dout = _flat(x), _flat(dout.to(dt))
    r1, k1, _ = affine(gamma1.float(), beta1.float(), mean1, var1, eps)
    r2, k2, t2 = affine(gamma2.float(), beta2.float(), mean2, var2, eps)
    r3, k3, _ = affine(gamma3.float(), beta3.float(), mean3, var3, eps)
    w1d, w2d = w1.to(dt).contiguous(), w2.to(dt).contiguous()
    ones = torch.ones(n, **f32)
    dbeta3, dgamma3, w3, c3 = out_grad(dout, p, ones, mean3, r3, k3, ho * wo, cfg, training)
    dp = _map(n, k, ho, wo, p)
    mo = n * ho * wo
    rows = _elementwise_rows(k)
    launch(_prep_kernel, (triton.cdiv(mo, rows),), p, dout, p, ones, p, dp, k3, k3, k3, w3, c3, mo, ho * wo,
           C=k,
           CP=cfg.cp_out, BM=rows, WRITE_Y=False, num_warps=4,
           cost=lambda: elementwise_cost("dp", mo, k, p.element_size(), 3))
    dw1, dw2, dgamma2, dbeta2, du, _ = ffn_backward(u, dp, None, w1d, w2d, k2, t2, mean2, r2, batch_mean_u,
                                                    batch_cov_u, None, None, cfg, training)
    # BlurPool's transpose: x's direct gradient, dy, BN1's sums
    dxd, dy = _map(n, c, h, w, x), _map(n, c, h, w, x)
    rows = _elementwise_rows(c)
    tiles = triton.cdiv(m, rows)
    part1 = torch.empty((tiles, 2, c), **f32)
    launch(_blur_bwd_kernel, (tiles,), du, a, dxd, dy, mean1, r1, part1, m, h, w, ho, wo, C=c, CP=_pow2(c),
           BM=rows, num_warps=4,
           cost=lambda: blur_cost("BlurPool transpose", n, c, h, w, x.element_size(), backward=True))
    dbeta1, dgamma1 = _pair(part1)
    u1, w1v = backward_terms(dgamma1, dbeta1, k1, r1, m, training)
    da = bn_input_grad(dy, a, k1, u1, w1v, mean1)
    dx = gconv3x3_dgrad_triton(da, w_conv, h, w, 1, residual=dxd)
    dw_conv = gconv3x3_wgrad_triton(da, x, 1, w_conv.dtype)
    return (dx, *_grads(dw_conv, dw1, dw2, (dgamma1, dbeta1, dgamma2, dbeta2, dgamma3, dbeta3),
                        (w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3)))


# ------------------------------------------------------------------------------------------------
# Cost declarations (kernels/_cost.py). Useful MACs: those of a layer-wise training step assigned to
# the launch that does them (forward 2 C R per pixel; backward dW2 and dW1 in the weights pass, dh
# and dy in the input pass; BlurPool 9 per output, forward and transpose); recomputed products are
# issued, not useful.
# ------------------------------------------------------------------------------------------------


def _passes(cfg: TrainConfig) -> int:
    return 3 if cfg.precision == "tf32x3" else 1


def moments_cost(cfg: TrainConfig, m: int, c: int, eb: int, shares: int, per: int) -> KernelCost:
    tiles = triton.cdiv(m, cfg.block_m)
    cp = _pow2(c)
    return KernelCost(useful_macs=0, mma_macs=tiles * cfg.block_m * cp * cp * _passes(cfg),
                      dram_bytes=eb * m * c + 4 * shares * (c + c * c), loops=(Loop("tiles", per),),
                      note=f"moments C={c}, {shares} shares of {per} tiles")


def ffn_fwd_cost(cfg: TrainConfig, m: int, ci: int, co: int, r: int, eb: int) -> KernelCost:
    tiles = triton.cdiv(m, cfg.block_m)
    chunks = triton.cdiv(r, cfg.block_h)
    return KernelCost(
        useful_macs=m * (ci + co) * r,
        mma_macs=tiles * chunks * cfg.block_m * (cfg.cp_in + cfg.cp_out) * cfg.block_h * _passes(cfg),
        dram_bytes=eb * m * (ci + co) + eb * (ci + co) * r + 8 * tiles * co,
        loops=(Loop("hidden", chunks),),
        note=f"FFN forward {ci}->{r}->{co} BM={cfg.block_m} BH={cfg.block_h}",
    )


def elementwise_cost(what: str, m: int, c: int, eb: int, maps: int) -> KernelCost:
    return KernelCost(useful_macs=0, mma_macs=0, dram_bytes=maps * eb * m * c, note=f"{what} C={c}")


def blur_cost(what: str, n: int, c: int, h: int, w: int, eb: int, backward: bool = False) -> KernelCost:
    """x and a (forward; backward: a, dx_direct, dy) at full resolution, u (2C) at half: 9 MACs per output
    element of the 2C-channel blur, as count_macs counts BlurPool."""
    ho, wo = (h + 1) // 2, (w + 1) // 2
    full = (3 if backward else 2) * n * h * w * c
    return KernelCost(useful_macs=9 * n * ho * wo * 2 * c, mma_macs=0,
                      dram_bytes=eb * (full + n * ho * wo * 2 * c),
                      note=f"{what} C={c}")


def sums_cost(cfg: TrainConfig, m: int, c: int, eb: int, shares: int, per: int) -> KernelCost:
    return KernelCost(useful_macs=0, mma_macs=0, dram_bytes=2 * eb * m * c + 8 * shares * c,
                      loops=(Loop("tiles", per),), note=f"BN3 backward sums C={c}, {shares} shares")


def ffn_bwd_weights_cost(cfg: TrainConfig, m: int, ci: int, co: int, r: int, eb: int, shares: int, per: int,
                         chunks: int) -> KernelCost:
    tiles = triton.cdiv(m, cfg.block_m_weights)
    # per tile and chunk: z and dh (recomputed), dW2 and dzn^T y
    return KernelCost(
        useful_macs=m * (ci + co) * r,
        mma_macs=tiles * chunks * 2 * cfg.block_m_weights * (cfg.cp_in + cfg.cp_out) * cfg.block_h_weights
        * _passes(cfg),
        # y and dp read once from DRAM (the chunks of a share run side by side and share them in L2)
        dram_bytes=(eb * m * (ci + co) + 4 * shares * ((ci + co) * r + 2 * r)
                    + chunks * eb * (ci + co) * cfg.block_h_weights),
        l2_bytes=(chunks - 1) * eb * m * (ci + co),
        loops=(Loop("tiles", per),),
        note=f"FFN backward weights {ci}->{r}->{co}, {shares} shares of {per} tiles x {chunks} chunks",
    )


def ffn_bwd_input_cost(cfg: TrainConfig, m: int, ci: int, co: int, r: int, eb: int, bn_sums: bool
                       ) -> KernelCost:
    tiles = triton.cdiv(m, cfg.block_m)
    chunks = triton.cdiv(r, cfg.block_h)
    return KernelCost(
        useful_macs=m * (ci + co) * r,
        mma_macs=tiles * chunks * cfg.block_m * cfg.block_h * (2 * cfg.cp_in + cfg.cp_out) * _passes(cfg),
        dram_bytes=(eb * m * (2 * ci + co + (ci if bn_sums else 0)) + eb * (ci + co) * r
                    + (8 * tiles * ci if bn_sums else 0)),
        loops=(Loop("hidden", chunks),),
        note=f"FFN backward input {ci}->{r}->{co}",
    )
