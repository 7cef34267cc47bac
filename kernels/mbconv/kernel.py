"""Triton kernels of the MBConv + Squeeze-Excite block (paper Section 5.4, Fig. 11), NHWC, folded BN.
reference.py is the specification; launcher.py picks the tiles, checks the inputs and launches.

    h = SiLU(W_exp x + b_exp)                      R = 4C hidden channels
    g = SiLU(gconv3x3(h) + b_conv)                 group width 8, zero padding 1
    g = BlurPool(g)                                stride 2 only (reflect pad 1, [1,2,1]^2/16)
    gate = sigmoid(W_se2 ReLU(W_se1 mean_hw(g) + b_se1) + b_se2)        (N, R)
    out = W_proj (g * gate) + b_proj (+ x)         residual for stride 1

Design: g is computed once, stored once and read once by a gated GEMM
--------------------------------------------------------------------
Every output pixel needs the SE gate, and the gate needs the mean of ``g`` over the whole image;
recomputing expand + conv after the pool would cost 56 % more tensor work at C = 256, so ``g`` is
written once in the input dtype (``gbuf``, (N, H'W', R)) and read back once. Two launches per block:

1. ``_mbconv_hidden_kernel`` (persistent: one program per SM walks its work items). A work item is
   (a block of IB images, a group of CG hidden chunks of RB channels). Per chunk the program loads
   the chunk's weights once, then expand (wgmma) + bias + SiLU -> ``h`` in a per-program scratch slot
   (zero-padded borders: the conv's zero padding), barrier, and per image the grouped conv from the
   slot in tiles of BM pixels (nine taps as five two-tap K = 16 steps of a batched [G CS, BM / CS, 16]
   x [G CS, 16, 8] ``tl.dot``: mma.sync, 10/9 of the useful conv MACs; each of the G groups' tiles is
   split in CS pixel sub-tiles so that every warp gets a batch entry of its own: with fewer entries
   than warps, Triton had each warp repeat another's mma.sync; AHEAD: each step's tap pair loaded from
   the slot one dot ahead, two loads in flight while a dot runs) + bias + SiLU; stride 1: ``g`` to
   ``gbuf`` and the pool in registers; stride 2: ``g`` to a second slot, barrier, BlurPool from it
   (``_blur``: reflect padding folded into the indices), the blurred ``g`` to ``gbuf``. Per (image,
   chunk) the first SE layer's share ``zpart[n, chunk] = W_se1[:, chunk] @ mean[n, chunk]``
   (``_se_partial``: fp32, (N, chunks, S)). No atomics.

   RESIDENT (maps of at most 256 pixels, where the tile fits in shared memory: Small's 16x16 and 8x8
   on sm_90): the item's IB images (XM = 256 rows, HWP = H W rounded up to a power of two rows per
   image) are one x tile, loaded before the chunk loop (``_x_rows``); it is loop-invariant there, so
   the compiler keeps it in shared memory and x is read from L2 once per item, not once per chunk
   (``tests/kernels/test_mbconv.py`` checks in the TTGIR that the tile's copy to shared memory comes
   before the chunk loop and that the loop loads no tile of its shape). Each chunk's expand is one
   [XM, CP] x [CP, RB] wgmma over all the item's pixels. Otherwise (larger maps, fp32, sm_80) the
   expand runs per image of the item in tiles of EM pixels (64 per warpgroup: a wgmma tile on sm_90;
   64-256 on sm_80, as the launcher's ``sm80_tiling`` picks), x read once per chunk.

2. ``_mbconv_project_kernel`` (grid: tiles of BM rows x output-channel blocks; BM = 128 on sm_90):
   the rows are one image's pixels (maps of more than BM / 2 pixels) or two whole images.
   ``acc = bias (+ x)``, then over R in steps of BR = 64: the step's gates,
   ``sigmoid(W_se2[step] z + b_se2[step])`` with ``z = ReLU(sum_chunk zpart + b_se1)`` of the tile's
   images (chunk partials summed in a fixed order, once per program), and
   ``acc += (gbuf tile * gate) @ W_proj[:, step]^T`` (wgmma, A gated in registers); stored once.
   W_se2 is read once per program, with the step's W_proj rows.

   GATE (launcher.py: items that hold every chunk of their images, Small's 16x16 stride 1 at batch
   128): after its work items the hidden kernel computes its images' gates itself (``_se_gates``, after
   a barrier: the SE partials it reads back were stored by other threads), once per image instead of
   once per projection tile, into ``gate_ptr`` (N, R) in x's dtype; the projection then reads one gate
   vector per R step and neither W_se2 nor the partials. ``_se_gates`` is compiled as a function of its
   own (``noinline``): inlined, its code took registers that the chunk loop then spilled (the barrier
   check follows the call, convfirstnet.analysis.ordering).

Every reduction runs in a fixed order, so the output is bit-reproducible.

Scratch
-------
Per program, in x's dtype: ``h`` as [image][H + 2 padded rows][G groups][W + 2 padded columns][8],
so the three taps of a row are contiguous 16-byte vectors and a warp's tap load covers consecutive
pixels of one group; the borders are zeroed by each launch before the first item and never written
again. Stride 2 adds the full-resolution ``g`` of one image as [H W pixels][RB channels]. The launcher
picks RB so that the slot stays in the L1 that the program's shared memory leaves at the smallest
carve-out (the cost model checks the declared working set against it); Triton's loader configures the
largest carve-out, 28 KB of L1, unless ``CONVFIRSTNET_L1_CARVEOUT=fit`` (kernels/_carveout.py).

Scratch ordering: stores, then ``tl.debug_barrier()`` (bar.sync), then loads by other threads of the
same program. That is safe because the scratch loads are plain ``ld.global`` (L1-allocating ``LDG``):
the kernel runs with ``num_stages=1``, so Triton's pipeliner does not turn them into ``cp.async`` issued
ahead of the barrier (a test checks the compiled PTX). Each round trip has its own argument
(``scr_ptr``: the ``h`` slots, ``gscr_ptr``: the stride-2 ``g`` slots, ``ms_ptr``), so that the compile
check (``convfirstnet.analysis.ordering``, tests/kernels/test_ordering.py) follows each one's stores and
loads through the control flow of the PTX and requires a ``bar.sync`` between. The projection has no
scratch; its pipelined loads (g, W_proj, W_se2) are ``cp.async`` copies (L2 only, counted so).

Tiling of the conv: TH x TW image rows x columns, TW = the map width rounded up to a power of two
(8 ... 64), TH = 64 / TW. When the tiles cover the map exactly (32x32, 16x16, 8x8: ``EXACT``) the
width is a constexpr: pixel addresses are linear and every tap is a constant offset in the slot.
Other sizes (any map >= 1x1) take clamped addresses for loads and masks on stores and on the pool.

Numerics: all dots accumulate in fp32; ``h``, ``g`` and the gated ``g`` are rounded to the input
dtype before they feed a tensor-core dot; the pool, the SE MLP and the blur run in fp32; the gate is
rounded to the input dtype before it scales ``g``. fp32 inputs use ``input_precision="tf32x3"``
(~fp32 accuracy). SiLU and the SE sigmoid are kernels/_activations.py's (1 / (1 + 2^(-x log2 e)); for
fp16/bf16 on the GPU through ``ex2.approx``/``rcp.approx``, ~2e-6 relative error over [-16, 16]; fp32
data and the interpreter, which cannot run inline asm, through ``tl.exp2`` and a division).

Predicted (``convfirstnet kernels``, Small, batch 128, fp16, sm_90, high end): see launcher.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._activations import sigmoid, silu


@triton.jit
def _silu(acc, half_bias, MODE: tl.constexpr):
    """SiLU(acc + 2 * half_bias) in fp32 (kernels/_activations.py; MODE 1: its inline-asm form)."""
    return silu(acc + 2.0 * half_bias, MODE == 1)


@triton.jit
def _sigmoid(e, MODE: tl.constexpr):
    """sigmoid(e) in fp32 (kernels/_activations.py; MODE 1: its inline-asm form)."""
    return sigmoid(e, MODE == 1)


@triton.jit
def _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, J: tl.constexpr, G: tl.constexpr,
                 CS: tl.constexpr):
    """Weights of taps 2J and 2J + 1 as the [G CS, 16, 8] operand (the tenth tap's are zero): batch
    entry b holds group b // CS (each group's weights CS times, for its CS pixel sub-tiles)."""
    g = (tl.arange(0, G * CS) // CS)[:, None, None]
    k = tl.arange(0, 16)[None, :, None]
    co = tl.arange(0, 8)[None, None, :]
    tap = 2 * J + k // 8
    r = r0 + g * 8 + co
    return tl.load(wconv_ptr + r * swc_r + (k % 8) * swc_i + (tap // 3) * swc_y + (tap % 3) * swc_x,
                   mask=(tap < 9) & (r < R), other=0.0)


@triton.jit
def _conv_pair_h(hs, q, PW, J: tl.constexpr, G: tl.constexpr, CS: tl.constexpr, TAPS: tl.constexpr):
    """Taps 2J and 2J + 1 (the tenth tap re-reads tap 8; its weights are zero) as the [G CS, BM / CS, 16]
    operand: batch entry b is group b // CS at the padded positions q[b] (its pixel sub-tile), k < 8
    input channels of tap 2J, k >= 8 of tap 2J + 1. Scratch layout [padded row][group][padded column][8].

    TAPS: the index order of the load, which decides the register layout Triton gives the tile and so
    the bank conflicts of its copy to shared memory for the batched mma.sync (launcher.tap_order(): the
    ``conflict_free_tap_order()`` per Triton version, checked on the compiled PTX, and measured 20 %
    faster on an H200 than 0 with Triton 3.6, unless launcher.TAP_ORDER forces one). 0: [G CS, BM / CS, 16]
    as is (Triton 3.6 and 3.8: 4x the conflict-free store wavefronts, and on 3.8 6x on the ldmatrix
    loads: 672 / 112); 1: loaded as [BM / CS, G CS, 16] and permuted (conflict-free on 3.6; 3.8 adds 6 barriers
    per pair); 2: loaded as [G CS x BM / CS, 16] rows and reshaped (conflict-free on 3.8; 3.6 drops to
    2-byte loads)."""
    GS: tl.constexpr = G * CS
    k = tl.arange(0, 16)
    tap = tl.minimum(2 * J + k // 8, 8)
    off = (tap // 3 - 1) * (G * PW * 8) + (tap % 3 - 1) * 8 + k % 8  # [16]
    gq = (tl.arange(0, GS) // CS)[:, None] * (PW * 8) + q  # [GS, MS]: each entry's pixel in its group
    if TAPS == 1:
        t = tl.load(hs + tl.trans(gq)[:, :, None] + off[None, None, :])
        return tl.permute(t, (1, 0, 2))
    elif TAPS == 2:
        MS: tl.constexpr = q.shape[1]
        t = tl.load(hs + tl.reshape(gq, (GS * MS,))[:, None] + off[None, :])
        return tl.reshape(t, (GS, MS, 16))
    else:  # its own sum, gq unused: from gq[:, :, None] it compiled slower (Small 13.49 -> 13.70 ms high)
        g = (tl.arange(0, GS) // CS)[:, None, None]
        return tl.load(hs + g * (PW * 8) + q[:, :, None] + off[None, None, :])


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


@triton.jit
def _x_rows(x_ptr, row0, n0, nimg, N, H, W, rc, c_ok, sxn, sxc, sxh, sxw,
            ROWS: tl.constexpr, HWP: tl.constexpr, MASK_C: tl.constexpr, EXACT: tl.constexpr):
    """Rows row0 ... row0 + ROWS - 1 of a RESIDENT item's x tile, [ROWS, CP] (image (row // HWP) of the
    item, pixel row % HWP; rows past H W or past the item's images are zero)."""
    mx = row0 + tl.arange(0, ROWS)
    xi = mx // HWP
    xpix = mx % HWP
    xy = tl.minimum(xpix // W, H - 1)  # rows past H W: clamped copies (masked on store)
    xx = xpix % W
    ok = (xpix < H * W) & (xi < nimg)
    xn = tl.minimum(n0 + xi, N - 1).to(tl.int64)
    if EXACT:
        xp = (x_ptr + xn * sxn + xpix * sxw)[:, None] + rc[None, :] * sxc
    else:
        xp = (x_ptr + xn * sxn + xy * sxh + xx * sxw)[:, None] + rc[None, :] * sxc
    if MASK_C:
        return tl.load(xp, mask=ok[:, None] & c_ok[None, :], other=0.0)
    else:
        return tl.load(xp, mask=ok[:, None], other=0.0)


@triton.jit
def _x_slot(nimg, H, W, IB, IMG, ROWE, ROWS: tl.constexpr, HWP: tl.constexpr):
    """The padded position in the h slot of each row of a RESIDENT item's x tile (the image clamped
    into the program's IB slots), and whether the row is real (see ``_x_rows``)."""
    mx = tl.arange(0, ROWS)
    xi = mx // HWP
    xpix = mx % HWP
    xy = tl.minimum(xpix // W, H - 1)
    return tl.minimum(xi, IB - 1) * IMG + (xy + 1) * ROWE + (xpix % W + 1) * 8, (xpix < H * W) & (xi < nimg)


# IB and CG are not specialized (the value 1 would otherwise compile a variant of its own)
@triton.jit(do_not_specialize=["IB", "CG"])
def _mbconv_hidden_kernel(
    x_ptr, wexp_ptr, bexp_ptr, wconv_ptr, bconv_ptr, w1_ptr, g_ptr, z_ptr, scr_ptr, gscr_ptr, ms_ptr,
    N, H, W_RT, OH, OW, C, R, S, NCHUNK, NGROUP, CG, ITEMS, IB, SLOT,
    sxn, sxc, sxh, sxw, swe_r, swe_c, swc_r, swc_i, swc_y, swc_x, sw1_s, sw1_r,
    b1_ptr, w2_ptr, b2_ptr, gate_ptr, sw2_r, sw2_s,  # GATE only
    STRIDE: tl.constexpr, RB: tl.constexpr, CP: tl.constexpr, SP: tl.constexpr,
    MASK_C: tl.constexpr, MASK_R: tl.constexpr,
    TW: tl.constexpr, BM: tl.constexpr, EM: tl.constexpr, TWO: tl.constexpr, BMO: tl.constexpr,
    EXACT: tl.constexpr, RESIDENT: tl.constexpr, XM: tl.constexpr, HWP: tl.constexpr,
    ZB: tl.constexpr, SILU: tl.constexpr, PREC: tl.constexpr, CS: tl.constexpr, SEB: tl.constexpr,
    NS: tl.constexpr, GATE: tl.constexpr, GB: tl.constexpr, NCP: tl.constexpr,
    ONE: tl.constexpr, AHEAD: tl.constexpr, TAPS: tl.constexpr,
):
    G: tl.constexpr = RB // 8
    GS: tl.constexpr = G * CS  # conv batch: each group's pixel tile split in CS sub-tiles
    MS: tl.constexpr = BM // CS
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
    inv_ohw = 1.0 / OHW  # the pool's divisor, once
    ROWE = G * PW * 8  # elements of one padded row of the h slot
    IMG = RB * PHW  # elements of one image's h slot
    if RESIDENT:
        IBS = IB  # images in the h slot
    else:
        IBS = 1
    hs = scr_ptr + pid.to(tl.int64) * SLOT
    gs = gscr_ptr + pid.to(tl.int64) * SLOT  # the slot past h (its own argument: a separate round trip)
    ms = ms_ptr + pid * (NS * RB)  # the program's mean slot: NS rows of RB (launcher: mean_slot)

    # Zero the border of each image's h slot (the conv's zero padding: 2 padded rows + 2 columns of
    # each row = 2 (W + 2) RB + 2 H RB elements) once; tiles write only the interior. The border is
    # runs of 8 channels (one 16-byte vector), so the fill takes ZB / 8 vectors per step: the index
    # arithmetic is paid once per vector, not per element.
    ZV: tl.constexpr = ZB // 8
    zv = tl.arange(0, ZV)
    z8 = tl.arange(0, 8)[None, :]
    BV = 2 * G * PW + 2 * H * G  # vectors of one image's border
    for z0 in range(0, IBS * BV, ZV):
        v = z0 + zv
        img = v // BV
        v1 = v % BV
        v2 = v1 - 2 * G * PW
        side = (1 + v2 // (2 * G)) * ROWE + ((v2 // 2) % G) * (PW * 8) + (v2 % 2) * ((PW - 1) * 8)
        off = tl.where(v1 < 2 * G * PW, (v1 // (G * PW)) * ((H + 1) * ROWE) + (v1 % (G * PW)) * 8, side)
        vp = hs + tl.multiple_of(img * IMG + off, 8)[:, None] + z8  # whole 16-byte vectors
        tl.store(vp, tl.zeros([ZV, 8], dtype), mask=(v < IBS * BV)[:, None])

    rr = tl.arange(0, RB)
    rc = tl.arange(0, CP)
    c_ok = rc < C
    bs = tl.arange(0, GS)
    m = ((bs % CS) * MS)[:, None] + tl.arange(0, MS)[None, :]  # [GS, MS]: pixel of the tile
    me = tl.arange(0, EM)
    THE: tl.constexpr = EM // TW
    g3 = (bs // CS)[:, None, None]
    c3 = tl.arange(0, 8)[None, None, :]
    ncol = tl.cdiv(W, TW)
    ntile = tl.cdiv(H, TH) * ncol
    ntile_e = tl.cdiv(H, THE) * ncol
    ncol_o = tl.cdiv(OW, TWO)
    ntile_o = tl.cdiv(OH, THO) * ncol_o
    mo = tl.arange(0, BMO)
    hcol = ((rr // 8) * (PW * 8) + rr % 8)[None, :]  # channel offsets in the h slot
    # ONE (the launcher: a program per item): the item "loop" has one trip the compiler can see, so
    # neither its counter nor the program count stay live across the chunk loop
    if ONE:
        item_end = pid + 1
        item_step = 1
    else:
        item_end = ITEMS
        item_step = nprog
    for item in range(pid, item_end, item_step):
        q = item % NGROUP
        n0 = (item // NGROUP) * IB
        nimg = tl.minimum(IB, N - n0)
        ch0 = q * CG
        if RESIDENT:
            # the item's images as one [XM, CP] x tile, read once for all its chunks: loop-invariant in
            # the chunk loop, so the compiler keeps it in shared memory (a test checks the SASS)
            xt = _x_rows(x_ptr, 0, n0, nimg, N, H, W, rc, c_ok, sxn, sxc, sxh, sxw, XM, HWP, MASK_C, EXACT)
        for ch in range(ch0, tl.minimum(ch0 + CG, NCHUNK)):
            r0 = ch * RB
            r_ok = (r0 + rr) < R
            r3 = r0 + g3 * 8 + c3
            # the chunk's weights, loaded once for the item's images
            if MASK_C or MASK_R:
                we = tl.load(wexp_ptr + (r0 + rr)[None, :] * swe_r + rc[:, None] * swe_c,
                             mask=c_ok[:, None] & r_ok[None, :], other=0.0)
            else:
                we = tl.load(wexp_ptr + (r0 + rr)[None, :] * swe_r + rc[:, None] * swe_c)
            hb_e = 0.5 * tl.load(bexp_ptr + r0 + rr, mask=r_ok, other=0.0).to(tl.float32)[None, :]
            hb_c = 0.5 * tl.load(bconv_ptr + r3, mask=r3 < R, other=0.0).to(tl.float32)
            w0 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 0, G, CS)
            w1 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 1, G, CS)
            w2 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 2, G, CS)
            w3 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 3, G, CS)
            w4 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 4, G, CS)
            if RESIDENT:
                # ---- expand of all the item's pixels: h = SiLU(x W_exp^T + b) into the padded slot
                tl.debug_barrier()  # the previous chunk's reads of the slot are done
                hv = _silu(tl.dot(xt, we, input_precision=PREC), hb_e, SILU).to(dtype)
                # the rows' slot positions, computed here rather than kept from the x tile's load (in
                # that layout they held registers across the chunk loop)
                qx, x_ok = _x_slot(nimg, H, W, IB, IMG, ROWE, XM, HWP)
                tl.store(hs + qx[:, None] + hcol, hv, mask=x_ok[:, None])
                tl.debug_barrier()
            for i in range(0, nimg):
                n = n0 + i
                tl.debug_barrier()  # the previous image's scratch reads (g slot, means) are done
                if RESIDENT:
                    hi = hs + i * IMG
                else:
                    hi = hs
                    x_img = x_ptr + tl.cast(n, tl.int64) * sxn
                    # ---- expand, one EM-pixel tile at a time, into the padded slot
                    for t in tl.range(0, ntile_e, num_stages=1):
                        y, xx_, yc, xc, ok = _tile(t, ncol, H, W, me, TW, THE, EXACT)
                        if EXACT:
                            xp1 = (x_img + (t * EM + me) * sxw)[:, None] + rc[None, :] * sxc
                        else:
                            xp1 = (x_img + yc * sxh + xc * sxw)[:, None] + rc[None, :] * sxc
                        if MASK_C:
                            xt1 = tl.load(xp1, mask=c_ok[None, :], other=0.0)
                        else:
                            xt1 = tl.load(xp1)
                        hv1 = _silu(tl.dot(xt1, we, input_precision=PREC), hb_e, SILU).to(dtype)
                        hp = hs + ((y + 1) * ROWE + (xx_ + 1) * 8)[:, None] + hcol
                        if EXACT:
                            tl.store(hp, hv1)
                        else:
                            tl.store(hp, hv1, mask=ok[:, None])
                    tl.debug_barrier()
                # ---- grouped conv (+ SiLU), 64-pixel tiles
                if STRIDE == 1:
                    pool = tl.zeros((GS, MS, 8), dtype=tl.float32)
                for t in tl.range(0, ntile, num_stages=1):
                    y, xx_, yc, xc, ok = _tile(t, ncol, H, W, m, TW, TH, EXACT)
                    qp = (yc + 1) * ROWE + (xc + 1) * 8
                    if AHEAD:  # each tap pair loaded one dot ahead of its use (the launcher's choice)
                        a0 = _conv_pair_h(hi, qp, PW, 0, G, CS, TAPS)
                        a1 = _conv_pair_h(hi, qp, PW, 1, G, CS, TAPS)
                        acc = tl.dot(a0, w0, input_precision=PREC)
                        a2 = _conv_pair_h(hi, qp, PW, 2, G, CS, TAPS)
                        acc = tl.dot(a1, w1, acc, input_precision=PREC)
                        a3 = _conv_pair_h(hi, qp, PW, 3, G, CS, TAPS)
                        acc = tl.dot(a2, w2, acc, input_precision=PREC)
                        a4 = _conv_pair_h(hi, qp, PW, 4, G, CS, TAPS)
                        acc = tl.dot(a3, w3, acc, input_precision=PREC)
                        acc = tl.dot(a4, w4, acc, input_precision=PREC)
                    else:
                        acc = tl.dot(_conv_pair_h(hi, qp, PW, 0, G, CS, TAPS), w0, input_precision=PREC)
                        acc = tl.dot(_conv_pair_h(hi, qp, PW, 1, G, CS, TAPS), w1, acc, input_precision=PREC)
                        acc = tl.dot(_conv_pair_h(hi, qp, PW, 2, G, CS, TAPS), w2, acc, input_precision=PREC)
                        acc = tl.dot(_conv_pair_h(hi, qp, PW, 3, G, CS, TAPS), w3, acc, input_precision=PREC)
                        acc = tl.dot(_conv_pair_h(hi, qp, PW, 4, G, CS, TAPS), w4, acc, input_precision=PREC)
                    v = _silu(acc, hb_c, SILU)
                    pix = (y * W + xx_)[:, :, None]
                    ok3 = ok[:, :, None]
                    if STRIDE == 1:
                        row0 = n * OHW
                        if RESIDENT and HWP > 64:  # 16x16: the row index (>= 0) zero-extended; sign-
                            # extended, its high word took a uniform register that spilled in the chunk loop
                            gp = g_ptr + (row0 + pix).to(tl.uint32).to(tl.int64) * R + r3
                        else:
                            gp = g_ptr + (row0 + pix).to(tl.int64) * R + r3
                        if EXACT:
                            pool += v
                            if MASK_R:
                                tl.store(gp, v.to(dtype), mask=r3 < R)
                            else:
                                tl.store(gp, v.to(dtype))
                        else:
                            pool += tl.where(ok3, v, 0.0)
                            tl.store(gp, v.to(dtype), mask=ok3 & (r3 < R))
                    else:  # the full-resolution g into its own slot, [H W pixels][RB]
                        if EXACT:
                            tl.store(gs + pix * RB + g3 * 8 + c3, v.to(dtype))
                        else:
                            tl.store(gs + pix * RB + g3 * 8 + c3, v.to(dtype), mask=ok3)
                if STRIDE == 1:
                    if NS == CS:  # each pixel sub-tile's sums as a row of its own ([CS][RB]),
                        # added by _se_partial (the sum over the sub-tiles here takes a layout conversion)
                        r2 = ((bs % CS) * RB + (bs // CS) * 8)[:, None] + tl.arange(0, 8)[None, :]
                        tl.store(ms + r2, tl.sum(pool, axis=1) * inv_ohw)
                    else:
                        r2 = tl.arange(0, G)[:, None] * 8 + tl.arange(0, 8)[None, :]
                        psum = tl.sum(pool, axis=1)
                        if CS > 1:  # the group's CS sub-tiles
                            psum = tl.sum(tl.reshape(psum, (G, CS, 8)), axis=1)
                        tl.store(ms + r2, psum * inv_ohw)
                elif STRIDE == 2:
                    tl.debug_barrier()
                    _blur(gs, g_ptr, ms, n, r0, rr, r_ok, H, W, OH, OW, R, ncol_o, ntile_o, mo, RB, TWO, THO,
                          EXACT, MASK_R)
                tl.debug_barrier()
                _se_partial(ms, w1_ptr, z_ptr, n, ch, NCHUNK, r0, rr, r_ok, S, sw1_s, sw1_r, RB, SP, SEB, NS)
    if GATE:  # every item held all the chunks of its images: their SE gates, once per image,
        # in a loop of their own after the work items
        tl.debug_barrier()  # the SE partials (stored by other threads) are complete
        for item in range(pid, item_end, item_step):
            n0 = (item // NGROUP) * IB
            _se_gates(z_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, n0, tl.minimum(IB, N - n0), N, NCHUNK, R, S,
                      sw2_r, sw2_s, SP, NCP, GB, SILU)


@triton.jit
def _blur(gs, g_ptr, ms, n, r0, rr, r_ok, H, W, OH, OW, R, ncol_o, ntile_o, mo, RB: tl.constexpr,
          TWO: tl.constexpr, THO: tl.constexpr, EXACT: tl.constexpr, MASK_R: tl.constexpr):
    """BlurPool of one image's chunk: [1, 2, 1]^2 / 16, stride 2, reflect padding folded into the
    indices, from the full-resolution g in the slot gs ([H W pixels][RB]); the blurred g goes to
    g_ptr, its mean over the image to ms."""
    BMO: tl.constexpr = TWO * THO
    OHW = OH * OW
    dtype = g_ptr.dtype.element_ty
    pool = tl.zeros((BMO, RB), dtype=tl.float32)
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
        op = g_ptr + (n * OHW + oy * OW + ox).to(tl.int64)[:, None] * R + (r0 + rr)[None, :]
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


@triton.jit
def _se_partial(mean_ptr, w1_ptr, z_ptr, n, ch, NCHUNK, r0, rr, r_ok, S, sw1_s, sw1_r, RB: tl.constexpr,
                SP: tl.constexpr, SEB: tl.constexpr, NS: tl.constexpr):
    """The first SE layer's share of one (image, chunk): zpart[n, chunk] = W_se1[:, chunk] @ mean[n, chunk]
    (fp32). The chunk's mean comes through the per-program slot: reducing it straight from the conv's
    layout pushed the registers past 255 (spills)."""
    mc = tl.load(mean_ptr + rr)
    for j in tl.static_range(1, NS):  # the chunk's mean in NS partial rows (stride 1: its pixel sub-tiles)
        mc += tl.load(mean_ptr + j * RB + rr)
    zrow = z_ptr + (tl.cast(n, tl.int64) * NCHUNK + ch) * SP
    # SEB rows of W_se1 per step (the launcher's choice: at 16 warps all SP rows in one step, one
    # 16-byte vector per thread; four steps of 16 held four sets of addresses across the loops)
    for s0 in tl.static_range(0, SP, SEB):
        s2 = s0 + tl.arange(0, SEB)
        w1c = tl.load(w1_ptr + s2[:, None] * sw1_s + (r0 + rr)[None, :] * sw1_r,
                      mask=(s2[:, None] < S) & r_ok[None, :], other=0.0)
        tl.store(zrow + s2, tl.sum(w1c.to(tl.float32) * mc[None, :], axis=1))


@triton.jit(noinline=True)
def _se_gates(z_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, n0, nimg, N, NCHUNK, R, S, sw2_r, sw2_s,
              SP: tl.constexpr, NCP: tl.constexpr, GB: tl.constexpr, SILU: tl.constexpr):
    """GATE: ``se_gates`` as a function of its own (module docstring)."""
    se_gates(z_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, n0, nimg, N, NCHUNK, R, S, sw2_r, sw2_s, SP, NCP, GB,
             SILU)


@triton.jit
def se_gates(z_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, n0, nimg, N, NCHUNK, R, S, sw2_r, sw2_s,
             SP: tl.constexpr, NCP: tl.constexpr, GB: tl.constexpr, SILU: tl.constexpr):
    """The SE gates of images n0 ... n0 + nimg - 1, ``sigmoid(W_se2 ReLU(sum_chunk zpart + b_se1) + b_se2)``
    rounded to the data type, to ``gate_ptr`` (N, R), in steps of GB hidden channels (the arithmetic of
    the projection's own gate path)."""
    sv = tl.arange(0, SP)
    s_ok = sv < S
    b1 = tl.load(b1_ptr + sv, mask=s_ok, other=0.0).to(tl.float32)
    for i in range(0, nimg):
        nj = tl.minimum(n0 + i, N - 1).to(tl.int64)
        z = _se_hidden(z_ptr, b1, nj, NCHUNK, sv, tl.arange(0, NCP), SP)
        se_gate_rows(z, w2_ptr, b2_ptr, gate_ptr, nj, R, sv, s_ok, sw2_r, sw2_s, GB, SILU)


@triton.jit
def se_gate_rows(z, w2_ptr, b2_ptr, gate_ptr, nj, R, sv, s_ok, sw2_r, sw2_s, GB: tl.constexpr,
                 SILU: tl.constexpr):
    """``sigmoid(W_se2 z + b_se2)`` of image nj from its SE hidden layer z ([SP] fp32, entries ``sv``),
    rounded to the data type, to ``gate_ptr`` (N, R), in steps of GB hidden channels."""
    dtype = gate_ptr.dtype.element_ty
    for r0 in range(0, R, GB):
        rg = r0 + tl.arange(0, GB)
        rv = rg < R
        w2 = tl.load(w2_ptr + rg[:, None] * sw2_r + sv[None, :] * sw2_s, mask=rv[:, None] & s_ok[None, :],
                     other=0.0).to(tl.float32)
        b2 = tl.load(b2_ptr + rg, mask=rv, other=0.0).to(tl.float32)
        gate = _sigmoid(tl.sum(w2 * z[None, :], axis=1) + b2, SILU)
        tl.store(gate_ptr + nj * R + rg, gate.to(dtype), mask=rv)


@triton.jit
def _acc_init(bproj_ptr, x_ptr, nrow, k, kv, oy, ox, m_ok, sxn, sxc, sxh, sxw, BM: tl.constexpr,
              BH: tl.constexpr, RESIDUAL: tl.constexpr):
    bias = tl.load(bproj_ptr + k, mask=kv, other=0.0).to(tl.float32)
    acc = tl.zeros((BM, BH), dtype=tl.float32) + bias[None, :]
    if RESIDUAL:
        res = tl.load(x_ptr + (nrow * sxn + oy * sxh + ox * sxw)[:, None] + k[None, :] * sxc,
                      mask=m_ok[:, None] & kv[None, :], other=0.0)
        acc += res.to(tl.float32)
    return acc


@triton.jit
def _se_hidden(z_ptr, b1, nj, NCHUNK, sv, ch, SP: tl.constexpr):
    """ReLU(sum over chunks of zpart[nj] + b1): the SE's hidden layer of image nj, [SP] fp32 (partials
    summed in a fixed order)."""
    zz = tl.load(z_ptr + (nj * NCHUNK + ch[:, None]) * SP + sv[None, :], mask=ch[:, None] < NCHUNK, other=0.0)
    return tl.maximum(tl.sum(zz, axis=0) + b1, 0.0)


# sgate (the gates' row stride) is not specialized: see the GATE loads below
@triton.jit(do_not_specialize=["sgate"])
def _mbconv_project_kernel(
    g_ptr, z_ptr, b1_ptr, w2_ptr, b2_ptr, wproj_ptr, bproj_ptr, x_ptr, out_ptr,
    N, OHW, OW, R, K, S, NCHUNK, TPI,
    sxn, sxc, sxh, sxw, son, sok, soh, sow, sw2_r, sw2_s, swp_k, swp_r,
    gate_ptr, sgate,  # GATE only
    RESIDUAL: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, HALVES: tl.constexpr, BR: tl.constexpr,
    SP: tl.constexpr, NCP: tl.constexpr, IPT: tl.constexpr, EVEN: tl.constexpr, PREC: tl.constexpr,
    SIGMOID: tl.constexpr, GATE: tl.constexpr,
):
    dtype = g_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n0 = (pid // TPI) * IPT
    m = tl.arange(0, BM)
    if IPT == 1:  # rows: pixels p0 ... p0 + BM - 1 of one image
        img = m * 0
        p = (pid % TPI) * BM + m
    else:  # rows: two whole images of OHW pixels each, the rest masked
        img = m // OHW
        p = m % OHW
    nrow = tl.minimum(n0 + img, N - 1).to(tl.int64)
    pv = (p < OHW) & (n0 + img < N) & (img < IPT)
    k0 = tl.program_id(1) * (BH * HALVES) + tl.arange(0, BH)
    k1 = k0 + BH
    rows = g_ptr + (nrow * OHW + p) * R
    oy = p // OW
    ox = p % OW
    # SE hidden layer of the tile's images; the gate itself, sigmoid(W_se2 z + b2), is computed per R
    # step from the step's W_se2 rows (W_se2 read once per program)
    # (GATE: the hidden kernel wrote the gates, (N, R) in the data type, read per R step)
    sv = tl.arange(0, SP)
    s_ok = sv < S
    if GATE:
        n0c = tl.minimum(n0, N - 1).to(tl.int64)
        n1c = tl.minimum(n0 + 1, N - 1).to(tl.int64)
    else:
        ch = tl.arange(0, NCP)
        b1 = tl.load(b1_ptr + sv, mask=s_ok, other=0.0).to(tl.float32)
        z0 = _se_hidden(z_ptr, b1, tl.minimum(n0, N - 1).to(tl.int64), NCHUNK, sv, ch, SP)
        if IPT == 2:
            z1 = _se_hidden(z_ptr, b1, tl.minimum(n0 + 1, N - 1).to(tl.int64), NCHUNK, sv, ch, SP)
    # accumulators start at bias (+ residual); with HALVES = 2 the output width is split in two
    # accumulators so that the epilogue converts half of it at a time
    acc0 = _acc_init(bproj_ptr, x_ptr, nrow, k0, k0 < K, oy, ox, pv, sxn, sxc, sxh, sxw, BM, BH, RESIDUAL)
    if HALVES == 2:
        acc1 = _acc_init(bproj_ptr, x_ptr, nrow, k1, k1 < K, oy, ox, pv, sxn, sxc, sxh, sxw, BM, BH, RESIDUAL)
    rb = tl.arange(0, BR)
    if GATE:  # the first step's gates; each step loads the next one's (launcher.py, "Projection")
        g0n = tl.load(gate_ptr + n0c * sgate + rb, mask=rb < R, other=0.0)
        g1n = g0n
        if IPT == 2:
            g1n = tl.load(gate_ptr + n1c * sgate + rb, mask=rb < R, other=0.0)
    for r0 in range(0, R, BR):
        rr = r0 + rb
        rv = rr < R
        if GATE:  # the step's gates: with a row stride of unknown alignment these are 2-byte LDGs
            # (L1-allocating, not pipelined), not 16-byte cp.async copies that every thread repeats from L2
            gsel = g0n[None, :]
            rn = rr + BR
            g0n = tl.load(gate_ptr + n0c * sgate + rn, mask=rn < R, other=0.0)
            if IPT == 2:
                gsel = tl.where((img == 1)[:, None], g1n[None, :], gsel)
                g1n = tl.load(gate_ptr + n1c * sgate + rn, mask=rn < R, other=0.0)
        else:
            if EVEN:  # R a multiple of BR, S of SP, every row real, K a multiple of BH * HALVES: no masks
                w2 = tl.load(w2_ptr + rr[:, None] * sw2_r + sv[None, :] * sw2_s).to(tl.float32)
                b2 = tl.load(b2_ptr + rr).to(tl.float32)
            else:
                w2 = tl.load(w2_ptr + rr[:, None] * sw2_r + sv[None, :] * sw2_s,
                             mask=rv[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
                b2 = tl.load(b2_ptr + rr, mask=rv, other=0.0).to(tl.float32)
            gsel = _sigmoid(tl.sum(w2 * z0[None, :], axis=1) + b2, SIGMOID).to(dtype)[None, :]
            if IPT == 2:
                gate1 = _sigmoid(tl.sum(w2 * z1[None, :], axis=1) + b2, SIGMOID).to(dtype)[None, :]
                gsel = tl.where((img == 1)[:, None], gate1, gsel)
        if EVEN:
            a = tl.load(rows[:, None] + rr[None, :]) * gsel
            b0 = tl.load(wproj_ptr + k0[None, :] * swp_k + rr[:, None] * swp_r)
        else:
            a = tl.load(rows[:, None] + rr[None, :], mask=pv[:, None] & rv[None, :], other=0.0) * gsel
            b0 = tl.load(wproj_ptr + k0[None, :] * swp_k + rr[:, None] * swp_r,
                         mask=rv[:, None] & (k0 < K)[None, :], other=0.0)
        acc0 = tl.dot(a, b0, acc0, input_precision=PREC)
        if HALVES == 2:
            if EVEN:
                b1t = tl.load(wproj_ptr + k1[None, :] * swp_k + rr[:, None] * swp_r)
            else:
                b1t = tl.load(wproj_ptr + k1[None, :] * swp_k + rr[:, None] * swp_r,
                              mask=rv[:, None] & (k1 < K)[None, :], other=0.0)
            acc1 = tl.dot(a, b1t, acc1, input_precision=PREC)
    o_rows = out_ptr + (nrow * son + oy * soh + ox * sow)[:, None]
    if EVEN:
        tl.store(o_rows + k0[None, :] * sok, acc0.to(dtype))
        if HALVES == 2:
            tl.store(o_rows + k1[None, :] * sok, acc1.to(dtype))
    else:
        tl.store(o_rows + k0[None, :] * sok, acc0.to(dtype), mask=pv[:, None] & (k0 < K)[None, :])
        if HALVES == 2:
            tl.store(o_rows + k1[None, :] * sok, acc1.to(dtype), mask=pv[:, None] & (k1 < K)[None, :])
