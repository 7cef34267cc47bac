"""Triton kernel for the head (paper Table 3): 1x1 conv C -> F (= 1280) + bias + SiLU + global mean.

    out[n, f] = mean_{h,w} SiLU(sum_c W[f, c] x[n, c, h, w] + b[f])            (N, F)

This module holds the ``@triton.jit`` code; launcher.py the host side (the configuration below, the
image groups, the launch and its cost declaration).

Waterline
---------
Batch 128, C = 256, 8x8 map, F = 1280, fp16 (Small at 256x256): 2.68 GMACs, 5.4 us on the tensor
cores of an H100 (989 TFLOP/s); DRAM traffic is x (4.2 MB), W (0.66 MB) and the output: 1.5 us at
3.35 TB/s. Layer-wise (conv writes the 1280-wide map, the pool reads it back) the bound is 14 us. So
the fused head is bound by the tensor cores, and the kernel's work is to keep everything else
(instructions, L2 traffic) below that. The previous design (one program per (image, 128 features),
pixels as the dot's M, pool as a cross-thread row reduction, SiLU through exp and a division) issued
~2360 SASS instructions per warp, an issue estimate of 12.9 us, and re-read its 64 KB weight slice
from L2 for every image: ~126 MB of L2 traffic.

Formulation: features as the dot's M
------------------------------------
``acc[BLOCK_F, BLOCK_P] = W[f-block, :] @ x[n]^T`` (features x pixels): the pool is then a sum
along each thread's own accumulator row (wgmma gives a thread 2 rows x BLOCK_P / 4 columns per 64-row
tile), finished by two shuffles within a quad, instead of a reduction across 128 threads.
SiLU is kernels/_activations.py's ``y / (1 + 2^(-y log2 e))``, y = acc + b: on the GPU path for
fp16/bf16 (``FAST_SILU``) through ``ex2.approx`` and ``rcp.approx`` by inline asm (two MUFU and three
fp32 instructions per element, ~2e-6 relative error); the interpreter, which cannot run inline asm,
and fp32 outputs use ``tl.exp2`` and a division, the same formula.

Pixels past H*W are not masked in the epilogue: they load x = 0, so their y is exactly b, and after
the pixel loop the kernel subtracts (padded pixels) x SiLU(b) from the sum, computed by the same
instructions. That saves a select per element.

Tiling and grid
---------------
A program owns BLOCK_F features and walks images g, g + G, g + 2G, ... (G image groups), so its
[BLOCK_F, C] weight slice is loaded once and reused for every image (``W_RESIDENT``: the loop
invariant stays in shared memory on sm_90, where wgmma reads both operands from there;
``tests/kernels/test_head.py`` pins that no weight load sits inside the image loop). grid =
(F_BLOCKS * G,) in grid.x, features fastest (programs that share an image run together and share its
x tile in L2), whatever the batch: G = min(N, 2 * SMs // F_BLOCKS) gives two resident programs per SM
(~146 registers and 80 KB of shared memory at C = 256) in one wave. C is split into at most two
power-of-two K parts, K1 = min(128, largest power of two <= C) and K2 = the rest rounded up to a power
of two (C = 128, 160, 192, 256 -> 128 + 0, 128 + 32, 128 + 64, 128 + 128: no padding at the model
widths), each one ``tl.dot`` over its whole K.

Per image, for each block of BLOCK_P pixels: load x^T [K, BLOCK_P] (channels contiguous in NHWC;
pixel p at ``p * sxp``: NHWC and NCHW memory both have uniformly strided pixels, other views are
copied to NHWC by the launcher first), the dots into fp32, SiLU, row sums into a fp32 [BLOCK_F]
total; after the last block, subtract the padding, scale by 1/(H*W), store in x's dtype. No atomics:
deterministic.

fp32 inputs (``input_precision="tf32x3"``, ~fp32 accuracy; the interpreter computes exact fp32) and
C > 256 take the K loop instead (``W_RESIDENT`` off): W and x in steps of BLOCK_K channels, W read
from L2 for every image. tf32x3 splits each operand in two, and on sm_80, where mma.sync takes its
operands from registers, a resident fp32 slice spilled (14 KB of stack per thread); fp32 is the
accuracy path, not the fast one.

Compiled for sm_90 (C = 256, 8x8, fp16): 8 warps (two wgmma warpgroups of 64 features), x prefetched
(``PREFETCH``: each (image, pixel block) step's x tile is loaded into registers one step ahead, before
the current step's dots, so its L2 latency is not exposed once per image), 128 registers, 96 KB of
shared memory, two programs per SM, no spills; 418 SASS instructions per warp and step (64 MUFU, 86
FADD, 50 FMUL, 16 HGMMA). Static estimate at batch 128 when it was designed: 7.2-10.1 us, L2-bound
at the high end (8.8 us: x once per feature block, 42 MB; W once per program, 17 MB); the 4-warp form
without the prefetch was 9.9-11.8 us (latency 5.7 + waits 4.8 us). The corrected model (the stall and
wait chains of the warps sharing a scheduler add) predicts 24-28 us; measured on an H200 (CUDA graph,
Triton 3.6): 21 us, against 94 us for Inductor's conv + SiLU + pool (``benchmarks/results/``,
gpu-check-blocks). The comparisons in this header were made with the model before. On sm_80
(4 warps, no prefetch: there the prefetched tile spilled 624 B) mma.sync takes its A operand from
registers and the compiler keeps the loop-invariant slice there.

The L2 traffic is 11.6x the DRAM bytes (60 MB against 5.2 MB), above issue 18's 2.5x, and no tiling
of this kind reaches 2.5x: with F_b features per program and one wave of programs on 132 SMs, x is
read F / F_b times (4.2 MB each) and W once per program (F_b x 512 B), 5.37 GB / F_b + 67.6 KB x F_b,
at least 38 MB (7.3x) at F_b ~ 280. BLOCK_F = 256 with 8 warps and one program per SM (128 KB of
weights in shared memory) was tried in the static report: 38.7 MB (7.5x), but 12.3-14.9 us against
9.9-11.8 us for the 4-warp form of this design (two programs per SM hide each other's waits), so it
was not kept.

Constants
---------
BLOCK_F = 128 features (fp32: 64): the dot's M, one wgmma 64-row tile per warpgroup; 1280 / 128 = 10
feature blocks. BLOCK_P = H*W rounded up to a power of two, between 16 (the smallest N used here)
and 64 (the [128, 64] fp32 accumulator is 32 registers per thread at 8 warps). num_stages = 1 on the
resident path: the x tile is not multi-buffered in shared memory (the prefetch holds the next one in
registers), which keeps shared memory at W + one x tile so that two programs fit per SM and hide each
other's load latency. BLOCK_K = 32 (fp32) / 64 on the K loop,
with num_stages = 2 (its per-step tiles are small; fp32: 1, two stages of tf32x3 splits spilled on sm_80).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._activations import silu


@triton.jit
def _x_tile(x_img, k, poff, p_ok, sxc, C, MASK_K: tl.constexpr):
    """x^T[k, p] of one image: channels k (rows) by pixels (columns), zero past H*W (and past C)."""
    if MASK_K:
        mask = (k < C)[:, None] & p_ok[None, :]
        return tl.load(x_img + k[:, None] * sxc + poff[None, :], mask=mask, other=0.0)
    return tl.load(x_img + k[:, None] * sxc + poff[None, :], mask=p_ok[None, :], other=0.0)


@triton.jit
def _w_tile(w_ptr, rf, f_ok, k, swf, swc, C, MASK_K: tl.constexpr):
    """W[f, k]: features (rows) by channels (columns), zero past F (and past C)."""
    if MASK_K:
        mask = f_ok[:, None] & (k < C)[None, :]
        return tl.load(w_ptr + rf[:, None] * swf + k[None, :] * swc, mask=mask, other=0.0)
    return tl.load(w_ptr + rf[:, None] * swf + k[None, :] * swc, mask=f_ok[:, None], other=0.0)


@triton.jit
def _x_next(x_ptr, n, pb, sxn, sxp, off, pix, HW, k, C, BLOCK_P: tl.constexpr, MASK_K: tl.constexpr,
            FULL_P: tl.constexpr):
    """x^T of pixel block ``pb`` of image n, [K, BLOCK_P], from the loop-invariant offsets ``off``
    ([BLOCK_P, K]). FULL_P: the pixel blocks cover H*W exactly (no pixel mask)."""
    base = x_ptr + tl.cast(n, tl.int64) * sxn + pb * BLOCK_P * sxp
    if MASK_K:
        if FULL_P:
            xt = tl.load(base + off, mask=(k < C)[None, :], other=0.0)
        else:
            xt = tl.load(base + off, mask=(pb * BLOCK_P + pix < HW)[:, None] & (k < C)[None, :], other=0.0)
    else:
        if FULL_P:
            xt = tl.load(base + off)
        else:
            xt = tl.load(base + off, mask=(pb * BLOCK_P + pix < HW)[:, None], other=0.0)
    return tl.trans(xt)


@triton.jit
def _row_sums(w1, w2, x1, x2, bias, K2: tl.constexpr, PREC: tl.constexpr, FAST_SILU: tl.constexpr):
    """sum over the block's pixels of SiLU(W x + b), [BLOCK_F] fp32 (both resident K parts)."""
    acc = tl.dot(w1, x1, input_precision=PREC)
    if K2 > 0:
        acc = tl.dot(w2, x2, acc, input_precision=PREC)
    return tl.sum(silu(acc + bias[:, None], FAST_SILU), axis=1)


@triton.jit
def _store_mean(out_ptr, n, son, rf, f_ok, total, n_pad, silu_b, inv_hw):
    """out[n, f-block] = the image's mean, without the padded pixels' SiLU(b)."""
    mean = (total - n_pad * silu_b) * inv_hw
    tl.store(out_ptr + tl.cast(n, tl.int64) * son + rf, mean.to(out_ptr.dtype.element_ty), mask=f_ok)


@triton.jit
def _head_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, out_ptr,
    # sizes: batch, channels, features, pixels per image, image groups, feature blocks
    N, C, F, HW, G, F_BLOCKS,
    # strides (elements): x as logical (N, C, H, W) with pixel p at p * sxp, w (F, C), out (N, F)
    sxn, sxc, sxp, swf, swc, son,
    # meta-parameters
    W_RESIDENT: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
    MASK_K1: tl.constexpr, MASK_K2: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_P: tl.constexpr, PREC: tl.constexpr,
    FAST_SILU: tl.constexpr, PB: tl.constexpr, FULL_P: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    fb = pid % F_BLOCKS
    g = pid // F_BLOCKS
    rf = fb * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = rf < F
    if W_RESIDENT:  # the weight slice, loaded once: loop invariant, it stays on chip for every image
        k1 = tl.arange(0, K1)
        w1 = _w_tile(w_ptr, rf, f_ok, k1, swf, swc, C, MASK_K1)
        w2 = w1  # (unused when K2 == 0)
        if K2 > 0:
            k2 = K1 + tl.arange(0, K2)
            w2 = _w_tile(w_ptr, rf, f_ok, k2, swf, swc, C, MASK_K2)
    else:
        kk = tl.arange(0, BLOCK_K)
    bias = tl.load(b_ptr + rf, mask=f_ok, other=0.0).to(tl.float32)
    silu_b = silu(bias, FAST_SILU)  # the value of every padded pixel (x = 0: y = b exactly)
    n_pad = tl.cdiv(HW, BLOCK_P) * BLOCK_P - HW
    inv_hw = 1.0 / HW

    if PREFETCH:  # (W_RESIDENT) one loop over the program's (image, pixel block) steps
        # each step's x tile is loaded one step ahead (into registers, before the dots of the current
        # one), so its L2 latency hides behind a step's dots and SiLU instead of being exposed once per
        # image; the last step runs after the loop and loads nothing more
        nsteps = tl.cdiv(N - g, G) * PB
        pix = tl.arange(0, BLOCK_P)
        # the x tile's element offsets as [pixels, channels], loop invariant: a step adds its image's
        # and pixel block's base
        off1 = pix[:, None] * sxp + k1[None, :] * sxc
        off2 = off1
        if K2 > 0:
            off2 = pix[:, None] * sxp + k2[None, :] * sxc
        x1n = _x_next(x_ptr, g, 0, sxn, sxp, off1, pix, HW, k1, C, BLOCK_P, MASK_K1, FULL_P)
        x2n = x1n
        if K2 > 0:
            x2n = _x_next(x_ptr, g, 0, sxn, sxp, off2, pix, HW, k2, C, BLOCK_P, MASK_K2, FULL_P)
        total = tl.zeros((BLOCK_F,), dtype=tl.float32)
        for s in range(0, nsteps - 1):
            x1c = x1n
            x2c = x2n
            n1 = g + ((s + 1) // PB) * G
            x1n = _x_next(x_ptr, n1, (s + 1) % PB, sxn, sxp, off1, pix, HW, k1, C, BLOCK_P, MASK_K1, FULL_P)
            if K2 > 0:
                x2n = _x_next(x_ptr, n1, (s + 1) % PB, sxn, sxp, off2, pix, HW, k2, C, BLOCK_P, MASK_K2, FULL_P)
            total += _row_sums(w1, w2, x1c, x2c, bias, K2, PREC, FAST_SILU)
            if s % PB == PB - 1:  # the image's last pixel block
                _store_mean(out_ptr, g + (s // PB) * G, son, rf, f_ok, total, n_pad, silu_b, inv_hw)
                total = tl.zeros((BLOCK_F,), dtype=tl.float32)
        total += _row_sums(w1, w2, x1n, x2n, bias, K2, PREC, FAST_SILU)
        _store_mean(out_ptr, g + ((nsteps - 1) // PB) * G, son, rf, f_ok, total, n_pad, silu_b, inv_hw)
    else:  # sm_80 (the prefetched tile spilled there) and the K loop: each image's tiles when needed
        for n in range(g, N, G):
            x_img = x_ptr + tl.cast(n, tl.int64) * sxn
            total = tl.zeros((BLOCK_F,), dtype=tl.float32)
            for p0 in range(0, HW, BLOCK_P):
                pix = p0 + tl.arange(0, BLOCK_P)
                p_ok = pix < HW
                poff = pix * sxp
                if W_RESIDENT:
                    acc = tl.dot(w1, _x_tile(x_img, k1, poff, p_ok, sxc, C, MASK_K1), input_precision=PREC)
                    if K2 > 0:
                        x2 = _x_tile(x_img, k2, poff, p_ok, sxc, C, MASK_K2)
                        acc = tl.dot(w2, x2, acc, input_precision=PREC)
                else:
                    acc = tl.zeros((BLOCK_F, BLOCK_P), dtype=tl.float32)
                    for k0 in range(0, C, BLOCK_K):
                        wk = _w_tile(w_ptr, rf, f_ok, k0 + kk, swf, swc, C, True)
                        xk = _x_tile(x_img, k0 + kk, poff, p_ok, sxc, C, True)
                        acc = tl.dot(wk, xk, acc, input_precision=PREC)
                total += tl.sum(silu(acc + bias[:, None], FAST_SILU), axis=1)
            _store_mean(out_ptr, n, son, rf, f_ok, total, n_pad, silu_b, inv_hw)
