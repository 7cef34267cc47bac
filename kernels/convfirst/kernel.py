"""Block-fusion Triton kernels for the ConvFirst block (paper Section 5.3.1, Fig. 7b), NHWC.

What is computed (reference.py is the specification; weights are BatchNorm-folded):

    stride 1, C -> C:  y = gconv3x3(x) + b_conv;  out = x + b2 + W2 ReLU(W1 y + b1)
    stride 2, C -> K:  y = gconv3x3(x) + b_conv at full resolution;  u = BlurPool(cat[x, y]);
                       out = b2 + W2 ReLU(W1 u + b1)                               (no residual)

gconv3x3 has group width 8 (groups = C / 8), padding 1. BlurPool is [1,2,1] (x) [1,2,1] / 16,
stride 2, reflect padding 1, output ceil(H/2) x ceil(W/2).

16-bit stride-1 blocks ship as two launches instead of ``_convfirst_s1_kernel`` (staged.py: the conv,
then ``_convfirst_ffn_kernel`` with this file's hidden chunks; launcher.py "Staged stride-1 blocks");
the stride-1 kernel here runs fp32 blocks and forced ones (``launcher.STAGED = False``).

Persistent programs and tiles
-----------------------------
The work is cut into TH x TW tiles of output pixels (all output channels), numbered image by image
(TILES = N x tiles per image, one int32 index: no grid.y limit on the batch). A launch runs a few
persistent programs per SM (launcher.py: as few as keep the busiest one at ceil(TILES / (SMs x
programs per SM)) tiles); each loops over tiles t = pid, pid + programs, ... (tl.range, not
software-pipelined). The tile position costs one scalar division per tile and the pixel coordinates
inside it are shifts and masks (TW is a power of two). After the conv every layer of the block is per
pixel, so tiles are independent; input tiles overlap by the halo. Pixels outside the map are masked.

x is read through its strides when its channel stride is 1 and the others are multiples of 8
elements (any channels-last tensor or crop); the strides reach the kernel in units of 8 elements, so
that 8 channels are provably one aligned 16-byte vector. Other layouts (NCHW, odd views) are copied to
channels-last once by the launcher. The output is NHWC.

Channel parts instead of power-of-two padding. tl.dot tiles are powers of two >= 16, so a width is
rounded up to a multiple of 16 and split into at most two power-of-two parts, each its own dot:
96 = 64 + 32 and 48 = 32 + 16 (no padding); 24 -> 32 and 72 -> 64 + 16 are padded and masked.

What stays on chip, and where (each claim pinned by the compile test in tests/kernels)
-------------------------------------------------------------------------------------
* No cp.async anywhere: every load is a plain ld.global. A software-pipelined 16-byte load becomes
  cp.async.cg (SASS LDGSTS.E.BYPASS), which skips L1 whatever its cache modifier says; the previous
  design fetched each of the ten tap windows of a tile from L2 that way.
* L1: the conv windows, the residual, the conv weights and the biases are LDG without .STRONG, which
  allocate in L1: a tile's nine shifted windows (stride 2: its 5x5 windows) and the residual re-read
  its halo tile from L1, and the conv weights and biases stay there across tiles. The working set is
  one halo tile plus those weights (C = 96: 62 + 15 KB), beside the program's shared memory.
* Shared memory, resident: the expand and projection weights of the first RESIDENT hidden chunks are
  loaded once per program, before its tile loop, as one tensor per chunk and part (tuples, indexed at
  compile time); used only as wgmma B operands, they are stored to shared memory once and stay there
  for all the program's tiles. The number is the launcher's (a shared-memory budget per config): all
  chunks where they fit beside the tile (Small's stage 1 and 2: 12 and 96 KB), a prefix otherwise.
* L1, cached: the next CACHED hidden chunks (a runtime loop) load their weights per tile with plain
  ld.global (LDG without .STRONG): the program's first tile fetches them from L2, its later tiles
  find them in L1, where they stay beside the halo tile and the conv weights (the launcher declares
  them in the L1 working set; the compile test checks that it fits in the L1 the compiled shared
  memory leaves). Used where resident chunks do not fit (C = 96: 8 of 18 chunks, 96 KB).
* L2 only: the weights of the other hidden chunks (a runtime loop, "streamed") are loaded per tile with
  ld.global.cg (LDG.E.128.STRONG.GPU): fetched from L2 by every tile, not allocated in L1.
Resident chunks cost registers across the tile loop: each wgmma k-step on a resident [K, N] weight
tile needs its own 64-bit shared-memory descriptor, computed once before the tile loop and live
through it (C = 96, 16 x 16 tiles: 10 descriptors per 32-channel chunk; with 8 chunks ptxas spilled
77 of them, with 2 already 216 B; the 32 -> 48 stride-2 variant spills with two or more). Cached
chunks reuse the streamed loop's buffers and descriptors: no register cost. That sets the budgets in
launcher.py.

Stride 1: the grouped conv as batched two-tap dots
--------------------------------------------------
A group has 8 input channels but tl.dot needs K >= 16. Step s (of 5) multiplies, for all groups g of
a channel part at once (a batched 3-D dot over the G groups):

    [x(tap 2s)[:, g] | x(tap 2s + 1)[:, g]]   [G, M, 16]   @   [W_g(tap 2s); W_g(tap 2s + 1)]   [G, 16, 8]

The tenth tap slot is masked to zero, so the issued conv MACs are 10/9 of the useful ones. The
batched dot compiles to mma.sync (m16n8k16); its [G, M, 8] result is permuted to [M, C] once. Triton
spreads the warps over the batch dimension, so with fewer groups than warps (a 32-channel part on 8
warps) several warps computed the same group: the batch is MS x G, the tile's rows cut into MS slices
(``_m_slices``), which keeps every warp on work of its own (C = 96: 1.34 -> 1.01 G mma.sync MACs per
launch, the declared figure). A part can be computed SUB channels at a time (one step loop each,
joined by a layout-only reshape): the operands of a dot are staged through shared memory, [MS x G,
M / MS, 16] in fp16 = 4 M P bytes, 64 KB for a 64-channel part of a 16 x 16 tile. The five
steps are a runtime loop (STEPS = 5 passed as a value, so that ptxas keeps the loop and one step's
operands live; unrolled, it hoisted all 50 window loads and spilled). The weights are read through
their strides; FusedConvFirst stores w_conv tap-major (blocks.tap_major: memory order kh, kw, ci, co),
where each tap's [16, 8] group block is two 16-byte vectors.

FFN over hidden chunks (both kernels)
-------------------------------------
acc starts at residual + b2 (stride 1; wide blocks, RES_LATE: b2, the residual added after the last
chunk) or b2 (stride 2); for each chunk of BLOCK_H hidden channels

    hid = ReLU(A @ W1[chunk]^T + b1[chunk]);   acc += hid @ W2[:, chunk]^T

both on wgmma, A (the conv output, or [blur(x) | blur(y)]) and hid from registers, the weights from
shared memory. A is given as parts (one per conv / blur part), each its own K slice of the expand. The
hidden tile never leaves the chip. The bias add and ReLU + 16-bit pack are two FADDs and one
cvt.rn.relu.f16x2.f32 per pair (inline asm, ASM=True on a GPU; the interpreter runs tl.maximum then
the cast, the same values).

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

As compiled, costed and measured (sm_90, ConvFirstNet-Small, batch 128, 256 x 256, fp16)
-----------------------------------------------------------------------------------------
``convfirstnet kernels --model small --arch sm_90`` (Triton 3.8.0), microseconds per block at the
model's fast / slow constants (CUDA graphs), against the layer-wise bound of the same model, and the
H200 (Triton 3.6, CUDA graphs; ``benchmarks/results/20261126T051713Z_h200_float16_small_gpu-check-
blocks.json``) against Inductor's layer-wise code in the same run (Ind.). /SM = programs per SM;
binds = the largest terms at the slow end (waits and latency: one warp's exposed waits and stall
cycles, times the warps sharing a scheduler); L2 = L2<->SM bytes over DRAM bytes.

    C, R, K, s, map        tile  warps regs smem  /SM | predicted layer-wise binds          L2/DRAM |H200 Ind.
    32, 96,32,1,128^2 (x2) 8x16    4   125  29 KB  4 | 316-472  445-548  waits 288, lat 183 1.21x | 409 1151
    32,192,64,2,128^2      8x8     4   248  58 KB  2 | 211-321  507-625  waits 197, lat 123 1.28x | 213 1040
    64,384,64,1, 64^2 (x4) 8x16    8   175 130 KB  1 | 267-362  344-425  waits 246, lat 114 1.21x | 329  686
    64,384,96,2, 64^2      8x16    8   255 100 KB  1 | 196-307  254-313  waits 229, lat  76 2.50x | 253  419
    96,576,96,1, 32^2 (x5) 16x16   8   255  60 KB  1 | 150-207  132-162  waits 146, lat  59 2.66x | 301  329

    stage 1 / 2 / 3: 0.632-0.945 / 1.278-1.768 / 0.944-1.340 ms predicted, 0.86 / 0.76 / 1.19 of the
    layer-wise bound at the slow end; no stack in any of them. Measured, every block beats Inductor
    (1.09-4.87x), the C = 96 block by the least. The H200 ran Triton 3.6 code, predicted slower than
    this compile at C = 96 (276-386 us against 150-207; measured 301): benchmarks/static/README.md.

Design notes below quote the static model of the time each choice was made (before its correction
against the H200, when it was 2-6x low): they rank the alternatives then weighed.

Stage 1 sits on its DRAM bound. The t = 6 blocks are bound by one warp's path: with one program per
SM (the resident weights fill shared memory) every warpgroup waits for its own wgmma groups, chunk
after chunk, so the waits add the tensor time to the stall cycles. C = 96 cannot keep its weights
(221 KB) beside a 256-pixel tile: the 96 fp32 accumulator registers per thread cap the tile at 256
pixels, a resident prefix spills (its descriptors, above), and shared memory and L1 are one 256 KB
array per SM. Per SM: the conv output (48 KB of shared memory, the expand's A operand for every chunk)
and the streamed chunk's buffers (12 KB) in a 64 KB carve-out; in the 192 KB of L1 the halo tile (62
KB), the conv weights (15 KB) and 8 cached chunks (96 KB). (That carve-out is what
``CONVFIRSTNET_L1_CARVEOUT=fit`` asks for; Triton's loader configures the largest one, 28 KB of L1, for
any kernel above 48 KB of shared memory: measured L1 hit rate 24 % on an H200, kernels/_carveout.py.) The other 10 chunks (123 KB per tile) come
from L2: 2.66x (before: 3.41x, all streamed). 2.5x needs about 118 KB cached, and the working set
then no longer fits in L1 (9 chunks: 188 of 192 KB, 2.57x).

Not in the model (a GPU run decides): whether another warpgroup's work overlaps a warpgroup's wgmma
wait (the model says no); the small-N dots (the conv's m16n8k16, stride 2's N = 16) below peak; L1
hit rates of the declared working sets (the model takes the L1 hit latency when they fit).

Host side (tile table, checks, grid, launch, cost declaration): launcher.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..gconv.kernel import load_rows_first


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


@triton.constexpr_function
def _m_slices(warps, groups, block_m):
    """Slices of the tile's rows that make the conv's batch (slices x groups) cover every warp."""
    ms = 1
    while ms * groups < warps and block_m // (2 * ms) >= 16:
        ms *= 2
    return ms


@triton.jit
def _rows(v, MS: tl.constexpr, G: tl.constexpr, MM: tl.constexpr):
    """[MS x MM] per-pixel values -> [MS x G, MM, 1]: batch entry b holds slice b // G of the rows."""
    if MS == 1:
        return v[None, :, None]
    else:
        return tl.reshape(tl.broadcast_to(tl.reshape(v, (MS, 1, MM)), (MS, G, MM)), (MS * G, MM))[:, :, None]


@triton.jit
def _tap_pair(ptrs, ok, TAPS: tl.constexpr):
    """Load a [B, MM, 16] tap pair. TAPS, the index order of the load, decides the register layout
    Triton gives the tile and so the bank conflicts of its copy to shared memory for the batched
    mma.sync (launcher.tap_order()): 0 as is (sm_90 PTX, 16-byte stores: 16 wavefronts a warp store where 4
    would do at P = 64 with Triton 3.6 and 3.8, and at P = 32 with 3.6); 1 loaded as [MM, B, 16] and
    permuted back (conflict-free at P = 32 and 64 with both)."""
    if TAPS == 1:
        return load_rows_first(ptrs, ok)
    else:
        return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _gconv_pairs(
    x_pix, oh, ow, m_ok, H, W, sxh, sxw, STEPS,
    wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr,
    C: tl.constexpr, CB: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr, WARPS: tl.constexpr, TAPS: tl.constexpr,
):
    """Grouped 3x3 conv (padding 1) of channels [CB, CB + P) for a tile: [BLOCK_M, P] in x's dtype.

    Two taps per K = 16: step s multiplies, for every group g of 8 channels at once (a batched dot),
    [x(tap 2s) | x(tap 2s+1)] ([P/8, BLOCK_M, 16]) by [W(tap 2s); W(tap 2s+1)] ([P/8, 16, 8]).
    STEPS = 5 steps (a runtime value, so that the compiler keeps the loop and its registers stay one
    step's) cover the nine taps and one zero tap (masked): 10/9 of the useful MACs. The loop is not
    software-pipelined, so every tap load is a plain ld.global (SASS LDG.E.128, allocated in L1, where
    the overlapping windows of the other taps find it): a pipelined 16-byte load would be cp.async.cg
    (LDGSTS.E.BYPASS: L2 only) whatever its cache modifier.
    """
    G: tl.constexpr = P // 8
    MS: tl.constexpr = _m_slices(WARPS, G, BLOCK_M)
    # batch = MS x G (M split in MS slices of MM rows), so that every warp owns batch entries of its
    # own instead of repeating another's (a batch of G < num_warps entries is computed several times)
    MM: tl.constexpr = BLOCK_M // MS
    B: tl.constexpr = MS * G
    g = tl.arange(0, B)[:, None, None] % G
    j = tl.arange(0, 16)[None, None, :]  # K index: tap half (j // 8), channel in group (j % 8)

    ok3 = _rows(m_ok, MS, G, MM)
    if CB + P > C:
        ok3 = ok3 & (CB + 8 * g + j % 8 < C)
    x_base = _rows(x_pix, MS, G, MM) + (CB + 8 * g + j % 8)  # [B, MM, 16], 8 contiguous channels per tap
    oh3 = _rows(oh, MS, G, MM)
    ow3 = _rows(ow, MS, G, MM)
    wj = tl.arange(0, 16)[None, :, None]
    wco = CB + 8 * g + tl.arange(0, 8)[None, None, :]  # [B, 1, 8] output channel
    w_base = wc_ptr + wco * swc_o + (wj % 8) * swc_i  # [B, 16, 8]
    acc = tl.zeros((B, MM, 8), tl.float32)
    for step in tl.range(0, STEPS, num_stages=1):
        tap = 2 * step + j // 8
        dh = tap // 3 - 1
        dw = tap % 3 - 1
        ih = oh3 + dh
        iw = ow3 + dw
        ok = ok3 & (tap < 9) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        xv = _tap_pair(x_base + (dh * sxh + dw * sxw), ok, TAPS)
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
    # [MS x G, MM, 8] -> [M, P]: channel 8g + n of pixel (b // G) MM + m
    y = tl.reshape(acc.to(x_pix.dtype.element_ty), (MS, G, MM, 8))
    return tl.reshape(tl.permute(y, (0, 2, 1, 3)), (BLOCK_M, P))


@triton.jit
def _cat_channels(a, b):
    """[M, P] and [M, P] -> [M, 2P] (a's channels first)."""
    M: tl.constexpr = a.shape[0]
    P: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (M, 2 * P))


@triton.jit
def _gconv_part(
    x_pix, oh, ow, m_ok, H, W, sxh, sxw, STEPS,
    wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr,
    C: tl.constexpr, CB: tl.constexpr, P: tl.constexpr, SUB: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr, WARPS: tl.constexpr, TAPS: tl.constexpr,
):
    """The grouped conv of channels [CB, CB + P) computed SUB channels at a time (``_gconv_pairs``, one
    step loop each), joined into [BLOCK_M, P]."""
    tl.static_assert(P <= SUB or P == 2 * SUB or P == 4 * SUB, "a part is 1, 2 or 4 conv dots wide")
    if P <= SUB:
        return _gconv_pairs(x_pix, oh, ow, m_ok, H, W, sxh, sxw, STEPS, wc_ptr, swc_o, swc_i, swc_h, swc_w,
                            bc_ptr, C, CB, P, BLOCK_M, PRECISION, WARPS, TAPS)
    elif P == 2 * SUB:
        y0 = _gconv_pairs(x_pix, oh, ow, m_ok, H, W, sxh, sxw, STEPS, wc_ptr, swc_o, swc_i, swc_h, swc_w,
                          bc_ptr, C, CB, SUB, BLOCK_M, PRECISION, WARPS, TAPS)
        y1 = _gconv_pairs(x_pix, oh, ow, m_ok, H, W, sxh, sxw, STEPS, wc_ptr, swc_o, swc_i, swc_h, swc_w,
                          bc_ptr, C, CB + SUB, SUB, BLOCK_M, PRECISION, WARPS, TAPS)
        return _cat_channels(y0, y1)
    else:
        y0 = _gconv_part(x_pix, oh, ow, m_ok, H, W, sxh, sxw, STEPS, wc_ptr, swc_o, swc_i, swc_h, swc_w,
                         bc_ptr, C, CB, 2 * SUB, SUB, BLOCK_M, PRECISION, WARPS, TAPS)
        y1 = _gconv_part(x_pix, oh, ow, m_ok, H, W, sxh, sxw, STEPS, wc_ptr, swc_o, swc_i, swc_h, swc_w,
                         bc_ptr, C, CB + 2 * SUB, 2 * SUB, SUB, BLOCK_M, PRECISION, WARPS, TAPS)
        return _cat_channels(y0, y1)


@triton.jit
def _tile_pixels(t, H, W, TH: tl.constexpr, TW: tl.constexpr):
    """Tile t of the tiles of a batch of H x W maps (numbered image by image, row-major within an
    image): its image n and, per row of the tile, the pixel (oh, ow) and whether it lies inside the
    map. One scalar division per tile; TW is a power of two, so the rest are shifts and masks."""
    tiles_w = tl.cdiv(W, TW)
    tiles = tl.cdiv(H, TH) * tiles_w
    n = t // tiles
    q = t % tiles
    r = tl.arange(0, TH * TW)
    oh = (q // tiles_w) * TH + r // TW
    ow = (q % tiles_w) * TW + r % TW
    return n, oh, ow, (oh < H) & (ow < W)


@triton.jit
def _w1_part(w1_ptr, sw1_r, sw1_c, h0, h_ok, BH: tl.constexpr, MASK_H: tl.constexpr,
             CB: tl.constexpr, P: tl.constexpr, CEND: tl.constexpr, MOD: tl.constexpr):
    """[P, BH]: W1[h0 + h, CB + c], zero where h_ok is false (MASK_H) or c >= CEND: one hidden chunk's
    expand weights for the A part at column CB, transposed for A @ W1^T. Masks only where needed, so
    that the loads stay 16-byte vectors along c."""
    c = CB + tl.arange(0, P)
    h = h0 + tl.arange(0, BH)
    p = w1_ptr + h[None, :] * sw1_r + c[:, None] * sw1_c
    if MASK_H and CB + P > CEND:
        return tl.load(p, mask=h_ok[None, :] & (c < CEND)[:, None], other=0.0, cache_modifier=MOD)
    elif MASK_H:
        return tl.load(p, mask=h_ok[None, :], other=0.0, cache_modifier=MOD)
    elif CB + P > CEND:
        return tl.load(p, mask=(c < CEND)[:, None], other=0.0, cache_modifier=MOD)
    else:
        return tl.load(p, cache_modifier=MOD)


@triton.jit
def _w2_part(w2_ptr, sw2_k, sw2_r, h0, h_ok, BH: tl.constexpr, MASK_H: tl.constexpr,
             KB: tl.constexpr, P: tl.constexpr, K: tl.constexpr, MOD: tl.constexpr):
    """[BH, P]: W2[KB + k, h0 + h], zero where h_ok is false (MASK_H) or k >= K: one hidden chunk's
    projection weights for the output part at KB, transposed for hid @ W2^T."""
    k = KB + tl.arange(0, P)
    h = h0 + tl.arange(0, BH)
    p = w2_ptr + h[:, None] * sw2_r + k[None, :] * sw2_k
    if MASK_H and KB + P > K:
        return tl.load(p, mask=h_ok[:, None] & (k < K)[None, :], other=0.0, cache_modifier=MOD)
    elif MASK_H:
        return tl.load(p, mask=h_ok[:, None], other=0.0, cache_modifier=MOD)
    elif KB + P > K:
        return tl.load(p, mask=(k < K)[None, :], other=0.0, cache_modifier=MOD)
    else:
        return tl.load(p, cache_modifier=MOD)


# The A operand of the expand is NG groups of CG columns (stride 1: one, y; stride 2: two, blur(x) then
# blur(y)), each split into NPX parts: NPX - 1 of PW columns and a last one of PWL. Part p's first W1
# column, its width, and the end of its group's valid columns (compile-time arithmetic):
@triton.constexpr_function
def _a_base(p, npx, pw, cg):
    return (p % npx) * pw + (p // npx) * cg


@triton.constexpr_function
def _a_width(p, npx, pw, pwl):
    return pwl if p % npx == npx - 1 else pw


@triton.constexpr_function
def _a_end(p, npx, cg):
    return (p // npx) * cg + cg


@triton.jit
def _resident_weights(
    w1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k, sw2_r,
    NPX: tl.constexpr, NG: tl.constexpr, PW: tl.constexpr, PWL: tl.constexpr, CG: tl.constexpr,
    K0: tl.constexpr, K1: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, RES: tl.constexpr,
):
    """The expand and projection weights of the first RES hidden chunks, one tensor per chunk and part
    (tuples: w1s[chunk * NG * NPX + A part], w2a[chunk], w2b[chunk] (absent when K1 == 0)). Loaded
    before a program's tile loop and used by its dots only, they are staged once into shared memory
    and stay there for all its tiles (the compile test pins the stores before the loop)."""
    w1s = ()
    w2a = ()
    w2b = ()
    for i in tl.static_range(RES):
        h_ok = i * BH + tl.arange(0, BH) < R
        for p in tl.static_range(NG * NPX):
            w1s = w1s + (_w1_part(w1_ptr, sw1_r, sw1_c, i * BH, h_ok, BH, i * BH + BH > R,
                                  _a_base(p, NPX, PW, CG), _a_width(p, NPX, PW, PWL), _a_end(p, NPX, CG),
                                  ""),)
        w2a = w2a + (_w2_part(w2_ptr, sw2_k, sw2_r, i * BH, h_ok, BH, i * BH + BH > R, 0, K0, K, ""),)
        if K1 > 0:
            w2b = w2b + (_w2_part(w2_ptr, sw2_k, sw2_r, i * BH, h_ok, BH, i * BH + BH > R, K0, K1, K, ""),)
    return w1s, w2a, w2b


@triton.jit
def _expand_chunk(ys, w1s, OFF: tl.constexpr, NA: tl.constexpr, PRECISION: tl.constexpr):
    """sum_p ys[p] @ w1s[OFF + p]: one hidden chunk's expand, fp32."""
    hid = tl.dot(ys[0], w1s[OFF], input_precision=PRECISION)
    for p in tl.static_range(1, NA):
        hid = tl.dot(ys[p], w1s[OFF + p], hid, input_precision=PRECISION)
    return hid


@triton.jit
def _project_chunk(hid, b1, acc0, acc1, w2_0, w2_1, dt: tl.constexpr, K1: tl.constexpr,
                   PRECISION: tl.constexpr, ASM: tl.constexpr):
    """acc += ReLU(hid + b1) @ [w2_0 | w2_1]: one hidden chunk's projection (b1 fp32, rounded to dt once)."""
    hid = _bias_relu(hid, b1[None, :], dt, ASM)
    acc0 = tl.dot(hid, w2_0, acc0, input_precision=PRECISION)
    if K1 > 0:
        acc1 = tl.dot(hid, w2_1, acc1, input_precision=PRECISION)
    return acc0, acc1


@triton.jit
def _hidden_chunk(ys, acc0, acc1, w1s, OFF: tl.constexpr, w2_0, w2_1, b1_ptr, H0, h_ok,
                  NA: tl.constexpr, K1: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr,
                  ASM: tl.constexpr):
    """acc += ReLU(sum_p ys[p] @ w1s[OFF + p] + b1[H0:H0 + BH]) @ [w2_0 | w2_1] for one hidden chunk."""
    hid = _expand_chunk(ys, w1s, OFF, NA, PRECISION)
    hh = H0 + tl.arange(0, BH)
    b1 = tl.load(b1_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
    return _project_chunk(hid, b1, acc0, acc1, w2_0, w2_1, ys[0].dtype, K1, PRECISION, ASM)


@triton.jit
def _hidden_chunk_b1(ys, acc0, acc1, w1s, OFF: tl.constexpr, w2_0, w2_1, b1, NA: tl.constexpr,
                     K1: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr):
    """``_hidden_chunk`` with the chunk's b1 given as an fp32 vector (staged.py: loaded before the tile
    loop, kept in registers)."""
    return _project_chunk(_expand_chunk(ys, w1s, OFF, NA, PRECISION), b1, acc0, acc1, w2_0, w2_1,
                          ys[0].dtype, K1, PRECISION, ASM)


@triton.jit
def _streamed_chunks(
    ys, acc0, acc1, w1_ptr, b1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k, sw2_r, H_START: tl.constexpr, H_END,
    NPX: tl.constexpr, NG: tl.constexpr, PW: tl.constexpr, PWL: tl.constexpr, CG: tl.constexpr,
    K0: tl.constexpr, K1: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BH: tl.constexpr,
    MOD: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
):
    """acc += the hidden chunks [H_START, H_END) (H_END a runtime value, which keeps the compiler from
    unrolling the loop), their weights loaded per tile with cache modifier MOD, not software-pipelined."""
    NA: tl.constexpr = NG * NPX
    for h0 in tl.range(H_START, H_END, BH, num_stages=1):
        h_ok = h0 + tl.arange(0, BH) < R
        w1s_h = ()
        for p in tl.static_range(NA):
            w1s_h = w1s_h + (_w1_part(w1_ptr, sw1_r, sw1_c, h0, h_ok, BH, R % BH != 0,
                                      _a_base(p, NPX, PW, CG), _a_width(p, NPX, PW, PWL),
                                      _a_end(p, NPX, CG), MOD),)
        w2_0 = _w2_part(w2_ptr, sw2_k, sw2_r, h0, h_ok, BH, R % BH != 0, 0, K0, K, MOD)
        w2_1 = w2_0
        if K1 > 0:
            w2_1 = _w2_part(w2_ptr, sw2_k, sw2_r, h0, h_ok, BH, R % BH != 0, K0, K1, K, MOD)
        acc0, acc1 = _hidden_chunk(ys, acc0, acc1, w1s_h, 0, w2_0, w2_1, b1_ptr, h0, h_ok, NA, K1, BH,
                                   PRECISION, ASM)
    return acc0, acc1


@triton.jit
def _ffn_chunks(
    ys, acc0, acc1, w1s, w2a, w2b,
    w1_ptr, b1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k, sw2_r, R_RUN,
    NPX: tl.constexpr, NG: tl.constexpr, PW: tl.constexpr, PWL: tl.constexpr, CG: tl.constexpr,
    K0: tl.constexpr, K1: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BH: tl.constexpr,
    RES: tl.constexpr, CACHED: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
):
    """acc += ReLU(A @ W1^T + b1) @ W2^T over the hidden chunks of BH channels (the hidden tile never
    leaves the chip). A is given as NG x NPX parts ys (``_a_base``, ``_a_width``); the output as
    power-of-two parts acc0 [M, K0] (channels [0, K0)) and acc1 [M, K1] ([K0, K0 + K1)), valid below K.

    Three kinds of chunks, in order:
    * the first RES take their weights from the resident tuples (``_resident_weights``, unrolled);
    * the next CACHED load theirs per tile with plain ld.global (a runtime loop): L1-allocating loads,
      which the program's later tiles find in L1 (the launcher declares them in the L1 working set);
    * the others (a runtime loop up to R_RUN = R) load theirs per tile with ld.global.cg: L2 traffic
      that does not pass through L1, where the conv windows and the cached chunks stay. (Pipelined,
      the pieces narrower than 16 bytes became cp.async.ca, which allocates in L1; ld.global.cg never
      does.)
    """
    NA: tl.constexpr = NG * NPX
    for i in tl.static_range(RES):
        h_ok = i * BH + tl.arange(0, BH) < R
        if K1 > 0:
            acc0, acc1 = _hidden_chunk(ys, acc0, acc1, w1s, i * NA, w2a[i], w2b[i], b1_ptr, i * BH, h_ok,
                                       NA, K1, BH, PRECISION, ASM)
        else:
            acc0, acc1 = _hidden_chunk(ys, acc0, acc1, w1s, i * NA, w2a[i], w2a[i], b1_ptr, i * BH, h_ok,
                                       NA, K1, BH, PRECISION, ASM)
    if (RES + CACHED) * BH < R:
        acc0, acc1 = _streamed_chunks(ys, acc0, acc1, w1_ptr, b1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k, sw2_r,
                                      (RES + CACHED) * BH, R_RUN, NPX, NG, PW, PWL, CG, K0, K1, K, R, BH,
                                      ".cg", PRECISION, ASM)
    if CACHED > 0:
        acc0, acc1 = _streamed_chunks(ys, acc0, acc1, w1_ptr, b1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k, sw2_r,
                                      RES * BH, tl.minimum(R_RUN, (RES + CACHED) * BH), NPX, NG, PW, PWL,
                                      CG, K0, K1, K, R, BH, "", PRECISION, ASM)
    return acc0, acc1


@triton.jit
def _convfirst_s1_kernel(
    # pointers
    x_ptr, wc_ptr, bc_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,
    # sizes: H x W map, TILES = N x tiles per image, R_RUN = R hidden channels (also a constexpr),
    # STEPS = 5 two-tap conv steps
    H, W, TILES, R_RUN, STEPS,
    # x's strides in units of 8 elements (unit channel stride), so that every 8-channel group is
    # provably one aligned 16-byte vector; the weights' strides in elements
    sxn8, sxh8, sxw8,
    swc_o, swc_i, swc_h, swc_w,  # w_conv (C, 8, 3, 3)
    sw1_r, sw1_c,  # w1 (R, C)
    sw2_k, sw2_r,  # w2 (C, R)
    # meta-parameters
    C: tl.constexpr, NPX: tl.constexpr, PW: tl.constexpr, PWL: tl.constexpr, K0: tl.constexpr,
    K1: tl.constexpr,
    R: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, BLOCK_H: tl.constexpr, RESIDENT: tl.constexpr,
    CACHED: tl.constexpr, SUB: tl.constexpr, RES_LATE: tl.constexpr, SPLIT_BASE: tl.constexpr,
    WARPS: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr, TAPS: tl.constexpr,
):
    tl.static_assert(PWL >= 16 and (NPX - 1) * PW + PWL >= C, "conv parts must cover C")
    tl.static_assert(K0 >= 16 and K0 + K1 >= C, "output parts must cover C")
    tl.static_assert(BLOCK_H >= 16, "tl.dot operands need >= 16 hidden channels")
    BLOCK_M: tl.constexpr = TH * TW
    sxn = tl.cast(sxn8, tl.int64) * 8
    sxh = sxh8 * 8
    sxw = sxw8 * 8
    w1s, w2a, w2b = _resident_weights(w1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k, sw2_r, NPX, 1, PW, PWL, C,
                                      K0, K1, C, R, BLOCK_H, RESIDENT)
    for t in tl.range(tl.program_id(0), TILES, tl.num_programs(0), num_stages=1):
        n, oh, ow, m_ok = _tile_pixels(t, H, W, TH, TW)
        if SPLIT_BASE:  # the image's base pointer, then int32 pixel offsets (see the launcher's table)
            x_pix = (x_ptr + n * sxn) + (oh * sxh + ow * sxw)
        else:
            x_pix = x_ptr + n * sxn + oh * sxh + ow * sxw
        out_pix = out_ptr + (n.to(tl.int64) * H * W + oh * W + ow) * C
        ys = ()
        for q in tl.static_range(NPX):  # the last (narrower) part first
            ys = (_gconv_part(x_pix, oh, ow, m_ok, H, W, sxh, sxw, STEPS, wc_ptr, swc_o, swc_i, swc_h,
                              swc_w, bc_ptr, C, _a_base(NPX - 1 - q, NPX, PW, C),
                              _a_width(NPX - 1 - q, NPX, PW, PWL), SUB, BLOCK_M, PRECISION,
                              WARPS, TAPS),) + ys
        if RES_LATE:
            acc0 = tl.zeros((BLOCK_M, K0), tl.float32) + _load_vec(b2_ptr, 0, K0, C)[None, :]
            acc1 = acc0
            if K1 > 0:
                acc1 = tl.zeros((BLOCK_M, K1), tl.float32) + _load_vec(b2_ptr, K0, K1, C)[None, :]
        else:
            acc0 = _load_part(x_pix, m_ok, 0, K0, C) + _load_vec(b2_ptr, 0, K0, C)[None, :]
            acc1 = acc0
            if K1 > 0:
                acc1 = _load_part(x_pix, m_ok, K0, K1, C) + _load_vec(b2_ptr, K0, K1, C)[None, :]
        acc0, acc1 = _ffn_chunks(ys, acc0, acc1, w1s, w2a, w2b, w1_ptr, b1_ptr, w2_ptr, sw1_r, sw1_c,
                                 sw2_k, sw2_r, R_RUN, NPX, 1, PW, PWL, C, K0, K1, C, R, BLOCK_H, RESIDENT,
                                 CACHED, PRECISION, ASM)
        if RES_LATE:  # one output part at a time: a part's residual is live only until its store
            _store_part(out_pix, acc0 + _load_part(x_pix, m_ok, 0, K0, C), m_ok, 0, K0, C)
            if K1 > 0:
                _store_part(out_pix, acc1 + _load_part(x_pix, m_ok, K0, K1, C), m_ok, K0, K1, C)
        else:
            _store_part(out_pix, acc0, m_ok, 0, K0, C)
            if K1 > 0:
                _store_part(out_pix, acc1, m_ok, K0, K1, C)


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
    # sizes: H x W input, HO x WO output, TILES = N x output tiles per image, R_RUN = R hidden channels
    # (also a constexpr; C and K are constexprs)
    H, W, HO, WO, TILES, R_RUN,
    # x's strides in units of 8 elements (unit channel stride); the weights' strides in elements
    sxn8, sxh8, sxw8,
    swc_o, swc_i, swc_h, swc_w,  # w_conv (C, 8, 3, 3)
    sw1_r, sw1_c,  # w1 (R, 2C): columns [0, C) act on blur(x), [C, 2C) on blur(y)
    sw2_k, sw2_r,  # w2 (K, R)
    # meta-parameters
    C: tl.constexpr, CP2: tl.constexpr, NPX: tl.constexpr, K: tl.constexpr, K0: tl.constexpr,
    K1: tl.constexpr, R: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, BLOCK_H: tl.constexpr,
    RESIDENT: tl.constexpr, CACHED: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
    BLUR_F16: tl.constexpr,
    ROW_LOOP: tl.constexpr,
):
    tl.static_assert(CP2 >= 16 and NPX * CP2 >= C and NPX <= 4, "blur/conv parts must cover C")
    tl.static_assert(K0 >= 16 and K0 + K1 >= K, "output parts must cover K")
    BLOCK_M: tl.constexpr = TH * TW
    if BLUR_F16:
        bt: tl.constexpr = tl.float16
    else:
        bt: tl.constexpr = tl.float32
    sxn = tl.cast(sxn8, tl.int64) * 8
    sxh = sxh8 * 8
    sxw = sxw8 * 8
    # A of the expand: blur(x) in NPX parts of CP2 channels (W1 columns [0, C)), then blur(y) alike
    w1s, w2a, w2b = _resident_weights(w1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k, sw2_r, NPX, 2, CP2, CP2, C,
                                      K0, K1, K, R, BLOCK_H, RESIDENT)
    for t in tl.range(tl.program_id(0), TILES, tl.num_programs(0), num_stages=1):
        n, oh, ow, m_ok = _tile_pixels(t, HO, WO, TH, TW)
        # BlurPool's reflect padding folded into per-row / per-column blur weights (exact powers of two):
        # [1/4, 1/2, 1/4] inside; first row/column (reflects -1 -> 1): [0, 1/2, 1/2]; last one of an
        # odd size (reflects H -> H - 2): [1/2, 1/2, 0].
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
        xc = x_ptr + n * sxn + oh2 * sxh + ow2 * sxw  # window centre (2oh, 2ow)
        xc = xc[:, None] + tl.arange(0, CP2)[None, :]
        # channel parts of CP2 (the grouped conv never mixes them), each blurred and convolved on its own
        uxs = ()
        uys = ()
        for p in tl.static_range(NPX):
            uy, ux = _blur_conv(xc + p * CP2, oh2, ow2, m_ok, H, W, sxh, sxw, ah0, ah1, ah2, aw0, aw1, aw2,
                                wc_ptr, swc_o, swc_i, swc_h, swc_w, bc_ptr, C, p * CP2, CP2, BLOCK_M, bt,
                                PRECISION, ROW_LOOP)
            uxs = uxs + (ux,)
            uys = uys + (uy,)
        acc0 = tl.zeros((BLOCK_M, K0), tl.float32) + _load_vec(b2_ptr, 0, K0, K)[None, :]
        acc1 = acc0
        if K1 > 0:
            acc1 = tl.zeros((BLOCK_M, K1), tl.float32) + _load_vec(b2_ptr, K0, K1, K)[None, :]
        acc0, acc1 = _ffn_chunks(uxs + uys, acc0, acc1, w1s, w2a, w2b, w1_ptr, b1_ptr, w2_ptr, sw1_r, sw1_c,
                                 sw2_k, sw2_r, R_RUN, NPX, 2, CP2, CP2, C, K0, K1, K, R, BLOCK_H, RESIDENT,
                                 CACHED, PRECISION, ASM)
        out_pix = out_ptr + (n.to(tl.int64) * HO * WO + oh * WO + ow) * K
        _store_part(out_pix, acc0, m_ok, 0, K0, K)
        if K1 > 0:
            _store_part(out_pix, acc1, m_ok, K0, K1, K)
