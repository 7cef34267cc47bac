"""Triton kernel for the head (paper Table 3): 1x1 conv C -> F (= 1280) + bias + SiLU + global mean.

    out[n, f] = mean_{h,w} SiLU(sum_c W[f, c] x[n, c, h, w] + b[f])            (N, F)

Design: the F-wide map never reaches DRAM
-----------------------------------------
Waterline arithmetic (one image, C=256, 8x8 map, F=1280, fp16; H100 op:byte = 990 TFLOP/s /
3.35 TB/s = 295 FLOP/B): the conv is 2*64*256*1280 = 42 MFLOP. Unfused, the 1280-wide map is
written by the conv and read by the pool (2 x 164 KB) besides x (32 KB): 117 FLOP/B, memory bound.
Fused, only x (32 KB, read once per F block; the repeats hit L2) and 2.5 KB of output move:
~1300 FLOP/B, compute bound.

Tiling and grid
---------------
Grid (cdiv(F, BLOCK_F), N): one program owns BLOCK_F output features of one image and walks the
image's H*W pixels in blocks of BLOCK_P rows. Per pixel block: ``acc[BLOCK_P, BLOCK_F]`` =
``tl.dot`` over C in steps of BLOCK_C (fp32 accumulation, operands in x's dtype; fp32 inputs use
``input_precision="tf32x3"``, ~fp32 accuracy on tensor cores, see kernels/mbconv/kernel.py), then
bias + SiLU, masked to zero on pixel rows past H*W, and summed over rows into a fp32 ``[BLOCK_F]``
running total. After the last block the total is divided by
H*W and stored in x's dtype. No atomics, no scratch: the op stays functional and deterministic.

Constants (``head_config``; not tuned on a GPU yet): BLOCK_F = 128 splits F = 1280 into 10
programs per image (batch 128 -> 1280 programs, ~10 waves of 132 SMs); BLOCK_P = the map size
rounded up to a power of two, at most 64 (the 8x8 final map at 256x256 input is one block; the
[64, 128] fp32 accumulator is 32 KB of registers at 4 warps); BLOCK_C = 64 (C = 128 ... 256 is
two to four K steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import launch

FP32_PRECISION = "tf32x3"  # dot precision for fp32 operands (the interpreter computes exact fp32)


@dataclass(frozen=True)
class HeadConfig:
    block_p: int  # pixels per block (rows of the dot)
    block_f: int  # output features per program
    block_c: int  # input channels per K step
    num_warps: int

    def constexprs(self) -> dict:
        return dict(BLOCK_P=self.block_p, BLOCK_F=self.block_f, BLOCK_C=self.block_c)


def head_config(c: int, f: int, h: int, w: int) -> HeadConfig:
    block_p = min(64, max(16, triton.next_power_of_2(h * w)))
    block_c = min(64, max(16, triton.next_power_of_2(c)))
    return HeadConfig(block_p, 128, block_c, 4)


SUPPORTED_C = (128, 160, 192, 256)  # the head follows stage 5 (SPEC 1, Table 3)


def shipped_variants() -> list[dict]:
    """Every distinct set of meta-parameters (``num_warps`` included) for the supported shapes
    (C 128 ... 256, maps 1x1 ... 64x64); the tests compile each for sm_90 and sm_80."""
    seen = {}
    for c in SUPPORTED_C:
        for hw in (1, 2, 4, 8, 16, 32, 64):
            cfg = head_config(c, 1280, hw, hw)
            meta = dict(cfg.constexprs(), num_warps=cfg.num_warps)
            seen[tuple(sorted(meta.items()))] = meta
    return list(seen.values())


@triton.jit
def _head_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, out_ptr,
    # sizes
    C, F, W, HW,
    # strides (elements): x in any layout, w (F, C), out (N, F)
    sxn, sxc, sxh, sxw, swf, swc, son,
    # meta-parameters
    BLOCK_P: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_C: tl.constexpr, PREC: tl.constexpr,
):
    pid_f = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    rf = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = rf < F
    rc = tl.arange(0, BLOCK_C)
    bias = tl.load(b_ptr + rf, mask=f_ok, other=0.0).to(tl.float32)
    x_img = x_ptr + n * sxn
    total = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for p0 in range(0, HW, BLOCK_P):
        pix = p0 + tl.arange(0, BLOCK_P)
        p_ok = pix < HW
        x_rows = x_img + (pix // W) * sxh + (pix % W) * sxw
        acc = tl.zeros((BLOCK_P, BLOCK_F), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c_ok = (c0 + rc) < C
            xt = tl.load(
                x_rows[:, None] + (c0 + rc)[None, :] * sxc, mask=p_ok[:, None] & c_ok[None, :], other=0.0
            )
            wt = tl.load(
                w_ptr + rf[None, :] * swf + (c0 + rc)[:, None] * swc,
                mask=c_ok[:, None] & f_ok[None, :], other=0.0,
            )
            acc = tl.dot(xt, wt, acc, input_precision=PREC)
        y = acc + bias[None, :]
        y = y / (1.0 + tl.exp(-y))
        total += tl.sum(tl.where(p_ok[:, None], y, 0.0), axis=0)
    tl.store(out_ptr + n * son + rf, (total / HW).to(out_ptr.dtype.element_ty), mask=f_ok)


def head_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Launch the fused head. Inputs are validated by op.py before this call."""
    n, c, h, wd = x.shape
    f = w.shape[0]
    out = torch.empty((n, f), device=x.device, dtype=x.dtype)
    if n == 0:
        return out
    cfg = head_config(c, f, h, wd)
    prec = FP32_PRECISION if x.dtype == torch.float32 else "tf32"  # only fp32 operands use it
    grid = (triton.cdiv(f, cfg.block_f), n)

    def cost() -> KernelCost:  # see kernels/_cost.py
        p_trips, c_trips = triton.cdiv(h * wd, cfg.block_p), triton.cdiv(c, cfg.block_c)
        return KernelCost(
            useful_macs=n * h * wd * c * f,
            mma_macs=grid[0] * grid[1] * p_trips * c_trips * cfg.block_p * cfg.block_c * cfg.block_f,
            dram_bytes=(x.numel() + out.numel() + w.numel() + b.numel()) * x.element_size(),
            loops=(Loop("pixel blocks", p_trips, body=(Loop("K steps over C", c_trips),)),),
        )

    launch(
        _head_kernel, grid,
        x, w, b.contiguous(), out, c, f, wd, h * wd, *x.stride(), *w.stride(), out.stride(0),
        PREC=prec, num_warps=cfg.num_warps, cost=cost, **cfg.constexprs(),
    )
    return out
