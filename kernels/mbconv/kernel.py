"""Triton kernels for the MBConv + Squeeze-Excite block (paper Section 5.4, Fig. 11), NHWC, folded BN.

What is computed (reference.py is the specification)::

    h = SiLU(W_exp x + b_exp)                      R = 4C hidden channels
    g = SiLU(gconv3x3(h) + b_conv)                 group width 8, zero padding 1
    g = BlurPool(g)                                stride 2 only (reflect pad 1, [1,2,1]^2/16)
    gate = sigmoid(W_se2 ReLU(W_se1 mean_hw(g) + b_se1) + b_se2)        (N, R)
    out = W_proj (g * gate) + b_proj (+ x)         residual for stride 1

Design: two passes that recompute the hidden activation instead of storing it
-----------------------------------------------------------------------------
The SE gate depends on the mean of ``g`` over the whole image, and every output pixel needs the gate.
The paper's kernel (Fig. 11) gives each processor a chunk of hidden channels over the whole map and
meets at a grid-wide barrier after the pooled squeeze vector is reduced in global memory. Triton has
no grid barrier that is safe without a cooperative launch (a spin-wait deadlocks when not every
program is resident, e.g. batch 256 at 16x16), so this file splits the block at that barrier:

1. ``_mbconv_kernel[PASS=1]`` (grid: spatial tiles x images): per hidden chunk, expand + SiLU +
   grouped conv + SiLU (+ BlurPool) on chip, then the tile's column sums are stored into
   ``partial`` (N, tiles, R) fp32. Nothing of width R per pixel is written. Per-tile partials
   rather than ``tl.atomic_add`` into (N, R): the sum order is fixed (bit-reproducible output,
   no zero-filled buffer), for 4 x R x 4 B = 8 KB per image at 16x16 (4 tiles).
2. ``_se_kernel`` (grid: images): sums the partials, the tiny SE MLP, ``gate`` (N, R) fp32.
3. ``_mbconv_kernel[PASS=2]``: recompute the same hidden chunks, multiply by the gate, accumulate
   the projection over hidden chunks in registers (no atomics on the output), add bias and residual,
   store the (N, K, H', W') output once.

Waterline arithmetic (one image, fp16; H100 SXM: 990 TFLOP/s dense fp16, 3.35 TB/s, op:byte =
295 FLOP/B). FLOP counts include the waste of the shipped tiles (next section): the expand runs on
an h window padded to a power of two (2x the pixels it serves), the grouped conv is a
block-diagonal ``tl.dot`` with K = BLOCK_R = 32 (4x the useful MACs: the price of tensor cores at
group width 8), and passes 1 and 2 both compute expand + conv. Shared-memory traffic of the gathers
is not counted.

* Stride 1, C = K = 128, R = 512, 16x16 (paper Table 5, MBConv s1): useful work is expand
  2*256*128*512 = 33.6 MFLOP + grouped conv 2*256*512*72 = 18.9 + project 33.6 = 86 MFLOP.
  Layer-wise kernels move x (64 KB), the 256 KB hidden tensor five times (expand writes h, conv
  reads h and writes g, pool reads g, gate*project reads g), the residual and the output
  (128 KB): ~1.47 MB, 58 FLOP/B, memory bound at >= 0.44 us per image.
  These kernels move x twice and the output once (~0.2 MB; partials and gate are 5 x R x 4 B) and
  execute 2 * (67 expand + 76 conv) + 34 project = 320 MFLOP: ~1600 FLOP/B, compute bound at
  >= 0.32 us per image (27 % of peak as useful work at best).
* Stride 2, C = K = 128, R = 512, 16x16 -> 8x8 (Table 5, MBConv s2): useful 33.6 + 18.9 + 8.4 =
  61 MFLOP; layer-wise ~1.3 MB (h written and read, full-resolution g written and read by the blur,
  the blurred g read by pool and project): 47 FLOP/B, >= 0.39 us. Here the g window is also
  padded 2x (81 -> 128 rows for 64 full-resolution pixels), so the conv costs 8x its useful MACs:
  2 * (67 + 151) + 8 = 444 MFLOP on ~0.15 MB, >= 0.45 us: on paper no faster than layer-wise.

So the two-pass design wins where the bytes it saves exceed the recompute, and the waste factors
decide by how much. The first levers, to be timed on a GPU: BLOCK_R = 16 (conv waste 2x instead of
4x: stride 1 -> 244 MFLOP, 0.25 us; stride 2 -> 293 MFLOP, 0.30 us), stride-2 tiles whose g window
fills its power of two (3x8 outputs: g 7x17 = 119 of 128 rows), and the two-taps-per-K batched dot
of KERNEL-NOTES (conv waste 10/9). A waste-free two-pass block is 2 * 52 + 34 = 138 MFLOP (0.14 us)
at stride 1.

Tiling and grid
---------------
One program owns an output tile of TILE_H x TILE_W pixels of one image and loops over the hidden
channels in chunks of BLOCK_R (a multiple of 8, so every group of the grouped conv lies in one
chunk and the conv needs no communication between chunks). For that tile it needs:

* the ``g`` window: the output tile itself (stride 1), or the (2*TILE_H+1) x (2*TILE_W+1) full
  resolution pixels under the blur filter (stride 2), flattened row-major into BLOCK_G rows;
  neighbouring stride-2 tiles share one row/column of that window (computed twice);
* the ``h`` window: the ``g`` window grown by one pixel each side (the 3x3 conv), flattened into
  BLOCK_H rows. Triton tensors have power-of-two sizes, so BLOCK_H / BLOCK_G / BLOCK_O are the next
  powers of two (>= 16 for ``tl.dot``); the extra rows are masked.

Per chunk: ``h`` = ``tl.dot`` over C in steps of BLOCK_C (x window rows loaded with masks that zero
pixels outside the image: that *is* the conv's zero padding of h, enforced again after the SiLU).
The grouped conv is nine taps; tap (dy, dx) gathers its shifted ``h`` rows with ``tl.gather``
(an on-chip shuffle through shared memory on the GPU) and multiplies by a block-diagonal
BLOCK_R x BLOCK_R weight tile built by a masked load (``j // 8 == r // 8``). The blur (stride 2) is
nine more gathers with the fixed weights; reflect padding is folded into the gather indices. All
accumulation is fp32; ``h`` and the gated ``g`` are rounded to the input dtype before their
``tl.dot`` (fp16/bf16 tensor cores). fp32 inputs use ``input_precision="tf32x3"`` (three TF32
tensor-core products with split operands, ~fp32 accuracy; the same choice as kernels/convfirst).
"ieee" was tried first: its FMA-lowered dots took 1 to more than 5 minutes per variant in ptxas
and 80 KB of shared memory. The interpreter computes every dot in exact fp32.

Configurations come from ``mbconv_config`` (a table by stride and map size, documented there) so
that a benchmark can report them and tests can compile every one of them for sm_90 and sm_80.
The interpreter (CPU tests) runs the same single configuration per shape; there is no autotuning
(KERNEL-NOTES: autotune under torch.compile/CUDA graphs and without a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import GROUP_WIDTH, launch

# ----------------------------------------------------------------------------------------------
# Configuration table
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MBConvConfig:
    """Tile choice for one (stride, map size, channels) shape; all fields become constexprs."""

    stride: int
    tile_h: int  # output tile height (pixels of the output map)
    tile_w: int  # output tile width
    block_r: int  # hidden channels per chunk (multiple of 8: whole conv groups)
    block_c: int  # input channels per expand K step
    block_k: int  # output channels (next power of two of K, all in one accumulator)
    num_warps: int

    # windows (see the module docstring): g window = pixels under the blur (stride 2) or the tile
    @property
    def g_h(self) -> int:
        return self.tile_h if self.stride == 1 else 2 * self.tile_h + 1

    @property
    def g_w(self) -> int:
        return self.tile_w if self.stride == 1 else 2 * self.tile_w + 1

    @property
    def block_o(self) -> int:
        return max(16, triton.next_power_of_2(self.tile_h * self.tile_w))

    @property
    def block_g(self) -> int:
        return self.block_o if self.stride == 1 else max(16, triton.next_power_of_2(self.g_h * self.g_w))

    @property
    def block_h(self) -> int:
        return max(16, triton.next_power_of_2((self.g_h + 2) * (self.g_w + 2)))

    def constexprs(self) -> dict:
        return dict(
            STRIDE=self.stride, TILE_H=self.tile_h, TILE_W=self.tile_w, G_H=self.g_h, G_W=self.g_w,
            BLOCK_O=self.block_o, BLOCK_G=self.block_g, BLOCK_H=self.block_h,
            BLOCK_R=self.block_r, BLOCK_C=self.block_c, BLOCK_K=self.block_k,
        )


# BLOCK_R = 32: 4 conv groups per chunk; the block-diagonal conv dot wastes BLOCK_R / 8 = 4x, and
# a K = 32 step keeps mma.sync/wgmma fed. 16 would halve the waste at twice the loop trips
# (to be measured on a GPU). 32 divides every R = 4C of the paper (192 ... 1024).
BLOCK_R = 32
# BLOCK_C = 64: the expand K step; every block input C (48 ... 256) is one to four steps.
BLOCK_C = 64
# dot precision for fp32 operands (module docstring); fp16/bf16 operands ignore it
FP32_PRECISION = "tf32x3"
# SE kernel chunk over R (broadcast-multiply + tl.sum on [BLOCK_S, SE_BLOCK_R], fp32).
SE_BLOCK_R = 128


def mbconv_config(c: int, r: int, k: int, h: int, w: int, stride: int) -> MBConvConfig:
    """Per-shape tiles (not tuned on a GPU yet). One tile per stride keeps the set of compiled
    variants small (each is compiled for sm_90 and sm_80 in the tests):

    * stride 1: 8x8 output tile; h window 10x10 = 100 -> 128 rows, so the expand runs on 2x the
      output pixels. The paper's maps are 16x16 (4 tiles per image) and 8x8 (one tile); smaller
      maps (down to 1x1) are masked rows of the same tile.
    * stride 2: 4x4 output tile; g window 9x9 = 81 -> 128 rows (2x the 64 full-resolution pixels
      under the tile), h window 11x11 = 121 -> 128 rows: the same FLOP waste as a 4x8 tile (g 9x17
      -> 256, h 11x19 -> 256), which compiled 3x slower (30-40 s per variant for sm_80 in ptxas,
      over 90 s in fp32) and needed 147 KB of shared memory in fp32 against 80 KB here.
    * BLOCK_K = K rounded up to a power of two (64, 128 or 256 for the paper's 48 ... 256): the
      whole output row of a pixel stays in one fp32 accumulator, so hidden chunks never meet in
      DRAM (no atomics on the output).
    * num_warps 8 once a program holds 256-row windows or a 64 x 256 fp32 accumulator (64 KB of
      registers: 64 per thread at 8 warps), else 4.
    """
    tile = (8, 8) if stride == 1 else (4, 4)
    block_k = max(16, triton.next_power_of_2(k))
    block_c = min(BLOCK_C, max(16, triton.next_power_of_2(c)))
    cfg = MBConvConfig(stride, tile[0], tile[1], BLOCK_R, block_c, block_k, 4)
    if cfg.block_h >= 256 or cfg.block_o * block_k >= 64 * 256:
        cfg = MBConvConfig(stride, tile[0], tile[1], BLOCK_R, block_c, block_k, 8)
    return cfg


def pass_constexprs(cfg: MBConvConfig, pass_: int) -> dict:
    """Meta-parameters of one pass, ``num_warps`` included. Pass 1 has no output accumulator, so
    BLOCK_K is pinned to 16 and the warps follow the window size only: all output widths share one
    compiled pass-1 variant."""
    meta = dict(cfg.constexprs(), PASS=pass_, num_warps=cfg.num_warps)
    if pass_ == 1:
        meta["BLOCK_K"] = 16
        meta["num_warps"] = 8 if cfg.block_h >= 256 else 4
    return meta


# The shapes the package supports (SPEC 1): block inputs C, stride-2 block outputs K.
SUPPORTED_C = (48, 64, 72, 96, 128, 160, 192, 256)
SUPPORTED_K_STRIDE2 = (128, 160, 192, 256)


def shipped_variants() -> list[dict]:
    """Every distinct set of meta-parameters (``num_warps`` included) the launcher picks for the
    supported shapes; the tests compile each for sm_90 and sm_80 (dtype and PREC added there)."""
    seen = {}
    for c in SUPPORTED_C:
        for stride, ks in ((1, (c,)), (2, SUPPORTED_K_STRIDE2)):
            for k in ks:
                for hw in (1, 2, 4, 8, 16, 32, 64):
                    if stride == 2 and hw < 2:
                        continue
                    cfg = mbconv_config(c, 4 * c, k, hw, hw, stride)
                    for p in (1, 2):
                        meta = pass_constexprs(cfg, p)
                        seen[tuple(sorted(meta.items()))] = meta
    return list(seen.values())


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _mbconv_kernel(
    # pointers
    x_ptr, out_ptr, part_ptr, gate_ptr,
    wexp_ptr, bexp_ptr, wconv_ptr, bconv_ptr, wproj_ptr, bproj_ptr,
    # sizes
    H, W, OH, OW, C, R, K, TILES_W,
    # strides (elements): x and out in any layout, 2-D weights (out, in)
    sxn, sxc, sxh, sxw, son, sok, soh, sow,
    swe_r, swe_c, swp_k, swp_r,
    # meta-parameters (see MBConvConfig)
    PASS: tl.constexpr, STRIDE: tl.constexpr,
    TILE_H: tl.constexpr, TILE_W: tl.constexpr, G_H: tl.constexpr, G_W: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    tl.static_assert(BLOCK_R % 8 == 0, "hidden chunks must hold whole conv groups")
    tl.static_assert(BLOCK_H >= (G_H + 2) * (G_W + 2))
    tl.static_assert(BLOCK_G >= G_H * G_W)
    tl.static_assert(BLOCK_O >= TILE_H * TILE_W)
    HALO_W: tl.constexpr = G_W + 2
    dtype = x_ptr.dtype.element_ty

    pid_t = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    oy0 = (pid_t // TILES_W) * TILE_H
    ox0 = (pid_t % TILES_W) * TILE_W
    # origin of the g window in full-resolution coordinates
    if STRIDE == 1:
        gy0 = oy0
        gx0 = ox0
    else:
        gy0 = 2 * oy0 - 1
        gx0 = 2 * ox0 - 1
    x_img = x_ptr + n * sxn

    # h window rows: image pixel of each row, and whether it is a real (in-image) pixel
    ph = tl.arange(0, BLOCK_H)
    hy = gy0 - 1 + ph // HALO_W
    hx = gx0 - 1 + ph % HALO_W
    h_ok = (ph < (G_H + 2) * HALO_W) & (hy >= 0) & (hy < H) & (hx >= 0) & (hx < W)
    x_rows = x_img + hy * sxh + hx * sxw

    # g window rows, and the h row each conv tap reads (padding rows point at row 0, unused)
    pg = tl.arange(0, BLOCK_G)
    g_in = pg < G_H * G_W
    gyl = tl.where(g_in, pg // G_W, 0)
    gxl = tl.where(g_in, pg % G_W, 0)

    # output tile rows
    po = tl.arange(0, BLOCK_O)
    oy = oy0 + po // TILE_W
    ox = ox0 + po % TILE_W
    o_ok = (po < TILE_H * TILE_W) & (oy < OH) & (ox < OW)

    rr = tl.arange(0, BLOCK_R)
    rc = tl.arange(0, BLOCK_C)
    rk = tl.arange(0, BLOCK_K)
    # block-diagonal conv tile: row j (input channel in chunk), column r (output channel in chunk)
    bd_in_group = (rr[:, None] // 8) == (rr[None, :] // 8)
    bd_offs = rr[None, :] * (8 * 9) + (rr[:, None] % 8) * 9

    acc_o = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_ok = (r0 + rr) < R
        # ---- expand: h[BLOCK_H, BLOCK_R] = SiLU(x_window @ W_exp[chunk]^T + b), zero off-image
        acc_h = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c_ok = (c0 + rc) < C
            xt = tl.load(
                x_rows[:, None] + (c0 + rc)[None, :] * sxc, mask=h_ok[:, None] & c_ok[None, :], other=0.0
            )
            wt = tl.load(
                wexp_ptr + (r0 + rr)[None, :] * swe_r + (c0 + rc)[:, None] * swe_c,
                mask=c_ok[:, None] & r_ok[None, :], other=0.0,
            )
            acc_h = tl.dot(xt, wt, acc_h, input_precision=PREC)
        b_e = tl.load(bexp_ptr + r0 + rr, mask=r_ok, other=0.0).to(tl.float32)
        hid = acc_h + b_e[None, :]
        hid = hid / (1.0 + tl.exp(-hid))  # SiLU (inlined: one self-contained kernel compiles from CPU too)
        hid = tl.where(h_ok[:, None], hid, 0.0).to(dtype)

        # ---- grouped 3x3 conv: nine gathered taps x block-diagonal weights
        acc_g = tl.zeros((BLOCK_G, BLOCK_R), dtype=tl.float32)
        for t in tl.static_range(9):
            src = (gyl + t // 3) * HALO_W + (gxl + t % 3)
            tap = tl.gather(hid, tl.broadcast_to(src[:, None], (BLOCK_G, BLOCK_R)), 0)
            wbd = tl.load(wconv_ptr + r0 * (8 * 9) + bd_offs + t, mask=bd_in_group & r_ok[None, :], other=0.0)
            acc_g = tl.dot(tap, wbd, acc_g, input_precision=PREC)
        b_c = tl.load(bconv_ptr + r0 + rr, mask=r_ok, other=0.0).to(tl.float32)
        g = acc_g + b_c[None, :]
        g = g / (1.0 + tl.exp(-g))

        # ---- BlurPool (stride 2): nine gathers with reflect-padded indices and weights [1,2,1]^2/16
        if STRIDE == 2:
            acc_b = tl.zeros((BLOCK_O, BLOCK_R), dtype=tl.float32)
            for t in tl.static_range(9):
                yy = 2 * oy - 1 + t // 3
                xx = 2 * ox - 1 + t % 3
                yy = tl.where(yy < 0, -yy, yy)
                yy = tl.where(yy >= H, 2 * H - 2 - yy, yy)
                xx = tl.where(xx < 0, -xx, xx)
                xx = tl.where(xx >= W, 2 * W - 2 - xx, xx)
                src = tl.where(o_ok, (yy - gy0) * G_W + (xx - gx0), 0)
                tap = tl.gather(g, tl.broadcast_to(src[:, None], (BLOCK_O, BLOCK_R)), 0)
                acc_b += tap * ((1 + (t // 3) % 2) * (1 + (t % 3) % 2) * 0.0625)
            g = acc_b

        if PASS == 1:
            # ---- pooled partial sums of this tile for this chunk: partial[n, tile, r]
            part = tl.sum(tl.where(o_ok[:, None], g, 0.0), axis=0)
            tl.store(part_ptr + (n * tl.num_programs(0) + pid_t) * R + r0 + rr, part, mask=r_ok)
        else:
            # ---- gate, then project this chunk into the output accumulator
            gate = tl.load(gate_ptr + n * R + r0 + rr, mask=r_ok, other=0.0)
            s = (g * gate[None, :]).to(dtype)
            wp = tl.load(
                wproj_ptr + rk[None, :] * swp_k + (r0 + rr)[:, None] * swp_r,
                mask=r_ok[:, None] & (rk < K)[None, :], other=0.0,
            )
            acc_o = tl.dot(s, wp, acc_o, input_precision=PREC)

    if PASS == 2:
        k_ok = rk < K
        m = o_ok[:, None] & k_ok[None, :]
        acc_o += tl.load(bproj_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if STRIDE == 1:  # residual: K == C, same pixels
            res = tl.load(x_img + rk[None, :] * sxc + (oy * sxh + ox * sxw)[:, None], mask=m, other=0.0)
            acc_o += res.to(tl.float32)
        o_ptrs = out_ptr + n * son + rk[None, :] * sok + (oy * soh + ox * sow)[:, None]
        tl.store(o_ptrs, acc_o.to(dtype), mask=m)


@triton.jit
def _se_kernel(
    part_ptr, gate_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
    R, S, TILES, HW_OUT,
    BLOCK_S: tl.constexpr, BLOCK_RS: tl.constexpr,
):
    """gate[n] = sigmoid(W2 ReLU(W1 mean[n] + b1) + b2) with mean[n] = sum_t partial[n, t] / HW_OUT,
    fp32; one program per image, tiles summed in a fixed order.

    Broadcast-multiply + ``tl.sum`` rather than ``tl.dot``: the matrix-vector products are
    S x R <= 64 x 1024 per image, too small for tensor cores to matter.
    """
    n = tl.program_id(0).to(tl.int64)
    rs = tl.arange(0, BLOCK_S)
    s_ok = rs < S
    z = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_RS):
        rr = r0 + tl.arange(0, BLOCK_RS)
        r_ok = rr < R
        p = tl.zeros((BLOCK_RS,), dtype=tl.float32)
        for t in range(0, TILES):
            p += tl.load(part_ptr + (n * TILES + t) * R + rr, mask=r_ok, other=0.0)
        p = p / HW_OUT
        w1 = tl.load(w1_ptr + rs[:, None] * R + rr[None, :], mask=s_ok[:, None] & r_ok[None, :], other=0.0)
        z += tl.sum(w1.to(tl.float32) * p[None, :], axis=1)
    z = tl.maximum(z + tl.load(b1_ptr + rs, mask=s_ok, other=0.0).to(tl.float32), 0.0)
    for r0 in range(0, R, BLOCK_RS):
        rr = r0 + tl.arange(0, BLOCK_RS)
        r_ok = rr < R
        w2 = tl.load(w2_ptr + rr[:, None] * S + rs[None, :], mask=r_ok[:, None] & s_ok[None, :], other=0.0)
        e = tl.sum(w2.to(tl.float32) * z[None, :], axis=1)
        e += tl.load(b2_ptr + rr, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(gate_ptr + n * R + rr, tl.sigmoid(e), mask=r_ok)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


MAX_K = 256  # widest output kept in one fp32 accumulator (BLOCK_K); the paper's stages stop at 256


def check_supported(r: int, k: int) -> None:
    """Shapes the Triton path handles (called by op.py before any launch)."""
    if k > MAX_K:
        raise ValueError(
            f"convfirstnet.mbconv: the Triton kernel supports up to {MAX_K} output channels, got {k}; "
            "use CONVFIRSTNET_KERNELS=reference for wider blocks"
        )
    if r % GROUP_WIDTH:
        raise ValueError(
            f"convfirstnet.mbconv: hidden width {r} is not a multiple of the group width {GROUP_WIDTH}"
        )


def se_config(s: int) -> dict:
    return dict(BLOCK_S=max(16, triton.next_power_of_2(s)), BLOCK_RS=SE_BLOCK_R)


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
    """Launch pass 1, the SE kernel and pass 2. Inputs are validated by op.py before this call."""
    n, c, h, w = x.shape
    r, k, s = w_exp.shape[0], w_proj.shape[0], w_se1.shape[0]
    oh, ow = (h, w) if stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    out = torch.empty((n, k, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    if n == 0:
        return out
    cfg = mbconv_config(c, r, k, h, w, stride)
    w_conv = w_conv.contiguous()  # (R, 8, 3, 3) addressed as r * 72 + j * 9 + tap
    w_se1, w_se2 = w_se1.contiguous(), w_se2.contiguous()
    # 1-D biases are addressed as base + index (unit stride)
    b_exp, b_conv, b_proj = b_exp.contiguous(), b_conv.contiguous(), b_proj.contiguous()
    b_se1, b_se2 = b_se1.contiguous(), b_se2.contiguous()
    tiles_w = triton.cdiv(ow, cfg.tile_w)
    tiles = triton.cdiv(oh, cfg.tile_h) * tiles_w
    grid = (tiles, n)
    # scratch, allocated here so the op stays functional and CUDA-graph safe; pass 1 writes every
    # element of ``partial`` and the SE kernel every element of ``gate``, so no zero fill
    partial = torch.empty((n, tiles, r), device=x.device, dtype=torch.float32)
    gate = torch.empty((n, r), device=x.device, dtype=torch.float32)
    prec = FP32_PRECISION if x.dtype == torch.float32 else "tf32"  # only fp32 operands use it
    args = (
        x, out, partial, gate, w_exp, b_exp, w_conv, b_conv, w_proj, b_proj,
        h, w, oh, ow, c, r, k, tiles_w,
        *x.stride(), *out.stride(), *w_exp.stride(), *w_proj.stride(),
    )

    def nbytes(*tensors: torch.Tensor) -> int:
        return sum(t.numel() for t in tensors) * x.element_size()

    def cost_pass(pass_: int) -> KernelCost:  # see kernels/_cost.py
        r_chunks, c_steps = triton.cdiv(r, cfg.block_r), triton.cdiv(c, cfg.block_c)
        # per program and hidden chunk: expand on the h window, nine block-diagonal conv taps on the g window
        per_chunk = c_steps * cfg.block_h * cfg.block_c * cfg.block_r + 9 * cfg.block_g * cfg.block_r ** 2
        loops = (Loop("hidden chunks", r_chunks, body=(Loop("expand K steps", c_steps),)),)
        if pass_ == 1:  # expand, grouped conv (and BlurPool) of the block, counted once here
            useful = n * h * w * r * (c + 9 * GROUP_WIDTH) + (n * oh * ow * r * 9 if stride == 2 else 0)
            return KernelCost(
                useful_macs=useful, mma_macs=tiles * n * r_chunks * per_chunk,
                dram_bytes=nbytes(x, w_exp, b_exp, w_conv, b_conv) + partial.numel() * 4, loops=loops,
                note="writes per-tile fp32 channel sums (partial), read back by the SE kernel",
            )
        per_chunk += cfg.block_o * cfg.block_r * cfg.block_k  # the projection
        return KernelCost(
            useful_macs=n * oh * ow * r * k, mma_macs=tiles * n * r_chunks * per_chunk,
            dram_bytes=nbytes(x, out, w_exp, b_exp, w_conv, b_conv, w_proj, b_proj) + gate.numel() * 4,
            loops=loops, note="recomputes pass 1's expand and conv",
        )

    def cost_se() -> KernelCost:
        se_chunks = triton.cdiv(r, SE_BLOCK_R)
        return KernelCost(
            useful_macs=n * 2 * r * s,
            mma_macs=0,
            dram_bytes=nbytes(w_se1, b_se1, w_se2, b_se2) + (partial.numel() + gate.numel()) * 4,
            loops=(Loop("R chunks (squeeze)", se_chunks, body=(Loop("tiles", tiles),)),
                   Loop("R chunks (excite)", se_chunks)),
        )

    launch(_mbconv_kernel, grid, *args, PREC=prec, cost=lambda: cost_pass(1), **pass_constexprs(cfg, 1))
    launch(
        _se_kernel, (n,), partial, gate, w_se1, b_se1, w_se2, b_se2, r, s, tiles, oh * ow, cost=cost_se,
        **se_config(s),
    )
    launch(_mbconv_kernel, grid, *args, PREC=prec, cost=lambda: cost_pass(2), **pass_constexprs(cfg, 2))
    return out
