"""The activations fused into the Triton kernels (sigmoid, SiLU), in one place, in fp32.

    sigmoid(x) = 1 / (1 + 2^(-x log2(e)))            silu(x) = x * sigmoid(x)

``FAST`` (a constexpr; compiled for a GPU): 2^t through ``ex2.approx.ftz.f32`` (MUFU.EX2) and the
reciprocal through ``rcp.approx.ftz.f32`` (MUFU.RCP), by inline asm (``SIGMOID_PTX``, ``SILU_PTX``):
FMUL, MUFU.EX2, FADD, MUFU.RCP (and one FMUL for SiLU) per element. Otherwise (the interpreter,
which cannot run inline asm; fp32 data) ``tl.exp2`` and a division: the same formula.

Accuracy. The PTX ISA (Floating Point Instructions: ``ex2``, ``rcp``) bounds ``ex2.approx.f32`` by
2 ulp and ``rcp.approx.f32`` by 1 ulp over their full ranges. The formula has no cancellation: as
x -> -inf, 1 + 2^t grows and its reciprocal shrinks, each a few ulp off, so sigmoid and SiLU stay
within ~2e-6 relative error over [-16, 16] (the rounding of t = -x log2(e), |t| <= 23.1, adds up
to |t| 2^-24 ln 2 ~ 1e-6). The form this replaces, 0.5 + 0.5 tanh(x / 2) with ``tanh.approx.f32``
(maximum relative error 2^-11, PTX ISA ``tanh``), cancels in 1 + tanh(x / 2) for x < 0: its
relative error grows as ~2^-11 / (1 + tanh(x / 2)), about 10 % at x = -6 and above 100 % below
x = -10, where the gate can come out as 0 or negative (tests/kernels/test_activations.py evaluates
both forms with every approximate instruction at its documented worst case).

Range: 2^t flushes to 0 below 2^-126 (x > 87: sigmoid = 1) and overflows to inf above 2^128
(x < -88.7: the reciprocal is 0, sigmoid 0 and SiLU -0.0, where the true values are below 1e-37).

Cost: two MUFU instructions per element where the tanh form had one. The MUFU pipe issues 16 per
clock per SM (CUDA C++ Programming Guide, arithmetic instruction throughput, compute capability
9.0), a quarter of the fp32 rate.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The GPU form as one PTX block each ($1 = x, $0 = the result; 0fBFB8AA3B = -log2(e), 0f3F800000 = 1).
# One block rather than a call per instruction: ptxas then kept the MBConv hidden kernel at 255
# registers without spilling (split into ex2 and rcp calls it spilled 24 B). The tests evaluate these
# strings instruction by instruction (tests/kernels/test_activations.py).
SIGMOID_PTX = tl.constexpr("{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
                           "add.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }")
SILU_PTX = tl.constexpr("{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
                        "add.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 t, t; mul.f32 $0, $1, t; }")


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    """sigmoid(x) = 1 / (1 + 2^(-x log2(e))) in fp32 (module docstring)."""
    if FAST:
        return tl.inline_asm_elementwise(SIGMOID_PTX, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / (1.0 + tl.exp2(x * -1.4426950408889634))


@triton.jit
def silu(x, FAST: tl.constexpr):
    """SiLU(x) = x sigmoid(x) in fp32 (module docstring)."""
    if FAST:
        return tl.inline_asm_elementwise(SILU_PTX, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return x * (1.0 / (1.0 + tl.exp2(x * -1.4426950408889634)))
