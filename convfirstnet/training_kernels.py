"""The training-form blocks (blocks.py, with BatchNorm) run through the fused training ops.

``fused_forward(block, x)`` computes exactly ``block(x)`` in the block's current mode, on the block's own
parameters and buffers (so the state_dict, checkpoints, optimisers and ``fuse()`` see no difference):

* training mode: BatchNorm with the batch's statistics; the running mean and variance are updated in
  place as ``nn.BatchNorm2d`` does (momentum, or the cumulative average when momentum is None; the
  unbiased variance), and ``num_batches_tracked`` is counted;
* eval mode: the running statistics;
* drop-path draws its per-image mask as timm's ``DropPath`` does (same shape, dtype and generator
  calls, so a seeded run draws the same mask).

MBConv + SE blocks have no fused training op: in training mode they run the recompute path
(mbconv_recompute.py: the layers' own kernels, only the narrow input stored, the wide activations
recomputed in the backward; the running statistics updated once, by nn.BatchNorm2d's rule); in eval
mode their layers.

The ConvFirst forward and backward are ``torch.ops.convfirstnet.convfirst_s1_train`` (+ ``_backward``): Triton
kernels on CUDA (and in the interpreter with ``CONVFIRSTNET_KERNELS=triton``), the PyTorch reference
otherwise. ``unsupported(block, x)`` names what the fused op cannot run (a block without a fused
training op, a norm other than BatchNorm2d, group width or kernel size of the grouped conv, dtype);
``dispatch(block, x)`` is what the training-form blocks call: the fused forward when the backend
selects the fused training kernels (``CONVFIRSTNET_KERNELS=triton``; ``auto``, the default, keeps the
layer-wise training form: see ``triton_selected``) and the block is supported, else None (run the
layers), with one warning line per distinct reason when the Triton kernels were selected but cannot
run the block; decided before any launch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import BlurPool2d
from timm.layers.activations import Sigmoid  # SEModule's gate ('sigmoid')

import warnings

from .kernels._cost import active_recording
from .kernels._launch import GROUP_WIDTH, HAS_TRITON, backend
from .kernels.convfirst_train.op import S1Train, S2Train
from .mbconv_recompute import recompute_forward

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the fused training kernels run

__all__ = ["dispatch", "fused_forward", "recomputes", "unsupported"]
_WARNED: set[str] = set()


def _bns(block: nn.Module) -> tuple[nn.Module, ...]:
    return block.bn_dw, block.bn_expand, block.bn_project


def recomputes(block: nn.Module) -> bool:
    """Whether ``block``'s training path is the memory-lean recompute (mbconv_recompute.py: layer-wise
    kernels, the wide activations recomputed in the backward) rather than a fused training op."""
    return type(block).__name__ == "MBConv"


def unsupported(block: nn.Module, x: torch.Tensor | None = None) -> str | None:
    """Why the fused training op (MBConv: the recompute path) cannot run ``block`` (on ``x``), or None."""
    name = type(block).__name__
    if name == "MBConv":  # blocks.MBConv (not imported: blocks imports this module)
        return _unsupported_mbconv(block, x)
    if name != "ConvFirst":
        return f"{name}: no fused training op for this block yet"
    if block.stride not in (1, 2):
        return f"{name} stride {block.stride}: the fused training ops run stride 1 and 2"
    for bn in _bns(block):
        if type(bn) is not nn.BatchNorm2d:
            return (f"{name}: norm layer {type(bn).__name__}: the fused training op implements BatchNorm2d "
                    "only")
        if not bn.affine or not bn.track_running_stats:
            return f"{name}: BatchNorm2d without affine parameters or running statistics is not supported"
    bns = _bns(block)
    if len({bn.training for bn in bns}) > 1 or len({bn.eps for bn in bns}) > 1:
        return f"{name}: its BatchNorms differ in mode (train / eval) or eps: the fused op runs them as one"
    conv = block.conv_dw
    c = conv.in_channels
    if conv.kernel_size != (3, 3):
        return f"{name}: grouped conv kernel size {conv.kernel_size}: only 3x3 is supported"
    if c % GROUP_WIDTH or conv.groups != c // GROUP_WIDTH or conv.out_channels != c:
        return (f"{name}: grouped conv of group width {c // conv.groups}: only group width {GROUP_WIDTH} is "
                "supported")
    if conv.bias is not None or conv.padding != (1, 1) or conv.stride != (1, 1) or conv.dilation != (1, 1):
        return f"{name}: grouped conv with a bias, padding other than 1, stride or dilation is not supported"
    if block.stride == 2 and not isinstance(block.blur, BlurPool2d):
        return (f"{name} stride 2: downsampling {type(block.blur).__name__}: the fused op implements "
                "BlurPool2d")
    for conv1 in (block.conv_expand, block.conv_project):
        if conv1.kernel_size != (1, 1) or conv1.bias is not None or conv1.groups != 1:
            return f"{name}: the 1x1 layers must be dense and bias-free"
    if not isinstance(block.act, nn.ReLU):
        return f"{name}: activation {type(block.act).__name__}: the fused op implements ReLU"
    return _unsupported_dtype(name, x)


def _unsupported_dtype(name: str, x: torch.Tensor | None) -> str | None:
    if x is not None:
        dtype = _activation_dtype(x)
        if dtype not in DTYPES:
            return f"{name}: dtype {dtype}: the fused training kernels run float16, bfloat16 and float32"
        if x.device.type == "cpu" and dtype == torch.bfloat16:
            return f"{name}: bfloat16 on CPU (the Triton interpreter computes bf16 tl.dot wrongly)"
    return None


def _unsupported_mbconv(block: nn.Module, x: torch.Tensor | None) -> str | None:
    """What the recompute path (mbconv_recompute.py) does not implement, or None."""
    name = "MBConv"
    if block.stride not in (1, 2):
        return f"{name} stride {block.stride}: the recompute path runs stride 1 and 2"
    bns = (block.bn_expand, block.bn_dw, block.bn_project)
    for bn in bns:
        if type(bn) is not nn.BatchNorm2d:
            return f"{name}: norm layer {type(bn).__name__}: the recompute path implements BatchNorm2d only"
        if not bn.affine or not bn.track_running_stats:
            return f"{name}: BatchNorm2d without affine parameters or running statistics is not supported"
    if len({bn.training for bn in bns}) > 1 or len({bn.eps for bn in bns}) > 1:
        return (f"{name}: its BatchNorms differ in mode (train / eval) or eps: the recompute path runs them "
                "as one")
    conv = block.conv_dw
    c = conv.in_channels
    if type(conv) is not nn.Conv2d and type(conv).__name__ != "GroupConv3x3":
        return f"{name}: grouped conv {type(conv).__name__}: expected an nn.Conv2d"
    if conv.kernel_size != (3, 3):
        return f"{name}: grouped conv kernel size {conv.kernel_size}: only 3x3 is supported"
    if c % GROUP_WIDTH or conv.groups != c // GROUP_WIDTH or conv.out_channels != c:
        return (f"{name}: grouped conv of group width {c // conv.groups}: only group width {GROUP_WIDTH} is "
                "supported")
    if (conv.bias is not None or conv.padding != (1, 1) or conv.stride != (1, 1) or conv.dilation != (1, 1)
            or conv.padding_mode != "zeros"):
        return f"{name}: grouped conv with a bias, padding other than 1, stride or dilation is not supported"
    for conv1 in (block.conv_expand, block.conv_project):
        if (type(conv1) is not nn.Conv2d or conv1.kernel_size != (1, 1) or conv1.bias is not None
                or conv1.groups != 1 or conv1.stride != (1, 1) or conv1.padding != (0, 0)):
            return f"{name}: the 1x1 layers must be dense, bias-free nn.Conv2d"
    if type(block.act) is not nn.SiLU:
        return f"{name}: activation {type(block.act).__name__}: the recompute path implements SiLU"
    se = block.se
    if (type(se).__name__ != "SEModule" or getattr(se, "add_maxpool", False) or type(se.bn) is not nn.Identity
            or type(se.act) is not nn.ReLU or type(se.gate) not in (nn.Sigmoid, Sigmoid)
            or se.fc1.bias is None or se.fc2.bias is None):
        return f"{name}: squeeze-excite other than timm's SEModule (mean pool, ReLU, sigmoid gate, biases)"
    if block.stride == 2:
        blur = block.blur
        if (not isinstance(blur, BlurPool2d) or blur.filt_size != 3 or blur.stride != 2
                or blur.pad_mode != "reflect"):
            return (f"{name} stride 2: downsampling {type(blur).__name__}: the recompute path implements "
                    "BlurPool2d")
    if type(block.drop_path).__name__ not in ("DropPath", "Identity"):
        return f"{name}: drop path {type(block.drop_path).__name__}: expected timm's DropPath"
    return _unsupported_dtype(name, x)


def triton_selected(x: torch.Tensor) -> bool:
    """The training blocks run the fused training kernels for ``x``: only when they are asked for
    (``CONVFIRSTNET_KERNELS=triton``; always while the static cost report records launches on meta
    tensors). ``auto`` keeps the layer-wise training form, on CUDA too: launched from Python, a fused
    training step of Small took 211 ms on an H200 against 103 ms layer-wise (the host's work per kernel
    bounds it); captured in a CUDA graph it took 84 ms against 99
    (benchmarks/results/20261126T145122Z_h200_float16_train-small_gpu-check-train.json). The inference
    ops keep ``auto`` = Triton on CUDA (kernels._launch.use_triton)."""
    if active_recording() is not None:
        return HAS_TRITON
    return HAS_TRITON and x.device.type != "meta" and backend() == "triton"


def dispatch(block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``fused_forward(block, x)`` when the Triton kernels are selected and can run the block; None
    (run the layers) otherwise, with one warning line per distinct reason when they were selected."""
    if not triton_selected(x):
        return None
    if recomputes(block) and not block.bn_expand.training:  # eval mode: the layers, as ever
        return None
    reason = unsupported(block, x)
    if reason is None:
        return fused_forward(block, x)
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"{reason}; running the layer-wise training form instead of the Triton kernels",
                      stacklevel=3)
    return None


def _activation_dtype(x: torch.Tensor) -> torch.dtype:
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _drop_scale(block: nn.Module, out_dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """timm's DropPath mask, drawn the same way (shape (N, 1, 1, 1) in the branch's dtype), as (N,) fp32."""
    dp = block.drop_path
    prob = getattr(dp, "drop_prob", 0.0)
    if not block.training or not prob:
        return torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
    keep = 1 - prob
    mask = torch.empty((x.shape[0], 1, 1, 1), dtype=out_dtype, device=x.device).bernoulli_(keep)
    if keep > 0.0 and getattr(dp, "scale_by_keep", True):
        mask.div_(keep)
    return mask.flatten().float()


def fused_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)`` through the fused training op (module docstring); MBConv through the recompute path."""
    dtype = _activation_dtype(x)
    if recomputes(block):
        return recompute_forward(block, x, dtype, _drop_scale(block, dtype, x))
    x = x.to(dtype)
    bn1, bn2, bn3 = _bns(block)
    training, eps = bn1.training, bn1.eps  # the three agree (unsupported() checks)
    w = [block.conv_dw.weight, block.conv_expand.weight.flatten(1), block.conv_project.weight.flatten(1)]
    if dtype != torch.float32:  # 16-bit activations take the weights in their dtype or fp32 (autocast)
        w = [t if t.dtype in (dtype, torch.float32) else t.to(dtype) for t in w]
    bn = (bn1.weight, bn1.bias, bn2.weight, bn2.bias, bn3.weight, bn3.bias, bn1.running_mean, bn1.running_var,
          bn2.running_mean, bn2.running_var, bn3.running_mean, bn3.running_var)
    if block.stride == 1:
        drop = _drop_scale(block, dtype, x)
        res = S1Train.apply(x, *w, *bn, drop, training, eps)
        out, stats, rows = res[0], res[3:9], x.shape[0] * x.shape[2] * x.shape[3]
    else:
        res = S2Train.apply(x, *w, *bn, training, eps)
        out, stats = res[0], res[4:10]
        rows = x.shape[0] * ((x.shape[2] + 1) // 2) * ((x.shape[3] + 1) // 2)
    if training:
        full = x.shape[0] * x.shape[2] * x.shape[3]  # BN1 normalises the full-resolution conv output
        with torch.no_grad():
            torch.ops.convfirstnet.bn_update_running(
                *stats, bn1.running_mean, bn1.running_var, bn2.running_mean, bn2.running_var,
                bn3.running_mean, bn3.running_var, bn1.num_batches_tracked, bn2.num_batches_tracked,
                bn3.num_batches_tracked, full, rows, rows,
                *(-1.0 if bn.momentum is None else float(bn.momentum) for bn in (bn1, bn2, bn3)))
    return out
