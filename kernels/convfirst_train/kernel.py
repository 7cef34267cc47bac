"""Triton kernels of the ConvFirst stride-1 training block (reference.py is the specification; the
launcher in launcher.py picks tiles and shares and declares costs; the per-channel arithmetic between
the passes runs in the finalize kernels of finalize.py). The grouped 3x3 conv, its dgrad and wgrad are
the gconv kernels (kernels/gconv).

Passes (M = N x H x W pixels, rows of the NHWC maps; C block channels, R = t C hidden)
------------------------------------------------------------------------------------------
Forward
  1. gconv forward: a = gconv(x), stored (narrow, C channels: kept for the backward).
  2. ``_moments_kernel`` (COV): per share of row tiles, the mean and the centred C x C second moment
     of a (one [C, BM] x [BM, C] dot per tile). ``_merge_moments_kernel`` merges the shares (Chan's
     formula) into BN1's mean and variance and the covariance of a, from which
     ``_linear_moments_kernel`` gives BN2's statistics exactly: y = k1 a + t1 is affine, so mean(z) =
     W1 mean(y) and var(z) = diag(W1 Cov(y) W1^T). No pass over the wide z.
  3. ``_ffn_fwd_kernel``: per tile of BM rows of its share, y = k1 a + t1, then over hidden chunks of
     BH: h = ReLU(k2 (y W1^T) + t2) and p += h W2^T; p stored (narrow) with the share's mean and
     centred second moment per channel (BN3's statistics, merged by ``_merge_moments_kernel``). 16-bit
     on sm_90 and later (launcher.RESIDENT_FFN): the FFN launch of inference's staged blocks instead
     (kernels/convfirst/staged.py ``ffn_train_forward``: persistent programs, the chunks' weights
     resident in shared memory up to C = 64), on k2 W1 (BN2 folded into the expand's rows, rounded
     once) and W2 in the activation dtype, which ``_linear_moments_kernel`` writes beside BN2's
     statistics; the same moments (``merge_tile_moments``).
  4. ``_residual_kernel``: out = x + d_n (k3 p + t3); ``_bn_running_kernel`` updates the three running
     statistics in place (a separate op: the block's op is functional).
Backward (dout given)
  5. ``_out_sums_kernel``: per share, sum dq and sum dq p_hat (dq = d_n dout): BN3's dbeta, dgamma,
     finished with every BatchNorm's r, k, t by ``_bn_terms_kernel``.
  6. ``_prep_kernel``: y = k1 a + t1 and dp = k3 dq + w3 p + c3 (BN3's backward, kernels/_batchnorm.py),
     each stored once in the activation dtype (narrow): the two inputs of the FFN's backward passes.
  7. ``_ffn_bwd_weights_kernel``, grid (shares, hidden chunks): per tile of the share, recompute z and
     h of the chunk; dh = dp W2[:, chunk]; dzn = dh [zn > 0]; accumulate dW2[:, chunk] += dp^T h,
     G[chunk] += dzn^T y, and the chunk's sum of dzn (BN2's dbeta). BN2's dgamma, the sum of dzn z_hat,
     needs no reduction of its own: z = y W1^T, so sum_m dzn (z - m2) = rowsum(W1 * G) - m2 sum dzn,
     which the finalize forms from G (whose dzn are rounded to the activation dtype, as a layer-wise
     network's BatchNorm backward receives them; the sum of dzn is of the fp32 values). Its per-tile
     reduction cost the pass 110 us of Small's 505-564 at C = 64 (static estimate, batch 128, sm_90). DZZ
     (two-part inputs, C = 96, whose pass sits at 255 registers and spilled 16 B without the sum, and at
     BH = 16 was predicted slower): the sum in the loop as before. The weight
     gradient partials are written per share (fp32, one row per share), summed in a fixed order by the
     gconv wgrad reduction and finished by ``_ffn_weights_finalize_kernel``. dW1 needs
     dz = k2 dzn + u2 + w2 (z - m2), whose u2, w2 need the sums over the whole batch; it is linear in
     dzn, so dW1 = k2 G + u2 sum(y)^T + w2 (z - m2)^T y, and (z - m2)^T y = M W1 Cov(y) + M (W1 mean(y)
     - m2) mean(y)^T comes from the forward's statistics of a: no second pass.
  8. ``_ffn_bwd_input_kernel``: per tile of its share, over all chunks: recompute z, dzn, dz; dy +=
     dz W1[chunk]; dy stored (narrow) with the share's sums of dy and dy a_hat (BN1's dbeta, dgamma,
     finished by ``_bn_terms_kernel``).
  9. ``_bn_input_grad_kernel``: da = k1 dy + u1 + w1 (a - m1), stored (narrow).
 10. gconv dgrad and wgrad in one launch over da's windows (gconv's fused backward), dout added to dx
     before its store (dx = dout + dgrad(da)); wgrad's deterministic two-stage reduction.

Stored for the backward: x (the block's input), a and p (C channels each) and per-channel statistics.
The wide activations (z, h, R = 3-6 C channels) never reach memory: pass 3 computes them once, passes
7 and 8 recompute them (2 + 7 CR MACs per pixel in all, against 2 + 4 for a layer-wise network that
stores and re-reads them).

Tiles
-----
A program's rows are BM consecutive pixels of the flat (M, C) view (the 1x1 layers and BatchNorm are
per pixel, so no halo). Channels are padded to CP, a power of two >= 16 (tl.dot), masked on load and
store; hidden chunks of BH are masked past R. The weights pass takes its channels in two parts instead
(launcher.channel_parts: CIA + CIB input, COA + COB output, each a power of two; a part of width 0 is
absent): at C = 96, 64 + 32 rather than 128 with a quarter masked, so its loads, dots and accumulators,
repeated once per hidden chunk, carry no padding; the forward FFN pass takes the same parts. The
weight-gradient dots of a 32-channel part have M = 32 (mma.sync), the others stay on wgmma. Partial
statistics per share (a run of TILES_PER_SHARE consecutive tiles) keep every reduction in a fixed
order: two identical calls give bitwise-equal results. Every dot accumulates in fp32; y, h, dp, dz and
dzn enter dots in the activation dtype (where a layer-wise network has them), fp32 activations use
3xTF32 on a GPU.

Stride 2 (C -> K, no residual)
------------------------------
a = gconv(x) and BN1 at full resolution; ``_blur_cat_kernel`` writes u = BlurPool(cat[x, BN1(a)]) (2C
channels at half resolution, stored: the FFN's input); the FFN passes above run 2C -> 6C -> K on u
(BN2's statistics from u's covariance), BN3 without residual. Backward: the FFN passes give du;
``_blur_bwd_kernel`` (BlurPool's transpose, a gather over the two candidate output rows and columns
of each pixel) gives x's direct gradient and dy with BN1's sums; then da, dgrad and wgrad as above.

As compiled (sm_90, fp16, ConvFirstNet-Small, batch 128, 256 x 256; ``convfirstnet kernels --train``,
benchmarks/static/small_b128_sm90_train.md: the static cost model's low-high ends, not a measurement)

    kernel                   registers  shared KB  MMA
    _moments_kernel           92-221     <= 128    wgmma (C = 32: mma.sync)
    _ffn_fwd_kernel          184-254     <= 75     wgmma (8 warps at C = 96 stride 1, else 4; now
                                                  stride 2 only on sm_90: stride 1 runs the staged
                                                  FFN launch, 172-254 registers, <= 124 KB)
    _ffn_bwd_weights_kernel  119-255     <= 198    wgmma (C = 32 and 32-channel parts: M = 32 weight
                                                  dots on mma.sync)
    _ffn_bwd_input_kernel    162-252     <= 114    wgmma
    finalize (finalize.py)    31-196     <= 65     mma.sync (the tf32x3 W1 Cov products)
    elementwise, BlurPool     54-176     <= 2      -
    no variant spills (stack 0 B).

    block (C -> K, map)      fused step (ms)   layer-wise training bound (ms)   stored MB fused / layer-wise
    s1 32, 128^2               1.41-1.70            3.23-3.99                      269 / 1208
    s2 32 -> 64, 128^2         1.20-1.47            2.32-2.85                      405 / 1351
    s1 64, 64^2                1.01-1.21            2.59-3.20                      204 / 1074
    s2 64 -> 96, 64^2          0.68-0.84            1.15-1.41                      202 /  672
    s1 96, 32^2                0.56-0.66            0.99-1.22                       81 /  403
    (fused: 20 or 24 Triton launches per step, of which 7 or 8 are the small finalize kernels, plus the
    drop-path mask's ops; before the finalize kernels, 121-126 small aten ops cost 0.16-0.17 ms per block)

Where the time goes: the narrow passes (gconv, moments, BN3 + residual, sums, prep, BN1's input
gradient: each a DRAM pass over C-channel maps; the gconv windows' and the BlurPool transpose's re-reads
served by L1, as their launches declare) bound stage 1; the weights pass (y and dp re-read by each of
R / 32 chunk programs; at C = 96 in 64 + 32 channel parts: 178 of the 658 us of a block, latency and
L2 bound, 206 us when padded to 128) and the forward and input FFN passes (latency and waits at one
8-warp program per SM, 94 and 117 us) bound stage 3. The forward takes the parts too (C = 96 stride 1:
107 -> 94 us; the stride-2 64 -> 96 FFN then fits on 4 warps, two programs per SM: 73 -> 42 us); the
input pass in parts was no faster (fewer MACs, more instructions) and stays padded. 64 hidden channels
per weights-pass program (half the L2 traffic) spill at C = 96 even in parts (32-136 B at 8 warps, 500 B
at 16). What a GPU run must confirm: the L1 hits of the gconv windows and the BlurPool transpose, the static
latency and L2 terms of the weights and input passes, the weight partials' reduction order on the
device (deterministic by construction), fp16/bf16 gradients against the fp32 training form at the
model's shapes, and ``convfirstnet bench --train`` against eager cuDNN and torch.compile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._scalars import fp32


@triton.jit
def _rows_of(t, M, BM: tl.constexpr):
    rows = t * BM + tl.arange(0, BM)
    return rows, rows < M


@triton.jit
def _load_tile(ptr, rows, rok, C: tl.constexpr, CP: tl.constexpr):
    """[BM, CP] tile of a contiguous (M, C) map (zero on masked rows and channels >= C), as stored."""
    c = tl.arange(0, CP)
    m = rok[:, None]
    if CP > C:
        m = m & (c < C)[None, :]
    return tl.load(ptr + rows[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0.0)


@triton.jit
def _load_cols(ptr, rows, rok, C: tl.constexpr, C0: tl.constexpr, CW: tl.constexpr):
    """[BM, CW] tile of channels C0 ... C0 + CW of a contiguous (M, C) map (zero on masked rows and
    channels >= C): one channel part (module docstring, Tiles)."""
    c = C0 + tl.arange(0, CW)
    m = rok[:, None]
    if C0 + CW > C:
        m = m & (c < C)[None, :]
    return tl.load(ptr + rows[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0.0)


@triton.jit
def _store_cols(ptr, v, rows, rok, C: tl.constexpr, C0: tl.constexpr, CW: tl.constexpr):
    """v [BM, CW] into channels C0 ... C0 + CW of a contiguous (M, C) map (masked as _load_cols)."""
    c = C0 + tl.arange(0, CW)
    m = rok[:, None]
    if C0 + CW > C:
        m = m & (c < C)[None, :]
    tl.store(ptr + rows[:, None].to(tl.int64) * C + c[None, :], v.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _w1t_part(w1_ptr, hh, hok, CI: tl.constexpr, C0: tl.constexpr, CW: tl.constexpr):
    """W1[chunk, C0:C0 + CW]^T, [CW, BH], of w1 (R, CI) (zero past R and CI)."""
    c = C0 + tl.arange(0, CW)
    return tl.load(w1_ptr + hh[None, :] * CI + c[:, None], mask=hok[None, :] & (c < CI)[:, None], other=0.0)


@triton.jit
def _w2c_part(w2_ptr, hh, hok, R, CO: tl.constexpr, C0: tl.constexpr, CW: tl.constexpr):
    """W2[C0:C0 + CW, chunk], [CW, BH], of w2 (CO, R) (zero past R and CO)."""
    c = C0 + tl.arange(0, CW)
    return tl.load(w2_ptr + c[:, None] * R + hh[None, :], mask=hok[None, :] & (c < CO)[:, None], other=0.0)


@triton.jit
def _store_w2_part(base, v, hh, hok, R, CO: tl.constexpr, C0: tl.constexpr, CW: tl.constexpr):
    """v [CW, BH] into rows C0 ... of a (CO, R) block."""
    c = C0 + tl.arange(0, CW)
    tl.store(base + c[:, None] * R + hh[None, :], v, mask=hok[None, :] & (c < CO)[:, None])


@triton.jit
def _store_w1_part(base, v, hh, hok, CI: tl.constexpr, C0: tl.constexpr, CW: tl.constexpr):
    """v [CW, BH] (transposed) into columns C0 ... of an (R, CI) block."""
    c = C0 + tl.arange(0, CW)
    tl.store(base + hh[None, :] * CI + c[:, None], v, mask=hok[None, :] & (c < CI)[:, None])


@triton.jit
def _store_tile(ptr, v, rows, rok, C: tl.constexpr, CP: tl.constexpr):
    c = tl.arange(0, CP)
    m = rok[:, None]
    if CP > C:
        m = m & (c < C)[None, :]
    tl.store(ptr + rows[:, None].to(tl.int64) * C + c[None, :], v.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _vec(ptr, idx, n):
    """fp32 vector ptr[idx] (zero where idx >= n)."""
    return tl.load(ptr + idx, mask=idx < n, other=0.0).to(tl.float32)


@triton.jit
def _store_vec(ptr, v, idx, n):
    tl.store(ptr + idx, v, mask=idx < n)


@triton.jit
def _tile_moments(v, rok, nt):
    """Per-channel mean and centred second moment of the rows ``rok`` of an fp32 tile ([CP] each)."""
    mean = tl.sum(v, axis=0) / nt
    vc = tl.where(rok[:, None], v - mean[None, :], 0.0)
    return mean, vc


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------


@triton.jit
def _moments_kernel(
    v_ptr, mean_ptr, m2_ptr,  # v (M, C) contiguous; partials: mean (shares, C), m2 (shares, C, C)
    M, TILES, TILES_PER_SHARE,
    C: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr,
):
    """Mean and centred C x C second moment of a share of row tiles, tile by tile (Chan's merge)."""
    share = tl.program_id(0)
    c = tl.arange(0, CP)
    dt = v_ptr.dtype.element_ty
    mean = tl.zeros((CP,), tl.float32)
    m2 = tl.zeros((CP, CP), tl.float32)
    t0 = share * TILES_PER_SHARE
    for t in range(t0, tl.minimum(t0 + TILES_PER_SHARE, TILES)):
        rows, rok = _rows_of(t, M, BM)
        # rows before this tile in the share: every tile but the batch's last is full
        n_prev = ((t - t0) * BM).to(tl.float32)
        nt = tl.minimum(M - t * BM, BM).to(tl.float32)
        tm, vc = _tile_moments(_load_tile(v_ptr, rows, rok, C, CP).to(tl.float32), rok, nt)
        # centred values in the data's dtype: (v - tm) keeps v's relative precision, the products
        # and sums are fp32
        vcd = vc.to(dt)
        m2 = tl.dot(tl.trans(vcd), vcd, m2, input_precision=PRECISION)
        d = tm - mean
        m2 += (d[:, None] * d[None, :]) * (n_prev * nt / (n_prev + nt))
        mean += d * (nt / (n_prev + nt))
    ok = c < C
    tl.store(mean_ptr + share * C + c, mean, mask=ok)
    tl.store(m2_ptr + share.to(tl.int64) * C * C + c[:, None] * C + c[None, :], m2,
             mask=ok[:, None] & ok[None, :])


@triton.jit
def _ffn_fwd_kernel(
    a_ptr, w1_ptr, w2_ptr, p_ptr,  # a (M, CI), p (M, CO) contiguous; w1 (R, CI), w2 (CO, R) as stored
    k1_ptr, t1_ptr, k2_ptr, t2_ptr,  # fp32 affine of the input (CI: BN1; AFFINE_IN) and of BN2 (R)
    mean_ptr, m2_ptr,  # fp32 partials of p per share: (shares, CO) each
    M, R, TILES, TILES_PER_SHARE,
    CI: tl.constexpr, CIA: tl.constexpr, CIB: tl.constexpr, CO: tl.constexpr, COA: tl.constexpr,
    COB: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr, AFFINE_IN: tl.constexpr,
):
    """Per tile of the share: p = W2 ReLU(k2 (W1 y) + t2) with y = k1 a + t1 (AFFINE_IN; else y = a),
    over hidden chunks; the share's moments of p (Chan's merge tile by tile, as _moments_kernel).
    Channels in two parts, as the weights pass."""
    share = tl.program_id(0)
    dt = a_ptr.dtype.element_ty
    mean_a = tl.zeros((COA,), tl.float32)
    m2_a = tl.zeros((COA,), tl.float32)
    if COB > 0:
        mean_b = tl.zeros((COB,), tl.float32)
        m2_b = tl.zeros((COB,), tl.float32)
    t0 = share * TILES_PER_SHARE
    for t in range(t0, tl.minimum(t0 + TILES_PER_SHARE, TILES)):
        rows, rok = _rows_of(t, M, BM)
        ya = _ffn_input(a_ptr, k1_ptr, t1_ptr, rows, rok, CI, 0, CIA, AFFINE_IN)
        acc_a = tl.zeros((BM, COA), tl.float32)
        if CIB > 0:
            yb = _ffn_input(a_ptr, k1_ptr, t1_ptr, rows, rok, CI, CIA, CIB, AFFINE_IN)
        if COB > 0:
            acc_b = tl.zeros((BM, COB), tl.float32)
        for h0 in range(0, R, BH):
            hh = h0 + tl.arange(0, BH)
            hok = hh < R
            z = tl.dot(ya, _w1t_part(w1_ptr, hh, hok, CI, 0, CIA).to(dt), input_precision=PRECISION)
            if CIB > 0:
                z = tl.dot(yb, _w1t_part(w1_ptr, hh, hok, CI, CIA, CIB).to(dt), z, input_precision=PRECISION)
            h = tl.maximum(z * _vec(k2_ptr, hh, R)[None, :] + _vec(t2_ptr, hh, R)[None, :], 0.0).to(dt)
            acc_a = tl.dot(h, tl.trans(_w2c_part(w2_ptr, hh, hok, R, CO, 0, COA).to(dt)), acc_a,
                           input_precision=PRECISION)
            if COB > 0:
                acc_b = tl.dot(h, tl.trans(_w2c_part(w2_ptr, hh, hok, R, CO, COA, COB).to(dt)), acc_b,
                               input_precision=PRECISION)
        n_prev = ((t - t0) * BM).to(tl.float32)
        nt = tl.minimum(M - t * BM, BM).to(tl.float32)
        mean_a, m2_a = _store_p_moments(p_ptr, acc_a.to(dt), rows, rok, CO, 0, COA, mean_a, m2_a, n_prev, nt)
        if COB > 0:
            mean_b, m2_b = _store_p_moments(p_ptr, acc_b.to(dt), rows, rok, CO, COA, COB, mean_b, m2_b,
                                            n_prev, nt)
    ca = tl.arange(0, COA)
    _store_vec(mean_ptr + share * CO, mean_a, ca, CO)
    _store_vec(m2_ptr + share * CO, m2_a, ca, CO)
    if COB > 0:
        cb = COA + tl.arange(0, COB)
        _store_vec(mean_ptr + share * CO, mean_b, cb, CO)
        _store_vec(m2_ptr + share * CO, m2_b, cb, CO)


@triton.jit
def _ffn_input(a_ptr, k1_ptr, t1_ptr, rows, rok, CI: tl.constexpr, C0: tl.constexpr, CW: tl.constexpr,
               AFFINE_IN: tl.constexpr):
    """Channels C0 ... C0 + CW of the FFN's input tile: y = k1 a + t1 (AFFINE_IN; else a), rounded once."""
    y = _load_cols(a_ptr, rows, rok, CI, C0, CW)
    if AFFINE_IN:
        c = C0 + tl.arange(0, CW)
        y = (y.to(tl.float32) * _vec(k1_ptr, c, CI)[None, :] + _vec(t1_ptr, c, CI)[None, :]).to(y.dtype)
    return y


@triton.jit
def _store_p_moments(p_ptr, p, rows, rok, CO: tl.constexpr, C0: tl.constexpr, CW: tl.constexpr, mean, m2,
                     n_prev, nt):
    """Stores channels C0 ... C0 + CW of p and merges the tile's moments of them into (mean, m2)."""
    _store_cols(p_ptr, p, rows, rok, CO, C0, CW)
    # BN3 statistics of the stored (rounded) p, as a layer-wise BatchNorm reads it
    return merge_tile_moments(p, rok, mean, m2, n_prev, nt)


@triton.jit
def merge_tile_moments(p, rok, mean, m2, n_prev, nt):
    """(mean, m2) of n_prev rows merged with the tile's rows ``rok`` of p (nt of them; Chan's formula;
    fp32 [CW] each; also kernels/convfirst/staged.py's training FFN)."""
    tm, pc = _tile_moments(tl.where(rok[:, None], p.to(tl.float32), 0.0), rok, nt)
    d = tm - mean
    m2 += tl.sum(pc * pc, axis=0) + d * d * (n_prev * nt / (n_prev + nt))
    mean += d * (nt / (n_prev + nt))
    return mean, m2


@triton.jit
def _residual_kernel(
    x_ptr, p_ptr, out_ptr, drop_ptr, k3_ptr, t3_ptr,  # x, p, out (M, C) contiguous; drop (N,) fp32
    M, HW,
    C: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr, RESIDUAL: tl.constexpr,
):
    """out = x + d_n (k3 p + t3): BN3, drop-path and the residual, rounded once (RESIDUAL False: the
    stride-2 block's out = k3 p + t3)."""
    rows, rok = _rows_of(tl.program_id(0), M, BM)
    c = tl.arange(0, CP)
    q = (_load_tile(p_ptr, rows, rok, C, CP).to(tl.float32) * _vec(k3_ptr, c, C)[None, :]
         + _vec(t3_ptr, c, C)[None, :])
    if RESIDUAL:
        d = tl.load(drop_ptr + rows // HW, mask=rok, other=0.0)
        q = _load_tile(x_ptr, rows, rok, C, CP).to(tl.float32) + d[:, None] * q
    _store_tile(out_ptr, q, rows, rok, C, CP)


@triton.jit
def reflect(i, n):
    """BlurPool's reflect padding of one pixel: -1 -> 1, n -> n - 2."""
    i = tl.where(i < 0, -i, i)
    return tl.where(i >= n, 2 * n - 2 - i, i)


@triton.jit
def _blur_cat_kernel(
    x_ptr, a_ptr, u_ptr,  # x, a (N, H, W, C) contiguous; u (N, HO, WO, 2C) contiguous
    k1_ptr, t1_ptr,  # BN1 affine (C)
    M, H, W, HO, WO,  # M = N HO WO output pixels
    C: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr,
):
    """u = BlurPool(cat[x, BN1(a)]): [1, 2, 1] x [1, 2, 1] / 16, stride 2, reflect padding 1. BN1 is
    affine and the filter sums to one, so blur(k1 a + t1) = k1 blur(a) + t1: the concat is never built."""
    rows, rok = _rows_of(tl.program_id(0), M, BM)
    c = tl.arange(0, CP)
    n = rows // (HO * WO)
    q = rows % (HO * WO)
    oh = q // WO
    ow = q % WO
    m = rok[:, None]
    if CP > C:
        m = m & (c < C)[None, :]
    bx = tl.zeros((BM, CP), tl.float32)
    ba = tl.zeros((BM, CP), tl.float32)
    for dh in tl.static_range(3):
        r = reflect(2 * oh + dh - 1, H)
        for dw in tl.static_range(3):
            col = reflect(2 * ow + dw - 1, W)
            wgt = (2 - (dh - 1) * (dh - 1)) * (2 - (dw - 1) * (dw - 1)) / 16.0
            off = ((n.to(tl.int64) * H + r) * W + col)[:, None] * C + c[None, :]
            bx += wgt * tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
            ba += wgt * tl.load(a_ptr + off, mask=m, other=0.0).to(tl.float32)
    by = ba * _vec(k1_ptr, c, C)[None, :] + _vec(t1_ptr, c, C)[None, :]
    out = u_ptr + rows[:, None].to(tl.int64) * (2 * C) + c[None, :]
    tl.store(out, bx.to(u_ptr.dtype.element_ty), mask=m)
    tl.store(out + C, by.to(u_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------


@triton.jit
def _out_sums_kernel(
    dout_ptr, p_ptr, drop_ptr, m3_ptr, v3_ptr, part_ptr,  # part: fp32 (shares, 2, C): sum dq, sum dq p_hat
    M, HW, TILES, TILES_PER_SHARE, eps,
    C: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr, DROP: tl.constexpr,
):
    """BN3's sums per share (dq = d_n dout with drop-path (DROP), else dout; p_hat with BN3's statistics)."""
    eps = fp32(eps)  # torch.compile passes floats as fp64 (_scalars.py)
    share = tl.program_id(0)
    c = tl.arange(0, CP)
    m3 = _vec(m3_ptr, c, C)
    r3 = 1.0 / tl.sqrt(tl.load(v3_ptr + c, mask=c < C, other=1.0) + eps)
    s_dq = tl.zeros((CP,), tl.float32)
    s_dqp = tl.zeros((CP,), tl.float32)
    t0 = share * TILES_PER_SHARE
    for t in range(t0, tl.minimum(t0 + TILES_PER_SHARE, TILES)):
        rows, rok = _rows_of(t, M, BM)
        dq = _load_tile(dout_ptr, rows, rok, C, CP).to(tl.float32)
        if DROP:
            dq = dq * tl.load(drop_ptr + rows // HW, mask=rok, other=0.0)[:, None]
        p_hat = (_load_tile(p_ptr, rows, rok, C, CP).to(tl.float32) - m3[None, :]) * r3[None, :]
        s_dq += tl.sum(dq, axis=0)
        s_dqp += tl.sum(dq * p_hat, axis=0)
    _store_vec(part_ptr + share * 2 * C, s_dq, c, C)
    _store_vec(part_ptr + share * 2 * C + C, s_dqp, c, C)


@triton.jit
def _prep_kernel(
    a_ptr, dout_ptr, p_ptr, drop_ptr, y_ptr, dp_ptr,  # maps (M, C) contiguous; drop (N,) fp32
    k1_ptr, t1_ptr, k3_ptr, w3_ptr, c3_ptr,  # y = k1 a + t1; dp = k3 dq + w3 p + c3 (dq = d_n dout)
    M, HW,
    C: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr, WRITE_Y: tl.constexpr, DROP: tl.constexpr,
):
    """The two inputs of the FFN's backward passes, each rounded once to the activation dtype (where a
    layer-wise network has them): y (recomputed from a; WRITE_Y) and dp (BN3's and drop-path's
    backward). The stride-2 block's FFN input is the stored u itself: only dp."""
    rows, rok = _rows_of(tl.program_id(0), M, BM)
    c = tl.arange(0, CP)
    if WRITE_Y:
        y = (_load_tile(a_ptr, rows, rok, C, CP).to(tl.float32) * _vec(k1_ptr, c, C)[None, :]
             + _vec(t1_ptr, c, C)[None, :])
        _store_tile(y_ptr, y, rows, rok, C, CP)
    dq = _load_tile(dout_ptr, rows, rok, C, CP).to(tl.float32)
    if DROP:
        dq = dq * tl.load(drop_ptr + rows // HW, mask=rok, other=0.0)[:, None]
    p = _load_tile(p_ptr, rows, rok, C, CP).to(tl.float32)
    dp = _vec(k3_ptr, c, C)[None, :] * dq + _vec(w3_ptr, c, C)[None, :] * p + _vec(c3_ptr, c, C)[None, :]
    _store_tile(dp_ptr, dp, rows, rok, C, CP)


@triton.jit
def _ffn_bwd_weights_kernel(
    y_ptr, dp_ptr, w1_ptr, w2_ptr,  # y (M, CI), dp (M, CO) contiguous; w1 (R, CI), w2 (CO, R) as stored
    k2_ptr, t2_ptr, m2_ptr, r2_ptr,  # BN2: affine, mean, 1/std (R)
    part_ptr,  # fp32 partials, one row of TOTAL per share: dW2 (CO, R) | dzn^T y (R, CI) | sum dzn (R)
    # | (DZZ) sum dzn z_hat (R)
    M, R, TILES, TILES_PER_SHARE, TOTAL,
    CI: tl.constexpr, CIA: tl.constexpr, CIB: tl.constexpr, CO: tl.constexpr, COA: tl.constexpr,
    COB: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr, DZZ: tl.constexpr,
):
    """Program (share, hidden chunk): the share's contributions to dW2[:, chunk], (dzn^T y)[chunk] and
    the chunk's sum of dzn, from z, h and dh recomputed tile by tile; the sum of dzn z_hat follows from
    dzn^T y in the finalize (module docstring), or with DZZ is summed here. Rows past M load as
    zero (y = dp = 0), which adds nothing to any sum. Channels in two parts (module docstring: CIA + CIB
    input, COA + COB output; a part of width 0 is absent)."""
    share = tl.program_id(0)
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    hok = hh < R
    dt = y_ptr.dtype.element_ty
    w1a = _w1t_part(w1_ptr, hh, hok, CI, 0, CIA).to(dt)  # [CIA, BH]
    w2a = _w2c_part(w2_ptr, hh, hok, R, CO, 0, COA).to(dt)  # [COA, BH]
    acc_w2a = tl.zeros((COA, BH), tl.float32)
    acc_ga = tl.zeros((CIA, BH), tl.float32)  # (dzn^T y)^T: y^T dzn keeps M = CIA on wgmma
    if CIB > 0:
        w1b = _w1t_part(w1_ptr, hh, hok, CI, CIA, CIB).to(dt)
        acc_gb = tl.zeros((CIB, BH), tl.float32)
    if COB > 0:
        w2b = _w2c_part(w2_ptr, hh, hok, R, CO, COA, COB).to(dt)
        acc_w2b = tl.zeros((COB, BH), tl.float32)
    k2, t2 = _vec(k2_ptr, hh, R), _vec(t2_ptr, hh, R)
    if DZZ:
        m2, r2 = _vec(m2_ptr, hh, R), _vec(r2_ptr, hh, R)
    s_dzn = tl.zeros((BH,), tl.float32)
    if DZZ:
        s_dzz = tl.zeros((BH,), tl.float32)
    t0 = share * TILES_PER_SHARE
    for t in range(t0, tl.minimum(t0 + TILES_PER_SHARE, TILES)):
        rows, rok = _rows_of(t, M, BM)
        ya = _load_cols(y_ptr, rows, rok, CI, 0, CIA)
        dpa = _load_cols(dp_ptr, rows, rok, CO, 0, COA)
        z = tl.dot(ya, w1a, input_precision=PRECISION)
        dh = tl.dot(dpa, w2a, input_precision=PRECISION)
        if CIB > 0:
            yb = _load_cols(y_ptr, rows, rok, CI, CIA, CIB)
            z = tl.dot(yb, w1b, z, input_precision=PRECISION)
        if COB > 0:
            dpb = _load_cols(dp_ptr, rows, rok, CO, COA, COB)
            dh = tl.dot(dpb, w2b, dh, input_precision=PRECISION)
        zn = z * k2[None, :] + t2[None, :]
        h = tl.maximum(zn, 0.0).to(dt)
        dzn = tl.where(zn > 0.0, dh, 0.0)
        s_dzn += tl.sum(dzn, axis=0)
        if DZZ:
            s_dzz += tl.sum(dzn * (z - m2[None, :]), axis=0)
        dznd = dzn.to(dt)
        acc_w2a = tl.dot(tl.trans(dpa), h, acc_w2a, input_precision=PRECISION)
        acc_ga = tl.dot(tl.trans(ya), dznd, acc_ga, input_precision=PRECISION)
        if COB > 0:
            acc_w2b = tl.dot(tl.trans(dpb), h, acc_w2b, input_precision=PRECISION)
        if CIB > 0:
            acc_gb = tl.dot(tl.trans(yb), dznd, acc_gb, input_precision=PRECISION)
    base = part_ptr + share.to(tl.int64) * TOTAL
    _store_w2_part(base, acc_w2a, hh, hok, R, CO, 0, COA)
    _store_w1_part(base + CO * R, acc_ga, hh, hok, CI, 0, CIA)
    if COB > 0:
        _store_w2_part(base, acc_w2b, hh, hok, R, CO, COA, COB)
    if CIB > 0:
        _store_w1_part(base + CO * R, acc_gb, hh, hok, CI, CIA, CIB)
    _store_vec(base + CO * R + R * CI, s_dzn, hh, R)
    if DZZ:
        _store_vec(base + CO * R + R * CI + R, s_dzz * r2, hh, R)


@triton.jit
def _ffn_bwd_input_kernel(
    y_ptr, dp_ptr, a_ptr, w1_ptr, w2_ptr, dy_ptr,  # y, a, dy (M, CI); dp (M, CO); w1 (R, CI), w2 (CO, R)
    m1_ptr, r1_ptr,  # BN1: mean, 1/std (CI)
    k2_ptr, t2_ptr, m2_ptr, u2_ptr, w2v_ptr,  # BN2: affine, mean; dz = k2 dzn + u2 + w2 (z - m2) (R)
    sums_ptr,  # fp32 per-share partials (shares, 2, CI): sum dy, sum dy a_hat
    M, R, TILES, TILES_PER_SHARE,
    CI: tl.constexpr, CPI: tl.constexpr, CO: tl.constexpr, CPO: tl.constexpr, BM: tl.constexpr,
    BH: tl.constexpr, PRECISION: tl.constexpr, BN_SUMS: tl.constexpr,
):
    """Per tile of the share: dy = sum over hidden chunks of dz W1[chunk], stored, with (BN_SUMS: the
    stride-1 block, whose FFN input is BN1's output) the share's sums of dy and dy a_hat."""
    share = tl.program_id(0)
    ci = tl.arange(0, CPI)
    co = tl.arange(0, CPO)
    dt = y_ptr.dtype.element_ty
    s_dy = tl.zeros((CPI,), tl.float32)
    s_dya = tl.zeros((CPI,), tl.float32)
    t0 = share * TILES_PER_SHARE
    for t in range(t0, tl.minimum(t0 + TILES_PER_SHARE, TILES)):
        rows, rok = _rows_of(t, M, BM)
        y = _load_tile(y_ptr, rows, rok, CI, CPI)
        dp = _load_tile(dp_ptr, rows, rok, CO, CPO)
        dy = tl.zeros((BM, CPI), tl.float32)
        for h0 in range(0, R, BH):
            hh = h0 + tl.arange(0, BH)
            hok = hh < R
            w1t = tl.load(w1_ptr + hh[None, :] * CI + ci[:, None], mask=hok[None, :] & (ci < CI)[:, None],
                          other=0.0).to(dt)  # [CPI, BH]
            w2c = tl.load(w2_ptr + co[:, None] * R + hh[None, :], mask=hok[None, :] & (co < CO)[:, None],
                          other=0.0).to(dt)  # [CPO, BH]
            z = tl.dot(y, w1t, input_precision=PRECISION)
            zn = z * _vec(k2_ptr, hh, R)[None, :] + _vec(t2_ptr, hh, R)[None, :]
            dzn = tl.where(zn > 0.0, tl.dot(dp, w2c, input_precision=PRECISION), 0.0)
            dz = (_vec(k2_ptr, hh, R)[None, :] * dzn + _vec(u2_ptr, hh, R)[None, :]
                  + _vec(w2v_ptr, hh, R)[None, :] * (z - _vec(m2_ptr, hh, R)[None, :]))
            dz = tl.where(rok[:, None], dz, 0.0).to(dt)
            dy = tl.dot(dz, tl.trans(w1t), dy, input_precision=PRECISION)
        dy = dy.to(dt)
        _store_tile(dy_ptr, dy, rows, rok, CI, CPI)
        if BN_SUMS:
            # BN1's sums from the stored (rounded) dy, as a layer-wise BatchNorm backward reads it
            a = _load_tile(a_ptr, rows, rok, CI, CPI).to(tl.float32)
            a_hat = (a - _vec(m1_ptr, ci, CI)[None, :]) * _vec(r1_ptr, ci, CI)[None, :]
            dyf = dy.to(tl.float32)
            s_dy += tl.sum(dyf, axis=0)
            s_dya += tl.sum(dyf * a_hat, axis=0)
    if BN_SUMS:
        _store_vec(sums_ptr + share * 2 * CI, s_dy, ci, CI)
        _store_vec(sums_ptr + share * 2 * CI + CI, s_dya, ci, CI)


@triton.jit
def _blur_bwd_kernel(
    du_ptr, a_ptr, dxd_ptr, dy_ptr,  # du (N, HO, WO, 2C); a, dx_direct, dy (N, H, W, C), all contiguous
    m1_ptr, r1_ptr, sums_ptr,  # BN1 mean, 1/std (C); fp32 per-share partials (shares, 2, C)
    M, H, W, HO, WO, TILES, TILES_PER_SHARE,  # M = N H W input pixels
    C: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr,
):
    """The transpose of ``_blur_cat_kernel``'s BlurPool, as a gather per input pixel (no atomics): pixel
    (i, j) receives f[dh] f[dw] / 16 du(oh, ow) from every output pixel whose tap (dh, dw) reads it after
    the reflection: 2 oh + dh - 1 = i (or its reflection, which lands on the same oh) leaves oh in
    {i // 2, i // 2 + 1}, ow alike: four candidates. Writes x's direct gradient
    and dy (BN1's output gradient) with the share's sums of dy and dy a_hat."""
    share = tl.program_id(0)
    c = tl.arange(0, CP)
    s_dy = tl.zeros((CP,), tl.float32)
    s_dya = tl.zeros((CP,), tl.float32)
    t0 = share * TILES_PER_SHARE
    for t in range(t0, tl.minimum(t0 + TILES_PER_SHARE, TILES)):
        rows, rok = _rows_of(t, M, BM)
        n = rows // (H * W)
        q = rows % (H * W)
        i = q // W
        j = q % W
        m = rok[:, None]
        if CP > C:
            m = m & (c < C)[None, :]
        gx = tl.zeros((BM, CP), tl.float32)
        gy = tl.zeros((BM, CP), tl.float32)
        for eh in tl.static_range(2):
            oh = i // 2 + eh
            wr = tl.zeros((BM,), tl.float32)
            for dh in tl.static_range(3):
                hit = reflect(2 * oh + dh - 1, H) == i
                wr += tl.where(hit, (2 - (dh - 1) * (dh - 1)) / 4.0, 0.0)
            wr = tl.where((oh >= 0) & (oh < HO), wr, 0.0)
            for ew in tl.static_range(2):
                ow = j // 2 + ew
                wc = tl.zeros((BM,), tl.float32)
                for dw in tl.static_range(3):
                    hit = reflect(2 * ow + dw - 1, W) == j
                    wc += tl.where(hit, (2 - (dw - 1) * (dw - 1)) / 4.0, 0.0)
                wc = tl.where((ow >= 0) & (ow < WO), wc, 0.0)
                wgt = wr * wc
                ok = m & (wgt > 0.0)[:, None]
                src = du_ptr + ((n.to(tl.int64) * HO + oh) * WO + ow)[:, None] * (2 * C) + c[None, :]
                gx += wgt[:, None] * tl.load(src, mask=ok, other=0.0).to(tl.float32)
                gy += wgt[:, None] * tl.load(src + C, mask=ok, other=0.0).to(tl.float32)
        _store_tile(dxd_ptr, gx, rows, rok, C, CP)
        gy = gy.to(dy_ptr.dtype.element_ty)
        _store_tile(dy_ptr, gy, rows, rok, C, CP)
        a = _load_tile(a_ptr, rows, rok, C, CP).to(tl.float32)
        a_hat = (a - _vec(m1_ptr, c, C)[None, :]) * _vec(r1_ptr, c, C)[None, :]
        dyf = gy.to(tl.float32)
        s_dy += tl.sum(dyf, axis=0)
        s_dya += tl.sum(dyf * a_hat, axis=0)
    _store_vec(sums_ptr + share * 2 * C, s_dy, c, C)
    _store_vec(sums_ptr + share * 2 * C + C, s_dya, c, C)


@triton.jit
def _bn_input_grad_kernel(
    dy_ptr, a_ptr, da_ptr, k1_ptr, u1_ptr, w1_ptr, m1_ptr,  # maps (M, C) contiguous; vectors (C) fp32
    M,
    C: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr,
):
    """da = k1 dy + u1 + w1 (a - m1): BN1's backward."""
    rows, rok = _rows_of(tl.program_id(0), M, BM)
    c = tl.arange(0, CP)
    dy = _load_tile(dy_ptr, rows, rok, C, CP).to(tl.float32)
    a = _load_tile(a_ptr, rows, rok, C, CP).to(tl.float32)
    da = (_vec(k1_ptr, c, C)[None, :] * dy + _vec(u1_ptr, c, C)[None, :]
          + _vec(w1_ptr, c, C)[None, :] * (a - _vec(m1_ptr, c, C)[None, :]))
    _store_tile(da_ptr, da, rows, rok, C, CP)
