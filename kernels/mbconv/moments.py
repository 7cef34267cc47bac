"""The MBConv kernels (kernel.py) in a training step's forward, where the three BatchNorms normalise with
the batch's statistics (convfirstnet/mbconv_fused_forward.py folds them per step):

* ``conv_moments``: the hidden kernel in its moments mode (``MOMENTS``): expand (BN_e folded) + SiLU +
  grouped conv as in inference, then, instead of g, the pool and the SE partials, per image and pixel
  sub-tile of the conv the fp32 sums of ``u - shift`` and of its square per hidden channel (``u`` the
  conv output before BN_d, ``shift`` passed as the conv bias), written to their own rows ([N][2][CS][R],
  no atomics). Merged here in a fixed order (per image, then over images by Chan's rule in fp64) into
  the batch mean and biased variance of ``u``. The shift (the caller passes BN_d's running mean) keeps
  the per-image sum of squares from cancelling when the mean is large against the spread.
* ``mbconv_unnormalised``: the usual launch pair (hidden kernel writing g and the SE partials,
  projection) without the residual: ``W_proj (g * gate) + b_proj``, whose BatchNorm the caller applies.

The geometry, buffers and cost declarations are launcher.py's (``mbconv_config``, ``hidden_cost``,
``project_cost``); the moments launch declares the hidden kernel's work less what it skips.
"""

from __future__ import annotations

import dataclasses

import torch

from .._cost import KernelCost, Loop
from .._launch import launch
from .kernel import _mbconv_hidden_kernel, _mbconv_project_kernel
from .launcher import BMO, FP32_PRECISION, MBConvGeometry, hidden_cost, mbconv_config, project_cost


def _geometry(x: torch.Tensor, w_exp: torch.Tensor, w_se1: torch.Tensor, k: int, stride: int
              ) -> MBConvGeometry:
    n, c, h, w = x.shape
    return mbconv_config(c, w_exp.shape[0], k, h, w, stride, n=n, s=w_se1.shape[0], dtype=x.dtype,
                         dense=x.stride(2) == w * x.stride(3), device=x.device)


def _settings(x: torch.Tensor) -> tuple[int, str]:
    """(SILU mode, dot precision) as launcher.mbconv_triton picks them."""
    silu = 0 if x.dtype == torch.float32 or x.device.type == "cpu" else 1
    return silu, FP32_PRECISION if x.dtype == torch.float32 else "tf32"


def _scratch(geo: MBConvGeometry, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden kernel's scratch (h slots, stride-2 g slots) and mean slots, as mbconv_triton makes them
    (NaN-filled on CPU, so that a read before a write fails a test)."""
    scratch = torch.empty((geo.programs * geo.slot,), device=x.device, dtype=x.dtype)
    if x.device.type == "cpu":
        scratch.fill_(float("nan"))
    mslot = torch.empty((geo.programs, geo.mean_slot), device=x.device, dtype=torch.float32)
    gscratch = scratch[geo.slot_images * geo.h_slot:] if geo.stride == 2 else scratch
    return scratch, gscratch, mslot


def moment_partials(x: torch.Tensor, w_exp: torch.Tensor, b_exp: torch.Tensor, w_conv: torch.Tensor,
                    shift: torch.Tensor, w_se1: torch.Tensor, k: int, stride: int) -> torch.Tensor:
    """The moments launch: [N, 2, CS, R] fp32, [n, 0, j] the sums of ``u - shift`` over pixel sub-tile j of
    image n, [n, 1, j] the sums of its square. ``w_exp``, ``b_exp``: the expand with BN_e folded;
    ``w_conv``: the raw grouped-conv weights (R, 8, 3, 3); ``w_se1`` and ``k`` only size the geometry
    (the same one as the launch pair that follows)."""
    n, c, h, w = x.shape
    r = w_exp.shape[0]
    geo = _geometry(x, w_exp, w_se1, k, stride)
    cs = geo.conv_split
    parts = torch.empty((n, 2, cs, r), device=x.device, dtype=torch.float32)
    if n == 0:
        return parts
    scratch, gscratch, mslot = _scratch(geo, x)
    silu, prec = _settings(x)
    unused = torch.empty((1,), device=x.device, dtype=x.dtype)  # g_ptr: no g is written
    neg_shift = (-shift).contiguous()
    launch(_mbconv_hidden_kernel, (geo.programs,), x, w_exp, b_exp.contiguous(), w_conv, neg_shift, w_se1,
           unused, parts, scratch, gscratch, mslot, n, h, w, geo.oh, geo.ow, c, r, w_se1.shape[0], geo.nchunk,
           geo.groups, geo.chunks_per_group, geo.items, geo.ib, geo.slot, *x.stride(),
           *w_exp.stride(), *w_conv.stride(), *w_se1.stride(), cost=lambda: moments_cost(geo),
           **geo.hidden_constexprs(silu, prec), MOMENTS=True)
    return parts


def merge_moments(parts: torch.Tensor, pixels: int, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, biased variance) per channel, fp32, from ``moment_partials``' rows over ``pixels`` pixels
    per image: each image's sums (its sub-tiles added), then Chan's parallel rule over the images in
    fp64 (no sum of squares over the whole batch, whose cancellation grows with it)."""
    s = parts.double().sum(2)  # [N, 2, R]
    mean_i = s[:, 0] / pixels
    m2_i = (s[:, 1] - s[:, 0] * mean_i).clamp_min(0.0)
    mean = mean_i.mean(0)
    m2 = m2_i.sum(0) + pixels * ((mean_i - mean) ** 2).sum(0)
    var = m2 / (pixels * parts.shape[0])
    return (mean + shift.double()).float(), var.float()


def moments_cost(geo: MBConvGeometry) -> KernelCost:
    """The hidden kernel's declaration (launcher.hidden_cost) less what the moments mode skips: the g
    store (stride 1: to DRAM; stride 2: its slot round trip and the blur), the pool and the SE partial
    (its MACs, W_se1 and the partials' writes); plus the moment rows (fp32) written."""
    full = hidden_cost(geo)
    n, r, eb, hw, ohw = geo.n, geo.r, geo.elem, geo.hw, geo.ohw
    useful = full.useful_macs - n * ((ohw * r * 9 if geo.stride == 2 else 0) + r * geo.s)
    rows = n * 2 * geo.conv_split * r * 4
    dram = full.dram_bytes - (geo.s * r + n * ohw * r) * eb - n * geo.nchunk * geo.sp * 4 + rows
    l2 = full.l2_bytes - geo.nchunk * n * geo.rb * 8
    if geo.stride == 2:
        l2 -= geo.nchunk * (n * hw * geo.rb + n * geo.tiles_o * 9 * BMO * geo.rb) * eb

    def strip(loops: tuple[Loop, ...]) -> tuple[Loop, ...]:
        return tuple(dataclasses.replace(lp, body=strip(lp.body)) for lp in loops
                     if lp.name != "blur tiles")

    return dataclasses.replace(full, useful_macs=useful, dram_bytes=dram, l2_bytes=l2,
                               loops=strip(full.loops),
                               note=full.note + "; moments: per-image sums of u and u^2, no g")


def mbconv_unnormalised(x: torch.Tensor, w_exp: torch.Tensor, b_exp: torch.Tensor, w_conv: torch.Tensor,
                        b_conv: torch.Tensor, w_se1: torch.Tensor, b_se1: torch.Tensor, w_se2: torch.Tensor,
                        b_se2: torch.Tensor, w_proj: torch.Tensor, b_proj: torch.Tensor, stride: int
                        ) -> torch.Tensor:
    """``W_proj (g * gate) + b_proj`` (NHWC, x's dtype): launcher.mbconv_triton's launch pair without the
    residual (whatever the stride), the weights with BN_e and BN_d folded (2-D 1x1 weights)."""
    n, c, h, w = x.shape
    r, k, s = w_exp.shape[0], w_proj.shape[0], w_se1.shape[0]
    geo = _geometry(x, w_exp, w_se1, k, stride)
    out = torch.empty((n, k, geo.oh, geo.ow), device=x.device, dtype=x.dtype,
                      memory_format=torch.channels_last)
    if n == 0:
        return out
    scratch, gscratch, mslot = _scratch(geo, x)
    gbuf = torch.empty((n, geo.ohw, r), device=x.device, dtype=x.dtype)
    zpart = torch.empty((n, geo.nchunk, geo.sp), device=x.device, dtype=torch.float32)
    silu, prec = _settings(x)
    b_exp, b_conv, b_proj, b_se1, b_se2 = (t.contiguous() for t in (b_exp, b_conv, b_proj, b_se1, b_se2))
    launch(_mbconv_hidden_kernel, (geo.programs,), x, w_exp, b_exp, w_conv, b_conv, w_se1, gbuf, zpart,
           scratch, gscratch, mslot, n, h, w, geo.oh, geo.ow, c, r, s, geo.nchunk, geo.groups,
           geo.chunks_per_group, geo.items, geo.ib, geo.slot, *x.stride(), *w_exp.stride(), *w_conv.stride(),
           *w_se1.stride(), cost=lambda: hidden_cost(geo), **geo.hidden_constexprs(silu, prec))
    launch(_mbconv_project_kernel, geo.p_grid, gbuf, zpart, b_se1, w_se2, b_se2, w_proj, b_proj, x, out,
           n, geo.ohw, geo.ow, r, k, s, geo.nchunk, geo.tpi, *x.stride(), *out.stride(), *w_se2.stride(),
           *w_proj.stride(), cost=lambda: _no_residual(project_cost(geo), geo),
           **dict(geo.project_constexprs(silu, prec), RESIDUAL=False))
    return out


def _no_residual(cost: KernelCost, geo: MBConvGeometry) -> KernelCost:
    """project_cost without the residual tile's read (stride 1 declares it)."""
    if geo.stride != 1:
        return cost
    out = geo.n * geo.ohw * geo.k * geo.elem
    return dataclasses.replace(cost, dram_bytes=cost.dram_bytes - out,
                               l1_unique_bytes_per_program=cost.l1_unique_bytes_per_program
                               - geo.p_bm * geo.p_bn * geo.elem)
