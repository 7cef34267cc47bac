"""Float arguments of the Triton kernels, read as fp32 whoever launched the kernel.

Triton's own launcher types a Python float argument ``fp32``; torch.compile, which launches the kernels
as user-defined Triton kernels, types it ``fp64`` (Inductor's ``_use_fp64_for_unbacked_floats``, on by
default since torch 2.10). Used as it comes, such an argument makes the arithmetic it enters fp64 (a
BatchNorm's ``1 / sqrt(var + eps)``, a gradient's ``* inv_p`` over a whole tile), and a loop-carried
fp32 accumulator that meets it stops the compile ("re-assigned to fp64 in loop"). Each kernel that
takes a float converts it once, first thing (one ``cvt.rn.f32.f64`` under torch.compile, nothing
otherwise); tests/kernels/test_compiled_launches.py compiles every such kernel with fp64 floats for
sm_90 and requires no other fp64 instruction in its PTX.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp32(x):
    """``x`` (a float argument: fp32, fp64, or a Python float under the interpreter) as an fp32 scalar."""
    return tl.full((), x, tl.float32)
