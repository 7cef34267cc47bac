"""Host side of the ConvFirst training kernels (kernel.py, finalize.py): tiles and shares, launches with
their cost declarations. The per-channel arithmetic between the passes runs in the finalize kernels (a
block's training step is 20 launches at stride 1, 24 at stride 2, and no other op but the drop-path
mask's); per-channel vectors travel between launches in fp32 buffers (finalize.py's VEC_* rows).

Every function here assumes the op's checks passed (op.py). x and dout are read as contiguous NHWC
(copied once if they are not); a, p, dy, da and the outputs are contiguous NHWC.

Tiles (``train_config``)
------------------------
* CP: the channels padded to a power of two >= 16 (tl.dot); BM = 128 rows (64 for fp32, whose 3xTF32
  operands take three times the registers); BH = 32 hidden channels per chunk; the forward FFN on 4
  warps, the input pass on 4 up to CP = 32 and 8 above (train_config says why).
* The weights pass (two fp32 accumulators of [channels, BH] live across its tile loop; channels in two
  power-of-two parts where that avoids padding, ``channel_parts``): 8 warps, 128 x 32 tiles (128 x 64 at
  64 channels in and out), three pipeline stages (train_config says why). The input pass takes 64-row
  tiles on 4 warps at 64 channels, stride 1.
* Shares (reductions in a fixed order, never depending on the device): the moments pass and the
  output-gradient sums use at least MIN_SHARE_ROWS rows per share and at most SHARES programs; the
  weights pass uses at most WEIGHT_PROGRAMS programs (shares x hidden chunks) and keeps its fp32
  partials (2 C R floats per share) under PARTIAL_SHARE of the bytes it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._cost import KernelCost, Loop
from .._launch import MAXNREG, cdiv, device_info, launch, next_power_of_2
from ..convfirst.staged import ffn_train_forward
from ..gconv.launcher import gconv3x3_backward_triton, gconv3x3_triton, reduce_partials
from .finalize import (
    VEC_C, VEC_K, VEC_R, VEC_ROWS, VEC_T, VEC_U, VEC_W,
    _bn_running_kernel,
    _bn_terms_kernel,
    _ffn_weights_finalize_kernel,
    _linear_moments_kernel,
    _merge_moments_kernel,
)
from .kernel import (
    _bn_input_grad_kernel,
    _ffn_bwd_input_kernel,
    _ffn_bwd_weights_kernel,
    _blur_bwd_kernel,
    _blur_cat_kernel,
    _ffn_fwd_kernel,
    _prep_kernel,
    _moments_kernel,
    _out_sums_kernel,
    _residual_kernel,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# rows per share of the moments and sums passes at least; 4096 left Small's 32 x 32 maps with 32 programs
# (latency bound: 53 -> 15 us for the C = 96 moments)
MIN_SHARE_ROWS = 1024
SHARES = 512  # programs of the moments and sums passes at most (about 4 per SM of an H100)
WEIGHT_PROGRAMS = 1024  # shares x hidden chunks of the weights pass at most
PARTIAL_SHARE = 0.1  # weights pass: fp32 partials at most this share of its bytes read
# elements per program of the elementwise passes (64 per thread, 4 warps): at 4096 (32) the residual pass
# of Small's C = 64 block waited on its loads, 61-91 us against 61-76 (DRAM-bound) now (static model,
# sm_90, batch 128); the BlurPool passes keep BLUR_ELEMS (at 8192 they spilled 904-912 B)
ELEMENTWISE_ELEMS = 8192
BLUR_ELEMS = 4096
# The BlurPool transpose (_blur_bwd_kernel, stride-2 backward), (elements, warps) a program by element
# size. 16-bit: one warp on 1024 elements. At 4096 on 4 warps its per-pixel gather (up to four candidates
# and their reflect weights) bound it on the stall chain: Small's 32 channels at 128x128 363-454 us and 64
# at 64x64 179-227 against 239-329 and 111-149 now (static estimate, batch 128, sm_90); better by both the
# model and its L1-pipe + latency sum at every stride-2 block of Nano, Tiny and Small (224 and 256), on
# Triton 3.6 and sm_80 too; 167-192 registers, no stack (2 warps on 2048 spilled 16 B at Nano's 48
# channels). fp32 keeps 4096 on 4 warps (one warp spilled 16-40 B)
BLUR_BWD = {2: (1024, 1), 4: (4096, 4)}
# The register limit (_launch.MAXNREG) of the FFN forward, the residual / BN3 pass and BlurPool's transpose:
# left to ptxas (Triton 3.8), the 96-channel residual pass took 88 registers (now 141) and its loads waited
# in sequence. Static estimate, Small's 13 ConvFirst training blocks, batch 128, high end, sm_90 / Triton
# 3.6 / sm_80: FFN forward 2.31 / 3.38 / 3.57 -> 2.30 / 3.04 / 3.50 ms, residual 1.00 / 1.00 / 1.26 ->
# 0.82 / 0.82 / 1.17, transpose 0.48 / 0.48 / 0.66 -> 0.44 / 0.45 / 0.61; no new stack. The BatchNorm terms
# launch too: 0.287 -> 0.148 ms on Triton 3.6 (the GPU image's), unchanged on 3.8 and sm_80
LIMITED = dict(maxnreg=MAXNREG)
# The stride-1 forward's FFN in 16-bit on sm_90 and later (``_resident_ffn``): True, the launch of
# inference's staged blocks (persistent programs, the hidden chunks' weights resident in shared memory up to
# C = 64; kernels/convfirst/staged.py ``ffn_train_forward``) on k2 W1 and W2 in the activation dtype, which
# the BN2 statistics launch writes; False, ``_ffn_fwd_kernel`` (every chunk's weights read per tile).
# Static estimate, Small's stride-1 blocks, batch 128, high end, us, C = 32 / 64 / 96: sm_90 246.8 / 171.7 /
# 186.7 -> 144.1 / 149.9 / 149.6, Triton 3.6 307.4 / 275.2 / 220.7 -> 140.7 / 158.4 / 154.0; faster at every
# stride-1 width of Pico, Nano and Tiny too (16 channels at 128x128 287.1 -> 75.2, 72 at 32x32 178.4 ->
# 135.5); no stack on either Triton. On sm_80 the C = 64 launch spilled 56 B and the C = 96 one rose 182.1 ->
# 339.1 (mma.sync): the old kernel there, and for fp32 (its 3xTF32 tiles)
RESIDENT_FFN = True
# Under the interpreter (CPU tensors) shares of two tiles, so that small test maps run every share
# loop more than once (the same code as the GPU's, other sizes).
INTERPRETER_SHARE_TILES = 2
# Finalize launches (finalize.py): SB shares per step ([SB, BLOCK] loads, 4096 elements on a GPU), BH
# hidden channels and BJ columns per dot of the FFN statistics. Under the interpreter, two shares per step
# and 16 columns, so that the tests' small maps and widths run those loops more than once. Warps: 4 (was
# 8) for the BatchNorm terms, linear moments and FFN weights finalize (the static estimate of all such
# launches of Pico..Small's ConvFirst blocks, fp16 and fp32, sm_90: 3.25 -> 2.44 ms with the merge's; sm_80
# 3.61 -> 2.78; Triton 3.6 3.84 -> 3.17); the moments' merge keeps 8 (on 4, Triton 3.6 spilled 8-72 B)
FIN = dict(sb=128, merge_block=64, terms_block=64, running_block=512, bh=16, bj=32, bo=32, reduce_block=64,
           reduce_sb=64, warps=4, merge_warps=8)
FIN_INTERPRETER = dict(sb=2, merge_block=256, terms_block=32, running_block=32, bh=32, bj=16, bo=16,
                       reduce_block=2048, reduce_sb=2, warps=4, merge_warps=4)


@dataclass(frozen=True)
class TrainConfig:
    cp_in: int  # FFN input channels padded to a power of two
    cp_out: int  # FFN output channels padded to a power of two
    parts_in: tuple[int, int]  # FFN input channels as two power-of-two parts (``channel_parts``)
    parts_out: tuple[int, int]  # FFN output channels alike
    block_m: int  # rows per tile
    block_h: int  # hidden channels per chunk
    block_m_weights: int  # rows per tile of the weights pass
    block_m_input: int  # rows per tile of the input pass
    block_h_weights: int  # hidden channels per program of the weights pass
    stages_weights: int  # software pipelining of the weights pass's tile loop
    num_warps: int  # the input pass
    num_warps_fwd: int  # the forward FFN pass
    precision: str


def _pow2(c: int) -> int:
    return max(16, next_power_of_2(c))


def channel_parts(c: int) -> tuple[int, int]:
    """c channels of the FFN weights pass as two power-of-two parts (the second 0 where one part, padded
    to _pow2(c) and masked past c, is used): 96 = 64 + 32 instead of 128 with a quarter masked, since
    that pass re-reads y and dp once per hidden chunk (L2 bound). Parts of 32 channels at least: a
    16-channel part's dots were not compiled and estimated (C = 48 stays padded to 64)."""
    a = next_power_of_2(c) // 2
    b = c - a
    if c != next_power_of_2(c) and b >= 32 and b & (b - 1) == 0:
        return a, b
    return _pow2(c), 0


def train_config(c_in: int, c_out: int, r: int, dtype: torch.dtype, stride: int = 1, arch: int = 90
                 ) -> TrainConfig:
    """Tiles of the FFN passes for c_in -> r -> c_out channels (stride 1: c_in = c_out = C; stride 2:
    2C -> 6C -> K)."""
    cpi, cpo = _pow2(c_in), _pow2(c_out)
    cp = max(cpi, cpo)
    fp32 = dtype == torch.float32
    bm = 64 if fp32 else 128
    # 32 hidden channels per chunk, the forward on 4 warps (static estimates of Small's blocks, batch 128,
    # sm_90: BH 64 -> 32 took the input pass at C = 64 from 234 to 174 us (two programs per SM instead
    # of one) and at C = 32 from 217 to 201; the forward on 4 warps at C = 96 from 105 to 63 us)
    bh = min(32, max(16, next_power_of_2(r)))
    # weights pass: 128 rows x 32 hidden channels, 8 warps, three pipeline stages for every CP (sm_90,
    # fp16: 150-230 registers, no stack, up to 217 KB of shared memory at CP = 128). Chosen by the
    # static estimate of Small's stride-1 blocks at batch 128: 64 x 32 and 1-2 stages were latency
    # bound (C = 64: 566-617 us against 264 us), 128 x 64 spilled, 256 x 32 was slower (397 us).
    bmw, bhw, stages = (64, 16, 2) if fp32 else (128, 32, 3)
    parts_in, parts_out = channel_parts(c_in), channel_parts(c_out)
    # 64 channels in and out (stage 2 of Small; 16-bit): the weights pass on 64 hidden channels (half the
    # programs, each re-reading y and dp once per chunk: 451 -> 426 us at stride 1, 238 -> 230 at stride
    # 2) and, at stride 1, the input pass on 64-row tiles with 4 warps, two programs per SM (208 registers:
    # 458 -> 378 us; at stride 2 242 -> 298); static estimates, high end, sm_90, batch 128. At 32 and 96
    # channels the same tiles spilled or were slower, and the 64-channel weights pass spills on sm_80.
    narrow64 = not fp32 and cpi == cpo == 64 and parts_in[1] == parts_out[1] == 0
    bhw = min(64, max(16, next_power_of_2(r))) if narrow64 and arch >= 90 else min(bhw, bh)
    narrow_input = narrow64 and stride == 1
    # the forward on 4 warps (two programs per SM), on 8 where 4 spill: a [BM, 128] accumulator (its tile
    # loop left 255 registers with 176-312 B of stack) or BN1's affine on a two-part input at CP = 128
    # (C = 96 stride 1: 48-200 B). The 64 -> 96 stride-2 FFN (output parts 64 + 32) fits on 4 warps: 73
    # -> 42 us per step, static estimate, Small at batch 128 on sm_90
    wide = sum(parts_out) >= 128 or (cp >= 128 and parts_in[1] > 0)
    return TrainConfig(cpi, cpo, parts_in, parts_out, bm, bh, bmw, 64 if narrow_input else bm, bhw, stages,
                       4 if cp <= 32 or narrow_input else 8, 8 if wide else 4, "tf32x3" if fp32 else "tf32")


def shares_of(tiles: int, block_m: int, interpreter: bool, cap: int = SHARES) -> tuple[int, int]:
    """(tiles per share, shares) of the moments and sums passes."""
    if interpreter:
        per = INTERPRETER_SHARE_TILES
    else:
        per = max(cdiv(MIN_SHARE_ROWS, block_m), cdiv(tiles, cap))
    per = min(per, max(1, tiles))
    return per, cdiv(tiles, per)


def weight_shares(tiles: int, chunks: int, c_in: int, c_out: int, r: int, cfg: TrainConfig, eb: int,
                  interpreter: bool) -> tuple[int, int]:
    """(tiles per share, shares) of the weights pass: at most WEIGHT_PROGRAMS programs and partials of
    at most PARTIAL_SHARE of the bytes it reads (y and dp per row, per chunk)."""
    if interpreter:
        return shares_of(tiles, cfg.block_m_weights, True)
    rows = tiles * cfg.block_m_weights
    budget = int(PARTIAL_SHARE * (c_in + c_out) * eb * rows * chunks / (4 * (c_in + c_out) * r)) if r else 1
    shares = max(1, min(tiles, WEIGHT_PROGRAMS // chunks, budget))
    per = cdiv(tiles, shares)
    return per, cdiv(tiles, per)


def tile_shares(tiles: int, interpreter: bool) -> tuple[int, int]:
    """(tiles per share, shares) of the FFN forward and input passes and the BlurPool transpose: at most
    SHARES programs (each writes one row of partial statistics), no minimum share size (these passes
    have work enough per tile)."""
    per = INTERPRETER_SHARE_TILES if interpreter else cdiv(tiles, SHARES)
    per = min(per, max(1, tiles))
    return per, cdiv(tiles, per)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous NHWC tensor (copied once if it is not)."""
    return t.contiguous(memory_format=torch.channels_last)


def _map(n: int, c: int, h: int, w: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty((n, c, h, w), dtype=like.dtype, device=like.device, memory_format=torch.channels_last)


def _elementwise_rows(c: int, elems: int = 0) -> int:
    return (elems or ELEMENTWISE_ELEMS) // _pow2(c)


def _f32(*shape, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def _vecs(width: int, like: torch.Tensor) -> torch.Tensor:
    """One BatchNorm's per-channel vectors (finalize.py: rows r, k, t, u, w, c)."""
    return _f32(VEC_ROWS, width, like=like)


def _fwd_vecs(width: int, like: torch.Tensor) -> list:
    """The training forward's k and t of one BatchNorm, as tensors of their own: a kernel writing rows of
    one buffer would make torch.compile's functionalization copy the buffer back (select_scatter)."""
    vec = [None] * VEC_ROWS
    vec[VEC_K], vec[VEC_T] = _f32(width, like=like), _f32(width, like=like)
    return vec


# ------------------------------------------------------------------------------------------------
# Finalize launches (finalize.py): the per-channel arithmetic between the passes
# ------------------------------------------------------------------------------------------------


def _fin(interpreter: bool) -> dict:
    return FIN_INTERPRETER if interpreter else FIN


def merge_moments(mean_part, m2_part, rows: int, rows_per_share: int, c: int, full: bool, *, gamma=None,
                  beta=None, eps: float = 0.0, vec=None, mean_copy: bool = False):
    """Chan's merge of per-share partials: (mean, var, cov (full) or None, a copy of the mean or None);
    with ``vec``, BatchNorm's k and t of the batch statistics written to its rows."""
    shares = mean_part.shape[0]
    fin = _fin(mean_part.device.type == "cpu")
    mean, var = _f32(c, like=mean_part), _f32(c, like=mean_part)
    cov = _f32(c, c, like=mean_part) if full else None
    copy = _f32(c, like=mean_part) if mean_copy else None
    m2_strides = (c * c, c, 1) if m2_part.dim() == 3 else (c, 1, 0)
    total = c * c if full else c
    block, sb = fin["merge_block"], fin["sb"]
    affine = vec is not None
    launch(_merge_moments_kernel, (cdiv(total, block),), mean_part, m2_part, mean,
           copy if mean_copy else mean, var, cov if full else mean, gamma if affine else mean,
           beta if affine else mean, vec[VEC_K] if affine else mean, vec[VEC_T] if affine else mean, shares,
           rows, rows_per_share, eps, *m2_strides, C=c, FULL=full, AFFINE=affine, COPY=mean_copy, SB=sb,
           BLOCK=block, num_warps=fin["merge_warps"],
           cost=lambda: finalize_cost("merge moments", 4 * shares * (2 * total + c) + 4 * (total + 3 * c),
                                      (Loop("shares", cdiv(shares, sb)),) * 2,
                                      f"C={c}, {shares} shares"))
    return mean, var, cov, copy


def linear_moments(mean_in, cov_in, kin, tin, w1, ref, gamma2, beta2, eps: float, vec2, w2=None):
    """BN2's batch mean and variance from its input's statistics (finalize.py), k2 and t2 into vec2. With
    ``w2`` also (k2 W1, W2) in ref's dtype, the forward FFN's weights (``ffn_forward``); else (None, None)."""
    r, ci = w1.shape
    fin = _fin(w1.device.type == "cpu")
    mean2, var2 = _f32(r, like=cov_in), _f32(r, like=cov_in)
    cpi, bj = _pow2(ci), fin["bj"]
    affine = kin is not None
    fold = w2 is not None
    co = w2.shape[0] if fold else 0
    w1s = torch.empty((r, ci), dtype=ref.dtype, device=ref.device) if fold else None
    w2d = torch.empty((co, r), dtype=ref.dtype, device=ref.device) if fold else None
    eb = ref.element_size()
    fold_bytes = (ci * (w1.element_size() + eb) + co * (w2.element_size() + eb)) * r if fold else 0
    loops = (Loop("column blocks", cdiv(cpi, bj)),)
    if fold:
        loops += (Loop("W2 rows", cdiv(co, fin["bo"])),)
    launch(_linear_moments_kernel, (cdiv(r, fin["bh"]),), mean_in, cov_in, kin if affine else mean_in,
           tin if affine else mean_in, w1, ref, gamma2, beta2, mean2, var2, vec2[VEC_K], vec2[VEC_T],
           w1s if fold else ref, w2 if fold else ref, w2d if fold else ref, r, eps, cpi, co, CI=ci, CPI=cpi,
           BH=fin["bh"], BJ=bj, AFFINE_IN=affine, FOLD=fold, BO=fin["bo"], num_warps=fin["warps"],
           cost=lambda: finalize_cost("linear moments",
                                      4 * (ci * ci * cdiv(r, fin["bh"]) + ci * r + 6 * r) + fold_bytes, loops,
                                      f"{ci}->{r}" + (", k2 W1 and W2 in its dtype" if fold else "")))
    return mean2, var2, w1s, w2d


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of its own for a pointer parameter that the launch leaves unused."""
    return torch.empty(0, dtype=like.dtype, device=like.device)


def bn_terms(bns, eps: float, rows: int, training: bool, sums=None):
    """(r, k, t) of each BatchNorm (gamma, beta, mean, var, vec) of ``bns`` into its vec; with ``sums``
    (index into bns, (S, 2, W) partials): that one's backward terms and (dgamma, dbeta)."""
    like = bns[0][4]
    fin = _fin(like.device.type == "cpu")
    # Unused slots get placeholders of their own (never read: one program row per BatchNorm given; the
    # first one's width, so the compiled variant stays the same): a tensor passed for two parameters that
    # the kernel writes keeps only one's writes under torch.compile (each is cloned, the last clone wins)
    args = []
    for gamma, beta, mean, var, vec in bns:
        args += [gamma, beta, mean, var, vec, vec.shape[1]]
    for _ in range(3 - len(bns)):
        args += [_placeholder(like) for _ in range(5)] + [like.shape[1]]
    width = max(b[4].shape[1] for b in bns)
    if sums is not None:
        which, part = sums
        g = bns[which][0]
        dgamma, dbeta = torch.empty_like(g), torch.empty_like(g)
        shares = part.shape[0]
    else:
        which, part, dgamma, dbeta, shares = -1, _placeholder(like), _placeholder(like), _placeholder(like), 0
    block, sb = fin["terms_block"], fin["sb"]
    launch(_bn_terms_kernel, (cdiv(width, block), len(bns)), *args, part, dgamma, dbeta, shares, rows,
           eps,
           SUMS1=which == 0, SUMS2=which == 1, SUMS3=which == 2, TRAINING=training, SB=sb, BLOCK=block,
           num_warps=fin["warps"], **LIMITED,
           cost=lambda: finalize_cost("BatchNorm terms", 4 * (2 * shares * width + sum(7 * b[4].shape[1]
                                                                                     for b in bns)),
                                      (Loop("shares", cdiv(shares, sb)),) if sums is not None else (),
                                      f"{len(bns)} BatchNorms"
                                      + (f", sums of {shares} shares" if shares else "")))
    return (dgamma, dbeta) if sums is not None else None


def update_running_triton(stats, running, counts, rows, momenta) -> None:
    """nn.BatchNorm2d's running-statistics update of three BatchNorms in place, one launch (finalize.py)."""
    fin = _fin(stats[0].device.type == "cpu")
    args = []
    for i in range(3):
        args += [stats[2 * i], stats[2 * i + 1], running[2 * i], running[2 * i + 1], counts[i],
                 running[2 * i].shape[0], rows[i], -1.0 if momenta[i] is None else float(momenta[i])]
    launch(_bn_running_kernel, (3,), *args, BLOCK=fin["running_block"], num_warps=4,
           cost=lambda: finalize_cost("running statistics", 4 * 4 * sum(r.shape[0] for r in running),
                                      tuple(Loop(f"channel blocks {i + 1}", cdiv(r.shape[0],
                                                                                      fin["running_block"]))
                                            for i, r in enumerate(running[::2])), "3 BatchNorms"))


# ------------------------------------------------------------------------------------------------
# Pieces shared by the stride-1 and stride-2 blocks
# ------------------------------------------------------------------------------------------------


def moments_triton(a: torch.Tensor, cfg: TrainConfig):
    """Per-share partials of the batch mean and centred C x C second moment of a contiguous NHWC map, fp32:
    (mean (S, C), m2 (S, C, C), rows per share)."""
    n, c, h, w = a.shape
    m = n * h * w
    tiles = cdiv(m, cfg.block_m)
    per, shares = shares_of(tiles, cfg.block_m, a.device.type == "cpu")
    mean = _f32(shares, c, like=a)
    m2 = _f32(shares, c, c, like=a)
    launch(_moments_kernel, (shares,), a, mean, m2, m, tiles, per, C=c, CP=_pow2(c), BM=cfg.block_m,
           PRECISION=cfg.precision, num_warps=4 if _pow2(c) <= 32 else 8,
           cost=lambda: moments_cost(cfg, m, c, a.element_size(), shares, per))
    return mean, m2, per * cfg.block_m


def ffn_forward(inp, vec_in, w1, w2, vec2, cfg: TrainConfig, folded=None):
    """p = W2 ReLU(BN2(W1 y)) with y = k1 inp + t1 (vec_in; None: y = inp) and p's per-share moments.
    ``folded`` (the stride-1 block): (k2 W1, W2) in inp's dtype, for the resident-weights FFN launch that
    inference's staged blocks run (kernels/convfirst/staged.py ``ffn_train_forward``)."""
    if folded is not None:
        return ffn_train_forward(inp, vec_in[VEC_K], vec_in[VEC_T], folded[0], vec2[VEC_T], folded[1])
    n, ci, h, w = inp.shape
    r, co = w1.shape[0], w2.shape[0]
    m = n * h * w
    p = _map(n, co, h, w, inp)
    tiles = cdiv(m, cfg.block_m)
    per, shares = tile_shares(tiles, inp.device.type == "cpu")
    pmean, pm2 = _f32(shares, co, like=inp), _f32(shares, co, like=inp)
    affine = vec_in is not None
    launch(_ffn_fwd_kernel, (shares,), inp, w1, w2, p, vec_in[VEC_K] if affine else pmean,
           vec_in[VEC_T] if affine else pmean, vec2[VEC_K], vec2[VEC_T], pmean, pm2, m, r, tiles, per, CI=ci,
           CIA=cfg.parts_in[0], CIB=cfg.parts_in[1], CO=co, COA=cfg.parts_out[0], COB=cfg.parts_out[1],
           BM=cfg.block_m, BH=cfg.block_h, PRECISION=cfg.precision,
           AFFINE_IN=affine, num_warps=cfg.num_warps_fwd, **LIMITED,
           cost=lambda: ffn_fwd_cost(cfg, m, ci, co, r, inp.element_size(), shares, per))
    return p, pmean, pm2, per * cfg.block_m


def out_sums(dout, p, drop, mean3, var3, eps: float, hw: int, cfg: TrainConfig):
    """BN3's backward sums per share (with drop-path when ``drop`` is given): (S, 2, K) partials."""
    n, co, h, w = p.shape
    m = n * h * w
    tiles = cdiv(m, cfg.block_m)
    per, shares = shares_of(tiles, cfg.block_m, p.device.type == "cpu")
    part = _f32(shares, 2, co, like=p)
    # one warp per 32 padded channels, two at least (was 4 up to 32 channels, else 8): each thread sums
    # more of its tile between the loads, which bound it on their waits and stall chain. Static estimate,
    # batch 128, sm_90, high end: Small's 32 channels at 128x128 130 -> 100 us, 64 at 64x64 74 -> 51, the
    # out_sums launches of Nano, Tiny and Small's ConvFirst blocks in fp16 and fp32 2.63 -> 1.69 ms in all
    # (sm_80 3.85 -> 2.47, Triton 3.6 2.20 -> 1.70); 111-255 registers, no stack
    launch(_out_sums_kernel, (shares,), dout, p, drop if drop is not None else mean3, mean3, var3, part, m,
           hw, tiles, per, eps, C=co, CP=cfg.cp_out, BM=cfg.block_m, DROP=drop is not None,
           num_warps=max(2, cfg.cp_out // 32),
           cost=lambda: sums_cost(cfg, m, co, p.element_size(), shares, per))
    return part


def ffn_backward(y, dp, a, w1, w2, vec1, mean1, vec2, mean2, gamma2, mean_in, cov_in, affine_in: bool,
                 cfg: TrainConfig, training: bool):
    """The FFN's backward from its input y (M, CI) and dp (M, CO): dW1, dW2, BN2's (dgamma2, dbeta2), dy
    and (a given: the stride-1 block, whose FFN input is BN1's output) BN1's per-share sums.

    mean_in, cov_in: the batch mean and covariance of the FFN input (affine_in: of a, with y = k1 a + t1),
    for dW1 = k2 G + u2 sum(y)^T + w2 (z - m2)^T y with (z - m2)^T y = M W1 Cov(y) + M (W1 mean(y) - m2)
    mean(y)^T (kernel.py, finalize.py)."""
    n, ci, h, w = y.shape
    r, co = w1.shape[0], w2.shape[0]
    m = n * h * w
    eb = y.element_size()
    interpreter = y.device.type == "cpu"
    fin = _fin(interpreter)
    chunks = cdiv(r, cfg.block_h_weights)
    wtiles = cdiv(m, cfg.block_m_weights)
    per, shares = weight_shares(wtiles, chunks, ci, co, r, cfg, eb, interpreter)
    dzz = cfg.parts_in[1] > 0  # kernel.py: the sum of dzn z_hat in the weights pass (C = 96)
    total = co * r + r * ci + (2 if dzz else 1) * r
    part = _f32(shares, total, like=y)
    launch(_ffn_bwd_weights_kernel, (shares, chunks), y, dp, w1, w2, vec2[VEC_K], vec2[VEC_T], mean2,
           vec2[VEC_R], part, m, r, wtiles, per, total, CI=ci, CIA=cfg.parts_in[0], CIB=cfg.parts_in[1],
           CO=co, COA=cfg.parts_out[0], COB=cfg.parts_out[1], BM=cfg.block_m_weights, BH=cfg.block_h_weights,
           PRECISION=cfg.precision, DZZ=dzz, num_warps=8,
           num_stages=cfg.stages_weights,
           cost=lambda: ffn_bwd_weights_cost(cfg, m, ci, co, r, eb, shares, per, chunks, total))
    red = _f32(total, like=y)
    block, sb = fin["reduce_block"], fin["reduce_sb"]
    reduce_partials(part, red, shares, total, block=block, sb=sb)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    dgamma2, dbeta2 = torch.empty_like(gamma2), torch.empty_like(gamma2)
    cpi = _pow2(ci)
    launch(_ffn_weights_finalize_kernel, (cdiv(r, fin["bh"]),), red, vec2, mean2, mean_in, cov_in,
           vec1[VEC_K] if affine_in else mean_in, vec1[VEC_T] if affine_in else mean_in, w1, y, dw1, dw2,
           dgamma2, dbeta2, r, m, cpi, co, CI=ci, CPI=cpi, CO=co, BH=fin["bh"], BJ=fin["bj"], BO=fin["bj"],
           AFFINE_IN=affine_in, DZZ=dzz,
           TRAINING=training, num_warps=fin["warps"],
           cost=lambda: finalize_cost("FFN weights", 4 * (2 * total + ci * ci * cdiv(r, fin["bh"])),
                                      (Loop("output blocks", cdiv(co, fin["bj"])),
                                       Loop("column blocks", cdiv(cpi, fin["bj"]))),
                                      f"{ci}->{r}->{co}"))
    dy = _map(n, ci, h, w, y)
    tiles = cdiv(m, cfg.block_m_input)
    ipr, ishares = tile_shares(tiles, interpreter)
    bn_sums = a is not None
    part1 = _f32(*((ishares, 2, ci) if bn_sums else (1,)), like=y)
    launch(_ffn_bwd_input_kernel, (ishares,), y, dp, a if bn_sums else y, w1, w2, dy,
           mean1 if bn_sums else mean2, vec1[VEC_R] if bn_sums else mean2, vec2[VEC_K], vec2[VEC_T], mean2,
           vec2[VEC_U], vec2[VEC_W], part1, m, r, tiles, ipr, CI=ci, CPI=cfg.cp_in, CO=co, CPO=cfg.cp_out,
           BM=cfg.block_m_input, BH=cfg.block_h, PRECISION=cfg.precision, BN_SUMS=bn_sums,
           num_warps=cfg.num_warps,
           cost=lambda: ffn_bwd_input_cost(cfg, m, ci, co, r, eb, bn_sums, ishares, ipr))
    return dw1, dw2, dgamma2, dbeta2, dy, (part1 if bn_sums else None)


def bn_input_grad(dy, a, vec1, mean1) -> torch.Tensor:
    n, c, h, w = a.shape
    m = n * h * w
    da = _map(n, c, h, w, a)
    rows = _elementwise_rows(c)
    launch(_bn_input_grad_kernel, (cdiv(m, rows),), dy, a, da, vec1[VEC_K], vec1[VEC_U], vec1[VEC_W],
           mean1, m, C=c, CP=_pow2(c), BM=rows, num_warps=4,
           cost=lambda: elementwise_cost("bn1 input grad", m, c, a.element_size(), 3))
    return da


def _resident_ffn(x: torch.Tensor) -> bool:
    """Whether the stride-1 forward's FFN runs ``ffn_train_forward`` (RESIDENT_FFN says where)."""
    return RESIDENT_FFN and x.dtype != torch.float32 and device_info(x.device).arch >= 90


def _stats_owned(stats, running) -> list[torch.Tensor]:
    """Eval mode returns the running statistics as fp32 tensors the op owns (outputs must not alias)."""
    return [t.float().clone() for t in stats] if running else list(stats)


def _eval_vecs(bns, eps: float, like):
    """Eval mode: the three BatchNorms' k and t from their running statistics, one launch."""
    vecs = [_vecs(g.shape[0], like) for g, *_ in bns]
    bn_terms([(g, b, m, v, vec) for (g, b, m, v), vec in zip(bns, vecs)], eps, 1, False)
    return vecs


# ------------------------------------------------------------------------------------------------
# Stride 1
# ------------------------------------------------------------------------------------------------


def convfirst_s1_train_triton(x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3,
                              running_mean1, running_var1, running_mean2, running_var2, running_mean3,
                              running_var3, drop_scale, training: bool, eps: float):
    """Forward; returns what reference.convfirst_s1_train_reference returns."""
    n, c, h, w = x.shape
    r = w1.shape[0]
    m = n * h * w
    cfg = train_config(c, c, r, x.dtype, arch=device_info(x.device).arch)
    x = _flat(x)
    w1, w2 = w1.contiguous(), w2.contiguous()  # the kernels index them densely
    a = gconv3x3_triton(x, w_conv, 1)
    resident = _resident_ffn(x)
    if training:
        vec1, vec2, vec3 = _fwd_vecs(c, x), _fwd_vecs(r, x), _fwd_vecs(c, x)
        part_mean, part_m2, rps = moments_triton(a, cfg)
        m1, v1, bcov1, bmean1 = merge_moments(part_mean, part_m2, m, rps, c, True, gamma=gamma1, beta=beta1,
                                              eps=eps, vec=vec1, mean_copy=True)
        # y = k1 a + t1: mean(y) = k1 m1 + t1 and Cov(y) = k1 Cov(a) k1; z = W1 y
        m2, v2, w1s, w2d = linear_moments(bmean1, bcov1, vec1[VEC_K], vec1[VEC_T], w1, x, gamma2, beta2, eps,
                                          vec2, w2 if resident else None)
    else:
        bns = ((gamma1, beta1, running_mean1, running_var1), (gamma2, beta2, running_mean2, running_var2),
               (gamma3, beta3, running_mean3, running_var3))
        vec1, vec2, vec3 = _eval_vecs(bns, eps, x)
        if resident:  # as the statistics launch folds them: k2 W1 from W1 as stored, rounded once
            w1s, w2d = (w1.float() * vec2[VEC_K][:, None]).to(x.dtype), w2.to(x.dtype)
    p, pmean, pm2, rps = ffn_forward(a, vec1, w1, w2, vec2, cfg, (w1s, w2d) if resident else None)
    if training:
        m3, v3, _, _ = merge_moments(pmean, pm2, m, rps, c, False, gamma=gamma3, beta=beta3, eps=eps,
                                     vec=vec3)
    else:
        m1, v1, m2, v2, m3, v3 = _stats_owned((running_mean1, running_var1, running_mean2, running_var2,
                                               running_mean3, running_var3), True)
        bmean1, bcov1 = _f32(c, like=x).zero_(), _f32(c, c, like=x).zero_()
    out = _map(n, c, h, w, x)
    rows = _elementwise_rows(c)
    launch(_residual_kernel, (cdiv(m, rows),), x, p, out, drop_scale, vec3[VEC_K], vec3[VEC_T], m,
           h * w, C=c, CP=cfg.cp_out, BM=rows, RESIDUAL=True, num_warps=4, **LIMITED,
           cost=lambda: elementwise_cost("residual", m, c, x.element_size(), 3))
    return (out, a, p, m1, v1, m2, v2, m3, v3, bmean1, bcov1)


def convfirst_s1_train_backward_triton(dout, x, a, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3,
                                       beta3, mean1, var1, mean2, var2, mean3, var3, batch_mean1, batch_cov1,
                                       drop_scale, training: bool, eps: float):
    """Backward; returns what reference.convfirst_s1_train_backward_reference returns."""
    n, c, h, w = x.shape
    r = w1.shape[0]
    m = n * h * w
    eb = x.element_size()
    cfg = train_config(c, c, r, x.dtype, arch=device_info(x.device).arch)
    x, dout = _flat(x), _flat(dout.to(x.dtype))
    w1, w2 = w1.contiguous(), w2.contiguous()  # the kernels index them densely
    vec1, vec2, vec3 = _vecs(c, x), _vecs(r, x), _vecs(c, x)
    part3 = out_sums(dout, p, drop_scale, mean3, var3, eps, h * w, cfg)
    dgamma3, dbeta3 = bn_terms([(gamma1, beta1, mean1, var1, vec1), (gamma2, beta2, mean2, var2, vec2),
                                (gamma3, beta3, mean3, var3, vec3)], eps, m, training, sums=(2, part3))
    # y and dp, once, in the activation dtype
    y, dp = _map(n, c, h, w, a), _map(n, c, h, w, a)
    rows = _elementwise_rows(c)
    launch(_prep_kernel, (cdiv(m, rows),), a, dout, p, drop_scale, y, dp, vec1[VEC_K], vec1[VEC_T],
           vec3[VEC_K], vec3[VEC_W], vec3[VEC_C], m, h * w, C=c, CP=cfg.cp_out, BM=rows, WRITE_Y=True,
           DROP=True, num_warps=4, cost=lambda: elementwise_cost("y and dp", m, c, eb, 5))
    dw1, dw2, dgamma2, dbeta2, dy, part1 = ffn_backward(y, dp, a, w1, w2, vec1, mean1, vec2, mean2, gamma2,
                                                        batch_mean1, batch_cov1, True, cfg, training)
    dgamma1, dbeta1 = bn_terms([(gamma1, beta1, mean1, var1, vec1)], eps, m, training, sums=(0, part1))
    da = bn_input_grad(dy, a, vec1, mean1)
    # the grouped conv: dgrad (+ dout, the residual's gradient) and wgrad in one launch over da's windows
    dx, dw_conv = gconv3x3_backward_triton(da, w_conv, x, w_conv.dtype, residual=dout)
    return (dx, dw_conv, dw1, dw2, dgamma1, dbeta1, dgamma2, dbeta2, dgamma3, dbeta3)


# ------------------------------------------------------------------------------------------------
# Stride 2
# ------------------------------------------------------------------------------------------------


def convfirst_s2_train_triton(x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3,
                              running_mean1, running_var1, running_mean2, running_var2, running_mean3,
                              running_var3, training: bool, eps: float):
    """Forward; returns what reference.convfirst_s2_train_reference returns."""
    n, c, h, w = x.shape
    r, k = w1.shape[0], w2.shape[0]
    ho, wo = (h + 1) // 2, (w + 1) // 2
    m, mo = n * h * w, n * ho * wo
    cfg = train_config(2 * c, k, r, x.dtype, stride=2, arch=device_info(x.device).arch)
    x = _flat(x)
    w1, w2 = w1.contiguous(), w2.contiguous()  # the kernels index them densely
    a = gconv3x3_triton(x, w_conv, 1)
    if training:
        vec1, vec2, vec3 = _fwd_vecs(c, x), _fwd_vecs(r, x), _fwd_vecs(k, x)
        part_mean, part_m2, rps = moments_triton(a, cfg)
        m1, v1, _, _ = merge_moments(part_mean, part_m2, m, rps, c, False, gamma=gamma1, beta=beta1, eps=eps,
                                     vec=vec1)
    else:
        bns = ((gamma1, beta1, running_mean1, running_var1), (gamma2, beta2, running_mean2, running_var2),
               (gamma3, beta3, running_mean3, running_var3))
        vec1, vec2, vec3 = _eval_vecs(bns, eps, x)
    u = _map(n, 2 * c, ho, wo, x)
    rows = _elementwise_rows(c, BLUR_ELEMS)
    launch(_blur_cat_kernel, (cdiv(mo, rows),), x, a, u, vec1[VEC_K], vec1[VEC_T], mo, h, w, ho, wo,
           C=c, CP=_pow2(c), BM=rows, num_warps=4,
           cost=lambda: blur_cost("blur(cat[x, BN1(a)])", n, c, h, w, x.element_size()))
    if training:
        part_mean, part_m2, rps = moments_triton(u, cfg)
        mean_u, _, cov_u, _ = merge_moments(part_mean, part_m2, mo, rps, 2 * c, True)
        m2, v2, _, _ = linear_moments(mean_u, cov_u, None, None, w1, x, gamma2, beta2, eps, vec2)
    p, pmean, pm2, rps = ffn_forward(u, None, w1, w2, vec2, cfg)
    if training:
        m3, v3, _, _ = merge_moments(pmean, pm2, mo, rps, k, False, gamma=gamma3, beta=beta3, eps=eps,
                                     vec=vec3)
    else:
        m1, v1, m2, v2, m3, v3 = _stats_owned((running_mean1, running_var1, running_mean2, running_var2,
                                               running_mean3, running_var3), True)
        mean_u, cov_u = _f32(2 * c, like=x).zero_(), _f32(2 * c, 2 * c, like=x).zero_()
    out = _map(n, k, ho, wo, x)
    rows = _elementwise_rows(k)
    launch(_residual_kernel, (cdiv(mo, rows),), p, p, out, vec3[VEC_K], vec3[VEC_K], vec3[VEC_T], mo,
           ho * wo, C=k, CP=cfg.cp_out, BM=rows, RESIDUAL=False, num_warps=4, **LIMITED,
           cost=lambda: elementwise_cost("BN3", mo, k, x.element_size(), 2))
    return (out, a, u, p, m1, v1, m2, v2, m3, v3, mean_u, cov_u)


def convfirst_s2_train_backward_triton(dout, x, a, u, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3,
                                       beta3, mean1, var1, mean2, var2, mean3, var3, batch_mean_u,
                                       batch_cov_u, training: bool, eps: float):
    """Backward; returns what reference.convfirst_s2_train_backward_reference returns."""
    n, c, h, w = x.shape
    r, k = w1.shape[0], w2.shape[0]
    ho, wo = (h + 1) // 2, (w + 1) // 2
    m, mo = n * h * w, n * ho * wo
    cfg = train_config(2 * c, k, r, x.dtype, stride=2, arch=device_info(x.device).arch)
    x, dout = _flat(x), _flat(dout.to(x.dtype))
    w1, w2 = w1.contiguous(), w2.contiguous()  # the kernels index them densely
    vec1, vec2, vec3 = _vecs(c, x), _vecs(r, x), _vecs(k, x)
    part3 = out_sums(dout, p, None, mean3, var3, eps, ho * wo, cfg)
    dgamma3, dbeta3 = bn_terms([(gamma1, beta1, mean1, var1, vec1), (gamma2, beta2, mean2, var2, vec2),
                                (gamma3, beta3, mean3, var3, vec3)], eps, mo, training, sums=(2, part3))
    dp = _map(n, k, ho, wo, p)
    rows = _elementwise_rows(k)
    launch(_prep_kernel, (cdiv(mo, rows),), p, dout, p, p, p, dp, vec3[VEC_K], vec3[VEC_K],
           vec3[VEC_K], vec3[VEC_W], vec3[VEC_C], mo, ho * wo, C=k, CP=cfg.cp_out, BM=rows, WRITE_Y=False,
           DROP=False, num_warps=4, cost=lambda: elementwise_cost("dp", mo, k, p.element_size(), 3))
    dw1, dw2, dgamma2, dbeta2, du, _ = ffn_backward(u, dp, None, w1, w2, vec1, None, vec2, mean2, gamma2,
                                                    batch_mean_u, batch_cov_u, False, cfg, training)
    # BlurPool's transpose: x's direct gradient, dy, BN1's sums
    dxd, dy = _map(n, c, h, w, x), _map(n, c, h, w, x)
    elems, warps = BLUR_BWD[x.element_size()]
    rows = _elementwise_rows(c, elems)
    tiles = cdiv(m, rows)
    per, shares = tile_shares(tiles, x.device.type == "cpu")
    part1 = _f32(shares, 2, c, like=x)
    launch(_blur_bwd_kernel, (shares,), du, a, dxd, dy, mean1, vec1[VEC_R], part1, m, h, w, ho, wo, tiles,
           per, C=c, CP=_pow2(c), BM=rows, num_warps=warps, **LIMITED,
           cost=lambda: blur_cost("BlurPool transpose", n, c, h, w, x.element_size(), backward=True,
                                  loops=(Loop("tiles", per),), l1=(rows, per)))
    dgamma1, dbeta1 = bn_terms([(gamma1, beta1, mean1, var1, vec1)], eps, m, training, sums=(0, part1))
    da = bn_input_grad(dy, a, vec1, mean1)
    dx, dw_conv = gconv3x3_backward_triton(da, w_conv, x, w_conv.dtype, residual=dxd)
    return (dx, dw_conv, dw1, dw2, dgamma1, dbeta1, dgamma2, dbeta2, dgamma3, dbeta3)


# ------------------------------------------------------------------------------------------------
# Cost declarations (kernels/_cost.py). Useful MACs: those of a layer-wise training step assigned to
# the launch that does them (forward 2 C R per pixel; backward dW2 and dW1 in the weights pass, dh
# and dy in the input pass; BlurPool 9 per output, forward and transpose); recomputed products are
# issued, not useful.
# ------------------------------------------------------------------------------------------------


def _passes(cfg: TrainConfig) -> int:
    return 3 if cfg.precision == "tf32x3" else 1


def moments_cost(cfg: TrainConfig, m: int, c: int, eb: int, shares: int, per: int) -> KernelCost:
    tiles = cdiv(m, cfg.block_m)
    cp = _pow2(c)
    return KernelCost(useful_macs=0, mma_macs=tiles * cfg.block_m * cp * cp * _passes(cfg),
                      dram_bytes=eb * m * c + 4 * shares * (c + c * c), loops=(Loop("tiles", per),),
                      note=f"moments C={c}, {shares} shares of {per} tiles")


def ffn_fwd_cost(cfg: TrainConfig, m: int, ci: int, co: int, r: int, eb: int, shares: int, per: int
                 ) -> KernelCost:
    tiles = cdiv(m, cfg.block_m)
    chunks = cdiv(r, cfg.block_h)
    return KernelCost(
        useful_macs=m * (ci + co) * r,
        mma_macs=tiles * chunks * cfg.block_m * (sum(cfg.parts_in) + sum(cfg.parts_out)) * cfg.block_h
        * _passes(cfg),
        dram_bytes=eb * m * (ci + co) + eb * (ci + co) * r + 8 * shares * co,
        loops=(Loop("tiles", per, (Loop("hidden", chunks),)),),
        note=f"FFN forward {ci}->{r}->{co} BM={cfg.block_m} BH={cfg.block_h}",
    )


def elementwise_cost(what: str, m: int, c: int, eb: int, maps: int) -> KernelCost:
    return KernelCost(useful_macs=0, mma_macs=0, dram_bytes=maps * eb * m * c, note=f"{what} C={c}")


def blur_cost(what: str, n: int, c: int, h: int, w: int, eb: int, backward: bool = False, loops: tuple = (),
              l1: tuple[int, int] | None = None) -> KernelCost:
    """x and a (forward; backward: a, dx_direct, dy) at full resolution, u (2C) at half: 9 MACs per output
    element of the 2C-channel blur, as count_macs counts BlurPool.

    ``l1`` (the transpose: rows per tile, tiles per program): its four candidate loads per pixel are plain
    ld.global (LDG.E.128, allocated in L1), and the pixels of a tile share their candidates, so per tile
    L2 serves a's tile once and the du pixels under it once: a tile of BM consecutive pixels spans at most
    ceil(BM / W) + 1 image rows, hence (those rows + 1) // 2 + 1 rows of du, and min(WO, ceil(min(BM, W)
    / 2) + 1) columns (an upper bound, met by Small's tiles; neighbouring tiles of a share share du rows
    too)."""
    ho, wo = (h + 1) // 2, (w + 1) // 2
    full = (3 if backward else 2) * n * h * w * c
    decl = {}
    if l1 is not None:
        bm, tiles = l1
        du_px = ((cdiv(bm, w) + 2) // 2 + 1) * min(wo, cdiv(min(bm, w), 2) + 1)
        tile = eb * (bm * c + du_px * 2 * c)
        decl = dict(l1_unique_bytes_per_program=tiles * tile, l1_working_set_bytes=tile)
    return KernelCost(useful_macs=9 * n * ho * wo * 2 * c, mma_macs=0,
                      dram_bytes=eb * (full + n * ho * wo * 2 * c), loops=loops,
                      note=f"{what} C={c}", **decl)


def sums_cost(cfg: TrainConfig, m: int, c: int, eb: int, shares: int, per: int) -> KernelCost:
    return KernelCost(useful_macs=0, mma_macs=0, dram_bytes=2 * eb * m * c + 8 * shares * c,
                      loops=(Loop("tiles", per),), note=f"BN3 backward sums C={c}, {shares} shares")


def ffn_bwd_weights_cost(cfg: TrainConfig, m: int, ci: int, co: int, r: int, eb: int, shares: int, per: int,
                         chunks: int, total: int) -> KernelCost:
    tiles = cdiv(m, cfg.block_m_weights)
    # per tile and chunk: z and dh (recomputed), dW2 and dzn^T y
    return KernelCost(
        useful_macs=m * (ci + co) * r,
        mma_macs=tiles * chunks * 2 * cfg.block_m_weights * (sum(cfg.parts_in) + sum(cfg.parts_out))
        * cfg.block_h_weights * _passes(cfg),
        # y and dp read once from DRAM (the chunks of a share run side by side and share them in L2)
        dram_bytes=(eb * m * (ci + co) + 4 * shares * total
                    + chunks * eb * (ci + co) * cfg.block_h_weights),
        l2_bytes=(chunks - 1) * eb * m * (ci + co),
        loops=(Loop("tiles", per),),
        note=f"FFN backward weights {ci}->{r}->{co}, {shares} shares of {per} tiles x {chunks} chunks",
    )


def ffn_bwd_input_cost(cfg: TrainConfig, m: int, ci: int, co: int, r: int, eb: int, bn_sums: bool,
                       shares: int, per: int) -> KernelCost:
    tiles = cdiv(m, cfg.block_m_input)
    chunks = cdiv(r, cfg.block_h)
    return KernelCost(
        useful_macs=m * (ci + co) * r,
        mma_macs=(tiles * chunks * cfg.block_m_input * cfg.block_h * (2 * cfg.cp_in + cfg.cp_out)
                  * _passes(cfg)),
        dram_bytes=(eb * m * (2 * ci + co + (ci if bn_sums else 0)) + eb * (ci + co) * r
                    + (8 * shares * ci if bn_sums else 0)),
        loops=(Loop("tiles", per, (Loop("hidden", chunks),)),),
        note=f"FFN backward input {ci}->{r}->{co}",
    )


def finalize_cost(what: str, dram_bytes: int, loops: tuple, note: str) -> KernelCost:
    """A finalize launch (finalize.py): per-channel partials and vectors read and written once, no MMA."""
    return KernelCost(useful_macs=0, mma_macs=0, dram_bytes=dram_bytes, loops=loops, note=f"{what} {note}")
