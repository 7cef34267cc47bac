"""A stride-1 ConvFirst block (folded weights, inference) as two launches instead of the fused kernel,
where ``staged`` takes them (launcher.py, "Staged stride-1 blocks": why and where).

a = gconv3x3(x) (the group-width-8 conv, kernels/gconv: several programs per SM, no hidden chunks beside
its windows), stored (C channels, narrow); then ``_convfirst_ffn_kernel``: per tile of BM consecutive
pixels, y = a + b_conv rounded once, out = x + b2 + W2 ReLU(W1 y + b1) over hidden chunks, the wide
hidden tile never leaving the chip. Its hidden chunks are the fused kernel's (kernel.py
``_resident_weights``, ``_streamed_chunks``): resident in shared memory for all of a program's tiles
where they fit (C <= 64; their b1 in registers), otherwise streamed from L2 per tile (ld.global.cg).
Without the conv's windows and registers beside them, the FFN runs 4-warp programs: with every chunk
resident one per SM, its tile loop software-pipelined (the a and x rows of the next tiles in flight by
cp.async), otherwise two per SM; the fused kernel runs one of 8 (C >= 64).

The same FFN launch runs the 16-bit stride-1 ConvFirst training forward on sm_90 (``ffn_train_forward``,
the kernel's TRAIN mode, for kernels/convfirst_train/launcher.py): p = W2 ReLU(k2 W1 (k1 a + t1) + t2)
with BN2 folded into the expand's rows, no residual, and per program the moments of the stored p (BN3's
batch statistics), its tiles one run so that the programs are equal shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import cdiv, launch
from ..gconv.launcher import gconv3x3_triton
from . import launcher
from ..convfirst_train.kernel import merge_tile_moments
from .kernel import (_a_base, _a_width, _hidden_chunk_b1, _load_part, _load_vec, _resident_weights,
                     _store_part, _streamed_chunks)


@triton.jit
def _convfirst_ffn_kernel(
    a_ptr, x_ptr, bc_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,  # a, x, out: (M, C) contiguous rows
    k1_ptr, mean_ptr, m2_ptr,  # TRAIN only: y's scale (C); out's moments, a row of C per program (fp32)
    M, TILES, R_RUN, PER, SPAN, STEP,
    sw1_r, sw1_c, sw2_k, sw2_r,
    C: tl.constexpr, NPX: tl.constexpr, PW: tl.constexpr, PWL: tl.constexpr, K0: tl.constexpr,
    K1: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BLOCK_H: tl.constexpr, RESIDENT: tl.constexpr,
    PRECISION: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr, TRAIN: tl.constexpr,
    B1_REGS: tl.constexpr,
):
    """out = x + b2 + W2 ReLU(W1 (a + b_conv) + b1), tile by tile (persistent programs: tiles PER p,
    PER p + STEP, ... below PER p + SPAN). TRAIN (the training forward, ``ffn_train_forward``): out = p =
    W2 ReLU(W1 (k1 a + b_conv) + b1), no residual and no b2, and the program's moments of the stored p
    (Chan's merge tile by tile) in its row of mean_ptr and m2_ptr; its tiles are one run (STEP 1)."""
    w1s, w2a, w2b = _resident_weights(w1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k, sw2_r, NPX, 1, PW, PWL, C,
                                      K0, K1, C, R, BLOCK_H, RESIDENT)
    dt = a_ptr.dtype.element_ty
    # B1_REGS: the resident chunks' b1, loaded once into registers (inference: in x's dtype): loaded per
    # chunk and tile, each load's latency was exposed before the chunk's bias + ReLU. The training forward's
    # b1 (BN2's shift, fp32) beside p's moments: in registers up to 128 channels (``_ffn_launch``)
    b1s = ()
    if B1_REGS:
        for i in tl.static_range(RESIDENT):
            hh = i * BLOCK_H + tl.arange(0, BLOCK_H)
            b1s = b1s + (tl.load(b1_ptr + hh, mask=hh < R, other=0.0),)
    t0 = tl.program_id(0) * PER
    if TRAIN:
        mean0 = tl.zeros((K0,), tl.float32)
        m20 = tl.zeros((K0,), tl.float32)
        mean1 = mean0
        m21 = m20
        if K1 > 0:
            mean1 = tl.zeros((K1,), tl.float32)
            m21 = tl.zeros((K1,), tl.float32)
    for t in tl.range(t0, tl.minimum(t0 + SPAN, TILES), STEP, num_stages=STAGES):
        rows = t * BM + tl.arange(0, BM)
        m_ok = rows < M
        a_pix = a_ptr + rows.to(tl.int64) * C
        x_pix = x_ptr + rows.to(tl.int64) * C
        out_pix = out_ptr + rows.to(tl.int64) * C
        ys = ()
        for p in tl.static_range(NPX):
            v = _load_part(a_pix, m_ok, _a_base(p, NPX, PW, C), _a_width(p, NPX, PW, PWL), C)
            if TRAIN:
                v = v * _load_vec(k1_ptr, _a_base(p, NPX, PW, C), _a_width(p, NPX, PW, PWL), C)[None, :]
            ys = ys + ((v + _load_vec(bc_ptr, _a_base(p, NPX, PW, C), _a_width(p, NPX, PW, PWL), C)[None, :]
                        ).to(dt),)
        if TRAIN:
            acc0 = tl.zeros((BM, K0), tl.float32)
            acc1 = acc0
            if K1 > 0:
                acc1 = tl.zeros((BM, K1), tl.float32)
        else:  # the residual and b2 start the accumulators: no extra registers across the chunk loop
            acc0 = _load_part(x_pix, m_ok, 0, K0, C) + _load_vec(b2_ptr, 0, K0, C)[None, :]
            acc1 = acc0
            if K1 > 0:
                acc1 = _load_part(x_pix, m_ok, K0, K1, C) + _load_vec(b2_ptr, K0, K1, C)[None, :]
        for i in tl.static_range(RESIDENT):
            if B1_REGS:
                b1 = b1s[i].to(tl.float32)
            else:
                hh = i * BLOCK_H + tl.arange(0, BLOCK_H)
                b1 = tl.load(b1_ptr + hh, mask=hh < R, other=0.0).to(tl.float32)
            if K1 > 0:
                acc0, acc1 = _hidden_chunk_b1(ys, acc0, acc1, w1s, i * NPX, w2a[i], w2b[i], b1, NPX, K1,
                                              PRECISION, ASM)
            else:
                acc0, acc1 = _hidden_chunk_b1(ys, acc0, acc1, w1s, i * NPX, w2a[i], w2a[i], b1, NPX, K1,
                                              PRECISION, ASM)
        if RESIDENT * BLOCK_H < R:  # the other chunks' weights (and b1) from L2, per tile
            acc0, acc1 = _streamed_chunks(ys, acc0, acc1, w1_ptr, b1_ptr, w2_ptr, sw1_r, sw1_c, sw2_k,
                                          sw2_r, RESIDENT * BLOCK_H, R_RUN, NPX, 1, PW, PWL, C, K0, K1, C, R,
                                          BLOCK_H, ".cg", PRECISION, ASM)
        _store_part(out_pix, acc0, m_ok, 0, K0, C)
        if K1 > 0:
            _store_part(out_pix, acc1, m_ok, K0, K1, C)
        if TRAIN:  # BN3's statistics of the stored (rounded) p, as a layer-wise BatchNorm reads it
            n_prev = ((t - t0) * BM).to(tl.float32)
            nt = tl.minimum(M - t * BM, BM).to(tl.float32)
            mean0, m20 = merge_tile_moments(acc0.to(dt), m_ok, mean0, m20, n_prev, nt)
            if K1 > 0:
                mean1, m21 = merge_tile_moments(acc1.to(dt), m_ok, mean1, m21, n_prev, nt)
    if TRAIN:
        k = tl.arange(0, K0)
        tl.store(mean_ptr + tl.program_id(0) * C + k, mean0, mask=k < C)
        tl.store(m2_ptr + tl.program_id(0) * C + k, m20, mask=k < C)
        if K1 > 0:
            k = K0 + tl.arange(0, K1)
            tl.store(mean_ptr + tl.program_id(0) * C + k, mean1, mask=k < C)
            tl.store(m2_ptr + tl.program_id(0) * C + k, m21, mask=k < C)


FFN_WARPS = 4
# ffn_train_forward's tiles a program under the interpreter (CPU tensors): the tests' small maps run its tile
# loop twice and merge the moments of several programs
TRAIN_INTERPRETER_TILES = 2
FFN_PROGRAMS_PER_SM = 2
RESIDENT_STAGES = 3  # 1: the tile loop not pipelined, two programs per SM (the form before; a GPU A/B)


@dataclass(frozen=True)
class FFNConfig:
    """One compiled variant of the FFN launch."""

    c: int
    r: int
    parts: tuple[int, int]  # channel parts of y and of the output (second 0 if none)
    block_m: int
    block_h: int
    num_warps: int
    programs_per_sm: int
    resident: int  # hidden chunks whose weights stay in shared memory (the others stream from L2)
    precision: str
    stages: int = 1  # software pipelining of the tile loop (its a and x rows loaded stages - 1 tiles ahead)

    @property
    def chunks(self) -> int:
        return -(-self.r // self.block_h)


def staged(x: torch.Tensor, stride: int) -> bool:
    """Whether the block runs as the conv and FFN launches rather than the fused kernel
    (``launcher.STAGED``; None: every 16-bit stride-1 block on sm_90 and later, launcher.py "Staged
    stride-1 blocks")."""
    if stride != 1:
        return False
    if launcher.STAGED is not None:
        return launcher.STAGED
    return x.dtype != torch.float32 and launcher.device_arch(x.device) >= 90


def ffn_config(c: int, r: int, dtype: torch.dtype, arch: int = 90, train: bool = False) -> FFNConfig:
    """The FFN launch's tiles for C -> R -> C in ``dtype`` on a GPU of compute capability ``arch`` (x 10)
    (launcher.py, "Staged stride-1 blocks"); ``train``: the training forward's (``ffn_train_forward``)."""
    parts = launcher.channel_parts(c)
    width = sum(parts)
    bh = launcher.hidden_block(r)
    if dtype == torch.float32:  # 3xTF32 operands triple the registers: the fused kernel's fp32 tiles
        bm, bh, budget = 64, min(bh, 32), 0
    elif width > 64:  # C = 72, 96: the weights (166-221 KB) stream from L2, 64 hidden channels a chunk
        # (on mma.sync, below sm_90, 128 rows spilled 24 B at C = 96)
        # (training: 32 hidden channels a chunk; with p's moments beside its accumulator, 64 spilled 152 B
        # at C = 96 and 64-row tiles took 150.5 against 149.6 us, static estimate, Small, sm_90, high end)
        bm, bh, budget = 128 if arch >= 90 else 64, 32 if train else 64, 0
    elif width > 32:  # C = 48, 64: every chunk resident (C = 64: 96 KB)
        bm, bh, budget = 64, 64, 96 << 10
    else:
        bm, budget = 128, 96 << 10
    res = launcher.resident_chunks(width, parts, bh, r, 4 if dtype == torch.float32 else 2, budget)
    # every chunk resident: the tile loop is the innermost loop, which Triton software-pipelines (a and x
    # rows cp.async'd RESIDENT_STAGES - 1 tiles ahead); one program per SM, whose buffers and chunks two
    # would not fit (C = 64) and which a second program does not speed up
    pipelined = res * bh >= r and dtype != torch.float32 and RESIDENT_STAGES > 1
    return FFNConfig(c, r, parts, bm, bh, FFN_WARPS, 1 if pipelined else FFN_PROGRAMS_PER_SM, res,
                     launcher.precision_for(dtype), RESIDENT_STAGES if pipelined else 1)


def ffn_cost(cfg: FFNConfig, m: int, programs: int, eb: int, train: bool = False) -> KernelCost:
    """What one FFN launch over m pixel rows issues (see ``kernels/_cost.py``): a, x and out once each, the
    weights once from DRAM (the streamed chunks' again from L2 by every tile: ld.global.cg, counted from
    the SASS); L1-allocating loads: per tile its a and x rows, read once (cp.async, skipping L1, where the
    tile loop is pipelined), and the biases, which every thread of every tile re-reads: the working set
    that must stay in L1 is the biases alone. ``train`` (``ffn_train_forward``): no x, b1 and the input's
    scale and shift in fp32, and a row of p's moments per program."""
    c, r, bm, bh = cfg.c, cfg.r, cfg.block_m, cfg.block_h
    trips = cdiv(cdiv(m, bm), programs)
    streamed = cfg.chunks - cfg.resident
    maps = 2 if train else 3
    small = (2 * c + r) * (4 if train else eb)
    return KernelCost(
        useful_macs=2 * m * c * r,
        mma_macs=programs * trips * cfg.chunks * bh * 2 * sum(cfg.parts) * bm,
        dram_bytes=eb * (maps * m * c + 2 * c * r) + small + (8 * programs * c if train else 0),
        loops=(Loop("tiles", trips, (Loop("streamed", streamed),) if streamed else ()),),
        l1_unique_bytes_per_program=eb * trips * (maps - 1) * bm * c + small,
        # (training: no L1 set declared, so the L1-allocating loads count as hits only where all the
        # unique bytes fit, and the check that a declared set's loads are all plain L1-allocating ones
        # (tests/kernels/test_convfirst_train.py) does not apply: the a rows go by cp.async where the tile
        # loop is pipelined, the streamed chunks by ld.global.cg)
        l1_working_set_bytes=None if train else small,
        note=f"FFN{' training forward' if train else ''} C={c} R={r} rows {bm}, {cfg.resident}/{cfg.chunks} "
             f"chunks resident, {trips} tiles per program",
    )


def _ffn_launch(cfg: FFNConfig, a, x, bc, w1, b1, w2, b2, out, k1, mean, m2, m: int, tiles: int,
                programs: int, per: int, train: bool) -> None:
    asm = a.device.type != "cpu" and a.dtype != torch.float32
    c, r = cfg.c, cfg.r
    # inference: tiles p, p + programs, ...; training: one run of per tiles (its moments' share)
    span, step = (per, 1) if train else (tiles, programs)
    # the training forward's fp32 b1 in registers at Small's C = 32 (96 channels; static estimate, batch
    # 128, sm_90, high end: 146.0 -> 144.1 us); at C = 64 (384) they took it to 255 registers and 96 B of
    # stack beside p's moments (loaded per chunk and tile: 149.9 us, no stack)
    b1_regs = not train or cfg.resident * cfg.block_h <= 128
    launch(_convfirst_ffn_kernel, (programs,), a, x, bc, w1, b1, w2, b2, out, k1, mean, m2, m, tiles, r,
           per if train else 1, span, step, *w1.stride(), *w2.stride(), C=c,
           NPX=1 + (cfg.parts[1] > 0), PW=cfg.parts[0], PWL=cfg.parts[1] or cfg.parts[0], K0=cfg.parts[0],
           K1=cfg.parts[1], R=r, BM=cfg.block_m, BLOCK_H=cfg.block_h, RESIDENT=cfg.resident,
           PRECISION=cfg.precision, ASM=asm, STAGES=cfg.stages, TRAIN=train, B1_REGS=b1_regs,
           num_warps=cfg.num_warps,
           num_stages=1, cost=lambda: ffn_cost(cfg, m, programs, a.element_size(), train))


def ffn_train_forward(a: torch.Tensor, k1: torch.Tensor, t1: torch.Tensor, w1s: torch.Tensor,
                      t2: torch.Tensor, w2: torch.Tensor):
    """The stride-1 ConvFirst training forward's FFN on this launch's tiles: p = W2 ReLU(w1s (k1 a + t1)
    + t2), with w1s = k2 W1 (BN2 folded into the expand's rows; kernels/convfirst_train/finalize.py
    ``_linear_moments_kernel`` forms it) and its per-program moments, for BN3. a: contiguous NHWC (N, C, H,
    W) 16-bit or fp32; k1, t1 (C), t2 (R) fp32; w1s (R, C), w2 (C, R) in a's dtype. Returns (p, mean (S,
    C), m2 (S, C), rows per share) as kernels/convfirst_train/launcher.py ``ffn_forward``."""
    n, c, h, w = a.shape
    r = w1s.shape[0]
    m = n * h * w
    cfg = ffn_config(c, r, a.dtype, launcher.device_arch(a.device), train=True)
    tiles = cdiv(m, cfg.block_m)
    per = TRAIN_INTERPRETER_TILES if a.device.type == "cpu" else cdiv(tiles, launcher.programs_for(cfg, tiles,
                                                                                                 a.device))
    programs = cdiv(tiles, per)
    p = torch.empty_like(a)
    mean = torch.empty((programs, c), device=a.device, dtype=torch.float32)
    m2 = torch.empty((programs, c), device=a.device, dtype=torch.float32)
    _ffn_launch(cfg, a, a, t1, w1s, t2, w2, t2, p, k1, mean, m2, m, tiles, programs, per, True)
    return p, mean, m2, per * cfg.block_m


def convfirst_staged(x: torch.Tensor, w_conv: torch.Tensor, b_conv: torch.Tensor, w1: torch.Tensor,
                     b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """The stride-1 block as the conv launch and the FFN launch; x (N, C, H, W) in any memory format,
    validated by the op. NHWC out."""
    n, c, h, w = x.shape
    r = w1.shape[0]
    x = x.contiguous(memory_format=torch.channels_last)
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    a = gconv3x3_triton(x, w_conv, 1)
    cfg = ffn_config(c, r, x.dtype, launcher.device_arch(x.device))
    m = n * h * w
    tiles = cdiv(m, cfg.block_m)
    programs = launcher.programs_for(cfg, tiles, x.device)
    _ffn_launch(cfg, a, x, b_conv.contiguous(), w1, b1.contiguous(), w2, b2.contiguous(), out, b1, b1, b1, m,
                tiles, programs, 1, False)
    return out
