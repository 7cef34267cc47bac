"""Host side of the fused ConvFirst kernels (kernel.py): the tile table, kernel limits, the grid,
the launch and its cost declaration. Every function here assumes the op's checks passed (op.py).

Tile constants (convfirst_config)
---------------------------------
Chosen by compiling for sm_90 and reading the static cost report (registers, spills, occupancy, the
binding term; no GPU timings yet). The sampled configurations are compiled for sm_90 and sm_80 in
tests/kernels/test_convfirst.py, all of them with CONVFIRSTNET_FULL_MATRIX=1.
  * Persistent programs (programs_per_sm per SM, checked against the compiled occupancy), num_stages 1:
    no load is software-pipelined (a pipelined 16-byte load is cp.async.cg, which skips L1).
  * stride 1, 16-bit, up to 32 channels: 8 x 16 tiles, 4 warps, 3 programs per SM (2 at R = 6C: what
    fits on sm_80), all hidden chunks resident (BLOCK_H <= 32); 16 x 16 tiles on 4 warps needed 240
    registers (2 per SM) and spilled at R = 6C. 33-64 channels: 8 x 16 tiles, 8 warps, one program
    per SM with every chunk resident (C = 64: 96 KB); 16 x 16 tiles spilled. Wider (C = 72, 96): 16 x 16
    tiles, 8 warps, BLOCK_H 32, no chunk resident (a resident prefix spilled its wgmma descriptors; 8 x 16
    tiles doubled the streamed bytes per pixel): 96 KB of chunks cached in L1 (L1_CACHED_BUDGET), the
    rest streamed from L2. Their layout keeps shared memory at 60 KB, so that 192 KB of L1 hold the
    cached chunks beside the halo tile: conv dots of 32 channels (conv_sub) with the narrow part first,
    the residual added after the FFN (residual_late: added before, its layout conversion beside the
    conv output's buffer made 64 KB, a 100 KB carve-out), and x's address split into image base and int32
    pixel offsets (split_base: with per-pixel 64-bit pointers ptxas spilled 8-16 B; C = 32 and 64
    compile to fewer instructions with them). On sm_80 (192 KB L1 + shared) the working set does not fit
    beside the 60 KB, and the wide layout spilled 32-88 B: there, and on any GPU but sm_90, they stream.
  * stride 2, fp16: 8 x 8 output tiles with 4 warps and 2 programs per SM up to 32 input channels,
    every chunk resident unless the output has a second part (K = 48: those spilled, so they stream);
    8 x 16 tiles, 8 warps and 16-channel blur parts for 48-64 with 60 KB of resident chunks (Small's
    64 -> 96: 2 of 6; 3 spilled, and the shared memory of 4 left too little L1 for the window).
  * BLOCK_H = 64 unless that pads R by more than 1/8 (R = 96 -> 32, 48 and 72 -> 16), capped as above.
  * fp32 (the checking path): 8 x 8 or 8 x 16 tiles, BLOCK_H <= 32, nothing resident (3xTF32 operands
    triple the registers; its wide variants spill up to 2 KB, as the previous design's did). bf16
    stride 2 blurs in fp32 in 16-channel parts on 8 x 8 tiles, 48 KB resident.
  * The stride-2 window is unrolled for fp16 (one block of straight-line code per channel part); the
    other dtypes run a runtime loop over the three tap rows (ROW_LOOP), which compiles 2-3x faster
    but issues ~35% more instructions (register rotation, recomputed addresses).

Staged stride-1 blocks (staged.py)
----------------------------------
Every 16-bit stride-1 block on sm_90 runs as two launches instead of the fused kernel: the group-width-8
conv (kernels/gconv, a = gconv(x) stored, C channels) and ``_convfirst_ffn_kernel`` (y = a + b_conv,
then the hidden chunks as above, the residual added in its accumulators), which stores nothing wide
either. The fused kernel keeps the conv's halo window, its weights and the chunks on one 8-warp program
per SM (C >= 64), whose exposed load waits bind it; apart, the conv runs 2-3 programs per SM and the
FFN 4-warp programs (one or two per SM, below). Static estimate of Small's blocks, batch 128, sm_90
(us, low-high; sum = L1 pipe + latency, the terms that measured block times followed), fused -> staged:
  * C = 96 at 32^2: 188-269 -> 100-130 (sum 128-134 -> 110-115);
  * C = 64 at 64^2: 345-483 -> 169-203 (241-252 -> 207-216);
  * C = 32 at 128^2: 316-472 -> 273-315 (356-371 -> 356-371);
  * when the staged form shipped (before the FFN's pipelined tile loop, below): the whole forward
    8.12-10.89 -> 7.03-9.12 ms; faster at batch 1, 8 and 32 too (stage 1 alone 4 us slower at batch 1);
    Pico's and Nano's widths (16-72) 1.2-2.2x faster, by the sum 1.0-1.7x.
FFN tiles: 128 rows, 64 hidden channels streamed from L2 at C = 72, 96 (a resident prefix spilled, as
did chunks cached in L1); 64 rows, every chunk resident at C = 48, 64; 128 rows, every chunk resident
up to 32 channels. The resident chunks' b1 is loaded once, into registers: loaded per chunk and tile,
its latency was exposed before each chunk's bias + ReLU (C = 64: 209-302 -> 198-266 us; prefetched a
chunk ahead instead, the compiler moved the loads back to their use). Where every chunk is resident the
tile loop is the innermost loop, and Triton software-pipelines it (3 stages: each tile's a and x rows
cp.async'd two tiles ahead, one program per SM, whose buffers and chunks two would not fit at C = 64):
the rows' load waits had been exposed before each tile's first dot, 75 % of the FFN's waits at C = 64.
C = 64: 198-266 -> 169-203 us, C = 48 (Nano): 213-321 -> 159-209, C = 32: 282-369 -> 273-315; the rows
through shared memory raise the L1 pipe term, so the sum rises by 1-14 us (C = 64: 195-203 -> 207-216;
on Triton 3.6 it falls, 67-70 -> 62-64 for the FFN launch), and at Nano's and Tiny's C = 24 (128^2) it
now ranks the staged block 2 % slower than the fused kernel (359-374 against 353-368 us; the model:
243-286 against 309-465). Below sm_90, when forced: 64 rows at C = 72, 96 (128 spilled 24 B). fp32
(the checking path) keeps the fused kernel, and so does the A100: there the model and the sum disagree
at C = 24, 32 (64^2), 72 and 96 (C = 96: 248-317 -> 244-300 us, sum 397 -> 420) and agree on staged
only at 16, 48 and 64. ``STAGED`` True or False forces one
form. A GPU run must confirm the ranking (scripts/gpu_check.py times the fused form beside it).

Under the interpreter the same single config is used (no autotuning), so launches are deterministic
under torch.compile and CUDA-graph capture. Widths above 128 (stride 1) or 64 input channels
(stride 2) are rejected before launch; ConvFirstNet uses at most 96 and 64.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .._cost import KernelCost, Loop, active_recording
from .._launch import FORCED_TAP_ORDER, GROUP_WIDTH, cdiv, launch, next_power_of_2, triton_before
from .kernel import _convfirst_s1_kernel, _convfirst_s2_kernel, _m_slices

MAX_CHANNELS = 128  # widest block the on-chip tiles are laid out for (ConvFirstNet uses <= 96)
MAX_CHANNELS_S2 = 64  # input channels of a stride-2 block (at most four blur/conv parts; ConvFirstNet: <= 64)
S2_PART = 16  # channels per blur/conv part of the stride-2 kernel when the input is wider than 32
# Persistent programs: the launch runs (SMs x programs_per_sm) programs, each looping over tiles. Under
# the interpreter (CPU tensors) a few programs stand for the SMs, so that every tile loop runs several
# times; recorded launches (meta tensors) are sized for the recording's target, by default an H100.
INTERPRETER_SMS = 1
RECORD_SMS = 132
RECORD_ARCH = 90
# W1 + W2 bytes of the hidden chunks a wide stride-1 program loads through L1 (ld.global, re-read from L1 by
# its later tiles): with the halo tile and the conv weights (C = 96: 62 + 15 KB) 176 of the 192 KB of L1
# that its 60 KB of shared memory leave on an H100 (the compile test checks the fit)
L1_CACHED_BUDGET = 96 << 10
# stride-1 blocks as the conv + FFN launches (staged.py) instead of the fused kernel: None = every 16-bit
# block on sm_90 and later (the docstring's "Staged stride-1 blocks"); True or False forces one form
STAGED: bool | None = None


@dataclass(frozen=True)
class ConvFirstConfig:
    """One compiled variant: the constexprs and launch options of a kernel."""

    stride: int
    c: int  # block input channels
    k: int  # output channels (== c for stride 1)
    c_parts: tuple[int, int]  # stride 1: the conv's power-of-two channel parts (second 0 if none), each
    # an A part of the expand; stride 2: (CP, CP2): channels padded to a power of two, blurred and
    # convolved in parts of CP2
    k_parts: tuple[int, int]  # output channel parts
    tile_h: int
    tile_w: int
    block_h: int
    row_loop: bool  # stride 2: runtime loop over the three tap rows (faster to compile, more instructions)
    num_warps: int
    num_stages: int
    precision: str  # tl.dot input_precision
    r: int = 0  # hidden channels
    resident: int = 0  # hidden chunks whose W1 and W2 stay in shared memory for all of a program's tiles
    programs_per_sm: int = 0  # persistent programs per SM (0: one program per tile)
    split_base: bool = False  # stride 1: x's address as image base + int32 pixel offsets
    residual_late: bool = False  # stride 1: the residual is added after the FFN
    conv_sub: int = 0  # stride 1: channels per conv dot (0: a whole channel part)
    cached: int = 0  # the next hidden chunks, whose W1 and W2 are loaded per tile through L1 (they stay there)

    @property
    def block_m(self) -> int:
        return self.tile_h * self.tile_w

    @property
    def chunks(self) -> int:
        return -(-self.r // self.block_h)


DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The order in which the stride-1 conv loads each tap pair (kernel.py ``_tap_pair``), which decides the
# bank conflicts of the pair's copy to shared memory for the batched mma.sync. Nsight Compute on an H200
# (benchmarks/results/ncu/20261126T150000Z_*, Triton 3.6, order 0): 46-51 % of these kernels' shared
# wavefronts were conflicts and their L1 data pipe ran 54-86 % busy. ``conflict_free_tap_order()``
# (sm_90 PTX: tests/kernels/test_convfirst.py) takes the L1-pipe term of Small's stride-1 launches from
# 348-363 / 190-198 / 148-154 us (stages 0 / 1 / 2, Triton 3.6) to 189-197 / 108-112 / 78-81, and
# their latency term from 202-211 / 147-153 / 149-156 to 185-193 / 116-121 / 103-108. The model's
# max() ranks stages 0-1 slower by its wait term, as it ranked the same change of the MBConv conv, which
# an H200 then measured 20-30 % faster per block; there the measured saving matched the fall of the
# L1-pipe term within 3-36 us on all four blocks (docs/cost-model.md, "What the tap-order change
# measured"), and the block times were 1.04-1.27x the L1-pipe plus latency terms, which order 1 lowers
# here by 113-184 us per block. Shipped on that evidence; a GPU run must confirm it (gpu_check.py times
# order 0 beside it, scripts/gpu_variants.py "convfirst taps"). None: conflict_free_tap_order(); 0, 1
# or 2 (CONVFIRSTNET_TAP_ORDER) force one.
TAP_ORDER = FORCED_TAP_ORDER


def conflict_free_tap_order(batch: int) -> int:
    """The TAPS whose tap-pair copies compile conflict-free with the installed Triton for a conv batch of
    ``batch`` entries ([batch, rows, 16] tiles): 1, except with Triton 3.7 or later at batch 4, where 0
    already is (and 1 costs 33 registers: Small's stages.0)."""
    return 0 if not triton_before(3, 7) and batch <= 4 else 1


def tap_order(cfg: "ConvFirstConfig") -> int:
    """The TAPS a stride-1 kernel of ``cfg`` compiles with: ``TAP_ORDER``, or when it is None the
    conflict-free order for the batch of its widest conv dot (kernel.py ``_gconv_pairs``)."""
    if TAP_ORDER is not None:
        return TAP_ORDER
    if cfg.c_parts[1] and not cfg.conv_sub and cfg.block_m >= 256:
        # sm_80's two-part config (C = 96 as 64 + 32, 256-pixel tiles, conv dots of 64 channels) is at
        # 255 registers: order 1 compiled with 24 B of spills there (Triton 3.8), order 0 without
        return 0
    groups = min(max(cfg.c_parts), cfg.conv_sub or 128) // 8
    return conflict_free_tap_order(_m_slices(cfg.num_warps, groups, cfg.tile_h * cfg.tile_w) * groups)


def channel_parts(c: int) -> tuple[int, int]:
    """c rounded up to a multiple of 16 (the smallest tl.dot K) as two powers of two, e.g. 96 -> (64, 32),
    48 -> (32, 16), 72 -> (64, 16): no padding to the next power of two."""
    c16 = -(-c // 16) * 16
    p0 = 1 << (c16.bit_length() - 1)
    p1 = c16 - p0
    if p1 & (p1 - 1):  # 112 = 64 + 48: not two powers of two; pad the second part
        p1 = next_power_of_2(p1)
    return p0, p1


def hidden_block(r: int) -> int:
    """Hidden chunk: 64 unless its masked tail would waste more than 1/8 of R, then 32, then 16."""
    for bh in (64, 32):
        if -(-r // bh) * bh - r <= r // 8:
            return bh
    return 16


def precision_for(dtype: torch.dtype) -> str:
    # fp32: 3xTF32 (three tensor-core passes, ~fp32 accuracy); ignored for 16-bit inputs.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def resident_chunks(a_width: int, k_parts: tuple[int, int], bh: int, r: int, eb: int, budget: int) -> int:
    """Hidden chunks whose expand (over `a_width` padded input columns) and projection weights fit in
    `budget` bytes of shared memory."""
    per_chunk = bh * (a_width + sum(k_parts)) * eb
    return min(-(-r // bh), budget // per_chunk)


def convfirst_config(
    c: int, k: int, stride: int, dtype: torch.dtype = torch.float16, r: int | None = None, arch: int = 90
) -> ConvFirstConfig:
    """The tile config for a C -> K block with R hidden channels (default 6C) in `dtype`, for a GPU of
    compute capability `arch` (x 10)."""
    r = 6 * c if r is None else r
    k_parts = channel_parts(k)
    bh = hidden_block(r)
    fp32 = dtype == torch.float32
    eb = 4 if fp32 else 2
    if stride == 1:
        c_parts = k_parts
        width = sum(k_parts)
        # (tile h, tile w, warps, programs per SM, shared memory for resident weights)
        if fp32:  # 3xTF32 dots triple the operand registers: smaller tiles and hidden chunks
            bh = min(bh, 32)
            th, tw, warps, per_sm, budget = (8, 8, 4, 2, 0) if width <= 32 else (8, 16, 8, 1, 0)
        elif width <= 32:
            th, tw, warps, per_sm, budget = 8, 16, 4, 3 if r <= 4 * c else 2, 96 << 10
            bh = min(bh, 32)
        elif width <= 64:
            th, tw, warps, per_sm, budget = 8, 16, 8, 1, 128 << 10
        else:  # the weights do not fit beside the tile and its registers: a part of them cached in L1
            th, tw, warps, per_sm, budget = 16, 16, 8, 1, 0
            bh = min(bh, 32)
        res = resident_chunks(sum(c_parts), k_parts, bh, r, eb, budget)
        cfg = ConvFirstConfig(1, c, k, c_parts, k_parts, th, tw, bh, False, warps, 1, precision_for(dtype),
                              r, res, per_sm)
        if width > 64 and not fp32 and arch == 90:
            # 60 KB of shared memory (the conv's 32-channel dots staged, the narrow part first; the residual
            # added after the FFN, so that its layout conversion does not meet the conv output's buffer):
            # a 64 KB carve-out leaves 192 KB of L1 for the halo tile, the conv weights and the cached
            # chunks (with CONVFIRSTNET_L1_CARVEOUT=fit; Triton's default carve-out leaves 28 KB, measured
            # L1 hit rate 24 %: kernels/_carveout.py). The base/offset split of x's address is what ptxas compiles without spilling here.
            cached = min(cfg.chunks - res, L1_CACHED_BUDGET // (bh * (c + k) * eb))
            cfg = replace(cfg, conv_sub=32, residual_late=True, split_base=True, cached=cached)
        return cfg
    cp = max(16, next_power_of_2(c))
    # (parts, tile h, tile w, warps, programs per SM, shared memory for resident weights)
    if dtype == torch.float16 and cp <= 32:
        # a second output part's resident chunks spilled (K = 48): those stream their weights
        c_parts, (th, tw, warps, per_sm, budget) = (cp, cp), (8, 8, 4, 2, 0 if k_parts[1] else 64 << 10)
        if arch < 90:  # mma.sync: 64-channel chunks spilled 104 B at 32 -> 64 (sm_80); 32 keep all resident
            bh = min(bh, 32)
    elif dtype == torch.float16:
        c_parts, (th, tw, warps, per_sm, budget) = (cp, S2_PART), (8, 16, 8, 1, 60 << 10)
    else:  # the blur runs in fp32: parts of 16 channels
        c_parts, (th, tw, warps, per_sm, budget) = (cp, S2_PART), (8, 8, 4, 2, 0 if fp32 else 48 << 10)
        if fp32:
            bh = min(bh, 32)
    # the unrolled stride-2 window is the fast path (fp16); the other dtypes loop over the tap rows,
    # which compiles ~3x faster
    row_loop = dtype != torch.float16
    res = resident_chunks(2 * c_parts[1] * -(-c // c_parts[1]), k_parts, bh, r, eb, budget)
    return ConvFirstConfig(stride, c, k, c_parts, k_parts, th, tw, bh, row_loop, warps, 1,
                           precision_for(dtype), r, res, per_sm)


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
    cfgs = {convfirst_config(c, k, s, dtype, r) for c, r, k, s in MODEL_SHAPES}
    return sorted(cfgs, key=lambda cfg: (cfg.stride, cfg.c, cfg.k, cfg.block_h))


def useful_macs(n: int, c: int, h: int, w: int, r: int, k: int, stride: int) -> int:
    """Multiply-accumulates of the block as the paper counts them (``profile.count_macs``): grouped
    conv at full resolution (72 C per pixel), BlurPool (9 per output element of the 2C-channel concat)
    for stride 2, and the two 1x1 layers at output resolution."""
    conv = n * h * w * 9 * GROUP_WIDTH * c
    if stride == 1:
        return conv + n * h * w * (c * r + r * k)
    ho, wo = (h + 1) // 2, (w + 1) // 2
    return conv + n * ho * wo * (9 * 2 * c + 2 * c * r + r * k)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------


def check_supported(x: torch.Tensor, c: int, k: int, stride: int = 1) -> None:
    """Kernel limits beyond the op's checks (raised before any allocation or launch)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        # Triton's interpreter computes bf16 tl.dot wrongly (garbage of 1e10 magnitude, triton 3.9)
        raise NotImplementedError(
            "convfirstnet.convfirst: bfloat16 through the Triton interpreter gives wrong tl.dot results; "
            "use float16/float32, or CONVFIRSTNET_KERNELS=reference on CPU"
        )
    if c % GROUP_WIDTH:
        raise ValueError(f"convfirstnet.convfirst: channels must be a multiple of {GROUP_WIDTH}, got {c}")
    if max(c, k) > MAX_CHANNELS:
        raise ValueError(
            f"convfirstnet.convfirst: the fused kernel keeps all channels on chip and supports at most "
            f"{MAX_CHANNELS}, got C={c}, K={k}"
        )
    if stride == 2 and c > MAX_CHANNELS_S2:
        raise ValueError(
            f"convfirstnet.convfirst: the fused stride-2 kernel supports at most {MAX_CHANNELS_S2} input "
            f"channels, got C={c}"
        )


def _vector_strides(x: torch.Tensor) -> torch.Tensor:
    """x with unit channel stride and the other strides multiples of 8 elements (what the kernels'
    16-byte channel vectors assume); any other layout is copied to channels-last once."""
    s = x.stride()
    if s[1] == 1 and s[0] % 8 == 0 and s[2] % 8 == 0 and s[3] % 8 == 0 and x.storage_offset() % 8 == 0:
        return x
    return x.contiguous(memory_format=torch.channels_last)


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
    check_supported(x, c, k, stride)
    ho, wo = (h, w) if stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    out = torch.empty((n, k, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    x = _vector_strides(x)
    b_conv, b1, b2 = b_conv.contiguous(), b1.contiguous(), b2.contiguous()
    cfg = convfirst_config(c, k, stride, x.dtype, r, device_arch(x.device))
    tiles = n * cdiv(ho, cfg.tile_h) * cdiv(wo, cfg.tile_w)
    grid = (programs_for(cfg, tiles, x.device),)
    # inline asm does not run in the interpreter (CPU tensors); GPU and recorded launches use it
    asm = x.device.type != "cpu" and x.dtype != torch.float32
    wstrides = (*w_conv.stride(), *w1.stride(), *w2.stride())
    cost = lambda: launch_cost(cfg, n, h, w, grid[0])
    if stride == 1:
        xs8 = (x.stride(0) // 8, x.stride(2) // 8, x.stride(3) // 8)
        launch(_convfirst_s1_kernel, grid, x, w_conv, b_conv, w1, b1, w2, b2, out, h, w, tiles, r, 5, *xs8,
               *wstrides, C=c, NPX=1 + (cfg.c_parts[1] > 0), PW=cfg.c_parts[0],
               PWL=cfg.c_parts[1] or cfg.c_parts[0], K0=cfg.k_parts[0], K1=cfg.k_parts[1],
               R=r, TH=cfg.tile_h, TW=cfg.tile_w,
               BLOCK_H=cfg.block_h, RESIDENT=cfg.resident, CACHED=cfg.cached,
               SUB=cfg.conv_sub or 128, RES_LATE=cfg.residual_late,
               SPLIT_BASE=cfg.split_base, WARPS=cfg.num_warps,
               PRECISION=cfg.precision,
               ASM=asm, TAPS=tap_order(cfg), num_warps=cfg.num_warps, num_stages=cfg.num_stages, cost=cost)
    else:
        xs8 = (x.stride(0) // 8, x.stride(2) // 8, x.stride(3) // 8)
        cp2 = cfg.c_parts[1]
        launch(_convfirst_s2_kernel, grid, x, w_conv, b_conv, w1, b1, w2, b2, out, h, w, ho, wo, tiles, r,
               *xs8, *wstrides, C=c, CP2=cp2, NPX=cdiv(c, cp2), K=k, K0=cfg.k_parts[0],
               K1=cfg.k_parts[1], R=r, TH=cfg.tile_h, TW=cfg.tile_w, BLOCK_H=cfg.block_h,
               RESIDENT=cfg.resident, CACHED=cfg.cached, PRECISION=cfg.precision, ASM=asm,
               BLUR_F16=x.dtype == torch.float16,
               ROW_LOOP=cfg.row_loop, num_warps=cfg.num_warps, num_stages=cfg.num_stages, cost=cost)
    return out


def device_sms(device: torch.device) -> int:
    """SMs of the device the launch runs on (CPU: the interpreter's stand-in; meta: the recording's
    target, by default an H100)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "cpu":
        return INTERPRETER_SMS
    rec = active_recording()
    return rec and rec.sms or RECORD_SMS


def device_arch(device: torch.device) -> int:
    """Compute capability x 10 of the device the launch runs on (CPU, the interpreter: sm_90's configs;
    meta: the recording's target, by default an H100)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    rec = active_recording() if device.type == "meta" else None
    return rec and rec.arch or RECORD_ARCH


def programs_for(cfg, tiles: int, device: torch.device) -> int:
    """Programs of a launch over `tiles` tiles: one per tile, or persistent programs (programs_per_sm per
    SM), as few as give the busiest one no more tiles (each loads its resident weights once). ``cfg``: a
    ConvFirstConfig or a staged.FFNConfig."""
    if not cfg.programs_per_sm:
        return tiles
    trips = cdiv(tiles, cfg.programs_per_sm * device_sms(device))
    return cdiv(tiles, trips)


def _l1_declaration(eb: int, trips: int, halo: int, small: int) -> dict:
    """The L1 part of a persistent program's declaration (elements -> bytes): per tile its halo window
    (re-read by the conv taps, and by the residual, from L1), once the conv weights, the biases (re-read
    by every tile, b1 of the streamed chunks included) and the cached chunks' W1 and W2 (plain
    ld.global, re-read by every tile). The streamed chunks' weights are not in it: they are
    ld.global.cg (LDG...STRONG.GPU, L2 only, counted in full by the report; the compile test pins that
    these are the only loads that skip L1, and that the working set fits in the L1 that the compiled
    shared memory leaves)."""
    return dict(l1_unique_bytes_per_program=eb * (trips * halo + small),
                l1_working_set_bytes=eb * (halo + small))


def _chunk_loops(cfg: ConvFirstConfig) -> tuple[Loop, ...]:
    """The runtime hidden-chunk loops of one tile: cached (through L1), then streamed (L2 only)."""
    cached = min(cfg.chunks - cfg.resident, cfg.cached)
    streamed = cfg.chunks - cfg.resident - cached
    return ((Loop("streamed", streamed),) if streamed else ()) + ((Loop("cached", cached),) if cached else ())


def _cached_elements(cfg: ConvFirstConfig, c1: int) -> int:
    """W1 and W2 elements of the cached chunks (masked rows and columns are not fetched)."""
    lo = cfg.resident * cfg.block_h
    return max(0, min(cfg.r, lo + cfg.cached * cfg.block_h) - lo) * (c1 + cfg.k)


def launch_cost(cfg: ConvFirstConfig, n: int, h: int, w: int, programs: int) -> KernelCost:
    """What one launch of `cfg` on an N x C x H x W input issues (see ``kernels/_cost.py``)."""
    ho, wo = (h, w) if cfg.stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    tiles = n * cdiv(ho, cfg.tile_h) * cdiv(wo, cfg.tile_w)
    trips = cdiv(tiles, programs)  # tiles of the busiest program
    r, bm, bh = cfg.r, cfg.block_m, cfg.block_h
    chunks = cfg.chunks
    kw = sum(cfg.k_parts)
    eb = 2 if cfg.precision == "tf32" else 4
    c1 = cfg.c if cfg.stride == 1 else 2 * cfg.c
    weights = 9 * GROUP_WIDTH * cfg.c + cfg.c + r * c1 + r + cfg.k * r + cfg.k
    if cfg.stride == 1:
        cw = sum(cfg.c_parts)
        conv = 5 * 16 * cw * bm  # five two-tap steps, K = 16, N = 8 per group
        ffn = chunks * bh * (cw + kw) * bm
        # L1-allocating loads: per tile its halo window (the nine taps and the residual re-read it from
        # L1), per program the conv weights and biases (re-read by every tile)
        halo = (cfg.tile_h + 2) * (cfg.tile_w + 2) * cfg.c
        # one five-step loop per conv dot: a channel part, or its slices of conv_sub channels
        conv_loops = sum(max(1, p // (cfg.conv_sub or p)) for p in cfg.c_parts if p)
        small = 9 * GROUP_WIDTH * cfg.c + cfg.c + r + cfg.k + _cached_elements(cfg, c1)
        return KernelCost(
            useful_macs=useful_macs(n, cfg.c, h, w, r, cfg.k, 1),
            mma_macs=programs * trips * (conv + ffn),
            dram_bytes=eb * (n * cfg.c * h * w + n * cfg.k * ho * wo + weights),
            loops=(Loop("tiles", trips, tuple(Loop("conv", 5) for _ in range(conv_loops)) + _chunk_loops(cfg)),),
            **_l1_declaration(eb, trips, halo, small),
            note=f"C={cfg.c} K={cfg.k} R={r} tile {cfg.tile_h}x{cfg.tile_w}, {cfg.resident}/{chunks} chunks "
                 f"resident, {min(cfg.cached, chunks - cfg.resident)} cached, {trips} tiles per program",
        )
    cp2 = cfg.c_parts[1]
    npx = cdiv(cfg.c, cp2)
    conv = 9 * cp2 * cp2 * npx * bm  # nine block-diagonal [CP2, CP2] tap dots per channel part
    ffn = chunks * bh * (2 * cp2 * npx + kw) * bm
    inner = [Loop("taprow", 3) for _ in range(npx) if cfg.row_loop] + list(_chunk_loops(cfg))
    # L1-allocating loads: per tile the 5x5 windows (the halo tile of the blurred 2x downsample,
    # re-read across taps from L1), per program the conv weights and the biases
    halo = (2 * cfg.tile_h + 3) * (2 * cfg.tile_w + 3) * cfg.c
    small = 9 * GROUP_WIDTH * cfg.c + cfg.c + r + cfg.k + _cached_elements(cfg, c1)
    return KernelCost(
        useful_macs=useful_macs(n, cfg.c, h, w, r, cfg.k, cfg.stride),
        mma_macs=programs * trips * (conv + ffn),
        dram_bytes=eb * (n * cfg.c * h * w + n * cfg.k * ho * wo + weights),
        loops=(Loop("tiles", trips, tuple(inner)),),
        **_l1_declaration(eb, trips, halo, small),
        note=f"C={cfg.c} K={cfg.k} R={r} tile {cfg.tile_h}x{cfg.tile_w}, {cfg.resident}/{chunks} chunks "
             f"resident, {trips} tiles per program",
    )
