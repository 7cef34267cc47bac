"""Model cost: parameters and multiply-accumulates, counted by PyTorch's own FLOP counter."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def count_macs(model: nn.Module, input_size: tuple[int, int, int] = (3, 256, 256)) -> int:
    """Multiply-accumulates for one image (FLOPs / 2), counted on a meta-device copy (shapes only).

    Counts every convolution (BlurPool and SE included) and the classifier, as the paper's tables do.
    Run it on the training form: fused blocks are custom ops the counter does not see.
    """
    meta = copy.deepcopy(model).eval().to("meta")
    with FlopCounterMode(display=False) as counter:
        meta(torch.empty(1, *input_size, device="meta"))
    return counter.get_total_flops() // 2
