"""The stride-2 passes of the fused MBConv training backward that go through BlurPool (backward_reference.py
states their math; same signatures, without ``_reference``): ``blur_gate_input`` (g = BlurPool(SiLU(v_d))
from the grouped conv's raw output d), ``blur_bn_d_sums`` and ``blur_bn_d_backward`` (BN_d's backward of
dy = Blur^T(dg) SiLU'(v_d)). v_d = gamma_d u_hat + beta_d = a d + b, u_hat, SiLU and SiLU' are recomputed
from d in fp32 per element; every sum runs in fp32.

BlurPool is timm's BlurPool2d: [1, 2, 1] x [1, 2, 1] / 16, stride 2, reflect padding of one pixel
(``reflect`` of the ConvFirst training kernels: -1 -> 1, H -> H - 2), H x W -> HO x WO = ceil(H / 2) x
ceil(W / 2). Its transpose is a gather (no atomics): input pixel (i, j) receives f[dh] f[dw] / 16 dg(oh, ow)
from every output pixel whose tap (dh, dw) reads it after the reflection, oh in {i // 2, i // 2 + 1} and
ow in {j // 2, j // 2 + 1}: four candidates, those of weight 0 (or past HO, WO) masked off.

Kernels (all tensors 2-D row-major (pixels, channels) views of NHWC maps):

* ``_blur_gate_kernel``: per tile of BM consecutive output pixels (of the flat N HO WO; a tile may straddle
  rows and images: every pixel finds its own (n, oh, ow)), the nine taps of d, SiLU(a d + b) of each
  (computed 9 times per output, 2.25 times per input pixel), the weighted sum rounded once to d's dtype.
* ``_blur_bn_d_kernel`` with a ``MODE`` constexpr, per tile of BM pixels of one image row (ceil(W / BM)
  tiles per row, BM lowered to a power of two >= W for narrow maps), so that the row i, its two row
  candidates and their weights are scalars and an even row, which has one, skips the other's two loads:
  the gather of dg, dy = Blur^T(dg) SiLU'(v). MODE 0: per program the partial sums of dy and dy u_hat over
  its pixels (elementwise [BM, RB] fp32 accumulators over the tiles, summed over the pixels once at the
  end), written as row ``group`` of a (groups, 2, R) fp32 buffer and merged over the groups in a fixed
  order by the weight gradients' reduction (gconv.launcher.reduce_partials, ``out2``: sum dy and sum dy
  u_hat from one launch; no atomics: two calls give equal bits). MODE 1: dd = gamma rho (dy - sum dy / P
  - u_hat sum(dy u_hat) / P) in d's dtype.

Grid: program (c, s) = channel chunk c of RB channels (RB_GATE for g; the fast axis) x group s of PER
consecutive tiles, about PROGRAMS_PER_SM programs per SM, each looping over its tiles. Tiles are [BM
pixels, RB channels] with the channels contiguous (16-byte loads and stores: R a multiple of 8 in 16-bit
data keeps the row starts aligned; EVEN_C (R a multiple of RB) drops the channel masks).

Loads. Each program's tile loop is software-pipelined (``tl.range(num_stages=NS_GATE / NS_BN_D)``, three
stages): the next two tiles' loads are in flight while one tile is computed. Triton issues them as 16-byte
cp.async, which on sm_90 is always ``.cg`` (LDGSTS.E.BYPASS: L2 only, tests/kernels/test_mbconv_blur_backward
.py checks it), so the taps' overlapping windows come from L2, not L1, and the cost declarations count
every tap as L2 traffic (no L1 working set). The second row candidates of the transpose are masked, not
branched over (an odd row's weights; the pipeliner takes no loads under a branch). Plain L1-allocating
loads (the form before) kept the taps' re-reads in L1, but each tile waited for its loads: the static
model's exposed waits were most of each launch.

As compiled (sm_90, fp16, Small at 256 x 256, batch 128; the static estimate of ``convfirstnet kernels``'
machinery, low-high, not a measurement; plain loads -> pipelined)

    block, launch                 regs   grid      estimate (us)               bound
    stages.3.0 (32x32, R = 384)
      blur_gate_input               64   6 x 86    132.0-198.1 -> 77.6- 82.0   latency
      blur_bn_d_sums (MODE 0)      128   3 x 175   152.6-230.0 -> 87.5- 92.3   latency
      blur_bn_d_backward (MODE 1)   96   3 x 175   274.7-452.2 -> 101.6-107.5  latency
    stages.4.0 (16x16, R = 1024)
      blur_gate_input                    16 x 32    -> 52.8-56.1
      blur_bn_d_sums (MODE 0)            8 x 64     -> 58.8-62.4
      blur_bn_d_backward (MODE 1)        8 x 64     -> 75.2-80.0

No stack in any; 36-41 KB of shared memory for the stages (4-6 programs per SM). The L2 term rises
(stages.3.0 MODE 1: 31-46 -> 62-91 us) and stays under the latency term. MODE 0 issues ~26 instructions
per element (five loads converted to fp32, the gather's FFMAs, sigmoid's FMUL, MUFU.EX2, FADD, MUFU.RCP,
SiLU', u_hat, two accumulators).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._activations import sigmoid
from .._cost import KernelCost, Loop
from .._launch import cdiv, device_info, launch, next_power_of_2
from .._scalars import fp32
from ..convfirst_train.kernel import reflect
from ..gconv.launcher import reduce_partials
from .gate_backward import bn_d_affine
from .launcher import kernel_settings

BM = 16  # pixels per tile
RB = 128  # channels per chunk of the BN_d passes (256 bytes of a 16-bit pixel row: 16 lanes x 16 B)
RB_GATE = 64  # channels per chunk of blur_gate_input
WARPS = 4
NS_GATE = 3  # pipeline stages of the tile loops (module docstring: Loads)
NS_BN_D = 3
PROGRAMS_PER_SM = 4
MIN_TILES = 2  # the fewest tiles per program (each program loops over several)
MERGE_GROUPS = 16  # groups per step of the partials' merge
MERGE_BLOCK = 256  # elements of the (2, R) result per merge program


@triton.jit
def _transpose_weights(i, H: tl.constexpr):
    """(w0, w1): the weights along an axis of size H with which pixel i gathers from outputs i // 2 and
    i // 2 + 1, f[dh] / 4 summed over the taps dh that read i after reflect. Even i: tap 1 of i / 2 (1/2).
    Odd i: tap 2 of i // 2 (1/4; i = 1 also tap 0 of output 0, reflected from -1: 1/2) and tap 0 of
    i // 2 + 1 (1/4; i = H - 2, H odd, also its tap 2, reflected from H: 1/2) where i + 1 < H (else past
    HO). Checked against the reflect gather for H = 2 ... 40 in the tests."""
    odd = (i % 2) == 1
    w0 = tl.where(odd, tl.where(i == 1, 0.5, 0.25), 0.5)
    w1 = tl.where(odd & (i + 1 < H), tl.where(i == H - 2, 0.5, 0.25), 0.0)
    return w0, w1


@triton.jit
def _blur_gate_kernel(d_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, g_ptr, R, MO, TILES, PER,
                      H: tl.constexpr, W: tl.constexpr, RB: tl.constexpr, BM: tl.constexpr,
                      EVEN_C: tl.constexpr, FAST: tl.constexpr, NS: tl.constexpr):
    """Program (c, s): g = BlurPool(SiLU(a d + b)) of channels c RB ... (c + 1) RB - 1 for the output pixels
    of tiles s PER ... (s + 1) PER - 1 (MO = N HO WO output pixels, TILES tiles of BM)."""
    HO: tl.constexpr = (H + 1) // 2
    WO: tl.constexpr = (W + 1) // 2
    c = tl.program_id(0) * RB + tl.arange(0, RB)
    s = tl.program_id(1)
    c_ok = c < R
    _, _, a, b = bn_d_affine(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, c, c_ok)
    a = a[None, :]
    b = b[None, :]
    t0 = s * PER
    for t in tl.range(t0, tl.minimum(t0 + PER, TILES), num_stages=NS):
        rows = t * BM + tl.arange(0, BM)
        rok = rows < MO
        n = rows // (HO * WO)
        q = rows % (HO * WO)
        oh = q // WO
        ow = q % WO
        m = rok[:, None]
        if not EVEN_C:
            m = m & c_ok[None, :]
        acc = tl.zeros((BM, RB), dtype=tl.float32)
        for dh in tl.static_range(3):
            r = reflect(2 * oh + dh - 1, H)
            for dw in tl.static_range(3):
                col = reflect(2 * ow + dw - 1, W)
                wgt = (2 - (dh - 1) * (dh - 1)) * (2 - (dw - 1) * (dw - 1)) / 16.0
                x = tl.load(d_ptr + ((n * H + r) * W + col)[:, None] * R + c[None, :], mask=m, other=0.0)
                v = x.to(tl.float32) * a + b
                acc += wgt * (v * sigmoid(v, FAST))
        tl.store(g_ptr + rows[:, None] * R + c[None, :], acc.to(g_ptr.dtype.element_ty), mask=m)


@triton.jit
def _blur_bn_d_kernel(dg_ptr, d_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, s0_ptr, s1_ptr, out_ptr,
                      R, TILES, PER, inv_p, H: tl.constexpr, W: tl.constexpr, MODE: tl.constexpr,
                      RB: tl.constexpr, BM: tl.constexpr, EVEN_C: tl.constexpr, FAST: tl.constexpr,
                      NS: tl.constexpr):
    """Program (c, s): channels c RB ... (c + 1) RB - 1 of the input pixels of tiles s PER ... (s + 1) PER - 1
    (TILES = N H ceil(W / BM) segments of BM pixels of an image row, masked past W). dy = Blur^T(dg)
    SiLU'(a d + b). MODE 0: out = the partials (groups, 2, R), row s: sum dy, sum dy u_hat over the
    program's pixels (s0, s1 unused). MODE 1: s0, s1 = sum dy, sum dy u_hat (R,); out = dd (N H W, R). A
    masked pixel or channel gathers dg = 0, so dy = 0."""
    inv_p = fp32(inv_p)  # torch.compile passes floats as fp64 (_scalars.py)
    HO: tl.constexpr = (H + 1) // 2
    WO: tl.constexpr = (W + 1) // 2
    c = tl.program_id(0) * RB + tl.arange(0, RB)
    s = tl.program_id(1)
    c_ok = c < R
    mean, rstd, a, b = bn_d_affine(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, c, c_ok)
    a = a[None, :]
    b = b[None, :]
    mr = (mean * rstd)[None, :]
    rs = rstd[None, :]
    if MODE == 0:
        acc_dy = tl.zeros((BM, RB), dtype=tl.float32)
        acc_dyu = tl.zeros((BM, RB), dtype=tl.float32)
    else:
        sum_dy = (tl.load(s0_ptr + c, mask=c_ok, other=0.0) * inv_p)[None, :]
        sum_dyu = (tl.load(s1_ptr + c, mask=c_ok, other=0.0) * inv_p)[None, :]
    TPR: tl.constexpr = (W + BM - 1) // BM  # tiles per image row
    t0 = s * PER
    for t in tl.range(t0, tl.minimum(t0 + PER, TILES), num_stages=NS):
        g = t // TPR  # the image row n H + i: i, its two row candidates and their weights are scalars
        i = g % H
        j = (t % TPR) * BM + tl.arange(0, BM)
        rows = g * W + j
        m = (j < W)[:, None]
        if not EVEN_C:
            m = m & c_ok[None, :]
        wr0, wr1 = _transpose_weights(i, H)
        wc0, wc1 = _transpose_weights(j, W)
        src = dg_ptr + ((g // H * HO + i // 2) * WO + j // 2)[:, None] * R + c[None, :]
        # Blur^T(dg): the candidates (oh, ow) = (i // 2 + eh, j // 2 + ew), weight 0 masking the load; an
        # even row has no second row candidate (wr1 = 0: its two loads masked off, not branched over, since
        # the pipeliner takes no loads under a branch)
        gy = (wr0 * wc0)[:, None] * tl.load(src, mask=m, other=0.0).to(tl.float32)
        gy += (wr0 * wc1)[:, None] * tl.load(src + R, mask=m & (wc1 > 0.0)[:, None], other=0.0).to(tl.float32)
        m1 = m & (wr1 + 0.0 * j > 0.0)[:, None]  # wr1 broadcast first (the interpreter)
        gy += (wr1 * wc0)[:, None] * tl.load(src + WO * R, mask=m1, other=0.0).to(tl.float32)
        gy += (wr1 * wc1)[:, None] * tl.load(src + (WO + 1) * R, mask=m1 & (wc1 > 0.0)[:, None],
                                             other=0.0).to(tl.float32)
        x = tl.load(d_ptr + rows[:, None] * R + c[None, :], mask=m, other=0.0).to(tl.float32)
        v = x * a + b
        sg = sigmoid(v, FAST)
        dy = gy * (sg + v * sg * (1.0 - sg))  # SiLU'(v) = s (1 + v (1 - s))
        u_hat = x * rs - mr
        if MODE == 0:
            acc_dy += dy
            acc_dyu += dy * u_hat
        else:
            dd = a * (dy - sum_dy - u_hat * sum_dyu)
            tl.store(out_ptr + rows[:, None] * R + c[None, :], dd.to(out_ptr.dtype.element_ty), mask=m)
    if MODE == 0:
        tl.store(out_ptr + s * 2 * R + c, tl.sum(acc_dy, axis=0), mask=c_ok)
        tl.store(out_ptr + s * 2 * R + R + c, tl.sum(acc_dyu, axis=0), mask=c_ok)


# ---------------------------------------------------------------------------------------------- launchers


def _check(op: str, d, mean_d, rstd_d, gamma_d, beta_d, n, h, w, dg=None, sums=()) -> None:
    """Shapes, dtypes, devices and contiguity, before any launch (one ValueError line)."""
    def bad(msg: str):
        raise ValueError(f"blur_backward.{op}: {msg}")

    if d.dim() != 2 or d.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        bad(f"d must be 2-D (P, R) fp32/fp16/bf16, got {tuple(d.shape)} {d.dtype}")
    p, r = d.shape
    if not all(isinstance(v, int) for v in (n, h, w)) or n < 1 or h < 2 or w < 2:
        bad(f"n, h, w must be ints, n >= 1 and h, w >= 2 (reflect padding), got {n}, {h}, {w}")
    if p != n * h * w or r < 1:
        bad(f"d must be ({n} x {h} x {w}, R) pixels, got {tuple(d.shape)}")
    if p * r >= 2**31:
        bad(f"{p} x {r} elements: past the kernels' 32-bit offsets")
    if dg is not None:
        mo = n * ((h + 1) // 2) * ((w + 1) // 2)
        if tuple(dg.shape) != (mo, r) or dg.dtype != d.dtype:
            bad(f"dg must be ({mo}, {r}) {d.dtype}, got {tuple(dg.shape)} {dg.dtype}")
    for name, t in (("mean_d", mean_d), ("rstd_d", rstd_d), *(("sums", s) for s in sums)):
        if tuple(t.shape) != (r,) or t.dtype != torch.float32:
            bad(f"{name} must be ({r},) fp32, got {tuple(t.shape)} {t.dtype}")
    for name, t in (("gamma_d", gamma_d), ("beta_d", beta_d)):
        if tuple(t.shape) != (r,) or t.dtype not in (torch.float32, d.dtype):
            bad(f"{name} must be ({r},) fp32 or {d.dtype}, got {tuple(t.shape)} {t.dtype}")
    ts = [d, mean_d, rstd_d, gamma_d, beta_d, *([dg] if dg is not None else []), *sums]
    if any(t.device != d.device for t in ts):
        bad("all tensors must be on d's device")
    if not all(t.is_contiguous() for t in ts):
        bad("every tensor must be contiguous (row-major)")


def _geometry(tiles: int, r: int, rb: int, bm: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(chunks, tiles, tiles per group, groups, BM) for ``tiles`` tiles of ``bm`` pixels in chunks of ``rb``
    channels: about PROGRAMS_PER_SM programs per SM, at least MIN_TILES tiles per program, none empty."""
    chunks = cdiv(r, rb)
    want = max(1, PROGRAMS_PER_SM * device_info(device).sms // chunks)
    per = max(min(MIN_TILES, tiles), cdiv(tiles, want))
    return chunks, tiles, per, cdiv(tiles, per), bm


def _bn_d_geometry(d: torch.Tensor, n: int, h: int, w: int) -> tuple[int, int, int, int, int]:
    """The BN_d passes' tiles: segments of an image row of BM pixels (fewer, a power of two >= W, for narrow
    maps), ceil(W / BM) per row."""
    bm = min(BM, next_power_of_2(w))
    return _geometry(n * h * cdiv(w, bm), d.shape[1], RB, bm, d.device)


def blur_gate_input(d: torch.Tensor, mean_d: torch.Tensor, rstd_d: torch.Tensor, gamma_d: torch.Tensor,
                    beta_d: torch.Tensor, n: int, h: int, w: int) -> torch.Tensor:
    """g = BlurPool(SiLU(v_d)) (N HO WO, R) in d's dtype, from d (N H W, R)."""
    _check("blur_gate_input", d, mean_d, rstd_d, gamma_d, beta_d, n, h, w)
    r = d.shape[1]
    ho, wo = (h + 1) // 2, (w + 1) // 2
    mo = n * ho * wo
    g = torch.empty((mo, r), device=d.device, dtype=d.dtype)
    geo = _geometry(cdiv(mo, BM), r, RB_GATE, BM, d.device)
    chunks, tiles, per, groups, _ = geo
    launch(_blur_gate_kernel, (chunks, groups), d, mean_d, rstd_d, gamma_d, beta_d, g, r, mo, tiles, per,
           cost=lambda: _cost(-1, n, h, w, r, geo, d.element_size(), gamma_d.element_size()),
           H=h, W=w, RB=RB_GATE, BM=BM, EVEN_C=r % RB_GATE == 0, FAST=kernel_settings(d)[0], NS=NS_GATE,
           num_warps=WARPS)
    return g


def _bn_d(mode: int, dg, d, mean_d, rstd_d, gamma_d, beta_d, s0, s1, out, n, h, w, geo) -> None:
    p, r = d.shape
    chunks, tiles, per, groups, bm = geo
    launch(_blur_bn_d_kernel, (chunks, groups), dg, d, mean_d, rstd_d, gamma_d, beta_d, s0, s1, out, r, tiles,
           per, 1.0 / p,
           cost=lambda: _cost(mode, n, h, w, r, geo, d.element_size(), gamma_d.element_size()),
           H=h, W=w, MODE=mode, RB=RB, BM=bm, EVEN_C=r % RB == 0, FAST=kernel_settings(d)[0], NS=NS_BN_D,
           num_warps=WARPS)


def blur_bn_d_sums(dg: torch.Tensor, d: torch.Tensor, mean_d: torch.Tensor, rstd_d: torch.Tensor,
                   gamma_d: torch.Tensor, beta_d: torch.Tensor, n: int, h: int, w: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum dy, sum dy u_hat) (R,) fp32 over the N H W pixels of d, dy = Blur^T(dg) SiLU'(v_d)."""
    _check("blur_bn_d_sums", d, mean_d, rstd_d, gamma_d, beta_d, n, h, w, dg)
    r = d.shape[1]
    geo = _bn_d_geometry(d, n, h, w)
    groups = geo[3]
    part = torch.empty((groups, 2, r), device=d.device, dtype=torch.float32)
    sum_dy = torch.empty((r,), device=d.device, dtype=torch.float32)
    sum_dyu = torch.empty((r,), device=d.device, dtype=torch.float32)
    _bn_d(0, dg, d, mean_d, rstd_d, gamma_d, beta_d, mean_d, mean_d, part, n, h, w, geo)
    # a group's partial row is (sum dy, sum dy u_hat): R elements to each result
    reduce_partials(part, sum_dy, groups, 2 * r, block=MERGE_BLOCK, sb=MERGE_GROUPS, out2=sum_dyu,
                    partials_in_l2=True, what="stride-2 BN_d backward: fixed-order merge of the partial sums")
    return sum_dy, sum_dyu


def blur_bn_d_backward(dg: torch.Tensor, d: torch.Tensor, mean_d: torch.Tensor, rstd_d: torch.Tensor,
                       gamma_d: torch.Tensor, beta_d: torch.Tensor, sum_dy: torch.Tensor,
                       sum_dy_uhat: torch.Tensor, n: int, h: int, w: int) -> torch.Tensor:
    """dd (N H W, R) in d's dtype: BN_d's backward of dy = Blur^T(dg) SiLU'(v_d)."""
    _check("blur_bn_d_backward", d, mean_d, rstd_d, gamma_d, beta_d, n, h, w, dg, (sum_dy, sum_dy_uhat))
    dd = torch.empty_like(d)
    _bn_d(1, dg, d, mean_d, rstd_d, gamma_d, beta_d, sum_dy, sum_dy_uhat, dd, n, h, w,
          _bn_d_geometry(d, n, h, w))
    return dd


def _cost(mode: int, n: int, h: int, w: int, r: int, geo, eb: int, wb: int) -> KernelCost:
    """mode -1: blur_gate_input; 0, 1: the MODEs of _blur_bn_d_kernel. DRAM: d and dg / g once, the
    statistics, MODE 0's partials (groups, 2, R) fp32, MODE 1's sums and dd. L2: every tap, as compiled
    (the pipelined loads bypass L1: module docstring). Useful MACs: the transpose's 9 per output element
    (count_macs' BlurPool) in MODE 0; the forward's (g recomputed) and MODE 1's transpose are
    recomputes."""
    _, _, per, groups, bm = geo
    ho, wo = (h + 1) // 2, (w + 1) // 2
    p, mo = n * h * w, n * ho * wo
    vec = 2 * r * 4 + 2 * r * wb
    dram = (p + mo) * r * eb + vec
    if mode < 0:
        note = "stride-2 MBConv backward: g = BlurPool(SiLU(v_d)) recomputed from d"
    elif mode == 0:
        dram += groups * 2 * r * 4
        note = "stride-2 BN_d backward sums: dy = Blur^T(dg) SiLU'(v_d), partials per group"
    else:
        dram += p * r * eb + 2 * r * 4
        note = "stride-2 BN_d backward: dd from dy = Blur^T(dg) SiLU'(v_d)"
    return KernelCost(9 * mo * r if mode == 0 else 0, 0, dram, (Loop("pixel tiles", per),), note=note)
