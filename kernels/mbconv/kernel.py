"""Triton kernels for the MBConv + Squeeze-Excite block (header to be written)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import GROUP_WIDTH, launch

FP32_PRECISION = "tf32x3"


@dataclass(frozen=True)
class HiddenConfig:
    stride: int
    rb: int  # hidden channels per work item
    cp: int  # input channels padded to a power of two (one expand K tile)
    mask_c: bool
    mask_r: bool
    exact: bool  # tiles cover the map exactly (W == tw, H multiple of bm // tw, dense pixel rows)
    tw: int  # tile width (pixels of an image row per tile)
    bm: int  # pixels per tile
    two: int  # blur output tile width
    bmo: int  # blur output pixels per tile
    num_warps: int

    def constexprs(self) -> dict:
        return dict(STRIDE=self.stride, RB=self.rb, CP=self.cp, MASK_C=self.mask_c, MASK_R=self.mask_r,
                    TW=self.tw, BM=self.bm, TWO=self.two, BMO=self.bmo, EXACT=self.exact, ZB=1024, num_warps=self.num_warps)


@dataclass(frozen=True)
class ProjectConfig:
    bm: int
    bh: int  # output channels per accumulator
    halves: int  # accumulators per program (1 or 2)
    br: int
    num_warps: int
    num_stages: int

    @property
    def bn(self) -> int:
        return self.bh * self.halves

    def constexprs(self) -> dict:
        return dict(BM=self.bm, BH=self.bh, HALVES=self.halves, BR=self.br, num_warps=self.num_warps,
                    num_stages=self.num_stages)


def hidden_config(c, r, h, w, stride, dtype, dense=True) -> HiddenConfig:
    rb, bm, bmo = 64, 64, 64
    cp = max(16, triton.next_power_of_2(c))
    tw = min(bm, max(8, triton.next_power_of_2(w)))
    two = min(bmo, max(8, triton.next_power_of_2((w + 1) // 2))) if stride == 2 else 8
    exact = dense and w == tw and h % (bm // tw) == 0
    if stride == 2:
        exact = exact and w % 2 == 0 and h % 2 == 0 and w // 2 == two and (h // 2) % (bmo // two) == 0
    return HiddenConfig(stride, rb, cp, c != cp, r % rb != 0, exact, tw, bm, two, bmo, 4)


def project_config(k, r, ohw, dtype) -> ProjectConfig:
    bm = 128 if ohw > 64 else 64
    bn = min(256, max(16, triton.next_power_of_2(k)))
    halves = 2 if bn > 128 else 1
    return ProjectConfig(bm, bn // halves, halves, 64, 8, 3)


@triton.jit
def _silu(acc, half_bias, MODE: tl.constexpr):
    """SiLU(acc + 2 * half_bias) in fp32. MODE 0: x / (1 + exp(-x)) (interpreter, fp32 data);
    MODE 1: with u = x / 2, SiLU(x) = u + u * tanh(u) through tanh.approx.f32 (three instructions)."""
    if MODE == 0:
        v = acc + 2.0 * half_bias
        return v / (1.0 + tl.exp(-v))
    else:
        u = acc * 0.5 + half_bias
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True,
                                      pack=1)
        return u + u * t


@triton.jit
def _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, J: tl.constexpr, G: tl.constexpr):
    g = tl.arange(0, G)[:, None, None]
    k = tl.arange(0, 16)[None, :, None]
    co = tl.arange(0, 8)[None, None, :]
    tap = 2 * J + k // 8
    r = r0 + g * 8 + co
    return tl.load(wconv_ptr + r * swc_r + (k % 8) * swc_i + (tap // 3) * swc_y + (tap % 3) * swc_x,
                   mask=(tap < 9) & (r < R), other=0.0)


@triton.jit
def _conv_pair_h(hs, q, PW, J: tl.constexpr, G: tl.constexpr):
    """Taps 2J and 2J + 1 (the tenth tap re-reads tap 8; its weights are zero) of the pixels at padded
    positions q, as the [G, BM, 16] operand: k < 8 input channels of tap 2J, k >= 8 of tap 2J + 1.
    Scratch layout [padded row][group][padded column][8]."""
    g = tl.arange(0, G)[:, None, None]
    k = tl.arange(0, 16)[None, None, :]
    tap = tl.minimum(2 * J + k // 8, 8)
    off = (tap // 3 - 1) * (G * PW * 8) + (tap % 3 - 1) * 8
    return tl.load(hs + g * (PW * 8) + q[None, :, None] + off + k % 8)


@triton.jit
def _tile(t, ncol, H, W, m, TW: tl.constexpr, TH: tl.constexpr, EXACT: tl.constexpr):
    """Pixel rows of tile ``t``: image row y, column x, clamped copies (always inside the image) and
    whether the row is a real pixel. EXACT: tiles cover the image exactly (W == TW, TH divides H)."""
    if EXACT:
        y = t * TH + m // TW
        x = m % TW
        return y, x, y, x, m < TW * TH
    else:
        y = (t // ncol) * TH + m // TW
        x = (t % ncol) * TW + m % TW
        return y, x, tl.minimum(y, H - 1), tl.minimum(x, W - 1), (y < H) & (x < W)


@triton.jit
def _mbconv_hidden_kernel(
    x_ptr, wexp_ptr, bexp_ptr, wconv_ptr, bconv_ptr, w1_ptr, g_ptr, z_ptr, scr_ptr, ms_ptr,
    N, H, W_RT, OH, OW, C, R, S, NCHUNK, ITEMS, IB, SLOT,
    sxn, sxc, sxh, sxw, swe_r, swe_c, swc_r, swc_i, swc_y, swc_x, sw1_s, sw1_r,
    STRIDE: tl.constexpr, RB: tl.constexpr, CP: tl.constexpr, SP: tl.constexpr,
    MASK_C: tl.constexpr, MASK_R: tl.constexpr,
    TW: tl.constexpr, BM: tl.constexpr, TWO: tl.constexpr, BMO: tl.constexpr, EXACT: tl.constexpr,
    ZB: tl.constexpr, SILU: tl.constexpr, PREC: tl.constexpr,
):
    G: tl.constexpr = RB // 8
    TH: tl.constexpr = BM // TW
    THO: tl.constexpr = BMO // TWO
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if EXACT:
        W: tl.constexpr = TW
    else:
        W = W_RT
    PW = W + 2
    PHW = (H + 2) * PW
    OHW = OH * OW
    hs = scr_ptr + pid.to(tl.int64) * SLOT
    gs = hs + RB * PHW
    ms = ms_ptr + pid * RB

    zr = tl.arange(0, ZB)
    for z0 in range(0, RB * PHW, ZB):
        tl.store(hs + z0 + zr, tl.zeros([ZB], dtype), mask=z0 + zr < RB * PHW)

    rr = tl.arange(0, RB)
    rc = tl.arange(0, CP)
    c_ok = rc < C
    m = tl.arange(0, BM)
    g3 = tl.arange(0, G)[:, None, None]
    c3 = tl.arange(0, 8)[None, None, :]
    ncol = tl.cdiv(W, TW)
    ntile = tl.cdiv(H, TH) * ncol
    ncol_o = tl.cdiv(OW, TWO)
    ntile_o = tl.cdiv(OH, THO) * ncol_o
    mo = tl.arange(0, BMO)
    sv = tl.arange(0, SP)

    for item in range(pid, ITEMS, nprog):
        r0 = (item % NCHUNK) * RB
        n0 = (item // NCHUNK) * IB
        r_ok = (r0 + rr) < R
        r3 = r0 + g3 * 8 + c3
        # weights of this hidden chunk, loaded once for IB images
        if MASK_C or MASK_R:
            we = tl.load(wexp_ptr + (r0 + rr)[None, :] * swe_r + rc[:, None] * swe_c,
                         mask=c_ok[:, None] & r_ok[None, :], other=0.0)
        else:
            we = tl.load(wexp_ptr + (r0 + rr)[None, :] * swe_r + rc[:, None] * swe_c)
        hb_e = 0.5 * tl.load(bexp_ptr + r0 + rr, mask=r_ok, other=0.0).to(tl.float32)[None, :]
        hb_c = 0.5 * tl.load(bconv_ptr + r3, mask=r3 < R, other=0.0).to(tl.float32)
        w0 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 0, G)
        w1 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 1, G)
        w2 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 2, G)
        w3 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 3, G)
        w4 = _conv_pair_w(wconv_ptr, r0, R, swc_r, swc_i, swc_y, swc_x, 4, G)
        for n in range(n0, tl.minimum(n0 + IB, N)):
            x_img = x_ptr + tl.cast(n, tl.int64) * sxn
            tl.debug_barrier()
            # ---- expand: h = SiLU(x W_exp^T + b) into the padded scratch
            for t in tl.range(0, ntile, num_stages=1):
                y, xx, yc, xc, ok = _tile(t, ncol, H, W, m, TW, TH, EXACT)
                if EXACT:
                    xp = (x_img + (t * BM + m) * sxw)[:, None] + rc[None, :] * sxc
                else:
                    xp = (x_img + yc * sxh + xc * sxw)[:, None] + rc[None, :] * sxc
                if MASK_C:
                    xt = tl.load(xp, mask=c_ok[None, :], other=0.0)
                else:
                    xt = tl.load(xp)
                hv = _silu(tl.dot(xt, we, input_precision=PREC), hb_e, SILU).to(dtype)
                hp = hs + ((y + 1) * (G * PW * 8) + (xx + 1) * 8)[:, None] + ((rr // 8) * (PW * 8) + rr % 8)[None, :]
                if EXACT:
                    tl.store(hp, hv)
                else:
                    tl.store(hp, hv, mask=ok[:, None])
            tl.debug_barrier()
            # ---- grouped conv (+ SiLU)
            if STRIDE == 1:
                pool = tl.zeros((G, BM, 8), dtype=tl.float32)
            else:
                pool = tl.zeros((BMO, RB), dtype=tl.float32)
            for t in tl.range(0, ntile, num_stages=1):
                y, xx, yc, xc, ok = _tile(t, ncol, H, W, m, TW, TH, EXACT)
                q = (yc + 1) * (G * PW * 8) + (xc + 1) * 8
                acc = tl.dot(_conv_pair_h(hs, q, PW, 0, G), w0, input_precision=PREC)
                acc = tl.dot(_conv_pair_h(hs, q, PW, 1, G), w1, acc, input_precision=PREC)
                acc = tl.dot(_conv_pair_h(hs, q, PW, 2, G), w2, acc, input_precision=PREC)
                acc = tl.dot(_conv_pair_h(hs, q, PW, 3, G), w3, acc, input_precision=PREC)
                acc = tl.dot(_conv_pair_h(hs, q, PW, 4, G), w4, acc, input_precision=PREC)
                v = _silu(acc, hb_c, SILU)
                pix = (y * W + xx)[None, :, None]
                ok3 = ok[None, :, None]
                if STRIDE == 1:
                    gp = g_ptr + (n * OHW + pix).to(tl.int64) * R + r3
                    if EXACT:
                        pool += v
                        if MASK_R:
                            tl.store(gp, v.to(dtype), mask=r3 < R)
                        else:
                            tl.store(gp, v.to(dtype))
                    else:
                        pool += tl.where(ok3, v, 0.0)
                        tl.store(gp, v.to(dtype), mask=ok3 & (r3 < R))
                else:
                    if EXACT:
                        tl.store(gs + pix * RB + g3 * 8 + c3, v.to(dtype))
                    else:
                        tl.store(gs + pix * RB + g3 * 8 + c3, v.to(dtype), mask=ok3)
            if STRIDE == 1:
                r2 = tl.arange(0, G)[:, None] * 8 + tl.arange(0, 8)[None, :]
                tl.store(ms + r2, tl.sum(pool, axis=1) / OHW)
            else:
                # ---- BlurPool: [1, 2, 1]^2 / 16, stride 2, reflect padding folded into the indices
                tl.debug_barrier()
                for t in range(0, ntile_o):
                    oy, ox, oyc, oxc, ok = _tile(t, ncol_o, OH, OW, mo, TWO, THO, EXACT)
                    accb = tl.zeros((BMO, RB), dtype=tl.float32)
                    for a in tl.static_range(3):
                        sy = 2 * oyc - 1 + a
                        sy = tl.where(sy < 0, -sy, sy)
                        if not EXACT:  # EXACT: H even, so 2 * oy + 1 <= H - 1
                            sy = tl.where(sy >= H, 2 * H - 2 - sy, sy)
                        for b in tl.static_range(3):
                            sx = 2 * oxc - 1 + b
                            sx = tl.where(sx < 0, -sx, sx)
                            if not EXACT:
                                sx = tl.where(sx >= W, 2 * W - 2 - sx, sx)
                            tap = tl.load(gs + ((sy * W + sx) * RB)[:, None] + rr[None, :])
                            accb += tap.to(tl.float32) * ((1 + a % 2) * (1 + b % 2) * 0.0625)
                    opix = (n * OHW + oy * OW + ox).to(tl.int64)
                    op = g_ptr + opix[:, None] * R + (r0 + rr)[None, :]
                    if EXACT:
                        pool += accb
                        if MASK_R:
                            tl.store(op, accb.to(dtype), mask=r_ok[None, :])
                        else:
                            tl.store(op, accb.to(dtype))
                    else:
                        pool += tl.where(ok[:, None], accb, 0.0)
                        tl.store(op, accb.to(dtype), mask=ok[:, None] & r_ok[None, :])
                tl.store(ms + rr, tl.sum(pool, axis=0) / OHW)
            # ---- SE reduce, this chunk's share: z[n] = sum over chunks of W_se1[:, chunk] mean[n, chunk].
            # The chunk's mean goes through the per-program slot ``ms``: reducing it straight from the
            # pool's layout pushed the registers past 255 (spills).
            tl.debug_barrier()
            mc = tl.load(ms + rr)
            zrow = z_ptr + (tl.cast(n, tl.int64) * NCHUNK + item % NCHUNK) * SP
            for s0 in tl.static_range(0, SP, 16):
                s2 = s0 + tl.arange(0, 16)
                w1c = tl.load(w1_ptr + s2[:, None] * sw1_s + (r0 + rr)[None, :] * sw1_r,
                              mask=(s2[:, None] < S) & r_ok[None, :], other=0.0)
                tl.store(zrow + s2, tl.sum(w1c.to(tl.float32) * mc[None, :], axis=1))


@triton.jit
def _acc_init(bproj_ptr, x_ptr, n, k, kv, oy, ox, m_ok, sxn, sxc, sxh, sxw, BM: tl.constexpr, BH: tl.constexpr,
              RESIDUAL: tl.constexpr):
    acc = tl.zeros((BM, BH), dtype=tl.float32) + tl.load(bproj_ptr + k, mask=kv, other=0.0).to(tl.float32)[None, :]
    if RESIDUAL:
        res = tl.load(x_ptr + n * sxn + k[None, :] * sxc + (oy * sxh + ox * sxw)[:, None],
                      mask=m_ok[:, None] & kv[None, :], other=0.0)
        acc += res.to(tl.float32)
    return acc


@triton.jit
def _mbconv_project_kernel(
    g_ptr, z_ptr, b1_ptr, w2_ptr, b2_ptr, wproj_ptr, bproj_ptr, x_ptr, out_ptr, gate_ptr,
    OHW, OW, R, K, S, NCHUNK, TPI,
    sxn, sxc, sxh, sxw, son, sok, soh, sow, sw2_r, sw2_s, swp_k, swp_r,
    RESIDUAL: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, HALVES: tl.constexpr, BR: tl.constexpr,
    SP: tl.constexpr, NCP: tl.constexpr, EVEN: tl.constexpr, PREC: tl.constexpr,
):
    dtype = g_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n = (pid // TPI).to(tl.int64)
    p = (pid % TPI) * BM + tl.arange(0, BM)
    pv = p < OHW
    k0 = tl.program_id(1) * (BH * HALVES) + tl.arange(0, BH)
    k1 = k0 + BH
    rows = g_ptr + (n * OHW + p) * R
    oy = p // OW
    ox = p % OW
    # SE: z = ReLU(sum of the per-chunk partials + b1); gate = sigmoid(W_se2 z + b2) into this program's slot
    sv = tl.arange(0, SP)
    ch = tl.arange(0, NCP)
    zz = tl.load(z_ptr + (n * NCHUNK + ch[:, None]) * SP + sv[None, :], mask=ch[:, None] < NCHUNK, other=0.0)
    z = tl.maximum(tl.sum(zz, axis=0) + tl.load(b1_ptr + sv, mask=sv < S, other=0.0).to(tl.float32), 0.0)
    gate = gate_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * R
    rb = tl.arange(0, BR)
    for r0 in range(0, R, BR):
        rr = r0 + rb
        rv = rr < R
        w2 = tl.load(w2_ptr + rr[:, None] * sw2_r + sv[None, :] * sw2_s, mask=rv[:, None] & (sv < S)[None, :],
                     other=0.0)
        e = tl.sum(w2.to(tl.float32) * z[None, :], axis=1) + tl.load(b2_ptr + rr, mask=rv, other=0.0).to(tl.float32)
        tl.store(gate + rr, tl.sigmoid(e).to(gate_ptr.dtype.element_ty), mask=rv)
    tl.debug_barrier()
    # accumulators start at bias (+ residual); with HALVES = 2 the output width is split in two
    # accumulators so that the epilogue converts half of it at a time
    acc0 = _acc_init(bproj_ptr, x_ptr, n, k0, k0 < K, oy, ox, pv, sxn, sxc, sxh, sxw, BM, BH, RESIDUAL)
    if HALVES == 2:
        acc1 = _acc_init(bproj_ptr, x_ptr, n, k1, k1 < K, oy, ox, pv, sxn, sxc, sxh, sxw, BM, BH, RESIDUAL)
    for r0 in range(0, R, BR):
        rr = r0 + rb
        if EVEN:  # R a multiple of BR, OHW of BM and K of BH * HALVES: no masks
            a = tl.load(rows[:, None] + rr[None, :]) * tl.load(gate + rr)[None, :]
            b0 = tl.load(wproj_ptr + k0[None, :] * swp_k + rr[:, None] * swp_r)
        else:
            rv = rr < R
            a = tl.load(rows[:, None] + rr[None, :], mask=pv[:, None] & rv[None, :], other=0.0)
            a = a * tl.load(gate + rr, mask=rv, other=0.0)[None, :]
            b0 = tl.load(wproj_ptr + k0[None, :] * swp_k + rr[:, None] * swp_r,
                         mask=rv[:, None] & (k0 < K)[None, :], other=0.0)
        acc0 = tl.dot(a, b0, acc0, input_precision=PREC)
        if HALVES == 2:
            if EVEN:
                b1 = tl.load(wproj_ptr + k1[None, :] * swp_k + rr[:, None] * swp_r)
            else:
                b1 = tl.load(wproj_ptr + k1[None, :] * swp_k + rr[:, None] * swp_r,
                             mask=rv[:, None] & (k1 < K)[None, :], other=0.0)
            acc1 = tl.dot(a, b1, acc1, input_precision=PREC)
    o_rows = out_ptr + n * son + (oy * soh + ox * sow)[:, None]
    if EVEN:
        tl.store(o_rows + k0[None, :] * sok, acc0.to(dtype))
        if HALVES == 2:
            tl.store(o_rows + k1[None, :] * sok, acc1.to(dtype))
    else:
        tl.store(o_rows + k0[None, :] * sok, acc0.to(dtype), mask=pv[:, None] & (k0 < K)[None, :])
        if HALVES == 2:
            tl.store(o_rows + k1[None, :] * sok, acc1.to(dtype), mask=pv[:, None] & (k1 < K)[None, :])


MAX_GRID = 2**31 - 1
DEFAULT_SMS = 132
INTERPRETER_PROGRAMS = 3
PROGRAMS_PER_SM = 2


def check_supported(r: int, k: int) -> None:
    if r % GROUP_WIDTH:
        raise ValueError(
            f"convfirstnet.mbconv: hidden width {r} is not a multiple of the group width {GROUP_WIDTH}"
        )


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM
    if device.type == "cpu":
        return INTERPRETER_PROGRAMS
    return DEFAULT_SMS * PROGRAMS_PER_SM


ITEM_OVERHEAD = 0.5  # cost of a work item's weight loads, in units of one image's work (to be measured)


def image_block(n: int, nchunk: int, hw: int, programs: int) -> int:
    """Images per work item: amortizes the per-item weight loads, keeps the programs balanced."""
    best, best_t = 1, None
    for ib in range(1, max(1, min(n, 1024 // max(hw, 1))) + 1):
        items = nchunk * triton.cdiv(n, ib)
        t = triton.cdiv(items, programs) * (ib + ITEM_OVERHEAD)
        if best_t is None or t < best_t:
            best, best_t = ib, t
    return best


def mbconv_triton(x, w_exp, b_exp, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj, stride):
    n, c, h, w = x.shape
    r, k, s = w_exp.shape[0], w_proj.shape[0], w_se1.shape[0]
    oh, ow = (h, w) if stride == 1 else ((h + 1) // 2, (w + 1) // 2)
    out = torch.empty((n, k, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    if n == 0:
        return out
    hw, ohw = h * w, oh * ow
    hc = hidden_config(c, r, h, w, stride, x.dtype, dense=x.stride(2) == w * x.stride(3))
    pc = project_config(k, r, ohw, x.dtype)
    sp = max(16, triton.next_power_of_2(s))
    b_exp, b_conv, b_proj = b_exp.contiguous(), b_conv.contiguous(), b_proj.contiguous()
    b_se1, b_se2 = b_se1.contiguous(), b_se2.contiguous()
    nchunk = triton.cdiv(r, hc.rb)
    programs = _programs(x.device)
    ib = image_block(n, nchunk, hw, programs)
    items = nchunk * triton.cdiv(n, ib)
    nprog = min(items, programs)
    slot = hc.rb * (h + 2) * (w + 2) + (hc.rb * hw if stride == 2 else 0)
    scratch = torch.empty((nprog * slot,), device=x.device, dtype=x.dtype)
    g = torch.empty((n, ohw, r), device=x.device, dtype=x.dtype)
    zpart = torch.empty((n, nchunk, sp), device=x.device, dtype=torch.float32)
    prec = FP32_PRECISION if x.dtype == torch.float32 else "tf32"
    silu = 0 if x.dtype == torch.float32 or x.device.type == "cpu" else 1
    eb = x.element_size()
    g_ = hc.rb // 8

    def hidden_cost():
        phw = (h + 2) * (w + 2)
        th, tho = hc.bm // hc.tw, hc.bmo // hc.two
        n_t = triton.cdiv(h, th) * triton.cdiv(w, hc.tw)
        n_o = triton.cdiv(oh, tho) * triton.cdiv(ow, hc.two)
        per_img = n_t * hc.bm * hc.rb * hc.cp + n_t * hc.bm * g_ * 8 * 16 * 5
        mma = nchunk * n * per_img
        useful = n * (hw * c * r + hw * r * 72 + (ohw * r * 9 if stride == 2 else 0) + r * s)
        dram = (n * c * hw + r * c + r + r * 72 + r + r * s + n * ohw * r) * eb + n * nchunk * sp * 4
        scr_img = hw * hc.rb + n_t * 5 * g_ * hc.bm * 16
        if stride == 2:
            scr_img += hw * hc.rb + n_o * 9 * hc.bmo * hc.rb
        scr = nprog * hc.rb * phw + nchunk * n * scr_img
        body = [Loop("expand tiles", n_t), Loop("conv tiles", n_t)]
        if stride == 2:
            body.append(Loop("blur tiles", n_o))
        loops = (Loop("zero scratch", triton.cdiv(hc.rb * phw, 1024)),
                 Loop("work items", triton.cdiv(items, nprog), (Loop("images", ib, tuple(body)),)))
        return KernelCost(useful, mma, dram, loops, l2_bytes=scr * eb, scratch_bytes_per_program=slot * eb)

    mslot = torch.empty((nprog, hc.rb), device=x.device, dtype=torch.float32)
    launch(_mbconv_hidden_kernel, (nprog,), x, w_exp, b_exp, w_conv, b_conv, w_se1, g, zpart, scratch, mslot,
           n, h, w, oh, ow, c, r, s, nchunk, items, ib, slot,
           *x.stride(), *w_exp.stride(), *w_conv.stride(), *w_se1.stride(),
           SILU=silu, PREC=prec, SP=sp, cost=hidden_cost, **hc.constexprs())
    tpi = triton.cdiv(ohw, pc.bm)
    grid = (n * tpi, triton.cdiv(k, pc.bn))

    def project_cost():
        steps = triton.cdiv(r, pc.br)
        dram = (n * ohw * r + k * r + k + r * s + s + r + n * ohw * k * (2 if stride == 1 else 1)) * eb
        dram += n * nchunk * sp * 4
        return KernelCost(n * ohw * r * k + n * r * s, grid[0] * grid[1] * pc.bm * pc.bn * steps * pc.br, dram,
                          (Loop("gate slices", steps), Loop("R steps", steps)),
                          l2_bytes=grid[0] * grid[1] * r * 2 * eb, scratch_bytes_per_program=r * eb)

    gate = torch.empty((grid[0] * grid[1], r), device=x.device, dtype=x.dtype)
    launch(_mbconv_project_kernel, grid, g, zpart, b_se1, w_se2, b_se2, w_proj, b_proj, x, out, gate,
           ohw, ow, r, k, s, nchunk, tpi, *x.stride(), *out.stride(), *w_se2.stride(), *w_proj.stride(),
           RESIDUAL=stride == 1, SP=sp, NCP=triton.next_power_of_2(nchunk), PREC=prec, cost=project_cost,
           EVEN=r % pc.br == 0 and ohw % pc.bm == 0 and k % pc.bn == 0,
           **pc.constexprs())
    return out
