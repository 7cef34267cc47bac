"""Host side of the head kernel (kernel.py, whose header explains the design): the tile configuration,
the image groups of the persistent grid, the launch with its cost declaration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._cost import KernelCost, Loop
from .._launch import cdiv, device_info, launch, next_power_of_2
from .kernel import _head_kernel

FP32_PRECISION = "tf32x3"  # dot precision for fp32 operands (the interpreter computes exact fp32)
MAX_RESIDENT_C = 256  # the resident weight slice: two K parts of at most 128 channels
PROGRAMS_PER_SM = 2
# Resident 16-bit programs on sm_90: 8 warps (two wgmma warpgroups of 64 features), two programs per SM
# at <= 128 registers: each warp's chain of SiLU and sums is half what 4 warps leave it (Small, batch 128:
# 9.9-11.8 -> 7.2-10.1 us predicted with the x prefetch, L2-bound at the high end). Below sm_90 4 warps and
# no prefetch: mma.sync keeps the slice in registers, the prefetched tile spilled 624 B there at 4 warps,
# and at 8 warps only one program fit per SM (21.9 -> 22.9 us at the low end).
RESIDENT_WARPS_SM90 = 8
SUPPORTED_C = (128, 160, 192, 256)  # the head follows stage 5 (SPEC 1, Table 3)


@dataclass(frozen=True)
class HeadConfig:
    c: int
    w_resident: bool  # the [BLOCK_F, C] weight slice on chip for all the program's images
    k1: int  # resident: first K part (power of two)
    k2: int  # resident: second K part (power of two, or 0)
    block_k: int  # otherwise: channels per step of the K loop
    block_f: int  # features per program (the dot's M)
    block_p: int  # pixels per block (the dot's N)
    num_warps: int = 4
    num_stages: int = 1
    prefetch: int = 0  # resident: 1 loads each step's x tile one step ahead (kernel.py)

    def constexprs(self) -> dict:
        return dict(W_RESIDENT=self.w_resident, K1=self.k1, K2=self.k2, MASK_K1=self.k1 > self.c,
                    MASK_K2=self.k1 + self.k2 > self.c, BLOCK_K=self.block_k, BLOCK_F=self.block_f,
                    BLOCK_P=self.block_p, PREFETCH=self.prefetch)

    def pixel_constexprs(self, hw: int) -> dict:
        """Pixel blocks per image, and whether they cover the image exactly (no pixel mask)."""
        return dict(PB=cdiv(hw, self.block_p), FULL_P=hw % self.block_p == 0)

    @property
    def k_issued(self) -> int:
        """Channels the dots multiply per pixel and feature (K padding included)."""
        return self.k1 + self.k2 if self.w_resident else self.block_k * cdiv(self.c, self.block_k)


def split_k(c: int) -> tuple[int, int]:
    """C as two power-of-two parts: (min(128, largest power of two <= C), the rest rounded up), each >= 16."""
    k1 = max(16, min(128, 1 << (max(1, c).bit_length() - 1)))
    rest = c - k1
    return k1, (max(16, next_power_of_2(rest)) if rest > 0 else 0)


def head_config(c: int, hw: int, dtype: torch.dtype, arch: int = 90) -> HeadConfig:
    block_p = min(64, max(16, next_power_of_2(max(1, hw))))
    if dtype != torch.float32 and c <= MAX_RESIDENT_C:
        k1, k2 = split_k(c)
        return HeadConfig(c, True, k1, k2, 0, 128, block_p, num_warps=RESIDENT_WARPS_SM90 if arch >= 90 else 4,
                          prefetch=int(arch >= 90))
    # fp32 (tf32x3 splits every operand in two: a resident slice would not fit in registers on sm_80,
    # where mma.sync takes its operands from registers) and C > 256: W and x in K steps, W from L2
    # fp32 is not multi-buffered: with num_stages = 2 the tf32x3 operand splits of both stages took
    # 255 registers and spilled 24 B on sm_80 at C = 160 and 256 (Triton 3.8.0)
    if dtype == torch.float32:
        return HeadConfig(c, False, 0, 0, 32, 64, block_p, num_stages=1)
    return HeadConfig(c, False, 0, 0, 64, 128, block_p, num_stages=2)


def image_groups(n: int, f_blocks: int, sms: int) -> int:
    """G: programs per feature block. Enough programs for PROGRAMS_PER_SM per SM, and each program
    walks N / G images with its weight slice on chip."""
    return max(1, min(n, PROGRAMS_PER_SM * sms // f_blocks))


def sm_count(device: torch.device) -> int:
    return device_info(device).sms


def pixel_stride(x: torch.Tensor) -> int | None:
    """sxp such that pixel p = h * W + w of an image sits at p * sxp (NHWC and NCHW memory, or a
    one-row / one-column map), else None."""
    _, _, h, w = x.shape
    if w == 1:
        return x.stride(2)
    return x.stride(3) if h == 1 or x.stride(2) == w * x.stride(3) else None


def head_cost(
    n: int, c: int, f: int, hw: int, cfg: HeadConfig, groups: int, elem: int, fp32: bool
) -> KernelCost:
    f_blocks = cdiv(f, cfg.block_f)
    p_blocks = cdiv(hw, cfg.block_p)
    passes = 3 if fp32 else 1  # tf32x3: three tensor-core products per dot
    inner = () if cfg.w_resident else (Loop("channel steps", cdiv(c, cfg.block_k)),)
    w_reads = f_blocks * groups if cfg.w_resident else n * f_blocks * p_blocks  # [BLOCK_F, C] slices
    return KernelCost(
        useful_macs=n * hw * c * f,
        mma_macs=passes * n * f_blocks * p_blocks * cfg.block_f * cfg.block_p * cfg.k_issued,
        dram_bytes=elem * (n * c * hw + f * c + f + n * f),
        loops=((Loop("(image, pixel block) steps", cdiv(n, groups) * p_blocks - 1),) if cfg.prefetch
               else (Loop("images", cdiv(n, groups), (Loop("pixel blocks", p_blocks, inner),)),)),
        note=f"{f_blocks} feature blocks x {groups} image groups; "
        + (f"weight slice [{cfg.block_f}, {c}] on chip per program" if cfg.w_resident
           else f"K steps of {cfg.block_k}")
        + f"; L2 reads ~{(f_blocks * n * c * hw + w_reads * cfg.block_f * c) * elem / 1e6:.0f} MB"
        + (", tf32x3 (3 passes)" if fp32 else ""),
    )


def head_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Launch the fused head. Inputs are validated by op.py before this call."""
    n, c, h, wd = x.shape
    f = w.shape[0]
    out = torch.empty((n, f), device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    if pixel_stride(x) is None:  # a view whose pixels are not uniformly strided: an NHWC copy first
        x = x.contiguous(memory_format=torch.channels_last)
    hw = h * wd
    cfg = head_config(c, hw, x.dtype, device_info(x.device).arch)
    f_blocks = cdiv(f, cfg.block_f)
    groups = image_groups(n, f_blocks, sm_count(x.device))
    fp32 = x.dtype == torch.float32
    launch(
        _head_kernel, (f_blocks * groups,),
        x, w, b.contiguous(), out, n, c, f, hw, groups, f_blocks,
        x.stride(0), x.stride(1), pixel_stride(x), *w.stride(), out.stride(0),
        PREC=FP32_PRECISION if fp32 else "tf32",
        # inline asm runs compiled only: on CPU tensors the kernel runs in the interpreter
        FAST_SILU=not fp32 and x.device.type != "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.constexprs(), **cfg.pixel_constexprs(hw),
        cost=lambda: head_cost(n, c, f, hw, cfg, groups, x.element_size(), fp32),
    )
    return out
