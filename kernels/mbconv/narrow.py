"""The narrow passes of the MBConv training forward (convfirstnet/mbconv_fused_forward.py), the passes over
the block's input x (N, C, H, W) and its projection output o (N, K, OH, OW) around the fused launches:

* ``x_moments``: BN_e's input statistics in one read of x: x's per-channel mean and its C x C Gram
  matrix centred there, sum over pixels of (x - mean)(x - mean)^T (fp32). Two launches:
  ``_gram_partials_kernel`` (grid: upper-triangle blocks of the Gram matrix x pixel splits; each
  program centres its pixels at a shift, its first tile's mean rounded to x's dtype, so no cancellation
  of size mean^2 / variance enters, and writes its split's mean and its Gram block centred at that
  mean, the tensor-core product accumulated in fp32) and ``_gram_merge_kernel`` (Chan's rule over the
  splits in a fixed order: G = sum G_s + n_s (m_s - m)(m_s - m)^T; no atomics, deterministic).
* ``bn_residual``: BN_p in training mode, then drop-path and the residual. Three launches:
  ``_channel_partials_kernel`` (per pixel split, per channel: the mean and centred sum of squares,
  centred at the split's first tile's mean), ``_bn_merge_kernel`` (Chan's rule over the splits in a
  fixed order; the scale gamma / sqrt(var + eps) and bias beta - mean scale; the running statistics
  updated as nn.BatchNorm2d does, (1 - f) running + f (mean, unbiased variance)) and
  ``_bn_apply_kernel`` (x + d_n (o scale + bias) at stride 1, o scale + bias at stride 2, written over o).
* ``bn_p_backward``: BN_p's training backward through drop-path (the first pass of the fused backward,
  backward_reference.bn_p_backward_reference), on (P, K) rows. Three launches in bn_residual's pattern:
  ``_bn_grad_partials_kernel`` (per pixel split, per channel: sum dob and sum dob o_hat, dob = d_n dout,
  o_hat = (o - mean) rstd; o_hat is centred at the batch mean already, so no shift), the weight
  gradients' reduction (gconv.launcher.reduce_partials: dgamma, dbeta, the splits summed in a fixed
  order) and ``_bn_grad_apply_kernel`` (do = gamma rstd (dob - dbeta / P - o_hat dgamma / P), one rounding
  to dout's dtype). The apply stays a launch of its own: formed instead per tile in the first pass over d
  (gate_backward's MODE 0, its channel chunks reading dout and o in do's place, chunk 0 writing do), that
  pass's static estimate (sm_90, Small, batch 128, fp16, high end) rose from 44.2 to 80.6 us at 16x16
  (L2-bound: o re-read by the other 7 chunks) against the apply's 19.9 (12.9 -> 23.8 at 8x8 against 6.0;
  stride 2, stages.4.0: 12.3 -> 21.4 against 6.0), and its compile took 255 registers and 16 B of stack.

Splits: pixel ranges of whole tiles, at least ``MIN_TILES`` tiles each, as many as fill the GPU's SMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import MAXNREG, cdiv, device_info, launch, next_power_of_2
from .._scalars import fp32
from ..gconv.launcher import reduce_partials
from .moments import bn_batch_tail, stats_out

GRAM_BLOCK = 128  # Gram block side of a program (channels; C <= 256: at most 2 x 2 blocks, 3 computed)
GRAM_PIXELS = 64  # pixels per step (the dot's K)
GRAM_WARPS = 8
GRAM_STAGES = 3
MERGE_TILE = 16  # Gram tile side per merge program
MERGE_SPLITS = 32  # splits per step of the Gram merge
STAT_PIXELS = 64  # pixels per step of the BN_p statistics (all K channels)
APPLY_PIXELS = 32  # pixels per program of the apply
MERGE_CHANNELS = 16  # channels per program of BN_p's merge
STAT_SPLITS = 64  # splits per step of BN_p's gradient reduction (bn_p_backward)
BN_MERGE_SPLITS = 128  # splits per step of BN_p's merge (one step at 128 splits)
MIN_TILES = 2  # the fewest tiles per split


def _splits(m: int, tile: int, want: int) -> tuple[int, int]:
    """(number of splits, pixels per split): whole tiles, >= MIN_TILES of them per split unless there are
    fewer, about ``want`` splits, none empty."""
    tiles = cdiv(m, tile)
    per = max(min(MIN_TILES, tiles), cdiv(tiles, max(1, want)))
    return cdiv(tiles, per), per * tile


@triton.jit
def _pixel_offsets(m, HW, W, sn, sh, sw, FLAT: tl.constexpr = False):
    """The offset of pixels ``m`` (flat over N, H, W) in an NHWC-strided tensor; ``FLAT`` (``_flat``: the
    pixels at one stride, as in a channels-last tensor) skips the integer divisions."""
    if FLAT:
        return m * sw
    n = m // HW
    p = m % HW
    return n * sn + (p // W) * sh + (p % W) * sw


def _flat(t: torch.Tensor) -> bool:
    """Whether pixel m of ``t`` (N, C, H, W) lies at m * stride(3) (``_pixel_offsets``' FLAT)."""
    n, _, h, w = t.shape
    sn, _, sh, sw = t.stride()
    return (h == 1 or sh == w * sw) and (n == 1 or sn == h * w * sw)


# ------------------------------------------------------------------------------------------ x moments


@triton.jit
def _centred_tile(x_ptr, m0, end, c, c_ok, shift, HW, W, sn, sc, sh, sw, FLAT: tl.constexpr, BM: tl.constexpr,
                  MASK_M: tl.constexpr, MASK_C: tl.constexpr):
    """x - shift over pixels m0 .. m0 + BM (rows from ``end`` on zero: MASK_M) and channels ``c`` (those past
    C zero: MASK_C), in x's dtype. Without the masks, no select."""
    m = m0 + tl.arange(0, BM)
    ptr = x_ptr + _pixel_offsets(m, HW, W, sn, sh, sw, FLAT)[:, None] + c[None, :] * sc
    if MASK_M:
        ok = (m < end)[:, None] & c_ok[None, :]
        d = tl.where(ok, tl.load(ptr, mask=ok, other=0.0) - shift[None, :], 0.0)
    elif MASK_C:
        d = tl.load(ptr, mask=c_ok[None, :], other=0.0) - shift[None, :]
    else:
        d = tl.load(ptr) - shift[None, :]
    return d.to(x_ptr.dtype.element_ty)


@triton.jit
def _gram_partials_kernel(x_ptr, part_ptr, mean_ptr, M, C, HW, W, CH, sn, sc, sh, sw,
                          NB: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
                          FLAT: tl.constexpr, MASK_C: tl.constexpr, TAIL: tl.constexpr):
    """Program (b, s): Gram block b (upper triangle, row-major) over the pixels of split s: writes
    part[s, I, J] = sum (x_I - m_I)(x_J - m_J)^T over the split, m its mean; diagonal blocks write
    mean[s, I]. The split's whole tiles unmasked (``MASK_C``: C < NB BC), then its short last tile (``TAIL``:
    M not a multiple of BM, only then compiled)."""
    dt = x_ptr.dtype.element_ty
    b = tl.program_id(0)
    s = tl.program_id(1)
    bi = b * 0
    for i in tl.static_range(1, NB):
        bi = tl.where(b >= i * NB - (i * (i - 1)) // 2, i, bi)
    bj = b - (bi * NB - (bi * (bi - 1)) // 2) + bi
    ci = bi * BC + tl.arange(0, BC)
    cj = bj * BC + tl.arange(0, BC)
    i_ok = ci < C
    j_ok = cj < C
    start = s * CH
    end = tl.minimum(start + CH, M)
    count = (end - start).to(tl.float32)
    # the shift: the split's first tile's mean, rounded to x's dtype (the centred values are exact-ish)
    zero = tl.zeros((BC,), dtype=dt)
    first = tl.minimum(end - start, BM).to(tl.float32)
    xi = _centred_tile(x_ptr, start, end, ci, i_ok, zero, HW, W, sn, sc, sh, sw, FLAT, BM, True, MASK_C)
    xj = _centred_tile(x_ptr, start, end, cj, j_ok, zero, HW, W, sn, sc, sh, sw, FLAT, BM, True, MASK_C)
    shift_i = (tl.sum(xi.to(tl.float32), axis=0) / first).to(dt)
    shift_j = (tl.sum(xj.to(tl.float32), axis=0) / first).to(dt)
    acc = tl.zeros((BC, BC), dtype=tl.float32)
    # the pixel sums of d on the tensor cores too (d times a one-hot column: exact products, fp32 sums),
    # reduced across threads once after the loop instead of once a tile
    col = tl.arange(0, 16)
    e_i = tl.zeros((BM, 16), dtype=dt) + (col == 0)[None, :].to(dt)
    e_j = tl.zeros((16, BM), dtype=dt) + (col == 0)[:, None].to(dt)
    s_i = tl.zeros((BC, 16), dtype=tl.float32)
    s_j = tl.zeros((16, BC), dtype=tl.float32)
    whole = start + (end - start) // BM * BM
    for m0 in range(start, whole, BM):
        di_t = tl.trans(_centred_tile(x_ptr, m0, end, ci, i_ok, shift_i, HW, W, sn, sc, sh, sw, FLAT, BM,
                                      False, MASK_C))
        dj = _centred_tile(x_ptr, m0, end, cj, j_ok, shift_j, HW, W, sn, sc, sh, sw, FLAT, BM, False, MASK_C)
        acc = tl.dot(di_t, dj, acc, input_precision=PREC)
        s_i = tl.dot(di_t, e_i, s_i, input_precision=PREC)
        s_j = tl.dot(e_j, dj, s_j, input_precision=PREC)
    if TAIL and whole < end:
        di_t = tl.trans(_centred_tile(x_ptr, whole, end, ci, i_ok, shift_i, HW, W, sn, sc, sh, sw, FLAT, BM,
                                      True, MASK_C))
        dj = _centred_tile(x_ptr, whole, end, cj, j_ok, shift_j, HW, W, sn, sc, sh, sw, FLAT, BM, True,
                           MASK_C)
        acc = tl.dot(di_t, dj, acc, input_precision=PREC)
        s_i = tl.dot(di_t, e_i, s_i, input_precision=PREC)
        s_j = tl.dot(e_j, dj, s_j, input_precision=PREC)
    sum_i = tl.sum(s_i, axis=1)
    sum_j = tl.sum(s_j, axis=0)
    # centred at the split's mean: sum d d^T - (sum d)(sum d)^T / n (d = x - shift; sum d / n is small)
    acc -= sum_i[:, None] * (sum_j / count)[None, :]
    tl.store(part_ptr + s * C * C + ci[:, None] * C + cj[None, :], acc, mask=i_ok[:, None] & j_ok[None, :])
    if bi == bj:
        tl.store(mean_ptr + s * C + ci, shift_i.to(tl.float32) + sum_i / count, mask=i_ok)


@triton.jit
def _gram_merge_kernel(part_ptr, mean_ptr, gram_ptr, xmean_ptr, M, C, CH, S, BC: tl.constexpr,
                       BT: tl.constexpr, BS: tl.constexpr):
    """Gram tile (I, J) of the whole batch from the splits' (Chan's rule; BS splits per step, summed in a
    fixed order); the lower triangle's blocks read transposed from the upper's. Programs on the diagonal
    write x's mean."""
    ti = tl.program_id(0)
    tj = tl.program_id(1)
    ci = ti * BT + tl.arange(0, BT)
    cj = tj * BT + tl.arange(0, BT)
    i_ok = ci < C
    j_ok = cj < C
    # the stored block of (I, J): row-major in the upper triangle of BC blocks, transposed below it
    up = ((ti * BT) // BC <= (tj * BT) // BC).to(tl.int32)
    rs = up * C + (1 - up)
    cs = up + (1 - up) * C
    sp = tl.arange(0, BS)
    mi = tl.zeros((BT,), dtype=tl.float32)
    mj = tl.zeros((BT,), dtype=tl.float32)
    for s0 in range(0, S, BS):
        s = s0 + sp
        s_ok = s < S
        n_s = tl.where(s_ok, tl.minimum(CH, M - s * CH), 0).to(tl.float32)
        mi += tl.sum(n_s[:, None] * tl.load(mean_ptr + s[:, None] * C + ci[None, :],
                                            mask=s_ok[:, None] & i_ok[None, :], other=0.0), axis=0)
        mj += tl.sum(n_s[:, None] * tl.load(mean_ptr + s[:, None] * C + cj[None, :],
                                            mask=s_ok[:, None] & j_ok[None, :], other=0.0), axis=0)
    mi = mi / tl.cast(M, tl.float32)
    mj = mj / tl.cast(M, tl.float32)
    g = tl.zeros((BT, BT), dtype=tl.float32)
    for s0 in range(0, S, BS):
        s = s0 + sp
        s_ok = s < S
        n_s = tl.where(s_ok, tl.minimum(CH, M - s * CH), 0).to(tl.float32)
        di = tl.load(mean_ptr + s[:, None] * C + ci[None, :], mask=s_ok[:, None] & i_ok[None, :], other=0.0)
        dj = tl.load(mean_ptr + s[:, None] * C + cj[None, :], mask=s_ok[:, None] & j_ok[None, :], other=0.0)
        di = n_s[:, None] * (di - mi[None, :])
        dj = dj - mj[None, :]
        ok = s_ok[:, None, None] & i_ok[None, :, None] & j_ok[None, None, :]
        blk = tl.load(part_ptr + s[:, None, None] * C * C + ci[None, :, None] * rs + cj[None, None, :] * cs,
                      mask=ok, other=0.0)
        g += tl.sum(blk + di[:, :, None] * dj[:, None, :], axis=0)
    tl.store(gram_ptr + ci[:, None] * C + cj[None, :], g, mask=i_ok[:, None] & j_ok[None, :])
    if ti == tj:
        tl.store(xmean_ptr + ci, mi, mask=i_ok)


def x_moments(x: torch.Tensor, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's per-channel mean (C,), the Gram matrix of x centred there (C, C)), both fp32, for x (N, C, H, W)
    of any strides (channels-last reads whole rows) with more than one pixel; the mean into ``mean``
    (contiguous fp32) where given."""
    n, c, h, w = x.shape
    m = n * h * w
    if m < 2:
        raise ValueError("x_moments: BatchNorm in training needs more than one value per channel")
    bc = min(GRAM_BLOCK, max(16, next_power_of_2(c)))
    nb = cdiv(c, bc)
    blocks = nb * (nb + 1) // 2
    splits, ch = _splits(m, GRAM_PIXELS, device_info(x.device).sms // blocks)
    part = torch.empty((splits, c, c), device=x.device, dtype=torch.float32)
    smean = torch.empty((splits, c), device=x.device, dtype=torch.float32)
    gram = torch.empty((c, c), device=x.device, dtype=torch.float32)
    mean = torch.empty((c,), device=x.device, dtype=torch.float32) if mean is None else mean
    sn, sc, sh, sw = x.stride()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # 16-bit operands ignore it
    eb = x.element_size()
    launch(_gram_partials_kernel, (blocks, splits), x, part, smean, m, c, h * w, w, ch, sn, sc, sh, sw,
           cost=lambda: _gram_partials_cost(m, c, bc, nb, splits, ch, eb),
           NB=nb, BC=bc, BM=GRAM_PIXELS, PREC=prec, FLAT=_flat(x), MASK_C=c % bc != 0,
           TAIL=m % GRAM_PIXELS != 0,
           num_warps=GRAM_WARPS, num_stages=GRAM_STAGES)
    bt = min(MERGE_TILE, bc)
    tiles = cdiv(c, bt)
    launch(_gram_merge_kernel, (tiles, tiles), part, smean, gram, mean, m, c, ch, splits,
           cost=lambda: _gram_merge_cost(c, bc, nb, splits, tiles), BC=bc, BT=bt, BS=MERGE_SPLITS,
           num_warps=4)
    return mean, gram


def _gram_partials_cost(m: int, c: int, bc: int, nb: int, splits: int, ch: int, eb: int) -> KernelCost:
    """x read once from DRAM; each further read of a pixel tile by the other blocks' programs of its split
    (adjacent in the grid) from L2; the splits' Gram blocks and means written. The dots as issued:
    BC x BC x BM per tile and the pixel sums' two BC x 16 x BM, the first tile loaded twice (the shift)."""
    blocks = nb * (nb + 1) // 2
    tiles = cdiv(m, GRAM_PIXELS)
    mma = blocks * tiles * (bc + 32) * bc * GRAM_PIXELS
    reads = blocks * (tiles + splits) * GRAM_PIXELS * 2 * bc * eb
    dram = m * c * eb + splits * (blocks * bc * bc + c) * 4
    return KernelCost(m * c * (c + 1) // 2, mma, dram, (Loop("pixel tiles", cdiv(ch, GRAM_PIXELS)),),
                      l2_bytes=max(0, reads - m * c * eb),
                      note="x's centred Gram blocks per pixel split (BN_e's input statistics)")


def _gram_merge_cost(c: int, bc: int, nb: int, splits: int, tiles: int) -> KernelCost:
    """The splits' stored Gram blocks (the upper triangle) read once from DRAM, the lower triangle's tiles
    a second time (transposed, by the programs below the diagonal, in the same wave: L2); their means
    by every program of a row and column (L2); the Gram matrix and mean written."""
    side = [min(bc, c - i * bc) for i in range(nb)]
    stored = sum(side[i] * side[j] for i in range(nb) for j in range(i, nb))
    dram = splits * (stored + c) * 4 + (c * c + c) * 4
    steps = cdiv(splits, MERGE_SPLITS)
    return KernelCost(splits * c * c, 0, dram, (Loop("splits", steps), Loop("splits again", steps)),
                      l2_bytes=tiles * tiles * splits * 2 * 2 * (c // tiles) * 4
                      + splits * (c * c - stored) * 4,
                      note="Chan's merge of the Gram partials")


# ------------------------------------------------------------------------------------------ BN_p


@triton.jit
def _channel_partials_kernel(o_ptr, part_ptr, M, K, HW, W, CH, sn, sc, sh, sw, BK: tl.constexpr,
                             BM: tl.constexpr, FLAT: tl.constexpr):
    """Split s: per channel the mean of o over its pixels and the sum of squares about it, as
    part[s, 0] and part[s, 1] (centred at the first tile's mean, in fp32)."""
    s = tl.program_id(0)
    k = tl.arange(0, BK)
    k_ok = k < K
    start = s * CH
    end = tl.minimum(start + CH, M)
    count = (end - start).to(tl.float32)
    m = start + tl.arange(0, BM)
    m_ok = m < end
    ok = m_ok[:, None] & k_ok[None, :]
    v = tl.load(o_ptr + _pixel_offsets(m, HW, W, sn, sh, sw, FLAT)[:, None] + k[None, :] * sc, mask=ok,
                other=0.0)
    shift = tl.sum(v.to(tl.float32), axis=0) / tl.minimum(end - start, BM).to(tl.float32)
    s1 = tl.zeros((BK,), dtype=tl.float32)
    s2 = tl.zeros((BK,), dtype=tl.float32)
    for m0 in range(start, end, BM):
        m = m0 + tl.arange(0, BM)
        ok = (m < end)[:, None] & k_ok[None, :]
        v = tl.load(o_ptr + _pixel_offsets(m, HW, W, sn, sh, sw, FLAT)[:, None] + k[None, :] * sc, mask=ok,
                    other=0.0)
        d = tl.where(ok, v.to(tl.float32) - shift[None, :], 0.0)
        s1 += tl.sum(d, axis=0)
        s2 += tl.sum(d * d, axis=0)
    tl.store(part_ptr + s * 2 * K + k, shift + s1 / count, mask=k_ok)
    tl.store(part_ptr + s * 2 * K + K + k, s2 - s1 * (s1 / count), mask=k_ok)


@triton.jit
def _bn_merge_kernel(part_ptr, gamma_ptr, beta_ptr, rm_ptr, rv_ptr, ss_ptr, st_ptr, M, K, CH, S, f, eps,
                     BK: tl.constexpr, BS: tl.constexpr):
    """BN_p's batch statistics from the splits' (Chan's rule; BS splits per step, summed in a fixed
    order): ss[0] = scale, ss[1] = bias; the running statistics updated (unbiased variance)."""
    f, eps = fp32(f), fp32(eps)  # fp64 under torch.compile
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    k_ok = k < K
    sp = tl.arange(0, BS)
    mf = tl.cast(M, tl.float32)
    mean = tl.zeros((BK,), dtype=tl.float32)
    m2 = tl.zeros((BK,), dtype=tl.float32)
    for s0 in range(0, S, BS):  # one pass: each step's splits merged, then into the running pair (Chan)
        s = s0 + sp
        s_ok = s < S
        ok = s_ok[:, None] & k_ok[None, :]
        n_s = tl.where(s_ok, tl.minimum(CH, M - s * CH), 0).to(tl.float32)
        ms = tl.load(part_ptr + (s * 2 * K)[:, None] + k[None, :], mask=ok, other=0.0)
        m2s = tl.load(part_ptr + (s * 2 * K + K)[:, None] + k[None, :], mask=ok, other=0.0)
        na = tl.minimum(s0 * CH, M).to(tl.float32)  # pixels merged so far
        nb = tl.sum(n_s, axis=0)
        mean_b = tl.sum(n_s[:, None] * ms, axis=0) / nb
        d = ms - mean_b[None, :]
        m2_b = tl.sum(m2s + n_s[:, None] * d * d, axis=0)
        delta = mean_b - mean
        mean += delta * (nb / (na + nb))
        m2 += m2_b + delta * delta * (na * nb / (na + nb))
    var = tl.maximum(m2 / mf, 0.0)
    # the batch statistics and the running update as BN_e's and BN_d's; scale and bias for the apply pass
    rstd = bn_batch_tail(k, k_ok, mean, var, rm_ptr, rv_ptr, st_ptr, K, f, mf / (mf - 1.0), eps)
    scale = tl.load(gamma_ptr + k, mask=k_ok, other=0.0).to(tl.float32) * rstd
    tl.store(ss_ptr + k, scale, mask=k_ok)
    tl.store(ss_ptr + K + k, tl.load(beta_ptr + k, mask=k_ok, other=0.0).to(tl.float32) - mean * scale,
             mask=k_ok)


@triton.jit
def _bn_apply_kernel(o_ptr, out_ptr, x_ptr, drop_ptr, ss_ptr, M, K, HW, W, so_n, so_c, so_h, so_w, sx_n, sx_c,
                     sx_h, sx_w, RESIDUAL: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    """out <- x + d_n (o scale + bias) (RESIDUAL), o scale + bias otherwise; one rounding to o's dtype.
    ``out`` has o's strides (it may be o)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.arange(0, BK)
    k_ok = k < K
    ok = (m < M)[:, None] & k_ok[None, :]
    off = _pixel_offsets(m, HW, W, so_n, so_h, so_w)[:, None] + k[None, :] * so_c
    scale = tl.load(ss_ptr + k, mask=k_ok, other=0.0)
    bias = tl.load(ss_ptr + K + k, mask=k_ok, other=0.0)
    y = tl.load(o_ptr + off, mask=ok, other=0.0).to(tl.float32) * scale[None, :] + bias[None, :]
    if RESIDUAL:
        d = tl.load(drop_ptr + m // HW, mask=m < M, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + _pixel_offsets(m, HW, W, sx_n, sx_h, sx_w)[:, None] + k[None, :] * sx_c, mask=ok,
                     other=0.0)
        y = xv.to(tl.float32) + d[:, None] * y
    tl.store(out_ptr + off, y.to(o_ptr.dtype.element_ty), mask=ok)


def bn_residual(o: torch.Tensor, x: torch.Tensor | None, drop: torch.Tensor, gamma: torch.Tensor,
                beta: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, f: float,
                eps: float, stats: torch.Tensor | None = None, keep_o: bool = False) -> torch.Tensor:
    """Training-mode BatchNorm of ``o`` (N, K, OH, OW; any strides, channels-last reads whole rows) with
    ``gamma``, ``beta``, then, with ``x`` (the block's input, o's shape, any strides),
    ``x + drop[n] * bn(o)``; written over ``o`` (``keep_o``: to a new tensor of o's strides), returned. The
    running statistics updated in place with factor ``f`` (nn.BatchNorm2d's rule), the batch mean and rstd
    written to ``stats`` ((2, K) fp32) when given."""
    n, k, h, w = o.shape
    if x is not None and x.shape != o.shape:
        raise ValueError(f"bn_residual: x {tuple(x.shape)} and o {tuple(o.shape)} differ")
    m = n * h * w
    if m < 2:
        raise ValueError("bn_residual: BatchNorm in training needs more than one value per channel")
    bk = max(16, next_power_of_2(k))
    splits, ch = _splits(m, STAT_PIXELS, device_info(o.device).sms)
    part = torch.empty((splits, 2, k), device=o.device, dtype=torch.float32)
    ss = torch.empty((2, k), device=o.device, dtype=torch.float32)
    st = stats_out(stats, k, o.device)
    out = torch.empty_like(o) if keep_o else o
    eb = o.element_size()
    launch(_channel_partials_kernel, (splits,), o, part, m, k, h * w, w, ch, *_nhwc(o), BK=bk, BM=STAT_PIXELS,
           FLAT=_flat(o),
           cost=lambda: KernelCost(0, 0, m * k * eb + splits * 2 * k * 4,
                                   (Loop("pixel tiles", cdiv(ch, STAT_PIXELS)),),
                                   l2_bytes=splits * STAT_PIXELS * k * eb,
                                   note="BN_p statistics per pixel split"),
           num_warps=4)
    bm = min(MERGE_CHANNELS, bk)
    steps = cdiv(splits, BN_MERGE_SPLITS)
    launch(_bn_merge_kernel, (cdiv(k, bm),), part, gamma, beta, running_mean, running_var, ss, st, m,
           k, ch, splits, f, eps, BK=bm, BS=BN_MERGE_SPLITS,
           cost=lambda: KernelCost(0, 0, splits * 2 * k * 4 + 2 * k * 4 + 8 * k * 4,
                                   (Loop("splits", steps),),
                                   note="Chan's merge of BN_p's partials; running update"),
           # one warp (was 4): a short merge, 3.1 -> 2.1 us (static, sm_90), no stack; maxnreg
           # (_launch.MAXNREG): Small's 36 blocks 0.074 -> 0.069 ms (sm_90), 0.094 -> 0.071 (sm_80)
           num_warps=1, maxnreg=MAXNREG)
    res = x if x is not None else o
    launch(_bn_apply_kernel, (cdiv(m, APPLY_PIXELS),), o, out, res, drop, ss, m, k, h * w, w,
           *_nhwc(o), *_nhwc(res), RESIDUAL=x is not None, BK=bk, BM=APPLY_PIXELS,
           cost=lambda: KernelCost(0, 0, m * k * eb * (3 if x is not None else 2) + 2 * k * 4 + n * 4,
                                   note="BN_p normalise (+ drop-path and residual)"),
           num_warps=2)  # two warps (was 4): Small's 36 blocks 0.546 -> 0.459 ms (static, sm_90), no stack
    return out


# ------------------------------------------------------------------------------------------ BN_p backward


@triton.jit
def _bn_grad_partials_kernel(dout_ptr, o_ptr, drop_ptr, mean_ptr, rstd_ptr, part_ptr, M, K, HW, CH,
                             BK: tl.constexpr, BM: tl.constexpr):
    """Split s: per channel, over its rows, sum dob and sum dob o_hat (dob = drop[image] dout, o_hat =
    (o - mean) rstd) as part[s, 0] and part[s, 1], fp32."""
    s = tl.program_id(0)
    k = tl.arange(0, BK)
    k_ok = k < K
    mean = tl.load(mean_ptr + k, mask=k_ok, other=0.0)
    rstd = tl.load(rstd_ptr + k, mask=k_ok, other=0.0)
    start = s * CH
    end = tl.minimum(start + CH, M)
    s1 = tl.zeros((BK,), dtype=tl.float32)
    s2 = tl.zeros((BK,), dtype=tl.float32)
    for m0 in range(start, end, BM):
        m = m0 + tl.arange(0, BM)
        m_ok = m < end
        ok = m_ok[:, None] & k_ok[None, :]
        off = m[:, None] * K + k[None, :]
        d = tl.load(drop_ptr + m // HW, mask=m_ok, other=0.0).to(tl.float32)
        dob = d[:, None] * tl.load(dout_ptr + off, mask=ok, other=0.0).to(tl.float32)
        o_hat = (tl.load(o_ptr + off, mask=ok, other=0.0).to(tl.float32) - mean[None, :]) * rstd[None, :]
        s1 += tl.sum(dob, axis=0)
        s2 += tl.sum(dob * o_hat, axis=0)
    tl.store(part_ptr + s * 2 * K + k, s1, mask=k_ok)
    tl.store(part_ptr + s * 2 * K + K + k, s2, mask=k_ok)


@triton.jit
def _bn_grad_apply_kernel(dout_ptr, o_ptr, drop_ptr, mean_ptr, rstd_ptr, gamma_ptr, dgamma_ptr, dbeta_ptr,
                          do_ptr, M, K, HW, BK: tl.constexpr, BM: tl.constexpr):
    """do = gamma rstd (dob - dbeta / M - o_hat dgamma / M); one rounding to dout's dtype."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < M
    k = tl.arange(0, BK)
    k_ok = k < K
    ok = m_ok[:, None] & k_ok[None, :]
    off = m[:, None] * K + k[None, :]
    mf = tl.cast(M, tl.float32)
    mean = tl.load(mean_ptr + k, mask=k_ok, other=0.0)
    rstd = tl.load(rstd_ptr + k, mask=k_ok, other=0.0)
    scale = tl.load(gamma_ptr + k, mask=k_ok, other=0.0).to(tl.float32) * rstd
    dgamma_m = tl.load(dgamma_ptr + k, mask=k_ok, other=0.0) / mf
    dbeta_m = tl.load(dbeta_ptr + k, mask=k_ok, other=0.0) / mf
    d = tl.load(drop_ptr + m // HW, mask=m_ok, other=0.0).to(tl.float32)
    dob = d[:, None] * tl.load(dout_ptr + off, mask=ok, other=0.0).to(tl.float32)
    o_hat = (tl.load(o_ptr + off, mask=ok, other=0.0).to(tl.float32) - mean[None, :]) * rstd[None, :]
    do = scale[None, :] * (dob - dbeta_m[None, :] - o_hat * dgamma_m[None, :])
    tl.store(do_ptr + off, do.to(do_ptr.dtype.element_ty), mask=ok)


def _check_bn_p_backward(dout, o, mean_p, rstd_p, gamma_p, drop, n) -> None:
    def fail(msg: str):
        raise ValueError(f"bn_p_backward: {msg}")

    if dout.dim() != 2 or not dout.is_contiguous() or o.shape != dout.shape or not o.is_contiguous():
        fail(f"dout {tuple(dout.shape)} and o {tuple(o.shape)} must be one row-major contiguous (P, K) shape")
    if dout.dtype not in (torch.float32, torch.float16, torch.bfloat16) or o.dtype != dout.dtype:
        fail(f"dout ({dout.dtype}) and o ({o.dtype}) must share one of fp32, fp16, bf16")
    m, k = dout.shape
    if n < 1 or m < 1 or m % n:
        fail(f"{m} rows are not {n} images of equal size")
    for name, t, size in (("mean_p", mean_p, k), ("rstd_p", rstd_p, k), ("gamma_p", gamma_p, k),
                          ("drop", drop, n)):
        if t.shape != (size,) or not t.is_contiguous():
            fail(f"{name} {tuple(t.shape)} must be a contiguous ({size},) vector")
        if t.device != dout.device:
            fail(f"{name} is on {t.device}, dout on {dout.device}")
    if mean_p.dtype != torch.float32 or rstd_p.dtype != torch.float32:
        fail(f"mean_p ({mean_p.dtype}) and rstd_p ({rstd_p.dtype}) must be fp32")
    for name, t in (("gamma_p", gamma_p), ("drop", drop)):
        if t.dtype not in (torch.float32, dout.dtype):
            fail(f"{name} ({t.dtype}) must be fp32 or dout's dtype ({dout.dtype})")
    if o.device != dout.device:
        fail(f"o is on {o.device}, dout on {dout.device}")


def bn_p_backward(dout: torch.Tensor, o: torch.Tensor, mean_p: torch.Tensor, rstd_p: torch.Tensor,
                  gamma_p: torch.Tensor, drop: torch.Tensor, n: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BN_p's backward through drop-path (backward_reference.bn_p_backward_reference): (do (P, K) in dout's
    dtype, dgamma_p (K,), dbeta_p (K,) fp32) for dout, o (P, K) row-major rows of ``n`` images, BN_p's
    batch mean and rstd (K,) fp32, gamma_p (K,), drop (n,) the per-image drop-path scale. Three launches:
    per pixel split the sums of dob and dob o_hat, their fixed-order merge, the apply pass."""
    _check_bn_p_backward(dout, o, mean_p, rstd_p, gamma_p, drop, n)
    m, k = dout.shape
    hw = m // n
    bk = max(16, next_power_of_2(k))
    splits, ch = _splits(m, STAT_PIXELS, device_info(dout.device).sms)
    part = torch.empty((splits, 2, k), device=dout.device, dtype=torch.float32)
    dgamma = torch.empty((k,), device=dout.device, dtype=torch.float32)
    dbeta = torch.empty((k,), device=dout.device, dtype=torch.float32)
    do = torch.empty_like(dout)
    eb = dout.element_size()
    vec = 2 * k * 4 + n * drop.element_size()  # mean, rstd, drop
    launch(_bn_grad_partials_kernel, (splits,), dout, o, drop, mean_p, rstd_p, part, m, k, hw, ch, BK=bk,
           BM=STAT_PIXELS,
           cost=lambda: KernelCost(0, 0, 2 * m * k * eb + vec + splits * 2 * k * 4,
                                   (Loop("pixel tiles", cdiv(ch, STAT_PIXELS)),),
                                   note="BN_p backward: sum dob, sum dob o_hat per pixel split"),
           num_warps=4)
    # a split's partials are (sum dob, sum dob o_hat) = (dbeta, dgamma): K columns to each
    reduce_partials(part, dbeta, splits, 2 * k, block=2 * min(MERGE_CHANNELS, bk), sb=STAT_SPLITS,
                    out2=dgamma, what="BN_p backward: fixed-order merge of the partials (dbeta, dgamma)")
    launch(_bn_grad_apply_kernel, (cdiv(m, APPLY_PIXELS),), dout, o, drop, mean_p, rstd_p, gamma_p,
           dgamma, dbeta, do, m, k, hw, BK=bk, BM=APPLY_PIXELS,
           cost=lambda: KernelCost(0, 0, 3 * m * k * eb + vec + k * gamma_p.element_size() + 2 * k * 4,
                                   note="BN_p backward: do from dob, o_hat, dgamma, dbeta"),
           num_warps=4)
    return do, dgamma, dbeta


def _nhwc(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(n, c, h, w) strides."""
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)
