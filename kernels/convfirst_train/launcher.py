"""Host side of the ConvFirst stride-1 training kernels (kernel.py): tiles, the per-channel arithmetic
between launches (kernels/_batchnorm.py), launches with their cost declarations.

Every function here assumes the op's checks passed (op.py). x and dout are read as contiguous NHWC
(copied once if they are not); a, p, dy, da and the outputs are contiguous NHWC.

Tiles (``train_config``)
------------------------
* CP: the channels padded to a power of two >= 16 (tl.dot); BM = 128 rows (64 for fp32, whose 3xTF32
  operands take three times the registers); BH = 64 hidden channels per chunk up to CP = 64, 32 above.
  4 warps up to CP = 32, 8 above.
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
from .._launch import GROUP_WIDTH, launch
from ..gconv.launcher import gconv3x3_dgrad_triton, gconv3x3_triton, gconv3x3_wgrad_triton
from .kernel import (
    _bn_input_grad_kernel,
    _ffn_bwd_input_kernel,
    _ffn_bwd_weights_kernel,
    _ffn_fwd_kernel,
    _prep_kernel,
    _moments_kernel,
    _out_sums_kernel,
    _residual_kernel,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_SHARE_ROWS = 4096  # rows per share of the moments and sums passes at least (partials <= ~2 %)
SHARES = 512  # programs of the moments and sums passes at most (about 4 per SM of an H100)
WEIGHT_PROGRAMS = 1024  # shares x hidden chunks of the weights pass at most
PARTIAL_SHARE = 0.1  # weights pass: fp32 partials at most this share of its bytes read
ELEMENTWISE_ELEMS = 4096  # elements per program of the elementwise passes (32 per thread, 4 warps)
# Under the interpreter (CPU tensors) shares of two tiles, so that small test maps run every share
# loop more than once (the same code as the GPU's, other sizes).
INTERPRETER_SHARE_TILES = 2


@dataclass(frozen=True)
class TrainConfig:
    cp: int  # channels padded to a power of two
    block_m: int  # rows per tile
    block_h: int  # hidden channels per chunk
    block_m_weights: int  # rows per tile of the weights pass
    block_h_weights: int  # hidden channels per program of the weights pass
    stages_weights: int  # software pipelining of the weights pass's tile loop
    num_warps: int
    precision: str


def train_config(c: int, r: int, dtype: torch.dtype) -> TrainConfig:
    cp = max(16, triton.next_power_of_2(c))
    fp32 = dtype == torch.float32
    bm = 64 if fp32 else 128
    bh = 64 if cp <= 64 and not fp32 else 32
    bh = min(bh, max(16, triton.next_power_of_2(r)))
    # weights pass: 128 rows x 32 hidden channels, 8 warps, three pipeline stages for every CP (sm_90,
    # fp16: 150-230 registers, no stack, up to 217 KB of shared memory at CP = 128). Chosen by the
    # static estimate of Small's stride-1 blocks at batch 128: 64 x 32 and 1-2 stages were latency
    # bound (C = 64: 566-617 us against 264 us), 128 x 64 spilled, 256 x 32 was slower (397 us).
    bmw, bhw, stages = (64, 16, 2) if fp32 else (128, 32, 3)
    return TrainConfig(cp, bm, bh, bmw, min(bhw, bh), stages, 4 if cp <= 32 else 8, "tf32x3" if fp32 else "tf32")


def shares_of(tiles: int, block_m: int, interpreter: bool, cap: int = SHARES) -> tuple[int, int]:
    """(tiles per share, shares) of the moments and sums passes."""
    if interpreter:
        per = INTERPRETER_SHARE_TILES
    else:
        per = max(triton.cdiv(MIN_SHARE_ROWS, block_m), triton.cdiv(tiles, cap))
    per = min(per, max(1, tiles))
    return per, triton.cdiv(tiles, per)


def weight_shares(tiles: int, chunks: int, c: int, r: int, cfg: TrainConfig, eb: int, interpreter: bool
                  ) -> tuple[int, int]:
    """(tiles per share, shares) of the weights pass: at most WEIGHT_PROGRAMS programs and partials of
    at most PARTIAL_SHARE of the bytes read (a, dout, p: 3 C eb per row, per chunk)."""
    if interpreter:
        return shares_of(tiles, cfg.block_m_weights, True)
    rows = tiles * cfg.block_m_weights
    budget = int(PARTIAL_SHARE * 3 * c * eb * rows * chunks / (8 * c * r)) if r else 1
    shares = max(1, min(tiles, WEIGHT_PROGRAMS // chunks, budget))
    per = triton.cdiv(tiles, shares)
    return per, triton.cdiv(tiles, per)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous NHWC tensor (copied once if it is not)."""
    return t.contiguous(memory_format=torch.channels_last)


def _pair(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two per-channel sums of (shares, 2, C) partials, summed over the shares in a fixed order (two
    separate tensors: op outputs must not alias)."""
    s = part.sum(0)
    return s[0].clone(), s[1].clone()


def _empty_like_map(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.channels_last)


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------


def moments_triton(a: torch.Tensor, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch mean (C,) and biased covariance (C, C) of a contiguous NHWC map, fp32."""
    n, c, h, w = a.shape
    m = n * h * w
    tiles = triton.cdiv(m, cfg.block_m)
    per, shares = shares_of(tiles, cfg.block_m, a.device.type == "cpu")
    mean = torch.empty((shares, c), dtype=torch.float32, device=a.device)
    m2 = torch.empty((shares, c, c), dtype=torch.float32, device=a.device)
    launch(_moments_kernel, (shares,), a, mean, m2, m, tiles, per, C=c, CP=cfg.cp, BM=cfg.block_m,
           PRECISION=cfg.precision, num_warps=cfg.num_warps,
           cost=lambda: moments_cost(cfg, m, c, a.element_size(), shares, per))
    return merge_moments(share_counts(m, per * cfg.block_m, shares, a.device), mean, m2)


def convfirst_s1_train_triton(x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3,
                              running_mean1, running_var1, running_mean2, running_var2, running_mean3,
                              running_var3, drop_scale, training: bool, eps: float):
    """Forward; returns what reference.convfirst_s1_train_reference returns."""
    n, c, h, w = x.shape
    r = w1.shape[0]
    m = n * h * w
    dt = x.dtype
    cfg = train_config(c, r, dt)
    f32 = dict(dtype=torch.float32, device=x.device)
    x = _flat(x)
    a = gconv3x3_triton(x, w_conv, 1)
    zeros_c = torch.zeros(c, **f32)
    if training:
        bmean1, bcov1 = moments_triton(a, cfg)
        m1, v1 = bmean1, bcov1.diagonal()
    else:
        bmean1, bcov1 = zeros_c, torch.zeros((c, c), **f32)
        m1, v1 = running_mean1.float(), running_var1.float()
    _, k1, t1 = affine(gamma1.float(), beta1.float(), m1, v1, eps)
    w1d, w2d = w1.to(dt).contiguous(), w2.to(dt).contiguous()
    if training:
        # y = k1 a + t1: mean(y) = beta1 and Cov(y) = k1 Cov(a) k1; z = W1 y
        m2, v2 = linear_moments(beta1.float(), k1[:, None] * bcov1 * k1[None, :], w1d.float())
    else:
        m2, v2 = running_mean2.float(), running_var2.float()
    _, k2, t2 = affine(gamma2.float(), beta2.float(), m2, v2, eps)
    p = _empty_like_map(a)
    tiles = triton.cdiv(m, cfg.block_m)
    pmean = torch.empty((tiles, c), **f32)
    pm2 = torch.empty((tiles, c), **f32)
    launch(_ffn_fwd_kernel, (tiles,), a, w1d, w2d, p, k1, t1, k2, t2, pmean, pm2, m, r, C=c, CP=cfg.cp,
           BM=cfg.block_m, BH=cfg.block_h, PRECISION=cfg.precision, num_warps=cfg.num_warps,
           cost=lambda: ffn_fwd_cost(cfg, m, c, r, x.element_size()))
    if training:
        m3, v3 = merge_moments(share_counts(m, cfg.block_m, tiles, x.device), pmean, pm2)
    else:
        m3, v3 = running_mean3.float(), running_var3.float()
    _, k3, t3 = affine(gamma3.float(), beta3.float(), m3, v3, eps)
    out = _empty_like_map(x)
    drop = drop_scale.float().contiguous()
    rows = ELEMENTWISE_ELEMS // cfg.cp
    launch(_residual_kernel, (triton.cdiv(m, rows),), x, p, out, drop, k3, t3, m, h * w, C=c,
           CP=cfg.cp, BM=rows, num_warps=4,
           cost=lambda: elementwise_cost("residual", m, c, x.element_size(), 3))
    stats = [s.clone() for s in (m1, v1, m2, v2, m3, v3, bmean1, bcov1)]
    return (out, a, p, *stats)


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------


def convfirst_s1_train_backward_triton(dout, x, a, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3,
                                       beta3, mean1, var1, mean2, var2, mean3, var3, batch_mean1, batch_cov1,
                                       drop_scale, training: bool, eps: float):
    """Backward; returns what reference.convfirst_s1_train_backward_reference returns."""
    n, c, h, w = x.shape
    r = w1.shape[0]
    m = n * h * w
    dt = x.dtype
    eb = x.element_size()
    cfg = train_config(c, r, dt)
    interpreter = x.device.type == "cpu"
    f32 = dict(dtype=torch.float32, device=x.device)
    x, dout = _flat(x), _flat(dout.to(dt))
    r1, k1, t1 = affine(gamma1.float(), beta1.float(), mean1, var1, eps)
    r2, k2, t2 = affine(gamma2.float(), beta2.float(), mean2, var2, eps)
    r3, k3, _ = affine(gamma3.float(), beta3.float(), mean3, var3, eps)
    w1d, w2d = w1.to(dt).contiguous(), w2.to(dt).contiguous()
    drop = drop_scale.float().contiguous()
    tiles = triton.cdiv(m, cfg.block_m)

    # BN3 (and drop-path): sum dq, sum dq p_hat
    per, shares = shares_of(tiles, cfg.block_m, interpreter)
    part = torch.empty((shares, 2, c), **f32)
    launch(_out_sums_kernel, (shares,), dout, p, drop, mean3, r3, part, m, h * w, tiles, per, C=c, CP=cfg.cp,
           BM=cfg.block_m, num_warps=cfg.num_warps, cost=lambda: sums_cost(cfg, m, c, eb, shares, per))
    dbeta3, dgamma3 = _pair(part)
    u3, w3 = backward_terms(dgamma3, dbeta3, k3, r3, m, training)
    c3 = u3 - w3 * mean3  # dp = k3 dq + w3 p + c3: w3 is the small batch term, so no cancellation

    # y and dp, once, in the activation dtype
    y, dp = _empty_like_map(a), _empty_like_map(a)
    rows = ELEMENTWISE_ELEMS // cfg.cp
    launch(_prep_kernel, (triton.cdiv(m, rows),), a, dout, p, drop, y, dp, k1, t1, k3, w3, c3, m, h * w, C=c,
           CP=cfg.cp, BM=rows, num_warps=4, cost=lambda: elementwise_cost("y and dp", m, c, eb, 5))

    # weights pass: dW2, dzn^T y and BN2's sums, per (share, hidden chunk)
    chunks = triton.cdiv(r, cfg.block_h_weights)
    wtiles = triton.cdiv(m, cfg.block_m_weights)
    per, shares = weight_shares(wtiles, chunks, c, r, cfg, eb, interpreter)
    dw2_part = torch.empty((shares, c, r), **f32)
    g_part = torch.empty((shares, r, c), **f32)
    sums = torch.empty((shares, 2, r), **f32)
    launch(_ffn_bwd_weights_kernel, (shares, chunks), y, dp, w1d, w2d, k2, t2, mean2, r2, dw2_part, g_part, sums,
           m, r, wtiles, per, C=c, CP=cfg.cp, BM=cfg.block_m_weights, BH=cfg.block_h_weights,
           PRECISION=cfg.precision, num_warps=8, num_stages=cfg.stages_weights,
           cost=lambda: ffn_bwd_weights_cost(cfg, m, c, r, eb, shares, per, chunks))
    dbeta2, dgamma2 = _pair(sums)
    u2, w2v = backward_terms(dgamma2, dbeta2, k2, r2, m, training)
    dw2 = dw2_part.sum(0)
    # dW1 = dz^T y with dz = k2 dzn + u2 + w2 (z - m2) (kernel.py, pass 6); in training
    # (z - m2)^T y = M W1 Cov(y) + M (W1 mean(y) - m2) mean(y)^T, mean(y) = beta1, Cov(y) = k1 Cov(a) k1
    dw1 = k2[:, None] * g_part.sum(0)
    if training:
        mean_y = k1 * (batch_mean1 - mean1) + beta1.float()
        cov_y = k1[:, None] * batch_cov1 * k1[None, :]
        w1f = w1d.float()
        zty = m * (w1f @ cov_y) + m * torch.outer(w1f @ mean_y - mean2, mean_y)
        dw1 = dw1 + m * torch.outer(u2, mean_y) + w2v[:, None] * zty

    # input pass: dy, and BN1's sums
    dy = _empty_like_map(a)
    part1 = torch.empty((tiles, 2, c), **f32)
    launch(_ffn_bwd_input_kernel, (tiles,), y, dp, a, w1d, w2d, dy, mean1, r1, k2, t2, mean2, u2, w2v, part1, m,
           r, C=c, CP=cfg.cp, BM=cfg.block_m, BH=cfg.block_h, PRECISION=cfg.precision, num_warps=cfg.num_warps,
           cost=lambda: ffn_bwd_input_cost(cfg, m, c, r, eb))
    dbeta1, dgamma1 = _pair(part1)
    u1, w1v = backward_terms(dgamma1, dbeta1, k1, r1, m, training)
    da = _empty_like_map(a)
    rows = ELEMENTWISE_ELEMS // cfg.cp
    launch(_bn_input_grad_kernel, (triton.cdiv(m, rows),), dy, a, da, k1, u1, w1v, mean1, m, C=c,
           CP=cfg.cp, BM=rows, num_warps=4, cost=lambda: elementwise_cost("bn1 input grad", m, c, eb, 3))

    # the grouped conv
    dx = gconv3x3_dgrad_triton(da, w_conv, h, w, 1) + dout
    dw_conv = gconv3x3_wgrad_triton(da, x, 1, w_conv.dtype)
    vec = [(dgamma1, gamma1), (dbeta1, beta1), (dgamma2, gamma2), (dbeta2, beta2), (dgamma3, gamma3),
           (dbeta3, beta3)]
    return (dx, dw_conv, dw1.to(w1.dtype), dw2.to(w2.dtype), *[v.to(like.dtype) for v, like in vec])


# ------------------------------------------------------------------------------------------------
# Cost declarations (kernels/_cost.py). Useful MACs: those of a layer-wise training step assigned to
# the launch that does them (forward 2 C R per pixel; backward dW2 and dW1 in the weights pass, dh
# and dy in the input pass); recomputed products are issued, not useful.
# ------------------------------------------------------------------------------------------------


def _passes(cfg: TrainConfig) -> int:
    return 3 if cfg.precision == "tf32x3" else 1


def moments_cost(cfg: TrainConfig, m: int, c: int, eb: int, shares: int, per: int) -> KernelCost:
    tiles = triton.cdiv(m, cfg.block_m)
    return KernelCost(useful_macs=0, mma_macs=tiles * cfg.block_m * cfg.cp * cfg.cp * _passes(cfg),
                      dram_bytes=eb * m * c + 4 * shares * (c + c * c), loops=(Loop("tiles", per),),
                      note=f"BN1 moments C={c}, {shares} shares of {per} tiles")


def ffn_fwd_cost(cfg: TrainConfig, m: int, c: int, r: int, eb: int) -> KernelCost:
    tiles = triton.cdiv(m, cfg.block_m)
    chunks = triton.cdiv(r, cfg.block_h)
    return KernelCost(
        useful_macs=2 * m * c * r,
        mma_macs=tiles * chunks * 2 * cfg.block_m * cfg.cp * cfg.block_h * _passes(cfg),
        dram_bytes=2 * eb * m * c + eb * 2 * c * r + 8 * tiles * c,
        loops=(Loop("hidden", chunks),),
        note=f"FFN forward C={c} R={r} BM={cfg.block_m} BH={cfg.block_h}",
    )


def elementwise_cost(what: str, m: int, c: int, eb: int, maps: int) -> KernelCost:
    return KernelCost(useful_macs=0, mma_macs=0, dram_bytes=maps * eb * m * c, note=f"{what} C={c}")


def sums_cost(cfg: TrainConfig, m: int, c: int, eb: int, shares: int, per: int) -> KernelCost:
    return KernelCost(useful_macs=0, mma_macs=0, dram_bytes=2 * eb * m * c + 8 * shares * c,
                      loops=(Loop("tiles", per),), note=f"BN3 backward sums C={c}, {shares} shares")


def ffn_bwd_weights_cost(cfg: TrainConfig, m: int, c: int, r: int, eb: int, shares: int, per: int,
                         chunks: int) -> KernelCost:
    tiles = triton.cdiv(m, cfg.block_m_weights)
    # per tile and chunk: z, dh (recomputed) and the two weight-gradient products
    return KernelCost(
        useful_macs=2 * m * c * r,
        mma_macs=tiles * chunks * 4 * cfg.block_m_weights * cfg.cp * cfg.block_h_weights * _passes(cfg),
        # a, dout, p read once from DRAM (the chunks of a share run side by side and share them in L2)
        dram_bytes=3 * eb * m * c + 8 * shares * c * r + 8 * shares * r + chunks * eb * 2 * c * cfg.block_h_weights,
        l2_bytes=(chunks - 1) * 3 * eb * m * c,
        loops=(Loop("tiles", per),),
        note=f"FFN backward weights C={c} R={r}, {shares} shares of {per} tiles x {chunks} chunks",
    )


def ffn_bwd_input_cost(cfg: TrainConfig, m: int, c: int, r: int, eb: int) -> KernelCost:
    tiles = triton.cdiv(m, cfg.block_m)
    chunks = triton.cdiv(r, cfg.block_h)
    return KernelCost(
        useful_macs=2 * m * c * r,
        mma_macs=tiles * chunks * 3 * cfg.block_m * cfg.cp * cfg.block_h * _passes(cfg),
        dram_bytes=4 * eb * m * c + eb * 2 * c * r + 8 * tiles * c,
        loops=(Loop("hidden", chunks),),
        note=f"FFN backward input C={c} R={r}",
    )


def useful_gconv_macs(n: int, c: int, h: int, w: int) -> int:
    return n * h * w * c * 9 * GROUP_WIDTH
