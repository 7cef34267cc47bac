"""Triton kernels of the group-width-8 3x3 convolution (padding 1, stride 1 or 2, no bias) on NHWC
activations: forward, dgrad (input gradient) and wgrad (weight gradient). reference.py is the
specification; launcher.py picks the tiles, checks the inputs and launches.

    y[n, oh, ow, co]  = sum_{k, kh, kw} w[co, k, kh, kw] x[n, s oh + kh - 1, s ow + kw - 1, 8 (co // 8) + k]

Two taps per K step
-------------------
A group has 8 input channels; ``tl.dot`` needs K >= 16. Every kernel here therefore multiplies two
taps at once, for all G groups of the program's channel block in one batched dot:

    A [G, BM, 16]: A[g, m, k] = x(pixel m shifted by tap t0 (k < 8) or t1 (k >= 8), channel 8 g + k % 8)
    B [G, 16, 8]:  B[g, k, j] = w[8 g + j, k % 8, t0 or t1]
    acc [G, BM, 8] += A @ B        (fp32 accumulator; channel 8 g + j of pixel m)

The nine taps are five steps (t0, t1) = (0, 1), (2, 3), (4, 5), (6, 7), (8, -): the tenth slot is
masked to zero in both operands, so the issued MACs are 10/9 of the useful ones (plus the masked
rows of partial tiles and masked groups). A batched 3-D dot compiles to ``mma.sync`` m16n8k16 (one
per 16 pixels, group and step). A block-diagonal 2-D dot would get wgmma but issue 8x the useful MACs
at 64 channels: 576 MACs per output element take 1.16 ps of an H100 SXM's 989 TFLOP/s against the
1.19 ps its 3.35 TB/s need for the element's 4 bytes of fp16 in + out, no margin left.

Reusable pieces (``@triton.jit`` helpers, used by all the kernels; the fused training blocks
build on them): ``tile_pixels`` (a program's image and TH x TW pixel tile), ``group_ok`` (masked
groups of a partial channel block), ``tap_window`` + ``load_tap_pair`` (the A operand: two shifted
windows of an NHWC map, zero padding by mask), ``tap_weights`` + ``load_tap_pair_weights`` (the B
operand, transposed within the group for dgrad), ``gconv_tile`` (the five-step product of one tile),
``wgrad_pair_product`` (one tap pair's contribution of a tile to the weight gradient),
``backward_pair_step`` (the fused backward's step: one dy pair for both gradients),
``store_group_tile`` / ``load_group_tile`` and ``store_wgrad_pair``.

Forward (``_gconv_fwd_kernel``)
-------------------------------
Grid (N x tiles per image / TPP, ceil(C / 8G)): a program owns TPP consecutive TH x TW tiles of output
pixels (launcher.tiles_per_program: up to 8 while enough programs remain) and a block of G groups (8G
channels; the groups past C of a last partial block are masked, MASK_C).
x is read through its strides: unit channel stride and pixel strides in units of 8 elements, so each
(group, pixel, tap) is one aligned 16-byte vector. The nine shifted windows of a tile overlap; the
tap loads are plain ``ld.global`` (PTX's default cache operator is .ca: SASS ``LDG.E.128``, allocated
in L1), so the re-reads of a tile's halo hit L1, and neighbouring tiles' halos come from L2. They are
not software-pipelined: Triton turns pipelined loads into 16-byte ``cp.async``, which is always .cg
(``LDGSTS.E.BYPASS``, L2 only) whatever ``cache_modifier`` says (checked on the compiled code: the
compile test pins LDG.E.128 and no LDGSTS). Each pair's copy to shared memory for the mma.sync is free
of bank conflicts in the load order ``launcher.tap_order()`` gives the installed Triton (``TAPS``: order 0
took the forward's shared wavefronts to 2.9-3.9x; a compile test checks the copies). The five steps are
written out (no loop); their five weight operands are loaded once per program, before its tiles
(``conv_pair_weights``; 16-bit operands: fp32 ones, split for 3xTF32, keep one load per step and tile).
Per tile a one-tile program paid the weights' load waits and their copies to shared memory for the
mma.sync: 40 % of its exposed waits at Small's 1024-channel 16x16 training map, where 8 tiles per
program take the static estimate from 130-215 to 110-166 us (L1-pipe 89-93 -> 78-81, latency 66-69 ->
60-62). Latency is hidden by the other programs resident per SM (63-180 registers, no stack, every model
shape, Triton 3.6 and 3.8).
Each input element is read from DRAM about once, y is written once. Pixels outside the map and the
padding ring are masked.

Dgrad (input gradient)
----------------------
Stride 1: the same kernel (``FLIP``): dx = conv(dy, w') with w'[8g + k, j, t] = w[8g + j, k, 8 - t],
the taps flipped and input/output swapped inside each group; only the weight operand's addresses
change.
Stride 2 (``_gconv_dgrad_s2_kernel``): a gather per input pixel, no atomics. Input pixel (2a + py,
2b + px) receives from output row a (tap row 1) when py = 0 and from rows a + 1 (tap row 0) and a
(tap row 2) when py = 1; columns alike. A program owns a TH x TW tile of positions (a, b) and computes
the four parity classes one after another, each from the dy windows at (a, b) .. (a + 1, b + 1):

    (0, 0): tap 4 at (0, 0), with an empty second slot          1 step
    (0, 1): taps 3 at (0, +1) and 5 at (0, 0)                   1 step
    (1, 0): taps 1 at (+1, 0) and 7 at (0, 0)                   1 step
    (1, 1): taps 0 at (+1, +1), 2 at (+1, 0); 6 at (0, +1), 8   2 steps

five steps for four input pixels, 10/9 of the useful MACs as in the forward. One accumulator is
live at a time; each class is stored (stride-2 pixels, 16-byte vectors per group) as it finishes. The
model's training form never runs this one (its stride-2 blocks convolve at stride 1, then BlurPool).

Wgrad (``_gconv_wgrad_kernel`` + ``_wgrad_reduce_kernel``), deterministic by default
------------------------------------------------------------------------------------
dw[8g + j, k, t] = sum over pixels p of x_t[p, 8g + k] dy[p, 8g + j], a reduction over N x H' x W'
pixels. Per tap pair: acc[G, 16, 8] += A^T @ dy with A the [G, BM, 16] window of the forward
(permuted to [G, 16, BM]) and dy the tile's [G, BM, 8] gradient: K = BM pixels per dot, five fp32
accumulators per program. Grid (shares, ceil(C / 8G)): the tiles of the whole batch, numbered image
by image, are cut into shares of TILES_PER_SHARE consecutive tiles; a program sums its share in tile
order and writes its five accumulators as an fp32 partial (share, C, 8, 9) (the tenth slot dropped).
A second launch sums the partials over the shares in a fixed order (blocks of SB shares, each summed
by a fixed tree, then block after block) and writes dw in its dtype. Every sum runs in an order fixed
by the shapes (the shares do not depend on the device), so two identical calls give bitwise-equal
gradients (for one compiled kernel: GPU architecture and Triton version). ATOMIC
(``deterministic=False``): the programs add their partials with fp32 atomics into a zeroed fp32
buffer instead (one launch, no partials buffer, order-dependent rounding).

Fused stride-1 backward (``_gconv_backward_kernel``), dy's windows read once for both gradients
-----------------------------------------------------------------------------------------------
Where both gradients of a stride-1 conv are wanted (the MBConv blocks' training backward), one launch
over wgrad's grid (shares x channel blocks) computes both: per tile of its share, each tap pair of dy's
window is loaded once (``backward_pair_step``) and feeds dx = the flipped conv of the window (the
stride-1 dgrad's product) and the wgrad accumulator of its pair against the tile's own x:

    dW_t = sum_p dy(p) x(p + d_t)^T = sum_q dy(q - d_t) x(q)^T

so window tap t of dy, dy(q + d_t) = dy(q - d_{8-t}), against x's centre gives the gradient of tap 8 - t,
transposed within the group (``store_wgrad_pair``'s FLIPPED layout). x's nine windows are never loaded,
only its tile: a tile loads 11 tap-sized tiles (10 slots of dy, x once) where it loaded 21 (static
estimate, Small, batch 128, sm_90, high end: 1024 channels at 16x16 236 -> 149 us, at 8x8 61 -> 40, 384 at
32x32 353 -> 223; no stack on sm_90 or sm_80, Triton 3.6 or 3.8).
Dgrad's five weight operands are loaded once per program, before its share (``conv_pair_weights``),
not once per tile: at Small's 1024-channel 16x16 map that took a tile's
exposed load waits from 15 to 10 and its loop from 811 to 547 SASS instructions per warp (the weights'
per-tile STSM / LDSM staging gone; 522 -> 362 barriers per warp). The partials go to wgrad's fixed-order
reduction (deterministic) or to fp32 atomics. DRAM: dy, x and dx once (6 bytes per element at fp16)
against 4 + 4 for the two launches, whose dgrad has no share loop but one tile per program. One warp per
group of the channel block (G warps; two groups a warp at G = 16, the small maps' blocks on sm_90,
launcher.py): at G = 2 four warps computed the wgrad dot ([2, 16, BM], one
16-row MMA tile per group) twice (compiled tensor-core MACs 2x the declared), and at G = 8 four warps
took 168 registers and, with fp32 master weights (autocast), 8 B of stack on sm_90. Compiled (fp16 and
bf16, fp32 weights, every model shape; Triton 3.6 and 3.8): sm_90 G = 8 8 x 8 tiles 126-128 registers (2
programs per SM, 24 KB shared memory), G = 4 8 x 8 127-150, G = 2 8 x 16 168; sm_80 128-188; fp32
(3xTF32) up to 255; no stack anywhere, mma.sync. G = 2 and fp32 reload the weights per tile: kept, they
spilled. Larger tiles do not pay: G = 4 at 8 x 16 took 190 registers (2 programs per SM, latency-bound
at 72 channels), G = 2 at 16 x 16 spilled 40 B. Static estimate of an earlier form of the cost model
(the current one's figures per launch: ``convfirstnet kernels --train``; fp16 activations and
weights, batch 128, sm_90, low-high us, with the reduction; ``convfirstnet.analysis`` on the recorded
launches) against dgrad + wgrad + reduction:

    C, map        two launches    fused       C, map        two launches    fused
    1024, 16^2    89.6-110.1      68.3-84.0   384, 32^2     132.5-163.0     101.2-124.5
    1024, 8^2     26.4-32.5       20.5-25.4   768, 16^2     68.2-83.6       51.9-63.7
    1024, 14^2    71.5-86.9       58.5-66.6   1024, 7^2     23.2-26.7       17.8-21.1

and faster at every stride-1 shape of MODEL_SHAPES (launcher.py; 72 at 28^2: 26.4-30.0 ->
24.7-26.4, the closest), with fp32 weights too (1024 at 14^2: 72.0-95.8 -> 64.3-67.7). The fused
launch is DRAM-bound at 16^2 and 32^2; at 8^2 and 7^2 wgrad's shares would leave one program per SM
(latency-bound, slower than the two launches at 7^2 for 512-768 channels), so the launcher takes
shorter shares there (launcher.backward_config).

Accumulation and precision
--------------------------
All dots accumulate in fp32 over K = 16 per step (9 x 8 = 72 products per output, in five steps) or
BM pixels per tile (wgrad, then TILES_PER_SHARE tiles, then the shares). fp16 / bf16 operands go to
the tensor cores as they are; fp32 operands use ``input_precision="tf32x3"`` (~fp32 accuracy; the
interpreter computes exact fp32). Weights may be fp32 with 16-bit activations (autocast keeps the
master weights in fp32): they are rounded to the activation dtype as they are loaded, exactly what
autocast's cast would do. Outputs are rounded once.

As compiled (fp16, batch 128, 224 x 224 training maps, sm_90; ``t_dram`` = x and y (dy, dx) once at
3.35 TB/s, ``t_issue`` = SASS instructions per warp weighted by the declared loops, x warps x programs,
at 4 per clock per SM on 132 SMs at 1.83 GHz; tests/kernels/_recorded.py ``bounds``)

    layer (C, map)      kernel   G  tile   regs  smem   SASS/warp   t_dram  t_issue  (us)
    Small 32, 112^2     forward  4  8x16     96  17 KB      705       61.4    37.0
                        dgrad    4  8x16    128  17 KB      827       61.4    43.4
                        wgrad    4  8x16    127  16 KB     7435       64.0    32.5    (+ reduction 1.2)
    Nano 24, 112^2      forward  4  8x16     96  17 KB      785       46.0    41.2    (one masked group)
                        dgrad    4  8x16    102  17 KB      932       46.0    48.9
    Pico 48, 56^2       dgrad    2  16x16   128  17 KB     1016       23.0    26.1    (G = 2)
    Pico 512, 14^2      forward  8  8x8     128  18 KB      731       15.4    12.8
                        dgrad    8  8x8     128  18 KB      911       15.4    15.9
                        wgrad    8  8x8     128  16 KB     8815       16.7     9.6

Every fp16/bf16 variant of the four models' shapes (stride 1 and 2, 224 and 256 inputs, forward,
dgrad, wgrad, reduction) compiles without stack for sm_90 and sm_80, all dots as mma.sync, shared
memory <= 18 KB (the dot operands' layout conversion), 63-180 registers. (The table's tiles are the
16 KB ones; the forward kernel and the fused backward now take 32 KB tap pairs at G >= 4, and wgrad at
stride 1 where C is whole groups of four, launcher.py FWD_TILE_ELEMS: 165-254 registers on sm_90, no
stack.) At the models' stride-1
shapes t_tensor is 13-24 % of t_dram on sm_90 (25-46 % on sm_80), and t_issue stays under t_dram
except where the per-pixel work is shared by few channels: dgrad (~20 % more instructions than the
forward, its transposed weight loads) at G = 2 and with masked groups, and Tiny's 72-channel layer
(up to 1.42x t_dram on sm_90). Stride 2 on 7 x 7 maps (no model shape) is issue-bound (wgrad 2.3x).
Not in this table: L1 and L2 bandwidth for the nine overlapping windows (10 tap slots x 2 bytes per
element and channel from L1, the halos from L2), load latency. The cost report (convfirstnet.analysis)
counts them: each launch declares its L1 working set (launcher._l1_declaration: a tile's halo window,
wgrad's dy tile, the program's weights), so L2 carries one window per tile where that set fits in the
L1 the compiled shared memory leaves (the compile test checks it on sm_90), and every requested byte
otherwise. A GPU run must confirm that the windows hit L1 and that the kernels run near DRAM bandwidth.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._activations import silu

# ------------------------------------------------------------------------------------------------
# Reusable pieces
# ------------------------------------------------------------------------------------------------


@triton.jit
def tile_pixels(t, HO, WO, TH: tl.constexpr, TW: tl.constexpr):
    """Tile ``t`` of the tiles of a batch of HO x WO maps (numbered image by image, row-major within
    an image): its image n and, per row m of the tile, the pixel (oh, ow) and whether it is inside the
    map. One scalar division per tile; TW is a power of two, so the rest are shifts and masks."""
    tiles_w = tl.cdiv(WO, TW)
    tiles = tl.cdiv(HO, TH) * tiles_w
    n = t // tiles
    q = t % tiles
    m = tl.arange(0, TH * TW)
    oh = (q // tiles_w) * TH + m // TW
    ow = (q % tiles_w) * TW + m % TW
    return n, oh, ow, (oh < HO) & (ow < WO)


@triton.jit
def group_ok(co0, C, G: tl.constexpr, MASK_C: tl.constexpr):
    """[G, 1, 1]: group g of the channel block starting at co0 lies inside the C channels. MASK_C (a
    constexpr): C is not a multiple of the block's 8G channels; otherwise every group is inside."""
    g = tl.arange(0, G)[:, None, None]
    if MASK_C:
        return co0 + 8 * g < C
    else:
        return tl.full((G, 1, 1), 1, tl.int1)


@triton.jit
def tap_window(pix, r, c, pix_ok, gok, G: tl.constexpr):
    """The loop-invariant part of a tile's A operands ([G, BM, 16], see ``load_tap_pair``).

    pix: [BM] pointers at each row's window centre, pixel (r, c) of its image, at the program's first
    channel (unit channel stride); pix_ok: the row is a real pixel; gok: ``group_ok``. Returns the
    [G, BM, 16] pointers of channel 8 g + k % 8 at the centre, the centre row / column and validity as
    [1, BM, 1] (per pixel: the masks are computed once for all G groups), ``gok``, and ``hi`` ([1, 1, 16]:
    k >= 8, the pair's second tap), as the tuple ``load_tap_pair`` takes."""
    g = tl.arange(0, G)[:, None, None]
    k = tl.arange(0, 16)[None, None, :]
    base = pix[None, :, None] + (8 * g + k % 8)
    return base, r[None, :, None], c[None, :, None], pix_ok[None, :, None], gok, k >= 8


@triton.jit
def load_rows_first(ptr, mask):
    """tl.load of a [B, M, K] tile issued as [M, B, K] and permuted back (``mask`` may broadcast along
    K): the load order behind TAPS 1, which on Triton 3.6 gives the tile a register layout whose copy to
    shared memory for a batched mma.sync has no bank conflicts (the ConvFirst kernel's tap pairs too)."""
    t = tl.load(tl.permute(ptr, (1, 0, 2)), mask=tl.permute(mask, (1, 0, 2)), other=0.0)
    return tl.permute(t, (1, 0, 2))


@triton.jit
def load_tap_pair(win, H, W, sh, sw, dh0, dw0, dh1, dw1, has1, TAPS: tl.constexpr):
    """A operand of a two-tap step, [G, BM, 16], from an NHWC map of H x W pixels (strides sh, sw in
    elements); ``win``: the tuple from ``tap_window``.

    Element [g, m, k]: channel 8 g + k % 8 of pixel (r + dh0, c + dw0) for k < 8, of pixel
    (r + dh1, c + dw1) for k >= 8 (zero when ``has1`` is false: the empty tenth tap); zero outside the
    map (the zero padding) and on rows that are not real pixels. Each (g, m, half) is one 16-byte
    vector (8 channels of 16-bit data).

    TAPS: the index order of the load, which decides the register layout Triton gives the tile and so
    the bank conflicts of its copy to shared memory for the batched mma.sync (launcher.tap_order()):
    0 [G, BM, 16] as is; 1 loaded as [BM, G, 16] and permuted (conflict-free on Triton 3.6); 2 loaded as
    [G BM, 16] rows and reshaped (conflict-free on 3.8). The MBConv hidden kernel's tap pairs have the
    same choice (kernels/mbconv/kernel.py ``_conv_pair_h``)."""
    base, r3, c3, ok3, gok, hi = win
    dh = tl.where(hi, dh1, dh0)
    dw = tl.where(hi, dw1, dw0)
    rr = r3 + dh
    cc = c3 + dw
    ok = (ok3 & (rr >= 0) & (rr < H) & (cc >= 0) & (cc < W) & (has1 | (hi == 0))) & gok
    # a plain ld.global (PTX's default cache operator .ca, SASS LDG.E.128): allocated in L1, where the
    # overlapping windows of the other taps find it. Not pipelined: cp.async of 16 bytes is always .cg
    # (LDGSTS.E.BYPASS, L2 only), whatever cache_modifier says.
    ptr = base + (dh * sh + dw * sw)
    if TAPS == 1:
        return load_rows_first(ptr, ok)
    elif TAPS == 2:
        GM: tl.constexpr = ptr.shape[0] * ptr.shape[1]
        t = tl.load(tl.reshape(ptr, (GM, 16)), mask=tl.reshape(ok, (GM, 16)), other=0.0)
        return tl.reshape(t, ptr.shape)
    else:
        return tl.load(ptr, mask=ok, other=0.0)


@triton.jit
def tap_weights(w_ptr, co0, swo, swi, gok, G: tl.constexpr, TRANSPOSE: tl.constexpr):
    """The loop-invariant part of the B operands ([G, 16, 8], see ``load_tap_pair_weights``): pointers
    at tap (0, 0), ``hi`` ([1, 16, 1]: k >= 8) and the groups inside C (``gok``). Element [g, k, j] is
    the weight from input channel 8 g + k % 8 to output channel 8 g + j of the channel block starting
    at co0: forward w[co0 + 8 g + j, k % 8]; TRANSPOSE (dgrad: dy is the input and dx the output, so
    the roles of the group's channels swap) w[co0 + 8 g + k % 8, j]. w is (C, 8, 3, 3) through its
    strides."""
    g = tl.arange(0, G)[:, None, None]
    k = tl.arange(0, 16)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    if TRANSPOSE:
        base = w_ptr + (co0 + 8 * g + k % 8) * swo + j * swi
    else:
        base = w_ptr + (co0 + 8 * g + j) * swo + (k % 8) * swi
    return base, k >= 8, gok


@triton.jit
def load_tap_pair_weights(base, hi, gok, t0, t1, swh, sww, dt: tl.constexpr, TAPS: tl.constexpr):
    """B operand of a two-tap step, [G, 16, 8] in dtype ``dt`` (``base, hi, gok`` from ``tap_weights``):
    the weights of tap t0 for k < 8 and of tap t1 for k >= 8 (zero unless 0 <= t1 <= 8). TAPS 1 (see
    ``load_tap_pair``): loaded as [16, 8, G] and permuted, so that Triton 3.6 reads the operand back from
    shared memory without bank conflicts (as [G, 16, 8] it read 2-byte elements at 8-16x the
    conflict-free wavefronts)."""
    off0 = (t0 // 3) * swh + (t0 % 3) * sww
    off1 = (t1 // 3) * swh + (t1 % 3) * sww
    ok1 = (t1 >= 0) & (t1 < 9)
    ptr = base + tl.where(hi, off1, off0)
    ok = (ok1 | (hi == 0)) & gok
    if TAPS == 1:
        w = tl.load(tl.permute(ptr, (1, 2, 0)), mask=tl.permute(ok, (1, 2, 0)), other=0.0)
        return tl.permute(w, (2, 0, 1)).to(dt)
    else:
        return tl.load(ptr, mask=ok, other=0.0).to(dt)


@triton.jit
def gconv_tile(pix, r, c, pix_ok, gok, H, W, sh, sw, w_ptr, co0, swo, swi, swh, sww,
               G: tl.constexpr, BM: tl.constexpr, FLIP: tl.constexpr, PRECISION: tl.constexpr,
               TAPS: tl.constexpr):
    """The grouped 3x3 conv of one tile: [G, BM, 8] fp32, channel 8 g + j of row m.

    Row m's input window is centred on pixel (r[m], c[m]) (the output pixel times the stride);
    ``pix`` points there at the block's first channel; ``gok``: ``group_ok``. Five two-tap steps in a
    runtime loop. FLIP: the dgrad form (weights of tap 8 - t, transposed within the group)."""
    dt = pix.dtype.element_ty
    win = tap_window(pix, r, c, pix_ok, gok, G)
    wbase, whi, wok = tap_weights(w_ptr, co0, swo, swi, gok, G, FLIP)
    acc = tl.zeros((G, BM, 8), tl.float32)
    for s in range(5):
        t0 = 2 * s
        t1 = t0 + 1
        a = load_tap_pair(win, H, W, sh, sw, t0 // 3 - 1, t0 % 3 - 1, t1 // 3 - 1, t1 % 3 - 1,
                          t1 < 9, TAPS)
        if FLIP:
            b = load_tap_pair_weights(wbase, whi, wok, 8 - t0, 8 - t1, swh, sww, dt, TAPS)
        else:
            b = load_tap_pair_weights(wbase, whi, wok, t0, t1, swh, sww, dt, TAPS)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def conv_pair_weights(w_ptr, co0, swo, swi, swh, sww, gok, dt: tl.constexpr, G: tl.constexpr,
                      FLIP: tl.constexpr, TAPS: tl.constexpr):
    """The five B operands of ``gconv_tile`` (FLIP: the dgrad form), loaded once: a program that runs
    several tiles (the forward's TPP, the fused backward's share) keeps them across its tile loop instead
    of reloading and re-staging them per tile."""
    wbase, whi, wok = tap_weights(w_ptr, co0, swo, swi, gok, G, FLIP)
    if FLIP:
        b0 = load_tap_pair_weights(wbase, whi, wok, 8, 7, swh, sww, dt, TAPS)
        b1 = load_tap_pair_weights(wbase, whi, wok, 6, 5, swh, sww, dt, TAPS)
        b2 = load_tap_pair_weights(wbase, whi, wok, 4, 3, swh, sww, dt, TAPS)
        b3 = load_tap_pair_weights(wbase, whi, wok, 2, 1, swh, sww, dt, TAPS)
        b4 = load_tap_pair_weights(wbase, whi, wok, 0, -1, swh, sww, dt, TAPS)
    else:
        b0 = load_tap_pair_weights(wbase, whi, wok, 0, 1, swh, sww, dt, TAPS)
        b1 = load_tap_pair_weights(wbase, whi, wok, 2, 3, swh, sww, dt, TAPS)
        b2 = load_tap_pair_weights(wbase, whi, wok, 4, 5, swh, sww, dt, TAPS)
        b3 = load_tap_pair_weights(wbase, whi, wok, 6, 7, swh, sww, dt, TAPS)
        b4 = load_tap_pair_weights(wbase, whi, wok, 8, 9, swh, sww, dt, TAPS)
    return b0, b1, b2, b3, b4


@triton.jit
def tap_pair_step(acc, win, H, W, sh, sw, b, T0: tl.constexpr, PRECISION: tl.constexpr, TAPS: tl.constexpr):
    """acc += A @ b for taps (T0, T0 + 1) (``load_tap_pair``; b from ``conv_pair_weights``)."""
    T1: tl.constexpr = T0 + 1
    a = load_tap_pair(win, H, W, sh, sw, T0 // 3 - 1, T0 % 3 - 1, T1 // 3 - 1, T1 % 3 - 1, T1 < 9, TAPS)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def gconv_tile_preloaded(pix, r, c, pix_ok, gok, H, W, sh, sw, b0, b1, b2, b3, b4, G: tl.constexpr,
                         BM: tl.constexpr, PRECISION: tl.constexpr, TAPS: tl.constexpr):
    """``gconv_tile`` with its five B operands given (``conv_pair_weights``)."""
    win = tap_window(pix, r, c, pix_ok, gok, G)
    acc = tl.zeros((G, BM, 8), tl.float32)
    acc = tap_pair_step(acc, win, H, W, sh, sw, b0, 0, PRECISION, TAPS)
    acc = tap_pair_step(acc, win, H, W, sh, sw, b1, 2, PRECISION, TAPS)
    acc = tap_pair_step(acc, win, H, W, sh, sw, b2, 4, PRECISION, TAPS)
    acc = tap_pair_step(acc, win, H, W, sh, sw, b3, 6, PRECISION, TAPS)
    acc = tap_pair_step(acc, win, H, W, sh, sw, b4, 8, PRECISION, TAPS)
    return acc


@triton.jit
def store_group_tile(pix, acc, ok, gok, G: tl.constexpr):
    """Store a [G, BM, 8] tile (rounded to the destination dtype): row m's channel 8 g + j at
    pix[m] + 8 g + j, where row m is ``ok`` and group g ``gok``."""
    g = tl.arange(0, G)[:, None, None]
    j = tl.arange(0, 8)[None, None, :]
    tl.store(pix[None, :, None] + 8 * g + j, acc.to(pix.dtype.element_ty), mask=ok[None, :, None] & gok)


@triton.jit
def load_group_tile(pix, ok, gok, G: tl.constexpr, TAPS: tl.constexpr):
    """Load a [G, BM, 8] tile: row m's channel 8 g + j from pix[m] + 8 g + j (zero where row m is not
    ``ok`` or group g not ``gok``). TAPS 1 (``load_tap_pair``): loaded as [BM, G, 8] and permuted, which
    on Triton 3.6 takes wgrad's copy of the dy tile to shared memory from 1.4-1.5x the conflict-free
    wavefronts to 1.0x (on 3.8, where TAPS is 2, the permuted load would add them)."""
    g = tl.arange(0, G)[:, None, None]
    j = tl.arange(0, 8)[None, None, :]
    ptr = pix[None, :, None] + 8 * g + j
    mask = ok[None, :, None] & gok
    if TAPS == 1:
        return load_rows_first(ptr, mask)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def wgrad_pair_product(acc, win, H, W, sh, sw, dy, T0: tl.constexpr, PRECISION: tl.constexpr,
                       TAPS: tl.constexpr):
    """acc[G, 16, 8] += A^T @ dy for taps (T0, T0 + 1): one tile's share of the weight gradient of a tap
    pair. A: the [G, BM, 16] operand of ``load_tap_pair`` (window from ``tap_window``), dy: the tile's
    [G, BM, 8] output gradient (zero on masked rows). acc[g, k, j] += sum_m A[g, m, k] dy[g, m, j]: the
    gradient of w[8 g + j, k % 8, T0 + k // 8]."""
    T1: tl.constexpr = T0 + 1
    a = load_tap_pair(win, H, W, sh, sw, T0 // 3 - 1, T0 % 3 - 1, T1 // 3 - 1, T1 % 3 - 1, T1 < 9, TAPS)
    return tl.dot(tl.permute(a, (0, 2, 1)), dy, acc, input_precision=PRECISION)


@triton.jit
def store_wgrad_pair(ptr, acc, co0, gok, T0: tl.constexpr, G: tl.constexpr, ATOMIC: tl.constexpr,
                     FLIPPED: tl.constexpr):
    """Write a tap pair's [G, 16, 8] fp32 accumulator into a (C, 8, 3, 3)-shaped contiguous fp32 buffer
    (the tenth tap slot and the groups outside C are dropped): element [g, k, j] goes to
    w[co0 + 8 g + j, k % 8, T0 + k // 8]; FLIPPED (``backward_pair_step``'s accumulator of dy's window
    taps T0, T0 + 1) to w[co0 + 8 g + k % 8, j, 8 - T0 - k // 8]. ATOMIC: added with fp32 atomics instead
    of stored."""
    g = tl.arange(0, G)[:, None, None]
    k = tl.arange(0, 16)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    t = T0 + k // 8
    if FLIPPED:
        p = ptr + (co0 + 8 * g + k % 8) * 72 + j * 9 + (8 - t)
    else:
        p = ptr + (co0 + 8 * g + j) * 72 + (k % 8) * 9 + t
    if ATOMIC:
        tl.atomic_add(p, acc, mask=(t < 9) & gok, sem="relaxed")
    else:
        tl.store(p, acc, mask=(t < 9) & gok)


@triton.jit
def backward_pair_step(dx, acc, win, H, W, sh, sw, b, xc, T0: tl.constexpr, PRECISION: tl.constexpr,
                       TAPS: tl.constexpr):
    """The fused backward's step of taps (T0, T0 + 1) of dy's window: one load of the pair A ([G, BM, 16],
    ``load_tap_pair``) feeds dgrad, dx += A @ b (b: the flipped weights, ``conv_pair_weights``), and wgrad,
    acc[g, k, i] += sum_m A[g, m, k] xc[g, m, i] with xc the tile's own x ([G, BM, 8]): window tap
    t = T0 + k // 8 of dy, dy(q + d_t) = dy(q - d_{8-t}), against x's centre gives the gradient of
    w[8 g + k % 8, i, 8 - t] (module docstring; ``store_wgrad_pair``'s FLIPPED layout)."""
    T1: tl.constexpr = T0 + 1
    a = load_tap_pair(win, H, W, sh, sw, T0 // 3 - 1, T0 % 3 - 1, T1 // 3 - 1, T1 % 3 - 1, T1 < 9, TAPS)
    dx = tl.dot(a, b, dx, input_precision=PRECISION)
    acc = tl.dot(tl.permute(a, (0, 2, 1)), xc, acc, input_precision=PRECISION)
    return dx, acc


@triton.jit
def wgrad_tile_products(acc0, acc1, acc2, acc3, acc4, win, H, W, sh, sw, dy, PRECISION: tl.constexpr,
                        TAPS: tl.constexpr):
    """One tile's products for the five tap-pair accumulators (``wgrad_pair_product`` of taps 0-1, ...,
    8 and the empty tenth)."""
    acc0 = wgrad_pair_product(acc0, win, H, W, sh, sw, dy, 0, PRECISION, TAPS)
    acc1 = wgrad_pair_product(acc1, win, H, W, sh, sw, dy, 2, PRECISION, TAPS)
    acc2 = wgrad_pair_product(acc2, win, H, W, sh, sw, dy, 4, PRECISION, TAPS)
    acc3 = wgrad_pair_product(acc3, win, H, W, sh, sw, dy, 6, PRECISION, TAPS)
    acc4 = wgrad_pair_product(acc4, win, H, W, sh, sw, dy, 8, PRECISION, TAPS)
    return acc0, acc1, acc2, acc3, acc4


@triton.jit
def store_wgrad_partials(part_ptr, share, C, acc0, acc1, acc2, acc3, acc4, co0, gok, G: tl.constexpr,
                         ATOMIC: tl.constexpr, FLIPPED: tl.constexpr):
    """The five accumulators (FLIPPED: ``backward_pair_step``'s, ``store_wgrad_pair``) into the program's
    share of the (shares, C, 8, 3, 3) partials, or (ATOMIC) added to the one (C, 8, 3, 3) buffer."""
    if ATOMIC:
        out = part_ptr
    else:
        out = part_ptr + share.to(tl.int64) * C * 72
    store_wgrad_pair(out, acc0, co0, gok, 0, G, ATOMIC, FLIPPED)
    store_wgrad_pair(out, acc1, co0, gok, 2, G, ATOMIC, FLIPPED)
    store_wgrad_pair(out, acc2, co0, gok, 4, G, ATOMIC, FLIPPED)
    store_wgrad_pair(out, acc3, co0, gok, 6, G, ATOMIC, FLIPPED)
    store_wgrad_pair(out, acc4, co0, gok, 8, G, ATOMIC, FLIPPED)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _gconv_fwd_kernel(
    # pointers: input (N, H, W, C) through strides, weight (C, 8, 3, 3), output (N, HO, WO, C) contiguous,
    # (RESIDUAL) a contiguous (N, HO, WO, C) map added to the output; (MOMENTS) the shift (C,) fp32 and
    # the program rows' moments (rows, 2, C) fp32; (BIAS_SILU) the bias (C,); (POOL) the tiles' pools
    # (TILES, C) fp32
    x_ptr, w_ptr, y_ptr, res_ptr, shift_ptr, mom_ptr, bias_ptr, pool_ptr,
    # sizes: C8 = C / 8 groups (C in groups: the compiler then knows pixel rows are whole 16-byte vectors);
    # TILES tiles of TH x TW output pixels in the batch, TPP per program
    H, W, HO, WO, C8, TILES,
    # strides: x's pixel strides in units of 8 elements (unit channel stride), w's in elements
    sxn8, sxh8, sxw8, swo, swi, swh, sww,
    # meta-parameters
    STRIDE: tl.constexpr, FLIP: tl.constexpr, G: tl.constexpr, MASK_C: tl.constexpr, TH: tl.constexpr,
    TW: tl.constexpr, PRECISION: tl.constexpr, RESIDUAL: tl.constexpr, TAPS: tl.constexpr,
    TPP: tl.constexpr, MOMENTS: tl.constexpr, BIAS_SILU: tl.constexpr, POOL: tl.constexpr,
    SILU: tl.constexpr,
):
    """Forward (FLIP = False) and stride-1 dgrad (FLIP = True, x = dy, y = dx). RESIDUAL: y += res, in
    fp32 before the one rounding (a block's dx = dout + dgrad: the sum never makes its own pass).
    Program (i, channel block) runs tiles i TPP .. i TPP + TPP - 1, with the weights loaded once.
    MOMENTS (a BatchNorm after the conv, kernels/mbconv/moments.py): the sums of y - shift and of its
    square over the program's pixels, from y as stored (rounded), in fp32, to row i of ``mom_ptr``.
    BIAS_SILU (the folded MBConv's conv, kernels/mbconv/staged.py): y = SiLU(conv + bias) (SILU: the
    activation's inline-asm form, kernels/_activations.py); POOL: per tile t the sums of y over its pixels
    (fp32, before the rounding, as the hidden kernel pools) to row t of ``pool_ptr``."""
    BM: tl.constexpr = TH * TW
    # strides passed in units of 8 elements, so that the compiler knows every 8-channel group is one
    # aligned 16-byte vector (tl.multiple_of on a scalar argument is dropped by Triton 3.8)
    sxn, sxh, sxw = 8 * sxn8, 8 * sxh8, 8 * sxw8
    C = 8 * C8
    co0 = tl.program_id(1) * (8 * G)
    gok = group_ok(co0, C, G, MASK_C)
    KEEP_W: tl.constexpr = PRECISION != "tf32x3"  # fp32 operands (3xTF32): one load per step, per tile
    if KEEP_W:
        b0, b1, b2, b3, b4 = conv_pair_weights(w_ptr, co0, swo, swi, swh, sww, gok, x_ptr.dtype.element_ty,
                                               G, FLIP, TAPS)
    t_start = tl.program_id(0) * TPP
    t_end = tl.minimum(t_start + TPP, TILES)
    if MOMENTS or BIAS_SILU:
        cj = co0 + 8 * tl.arange(0, G)[:, None] + tl.arange(0, 8)[None, :]  # [G, 8] channels
        cj_ok = cj < C
    if BIAS_SILU:
        bias = tl.load(bias_ptr + cj, mask=cj_ok, other=0.0).to(tl.float32)
    if MOMENTS:
        shift = tl.load(shift_ptr + cj, mask=cj_ok, other=0.0)[:, None, :]
        s1 = tl.zeros((G, 8), tl.float32)
        s2 = tl.zeros((G, 8), tl.float32)
    for t in range(t_start, t_end):
        n, oh, ow, ok = tile_pixels(t, HO, WO, TH, TW)
        r = oh * STRIDE
        c = ow * STRIDE
        pix = x_ptr + n.to(tl.int64) * sxn + r * sxh + c * sxw + co0
        if KEEP_W:
            acc = gconv_tile_preloaded(pix, r, c, ok, gok, H, W, sxh, sxw, b0, b1, b2, b3, b4, G, BM,
                                       PRECISION, TAPS)
        else:
            acc = gconv_tile(pix, r, c, ok, gok, H, W, sxh, sxw, w_ptr, co0, swo, swi, swh, sww, G, BM,
                             FLIP, PRECISION, TAPS)
        pix_out = (n.to(tl.int64) * HO * WO + oh * WO + ow) * C + co0
        if RESIDUAL:
            acc += load_group_tile(res_ptr + pix_out, ok, gok, G, 0).to(tl.float32)
        if BIAS_SILU:
            acc = silu(acc + bias[:, None, :], SILU == 1)
        store_group_tile(y_ptr + pix_out, acc, ok, gok, G)
        if POOL:
            pooled = tl.sum(tl.where(ok[None, :, None], acc, 0.0), axis=1)
            tl.store(pool_ptr + tl.cast(t, tl.int64) * C + cj, pooled, mask=cj_ok)
        if MOMENTS:
            u = tl.where(ok[None, :, None], acc.to(y_ptr.dtype.element_ty).to(tl.float32) - shift, 0.0)
            s1 += tl.sum(u, axis=1)
            s2 += tl.sum(u * u, axis=1)
    if MOMENTS:
        row = mom_ptr + tl.program_id(0).to(tl.int64) * (2 * C) + cj
        tl.store(row, s1, mask=cj_ok)
        tl.store(row + C, s2, mask=cj_ok)


@triton.jit
def _dgrad_class(win, HO, WO, syh, syw, wbase, whi, wok, swh, sww, out, out_ok, gok,
                 T0: tl.constexpr, DH0: tl.constexpr, DW0: tl.constexpr,
                 T1: tl.constexpr, DH1: tl.constexpr, DW1: tl.constexpr,
                 T2: tl.constexpr, DH2: tl.constexpr, DW2: tl.constexpr,
                 T3: tl.constexpr, DH3: tl.constexpr, DW3: tl.constexpr,
                 G: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr, TAPS: tl.constexpr):
    """One parity class of the stride-2 dgrad: taps T0..T3 (-1: absent) of w, applied to the dy windows
    at offsets (DHi, DWi) from (a, b); one or two two-tap steps; stored at ``out`` where ``out_ok``."""
    dt = out.dtype.element_ty
    acc = tl.zeros((G, BM, 8), tl.float32)
    x = load_tap_pair(win, HO, WO, syh, syw, DH0, DW0, DH1, DW1, T1 >= 0, TAPS)
    acc = tl.dot(x, load_tap_pair_weights(wbase, whi, wok, T0, T1, swh, sww, dt, TAPS), acc,
                 input_precision=PRECISION)
    if T2 >= 0:
        x = load_tap_pair(win, HO, WO, syh, syw, DH2, DW2, DH3, DW3, T3 >= 0, TAPS)
        acc = tl.dot(x, load_tap_pair_weights(wbase, whi, wok, T2, T3, swh, sww, dt, TAPS), acc,
                     input_precision=PRECISION)
    store_group_tile(out, acc, out_ok, gok, G)


@triton.jit
def _gconv_dgrad_s2_kernel(
    # pointers: dy (N, HO, WO, C) through strides, weight (C, 8, 3, 3), dx (N, H, W, C) contiguous
    dy_ptr, w_ptr, dx_ptr,
    # sizes: H x W input map, HO = ceil(H / 2) x WO = ceil(W / 2) output map, C8 = C / 8 groups
    H, W, HO, WO, C8,
    # strides: dy's pixel strides in units of 8 elements (unit channel stride), w's in elements
    syn8, syh8, syw8, swo, swi, swh, sww,
    # meta-parameters
    G: tl.constexpr, MASK_C: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, PRECISION: tl.constexpr,
    TAPS: tl.constexpr,
):
    """Stride-2 dgrad as a gather: a tile of positions (a, b), each giving the input pixels
    (2a + py, 2b + px) of the four parity classes (module docstring)."""
    BM: tl.constexpr = TH * TW
    syn, syh, syw = 8 * syn8, 8 * syh8, 8 * syw8  # 16-byte vectors of 8 channels (see the forward)
    C = 8 * C8
    n, a, b, ok = tile_pixels(tl.program_id(0), HO, WO, TH, TW)
    co0 = tl.program_id(1) * (8 * G)
    pix = dy_ptr + n.to(tl.int64) * syn + a * syh + b * syw + co0
    gok = group_ok(co0, C, G, MASK_C)
    win = tap_window(pix, a, b, ok, gok, G)
    wbase, whi, wok = tap_weights(w_ptr, co0, swo, swi, gok, G, True)
    ih = 2 * a
    iw = 2 * b
    out = dx_ptr + (n.to(tl.int64) * H * W + ih * W + iw) * C + co0
    row1 = ok & (ih + 1 < H)
    col1 = iw + 1 < W
    # (py, px) = (0, 0): tap 4 (kh = kw = 1) from dy(a, b)
    _dgrad_class(win, HO, WO, syh, syw, wbase, whi, wok, swh, sww, out, ok, gok,
                 4, 0, 0, -1, 0, 0, -1, 0, 0, -1, 0, 0, G, BM, PRECISION, TAPS)
    # (0, 1): kw = 0 from column b + 1, kw = 2 from column b
    _dgrad_class(win, HO, WO, syh, syw, wbase, whi, wok, swh, sww, out + C, ok & col1, gok,
                 3, 0, 1, 5, 0, 0, -1, 0, 0, -1, 0, 0, G, BM, PRECISION, TAPS)
    # (1, 0): kh = 0 from row a + 1, kh = 2 from row a
    _dgrad_class(win, HO, WO, syh, syw, wbase, whi, wok, swh, sww, out + W * C, row1, gok,
                 1, 1, 0, 7, 0, 0, -1, 0, 0, -1, 0, 0, G, BM, PRECISION, TAPS)
    # (1, 1): the four corner taps
    _dgrad_class(win, HO, WO, syh, syw, wbase, whi, wok, swh, sww, out + (W + 1) * C,
                 row1 & col1, gok, 0, 1, 1, 2, 1, 0, 6, 0, 1, 8, 0, 0, G, BM, PRECISION, TAPS)


@triton.jit
def _gconv_wgrad_kernel(
    # pointers: x (N, H, W, C) and dy (N, HO, WO, C) through strides; fp32 partials (shares, C, 8, 3, 3)
    # contiguous, or (ATOMIC) one zeroed fp32 (C, 8, 3, 3) buffer
    x_ptr, dy_ptr, part_ptr,
    # sizes: C8 = C / 8 groups; TILES tiles of TH x TW output pixels in the batch, TILES_PER_SHARE per
    # program
    H, W, HO, WO, C8, TILES, TILES_PER_SHARE,
    # strides of x and dy in units of 8 elements (unit channel stride)
    sxn8, sxh8, sxw8, syn8, syh8, syw8,
    # meta-parameters
    STRIDE: tl.constexpr, G: tl.constexpr, MASK_C: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC: tl.constexpr, TAPS: tl.constexpr,
):
    """Weight-gradient partials: program (share, channel block) sums its share of tiles in tile order."""
    sxn, sxh, sxw = 8 * sxn8, 8 * sxh8, 8 * sxw8  # 16-byte vectors of 8 channels (see the forward)
    syn, syh, syw = 8 * syn8, 8 * syh8, 8 * syw8
    C = 8 * C8
    share = tl.program_id(0)
    co0 = tl.program_id(1) * (8 * G)
    gok = group_ok(co0, C, G, MASK_C)
    acc0 = tl.zeros((G, 16, 8), tl.float32)
    acc1 = tl.zeros((G, 16, 8), tl.float32)
    acc2 = tl.zeros((G, 16, 8), tl.float32)
    acc3 = tl.zeros((G, 16, 8), tl.float32)
    acc4 = tl.zeros((G, 16, 8), tl.float32)
    t_start = share * TILES_PER_SHARE
    t_end = tl.minimum(t_start + TILES_PER_SHARE, TILES)
    for t in range(t_start, t_end):
        n, oh, ow, ok = tile_pixels(t, HO, WO, TH, TW)
        dy = load_group_tile(dy_ptr + n.to(tl.int64) * syn + oh * syh + ow * syw + co0, ok, gok, G, TAPS)
        r = oh * STRIDE
        c = ow * STRIDE
        pix = x_ptr + n.to(tl.int64) * sxn + r * sxh + c * sxw + co0
        win = tap_window(pix, r, c, ok, gok, G)
        acc0, acc1, acc2, acc3, acc4 = wgrad_tile_products(acc0, acc1, acc2, acc3, acc4, win, H, W, sxh, sxw,
                                                           dy, PRECISION, TAPS)
    store_wgrad_partials(part_ptr, share, C, acc0, acc1, acc2, acc3, acc4, co0, gok, G, ATOMIC, False)


@triton.jit
def _wgrad_reduce_kernel(part_ptr, dw_ptr, dw2_ptr, SHARES, TOTAL, SPLIT, SB: tl.constexpr,
                         BLOCK: tl.constexpr, TWO: tl.constexpr):
    """dw[i] = sum over the shares s of partial[s, i] (fp32), stored in dw's dtype (TWO: elements from
    SPLIT on to dw2[i - SPLIT], two results of their own from one launch). SB shares at a time: one
    [SB, BLOCK] tile of independent loads (many in flight: a loop over single shares would wait for one
    load per share), summed over the shares by tl.sum (a fixed tree), then added to the running sum in
    share-block order. Rows past SHARES read as 0.0, which adds exactly."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < TOTAL
    rows = tl.arange(0, SB)
    acc = tl.zeros((BLOCK,), tl.float32)
    p = part_ptr + rows[:, None].to(tl.int64) * TOTAL + offs[None, :]
    for s0 in range(0, SHARES, SB):
        tile = tl.load(p, mask=(s0 + rows < SHARES)[:, None] & ok[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
        p += SB * TOTAL  # 64-bit pointer arithmetic: no int32 overflow of s x TOTAL
    if TWO:
        tl.store(dw_ptr + offs, acc.to(dw_ptr.dtype.element_ty), mask=ok & (offs < SPLIT))
        tl.store(dw2_ptr + (offs - SPLIT), acc.to(dw2_ptr.dtype.element_ty), mask=ok & (offs >= SPLIT))
    else:
        tl.store(dw_ptr + offs, acc.to(dw_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gconv_backward_kernel(
    # pointers: dy (N, H, W, C) and x (N, H, W, C) through strides, weight (C, 8, 3, 3), dx and (RESIDUAL)
    # res (N, H, W, C) contiguous; fp32 partials (shares, C, 8, 3, 3) contiguous, or (ATOMIC) one zeroed
    # fp32 (C, 8, 3, 3)
    dy_ptr, x_ptr, w_ptr, dx_ptr, res_ptr, part_ptr,
    # sizes: C8 = C / 8 groups; TILES tiles of TH x TW pixels in the batch, TILES_PER_SHARE per program
    H, W, C8, TILES, TILES_PER_SHARE,
    # strides: dy's and x's pixel strides in units of 8 elements (unit channel stride), w's in elements
    syn8, syh8, syw8, sxn8, sxh8, sxw8, swo, swi, swh, sww,
    # meta-parameters
    G: tl.constexpr, MASK_C: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, PRECISION: tl.constexpr,
    ATOMIC: tl.constexpr, TAPS: tl.constexpr, RESIDUAL: tl.constexpr,
):
    """Stride-1 dgrad and wgrad from one read of dy's windows: program (share, channel block) runs its
    share of tiles in tile order; per tile, each tap pair of dy's window is loaded once and feeds both
    dx (the flipped conv, the forward kernel's FLIP) and the wgrad accumulators against the tile's own
    x (``backward_pair_step``: x's nine windows are never loaded, only its centre tile); dx (+ RESIDUAL:
    res's tile, added in fp32 before the rounding, as the stride-1 dgrad's) is stored per tile, the
    partials once per program, as the wgrad kernel's (its reduction merges them)."""
    BM: tl.constexpr = TH * TW
    syn, syh, syw = 8 * syn8, 8 * syh8, 8 * syw8  # 16-byte vectors of 8 channels (see the forward)
    sxn, sxh, sxw = 8 * sxn8, 8 * sxh8, 8 * sxw8
    C = 8 * C8
    share = tl.program_id(0)
    co0 = tl.program_id(1) * (8 * G)
    gok = group_ok(co0, C, G, MASK_C)
    dt = dy_ptr.dtype.element_ty
    acc0 = tl.zeros((G, 16, 8), tl.float32)
    acc1 = tl.zeros((G, 16, 8), tl.float32)
    acc2 = tl.zeros((G, 16, 8), tl.float32)
    acc3 = tl.zeros((G, 16, 8), tl.float32)
    acc4 = tl.zeros((G, 16, 8), tl.float32)
    # dgrad's weights loaded once for the share, not once per tile (a tile's five weight loads were a
    # third of its exposed load waits at Small's 1024-channel 16x16 map). Not with fp32 operands (3xTF32)
    # nor G = 2 (two warps, 8 x 16 tiles): kept, they spilled 8-24 B
    KEEP_W: tl.constexpr = (PRECISION != "tf32x3") and (G >= 4)
    if KEEP_W:
        b0, b1, b2, b3, b4 = conv_pair_weights(w_ptr, co0, swo, swi, swh, sww, gok, dt, G, True, TAPS)
    else:  # each step loads its pair's weights (``gconv_tile``'s FLIP form)
        wbase, whi, wok = tap_weights(w_ptr, co0, swo, swi, gok, G, True)
    t_start = share * TILES_PER_SHARE
    t_end = tl.minimum(t_start + TILES_PER_SHARE, TILES)
    for t in range(t_start, t_end):
        n, oh, ow, ok = tile_pixels(t, H, W, TH, TW)
        pix_dy = dy_ptr + n.to(tl.int64) * syn + oh * syh + ow * syw + co0
        win = tap_window(pix_dy, oh, ow, ok, gok, G)
        xc = load_group_tile(x_ptr + n.to(tl.int64) * sxn + oh * sxh + ow * sxw + co0, ok, gok, G, TAPS)
        dx = tl.zeros((G, BM, 8), tl.float32)
        if not KEEP_W:
            b0 = load_tap_pair_weights(wbase, whi, wok, 8, 7, swh, sww, dt, TAPS)
        dx, acc0 = backward_pair_step(dx, acc0, win, H, W, syh, syw, b0, xc, 0, PRECISION, TAPS)
        if not KEEP_W:
            b1 = load_tap_pair_weights(wbase, whi, wok, 6, 5, swh, sww, dt, TAPS)
        dx, acc1 = backward_pair_step(dx, acc1, win, H, W, syh, syw, b1, xc, 2, PRECISION, TAPS)
        if not KEEP_W:
            b2 = load_tap_pair_weights(wbase, whi, wok, 4, 3, swh, sww, dt, TAPS)
        dx, acc2 = backward_pair_step(dx, acc2, win, H, W, syh, syw, b2, xc, 4, PRECISION, TAPS)
        if not KEEP_W:
            b3 = load_tap_pair_weights(wbase, whi, wok, 2, 1, swh, sww, dt, TAPS)
        dx, acc3 = backward_pair_step(dx, acc3, win, H, W, syh, syw, b3, xc, 6, PRECISION, TAPS)
        if not KEEP_W:
            b4 = load_tap_pair_weights(wbase, whi, wok, 0, -1, swh, sww, dt, TAPS)
        dx, acc4 = backward_pair_step(dx, acc4, win, H, W, syh, syw, b4, xc, 8, PRECISION, TAPS)
        out = (n.to(tl.int64) * H * W + oh * W + ow) * C + co0
        if RESIDUAL:
            dx += load_group_tile(res_ptr + out, ok, gok, G, TAPS).to(tl.float32)
        store_group_tile(dx_ptr + out, dx, ok, gok, G)
    store_wgrad_partials(part_ptr, share, C, acc0, acc1, acc2, acc3, acc4, co0, gok, G, ATOMIC, True)
