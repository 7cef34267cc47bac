"""``torch.ops.convfirstnet.gconv3x3`` (+ ``_dgrad``, ``_wgrad``, ``_backward``): checks, then the Triton
kernels or the reference; autograd through the dgrad and wgrad ops.

    gconv3x3(x, weight, stride, deterministic=True) -> y              (N, C, H', W') NHWC, x's dtype
    gconv3x3_dgrad(grad_out, weight, height, width, stride) -> dx     (N, C, H, W) NHWC, grad_out's dtype
    gconv3x3_wgrad(grad_out, x, weight_dtype, stride, deterministic=True) -> dw     (C, 8, 3, 3)
    gconv3x3_backward(grad_out, x, weight, deterministic=True) -> (dx, dw)         stride 1, one read of
                                                                                   grad_out

x in any memory format (layouts other than channels-last are copied once before the kernels), C a
multiple of 8, weight (C, 8, 3, 3) in x's dtype, or fp32 with 16-bit x (autocast's master weights:
the kernels round them as they load them, and dw comes back in fp32 from fp32 partial sums).
``deterministic`` (default): dw from a fixed-order two-stage reduction, bitwise reproducible;
False: fp32 atomics. Shapes, dtypes and devices are checked before anything runs; the backend
(Triton or reference) is chosen per call by ``kernels._launch.use_triton``.
"""

import torch

from .._launch import (
    FLOAT_DTYPES,
    GROUP_WIDTH,
    HAS_TRITON,
    REFERENCE_DTYPES,
    check_activation,
    define_op,
    use_triton,
)
from .reference import (
    gconv3x3_backward_reference,
    gconv3x3_dgrad_reference,
    gconv3x3_reference,
    gconv3x3_wgrad_reference,
)

if HAS_TRITON:
    from .launcher import (
        gconv3x3_backward_triton,
        gconv3x3_dgrad_triton,
        gconv3x3_triton,
        gconv3x3_wgrad_triton,
    )

HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_weight(op: str, w: torch.Tensor, act: torch.Tensor, c: int) -> None:
    """weight (C, 8, 3, 3) on act's device, in act's dtype or fp32 with 16-bit activations."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"convfirstnet.{op}: weight must be a tensor, got {type(w).__name__}")
    if w.dim() != 4:
        raise ValueError(f"convfirstnet.{op}: weight must be 4-D (C, 8, 3, 3), got shape {tuple(w.shape)}")
    if tuple(w.shape[2:]) != (3, 3):
        raise ValueError(
            f"convfirstnet.{op}: kernel size {w.shape[2]}x{w.shape[3]}: only 3x3 convolutions are supported "
            f"(weight shape {tuple(w.shape)})"
        )
    if w.shape[1] != GROUP_WIDTH:
        raise ValueError(
            f"convfirstnet.{op}: group width {w.shape[1]} (weight shape {tuple(w.shape)}): only group width "
            f"{GROUP_WIDTH} is supported (groups = C / {GROUP_WIDTH})"
        )
    if w.shape[0] != c:
        raise ValueError(f"convfirstnet.{op}: weight has {w.shape[0]} output channels, the input has {c}")
    if w.device != act.device:
        raise ValueError(f"convfirstnet.{op}: input is on {act.device} but the weight is on {w.device}")
    if not (w.dtype == act.dtype or (w.dtype == torch.float32 and act.dtype in HALF_DTYPES)):
        raise TypeError(
            f"convfirstnet.{op}: weight dtype {w.dtype} with {act.dtype} activations; the weight must have "
            "the activations' dtype, or be float32 with float16/bfloat16 activations"
        )


def check_input(op: str, x: torch.Tensor, name: str = "x") -> int:
    """A 4-D float activation whose channels form groups of 8; returns C."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"convfirstnet.{op}: {name} must be a tensor, got {type(x).__name__}")
    c = x.shape[1] if x.dim() == 4 else -1
    check_activation(op, x, c, name=name)
    if c % GROUP_WIDTH or c == 0:
        raise ValueError(
            f"convfirstnet.{op}: {name} has {c} channels; group width {GROUP_WIDTH} needs a positive "
            f"multiple of {GROUP_WIDTH}"
        )
    return c


def check_stride(op: str, stride: int) -> None:
    if stride not in (1, 2):
        raise ValueError(f"convfirstnet.{op}: stride must be 1 or 2, got {stride}")


def check_grad_out(op: str, grad_out: torch.Tensor, x: torch.Tensor, stride: int) -> int:
    """grad_out of the conv of x at ``stride`` (the output's shape, x's dtype and device); returns C."""
    c = check_input(op, x)
    check_input(op, grad_out, "grad_out")
    check_stride(op, stride)
    n, _, h, w = x.shape
    expect = (n, c, (h + stride - 1) // stride, (w + stride - 1) // stride)
    if tuple(grad_out.shape) != expect:
        raise ValueError(
            f"convfirstnet.{op}: grad_out of {tuple(grad_out.shape)} does not match x of {tuple(x.shape)} at "
            f"stride {stride} (expected {expect})"
        )
    if grad_out.dtype != x.dtype or grad_out.device != x.device:
        raise TypeError(
            f"convfirstnet.{op}: grad_out ({grad_out.dtype}, {grad_out.device}) and x ({x.dtype}, "
            f"{x.device}) must have the same dtype and device"
        )
    return c


@define_op("convfirstnet::gconv3x3")
def gconv3x3(x: torch.Tensor, weight: torch.Tensor, stride: int, deterministic: bool = True) -> torch.Tensor:
    """Group-width-8 3x3 conv, padding 1, no bias; NHWC out. ``deterministic`` applies to the backward's
    weight gradient. See reference.py."""
    c = check_input("gconv3x3", x)
    check_weight("gconv3x3", weight, x, c)
    check_stride("gconv3x3", stride)
    if use_triton(x):
        return gconv3x3_triton(x, weight, stride)
    return gconv3x3_reference(x, weight, stride)


@define_op("convfirstnet::gconv3x3_dgrad")
def gconv3x3_dgrad(grad_out: torch.Tensor, weight: torch.Tensor, height: int, width: int, stride: int
                   ) -> torch.Tensor:
    """dL/dx of ``gconv3x3`` for an input of height x width pixels; NHWC out in grad_out's dtype."""
    c = check_input("gconv3x3_dgrad", grad_out, "grad_out")
    check_weight("gconv3x3_dgrad", weight, grad_out, c)
    check_stride("gconv3x3_dgrad", stride)
    expect = ((height + stride - 1) // stride, (width + stride - 1) // stride)
    if height < 1 or width < 1 or tuple(grad_out.shape[2:]) != expect:
        raise ValueError(
            f"convfirstnet.gconv3x3_dgrad: grad_out of {tuple(grad_out.shape)} does not match a "
            f"{height}x{width} input at stride {stride} (expected {expect[0]}x{expect[1]})"
        )
    if use_triton(grad_out):
        return gconv3x3_dgrad_triton(grad_out, weight, height, width, stride)
    return gconv3x3_dgrad_reference(grad_out, weight, height, width, stride)


@define_op("convfirstnet::gconv3x3_wgrad")
def gconv3x3_wgrad(grad_out: torch.Tensor, x: torch.Tensor, weight_dtype: torch.dtype, stride: int,
                   deterministic: bool = True) -> torch.Tensor:
    """dL/dweight of ``gconv3x3``: (C, 8, 3, 3) in ``weight_dtype``, summed in fp32."""
    check_grad_out("gconv3x3_wgrad", grad_out, x, stride)
    if weight_dtype not in FLOAT_DTYPES + REFERENCE_DTYPES:
        raise TypeError(f"convfirstnet.gconv3x3_wgrad: weight_dtype must be a float dtype, "
                        f"got {weight_dtype}")
    if use_triton(x):
        return gconv3x3_wgrad_triton(grad_out, x, stride, weight_dtype, deterministic)
    return gconv3x3_wgrad_reference(grad_out, x, stride, weight_dtype)


@define_op("convfirstnet::gconv3x3_backward")
def gconv3x3_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of a stride-1 ``gconv3x3``: (dL/dx NHWC in grad_out's dtype, dL/dweight (C, 8, 3, 3)
    in weight's dtype, summed in fp32), equal to ``gconv3x3_dgrad`` and ``gconv3x3_wgrad``; the Triton
    branch reads grad_out once (one launch for both, then wgrad's reduction)."""
    c = check_grad_out("gconv3x3_backward", grad_out, x, 1)
    check_weight("gconv3x3_backward", weight, x, c)
    if use_triton(x):
        return gconv3x3_backward_triton(grad_out, weight, x, weight.dtype, deterministic)
    return gconv3x3_backward_reference(grad_out, x, weight)


# ------------------------------------------------------------------------------------------------
# Autograd. The forward's backward runs dgrad and wgrad, each only when asked for (both at stride 1: the
# fused gconv3x3_backward, one read of grad_out). The three maps are bilinear and each other's adjoints,
# so dgrad, wgrad and the fused backward have backwards made of the same three ops (double backward, and
# torch.compile of graphs that differentiate them):
#   <g, dgrad(dy, w)> = <gconv(g, w), dy>   ->  d/d dy = gconv(g, w),  d/dw = wgrad(dy, g)
#   <g, wgrad(dy, x)> = <dy, gconv(x, g)>   ->  d/d dy = gconv(x, g),  d/dx = dgrad(dy, g)
# ------------------------------------------------------------------------------------------------


def _setup_forward(ctx, inputs, output) -> None:
    x, weight, stride, deterministic = inputs
    ctx.stride, ctx.deterministic = stride, deterministic
    ctx.hw = (x.shape[2], x.shape[3])
    ctx.weight_dtype = weight.dtype
    # dgrad needs the weight, wgrad the input: keep only what the backward will use
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ctx.save_for_backward(x if need_w else None, weight if need_x else None)


def _backward_forward(ctx, grad_out: torch.Tensor):
    x, weight = ctx.saved_tensors
    dx = dw = None
    if ctx.stride == 1 and ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
        dx, dw = torch.ops.convfirstnet.gconv3x3_backward(grad_out, x, weight, ctx.deterministic)
        return dx, dw, None, None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.convfirstnet.gconv3x3_dgrad(grad_out, weight, ctx.hw[0], ctx.hw[1], ctx.stride)
    if ctx.needs_input_grad[1]:
        dw = torch.ops.convfirstnet.gconv3x3_wgrad(grad_out, x, ctx.weight_dtype, ctx.stride,
                                                   ctx.deterministic)
    return dx, dw, None, None


def _setup_dgrad(ctx, inputs, output) -> None:
    dy, weight, _, _, stride = inputs
    ctx.stride, ctx.weight_dtype = stride, weight.dtype
    ctx.save_for_backward(dy, weight)


def _backward_dgrad(ctx, g: torch.Tensor):
    dy, weight = ctx.saved_tensors
    d_dy = d_w = None
    if ctx.needs_input_grad[0]:
        d_dy = torch.ops.convfirstnet.gconv3x3(g, weight, ctx.stride)
    if ctx.needs_input_grad[1]:
        d_w = torch.ops.convfirstnet.gconv3x3_wgrad(dy, g, ctx.weight_dtype, ctx.stride)
    return d_dy, d_w, None, None, None


def _setup_wgrad(ctx, inputs, output) -> None:
    dy, x, _, stride, _ = inputs
    ctx.stride, ctx.hw = stride, (x.shape[2], x.shape[3])
    ctx.save_for_backward(dy, x)


def _backward_wgrad(ctx, g: torch.Tensor):
    dy, x = ctx.saved_tensors
    d_dy = d_x = None
    # g has the weight's dtype; as a weight of 16-bit activations it must be fp32 or theirs
    g = g.to(torch.float32 if x.dtype in HALF_DTYPES else x.dtype)
    if ctx.needs_input_grad[0]:
        d_dy = torch.ops.convfirstnet.gconv3x3(x, g, ctx.stride)
    if ctx.needs_input_grad[1]:
        d_x = torch.ops.convfirstnet.gconv3x3_dgrad(dy, g, ctx.hw[0], ctx.hw[1], ctx.stride)
    return d_dy, d_x, None, None, None


def _setup_backward(ctx, inputs, output) -> None:
    dy, x, weight, _ = inputs
    ctx.save_for_backward(dy, x, weight)


def _backward_backward(ctx, g_dx: torch.Tensor, g_dw: torch.Tensor):
    # the sum of the two rules above: (dx, dw) = (dgrad(dy, w), wgrad(dy, x))
    dy, x, weight = ctx.saved_tensors
    d_dy = d_x = d_w = None
    g_dw = g_dw.to(torch.float32 if x.dtype in HALF_DTYPES else x.dtype)
    if ctx.needs_input_grad[0]:
        d_dy = torch.ops.convfirstnet.gconv3x3(g_dx, weight, 1) + torch.ops.convfirstnet.gconv3x3(x, g_dw, 1)
    if ctx.needs_input_grad[1]:
        d_x = torch.ops.convfirstnet.gconv3x3_dgrad(dy, g_dw, x.shape[2], x.shape[3], 1)
    if ctx.needs_input_grad[2]:
        d_w = torch.ops.convfirstnet.gconv3x3_wgrad(dy, g_dx, weight.dtype, 1)
    return d_dy, d_x, d_w, None


torch.library.register_autograd("convfirstnet::gconv3x3", _backward_forward, setup_context=_setup_forward)
torch.library.register_autograd("convfirstnet::gconv3x3_dgrad", _backward_dgrad, setup_context=_setup_dgrad)
torch.library.register_autograd("convfirstnet::gconv3x3_wgrad", _backward_wgrad, setup_context=_setup_wgrad)
torch.library.register_autograd("convfirstnet::gconv3x3_backward", _backward_backward,
                                setup_context=_setup_backward)
