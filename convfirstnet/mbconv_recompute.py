"""MBConv + SE training that stores only the block's narrow input: the wide hidden activations (expand,
grouped conv, SE, gate; R = 4C channels) are recomputed from it in the backward, with layer-wise
kernels (the forward, where the Triton kernels run, through the fused MBConv kernels).

    torch.ops.convfirstnet.mbconv_recompute_train(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d,
        w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p, beta_p, running_mean_e, running_var_e,
        running_mean_d, running_var_d, running_mean_p, running_var_p, drop_scale, stride, momenta, eps,
        num_batches_tracked)
        -> (out, new running_mean_e, running_var_e, running_mean_d, running_var_d, running_mean_p,
            running_var_p)

    h = SiLU(BN_e(W_exp x));  a = SiLU(BN_d(gconv3x3(h)));  g = BlurPool(a) when stride 2, else a
    q = g sigmoid(W_se2 ReLU(W_se1 mean_hw(g) + b_se1) + b_se2);  o = BN_p(W_proj q)
    out = x + d_n o (stride 1; d_n the drop-path scale of image n), o (stride 2)

Weights in the module's shapes (4-D); the three BatchNorms normalise with the batch statistics
(``torch.native_batch_norm``, training mode). Their running statistics are updated on copies with
the factor of ``nn.BatchNorm2d`` (``momenta``: each one's momentum, or -1 for None: then 1 /
num_batches_tracked, which the caller has already counted), by the same kernel and rule, and returned:
the caller copies them back (a differentiable op must not mutate its inputs). Only ``out`` is
differentiable. Where the MBConv kernels run (mbconv_fused_forward.selected) the forward is theirs,
the BatchNorms normalising by the batch statistics (mbconv_fused_forward.py); elsewhere, and on
fake tensors, the layers below. Autograd saves x, the weights and drop_scale;
``mbconv_recompute_train_backward`` reruns the layer-wise forward without touching any running statistic
(running stats None, the same batch statistics, deterministically) and applies aten's backward of each
layer (``convolution_backward``, ``native_batch_norm_backward``, ``silu_backward``, ...): the formulas
autograd of the training form uses.

The group-width-8 conv runs ``torch.ops.convfirstnet.gconv3x3`` (+ ``gconv3x3_backward``) when the
Triton kernels are selected for x (``kernels._launch.use_triton``), ``F.conv2d`` otherwise. Both ops are
opaque custom ops, so ``torch.compile(fullgraph=True)`` keeps the recompute in the backward instead of
merging it with the forward (which would store the wide tensors again).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import mbconv_fused_backward, mbconv_fused_forward
from .kernels._autograd import function_around
from .kernels._blurpool import blur_filter
from .kernels._launch import GROUP_WIDTH, use_triton
from .kernels.mbconv.backward_reference import x_moments_reference

aten = torch.ops.aten
T = torch.Tensor
_1x1 = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "transposed": False,
        "output_padding": [0, 0]}


def _layers(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p,
            beta_p, drop_scale, stride: int, eps: float, running=None, factors=None) -> dict:
    """The training-form forward; every intermediate the backward needs. ``running``: the six running
    statistics to update in place (None: leave them alone, as the recompute must)."""
    dt = x.dtype
    run = running or (None,) * 6
    fac = factors or (0.0,) * 3
    v = {"x": x}
    v["e"] = F.conv2d(x, w_exp.to(dt))
    v["eb"], v["mean_e"], v["rstd_e"] = torch.native_batch_norm(v["e"], gamma_e, beta_e, run[0], run[1], True,
                                                                fac[0], eps)
    h = F.silu(v["eb"])
    if use_triton(h):
        h = h.contiguous(memory_format=torch.channels_last)
        v["d"] = torch.ops.convfirstnet.gconv3x3(h, w_dw, 1, True)
    else:
        v["d"] = F.conv2d(h, w_dw.to(dt), None, 1, 1, 1, h.shape[1] // GROUP_WIDTH)
    v["h"] = h
    v["db"], v["mean_d"], v["rstd_d"] = torch.native_batch_norm(v["d"], gamma_d, beta_d, run[2], run[3], True,
                                                                fac[1], eps)
    a = F.silu(v["db"])
    if stride == 2:  # timm's BlurPool2d: reflect padding of one pixel, [1 2 1]^2 / 16, stride 2
        v["apad"] = F.pad(a, (1, 1, 1, 1), mode="reflect")
        v["a"], g = a, F.conv2d(v["apad"], blur_filter(a.shape[1], dt, a.device), stride=2, groups=a.shape[1])
    else:
        g = a
    v["g"] = g
    v["p"] = g.mean((2, 3), keepdim=True)
    v["r"] = torch.relu(F.conv2d(v["p"], w_se1.to(dt), b_se1.to(dt)))
    v["gate"] = torch.sigmoid(F.conv2d(v["r"], w_se2.to(dt), b_se2.to(dt)))
    v["q"] = g * v["gate"]
    v["o"] = F.conv2d(v["q"], w_proj.to(dt))
    ob, v["mean_p"], v["rstd_p"] = torch.native_batch_norm(v["o"], gamma_p, beta_p, run[4], run[5], True,
                                                           fac[2], eps)
    if running is not None:  # the forward (the recompute needs BN_p's statistics only)
        v["out"] = x + ob * drop_scale.to(dt)[:, None, None, None] if stride == 1 else ob
    return v


def _forward(x: T, w_exp: T, gamma_e: T, beta_e: T, w_dw: T, gamma_d: T, beta_d: T, w_se1: T, b_se1: T,
             w_se2: T, b_se2: T, w_proj: T, gamma_p: T, beta_p: T, rm_e: T, rv_e: T, rm_d: T, rv_d: T,
             rm_p: T, rv_p: T, drop_scale: T, stride: int, momenta: list[float], eps: float, counts: list[T]
             ) -> tuple[T, T, T, T, T, T, T, T, T]:
    # nn.BatchNorm2d's factor: the momentum, or 1 / num_batches_tracked (already counted) for momentum None
    factors = tuple(m if m >= 0 else 1.0 / float(n) for m, n in zip(momenta, counts))
    return _train(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj,
                  gamma_p, beta_p, (rm_e, rv_e, rm_d, rv_d, rm_p, rv_p), drop_scale, stride, factors, eps,
                  fused=True)


def _train(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p,
           beta_p, running, drop_scale, stride, factors, eps, fused=False):
    """(out, the six updated running statistics, o, stats): o the projection before BN_p (narrow), stats
    the batch mean and rstd of BN_e, BN_d, BN_p and x's moments (mbconv_fused_forward.stats_size): what the
    backward (mbconv_fused_backward.py) starts from."""
    running = tuple(torch._foreach_add(list(running), 0))  # the six copies in one multi-tensor launch
    r, k = w_exp.shape[0], w_proj.shape[0]
    stats = x.new_empty((mbconv_fused_forward.stats_size(x.shape[1], r, k),), dtype=torch.float32)
    if fused and mbconv_fused_forward.selected(x, w_exp, w_proj, stride):  # the MBConv kernels
        out, o = mbconv_fused_forward.forward(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1,
                                              w_se2, b_se2, w_proj, gamma_p, beta_p, running, drop_scale,
                                              stride, factors, eps, stats)
        return (out, *running, o, stats)
    v = _layers(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p,
                beta_p, drop_scale, stride, eps, running, factors)
    for rows, bn in zip(mbconv_fused_forward.stats_rows(stats, r, k), "edp"):
        rows[0], rows[1] = v["mean_" + bn], v["rstd_" + bn]
    dev = x.device.type
    with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else contextlib.nullcontext():
        rows = x.detach().to(stats.dtype).permute(0, 2, 3, 1).reshape(-1, x.shape[1])
        w = w_exp.detach().reshape(r, -1).to(x.dtype)  # rounded as the layer's conv rounds it
        for dst, src in zip(mbconv_fused_forward.x_rows(stats, x.shape[1], r, k),
                            x_moments_reference(rows, w)):
            dst.copy_(src)
    return (v["out"], *running, v["o"].contiguous(memory_format=torch.channels_last), stats)


def _fake(*args):
    """Every layer on fake / meta tensors; only the momentum-None factor would read a value."""
    *tensors, drop_scale, stride, momenta, eps, counts = args
    return _train(*tensors[:14], tuple(tensors[14:20]), drop_scale, stride, (0.0,) * 3, eps)


mbconv_recompute_train = torch.library.custom_op("convfirstnet::mbconv_recompute_train", _forward,
                                                 mutates_args=())
mbconv_recompute_train.register_fake(_fake)


def _bn_backward(grad, v: dict, gamma, which: str, bn: str, eps: float):
    """aten's training-mode BatchNorm backward of v[which] with the batch statistics it was normalised by."""
    return aten.native_batch_norm_backward(grad, v[which], gamma, None, None, v["mean_" + bn],
                                           v["rstd_" + bn], True, eps, [True, True, True])


def _backward(grad_out: T, x: T, w_exp: T, gamma_e: T, beta_e: T, w_dw: T, gamma_d: T, beta_d: T, w_se1: T,
              b_se1: T, w_se2: T, b_se2: T, w_proj: T, gamma_p: T, beta_p: T, o: T, stats: T, drop_scale: T,
              stride: int, eps: float) -> tuple[T, T, T, T, T, T, T, T, T, T, T, T, T, T]:
    return _backward_impl(grad_out, x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2,
                          b_se2, w_proj, gamma_p, beta_p, o, stats, drop_scale, stride, eps, fused=True)


def _backward_fake(*args):
    """The layers' backward on fake / meta tensors (the same shapes and dtypes as the fused passes')."""
    return _backward_impl(*args, fused=False)


def _backward_impl(grad_out, x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2,
                   w_proj, gamma_p, beta_p, o, stats, drop_scale, stride, eps, fused):
    if fused and mbconv_fused_backward.selected(x, w_exp, w_proj, stride):  # the fused passes
        return mbconv_fused_backward.backward(grad_out, x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d,
                                              w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p, beta_p, o, stats,
                                              drop_scale, stride, triton=True)
    dt = x.dtype
    v = _layers(x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p,
                beta_p, drop_scale, stride, eps)
    grad_out = grad_out.to(dt)
    dob = grad_out * drop_scale.to(dt)[:, None, None, None] if stride == 1 else grad_out
    do, dgamma_p, dbeta_p = _bn_backward(dob, v, gamma_p, "o", "p", eps)
    dq, dw_proj, _ = aten.convolution_backward(do, v["q"], w_proj.to(dt), None, **_1x1, groups=1,
                                               output_mask=[True, True, False])
    g, gate = v["g"], v["gate"]
    dgate = (dq * g).sum((2, 3), keepdim=True)
    dt_se = aten.sigmoid_backward(dgate, gate)
    dr, dw_se2, db_se2 = aten.convolution_backward(dt_se, v["r"], w_se2.to(dt), [w_se2.shape[0]], **_1x1,
                                                   groups=1, output_mask=[True, True, True])
    ds = aten.threshold_backward(dr, v["r"], 0)
    dp, dw_se1, db_se1 = aten.convolution_backward(ds, v["p"], w_se1.to(dt), [w_se1.shape[0]], **_1x1,
                                                   groups=1, output_mask=[True, True, True])
    dg = dq * gate + dp / (g.shape[2] * g.shape[3])  # the gate's input, and the pool's broadcast
    if stride == 2:
        a = v["a"]
        dpad, _, _ = aten.convolution_backward(dg, v["apad"], blur_filter(a.shape[1], dt, a.device), None,
                                               [2, 2], [0, 0], [1, 1], False, [0, 0], a.shape[1],
                                               [True, False, False])
        da = aten.reflection_pad2d_backward(dpad, a, [1, 1, 1, 1])
    else:
        da = dg
    dd, dgamma_d, dbeta_d = _bn_backward(aten.silu_backward(da, v["db"]), v, gamma_d, "d", "d", eps)
    h = v["h"]
    if use_triton(h):
        dd = dd.contiguous(memory_format=torch.channels_last)
        dh, dw_dw = torch.ops.convfirstnet.gconv3x3_backward(dd, h, w_dw, True)  # dd read once
    else:
        dh, dw_dw, _ = aten.convolution_backward(dd, h, w_dw.to(dt), None, [1, 1], [1, 1], [1, 1], False,
                                                 [0, 0], h.shape[1] // GROUP_WIDTH, [True, True, False])
    de, dgamma_e, dbeta_e = _bn_backward(aten.silu_backward(dh, v["eb"]), v, gamma_e, "e", "e", eps)
    dx, dw_exp, _ = aten.convolution_backward(de, x, w_exp.to(dt), None, **_1x1, groups=1,
                                              output_mask=[True, True, False])
    if stride == 1:
        dx = dx + grad_out
    grads = (dx, dw_exp, dgamma_e, dbeta_e, dw_dw, dgamma_d, dbeta_d, dw_se1, db_se1, dw_se2, db_se2, dw_proj,
             dgamma_p, dbeta_p)
    params = (x, w_exp, gamma_e, beta_e, w_dw, gamma_d, beta_d, w_se1, b_se1, w_se2, b_se2, w_proj, gamma_p,
              beta_p)
    return tuple(gr.to(p.dtype) for gr, p in zip(grads, params))


mbconv_recompute_train_backward = torch.library.custom_op("convfirstnet::mbconv_recompute_train_backward",
                                                          _backward, mutates_args=())
mbconv_recompute_train_backward.register_fake(_backward_fake)


def _setup(ctx, inputs, output) -> None:
    ctx.stride, ctx.eps = inputs[21], inputs[23]
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    # x, the weights, o and the BatchNorms' statistics, drop_scale: nothing wide
    ctx.save_for_backward(*inputs[:14], output[7], output[8], inputs[20])


def _autograd(ctx, grad_out, *unused):
    if grad_out is None:
        return (*(None,) * 24, [None] * 3)
    x, *weights, o, stats, drop_scale = ctx.saved_tensors
    grads = torch.ops.convfirstnet.mbconv_recompute_train_backward(grad_out, x, *weights, o, stats,
                                                                   drop_scale, ctx.stride, ctx.eps)
    return (*grads, *(None,) * 10, [None] * 3)  # counts: a list of three


torch.library.register_autograd("convfirstnet::mbconv_recompute_train", _autograd, setup_context=_setup)


# what the blocks call (kernels/_autograd.function_around: the op's autograd without its host cost); the
# counts list's gradients come back as one None
_Recompute = function_around("MBConvRecomputeTrain", torch.ops.convfirstnet.mbconv_recompute_train, _setup,
                             lambda ctx, *grads: (*_autograd(ctx, *grads)[:-1], None))


# The small ops of a step besides the layers' kernels, each a multi-tensor launch: the num_batches_tracked
# increments, the copies of the running statistics in the op and the copies back (the static training
# report charges each a launch gap)
SMALL_OPS_PER_STEP = 3


def op_weights(block) -> tuple[T, ...]:
    """The 13 weights of a blocks.MBConv in the op's argument order (after x): W_exp, BN_e's gamma and
    beta, W_dw, BN_d's, the SE's two convs' weights and biases, W_proj, BN_p's."""
    bns = (block.bn_expand, block.bn_dw, block.bn_project)
    se = block.se
    return (block.conv_expand.weight, bns[0].weight, bns[0].bias, block.conv_dw.weight, bns[1].weight,
            bns[1].bias, se.fc1.weight, se.fc1.bias, se.fc2.weight, se.fc2.bias, block.conv_project.weight,
            bns[2].weight, bns[2].bias)


def recompute_forward(block, x: torch.Tensor, dtype: torch.dtype, drop: torch.Tensor) -> torch.Tensor:
    """``block(x)`` of a training-mode MBConv (blocks.MBConv) through the op, its BatchNorms updated as
    ``nn.BatchNorm2d`` does: num_batches_tracked += 1, then running = (1 - f) running + f batch (unbiased
    variance), f = momentum, or 1 / num_batches_tracked when momentum is None. ``drop``: the drop-path
    scale per image, drawn by the caller."""
    bns = (block.bn_expand, block.bn_dw, block.bn_project)
    with torch.no_grad():
        torch._foreach_add_([bn.num_batches_tracked for bn in bns], 1)
    res = _Recompute.apply(
        x.to(dtype), *op_weights(block), *(t for bn in bns for t in (bn.running_mean, bn.running_var)), drop,
        block.stride, [-1.0 if bn.momentum is None else float(bn.momentum) for bn in bns], bns[0].eps,
        [bn.num_batches_tracked for bn in bns])
    with torch.no_grad():
        torch._foreach_copy_([t for bn in bns for t in (bn.running_mean, bn.running_var)], list(res[1:7]))
    return res[0]
