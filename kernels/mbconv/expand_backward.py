"""The expand passes of the fused MBConv training backward (backward_reference.py states each one), over
the block's narrow input x (P, C) with z = x W_exp^T (K = C) recomputed on the tensor cores:

* ``expand_hidden``: h = SiLU(gamma_e e_hat + beta_e), e_hat = (z - mu_e) rho_e, written (P, R);
* ``bn_e_sums``: dv = dh SiLU'(v_e); per channel sum dv and sum dv e_hat (a partials launch + merge);
* ``bn_e_backward``: de = gamma_e rho_e (dv - sum dv / P - e_hat sum(dv e_hat) / P) written in x's dtype,
  and dW_exp = de^T x from de as rounded (a partials launch + merge);
* ``expand_dgrad``: dx = de W_exp (+ the residual), a GEMM over pixel tiles (K = R).

The first three are one kernel, ``_expand_kernel``, in three modes. Grid: (hidden chunks of RB channels,
pixel splits); program (j, s) loads its chunk's W_exp rows [RB, C] once, before its loop, and walks the
pixel tiles (BM rows) of split s: z = x_tile W^T (fp32 accumulation), then the mode's epilogue. The
programs of one split are adjacent in the grid, so x's tiles are read from DRAM once and re-read by the
other chunks from L2. Per-split partials (fp32, their own rows) are summed over the splits in a fixed
order by the weight gradients' reduction (gconv.launcher.reduce_partials): no atomics, two identical
calls give equal results.

Splits: whole pixel tiles (narrow._splits), about as many as fill the GPU's SMs with the chunks (twice as
many where two programs share an SM).

Tiles (``TILES``, ``DGRAD_TILES``; 8 warps each but the sums mode's 16). At Small's C = 256, R = 1024 in
16-bit, compiled for sm_90: the h and sums modes 8 chunks x 16 splits of 64-pixel tiles, W's chunk 64 KB of
shared memory (176 KB in all), 127 and 128 registers. The sums mode's four warpgroups each own 32 of the
chunk's 128 channels: each warp's epilogue is half that of the 8-warp form (254 registers), which takes the
static estimate at 16x16 from 35.2 / 40.7 to 29.9 / 35.1 us (low / high; DRAM 25.2 / 31.2) and at 8x8 from
10.6 / 12.3 to 9.4 / 12.4 (L2-bound). At 16x16 the h mode runs two programs per SM (``PAIRED``: 8 x 32
programs, one pipeline stage, 96 KB, at most 128 registers: 127) so that one program's dots run while the
other's epilogue does (static estimate at the high end 38 -> 35 us, now L2-bound: x re-read by the 8
chunks); the de mode 16 chunks x 8 splits of 128-pixel tiles, 255 registers and no stack because its
per-channel vectors are folded to four (v = z A + B, de = A dv + z D1 + D0; each thread holds 16 channels of
each over the loop); expand_dgrad 244 registers, 128-pixel tiles at 8x8 too (64 programs: see
``DGRAD_TILES``). The sums and de modes stay one program per SM: capped at 128 registers with 8 warps they
spill in the loop (sums with its per-tile sums reduced in the tile: 240 B of stack; de with 64 x 64 tiles:
376 B), and the de mode's dW_exp^T partial [C, RB] needs RB = 64 to stay in registers at all. The de mode
does not take 16 warps: its z feeds the dW_exp dot, and for such chained dots Triton puts every warp along
M, so 16 warps over 128 pixels compute the z dot twice and spill (424 B of stack); 256-pixel tiles leave
room for one pipeline stage and spill too (384 B). Its two dots wait for their results right after they
are issued (wgmma wait 0: de reaches the second one through an unbuffered shared-memory copy), so they do
not overlap its epilogue. fp32 (3xTF32: each operand split in two parts in registers, the whole C = 256 row
per tile) takes smaller tiles that fit the shared memory and spills (440 to 1568 B of stack): correct, not
fast; a K loop over C would be its fix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._activations import sigmoid, silu
from .._cost import KernelCost, Loop
from .._launch import FLOAT_DTYPES, cdiv, device_info, launch, next_power_of_2
from .._scalars import fp32
from ..gconv.launcher import reduce_partials
from .launcher import MAX_C, kernel_settings
from .narrow import _splits

MODE_H, MODE_SUMS, MODE_DE = 0, 1, 2
# (RB hidden channels, BM pixels, warps, pipeline stages) of the expand kernel by mode and element size.
# 16-bit: h and sums RB = 128 x BM = 64, 3 stages (sums on 16 warps: module docstring); de RB = 64 (its
# dW_exp^T partial [C, RB] fp32 stays in registers) x BM = 128 (the z dot's M is 64 per warpgroup; the
# dW_exp dot's K), 2 stages (x tiles of 64 KB). fp32 (3xTF32 keeps each operand as two parts): the tiles
# that fit the shared memory, one stage; they spill (see the module docstring).
TILES = {(MODE_H, 2): (128, 64, 8, 3), (MODE_SUMS, 2): (128, 64, 16, 3), (MODE_DE, 2): (64, 128, 8, 2),
         (MODE_H, 4): (64, 64, 8, 1), (MODE_SUMS, 4): (64, 64, 8, 1), (MODE_DE, 4): (32, 64, 8, 1)}
# expand_dgrad by element size: (pixel tile, K step, warps). Not halved where it leaves SMs idle (Small at
# 8x8: 64 programs): each program reads all of W_exp (512 KB) from L2, and at 64-pixel tiles those re-reads
# (64 MB) would outweigh de (16 MB): static estimate 15.5 us (L2-bound) at 64 against 12.5 at 128 pixels.
DGRAD_TILES = {2: (128, 32, 8), 4: (64, 32, 8)}
# Modes whose programs fit two per SM with one pipeline stage (h in 16-bit: 128 registers, 96 KB of shared
# memory; the sums mode (16 warps) and the de mode (255 registers) do not): with twice the splits, each
# program's serial chain (its epilogues and the waits for its own dots) is half as long while the other
# program's dots run. Taken where every split keeps >= PAIRED_MIN_TILES tiles (the chunk of W_exp that each
# program loads stays small next to its x tiles): at 16x16, not at 8x8.
PAIRED = {(MODE_H, 2)}
PAIRED_MIN_TILES = 8
REGISTERS = 65536  # per SM (sm_80, sm_90): two programs of 8 warps take at most 128 registers a thread
SUM_COLUMNS = 256  # columns per program of the split merge
SUM_SPLITS = 8  # splits per step of the split merge


@triton.jit
def _expand_kernel(x_ptr, w_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, dh_ptr, sdv_ptr, sdve_ptr, out_ptr,
                   part_ptr,
                   P, C, R, CH, inv_p, MODE: tl.constexpr, RB: tl.constexpr, CP: tl.constexpr,
                   BM: tl.constexpr, EVEN_R: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr):
    """Program (j, s): hidden channels j RB ... j RB + RB - 1 over the pixels of split s.
    MODE 0: h -> out. MODE 1: part[s, 0, r] = sum dv, part[s, 1, r] = sum dv e_hat. MODE 2: de -> out,
    part[s] = de^T x [R, C] for the chunk's rows (``sdv``, ``sdve``: sum dv and sum dv e_hat)."""
    inv_p = fp32(inv_p)  # torch.compile passes floats as fp64 (_scalars.py)
    dt = x_ptr.dtype.element_ty
    j = tl.program_id(0)
    s = tl.program_id(1)
    r = j * RB + tl.arange(0, RB)
    r_ok = r < R
    c = tl.arange(0, CP)
    c_ok = c < C
    w = tl.load(w_ptr + r[:, None] * C + c[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
    wt = tl.trans(w)  # [CP, RB], loop-invariant
    mean = tl.load(mean_ptr + r, mask=r_ok, other=0.0)
    rstd = tl.load(rstd_ptr + r, mask=r_ok, other=0.0)
    gamma = tl.load(gamma_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    # per-channel vectors folded, so fewer of them stay in registers over the loop (each thread holds 16
    # channels of each): v = z A + B; in mode 2, de = A dv - A sum dv / P - e_hat A sum(dv e_hat) / P
    # = A dv + z D1 + D0
    a = gamma * rstd
    b = beta - a * mean
    if MODE == 2:
        t = -a * (tl.load(sdve_ptr + r, mask=r_ok, other=0.0) * inv_p)  # the e_hat coefficient
        d1 = t * rstd
        d0 = -a * (tl.load(sdv_ptr + r, mask=r_ok, other=0.0) * inv_p) - d1 * mean
        dwt = tl.zeros((CP, RB), dtype=tl.float32)  # dW_exp^T: the wgmma's M is C
    if MODE == 1:  # elementwise partial sums, reduced over the rows once, after the loop
        s1 = tl.zeros((BM, RB), dtype=tl.float32)
        s2 = tl.zeros((BM, RB), dtype=tl.float32)
    start = s * CH
    end = tl.minimum(start + CH, P)
    for m0 in range(start, end, BM):
        m = m0 + tl.arange(0, BM)
        m_ok = m < end
        xt = tl.load(x_ptr + m[:, None] * C + c[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
        z = tl.dot(xt, wt, input_precision=PREC)  # [BM, RB] fp32
        v = z * a[None, :] + b[None, :]
        if EVEN_R:  # R a multiple of RB: row masks only (fewer predicate registers)
            ok = m_ok[:, None]
        else:
            ok = m_ok[:, None] & r_ok[None, :]
        if MODE == 0:
            tl.store(out_ptr + m[:, None] * R + r[None, :], silu(v, FAST).to(dt), mask=ok)
        else:
            dh = tl.load(dh_ptr + m[:, None] * R + r[None, :], mask=ok, other=0.0).to(tl.float32)
            sg = sigmoid(v, FAST)
            dv = dh * (sg * (1.0 + v * (1.0 - sg)))  # SiLU'(v); 0 on masked rows (dh = 0)
            if MODE == 1:
                s1 += dv
                s2 += dv * ((z - mean[None, :]) * rstd[None, :])
            else:
                de = tl.where(m_ok[:, None], a[None, :] * dv + (z * d1[None, :] + d0[None, :]), 0.0).to(dt)
                tl.store(out_ptr + m[:, None] * R + r[None, :], de, mask=ok)
                dwt = tl.dot(tl.trans(xt), de, dwt, input_precision=PREC)
    if MODE == 1:
        tl.store(part_ptr + s * 2 * R + r, tl.sum(s1, axis=0), mask=r_ok)
        tl.store(part_ptr + s * 2 * R + R + r, tl.sum(s2, axis=0), mask=r_ok)
    if MODE == 2:
        tl.store(part_ptr + s * R * C + r[None, :] * C + c[:, None], dwt, mask=r_ok[None, :] & c_ok[:, None])


@triton.jit
def _dgrad_kernel(de_ptr, w_ptr, res_ptr, dx_ptr, P, C, R, RESIDUAL: tl.constexpr, BM: tl.constexpr,
                  CP: tl.constexpr, RS: tl.constexpr, PREC: tl.constexpr):
    """Pixel tile i: dx = de W_exp (+ residual), RS hidden channels per K step, one rounding."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < P
    c = tl.arange(0, CP)
    c_ok = c < C
    acc = tl.zeros((BM, CP), dtype=tl.float32)
    for r0 in range(0, R, RS):
        r = r0 + tl.arange(0, RS)
        r_ok = r < R
        de = tl.load(de_ptr + m[:, None] * R + r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        w = tl.load(w_ptr + r[:, None] * C + c[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        acc = tl.dot(de, w, acc, input_precision=PREC)
    ok = m_ok[:, None] & c_ok[None, :]
    if RESIDUAL:
        acc += tl.load(res_ptr + m[:, None] * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(dx_ptr + m[:, None] * C + c[None, :], acc.to(dx_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------ checks


def _check(op: str, name: str, t, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, the input on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (row-major), got strides {t.stride()}")


def _check_expand(op: str, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh=None) -> tuple[int, int, int]:
    """(P, C, R) after checking every argument of the expand kernel's modes."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a 2-D (P, C) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: x has dtype {x.dtype}, expected float32, float16 or bfloat16")
    p, c = x.shape
    if not isinstance(w_exp, torch.Tensor) or w_exp.dim() != 2:
        raise ValueError(f"{op}: w_exp must be a 2-D (R, C) tensor")
    r = w_exp.shape[0]
    dev = x.device
    _check(op, "x", x, (p, c), (x.dtype,), dev)
    _check(op, "w_exp", w_exp, (r, c), (x.dtype,), dev)
    for name, t in (("mean_e", mean_e), ("rstd_e", rstd_e)):
        _check(op, name, t, (r,), (torch.float32,), dev)
    for name, t in (("gamma_e", gamma_e), ("beta_e", beta_e)):
        _check(op, name, t, (r,), tuple(dict.fromkeys((torch.float32, x.dtype))), dev)
    if dh is not None:
        _check(op, "dh", dh, (p, r), (x.dtype,), dev)
    _check_sizes(op, p, c, r)
    return p, c, r


def _check_sizes(op: str, p: int, c: int, r: int) -> None:
    if p < 1 or c < 1 or r < 1:
        raise ValueError(f"{op}: empty operands (P, C, R) = {(p, c, r)}")
    if c > MAX_C:  # a whole row of x (and W_exp's chunk) is one tile in shared memory
        raise ValueError(f"{op}: C = {c} channels, the kernels take at most {MAX_C}")
    if p * max(r, c) >= 2**31:
        raise ValueError(f"{op}: P x max(R, C) = {p * max(r, c)} elements exceed 32-bit offsets")


# ------------------------------------------------------------------------------------------ launches


def _expand_launch(mode: int, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh, sdv, sdve, out, part, splits,
                   ch, paired):
    rb, bm, warps, stages = TILES[mode, _size(x)]
    p, c = x.shape
    r = w_exp.shape[0]
    fast, prec = kernel_settings(x)
    nchunk = cdiv(r, rb)
    cp = max(16, next_power_of_2(c))
    dh_arg = dh if dh is not None else x
    launch(_expand_kernel, (nchunk, splits), x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh_arg, sdv, sdve,
           out, part, p, c, r, ch, 1.0 / p,
           cost=lambda: _expand_cost(mode, p, c, r, rb, cp, bm, splits, ch, x.element_size(),
                                     gamma_e.element_size()),
           MODE=mode, RB=rb, CP=cp, BM=bm, EVEN_R=r % rb == 0, FAST=fast, PREC=prec, num_warps=warps,
           **({"num_stages": 1, "maxnreg": REGISTERS // (64 * warps)} if paired else {"num_stages": stages}))


def _expand_cost(mode: int, p: int, c: int, r: int, rb: int, cp: int, bm: int, splits: int, ch: int,
                 eb: int, gb: int) -> KernelCost:
    """x read from DRAM once, re-read from L2 by the other chunks' programs of its split (adjacent in the
    grid); W_exp and the per-channel vectors once; dh read once and h or de written once; the partials
    written. The dots as issued: BM x RB x CP per tile (z), plus RB x CP x BM (dW_exp) in mode 2. MACs
    of the block's math: the recompute of z counts nothing (the forward counted it), dW_exp P R C."""
    nchunk = cdiv(r, rb)
    tiles = splits * cdiv(ch, bm)  # tiles as issued (the last split's short tail masked)
    z = nchunk * tiles * bm * rb * cp
    vectors = r * (2 * 4 + 2 * gb)
    dram = p * c * eb + r * c * eb + vectors
    if mode == MODE_H:
        dram += p * r * eb
        note = "h = SiLU(BN_e(x W_exp^T)) recomputed for the conv's backward"
    elif mode == MODE_SUMS:
        dram += p * r * eb + splits * 2 * r * 4
        note = "BN_e backward sums (z recomputed), partials per pixel split"
    else:
        dram += 2 * p * r * eb + 2 * r * 4 + splits * r * c * 4
        note = "de = BN_e backward (z recomputed), dW_exp partials per pixel split"
    return KernelCost(p * r * c if mode == MODE_DE else 0, z * (2 if mode == MODE_DE else 1), dram,
                      (Loop("pixel tiles", cdiv(ch, bm)),),
                      l2_bytes=(nchunk - 1) * p * c * eb, note=note)


def _split_sum(part: torch.Tensor, out: torch.Tensor, what: str, out2: torch.Tensor | None = None):
    """out = part (S, L) summed over its rows in a fixed order (one launch; the partials were just
    written, read from L2); with out2, its first out.numel() columns go to out and the rest to out2."""
    reduce_partials(part, out, part.shape[0], part.shape[1], block=SUM_COLUMNS, sb=SUM_SPLITS, out2=out2,
                    partials_in_l2=True, what=f"fixed-order merge of {what}")
    return out


def _size(x: torch.Tensor) -> int:
    return 4 if x.element_size() == 4 else 2


def _expand_splits(mode: int, x: torch.Tensor, r: int) -> tuple[int, int, bool]:
    """(splits, pixels per split, whether two programs share an SM: ``PAIRED``)."""
    rb, bm = TILES[mode, _size(x)][:2]
    per_sm = max(1, device_info(x.device).sms // cdiv(r, rb))
    paired = (mode, _size(x)) in PAIRED and cdiv(x.shape[0], bm) >= 2 * per_sm * PAIRED_MIN_TILES
    return (*_splits(x.shape[0], bm, 2 * per_sm if paired else per_sm), paired)


def expand_hidden(x: torch.Tensor, w_exp: torch.Tensor, mean_e: torch.Tensor, rstd_e: torch.Tensor,
                  gamma_e: torch.Tensor, beta_e: torch.Tensor) -> torch.Tensor:
    """h = SiLU(gamma_e (x W_exp^T - mean_e) rstd_e + beta_e), (P, R) in x's dtype."""
    p, _c, r = _check_expand("expand_hidden", x, w_exp, mean_e, rstd_e, gamma_e, beta_e)
    h = torch.empty((p, r), device=x.device, dtype=x.dtype)
    splits, ch, paired = _expand_splits(MODE_H, x, r)
    _expand_launch(MODE_H, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, None, mean_e, mean_e, h, h, splits, ch,
                   paired)
    return h


def bn_e_sums(x: torch.Tensor, w_exp: torch.Tensor, mean_e: torch.Tensor, rstd_e: torch.Tensor,
              gamma_e: torch.Tensor, beta_e: torch.Tensor, dh: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum dv (R,), sum dv e_hat (R,)) fp32, dv = dh SiLU'(v_e): partials per pixel split, then merged."""
    _p, _c, r = _check_expand("bn_e_sums", x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh)
    splits, ch, paired = _expand_splits(MODE_SUMS, x, r)
    part = torch.empty((splits, 2 * r), device=x.device, dtype=torch.float32)
    _expand_launch(MODE_SUMS, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh, mean_e, mean_e, x, part, splits,
                   ch, paired)
    sum_dv, sum_dve = (torch.empty((r,), device=x.device, dtype=torch.float32) for _ in range(2))
    _split_sum(part, sum_dv, "BN_e's sums", sum_dve)  # two tensors of their own (the op's outputs)
    return sum_dv, sum_dve


def bn_e_backward(x: torch.Tensor, w_exp: torch.Tensor, mean_e: torch.Tensor, rstd_e: torch.Tensor,
                  gamma_e: torch.Tensor, beta_e: torch.Tensor, dh: torch.Tensor, sum_dv: torch.Tensor,
                  sum_dv_ehat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(de (P, R) in x's dtype, dW_exp = de^T x (R, C) fp32 from de as rounded): one pass over dh, the
    dW_exp partials per pixel split merged in a fixed order."""
    op = "bn_e_backward"
    p, c, r = _check_expand(op, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh)
    _check(op, "sum_dv", sum_dv, (r,), (torch.float32,), x.device)
    _check(op, "sum_dv_ehat", sum_dv_ehat, (r,), (torch.float32,), x.device)
    splits, ch, paired = _expand_splits(MODE_DE, x, r)
    de = torch.empty((p, r), device=x.device, dtype=x.dtype)
    part = torch.empty((splits, r * c), device=x.device, dtype=torch.float32)
    _expand_launch(MODE_DE, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh, sum_dv, sum_dv_ehat, de, part,
                   splits, ch, paired)
    dw = _split_sum(part, torch.empty((r, c), device=x.device, dtype=torch.float32), "dW_exp's partials")
    return de, dw


def expand_dgrad(de: torch.Tensor, w_exp: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """dx = de W_exp (+ residual), (P, C) in de's dtype; one rounding."""
    op = "expand_dgrad"
    if not isinstance(de, torch.Tensor) or de.dim() != 2:
        raise ValueError(f"{op}: de must be a 2-D (P, R) tensor")
    if de.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: de has dtype {de.dtype}, expected float32, float16 or bfloat16")
    if not isinstance(w_exp, torch.Tensor) or w_exp.dim() != 2:
        raise ValueError(f"{op}: w_exp must be a 2-D (R, C) tensor")
    p, r = de.shape
    c = w_exp.shape[1]
    _check(op, "de", de, (p, r), (de.dtype,), de.device)
    _check(op, "w_exp", w_exp, (r, c), (de.dtype,), de.device)
    if residual is not None:
        _check(op, "residual", residual, (p, c), (de.dtype,), de.device)
    _check_sizes(op, p, c, r)
    dx = torch.empty((p, c), device=de.device, dtype=de.dtype)
    _, prec = kernel_settings(de)
    cp = max(16, next_power_of_2(c))
    bm, rs, warps = DGRAD_TILES[_size(de)]
    tiles = cdiv(p, bm)
    eb = de.element_size()
    launch(_dgrad_kernel, (tiles,), de, w_exp, residual if residual is not None else dx, dx, p, c, r,
           cost=lambda: KernelCost(p * r * c, tiles * bm * cp * cdiv(r, rs) * rs,
                                   p * r * eb + r * c * eb + p * c * eb * (2 if residual is not None else 1),
                                   (Loop("hidden steps", cdiv(r, rs)),),
                                   l2_bytes=(tiles - 1) * r * c * eb,
                                   note="dx = de W_exp (+ residual)"),
           RESIDUAL=residual is not None, BM=bm, CP=cp, RS=rs, PREC=prec, num_warps=warps)
    return dx
