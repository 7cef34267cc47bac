"""Triton kernel for the stem (paper stage 0): dense 3x3 conv, stride 2, padding 1, + bias, ReLU.

    x: (N, C_IN, H, W) in NCHW or NHWC memory (read through its strides, no copy)
    w: (C0, C_IN, 3, 3), b: (C0,)      (BatchNorm folded)
    out = ReLU(conv2d(x, w, b, stride=2, padding=1))   (N, C0, ceil(H/2), ceil(W/2)), NHWC memory

This module holds the ``@triton.jit`` code; launcher.py the host side (the tile configuration below,
the kernel limits, the grid, the launch and its cost declaration).

Waterline: why the stem is a gather plus one small tensor-core dot
-----------------------------------------------------------------
At batch 128, 256x256, fp16, C0 = 32 (Small) the stem reads the 3-channel image (50 MB) and writes
the 32-channel 128x128 map (134 MB): 184.5 MB, 55 us at 3.35 TB/s. Its 1.8 GMACs take 3.7 us on the
tensor cores, but 27 x C0 fp32 FMAs per output pixel are 2.1M pixels x 864 / 32 lanes = 57M warp
instructions, 59 us at 4 warp-instructions per clock on 132 SMs: an FMA formulation cannot reach the
DRAM bound (the previous kernel, 27 rank-1 updates, compiled to 2167 SASS instructions per warp per
128 pixels: ~148 us). So the reduction runs on the tensor cores and the kernel's instructions go to
the gather: each output pixel's 27 taps are loaded once (27 scalar loads per pixel, one per thread),
laid out as one row of an im2col tile, and multiplied by the [32, C0] weight matrix in one ``tl.dot``.
K is padded from 27 to 32 (the padding is zeros known at compile time: no loads; the 5/32 extra
tensor-core work is free in a memory-bound kernel).

Tiling and grid
---------------
A tile is BLOCK_M = 128 output pixels of one image: ROWS = BLOCK_M / BW consecutive output rows of
BW pixels (BW = the output width rounded up to a power of two, at most 128: one whole output row at
256x256 input). A program does STEPS = min(4, tile rows) tiles one below the other in a runtime loop,
so its setup (decoding its image and tile position with two scalar divisions, loading the weights
and bias) is paid once per 4 tiles. grid = (N * cdiv(tile rows, STEPS) * tile columns,), all in
grid.x (limit 2^31 - 1, checked by the launcher). Each pixel's (row, column) in its tile comes from
constexpr shifts: no per-pixel division.

The im2col tile
---------------
Column k of the [BLOCK_M, 32] tile is tap k = c * 9 + kh * 3 + kw, the order of a contiguous
(C0, C_IN, 3, 3) weight, so for the usual contiguous weight (``W_CONTIG``) row k of the [32, C0_PAD]
weight operand is simply element k of each output channel's 27. Each tap is a [BLOCK_M] load (one
element per thread, 4 warps x 32 threads = 128 pixels) from one of three row pointers per pixel
(the window's left pixel in each of its rows) plus ``kw * sxw + c * sxc``: with a dense NHWC image
(``NHWC``: channel stride 1, pixel stride C_IN, fixed at compile time) that is an immediate offset in
the load instruction. The 32 loaded vectors become the tile with ``tl.join`` (each join appends a
length-2 axis held by the same thread; joining v_i with v_(i+16), then i with i+8, i+4, i+2, i+1 gives
columns in tap order after the reshape), so every thread holds its pixel's row: no shuffles. Zero
padding of the convolution is the load mask: one predicate per tap position (3 rows x 3 columns,
combined once per pixel), shared by the input channels. C_IN > 3 (up to 16) uses cdiv(9 C_IN, 32)
tiles and dots (their weight rows are then loaded per tile).

Accumulation and epilogue
-------------------------
``acc = dot(A, Wk, bias)`` in fp32 (operands in x's dtype: fp16/bf16 products are exact in fp32;
fp32 inputs use ``tf32x3``, ~fp32 accuracy on tensor cores, exact fp32 in the interpreter), ReLU,
cast, and one store of the tile: C0 is a compile-time constant, so a pixel's C0 outputs are
contiguous 16-byte vectors and a one-row tile is BLOCK_M * C0 contiguous NHWC elements.

Compiled for sm_90 (Small: C0 = 32, fp16, NHWC, batch 128, 256x256; ``tests/kernels/test_stem.py``
keeps these properties): wgmma (HGMMA 64x32x16), 85 registers, no spills, 10 KB of shared memory for
the dot operands; 252 SASS instructions per warp per 128-pixel tile plus ~190 per program (the old
kernel: 2167 per tile). Issue estimate 4096 programs x 4 warps x 1203 / (4 x 132 SMs x 1.83 GHz) =
21 us, under the 55 us DRAM bound (Pico, C0 = 16: 17 us against 35 us). The static report
(``convfirstnet kernels``) predicts 74-100 us (stall cycles and waits of the five programs an SM runs at
once on top of the DRAM term); measured on an H200 (CUDA graph, Triton 3.6): 64 us, 2.9 TB/s of DRAM
traffic, against 209 us for Inductor's conv + ReLU (``benchmarks/results/``, gpu-check-blocks).

Tile constants
--------------
BLOCK_M = 128 = 4 warps x 32 threads: one pixel per thread in the gather, and the M = 128 of two
wgmma 64-row tiles. K_PAD = 32 (27 taps, the next multiple of the fp16 MMA K step 16 that is a
power of two). C0_PAD = C0 rounded up to a power of two >= 16 (the dot's N; masked on store).
ROW_STEPS = 4 tiles per program: ~190 setup instructions shared by 4 tiles of ~250, and still
4096 programs (31 per SM) at batch 128.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tap(row0, row1, row2, k: tl.constexpr, row_top, row_mid, row_bot, col_left, col_right,
         sxc, sxw, C_IN: tl.constexpr):
    """Column k of the im2col tile: x[c, 2 oh - 1 + kh, 2 ow - 1 + kw] for k = c * 9 + kh * 3 + kw,
    zero outside the image (and for the K padding k >= 9 C_IN, without a load). row0..row2 point at
    each window's left pixel in its three rows; with NHWC the rest of the offset is a constant."""
    if k < 9 * C_IN:
        c: tl.constexpr = k // 9
        kh: tl.constexpr = (k // 3) % 3
        kw: tl.constexpr = k % 3
        if kh == 0:
            ptr = row0
            ok = row_top
        elif kh == 1:
            ptr = row1
            ok = row_mid
        else:
            ptr = row2
            ok = row_bot
        if kw == 0:
            ok = ok & col_left
        elif kw == 2:
            ok = ok & col_right
        v = tl.load(ptr + (kw * sxw + c * sxc), mask=ok, other=0.0)
    else:
        v = tl.zeros(row0.shape, dtype=row0.dtype.element_ty)
    return v


@triton.jit
def _im2col32(row0, row1, row2, K0: tl.constexpr, row_top, row_mid, row_bot, col_left, col_right,
              sxc, sxw, C_IN: tl.constexpr, BLOCK_M: tl.constexpr):
    """The [BLOCK_M, 32] im2col tile of taps K0 ... K0 + 31, built from 32 per-pixel loads."""
    v0 = _tap(row0, row1, row2, K0 + 0, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v1 = _tap(row0, row1, row2, K0 + 1, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v2 = _tap(row0, row1, row2, K0 + 2, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v3 = _tap(row0, row1, row2, K0 + 3, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v4 = _tap(row0, row1, row2, K0 + 4, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v5 = _tap(row0, row1, row2, K0 + 5, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v6 = _tap(row0, row1, row2, K0 + 6, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v7 = _tap(row0, row1, row2, K0 + 7, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v8 = _tap(row0, row1, row2, K0 + 8, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v9 = _tap(row0, row1, row2, K0 + 9, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v10 = _tap(row0, row1, row2, K0 + 10, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v11 = _tap(row0, row1, row2, K0 + 11, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v12 = _tap(row0, row1, row2, K0 + 12, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v13 = _tap(row0, row1, row2, K0 + 13, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v14 = _tap(row0, row1, row2, K0 + 14, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v15 = _tap(row0, row1, row2, K0 + 15, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v16 = _tap(row0, row1, row2, K0 + 16, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v17 = _tap(row0, row1, row2, K0 + 17, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v18 = _tap(row0, row1, row2, K0 + 18, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v19 = _tap(row0, row1, row2, K0 + 19, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v20 = _tap(row0, row1, row2, K0 + 20, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v21 = _tap(row0, row1, row2, K0 + 21, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v22 = _tap(row0, row1, row2, K0 + 22, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v23 = _tap(row0, row1, row2, K0 + 23, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v24 = _tap(row0, row1, row2, K0 + 24, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v25 = _tap(row0, row1, row2, K0 + 25, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v26 = _tap(row0, row1, row2, K0 + 26, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v27 = _tap(row0, row1, row2, K0 + 27, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v28 = _tap(row0, row1, row2, K0 + 28, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v29 = _tap(row0, row1, row2, K0 + 29, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v30 = _tap(row0, row1, row2, K0 + 30, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    v31 = _tap(row0, row1, row2, K0 + 31, row_top, row_mid, row_bot, col_left, col_right, sxc, sxw, C_IN)
    # tl.join(a, b) appends an axis of length 2 (a at 0, b at 1). Joining i with i + 16, then the
    # pairs i with i + 8, i + 4, i + 2, i + 1 makes element [m, b1, b2, b3, b4, b5] tap
    # 16 b1 + 8 b2 + 4 b3 + 2 b4 + b5: the row-major reshape to [BLOCK_M, 32] puts tap k in column k.
    p0, p1, p2, p3 = tl.join(v0, v16), tl.join(v1, v17), tl.join(v2, v18), tl.join(v3, v19)
    p4, p5, p6, p7 = tl.join(v4, v20), tl.join(v5, v21), tl.join(v6, v22), tl.join(v7, v23)
    p8, p9, p10, p11 = tl.join(v8, v24), tl.join(v9, v25), tl.join(v10, v26), tl.join(v11, v27)
    p12, p13, p14, p15 = tl.join(v12, v28), tl.join(v13, v29), tl.join(v14, v30), tl.join(v15, v31)
    q0, q1, q2, q3 = tl.join(p0, p8), tl.join(p1, p9), tl.join(p2, p10), tl.join(p3, p11)
    q4, q5, q6, q7 = tl.join(p4, p12), tl.join(p5, p13), tl.join(p6, p14), tl.join(p7, p15)
    r0, r1, r2, r3 = tl.join(q0, q4), tl.join(q1, q5), tl.join(q2, q6), tl.join(q3, q7)
    s0, s1 = tl.join(r0, r2), tl.join(r1, r3)
    return tl.reshape(tl.join(s0, s1), (BLOCK_M, 32))


@triton.jit
def _w_chunk(w_ptr, chunk: tl.constexpr, offs_c, c_ok, swo, swi, swh, sww, C_IN: tl.constexpr,
             W_CONTIG: tl.constexpr):
    """Rows chunk * 32 ... + 31 of the [K_PAD, C_PAD] weight operand: row k holds tap k of every output
    channel (zero past the 9 * C_IN taps and the C0 channels)."""
    k = chunk * 32 + tl.arange(0, 32)
    if W_CONTIG:  # w[o, c, kh, kw] at o * 9 C_IN + k
        w_off = k[:, None] + offs_c[None, :] * (9 * C_IN)
    else:
        w_off = (k // 9 * swi + (k // 3) % 3 * swh + k % 3 * sww)[:, None] + offs_c[None, :] * swo
    return tl.load(w_ptr + w_off, mask=(k < 9 * C_IN)[:, None] & c_ok[None, :], other=0.0)


@triton.jit
def _stem_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, out_ptr,
    # sizes: input H x W, output HO x WO; tiles per image: TILES_H x TILES_W; tile rows per program
    H, W, HO, WO, TILES_H, TILES_W, STEPS,
    # strides (elements) of x as logical (N, C_IN, H, W) and of w (C0, C_IN, 3, 3)
    sxn, sxc, sxh, sxw,
    swo, swi, swh, sww,
    # meta-parameters
    C_IN: tl.constexpr, C0: tl.constexpr, C_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BW: tl.constexpr,
    NHWC: tl.constexpr, W_CONTIG: tl.constexpr, PREC: tl.constexpr,
):
    tl.static_assert(BLOCK_M % BW == 0)
    ROWS: tl.constexpr = BLOCK_M // BW
    K_CHUNKS: tl.constexpr = (9 * C_IN + 31) // 32
    if NHWC:  # dense NHWC pixels: channel stride 1, pixel stride C_IN, known at compile time
        sxc = 1
        sxw = C_IN

    # program -> (image n, first tile row th0, tile column tw); it does tile rows th0 ... th0 + STEPS - 1
    pid = tl.program_id(0)
    tw = pid % TILES_W
    t = pid // TILES_W
    groups_h = tl.cdiv(TILES_H, STEPS)
    th0 = (t % groups_h) * STEPS
    n = t // groups_h
    x_img = x_ptr + n.to(tl.int64) * sxn
    out_img = out_ptr + n.to(tl.int64) * HO * WO * C0

    m = tl.arange(0, BLOCK_M)
    ow = tw * BW + m % BW
    iw0 = 2 * ow - 1  # left tap column of each window
    col_ok = ow < WO
    col_left = iw0 >= 0  # only the first and last columns / rows can fall outside the image
    col_right = iw0 + 2 < W
    pix = (m // BW) * WO + ow  # output pixel of each tile row, relative to the tile's first row

    offs_c = tl.arange(0, C_PAD)
    c_ok = offs_c < C0
    bias = tl.load(b_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    if K_CHUNKS == 1:  # the whole weight operand, loaded once (C_IN <= 3)
        w0 = _w_chunk(w_ptr, 0, offs_c, c_ok, swo, swi, swh, sww, C_IN, W_CONTIG)

    for th in range(th0, tl.minimum(th0 + STEPS, TILES_H)):
        oh = th * ROWS + m // BW
        m_ok = col_ok & (oh < HO)
        ih0 = 2 * oh - 1  # top tap row of each window
        row_top = m_ok & (ih0 >= 0)
        row_bot = m_ok & (ih0 + 2 < H)
        row0 = x_img + (ih0 * sxh + iw0 * sxw)  # each window's top-left tap
        row1 = row0 + sxh
        row2 = row1 + sxh
        acc = tl.broadcast_to(bias[None, :], (BLOCK_M, C_PAD))
        for chunk in tl.static_range(K_CHUNKS):
            a = _im2col32(row0, row1, row2, chunk * 32, row_top, m_ok, row_bot, col_left, col_right,
                          sxc, sxw, C_IN, BLOCK_M)
            if K_CHUNKS == 1:
                wk = w0
            else:
                wk = _w_chunk(w_ptr, chunk, offs_c, c_ok, swo, swi, swh, sww, C_IN, W_CONTIG)
            acc = tl.dot(a, wk, acc, input_precision=PREC)
        acc = tl.maximum(acc, 0.0)
        # NHWC output: the tile's first row, then r * WO + column for row r of the tile
        tile = out_img + th * ROWS * WO * C0
        tl.store(tile + pix[:, None] * C0 + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & c_ok[None, :])
