"""The three passes of the fused MBConv training backward over the grouped conv's raw output d (P, R):
``dgate_pool``, ``bn_d_sums``, ``bn_d_backward`` (backward_reference.py states their math; same
signatures, without ``_reference``). Each reads d once and recomputes dq = do W_proj on the tensor cores
(the projection's input gradient, never stored), with u_hat, v and g = SiLU(v) from d in fp32.

One kernel, ``_gate_backward_kernel``, with a ``MODE`` constexpr:

* 0 (``dgate_pool``): per image, the sums over its pixels of dq g and of g, written as (N, R) rows.
* 1 (``bn_d_sums``): dy = (dq gate_n + dpix_n) SiLU'(v); per program the sums of dy and dy u_hat and the
  dW_proj partial do^T (g gate_n), written to the program's rows of a (groups, K + 2, R) buffer;
  ``_merge_kernel`` sums the groups in a fixed order (no atomics: two calls give equal bits).
* 2 (``bn_d_backward``): dd = gamma rho (dy - sum dy / P - u_hat sum(dy u_hat) / P) in d's dtype.

Grid: program (c, s) = channel chunk c of RB channels (the fast axis, so the chunks of one image group run
together and the do tiles they share are re-read from L2) x image group s of whole images (per-image sums
complete within a program, no merge for MODE 0), about one program per SM (RB = 128 for MODES 0 and 2:
8 chunks x 16 groups at Small; RB = 64 for MODE 1, whose [K, RB] fp32 dW_proj partial lives in registers:
16 x 8). The chunk's W_proj slice is loaded once per program (loop-invariant, in shared memory). One loop
walks the group's tiles of BM pixels, image by image (a tile never straddles two images; the last tile of
an image is masked where BM does not divide HW). Tiles are [channels, pixels] (see the kernel). Products
on 16-bit operands with fp32 accumulation (fp32 data: launcher.FP32_PRECISION); every sum in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._activations import sigmoid
from .._cost import KernelCost, Loop
from .._launch import device_info, launch
from .launcher import kernel_settings

BM = 64  # pixels per tile (the dots' M; wgmma needs >= 64)
RB = (128, 64, 128)  # channels per chunk by MODE (MODE 1 also holds the [K, RB] fp32 dW_proj partial)
STAGES = 3  # do tiles in flight (cp.async)
# fp32 data (tiles of twice the bytes, tf32x3 dots): the W_proj slice and the do tiles within shared memory
# (sm_90, Small: 192 KB; 64 channels took 256-320 KB). It spills and takes mma.sync: a fallback, not tuned
RB_FP32 = (32, 16, 32)
STAGES_FP32 = 2
WARPS = 8  # two warpgroups
MIN_IMAGES = 2  # the fewest images per group: the W_proj slice is read once per program
MERGE_GROUPS = 16  # groups per step of the merge
MERGE_BLOCK = 512  # elements of the (K + 2, R) result per merge program


@triton.jit
def _gate_backward_kernel(d_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, do_ptr, w_ptr, gate_ptr, dpix_ptr,
                          a0_ptr, a1_ptr, a2_ptr, N, R, K, IPG, inv_p, HW: tl.constexpr,
                          MODE: tl.constexpr, RB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                          EVEN_HW: tl.constexpr, EVEN_CK: tl.constexpr, FAST: tl.constexpr,
                          PREC: tl.constexpr):
    """Program (c, s): channels c RB ... (c + 1) RB - 1 of images s IPG ... (s + 1) IPG - 1 (TPI = HW / BM
    tiles each, rounded up). MODE 0: a0 = dgate, a1 = gsum (N, R). MODE 1: a2 = the partials (groups,
    K + 2, R): rows 0 ... K - 1 dW_proj, K sum dy, K + 1 sum dy u_hat. MODE 2: a0 = sum dy, a1 = sum dy
    u_hat (R,), a2 = dd (P, R). EVEN_HW: HW a multiple of BM (no pixel masks); EVEN_CK: R a multiple
    of RB and K = BK (no channel masks; a masked channel has a = b = gate = dpix = 0 and dq = 0: g = dy = 0).

    Tiles are transposed, [RB channels, BM pixels]: dq^T = W^T do^T puts the pixels along the wgmma
    accumulator's N, where a thread holds BM / 4 of a row's values and 3 more lanes the rest, so at
    RB = 128 (one warpgroup per 64 channels) an image's sums over pixels take adds and two shuffle rounds,
    no shared memory and no barrier. dW_proj += do^T q (MODE 1) takes q from shared memory: as the A
    operand from registers (q^T do) ptxas serialised every wgmma of the loop (C7515)."""
    TPI: tl.constexpr = (HW + BM - 1) // BM
    dt = d_ptr.dtype.element_ty
    c = tl.program_id(0) * RB + tl.arange(0, RB)
    s = tl.program_id(1)
    k = tl.arange(0, BK)
    i = tl.arange(0, BM)
    c_ok = c < R
    k_ok = k < K
    mean = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
    rstd = tl.load(rstd_ptr + c, mask=c_ok, other=0.0)
    gamma = tl.load(gamma_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    # v = gamma u_hat + beta = d a + b (MODE 0 needs no u_hat); u_hat = d rstd - mean rstd
    a = (gamma * rstd)[:, None]
    b = (beta - gamma * rstd * mean)[:, None]
    mr = (mean * rstd)[:, None]
    wt = tl.load(w_ptr + c[:, None] + k[None, :] * R, mask=c_ok[:, None] & k_ok[None, :], other=0.0)  # W^T
    n0 = s * IPG
    tiles = (tl.minimum(n0 + IPG, N) - n0) * TPI
    acc = tl.zeros((RB,), dtype=tl.float32)  # MODE 0: sum dq g of the image
    acc2 = tl.zeros((RB,), dtype=tl.float32)  # MODE 0: sum g of the image
    if MODE == 1:
        # sum dy, sum dy u_hat per thread's elements, reduced after the loop: at RB = 64 a tile's pixels
        # span both warpgroups, whose per-tile sums would meet in shared memory behind barriers
        acc_dy = tl.zeros((RB, BM), dtype=tl.float32)
        acc_dyu = tl.zeros((RB, BM), dtype=tl.float32)
        acc_w = tl.zeros((BK, RB), dtype=tl.float32)  # dW_proj
    if MODE == 2:
        sum_dy = (tl.load(a0_ptr + c, mask=c_ok, other=0.0) * inv_p)[:, None]
        sum_dyu = (tl.load(a1_ptr + c, mask=c_ok, other=0.0) * inv_p)[:, None]
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
        v = x * a + b
        sg = sigmoid(v, FAST)
        if MODE == 0:
            g = v * sg
            if not EVEN_HW:  # (with the channel mask, and all of them on the loads: the compile of MODE 0
                # at 14x14 keeps the cheaper layouts, 32-38 against 46-57 us in the static estimate)
                g = tl.where(c_ok[:, None] & row_ok[None, :], g, 0.0)
            acc += tl.sum(dq * g, axis=1)
            acc2 += tl.sum(g, axis=1)
            last = t % TPI == TPI - 1  # the image's sums are complete: write them, start the next
            tl.store(a0_ptr + img * R + c, acc, mask=c_ok & last)
            tl.store(a1_ptr + img * R + c, acc2, mask=c_ok & last)
            acc = tl.where(last, 0.0, acc)
            acc2 = tl.where(last, 0.0, acc2)
        else:
            gate = tl.load(gate_ptr + img * R + c, mask=c_ok, other=0.0)[:, None]
            dpix = tl.load(dpix_ptr + img * R + c, mask=c_ok, other=0.0)[:, None]
            g = v * sg
            dy = (dq * gate + dpix) * (sg + g * (1.0 - sg))  # SiLU'(v) = s (1 + v (1 - s))
            u_hat = x * rstd[:, None] - mr
            if MODE == 1:
                if not EVEN_HW:
                    dy = tl.where(row_ok[None, :], dy, 0.0)
                    g = tl.where(row_ok[None, :], g, 0.0)
                acc_dy += dy
                acc_dyu += dy * u_hat
                acc_w = tl.dot(tl.trans(do), tl.trans((g * gate).to(dt)), acc_w, input_precision=PREC)
            else:
                dd = (a * (dy - sum_dy - u_hat * sum_dyu)).to(dt)
                if EVEN_HW and EVEN_CK:
                    tl.store(a2_ptr + c[:, None] + rows[None, :] * R, dd)
                elif EVEN_HW:
                    tl.store(a2_ptr + c[:, None] + rows[None, :] * R, dd, mask=c_ok[:, None])
                elif EVEN_CK:
                    tl.store(a2_ptr + c[:, None] + rows[None, :] * R, dd, mask=row_ok[None, :])
                else:
                    tl.store(a2_ptr + c[:, None] + rows[None, :] * R, dd,
                             mask=c_ok[:, None] & row_ok[None, :])
    if MODE == 1:
        part = a2_ptr + s * (K + 2) * R
        tl.store(part + k[:, None] * R + c[None, :], acc_w, mask=k_ok[:, None] & c_ok[None, :])
        tl.store(part + K * R + c, tl.sum(acc_dy, axis=1), mask=c_ok)
        tl.store(part + (K + 1) * R + c, tl.sum(acc_dyu, axis=1), mask=c_ok)


@triton.jit
def _merge_kernel(part_ptr, dw_ptr, sum_ptr, sumu_ptr, KR, R, S, BE: tl.constexpr, BS: tl.constexpr):
    """The groups' partials (S, K + 2, R) summed in a fixed order, BS groups per step: rows 0 ... K - 1 to
    dW_proj (K, R), row K to sum dy, row K + 1 to sum dy u_hat."""
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    E = KR + 2 * R
    e_ok = e < E
    sp = tl.arange(0, BS)
    acc = tl.zeros((BE,), dtype=tl.float32)
    for s0 in range(0, S, BS):
        s = s0 + sp
        acc += tl.sum(tl.load(part_ptr + s[:, None] * E + e[None, :], mask=(s < S)[:, None] & e_ok[None, :],
                              other=0.0), axis=0)
    tl.store(dw_ptr + e, acc, mask=e < KR)
    tl.store(sum_ptr + (e - KR), acc, mask=(e >= KR) & (e < KR + R))
    tl.store(sumu_ptr + (e - KR - R), acc, mask=(e >= KR + R) & e_ok)


# ---------------------------------------------------------------------------------------------- launchers


def _check(op: str, d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, n, gate=None, dpix=None, sums=()) -> None:
    """Shapes, dtypes, devices and contiguity, before any launch (one ValueError line)."""
    def bad(msg: str):
        raise ValueError(f"gate_backward.{op}: {msg}")

    if d.dim() != 2 or d.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        bad(f"d must be 2-D (P, R) fp32/fp16/bf16, got {tuple(d.shape)} {d.dtype}")
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
    for name, t in (("mean_d", mean_d), ("rstd_d", rstd_d), *(("sums", s) for s in sums)):
        if tuple(t.shape) != (r,) or t.dtype != torch.float32:
            bad(f"{name} must be ({r},) fp32, got {tuple(t.shape)} {t.dtype}")
    for name, t in (("gamma_d", gamma_d), ("beta_d", beta_d)):
        if tuple(t.shape) != (r,) or t.dtype not in (torch.float32, d.dtype):
            bad(f"{name} must be ({r},) fp32 or {d.dtype}, got {tuple(t.shape)} {t.dtype}")
    for name, t in (("gate", gate), ("dpix", dpix)):
        if t is not None and (tuple(t.shape) != (n, r) or t.dtype != torch.float32):
            bad(f"{name} must be ({n}, {r}) fp32, got {tuple(t.shape)} {t.dtype}")
    ts = [d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, *(t for t in (gate, dpix) if t is not None), *sums]
    if any(t.device != d.device for t in ts):
        bad("all tensors must be on d's device")
    if not all(t.is_contiguous() for t in ts):
        bad("every tensor must be contiguous (row-major)")


def _geometry(d: torch.Tensor, n: int, mode: int) -> tuple[int, int, int, int, int]:
    """(channels per chunk, chunks, groups, images per group, tiles per image) of MODE's grid: about one
    program per SM (each program loads its W_proj slice once), at least MIN_IMAGES images per group."""
    p, r = d.shape
    rb = (RB_FP32 if d.dtype == torch.float32 else RB)[mode]
    chunks = triton.cdiv(r, rb)
    want = max(1, device_info(d.device).sms // chunks)
    ipg = max(min(MIN_IMAGES, n), triton.cdiv(n, want))
    return rb, chunks, triton.cdiv(n, ipg), ipg, triton.cdiv(p // n, BM)


def _launch(mode: int, d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, gate, dpix, a0, a1, a2, n,
            geo) -> None:
    """MODE's launch; a0, a1, a2: MODE 0 dgate, gsum, (unused); MODE 1 (unused) x 2, the partials;
    MODE 2 sum dy, sum dy u_hat, dd."""
    p, r = d.shape
    kk = do.shape[1]
    hw = p // n
    rb, chunks, groups, ipg, _ = geo
    silu, prec = kernel_settings(d)
    bk = max(16, triton.next_power_of_2(kk))
    launch(_gate_backward_kernel, (chunks, groups), d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, gate,
           dpix, a0, a1, a2, n, r, kk, ipg, 1.0 / p,
           cost=lambda: _cost(mode, p, r, kk, n, geo, d.element_size()),
           HW=hw, MODE=mode, RB=rb, BM=BM, BK=bk, EVEN_HW=hw % BM == 0, EVEN_CK=r % rb == 0 and kk == bk,
           FAST=silu, PREC=prec, num_warps=WARPS,
           num_stages=STAGES_FP32 if d.dtype == torch.float32 else STAGES)


def dgate_pool(d: torch.Tensor, mean_d: torch.Tensor, rstd_d: torch.Tensor, gamma_d: torch.Tensor,
               beta_d: torch.Tensor, do: torch.Tensor, w_proj: torch.Tensor, n: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, gsum), both (N, R) fp32: per image, sum over its pixels of dq g and of g."""
    _check("dgate_pool", d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, n)
    r = d.shape[1]
    dgate = torch.empty((n, r), device=d.device, dtype=torch.float32)
    gsum = torch.empty((n, r), device=d.device, dtype=torch.float32)
    _launch(0, d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, mean_d, mean_d, dgate, gsum, dgate, n,
            _geometry(d, n, 0))
    return dgate, gsum


def bn_d_sums(d: torch.Tensor, mean_d: torch.Tensor, rstd_d: torch.Tensor, gamma_d: torch.Tensor,
              beta_d: torch.Tensor, do: torch.Tensor, w_proj: torch.Tensor, gate: torch.Tensor,
              dpix: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum dy (R,), sum dy u_hat (R,), dW_proj (K, R)), fp32: views of one (K + 2, R) buffer."""
    _check("bn_d_sums", d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, n, gate, dpix)
    r, kk = d.shape[1], do.shape[1]
    geo = _geometry(d, n, 1)
    groups = geo[2]
    part = torch.empty((groups, kk + 2, r), device=d.device, dtype=torch.float32)
    dw = torch.empty((kk, r), device=d.device, dtype=torch.float32)
    sum_dy = torch.empty((r,), device=d.device, dtype=torch.float32)
    sum_dyu = torch.empty((r,), device=d.device, dtype=torch.float32)
    _launch(1, d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, gate, dpix, mean_d, mean_d, part, n, geo)
    e = (kk + 2) * r
    steps = triton.cdiv(groups, MERGE_GROUPS)
    launch(_merge_kernel, (triton.cdiv(e, MERGE_BLOCK),), part, dw, sum_dy, sum_dyu, kk * r, r, groups,
           cost=lambda: KernelCost(0, 0, e * 4, (Loop("groups", steps),), l2_bytes=groups * e * 4,
                                   l2_footprint_bytes=groups * e * 4,
                                   note="BN_d sums, dW_proj: the groups' partials summed in a fixed order"),
           BE=MERGE_BLOCK, BS=MERGE_GROUPS, num_warps=4)
    return sum_dy, sum_dyu, dw


def bn_d_backward(d: torch.Tensor, mean_d: torch.Tensor, rstd_d: torch.Tensor, gamma_d: torch.Tensor,
                  beta_d: torch.Tensor, do: torch.Tensor, w_proj: torch.Tensor, gate: torch.Tensor,
                  dpix: torch.Tensor, sum_dy: torch.Tensor, sum_dy_uhat: torch.Tensor, n: int
                  ) -> torch.Tensor:
    """dd (P, R) in d's dtype."""
    _check("bn_d_backward", d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, n, gate, dpix,
           (sum_dy, sum_dy_uhat))
    dd = torch.empty_like(d)
    _launch(2, d, mean_d, rstd_d, gamma_d, beta_d, do, w_proj, gate, dpix, sum_dy, sum_dy_uhat, dd, n,
            _geometry(d, n, 2))
    return dd


def _cost(mode: int, p: int, r: int, kk: int, n: int, geo, eb: int) -> KernelCost:
    """d, do, W_proj, the statistics and two (N, R) fp32 tensors (written by MODE 0, gate and dpix read by
    the others) once from DRAM; do's re-reads by the other chunks' programs (adjacent in the grid), the
    W_proj slices' by the other groups and gate/dpix rows' per tile from L2; MODE 1 writes its partials,
    MODE 2 dd. The dots as issued: BM x BK x RB per tile (the masked pixels of an image's last tile and
    K's padding included), MODE 1 a second one of BK x RB x BM. Useful: dq once (MODE 0) and dW_proj
    (MODE 1); the other dq's are recomputed."""
    rb, chunks, groups, ipg, tpi = geo
    bk = max(16, triton.next_power_of_2(kk))
    tiles = n * tpi
    mma = chunks * tiles * BM * bk * rb * (2 if mode == 1 else 1)
    useful = p * kk * r if mode < 2 else 0
    dram = (p * r + p * kk + kk * r) * eb + 4 * r * 4 + 2 * n * r * 4
    l2 = (chunks - 1) * p * kk * eb + (groups - 1) * kk * r * eb
    if mode:
        l2 += 2 * (tiles - n) * r * 4
    if mode == 1:
        dram += groups * (kk + 2) * r * 4
    if mode == 2:
        dram += p * r * eb + 2 * r * 4
    notes = ("SE backward: per image sum dq g and sum g", "BN_d backward sums and dW_proj partials",
             "BN_d backward: dd written")
    return KernelCost(useful, mma, dram, (Loop("pixel tiles", ipg * tpi),), l2_bytes=l2, note=notes[mode])
