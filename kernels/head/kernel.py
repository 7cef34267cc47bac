"""Triton kernel for the head (paper Table 3): 1x1 conv C -> F (= 1280) + bias + SiLU + global mean.

    out[n, f] = mean_{h,w} SiLU(sum_c W[f, c] x[n, c, h, w] + b[f])            (N, F)

Waterline
---------
Batch 128, C = 256, 8x8 map, F = 1280, fp16 (Small at 256x256): 2.68 GMACs, 5.4 us on the tensor
cores of an H100 (989 TFLOP/s); DRAM traffic is x (4.2 MB), W (0.66 MB) and the output: 1.5 us at
3.35 TB/s. Layer-wise (conv writes the 1280-wide map, the pool reads it back) the bound is 14 us. So
the fused head is bound by the tensor cores, and the kernel's work is to keep everything else
(instructions, L2 traffic) below that. The previous design (one program per (image, 128 features),
pixels as the dot's M, pool as a cross-thread row reduction, SiLU through exp and a division) issued
~2360 SASS instructions per warp, an issue estimate of 12.9 us, and re-read its 64 KB weight slice
from L2 for every image: ~126 MB of L2 traffic.

Formulation: features as the dot's M
------------------------------------
``acc[BLOCK_F, BLOCK_P] = W[f-block, :] @ x[n]^T`` (features x pixels): the pool is then a sum
along each thread's own accumulator row (wgmma gives a thread 2 rows x BLOCK_P / 4 columns per 64-row
tile), finished by two shuffles within a quad, instead of a reduction across 128 threads.
SiLU is ``h + h * tanh(h)`` with ``h = (acc + b) / 2`` (= y * sigmoid(y)): one FFMA, one MUFU.TANH
and one FFMA per element on the GPU path (``FAST_SILU``: ``tanh.approx.f32`` through inline asm,
max relative error 2^-10.99, used for fp16/bf16 outputs whose own rounding is 2^-11 / 2^-8). The
interpreter cannot run inline asm, and fp32 outputs need more accuracy: there ``tanh(h)`` is
``2 / (1 + exp(-2h)) - 1``, the same formula around it.

Pixels past H*W are not masked in the epilogue: they load x = 0, so their y is exactly b, and after
the pixel loop the kernel subtracts (padded pixels) x SiLU(b) from the sum, computed by the same
instructions. That saves a select per element.

Tiling and grid
---------------
A program owns BLOCK_F features and walks images g, g + G, g + 2G, ... (G image groups), so its
[BLOCK_F, C] weight slice is loaded once and reused for every image (``W_RESIDENT``: the loop
invariant stays in shared memory on sm_90, where wgmma reads both operands from there;
``tests/kernels/test_head.py`` pins that no weight load sits inside the image loop). grid =
(F_BLOCKS * G,) in grid.x, features fastest (programs that share an image run together and share its
x tile in L2), whatever the batch: G = min(N, 2 * SMs // F_BLOCKS) gives two resident programs per SM
(~146 registers and 80 KB of shared memory at C = 256) in one wave. C is split into at most two
power-of-two K parts, K1 = min(128, largest power of two <= C) and K2 = the rest rounded up to a power
of two (C = 128, 160, 192, 256 -> 128 + 0, 128 + 32, 128 + 64, 128 + 128: no padding at the model
widths), each one ``tl.dot`` over its whole K.

Per image, for each block of BLOCK_P pixels: load x^T [K, BLOCK_P] (channels contiguous in NHWC;
pixel p at ``p * sxp``: NHWC and NCHW memory both have uniformly strided pixels, other views are
copied to NHWC by the launcher first), the dots into fp32, SiLU, row sums into a fp32 [BLOCK_F]
total; after the last block, subtract the padding, scale by 1/(H*W), store in x's dtype. No atomics:
deterministic.

fp32 inputs (``input_precision="tf32x3"``, ~fp32 accuracy; the interpreter computes exact fp32) and
C > 256 take the K loop instead (``W_RESIDENT`` off): W and x in steps of BLOCK_K channels, W read
from L2 for every image. tf32x3 splits each operand in two, and on sm_80, where mma.sync takes its
operands from registers, a resident fp32 slice spilled (14 KB of stack per thread); fp32 is the
accuracy path, not the fast one.

Compiled for sm_90 (C = 256, 8x8, fp16): wgmma, 146 registers, 80 KB shared memory, no spills;
~560 SASS instructions per warp per (image, feature block), of which 128 FFMA, 76 FADD, 64 MUFU and
32 HGMMA: an issue estimate of 3.5 us at batch 128, under the 5.5 us tensor bound. L2 reads ~60 MB
(x once per feature block, 42 MB; W once per program, 17 MB; the previous design: ~126 MB). Not timed
on a GPU yet. On sm_80 mma.sync takes its A operand from registers and the compiler keeps the
loop-invariant slice there: ~250 registers, no spills, one program per SM.

Constants
---------
BLOCK_F = 128 features (fp32: 64): the dot's M, two wgmma 64-row tiles for 4 warps; 1280 / 128 = 10
feature blocks. BLOCK_P = H*W rounded up to a power of two, between 16 (the smallest N used here)
and 64 (the [128, 64] fp32 accumulator is 64 registers per thread). num_stages = 1 on the resident
path: the x tile is not multi-buffered, which keeps shared memory at W + one x tile so that two
programs fit per SM and hide each other's load latency. BLOCK_K = 32 (fp32) / 64 on the K loop,
with num_stages = 2 (its per-step tiles are small).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import device_info, launch

FP32_PRECISION = "tf32x3"  # dot precision for fp32 operands (the interpreter computes exact fp32)
MAX_RESIDENT_C = 256  # the resident weight slice: two K parts of at most 128 channels
PROGRAMS_PER_SM = 2


@triton.jit
def _tanh(h, FAST: tl.constexpr):
    if FAST:  # MUFU.TANH: max relative error 2^-10.99 (PTX ISA, tanh.approx.f32)
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [h], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        t = 2.0 / (1.0 + tl.exp(-2.0 * h)) - 1.0
    return t


@triton.jit
def _x_tile(x_img, k, poff, p_ok, sxc, C, MASK_K: tl.constexpr):
    """x^T[k, p] of one image: channels k (rows) by pixels (columns), zero past H*W (and past C)."""
    if MASK_K:
        mask = (k < C)[:, None] & p_ok[None, :]
        return tl.load(x_img + k[:, None] * sxc + poff[None, :], mask=mask, other=0.0)
    return tl.load(x_img + k[:, None] * sxc + poff[None, :], mask=p_ok[None, :], other=0.0)


@triton.jit
def _w_tile(w_ptr, rf, f_ok, k, swf, swc, C, MASK_K: tl.constexpr):
    """W[f, k]: features (rows) by channels (columns), zero past F (and past C)."""
    if MASK_K:
        mask = f_ok[:, None] & (k < C)[None, :]
        return tl.load(w_ptr + rf[:, None] * swf + k[None, :] * swc, mask=mask, other=0.0)
    return tl.load(w_ptr + rf[:, None] * swf + k[None, :] * swc, mask=f_ok[:, None], other=0.0)


@triton.jit
def _head_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, out_ptr,
    # sizes: batch, channels, features, pixels per image, image groups, feature blocks
    N, C, F, HW, G, F_BLOCKS,
    # strides (elements): x as logical (N, C, H, W) with pixel p at p * sxp, w (F, C), out (N, F)
    sxn, sxc, sxp, swf, swc, son,
    # meta-parameters
    W_RESIDENT: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
    MASK_K1: tl.constexpr, MASK_K2: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_P: tl.constexpr, PREC: tl.constexpr,
    FAST_SILU: tl.constexpr,
):
    pid = tl.program_id(0)
    fb = pid % F_BLOCKS
    g = pid // F_BLOCKS
    rf = fb * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = rf < F
    if W_RESIDENT:  # the weight slice, loaded once: loop invariant, it stays on chip for every image
        k1 = tl.arange(0, K1)
        w1 = _w_tile(w_ptr, rf, f_ok, k1, swf, swc, C, MASK_K1)
        if K2 > 0:
            k2 = K1 + tl.arange(0, K2)
            w2 = _w_tile(w_ptr, rf, f_ok, k2, swf, swc, C, MASK_K2)
    else:
        kk = tl.arange(0, BLOCK_K)
    hb = 0.5 * tl.load(b_ptr + rf, mask=f_ok, other=0.0).to(tl.float32)
    silu_b = hb + hb * _tanh(hb, FAST_SILU)  # SiLU(b): the value of every padded pixel
    n_pad = tl.cdiv(HW, BLOCK_P) * BLOCK_P - HW
    inv_hw = 1.0 / HW

    for n in range(g, N, G):
        x_img = x_ptr + tl.cast(n, tl.int64) * sxn
        total = tl.zeros((BLOCK_F,), dtype=tl.float32)
        for p0 in range(0, HW, BLOCK_P):
            pix = p0 + tl.arange(0, BLOCK_P)
            p_ok = pix < HW
            poff = pix * sxp
            if W_RESIDENT:
                acc = tl.dot(w1, _x_tile(x_img, k1, poff, p_ok, sxc, C, MASK_K1), input_precision=PREC)
                if K2 > 0:
                    x2 = _x_tile(x_img, k2, poff, p_ok, sxc, C, MASK_K2)
                    acc = tl.dot(w2, x2, acc, input_precision=PREC)
            else:
                acc = tl.zeros((BLOCK_F, BLOCK_P), dtype=tl.float32)
                for k0 in range(0, C, BLOCK_K):
                    wk = _w_tile(w_ptr, rf, f_ok, k0 + kk, swf, swc, C, True)
                    xk = _x_tile(x_img, k0 + kk, poff, p_ok, sxc, C, True)
                    acc = tl.dot(wk, xk, acc, input_precision=PREC)
            h = acc * 0.5 + hb[:, None]
            total += tl.sum(h + h * _tanh(h, FAST_SILU), axis=1)
        mean = (total - n_pad * silu_b) * inv_hw
        tl.store(out_ptr + tl.cast(n, tl.int64) * son + rf, mean.to(out_ptr.dtype.element_ty), mask=f_ok)


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

    def constexprs(self) -> dict:
        return dict(W_RESIDENT=self.w_resident, K1=self.k1, K2=self.k2, MASK_K1=self.k1 > self.c,
                    MASK_K2=self.k1 + self.k2 > self.c, BLOCK_K=self.block_k, BLOCK_F=self.block_f,
                    BLOCK_P=self.block_p)

    @property
    def k_issued(self) -> int:
        """Channels the dots multiply per pixel and feature (K padding included)."""
        return self.k1 + self.k2 if self.w_resident else self.block_k * triton.cdiv(self.c, self.block_k)


def split_k(c: int) -> tuple[int, int]:
    """C as two power-of-two parts: (min(128, largest power of two <= C), the rest rounded up), each >= 16."""
    k1 = max(16, min(128, 1 << (max(1, c).bit_length() - 1)))
    rest = c - k1
    return k1, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


def head_config(c: int, hw: int, dtype: torch.dtype) -> HeadConfig:
    block_p = min(64, max(16, triton.next_power_of_2(max(1, hw))))
    if dtype != torch.float32 and c <= MAX_RESIDENT_C:
        k1, k2 = split_k(c)
        return HeadConfig(c, True, k1, k2, 0, 128, block_p)
    # fp32 (tf32x3 splits every operand in two: a resident slice would not fit in registers on sm_80,
    # where mma.sync takes its operands from registers) and C > 256: W and x in K steps, W from L2
    if dtype == torch.float32:
        return HeadConfig(c, False, 0, 0, 32, 64, block_p, num_stages=2)
    return HeadConfig(c, False, 0, 0, 64, 128, block_p, num_stages=2)


SUPPORTED_C = (128, 160, 192, 256)  # the head follows stage 5 (SPEC 1, Table 3)


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
    f_blocks = triton.cdiv(f, cfg.block_f)
    p_blocks = triton.cdiv(hw, cfg.block_p)
    passes = 3 if fp32 else 1  # tf32x3: three tensor-core products per dot
    inner = () if cfg.w_resident else (Loop("channel steps", triton.cdiv(c, cfg.block_k)),)
    w_reads = f_blocks * groups if cfg.w_resident else n * f_blocks * p_blocks  # [BLOCK_F, C] slices
    return KernelCost(
        useful_macs=n * hw * c * f,
        mma_macs=passes * n * f_blocks * p_blocks * cfg.block_f * cfg.block_p * cfg.k_issued,
        dram_bytes=elem * (n * c * hw + f * c + f + n * f),
        loops=(Loop("images", triton.cdiv(n, groups), (Loop("pixel blocks", p_blocks, inner),)),),
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
    cfg = head_config(c, hw, x.dtype)
    f_blocks = triton.cdiv(f, cfg.block_f)
    groups = image_groups(n, f_blocks, sm_count(x.device))
    fp32 = x.dtype == torch.float32
    launch(
        _head_kernel, (f_blocks * groups,),
        x, w, b.contiguous(), out, n, c, f, hw, groups, f_blocks,
        x.stride(0), x.stride(1), pixel_stride(x), *w.stride(), out.stride(0),
        PREC=FP32_PRECISION if fp32 else "tf32",
        # inline asm runs compiled only: on CPU tensors the kernel runs in the interpreter
        FAST_SILU=not fp32 and x.device.type != "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.constexprs(),
        cost=lambda: head_cost(n, c, f, hw, cfg, groups, x.element_size(), fp32),
    )
    return out
