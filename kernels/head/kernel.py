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

Compiled for sm_90 (C = 256, 8x8, fp16): wgmma, 146 registers, 80 KB shared memory, no spills;
~560 SASS instructions per warp per (image, feature block), of which 128 FFMA, 76 FADD, 64 MUFU and
32 HGMMA: an issue estimate of 3.5 us at batch 128, under the 5.5 us tensor bound. L2 reads ~60 MB
(x once per feature block, 42 MB; W once per program, 17 MB; the previous design: ~126 MB). Not timed
on a GPU yet. On sm_80 mma.sync takes its A operand from registers and the compiler keeps the
loop-invariant slice there: ~250 registers, no spills, one program per SM.

The L2 traffic is 11.6x the DRAM bytes (60 MB against 5.2 MB), above issue 18's 2.5x, and no tiling
of this kind reaches 2.5x: with F_b features per program and one wave of programs on 132 SMs, x is
read F / F_b times (4.2 MB each) and W once per program (F_b x 512 B), 5.37 GB / F_b + 67.6 KB x F_b,
at least 38 MB (7.3x) at F_b ~ 280. BLOCK_F = 256 with 8 warps and one program per SM (128 KB of
weights in shared memory) was tried in the static report: 38.7 MB (7.5x), but 12.3-14.9 us against
9.9-11.8 us for this design (two programs per SM hide each other's waits), so it was not kept.

Constants
---------
BLOCK_F = 128 features (fp32: 64): the dot's M, two wgmma 64-row tiles for 4 warps; 1280 / 128 = 10
feature blocks. BLOCK_P = H*W rounded up to a power of two, between 16 (the smallest N used here)
and 64 (the [128, 64] fp32 accumulator is 64 registers per thread). num_stages = 1 on the resident
path: the x tile is not multi-buffered, which keeps shared memory at W + one x tile so that two
programs fit per SM and hide each other's load latency. BLOCK_K = 32 (fp32) / 64 on the K loop,
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
    FAST_SILU: tl.constexpr,
):
    pid = tl.program_id(0)
    fb = pid % F_BLOCKS
    g = pid // F_BLOCKS
    rf = fb * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = rf < F
    if W_RESIDENT:  # the weight slice, loaded once: loop invariant, it stays on chip for every image
        k1 = tl.arange(0, K1)
        w1 = _w_tile(w_ptr, rf, f_ok, k1, swf, swc, C, MASK_K1)
        if K2 > 0:
            k2 = K1 + tl.arange(0, K2)
            w2 = _w_tile(w_ptr, rf, f_ok, k2, swf, swc, C, MASK_K2)
    else:
        kk = tl.arange(0, BLOCK_K)
    bias = tl.load(b_ptr + rf, mask=f_ok, other=0.0).to(tl.float32)
    silu_b = silu(bias, FAST_SILU)  # the value of every padded pixel (x = 0: y = b exactly)
    n_pad = tl.cdiv(HW, BLOCK_P) * BLOCK_P - HW
    inv_hw = 1.0 / HW

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
        mean = (total - n_pad * silu_b) * inv_hw
        tl.store(out_ptr + tl.cast(n, tl.int64) * son + rf, mean.to(out_ptr.dtype.element_ty), mask=f_ok)
