"""Block-fusion Triton kernels for the ConvFirst block (paper Section 5.3.1, Fig. 7b), NHWC.

What is computed (reference.py is the specification; weights are BatchNorm-folded):

    stride 1, C -> C:  y = gconv3x3(x) + b_conv;  out = x + b2 + W2 ReLU(W1 y + b1)
    stride 2, C -> K:  y = gconv3x3(x) + b_conv at full resolution;  u = BlurPool(cat[x, y]);
                       out = b2 + W2 ReLU(W1 u + b1)                               (no residual)

gconv3x3 has group width 8 (groups = C / 8), padding 1. BlurPool is [1,2,1] (x) [1,2,1] / 16,
stride 2, reflect padding 1, output ceil(H/2) x ceil(W/2).

Tiling and grid
---------------
A program owns a TH x TW tile of output pixels of one image and all output channels; the grid is
1-D with N x ceil(H'/TH) x ceil(W'/TW) programs (no grid.y limit on the batch). The tile position
costs one scalar division per program and the pixel coordinates inside it are shifts and masks (TW
is a power of two): a flat N*H*W tiling needs integer divisions by H*W and W per element, which the
compiler rematerialises in every layout that uses them (8% of the instructions of a C = 64
prototype). After
the conv every layer of the block is per pixel, so output tiles are independent; input tiles overlap
by the halo, which the loads read through L1. Pixels outside the map are masked.

x is read through its strides when its channel stride is 1 and the others are multiples of 8
elements (any channels-last tensor or crop): 8 channels are one 16-byte vector. Other layouts (NCHW,
odd views) are copied to channels-last once by the launcher. The output is NHWC.

Channel parts instead of power-of-two padding. tl.dot tiles are powers of two >= 16, so a width is
rounded up to a multiple of 16 and split into at most two power-of-two parts, each its own dot:
96 = 64 + 32 and 48 = 32 + 16 (no padding); 24 -> 32 and 72 -> 64 + 16 are padded and masked.

Stride 1: the grouped conv as batched two-tap dots
--------------------------------------------------
A group has 8 input channels but tl.dot needs K >= 16. Step s (of 5) multiplies, for all groups g of
a channel part at once (a batched 3-D dot over the G groups):

    [x(tap 2s)[:, g] | x(tap 2s + 1)[:, g]]   [G, M, 16]   @   [W_g(tap 2s); W_g(tap 2s + 1)]   [G, 16, 8]

The tenth tap slot is masked to zero, so the issued conv MACs are 10/9 of the useful ones. The
batched dot compiles to mma.sync (m16n8k16); its [G, M, 8] result is permuted to [M, C] once. The
tap loads carry cache_modifier=".ca": the software pipeliner then emits cp.async.ca (L1-allocating)
instead of the L1-bypassing cp.async.cg, so the halo re-reads of a tile hit L1 (pinned by the
compile test). The weights are read through their strides; FusedConvFirst stores w_conv tap-major
(blocks.tap_major: memory order kh, kw, ci, co), where each tap's [16, 8] group block is two
16-byte vectors.

FFN over hidden chunks (both kernels)
-------------------------------------
acc starts at residual + b2 (stride 1) or b2 (stride 2); for each chunk of BLOCK_H hidden channels

    hid = ReLU(y @ W1[chunk]^T + b1[chunk]);   acc += hid @ W2[:, chunk]^T

both on wgmma (the weight chunks staged in shared memory by cp.async, two stages). The hidden tile
never leaves the chip. Per hidden value the epilogue is what bounds the t = 6 blocks (SiLU is not
used here, ReLU is): the bias add and ReLU + fp16 pack are two FADDs and one cvt.rn.relu.f16x2.f32
per pair (inline asm, ASM=True on a GPU; the interpreter runs tl.maximum then the cast, the same
values). A chunk costs 190-240 SASS instructions per warp, of which 100-180 are per-chunk overhead
(wgmma descriptors, barriers, the b1 load) that larger tiles amortise.

Stride 2: blur first, the 5x5 window read once
----------------------------------------------
BlurPool and the conv are linear, so blur(y) = sum_tap Xb_tap @ Wbd_tap + b_conv (the blur weights
sum to 1) and blur(x) = Xb_centre, where Xb_tap = sum_b f_b x(2o + b + tap - 2) is the blurred input
of conv tap `tap`. All nine come from the 5x5 window of x around (2oh, 2ow), loaded once (25
vector loads per 8 channels instead of the 81 of blurring per tap). BlurPool's reflect padding is
folded into per-row and per-column blur weights: [1, 2, 1]/4 inside, [0, 2, 2]/4 for the first
row/column (-1 reflects to 1), [2, 2, 0]/4 for the last one of an odd size (H reflects to H - 2);
all are powers of two, exact in fp16. The conv's zero padding (applied after the reflection, as in
the reference) is the load mask. The blur is separable: each window row is blurred along w for the
three tap columns, and the nine tap inputs are vertical blurs of three rows: 72 multiply-adds per
pair of channels, as HFMA2 in fp16 (only the additions round) and in fp32 for bf16/fp32 inputs.
Each tap input then feeds one block-diagonal dot [M, P] @ [P, P] (wgmma) per channel part of P
channels (P = the padded width up to 32, else 16: with 64 channels, four parts keep the window's
registers below the spill point). Issued conv MACs: 9 P per channel per output pixel, against the
288 the paper counts for the full-resolution conv: blurring first does a quarter of the work.
The FFN's expand takes [blur(x) | blur(y)] as two K parts; the concat is never built.

Accumulation and precision
--------------------------
Dots accumulate in fp32. y (stride 2: each blurred tap input and blur(y)) and the hidden tile are
rounded to the activation dtype before the next dot, where a layer-wise network stores them; the
residual and the biases are added in fp32; the output is rounded once. fp32 inputs use
input_precision="tf32x3" (3xTF32, ~fp32 accuracy) with smaller tiles; the interpreter computes
every dot in fp32. bf16 runs only on a GPU (the interpreter's bf16 dot is wrong).

Waterline as compiled (sm_90, ConvFirstNet-Small, batch 128, 256 x 256, fp16)
------------------------------------------------------------------------------
From the static cost report's model: t_tensor = issued MACs at 989.4 TFLOP/s (times the wave
quantisation), t_dram = minimal bytes (x read once, out written once, weights once) at 3.35 TB/s,
t_issue = SASS instructions per warp weighted by the declared loop trips, x warps x programs, at 4
warp-instructions per clock per SM (132 SMs, 1.83 GHz); predicted = the largest. Layer-wise = the
waterline's bound for the same block run as separate layers. Before = the previous kernels
(block-diagonal conv padded to C_PAD, flat 64/128-pixel tiles, 81 loads per stride-2 tile).

    block (C, R, K, s, map)        issued/useful   t_tensor  t_dram  t_issue  predicted | layer-wise  before
    32,  96, 32, 1, 128^2  (x2)         1.03         37.5     80.1     77.8     80.1   |    440.7     206.7
    32, 192, 64, 2, 128^2               0.98         36.4     60.1     72.7     72.7   |    500.8     439.8
    64, 384, 64, 1,  64^2  (x4)         1.01         59.3     40.1     51.3     59.3   |    340.6     170.2
    64, 384, 96, 2,  64^2               0.90         26.0     27.6     39.4     39.4   |    248.0     250.1
    96, 576, 96, 1,  32^2  (x5)         1.01         32.3     15.1     28.2     32.3   |    127.8     143.0
                                                                                     (microseconds)
    stage 1 / 2 / 3 predicted: 0.160 / 0.310 / 0.201 ms   (before 0.413 / 1.121 / 0.965)
    layer-wise bound:          0.881 / 1.863 / 0.887 ms;  block-fusion bound: 0.160 / 0.288 / 0.184

Compiled variants (registers, stack, shared memory, weighted SASS instructions per warp per program):
s1 C=32 16x16 tile, 4 warps: 226 regs, no stack, 33 KB, 2261; s2 32->64 8x8, 4 warps: 166, 0, 37 KB,
2113; s1 C=64 16x16, 8 warps: 250, 0, 66 KB, 2931; s2 64->96 8x16, 8 warps: 194, 0, 72 KB, 4504;
s1 C=96 16x16, 8 warps, BLOCK_H 32: 253, 0, 72 KB, 6448. Stage 1 sits on its DRAM bound, the t = 6
blocks on their tensor bound; the stride-2 blocks are issue bound (the 72 HFMA2 per channel pair of
the blur and the window's masked loads).

Not in the model: the weights are re-read from L2 by every program (W1 + W2 are 98 KB at C = 64 and
221 KB at C = 96 in fp16, per 256-pixel tile: 0.4 and 0.9 KB per pixel); the small-N dots (the conv's
m16n8k16, stride 2's N = 16) run below the tensor-core peak when their operands come from shared
memory. A GPU measurement decides whether persistent programs that keep the weights on chip pay off.

Host side (tile table, checks, grid, launch, cost declaration): launcher.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ------------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------------


@triton.jit
def _bias_relu(acc, bias, dt: tl.constexpr, ASM: tl.constexpr):
    """ReLU(acc + bias) rounded once to `dt` (fp32 acc and bias).

    ASM (16-bit dt, compiled for a GPU): two fp32 adds and one `cvt.rn.relu.{f16,bf16}x2.f32`, which
    applies the ReLU and packs two results per instruction (sm_80+). The plain path computes the same
    values (max then round == round then max) and is what the interpreter runs.
    """
    if ASM and dt == tl.float16:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t0, t1; add.f32 t0, $1, $3; add.f32 t1, $2, $4; "
            "cvt.rn.relu.f16x2.f32 $0, t1, t0; }",
            "=r,r,r,r,r", [acc, bias], dtype=tl.float16, is_pure=True, pack=2,
        )
    elif ASM and dt == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t0, t1; add.f32 t0, $1, $3; add.f32 t1, $2, $4; "
            "cvt.rn.relu.bf16x2.f32 $0, t1, t0; }",
            "=r,r,r,r,r", [acc, bias], dtype=tl.bfloat16, is_pure=True, pack=2,
        )
    else:
        return tl.maximum(acc + bias, 0.0).to(dt)


@triton.jit
def _ffn(
    a0, a1, acc0, acc1,
    w1_ptr, b1_ptr, w2_ptr, R, sw1_r, sw1_c, sw2_k, sw2_r,
    A0: tl.constexpr, A0_END: tl.constexpr, A1: tl.constexpr, A1_BASE: tl.constexpr, A1_END: tl.constexpr,
    K0: tl.constexpr, K1: tl.constexpr, K: tl.constexpr,
    BLOCK_H: tl.constexpr, EVEN_R: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
):
    """acc += ReLU([a0 | a1] @ W1^T + b1) @ W2^T over hidden chunks of BLOCK_H (the hidden tile never
    leaves the chip).

    a0: [M, A0] holds W1 columns [0, A0) (valid below A0_END); a1: [M, A1] holds columns
    [A1_BASE, A1_BASE + A1) (valid below A1_END), absent when A1 == 0. The output is split into
    power-of-two parts acc0 [M, K0] (channels [0, K0)) and acc1 [M, K1] ([K0, K0 + K1)), valid below K.
    """
    dt = a0.dtype
    offs_h = tl.arange(0, BLOCK_H)
    c0 = tl.arange(0, A0)
    k0 = tl.arange(0, K0)
    for h0 in range(0, R, BLOCK_H):
        hh = h0 + offs_h
        h_ok = hh < R
        if EVEN_R:
            h_ok = tl.full((BLOCK_H,), 1, tl.int1)
        w1p = w1_ptr + hh[None, :] * sw1_r
        m = h_ok[None, :]
        if A0 > A0_END:
            m = m & (c0 < A0_END)[:, None]
        hid = tl.dot(a0, tl.load(w1p + c0[:, None] * sw1_c, mask=m, other=0.0), input_precision=PRECISION)
        if A1 > 0:
            c1 = A1_BASE + tl.arange(0, A1)
            m = h_ok[None, :]
            if A1_BASE + A1 > A1_END:
                m = m & (c1 < A1_END)[:, None]
            hid = tl.dot(a1, tl.load(w1p + c1[:, None] * sw1_c, mask=m, other=0.0), hid,
                         input_precision=PRECISION)
        b1 = tl.load(b1_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
        hid = _bias_relu(hid, b1[None, :], dt, ASM)
        w2p = w2_ptr + hh[:, None] * sw2_r
        m = h_ok[:, None]
        if K0 > K:
            m = m & (k0 < K)[None, :]
        acc0 = tl.dot(hid, tl.load(w2p + k0[None, :] * sw2_k, mask=m, other=0.0), acc0,
                      input_precision=PRECISION)
        if K1 > 0:
            k1 = K0 + tl.arange(0, K1)
            m = h_ok[:, None]
            if K0 + K1 > K:
                m = m & (k1 < K)[None, :]
            acc1 = tl.dot(hid, tl.load(w2p + k1[None, :] * sw2_k, mask=m, other=0.0), acc1,
                          input_precision=PRECISION)
    return acc0, acc1


@triton.jit
def _store_part(out_pix, acc, m_ok, KB: tl.constexpr, P: tl.constexpr, K: tl.constexpr):
    """Store channels [KB, KB + P) (valid below K) of an NHWC tile; out_pix points at channel 0."""
    k = KB + tl.arange(0, P)
    m = m_ok[:, None]
    if KB + P > K:
        m = m & (k < K)[None, :]
    tl.store(out_pix[:, None] + k[None, :], acc.to(out_pix.dtype.element_ty), mask=m)


@triton.jit
def _load_part(pix, m_ok, KB: tl.constexpr, P: tl.constexpr, K: tl.constexpr):
    """Load channels [KB, KB + P) (zero at and above K) of an NHWC tile as fp32."""
    k = KB + tl.arange(0, P)
    m = m_ok[:, None]
    if KB + P > K:
        m = m & (k < K)[None, :]
    return tl.load(pix[:, None] + k[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _load_vec(ptr, KB: tl.constexpr, P: tl.constexpr, K: tl.constexpr):
    k = KB + tl.arange(0, P)
    if KB + P > K:
        return tl.load(ptr + k, mask=k < K, other=0.0).to(tl.float32)
    else:
        return tl.load(ptr + k).to(tl.float32)


# ------------------------------------------------------------------------------------------------
# Stride 1
# ------------------------------------------------------------------------------------------------


@triton.jit
def _gconv_pairs(
    x_pix, oh, ow, m_ok, H, W, sxh, sxw,
    wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr,
    C: tl.constexpr, CB: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grouped 3x3 conv (padding 1) of channels [CB, CB + P) for a tile: [BLOCK_M, P] in x's dtype.

    Two taps per K = 16: step s multiplies, for every group g of 8 channels at once (a batched dot),
    [x(tap 2s) | x(tap 2s+1)] ([P/8, BLOCK_M, 16]) by [W(tap 2s); W(tap 2s+1)] ([P/8, 16, 8]).
    Five steps cover the nine taps and one zero tap (masked): 10/9 of the useful MACs.
    """
    G: tl.constexpr = P // 8
    g = tl.arange(0, G)[:, None, None]
    j = tl.arange(0, 16)[None, None, :]  # K index: tap half (j // 8), channel in group (j % 8)
    ok3 = m_ok[None, :, None]
    if CB + P > C:
        ok3 = ok3 & (CB + 8 * g + j % 8 < C)
    x_base = x_pix[None, :, None] + (CB + 8 * g + j % 8)  # [G, M, 16], 8 contiguous channels per tap
    oh3 = oh[None, :, None]
    ow3 = ow[None, :, None]
    wj = tl.arange(0, 16)[None, :, None]
    wco = CB + 8 * g + tl.arange(0, 8)[None, None, :]  # [G, 1, 8] output channel
    w_base = wc_ptr + wco * swc_o + (wj % 8) * swc_i  # [G, 16, 8]
    acc = tl.zeros((G, BLOCK_M, 8), tl.float32)
    for step in range(5):
        tap = 2 * step + j // 8
        dh = tap // 3 - 1
        dw = tap % 3 - 1
        ih = oh3 + dh
        iw = ow3 + dw
        ok = ok3 & (tap < 9) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        # ".ca": the nine shifted windows of a tile overlap, keep them in L1 (not cp.async.cg)
        xv = tl.load(x_base + dh * sxh + dw * sxw, mask=ok, other=0.0, cache_modifier=".ca")
        wtap = 2 * step + wj // 8
        w_ok = wtap < 9
        if CB + P > C:
            w_ok = w_ok & (wco < C)
        wv = tl.load(w_base + (wtap // 3) * swc_h + (wtap % 3) * swc_w, mask=w_ok, other=0.0)
        acc = tl.dot(xv, wv, acc, input_precision=PRECISION)
    if CB + P > C:
        acc += tl.load(bc_ptr + wco, mask=wco < C, other=0.0).to(tl.float32)
    else:
        acc += tl.load(bc_ptr + wco).to(tl.float32)
    # [G, M, 8] -> [M, P]: channel 8g + n of pixel m
    return tl.reshape(tl.permute(acc.to(x_pix.dtype.element_ty), (1, 0, 2)), (BLOCK_M, P))


@triton.jit
def _program_tile(H, W, TH: tl.constexpr, TW: tl.constexpr):
    """This program's image n and its TH x TW tile of the H x W output map (grid: N x tiles per image):
    each row's output pixel (oh, ow) and whether it lies inside the map."""
    pid = tl.program_id(0)
    tiles_w = tl.cdiv(W, TW)
    tiles = tl.cdiv(H, TH) * tiles_w
    n = pid // tiles
    t = pid % tiles
    r = tl.arange(0, TH * TW)
    oh = (t // tiles_w) * TH + r // TW
    ow = (t % tiles_w) * TW + r % TW
    return n, oh, ow, (oh < H) & (ow < W)


@triton.jit
def _convfirst_s1_kernel(
    # pointers
    x_ptr, wc_ptr, bc_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,
    # sizes: H x W map, R hidden channels (C is a constexpr)
    H, W, R,
    # strides (elements): x as logical (N, C, H, W) with unit channel stride, weights as given
    sxn, sxh, sxw,
    swc_o, swc_i, swc_h, swc_w,  # w_conv (C, 8, 3, 3)
    sw1_r, sw1_c,  # w1 (R, C)
    sw2_k, sw2_r,  # w2 (C, R)
    # meta-parameters
    C: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
    BLOCK_H: tl.constexpr, EVEN_R: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
):
    tl.static_assert(C0 >= 16 and C1 >= 0 and C0 + C1 >= C, "channel parts must cover C")
    tl.static_assert(BLOCK_H >= 16, "tl.dot operands need >= 16 hidden channels")
    BLOCK_M: tl.constexpr = TH * TW
    # the launcher guarantees strides that are multiples of 8 elements (16-byte vectors of 8 channels)
    sxn = tl.multiple_of(sxn, 8)
    sxh = tl.multiple_of(sxh, 8)
    sxw = tl.multiple_of(sxw, 8)
    n, oh, ow, m_ok = _program_tile(H, W, TH, TW)
    x_pix = x_ptr + n.to(tl.int64) * sxn + oh * sxh + ow * sxw
    out_pix = out_ptr + (n.to(tl.int64) * H * W + oh * W + ow) * C

    y0 = _gconv_pairs(x_pix, oh, ow, m_ok, H, W, sxh, sxw, wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr,
                      C, 0, C0, BLOCK_M, PRECISION)
    acc0 = _load_part(x_pix, m_ok, 0, C0, C) + _load_vec(b2_ptr, 0, C0, C)[None, :]
    y1 = y0
    acc1 = acc0
    if C1 > 0:
        y1 = _gconv_pairs(x_pix, oh, ow, m_ok, H, W, sxh, sxw, wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr,
                          C, C0, C1, BLOCK_M, PRECISION)
        acc1 = _load_part(x_pix, m_ok, C0, C1, C) + _load_vec(b2_ptr, C0, C1, C)[None, :]
    acc0, acc1 = _ffn(y0, y1, acc0, acc1, w1_ptr, b1_ptr, w2_ptr, R, sw1_r, sw1_c, sw2_k, sw2_r,
                      C0, C, C1, C0, C, C0, C1, C, BLOCK_H, EVEN_R, PRECISION, ASM)
    _store_part(out_pix, acc0, m_ok, 0, C0, C)
    if C1 > 0:
        _store_part(out_pix, acc1, m_ok, C0, C1, C)


# ------------------------------------------------------------------------------------------------
# Stride 2
# ------------------------------------------------------------------------------------------------


@triton.jit
def _hblur(p, ow2, row_ok, c_ok, W, sxw, a0, a1, a2, BT: tl.constexpr):
    """One window row (p: [M, P] pointers at column 2ow), blurred along w for the three conv column
    taps: z_tw = a0 x(2ow + tw - 2) + a1 x(2ow + tw - 1) + a2 x(2ow + tw), zero outside the map, in BT."""
    ok = row_ok[:, None] & c_ok
    c = ow2[:, None]
    xm2 = tl.load(p - 2 * sxw, mask=ok & (c >= 2), other=0.0).to(BT)
    xm1 = tl.load(p - sxw, mask=ok & (c >= 1), other=0.0).to(BT)
    x0 = tl.load(p, mask=ok, other=0.0).to(BT)
    xp1 = tl.load(p + sxw, mask=ok & (c + 1 < W), other=0.0).to(BT)
    xp2 = tl.load(p + 2 * sxw, mask=ok & (c + 2 < W), other=0.0).to(BT)
    z0 = xm2 * a0 + xm1 * a1 + x0 * a2
    z1 = xm1 * a0 + x0 * a1 + xp1 * a2
    z2 = x0 * a0 + xp1 * a1 + xp2 * a2
    return z0, z1, z2


@triton.jit
def _vtap(acc, za, zb, zc, ah0, ah1, ah2, w_base, TAP_H: tl.constexpr, TAP_W: tl.constexpr, w_ok,
          swc_h, swc_w, dt: tl.constexpr, PRECISION: tl.constexpr):
    """acc += Xb @ Wbd for conv tap (TAP_H, TAP_W), where Xb = ah0 za + ah1 zb + ah2 zc is the tap's
    blurred input and Wbd[ci, co] = w_conv[co, ci % 8, tap] within a group (block diagonal).
    Returns (acc, Xb)."""
    xb = (za * ah0 + zb * ah1 + zc * ah2).to(dt)
    wt = tl.load(w_base + TAP_H * swc_h + TAP_W * swc_w, mask=w_ok, other=0.0)
    return tl.dot(xb, wt, acc, input_precision=PRECISION), xb


@triton.jit
def _cat_cols(a, b, BLOCK_M: tl.constexpr, P: tl.constexpr):
    """[M, P] | [M, P] -> [M, 2P] (columns of a, then of b)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (BLOCK_M, 2 * P))


@triton.jit
def _blur_conv(
    xc, oh2, ow2, m_ok, H, W, sxh, sxw, ah0, ah1, ah2, aw0, aw1, aw2,
    wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr,
    C: tl.constexpr, CB: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, ROW_LOOP: tl.constexpr,
):
    """(blur(y), blur(x)) for channels [CB, CB + P) of a tile, both [BLOCK_M, P] in x's dtype.

    xc: [BLOCK_M, P] pointers at x(2oh, 2ow, CB + j). Window rows -2..2 are each blurred along w for
    the three conv column taps (z[row][tw]); the nine conv-tap inputs are the vertical blurs of three
    consecutive rows. Rows are consumed in order, so at most four rows of z are live.
    """
    dt = xc.dtype.element_ty
    c_ok = tl.full((1, P), 1, tl.int1)
    if CB + P > C:
        c_ok = ((CB + tl.arange(0, P)) < C)[None, :]
    ci = tl.arange(0, P)[:, None]
    co = (CB + tl.arange(0, P))[None, :]
    w_ok = ci // 8 == (co - CB) // 8
    if CB + P > C:
        w_ok = w_ok & (co < C)
    w_base = wc_ptr + co * swc_o + (ci % 8) * swc_i
    acc = tl.zeros((BLOCK_M, P), tl.float32)
    if ROW_LOOP:
        # the same computation with a runtime loop over the three tap rows (tap row th needs window
        # rows th-2..th): a third of the code, ~35% more instructions (register rotation, addresses)
        za0, za1, za2 = _hblur(xc - 2 * sxh, ow2, m_ok & (oh2 >= 2), c_ok, W, sxw, aw0, aw1, aw2, BT)
        zb0, zb1, zb2 = _hblur(xc - sxh, ow2, m_ok & (oh2 >= 1), c_ok, W, sxw, aw0, aw1, aw2, BT)
        ux = tl.zeros((BLOCK_M, P), dt)
        for th in range(3):
            zc0, zc1, zc2 = _hblur(xc + th * sxh, ow2, m_ok & (oh2 + th < H), c_ok, W, sxw, aw0, aw1, aw2, BT)
            w_row = w_base + th * swc_h
            acc, _ = _vtap(acc, za0, zb0, zc0, ah0, ah1, ah2, w_row, 0, 0, w_ok, swc_h, swc_w, dt, PRECISION)
            acc, xb = _vtap(acc, za1, zb1, zc1, ah0, ah1, ah2, w_row, 0, 1, w_ok, swc_h, swc_w, dt, PRECISION)
            ux = tl.where(th == 1, xb, ux)  # blur(x) is the blurred input of the centre tap
            acc, _ = _vtap(acc, za2, zb2, zc2, ah0, ah1, ah2, w_row, 0, 2, w_ok, swc_h, swc_w, dt, PRECISION)
            za0, za1, za2 = zb0, zb1, zb2
            zb0, zb1, zb2 = zc0, zc1, zc2
    else:
        z00, z01, z02 = _hblur(xc - 2 * sxh, ow2, m_ok & (oh2 >= 2), c_ok, W, sxw, aw0, aw1, aw2, BT)
        z10, z11, z12 = _hblur(xc - sxh, ow2, m_ok & (oh2 >= 1), c_ok, W, sxw, aw0, aw1, aw2, BT)
        z20, z21, z22 = _hblur(xc, ow2, m_ok, c_ok, W, sxw, aw0, aw1, aw2, BT)
        acc, _ = _vtap(acc, z00, z10, z20, ah0, ah1, ah2, w_base, 0, 0, w_ok, swc_h, swc_w, dt, PRECISION)
        acc, _ = _vtap(acc, z01, z11, z21, ah0, ah1, ah2, w_base, 0, 1, w_ok, swc_h, swc_w, dt, PRECISION)
        acc, _ = _vtap(acc, z02, z12, z22, ah0, ah1, ah2, w_base, 0, 2, w_ok, swc_h, swc_w, dt, PRECISION)
        z30, z31, z32 = _hblur(xc + sxh, ow2, m_ok & (oh2 + 1 < H), c_ok, W, sxw, aw0, aw1, aw2, BT)
        acc, _ = _vtap(acc, z10, z20, z30, ah0, ah1, ah2, w_base, 1, 0, w_ok, swc_h, swc_w, dt, PRECISION)
        acc, ux = _vtap(acc, z11, z21, z31, ah0, ah1, ah2, w_base, 1, 1, w_ok, swc_h, swc_w, dt, PRECISION)
        acc, _ = _vtap(acc, z12, z22, z32, ah0, ah1, ah2, w_base, 1, 2, w_ok, swc_h, swc_w, dt, PRECISION)
        z40, z41, z42 = _hblur(xc + 2 * sxh, ow2, m_ok & (oh2 + 2 < H), c_ok, W, sxw, aw0, aw1, aw2, BT)
        acc, _ = _vtap(acc, z20, z30, z40, ah0, ah1, ah2, w_base, 2, 0, w_ok, swc_h, swc_w, dt, PRECISION)
        acc, _ = _vtap(acc, z21, z31, z41, ah0, ah1, ah2, w_base, 2, 1, w_ok, swc_h, swc_w, dt, PRECISION)
        acc, _ = _vtap(acc, z22, z32, z42, ah0, ah1, ah2, w_base, 2, 2, w_ok, swc_h, swc_w, dt, PRECISION)
    # blur(y) = sum_tap Xb_tap @ Wbd_tap + b_conv (the blur weights sum to 1); blur(x) = Xb of the centre tap
    uy = (acc + _load_vec(bc_ptr, CB, P, C)[None, :]).to(dt)
    return uy, ux


@triton.jit
def _convfirst_s2_kernel(
    # pointers
    x_ptr, wc_ptr, bc_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,
    # sizes: H x W input, HO x WO output, R hidden channels (C, K are constexprs)
    H, W, HO, WO, R,
    # strides (elements)
    sxn, sxh, sxw,
    swc_o, swc_i, swc_h, swc_w,  # w_conv (C, 8, 3, 3)
    sw1_r, sw1_c,  # w1 (R, 2C): columns [0, C) act on blur(x), [C, 2C) on blur(y)
    sw2_k, sw2_r,  # w2 (K, R)
    # meta-parameters
    C: tl.constexpr, CP: tl.constexpr, CP2: tl.constexpr, K: tl.constexpr, K0: tl.constexpr,
    K1: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_R: tl.constexpr,
    PRECISION: tl.constexpr, ASM: tl.constexpr, BLUR_F16: tl.constexpr, ROW_LOOP: tl.constexpr,
):
    tl.static_assert(CP >= 16 and CP >= C, "CP: channels padded to a power of two >= 16")
    tl.static_assert(K0 >= 16 and K0 + K1 >= K, "output parts must cover K")
    BLOCK_M: tl.constexpr = TH * TW
    if BLUR_F16:
        bt: tl.constexpr = tl.float16
    else:
        bt: tl.constexpr = tl.float32
    sxn = tl.multiple_of(sxn, 8)
    sxh = tl.multiple_of(sxh, 8)
    sxw = tl.multiple_of(sxw, 8)
    n, oh, ow, m_ok = _program_tile(HO, WO, TH, TW)
    # BlurPool's reflect padding folded into per-row / per-column blur weights (exact powers of two):
    # [1/4, 1/2, 1/4] inside; first row/column (reflects -1 -> 1): [0, 1/2, 1/2]; last one of an odd
    # size (reflects H -> H - 2): [1/2, 1/2, 0].
    top = oh == 0
    bot = 2 * oh + 1 == H
    ah0 = tl.where(top, 0.0, tl.where(bot, 0.5, 0.25)).to(bt)[:, None]
    ah1 = tl.full((BLOCK_M, 1), 0.5, bt)
    ah2 = tl.where(top, 0.5, tl.where(bot, 0.0, 0.25)).to(bt)[:, None]
    left = ow == 0
    right = 2 * ow + 1 == W
    aw0 = tl.where(left, 0.0, tl.where(right, 0.5, 0.25)).to(bt)[:, None]
    aw1 = tl.full((BLOCK_M, 1), 0.5, bt)
    aw2 = tl.where(left, 0.5, tl.where(right, 0.0, 0.25)).to(bt)[:, None]
    oh2 = 2 * oh
    ow2 = 2 * ow
    xc = x_ptr + n.to(tl.int64) * sxn + oh2 * sxh + ow2 * sxw  # window centre (2oh, 2ow)

    xc = xc[:, None] + tl.arange(0, CP2)[None, :]
    # channel parts of CP2 (the grouped conv never mixes them): 1, 2 or 4 parts, concatenated
    uy, ux = _blur_conv(xc, oh2, ow2, m_ok, H, W, sxh, sxw, ah0, ah1, ah2, aw0, aw1, aw2,
                        wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr, C, 0, CP2, BLOCK_M, bt, PRECISION,
                        ROW_LOOP)
    if CP >= 2 * CP2:
        uy1, ux1 = _blur_conv(xc + CP2, oh2, ow2, m_ok, H, W, sxh, sxw, ah0, ah1, ah2, aw0, aw1, aw2,
                              wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr, C, CP2, CP2, BLOCK_M, bt, PRECISION,
                              ROW_LOOP)
        if CP == 4 * CP2:
            uy2, ux2 = _blur_conv(xc + 2 * CP2, oh2, ow2, m_ok, H, W, sxh, sxw, ah0, ah1, ah2, aw0, aw1, aw2,
                                  wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr, C, 2 * CP2, CP2, BLOCK_M, bt,
                                  PRECISION, ROW_LOOP)
            uy3, ux3 = _blur_conv(xc + 3 * CP2, oh2, ow2, m_ok, H, W, sxh, sxw, ah0, ah1, ah2, aw0, aw1, aw2,
                                  wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr, C, 3 * CP2, CP2, BLOCK_M, bt,
                                  PRECISION, ROW_LOOP)
            uy = _cat_cols(_cat_cols(uy, uy1, BLOCK_M, CP2), _cat_cols(uy2, uy3, BLOCK_M, CP2),
                           BLOCK_M, 2 * CP2)
            ux = _cat_cols(_cat_cols(ux, ux1, BLOCK_M, CP2), _cat_cols(ux2, ux3, BLOCK_M, CP2),
                           BLOCK_M, 2 * CP2)
        else:
            uy = _cat_cols(uy, uy1, BLOCK_M, CP2)
            ux = _cat_cols(ux, ux1, BLOCK_M, CP2)

    acc0 = tl.zeros((BLOCK_M, K0), tl.float32) + _load_vec(b2_ptr, 0, K0, K)[None, :]
    acc1 = acc0
    if K1 > 0:
        acc1 = tl.zeros((BLOCK_M, K1), tl.float32) + _load_vec(b2_ptr, K0, K1, K)[None, :]
    acc0, acc1 = _ffn(ux, uy, acc0, acc1, w1_ptr, b1_ptr, w2_ptr, R, sw1_r, sw1_c, sw2_k, sw2_r,
                      CP, C, CP, C, 2 * C, K0, K1, K, BLOCK_H, EVEN_R, PRECISION, ASM)
    out_pix = out_ptr + (n.to(tl.int64) * HO * WO + oh * WO + ow) * K
    _store_part(out_pix, acc0, m_ok, 0, K0, K)
    if K1 > 0:
        _store_part(out_pix, acc1, m_ok, K0, K1, K)
