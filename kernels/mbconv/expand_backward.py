"""The expand passes of the fused MBConv training backward (backward_reference.py states each one), over
the block's narrow input x (P, C) with z = x W_exp^T (K = C) recomputed on the tensor cores:

* ``expand_hidden``: h = SiLU(gamma_e e_hat + beta_e), e_hat = (z - mu_e) rho_e, written (P, R) (the
  backward's recompute; ``expand_forward``, the same launch, for the forwards, whose cost declaration
  counts the expand's MACs);
* ``bn_e_weights``: dv = dh SiLU'(v_e); one pass accumulates D = dv^T x and sum dv per pixel split, then
  one small launch (``_bn_e_finalize_kernel``) merges the splits in a fixed order and forms BN_e's
  dgamma = sum dv e_hat = rho_e (rowsum(W_exp * D) - mu_e sum dv), dbeta = sum dv, dW_exp = de^T x and the
  dx pass's terms:
      de = k dv + u + w (z - mu_e),  k = gamma_e rho_e,  u = -k sum dv / P,  w = -k rho_e dgamma / P
      de^T x = k D + P u mean(x)^T + w (W_exp G + P (W_exp mean(x) - mu_e) mean(x)^T)
  with G x's Gram matrix centred at its mean: the forward's BN_e statistics launch computes W_exp G and saves
  it with mean(x) (moments.bn_e_stats; R C + C fp32 values per block);
* ``bn_e_dx``: dx = de W_exp (+ the residual), de recomputed per pixel tile from x and dh, hidden chunk by
  hidden chunk, and rounded to x's dtype as a layer-wise backward rounds it: de is never written.

So dh is read twice and de never goes to DRAM: the passes before this form (sums; de written, dW_exp from it;
dx = de W_exp read back) read dh twice and wrote and read de, at Small's 16x16 training map 64 MB each way.

``_expand_kernel`` runs the first two passes (``MODE``). Grid: (hidden chunks of RB channels, pixel splits);
program (j, s) loads its chunk's W_exp rows [RB, C] once, before its loop, and walks the pixel tiles (BM
rows) of split s: z = x_tile W^T (fp32 accumulation), then the mode's epilogue. The programs of one split are
adjacent in the grid, so x's tiles are read from DRAM once and re-read by the other chunks from L2.
Per-split partials (fp32, their own rows) are summed over the splits in split order (no atomics: two
identical calls give equal results). dv is rounded to x's dtype for D (the tensor cores' operand) and for
sum dv alike, so that the two agree in dgamma's difference. Splits: whole pixel tiles (narrow._splits), about
as many as fill the GPU's SMs with the chunks.

Tiles (``TILES``, ``DX_TILES``, ``FINALIZE``), compiled for sm_90 at Small's C = 256, R = 1024 in 16-bit
(static estimate at batch 128, 16x16, low-high us):
* h: 8 chunks of RB = 128 x 16 splits of 64-pixel tiles, 4 warps, 3 pipeline stages, 243 registers, 168
  KB of shared memory, one program per SM. 43-49 (8x8: 12-14); sm_80 90-91. Each chunk's programs re-read
  x from L2, so half as many chunks as at RB = 64 take the L2 traffic from 352 to 218 MB (8x8: 100 to 67).
  RB = 64 (128 registers, 136 KB): 48-54 (8x8: 14-16; sm_80 120). The 8-warp tile of RB = 128 took 65-75
  (3 stages) and 78-97 with two programs per SM (one stage, registers capped at 128); RB = 256 does not
  fit one SM (255 registers and 240 KB at 3 stages).
* weights pass: 32 chunks of RB = 32 x 4 splits of 64-pixel tiles, 4 warps, 3 pipeline stages (x tiles
  in flight), 203 registers (EXPAND_MAXNREG), one program per SM (its shared memory). 90-102 (8x8:
  24-28). Two stages let two programs share an SM (168 registers) but left the z dot's loads exposed:
  122-151 (8x8: 32-40).
  RB = 64 on 8 warps (the de pass's tile) took 251 registers: 132-160; RB = 64 on 4 warps spilled 40 B.
* merge and terms: 64 programs of 16 hidden rows, 4 warps, 135 registers. 3-4 (the ConvFirst FFN's
  finalize, forming W_exp G itself from G on the tensor cores, took 18-21 plus a merge launch of 4-5).
* dx: 64-pixel tiles, 32 hidden channels per step, 4 warps, 253 registers, two programs per SM. 85-94;
  128-pixel tiles of 64 channels on 8 warps spilled 24 B (255 registers) and took 108-121.
Against the passes before (sums 116-136, de 128-157, dgrad 32-39 us and two merges) the three launches took
193-215 (now 178-200) against 282-340 us at 16x16; the block's backward 88-125 us less at 16x16, 31-43 at 8x8.
fp32 (3xTF32: each operand split in two parts in registers, the whole C = 256 row per tile) takes smaller
tiles that fit the shared memory and spills: correct, not fast; a K loop over C would be its fix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._activations import sigmoid, silu
from .._cost import KernelCost, Loop
from .._launch import FLOAT_DTYPES, MAXNREG, cdiv, device_info, launch, next_power_of_2
from .launcher import MAX_C, kernel_settings
from .narrow import _splits

MODE_H, MODE_D = 0, 1
# (RB hidden channels, BM pixels, warps, pipeline stages) of the expand kernel by mode and element size.
# 16-bit: h RB = 128 x BM = 64 on one warpgroup, 3 stages; the weights mode RB = 32 (its D^T partial
# [C, RB] fp32 stays in registers) x BM = 64 on one warpgroup, 3 stages (module docstring).
# fp32 (3xTF32 keeps each operand as two parts): the tiles that fit the shared memory, one stage; they spill
# (see the module docstring).
TILES = {(MODE_H, 2): (128, 64, 4, 3), (MODE_D, 2): (32, 64, 4, 3),
         (MODE_H, 4): (64, 64, 8, 1), (MODE_D, 4): (32, 64, 8, 1)}
# The 16-bit expand kernel's register limit. Left to ptxas (Triton 3.8, sm_90), the weights pass took 171
# registers and the 32x32 h pass 178 (one program per SM either way: its shared memory); at 255 they take
# 203 and 244, and the SASS waits less on the z dot's loads. Static estimate, batch 128, high end: the
# weights pass 117.2 -> 101.7 us at 16x16, 31.4 -> 27.5 at 8x8; Small's 36 MBConv training blocks 5.13 ->
# 4.78 ms (Triton 3.6 4.95 -> 4.83, sm_80 13.05 -> 13.02), no stack.
EXPAND_MAXNREG = MAXNREG
# bn_e_dx by element size: (pixel tile, hidden channels per step, warps).
DX_TILES = {2: (64, 32, 4), 4: (64, 16, 4)}
# The finalize launch (merge of the weights pass's partials and BN_e's terms): (hidden rows per program,
# warps). Two warps (was 4): Small's 36 training blocks 0.139 -> 0.105 ms (static, sm_90, high end), no
# stack on sm_90, sm_80, Triton 3.6 or 3.8.
FINALIZE = (16, 2)


@triton.jit
def _v_terms(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, r, r_ok):
    """BN_e's affine over z, folded (v = z a + b), and its mean: [RB] each."""
    mean = tl.load(mean_ptr + r, mask=r_ok, other=0.0)
    rstd = tl.load(rstd_ptr + r, mask=r_ok, other=0.0)
    gamma = tl.load(gamma_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    a = gamma * rstd
    return a, beta - a * mean, mean


@triton.jit
def _dv(dh_ptr, v, m, r, ok, R, FAST: tl.constexpr):
    """dv = dh SiLU'(v) in fp32 ([BM, RB]; 0 where dh is masked)."""
    dh = tl.load(dh_ptr + m[:, None] * R + r[None, :], mask=ok, other=0.0).to(tl.float32)
    sg = sigmoid(v, FAST)
    return dh * (sg * (1.0 + v * (1.0 - sg)))


@triton.jit
def _expand_kernel(x_ptr, w_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, dh_ptr, out_ptr, part_ptr,
                   P, C, R, CH, MODE: tl.constexpr, RB: tl.constexpr, CP: tl.constexpr,
                   BM: tl.constexpr, EVEN_R: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr,
                   FOLDED: tl.constexpr):
    """Program (j, s): hidden channels j RB ... j RB + RB - 1 over the pixels of split s.
    MODE 0: h -> out. MODE 1: part[s] = (D = dv^T x [R, C] for the chunk's rows | sum dv [R]), dv rounded to
    x's dtype for both (the tensor cores' operand, and the sums consistent with it). FOLDED (MODE 0, the
    folded inference form): v = z + beta, the other per-channel vectors not read."""
    dt = x_ptr.dtype.element_ty
    j = tl.program_id(0)
    s = tl.program_id(1)
    r = j * RB + tl.arange(0, RB)
    r_ok = r < R
    c = tl.arange(0, CP)
    c_ok = c < C
    w = tl.load(w_ptr + r[:, None] * C + c[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
    wt = tl.trans(w)  # [CP, RB], loop-invariant
    # per-channel vectors folded, so fewer of them stay in registers over the loop: v = z a + b
    if FOLDED:
        a = tl.full((RB,), 1.0, tl.float32)
        b = tl.load(beta_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    else:
        a, b, _mean = _v_terms(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, r, r_ok)
    if MODE == 1:
        dacc = tl.zeros((CP, RB), dtype=tl.float32)  # D^T: the wgmma's M is C
        sdv = tl.zeros((RB,), dtype=tl.float32)
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
            dv = _dv(dh_ptr, v, m, r, ok, R, FAST).to(dt)  # 0 on masked rows (dh = 0)
            sdv += tl.sum(dv.to(tl.float32), axis=0)
            dacc = tl.dot(tl.trans(xt), dv, dacc, input_precision=PREC)
    if MODE == 1:
        base = part_ptr + s * (R * C + R)
        tl.store(base + r[None, :] * C + c[:, None], dacc, mask=r_ok[None, :] & c_ok[:, None])
        tl.store(base + R * C + r, sdv, mask=r_ok)


@triton.jit
def _expand_dx_kernel(x_ptr, w_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, uw_ptr, dh_ptr, res_ptr, dx_ptr,
                      P, C, R, RESIDUAL: tl.constexpr, BM: tl.constexpr, CP: tl.constexpr, RB: tl.constexpr,
                      EVEN_R: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr):
    """Pixel tile i: dx = de W_exp (+ residual), de = a dv + u + w (z - mean) recomputed from x and dh chunk
    by chunk (RB hidden channels per K step) and rounded to x's dtype, as a layer-wise backward rounds it;
    one rounding of dx."""
    dt = x_ptr.dtype.element_ty
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < P
    c = tl.arange(0, CP)
    c_ok = c < C
    xt = tl.load(x_ptr + m[:, None] * C + c[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
    acc = tl.zeros((BM, CP), dtype=tl.float32)
    for r0 in range(0, R, RB):
        r = r0 + tl.arange(0, RB)
        r_ok = r < R
        w = tl.load(w_ptr + r[:, None] * C + c[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        z = tl.dot(xt, tl.trans(w), input_precision=PREC)  # [BM, RB] fp32
        a, b, mean = _v_terms(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, r, r_ok)
        u = tl.load(uw_ptr + r, mask=r_ok, other=0.0)
        wv = tl.load(uw_ptr + R + r, mask=r_ok, other=0.0)
        if EVEN_R:
            ok = m_ok[:, None]
        else:
            ok = m_ok[:, None] & r_ok[None, :]
        dv = _dv(dh_ptr, z * a[None, :] + b[None, :], m, r, ok, R, FAST)
        de = a[None, :] * dv + (z * wv[None, :] + (u - wv * mean)[None, :])
        acc = tl.dot(tl.where(ok, de, 0.0).to(dt), w, acc, input_precision=PREC)
    ok = m_ok[:, None] & c_ok[None, :]
    if RESIDUAL:
        acc += tl.load(res_ptr + m[:, None] * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(dx_ptr + m[:, None] * C + c[None, :], acc.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bn_e_finalize_kernel(part_ptr, w_ptr, wg_ptr, mean_x_ptr, mean_ptr, rstd_ptr, gamma_ptr, dw_ptr,
                          dgamma_ptr, dbeta_ptr, uw_ptr, S, R, C, P, BH: tl.constexpr, CP: tl.constexpr):
    """Program: BH hidden channels. D and sum dv summed over the S splits' partials in split order (fixed:
    no atomics), then dgamma = rho (rowsum(W * D) - mu sum dv), dbeta = sum dv, u, w and dW_exp = k D +
    P u mean(x)^T + w (W G + P (W mean(x) - mu) mean(x)^T) (module docstring), W rounded as the passes
    multiply by it (x's dtype, as stored)."""
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    hok = h < R
    c = tl.arange(0, CP)
    cok = c < C
    msk = hok[:, None] & cok[None, :]
    rows = h[:, None] * C + c[None, :]
    d = tl.zeros((BH, CP), dtype=tl.float32)
    sdv = tl.zeros((BH,), dtype=tl.float32)
    for s in range(0, S):
        base = part_ptr + s * (R * C + R)
        d += tl.load(base + rows, mask=msk, other=0.0)
        sdv += tl.load(base + R * C + h, mask=hok, other=0.0)
    w = tl.load(w_ptr + rows, mask=msk, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + h, mask=hok, other=0.0)
    rstd = tl.load(rstd_ptr + h, mask=hok, other=0.0)
    k = tl.load(gamma_ptr + h, mask=hok, other=0.0).to(tl.float32) * rstd
    sdg = rstd * (tl.sum(w * d, axis=1) - mean * sdv)
    pf = tl.cast(P, tl.float32)
    u = -k * sdv / pf
    wv = -k * rstd * sdg / pf
    mu = tl.load(mean_x_ptr + c, mask=cok, other=0.0)
    wmu = tl.sum(w * mu[None, :], axis=1) - mean
    wg = tl.load(wg_ptr + rows, mask=msk, other=0.0)
    dw = k[:, None] * d + (pf * u[:, None]) * mu[None, :]
    dw += wv[:, None] * (wg + (pf * wmu)[:, None] * mu[None, :])
    tl.store(dw_ptr + rows, dw, mask=msk)
    tl.store(dgamma_ptr + h, sdg, mask=hok)
    tl.store(dbeta_ptr + h, sdv, mask=hok)
    tl.store(uw_ptr + h, u, mask=hok)
    tl.store(uw_ptr + R + h, wv, mask=hok)


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


def _check_expand(op: str, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh=None, folded: bool = False
                  ) -> tuple[int, int, int]:
    """(P, C, R) after checking every argument of the expand kernel's modes (``folded``: the FOLDED
    form's, whose only vector is beta_e = b_exp)."""
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
    if not folded:
        for name, t in (("mean_e", mean_e), ("rstd_e", rstd_e)):
            _check(op, name, t, (r,), (torch.float32,), dev)
    for name, t in ((("b_exp", beta_e),) if folded else (("gamma_e", gamma_e), ("beta_e", beta_e))):
        _check(op, name, t, (r,), tuple(dict.fromkeys((torch.float32, x.dtype))), dev)
    if dh is not None:
        _check(op, "dh", dh, (p, r), (x.dtype,), dev)
    _check_sizes(op, p, c, r)
    return p, c, r


def offsets_fit(p: int, c: int, r: int) -> bool:
    """Whether the (P, C) and (P, R) operands take the expand kernel's 32-bit offsets."""
    return p * max(r, c) < 2**31


def _check_sizes(op: str, p: int, c: int, r: int) -> None:
    if p < 1 or c < 1 or r < 1:
        raise ValueError(f"{op}: empty operands (P, C, R) = {(p, c, r)}")
    if c > MAX_C:  # a whole row of x (and W_exp's chunk) is one tile in shared memory
        raise ValueError(f"{op}: C = {c} channels, the kernels take at most {MAX_C}")
    if not offsets_fit(p, c, r):
        raise ValueError(f"{op}: P x max(R, C) = {p * max(r, c)} elements exceed 32-bit offsets")


# ------------------------------------------------------------------------------------------ launches


def _expand_launch(mode: int, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh, out, part, splits, ch,
                   forward: bool = False, folded: bool = False):
    rb, bm, warps, stages = TILES[mode, _size(x)]
    p, c = x.shape
    r = w_exp.shape[0]
    fast, prec = kernel_settings(x)
    nchunk = cdiv(r, rb)
    cp = max(16, next_power_of_2(c))
    dh_arg = dh if dh is not None else x
    launch(_expand_kernel, (nchunk, splits), x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh_arg, out, part, p,
           c, r, ch,
           cost=lambda: _expand_cost(mode, p, c, r, rb, cp, bm, splits, ch, x.element_size(),
                                     gamma_e.element_size(), forward, folded),
           MODE=mode, RB=rb, CP=cp, BM=bm, EVEN_R=r % rb == 0, FAST=fast, PREC=prec, FOLDED=folded,
           num_warps=warps, num_stages=stages, **(dict(maxnreg=EXPAND_MAXNREG) if _size(x) == 2 else {}))


def _expand_cost(mode: int, p: int, c: int, r: int, rb: int, cp: int, bm: int, splits: int, ch: int,
                 eb: int, gb: int, forward: bool = False, folded: bool = False) -> KernelCost:
    """x read from DRAM once, re-read from L2 by the other chunks' programs of its split (adjacent in the
    grid); W_exp and the per-channel vectors once; dh read once or h written once; the partials written.
    The dots as issued: BM x RB x CP per tile (z), plus RB x CP x BM (D) in the weights mode. MACs of the
    block's math: h P R C in a forward (``forward``), nothing for the backward's recompute (the forward
    counted it), D (dW_exp's) P R C."""
    nchunk = cdiv(r, rb)
    tiles = splits * cdiv(ch, bm)  # tiles as issued (the last split's short tail masked)
    z = nchunk * tiles * bm * rb * cp
    dram = p * c * eb + r * c * eb + (r * gb if folded else r * (2 * 4 + 2 * gb)) + p * r * eb
    if mode == MODE_H:
        note = "h = SiLU(BN_e(x W_exp^T))" + ("" if forward else " recomputed for the conv's backward")
    else:
        dram += splits * (r * c + r) * 4
        note = "BN_e backward weights pass: D = dv^T x and sum dv (z recomputed), partials per pixel split"
    return KernelCost(p * r * c if mode == MODE_D or forward else 0, z * (2 if mode == MODE_D else 1), dram,
                      (Loop("pixel tiles", cdiv(ch, bm)),),
                      l2_bytes=(nchunk - 1) * p * c * eb, note=note)


def _size(x: torch.Tensor) -> int:
    return 4 if x.element_size() == 4 else 2


def _expand_splits(mode: int, x: torch.Tensor, r: int) -> tuple[int, int]:
    """(splits, pixels per split): about one program per SM with the chunks."""
    rb, bm = TILES[mode, _size(x)][:2]
    return _splits(x.shape[0], bm, max(1, device_info(x.device).sms // cdiv(r, rb)))


def expand_hidden(x: torch.Tensor, w_exp: torch.Tensor, mean_e: torch.Tensor, rstd_e: torch.Tensor,
                  gamma_e: torch.Tensor, beta_e: torch.Tensor) -> torch.Tensor:
    """h = SiLU(gamma_e (x W_exp^T - mean_e) rstd_e + beta_e), (P, R) in x's dtype: the backward's
    recompute."""
    return _hidden("expand_hidden", x, w_exp, mean_e, rstd_e, gamma_e, beta_e, False)


def expand_forward(x: torch.Tensor, w_exp: torch.Tensor, mean_e: torch.Tensor, rstd_e: torch.Tensor,
                   gamma_e: torch.Tensor, beta_e: torch.Tensor) -> torch.Tensor:
    """``expand_hidden`` in a forward (the training forward, the staged inference launches): the same
    launch, whose cost declaration counts the expand's MACs."""
    return _hidden("expand_forward", x, w_exp, mean_e, rstd_e, gamma_e, beta_e, True)


def expand_folded(x: torch.Tensor, w_exp: torch.Tensor, b_exp: torch.Tensor) -> torch.Tensor:
    """h = SiLU(x W_exp^T + b_exp), (P, R) in x's dtype: the folded inference form (staged.py), whose
    BatchNorm the weights hold; b_exp (R,) in x's dtype or fp32 (the kernel reads no other vector: b_exp
    fills their arguments)."""
    return _hidden("expand_folded", x, w_exp, b_exp, b_exp, b_exp, b_exp, True, folded=True)


def _hidden(op: str, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, forward: bool, folded: bool = False
            ) -> torch.Tensor:
    p, _c, r = _check_expand(op, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, folded=folded)
    h = torch.empty((p, r), device=x.device, dtype=x.dtype)
    splits, ch = _expand_splits(MODE_H, x, r)
    _expand_launch(MODE_H, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, None, h, h, splits, ch, forward, folded)
    return h


def bn_e_weights(x: torch.Tensor, w_exp: torch.Tensor, mean_e: torch.Tensor, rstd_e: torch.Tensor,
                 gamma_e: torch.Tensor, beta_e: torch.Tensor, dh: torch.Tensor, mean_x: torch.Tensor,
                 wg_x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """BN_e's backward without de: (dW_exp (R, C), dgamma_e = sum dv e_hat (R,), dbeta_e = sum dv (R,), uw
    (2, R): de = gamma_e rstd_e dv + u + w (z - mean_e)), all fp32. One pass over dh accumulates D = dv^T x
    and sum dv per pixel split; one launch merges the splits in a fixed order and forms the rest from x's
    mean ``mean_x`` (C,) and ``wg_x`` (R, C) = W_exp G, G x's centred Gram matrix (both fp32, the
    forward's: moments.bn_e_stats), module docstring."""
    op = "bn_e_weights"
    p, c, r = _check_expand(op, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh)
    _check(op, "mean_x", mean_x, (c,), (torch.float32,), x.device)
    _check(op, "wg_x", wg_x, (r, c), (torch.float32,), x.device)
    splits, ch = _expand_splits(MODE_D, x, r)
    total = r * c + r
    part = torch.empty((splits, total), device=x.device, dtype=torch.float32)
    _expand_launch(MODE_D, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh, x, part, splits, ch)
    dw = torch.empty((r, c), device=x.device, dtype=torch.float32)
    dgamma, dbeta = (torch.empty((r,), device=x.device, dtype=torch.float32) for _ in range(2))
    uw = torch.empty((2, r), device=x.device, dtype=torch.float32)
    bh, warps = FINALIZE
    cp = max(16, next_power_of_2(c))
    launch(_bn_e_finalize_kernel, (cdiv(r, bh),), part, w_exp, wg_x, mean_x, mean_e, rstd_e, gamma_e, dw,
           dgamma, dbeta, uw, splits, r, c, p,
           cost=lambda: KernelCost(0, 0, 4 * (2 * r * c + c + 7 * r) + r * c * x.element_size(),
                                   (Loop("splits", splits),), l2_bytes=splits * total * 4,
                                   note=f"BN_e backward: fixed-order merge of D, dgamma, dW_exp ({c}->{r})"),
           BH=bh, CP=cp, num_warps=warps)
    return dw, dgamma, dbeta, uw


def bn_e_dx(x: torch.Tensor, w_exp: torch.Tensor, mean_e: torch.Tensor, rstd_e: torch.Tensor,
            gamma_e: torch.Tensor, beta_e: torch.Tensor, dh: torch.Tensor, uw: torch.Tensor,
            residual: torch.Tensor | None) -> torch.Tensor:
    """dx = de W_exp (+ residual), (P, C) in x's dtype, de (``bn_e_weights``'s uw) recomputed per pixel tile
    from x and dh, never written."""
    op = "bn_e_dx"
    p, c, r = _check_expand(op, x, w_exp, mean_e, rstd_e, gamma_e, beta_e, dh)
    _check(op, "uw", uw, (2, r), (torch.float32,), x.device)
    if residual is not None:
        _check(op, "residual", residual, (p, c), (x.dtype,), x.device)
    dx = torch.empty((p, c), device=x.device, dtype=x.dtype)
    fast, prec = kernel_settings(x)
    cp = max(16, next_power_of_2(c))
    bm, rb, warps = DX_TILES[_size(x)]
    tiles = cdiv(p, bm)
    eb = x.element_size()
    launch(_expand_dx_kernel, (tiles,), x, w_exp, mean_e, rstd_e, gamma_e, beta_e, uw, dh,
           residual if residual is not None else dx, dx, p, c, r,
           cost=lambda: KernelCost(p * r * c, 2 * tiles * bm * cp * cdiv(r, rb) * rb,
                                   p * r * eb + r * c * eb + p * c * eb * (3 if residual is not None else 2)
                                   + r * (4 * 4 + 2 * gamma_e.element_size()),
                                   (Loop("hidden steps", cdiv(r, rb)),),
                                   l2_bytes=(tiles - 1) * r * c * eb,
                                   note="dx = de W_exp (+ residual), de recomputed (z, dv)"),
           RESIDUAL=residual is not None, BM=bm, CP=cp, RB=rb, EVEN_R=r % rb == 0, FAST=fast, PREC=prec,
           num_warps=warps)
    return dx
