"""The SE step of the fused MBConv training backward on (N, R) vectors: ``se_backward``
(backward_reference.se_backward_reference states its math; same signature, without ``_reference``).
From the per-image sums gsum = sum_hw g and dgate = sum_hw dq g (gate_backward.dgate_pool):

    pool = gsum / HW      s = pool W_se1^T + b_se1      gate = sigmoid(ReLU(s) W_se2^T + b_se2)
    dt = dgate gate (1 - gate)      dW_se2 = dt^T ReLU(s), db_se2 = sum_n dt
    ds = (dt W_se2) [s > 0]         dW_se1 = ds^T pool,    db_se1 = sum_n ds      dpix = ds W_se1 / HW

Six products of N x R x S (Small, batch 128: 128 x 1024 x 64, 50 M MACs in all), so the launches are
sized for parallelism and for each weight being read by few programs (W_se1 and W_se2 are 256 KB in fp32:
a program that walked all of R would read them whole). The chain has two reductions over R (s and ds)
and the weight gradients reduce over N, so three launches, the first two on tiles of BN images x RC
channels:

* ``_s_partials_kernel`` (groups x chunks): the chunk's part of s, pool_chunk W_se1[:, chunk]^T, written
  to (chunks, N, SP) partials (rows padded to SP = S rounded up to a power of two: aligned loads).
* ``_gate_kernel`` (groups x chunks): s = b_se1 + the partials (chunk 0's programs write it, (N, SP));
  the chunk's gate (written) and dt; the chunk's part of dt W_se2 to (chunks, N, SP) partials.
* ``_grad_kernel`` (one program per tile index, each with a tile of both kinds): a dpix tile (BN images
  x RC channels: ds = the partials' sum masked by s > 0, times W_se1's chunk) and a weight-gradient tile
  (SC columns of S x RW channels: dW_se1 and dW_se2 over all images, NW at a time in image order, ds
  re-summed from the partials for its SC columns, dt recomputed from gate and dgate; the first column
  of tiles writes db_se1, the first row db_se2). At Small 128 dpix tiles (8 x 16) and 64 weight tiles
  (4 x 16).

The partials are summed from one load of all chunks (tl.sum over the chunk axis: a fixed tree) and every
other sum runs in a fixed order (no atomics): two identical calls give equal bits. All in fp32: the
products by ``tl.dot`` with input_precision "ieee" (FMA, no tensor cores: the operands are fp32 and the
work is small; tf32x3 on mma.sync estimated slower, its operand splits and layout changes), the sigmoid
in the exact form of _activations (exp2 and a division).

Chunks of RC = 64 channels: at 128 the gate and gradient launches took 255 registers and 80 and 64 B of
stack with Triton 3.6 (the GPU image's) at Small's R = 1024, S = 64 (Triton 3.8: 128-175 registers, no
stack); at 64 they take 117 and 165 (3.6) and 64 and 176 (3.8), no stack. Below sm_90 RC_SM80 = 128.
Static estimate (sm_90, Small, batch 128, fp32 master weights; us, low-high, with one graph launch gap
each; Triton 3.8): 3.0-3.7, 4.2-5.4 and 11.2-11.7, together 18.4-20.8 against 21.3-23.2 at RC = 128
(Triton 3.6: 27.1-28.9 against 24.2-28.3 with the spills), all latency- or L1-bound; the 17 aten ops this
replaces were counted at one launch gap each (~1.3 us): 21/23 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._activations import sigmoid
from .._cost import KernelCost, Loop
from .._launch import MAXNREG, cdiv, device_info, launch, next_power_of_2
from .._scalars import fp32

BN = 16  # images per tile (the dots' M; 16 is their least)
RC = 64  # channels per chunk of the chain (one s and one ds partial per chunk; module docstring)
RC_SM80 = 128  # below sm_90 (the A100's static estimate: 64 took 42-47 us against 26 at Small's R = 1024)
SC = 16  # S columns per weight-gradient tile
RW = 64  # channels per weight-gradient tile
NW = 32  # images per step of a weight-gradient tile (its shared memory, the dots' layout changes, grows
# with NW: 104 KB at 32, 208 KB at 64, past the A100's 163 KB)
WARPS = 8
# s's partials and the gate launch compiled with maxnreg (_launch.MAXNREG): left to ptxas (Triton 3.8) they
# waited on fewer loads at a time. Static estimate, Small's 36 MBConv training blocks, batch 128, high end:
# 0.132 -> 0.100 and 0.195 -> 0.172 ms on sm_90 (Triton 3.6 0.135 -> 0.098, the gate's unchanged; sm_80
# unchanged), no stack
LIMITED = dict(maxnreg=MAXNREG)
PREC = "ieee"  # fp32 products on the FMA pipe


@triton.jit
def _chain_tile(N, R, S, BN: tl.constexpr, RC: tl.constexpr, SP: tl.constexpr):
    """Program (g, c) of the chain's two launches: (c, the group's images n, the chunk's channels r, the
    S columns j padded to SP, and their masks)."""
    c = tl.program_id(1)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = c * RC + tl.arange(0, RC)
    j = tl.arange(0, SP)
    return c, n, r, j, n < N, r < R, j < S


@triton.jit
def _s_partials_kernel(gsum_ptr, w1_ptr, part_ptr, N, R, S, hw, BN: tl.constexpr, RC: tl.constexpr,
                       SP: tl.constexpr,
                       PREC: tl.constexpr):
    """Program (g, c): part[c, n, :] = (gsum[n, chunk] / hw) W_se1[:, chunk]^T for the group's images."""
    hw = fp32(hw)  # torch.compile passes floats as fp64 (_scalars.py)
    c, n, r, j, n_ok, r_ok, j_ok = _chain_tile(N, R, S, BN, RC, SP)
    pool = tl.load(gsum_ptr + n[:, None] * R + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0) / hw
    w1t = tl.load(w1_ptr + j[None, :] * R + r[:, None], mask=r_ok[:, None] & j_ok[None, :],
                  other=0.0).to(tl.float32)
    s = tl.dot(pool, w1t, input_precision=PREC)
    tl.store(part_ptr + (c * N + n[:, None]) * SP + j[None, :], s, mask=n_ok[:, None])


@triton.jit
def _dt(dgate, gate):
    """The gate's pre-activation gradient, dgate gate (1 - gate), in one order for both launches."""
    return dgate * gate * (1.0 - gate)


@triton.jit
def _partials(part_ptr, n, j, n_ok, N, SP: tl.constexpr, CH: tl.constexpr, CHP: tl.constexpr):
    """sum over the CH chunks of part[c, n, j] (rows of SP: one load of all of them, summed in a fixed
    tree)."""
    c = tl.arange(0, CHP)
    ok = (c < CH)[:, None, None] & n_ok[None, :, None] & (j >= 0)[None, None, :]
    off = (c[:, None, None] * N + n[None, :, None]) * SP + j[None, None, :]
    v = tl.load(part_ptr + off, mask=ok, other=0.0)
    return tl.sum(v, axis=0)


@triton.jit
def _gate_kernel(dgate_ptr, b1_ptr, w2_ptr, b2_ptr, spart_ptr, s_ptr, gate_ptr, dspart_ptr, N, R, S,
                 CH: tl.constexpr, CHP: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr, SP: tl.constexpr,
                 PREC: tl.constexpr):
    """Program (g, c): s of the group's images (chunk 0 writes it), the chunk's gate (written) and
    dspart[c, n, :] = dt_chunk W_se2[chunk, :]."""
    c, n, r, j, n_ok, r_ok, j_ok = _chain_tile(N, R, S, BN, RC, SP)
    nj = n_ok[:, None] & j_ok[None, :]
    nr = n_ok[:, None] & r_ok[None, :]
    s = _partials(spart_ptr, n, j, n_ok, N, SP, CH, CHP)
    s += tl.load(b1_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    if c == 0:
        tl.store(s_ptr + n[:, None] * SP + j[None, :], s, mask=n_ok[:, None])
    act = tl.where(nj, tl.maximum(s, 0.0), 0.0)
    w2 = tl.load(w2_ptr + r[:, None] * S + j[None, :], mask=r_ok[:, None] & j_ok[None, :],
                 other=0.0).to(tl.float32)
    z = tl.dot(act, tl.trans(w2), input_precision=PREC)
    z += tl.load(b2_ptr + r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
    gate = sigmoid(z, False)
    tl.store(gate_ptr + n[:, None] * R + r[None, :], gate, mask=nr)
    dgate = tl.load(dgate_ptr + n[:, None] * R + r[None, :], mask=nr, other=0.0)
    dt = _dt(dgate, gate)
    ds = tl.dot(dt, w2, input_precision=PREC)
    tl.store(dspart_ptr + (c * N + n[:, None]) * SP + j[None, :], ds, mask=n_ok[:, None])


@triton.jit
def _grad_kernel(gsum_ptr, dgate_ptr, w1_ptr, s_ptr, gate_ptr, dspart_ptr, dpix_ptr, dw1_ptr, db1_ptr,
                 dw2_ptr, db2_ptr, N, R, S, hw, PIX_TILES, W_TILES, CH: tl.constexpr, CHP: tl.constexpr,
                 BN: tl.constexpr, RC: tl.constexpr, SP: tl.constexpr, SCH: tl.constexpr, SC: tl.constexpr,
                 RW: tl.constexpr, NW: tl.constexpr, PREC: tl.constexpr):
    """Program t: dpix tile t (group t // CH, chunk t % CH) if t < PIX_TILES, and weight tile t
    (S columns (t % SCH) SC ..., channels (t // SCH) RW ...) if t < W_TILES; a tile past its count runs
    masked (no stores)."""
    hw = fp32(hw)  # torch.compile passes floats as fp64 (_scalars.py)
    t = tl.program_id(0)
    # dpix tile: ds of the group's images (partials in chunk order, masked by s > 0), times W_se1's chunk
    n = (t // CH) * BN + tl.arange(0, BN)
    r = (t % CH) * RC + tl.arange(0, RC)
    j = tl.arange(0, SP)
    n_ok = (n < N) & (t < PIX_TILES)
    r_ok = r < R
    j_ok = j < S
    ds = _partials(dspart_ptr, n, j, n_ok, N, SP, CH, CHP)
    s = tl.load(s_ptr + n[:, None] * SP + j[None, :], mask=n_ok[:, None], other=0.0)
    ds = tl.where(s > 0.0, ds, 0.0)
    w1 = tl.load(w1_ptr + j[:, None] * R + r[None, :], mask=j_ok[:, None] & r_ok[None, :],
                 other=0.0).to(tl.float32)
    dpix = tl.dot(ds, w1, input_precision=PREC) / hw
    tl.store(dpix_ptr + n[:, None] * R + r[None, :], dpix, mask=n_ok[:, None] & r_ok[None, :])

    # weight-gradient tile: over all images, NW at a time in image order
    a = t % SCH
    b = t // SCH
    w_ok = t < W_TILES
    jw = a * SC + tl.arange(0, SC)
    rw = b * RW + tl.arange(0, RW)
    jw_ok = (jw < S) & w_ok
    rw_ok = (rw < R) & w_ok
    dw1 = tl.zeros((SC, RW), dtype=tl.float32)
    dw2 = tl.zeros((RW, SC), dtype=tl.float32)
    db1 = tl.zeros((SC,), dtype=tl.float32)
    db2 = tl.zeros((RW,), dtype=tl.float32)
    for m0 in range(0, N, NW):
        m = m0 + tl.arange(0, NW)
        m_ok = (m < N) & w_ok
        mr = m_ok[:, None] & rw_ok[None, :]
        dsw = _partials(dspart_ptr, m, jw, m_ok, N, SP, CH, CHP)
        sw = tl.load(s_ptr + m[:, None] * SP + jw[None, :], mask=m_ok[:, None], other=0.0)
        dsw = tl.where(sw > 0.0, dsw, 0.0)
        act = tl.maximum(sw, 0.0)
        pool = tl.load(gsum_ptr + m[:, None] * R + rw[None, :], mask=mr, other=0.0) / hw
        gate = tl.load(gate_ptr + m[:, None] * R + rw[None, :], mask=mr, other=0.0)
        dt = _dt(tl.load(dgate_ptr + m[:, None] * R + rw[None, :], mask=mr, other=0.0), gate)
        dw1 = tl.dot(tl.trans(dsw), pool, dw1, input_precision=PREC)
        dw2 = tl.dot(tl.trans(dt), act, dw2, input_precision=PREC)
        db1 += tl.sum(dsw, axis=0)
        db2 += tl.sum(dt, axis=0)
    tl.store(dw1_ptr + jw[:, None] * R + rw[None, :], dw1, mask=jw_ok[:, None] & rw_ok[None, :])
    tl.store(dw2_ptr + rw[:, None] * S + jw[None, :], dw2, mask=rw_ok[:, None] & jw_ok[None, :])
    tl.store(db1_ptr + jw, db1, mask=jw_ok & (b == 0))
    tl.store(db2_ptr + rw, db2, mask=rw_ok & (a == 0))


# ---------------------------------------------------------------------------------------------- launcher


def _matrix(name: str, w: torch.Tensor, rows: int, cols: int) -> None:
    """A 1x1 conv weight as (rows, cols) or (rows, cols, 1, 1), fp32 or 16-bit, contiguous."""
    ok = tuple(w.shape) in ((rows, cols), (rows, cols, 1, 1))
    if not ok or w.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not w.is_contiguous():
        raise ValueError(f"se_backward: {name} must be contiguous ({rows}, {cols}) or ({rows}, {cols}, 1, 1) "
                         f"fp32/fp16/bf16, got {tuple(w.shape)} {w.dtype}")


def _check(gsum, dgate, w_se1, b_se1, w_se2, b_se2, hw) -> tuple[int, int, int]:
    """(N, R, S); shapes, dtypes, devices and contiguity before any launch (one ValueError line)."""
    if gsum.dim() != 2 or gsum.dtype != torch.float32 or not gsum.is_contiguous():
        raise ValueError(f"se_backward: gsum must be contiguous (N, R) fp32, got {tuple(gsum.shape)} "
                         f"{gsum.dtype}")
    n, r = gsum.shape
    if tuple(dgate.shape) != (n, r) or dgate.dtype != torch.float32 or not dgate.is_contiguous():
        raise ValueError(f"se_backward: dgate must be contiguous ({n}, {r}) fp32 like gsum, got "
                         f"{tuple(dgate.shape)} {dgate.dtype}")
    if w_se1.dim() not in (2, 4):
        raise ValueError(f"se_backward: w_se1 must be (S, R) or (S, R, 1, 1), got {tuple(w_se1.shape)}")
    s = w_se1.shape[0]
    _matrix("w_se1", w_se1, s, r)
    _matrix("w_se2", w_se2, r, s)
    for name, b, k in (("b_se1", b_se1, s), ("b_se2", b_se2, r)):
        if tuple(b.shape) != (k,) or b.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"se_backward: {name} must be ({k},) fp32/fp16/bf16, got {tuple(b.shape)} "
                             f"{b.dtype}")
    if isinstance(hw, bool) or not isinstance(hw, int) or hw < 1:
        raise ValueError(f"se_backward: hw must be a positive int (pixels per image), got {hw!r}")
    if n < 1 or s < 1 or n * max(r, s) * cdiv(r, RC) >= 2**31:
        raise ValueError(f"se_backward: N = {n}, R = {r}, S = {s} out of range")
    if any(t.device != gsum.device for t in (dgate, w_se1, b_se1, w_se2, b_se2)):
        raise ValueError("se_backward: all tensors must be on gsum's device")
    return n, r, s


def se_backward(gsum: torch.Tensor, dgate: torch.Tensor, w_se1: torch.Tensor, b_se1: torch.Tensor,
                w_se2: torch.Tensor, b_se2: torch.Tensor, hw: int) -> tuple[torch.Tensor, ...]:
    """(gate (N, R), dpix (N, R), dW_se1, db_se1 (S,), dW_se2, db_se2 (R,)), fp32 and each in memory of its
    own; the weight gradients in the weights' shapes. gsum, dgate: (N, R) fp32 per-image sums
    (dgate_pool); w_se1 (S, R), w_se2 (R, S) (or with trailing 1 x 1) and the biases, fp32 or 16-bit;
    hw: pixels per image. Three launches (module docstring)."""
    n, r, s = _check(gsum, dgate, w_se1, b_se1, w_se2, b_se2, hw)
    dev = gsum.device
    f32 = dict(device=dev, dtype=torch.float32)
    sp = max(16, next_power_of_2(s))
    rc = RC if device_info(dev).arch >= 90 else RC_SM80
    groups, chunks = cdiv(n, BN), cdiv(r, rc)
    sch = cdiv(s, SC)
    pix_tiles, w_tiles = groups * chunks, sch * cdiv(r, RW)
    spart = torch.empty((chunks, n, sp), **f32)  # rows padded to SP (aligned; the padding holds zeros)
    dspart = torch.empty((chunks, n, sp), **f32)
    s_val = torch.empty((n, sp), **f32)
    gate = torch.empty((n, r), **f32)
    dpix = torch.empty((n, r), **f32)
    dw1 = torch.empty(w_se1.shape, **f32)
    dw2 = torch.empty(w_se2.shape, **f32)
    db1 = torch.empty((s,), **f32)
    db2 = torch.empty((r,), **f32)
    hwf = float(hw)
    web = w_se1.element_size()
    vec, part = n * r * 4, chunks * n * sp * 4
    launch(_s_partials_kernel, (groups, chunks), gsum, w_se1, spart, n, r, s, hwf,
           cost=lambda: KernelCost(n * r * s, 0, vec + r * s * web + part, (),
                                   l2_bytes=(groups - 1) * r * s * web,
                                   note="SE backward: s's partials over channel chunks"),
           BN=BN, RC=rc, SP=sp, PREC=PREC, num_warps=WARPS, **LIMITED)
    chp = next_power_of_2(chunks)
    launch(_gate_kernel, (groups, chunks), dgate, b_se1, w_se2, b_se2, spart, s_val, gate, dspart, n, r, s,
           cost=lambda: KernelCost(2 * n * r * s, 0, 2 * vec + r * s * web + (r + s) * 4 + n * sp * 4 + part,
                                   (),
                                   l2_bytes=chunks * part + (groups - 1) * r * s * web,
                                   l2_footprint_bytes=part,
                                   note="SE backward: s, the gate, ds's partials over channel chunks"),
           CH=chunks, CHP=chp, BN=BN, RC=rc, SP=sp, PREC=PREC, num_warps=WARPS, **LIMITED)
    launch(_grad_kernel, (max(pix_tiles, w_tiles),), gsum, dgate, w_se1, s_val, gate, dspart, dpix, dw1, db1,
           dw2, db2, n, r, s, hwf, pix_tiles, w_tiles,
           cost=lambda: _grad_cost(n, r, s, sp, web, chunks, groups, sch),
           CH=chunks, CHP=chp, BN=BN, RC=rc, SP=sp, SCH=sch, SC=SC, RW=RW, NW=NW, PREC=PREC, num_warps=WARPS)
    return gate, dpix, dw1, db1, dw2, db2


def _grad_cost(n: int, r: int, s: int, sp: int, web: int, chunks: int, groups: int, sch: int) -> KernelCost:
    """gsum, dgate and W_se1 once from DRAM, their re-reads (gsum and dgate by each column of weight tiles,
    W_se1's chunks by every group) from L2; gate, s and ds's partials (the launch before wrote them) from
    L2: the partials and s by every dpix tile of a group (all S) and every weight tile of a channel range
    (SC columns), gate by each column of weight tiles; dpix and the weight gradients written."""
    vec, part, sv = n * r * 4, chunks * n * sp * 4, n * sp * 4
    rtiles = cdiv(r, RW)
    dram = 2 * vec + r * s * web + vec + 2 * r * s * 4 + (r + s) * 4
    l2 = (chunks + rtiles) * (part + sv) + sch * vec + (sch - 1) * 2 * vec + (groups - 1) * r * s * web
    return KernelCost(3 * n * r * s, 0, dram,
                      (Loop("image steps", cdiv(n, NW)),),
                      l2_bytes=l2, l2_footprint_bytes=3 * vec + part + sv,
                      note="SE backward: dpix, dW_se1, dW_se2 and the biases' gradients")
