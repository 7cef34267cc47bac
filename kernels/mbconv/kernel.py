"""Triton kernels for the MBConv + Squeeze-Excite block (paper Section 5.4, Fig. 11), NHWC, folded BN.

What is computed (reference.py is the specification)::

    h = SiLU(W_exp x + b_exp)                      R = 4C hidden channels
    g = SiLU(gconv3x3(h) + b_conv)                 group width 8, zero padding 1
    g = BlurPool(g)                                stride 2 only (reflect pad 1, [1,2,1]^2/16)
    gate = sigmoid(W_se2 ReLU(W_se1 mean_hw(g) + b_se1) + b_se2)        (N, R)
    out = W_proj (g * gate) + b_proj (+ x)         residual for stride 1

Design: the hidden tensor is computed once, stored once, and read once by a gated GEMM
--------------------------------------------------------------------------------------
Every output pixel needs the SE gate, and the gate needs the mean of ``g`` over the whole image. A
design that recomputes expand + conv after the pool pays (C R + 72 R) / (2 C R + 72 R) = 56 % more
tensor-core work at C = 256 than the block's useful MACs, so ``g`` is computed once, written
once in the input dtype (``gbuf``, (slice, H'W', R)) and read back once, from L2 where it fits
(batch slices, below). Two launches per block and batch slice:

1. ``_mbconv_hidden_kernel`` (persistent, one program per SM slot): a work item is (hidden chunk of
   RB = 64 channels, block of IB images). The program loads the chunk's weights once per item and,
   per image, runs over the WHOLE image in tiles of BM = 64 pixels:
   expand (one wgmma K tile over all C <= 256 input channels) + bias + SiLU -> ``h`` in a
   per-program scratch slot (zero-padded borders: the conv's zero padding), barrier, grouped conv
   from the scratch (nine taps as five two-tap K = 16 steps of a batched [8 groups, 64, 16] x
   [8, 16, 8] ``tl.dot``: mma.sync, 10/9 of the useful conv MACs) + bias + SiLU, then
   stride 1: ``g`` to ``gbuf`` and the pooled sum in registers; stride 2: ``g`` to a second
   scratch slot, barrier, BlurPool from it with the reflect padding folded into the indices, the
   blurred ``g`` to ``gbuf`` and the pool. The image's mean of this chunk is complete inside the
   program (whole image), so the first SE layer's share is computed right there:
   ``zpart[n, chunk] = W_se1[:, chunk] @ mean[n, chunk]`` (fp32, (N, chunks, S)). No atomics.
2. ``_mbconv_project_kernel`` (grid: 64-pixel tiles of one image x output-channel blocks): the rest
   of the SE, ``gate = sigmoid(W_se2 ReLU(sum_chunk zpart + b_se1) + b_se2)`` for its image (chunk
   partials summed in a fixed order), written to the program's gate slot; barrier; then
   ``acc = bias (+ x)`` and ``acc += (gbuf tile * gate) @ W_proj^T`` over R in steps of 64
   (wgmma, A gated in registers), stored once.

Every reduction runs in a fixed order, so the output is bit-reproducible. The grid of the hidden
kernel is the number of resident programs (``PROGRAMS_PER_SM`` x SMs, one per SM where the slots
of two would crowd the L2, as at 32x32 stride 2): each program reuses its
scratch slot for every item, so the scratch (2 x 41 KB per program at 16x16) stays in L2 instead
of being written back to DRAM; the projection grid is (N x tiles per image) in grid.x (up to
2^31 - 1) and output-channel blocks in grid.y.

Batch slices: ``g`` stays in L2 between the two launches
--------------------------------------------------------
The projection reads ``g`` right after the hidden kernel wrote it. When one slice's ``g`` plus the
hidden kernel's scratch fit in L2_SHARE (3/4) of the L2, that read hits L2 instead of DRAM, so the
launcher runs the pair per slice of the batch (``l2_slice``): at 16x16, R = 1024, ``g`` is 512 KB
per image and a batch of 128 runs as 4 slices of 32 images on an H100 (each slice's projection is
one wave of 128 programs); at 8x8 the whole batch's 16 MB fit in one slice. Every slice reuses the
same buffers, so a slice's ``g`` overwrites the previous one's lines in L2. The report still counts
``g``'s write as DRAM traffic (a dirty line is written back when it leaves the L2) and its read as
L2 traffic (``l2_footprint_bytes``: the report checks that it fits). Where a slice that fits would
leave the hidden kernel's programs without work (32x32 stride 2: its scratch alone takes the L2),
the batch runs as one pair and ``g`` goes through DRAM.

Tiling of the hidden kernel
---------------------------
Pixels are tiled as TH x TW image rows x columns, TW = the map width rounded up to a power of two
(8 ... 64), TH = 64 / TW. When the tiles cover the map exactly (the paper's 32x32, 16x16, 8x8:
``EXACT``, with dense pixel rows) the width is a constexpr: pixel addresses are linear, every
conv tap is a constant offset in the scratch, and no row needs a mask. Other sizes (any map >=
1x1: 14x14 and 7x7 at 224x224, odd maps) take the general path: clamped addresses for loads,
masks on stores and on the pool.

Scratch layout (per program, x dtype): ``h`` as [H + 2 padded rows][8 groups][W + 2 padded
columns][8 channels], so the three taps of a row are contiguous 16-byte vectors and a warp's tap
load covers consecutive pixels of one group; the borders are zeroed by the first slice's launch
and never written again (later slices reuse the zeroed slots). Stride 2 adds the full-resolution
``g`` as [H W pixels][64 channels].

Scratch ordering: stores, then ``tl.debug_barrier()`` (bar.sync), then loads by other threads of
the same program. That is safe because the scratch loads are plain ``ld.global``: the tile loops
run with ``num_stages=1``, so Triton's pipeliner does not turn them into ``cp.async`` issued
ahead of the barrier. The projection's gate-slot loads are pipelined (``cp.async``), but only inside
the R loop, which starts after the barrier. Each round trip has its own argument (``scr_ptr``: the
``h`` slots, ``gscr_ptr``: the stride-2 ``g`` slots, ``ms_ptr``, ``gate_ptr``), so that the compile
check (``convfirstnet.analysis.ordering``, tests/kernels/test_ordering.py) can follow each one's
stores and loads through the control flow of the PTX and require a ``bar.sync`` between them.

Numerics: all dots accumulate in fp32; ``h``, ``g`` and the gated ``g`` are rounded to the input
dtype before they feed a tensor-core dot (as the two-pass kernel did); the pool, the SE MLP and the
blur run in fp32; the gate is rounded to the input dtype before it scales ``g`` (one fp16 multiply).
fp32 inputs use ``input_precision="tf32x3"`` (~fp32 accuracy; "ieee" took minutes per variant in
ptxas). SiLU and the SE sigmoid are kernels/_activations.py's (1 / (1 + 2^(-x log2 e)); for fp16/bf16
on the GPU through ``ex2.approx``/``rcp.approx``, ~2e-6 relative error over [-16, 16]; fp32 data and
the interpreter, which cannot run inline asm, through ``tl.exp2`` and a division).

Waterline, as compiled (Small, batch 128, fp16, sm_90 = H100 SXM 989 TFLOP/s, 3.35 TB/s, 132 SMs;
``t_issue`` = warp-instructions from the SASS, weighted by the declared loop trips, / (4 per clock
per SM x 132 x 1.83 GHz); the layer-wise bound is the waterline of Inductor-style kernels; the
launches of a block's slices summed):
    block (Small)            launch   regs  smem    MMA kind        t_tensor  t_dram  t_issue  bound
    stage 4, s2 32x32 96->256  hidden  186   42 KB  wgmma+mma.sync    21.8     15.1    45.5    45.5 us
                 (1 slice)   project  153  112 KB  wgmma              6.7     12.6    13.3    13.3
    stage 4, s1 16x16 256      hidden  255   74 KB  wgmma+mma.sync    23.5     26.2    28.8    28.8
                (4 slices)   project  162  112 KB  wgmma             17.9     11.0    23.1    23.1
    stage 5, s2 16x16 256      hidden  186   74 KB  wgmma+mma.sync    23.5     10.4    35.9    35.9
                 (1 slice)   project  159  112 KB  wgmma              4.5      1.6     5.6     5.6
    stage 5, s1 8x8 256        hidden  255   74 KB  wgmma+mma.sync     5.9      6.7     9.0     9.0
                 (1 slice)   project  161  112 KB  wgmma              4.5      2.9     5.7     5.7

    block                    predicted  layer-wise  ratio  issued/useful MACs
    stage 4, s2 32x32            58.8      170.5     0.34     1.16 (C = 96 padded to 128 in the expand)
    stage 4, s1 16x16 (x17)      51.9      156.0     0.33     1.01
    stage 5, s2 16x16            41.5      112.2     0.37     1.01
    stage 5, s1 8x8 (x17)        14.7       39.6     0.37     1.01
    stage 4                     941        2823      0.33
    stage 5                     293         785      0.37

Fused Small's variants use no stack (fp16, sm_90 and sm_80). Elsewhere (the compile test): 16-bit
variants of other widths and map sizes spill at most 8 B, outside the tile loops; fp32 variants
(3xTF32 holds each operand as two parts) spill up to ~1 KB in the hidden kernel. The two-pass kernels these replace: issued/useful
3.2 (stride 1) to 7.4 (stride 2), 255 registers everywhere with up to 2.5 KB of spills, and the
same estimate gave 10.2 ms for stage 4 and 3.8 ms for stage 5 (3.6x and 4.9x the layer-wise bound).

Per block, the two launches are bounded by instruction issue: the hidden kernel's (expand, conv,
SiLU, scratch traffic) and the projection's (a third of it is the SE gate, recomputed by each of an
image's 64-pixel tiles). With ``g`` read
from L2, the DRAM floor of a 16x16 block is x in, ``g`` written, out (and x again for the residual):
37 us against 56 us when ``g`` is also read from DRAM. Not counted by the model: L2 bandwidth (``g``
read back, ``x`` re-read by each of the R/64 chunk items of an image, ``W_proj`` by each 64-row tile)
and latency; the first GPU measurement decides how much of the L2 read shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._activations import sigmoid, silu
from .._cost import KernelCost, Loop, active_recording
from .._launch import GROUP_WIDTH, launch

# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------

# dot precision for fp32 operands (module docstring); fp16/bf16 operands ignore it
FP32_PRECISION = "tf32x3"
# Hidden channels per work item: 8 conv groups. The [64 px, 64] expand tile is one wgmma
# (M = N = 64) and the conv accumulator [8, 64, 8] is 32 fp32 registers per thread at 4 warps;
# the compiled kernel sits at 255 registers with this width, so 128 would spill.
RB = 64
RB_FP32 = 32
# Pixels per tile: wgmma needs M = 64 per warpgroup (4 warps).
BM = 64
# BlurPool output pixels per tile (stride 2).
BMO = 64
# Elements per store of the one-time zero fill of a scratch slot.
ZERO_BLOCK = 1024
# The expand loads all input channels as one K tile ([64, CP] x [CP, 64]); 256 is the widest
# block input of the paper (Table 3). Wider inputs take CONVFIRSTNET_KERNELS=reference.
MAX_C = 256
# Projection tiles: 64 pixel rows (one wgmma M) x 128 output channels per accumulator, two
# accumulators for outputs wider than 128 (one [64, 256] fp32 accumulator plus the residual
# epilogue spilled), K steps of 64 hidden channels, 8 warps, 3 pipeline stages (115 KB of shared
# memory on sm_90, 82 KB on sm_80). 128-row tiles spilled on sm_80.
P_BM, P_BH, P_BR, P_WARPS, P_STAGES = 64, 128, 64, 8, 3
P_BH_FP32 = 64
# Resident hidden-kernel programs per SM (255 registers x 128 threads, 75 KB of shared memory:
# two fit on sm_90 and sm_80). The grid is this times the SM count (persistent programs).
PROGRAMS_PER_SM = 2
# SM count and L2 assumed when the launch is recorded on meta tensors without a target (H100 SXM).
RECORD_SMS = 132
RECORD_L2 = 50 * 1024 * 1024
# Share of the L2 the resident programs' scratch may take (the rest holds the streamed x, g and weights).
L2_SHARE = 0.75
# Programs under the interpreter (CPU): it runs programs one after another, so few programs
# with several items each cost the same and exercise the item loop.
INTERPRETER_PROGRAMS = 3
# L2 assumed under the interpreter: small, so that tests at model widths exercise the batch slices.
INTERPRETER_L2 = 4 * 1024 * 1024
# Per-warp instruction estimates from the sm_90 SASS (expand + conv tile; the weight loads of a
# work item), used only to choose the images per item (``image_block``).
TILE_COST, ITEM_COST = 700, 400


@dataclass(frozen=True)
class HiddenConfig:
    """Meta-parameters of one hidden-kernel launch (all become constexprs)."""

    stride: int
    cp: int  # input channels rounded up to a power of two (one expand K tile)
    sp: int  # SE width rounded up to a power of two (>= 16)
    mask_c: bool  # C < CP
    mask_r: bool  # R not a multiple of RB
    exact: bool  # tiles cover the map exactly (W == TW, TH | H, dense pixel rows; stride 2: also the output)
    tw: int  # tile width (pixels of an image row per tile)
    two: int  # blur output tile width
    rb: int = RB  # hidden channels per work item
    num_warps: int = 4

    def constexprs(self) -> dict:
        return dict(STRIDE=self.stride, RB=self.rb, CP=self.cp, SP=self.sp, MASK_C=self.mask_c, MASK_R=self.mask_r,
                    TW=self.tw, BM=BM, TWO=self.two, BMO=BMO, EXACT=self.exact, ZB=ZERO_BLOCK,
                    num_warps=self.num_warps)


def hidden_config(
    c: int, r: int, s: int, h: int, w: int, stride: int, dense: bool = True, dtype: torch.dtype = torch.float16
) -> HiddenConfig:
    """Tiles for one shape (module docstring, "Tiling"). ``dense``: x's pixel rows are contiguous
    (stride(H) == W * stride(W)), which the exact path's linear pixel addresses need. fp32 takes
    chunks of RB_FP32 channels: its 3xTF32 dots hold each operand twice (hi and lo parts), and at
    RB = 64 the C = 256 expand needed 232 KB of shared memory on sm_90 (over the 227 KB limit)."""
    cp = max(16, triton.next_power_of_2(c))
    tw = min(BM, max(8, triton.next_power_of_2(w)))
    exact = dense and w == tw and h % (BM // tw) == 0
    two = 8
    if stride == 2:
        ow = (w + 1) // 2
        two = min(BMO, max(8, triton.next_power_of_2(ow)))
        exact = exact and h % 2 == 0 and w % 2 == 0 and ow == two and (h // 2) % (BMO // two) == 0
    rb, warps = (RB_FP32, 4) if dtype == torch.float32 else (RB, 4)
    return HiddenConfig(stride, cp, max(16, triton.next_power_of_2(s)), c != cp, r % rb != 0, exact, tw, two, rb,
                        warps)


def project_config(k: int, r: int, ohw: int, dtype: torch.dtype = torch.float16) -> dict:
    """Meta-parameters of the projection launch (see P_* above; fp32: one accumulator of at most
    P_BH_FP32 outputs, as the 3xTF32 operands spill at 128)."""
    bn = min(P_BH_FP32 if dtype == torch.float32 else 2 * P_BH, max(16, triton.next_power_of_2(k)))
    halves = 2 if bn > P_BH else 1
    return dict(BM=P_BM, BH=bn // halves, HALVES=halves, BR=P_BR, num_warps=P_WARPS, num_stages=P_STAGES,
                EVEN=r % P_BR == 0 and ohw % P_BM == 0 and k % bn == 0)


def image_block(n: int, nchunk: int, tiles: int, programs: int) -> int:
    """Images per work item. More images per item amortize the item's weight loads (ITEM_COST)
    over more tiles; fewer keep enough items to balance the programs. Picks the IB with the
    smallest estimated critical path, ceil(items / programs) x (IB x tiles x TILE_COST + ITEM_COST),
    up to ~1024 pixels per item."""
    best, best_t = 1, None
    for ib in range(1, max(1, min(n, 16 // tiles)) + 1):
        t = triton.cdiv(nchunk * triton.cdiv(n, ib), programs) * (ib * tiles * TILE_COST + ITEM_COST)
        if best_t is None or t < best_t:
            best, best_t = ib, t
    return best


def device_sms_l2(device: torch.device) -> tuple[int, int]:
    """SM count and L2 bytes of the device the launch runs on (meta: the recording's target, by
    default an H100)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.multi_processor_count, props.L2_cache_size
    if device.type == "cpu":  # the interpreter: its programs stand for the SMs
        return INTERPRETER_PROGRAMS, INTERPRETER_L2
    rec = active_recording()
    return (rec and rec.sms or RECORD_SMS), (rec and rec.l2_bytes or RECORD_L2)


def l2_slice(n: int, g_image_bytes: int, scratch_bytes: int, l2: int, sms: int, programs_per_image: int,
             min_images: int) -> int:
    """Images per (hidden, projection) launch pair. The projection reads ``g`` right after the hidden
    kernel wrote it; when the pair's ``g`` and the hidden kernel's scratch fit in L2_SHARE of the L2,
    that read is an L2 hit instead of DRAM traffic (at 16x16, R = 1024: 512 KB of ``g`` per image, so
    a batch of 128 is cut into slices of 32 images on an H100). The whole batch when it fits, or when
    a slice that fits would have fewer than ``min_images`` (too few work items to keep the hidden
    kernel's programs busy; then ``g`` goes through DRAM); otherwise the slice size with the fewest
    projection waves over the batch, then the fewest slices."""
    cap = int((L2_SHARE * l2 - scratch_bytes) // max(1, g_image_bytes))
    if cap >= n or cap < min_images:
        return n
    best, best_key = cap, None
    # the waves repeat with a period of at most `sms` images: two periods below the cap suffice
    for ns in range(cap, max(min_images, cap - 2 * sms) - 1, -1):
        full, last = divmod(n, ns)
        waves = full * triton.cdiv(ns * programs_per_image, sms) + triton.cdiv(last * programs_per_image, sms)
        key = (waves, triton.cdiv(n, ns))
        if best_key is None or key <= best_key:
            best, best_key = ns, key
    return best


def persistent_programs(device: torch.device, slot_bytes: int) -> int:
    """Grid size of the hidden kernel: resident programs on the device (PROGRAMS_PER_SM per SM), fewer
    per SM (down to one) while their scratch slots would take more than L2_SHARE of the L2: the scratch
    must stay in L2 or it becomes DRAM traffic (a 32x32 stride-2 slot is 279 KB: 264 programs would
    need 74 MB, more than an H100's 50 MB of L2)."""
    if device.type == "cpu":
        return INTERPRETER_PROGRAMS
    sms, l2 = device_sms_l2(device)
    per_sm = PROGRAMS_PER_SM
    while per_sm > 1 and per_sm * sms * slot_bytes > L2_SHARE * l2:
        per_sm -= 1
    return per_sm * sms


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _silu(acc, half_bias, MODE: tl.constexpr):
    """SiLU(acc + 2 * half_bias) in fp32 (kernels/_activations.py; MODE 1: its inline-asm form)."""
    return silu(acc + 2.0 * half_bias, MODE == 1)


@triton.jit
def _sigmoid(e, MODE: tl.constexpr):
    """sigmoid(e) in fp32 (kernels/_activations.py; MODE 1: its inline-asm form)."""
    return sigmoid(e, MODE == 1)


@triton.jit
def _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, J: tl.constexpr, G: tl.constexpr):
    g = tl.arange(0, G)[:, None, None]
    k = tl.arange(0, 16)[None, :, None]
    co = tl.arange(0, 8)[None, None, :]
    tap = 2 * J + k // 8
    r = r0 + g * 8 + co
    return tl.load(wconv_ptr + r * swc_r + (k % 8) * swc_i + (tap // 3) * swc_y + (tap % 3) * swc_x,
                   mask=(tap < 9) & (r < R), other=0.0)


@triton.jit
def _conv_pair_h(hs, q, PW, J: tl.constexpr, G: tl.constexpr):
    """Taps 2J and 2J + 1 (the tenth tap re-reads tap 8; its weights are zero) of the pixels at padded
    positions q, as the [G, BM, 16] operand: k < 8 input channels of tap 2J, k >= 8 of tap 2J + 1.
    Scratch layout [padded row][group][padded column][8]."""
    g = tl.arange(0, G)[:, None, None]
    k = tl.arange(0, 16)[None, None, :]
    tap = tl.minimum(2 * J + k // 8, 8)
    off = (tap // 3 - 1) * (G * PW * 8) + (tap % 3 - 1) * 8
    return tl.load(hs + g * (PW * 8) + q[None, :, None] + off + k % 8)


@triton.jit
def _tile(t, ncol, H, W, m, TW: tl.constexpr, TH: tl.constexpr, EXACT: tl.constexpr):
    """Pixel rows of tile ``t``: image row y, column x, clamped copies (always inside the image) and
    whether the row is a real pixel. EXACT: tiles cover the image exactly (W == TW, TH divides H)."""
    if EXACT:
        y = t * TH + m // TW
        x = m % TW
        return y, x, y, x, m < TW * TH
    else:
        y = (t // ncol) * TH + m // TW
        x = (t % ncol) * TW + m % TW
        return y, x, tl.minimum(y, H - 1), tl.minimum(x, W - 1), (y < H) & (x < W)


# IB is not specialized: at IB = 1 the specialized variant spilled 40 B (Small, 16x16, fp16, sm_90)
@triton.jit(do_not_specialize=["IB"])
def _mbconv_hidden_kernel(
    x_ptr, wexp_ptr, bexp_ptr, wconv_ptr, bconv_ptr, w1_ptr, g_ptr, z_ptr, scr_ptr, gscr_ptr, ms_ptr,
    N, H, W_RT, OH, OW, C, R, S, NCHUNK, ITEMS, IB, SLOT, NZ,
    sxn, sxc, sxh, sxw, swe_r, swe_c, swc_r, swc_i, swc_y, swc_x, sw1_s, sw1_r,
    STRIDE: tl.constexpr, RB: tl.constexpr, CP: tl.constexpr, SP: tl.constexpr,
    MASK_C: tl.constexpr, MASK_R: tl.constexpr,
    TW: tl.constexpr, BM: tl.constexpr, TWO: tl.constexpr, BMO: tl.constexpr, EXACT: tl.constexpr,
    ZB: tl.constexpr, SILU: tl.constexpr, PREC: tl.constexpr,
):
    G: tl.constexpr = RB // 8
    TH: tl.constexpr = BM // TW
    THO: tl.constexpr = BMO // TWO
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if EXACT:
        W: tl.constexpr = TW
    else:
        W = W_RT
    PW = W + 2
    PHW = (H + 2) * PW
    OHW = OH * OW
    hs = scr_ptr + pid.to(tl.int64) * SLOT
    gs = gscr_ptr + pid.to(tl.int64) * SLOT  # the same slot past h (its own argument: a separate round trip)
    ms = ms_ptr + pid * RB

    # Zero the h slot's border (the conv's zero padding, NZ = 2 padded rows + 2 columns of each row
    # = 2 (W + 2) RB + 2 H RB elements) once: tiles write only the interior, and later launches on
    # the same scratch (batch slices) find the border still zero (NZ = 0; a multiple of 16 either
    # way, so both launches share one compiled variant).
    zr = tl.arange(0, ZB)
    ROWE = G * PW * 8  # elements of one padded row
    for z0 in range(0, NZ, ZB):
        e = z0 + zr
        e2 = e - 2 * ROWE
        row = 1 + e2 // (G * 16)
        side = row * ROWE + ((e2 // 16) % G) * (PW * 8) + ((e2 // 8) % 2) * ((PW - 1) * 8) + e2 % 8
        off = tl.where(e < 2 * ROWE, (e // ROWE) * ((H + 1) * ROWE) + e % ROWE, side)
        tl.store(hs + off, tl.zeros([ZB], dtype), mask=e < NZ)

    rr = tl.arange(0, RB)
    rc = tl.arange(0, CP)
    c_ok = rc < C
    m = tl.arange(0, BM)
    g3 = tl.arange(0, G)[:, None, None]
    c3 = tl.arange(0, 8)[None, None, :]
    ncol = tl.cdiv(W, TW)
    ntile = tl.cdiv(H, TH) * ncol
    ncol_o = tl.cdiv(OW, TWO)
    ntile_o = tl.cdiv(OH, THO) * ncol_o
    mo = tl.arange(0, BMO)
    sv = tl.arange(0, SP)

    for item in range(pid, ITEMS, nprog):
        r0 = (item % NCHUNK) * RB
        n0 = (item // NCHUNK) * IB
        r_ok = (r0 + rr) < R
        r3 = r0 + g3 * 8 + c3
        # weights of this hidden chunk, loaded once for IB images
        if MASK_C or MASK_R:
            we = tl.load(wexp_ptr + (r0 + rr)[None, :] * swe_r + rc[:, None] * swe_c,
                         mask=c_ok[:, None] & r_ok[None, :], other=0.0)
        else:
            we = tl.load(wexp_ptr + (r0 + rr)[None, :] * swe_r + rc[:, None] * swe_c)
        hb_e = 0.5 * tl.load(bexp_ptr + r0 + rr, mask=r_ok, other=0.0).to(tl.float32)[None, :]
        hb_c = 0.5 * tl.load(bconv_ptr + r3, mask=r3 < R, other=0.0).to(tl.float32)
        w0 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 0, G)
        w1 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 1, G)
        w2 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 2, G)
        w3 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 3, G)
        w4 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 4, G)
        for n in range(n0, tl.minimum(n0 + IB, N)):
            x_img = x_ptr + tl.cast(n, tl.int64) * sxn
            tl.debug_barrier()
            # ---- expand: h = SiLU(x W_exp^T + b) into the padded scratch
            for t in tl.range(0, ntile, num_stages=1):
                y, xx, yc, xc, ok = _tile(t, ncol, H, W, m, TW, TH, EXACT)
                if EXACT:
                    xp = (x_img + (t * BM + m) * sxw)[:, None] + rc[None, :] * sxc
                else:
                    xp = (x_img + yc * sxh + xc * sxw)[:, None] + rc[None, :] * sxc
                if MASK_C:
                    xt = tl.load(xp, mask=c_ok[None, :], other=0.0)
                else:
                    xt = tl.load(xp)
                hv = _silu(tl.dot(xt, we, input_precision=PREC), hb_e, SILU).to(dtype)
                hp = hs + ((y + 1) * (G * PW * 8) + (xx + 1) * 8)[:, None] + ((rr // 8) * (PW * 8) + rr % 8)[None, :]
                if EXACT:
                    tl.store(hp, hv)
                else:
                    tl.store(hp, hv, mask=ok[:, None])
            tl.debug_barrier()
            # ---- grouped conv (+ SiLU)
            if STRIDE == 1:
                pool = tl.zeros((G, BM, 8), dtype=tl.float32)
            else:
                pool = tl.zeros((BMO, RB), dtype=tl.float32)
            for t in tl.range(0, ntile, num_stages=1):
                y, xx, yc, xc, ok = _tile(t, ncol, H, W, m, TW, TH, EXACT)
                q = (yc + 1) * (G * PW * 8) + (xc + 1) * 8
                acc = tl.dot(_conv_pair_h(hs, q, PW, 0, G), w0, input_precision=PREC)
                acc = tl.dot(_conv_pair_h(hs, q, PW, 1, G), w1, acc, input_precision=PREC)
                acc = tl.dot(_conv_pair_h(hs, q, PW, 2, G), w2, acc, input_precision=PREC)
                acc = tl.dot(_conv_pair_h(hs, q, PW, 3, G), w3, acc, input_precision=PREC)
                acc = tl.dot(_conv_pair_h(hs, q, PW, 4, G), w4, acc, input_precision=PREC)
                v = _silu(acc, hb_c, SILU)
                pix = (y * W + xx)[None, :, None]
                ok3 = ok[None, :, None]
                if STRIDE == 1:
                    gp = g_ptr + (n * OHW + pix).to(tl.int64) * R + r3
                    if EXACT:
                        pool += v
                        if MASK_R:
                            tl.store(gp, v.to(dtype), mask=r3 < R)
                        else:
                            tl.store(gp, v.to(dtype))
                    else:
                        pool += tl.where(ok3, v, 0.0)
                        tl.store(gp, v.to(dtype), mask=ok3 & (r3 < R))
                else:
                    if EXACT:
                        tl.store(gs + pix * RB + g3 * 8 + c3, v.to(dtype))
                    else:
                        tl.store(gs + pix * RB + g3 * 8 + c3, v.to(dtype), mask=ok3)
            if STRIDE == 1:
                r2 = tl.arange(0, G)[:, None] * 8 + tl.arange(0, 8)[None, :]
                tl.store(ms + r2, tl.sum(pool, axis=1) / OHW)
            else:
                # ---- BlurPool: [1, 2, 1]^2 / 16, stride 2, reflect padding folded into the indices
                tl.debug_barrier()
                for t in range(0, ntile_o):
                    oy, ox, oyc, oxc, ok = _tile(t, ncol_o, OH, OW, mo, TWO, THO, EXACT)
                    accb = tl.zeros((BMO, RB), dtype=tl.float32)
                    for a in tl.static_range(3):
                        sy = 2 * oyc - 1 + a
                        sy = tl.where(sy < 0, -sy, sy)
                        if not EXACT:  # EXACT: H even, so 2 * oy + 1 <= H - 1
                            sy = tl.where(sy >= H, 2 * H - 2 - sy, sy)
                        for b in tl.static_range(3):
                            sx = 2 * oxc - 1 + b
                            sx = tl.where(sx < 0, -sx, sx)
                            if not EXACT:
                                sx = tl.where(sx >= W, 2 * W - 2 - sx, sx)
                            tap = tl.load(gs + ((sy * W + sx) * RB)[:, None] + rr[None, :])
                            accb += tap.to(tl.float32) * ((1 + a % 2) * (1 + b % 2) * 0.0625)
                    opix = (n * OHW + oy * OW + ox).to(tl.int64)
                    op = g_ptr + opix[:, None] * R + (r0 + rr)[None, :]
                    if EXACT:
                        pool += accb
                        if MASK_R:
                            tl.store(op, accb.to(dtype), mask=r_ok[None, :])
                        else:
                            tl.store(op, accb.to(dtype))
                    else:
                        pool += tl.where(ok[:, None], accb, 0.0)
                        tl.store(op, accb.to(dtype), mask=ok[:, None] & r_ok[None, :])
                tl.store(ms + rr, tl.sum(pool, axis=0) / OHW)
            # ---- SE reduce, this chunk's share: z[n] = sum over chunks of W_se1[:, chunk] mean[n, chunk].
            # The chunk's mean goes through the per-program slot ``ms``: reducing it straight from the
            # pool's layout pushed the registers past 255 (spills).
            tl.debug_barrier()
            mc = tl.load(ms + rr)
            zrow = z_ptr + (tl.cast(n, tl.int64) * NCHUNK + item % NCHUNK) * SP
            for s0 in tl.static_range(0, SP, 16):
                s2 = s0 + tl.arange(0, 16)
                w1c = tl.load(w1_ptr + s2[:, None] * sw1_s + (r0 + rr)[None, :] * sw1_r,
                              mask=(s2[:, None] < S) & r_ok[None, :], other=0.0)
                tl.store(zrow + s2, tl.sum(w1c.to(tl.float32) * mc[None, :], axis=1))


@triton.jit
def _acc_init(bproj_ptr, x_ptr, n, k, kv, oy, ox, m_ok, sxn, sxc, sxh, sxw, BM: tl.constexpr, BH: tl.constexpr,
              RESIDUAL: tl.constexpr):
    acc = tl.zeros((BM, BH), dtype=tl.float32) + tl.load(bproj_ptr + k, mask=kv, other=0.0).to(tl.float32)[None, :]
    if RESIDUAL:
        res = tl.load(x_ptr + n * sxn + k[None, :] * sxc + (oy * sxh + ox * sxw)[:, None],
                      mask=m_ok[:, None] & kv[None, :], other=0.0)
        acc += res.to(tl.float32)
    return acc


@triton.jit
def _mbconv_project_kernel(
    g_ptr, z_ptr, b1_ptr, w2_ptr, b2_ptr, wproj_ptr, bproj_ptr, x_ptr, out_ptr, gate_ptr,
    OHW, OW, R, K, S, NCHUNK, TPI,
    sxn, sxc, sxh, sxw, son, sok, soh, sow, sw2_r, sw2_s, swp_k, swp_r,
    RESIDUAL: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, HALVES: tl.constexpr, BR: tl.constexpr,
    SP: tl.constexpr, NCP: tl.constexpr, EVEN: tl.constexpr, PREC: tl.constexpr, SIGMOID: tl.constexpr,
):
    dtype = g_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n = (pid // TPI).to(tl.int64)
    p = (pid % TPI) * BM + tl.arange(0, BM)
    pv = p < OHW
    k0 = tl.program_id(1) * (BH * HALVES) + tl.arange(0, BH)
    k1 = k0 + BH
    rows = g_ptr + (n * OHW + p) * R
    oy = p // OW
    ox = p % OW
    # SE: z = ReLU(sum of the per-chunk partials + b1); gate = sigmoid(W_se2 z + b2) into this program's slot
    sv = tl.arange(0, SP)
    ch = tl.arange(0, NCP)
    zz = tl.load(z_ptr + (n * NCHUNK + ch[:, None]) * SP + sv[None, :], mask=ch[:, None] < NCHUNK, other=0.0)
    z = tl.maximum(tl.sum(zz, axis=0) + tl.load(b1_ptr + sv, mask=sv < S, other=0.0).to(tl.float32), 0.0)
    gate = gate_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * R
    rb = tl.arange(0, BR)
    for r0 in range(0, R, BR):
        rr = r0 + rb
        rv = rr < R
        w2 = tl.load(w2_ptr + rr[:, None] * sw2_r + sv[None, :] * sw2_s, mask=rv[:, None] & (sv < S)[None, :],
                     other=0.0)
        e = tl.sum(w2.to(tl.float32) * z[None, :], axis=1) + tl.load(b2_ptr + rr, mask=rv, other=0.0).to(tl.float32)
        tl.store(gate + rr, _sigmoid(e, SIGMOID).to(gate_ptr.dtype.element_ty), mask=rv)
    tl.debug_barrier()
    # accumulators start at bias (+ residual); with HALVES = 2 the output width is split in two
    # accumulators so that the epilogue converts half of it at a time
    acc0 = _acc_init(bproj_ptr, x_ptr, n, k0, k0 < K, oy, ox, pv, sxn, sxc, sxh, sxw, BM, BH, RESIDUAL)
    if HALVES == 2:
        acc1 = _acc_init(bproj_ptr, x_ptr, n, k1, k1 < K, oy, ox, pv, sxn, sxc, sxh, sxw, BM, BH, RESIDUAL)
    for r0 in range(0, R, BR):
        rr = r0 + rb
        if EVEN:  # R a multiple of BR, OHW of BM and K of BH * HALVES: no masks
            a = tl.load(rows[:, None] + rr[None, :]) * tl.load(gate + rr)[None, :]
            b0 = tl.load(wproj_ptr + k0[None, :] * swp_k + rr[:, None] * swp_r)
        else:
            rv = rr < R
            a = tl.load(rows[:, None] + rr[None, :], mask=pv[:, None] & rv[None, :], other=0.0)
            a = a * tl.load(gate + rr, mask=rv, other=0.0)[None, :]
            b0 = tl.load(wproj_ptr + k0[None, :] * swp_k + rr[:, None] * swp_r,
                         mask=rv[:, None] & (k0 < K)[None, :], other=0.0)
        acc0 = tl.dot(a, b0, acc0, input_precision=PREC)
        if HALVES == 2:
            if EVEN:
                b1 = tl.load(wproj_ptr + k1[None, :] * swp_k + rr[:, None] * swp_r)
            else:
                b1 = tl.load(wproj_ptr + k1[None, :] * swp_k + rr[:, None] * swp_r,
                             mask=rv[:, None] & (k1 < K)[None, :], other=0.0)
            acc1 = tl.dot(a, b1, acc1, input_precision=PREC)
    o_rows = out_ptr + n * son + (oy * soh + ox * sow)[:, None]
    if EVEN:
        tl.store(o_rows + k0[None, :] * sok, acc0.to(dtype))
        if HALVES == 2:
            tl.store(o_rows + k1[None, :] * sok, acc1.to(dtype))
    else:
        tl.store(o_rows + k0[None, :] * sok, acc0.to(dtype), mask=pv[:, None] & (k0 < K)[None, :])
        if HALVES == 2:
            tl.store(o_rows + k1[None, :] * sok, acc1.to(dtype), mask=pv[:, None] & (k1 < K)[None, :])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

MAX_GRID_X = 2**31 - 1  # CUDA grid.x limit (grid.y/z: 65535)
MAX_GRID_YZ = 65535


def check_supported(x: torch.Tensor, c: int, r: int, k: int) -> None:
    """Kernel limits beyond the op's checks (raised before any allocation or launch)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        # Triton's interpreter computes bf16 tl.dot wrongly (triton 3.9)
        raise NotImplementedError(
            "convfirstnet.mbconv: bfloat16 through the Triton interpreter gives wrong tl.dot results; "
            "use float16/float32, or CONVFIRSTNET_KERNELS=reference on CPU"
        )
    if r % GROUP_WIDTH:
        raise ValueError(
            f"convfirstnet.mbconv: hidden width {r} is not a multiple of the group width {GROUP_WIDTH}"
        )
    if c > MAX_C:
        raise ValueError(
            f"convfirstnet.mbconv: the Triton kernel supports up to {MAX_C} input channels, got {c}; "
            "use CONVFIRSTNET_KERNELS=reference for wider blocks"
        )
    tiles = triton.cdiv(x.shape[2] * x.shape[3], P_BM) if x.dim() == 4 else 1
    if x.shape[0] * tiles > MAX_GRID_X or triton.cdiv(k, 2 * P_BH) > MAX_GRID_YZ:
        raise ValueError(f"convfirstnet.mbconv: batch {x.shape[0]} x {tiles} tiles exceeds the grid limit")


def mbconv_triton(
    x: torch.Tensor,
    w_exp: torch.Tensor,
    b_exp: torch.Tensor,
    w_conv: torch.Tensor,
    b_conv: torch.Tensor,
    w_se1: torch.Tensor,
    b_se1: torch.Tensor,
    w_se2: torch.Tensor,
    b_se2: torch.Tensor,
    w_proj: torch.Tensor,
    b_proj: torch.Tensor,
    stride: int,
) -> torch.Tensor:
    """Launch the hidden kernel and the projection, per batch slice (``l2_slice``). Inputs are
    validated by op.py before this call; every buffer is allocated here (the op stays functional and
    CUDA-graph safe)."""
    n, c, h, w = x.shape
    r, k, s = w_exp.shape[0], w_proj.shape[0], w_se1.shape[0]
    oh, ow = (h, w) if stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    out = torch.empty((n, k, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    if n == 0:
        return out
    hw, ohw = h * w, oh * ow
    hc = hidden_config(c, r, s, h, w, stride, dense=x.stride(2) == w * x.stride(3), dtype=x.dtype)
    pc = project_config(k, r, ohw, x.dtype)
    rb = hc.rb
    # 1-D biases are addressed as base + index (unit stride)
    b_exp, b_conv, b_proj = b_exp.contiguous(), b_conv.contiguous(), b_proj.contiguous()
    b_se1, b_se2 = b_se1.contiguous(), b_se2.contiguous()
    nchunk = triton.cdiv(r, rb)
    th, tho = BM // hc.tw, BMO // hc.two
    tiles = triton.cdiv(h, th) * triton.cdiv(w, hc.tw)
    tiles_o = triton.cdiv(oh, tho) * triton.cdiv(ow, hc.two)
    phw = (h + 2) * (w + 2)
    slot = rb * phw + (rb * hw if stride == 2 else 0)  # elements of one program's scratch slot
    eb = x.element_size()
    programs = persistent_programs(x.device, slot * eb + rb * 4)
    tpi = triton.cdiv(ohw, pc["BM"])
    bn = pc["BH"] * pc["HALVES"]
    kb = triton.cdiv(k, bn)
    sms, l2 = device_sms_l2(x.device)
    scratch_bytes = programs * (slot * eb + rb * 4)
    ns = l2_slice(n, ohw * r * eb, scratch_bytes, l2, sms, tpi * kb, triton.cdiv(programs, nchunk))
    g_in_l2 = ns * ohw * r * eb + scratch_bytes <= L2_SHARE * l2
    ib = image_block(ns, nchunk, tiles, programs)
    nprog = min(nchunk * triton.cdiv(ns, ib), programs)
    # Scratch: every element a program reads it has written (or zeroed) first, so no zero fill here.
    # Every buffer below is reused by each slice: the slice's g is overwritten while it is in L2.
    scratch = torch.empty((nprog * slot,), device=x.device, dtype=x.dtype)
    if x.device.type == "cpu":  # the interpreter (tests): a read before a write or zero fill shows as NaN
        scratch.fill_(float("nan"))
    mslot = torch.empty((nprog, rb), device=x.device, dtype=torch.float32)
    gbuf = torch.empty((ns, ohw, r), device=x.device, dtype=x.dtype)
    zpart = torch.empty((ns, nchunk, hc.sp), device=x.device, dtype=torch.float32)
    gate = torch.empty((ns * tpi * kb, r), device=x.device, dtype=x.dtype)  # per-program gate slots
    prec = FP32_PRECISION if x.dtype == torch.float32 else "tf32"  # only fp32 operands use it
    silu = 0 if x.dtype == torch.float32 or x.device.type == "cpu" else 1
    for n0 in range(0, n, ns):
        m = min(ns, n - n0)
        label = f" (slice {n0 // ns + 1} of {triton.cdiv(n, ns)})" if ns < n else ""
        _launch_slice(x[n0:n0 + m], out[n0:n0 + m], w_exp, b_exp, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2,
                      w_proj, b_proj, stride, hc, pc, scratch, mslot, gbuf[:m], zpart[:m], gate, programs, ib,
                      g_in_l2, n0 == 0, silu, prec, label)
    return out


def _launch_slice(x, out, w_exp, b_exp, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj, stride,
                  hc, pc, scratch, mslot, gbuf, zpart, gate, programs, ib, g_in_l2, zero, silu, prec, label):
    """The two launches of one batch slice; the cost lambdas declare what each launch does. ``zero``:
    this launch zeroes the scratch borders (the first slice; it has the most programs)."""
    n, c, h, w = x.shape
    r, k, s = w_exp.shape[0], w_proj.shape[0], w_se1.shape[0]
    oh, ow = out.shape[2], out.shape[3]
    hw, ohw = h * w, oh * ow
    rb, eb = hc.rb, x.element_size()
    nchunk = triton.cdiv(r, rb)
    th, tho = BM // hc.tw, BMO // hc.two
    tiles = triton.cdiv(h, th) * triton.cdiv(w, hc.tw)
    tiles_o = triton.cdiv(oh, tho) * triton.cdiv(ow, hc.two)
    phw = (h + 2) * (w + 2)
    slot = rb * phw + (rb * hw if stride == 2 else 0)
    items = nchunk * triton.cdiv(n, ib)  # ib of the first (largest) slice: no slice has more programs
    nprog = min(items, programs)

    border = 2 * rb * (w + 2) + 2 * h * rb  # elements of the h slot's zero border

    def hidden_cost() -> KernelCost:
        g8 = rb // 8
        useful = n * (hw * c * r + hw * r * 72 + (ohw * r * 9 if stride == 2 else 0) + r * s)
        mma = nchunk * n * tiles * (BM * rb * hc.cp + g8 * BM * 16 * 8 * 5)
        # g is counted as written to DRAM even when the projection reads it from L2 (a dirty line
        # is written back when it leaves the L2, unless the next slice overwrites it first)
        dram = (n * c * hw + r * c + r * 72 + 2 * r + s * r + n * ohw * r) * eb + n * nchunk * hc.sp * 4
        scr_img = hw * rb + tiles * 5 * g8 * BM * 16  # h written, then five two-tap reads per tile
        if stride == 2:
            scr_img += hw * rb + tiles_o * 9 * BMO * rb  # g written, then nine blur taps
        l2 = ((nprog * border if zero else 0) + nchunk * n * scr_img) * eb + nchunk * n * rb * 8
        body = [Loop("expand tiles", tiles), Loop("conv tiles", tiles)]
        if stride == 2:
            body.append(Loop("blur tiles", tiles_o))
        loops = (Loop("zero scratch", triton.cdiv(border, ZERO_BLOCK) if zero else 0),
                 Loop("work items", triton.cdiv(items, nprog), (Loop("images", ib, tuple(body)),)))
        # L1-allocating loads: per item its weights, per image x and the scratch slot (the nine conv taps
        # and the blur taps re-read the slot from L1 while it fits there)
        per_item = (rb * c + rb * 72 + 2 * rb + s * rb) * eb + ib * (hw * c + slot) * eb + ib * rb * 4
        return KernelCost(useful, mma, dram, loops, l2_bytes=l2, scratch_bytes_per_program=slot * eb + rb * 4,
                          l1_unique_bytes_per_program=triton.cdiv(items, nprog) * per_item,
                          l1_working_set_bytes=slot * eb + rb * 4,
                          note=f"{nprog} persistent programs, {items} items of {ib} image(s) x {rb} channels"
                          + label)

    launch(_mbconv_hidden_kernel, (nprog,), x, w_exp, b_exp, w_conv, b_conv, w_se1, gbuf, zpart, scratch,
           scratch[rb * phw:] if stride == 2 else scratch, mslot,
           n, h, w, oh, ow, c, r, s, nchunk, items, ib, slot, border if zero else 0,
           *x.stride(), *w_exp.stride(), *w_conv.stride(), *w_se1.stride(),
           SILU=silu, PREC=prec, cost=hidden_cost, **hc.constexprs())

    tpi = triton.cdiv(ohw, pc["BM"])
    bn = pc["BH"] * pc["HALVES"]
    grid = (n * tpi, triton.cdiv(k, bn))

    def project_cost() -> KernelCost:
        steps = triton.cdiv(r, pc["BR"])
        g_bytes = n * ohw * r * eb
        dram = (k * r + k + r * s + s + r + n * ohw * k * (2 if stride == 1 else 1)) * eb
        dram += n * nchunk * hc.sp * 4 + (0 if g_in_l2 else g_bytes)
        mma = grid[0] * grid[1] * pc["BM"] * bn * steps * pc["BR"]
        # L1-allocating loads: the SE weights and partials, the gate slot this program wrote, biases, the
        # residual tile
        unique = (r * s + r + s + r + bn + (pc["BM"] * bn if stride == 1 else 0)) * eb + nchunk * hc.sp * 4
        return KernelCost(n * ohw * r * k + n * r * s, mma, dram, (Loop("gate", steps), Loop("R steps", steps)),
                          l1_unique_bytes_per_program=unique,
                          l2_bytes=grid[0] * grid[1] * r * 2 * eb + (g_bytes if g_in_l2 else 0),
                          scratch_bytes_per_program=r * eb, l2_footprint_bytes=g_bytes if g_in_l2 else 0,
                          note=("g read from L2" if g_in_l2 else "g read from DRAM") + label)

    launch(_mbconv_project_kernel, grid, gbuf, zpart, b_se1, w_se2, b_se2, w_proj, b_proj, x, out, gate,
           ohw, ow, r, k, s, nchunk, tpi, *x.stride(), *out.stride(), *w_se2.stride(), *w_proj.stride(),
           RESIDUAL=stride == 1, SP=hc.sp, NCP=triton.next_power_of_2(nchunk), PREC=prec, SIGMOID=silu,
           cost=project_cost, **pc)
