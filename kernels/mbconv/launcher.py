"""Host side of the MBConv + SE kernels (kernel.py): the geometry of one launch pair, kernel limits,
buffers, launches with their cost declarations.

Every function here assumes the op's checks passed (shapes, dtypes, devices: op.py). One
:class:`MBConvGeometry` (``mbconv_config``) holds every tile size, trip count and grid of a block's
two launches, computed once from the shapes and the device (SM count, L2 size, shared memory per
program, arch: ``kernels._launch.device_info``); the launches and their cost declarations read it.

Choices (kernel.py explains the kernels)
----------------------------------------
* Hidden chunk RB = 64 channels (8 conv groups), halved while the program's scratch slot would not
  stay in L1 (``SLOT_L1_*``: 16x16 and 32x32 stride 2 take 32), 32 for fp32 (3xTF32 holds each
  operand twice; at 64 the C = 256 expand needed more shared memory than sm_90 has).
* RESIDENT items (H W <= 256, 16-bit data): XM = 256 rows of x (IB = 256 / HWP images, fewer while
  their h slots would not stay in L1), one 8-warp program per SM on sm_90 (x takes 128 KB of shared
  memory at C = 256; 8 warps measured faster than 16 and 4, ``HIDDEN_WARPS``); chunk groups: as few
  as keep every SM busy (``chunk_groups``: 16x16 one group, 8x8 four).
  Other maps (and fp32, and sm_80): items of one image and one chunk, one 16-warp program per SM on
  sm_90. Below sm_90 (16-bit data): one 8-warp program per SM, with the largest chunk and expand tile
  whose slot stays in the L1 the program's shared memory leaves (``sm80_tiling``: 16x16 stride 1 RB 64,
  EM 128; 16x16 stride 2 and 8x8 RB 64, EM 64; 32x32 stride 2 RB 16, EM 128), and items of XM / HWP
  images (8x8: four, so each chunk's weights are read once per four images); 4-warp programs
  elsewhere (fp32; two per SM where both slots fit the L1 an A100 leaves them).
* One launch pair over the whole batch. ``g`` stays in L2 for the projection where it fits in
  L2_SHARE of the L2 beside the scratch (8x8 and 16x16 stride 2 at batch 128); otherwise its read is
  DRAM traffic. Cutting the batch into slices whose ``g`` fits was predicted slower for Small at batch
  128 (16x16: 115.6 against 110.7 us per block, high end): a slice leaves too few images to keep the
  hidden kernel's programs busy without re-reading x per chunk group, and adds launches.
* Staged launches (staged.py ``staged``): every block whose expand output takes the expand kernel's
  32-bit offsets runs as staged launches with h and g through DRAM, in place of the hidden kernel
  (staged.py ``mbconv_staged_triton``): the expand; the group-width-8 conv with bias + SiLU in its
  epilogue (kernels/gconv ``BIAS_SILU``); stride 1: each tile's pool in the same epilogue (``POOL``), the
  SE gates from the pools, the projection + residual; stride 2: BlurPool with the pool, the gates, the
  projection. Static estimate (Small, batch 128, sm_90; us, low-high, staged against hidden; the sum =
  the L1-pipe and latency terms that tracked the H200's block timings; with the projection's gates
  loaded a step ahead): 16x16 stride 1 168-208 against 258-376 (sum 239-249 against 251-262; the hidden
  kernel measured 311 there, Inductor 350); 8x8 65-84 against 96-137 (sum 85-88 against 94-98); 16x16
  stride 2 203-267 against 300-437 (sum 258-269 against 279-291; measured 332, Inductor 337); 32x32
  stride 2 (C 96 -> 256) 235-298 (sum 331-345) against 627-974 (sum 420-438 before the gate change; the
  hidden kernel, whose x tile does not stay resident there, measured 426, Inductor 472). Staged is
  faster by both measures at 14x14, 7x7 and 28x28, at Pico's, Nano's and Tiny's widths, and on sm_80.
  Since then the expand takes 128 hidden channels a program and the 8x8 conv 16 groups (below): 16x16
  stride 1 164-204 (sum 231-241), 8x8 58-71 (81-85), 16x16 stride 2 186-241 (241-251), 32x32 stride 2
  231-287 (322-336; the last two with the BlurPool pass on 4 warps, moments.py).
  Before the gate change (both forms use the projection): at batch 1 both measures ranked it faster
  except at 16x16 stride 2, where the model had it 1 us slower (36-47 against 35-46; sum 37-39 against
  41-43); at 16x16 stride 1 and batch 8 or 32 the sum ranked the hidden kernel 4-7 % faster (8: 33-35
  against 36-37; 32: 86-90 against 90-94), where the model had a tie (31-44 against 33-44) or staged
  24 % faster (68-85 against 79-112); 8x8, 16x16 stride 2 and 32x32 stayed staged by both at every
  batch. One rule for every batch: a GPU run decides (``scripts/gpu_variants.py --variants
  shipped,hidden``). Batches whose expand output passes 2^31 elements take the hidden kernel.
* Projection: 128-row tiles on sm_90, 64 for fp32 and below sm_90 (one image's pixels, or two whole
  images of at most half a tile), output channels in two accumulators of 128 for K <= 256 (one
  program per tile reads g and the gates once:
  8x8 at batch 128 runs 64 such programs, predicted faster than 128 with K split), split into grid.y
  only when the tiles would leave three quarters of the SMs idle; 8 warps, 3 pipeline stages. The
  gates of a stored-gate projection (GATE) are loaded one R step ahead, in registers across the step:
  loaded in their step, each 2-byte load's latency was exposed before the gating (16x16: 44-56 -> 32-39
  us; 8x8 18-24 -> 16-19; Nano's K = 160 variant no longer spills its 24 B; A100 forward 18.70-21.55 ->
  14.64-17.61 ms).
* The expand (expand_backward.py ``expand_folded``: the training kernel's FOLDED form, v = z + b_exp,
  no identity BatchNorm vectors built per call; 128 hidden channels a program, x re-read from L2 by 8
  chunks, 45-51 us at 16x16) and the conv (16 groups a program on 8x8 maps, kernels/gconv/launcher.py:
  8x8 29-42 -> 23-30 us) are the training kernels' launches with their inference configs.

Predicted and measured
----------------------
Static model (``convfirstnet kernels --model small``: batch 128, fp16, CUDA graphs, Triton 3.8; us,
low-high; binds = the largest terms at the high end) against the H200 (Triton 3.6, CUDA graphs, both
launches of a block, ``scripts/gpu_variants.py``: ``benchmarks/results/variants/20261126T1257*``; the
16-warp figures from ``benchmarks/results/20261126T123856Z_h200_float16_small_gpu-check-blocks.json``)
and Inductor's layer-wise code (``..._051713Z_..._gpu-check-blocks.json``):

    block (Small, sm_90)   launch  warps regs  smem  predicted  binds (high end)   measured (16 w) Inductor
    s1 16x16, C 256 (x17)  hidden    8   180  170 KB 206-299    waits 200, lat. 98    403 (426)   350
                           project   8   255  160 KB  44-56     DRAM 37, L2 38
    s1 8x8, C 256 (x17)    hidden    8   188  170 KB  67-97     waits 65, lat. 31     128 (136)   263
                           project   8   254  176 KB  24-30     latency 21, tensor 11
    s2 32x32, C 96 -> 256  hidden   16   126   92 KB 477-712    waits 490, lat. 220   636 (635)   472
                           project   8   221  160 KB  42-53     waits 29, latency 23
    s2 16x16, C 256        hidden    8   255  170 KB 235-333    waits 204, lat. 128   436 (479)   337
                           project   8   252  176 KB  21-27     latency 18, tensor 11

The 8-warp hidden programs are what the GPU measured fastest: fused Small 14.76 ms with 16 warps,
14.21 with 8 (``..._variants_model.json``); at 16x16, 4 warps 467 us, 8 warps with RB = 32 458, tiled
8 warps 433. Loading the conv's tap pairs one dot ahead (``pairs_ahead``), predicted 428 -> 355 us at
16x16 (low ends), measured 429 -> 427: nothing. The model's band holds the 16-warp blocks but not
these: the GPU measured the 8-warp blocks at 1.01-1.21x its high end (16x16 hidden + projection
250-354 against 403), and the model had ranked the tap-pair order and the warp count by gains of 17 %
and 30 % where the GPU gave 0 % and 5 %: its wait term (one warp's exposed waits times the warps
sharing a scheduler) is not what these programs pay. Three of the four blocks stay slower than
Inductor's layer-wise code (0.74-0.87x): an open defect. On an A100 (``--arch sm_80``: mma.sync,
8-warp tiled hidden programs, 64-row projection tiles) the same blocks are predicted at 450-572,
157-201, 696-936 and 398-520 us (not measured).

Design notes in this file and in kernel.py quote the static model of the time each choice was made
(before its correction against the H200, when it was 2-6x low on these kernels): they rank the
alternatives then weighed, and are not today's predictions; the saved reports under
``benchmarks/static/`` are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._carveout import RESERVED_PER_BLOCK, smallest_carveout
from .._cost import KernelCost, Loop
from .._launch import (
    FORCED_TAP_ORDER,
    GROUP_WIDTH,
    GPUInfo,
    cdiv,
    conflict_free_tap_order,
    device_info,
    launch,
    next_power_of_2,
)
from .kernel import _mbconv_hidden_kernel, _mbconv_project_kernel

FP32_PRECISION = "tf32x3"  # dot precision for fp32 operands; fp16/bf16 operands ignore it
RB, RB_SMALL = 64, 32  # hidden channels per chunk (module docstring)
BMO = 64  # blur output pixels per tile
# Conv tile: CONV_ELEMS / RB pixels (G = RB / 8 groups), so that the tap-pair operand is 16 KB whatever
# RB (as gconv's tiles); the batch is split further into pixel sub-tiles where G is below the warps
# (``conv_split``).
CONV_ELEMS = 4096
# Not shipped, a variant for a GPU run (scripts/gpu_variants.py "conv tiles 128"): on sm_90 with 16-bit
# data, 32 KB tap pairs (128 pixels at RB = 64) on maps of more than 64 pixels at stride 1 and in tiled
# programs. Each conv tile waits for its five tap pairs in turn, and a tile of twice the pixels pays those
# waits once for twice the work: the static model's high end falls (Small batch 128, the training
# forward's hidden launch: 16x16 291 -> 207 us, 32x32 stride 2 795 -> 521; inference 15.35 -> 13.57 ms),
# but only through its wait term, which over-credited earlier changes of this kernel's tap loads
# (docs/cost-model.md); the sum of the L1-pipe and stall terms that tracked the H200's measurements stays
# flat (16x16: 168-175 -> 171-179 us; 32x32: 314-327 -> 305-317). 8x8 and the RESIDENT 16x16 stride 2
# spilled 8-16 B: excluded.
WIDE_CONV_TILES = False
CONV_ELEMS_WIDE = 8192
# The staged launches (staged.py) instead of the hidden kernel: None takes them wherever the expand's
# 32-bit offsets hold (module docstring), True / False forces them (tests, scripts/gpu_variants.py)
STAGED: bool | None = None
BM = 64  # pixels per warpgroup of an expand tile (the wgmma M)
XM = 256  # rows of a RESIDENT item's x tile (a [256, 256] fp16 tile is 128 KB of shared memory)
# Shared memory of a RESIDENT program beside its x tile and W_exp chunk (layout conversions of the
# conv operands; 14 KB as compiled for sm_90 at C = 256)
RESIDENT_SMEM_EXTRA = 16 * 1024
ZERO_BLOCK = 4096  # elements per step of the scratch border fill (one 16-byte vector per thread at 16 warps)
# The expand loads all input channels as one K tile; 256 is the widest block input of the paper
# (Table 3). Wider inputs take CONVFIRSTNET_KERNELS=reference.
MAX_C = 256
# Scratch slot bytes that stay in L1: an sm_90 SM has 256 KB of L1 + shared memory; a RESIDENT
# program's ~175 KB of shared memory leaves 60 KB (carve-out 196 KB), a tiled one's ~25 KB leaves 224 KB.
# That is the smallest carve-out (CONVFIRSTNET_L1_CARVEOUT=fit); Triton's loader configures the largest
# for kernels above 48 KB of shared memory, 28 KB of L1 (measured: the slot's L1 hit rate 56-67 %,
# kernels/_carveout.py).
SLOT_L1_RESIDENT = 56 * 1024
SLOT_L1_TILED = 160 * 1024
# Two 4-warp tiled programs of ~60 KB of shared memory each on an A100 (192 KB of L1 + shared memory
# per SM, carve-out 132 KB) leave 60 KB of L1 for both slots.
SLOT_L1_PAIR = 56 * 1024
# Hidden kernel programs, one per SM, on sm_90 with 16-bit data: 8 warps RESIDENT, measured on an H200
# (Triton 3.6, Small batch 128, benchmarks/results/variants/20261126T1257*): fused Small 14.76 -> 14.21 ms
# against 16 warps, the 16x16 blocks 0.426 -> 0.403 ms, 8x8 0.136 -> 0.128, 16x16 stride 2 0.479 -> 0.436
# (32x32 stride 2 is tiled: unchanged); 4 warps 0.467 and 8 warps with RB = 32 0.458 at 16x16. The
# static model had ranked 16 warps first before its correction and 8 first after it (by ~30 %, where
# the GPU gave 5 %). At 8 warps ptxas uses 180-255 registers, no spills in the loops. Tiled: expand
# tiles of EM = 256 pixels (a 64-row wgmma per warpgroup; 64-pixel tiles at 8 or 16 warps compiled to
# mma.sync), 16 warps (8 measured 0.433 against 0.427 ms at 16x16). fp32 and sm_80 (16 warps spilled
# there): 4 warps, EM = 64, two programs per SM where both slots stay in L1.
HIDDEN_WARPS = 8
HIDDEN_WARPS_TILED = 16
PAIRS_AHEAD = True  # the conv's tap pairs loaded one dot ahead (MBConvGeometry.pairs_ahead)
# The order in which the conv loads each tap pair (kernel.py ``_conv_pair_h``'s TAPS), which decides
# the bank conflicts of the pair's copy to shared memory for the batched mma.sync. Nsight Compute on an
# H200 (benchmarks/results/ncu/20261126T150000Z_*, Triton 3.6, order 0): in the 16x16 hidden kernel the
# L1 data pipe ran at 66 % of its peak and 17.4 M of its 24.6 M shared store wavefronts were conflicts.
# Compiled for sm_90 (warp 0's PTX addresses, convfirstnet.analysis.shared.ptx_shared_accesses): order 0
# stores the pairs at 4x the conflict-free wavefronts on Triton 3.6 and 3.8 (and on 3.8 reads them back
# with ldmatrix at 6x); ``conflict_free_tap_order()`` is conflict-free on both, with 2-45 more registers
# (no spills) and 4 more bar.sync. Timed on an H200 (Triton 3.6, batch 128, fp16, CUDA graphs,
# benchmarks/results/variants/20261127T00*): order 1 against 0, 16x16 stride 1 0.321 against 0.403 ms,
# 16x16 stride 2 0.348 against 0.433, 8x8 0.108 against 0.127, 32x32 stride 2 0.444 against 0.633, Small
# 12.21-12.25 against 14.14-14.22 ms (order 2, conflict-free on 3.8 only: 0.364, 0.379, 0.130 ms). The
# static model had ranked order 1 slower on 3.6 (its wait term: docs/cost-model.md).
# None: conflict_free_tap_order() for the installed Triton; 0, 1 or 2 (CONVFIRSTNET_TAP_ORDER) force one
TAP_ORDER = FORCED_TAP_ORDER


def tap_order() -> int:
    """The TAPS the kernels compile with: ``TAP_ORDER``, or the conflict-free order when it is None."""
    return conflict_free_tap_order() if TAP_ORDER is None else TAP_ORDER


HIDDEN_WARPS_SM80 = 8  # RESIDENT programs below sm_90 (C <= 128 there: the x tile fits)
# Tiled 16-bit programs below sm_90: 8 warps (with 4-warp programs, one per SM, the hidden kernel of a
# 16x16 stride-1 block was predicted at 221 us on an A100, latency 207 + waits 13; at 8 warps 118,
# latency 112 + waits 5), with the largest expand tile EM (of EM_SM80) and chunk RB (halved down to 16)
# whose slot stays in the L1 that the program's shared memory leaves (``sm80_tiling``). That shared
# memory is the x tile and the W_exp chunk plus TILED_SMEM_EXTRA_SM80, as compiled for sm_80: 106 KB at
# EM = 128, RB = 64, C = 256 (16x16 stride 1), 74 KB at EM = 64 (16x16 stride 2, 8x8), 46 KB at
# EM = 128, RB = 16, C = 96 (32x32 stride 2: at RB = 32 its 136 KB slot fit beside no tile). 256-pixel
# tiles would fit there too (predicted 4 us faster for Small), but at C = 128 (Tiny's 32x32 stride 2)
# they compiled to 255 registers and 64 B of spills in the chunk loop. Without a register limit ptxas
# compiled the 16x16 stride-2 variant to 128 registers and 72 B of spills in the chunk loop (Triton
# 3.8); with maxnreg = 255 it takes 224 and spills nothing. The SE partial loads all SP rows of W_se1 in
# one step (SEB = SP; 8x8: 69.4-69.9 -> 67.5-68.1 us per block predicted against steps of 32).
HIDDEN_WARPS_TILED_SM80 = 8
HIDDEN_MAXNREG_SM80 = 255
EM_SM80 = (128, 64)
TILED_SMEM_EXTRA_SM80 = 10 * 1024
# An A100 SM: 192 KB of L1 + shared memory; the shared-memory carve-outs (KB) the driver picks the
# smallest that holds the program from, 1 KB reserved per program (CUDA C++ Programming Guide, compute
# capability 8.0; the cost model's figures, convfirstnet/analysis/hardware.py)
L1_SHARED_SM80 = 192 * 1024
CARVEOUTS_KB_SM80 = (0, 8, 16, 32, 64, 100, 132, 164)
# Projection tiles: 128 pixel rows (two wgmma warpgroups of 64) x 128 output channels per accumulator,
# two accumulators for K <= 256, K steps of 64 hidden channels, 8 warps, 3 pipeline stages.
P_BM, P_BH, P_BR, P_WARPS, P_STAGES = 128, 128, 64, 8, 3
P_BH_FP32 = 64
# 64-row projection tiles for fp32 (3xTF32 operands in 128-row tiles took 213 KB of shared memory) and
# below sm_90 (mma.sync keeps the A operand in registers: 128-row tiles spilled 88-168 B on sm_80)
P_BM_SMALL = 64
# GATE: where each hidden-kernel item holds every chunk of its images (RESIDENT stride-1 maps of more than
# 64 pixels in one chunk group: Small's 16x16 at batch 128), the hidden kernel ends with the images' SE
# gates (``_se_gates``: W_se2 read once per image, in steps of GATE_ROWS hidden channels), and the
# projection reads a gate vector per R step instead of W_se2 (128 KB at R = 1024) and the SE partials in
# each of its tiles (two per 16x16 image): 16x16 block 103.3 -> 99.0 us predicted at the high end
# (projection 44.8 -> 39.2, hidden kernel 58.5 -> 59.9), 84.3 -> 85.4 at the low end (there the
# projection is DRAM bound either way). 512 rows per step: 59.9 us against 60.4 at 128; at 1024 the
# function spilled.
GATE_ROWS = 512
# The standalone gate launches (moments._se_gates_kernel, staged._se_pool_gates_kernel) take GATE_ROWS
# steps except where R > GATE_ROWS is not a multiple of 256: Nano's R = 640 (S = 40) took 255 registers
# and spilled 488-512 B in both at 512 (sm_90); at 128 no stack, 9.1-10.2 and 11.3-13.4 us against
# 20.0-28.0 and 21.5-30.1 (static estimate, batch 128)
GATE_ROWS_MASKED = 128


def gate_rows(r: int) -> int:
    """Hidden channels per step of the standalone gate launches (GATE_ROWS_MASKED's comment)."""
    return GATE_ROWS if r <= GATE_ROWS or r % 256 == 0 else GATE_ROWS_MASKED


# Share of the L2 the resident programs' scratch may take (the rest holds the streamed x, g, weights).
L2_SHARE = 0.75
# Per-warp instruction estimates from the sm_90 SASS (a chunk of a 256-pixel item; an item's x tile),
# used only to choose the chunk groups (``chunk_groups``).
CHUNK_COST, ITEM_COST = 3000, 800
# Under the interpreter (CPU) programs run one after another: 3 programs with several items each
# cost the same as many and exercise the item loop; a small L2 share keeps g "in DRAM" there.
INTERPRETER_PROGRAMS = 3
INTERPRETER_L2 = 4 * 1024 * 1024
MAX_GRID_X = 2**31 - 1  # CUDA grid.x limit (grid.y/z: 65535)
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class MBConvGeometry:
    """Everything the two launches of one block need: shapes, tiles, trip counts, grids."""

    n: int
    c: int
    r: int
    s: int
    k: int
    h: int
    w: int
    stride: int
    oh: int
    ow: int
    elem: int  # bytes per element of x
    fp32: bool
    # hidden kernel
    rb: int  # hidden channels per chunk
    cp: int  # input channels rounded up to a power of two (one expand K tile)
    sp: int  # SE width rounded up to a power of two (>= 16)
    tw: int  # conv tile width (pixels of an image row per tile)
    two: int  # blur output tile width
    exact: bool  # tiles cover the map exactly (dense pixel rows; stride 2: also the output)
    resident: bool  # an item's x tile is read once for all its chunks
    hwp: int  # pixels per image rounded up to a power of two (RESIDENT rows per image)
    ib: int  # images per item
    chunks_per_group: int  # hidden chunks per item
    programs: int  # hidden-kernel programs (persistent)
    # projection
    p_bm: int
    p_bh: int
    halves: int
    ipt: int  # whole images per projection tile (1: a tile holds pixels of one image)
    tpi: int  # projection tiles per image (1 when ipt > 1)
    g_in_l2: bool  # g (plus the scratch) fits in L2_SHARE of the L2: the projection reads it from L2
    hidden_warps: int
    cm: int  # pixels per conv tile
    em: int  # pixels per expand tile of the tiled path
    maxnreg: bool = False  # compile the hidden kernel with HIDDEN_MAXNREG_SM80
    gate: bool = False  # the hidden kernel computes the SE gates, the projection reads them (GATE_ROWS)

    @property
    def hw(self) -> int:
        return self.h * self.w

    @property
    def ohw(self) -> int:
        return self.oh * self.ow

    @property
    def nchunk(self) -> int:
        return cdiv(self.r, self.rb)

    @property
    def groups(self) -> int:
        return cdiv(self.nchunk, self.chunks_per_group)

    @property
    def image_blocks(self) -> int:
        return cdiv(self.n, self.ib)

    @property
    def items(self) -> int:
        return self.image_blocks * self.groups

    @property
    def one_item(self) -> bool:
        """The hidden kernel's ONE: a program per item, so the item loop has one trip the compiler sees and
        neither its counter nor the program count stay live across the chunk loop. At 16 warps (the
        128-register limit) that took Small's 16x16 stride-1 variants (batch 128, sm_90) from 8-16 B of
        stack to none, 0.1-0.4 us faster predicted; the 8x8 ones (no stack either way) 0.2-0.7 us faster
        (inference 16.90-18.55 -> 16.64-18.31 us). Stride 2 keeps the loop: with ONE its 16x16 -> 8x8
        variant also lost its 8 B of stack but was predicted 68.6-72.5 -> 71.6-78.4 us (exposed waits
        22.8 -> 29.1 us at the low end; SEB 32 or CS 8 with it: 71.1-74.8, 73.7-76.9). Its moments
        variant (no stack either way) takes ONE (moments.py): 53.80-59.78 -> 53.04-58.99 us."""
        return self.stride == 1 and self.items == self.programs

    @property
    def pairs_ahead(self) -> bool:
        """The hidden kernel's AHEAD: the conv loads each tap pair from the slot one dot ahead of its use, so
        two loads are in flight while a dot runs instead of each pair waiting out a whole load latency
        before its dot. Small at batch 128, sm_90, predicted per block (us, low-high; Triton 3.8):
        16x16 stride 1 428-648 -> 355-509, 8x8 136-202 -> 118-167, 32x32 stride 2 623-970 -> 519-765,
        16x16 stride 2 483-732 -> 413-596 (exposed waits on the slot loads -30 %, bar.sync executed per
        warp 911 -> 655 at 16x16); measured on an H200 at 16 warps: 429 -> 427 us at 16x16, 136 -> 135
        at 8x8, i.e. nothing (kept: no cost either). Two pairs ahead held a third layout-conversion
        buffer (200 KB of shared memory, too little L1 left for the slot); loading the next tile's first
        pairs across the tile loop was predicted slower (361-523 at 16x16). Off for RESIDENT stride-2
        items that hold part of the chunks (small batches): the extra live pair spilled 64 B inside the
        chunk loop there."""
        return PAIRS_AHEAD and not (self.stride == 2 and self.resident and self.groups > 1)

    @property
    def conv_split(self) -> int:
        """Pixel sub-tiles per conv group: the batched conv dot gets at least one batch entry per warp
        (Triton spreads the warps over the batch first; with fewer entries than warps each warp
        repeated another's mma.sync), each sub-tile at least 16 rows (an mma.sync M)."""
        return max(1, min(self.hidden_warps // (self.rb // 8), self.cm // 16))

    @property
    def tiles(self) -> int:
        return cdiv(self.h, self.cm // self.tw) * cdiv(self.w, self.tw)

    @property
    def tiles_o(self) -> int:
        return cdiv(self.oh, BMO // self.two) * cdiv(self.ow, self.two)

    @property
    def slot_images(self) -> int:
        return self.ib if self.resident else 1

    @property
    def h_slot(self) -> int:
        """Elements of one image's h slot (padded rows and columns)."""
        return self.rb * (self.h + 2) * (self.w + 2)

    @property
    def border(self) -> int:
        """Elements of one image's h slot border (zeroed once per launch)."""
        return 2 * self.rb * (self.w + 2) + 2 * self.h * self.rb

    @property
    def slot(self) -> int:
        """Elements of one program's scratch slot."""
        return self.slot_images * self.h_slot + (self.rb * self.hw if self.stride == 2 else 0)

    @property
    def mean_slot(self) -> int:
        """fp32 elements of one program's mean slot: a chunk's means of one image, in ``mean_rows`` rows."""
        return self.rb * self.mean_rows

    @property
    def mean_rows(self) -> int:
        """Rows of partial means per chunk: RESIDENT stride-1 maps of at most 64 pixels (8x8) store a row
        per pixel sub-tile of the conv, summed by the SE partial (their sum in the conv's layout took a
        layout conversion: 8x8 hidden kernel 18.9 -> 18.6 us predicted at the high end). On 16x16
        stride 1 the rows moved spills into the chunk loop (local traffic 18 -> 92 KB per program)."""
        return self.conv_split if self.resident and self.stride == 1 and self.hwp <= 64 else 1

    @property
    def scratch_bytes(self) -> int:
        """Bytes of one program's scratch: the slot and the fp32 mean slot."""
        return self.slot * self.elem + self.mean_slot * 4

    @property
    def g_bytes(self) -> int:
        return self.n * self.ohw * self.r * self.elem

    @property
    def p_bn(self) -> int:
        return self.p_bh * self.halves

    @property
    def p_tiles(self) -> int:
        return cdiv(self.n, self.ipt) * self.tpi

    @property
    def p_grid(self) -> tuple[int, int]:
        return self.p_tiles, cdiv(self.k, self.p_bn)

    @property
    def p_even(self) -> bool:
        rows_full = self.ohw % self.p_bm == 0 if self.ipt == 1 else (
            self.ipt * self.ohw == self.p_bm and self.n % self.ipt == 0)
        return self.r % P_BR == 0 and self.s == self.sp and rows_full and self.k % self.p_bn == 0

    @property
    def tiles_e(self) -> int:
        return cdiv(self.h, self.em // self.tw) * cdiv(self.w, self.tw)

    def hidden_constexprs(self, silu: int, prec: str) -> dict:
        return dict(STRIDE=self.stride, RB=self.rb, CP=self.cp, SP=self.sp, MASK_C=self.c != self.cp,
                    MASK_R=self.r % self.rb != 0, TW=self.tw, BM=self.cm, EM=self.em, TWO=self.two, BMO=BMO,
                    EXACT=self.exact,
                    RESIDENT=self.resident, XM=XM if self.resident else 16,
                    HWP=self.hwp if self.resident else 1,
                    ZB=ZERO_BLOCK, SILU=silu, PREC=prec, CS=self.conv_split, NS=self.mean_rows,
                    ONE=self.one_item, AHEAD=self.pairs_ahead, TAPS=tap_order(),
                    SEB=self.sp if self.maxnreg else min(self.sp, 4 * self.hidden_warps),  # sm_80: one step
                    # every constexpr passed, none left to a default: torch.compile's wrapper of a user
                    # kernel drops defaulted arguments from the launch it generates
                    GATE=self.gate, GB=GATE_ROWS if self.gate else 128,
                    NCP=next_power_of_2(self.nchunk) if self.gate else 1,
                    num_warps=self.hidden_warps, num_stages=1, **self.hidden_options)

    @property
    def hidden_options(self) -> dict:
        """Compile options beyond warps and stages: the 8-warp tiled programs below sm_90 may use every
        register (HIDDEN_WARPS_TILED_SM80)."""
        return dict(maxnreg=HIDDEN_MAXNREG_SM80) if self.maxnreg else {}

    def project_constexprs(self, silu: int, prec: str) -> dict:
        return dict(RESIDUAL=self.stride == 1, BM=self.p_bm, BH=self.p_bh, HALVES=self.halves, BR=P_BR,
                    SP=self.sp, NCP=next_power_of_2(self.nchunk), IPT=self.ipt, EVEN=self.p_even,
                    PREC=prec, SIGMOID=silu, GATE=self.gate,
                    num_warps=P_WARPS, num_stages=P_STAGES)


def conv_rows(rb: int, elems: int = CONV_ELEMS) -> int:
    return max(BM, elems // rb)


def chunk_groups(image_blocks: int, nchunk: int, programs: int) -> int:
    """Chunks per RESIDENT item: the fewest groups (each group re-reads the item's x) among those with
    the smallest estimated critical path, ceil(items / programs) x (chunks per item x CHUNK_COST +
    ITEM_COST)."""
    best, best_t = nchunk, None
    for groups in range(1, nchunk + 1):
        cg = cdiv(nchunk, groups)
        if cdiv(nchunk, cg) != groups:
            continue
        t = cdiv(image_blocks * groups, programs) * (cg * CHUNK_COST + ITEM_COST)
        if best_t is None or t < best_t:
            best, best_t = cg, t
    return best


def l1_left_sm80(shared: int) -> int:
    """L1 bytes an A100 SM leaves beside one program of ``shared`` bytes of shared memory."""
    carveout = smallest_carveout(shared + RESERVED_PER_BLOCK, CARVEOUTS_KB_SM80)
    return 0 if carveout is None else L1_SHARED_SM80 - carveout


def sm80_tiling(rb: int, cp: int, elem: int, hw: int, shared_per_block: int,
                slot_bytes) -> tuple[int, int] | None:
    """(RB, EM) of an 8-warp tiled program below sm_90: the largest chunk (halving ``rb`` down to 16),
    then the largest expand tile (of EM_SM80, at most the map), whose scratch slot and means fit in the
    L1 left beside the program's shared memory (HIDDEN_WARPS_TILED_SM80); None if none fits."""
    while rb >= 16:
        for em in EM_SM80:
            if em > max(BM, next_power_of_2(hw)):
                continue
            shared = (em + rb) * cp * elem + TILED_SMEM_EXTRA_SM80
            if shared <= shared_per_block and slot_bytes(1, rb) + rb * 4 <= l1_left_sm80(shared):
                return rb, em
        rb //= 2
    return None


def target_info(device: torch.device) -> GPUInfo:
    """The GPU the launches are sized for (the interpreter: INTERPRETER_* programs and L2)."""
    info = device_info(device)
    if device.type == "cpu":
        return GPUInfo(INTERPRETER_PROGRAMS, INTERPRETER_L2, info.shared_per_block, info.arch)
    return info


def mbconv_config(c: int, r: int, k: int, h: int, w: int, stride: int, *, n: int = 128, s: int | None = None,
                  dtype: torch.dtype = torch.float16, dense: bool = True,
                  device: torch.device | str = "meta") -> MBConvGeometry:
    """The geometry of one launch pair over ``n`` images (module docstring). ``dense``: x's pixel rows
    are contiguous (stride(H) == W * stride(W)), which the exact path's linear pixel addresses need;
    ``device``: the GPU whose SM count and L2 size set the programs (meta: the recording's target)."""
    s = max(1, c // 4) if s is None else s
    elem = dtype.itemsize
    fp32 = dtype == torch.float32
    oh, ow = (h, w) if stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    cp = max(16, next_power_of_2(c))
    tw = min(BM, max(8, next_power_of_2(w)))
    two = min(BMO, max(8, next_power_of_2(ow))) if stride == 2 else 8
    gpu = target_info(torch.device(device))
    sms, l2 = gpu.sms, gpu.l2_bytes
    hwp = next_power_of_2(h * w)
    # RESIDENT needs the x tile and a chunk's W_exp in shared memory (sm_80: 163 KB per program, too
    # little at C = 256; fp32: 3xTF32 keeps each operand as two parts, 299 KB at C = 128)
    resident = hwp <= XM and not fp32 and (XM + RB) * cp * elem + RESIDENT_SMEM_EXTRA <= gpu.shared_per_block
    ib = max(1, XM // hwp) if resident else 1
    if resident:
        warps = HIDDEN_WARPS if gpu.arch >= 90 else HIDDEN_WARPS_SM80
    else:
        warps = HIDDEN_WARPS_TILED if gpu.arch >= 90 and not fp32 else 4

    def slot_bytes(ib: int, rb: int) -> int:
        return ((ib if resident else 1) * rb * (h + 2) * (w + 2) + (rb * h * w if stride == 2 else 0)) * elem

    limit = SLOT_L1_RESIDENT if resident else SLOT_L1_TILED
    rb = RB_SMALL if fp32 else RB
    while rb > 16 and slot_bytes(1, rb) > limit:  # the slot must stay in L1 (module docstring)
        rb //= 2
    em = BM * max(1, warps // 4)
    tiling = None
    if not resident and not fp32 and gpu.arch < 90:
        tiling = sm80_tiling(rb, cp, elem, h * w, gpu.shared_per_block, slot_bytes)
    if tiling is not None:  # 8-warp tiled programs below sm_90 (HIDDEN_WARPS_TILED_SM80), items of XM pixels
        rb, em = tiling
        warps = HIDDEN_WARPS_TILED_SM80
        ib = max(1, XM // hwp)
    ib = min(ib, next_power_of_2(max(n, 1)))
    if resident:
        while ib > 1 and slot_bytes(ib, rb) > limit:  # small maps: fewer images per slot
            ib //= 2
    nchunk = cdiv(r, rb)
    blocks = cdiv(max(n, 1), ib)
    cg = chunk_groups(blocks, nchunk, sms) if resident else 1
    # EXACT: the conv (and tiled expand, and blur) tiles cover the map exactly, with dense pixel rows
    wide = WIDE_CONV_TILES and not fp32 and gpu.arch >= 90 and hwp > 64 and (stride == 1 or not resident)
    cm = conv_rows(rb, CONV_ELEMS_WIDE if wide else CONV_ELEMS)
    if resident and stride == 1 and warps >= 16 and hwp > 64 and cg < nchunk:
        # half-size conv tiles on RESIDENT stride-1 maps of more than 64 pixels (Small's 16x16) whose
        # items hold part of the chunks (small batches): with 64-pixel tiles the 16-warp sm_90 compile
        # spilled inside the chunk loop (Triton 3.8). Items of all the chunks (batch 128) take 64-pixel
        # tiles: 16x16 hidden kernel 70.5 -> 58.5 us predicted at the high end (half the conv tiles'
        # per-tile stall cycles and exposed waits)
        cm //= 2
    exact = dense and w == tw and h % (cm // tw) == 0
    if not resident:
        exact = exact and h % max(1, em // tw) == 0
    if stride == 2:
        exact = exact and h % 2 == 0 and w % 2 == 0 and ow == two and (oh % (BMO // two) == 0)
    # 4-warp tiled programs: two per SM while both slots stay in the L1 that both programs' shared
    # memory leaves on any target (SLOT_L1_PAIR), and all slots in L2_SHARE of the L2
    per_sm = 2 if warps == 4 and 2 * slot_bytes(ib, rb) <= SLOT_L1_PAIR else 1
    if per_sm * sms * slot_bytes(ib, rb) > L2_SHARE * l2:
        per_sm = 1
    programs = max(1, min(blocks * cdiv(nchunk, cg), per_sm * sms))
    # projection
    ohw = oh * ow
    p_bm = P_BM_SMALL if fp32 or gpu.arch < 90 else P_BM
    ipt = 2 if ohw <= p_bm // 2 else 1
    tpi = cdiv(ohw, p_bm) if ipt == 1 else 1
    bn = min(P_BH_FP32 if fp32 else 2 * P_BH, max(16, next_power_of_2(k)))
    if 4 * cdiv(max(n, 1), ipt) * tpi <= sms:  # very few tiles: output channels in grid.y too
        bn = min(bn, P_BH)
    halves = 2 if bn > P_BH else 1
    g_in_l2 = n * ohw * r * elem + programs * (slot_bytes(ib, rb) + rb * 4) <= L2_SHARE * l2
    # GATE_ROWS; unmasked widths only (C and S powers of two): at Nano's C = 160, S = 40 the hidden
    # kernel spilled 216 B
    gate = (resident and stride == 1 and hwp > 64 and cg >= nchunk and c == cp
            and s == max(16, next_power_of_2(s)))
    return MBConvGeometry(
        n=n, c=c, r=r, s=s, k=k, h=h, w=w, stride=stride, oh=oh, ow=ow, elem=elem, fp32=fp32, rb=rb, cp=cp,
        sp=max(16, next_power_of_2(s)), tw=tw, two=two, exact=exact, resident=resident,
        hwp=hwp, ib=ib, chunks_per_group=cg, programs=programs, p_bm=p_bm, p_bh=bn // halves, halves=halves,
        ipt=ipt, tpi=tpi, g_in_l2=g_in_l2,
        hidden_warps=warps, cm=cm, em=em,
        maxnreg=warps == HIDDEN_WARPS_TILED_SM80 and not resident and gpu.arch < 90, gate=gate)


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
    tiles = cdiv(x.shape[2] * x.shape[3], P_BM) if x.dim() == 4 else 1
    if x.shape[0] * tiles > MAX_GRID_X or cdiv(k, 2 * P_BH) > MAX_GRID_YZ:
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
    """Launch the hidden kernel and the projection. Inputs are validated by op.py before this call;
    every buffer is allocated here (the op stays functional and CUDA-graph safe)."""
    n, c, h, w = x.shape
    r, k, s = w_exp.shape[0], w_proj.shape[0], w_se1.shape[0]
    geo = geometry_of(x, r, k, s, stride)
    out = torch.empty((n, k, geo.oh, geo.ow), device=x.device, dtype=x.dtype,
                      memory_format=torch.channels_last)
    if n == 0:
        return out
    # 1-D biases are addressed as base + index (unit stride)
    b_exp, b_conv, b_proj = b_exp.contiguous(), b_conv.contiguous(), b_proj.contiguous()
    b_se1, b_se2 = b_se1.contiguous(), b_se2.contiguous()
    scratch, gscratch, mslot = hidden_buffers(geo, x)
    gbuf = torch.empty((n, geo.ohw, r), device=x.device, dtype=x.dtype)
    zpart = torch.empty((n, geo.nchunk, geo.sp), device=x.device, dtype=torch.float32)
    gates = torch.empty((n, r) if geo.gate else (1,), device=x.device, dtype=x.dtype)
    if x.device.type == "cpu":  # the interpreter: a gate read before the hidden kernel wrote it shows as NaN
        gates.fill_(float("nan"))
    silu, prec = kernel_settings(x)
    residual = geo.stride == 1
    launch(_mbconv_hidden_kernel, (geo.programs,), x, w_exp, b_exp, w_conv, b_conv, w_se1, gbuf, zpart,
           scratch, gscratch, mslot, n, h, w, geo.oh, geo.ow, c, r, s, geo.nchunk, geo.groups,
           geo.chunks_per_group, geo.items, geo.ib, geo.slot, *x.stride(), *w_exp.stride(), *w_conv.stride(), *w_se1.stride(),
           b_se1, w_se2, b_se2, gates, *w_se2.stride(),
           cost=lambda: hidden_cost(geo, geo.one_item), **geo.hidden_constexprs(silu, prec))
    launch_project(geo, gbuf, zpart, gates, b_se1, w_se2, b_se2, w_proj, b_proj, x, out, residual)
    return out


def launch_project(geo: MBConvGeometry, gbuf: torch.Tensor, zpart: torch.Tensor, gates: torch.Tensor,
                   b_se1: torch.Tensor, w_se2: torch.Tensor, b_se2: torch.Tensor, w_proj: torch.Tensor,
                   b_proj: torch.Tensor, x: torch.Tensor, out: torch.Tensor, residual: bool) -> None:
    """The projection launch over ``gbuf`` (N, OH OW, R): the SE gates from ``gates`` (geo.gate) or from
    the SE partials ``zpart`` (N, chunks, SP); ``residual`` (stride 1) adds x."""
    r, k, s = w_proj.shape[1], w_proj.shape[0], w_se2.shape[1]
    pconst = geo.project_constexprs(*kernel_settings(x))
    launch(_mbconv_project_kernel, geo.p_grid, gbuf, zpart, b_se1, w_se2, b_se2, w_proj, b_proj, x, out,
           geo.n, geo.ohw, geo.ow, r, k, s, geo.nchunk, geo.tpi, *x.stride(), *out.stride(), *w_se2.stride(),
           *w_proj.stride(), gates, r, cost=lambda: project_cost(geo, residual=residual),
           **dict(pconst, RESIDUAL=residual))


def geometry_of(x: torch.Tensor, r: int, k: int, s: int, stride: int) -> MBConvGeometry:
    """The geometry the launches take for x (NCHW shape, any layout the op accepts)."""
    n, c, h, w = x.shape
    return mbconv_config(c, r, k, h, w, stride, n=n, s=s, dtype=x.dtype, dense=x.stride(2) == w * x.stride(3),
                         device=x.device)


def kernel_settings(x: torch.Tensor) -> tuple[int, str]:
    """(SILU mode, dot precision): the exact-form activations on a GPU, the plain ones in the
    interpreter; the dot precision only fp32 operands use."""
    silu = 0 if x.dtype == torch.float32 or x.device.type == "cpu" else 1
    return silu, FP32_PRECISION if x.dtype == torch.float32 else "tf32"


def hidden_buffers(geo: MBConvGeometry, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden kernel's scratch, its stride-2 g slots and its fp32 mean slots. Every scratch element
    a program reads it has written (or zeroed) first, so no zero fill; in the interpreter (tests) the
    scratch is NaN-filled, so that a read before a write shows. The stride-2 g slots, past the h slots
    of each program's slot, are their own argument so that the barrier check
    (convfirstnet.analysis.ordering) follows each round trip apart."""
    scratch = torch.empty((geo.programs * geo.slot,), device=x.device, dtype=x.dtype)
    if x.device.type == "cpu":
        scratch.fill_(float("nan"))
    mslot = torch.empty((geo.programs, geo.mean_slot), device=x.device, dtype=torch.float32)
    gscratch = scratch[geo.slot_images * geo.h_slot:] if geo.stride == 2 else scratch
    return scratch, gscratch, mslot


def hidden_cost(geo: MBConvGeometry, one: bool) -> KernelCost:
    """What the hidden kernel does (kernels/_cost.py gives the counting rules); ``one``: the launch's ONE."""
    n, c, r, s, rb, eb = geo.n, geo.c, geo.r, geo.s, geo.rb, geo.elem
    hw, ohw, nchunk, g8 = geo.hw, geo.ohw, geo.nchunk, geo.rb // 8
    # the SE MLP's first layer (and with GATE its second)
    useful = n * (hw * c * r + hw * r * 72 + (ohw * r * 9 if geo.stride == 2 else 0) + r * s * (1 + geo.gate))
    expand_rows = geo.image_blocks * XM if geo.resident else n * geo.tiles_e * geo.em
    mma = nchunk * (expand_rows * rb * geo.cp + n * geo.tiles * geo.cm * g8 * 16 * 8 * 5)
    conv_reads = n * geo.tiles * geo.cm * 5 * g8 * 16
    # g is counted as written to DRAM even when the projection reads it from L2 (a dirty line is
    # written back when it leaves the L2)
    dram = (n * c * hw + r * c + r * 72 + 2 * r + s * r + n * ohw * r) * eb + n * nchunk * geo.sp * 4
    if geo.gate:  # W_se2 and the SE biases read, the gates written
        dram += (r * s + r + s + n * r) * eb
    # scratch traffic per chunk: h written, five two-tap reads; stride 2: the full-resolution g written,
    # nine blur taps per output tile; the means (fp32)
    scr = n * hw * rb + conv_reads
    if geo.stride == 2:
        scr += n * hw * rb + n * geo.tiles_o * 9 * BMO * rb
    l2 = (geo.programs * geo.slot_images * geo.border + nchunk * scr) * eb + nchunk * n * rb * 8
    # every bound is a runtime value (fixed: compiled as a loop even at one trip) but the work items'
    # with ONE, which the compiler sees as one trip
    per_image = () if geo.resident else (Loop("expand tiles", geo.tiles_e, fixed=True),)
    per_image += (Loop("conv tiles", geo.tiles, fixed=True),)
    if geo.stride == 2:
        per_image += (Loop("blur tiles", geo.tiles_o, fixed=True),)
    rounds = cdiv(geo.items, geo.programs)
    loops = (Loop("zero scratch", cdiv(geo.slot_images * geo.border, ZERO_BLOCK), fixed=True),
             Loop("work items", rounds, (Loop("chunks", geo.chunks_per_group,
                                              (Loop("images", geo.ib, per_image, fixed=True),), fixed=True),),
                  fixed=not one))
    if geo.gate:
        loops += (Loop("gate items", rounds, fixed=not one),
                  Loop("gate images", rounds * geo.ib, (Loop("gate steps", cdiv(r, GATE_ROWS), fixed=True),),
                       fixed=True))
    # L1-allocating loads, per item: x (RESIDENT: once; else once per chunk), each chunk's weights
    # and its slot once (the nine taps re-read it from L1), the means
    cg, ib = geo.chunks_per_group, geo.ib
    x_item = ib * hw * c * eb * (1 if geo.resident else cg)
    weights = cg * (rb * c + rb * 72 + 2 * rb + s * rb) * eb
    slots = cg * (geo.slot * eb + geo.mean_slot * 4)
    if geo.gate:  # per item: W_se2 and the SE biases, the item's images' SE partials
        weights += (r * s + r + s) * eb + ib * nchunk * geo.sp * 4
    return KernelCost(useful, mma, dram, loops, l2_bytes=l2, scratch_bytes_per_program=geo.scratch_bytes,
                      l1_unique_bytes_per_program=rounds * (x_item + weights + slots),
                      l1_working_set_bytes=geo.scratch_bytes,
                      note=f"{geo.programs} persistent programs, {geo.items} items of {ib} image(s) x {cg} "
                      f"chunks of {rb} channels" + (", x read once per item" if geo.resident else ""))


def project_cost(geo: MBConvGeometry, *, residual: bool = True) -> KernelCost:
    """What the projection does (``residual``: it reads the residual tile, at stride 1)."""
    n, r, k, s, eb = geo.n, geo.r, geo.k, geo.s, geo.elem
    res = residual and geo.stride == 1
    steps = cdiv(r, P_BR)
    tiles, kb = geo.p_grid
    dram = (k * r + k + n * geo.ohw * k * (2 if res else 1)) * eb + (0 if geo.g_in_l2 else geo.g_bytes)
    # the SE: the gates the hidden kernel wrote (GATE), or W_se2, the biases and the SE partials
    dram += n * r * eb if geo.gate else (r * s + s + r) * eb + n * geo.nchunk * geo.sp * 4
    mma = tiles * kb * geo.p_bm * geo.p_bn * steps * P_BR
    # L1-allocating loads: the SE partials of the tile's images and the SE biases (GATE: the images'
    # gates), the projection bias, the residual tile: each read once (W_se2, g and W_proj are pipelined
    # cp.async copies, L2 only)
    unique = (geo.p_bn + (geo.p_bm * geo.p_bn if res else 0)) * eb
    se = geo.ipt * r * eb if geo.gate else (2 * s + r) * eb + geo.ipt * geo.nchunk * geo.sp * 4
    return KernelCost(n * geo.ohw * r * k + (0 if geo.gate else n * r * s), mma, dram, (Loop("R steps", steps),),
                      l1_unique_bytes_per_program=unique + se,
                      l1_working_set_bytes=geo.ipt * (r * eb if geo.gate else geo.nchunk * geo.sp * 4),
                      l2_bytes=geo.g_bytes if geo.g_in_l2 else 0,
                      l2_footprint_bytes=geo.g_bytes if geo.g_in_l2 else 0,
                      note=("g read from L2" if geo.g_in_l2 else "g read from DRAM")
                      + (f", {geo.ipt} images per tile" if geo.ipt > 1 else ""))
