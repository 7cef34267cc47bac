"""Shared helper of the stem / ConvFirst kernel tests: strided NaN-banded inputs.

(Compiling for GPU targets goes through tests/kernels/_recorded.py and convfirstnet.analysis.)
"""

from __future__ import annotations

import torch


def nan_banded(x: torch.Tensor, memory_format=torch.channels_last) -> torch.Tensor:
    """`x` as a strided view into a larger NaN-filled buffer in the given memory format.

    The interpreter reads out-of-bounds addresses without complaint, so a missing mask would read
    neighbouring memory: here that memory is NaN and the output check fails loudly. The view keeps
    x's logical shape but has padded strides (non-contiguous), so stride handling is exercised too.
    """
    n, c, h, w = x.shape
    big = torch.full((n + 1, c + 3, h + 2, w + 3), float("nan"), dtype=x.dtype)
    big = big.contiguous(memory_format=memory_format)
    view = big[:n, 1 : c + 1, 1 : h + 1, 2 : w + 2]
    view.copy_(x)
    return view
