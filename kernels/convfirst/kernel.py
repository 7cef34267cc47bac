"""Block-fusion Triton kernels for the ConvFirst block (paper Section 5.3.1, Fig. 7b), NHWC.

What is computed (reference.py is the specification; weights are BatchNorm-folded):

    stride 1, C -> C:  y = gconv3x3(x) + b_conv;  out = x + b2 + W2 ReLU(W1 y + b1)
    stride 2, C -> K:  y = gconv3x3(x) + b_conv at full resolution;  u = BlurPool(cat[x, y]);
                       out = b2 + W2 ReLU(W1 u + b1)                               (no residual)

gconv3x3 has group width 8 (groups = C / 8), padding 1. BlurPool is [1,2,1] (x) [1,2,1] / 16,
stride 2, reflect padding 1, output ceil(H/2) x ceil(W/2).

Tiling and grid
---------------
Both kernels tile the *output* pixels of the whole batch, flattened in NHW order: program `pid`
owns the BLOCK_M output pixels `pid * BLOCK_M + [0, BLOCK_M)` and ALL output channels, so the grid
is `cdiv(N * H_out * W_out, BLOCK_M)` programs and there is no inter-program communication (the
paper's point: after the conv, every layer of the block is per-pixel, so output tiles are
independent; only input tiles overlap). A flat pixel tile rather than a 2-D TH x TW tile keeps the
masks to one comparison (`m < M`) and keeps programs full for small maps (7x7, 8x8) and odd sizes;
a tile covers about BLOCK_M / W image rows, and the 3x3 halo rows above and below it are the rows
the neighbouring programs read, which are resident in L2 when programs are scheduled in order.

Channels are padded to powers of two (C_PAD, K_PAD >= 16, the smallest `tl.dot` operand the GPU
compiler accepts); padded channels are masked to zero on load and never stored. Hidden channels
are never padded: the R loop walks BLOCK_H chunks and masks the last one (R = 6C is not a multiple
of 64 for C = 24, 72).

Input halo. Triton has no addressable shared memory, so "load the input tile with a 1-pixel halo
once" is realised the way the paper describes its own kernel ("the overlap is handled by the
memory cache, so each input value is loaded from DRAM at most once"): the 9 shifted [BLOCK_M,
C_PAD] views of a tile are 9 masked loads of the same ~(BLOCK_M/W + 2) rows, which hit L1/L2
after the first. DRAM traffic per block is therefore ~ one read of x plus one write of out.

Grouped conv (group width 8) as a block-diagonal dense tap
----------------------------------------------------------
`tl.dot` needs K >= 16 on sm_80/sm_90 (KERNEL-NOTES), so a group's 8x8 weight cannot be its own
dot. Each of the 9 taps is one dense dot `x_tap[BLOCK_M, C_PAD] @ Wbd_tap[C_PAD, C_PAD]` where
`Wbd_tap[ci, co] = w_conv[co, ci % 8, tap]` if ci // 8 == co // 8 else 0, built on the fly with a
masked load from the (C, 8, 3, 3) weight (L2-resident). Of the three formulations in KERNEL-NOTES
this one is the simplest, runs on tensor cores (wgmma on Hopper) and accumulates in fp32 in the dot;
its cost is C_PAD / 8 times the useful conv MACs (2x at C = 16 up to 16x at C = 72/96).

Waterline (paper 5.3.2). Per output pixel in fp16 the block reads C and writes K values, and the
useful work is 72C (conv, per full-res pixel) + C1*R + R*K MACs. Useful operational intensity,
with the tensor-core work the kernel actually issues (block-diagonal conv, C and K padded to powers
of two, R rounded up to BLOCK_H) relative to the useful work:

    block (C, R, K, stride)   FLOP/byte   issued/useful    block (C, R, K, s)   FLOP/byte   issued/useful
    16,  48, 16, 1                 84         1.62          16,  96, 32, 2            112         0.98
    24,  72, 24, 1                108         3.36          24, 144, 48, 2            144         1.63
    32,  96, 32, 1                132         2.06          32, 192, 64, 2            176         1.00
    32, 192, 32, 1                228         1.47          32, 192, 48, 2            175         1.10
    48, 288, 48, 1                324         2.50          48, 288, 64, 2            234         1.64
    64, 384, 64, 1                420         1.60          48, 288, 72, 2            236         1.91
    72, 432, 72, 1                468         3.89          64, 384, 96, 2            297         1.29
    96, 576, 96, 1                612         2.51

(stride 2: the conv counted once per full-res pixel, 4 per output pixel; issued work = 9 dots per
output pixel.) The waterline is ~100 FLOP/byte on the paper's A5000 and ~295 on H100 (fp16 dense
990 TFLOP/s over 3.35 TB/s). Blocks under it are memory bound and the extra issued work is hidden;
the compute-bound ones (stride 1 with C >= 48 on H100) pay it in full, most at C = 24 and 72 where
power-of-two padding adds to the block-diagonal waste. Removing it (per-16-channel batched dots
for the conv, non-power-of-two channel splits) is the first optimisation to time on a GPU.

Accumulation and precision
--------------------------
y accumulates in fp32 (dot accumulator), gets its bias, and is rounded once to the activation dtype
to feed the W1 dot (as a layer-wise fp16 network would store it). For each hidden chunk
`h = ReLU(y @ W1[:, chunk] + b1[chunk])` is an fp32 [BLOCK_M, BLOCK_H] tile, rounded to the
activation dtype and accumulated into `acc` (fp32, [BLOCK_M, K_PAD]) by `tl.dot(h, W2[chunk, :], acc)`.
`acc` starts as residual + b2 (stride 1) or b2 (stride 2). The hidden activation lives only in
registers/shared memory. fp32 inputs use `input_precision="tf32x3"` (3xTF32 split products on tensor
cores, ~fp32 accuracy; "ieee" FMA dots took minutes to compile at C_PAD = 128). fp32 is the checking
path, fp16/bf16 are the fast ones. (The interpreter computes every dot in exact fp32.)

Stride 2: one kernel
--------------------
Output pixel (oh, ow) needs the concat map at full-res rows/cols 2o-1, 2o, 2o+1 (reflected at the
border: -1 -> 1, H -> H-2), and y at those 9 positions needs x at offsets -1..+1 around each, i.e.
a 5x5 x-window (plus reflection). BlurPool and the conv are both linear, so with
`Xb_tap = sum_{b in 3x3} f_b * x(refl(2o + b - 1) + tap - 1)` (zero outside the image, which is the
conv's zero padding applied after the blur's reflection, exactly as the reference does):

    blur(y) = sum_tap Xb_tap @ Wbd_tap + b_conv      (sum f_b = 1 carries the bias through)
    blur(x) = Xb_center

So per tap the kernel forms the blurred input tile on chip (9 masked loads, fp32 FMA with the
exact power-of-two filter weights), runs ONE block-diagonal dot, and the x half of the concat is the
centre tap's Xb (selected with a `tl.where` on the tap index). Xb is rounded to the activation dtype
for the dot (one extra rounding of a convex combination of inputs, |err| <= 2^-11 relative in fp16).
The FFN then never materialises the concat: `W1 u = W1[:, :C] blur(x) + W1[:, C:] blur(y)` is two
dots per hidden chunk. Conv MACs stay at 9 dots per output pixel (= 2.25 dots per
full-res pixel, vs 1 in a layer-wise conv) but nothing but x is read and nothing but out is written:
a two-kernel split (conv+blur kernel writing u, then an FFN kernel) would add a 2C-channel
quarter-resolution round trip and a launch for no saved work. Cost of this choice: 81 masked
L1-hitting loads of [BLOCK_M, C_PAD] per program (CUDA-core FMA work 81*C per output pixel, small
next to the 2*2C*6C + 6C*K tensor-core FFN MACs).

Tile constants (CONFIG table below)
-----------------------------------
No GPU was available when this was written, so the table is derived, not swept; every entry is
compiled for sm_90 and sm_80 in tests/kernels/test_convfirst.py (shared memory must fit A100's
163 KB). Rules:
  * BLOCK_H = 64: the hidden chunk; a [BLOCK_M, 64] fp32 tile plus a 64-wide W1/W2 slice keeps the
    per-chunk shared memory at 16-33 KB (KERNEL-NOTES) and 64 divides R for most shapes.
  * BLOCK_M = 128 for C_PAD <= 32 (arithmetic per pixel is small, so bigger tiles amortise the
    per-program weight reads; y + acc are 2 x 128 x 32 fp32 = 64 regs/thread at 4 warps), 64 for
    C_PAD >= 64 (y, acc and the fp32 hidden tile at C_PAD = 128 are 3 x 64 x 128 fp32 = 96
    regs/thread at 8 warps; BLOCK_M = 128 there would spill).
  * num_warps = 4 up to BLOCK_M x max(C_PAD, K_PAD) = 4096 fp32 elements per live tile, else 8.
  * num_stages = 2 for fp16/bf16: the tap and R loops have at most 9 iterations; deeper pipelining
    only adds shared memory. 1 for fp32: double-buffered fp32 operands at C_PAD = 128 needed 229 KB.
  * The tap loops are runtime loops (`range(9)`), not unrolled: unrolling the stride-2 kernel's
    9 x 9 loads, or fp32 dots at C_PAD = 128, made one compile take 20 s to > 2 min on CPU.
Under the interpreter the same single config is used (multi-config autotune needs a GPU), and the
table never autotunes, so launches are deterministic under torch.compile and CUDA-graph capture.
Channel counts above 128 (not in ConvFirstNet) are rejected before launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import launch

GROUP = 8  # channels per group of the 3x3 conv (paper 5.3: matches mma.m16n8k8)
MAX_CHANNELS = 128  # C_PAD / K_PAD limit of the register-resident tiles


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _convfirst_s1_kernel(
    # pointers
    x_ptr, wc_ptr, bc_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,
    # sizes: M = N * H * W output pixels, C channels, R hidden channels
    M, H, W, C, R,
    # strides (elements): x as logical (N, C, H, W) in any memory format, weights as given
    sxn, sxc, sxh, sxw,
    swc_o, swc_i, swc_h, swc_w,  # w_conv (C, 8, 3, 3)
    sw1_r, sw1_c,  # w1 (R, C)
    sw2_k, sw2_r,  # w2 (C, R)
    # meta-parameters
    C_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    tl.static_assert(C_PAD >= 16, "tl.dot operands need >= 16 channels")
    tl.static_assert(BLOCK_H >= 16, "tl.dot operands need >= 16 hidden channels")
    dt = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # flat output pixel (n, h, w)
    m_ok = offs_m < M
    hw = H * W
    n = offs_m // hw
    oh = (offs_m % hw) // W
    ow = offs_m % W
    x_img = x_ptr + n.to(tl.int64) * sxn  # [BLOCK_M] image base pointers (int64: batch x image > 2^31)
    offs_c = tl.arange(0, C_PAD)
    c_ok = offs_c < C

    # Block-diagonal tap weight Wbd[ci, co] (see header): offsets and mask shared by all 9 taps.
    ci = offs_c[:, None]
    co = offs_c[None, :]
    wbd_mask = (ci // 8 == co // 8) & (ci < C) & (co < C)
    wbd_off = co * swc_o + (ci % 8) * swc_i

    # ---- grouped 3x3 conv, padding 1: 9 shifted loads of the tile (halo rows hit L1/L2) ----
    y = tl.zeros((BLOCK_M, C_PAD), dtype=tl.float32)
    for tap in range(9):
        ih = oh + (tap // 3 - 1)
        iw = ow + (tap % 3 - 1)
        ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        xt = tl.load(
            x_img[:, None] + ih[:, None] * sxh + iw[:, None] * sxw + offs_c[None, :] * sxc,
            mask=ok[:, None] & c_ok[None, :], other=0.0,
        )
        wt = tl.load(wc_ptr + wbd_off + (tap // 3) * swc_h + (tap % 3) * swc_w, mask=wbd_mask, other=0.0)
        y = tl.dot(xt, wt, y, input_precision=PRECISION)
    y += tl.load(bc_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    y = y.to(dt)

    # ---- accumulator = residual + output bias (the centre tap, re-read from L1) ----
    io_mask = m_ok[:, None] & c_ok[None, :]
    resid = tl.load(
        x_img[:, None] + oh[:, None] * sxh + ow[:, None] * sxw + offs_c[None, :] * sxc,
        mask=io_mask, other=0.0,
    )
    acc = resid.to(tl.float32) + tl.load(b2_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]

    # ---- FFN over hidden chunks: acc += ReLU(y @ W1[:, chunk] + b1) @ W2[chunk, :] ----
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, R, BLOCK_H):
        hh = h0 + offs_h
        h_ok = hh < R
        w1t = tl.load(w1_ptr + hh[None, :] * sw1_r + offs_c[:, None] * sw1_c,
                      mask=c_ok[:, None] & h_ok[None, :], other=0.0)  # [C_PAD, BLOCK_H]
        b1c = tl.load(b1_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
        hid = tl.maximum(tl.dot(y, w1t, input_precision=PRECISION) + b1c[None, :], 0.0)
        w2t = tl.load(w2_ptr + offs_c[None, :] * sw2_k + hh[:, None] * sw2_r,
                      mask=h_ok[:, None] & c_ok[None, :], other=0.0)  # [BLOCK_H, C_PAD]
        acc = tl.dot(hid.to(dt), w2t, acc, input_precision=PRECISION)

    # ---- store the NHWC tile: out[m, c] at m * C + c ----
    out_off = offs_m.to(tl.int64)[:, None] * C + offs_c[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _convfirst_s2_kernel(
    # pointers
    x_ptr, wc_ptr, bc_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,
    # sizes: M = N * HO * WO output pixels; H, W input; C in, R hidden, K out channels
    M, H, W, HO, WO, C, R, K,
    # strides (elements)
    sxn, sxc, sxh, sxw,
    swc_o, swc_i, swc_h, swc_w,  # w_conv (C, 8, 3, 3)
    sw1_r, sw1_c,  # w1 (R, 2C): columns [0, C) act on blur(x), [C, 2C) on blur(y)
    sw2_k, sw2_r,  # w2 (K, R)
    # meta-parameters
    C_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tl.static_assert(C_PAD >= 16, "tl.dot operands need >= 16 channels")
    tl.static_assert(K_PAD >= 16, "tl.dot operands need >= 16 output channels")
    tl.static_assert(BLOCK_H >= 16, "tl.dot operands need >= 16 hidden channels")
    dt = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # flat half-resolution output pixel
    m_ok = offs_m < M
    hwo = HO * WO
    n = offs_m // hwo
    oh = (offs_m % hwo) // WO
    ow = offs_m % WO
    x_img = x_ptr + n.to(tl.int64) * sxn
    offs_c = tl.arange(0, C_PAD)
    c_ok = offs_c < C

    ci = offs_c[:, None]
    co = offs_c[None, :]
    wbd_mask = (ci // 8 == co // 8) & (ci < C) & (co < C)
    wbd_off = co * swc_o + (ci % 8) * swc_i

    # ---- blur(y) = sum_tap Xb_tap @ Wbd_tap;  blur(x) = Xb_centre (header) ----
    uy = tl.zeros((BLOCK_M, C_PAD), dtype=tl.float32)
    ux = tl.zeros((BLOCK_M, C_PAD), dtype=tl.float32)
    for tap in range(9):
        xb = tl.zeros((BLOCK_M, C_PAD), dtype=tl.float32)
        for b in range(9):  # a runtime loop: unrolling 9 x 9 loads made compiles take ~20-60 s
            # blur tap b at full resolution, reflected into [0, H) x [0, W) (H, W >= 2) ...
            rh = 2 * oh + (b // 3 - 1)
            rh = tl.where(rh < 0, -rh, rh)
            rh = tl.where(rh >= H, 2 * H - 2 - rh, rh)
            rw = 2 * ow + (b % 3 - 1)
            rw = tl.where(rw < 0, -rw, rw)
            rw = tl.where(rw >= W, 2 * W - 2 - rw, rw)
            # ... then conv tap, zero-padded
            ih = rh + (tap // 3 - 1)
            iw = rw + (tap % 3 - 1)
            ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            xv = tl.load(
                x_img[:, None] + ih[:, None] * sxh + iw[:, None] * sxw + offs_c[None, :] * sxc,
                mask=ok[:, None] & c_ok[None, :], other=0.0,
            )
            fb = (1 + (b // 3) % 2) * (1 + (b % 3) % 2) * 0.0625  # [1,2,1] (x) [1,2,1] / 16
            xb += xv.to(tl.float32) * fb
        ux = tl.where(tap == 4, xb, ux)  # the centre conv tap's blurred tile is blur(x)
        wt = tl.load(wc_ptr + wbd_off + (tap // 3) * swc_h + (tap % 3) * swc_w, mask=wbd_mask, other=0.0)
        uy = tl.dot(xb.to(dt), wt, uy, input_precision=PRECISION)
    uy += tl.load(bc_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    ux_q = ux.to(dt)
    uy_q = uy.to(dt)

    # ---- FFN on the (never materialised) concat: W1 u = W1[:, :C] blur(x) + W1[:, C:] blur(y) ----
    offs_k = tl.arange(0, K_PAD)
    k_ok = offs_k < K
    acc = tl.zeros((BLOCK_M, K_PAD), dtype=tl.float32)
    acc += tl.load(b2_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, R, BLOCK_H):
        hh = h0 + offs_h
        h_ok = hh < R
        w1_mask = c_ok[:, None] & h_ok[None, :]
        w1_base = w1_ptr + hh[None, :] * sw1_r + offs_c[:, None] * sw1_c
        w1x = tl.load(w1_base, mask=w1_mask, other=0.0)  # [C_PAD, BLOCK_H]
        w1y = tl.load(w1_base + C * sw1_c, mask=w1_mask, other=0.0)
        b1c = tl.load(b1_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
        hid = tl.dot(ux_q, w1x, input_precision=PRECISION)
        hid = tl.dot(uy_q, w1y, hid, input_precision=PRECISION)
        hid = tl.maximum(hid + b1c[None, :], 0.0)
        w2t = tl.load(w2_ptr + offs_k[None, :] * sw2_k + hh[:, None] * sw2_r,
                      mask=h_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_H, K_PAD]
        acc = tl.dot(hid.to(dt), w2t, acc, input_precision=PRECISION)

    out_off = offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & k_ok[None, :])


# ------------------------------------------------------------------------------------------------
# Tile table
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvFirstConfig:
    """One compiled variant: the constexprs and launch options of a kernel."""

    stride: int
    c_pad: int
    k_pad: int  # == c_pad for stride 1
    block_m: int
    block_h: int
    num_warps: int
    num_stages: int
    precision: str  # tl.dot input_precision


BLOCK_H = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pad(c: int) -> int:
    return max(16, triton.next_power_of_2(c))


def precision_for(dtype: torch.dtype) -> str:
    # fp32: 3xTF32 (three tensor-core passes, ~fp32 accuracy); "ieee" expands every dot into
    # unrolled FMAs (> 2 minutes of compile time at C_PAD = 128). Ignored for 16-bit inputs.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def convfirst_config(c: int, k: int, stride: int, dtype: torch.dtype = torch.float16) -> ConvFirstConfig:
    """The tile config used for a C -> K block in `dtype` (R does not change the compiled kernel)."""
    c_pad, k_pad = _pad(c), _pad(k)
    block_m = 128 if max(c_pad, k_pad) <= 32 else 64
    num_warps = 4 if block_m * max(c_pad, k_pad) <= 4096 else 8
    # fp32 operands are twice as large: a double-buffered fp32 [128, 128] tap weight plus the
    # [64, 128] input tile needed 229 KB at C_PAD = 128 (over Hopper's 227 KB), so no pipelining.
    num_stages = 1 if dtype == torch.float32 else 2
    return ConvFirstConfig(
        stride, c_pad, k_pad, block_m, BLOCK_H, num_warps, num_stages, precision_for(dtype)
    )


# The ConvFirst blocks of Pico..Small (SPEC Table 3) as (C, R, K, stride): stride-1 blocks with
# their expansion t, stride-2 blocks C -> K with R = 6C (input of the expand is 2C wide).
MODEL_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    # stage 1, stride 1, t = 3
    (16, 48, 16, 1), (24, 72, 24, 1), (32, 96, 32, 1),
    # stage 2/3, stride 1, t = 6
    (32, 192, 32, 1), (48, 288, 48, 1), (64, 384, 64, 1), (72, 432, 72, 1), (96, 576, 96, 1),
    # first block of stage 2 (C0 -> C2) and stage 3 (C2 -> C3), stride 2, R = 6C
    (16, 96, 32, 2), (24, 144, 48, 2), (32, 192, 64, 2),
    (32, 192, 48, 2), (48, 288, 64, 2), (48, 288, 72, 2), (64, 384, 96, 2),
)


def shipped_configs(dtype: torch.dtype = torch.float16) -> list[ConvFirstConfig]:
    """Every distinct compiled config the model shapes use in `dtype` (what the GPU compile test builds)."""
    cfgs = {convfirst_config(c, k, s, dtype) for c, _, k, s in MODEL_SHAPES}
    return sorted(cfgs, key=lambda cfg: (cfg.stride, cfg.c_pad, cfg.k_pad))


def useful_macs(n: int, c: int, h: int, w: int, r: int, k: int, stride: int) -> int:
    """Multiply-accumulates of the block as the paper counts them (for % of peak in benchmarks):
    grouped conv at full resolution (72 C per pixel) plus the two 1x1 layers at output resolution.
    The block-diagonal conv (C_PAD / 8 x) and the stride-2 blur recompute are not counted."""
    conv = n * h * w * 9 * GROUP * c
    ho, wo = (h, w) if stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    c1 = c if stride == 1 else 2 * c
    return conv + n * ho * wo * (c1 * r + r * k)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------


def check_supported(x: torch.Tensor, c: int, k: int) -> None:
    """Kernel limits beyond the op's checks (raised before any allocation or launch)."""
    if x.dtype == torch.bfloat16 and x.device.type != "cuda":
        # Triton's interpreter computes bf16 tl.dot wrongly (garbage of 1e10 magnitude, triton 3.9)
        raise NotImplementedError(
            "convfirstnet.convfirst: bfloat16 through the Triton interpreter gives wrong tl.dot results; "
            "use float16/float32, or CONVFIRSTNET_KERNELS=reference on CPU"
        )
    if c % GROUP:
        raise ValueError(f"convfirstnet.convfirst: channels must be a multiple of {GROUP}, got {c}")
    if max(c, k) > MAX_CHANNELS:
        raise ValueError(
            f"convfirstnet.convfirst: the fused kernel keeps all channels on chip and supports at most "
            f"{MAX_CHANNELS}, got C={c}, K={k}"
        )


def convfirst_triton(
    x: torch.Tensor,
    w_conv: torch.Tensor,
    b_conv: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    stride: int,
) -> torch.Tensor:
    """Launch the fused block. Inputs are validated by the op; x may be in any memory format."""
    n, c, h, w = x.shape
    r, k = w1.shape[0], w2.shape[0]
    check_supported(x, c, k)
    ho, wo = (h, w) if stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    out = torch.empty((n, k, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    m = n * ho * wo
    if m == 0:
        return out
    b_conv, b1, b2 = b_conv.contiguous(), b1.contiguous(), b2.contiguous()
    cfg = convfirst_config(c, k, stride, x.dtype)
    grid = (triton.cdiv(m, cfg.block_m),)
    common = (*x.stride(), *w_conv.stride(), *w1.stride(), *w2.stride())
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_H=cfg.block_h, PRECISION=cfg.precision,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def cost() -> KernelCost:  # see kernels/_cost.py
        chunks = triton.cdiv(r, cfg.block_h)
        bm, cp, kp, bh = cfg.block_m, cfg.c_pad, cfg.k_pad, cfg.block_h
        blur = 0 if stride == 1 else n * ho * wo * 2 * c * 9  # BlurPool of the 2C-wide concat
        if stride == 1:  # 9 block-diagonal tap dots, then W1 and W2 per hidden chunk
            per_program = 9 * bm * cp * cp + chunks * (bm * cp * bh + bm * bh * cp)
            loops = (Loop("conv taps", 9), Loop("hidden chunks", chunks))
        else:  # 9 tap dots on blurred windows, then two W1 dots (x and y halves) and W2 per chunk
            per_program = 9 * bm * cp * cp + chunks * (2 * bm * cp * bh + bm * bh * kp)
            loops = (Loop("conv taps", 9, body=(Loop("blur taps", 9),)), Loop("hidden chunks", chunks))
        weights = sum(t.numel() for t in (w_conv, b_conv, w1, b1, w2, b2))
        return KernelCost(
            useful_macs=useful_macs(n, c, h, w, r, k, stride) + blur,
            mma_macs=grid[0] * per_program,
            dram_bytes=(x.numel() + out.numel() + weights) * x.element_size(),
            loops=loops,
        )

    if stride == 1:
        launch(
            _convfirst_s1_kernel, grid,
            x, w_conv, b_conv, w1, b1, w2, b2, out, m, h, w, c, r, *common, C_PAD=cfg.c_pad, cost=cost, **meta
        )
    else:
        launch(
            _convfirst_s2_kernel, grid,
            x, w_conv, b_conv, w1, b1, w2, b2, out, m, h, w, ho, wo, c, r, k, *common,
            C_PAD=cfg.c_pad, K_PAD=cfg.k_pad, cost=cost, **meta,
        )
    return out
