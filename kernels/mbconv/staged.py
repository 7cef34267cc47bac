"""An MBConv + SE block (folded weights, inference) as staged launches instead of the hidden kernel, where
``staged`` takes them (launcher.py: why and where), h and g through DRAM.

h = SiLU(x W_exp^T + b_exp) (the expand kernel, expand_backward.expand_forward), then g = SiLU(gconv3x3(h)
+ b_conv) (the group-width-8 conv with its BIAS_SILU epilogue, kernels/gconv). Stride 1: the conv's
epilogue also sums each tile's g (POOL); the SE gates from those pools (``_se_pool_gates_kernel``, one
image per program); the projection + the residual (launcher.launch_project, reading one gate vector per
step): four launches. Stride 2: the training forward's BN_d pass blurs and pools g as it is
(moments.mbconv_from_conv_output, ``activated``), then the gates and the projection: five.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._cost import KernelCost, Loop
from .._launch import cdiv, launch, next_power_of_2
from ..gconv.launcher import gconv3x3_silu_triton
from . import launcher
from .expand_backward import expand_folded, offsets_fit
from .kernel import se_gate_rows
from .launcher import gate_rows, geometry_of, kernel_settings, launch_project
from .moments import mbconv_from_conv_output

POOL_CHANNELS = 256  # hidden channels a step of the gates' first SE layer
POOL_TILES = 8  # tiles' pool rows a step at most
POOL_WARPS = 4


def staged(x: torch.Tensor, r: int) -> bool:
    """Whether the block runs as staged launches rather than the hidden kernel (``launcher.STAGED``; None:
    wherever the expand's operands take its 32-bit offsets, launcher.py's docstring; past that the hidden
    kernel, which takes any batch)."""
    if launcher.STAGED is not None:
        return launcher.STAGED
    n, c, h, w = x.shape
    return offsets_fit(n * h * w, c, r)


@triton.jit
def _se_pool_gates_kernel(pool_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, T, HW, R, S,
                          sw1_s, sw1_r, sw2_r, sw2_s, SP: tl.constexpr, RB: tl.constexpr, TB: tl.constexpr,
                          GB: tl.constexpr, SILU: tl.constexpr):
    """The SE gates of image n from its T tiles' pools (N T, R) fp32: mean = (sum of the rows, in a fixed
    order) / (H W), z = ReLU(W_se1 mean + b_se1), gates = sigmoid(W_se2 z + b_se2) in x's dtype, (N, R)
    (kernel.py ``se_gate_rows``: the hidden kernel's gate arithmetic)."""
    n = tl.program_id(0).to(tl.int64)
    sv = tl.arange(0, SP)
    s_ok = sv < S
    z = tl.zeros((SP,), dtype=tl.float32)
    for r0 in range(0, R, RB):
        rv = r0 + tl.arange(0, RB)
        r_ok = rv < R
        total = tl.zeros((RB,), dtype=tl.float32)
        for t0 in range(0, T, TB):
            tv = t0 + tl.arange(0, TB)
            rows = tl.load(pool_ptr + (n * T + tv[:, None]) * R + rv[None, :],
                           mask=(tv < T)[:, None] & r_ok[None, :], other=0.0)
            total += tl.sum(rows, axis=0)
        w1 = tl.load(w1_ptr + sv[:, None] * sw1_s + rv[None, :] * sw1_r, mask=s_ok[:, None] & r_ok[None, :],
                     other=0.0).to(tl.float32)
        z += tl.sum(w1 * (total / HW)[None, :], axis=1)
    z = tl.maximum(z + tl.load(b1_ptr + sv, mask=s_ok, other=0.0).to(tl.float32), 0.0)
    se_gate_rows(z, w2_ptr, b2_ptr, gate_ptr, n, R, sv, s_ok, sw2_r, sw2_s, GB, SILU)


def _se_pool_gates_cost(n: int, r: int, s: int, tiles: int, tb: int, eb: int) -> KernelCost:
    """The pools read once (TB rows a step); W_se1, W_se2 and the biases once per launch (then from L2 for
    the other images); the gates written."""
    weights = (2 * r * s + r + s) * eb
    dram = weights + n * tiles * r * 4 + n * r * eb
    rows = (Loop("pool rows", cdiv(tiles, tb), fixed=True),) if tiles > 1 else ()  # T = 1: a constexpr
    loops = (Loop("pool steps", cdiv(r, POOL_CHANNELS), rows, fixed=True),
             Loop("gate steps", cdiv(r, gate_rows(r)), fixed=True))
    return KernelCost(2 * n * r * s, 0, dram, loops, l2_bytes=(n - 1) * weights,
                      l1_unique_bytes_per_program=weights + tiles * r * 4,
                      note="the SE gates from the tiles' pools, one image per program")


def se_pool_gates(pools: torch.Tensor, tiles: int, pixels: int, w_se1: torch.Tensor, b_se1: torch.Tensor,
                  w_se2: torch.Tensor, b_se2: torch.Tensor, dtype: torch.dtype, silu: int) -> torch.Tensor:
    """The SE gates (N, R) in ``dtype`` from the pools (N ``tiles``, R) fp32 of images of ``pixels`` pixels
    (``_se_pool_gates_kernel``; ``silu``: the sigmoid's inline-asm form, launcher.kernel_settings)."""
    r, s = w_se2.shape
    n = pools.shape[0] // tiles
    gates = torch.empty((n, r), device=pools.device, dtype=dtype)
    eb = gates.element_size()
    tb = min(POOL_TILES, next_power_of_2(tiles))
    launch(_se_pool_gates_kernel, (n,), pools, w_se1, b_se1.contiguous(), w_se2, b_se2.contiguous(), gates,
           tiles, pixels, r, s, *w_se1.stride(), *w_se2.stride(),
           cost=lambda: _se_pool_gates_cost(n, r, s, tiles, tb, eb), SP=max(16, next_power_of_2(s)),
           RB=POOL_CHANNELS, TB=tb, GB=gate_rows(r), SILU=silu,
           num_warps=POOL_WARPS)
    return gates


def _stride1(x: torch.Tensor, hid: torch.Tensor, w_conv: torch.Tensor, b_conv: torch.Tensor,
             w_se1: torch.Tensor, b_se1: torch.Tensor, w_se2: torch.Tensor, b_se2: torch.Tensor,
             w_proj: torch.Tensor, b_proj: torch.Tensor) -> torch.Tensor:
    """The conv with bias, SiLU and the pool, the gates, the projection + x (module docstring)."""
    n, c, h, w = x.shape
    r, k, s = w_proj.shape[1], w_proj.shape[0], w_se1.shape[0]
    silu, _ = kernel_settings(x)
    h4 = hid.view(n, h, w, r).permute(0, 3, 1, 2)
    g4, pools, tpi = gconv3x3_silu_triton(h4, w_conv, b_conv.contiguous(), silu, True)
    gates = se_pool_gates(pools, tpi, h * w, w_se1, b_se1, w_se2, b_se2, x.dtype, silu)
    geo = dataclasses.replace(geometry_of(x, r, k, s, 1), gate=True)  # the projection reads the gates
    out = torch.empty((n, k, h, w), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    launch_project(geo, g4.permute(0, 2, 3, 1).reshape(n, h * w, r), pools, gates, b_se1, w_se2, b_se2,
                   w_proj, b_proj.contiguous(), x, out, True)
    return out


def mbconv_staged_triton(x: torch.Tensor, w_exp: torch.Tensor, b_exp: torch.Tensor, w_conv: torch.Tensor,
                         b_conv: torch.Tensor, w_se1: torch.Tensor, b_se1: torch.Tensor, w_se2: torch.Tensor,
                         b_se2: torch.Tensor, w_proj: torch.Tensor, b_proj: torch.Tensor,
                         stride: int) -> torch.Tensor:
    """The block as staged launches with the folded weights (module docstring)."""
    n, c, h, w = x.shape
    r = w_exp.shape[0]
    x2 = x.permute(0, 2, 3, 1).reshape(n * h * w, c)
    hid = expand_folded(x2, w_exp.contiguous(), b_exp.contiguous())
    if stride == 1:
        return _stride1(x, hid, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj)
    g4, _, _ = gconv3x3_silu_triton(hid.view(n, h, w, r).permute(0, 3, 1, 2), w_conv, b_conv.contiguous(),
                                    kernel_settings(x)[0], False)
    del hid
    g = g4.permute(0, 2, 3, 1).reshape(n, h * w, r)
    # activated: the BN_d pass only blurs and pools g; its statistics and affine are not read (b_conv
    # stands in for them: no tensor is built, and no fill kernel launched, for arguments never read)
    b = b_conv.contiguous()
    return mbconv_from_conv_output(g, x, b, b, b, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj, stride,
                                   activated=True)
