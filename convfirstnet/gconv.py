"""The training form's group-width-8 3x3 convolution on the Triton op, as a drop-in ``nn.Conv2d``.

``GroupConv3x3(C, stride)`` is ``nn.Conv2d(C, C, 3, stride, 1, groups=C // 8, bias=False)``: the same
class hierarchy, parameters (``weight`` (C, 8, 3, 3), no bias), initialisation and state_dict keys, so
checkpoints, ``fuse()`` and timm's helpers see no difference. Its forward runs
``torch.ops.convfirstnet.gconv3x3`` (Triton forward, dgrad and wgrad on CUDA; the PyTorch reference
on CPU unless ``CONVFIRSTNET_KERNELS=triton``), whose weight gradient is deterministic by default.

When the Triton path is selected (``CONVFIRSTNET_KERNELS=triton``, or ``auto`` with a CUDA tensor) but
the kernels do not take the input as it is (a dtype other than float16/bfloat16/float32, a layout
other than channels-last, bfloat16 in the CPU interpreter): ``triton`` raises a TypeError/ValueError
naming the problem before anything runs; ``auto`` falls back to ``F.conv2d`` with one warning line
per problem. Under autocast the input is cast to the autocast dtype and the weight stays in fp32
(the kernels round it as they load it; its gradient comes back in fp32).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels._launch import GROUP_WIDTH, backend

_WARNED: set[str] = set()


def triton_refusal(x: torch.Tensor) -> tuple[type[Exception], str] | None:
    """Why the Triton kernels would not take ``x`` as it is: (exception type, reason), or None."""
    from .kernels.gconv.launcher import DTYPES, reads_in_place

    if x.dtype not in DTYPES:
        return TypeError, f"dtype {x.dtype} (the kernels run float16, bfloat16 and float32)"
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return TypeError, "bfloat16 on CPU (the Triton interpreter computes bf16 tl.dot wrongly)"
    # the storage offset is not traceable under torch.compile: the strides decide (the launcher copies a
    # channels-last crop whose offset is not a multiple of 8)
    if x.dim() == 4 and not reads_in_place(x, offset=not torch.compiler.is_compiling()):
        return ValueError, (
            f"input strides {tuple(x.stride())} are not channels-last (NHWC), which the kernels read; "
            "convert the model and its input with .to(memory_format=torch.channels_last)"
        )
    return None


class GroupConv3x3(nn.Conv2d):
    """Group-width-8 3x3 convolution, padding 1, stride 1 or 2, no bias (module docstring).

    ``deterministic``: the weight gradient is summed in a fixed order (default; also forced while
    ``torch.use_deterministic_algorithms(True)`` is on); False sums it with fp32 atomics.
    """

    def __init__(self, channels: int, stride: int = 1, deterministic: bool = True, device=None, dtype=None):
        if channels <= 0 or channels % GROUP_WIDTH:
            raise ValueError(f"GroupConv3x3: channels must be a positive multiple of {GROUP_WIDTH}, "
                             f"got {channels}")
        if stride not in (1, 2):
            raise ValueError(f"GroupConv3x3: stride must be 1 or 2, got {stride}")
        super().__init__(channels, channels, 3, stride, 1, groups=channels // GROUP_WIDTH, bias=False,
                         device=device, dtype=dtype)
        self.deterministic = deterministic

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, deterministic: bool = True) -> nn.Conv2d:
        """The same layer (sharing ``conv``'s weight) as a GroupConv3x3. A conv of another kind (group
        width, kernel size, padding, stride, dilation, bias, padding mode) is refused with a ValueError
        under ``CONVFIRSTNET_KERNELS=triton``; otherwise it is returned unchanged with one warning."""
        problem = _unsupported_conv(conv)
        if problem is not None:
            if backend() == "triton":
                raise ValueError(f"GroupConv3x3.from_conv: {problem}")
            _warn_once(f"GroupConv3x3.from_conv: {problem}; the layer stays an nn.Conv2d")
            return conv
        new = cls(conv.in_channels, conv.stride[0], deterministic, device="meta")
        new.weight = conv.weight
        return new

    def extra_repr(self) -> str:
        return super().extra_repr() + f", deterministic={self.deterministic}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        mode = backend()
        if mode == "triton" or (mode == "auto" and x.device.type == "cuda"):
            refusal = triton_refusal(x)
            if refusal is not None:
                exc, reason = refusal
                if mode == "triton":
                    raise exc(f"GroupConv3x3 with CONVFIRSTNET_KERNELS=triton: {reason}")
                _warn_once(f"GroupConv3x3: {reason}; running F.conv2d instead of the Triton kernels")
                return F.conv2d(x, self.weight.to(x.dtype), None, self.stride, self.padding, self.dilation,
                                self.groups)
        deterministic = self.deterministic or torch.are_deterministic_algorithms_enabled()
        return torch.ops.convfirstnet.gconv3x3(x, self.weight, self.stride[0], deterministic)


def _unsupported_conv(conv: nn.Module) -> str | None:
    if type(conv) is not nn.Conv2d and not isinstance(conv, GroupConv3x3):
        return f"expected an nn.Conv2d, got {type(conv).__name__}"
    c = conv.in_channels
    if conv.out_channels != c or c % GROUP_WIDTH or conv.groups != c // GROUP_WIDTH:
        return (f"group width {conv.in_channels // conv.groups} with {c} -> {conv.out_channels} channels: "
                f"only C -> C with group width {GROUP_WIDTH} is supported")
    if conv.kernel_size != (3, 3):
        return f"kernel size {conv.kernel_size}: only 3x3 is supported"
    if conv.padding != (1, 1) or conv.padding_mode != "zeros" or conv.dilation != (1, 1):
        return (f"padding {conv.padding} ({conv.padding_mode}), dilation {conv.dilation}: only zero "
                "padding 1 without dilation is supported")
    if conv.stride not in ((1, 1), (2, 2)):
        return f"stride {conv.stride}: only 1 or 2 is supported"
    if conv.bias is not None:
        return "a bias: only bias-free convolutions are supported (a BatchNorm follows in ConvFirstNet)"
    return None


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)
