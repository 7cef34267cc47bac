"""The passes of the fused MBConv training backward over the grouped conv's raw output d (P, R):
``dgate_pool``, ``bn_d_backward`` (two passes over d) and ``bn_d_sums`` between them, on (N, R) vectors
(backward_reference.py states their math; same signatures, without ``_reference``). Each pass over d reads
it once and recomputes dq = do W_proj on the tensor cores (the projection's input gradient, never stored),
with u_hat, v, g = SiLU(v) and s' = SiLU'(v) from d in fp32.

One kernel, ``_gate_backward_kernel``, with a ``MODE`` constexpr:

* 0 (``dgate_pool``): per image, the sums over its pixels of dq g and of g (the SE backward's inputs) and
  of dq s', s', dq s' u_hat and s' u_hat, written as (N, R) rows. BN_d's backward sums need gate and dpix,
  known only after the SE backward; as both are constant over an image (dy = (dq gate_n + dpix_n) s'),
  ``bn_d_sums`` forms them from these four per-image sums (``_sums_kernel``: a fixed order over the
  images) instead of a pass of its own over d.
* 1 (``bn_d_backward``): dy = (dq gate_n + dpix_n) s', dd = gamma rho (dy - sum dy / P - u_hat sum(dy
  u_hat) / P) in d's dtype, and per program the dW_proj partial do^T (g gate_n), written to the program's
  (K, R) rows of a (groups, K, R) buffer; the weight gradients' reduction
  (gconv.launcher.reduce_partials) sums the groups in a fixed order (no atomics: two calls give equal
  bits).

Grid: program (c, s) = channel chunk c of RB channels (the fast axis, so the chunks of one image group run
together and the do tiles they share are re-read from L2) x image group s of whole images (per-image sums
complete within a program, no merge for MODE 0), about one program per SM (RB = 128 for MODE 0: 8 chunks
x 16 groups at Small; RB = 64 for MODE 1, whose [K, RB] fp32 dW_proj partial lives in registers: 16 x 8;
sm_80: RB_SM80).
The chunk's W_proj slice is loaded once per program (loop-invariant, in shared memory). One loop walks the
group's tiles of BM pixels, image by image (a tile never straddles two images; the last tile of an image
is masked where BM does not divide HW). Tiles are [channels, pixels] (see the kernel). Products on 16-bit
operands with fp32 accumulation (fp32 data: launcher.FP32_PRECISION); every sum in fp32.

Stride 2 (g = BlurPool(SiLU(v_d)) at half resolution, given: the blur mixes neighbouring pixels of v_d, so
g is written by its own pass and these read it): ``gate_pool`` and ``gate_grad``, the kernel's ``GIVEN``
variant, whose tile is g itself (no BatchNorm, no SiLU). MODE 0 writes dgate and gsum only (BN_d's sums
are taken over d's pixels through the blur's transpose, elsewhere); MODE 1 writes dg = dq gate_n + dpix_n
(rounded once to g's dtype) and the same dW_proj partials. Grid, tiles and the merge as above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._activations import sigmoid
from .._cost import KernelCost, Loop
from .._launch import MAXNREG, cdiv, device_info, launch, next_power_of_2
from .._scalars import fp32
from ..gconv.launcher import reduce_partials
from .launcher import kernel_settings

BM = 64  # pixels per tile (the dots' M; wgmma needs >= 64)
RB = (128, 64)  # channels per chunk by MODE (MODE 1 also holds the [K, RB] fp32 dW_proj partial)
STAGES = 3  # do tiles in flight (cp.async)
# sm_80 (mma.sync: the dots' fragments take more registers than wgmma's): MODE 1 on 32-channel chunks. At
# 64 it spilled 320 B at Small's 16x16 map and 344 B at 8x8; at 32 nothing, and the static estimate (batch
# 128, high end) 969.8 -> 715.6 and 212.4 -> 181.8 us. MODE 0 keeps 128 (at 64: 56.1 -> 72.7 us at 8x8)
RB_SM80 = (128, 32)
# fp32 data (tiles of twice the bytes, tf32x3 dots): the W_proj slice and the do tiles within shared memory
# (sm_90, Small: 192 KB; 64 channels took 256-320 KB). It spills and takes mma.sync: a fallback, not tuned
RB_FP32 = (32, 16)
STAGES_FP32 = 2
WARPS = 8  # two warpgroups
# Both modes compiled with maxnreg (_launch.MAXNREG): Triton 3.6 (the GPU image's) then keeps more of the
# do tiles' loads in flight. Small's 36 MBConv training blocks, static, batch 128, high end: 5.89 -> 5.46
# ms on Triton 3.6; Triton 3.8 (already at 211-254 registers) 4.985 -> 4.979, sm_80 unchanged; no new stack
GATE_MAXNREG = MAXNREG
MIN_IMAGES = 2  # the fewest images per group: the W_proj slice is read once per program
MERGE_GROUPS = 16  # groups per step of the merge
MERGE_BLOCK = 512  # elements of the (K, R) result per merge program
SUMS_IMAGES = 64  # images per step of bn_d_sums
SUMS_BLOCK = 8  # channels per bn_d_sums program (at Small: 128 programs, two steps)
# bn_d_sums with maxnreg (_launch.MAXNREG): its loads in flight together; Small's 36 MBConv training blocks,
# static, high end: 0.096 -> 0.077 ms (sm_90), 0.097 -> 0.078 (Triton 3.6), 0.158 -> 0.117 (sm_80)
SUMS_MAXNREG = MAXNREG


@triton.jit
def bn_d_affine(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, c, c_ok):
    """(mean, rstd, a, b) of channels c (0 where masked), fp32: BN_d's v = gamma u_hat + beta = d a + b
    (u_hat = (d - mean) rstd), so a = gamma rstd, b = beta - gamma rstd mean."""
    mean = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
    rstd = tl.load(rstd_ptr + c, mask=c_ok, other=0.0)
    gamma = tl.load(gamma_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    return mean, rstd, gamma * rstd, beta - gamma * rstd * mean


@triton.jit
def _as_dq(t, dq):
    """t + 0 dq (t for finite dq; NaN where dq is not finite, as every result derived from it would be): t in
    dq's wgmma accumulator layout. Otherwise the compiler keeps what derives from d alone (g, s', u_hat) in
    the load's layout, and each sum over pixels of such a value crosses warps through shared memory behind
    barriers, with a conversion of its result. sm_90, Small 16x16, static estimate: dgate_pool 44 BAR and
    108 SHFL in its listing and 51-57 us without, 20, 24 and 39-44 us with g and s' converted (u_hat too:
    43-49; d's tile itself: 48-58 us, all the element-wise work then waits for the dot); bn_d_backward
    79-90 us without, 59-70 with s' converted."""
    return t + dq * 0.0


@triton.jit
def _gate_backward_kernel(d_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, do_ptr, w_ptr, gate_ptr, dpix_ptr,
                          a0_ptr, a1_ptr, a2_ptr, a3_ptr, N, R, K, IPG, inv_p, HW: tl.constexpr,
                          MODE: tl.constexpr, RB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                          EVEN_HW: tl.constexpr, EVEN_CK: tl.constexpr, FAST: tl.constexpr,
                          PREC: tl.constexpr, GIVEN: tl.constexpr):
    """Program (c, s): channels c RB ... (c + 1) RB - 1 of images s IPG ... (s + 1) IPG - 1 (TPI = HW / BM
    tiles each, rounded up). MODE 0: a0 = dgate, a1 = gsum (N, R), a2 = the parts (4, N, R): sum dq s',
    sum s', sum dq s' u_hat, sum s' u_hat. MODE 1: a0 = sum dy, a1 = sum dy u_hat (R,), a2 = dd (P, R),
    a3 = the dW_proj partials (groups, K, R). EVEN_HW: HW a multiple of BM (no pixel masks); EVEN_CK: R a
    multiple of RB and K = BK (no channel masks; a masked channel has a = b = gate = dpix = 0 and dq = 0).
    A masked pixel has do = 0, so dq = 0 and its do^T q terms vanish.

    Tiles are transposed, [RB channels, BM pixels]: dq^T = W^T do^T puts the pixels along the wgmma
    accumulator's N, where a thread holds BM / 4 of a row's values and 3 more lanes the rest, so at
    RB = 128 (one warpgroup per 64 channels) an image's sums over pixels take adds and two shuffle rounds,
    no shared memory and no barrier. dW_proj += do^T q (MODE 1) takes q from shared memory: as the A
    operand from registers (q^T do) ptxas serialised every wgmma of the loop (C7515).

    GIVEN: d_ptr is g, mean ... beta unused; MODE 0 without a2 (no parts), MODE 1 writes dg to a2 and reads
    no a0, a1. MODE 0 still puts g in dq's layout (_as_dq; sm_90, g 16x16, R = 384, K = 192: 94
    registers, 13.8-17.6 us estimated, against 146 and 14.3-18.1 without); MODE 1 keeps g in its load's
    layout, bound for shared memory as the dot's operand (converted: 22.1-29.8 -> 28.7-34.3 us)."""
    inv_p = fp32(inv_p)  # torch.compile passes floats as fp64 (_scalars.py)
    TPI: tl.constexpr = (HW + BM - 1) // BM
    dt = d_ptr.dtype.element_ty
    c = tl.program_id(0) * RB + tl.arange(0, RB)
    s = tl.program_id(1)
    k = tl.arange(0, BK)
    i = tl.arange(0, BM)
    c_ok = c < R
    k_ok = k < K
    if not GIVEN:
        mean, rstd, a, b = bn_d_affine(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, c, c_ok)
        a = a[:, None]
        b = b[:, None]
        mr = (mean * rstd)[:, None]
    wt = tl.load(w_ptr + c[:, None] + k[None, :] * R, mask=c_ok[:, None] & k_ok[None, :], other=0.0)  # W^T
    n0 = s * IPG
    tiles = (tl.minimum(n0 + IPG, N) - n0) * TPI
    if MODE == 0:  # the image's sums of dq g, g, dq s', s', dq s' u_hat, s' u_hat
        acc_dqg = tl.zeros((RB,), dtype=tl.float32)
        acc_g = tl.zeros((RB,), dtype=tl.float32)
        if not GIVEN:
            acc_dqs = tl.zeros((RB,), dtype=tl.float32)
            acc_s = tl.zeros((RB,), dtype=tl.float32)
            acc_dqsu = tl.zeros((RB,), dtype=tl.float32)
            acc_su = tl.zeros((RB,), dtype=tl.float32)
            NR = N * R
    else:
        if not GIVEN:
            sum_dy = (tl.load(a0_ptr + c, mask=c_ok, other=0.0) * inv_p)[:, None]
            sum_dyu = (tl.load(a1_ptr + c, mask=c_ok, other=0.0) * inv_p)[:, None]
        acc_w = tl.zeros((BK, RB), dtype=tl.float32)  # dW_proj
    for t in range(tiles):
        img = n0 + t // TPI
        j = (t % TPI) * BM + i
        rows = img * HW + j
        xp = d_ptr + c[:, None] + rows[None, :] * R
        dp = do_ptr + rows[:, None] * K + k[None, :]
        row_ok = j < HW
        if EVEN_HW and EVEN_CK:
            x = tl.load(xp)
            do = tl.load(dp)
        elif EVEN_HW:
            x = tl.load(xp, mask=c_ok[:, None], other=0.0)
            do = tl.load(dp, mask=k_ok[None, :], other=0.0)
        elif EVEN_CK and MODE != 0:
            x = tl.load(xp, mask=row_ok[None, :], other=0.0)
            do = tl.load(dp, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(xp, mask=c_ok[:, None] & row_ok[None, :], other=0.0)
            do = tl.load(dp, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        dq = tl.dot(wt, tl.trans(do), input_precision=PREC)  # [RB, BM]
        if GIVEN:  # the tile is g (masked pixels and channels loaded as 0)
            g = x
        else:
            v = x * a + b
            sg = sigmoid(v, FAST)
            g = v * sg
            s1 = sg + g * (1.0 - sg)  # SiLU'(v) = s (1 + v (1 - s))
            u_hat = x * rstd[:, None] - mr
        if MODE == 0:
            if not EVEN_HW and not GIVEN:  # (with the channel mask, and all of them on the loads: the
                # compile of MODE 0 at 14x14 keeps the cheaper layouts; masked before _as_dq: 44-50 against
                # 47-54 us after)
                ok = c_ok[:, None] & row_ok[None, :]
                g = tl.where(ok, g, 0.0)
                s1 = tl.where(ok, s1, 0.0)
            g = _as_dq(g, dq)
            if not GIVEN:
                s1 = _as_dq(s1, dq)
                dqs = dq * s1
            acc_dqg += tl.sum(dq * g, axis=1)
            acc_g += tl.sum(g, axis=1)
            if not GIVEN:
                acc_dqs += tl.sum(dqs, axis=1)
                acc_s += tl.sum(s1, axis=1)
                acc_dqsu += tl.sum(dqs * u_hat, axis=1)
                acc_su += tl.sum(s1 * u_hat, axis=1)
            last = t % TPI == TPI - 1  # the image's sums are complete: write them, start the next
            ok = c_ok & last
            tl.store(a0_ptr + img * R + c, acc_dqg, mask=ok)
            tl.store(a1_ptr + img * R + c, acc_g, mask=ok)
            if not GIVEN:
                tl.store(a2_ptr + img * R + c, acc_dqs, mask=ok)
                tl.store(a2_ptr + NR + img * R + c, acc_s, mask=ok)
                tl.store(a2_ptr + 2 * NR + img * R + c, acc_dqsu, mask=ok)
                tl.store(a2_ptr + 3 * NR + img * R + c, acc_su, mask=ok)
            acc_dqg = tl.where(last, 0.0, acc_dqg)
            acc_g = tl.where(last, 0.0, acc_g)
            if not GIVEN:
                acc_dqs = tl.where(last, 0.0, acc_dqs)
                acc_s = tl.where(last, 0.0, acc_s)
                acc_dqsu = tl.where(last, 0.0, acc_dqsu)
                acc_su = tl.where(last, 0.0, acc_su)
        else:
            gate = tl.load(gate_ptr + img * R + c, mask=c_ok, other=0.0)[:, None]
            dpix = tl.load(dpix_ptr + img * R + c, mask=c_ok, other=0.0)[:, None]
            if GIVEN:  # dd stands for dg
                dd = (dq * gate + dpix).to(dt)
            else:
                s1 = _as_dq(s1, dq)
                dy = (dq * gate + dpix) * s1
                dd = (a * (dy - sum_dy - u_hat * sum_dyu)).to(dt)
            if EVEN_HW and EVEN_CK:
                tl.store(a2_ptr + c[:, None] + rows[None, :] * R, dd)
            elif EVEN_HW:
                tl.store(a2_ptr + c[:, None] + rows[None, :] * R, dd, mask=c_ok[:, None])
            elif EVEN_CK:
                tl.store(a2_ptr + c[:, None] + rows[None, :] * R, dd, mask=row_ok[None, :])
            else:
                tl.store(a2_ptr + c[:, None] + rows[None, :] * R, dd, mask=c_ok[:, None] & row_ok[None, :])
            acc_w = tl.dot(tl.trans(do), tl.trans((g * gate).to(dt)), acc_w, input_precision=PREC)
    if MODE == 1:
        tl.store(a3_ptr + s * K * R + k[:, None] * R + c[None, :], acc_w, mask=k_ok[:, None] & c_ok[None, :])


@triton.jit
def _sums_kernel(parts_ptr, gate_ptr, dpix_ptr, sum_ptr, sumu_ptr, N, R, BN: tl.constexpr, BR: tl.constexpr):
    """BN_d's backward sums of channels c BR ... (c + 1) BR - 1: sum dy = sum_n gate_n sum dq s' + dpix_n
    sum s', sum dy u_hat = sum_n gate_n sum dq s' u_hat + dpix_n sum s' u_hat (the parts (4, N, R)), over
    the images in a fixed order, BN per step."""
    c = tl.program_id(0) * BR + tl.arange(0, BR)
    c_ok = c < R
    i = tl.arange(0, BN)
    NR = N * R
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    accu = tl.zeros((BN, BR), dtype=tl.float32)
    for n0 in range(0, N, BN):
        n = n0 + i
        off = n[:, None] * R + c[None, :]
        m = (n < N)[:, None] & c_ok[None, :]
        gate = tl.load(gate_ptr + off, mask=m, other=0.0)
        dpix = tl.load(dpix_ptr + off, mask=m, other=0.0)
        acc += gate * tl.load(parts_ptr + off, mask=m, other=0.0)
        acc += dpix * tl.load(parts_ptr + NR + off, mask=m, other=0.0)
        accu += gate * tl.load(parts_ptr + 2 * NR + off, mask=m, other=0.0)
        accu += dpix * tl.load(parts_ptr + 3 * NR + off, mask=m, other=0.0)
    tl.store(sum_ptr + c, tl.sum(acc, axis=0), mask=c_ok)
    tl.store(sumu_ptr + c, tl.sum(accu, axis=0), mask=c_ok)


# ---------------------------------------------------------------------------------------------- launchers


def _check(op: str, d, stats, do, w_proj, n, gate=None, dpix=None, sums=()) -> None:
    """Shapes, dtypes, devices and contiguity, before any launch (one ValueError line). ``stats``: BN_d's
    (mean_d, rstd_d, gamma_d, beta_d), None when ``d`` is g itself (the stride-2 passes)."""
    def bad(msg: str):
        raise ValueError(f"gate_backward.{op}: {msg}")

    x = "d" if stats is not None else "g"
    if d.dim() != 2 or d.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        bad(f"{x} must be 2-D (P, R) fp32/fp16/bf16, got {tuple(d.shape)} {d.dtype}")
    p, r = d.shape
    if not isinstance(n, int) or n < 1 or p < 1 or p % n:
        bad(f"{p} pixels are not {n} images of equal size")
    if do.dim() != 2 or do.shape[0] != p or do.dtype != d.dtype:
        bad(f"do must be ({p}, K) {d.dtype}, got {tuple(do.shape)} {do.dtype}")
    kk = do.shape[1]
    if p * max(r, kk) >= 2**31:
        bad(f"{p} x {max(r, kk)} elements: past the kernels' 32-bit offsets")
    if tuple(w_proj.shape) != (kk, r) or w_proj.dtype != d.dtype:
        bad(f"w_proj must be ({kk}, {r}) {d.dtype}, got {tuple(w_proj.shape)} {w_proj.dtype}")
    stats = stats or ()
    for name, t in (*zip(("mean_d", "rstd_d"), stats[:2]), *(("sums", s) for s in sums)):
        if tuple(t.shape) != (r,) or t.dtype != torch.float32:
            bad(f"{name} must be ({r},) fp32, got {tuple(t.shape)} {t.dtype}")
    for name, t in zip(("gamma_d", "beta_d"), stats[2:]):
        if tuple(t.shape) != (r,) or t.dtype not in (torch.float32, d.dtype):
            bad(f"{name} must be ({r},) fp32 or {d.dtype}, got {tuple(t.shape)} {t.dtype}")
    for name, t in (("gate", gate), ("dpix", dpix)):
        if t is not None and (tuple(t.shape) != (n, r) or t.dtype != torch.float32):
            bad(f"{name} must be ({n}, {r}) fp32, got {tuple(t.shape)} {t.dtype}")
    ts = [d, *stats, do, w_proj, *(t for t in (gate, dpix) if t is not None), *sums]
    if any(t.device != d.device for t in ts):
        bad(f"all tensors must be on {x}'s device")
    if not all(t.is_contiguous() for t in ts):
        bad("every tensor must be contiguous (row-major)")


def _geometry(d: torch.Tensor, n: int, mode: int) -> tuple[int, int, int, int, int]:
    """(channels per chunk, chunks, groups, images per group, tiles per image) of MODE's grid: about one
    program per SM (each program loads its W_proj slice once), at least MIN_IMAGES images per group."""
    p, r = d.shape
    gpu = device_info(d.device)
    rb = (RB_FP32 if d.dtype == torch.float32 else RB_SM80 if gpu.arch < 90 else RB)[mode]
    chunks = cdiv(r, rb)
    want = max(1, gpu.sms // chunks)
    ipg = max(min(MIN_IMAGES, n), cdiv(n, want))
    return rb, chunks, cdiv(n, ipg), ipg, cdiv(p // n, BM)


def _launch(mode: int, d, stats, do, w_proj, gate, dpix, a0, a1, a2, a3, n, geo) -> None:
    """MODE's launch; a0 ... a3: MODE 0 dgate, gsum, the parts, (unused); MODE 1 sum dy, sum dy u_hat, dd,
    the dW_proj partials. ``stats`` None: GIVEN, ``d`` is g (a0 as the statistics' unused pointers; MODE 0
    without the parts, MODE 1 writes dg in a2 and reads no sums)."""
    given = stats is None
    mean_d, rstd_d, gamma_d, beta_d = (a0,) * 4 if given else stats
    p, r = d.shape
    kk = do.shape[1]
    hw = p // n
    rb, chunks, groups, ipg, _ = geo
    silu, prec = kernel_settings(d)
    bk = max(16, next_power_of_2(kk))
    launch(_gate_backward_kernel, (chunks, groups), d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, gate,
           dpix, a0, a1, a2, a3, n, r, kk, ipg, 1.0 / p,
           cost=lambda: _cost(mode, given, p, r, kk, n, geo, d.element_size()),
           HW=hw, MODE=mode, RB=rb, BM=BM, BK=bk, EVEN_HW=hw % BM == 0, EVEN_CK=r % rb == 0 and kk == bk,
           FAST=silu, PREC=prec, GIVEN=given, num_warps=WARPS, maxnreg=GATE_MAXNREG,
           num_stages=STAGES_FP32 if d.dtype == torch.float32 else STAGES)


def dgate_pool(d: torch.Tensor, mean_d: torch.Tensor, rstd_d: torch.Tensor, gamma_d: torch.Tensor,
               beta_d: torch.Tensor, do: torch.Tensor, w_proj: torch.Tensor, n: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate, gsum, parts), fp32: per image, sum over its pixels of dq g and of g, (N, R) each; parts
    (4, N, R): per image the sums of dq s', s', dq s' u_hat and s' u_hat (s' = SiLU'(v_d))."""
    _check("dgate_pool", d, (mean_d, rstd_d, gamma_d, beta_d), do, w_proj, n)
    r = d.shape[1]
    dgate = torch.empty((n, r), device=d.device, dtype=torch.float32)
    gsum = torch.empty((n, r), device=d.device, dtype=torch.float32)
    parts = torch.empty((4, n, r), device=d.device, dtype=torch.float32)
    _launch(0, d, (mean_d, rstd_d, gamma_d, beta_d), do, w_proj, mean_d, mean_d, dgate, gsum, parts, parts,
            n, _geometry(d, n, 0))
    return dgate, gsum, parts


def bn_d_sums(parts: torch.Tensor, gate: torch.Tensor, dpix: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum dy, sum dy u_hat), (R,) fp32, from dgate_pool's parts (4, N, R) and gate, dpix (N, R) fp32."""
    def bad(msg: str):
        raise ValueError(f"gate_backward.bn_d_sums: {msg}")

    if parts.dim() != 3 or parts.shape[0] != 4 or parts.dtype != torch.float32:
        bad(f"parts must be (4, N, R) fp32, got {tuple(parts.shape)} {parts.dtype}")
    n, r = parts.shape[1:]
    for name, t in (("gate", gate), ("dpix", dpix)):
        if tuple(t.shape) != (n, r) or t.dtype != torch.float32:
            bad(f"{name} must be ({n}, {r}) fp32, got {tuple(t.shape)} {t.dtype}")
    if gate.device != parts.device or dpix.device != parts.device:
        bad("all tensors must be on parts' device")
    if not (parts.is_contiguous() and gate.is_contiguous() and dpix.is_contiguous()):
        bad("every tensor must be contiguous (row-major)")
    sum_dy = torch.empty((r,), device=parts.device, dtype=torch.float32)
    sum_dyu = torch.empty((r,), device=parts.device, dtype=torch.float32)
    launch(_sums_kernel, (cdiv(r, SUMS_BLOCK),), parts, gate, dpix, sum_dy, sum_dyu, n, r,
           cost=lambda: KernelCost(0, 0, 2 * r * 4, (Loop("images", cdiv(n, SUMS_IMAGES)),),
                                   l2_bytes=6 * n * r * 4, l2_footprint_bytes=6 * n * r * 4,
                                   note="BN_d sums: the per-image parts, gate and dpix over the images"),
           BN=SUMS_IMAGES, BR=SUMS_BLOCK, num_warps=4, maxnreg=SUMS_MAXNREG)
    return sum_dy, sum_dyu


def bn_d_backward(d: torch.Tensor, mean_d: torch.Tensor, rstd_d: torch.Tensor, gamma_d: torch.Tensor,
                  beta_d: torch.Tensor, do: torch.Tensor, w_proj: torch.Tensor, gate: torch.Tensor,
                  dpix: torch.Tensor, sum_dy: torch.Tensor, sum_dy_uhat: torch.Tensor, n: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dd (P, R) in d's dtype, dW_proj (K, R) fp32)."""
    _check("bn_d_backward", d, (mean_d, rstd_d, gamma_d, beta_d), do, w_proj, n, gate, dpix,
           (sum_dy, sum_dy_uhat))
    r, kk = d.shape[1], do.shape[1]
    geo = _geometry(d, n, 1)
    groups = geo[2]
    dd = torch.empty_like(d)
    part = torch.empty((groups, kk, r), device=d.device, dtype=torch.float32)
    dw = torch.empty((kk, r), device=d.device, dtype=torch.float32)
    _launch(1, d, (mean_d, rstd_d, gamma_d, beta_d), do, w_proj, gate, dpix, sum_dy, sum_dy_uhat, dd, part,
            n, geo)
    _merge_dw(part, dw)
    return dd, dw


def _merge_dw(part: torch.Tensor, dw: torch.Tensor) -> None:
    reduce_partials(part, dw, part.shape[0], dw.numel(), block=MERGE_BLOCK, sb=MERGE_GROUPS,
                    partials_in_l2=True, what="dW_proj: the groups' partials summed in a fixed order")


# ---- stride 2: g (N HO WO, R) given (g = BlurPool(SiLU(v_d)), written by the forward's recompute)


def gate_pool(g: torch.Tensor, do: torch.Tensor, w_proj: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, gsum) (N, R) fp32: per image, the sums over its pixels of dq g and of g (dq = do W_proj)."""
    _check("gate_pool", g, None, do, w_proj, n)
    r = g.shape[1]
    dgate = torch.empty((n, r), device=g.device, dtype=torch.float32)
    gsum = torch.empty((n, r), device=g.device, dtype=torch.float32)
    _launch(0, g, None, do, w_proj, dgate, dgate, dgate, gsum, dgate, dgate, n, _geometry(g, n, 0))
    return dgate, gsum


def gate_grad(g: torch.Tensor, do: torch.Tensor, w_proj: torch.Tensor, gate: torch.Tensor, dpix: torch.Tensor,
              n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg = dq gate_n + dpix_n (P, R) in g's dtype, rounded once; dW_proj = do^T (g gate) (K, R) fp32)."""
    _check("gate_grad", g, None, do, w_proj, n, gate, dpix)
    r, kk = g.shape[1], do.shape[1]
    geo = _geometry(g, n, 1)
    dg = torch.empty_like(g)
    part = torch.empty((geo[2], kk, r), device=g.device, dtype=torch.float32)
    dw = torch.empty((kk, r), device=g.device, dtype=torch.float32)
    _launch(1, g, None, do, w_proj, gate, dpix, gate, gate, dg, part, n, geo)
    _merge_dw(part, dw)
    return dg, dw


def _cost(mode: int, given: bool, p: int, r: int, kk: int, n: int, geo, eb: int) -> KernelCost:
    """d (g if GIVEN), do, W_proj, BN_d's statistics (not if GIVEN) and two (N, R) fp32 tensors (written by
    MODE 0, gate and dpix read by MODE 1) once from DRAM; do's re-reads by the other chunks' programs
    (adjacent in the grid), the W_proj slices' by the other groups and gate/dpix rows' per tile from L2;
    MODE 0 writes the four parts (N, R) too (not if GIVEN), MODE 1 dd (dg) and its dW_proj partials, and
    reads sum dy, sum dy u_hat (not if GIVEN). The dots as issued: BM x BK x RB per tile (the masked pixels
    of an image's last tile and K's padding included), MODE 1 a second one of BK x RB x BM. Useful: dq
    once (MODE 0) and dW_proj (MODE 1); MODE 1's dq is recomputed."""
    rb, chunks, groups, ipg, tpi = geo
    bk = max(16, next_power_of_2(kk))
    tiles = n * tpi
    mma = chunks * tiles * BM * bk * rb * (2 if mode == 1 else 1)
    useful = p * kk * r
    dram = (p * r + p * kk + kk * r) * eb + (0 if given else 4 * r * 4) + 2 * n * r * 4
    l2 = (chunks - 1) * p * kk * eb + (groups - 1) * kk * r * eb
    if mode == 0:
        dram += 0 if given else 4 * n * r * 4
    else:
        l2 += 2 * (tiles - n) * r * 4
        dram += p * r * eb + (0 if given else 2 * r * 4) + groups * kk * r * 4
    notes = (("SE backward: per image sum dq g, sum g and BN_d's backward sums' parts",
              "BN_d backward: dd written, dW_proj partials"),
             ("SE backward (stride 2): per image sum dq g, sum g over g given",
              "dg = dq gate + dpix written, dW_proj partials (stride 2: g given)"))
    return KernelCost(useful, mma, dram, (Loop("pixel tiles", ipg * tpi),), l2_bytes=l2,
                      note=notes[given][mode])
