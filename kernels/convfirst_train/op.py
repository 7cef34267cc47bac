"""``torch.ops.convfirstnet.convfirst_s1_train`` (+ ``_backward``): the ConvFirst stride-1 training block,
checks, then the Triton kernels or the reference; autograd through the backward op.

    convfirst_s1_train(x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3,
                       running_mean1, running_var1, running_mean2, running_var2, running_mean3,
                       running_var3, drop_scale, training, eps)
        -> (out, a, p, mean1, var1, mean2, var2, mean3, var3, batch_mean1, batch_cov1)

x (N, C, H, W) float16/bfloat16/float32 (float64: reference only), C a multiple of 8; w_conv (C, 8, 3, 3),
w1 (R, C), w2 (C, R) in x's dtype or fp32 with 16-bit x (autocast's master weights); BatchNorm
parameters and running statistics (C,) / (R,) fp32 or x's dtype; drop_scale (N,): the drop-path scale
per image (0 or 1 / keep probability; ones without drop-path). ``training``: BatchNorm with batch
statistics (returned: mean_i, var_i biased; the caller updates the running statistics), else with the
running ones. The running statistics are read, never written. Only ``out`` is differentiable; a and
p are the narrow activations kept for the backward. reference.py is the specification.
"""

from __future__ import annotations

import torch

from .._autograd import function_around
from .._batchnorm import update_running
from .._launch import GROUP_WIDTH, HAS_TRITON, check_activation, define_op, triton_op, use_triton
from .reference import (
    convfirst_s1_train_backward_reference,
    convfirst_s1_train_reference,
    convfirst_s2_train_backward_reference,
    convfirst_s2_train_reference,
)

if HAS_TRITON:
    from .launcher import (
        DTYPES,
        convfirst_s1_train_backward_triton,
        convfirst_s1_train_triton,
        convfirst_s2_train_backward_triton,
        convfirst_s2_train_triton,
        update_running_triton,
    )

OP = "convfirst_s1_train"
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _check_param(name: str, t: torch.Tensor, shape: tuple, x: torch.Tensor, weight: bool, op: str = OP
                 ) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"convfirstnet.{op}: {name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"convfirstnet.{op}: {name} has shape {tuple(t.shape)}, expected {shape}")
    if t.device != x.device:
        raise ValueError(f"convfirstnet.{op}: input is on {x.device} but {name} is on {t.device}")
    ok = t.dtype == x.dtype or (t.dtype == torch.float32 and x.dtype in HALF_DTYPES)
    if not ok:
        kind = "weight" if weight else "BatchNorm tensor"
        raise TypeError(f"convfirstnet.{op}: {kind} {name} has dtype {t.dtype} with {x.dtype} activations; "
                        "expected the activations' dtype, or float32 with float16/bfloat16 activations")


def check_inputs(x, w_conv, w1, w2, bn: dict, drop_scale, training: bool, stride: int = 1) -> None:
    """Shapes, dtypes and devices of every argument, before anything runs."""
    op = OP if stride == 1 else "convfirst_s2_train"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"convfirstnet.{op}: x must be a tensor, got {type(x).__name__}")
    c = x.shape[1] if x.dim() == 4 else -1
    check_activation(op, x, c)
    if c % GROUP_WIDTH or c == 0:
        raise ValueError(f"convfirstnet.{op}: x has {c} channels; group width {GROUP_WIDTH} needs a positive "
                         f"multiple of {GROUP_WIDTH}")
    if isinstance(w_conv, torch.Tensor) and w_conv.dim() == 4 and tuple(w_conv.shape[2:]) != (3, 3):
        raise ValueError(f"convfirstnet.{op}: kernel size {w_conv.shape[2]}x{w_conv.shape[3]}: only 3x3 "
                         "grouped convolutions are supported")
    if isinstance(w_conv, torch.Tensor) and w_conv.dim() == 4 and w_conv.shape[1] != GROUP_WIDTH:
        raise ValueError(f"convfirstnet.{op}: group width {w_conv.shape[1]}: only group width {GROUP_WIDTH} "
                         "is supported")
    for name, t in (("w1", w1), ("w2", w2)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"convfirstnet.{op}: {name} must be a 2-D tensor")
    r = w1.shape[0]
    k = c if stride == 1 else w2.shape[0]
    c1 = c if stride == 1 else 2 * c
    _check_param("w_conv", w_conv, (c, GROUP_WIDTH, 3, 3), x, True, op)
    _check_param("w1", w1, (r, c1), x, True, op)
    _check_param("w2", w2, (k, r), x, True, op)
    for name, t in bn.items():
        width = r if name.endswith("2") else k if name.endswith("3") else c
        _check_param(name, t, (width,), x, False, op)
    if drop_scale is not None:
        _check_param("drop_scale", drop_scale, (x.shape[0],), x, False, op)
    if stride == 2 and x.numel() and min(x.shape[2], x.shape[3]) < 2:
        raise ValueError(f"convfirstnet.{op}: BlurPool needs a map of at least 2x2, got {tuple(x.shape)}")
    if training and x.shape[0] * x.shape[2] * x.shape[3] < 2:
        raise ValueError(f"convfirstnet.{op}: BatchNorm in training mode needs more than one value per "
                         f"channel, got input of shape {tuple(x.shape)}")


def _bn(gamma1, beta1, gamma2, beta2, gamma3, beta3, rm1, rv1, rm2, rv2, rm3, rv3) -> dict:
    return dict(gamma1=gamma1, beta1=beta1, gamma2=gamma2, beta2=beta2, gamma3=gamma3, beta3=beta3,
                running_mean1=rm1, running_var1=rv1, running_mean2=rm2, running_var2=rv2, running_mean3=rm3,
                running_var3=rv3)


def _triton_ok(x: torch.Tensor) -> bool:
    if not use_triton(x):
        return False
    if x.dtype not in DTYPES:
        raise TypeError(f"convfirstnet.{OP}: the Triton kernels run float16, bfloat16 and float32, "
                        f"got {x.dtype}")
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        raise TypeError(f"convfirstnet.{OP}: bfloat16 through the Triton interpreter gives wrong tl.dot "
                        "results; use float16/float32, or CONVFIRSTNET_KERNELS=reference on CPU")
    return True


@define_op("convfirstnet::convfirst_s1_train")
def convfirst_s1_train(
    x: torch.Tensor, w_conv: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
    gamma1: torch.Tensor, beta1: torch.Tensor, gamma2: torch.Tensor, beta2: torch.Tensor,
    gamma3: torch.Tensor, beta3: torch.Tensor,
    running_mean1: torch.Tensor, running_var1: torch.Tensor, running_mean2: torch.Tensor,
    running_var2: torch.Tensor, running_mean3: torch.Tensor, running_var3: torch.Tensor,
    drop_scale: torch.Tensor, training: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ConvFirst stride-1 training block (module docstring; reference.py)."""
    args = (x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3, running_mean1, running_var1,
            running_mean2, running_var2, running_mean3, running_var3, drop_scale, training, eps)
    check_inputs(x, w_conv, w1, w2, _bn(*args[4:16]), drop_scale, training)
    if _triton_ok(x):
        return convfirst_s1_train_triton(*args)
    return convfirst_s1_train_reference(*args)


@define_op("convfirstnet::convfirst_s1_train_backward")
def convfirst_s1_train_backward(
    grad_out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, p: torch.Tensor, w_conv: torch.Tensor,
    w1: torch.Tensor, w2: torch.Tensor, gamma1: torch.Tensor, beta1: torch.Tensor, gamma2: torch.Tensor,
    beta2: torch.Tensor, gamma3: torch.Tensor, beta3: torch.Tensor, mean1: torch.Tensor, var1: torch.Tensor,
    mean2: torch.Tensor, var2: torch.Tensor, mean3: torch.Tensor, var3: torch.Tensor,
    batch_mean1: torch.Tensor, batch_cov1: torch.Tensor, drop_scale: torch.Tensor, training: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``convfirst_s1_train``'s out: (dx, dw_conv, dw1, dw2, dgamma1, dbeta1, dgamma2, dbeta2,
    dgamma3, dbeta3), from the saved narrow maps a, p and the statistics the forward returned."""
    args = (grad_out, x, a, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3, mean1, var1,
            mean2, var2, mean3, var3, batch_mean1, batch_cov1, drop_scale, training, eps)
    for name, t in (("grad_out", grad_out), ("a", a), ("p", p)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(x.shape) or t.dtype != x.dtype:
            raise ValueError(f"convfirstnet.{OP}_backward: {name} must match x ({tuple(x.shape)}, {x.dtype})")
    if _triton_ok(x):
        return convfirst_s1_train_backward_triton(*args)
    return convfirst_s1_train_backward_reference(*args)


@define_op("convfirstnet::convfirst_s2_train")
def convfirst_s2_train(
    x: torch.Tensor, w_conv: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
    gamma1: torch.Tensor, beta1: torch.Tensor, gamma2: torch.Tensor, beta2: torch.Tensor,
    gamma3: torch.Tensor, beta3: torch.Tensor,
    running_mean1: torch.Tensor, running_var1: torch.Tensor, running_mean2: torch.Tensor,
    running_var2: torch.Tensor, running_mean3: torch.Tensor, running_var3: torch.Tensor,
    training: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ConvFirst stride-2 training block, C -> K: (out, a, u, p, mean1, var1, mean2, var2, mean3, var3,
    batch_mean_u, batch_cov_u); w1 (R, 2C), w2 (K, R), BN3 tensors (K,). See reference.py."""
    args = (x, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3, running_mean1, running_var1,
            running_mean2, running_var2, running_mean3, running_var3, training, eps)
    check_inputs(x, w_conv, w1, w2, _bn(*args[4:16]), None, training, stride=2)
    if _triton_ok(x):
        return convfirst_s2_train_triton(*args)
    return convfirst_s2_train_reference(*args)


@define_op("convfirstnet::convfirst_s2_train_backward")
def convfirst_s2_train_backward(
    grad_out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, u: torch.Tensor, p: torch.Tensor,
    w_conv: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gamma1: torch.Tensor, beta1: torch.Tensor,
    gamma2: torch.Tensor, beta2: torch.Tensor, gamma3: torch.Tensor, beta3: torch.Tensor, mean1: torch.Tensor,
    var1: torch.Tensor, mean2: torch.Tensor, var2: torch.Tensor, mean3: torch.Tensor, var3: torch.Tensor,
    batch_mean_u: torch.Tensor, batch_cov_u: torch.Tensor, training: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``convfirst_s2_train``'s out (as the stride-1 backward)."""
    args = (grad_out, x, a, u, p, w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3, mean1, var1,
            mean2, var2, mean3, var3, batch_mean_u, batch_cov_u, training, eps)
    if (not isinstance(grad_out, torch.Tensor) or tuple(grad_out.shape) != tuple(p.shape)
            or grad_out.dtype != x.dtype):
        raise ValueError(f"convfirstnet.convfirst_s2_train_backward: grad_out must match p "
                         f"({tuple(p.shape)}, {x.dtype})")
    if _triton_ok(x):
        return convfirst_s2_train_backward_triton(*args)
    return convfirst_s2_train_backward_reference(*args)


# ------------------------------------------------------------------------------------------------
# The running statistics of a block's three BatchNorms, in place (one launch)
# ------------------------------------------------------------------------------------------------

_RUNNING = ("running_mean1", "running_var1", "running_mean2", "running_var2", "running_mean3", "running_var3",
            "num_batches_tracked1", "num_batches_tracked2", "num_batches_tracked3")


def bn_update_running(
    mean1: torch.Tensor, var1: torch.Tensor, mean2: torch.Tensor, var2: torch.Tensor, mean3: torch.Tensor,
    var3: torch.Tensor, running_mean1: torch.Tensor, running_var1: torch.Tensor, running_mean2: torch.Tensor,
    running_var2: torch.Tensor, running_mean3: torch.Tensor, running_var3: torch.Tensor,
    num_batches_tracked1: torch.Tensor, num_batches_tracked2: torch.Tensor,
    num_batches_tracked3: torch.Tensor,
    rows1: int, rows2: int, rows3: int, momentum1: float, momentum2: float, momentum3: float,
) -> None:
    """nn.BatchNorm2d's training-mode update of three BatchNorms from a fused block's batch statistics
    (mean_i, biased var_i over rows_i values per channel): num_batches_tracked_i += 1, then running =
    (1 - f) running + f batch with the unbiased variance, f = momentum_i, or 1 / num_batches_tracked_i
    where momentum_i < 0 (nn.BatchNorm2d's momentum=None). One Triton launch, else PyTorch ops."""
    stats = (mean1, var1, mean2, var2, mean3, var3)
    running = (running_mean1, running_var1, running_mean2, running_var2, running_mean3, running_var3)
    counts = (num_batches_tracked1, num_batches_tracked2, num_batches_tracked3)
    rows, momenta = (rows1, rows2, rows3), (momentum1, momentum2, momentum3)
    for i in range(3):
        if stats[2 * i].shape != running[2 * i].shape or stats[2 * i + 1].shape != running[2 * i + 1].shape:
            raise ValueError(f"convfirstnet.bn_update_running: BatchNorm {i + 1}'s statistics "
                             f"{tuple(stats[2 * i].shape)} do not match its running statistics "
                             f"{tuple(running[2 * i].shape)}")
    if HAS_TRITON and use_triton(mean1) and mean1.dtype == torch.float32:
        update_running_triton(stats, running, counts, rows, [None if f < 0 else f for f in momenta])
        return
    for i in range(3):
        counts[i].add_(1)
        f = 1.0 / counts[i].float() if momenta[i] < 0 else momenta[i]
        update_running(running[2 * i], running[2 * i + 1], stats[2 * i], stats[2 * i + 1], rows[i], f)


if HAS_TRITON:
    bn_update_running = triton_op("convfirstnet::bn_update_running", bn_update_running, mutates_args=_RUNNING)
else:  # pragma: no cover - machines without triton
    bn_update_running = torch.library.custom_op("convfirstnet::bn_update_running", bn_update_running,
                                                mutates_args=_RUNNING)
    bn_update_running.register_fake(lambda *args: None)


# ------------------------------------------------------------------------------------------------
# Autograd: out's gradient through the backward op; a, p and the statistics are not differentiable.
# ------------------------------------------------------------------------------------------------

_PARAMS = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # w_conv, w1, w2, gamma1, beta1, gamma2, beta2, gamma3, beta3


def _setup(ctx, inputs, output) -> None:
    x, w_conv, w1, w2, g1, b1, g2, b2, g3, b3 = inputs[:10]
    drop_scale, training, eps = inputs[16:19]
    out, a, p, *stats = output
    ctx.training, ctx.eps = training, eps
    ctx.mark_non_differentiable(a, p, *stats)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the outputs nobody differentiates
    ctx.save_for_backward(x, a, p, w_conv, w1, w2, g1, b1, g2, b2, g3, b3, *stats, drop_scale)


def _backward(ctx, grad_out, *unused):
    x, a, p, w_conv, w1, w2, g1, b1, g2, b2, g3, b3, *rest = ctx.saved_tensors
    *stats, drop_scale = rest
    if grad_out is None:
        return (None,) * 19
    grads = torch.ops.convfirstnet.convfirst_s1_train_backward(
        grad_out, x, a, p, w_conv, w1, w2, g1, b1, g2, b2, g3, b3, *stats, drop_scale, ctx.training, ctx.eps)
    return (*grads, *(None,) * 9)


torch.library.register_autograd("convfirstnet::convfirst_s1_train", _backward, setup_context=_setup)


def _setup_s2(ctx, inputs, output) -> None:
    x, w_conv, w1, w2, g1, b1, g2, b2, g3, b3 = inputs[:10]
    training, eps = inputs[16:18]
    out, a, u, p, *stats = output
    ctx.training, ctx.eps = training, eps
    ctx.mark_non_differentiable(a, u, p, *stats)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, a, u, p, w_conv, w1, w2, g1, b1, g2, b2, g3, b3, *stats)


def _backward_s2(ctx, grad_out, *unused):
    saved = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 18
    grads = torch.ops.convfirstnet.convfirst_s2_train_backward(grad_out, *saved, ctx.training, ctx.eps)
    return (*grads, *(None,) * 8)


torch.library.register_autograd("convfirstnet::convfirst_s2_train", _backward_s2, setup_context=_setup_s2)

# what the blocks call (training_kernels.fused_forward): the ops with the autograd above, without its host
# cost (_autograd.function_around)
S1Train = function_around("ConvFirstS1Train", torch.ops.convfirstnet.convfirst_s1_train, _setup, _backward)
S2Train = function_around("ConvFirstS2Train", torch.ops.convfirstnet.convfirst_s2_train, _setup_s2,
                          _backward_s2)
