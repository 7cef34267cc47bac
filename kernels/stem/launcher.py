"""Host side of the stem kernel (kernel.py, whose header explains the design): the tile configuration,
the kernel limits checked before launch, the grid and the launch with its cost declaration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._cost import KernelCost, Loop
from .._launch import cdiv, launch, next_power_of_2
from .kernel import _stem_kernel

FP32_PRECISION = "tf32x3"  # dot precision for fp32 operands (the interpreter computes exact fp32)
GRID_LIMIT = 2**31 - 1  # grid.x
INDEX_LIMIT = 2**31  # per-image element offsets are int32
MAX_CHANNELS = 128  # acc is a [BLOCK_M, C_PAD] fp32 register tile (128 per thread at C_PAD = 128)
MAX_IN_CHANNELS = 16  # cdiv(9 * 16, 32) = 5 im2col tiles, unrolled
ROW_STEPS = 4  # tiles per program: amortizes the program's setup (index decoding, weights, bias)
# Stem shapes of Pico..Small (SPEC Table 3): RGB in, C0 out.
MODEL_SHAPES: tuple[tuple[int, int], ...] = ((3, 16), (3, 24), (3, 32))


@dataclass(frozen=True)
class StemConfig:
    c_in: int
    c0: int
    c_pad: int  # C0 rounded up to a power of two >= 16 (the dot's N)
    bw: int  # output pixels per tile row (power of two <= BLOCK_M)
    steps: int  # tiles per program, one below the other (a runtime loop)
    block_m: int = 128
    num_warps: int = 4

    @property
    def rows(self) -> int:
        return self.block_m // self.bw

    @property
    def k_pad(self) -> int:
        return 32 * cdiv(9 * self.c_in, 32)


def stem_config(c_in: int, c_out: int, ho: int, wo: int) -> StemConfig:
    block_m = 128
    bw = min(block_m, next_power_of_2(max(1, wo)))
    steps = max(1, min(ROW_STEPS, cdiv(ho, block_m // bw)))
    return StemConfig(c_in, c_out, max(16, next_power_of_2(c_out)), bw, steps, block_m)



def check_supported(c_in: int, c_out: int) -> None:
    if c_out > MAX_CHANNELS or c_in > MAX_IN_CHANNELS:
        raise ValueError(
            f"convfirstnet.stem: the kernel supports up to {MAX_IN_CHANNELS} input and {MAX_CHANNELS} output "
            f"channels, got {c_in} -> {c_out}"
        )


def stem_grid(n: int, ho: int, wo: int, cfg: StemConfig) -> tuple[int, int, int]:
    """(programs, tiles_h, tiles_w) of a launch: tiles_h x tiles_w tiles per image, cfg.steps per program."""
    tiles_h, tiles_w = cdiv(ho, cfg.rows), cdiv(wo, cfg.bw)
    return n * cdiv(tiles_h, cfg.steps) * tiles_w, tiles_h, tiles_w


def check_launchable(x: torch.Tensor, c_out: int) -> None:
    """The limits of one launch, checked before it: grid.x and int32 offsets inside one image."""
    n, c_in, h, w = x.shape
    ho, wo = (h + 1) // 2, (w + 1) // 2
    programs, _, _ = stem_grid(n, ho, wo, stem_config(c_in, c_out, ho, wo))
    if programs > GRID_LIMIT:
        raise ValueError(
            f"convfirstnet.stem: {programs} programs for input {tuple(x.shape)} exceed the grid limit "
            f"{GRID_LIMIT}; split the batch"
        )
    span = sum((size - 1) * abs(stride) for size, stride in zip(x.shape[1:], x.stride()[1:])) + 1
    if span >= INDEX_LIMIT or ho * wo * c_out >= INDEX_LIMIT:
        raise ValueError(
            f"convfirstnet.stem: one image of {tuple(x.shape[1:])} spans {span} elements; the kernel indexes "
            f"inside an image with 32-bit offsets (limit {INDEX_LIMIT})"
        )


def stem_cost(n: int, h: int, w: int, cfg: StemConfig, tiles: int, elem: int, fp32: bool) -> KernelCost:
    ho, wo = (h + 1) // 2, (w + 1) // 2
    passes = 3 if fp32 else 1  # tf32x3: three tensor-core products per dot
    return KernelCost(
        useful_macs=n * ho * wo * cfg.c0 * 9 * cfg.c_in,
        mma_macs=passes * n * tiles * cfg.block_m * cfg.c_pad * cfg.k_pad,
        # the image once (each input pixel is in 1 to 4 windows; the overlap is served by L1/L2),
        # the output once, the weights and bias once
        dram_bytes=elem * (n * cfg.c_in * h * w + n * ho * wo * cfg.c0 + cfg.c0 * (9 * cfg.c_in + 1)),
        loops=(Loop("tile rows", cfg.steps),),
        note=f"{cfg.rows}x{cfg.bw}-pixel tiles, {cfg.steps} per program, K {9 * cfg.c_in} padded to "
        f"{cfg.k_pad}, N {cfg.c0} padded to {cfg.c_pad}" + (", tf32x3 (3 passes)" if fp32 else ""),
    )


def stem_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Launch the stem kernel. Inputs are validated by the op (and ``check_supported`` /
    ``check_launchable``); x may be NCHW, NHWC or any strided view."""
    n, c_in, h, wd = x.shape
    c0 = w.shape[0]
    ho, wo = (h + 1) // 2, (wd + 1) // 2
    out = torch.empty((n, c0, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    cfg = stem_config(c_in, c0, ho, wo)
    programs, tiles_h, tiles_w = stem_grid(n, ho, wo, cfg)
    nhwc = x.stride(1) == 1 and x.stride(3) == c_in
    fp32 = x.dtype == torch.float32
    launch(
        _stem_kernel, (programs,),
        x, w, b.contiguous(), out, h, wd, ho, wo, tiles_h, tiles_w, cfg.steps, *x.stride(), *w.stride(),
        C_IN=c_in, C0=c0, C_PAD=cfg.c_pad, BLOCK_M=cfg.block_m, BW=cfg.bw, NHWC=nhwc,
        W_CONTIG=w.is_contiguous(), PREC=FP32_PRECISION if fp32 else "tf32", num_warps=cfg.num_warps,
        cost=lambda: stem_cost(n, h, wd, cfg, tiles_h * tiles_w, x.element_size(), fp32),
    )
    return out
