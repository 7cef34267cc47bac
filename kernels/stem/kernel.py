"""Triton kernel for the stem (paper stage 0): dense 3x3 conv, stride 2, padding 1, + bias, ReLU.

    x: (N, C_IN, H, W) in NCHW or NHWC memory (read through its strides, no copy)
    w: (C0, C_IN, 3, 3), b: (C0,)      (BatchNorm folded)
    out = ReLU(conv2d(x, w, b, stride=2, padding=1))   (N, C0, ceil(H/2), ceil(W/2)), NHWC memory

Tiling and grid
---------------
Program `pid` owns BLOCK_M output pixels of the batch flattened in NHW order and all C0 output
channels (padded to C_PAD, a power of two >= 16, masked): grid = cdiv(N * HO * WO, BLOCK_M). The
tile is stored as one [BLOCK_M, C0] block, i.e. BLOCK_M * C0 contiguous NHWC elements.

Accumulation
------------
The reduction has only C_IN * 9 = 27 terms, too short for a tensor-core dot (K would be padded
from 27 to 32 and the operands built by gathers), and the stem is memory bound anyway (3 input
channels read, C0 = 16..32 written per output pixel: ~14 MOPs of 0.86 GMACs in Pico). So the
kernel is 27 rank-1 updates in fp32: for each (input channel, tap) it loads one input value per
output pixel (a [BLOCK_M] gather: stride 2 in W, channel stride 1 (NHWC) or H*W (NCHW)) and one
weight per output channel ([C_PAD], L1-resident) and does `acc += x[:, None] * w[None, :]`.
Padding is a mask on the input coordinates (zero padding); masked pixels (m >= M) are not stored.

Tile constants
--------------
BLOCK_M = 128 output pixels, 4 warps: acc is 128 x C_PAD fp32 (32 regs/thread at C_PAD = 32), and
128 pixels x 3 channels is 384 scattered input loads per tap batch; larger tiles only reduce the
program count, which is already >= 4k at the paper's batch 128 x 128x128 outputs. Not tuned on a
GPU (none available when written); compiled for sm_90/sm_80 in tests/kernels/test_stem.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._cost import KernelCost
from .._launch import launch


@triton.jit
def _stem_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, out_ptr,
    # sizes: M = N * HO * WO output pixels
    M, H, W, HO, WO, C0,
    # strides (elements) of x as logical (N, C_IN, H, W) and of w (C0, C_IN, 3, 3)
    sxn, sxc, sxh, sxw,
    swo, swi, swh, sww,
    # meta-parameters
    C_IN: tl.constexpr, C_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    hwo = HO * WO
    n = offs_m // hwo
    oh = (offs_m % hwo) // WO
    ow = offs_m % WO
    x_img = x_ptr + n.to(tl.int64) * sxn
    offs_c = tl.arange(0, C_PAD)
    c_ok = offs_c < C0

    acc = tl.zeros((BLOCK_M, C_PAD), dtype=tl.float32)
    acc += tl.load(b_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for tap in tl.static_range(9):
        ih = 2 * oh + (tap // 3 - 1)
        iw = 2 * ow + (tap % 3 - 1)
        ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        pix = x_img + ih * sxh + iw * sxw
        for ci in tl.static_range(C_IN):
            xv = tl.load(pix + ci * sxc, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_M]
            wv = tl.load(w_ptr + offs_c * swo + ci * swi + (tap // 3) * swh + (tap % 3) * sww,
                         mask=c_ok, other=0.0).to(tl.float32)  # [C_PAD]
            acc += xv[:, None] * wv[None, :]
    acc = tl.maximum(acc, 0.0)
    out_off = offs_m.to(tl.int64)[:, None] * C0 + offs_c[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])


@dataclass(frozen=True)
class StemConfig:
    c_in: int
    c_pad: int
    block_m: int = 128
    num_warps: int = 4


MAX_CHANNELS = 128  # acc is a [BLOCK_M, C_PAD] register tile


def stem_config(c_in: int, c_out: int) -> StemConfig:
    return StemConfig(c_in, max(16, triton.next_power_of_2(c_out)))


# Stem shapes of Pico..Small (SPEC Table 3): RGB in, C0 out.
MODEL_SHAPES: tuple[tuple[int, int], ...] = ((3, 16), (3, 24), (3, 32))


def shipped_configs() -> list[StemConfig]:
    return sorted({stem_config(ci, co) for ci, co in MODEL_SHAPES}, key=lambda cfg: cfg.c_pad)


def check_supported(c_in: int, c_out: int) -> None:
    if c_out > MAX_CHANNELS or c_in > 16:
        raise ValueError(
            f"convfirstnet.stem: the kernel supports up to 16 input and {MAX_CHANNELS} output channels, "
            f"got {c_in} -> {c_out}"
        )


def stem_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Launch the stem kernel. Inputs are validated by the op; x may be NCHW or NHWC."""
    n, c_in, h, wd = x.shape
    c0 = w.shape[0]
    check_supported(c_in, c0)
    ho, wo = (h + 1) // 2, (wd + 1) // 2
    out = torch.empty((n, c0, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    m = n * ho * wo
    if m == 0:
        return out
    cfg = stem_config(c_in, c0)

    def cost() -> KernelCost:  # see kernels/_cost.py; no runtime loops (taps and channels are unrolled)
        return KernelCost(
            useful_macs=m * c0 * c_in * 9,
            mma_macs=0,  # rank-1 fp32 updates on CUDA cores
            dram_bytes=(x.numel() + out.numel() + w.numel() + b.numel()) * x.element_size(),
            note="27 rank-1 fp32 updates per output tile, no tensor cores",
        )

    launch(
        _stem_kernel, (triton.cdiv(m, cfg.block_m),),
        x, w, b.contiguous(), out, m, h, wd, ho, wo, c0, *x.stride(), *w.stride(),
        C_IN=c_in, C_PAD=cfg.c_pad, BLOCK_M=cfg.block_m, num_warps=cfg.num_warps, cost=cost,
    )
    return out
