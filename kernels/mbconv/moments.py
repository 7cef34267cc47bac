"""The MBConv kernels in a training step's forward, where the three BatchNorms normalise with the batch's
statistics (convfirstnet/mbconv_fused_forward.py runs them per step):

* BN_d's statistics from the grouped conv's output u (N, H W, R), which the group-width-8 conv (kernels/gconv)
  writes from h = SiLU(BN_e(W_exp x)) (expand_backward.py ``expand_forward``): fp32 sums of ``u - shift`` and
  of its square per hidden channel (the shift BN_d's running mean, which keeps the sums of squares from
  cancelling when the mean is large against the spread), in rows of their own ([rows][2][R], no atomics).
  Where the conv's tiles cover the map exactly (every map of Small at 256 x 256), the conv's programs sum them
  over their own tiles as they store u (gconv.launcher.gconv3x3_moments_triton: a row per program; 16x16
  stride 1 98 + 33 -> 94 us, static, sm_90, high end); elsewhere ``conv_moments`` (``_conv_moments_kernel``)
  makes one pass over u, a row per image. Against the hidden kernel computing expand, conv and these sums in
  one launch (x resident in shared memory, one program per image): its 174 KB of shared memory left one 8-warp
  program per SM, whose load waits bound it (static estimate, Small, batch 128, sm_90, high end: 16x16 stride
  1 291 us against 54 + 94 us for the expand and the conv with the moments; 32x32 stride 2, 96 channels, 795
  against 60 + 140).
* ``bn_e_stats`` and ``bn_d_stats`` (``_bn_e_stats_kernel``, ``_bn_d_stats_kernel``): one small launch
  each that writes a BatchNorm's batch mean and rstd, which the kernels after it normalise by, and updates
  its running statistics in place (nn.BatchNorm2d's rule, unbiased variance). BN_e: mean and variance of
  W x from x's mean and Gram matrix (narrow.py ``x_moments``), and W G, which the backward forms dW_exp
  from; BN_d: the moment rows merged in a fixed order (per row, then Chan's rule over the rows, in tiles of
  rows). They replace ~60 per-channel torch ops, each a launch of its own. No weights are folded: the
  expand and the BN_d pass apply gamma rstd and beta themselves.
* ``mbconv_from_conv_output`` finishes the block from u: ``_bn_silu_pool_kernel`` (g = SiLU(BN_d(u)),
  stride 1 in place, stride 2 blurred; the pool, the SE partials), ``_se_gates_kernel`` (the gates, one
  image per program) and the projection without the residual: ``W_proj (g * gate) + b_proj``, whose
  BatchNorm the caller applies.

The geometry and the projection's launch are launcher.py's (``geometry_of``, ``launch_project``).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import MAXNREG, cdiv, launch, next_power_of_2
from .._scalars import fp32
from .kernel import _silu, se_gates
from .launcher import MBConvGeometry, gate_rows, geometry_of, kernel_settings, launch_project


CM_PIXELS, CM_CHANNELS, CM_WARPS = 32, 128, 4  # conv_moments' tile: pixels x channels a step


@triton.jit
def _conv_moments_kernel(u_ptr, shift_ptr, parts_ptr, HW, R, BP: tl.constexpr, BR: tl.constexpr):
    """Image n, BR channels: the sums of u - shift and of its square over the image's HW pixels (fp32,
    u read in its dtype), to parts[n, 0] and parts[n, 1] (``bn_d_stats``' rows).
    Per-lane accumulators, reduced over the pixels once at the end."""
    n = tl.program_id(0)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    r_ok = r < R
    shift = tl.load(shift_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    base = u_ptr + n.to(tl.int64) * HW * R
    s1 = tl.zeros((BP, BR), dtype=tl.float32)
    s2 = tl.zeros((BP, BR), dtype=tl.float32)
    for p0 in range(0, HW, BP):
        p = p0 + tl.arange(0, BP)
        ok = (p < HW)[:, None] & r_ok[None, :]
        v = tl.load(base + p[:, None] * R + r[None, :], mask=ok, other=0.0).to(tl.float32)
        d = tl.where(ok, v - shift[None, :], 0.0)
        s1 += d
        s2 += d * d
    row = parts_ptr + n * (2 * R) + r
    tl.store(row, tl.sum(s1, axis=0), mask=r_ok)
    tl.store(row + R, tl.sum(s2, axis=0), mask=r_ok)


def conv_moments(u: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """BN_d's moment rows ([N, 2, R] fp32, ``bn_d_stats``' input) from the conv output ``u`` (N, H W, R)
    contiguous, as written by the group-width-8 conv (NHWC), shifted by ``shift`` (BN_d's running mean):
    the pass for maps the conv's tiles do not cover exactly (module docstring)."""
    n, hw, r = u.shape
    if not u.is_contiguous() or shift.shape != (r,):
        raise ValueError(f"conv_moments: u must be a contiguous (N, H W, R) tensor and shift ({r},), got "
                         f"{tuple(u.shape)} (contiguous: {u.is_contiguous()}) and {tuple(shift.shape)}")
    parts = torch.empty((n, 2, r), device=u.device, dtype=torch.float32)
    if n == 0:
        return parts
    br = min(CM_CHANNELS, max(16, next_power_of_2(r)))
    bp = min(CM_PIXELS, next_power_of_2(hw))
    eb = u.element_size()
    launch(_conv_moments_kernel, (n, cdiv(r, br)), u, shift, parts, hw, r,
           cost=lambda: KernelCost(0, 0, n * hw * r * eb + r * 4 + n * 2 * r * 4,
                                   (Loop("pixel steps", cdiv(hw, bp), fixed=True),),
                                   note="BN_d's moment rows from the conv output"),
           BP=bp, BR=br, num_warps=CM_WARPS)
    return parts


BNS_ELEMS = 8192  # elements of u per step of the BN_d pass (16 KB of fp16: eight 16-byte loads a thread)
# stride 1 (the training forward's BN_d + SiLU + pool pass) on 2 warps (was 4): each thread carries more
# of its step between the loads. Static estimate of Small's 34 stride-1 MBConv training blocks, batch 128,
# sm_90, high end: 1.68 -> 1.46 ms (sm_80 2.67 -> 2.35, Triton 3.6 1.76 -> 1.62), no stack
BNS_WARPS = 2
BNS_BLUR_STAGES = 3  # stride 2's full-resolution loop pipelined (cp.async); stride 1 runs 2 trips: none
BNS_BLUR_WARPS = 8  # stride 2 (at 4 warps the 32x32 variant took 255 registers and 8 B of stack)
# stride 2 when g is given activated (the staged inference blocks: blur and pool only): 4 warps, 64-134
# registers, no stack (sm_90 and sm_80, Triton 3.6 and 3.8). Static estimate, Small, batch 128, sm_90:
# 16x16 56-83 -> 43-61 us, 32x32 43-60 -> 39-48 (L1 pipe + latency 49 -> 38, 44 -> 38). With maxnreg
# (_launch.MAXNREG: its loads in flight together): Small's two such launches 0.109 -> 0.092 ms (sm_90),
# 0.169 -> 0.093 (Triton 3.6), 0.220 -> 0.124 (sm_80), high end, no stack; the training forms, limited
# alike, rose (1.46 -> 1.53 ms over the 36 blocks): they keep ptxas' choice
BNS_BLUR_WARPS_ACTIVATED = 4
# Stride 2 writes g at full resolution in place of u and blurs it back, one SiLU per pixel, rather than
# recomputing BN_d + SiLU for each of the nine taps (2.25 per pixel). SiLU is two MUFU operations (ex2,
# rcp), which an SM issues at 16 a clock (CUDA C++ Programming Guide, arithmetic instruction throughput,
# compute capability 9.0), a rate the static model does not count: at Small's 16x16 stride-2 block (batch
# 128) the per-tap form needs 151 M of them, >= 40 us at 1.755 GHz, the in-place form 67 M, >= 18 us.
# The model's L1-pipe + latency sum (the one the H200's block times tracked, docs/cost-model.md) also
# falls (16x16: 98 -> 90 us; 32x32: 99 -> 85), but its wait term rises with the barrier and the read-back,
# so the report ranks the in-place form 27-53 us slower at 16x16 and -1 to +22 us at 32x32. A GPU run
# decides.
SEG_WARPS = 4
# The gates with maxnreg (_launch.MAXNREG): left to ptxas they waited on fewer of their loads at a time.
# Small's 36 MBConv training forwards, static, batch 128, high end: 0.266 -> 0.170 ms (sm_90), 0.259 ->
# 0.166 (Triton 3.6), 0.586 -> 0.322 (sm_80), no stack
SEG_MAXNREG = MAXNREG


@triton.jit
def _bn_d(u_ptr, a, hb, SILU: tl.constexpr, mask):
    """SiLU(BN_d(u)) in fp32 at the addresses ``u_ptr`` (zero where masked off)."""
    return _silu(tl.load(u_ptr, mask=mask, other=0.0).to(tl.float32) * a[None, :], hb[None, :], SILU)


@triton.jit
def _bn_silu_pool_kernel(u_ptr, gf_ptr, g_ptr, st_ptr, gamma_ptr, beta_ptr, w1_ptr, z_ptr, H, W, OH, OW, R, S,
                         NCHUNK, sw1_s, sw1_r, RB: tl.constexpr, BP: tl.constexpr, SP: tl.constexpr,
                         SILU: tl.constexpr, MASK_R: tl.constexpr, STRIDE: tl.constexpr, NS: tl.constexpr,
                         ACTIVATED: tl.constexpr):
    """Over the conv output u (N, H W, R): one (image, RB-channel chunk) per program. g =
    SiLU(gamma rstd (u - mean) + beta) (BN_d with the batch's statistics, ``st_ptr``: mean, then rstd R
    entries on; fp32); stride 2: g = BlurPool(g) ([1, 2, 1]^2 / 16, stride 2, reflect padding folded into
    the indices, as kernel.py ``_blur``: first g at full resolution, rounded, in place of u, then the taps
    read it back, mostly from L1). g, rounded to the data type, to ``g_ptr`` (N, OH OW, R) (stride 1: in
    place over u); its pool (fp32, before the rounding, as the hidden kernel pools) and the chunk's
    first-SE-layer share ``zpart[n, chunk] = W_se1[:, chunk] @ mean[n, chunk]`` (the hidden kernel's
    ``_se_partial`` layout, (N, chunks, SP) fp32).
    ACTIVATED (stride 2, the folded block's staged launches, staged.py): u is already g at full resolution
    (the conv's epilogue added the bias and SiLU), so the blur reads it as it is: no BN_d, no in-place
    pass, no barrier."""
    n = tl.program_id(0)
    ch = tl.program_id(1)
    r = ch * RB + tl.arange(0, RB)
    r_ok = r < R
    mean = tl.load(st_ptr + r, mask=r_ok, other=0.0)
    rstd = tl.load(st_ptr + R + r, mask=r_ok, other=0.0)
    a = tl.load(gamma_ptr + r, mask=r_ok, other=0.0).to(tl.float32) * rstd
    hb = 0.5 * (tl.load(beta_ptr + r, mask=r_ok, other=0.0).to(tl.float32) - mean * a)
    OHW = OH * OW
    ub = u_ptr + tl.cast(n, tl.int64) * (H * W) * R + r[None, :]
    gfb = gf_ptr + tl.cast(n, tl.int64) * (H * W) * R + r[None, :]  # stride 2: u's memory, its own argument
    gb = g_ptr + tl.cast(n, tl.int64) * OHW * R + r[None, :]
    pool = tl.zeros((RB,), dtype=tl.float32)
    if STRIDE == 2 and not ACTIVATED:  # g at full resolution, rounded, in place of u (as the hidden
        # kernel's slot holds it; each thread writes the elements it read), then a barrier: the blur reads it
        # back through other threads (plain ld.global: num_stages=1). gf_ptr is u's memory as an argument of
        # its own, so that the barrier check (convfirstnet.analysis.ordering) follows this round trip apart
        # from u's reads.
        for p0 in tl.range(0, H * W, BP, num_stages=NS):
            p = p0 + tl.arange(0, BP)
            ok = (p < H * W)[:, None]
            if MASK_R:
                ok = ok & r_ok[None, :]
            g = _bn_d(ub + p[:, None] * R, a, hb, SILU, ok)
            tl.store(gfb + p[:, None] * R, g.to(gf_ptr.dtype.element_ty), mask=ok)
        tl.debug_barrier()
    for p0 in range(0, OHW, BP):
        p = p0 + tl.arange(0, BP)
        ok = (p < OHW)[:, None]
        if MASK_R:
            ok = ok & r_ok[None, :]
        if STRIDE == 1:
            g = _bn_d(ub + p[:, None] * R, a, hb, SILU, ok)
        else:  # the blur's nine taps from the full-resolution g that the loop above left in place of u
            oy = p // OW
            ox = p % OW
            g = tl.zeros((BP, RB), dtype=tl.float32)
            for i in tl.static_range(3):
                sy = 2 * oy - 1 + i
                sy = tl.where(sy < 0, -sy, sy)
                sy = tl.where(sy >= H, 2 * H - 2 - sy, sy)
                for j in tl.static_range(3):
                    sx = 2 * ox - 1 + j
                    sx = tl.where(sx < 0, -sx, sx)
                    sx = tl.where(sx >= W, 2 * W - 2 - sx, sx)
                    tap = tl.load(gfb + ((sy * W + sx) * R)[:, None], mask=ok, other=0.0)
                    g += tap.to(tl.float32) * ((1 + i % 2) * (1 + j % 2) * 0.0625)
        tl.store(gb + p[:, None] * R, g.to(g_ptr.dtype.element_ty), mask=ok)
        pool += tl.sum(tl.where(ok, g, 0.0), axis=0)
    mc = pool / OHW
    sv = tl.arange(0, SP)
    w1 = tl.load(w1_ptr + sv[:, None] * sw1_s + r[None, :] * sw1_r, mask=(sv < S)[:, None] & r_ok[None, :],
                 other=0.0)
    zrow = z_ptr + (tl.cast(n, tl.int64) * NCHUNK + ch) * SP
    tl.store(zrow + sv, tl.sum(w1.to(tl.float32) * mc[None, :], axis=1))


@triton.jit
def _se_gates_kernel(z_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, N, NCHUNK, R, S, sw2_r, sw2_s,
                     SP: tl.constexpr, NCP: tl.constexpr, GB: tl.constexpr, SILU: tl.constexpr):
    """The SE gates of one image from its partials (kernel.py ``se_gates``, the hidden kernel's GATE
    tail, inlined here), so that every projection tile reads one gate vector instead of W_se2 and the
    partials."""
    se_gates(z_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, tl.program_id(0), 1, N, NCHUNK, R, S, sw2_r, sw2_s,
              SP, NCP, GB, SILU)


def mbconv_from_conv_output(u: torch.Tensor, x: torch.Tensor, stats: torch.Tensor, gamma: torch.Tensor,
                            beta: torch.Tensor, w_se1: torch.Tensor, b_se1: torch.Tensor, w_se2: torch.Tensor,
                            b_se2: torch.Tensor, w_proj: torch.Tensor, b_proj: torch.Tensor, stride: int,
                            activated: bool = False) -> torch.Tensor:
    """``W_proj (g * gate) + b_proj`` (NHWC, x's dtype) from the conv output ``u`` (N, H W, R) that the
    group-width-8 conv wrote: the BN_d pass (``_bn_silu_pool_kernel``: g, stride 1 in place over u, stride 2
    blurred into a buffer of its own; the SE partials), the SE gates, then the projection (no residual).
    ``stats``: BN_d's batch (mean; rstd), (2, R) fp32 (``bn_d_stats``'); ``gamma``, ``beta``: BN_d's
    affine. ``activated`` (stride 2): u is already SiLU(conv + bias), blurred as it is (the BN_d arguments
    are not read)."""
    n, c, h, w = x.shape
    r, k, s = w_proj.shape[1], w_proj.shape[0], w_se1.shape[0]
    geo = dataclasses.replace(geometry_of(x, r, k, s, stride), gate=True)  # the gates: a launch of their own
    out = torch.empty((n, k, geo.oh, geo.ow), device=x.device, dtype=x.dtype,
                      memory_format=torch.channels_last)
    if n == 0:
        return out
    g = u if stride == 1 else torch.empty((n, geo.ohw, r), device=x.device, dtype=x.dtype)
    zpart = torch.empty((n, geo.nchunk, geo.sp), device=x.device, dtype=torch.float32)
    silu, _ = kernel_settings(x)
    bp = min(next_power_of_2(geo.ohw), max(1, BNS_ELEMS // geo.rb))
    launch(_bn_silu_pool_kernel, (n, geo.nchunk), u, u, g, stats, gamma, beta, w_se1, zpart, h, w, geo.oh,
           geo.ow, r, s, geo.nchunk, *w_se1.stride(),
           cost=lambda: _bn_silu_pool_cost(geo, bp, gamma.element_size(), activated),
           RB=geo.rb, BP=bp, SP=geo.sp, SILU=silu, MASK_R=r % geo.rb != 0, STRIDE=stride,
           NS=BNS_BLUR_STAGES if stride == 2 else 1, ACTIVATED=activated,
           num_warps=BNS_WARPS if stride == 1 else BNS_BLUR_WARPS_ACTIVATED if activated else BNS_BLUR_WARPS,
           **(dict(maxnreg=MAXNREG) if activated else {}),
           num_stages=1)
    gates = torch.empty((n, r), device=x.device, dtype=x.dtype)
    b_se1, b_se2 = b_se1.contiguous(), b_se2.contiguous()
    launch(_se_gates_kernel, (n,), zpart, b_se1, w_se2, b_se2, gates, n, geo.nchunk, r, s, *w_se2.stride(),
           cost=lambda: _se_gates_cost(geo), SP=geo.sp, NCP=next_power_of_2(geo.nchunk), GB=gate_rows(r),
           SILU=silu, num_warps=SEG_WARPS, maxnreg=SEG_MAXNREG)
    launch_project(geo, g, zpart, gates, b_se1, w_se2, b_se2, w_proj, b_proj.contiguous(), x, out, False)
    return out


def _bn_silu_pool_cost(geo: MBConvGeometry, bp: int, pb: int, activated: bool = False) -> KernelCost:
    """u read and g written once (stride 1: in place), W_se1 once per launch (from L2 for the other
    images), the statistics and affine per program, the SE partials written. Stride 2: the full-resolution
    g written in place of u (its dirty lines counted as written back to DRAM; not when ``activated``) and
    read back by the blur's nine taps, mostly from L1 (unique: the image's chunk once; working set: the
    input rows of one step of BP output pixels)."""
    n, r, s, eb, hw, ohw, rb = geo.n, geo.r, geo.s, geo.elem, geo.hw, geo.ohw, geo.rb
    in_place = geo.stride == 2 and not activated
    vectors = 0 if activated else 8 + 2 * pb  # BN_d's statistics and affine (activated: not read)
    dram = n * (hw * (2 if in_place else 1) + ohw) * r * eb + s * r * eb + r * vectors
    dram += n * geo.nchunk * geo.sp * 4
    unique = hw * rb * eb + geo.sp * rb * eb + rb * vectors
    rows = min(geo.h, 2 * cdiv(bp, geo.ow) + 1)
    working = rows * geo.w * rb * eb if geo.stride == 2 else 0
    useful = n * r * s + (n * ohw * r * 9 if geo.stride == 2 else 0)
    loops = (Loop("pixel tiles", cdiv(ohw, bp), fixed=True),)
    if in_place:
        loops = (Loop("full-resolution tiles", cdiv(hw, bp), fixed=True),) + loops
    return KernelCost(useful, 0, dram, loops,
                      l2_bytes=(n - 1) * s * r * eb, l1_unique_bytes_per_program=unique,
                      l1_working_set_bytes=working,
                      note=("BlurPool of g" if activated else "BN_d + SiLU over u")
                      + (" + BlurPool" if in_place else "" if activated else ", in place")
                      + ", the pool and the SE partials")


def _se_gates_cost(geo: MBConvGeometry) -> KernelCost:
    """W_se2 and the biases once per launch (then from L2), the partials read, the gates written."""
    n, r, s, eb = geo.n, geo.r, geo.s, geo.elem
    dram = (r * s + r + s + n * r) * eb + n * geo.nchunk * geo.sp * 4
    unique = (r * s + r + s) * eb + geo.nchunk * geo.sp * 4
    return KernelCost(n * r * s, 0, dram, (Loop("gate steps", cdiv(r, gate_rows(r)), fixed=True),),
                      l2_bytes=(n - 1) * (r * s + r + s) * eb, l1_unique_bytes_per_program=unique,
                      note="the SE gates, one image per program")


# ------------------------------------------------------------------------------ batch statistics

STATS_ROWS = 16  # output channels per program of BN_e's statistics (a tl.dot M)
STATS_K = 32  # Gram rows per step
STATS_CHANNELS, STATS_IMAGES = 8, 128  # BN_d's statistics: channels per program x moment rows per step
# Warps of BN_d's and BN_e's statistics launches: 1 and 4 (were 4 and 8; static estimate of Small's 36
# MBConv training blocks, batch 128, sm_90, high end: 0.096 -> 0.070 and 0.302 -> 0.222 ms; lower on sm_80
# and Triton 3.6 too, no stack on any)
STATS_WARPS = 1  # BN_d's
EXPAND_WARPS = 4  # BN_e's


@triton.jit
def bn_batch_tail(r, r_ok, mean, var, rm_ptr, rv_ptr, st_ptr, R, f, unbias, eps):
    """rstd = 1 / sqrt(var + eps); stores the batch statistics the kernels normalise by (``st_ptr``: mean,
    then rstd R entries on) and the running update (1 - f) running + f (mean, unbiased var); returns rstd
    (fp32). BN_e's and BN_d's statistics here and BN_p's merge (narrow.py) end with it."""
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(st_ptr + r, mean, mask=r_ok)
    tl.store(st_ptr + R + r, rstd, mask=r_ok)
    rm = tl.load(rm_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    rv = tl.load(rv_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    tl.store(rm_ptr + r, (1.0 - f) * rm + f * mean, mask=r_ok)
    tl.store(rv_ptr + r, (1.0 - f) * rv + f * (var * unbias), mask=r_ok)
    return rstd


@triton.jit
def _bn_e_stats_kernel(w_ptr, mean_ptr, centre_ptr, gram_ptr, rm_ptr, rv_ptr, st_ptr, wg_ptr, R, C, swr, swc,
                       inv_m, f, unbias, eps, BR: tl.constexpr, CP: tl.constexpr, BK: tl.constexpr,
                       SPLIT: tl.constexpr, STORE_WG: tl.constexpr):
    """BN_e of z = W x (W in x's dtype, as the expand multiplies by it): mean = W mean_x, var =
    W (G / M - d d^T) W^T (diagonal), G the Gram matrix of x centred at ``centre`` (x's mean: d = 0 from
    narrow.x_moments), d = mean_x - centre.
    ``SPLIT`` (16-bit W): W G on the tensor cores as two TF32 products, W G_hi + W G_lo, G_hi = G with its
    low 13 mantissa bits cleared (exact in TF32), G_lo = G - G_hi (exact in fp32); W in a 16-bit dtype is
    exact in TF32, so the only rounding beyond fp32 accumulation is G_lo's to TF32 (< 2^-21 of |G|).
    Otherwise (fp32 W) fp32 FMA (ieee). STORE_WG: W G (R, C) fp32 is written too (the training backward
    forms dW_exp from it: expand_backward.bn_e_weights)."""
    inv_m, f, unbias, eps = fp32(inv_m), fp32(f), fp32(unbias), fp32(eps)  # fp64 under torch.compile
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = r < R
    cc = tl.arange(0, CP)
    c_ok = cc < C
    w = tl.load(w_ptr + r[:, None] * swr + cc[None, :] * swc, mask=r_ok[:, None] & c_ok[None, :],
                other=0.0).to(tl.float32)
    mean_x = tl.load(mean_ptr + cc, mask=c_ok, other=0.0)
    d = mean_x - tl.load(centre_ptr + cc, mask=c_ok, other=0.0).to(tl.float32)
    wg = tl.zeros((BR, CP), dtype=tl.float32)
    for k0 in range(0, C, BK):  # W G in steps of BK Gram rows
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < C
        wk = tl.load(w_ptr + r[:, None] * swr + kk[None, :] * swc, mask=r_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        g = tl.load(gram_ptr + kk[:, None] * C + cc[None, :], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        if SPLIT:
            g_hi = (g.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            wg = tl.dot(wk, g_hi, wg, input_precision="tf32")
            wg = tl.dot(wk, g - g_hi, wg, input_precision="tf32")
        else:
            wg = tl.dot(wk, g, wg, input_precision="ieee")
    wd = tl.sum(w * d[None, :], axis=1)
    var = tl.maximum(tl.sum(wg * w, axis=1) * inv_m - wd * wd, 0.0)
    mean = tl.sum(w * mean_x[None, :], axis=1)
    bn_batch_tail(r, r_ok, mean, var, rm_ptr, rv_ptr, st_ptr, R, f, unbias, eps)
    if STORE_WG:
        tl.store(wg_ptr + r[:, None] * C + cc[None, :], wg, mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _bn_d_stats_kernel(parts_ptr, rm_ptr, rv_ptr, st_ptr, N, R, P, f, unbias, eps, BR: tl.constexpr,
                       BN: tl.constexpr):
    """BN_d from the moment rows ([N][2][R]: sums of u - shift and its square per row of P pixels (an
    image, or a conv program's tiles), shift = the running mean, read before its update): per row mean_i
    and M2_i; per tile of BN rows their mean and M2 = sum M2_i + P (mean_i - mean)^2; the tiles merged in
    order into the batch's (Chan's rule, one pass)."""
    f, unbias, eps = fp32(f), fp32(unbias), fp32(eps)  # fp64 under torch.compile
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = r < R
    pf = tl.cast(P, tl.float32)
    mean_s = tl.zeros((BR,), dtype=tl.float32)
    m2 = tl.zeros((BR,), dtype=tl.float32)
    for n0 in range(0, N, BN):  # one pass: each tile's mean and M2, merged into the running pair (Chan)
        nn = n0 + tl.arange(0, BN)
        ok = (nn < N)[:, None] & r_ok[None, :]
        rows = parts_ptr + (nn * (2 * R))[:, None] + r[None, :]
        s1 = tl.load(rows, mask=ok, other=0.0)
        s2 = tl.load(rows + R, mask=ok, other=0.0)
        mi = s1 / pf
        nb = tl.minimum(N - n0, BN).to(tl.float32)
        mean_b = tl.sum(mi, axis=0) / nb
        dev = mi - mean_b[None, :]
        m2_b = tl.sum(tl.where(ok, s2 - s1 * mi + pf * dev * dev, 0.0), axis=0)
        na = nb * 0.0 + n0  # rows merged so far
        delta = mean_b - mean_s
        mean_s += delta * (nb / (na + nb))
        m2 += m2_b + delta * delta * (pf * na * nb / (na + nb))
    var = tl.maximum(m2 / (N * P), 0.0)
    mean = mean_s + tl.load(rm_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    bn_batch_tail(r, r_ok, mean, var, rm_ptr, rv_ptr, st_ptr, R, f, unbias, eps)


def stats_out(stats: torch.Tensor | None, r: int, device) -> torch.Tensor:
    """Where a BatchNorm's batch mean and rstd go: ``stats`` ((2, R) fp32, contiguous), or a new tensor."""
    if stats is None:
        return torch.empty((2, r), device=device, dtype=torch.float32)
    if stats.shape != (2, r) or stats.dtype != torch.float32 or not stats.is_contiguous():
        raise ValueError(f"stats: expected a contiguous (2, {r}) fp32 tensor, got {tuple(stats.shape)} "
                         f"{stats.dtype}")
    return stats


def bn_e_stats(w: torch.Tensor, mean_x: torch.Tensor, centre: torch.Tensor, gram: torch.Tensor,
               running_mean: torch.Tensor, running_var: torch.Tensor, f: float, eps: float, pixels: int,
               stats: torch.Tensor | None = None, wg: torch.Tensor | None = None) -> torch.Tensor:
    """BN_e's batch mean and rstd ((2, R) fp32: ``stats`` when given) of z = W x; the running statistics
    updated in place, and W G to ``wg`` ((R, C) fp32, contiguous) when given.
    ``w``: (R, C) in x's dtype (the expand's operand); ``mean_x`` (C,) fp32, ``centre`` (C,), any float
    dtype, ``gram`` (C, C) fp32: sum over the M = ``pixels`` pixels of (x - centre)(x - centre)^T
    (narrow.x_moments: centre = mean_x)."""
    r, c = w.shape
    st = stats_out(stats, r, w.device)
    cp = max(16, next_power_of_2(c))
    split = w.dtype != torch.float32
    launch(_bn_e_stats_kernel, (cdiv(r, STATS_ROWS),), w, mean_x, centre, gram.contiguous(), running_mean,
           running_var, st, st if wg is None else wg, r, c, *w.stride(), 1.0 / pixels, f,
           pixels / (pixels - 1), eps,
           cost=lambda: _bn_e_stats_cost(r, c, cp, w.element_size(), split, wg is not None),
           BR=STATS_ROWS, CP=cp, BK=min(STATS_K, cp), SPLIT=split, STORE_WG=wg is not None,
           num_warps=EXPAND_WARPS)
    return st


def bn_d_stats(parts: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, f: float,
               eps: float, pixels: int, stats: torch.Tensor | None = None) -> torch.Tensor:
    """BN_d's batch mean and rstd ((2, R) fp32: ``stats`` when given) from moment rows (``conv_moments``'
    or the conv's, (rows, 2, R) fp32) over ``pixels`` pixels per row, whose shift was ``running_mean``; the
    running statistics updated in place."""
    n, _, r = parts.shape
    count = n * pixels
    st = stats_out(stats, r, parts.device)
    launch(_bn_d_stats_kernel, (cdiv(r, STATS_CHANNELS),), parts.contiguous(), running_mean, running_var, st,
           n, r, pixels, f, count / (count - 1), eps, cost=lambda: _bn_d_stats_cost(n, r),
           BR=STATS_CHANNELS, BN=STATS_IMAGES, num_warps=STATS_WARPS)
    return st


def _bn_e_stats_cost(r: int, c: int, cp: int, wb: int, split: bool, store_wg: bool) -> KernelCost:
    """W (read twice: rows and K steps), the Gram matrix once per program (from L2 after the first), the
    per-channel vectors; the statistics written, and W G (fp32) where stored. Split TF32: two
    tensor-core products as issued (STATS_ROWS x CP x CP a program each)."""
    progs = cdiv(r, STATS_ROWS)
    dram = 2 * r * c * wb + c * c * 4 + 2 * c * 4 + 6 * r * 4
    dram += r * c * 4 if store_wg else 0
    mma = 2 * progs * STATS_ROWS * cp * cp if split else 0
    return KernelCost(r * c * c + 2 * r * c, mma, dram, (Loop("Gram steps", cdiv(c, STATS_K)),),
                      l2_bytes=progs * c * c * 4, note="BN_e's statistics from x's Gram matrix")


def _bn_d_stats_cost(n: int, r: int) -> KernelCost:
    """The moment rows read once, the statistics and running statistics written."""
    steps = cdiv(n, STATS_IMAGES)
    return KernelCost(4 * n * r, 0, n * 2 * r * 4 + 6 * r * 4, (Loop("images", steps),),
                      note="BN_d's statistics from the moment rows (Chan's merge)")
