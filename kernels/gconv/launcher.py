"""Host side of the group-width-8 3x3 convolution kernels (kernel.py): tile configs, kernel limits,
launches with their cost declarations.

Every function here assumes the op's checks passed (shapes, dtypes, devices: op.py). Inputs whose
layout the kernels cannot read in place (channel stride 1, pixel strides and offset multiples of 8
elements: channels-last tensors and their crops) are copied to channels-last once; outputs are
contiguous NHWC (y, dx) or contiguous (C, 8, 3, 3) (dw). Pixel strides and C go to the kernels in
units of 8 elements, so that the compiler can prove each group's 8 channels one aligned 16-byte vector
(``tl.multiple_of`` on a scalar argument has no effect in Triton 3.8: C = 24 compiled to 2-byte
loads and stores and spilled).

``gconv3x3_moments_triton``: the stride-1 forward of a conv that a BatchNorm follows (the MBConv
training forward, kernels/mbconv/moments.py), whose programs also sum y - shift and its square over their
tiles, from y as stored: taken where the tiles cover the map exactly (``moments_rows``), so that every
row of sums counts the same pixels. Its y is the plain forward's bit for bit (tests/kernels/test_gconv.py).

Tiles (``tile_config``)
-----------------------
* Channel block: G groups (8G channels) per program, G chosen by ``groups_per_program`` from the
  issue cost per output of each G as compiled (G_ISSUE) and the masked groups it would pad:
  ConvFirstNet's widths give G = 8 for multiples of 64, G = 4 for 24 (one masked group), 32, 72 (3
  masked of 12), 96 and 288, G = 2 for 16 and 48.
* Pixels: BM = TILE_ELEMS / G rows per program, so that the [G, BM, 16] tap-pair operand is 16 KB
  whatever G: 64 pixels at G = 8, 128 at G = 4, 256 at G = 2 (fp32: half). The forward kernel
  (forward, stride-1 dgrad; ``fwd_tile_config``) and the fused backward take twice that at G >= 4
  (FWD_TILE_ELEMS: 32 KB pairs, 128 pixels at G = 8, 256 at G = 4): each tile waits for its five tap
  pairs in turn, and a tile of twice the pixels pays those waits once for twice the work (static
  estimate, sm_90, fp16, batch 128, high end: the forward at 1024 channels 16 x 16 167 -> 98 us, at 32
  channels 128 x 128 337 -> 165; the fused backward at 1024 channels 16 x 16 426 -> 236, at 384 32 x 32
  638 -> 353; 167-254 registers, no stack). At G = 2 the larger tiles spilled (568 B): TILE_ELEMS there.
  wgrad keeps TILE_ELEMS (at 64 channels 64 x 64 and 1024 at 16 x 16 the larger tiles were slower)
  except at stride 1 where C is whole groups of G = 4 (32 channels 128 x 128 268 -> 203 us, 96 at 32 x 32
  52 -> 36; 128 -> 166 registers, no stack; at stride 2 32 channels 128 x 128 went 69 -> 74, and the
  masked groups of 24 and 72 channels spilled 8 B on sm_80). The
  tile is TH x TW with TW the map width rounded up to a power of two, at most 8 columns for 64 pixels
  and 16 above (halo re-reads (TH + 2)(TW + 2) / (TH TW) <= 1.56, served by L1), and TH no taller than
  the map.
* Maps smaller than the tile (8 x 8 and 7 x 7 at G = 8: 64-pixel tiles, 16 KB pairs): G = 16 where C
  is whole blocks of 128 channels (``small_map_g16``; the fused backward too, below), which keeps the
  32 KB pairs, and at least FWD_MIN_PROGRAMS_G16 programs (two resident per SM: 255 registers, 28 KB of
  shared memory, no stack), so two tiles per program at batch 128. Static estimate of Small's BIAS_SILU +
  POOL forward at 1024 channels 8 x 8 (sm_90, fp16, batch 128): 29-42 -> 23-30 us (L1 pipe + latency
  39-41 -> 38-39); with one tile per program 25-33, but 42-44 by that sum.
* 4 warps, no software pipelining (num_stages = 1): the tap windows are plain L1-allocating loads
  (kernel.py); latency is hidden by the other resident programs (72-254 registers: 2-7 per SM).

Wgrad shares (``wgrad_shares``)
-------------------------------
The tiles of the batch (per channel block) are cut into shares of TILES_PER_SHARE consecutive tiles,
one program each: at least MIN_SHARE_PIXELS output pixels per share (an fp32 partial of 8G x 72
values costs 72 x 4 bytes per channel against 4 bytes per pixel and channel of 16-bit x and dy read,
so >= 1024 pixels keep the partials under 7 % of the traffic), and more per share when that still
leaves more than WGRAD_PROGRAMS programs (about 8 per SM of an H100). The shares depend only on the
shapes, never on the device, so the reduction order (and the bits of dw) is the same on any GPU.

Where G = 8 with full shares gives fewer than WGRAD_MIN_PROGRAMS programs (small maps: Small's 8 x 8 and
7 x 7 stages at batch 128 make 8 shares x 16 channel blocks), each SM runs at most one program, whose
tiles follow one another: latency-bound, not DRAM-bound. ``wgrad_tile_config`` then takes G = 4 (the
same issue per output, G_ISSUE): twice the programs, with shares of as many pixels, so no more partials
(static model, sm_90, high end, partials + reduction: Small's 8 x 8 wgrad 21.2 -> 18.8 us, 7 x 7
21.2 -> 15.9 us; 512 to 768 channels at 7 x 7 and 8 x 8 ~20 -> ~14.5 us; 64 at 28 x 28 20.0 -> 14.6 us).

Fused backward (``backward_config``)
------------------------------------
wgrad's G and shares with the forward kernel's tiles (FWD_TILE_ELEMS), and three changes found on the
static estimate (sm_90, fp16, batch 128; kernel.py has the figures): at most 128 pixels a tile
(BACKWARD_MAX_BLOCK_M: at G = 2 256 spilled); one warp per group (G warps: 4 computed the
wgrad dots twice at G = 2 and spilled with fp32 weights at G = 8); and where wgrad's shares make fewer
programs than one wave of BACKWARD_PROGRAMS (3 per SM of an H100 at G >= 4, 5 at G = 2), shorter
shares, of at least BACKWARD_MIN_SHARE_PIXELS pixels, to fill it (Small's 8 x 8 and 7 x 7 maps: 12
shares of 11 tiles instead of 8 of 16). On sm_90, maps smaller than the G = 8 tile (8 x 8, 7 x 7) take
G = 16 instead of wgrad's G = 4 (``small_map_g16``; two groups a warp: 8 warps, 254 registers, 52 KB of
shared memory, one program per SM, no stack, Triton 3.6 and 3.8), in one wave of BACKWARD_PROGRAMS[16]
(132) programs (Small's 8 x 8: 16 shares of 8 tiles x 8 blocks). Static estimate with the reduction (fp16,
fp32 weights, batch 128, us): 1024 channels at 8 x 8 76-125 -> 48-72 (L1 pipe + latency 72-75 ->
63-66); 512, 640, 768 at 7 x 7 41-67 -> 26-39, 48-78 -> 31-46, 55-90 -> 36-54; its exposed waits
halve. On sm_80 the L1 pipe term rises (1024 at 8 x 8: sum 141 -> 169) while the max model falls
(152-258 -> 119-168): G = 4 kept there. Shapes alone decide (and at these maps whether the GPU is
sm_90 or later), so dw's bits do not depend on the particular device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .._cost import KernelCost, Loop
from .._launch import (FORCED_TAP_ORDER, GROUP_WIDTH, MAXNREG, cdiv, conflict_free_tap_order, device_info,
                       launch, next_power_of_2)
from .kernel import (
    _gconv_backward_kernel,
    _gconv_dgrad_s2_kernel,
    _gconv_fwd_kernel,
    _gconv_wgrad_kernel,
    _wgrad_reduce_kernel,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE_ELEMS = {2: 512, 4: 256}  # G x BM by element size: a 16 KB [G, BM, 16] tap-pair operand
# The forward kernel (forward, stride-1 dgrad) and the fused backward: 32 KB tap pairs at 16-bit (module
# docstring: Tiles)
FWD_TILE_ELEMS = {2: 1024, 4: 256}
# fp32 wgrad: an eighth of that. Its five accumulators plus 3xTF32 operands (each split in two) spilled
# 8-232 B at 256 elements and up to 32 B at 128 (sm_90 and sm_80); fp32 is the checking path.
WGRAD_FP32_ELEMS = 64
NUM_WARPS = 4
# The register limit of the forward kernel's plain and BIAS_SILU launches (not MOMENTS'). BIAS_SILU: left
# to ptxas, a one-tile program at 8x8 (Small's blocks at batch 2-8) took 128 registers and spilled 8 B in
# its tile loop (sm_90, Triton 3.8); at 255 it takes 240 and spills nothing, and the static estimate at
# batch 128 is the same or lower (8x8 30.6-42.9 -> 29.2-41.5 us, 16x16 79.6-104.0 -> 80.6-105.0). Plain
# (the MBConv training backward's recompute of d): Triton 3.8 gave the 1024-channel 16x16 and 8x8 convs
# 167 registers for three programs per SM, whose SASS waits longer on its loads (latency term 48 -> 40
# and 18 -> 11 us); at 255 they take 254-255, as Triton 3.6 does unasked. Static estimate, fp16, batch 128,
# sm_90, high end: 97.3 -> 81.3 and 36.0 -> 22.8 us; over the four models' 44 shapes 3.27 -> 3.04 ms
# (sm_80 4.63 -> 4.56, Triton 3.6 3.18 -> 3.14, fp32 22.6 -> 21.1), no stack. Not for MOMENTS or the
# stride-1 dgrad, already at 254-255 registers: there the limit only reorders ptxas' schedule, and their
# estimates rose (the moments at 16x16 93.8 -> 102.6 us, Triton 3.6's dgrad 81.3 -> 92.8).
FWD_MAXNREG = MAXNREG
NUM_STAGES = 1  # no cp.async: a 16-byte cp.async is always .cg (L2 only), the windows must hit L1
MIN_SHARE_PIXELS = 1024  # output pixels per wgrad share at least (partials <= ~7 % of the traffic)
WGRAD_PROGRAMS = 1024  # wgrad shares x channel blocks at most, unless a share would fall below the minimum
# Fused backward (module docstring): pixels a tile at most, pixels a share at least where shares are
# shortened, and the programs the grid should reach (H100: 132 SMs x 3 or 5 programs) by G. G = 4 two
# waves: at one, the ConvFirst training blocks' 72 and 96 channels at 32x32 ran 384 programs, one full
# round and a third (static estimate, Small, batch 128, sm_90: 92 -> 75 us with 768; on sm_80 the 8x8
# and 7x7 MBConv convs, G = 4 there, 182 -> 156 and 135 -> 108 us, the 32x32 ones 108 -> 114)
BACKWARD_MAX_BLOCK_M = {16: 64, 8: 128, 4: 128, 2: 128}
BACKWARD_MIN_SHARE_PIXELS = 256
BACKWARD_PROGRAMS = {16: 132, 8: 396, 4: 792, 2: 660}
# The order in which every kernel loads its tap pairs (kernel.py ``load_tap_pair``), which decides the
# bank conflicts of the pair's copy to shared memory for the batched mma.sync: compiled for sm_90 at
# Small's 1024-channel 16x16 training map (fp16, fp32 master weights), order 0 takes the forward's
# shared wavefronts to 2.9x (Triton 3.6) and 3.9x (3.8) of their conflict-free count and the fused
# backward's to 1.8x and 1.6x; conflict_free_tap_order() takes every kernel's to 1.0-1.08x (on 3.6 with
# the weights and wgrad's dy tile loaded permuted too; test_gconv.py checks the tap copies). The
# static model's L1-pipe term of the two launches falls from 155-162 and 305-318 us to 89-93 and 166-173
# (3.6), their latency term from 101-105 and 186-194 to 69-72 and 143-149. Shipped on the H200's
# measurement of the same change in the MBConv hidden kernel (kernels/mbconv/launcher.py,
# docs/cost-model.md); a GPU run must confirm it here (scripts/gpu_gconv.py times both orders).
# None: conflict_free_tap_order(); 0, 1 or 2 (CONVFIRSTNET_TAP_ORDER) force one.
TAP_ORDER = FORCED_TAP_ORDER
WGRAD_MIN_PROGRAMS = 132  # the SMs of an H100: a wgrad grid of full shares below this takes G = 4 for G = 8
# Partials reduction: BLOCK dw elements per program, SB shares per step ([SB, BLOCK] = 4096 fp32, 32 per
# thread): up to 1024 shares take 16 steps of independent loads (a share-by-share loop would be a chain
# of 1024 dependent load latencies). Compiled with maxnreg (_launch.MAXNREG): left to ptxas (Triton 3.8) it
# took 40-64 registers and waited on fewer loads at a time; Small's training step, static estimate, batch
# 128, high end, its MBConv and ConvFirst blocks' reductions: sm_90 0.75 + 0.28 -> 0.52 + 0.21 ms, Triton
# 3.6 0.94 + 0.49 -> 0.56 + 0.21, sm_80 1.00 + 0.46 -> 0.63 + 0.26
REDUCE_BLOCK = 64
REDUCE_SB = 64
# Under the interpreter (CPU tensors) programs run one after another at ~10 ms each whatever their
# size: one wide program per 2048 dw elements. Shares of 2 tiles and reduction steps of 2 shares, so
# that the small maps the tests can afford run every wgrad loop more than once (the same code as the
# GPU's, other constexprs).
INTERPRETER_REDUCE_BLOCK = 2048
INTERPRETER_REDUCE_SB = 2
INTERPRETER_SHARE_TILES = 2
INTERPRETER_TPP = 2
# Forward and stride-1 dgrad: up to FWD_MAX_TPP tiles per program, its weights loaded once for them (each
# program's copies of its five weight operands to shared memory for the mma.sync, and their load waits,
# were 40 % of the exposed waits of a one-tile program at Small's 1024-channel 16x16 training map), as
# long as at least FWD_MIN_PROGRAMS programs remain (132 SMs x 3 resident 4-warp programs x 2 rounds)
FWD_MAX_TPP = 8
FWD_MIN_PROGRAMS = 792
# G = 16 (module docstring: Tiles; 255 registers, two resident programs per SM): 132 x 3, 1.5 rounds
FWD_MIN_PROGRAMS_G16 = 396
SMALL_MAP_G16 = True  # small_map_g16 (False: G = 8 forward tiles and wgrad's G in the fused backward)

# The grouped 3x3 convs of the four models' training form, (channels, map side) at a 224 x 224 input
# (tests check this against the models). All run at stride 1: the stride-2 blocks convolve at their
# input resolution before BlurPool. ConvFirst blocks convolve their input width (stages 1-3), MBConv
# blocks their hidden width 4C (stages 4-5). At 256 x 256 (evaluation) every side is 8/7 of these.
MODEL_SHAPES: dict[str, tuple[tuple[int, int], ...]] = {
    "pico": ((16, 112), (32, 56), (48, 28), (192, 28), (512, 14), (512, 7)),
    "nano": ((24, 112), (48, 56), (64, 28), (256, 28), (640, 14), (640, 7)),
    "tiny": ((24, 112), (48, 56), (72, 28), (288, 28), (768, 14), (768, 7)),
    "small": ((32, 112), (64, 56), (96, 28), (384, 28), (1024, 14), (1024, 7)),
}


@dataclass(frozen=True)
class TileConfig:
    """One compiled variant of a kernel: the constexprs and launch options."""

    g: int  # groups per program (8g channels)
    tile_h: int
    tile_w: int
    num_warps: int
    num_stages: int
    precision: str  # tl.dot input_precision

    @property
    def block_m(self) -> int:
        return self.tile_h * self.tile_w

    @property
    def channels(self) -> int:
        return GROUP_WIDTH * self.g


# Relative issue cost per output element of a block of G groups (fp16 forward, sm_90 SASS weighted by
# the static cost model: 0.71, 0.68, 0.85 and 2.05 warp-instructions per output at G = 8, 4, 2, 1):
# per-pixel work (addresses, masks) is shared by the G groups of a block, so small blocks cost more.
G_ISSUE = {8: 1.0, 4: 1.0, 2: 1.2, 1: 2.9}


def groups_per_program(c: int) -> int:
    """Groups per channel block: the G with the least issue per real output, G_ISSUE[G] times the
    padding of C / 8 groups up to a multiple of G (masked groups): 16 -> 2, 24 -> 4 (one masked group),
    48 -> 2, 72 -> 4 (three masked), 96 -> 4, 288 -> 4, multiples of 64 -> 8."""
    groups = c // GROUP_WIDTH
    return min(G_ISSUE, key=lambda g: (G_ISSUE[g] * cdiv(groups, g) * g / groups, -g))


def precision_for(dtype: torch.dtype) -> str:
    # fp32 operands: 3xTF32 (~fp32 accuracy); 16-bit operands ignore it
    return "tf32x3" if dtype == torch.float32 else "tf32"


def tile_config(c: int, ho: int, wo: int, dtype: torch.dtype, wgrad: bool = False, g: int | None = None,
                max_block_m: int | None = None, elems: dict[int, int] = TILE_ELEMS) -> TileConfig:
    """Tiles for a C-channel conv over HO x WO positions (output pixels; stride-2 dgrad: 2x2 quads), with
    ``g`` groups per program (default: groups_per_program), at most ``max_block_m`` pixels a tile, and
    G x BM = ``elems`` by element size (TILE_ELEMS; the forward kernel's FWD_TILE_ELEMS)."""
    g = g or groups_per_program(c)
    elems = WGRAD_FP32_ELEMS if wgrad and dtype == torch.float32 else elems[dtype.itemsize]
    bm = max(16, elems // g)
    if max_block_m:
        bm = min(bm, max_block_m)
    tw = min(8 if bm <= 64 else 16, max(8, next_power_of_2(wo)))
    th = min(bm // tw, max(2, next_power_of_2(ho)))
    return TileConfig(g, th, tw, NUM_WARPS, NUM_STAGES, precision_for(dtype))


def fwd_tile_config(c: int, ho: int, wo: int, dtype: torch.dtype) -> TileConfig:
    """The forward kernel's tiles (forward, stride-1 dgrad): FWD_TILE_ELEMS at G >= 4, TILE_ELEMS at G = 2
    (module docstring: Tiles)."""
    if small_map_g16(c, ho, wo, dtype):
        return tile_config(c, ho, wo, dtype, g=16, elems=FWD_TILE_ELEMS)
    g = groups_per_program(c)
    return tile_config(c, ho, wo, dtype, g=g, elems=FWD_TILE_ELEMS if g >= 4 else TILE_ELEMS)


def small_map_g16(c: int, h: int, w: int, dtype: torch.dtype) -> bool:
    """Whether a map smaller than the G = 8 tile (8 x 8, 7 x 7: 64 pixels, 16 KB pairs) takes G = 16 (128
    channels, 32 KB pairs) in the forward kernel and the fused backward (module docstring: Tiles;
    SMALL_MAP_G16 False: never, the form before)."""
    return (SMALL_MAP_G16 and groups_per_program(c) == 8 and dtype.itemsize == 2 and c % 128 == 0
            and 2 * 8 * tile_config(c, h, w, dtype, g=8, elems=FWD_TILE_ELEMS).block_m <= FWD_TILE_ELEMS[2])


def _tiles(n: int, ho: int, wo: int, cfg: TileConfig) -> int:
    return n * cdiv(ho, cfg.tile_h) * cdiv(wo, cfg.tile_w)


def tiles_per_program(n: int, c: int, ho: int, wo: int, cfg: TileConfig, interpreter: bool = False) -> int:
    """Tiles per forward / stride-1 dgrad program (kernel.py ``TPP``: its weights loaded once for them):
    the largest power of two up to FWD_MAX_TPP that divides the tiles (every program runs as many) and
    leaves at least FWD_MIN_PROGRAMS programs; INTERPRETER_TPP under the interpreter where it divides.
    One at G = 2 (Pico's 16 channels, 16 x 16 tiles): with the tile loop it took 252-255 registers."""
    tiles, cblocks = _tiles(n, ho, wo, cfg), cdiv(c, cfg.channels)
    if cfg.g < 4:
        return 1
    if interpreter:
        return INTERPRETER_TPP if tiles % INTERPRETER_TPP == 0 else 1
    tpp, least = 1, FWD_MIN_PROGRAMS_G16 if cfg.g == 16 else FWD_MIN_PROGRAMS
    while (2 * tpp <= FWD_MAX_TPP and tiles % (2 * tpp) == 0
           and tiles // (2 * tpp) * cblocks >= least):
        tpp *= 2
    return tpp


def wgrad_shares(tiles: int, cblocks: int, block_m: int, interpreter: bool = False) -> tuple[int, int]:
    """(tiles per share, shares) for ``tiles`` tiles of ``block_m`` pixels and ``cblocks`` channel blocks."""
    if interpreter and INTERPRETER_SHARE_TILES:
        per_share = INTERPRETER_SHARE_TILES
    else:
        per_share = max(cdiv(MIN_SHARE_PIXELS, block_m),
                        cdiv(tiles * cblocks, WGRAD_PROGRAMS))
    per_share = min(per_share, max(1, tiles))
    return per_share, cdiv(tiles, per_share)


def wgrad_tile_config(n: int, c: int, ho: int, wo: int, dtype: torch.dtype, stride: int = 1) -> TileConfig:
    """Wgrad's tiles: tile_config's (the forward kernel's at stride 1 where C is whole groups of G = 4),
    or G = 4 for G = 8 where G = 8's grid of full shares (at least MIN_SHARE_PIXELS pixels each) has fewer
    than WGRAD_MIN_PROGRAMS programs and G = 4's has more (module docstring). The GPU's share rule decides,
    also under the interpreter: shapes alone choose the tiles."""
    cfg = tile_config(c, ho, wo, dtype, wgrad=True)
    if cfg.g == 4 and stride == 1 and c % cfg.channels == 0:
        return tile_config(c, ho, wo, dtype, wgrad=True, elems=FWD_TILE_ELEMS)

    def programs(cfg: TileConfig) -> tuple[int, int]:
        cblocks = cdiv(c, cfg.channels)
        per_share, shares = wgrad_shares(_tiles(n, ho, wo, cfg), cblocks, cfg.block_m)
        return per_share * cfg.block_m, shares * cblocks

    if cfg.g != 8:
        return cfg
    pixels, count = programs(cfg)
    if count >= WGRAD_MIN_PROGRAMS or pixels < MIN_SHARE_PIXELS:
        return cfg
    half = tile_config(c, ho, wo, dtype, wgrad=True, g=4)
    return half if programs(half)[1] > count else cfg


def backward_config(n: int, c: int, h: int, w: int, dtype: torch.dtype, interpreter: bool = False,
                    arch: int = 90) -> tuple[TileConfig, int, int]:
    """The fused backward's tiles and shares on a GPU of compute capability ``arch`` (x 10): (config, tiles
    per share, shares) (module docstring)."""
    g = 16 if arch >= 90 and small_map_g16(c, h, w, dtype) else wgrad_tile_config(n, c, h, w, dtype).g
    cfg = tile_config(c, h, w, dtype, wgrad=True, g=g, max_block_m=BACKWARD_MAX_BLOCK_M[g],
                      elems=FWD_TILE_ELEMS)
    cfg = dataclasses.replace(cfg, num_warps=min(g, 8))  # one warp per group, two at G = 16 (docstring)
    tiles, cblocks = _tiles(n, h, w, cfg), cdiv(c, cfg.channels)
    per_share, shares = wgrad_shares(tiles, cblocks, cfg.block_m, interpreter)
    wave = BACKWARD_PROGRAMS[cfg.g]
    if not (interpreter and INTERPRETER_SHARE_TILES) and shares * cblocks < wave:
        # shorter shares: as many programs as one wave holds
        per_share = max(cdiv(BACKWARD_MIN_SHARE_PIXELS, cfg.block_m),
                        cdiv(tiles, max(1, wave // cblocks)))
        per_share = min(per_share, tiles)
        shares = cdiv(tiles, per_share)
    return cfg, per_share, shares


# ------------------------------------------------------------------------------------------------
# Checks and layouts
# ------------------------------------------------------------------------------------------------


def check_supported(op: str, x: torch.Tensor) -> None:
    """Kernel limits beyond the op's checks, raised before any allocation or launch."""
    if x.dtype not in DTYPES:
        raise TypeError(f"convfirstnet.{op}: the Triton kernels run float16, bfloat16 and float32, "
                        f"got {x.dtype}")
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        # Triton's interpreter computes bf16 tl.dot wrongly (KERNEL-NOTES)
        raise TypeError(
            f"convfirstnet.{op}: bfloat16 through the Triton interpreter gives wrong tl.dot results; "
            "use float16/float32, or CONVFIRSTNET_KERNELS=reference on CPU"
        )


def reads_in_place(x: torch.Tensor, offset: bool = True) -> bool:
    """True when the kernels read x through its strides: unit channel stride, the other strides and the
    storage offset multiples of 8 elements (16-byte vectors of 8 channels): channels-last and its crops.
    ``offset=False``: the strides only (the launcher copies a misaligned crop)."""
    s = x.stride()
    aligned = x.storage_offset() % 8 == 0 if offset else True
    return s[1] == 1 and s[0] % 8 == 0 and s[2] % 8 == 0 and s[3] % 8 == 0 and aligned


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    return x if reads_in_place(x) else x.contiguous(memory_format=torch.channels_last)


def _vector_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """x's N, H, W strides in units of 8 elements (the kernels' 16-byte channel vectors; reads_in_place)."""
    return x.stride(0) // 8, x.stride(2) // 8, x.stride(3) // 8


def _residual_map(residual: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """A residual added to dx (the fused training blocks' dout): dx's shape and dtype, channels-last."""
    assert tuple(residual.shape) == tuple(dx.shape) and residual.dtype == dx.dtype
    return residual.contiguous(memory_format=torch.channels_last)


def _out_hw(h: int, w: int, stride: int) -> tuple[int, int]:
    return (h + stride - 1) // stride, (w + stride - 1) // stride


# ------------------------------------------------------------------------------------------------
# Launches
# ------------------------------------------------------------------------------------------------


def tap_order() -> int:
    """The kernels' TAPS (kernel.py ``load_tap_pair``): ``TAP_ORDER``, or the conflict-free order when it
    is None."""
    return conflict_free_tap_order() if TAP_ORDER is None else TAP_ORDER


def _meta(cfg: TileConfig, c: int) -> dict:
    """The constexprs and launch options every conv kernel takes."""
    return dict(G=cfg.g, MASK_C=c % cfg.channels != 0, TH=cfg.tile_h, TW=cfg.tile_w, PRECISION=cfg.precision,
                TAPS=tap_order(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _forward(x: torch.Tensor, w: torch.Tensor, stride: int, shift: torch.Tensor | None,
             bias: torch.Tensor | None = None, silu: int = 0, pool: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward kernel's launch: (y, None); with ``shift`` (MOMENTS) (y, the moment rows); with ``bias``
    (BIAS_SILU) (SiLU(y + bias), None), and ``pool`` (POOL) (SiLU(y + bias), the tiles' pools)."""
    n, c, h, wd = x.shape
    ho, wo = _out_hw(h, wd, stride)
    y = torch.empty((n, c, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    cfg = fwd_tile_config(c, ho, wo, x.dtype)
    tiles = _tiles(n, ho, wo, cfg)
    f32 = dict(dtype=torch.float32, device=x.device)
    pools = torch.empty((tiles, c), **f32) if pool else None
    if y.numel() == 0:
        return y, pools if shift is None else torch.empty((0, 2, c), **f32)
    x = _nhwc(x)
    tpp = tiles_per_program(n, c, ho, wo, cfg, x.device.type == "cpu")
    grid = (cdiv(tiles, tpp), cdiv(c, cfg.channels))
    parts = None if shift is None else torch.empty((grid[0], 2, c), **f32)

    def cost() -> KernelCost:
        base = conv_cost("forward", cfg, n, c, h, wd, stride, x.element_size(), w.element_size(), tpp=tpp)
        if shift is not None:
            return dataclasses.replace(base, dram_bytes=base.dram_bytes + c * 4 + grid[0] * 2 * c * 4,
                                       note=base.note + "; a BatchNorm's moments per program")
        if bias is not None:
            extra = c * bias.element_size() + (tiles * c * 4 if pool else 0)
            note = "; bias + SiLU" + (", the tiles' pools" if pool else "")
            return dataclasses.replace(base, dram_bytes=base.dram_bytes + extra, note=base.note + note)
        return base

    launch(_gconv_fwd_kernel, grid, x, w, y, None, shift, parts, bias, pools, h, wd, ho, wo, c // GROUP_WIDTH,
           tiles, *_vector_strides(x), *w.stride(), STRIDE=stride, FLIP=False, RESIDUAL=False, TPP=tpp,
           MOMENTS=shift is not None, BIAS_SILU=bias is not None, POOL=pool, SILU=silu, **_meta(cfg, c),
           cost=cost, **(dict(maxnreg=FWD_MAXNREG) if shift is None else {}))
    return y, parts if bias is None else pools


def gconv3x3_triton(x: torch.Tensor, w: torch.Tensor, stride: int) -> torch.Tensor:
    """Forward: (N, C, H, W) -> (N, C, H', W') NHWC in x's dtype."""
    check_supported("gconv3x3", x)
    return _forward(x, w, stride, None)[0]


def gconv3x3_silu_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, silu: int, pool: bool
                         ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Stride-1 forward with a bias and SiLU after it (the folded MBConv's conv, kernels/mbconv/staged.py):
    (y, pools, tiles per image), y = SiLU(conv(x) + bias) in x's dtype; ``pool``: pools (N tiles per
    image, C) fp32, row t the sums of y over tile t's pixels (before the rounding; the tiles are numbered
    image by image), otherwise None. ``silu``: the activation's form (1: inline asm, GPU 16-bit only)."""
    check_supported("gconv3x3", x)
    n, c, h, wd = x.shape
    if bias.shape != (c,):
        raise ValueError(f"gconv3x3 + SiLU: a ({c},) bias, got {tuple(bias.shape)}")
    y, pools = _forward(x, w, 1, None, bias, silu, pool)
    return y, pools, _tiles(1, h, wd, fwd_tile_config(c, h, wd, x.dtype))


def moments_rows(n: int, c: int, h: int, w: int, dtype: torch.dtype, interpreter: bool = False) -> int | None:
    """Pixels per row of ``gconv3x3_moments_triton``'s moments (each program's tiles, all full), or None
    where a program's tiles would hold masked pixels (a map its tiles do not cover exactly)."""
    cfg = fwd_tile_config(c, h, w, dtype)
    if h % cfg.tile_h or w % cfg.tile_w:
        return None
    return cfg.block_m * tiles_per_program(n, c, h, w, cfg, interpreter)


def gconv3x3_moments_triton(x: torch.Tensor, w: torch.Tensor, shift: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stride-1 forward with a following BatchNorm's moments: (y, parts), parts (rows, 2, C) fp32, row
    i the sums of y - shift and of its square (y as stored) over program i's ``moments_rows`` pixels
    (kernels/mbconv/moments.py ``bn_d_stats`` takes them as it takes one image's). y is the forward's, bit
    for bit. Only where ``moments_rows`` is not None."""
    check_supported("gconv3x3", x)
    n, c, h, wd = x.shape
    if moments_rows(n, c, h, wd, x.dtype, x.device.type == "cpu") is None or shift.shape != (c,):
        raise ValueError(f"gconv3x3 moments: a {h} x {wd} map its tiles cover exactly and a ({c},) shift, "
                         f"got shift {tuple(shift.shape)}")
    return _forward(x, w, 1, shift)


def gconv3x3_dgrad_triton(dy: torch.Tensor, w: torch.Tensor, h: int, wd: int, stride: int,
                          residual: torch.Tensor | None = None) -> torch.Tensor:
    """Input gradient: dy (N, C, H', W') -> dx (N, C, H, W) NHWC in dy's dtype. ``residual`` (stride 1; an
    (N, C, H, W) map in dy's dtype): added to dx in fp32 before dx is rounded and stored (the fused
    training blocks' dx = dout + dgrad(da) in one pass)."""
    check_supported("gconv3x3_dgrad", dy)
    n, c, ho, wo = dy.shape
    dx = torch.empty((n, c, h, wd), dtype=dy.dtype, device=dy.device, memory_format=torch.channels_last)
    if dx.numel() == 0:
        return dx
    dy = _nhwc(dy)
    if residual is not None:
        assert stride == 1
        residual = _residual_map(residual, dx)
    sizes = (h, wd, ho, wo, c // GROUP_WIDTH)
    strides = (*_vector_strides(dy), *w.stride())
    # stride 1: tiles of dx pixels; stride 2: tiles of positions (a, b), each the 2x2 input pixels
    # (2a + py, 2b + px), i.e. tiles over the H' x W' map
    cfg = fwd_tile_config(c, ho, wo, dy.dtype) if stride == 1 else tile_config(c, ho, wo, dy.dtype)
    tiles, cblocks = _tiles(n, ho, wo, cfg), cdiv(c, cfg.channels)
    eb, wb = dy.element_size(), w.element_size()
    if stride == 1:
        tpp = tiles_per_program(n, c, ho, wo, cfg, dy.device.type == "cpu")
        kind = "dgrad s1" if residual is None else "dgrad s1 + residual"
        # residual None: a constexpr (RESIDUAL), never read
        launch(_gconv_fwd_kernel, (cdiv(tiles, tpp), cblocks), dy, w, dx, residual, None, None, None, None,
               *sizes, tiles, *strides, STRIDE=1, FLIP=True, RESIDUAL=residual is not None, TPP=tpp,
               MOMENTS=False, BIAS_SILU=False, POOL=False, SILU=0, **_meta(cfg, c),
               cost=lambda: conv_cost(kind, cfg, n, c, h, wd, 1, eb, wb, residual=residual is not None,
                                      tpp=tpp))
    else:
        launch(_gconv_dgrad_s2_kernel, (tiles, cblocks), dy, w, dx, *sizes, *strides, **_meta(cfg, c),
               cost=lambda: conv_cost("dgrad s2", cfg, n, c, h, wd, 2, eb, wb))
    return dx


def gconv3x3_wgrad_triton(
    dy: torch.Tensor, x: torch.Tensor, stride: int, out_dtype: torch.dtype, deterministic: bool = True
) -> torch.Tensor:
    """Weight gradient (C, 8, 3, 3) in ``out_dtype`` from x (N, C, H, W) and dy (N, C, H', W'): fp32
    partial sums per share (module docstring), reduced in a fixed order by a second launch, or (not
    ``deterministic``) added with fp32 atomics into a zeroed fp32 buffer."""
    check_supported("gconv3x3_wgrad", x)
    n, c, h, wd = x.shape
    ho, wo = dy.shape[2:]
    if n * ho * wo == 0:
        return torch.zeros((c, GROUP_WIDTH, 3, 3), dtype=out_dtype, device=x.device)
    x, dy = _nhwc(x), _nhwc(dy)
    cfg = wgrad_tile_config(n, c, ho, wo, x.dtype, stride)
    tiles = _tiles(n, ho, wo, cfg)
    cblocks = cdiv(c, cfg.channels)
    interpreter = x.device.type == "cpu"
    per_share, shares = wgrad_shares(tiles, cblocks, cfg.block_m, interpreter)
    total = c * GROUP_WIDTH * 9
    args = (h, wd, ho, wo, c // GROUP_WIDTH, tiles, per_share, *_vector_strides(x), *_vector_strides(dy))
    cost = lambda: wgrad_cost(cfg, n, c, h, wd, stride, x.element_size(), per_share, shares, deterministic)
    if not deterministic:
        dw32 = torch.zeros((c, GROUP_WIDTH, 3, 3), dtype=torch.float32, device=x.device)
        launch(_gconv_wgrad_kernel, (shares, cblocks), x, dy, dw32, *args, STRIDE=stride, ATOMIC=True,
               **_meta(cfg, c), cost=cost)
        return dw32.to(out_dtype)
    partials = torch.empty((shares, c, GROUP_WIDTH, 3, 3), dtype=torch.float32, device=x.device)
    dw = torch.empty((c, GROUP_WIDTH, 3, 3), dtype=out_dtype, device=x.device)
    launch(_gconv_wgrad_kernel, (shares, cblocks), x, dy, partials, *args, STRIDE=stride, ATOMIC=False,
           **_meta(cfg, c), cost=cost)
    block, sb = (INTERPRETER_REDUCE_BLOCK, INTERPRETER_REDUCE_SB) if interpreter else (REDUCE_BLOCK,
                                                                                       REDUCE_SB)
    reduce_partials(partials, dw, shares, total, block=block, sb=sb)
    return dw


def gconv3x3_backward_triton(dy: torch.Tensor, w: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype,
                             deterministic: bool = True, residual: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of a stride-1 conv from one read of dy: (dx (N, C, H, W) NHWC in dy's dtype,
    dw (C, 8, 3, 3) in ``out_dtype``). One launch over wgrad's tiles and shares (dgrad of each tile
    stored, wgrad partials per share), then wgrad's fixed-order reduction (or, not ``deterministic``,
    fp32 atomics into a zeroed buffer). ``residual`` (an (N, C, H, W) map in dy's dtype): added to dx in
    fp32 before dx is rounded and stored, as ``gconv3x3_dgrad_triton``'s (the fused ConvFirst training
    blocks' dx = dout + dgrad(da))."""
    check_supported("gconv3x3_backward", x)
    n, c, h, wd = x.shape
    dx = torch.empty((n, c, h, wd), dtype=dy.dtype, device=dy.device, memory_format=torch.channels_last)
    if dx.numel() == 0:
        return dx, torch.zeros((c, GROUP_WIDTH, 3, 3), dtype=out_dtype, device=x.device)
    x, dy = _nhwc(x), _nhwc(dy)
    if residual is not None:
        residual = _residual_map(residual, dx)
    interpreter = x.device.type == "cpu"
    cfg, per_share, shares = backward_config(n, c, h, wd, x.dtype, interpreter, device_info(x.device).arch)
    tiles = _tiles(n, h, wd, cfg)
    cblocks = cdiv(c, cfg.channels)
    args = (h, wd, c // GROUP_WIDTH, tiles, per_share, *_vector_strides(dy), *_vector_strides(x), *w.stride())
    cost = lambda: backward_cost(cfg, n, c, h, wd, x.element_size(), w.element_size(), per_share, shares,
                                 deterministic, residual is not None)
    res = residual if residual is not None else dx  # RESIDUAL False: a constexpr, never read
    if not deterministic:
        dw32 = torch.zeros((c, GROUP_WIDTH, 3, 3), dtype=torch.float32, device=x.device)
        launch(_gconv_backward_kernel, (shares, cblocks), dy, x, w, dx, res, dw32, *args, ATOMIC=True,
               RESIDUAL=residual is not None, **_meta(cfg, c), cost=cost)
        return dx, dw32.to(out_dtype)
    partials = torch.empty((shares, c, GROUP_WIDTH, 3, 3), dtype=torch.float32, device=x.device)
    dw = torch.empty((c, GROUP_WIDTH, 3, 3), dtype=out_dtype, device=x.device)
    launch(_gconv_backward_kernel, (shares, cblocks), dy, x, w, dx, res, partials, *args, ATOMIC=False,
           RESIDUAL=residual is not None, **_meta(cfg, c), cost=cost)
    block, sb = (INTERPRETER_REDUCE_BLOCK, INTERPRETER_REDUCE_SB) if interpreter else (REDUCE_BLOCK,
                                                                                       REDUCE_SB)
    reduce_partials(partials, dw, shares, c * GROUP_WIDTH * 9, block=block, sb=sb,
                    what="gconv3x3 backward wgrad")
    return dx, dw


def reduce_partials(partials: torch.Tensor, out: torch.Tensor, shares: int, total: int, *, block: int,
                    sb: int, out2: torch.Tensor | None = None, partials_in_l2: bool = False,
                    what: str = "gconv3x3 wgrad") -> None:
    """out[i] = sum over s of partials[s, i] (fp32, s in a fixed order: bitwise reproducible), for the
    ``total`` elements of each of ``shares`` partial rows; ``sb`` rows at a time, ``block`` elements per
    program. The deterministic second stage of every weight gradient summed from per-share partials.
    With ``out2``, the elements from out.numel() on go to out2 (two results of their own, as a custom
    op's outputs must be, from one launch). ``partials_in_l2``: the partials were written by the launch
    just before and fit L2, so their read is L2 traffic (else DRAM)."""
    split = out.numel() if out2 is not None else total
    launch(_wgrad_reduce_kernel, (cdiv(total, block),), partials, out, out if out2 is None else out2,
           shares, total, split, SB=sb, BLOCK=block, TWO=out2 is not None, num_warps=NUM_WARPS,
           maxnreg=MAXNREG,
           cost=lambda: reduce_cost(shares, total, sb, out.element_size(), partials_in_l2, what))


# ------------------------------------------------------------------------------------------------
# Cost declarations (kernels/_cost.py)
# ------------------------------------------------------------------------------------------------


def _passes(cfg: TileConfig) -> int:
    """Tensor-core products per dot: 3xTF32 (fp32 operands) issues three (hi x hi, hi x lo, lo x hi)."""
    return 3 if cfg.precision == "tf32x3" else 1


def useful_macs(n: int, c: int, h: int, w: int, stride: int) -> int:
    """72 MACs per output element (9 taps x 8 channels): the forward's count, and dgrad's and wgrad's
    (each multiplies every output-gradient element by the same 72 weights or inputs)."""
    ho, wo = _out_hw(h, w, stride)
    return n * ho * wo * c * 9 * GROUP_WIDTH


def window_pixels(cfg: TileConfig, stride: int, positions: bool = False) -> int:
    """Input pixels under the nine taps of one TH x TW tile of outputs at ``stride`` (``positions``: the
    stride-2 dgrad's tile of positions, whose dy windows span (TH + 1) x (TW + 1))."""
    if positions:
        return (cfg.tile_h + 1) * (cfg.tile_w + 1)
    return ((cfg.tile_h - 1) * stride + 3) * ((cfg.tile_w - 1) * stride + 3)


def _l1_declaration(cfg: TileConfig, window: int, tile_reads: int, eb: int, wb: int, tiles: int = 1,
                    weights: bool = True) -> dict:
    """The L1 part of a declaration: the tap windows are plain ld.global (LDG.E.128, allocated in L1; the
    compile test pins it), so the nine taps of a tile fetch its halo window from L2 once and re-read it
    from L1; the maps read once per tile (a residual, wgrad's dy) and the program's weights once. Per
    program, ``tiles`` tiles; in L1 at one time, one tile's window and reads and the weights."""
    ch = cfg.channels
    tile = eb * ch * (window + tile_reads * cfg.block_m)
    w = wb * ch * GROUP_WIDTH * 9 if weights else 0
    return dict(l1_unique_bytes_per_program=tiles * tile + w, l1_working_set_bytes=tile + w)


def conv_cost(kind: str, cfg: TileConfig, n: int, c: int, h: int, w: int, stride: int, eb: int, wb: int,
              residual: bool = False, tpp: int = 1) -> KernelCost:
    """Forward or dgrad: x (dy) read once, y (dx) written once (and a residual map read once), the weights
    once; five [G, BM, 16] x [G, 16, 8] steps per program (per tile of positions for stride-2 dgrad)."""
    ho, wo = _out_hw(h, w, stride)
    programs = _tiles(n, ho, wo, cfg) * cdiv(c, cfg.channels)  # of one tile each (mma_macs)
    # forward and stride-1 dgrad: ``tpp`` tiles per program, as launched (tiles_per_program)
    loops = () if kind == "dgrad s2" else (Loop("tiles", tpp, (Loop("taps", 5),)),)
    # the stride-1 dgrad is the forward's kernel at stride 1 over dy; the stride-2 dgrad gathers dy windows
    window = window_pixels(cfg, 1 if kind.startswith("dgrad s1") else stride, positions=kind == "dgrad s2")
    return KernelCost(
        useful_macs=useful_macs(n, c, h, w, stride),
        mma_macs=programs * 5 * cfg.g * cfg.block_m * 16 * 8 * _passes(cfg),
        dram_bytes=eb * n * c * (h * w + ho * wo + (h * w if residual else 0)) + wb * c * GROUP_WIDTH * 9,
        loops=loops,
        note=f"gconv3x3 {kind} C={c} G={cfg.g} tile {cfg.tile_h}x{cfg.tile_w}",
        **_l1_declaration(cfg, window, 1 if residual else 0, eb, wb, tiles=tpp),
    )


def wgrad_cost(cfg: TileConfig, n: int, c: int, h: int, w: int, stride: int, eb: int, per_share: int,
               shares: int, deterministic: bool) -> KernelCost:
    """Wgrad partials: x and dy read once, the fp32 partials written once (atomics: added in L2, the fp32
    dw written once); five [G, 16, BM] x [G, BM, 8] dots per tile."""
    ho, wo = _out_hw(h, w, stride)
    tiles = _tiles(n, ho, wo, cfg)
    cblocks = cdiv(c, cfg.channels)
    partials = shares if deterministic else 1
    return KernelCost(
        useful_macs=useful_macs(n, c, h, w, stride),
        mma_macs=tiles * cblocks * 5 * cfg.g * 16 * cfg.block_m * 8 * _passes(cfg),
        dram_bytes=eb * n * c * (h * w + ho * wo) + 4 * partials * c * GROUP_WIDTH * 9,
        loops=(Loop("tiles", per_share),),
        **_l1_declaration(cfg, window_pixels(cfg, stride), 1, eb, 0, tiles=per_share, weights=False),
        note=f"gconv3x3 wgrad C={c} G={cfg.g} tile {cfg.tile_h}x{cfg.tile_w}, {shares} shares of "
             f"{per_share} tiles"
             + ("" if deterministic else " (atomics)"),
    )


def backward_cost(cfg: TileConfig, n: int, c: int, h: int, w: int, eb: int, wb: int, per_share: int,
                  shares: int, deterministic: bool, residual: bool = False) -> KernelCost:
    """The fused stride-1 backward: dy and x read once, dx written once, the weights once, the fp32
    partials written once (atomics: the fp32 dw); per tile the dgrad's five [G, BM, 16] x [G, 16, 8] steps
    and the wgrad's five [G, 16, BM] x [G, BM, 8] dots, both fed by one load of each of dy's tap pairs.
    L1: per tile dy's halo window and x's tile (and a residual's) read once, the program's weights."""
    tiles = _tiles(n, h, w, cfg)
    cblocks = cdiv(c, cfg.channels)
    partials = shares if deterministic else 1
    return KernelCost(
        useful_macs=2 * useful_macs(n, c, h, w, 1),
        mma_macs=2 * tiles * cblocks * 5 * cfg.g * cfg.block_m * 16 * 8 * _passes(cfg),
        dram_bytes=eb * n * c * (4 if residual else 3) * h * w + wb * c * GROUP_WIDTH * 9
        + 4 * partials * c * GROUP_WIDTH * 9,
        loops=(Loop("tiles", per_share, (Loop("taps", 5),)),),
        **_l1_declaration(cfg, window_pixels(cfg, 1), 2 if residual else 1, eb, wb, tiles=per_share),
        note=f"gconv3x3 backward (dgrad{' + residual' if residual else ''} + wgrad) C={c} G={cfg.g} "
             f"tile {cfg.tile_h}x{cfg.tile_w}, {shares} "
             f"shares of {per_share} tiles" + ("" if deterministic else " (atomics)"),
    )


def reduce_cost(shares: int, total: int, sb: int, out_bytes: int, partials_in_l2: bool = False,
                what: str = "gconv3x3 wgrad") -> KernelCost:
    """The partials read once (from L2 where ``partials_in_l2``: their footprint declared), the result
    written once; no MACs."""
    parts = 4 * shares * total
    loops = (Loop("share blocks", cdiv(shares, sb)),)
    note = f"{what}: reduction of {shares} partials, {sb} at a time"
    if partials_in_l2:
        return KernelCost(0, 0, out_bytes * total, loops, l2_bytes=parts, l2_footprint_bytes=parts, note=note)
    return KernelCost(useful_macs=0, mma_macs=0, dram_bytes=parts + out_bytes * total, loops=loops, note=note)
