"""Per-channel finalize kernels of the fused training blocks: the BatchNorm arithmetic between the big
passes (kernels/_batchnorm.py gives the formulas and the host-side twin of each), as a handful of
small launches instead of a hundred small aten ops per block step.

Each kernel reduces per-share partials (written by the pass before it, at most a few hundred shares)
in a fixed order (share blocks of SB summed by tl.sum, block after block), so its results do not
depend on scheduling, and writes the per-channel vectors the next passes read. Per-channel vectors
of one BatchNorm of width W live in one fp32 buffer of VEC_ROWS x W (``VEC_*`` rows below):

    r = 1 / sqrt(var + eps),  k = gamma r,  t = beta - mean k             (forward affine)
    u = -k dbeta / M,  w = -k r dgamma / M,  c = u - w mean              (backward terms; zero in eval)

* ``_merge_moments_kernel``: Chan's merge of (mean, centred second moment) partials per share, for the
  full C x C covariance (FULL) or its diagonal; the mean and variance, optionally k and t.
* ``_linear_moments_kernel``: the statistics of z = W v from v's mean and covariance (v = k_in a + t_in
  when AFFINE_IN): mean W mean_v, variance diag(W Cov(v) W^T) (no pass over the wide z), and k, t;
  FOLD: also k W and W2 in the activation dtype, the stride-1 forward FFN's weights.
* ``_bn_terms_kernel``: r, k, t of up to three BatchNorms from their statistics, and for one of them
  the backward terms from per-share (sum dout, sum dout v_hat) partials: dbeta, dgamma (stored in the
  parameter's dtype), u, w, c.
* ``_ffn_weights_finalize_kernel``: after the reduction of the FFN weights pass's partials: BN2's
  dbeta, dgamma, u, w, dW2 in the weight's dtype and dW1 = k2 G + u2 sum(v)^T + w2 (z - m2)^T v, whose
  last term follows from v's statistics: (z - m2)^T v = M W1 Cov(v) + M (W1 mean(v) - m2) mean(v)^T.
* ``_bn_running_kernel``: nn.BatchNorm2d's running-statistics update of up to three BatchNorms, in place
  (num_batches_tracked counted; momentum, or the cumulative average 1 / num_batches_tracked when the
  momentum is None (passed as a negative value); the unbiased batch variance var M / (M - 1)).

Products of fp32 per-channel matrices (W1 Cov, at most R x C x C MACs) use ``input_precision="tf32x3"``
(three TF32 products: about fp32 accuracy, on the tensor cores; the exact fp32 FMA form compiled to a
latency-bound 100-180 us per launch at Small's C = 96 in the static estimate, against 7-12 us; the
interpreter computes exact fp32). Weights are read as stored (fp32 master weights under autocast) and
rounded to the activation dtype (``ref_ptr``'s) where a layer-wise network's autocast would round them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._scalars import fp32

VEC_R, VEC_K, VEC_T, VEC_U, VEC_W, VEC_C = range(6)
VEC_ROWS = 6


@triton.jit
def _share_counts(s, S, M, RPS):
    """Rows of shares ``s`` (fp32; every share RPS rows but the last, zero past S)."""
    cnt = tl.where(s < S - 1, RPS, M - RPS * (S - 1))
    return tl.where(s < S, cnt, 0).to(tl.float32)


@triton.jit
def _merge_moments_kernel(
    mean_part, m2_part,  # fp32 partials: mean (S, C); m2 (i, j) of share s at s M2_S + i M2_R + j M2_C
    mean_ptr, mean_copy_ptr, var_ptr, cov_ptr,  # outputs (C), (C), (C), (C, C) fp32
    gamma_ptr, beta_ptr, k_ptr, t_ptr,  # AFFINE: gamma, beta (C) as stored; k, t (C) fp32 out
    S, M, RPS, eps, M2_S, M2_R, M2_C,
    C: tl.constexpr, FULL: tl.constexpr, AFFINE: tl.constexpr, COPY: tl.constexpr, SB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program: BLOCK elements (i, j) of the covariance (FULL) or BLOCK channels i = j; two passes over
    the shares (the total mean, then the spread of the share means about it)."""
    eps = fp32(eps)  # torch.compile passes floats as fp64 (_scalars.py)
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if FULL:
        ok = e < C * C
        i = e // C
        j = e % C
    else:
        ok = e < C
        i = e
        j = e
    n = tl.cast(M, tl.float32)
    rows = tl.arange(0, SB)
    tmi = tl.zeros((BLOCK,), tl.float32)
    tmj = tl.zeros((BLOCK,), tl.float32)
    sm2 = tl.zeros((BLOCK,), tl.float32)
    for s0 in range(0, S, SB):
        s = s0 + rows
        cnt = _share_counts(s, S, M, RPS)
        msk = (s < S)[:, None] & ok[None, :]
        mi = tl.load(mean_part + s[:, None] * C + i[None, :], mask=msk, other=0.0)
        mj = tl.load(mean_part + s[:, None] * C + j[None, :], mask=msk, other=0.0)
        m2 = tl.load(m2_part + s[:, None].to(tl.int64) * M2_S + i[None, :] * M2_R + j[None, :] * M2_C,
                     mask=msk, other=0.0)
        wgt = (cnt / n)[:, None]
        tmi += tl.sum(wgt * mi, axis=0)
        tmj += tl.sum(wgt * mj, axis=0)
        sm2 += tl.sum(m2, axis=0)
    spread = tl.zeros((BLOCK,), tl.float32)
    for s0 in range(0, S, SB):
        s = s0 + rows
        cnt = _share_counts(s, S, M, RPS)
        msk = (s < S)[:, None] & ok[None, :]
        di = tl.load(mean_part + s[:, None] * C + i[None, :], mask=msk, other=0.0) - tmi[None, :]
        dj = tl.load(mean_part + s[:, None] * C + j[None, :], mask=msk, other=0.0) - tmj[None, :]
        spread += tl.sum(cnt[:, None] * di * dj, axis=0)
    cov = (sm2 + spread) / n
    if FULL:
        tl.store(cov_ptr + e, cov, mask=ok)
    diag = ok & (i == j)
    tl.store(mean_ptr + i, tmi, mask=diag)
    if COPY:
        tl.store(mean_copy_ptr + i, tmi, mask=diag)
    tl.store(var_ptr + i, cov, mask=diag)
    if AFFINE:
        g = tl.load(gamma_ptr + i, mask=diag, other=0.0).to(tl.float32)
        b = tl.load(beta_ptr + i, mask=diag, other=0.0).to(tl.float32)
        k = g / tl.sqrt(tl.where(diag, cov, 1.0) + eps)  # off the diagonal: not a variance, not stored
        tl.store(k_ptr + i, k, mask=diag)
        tl.store(t_ptr + i, b - tmi * k, mask=diag)


@triton.jit
def _w_rows(w_ptr, hh, hok, ci, cok, CI: tl.constexpr, dt: tl.constexpr):
    """Rows ``hh`` of W (R, CI as stored) rounded to the activation dtype ``dt`` (as the FFN passes
    multiply by it), in fp32: [BH, CPI]."""
    w = tl.load(w_ptr + hh[:, None] * CI + ci[None, :], mask=hok[:, None] & cok[None, :], other=0.0)
    return w.to(dt).to(tl.float32)


@triton.jit
def _linear_moments_kernel(
    mean_in, cov_in, kin_ptr, tin_ptr,  # v's statistics (CI), (CI, CI) fp32; AFFINE_IN: v = kin a + tin
    w_ptr, ref_ptr,  # W (R, CI) as stored; ref: any tensor of the activation dtype (never read)
    gamma_ptr, beta_ptr, mean_ptr, var_ptr, k_ptr, t_ptr,  # gamma, beta (R) as stored; outputs (R) fp32
    ws_ptr, w2_ptr, w2d_ptr,  # FOLD: k W (R, CI) and W2 (CO, R) as stored -> W2 (CO, R), activation dtype
    R, eps, COLS, CO,
    CI: tl.constexpr, CPI: tl.constexpr, BH: tl.constexpr, BJ: tl.constexpr, AFFINE_IN: tl.constexpr,
    FOLD: tl.constexpr, BO: tl.constexpr,
):
    """Program: BH output channels of z = W v: mean W mean_v, variance diag(W Cov(v) W^T), k, t. FOLD
    (the stride-1 training forward's FFN, launcher.ffn_forward): also W scaled by k, so that
    k z + t = (k W) v + t, and W2's columns of these channels, both in the activation dtype (BO rows of
    W2 a step)."""
    eps = fp32(eps)  # torch.compile passes floats as fp64 (_scalars.py)
    hh = tl.program_id(0) * BH + tl.arange(0, BH)
    hok = hh < R
    ci = tl.arange(0, CPI)
    cok = ci < CI
    dt = ref_ptr.dtype.element_ty
    w = _w_rows(w_ptr, hh, hok, ci, cok, CI, dt)
    mu = tl.load(mean_in + ci, mask=cok, other=0.0)
    if AFFINE_IN:
        kin = tl.load(kin_ptr + ci, mask=cok, other=0.0)
        mu = kin * mu + tl.load(tin_ptr + ci, mask=cok, other=0.0)
    mean = tl.sum(w * mu[None, :], axis=1)
    var = tl.zeros((BH,), tl.float32)
    for j0 in range(0, COLS, BJ):  # COLS = CPI at run time: a loop, not unrolled (registers)
        cj = j0 + tl.arange(0, BJ)
        jok = cj < CI
        cov = tl.load(cov_in + ci[:, None] * CI + cj[None, :], mask=cok[:, None] & jok[None, :], other=0.0)
        if AFFINE_IN:
            cov = cov * kin[:, None] * tl.load(kin_ptr + cj, mask=jok, other=0.0)[None, :]
        a = tl.dot(w, cov, input_precision="tf32x3")
        wj = tl.load(w_ptr + hh[:, None] * CI + cj[None, :], mask=hok[:, None] & jok[None, :], other=0.0)
        var += tl.sum(a * wj.to(dt).to(tl.float32), axis=1)
    g = tl.load(gamma_ptr + hh, mask=hok, other=0.0).to(tl.float32)
    b = tl.load(beta_ptr + hh, mask=hok, other=0.0).to(tl.float32)
    k = g / tl.sqrt(var + eps)
    tl.store(mean_ptr + hh, mean, mask=hok)
    tl.store(var_ptr + hh, var, mask=hok)
    tl.store(k_ptr + hh, k, mask=hok)
    tl.store(t_ptr + hh, b - mean * k, mask=hok)
    if FOLD:  # k W from W as stored (fp32 under autocast): rounded once
        wm = hok[:, None] & cok[None, :]
        ws = tl.load(w_ptr + hh[:, None] * CI + ci[None, :], mask=wm, other=0.0).to(tl.float32) * k[:, None]
        tl.store(ws_ptr + hh[:, None] * CI + ci[None, :], ws.to(dt), mask=wm)
        for o0 in range(0, CO, BO):
            o = o0 + tl.arange(0, BO)
            om = (o < CO)[:, None] & hok[None, :]
            w2 = tl.load(w2_ptr + o[:, None] * R + hh[None, :], mask=om, other=0.0)
            tl.store(w2d_ptr + o[:, None] * R + hh[None, :], w2.to(dt), mask=om)


@triton.jit
def _bn_vec(gamma_ptr, beta_ptr, mean_ptr, var_ptr, vec_ptr, W, eps, sums_ptr, dgamma_ptr, dbeta_ptr, S, M,
            blk, SUMS: tl.constexpr, TRAINING: tl.constexpr, SB: tl.constexpr, BLOCK: tl.constexpr):
    c = blk * BLOCK + tl.arange(0, BLOCK)
    ok = c < W
    g = tl.load(gamma_ptr + c, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(beta_ptr + c, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(mean_ptr + c, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(var_ptr + c, mask=ok, other=1.0).to(tl.float32)
    r = 1.0 / tl.sqrt(v + eps)
    k = g * r
    tl.store(vec_ptr + 0 * W + c, r, mask=ok)
    tl.store(vec_ptr + 1 * W + c, k, mask=ok)
    tl.store(vec_ptr + 2 * W + c, b - m * k, mask=ok)
    if SUMS:
        rows = tl.arange(0, SB)
        sdb = tl.zeros((BLOCK,), tl.float32)
        sdg = tl.zeros((BLOCK,), tl.float32)
        for s0 in range(0, S, SB):
            s = s0 + rows
            msk = (s < S)[:, None] & ok[None, :]
            p = sums_ptr + s[:, None] * (2 * W) + c[None, :]
            sdb += tl.sum(tl.load(p, mask=msk, other=0.0), axis=0)
            sdg += tl.sum(tl.load(p + W, mask=msk, other=0.0), axis=0)
        tl.store(dbeta_ptr + c, sdb.to(dbeta_ptr.dtype.element_ty), mask=ok)
        tl.store(dgamma_ptr + c, sdg.to(dgamma_ptr.dtype.element_ty), mask=ok)
        if TRAINING:
            u = sdb * (-1.0 / M) * k
            w = sdg * (-1.0 / M) * k * r
        else:
            u = tl.zeros((BLOCK,), tl.float32)
            w = tl.zeros((BLOCK,), tl.float32)
        tl.store(vec_ptr + 3 * W + c, u, mask=ok)
        tl.store(vec_ptr + 4 * W + c, w, mask=ok)
        tl.store(vec_ptr + 5 * W + c, u - w * m, mask=ok)


@triton.jit
def _bn_terms_kernel(
    g1, b1, m1, v1, vec1, W1, g2, b2, m2, v2, vec2, W2, g3, b3, m3, v3, vec3, W3,  # per BatchNorm
    sums_ptr, dgamma_ptr, dbeta_ptr,  # the BatchNorm with SUMS: partials (S, 2, W); outputs (W)
    S, M, eps,
    SUMS1: tl.constexpr, SUMS2: tl.constexpr, SUMS3: tl.constexpr, TRAINING: tl.constexpr,
    SB: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (channel blocks, BatchNorms): r, k, t of each; u, w, c (and dbeta, dgamma) of the one with
    SUMS (module docstring)."""
    eps = fp32(eps)  # torch.compile passes floats as fp64 (_scalars.py)
    blk = tl.program_id(0)
    which = tl.program_id(1)
    if which == 0:
        _bn_vec(g1, b1, m1, v1, vec1, W1, eps, sums_ptr, dgamma_ptr, dbeta_ptr, S, M, blk, SUMS1, TRAINING,
                SB, BLOCK)
    elif which == 1:
        _bn_vec(g2, b2, m2, v2, vec2, W2, eps, sums_ptr, dgamma_ptr, dbeta_ptr, S, M, blk, SUMS2, TRAINING,
                SB, BLOCK)
    else:
        _bn_vec(g3, b3, m3, v3, vec3, W3, eps, sums_ptr, dgamma_ptr, dbeta_ptr, S, M, blk, SUMS3, TRAINING,
                SB, BLOCK)


@triton.jit
def _ffn_weights_finalize_kernel(
    red_ptr,  # fp32 sums over the shares: dW2 (CO, R) | G = dzn^T y (R, CI) | sum dzn (R)
    # | (DZZ) sum dzn z_hat (R)
    vec2, mean2_ptr,  # BN2's vectors (VEC_ROWS, R): r, k read; u, w written; its batch mean (R)
    mean_in, cov_in, kin_ptr, tin_ptr,  # the FFN input's statistics; AFFINE_IN: v = kin a + tin
    w1_ptr, ref_ptr,  # W1 (R, CI) as stored; ref: a tensor of the activation dtype (never read)
    dw1_ptr, dw2_ptr, dgamma_ptr, dbeta_ptr,  # outputs in the parameters' dtypes
    R, M, COLS, ROWS_OUT,
    CI: tl.constexpr, CPI: tl.constexpr, CO: tl.constexpr, BH: tl.constexpr, BJ: tl.constexpr,
    BO: tl.constexpr, AFFINE_IN: tl.constexpr, DZZ: tl.constexpr, TRAINING: tl.constexpr,
):
    """Program: BH hidden channels: BN2's backward terms, dW2[:, chunk], dW1[chunk] (module docstring).
    BN2's dgamma, sum dzn z_hat = r2 (rowsum(W1 * G) - m2 sum dzn): z = y W1^T (W1 rounded to the
    activation dtype, as the weights pass multiplies), so sum_m dzn z = sum_c W1[:, c] G[:, c]; DZZ: as
    the weights pass summed it."""
    hh = tl.program_id(0) * BH + tl.arange(0, BH)
    hok = hh < R
    off_g = CO * R
    off_s = CO * R + R * CI
    ci = tl.arange(0, CPI)
    cok = ci < CI
    dt = ref_ptr.dtype.element_ty
    w = _w_rows(w1_ptr, hh, hok, ci, cok, CI, dt)
    r2 = tl.load(vec2 + hh, mask=hok, other=0.0)
    k2 = tl.load(vec2 + R + hh, mask=hok, other=0.0)
    m2 = tl.load(mean2_ptr + hh, mask=hok, other=0.0)
    sdb = tl.load(red_ptr + off_s + hh, mask=hok, other=0.0)
    if DZZ:
        sdg = tl.load(red_ptr + off_s + R + hh, mask=hok, other=0.0)
    else:
        g = tl.load(red_ptr + off_g + hh[:, None] * CI + ci[None, :], mask=hok[:, None] & cok[None, :],
                    other=0.0)
        sdg = r2 * (tl.sum(w * g, axis=1) - m2 * sdb)
    tl.store(dbeta_ptr + hh, sdb.to(dbeta_ptr.dtype.element_ty), mask=hok)
    tl.store(dgamma_ptr + hh, sdg.to(dgamma_ptr.dtype.element_ty), mask=hok)
    mf = tl.cast(M, tl.float32)
    if TRAINING:
        u2 = sdb * (-1.0 / mf) * k2
        w2 = sdg * (-1.0 / mf) * k2 * r2
    else:
        u2 = tl.zeros((BH,), tl.float32)
        w2 = tl.zeros((BH,), tl.float32)
    tl.store(vec2 + 3 * R + hh, u2, mask=hok)
    tl.store(vec2 + 4 * R + hh, w2, mask=hok)
    for o0 in range(0, ROWS_OUT, BO):  # ROWS_OUT = CO at run time
        o = o0 + tl.arange(0, BO)
        msk = (o < CO)[:, None] & hok[None, :]
        d = tl.load(red_ptr + o[:, None] * R + hh[None, :], mask=msk, other=0.0)
        tl.store(dw2_ptr + o[:, None] * R + hh[None, :], d.to(dw2_ptr.dtype.element_ty), mask=msk)
    if TRAINING:
        mu = tl.load(mean_in + ci, mask=cok, other=0.0)
        if AFFINE_IN:
            kin = tl.load(kin_ptr + ci, mask=cok, other=0.0)
            mu = kin * mu + tl.load(tin_ptr + ci, mask=cok, other=0.0)
        wmu = tl.sum(w * mu[None, :], axis=1) - m2
    for j0 in range(0, COLS, BJ):  # COLS = CPI at run time: a loop, not unrolled (registers)
        cj = j0 + tl.arange(0, BJ)
        jok = cj < CI
        msk = hok[:, None] & jok[None, :]
        d = k2[:, None] * tl.load(red_ptr + off_g + hh[:, None] * CI + cj[None, :], mask=msk, other=0.0)
        if TRAINING:
            cov = tl.load(cov_in + ci[:, None] * CI + cj[None, :], mask=cok[:, None] & jok[None, :],
                          other=0.0)
            muj = tl.load(mean_in + cj, mask=jok, other=0.0)
            if AFFINE_IN:
                kj = tl.load(kin_ptr + cj, mask=jok, other=0.0)
                cov = cov * kin[:, None] * kj[None, :]
                muj = kj * muj + tl.load(tin_ptr + cj, mask=jok, other=0.0)
            a = tl.dot(w, cov, input_precision="tf32x3")  # (W1 Cov(v))[chunk, j block]
            d += mf * u2[:, None] * muj[None, :] + w2[:, None] * (mf * a + mf * wmu[:, None] * muj[None, :])
        tl.store(dw1_ptr + hh[:, None] * CI + cj[None, :], d.to(dw1_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _lerp(a, b, f):
    """torch.lerp's formula (exactly b at f = 1, the first step of a cumulative average)."""
    return tl.where(f < 0.5, a + f * (b - a), b - (b - a) * (1.0 - f))


@triton.jit
def _running(mean_ptr, var_ptr, rm_ptr, rv_ptr, nbt_ptr, W, rows, momentum, BLOCK: tl.constexpr):
    nbt = tl.load(nbt_ptr) + 1
    tl.store(nbt_ptr, nbt)
    f = tl.where(momentum < 0.0, 1.0 / nbt.to(tl.float32), momentum)
    unbiased = tl.cast(rows, tl.float32) / tl.cast(tl.maximum(rows - 1, 1), tl.float32)
    for c0 in range(0, W, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        ok = c < W
        rm = tl.load(rm_ptr + c, mask=ok, other=0.0)
        rv = tl.load(rv_ptr + c, mask=ok, other=0.0)
        bm = tl.load(mean_ptr + c, mask=ok, other=0.0).to(rm.dtype).to(tl.float32)
        bv = (tl.load(var_ptr + c, mask=ok, other=0.0) * unbiased).to(rv.dtype).to(tl.float32)
        rmf = rm.to(tl.float32)
        rvf = rv.to(tl.float32)
        tl.store(rm_ptr + c, _lerp(rmf, bm, f).to(rm.dtype), mask=ok)
        tl.store(rv_ptr + c, _lerp(rvf, bv, f).to(rv.dtype), mask=ok)


@triton.jit
def _bn_running_kernel(
    mean1, var1, rm1, rv1, nbt1, W1, rows1, mom1,
    mean2, var2, rm2, rv2, nbt2, W2, rows2, mom2,
    mean3, var3, rm3, rv3, nbt3, W3, rows3, mom3,
    BLOCK: tl.constexpr,
):
    """Program b: BatchNorm b's running statistics and num_batches_tracked, in place (module docstring)."""
    mom1, mom2, mom3 = fp32(mom1), fp32(mom2), fp32(mom3)  # fp64 under torch.compile
    which = tl.program_id(0)
    if which == 0:
        _running(mean1, var1, rm1, rv1, nbt1, W1, rows1, mom1, BLOCK)
    elif which == 1:
        _running(mean2, var2, rm2, rv2, nbt2, W2, rows2, mom2, BLOCK)
    else:
        _running(mean3, var3, rm3, rv3, nbt3, W3, rows3, mom3, BLOCK)
