"""ConvFirstNet blocks: the training form (with BatchNorm) beside its inference form (folded, fused).

Each training block has ``fuse()``, which folds its BatchNorms in fp64 and returns the matching
``Fused*`` module; ``timm.utils.reparameterize_model`` calls exactly that. A fused block holds conv
weights and biases only and its forward is one ``torch.ops.convfirstnet`` op (Triton kernel on GPU,
PyTorch reference on CPU), on NHWC activations.

Gradients: every op has a backward (``kernels/_autograd.py``: it recomputes the block through its
PyTorch reference), for the input and for every weight and bias. The folded weights are parameters
that require grad exactly when the training block's parameters do (the default; a block frozen with
``requires_grad_(False)`` before ``fuse()`` stays frozen), as ``torch.nn.utils.fusion.fuse_conv_bn_eval``
keeps ``requires_grad``. So ``model.parameters()`` of a fused model trains like any model's; BatchNorm is
gone, so what trains is the folded convolution (there are no batch statistics to update).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn as nn
from timm.layers import BlurPool2d, DropPath, SEModule

from .folding import fold_conv_bn
from .kernels._launch import GROUP_WIDTH
from .kernels.mbconv.op import check_mbconv
from .kernels.mbconv.reference import mbconv_layerwise
from .training_kernels import dispatch as _fused_training
MIN_INPUT_SIZE = 32  # five stride-2 stages; each BlurPool reflects one pixel, so needs a 2x2 map
INPUT_DTYPES = "float32, float16, bfloat16 or float64"


def check_input(x: object, in_chans: int, weight: torch.Tensor) -> None:
    """Raise one clear error for what the model cannot take: called by the stem, so every path through
    the model checks it (``forward``, ``forward_features``, ``forward_intermediates``, timm's
    ``features_only`` wrapper), before any kernel launch. ``weight`` is the stem's, for device and dtype.
    """
    if not isinstance(x, torch.Tensor):
        hint = "; convert it with torch.from_numpy(...)" if type(x).__module__ == "numpy" else ""
        raise TypeError(
            f"ConvFirstNet expects a torch.Tensor (N, C, H, W) image batch, got {type(x).__module__}."
            f"{type(x).__qualname__}{hint}"
        )
    if x.dim() != 4:
        raise ValueError(f"ConvFirstNet expects a 4-D (N, C, H, W) image batch, got shape {tuple(x.shape)}")
    if x.shape[1] != in_chans:
        raise ValueError(f"ConvFirstNet expects {in_chans} input channels, got {x.shape[1]} ({tuple(x.shape)})")
    if min(x.shape[2], x.shape[3]) < MIN_INPUT_SIZE:
        raise ValueError(
            f"ConvFirstNet needs an input of at least {MIN_INPUT_SIZE}x{MIN_INPUT_SIZE}, got {x.shape[2]}x{x.shape[3]}"
        )
    if not x.is_floating_point():
        raise TypeError(
            f"ConvFirstNet expects a floating-point image batch ({INPUT_DTYPES}), got {x.dtype}; "
            "convert and normalise it first (e.g. x.float() / 255, then the model's mean and std)"
        )
    if x.device != weight.device:
        raise ValueError(
            f"input is on {x.device} but the model is on {weight.device}; "
            "move the model and the input to the same device"
        )
    if x.dtype != weight.dtype and not (x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)):
        raise TypeError(
            f"input dtype {x.dtype} differs from the model's {weight.dtype}; "
            "cast the input (or use torch.autocast)"
        )


class NonFiniteInputWarning(UserWarning):
    """An input batch holds NaN or Inf values (see :func:`warn_non_finite`)."""


_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda x: False)


def finite_check_enabled(x: torch.Tensor) -> bool:
    """Whether :func:`warn_non_finite` looks at ``x``: on CPU tensors, and on every device with
    ``CONVFIRSTNET_CHECK_FINITE=1``; never under ``torch.compile`` or ``torch.export`` tracing, nor inside
    a ``torch.func`` transform (``vmap`` refuses a branch on a tensor's value).

    The check is one ``isfinite`` reduction over the input and a branch on its result. On a CPU that is a
    small fraction of the forward pass. On a GPU the branch makes the host wait for the GPU on every
    forward and cannot be captured in a CUDA graph, so it is off there unless asked for; compiled and
    exported graphs (a data-dependent branch) never hold it.
    """
    if torch.compiler.is_compiling() or _functorch_wrapped(x):
        return False
    if os.environ.get("CONVFIRSTNET_CHECK_FINITE", "") == "1":
        return x.device.type != "meta"
    return x.device.type == "cpu"


def warn_non_finite(x: torch.Tensor, owner: nn.Module) -> None:
    """Warn once per ``owner`` (the model's stem) when the input holds NaN or Inf values: the outputs of
    those images are NaN. Only where :func:`finite_check_enabled`; it never changes the result."""
    if getattr(owner, "_non_finite_warned", False) or not finite_check_enabled(x):
        return
    if not bool(torch.isfinite(x).all()):
        owner._non_finite_warned = True
        warnings.warn(
            f"ConvFirstNet input holds NaN or Inf values (shape {tuple(x.shape)}): the outputs of those "
            "images will be NaN; check how the images are loaded and normalised (warned once per model)",
            NonFiniteInputWarning,
            stacklevel=2,
        )


def _gconv3x3(channels: int, stride: int = 1) -> nn.Conv2d:
    # The same layer on the Triton op (forward, dgrad, wgrad; same parameters, init and state_dict) is
    # ``GroupConv3x3(channels, stride)`` (convfirstnet.gconv): returning it switches the training form.
    return nn.Conv2d(channels, channels, 3, stride, 1, groups=channels // GROUP_WIDTH, bias=False)


def _conv1x1(c_in: int, c_out: int) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 1, bias=False)


def _trainable_like(block: nn.Module, fused: "FusedBlock") -> "FusedBlock":
    """``fused`` with its weights requiring grad when any parameter of the training ``block`` does."""
    return fused.requires_grad_(any(p.requires_grad for p in block.parameters()))


class FusedBlock(nn.Module):
    """Base of the inference blocks: folded weights as parameters, autocast handled before the op."""

    weight_names: tuple[str, ...] = ()

    def _register(self, **tensors: torch.Tensor) -> None:
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t.detach().clone()))

    def _cast(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # Custom ops have no autocast rule: run them in the autocast dtype explicitly.
        weights = [getattr(self, n) for n in self.weight_names]
        if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):  # meta: cost recording
            dtype = torch.get_autocast_dtype(x.device.type)
            return x.to(dtype), [w.to(dtype) for w in weights]
        return x, weights


# ---------------------------------------------------------------------------------------------- stem
class Stem(nn.Module):
    """Paper stage 0: dense 3x3 conv, stride 2, BatchNorm, ReLU."""

    conv_bn_pairs = (("conv", "bn"),)

    def __init__(self, in_chans: int, out_chs: int):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, out_chs, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(out_chs)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.conv.in_channels, self.conv.weight)
        warn_non_finite(x, self)
        return self.act(self.bn(self.conv(x)))

    def fuse(self) -> "FusedStem":
        return _trainable_like(self, FusedStem(*fold_conv_bn(self.conv, self.bn)))


class FusedStem(FusedBlock):
    weight_names = ("w", "b")

    def __init__(self, w: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self._register(w=w, b=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.w.shape[1], self.w)
        warn_non_finite(x, self)
        x, (w, b) = self._cast(x)
        return torch.ops.convfirstnet.stem(x, w, b)


# ----------------------------------------------------------------------------------------- ConvFirst
class ConvFirst(nn.Module):
    """ConvFirst block (paper Fig. 6): grouped 3x3 conv first, then a 1x1 -> ReLU -> 1x1 FFN.

    stride 1: ``out = x + BN(W2 ReLU(BN(W1 BN(gconv(x)))))``
    stride 2: ``u = BlurPool(cat[x, BN(gconv(x))])``, ``out = BN(W2 ReLU(BN(W1 u)))``, no residual.
    Hidden width R = expansion x C (C = block input channels).
    """

    conv_bn_pairs = (("conv_dw", "bn_dw"), ("conv_expand", "bn_expand"), ("conv_project", "bn_project"))

    def __init__(self, in_chs: int, out_chs: int, stride: int, expansion: int, drop_path: float = 0.0):
        super().__init__()
        if stride == 1 and in_chs != out_chs:
            raise ValueError(f"a stride-1 ConvFirst block is C -> C, got {in_chs} -> {out_chs}")
        self.stride = stride
        hidden = expansion * in_chs
        ffn_in = in_chs if stride == 1 else 2 * in_chs
        self.conv_dw = _gconv3x3(in_chs)
        self.bn_dw = nn.BatchNorm2d(in_chs)
        self.blur = BlurPool2d(ffn_in, filt_size=3, stride=2) if stride == 2 else nn.Identity()
        self.conv_expand = _conv1x1(ffn_in, hidden)
        self.bn_expand = nn.BatchNorm2d(hidden)
        self.act = nn.ReLU(inplace=True)
        self.conv_project = _conv1x1(hidden, out_chs)
        self.bn_project = nn.BatchNorm2d(out_chs)
        self.drop_path = DropPath(drop_path) if drop_path > 0 and stride == 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _fused_training(self, x)  # the fused training op when the Triton kernels are selected
        if out is not None:
            return out
        y = self.bn_dw(self.conv_dw(x))
        u = y if self.stride == 1 else self.blur(torch.cat([x, y], dim=1))
        out = self.bn_project(self.conv_project(self.act(self.bn_expand(self.conv_expand(u)))))
        return x + self.drop_path(out) if self.stride == 1 else out

    def fuse(self) -> "FusedConvFirst":
        w_conv, b_conv = fold_conv_bn(self.conv_dw, self.bn_dw)
        w1, b1 = fold_conv_bn(self.conv_expand, self.bn_expand)
        w2, b2 = fold_conv_bn(self.conv_project, self.bn_project)
        fused = FusedConvFirst(w_conv, b_conv, w1.flatten(1), b1, w2.flatten(1), b2, self.stride)
        return _trainable_like(self, fused)


def tap_major(w_conv: torch.Tensor) -> torch.Tensor:
    """The grouped-conv weight with the same logical (C, 8, 3, 3) shape, stored tap-major: memory order
    (kh, kw, ci, co), strides (1, C, 24C, 8C). The fused ConvFirst and MBConv kernels read weights
    through their strides; in this layout each tap's per-group 8 x 8 blocks load as 16-byte vectors of
    output channels. Any other layout gives the same results (slower weight loads). Parameter copies
    (``clone``, ``.half()``, ``.to()``) keep it."""
    return w_conv.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)


class FusedConvFirst(FusedBlock):
    weight_names = ("w_conv", "b_conv", "w1", "b1", "w2", "b2")

    def __init__(self, w_conv, b_conv, w1, b1, w2, b2, stride: int):
        super().__init__()
        self.stride = stride
        # clone() and Module.to()/.half() preserve this (dense) layout
        self._register(w_conv=tap_major(w_conv), b_conv=b_conv, w1=w1, b1=b1, w2=w2, b2=b2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weights = self._cast(x)
        return torch.ops.convfirstnet.convfirst(x, *weights, self.stride)


# -------------------------------------------------------------------------------------- MBConv + SE
class MBConv(nn.Module):
    """MBConv with Squeeze-Excite (paper Fig. 9), expansion 4, SE reduced to 0.25 x block input channels.

    ``h = SiLU(BN(W_exp x))``; ``g = SiLU(BN(gconv(h)))`` (then BlurPool when stride 2);
    ``out = BN(W_proj SE(g))`` plus ``x`` when stride 1. SE is timm's ``SEModule`` (1x1 convs with bias,
    ReLU, sigmoid gate), as in EfficientNet.
    """

    conv_bn_pairs = (("conv_expand", "bn_expand"), ("conv_dw", "bn_dw"), ("conv_project", "bn_project"))

    def __init__(
        self, in_chs: int, out_chs: int, stride: int, expansion: int = 4, se_ratio: float = 0.25,
        drop_path: float = 0.0,
    ):
        super().__init__()
        if stride == 1 and in_chs != out_chs:
            raise ValueError(f"a stride-1 MBConv block is C -> C, got {in_chs} -> {out_chs}")
        self.stride = stride
        hidden = expansion * in_chs
        self.conv_expand = _conv1x1(in_chs, hidden)
        self.bn_expand = nn.BatchNorm2d(hidden)
        self.act = nn.SiLU(inplace=True)
        self.conv_dw = _gconv3x3(hidden)
        self.bn_dw = nn.BatchNorm2d(hidden)
        self.blur = BlurPool2d(hidden, filt_size=3, stride=2) if stride == 2 else nn.Identity()
        self.se = SEModule(hidden, rd_channels=round(se_ratio * in_chs), act_layer=nn.ReLU)
        self.conv_project = _conv1x1(hidden, out_chs)
        self.bn_project = nn.BatchNorm2d(out_chs)
        self.drop_path = DropPath(drop_path) if drop_path > 0 and stride == 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _fused_training(self, x)  # training mode with the Triton kernels selected: the recompute path
        if out is not None:
            return out
        h = self.act(self.bn_expand(self.conv_expand(x)))
        g = self.blur(self.act(self.bn_dw(self.conv_dw(h))))
        out = self.bn_project(self.conv_project(self.se(g)))
        return x + self.drop_path(out) if self.stride == 1 else out

    def fuse(self) -> "FusedMBConv":
        w_exp, b_exp = fold_conv_bn(self.conv_expand, self.bn_expand)
        w_conv, b_conv = fold_conv_bn(self.conv_dw, self.bn_dw)
        w_proj, b_proj = fold_conv_bn(self.conv_project, self.bn_project)
        se = self.se
        fused = FusedMBConv(
            w_exp.flatten(1), b_exp, tap_major(w_conv), b_conv,
            se.fc1.weight.flatten(1), se.fc1.bias, se.fc2.weight.flatten(1), se.fc2.bias,
            w_proj.flatten(1), b_proj, self.stride,
        )
        return _trainable_like(self, fused)


# Which form of an MBConv block torch.compile compiles (FusedMBConv.compiled_path; the environment's
# CONVFIRSTNET_COMPILED_MBCONV when the block is made): "fused" (and "auto", the default) the fused op,
# "layer-wise" the layers on the same folded weights. Measured on an H200 (Small, batch 128, fp16, Triton
# 3.6, CUDA graphs): with the conv's conflict-free tap order and the fitted L1 carve-out the fused blocks
# take 0.426 ms at 32x32 stride 2, 0.311 at 16x16 stride 1, 0.332 at 16x16 stride 2 and 0.106 at 8x8
# (benchmarks/results/variants/20261127T00*), against 0.472, 0.350, 0.337 and 0.263 for torch.compile
# of the BatchNorm-folded block (benchmarks/results/20261126T051713Z_h200_float16_small_gpu-check-blocks
# .json). Before those two changes the fused blocks lost on maps of 256 pixels or more (0.633, 0.403,
# 0.433), which "auto" then compiled layer-wise.
COMPILED_PATHS = ("auto", "fused", "layer-wise")


def compiled_mbconv_path() -> str:
    """``CONVFIRSTNET_COMPILED_MBCONV`` (default ``auto``), checked against ``COMPILED_PATHS``."""
    name = os.environ.get("CONVFIRSTNET_COMPILED_MBCONV", "auto").strip().lower() or "auto"
    if name not in COMPILED_PATHS:
        raise ValueError(
            f"CONVFIRSTNET_COMPILED_MBCONV={name!r}: expected one of {', '.join(COMPILED_PATHS)}"
        )
    return name


@torch.compiler.assume_constant_result  # run when traced: torch 2.11's dynamo folds is_exporting() to True
def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


class FusedMBConv(FusedBlock):
    """The fused MBConv + SE block. Eager (and ``torch.export``): one ``torch.ops.convfirstnet.mbconv``.
    Under ``torch.compile``, where ``compiled_path`` says so (``COMPILED_PATHS``), the same folded weights
    go through the layers instead (``mbconv_layerwise``, after the op's input checks), which torch.compile
    turns into its own kernels."""

    weight_names = ("w_exp", "b_exp", "w_conv", "b_conv", "w_se1", "b_se1", "w_se2", "b_se2", "w_proj", "b_proj")
    compiled_path = "auto"  # blocks saved before the attribute existed

    def __init__(self, w_exp, b_exp, w_conv, b_conv, w_se1, b_se1, w_se2, b_se2, w_proj, b_proj, stride: int):
        super().__init__()
        self.stride = stride
        self.compiled_path = compiled_mbconv_path()
        self._register(
            w_exp=w_exp, b_exp=b_exp, w_conv=w_conv, b_conv=b_conv, w_se1=w_se1, b_se1=b_se1,
            w_se2=w_se2, b_se2=b_se2, w_proj=w_proj, b_proj=b_proj,
        )

    def compiles_layers(self, x: torch.Tensor) -> bool:
        """Whether torch.compile of this block on ``x`` compiles its layers (``compiled_path``)."""
        return self.compiled_path == "layer-wise"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weights = self._cast(x)
        if torch.compiler.is_compiling() and not _exporting() and self.compiles_layers(x):
            check_mbconv(x, *weights, self.stride)
            return mbconv_layerwise(x, *weights, self.stride)
        return torch.ops.convfirstnet.mbconv(x, *weights, self.stride)


# ---------------------------------------------------------------------------------------------- head
class Head(nn.Module):
    """1x1 conv to 1280, BatchNorm, SiLU, global average pool -> (N, 1280) (classifier is separate)."""

    conv_bn_pairs = (("conv", "bn"),)

    def __init__(self, in_chs: int, out_chs: int = 1280):
        super().__init__()
        self.conv = _conv1x1(in_chs, out_chs)
        self.bn = nn.BatchNorm2d(out_chs)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x))).mean(dim=(2, 3))

    def fuse(self) -> "FusedHead":
        w, b = fold_conv_bn(self.conv, self.bn)
        return _trainable_like(self, FusedHead(w.flatten(1), b))


class FusedHead(FusedBlock):
    weight_names = ("w", "b")

    def __init__(self, w: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self._register(w=w, b=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, (w, b) = self._cast(x)
        return torch.ops.convfirstnet.head(x, w, b)
