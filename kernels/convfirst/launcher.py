"""Host side of the fused ConvFirst kernels (kernel.py): the tile table, kernel limits, the grid,
the launch and its cost declaration. Every function here assumes the op's checks passed (op.py).

Tile constants (convfirst_config)
---------------------------------
Chosen by compiling for sm_90 and reading the issue estimate and register use (no GPU timings yet);
every shipped configuration is compiled for sm_90 and sm_80 in tests/kernels/test_convfirst.py.
  * stride 1: 16 x 16 tiles (256 pixels amortise the per-chunk and per-tap overheads and halve the L2
    weight traffic of 128); 4 warps up to 32 channels, 8 warps above (the accumulators, the hidden
    tile and the conv output then fit in 255 registers without spilling). BLOCK_H = 64 unless that
    pads R by more than 1/8 (R = 96 -> 32, 48 and 72 -> 16), and 32 for C > 64, where a 64-wide
    hidden tile next to two accumulator parts would spill.
  * stride 2: 8 x 8 output tiles with 4 warps for inputs up to 32 channels; 8 x 16 with 8 warps and
    16-channel blur parts for 48-64 (a 64-pixel tile on 8 warps spends most of its FFN in per-chunk
    overhead; 32-channel parts on 128 pixels spill).
  * fp32 (the checking path): 8 x 8 or 8 x 16 tiles and BLOCK_H <= 32 (3xTF32 operands triple the
    registers; a 16 x 16 tile at C = 96 needed 237 KB of shared memory). bf16 stride 2 blurs in fp32
    in 16-channel parts on 8 x 8 tiles.
  * num_stages = 2: the hidden loop's weight chunks are double-buffered; the conv loop has 5 trips.
  * The stride-2 window is unrolled for fp16 (one block of straight-line code per channel part); the
    other dtypes run a runtime loop over the three tap rows (ROW_LOOP), which compiles 2-3x faster
    (CI compiles every configuration) but issues ~35% more instructions (register rotation,
    recomputed addresses): 99.8 instead of 72.7 us for the 32 -> 64 block.
Under the interpreter the same single config is used (no autotuning), so launches are deterministic
under torch.compile and CUDA-graph capture. Widths above 128 (stride 1) or 64 input channels
(stride 2) are rejected before launch; ConvFirstNet uses at most 96 and 64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .._cost import KernelCost, Loop
from .._launch import GROUP_WIDTH, launch
from .kernel import _convfirst_s1_kernel, _convfirst_s2_kernel

MAX_CHANNELS = 128  # widest block the on-chip tiles are laid out for (ConvFirstNet uses <= 96)
MAX_CHANNELS_S2 = 64  # input channels of a stride-2 block (at most four blur/conv parts; ConvFirstNet: <= 64)
S2_PART = 16  # channels per blur/conv part of the stride-2 kernel when the input is wider than 32


@dataclass(frozen=True)
class ConvFirstConfig:
    """One compiled variant: the constexprs and launch options of a kernel."""

    stride: int
    c: int  # block input channels
    k: int  # output channels (== c for stride 1)
    c_parts: tuple[int, int]  # stride 1: power-of-two channel parts (second 0 if none);
    # stride 2: (CP, CP2): channels padded to a power of two, blurred and convolved in parts of CP2
    k_parts: tuple[int, int]  # output channel parts
    tile_h: int
    tile_w: int
    block_h: int
    row_loop: bool  # stride 2: runtime loop over the three tap rows (faster to compile, more instructions)
    num_warps: int
    num_stages: int
    precision: str  # tl.dot input_precision

    @property
    def block_m(self) -> int:
        return self.tile_h * self.tile_w


DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def channel_parts(c: int) -> tuple[int, int]:
    """c rounded up to a multiple of 16 (the smallest tl.dot K) as two powers of two, e.g. 96 -> (64, 32),
    48 -> (32, 16), 72 -> (64, 16): no padding to the next power of two."""
    c16 = -(-c // 16) * 16
    p0 = 1 << (c16.bit_length() - 1)
    p1 = c16 - p0
    if p1 & (p1 - 1):  # 112 = 64 + 48: not two powers of two; pad the second part
        p1 = triton.next_power_of_2(p1)
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


def convfirst_config(
    c: int, k: int, stride: int, dtype: torch.dtype = torch.float16, r: int | None = None
) -> ConvFirstConfig:
    """The tile config for a C -> K block with R hidden channels (default 6C) in `dtype`."""
    r = 6 * c if r is None else r
    k_parts = channel_parts(k)
    bh = hidden_block(r)
    fp32 = dtype == torch.float32
    if stride == 1:
        c_parts = k_parts
        width = sum(c_parts)
        if fp32:  # 3xTF32 dots triple the operand registers: smaller tiles and hidden chunks
            (th, tw, warps), bh = ((8, 8, 4) if width <= 32 else (8, 16, 8)), min(bh, 32)
        elif width <= 32:
            th, tw, warps = 16, 16, 4
        else:
            th, tw, warps = 16, 16, 8
            if width > 64:
                bh = min(bh, 32)
    else:
        cp = max(16, triton.next_power_of_2(c))
        if dtype == torch.float16 and cp <= 32:
            c_parts, (th, tw, warps) = (cp, cp), (8, 8, 4)
        elif dtype == torch.float16:
            c_parts, (th, tw, warps) = (cp, S2_PART), (8, 16, 8)
        else:  # the blur runs in fp32: parts of 16 channels
            c_parts, (th, tw, warps) = (cp, S2_PART), (8, 8, 4)
            if fp32:
                bh = min(bh, 32)
    # the unrolled stride-2 window is the fast path (fp16); the other dtypes loop over the tap rows,
    # which compiles ~3x faster
    row_loop = stride == 2 and dtype != torch.float16
    return ConvFirstConfig(stride, c, k, c_parts, k_parts, th, tw, bh, row_loop, warps, 2,
                           precision_for(dtype))


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
    cfg = convfirst_config(c, k, stride, x.dtype, r)
    grid = (n * triton.cdiv(ho, cfg.tile_h) * triton.cdiv(wo, cfg.tile_w),)
    # inline asm does not run in the interpreter (CPU tensors); GPU and recorded launches use it
    asm = x.device.type != "cpu" and x.dtype != torch.float32
    strides = (x.stride(0), x.stride(2), x.stride(3), *w_conv.stride(), *w1.stride(), *w2.stride())
    meta = dict(TH=cfg.tile_h, TW=cfg.tile_w, BLOCK_H=cfg.block_h, EVEN_R=r % cfg.block_h == 0,
                PRECISION=cfg.precision, ASM=asm, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    cost = lambda: launch_cost(cfg, n, h, w, r)
    if stride == 1:
        launch(_convfirst_s1_kernel, grid, x, w_conv, b_conv, w1, b1, w2, b2, out, h, w, r, *strides,
               C=c, C0=cfg.c_parts[0], C1=cfg.c_parts[1], cost=cost, **meta)
    else:
        launch(_convfirst_s2_kernel, grid, x, w_conv, b_conv, w1, b1, w2, b2, out, h, w, ho, wo, r, *strides,
               C=c, CP=cfg.c_parts[0], CP2=cfg.c_parts[1], K=k, K0=cfg.k_parts[0], K1=cfg.k_parts[1],
               BLUR_F16=x.dtype == torch.float16, ROW_LOOP=cfg.row_loop, cost=cost, **meta)
    return out


def launch_cost(cfg: ConvFirstConfig, n: int, h: int, w: int, r: int) -> KernelCost:
    """What one launch of `cfg` on an N x C x H x W input issues (see ``kernels/_cost.py``)."""
    ho, wo = (h, w) if cfg.stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    programs = n * triton.cdiv(ho, cfg.tile_h) * triton.cdiv(wo, cfg.tile_w)
    bm, bh = cfg.block_m, cfg.block_h
    chunks = triton.cdiv(r, bh)
    kw = sum(cfg.k_parts)
    if cfg.stride == 1:
        cw = sum(cfg.c_parts)
        conv = 5 * 16 * cw * bm  # five two-tap steps, K = 16, N = 8 per group
        ffn = chunks * bh * (cw + kw) * bm
        loops = [Loop("conv", 5) for p in cfg.c_parts if p] + [Loop("hidden", chunks)]
    else:
        cp, cp2 = cfg.c_parts
        conv = 9 * cp2 * cp * bm  # nine block-diagonal [CP2, CP2] tap dots per channel part
        ffn = chunks * bh * (2 * cp + kw) * bm
        loops = [Loop("taprow", 3) for _ in range(cp // cp2) if cfg.row_loop] + [Loop("hidden", chunks)]
    eb = 2 if cfg.precision == "tf32" else 4
    c1 = cfg.c if cfg.stride == 1 else 2 * cfg.c
    weights = 9 * GROUP_WIDTH * cfg.c + cfg.c + r * c1 + r + cfg.k * r + cfg.k
    # L1-allocating loads: stride 1 reads the tile's x once more for the residual, stride 2 its 5x5
    # windows (the halo tile, re-read across taps from L1); both the conv weights and the biases
    if cfg.stride == 1:
        tile = cfg.tile_h * cfg.tile_w * cfg.c
    else:
        tile = (2 * cfg.tile_h + 3) * (2 * cfg.tile_w + 3) * cfg.c
    return KernelCost(
        l1_unique_bytes_per_program=eb * (tile + 9 * GROUP_WIDTH * cfg.c + cfg.c + r + cfg.k),
        useful_macs=useful_macs(n, cfg.c, h, w, r, cfg.k, cfg.stride),
        mma_macs=programs * (conv + ffn),
        dram_bytes=eb * (n * cfg.c * h * w + n * cfg.k * ho * wo + weights),
        loops=tuple(loops),
        note=f"C={cfg.c} K={cfg.k} R={r} tile {cfg.tile_h}x{cfg.tile_w}",
    )
