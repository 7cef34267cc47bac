"""Autograd for the fused-block ops: the backward recomputes the block through its PyTorch reference.

Each ``torch.ops.convfirstnet.<block>`` op registers (at the end of its ``op.py``)

    register_reference_autograd("convfirstnet::<block>", <block>_reference)

which gives the op a backward for the input and every weight and bias. The forward runs the Triton
kernel (or the reference) and saves only its inputs; the backward re-runs the block's reference
(``reference.py``, the same math in plain PyTorch ops, computed in fp32, or fp64 for fp64 inputs)
under ``torch.func.vjp`` and returns the vector-Jacobian products for the inputs that need them.

Cost, per block and backward pass: one forward of the reference (the block's MACs again, in PyTorch
ops rather than the fused kernel) plus its backward (about twice that), so a backward through the
fused form costs roughly what a backward through the training form costs, plus one extra forward.
Memory: the forward keeps each block's input (as the training form does, but none of the wide hidden
activations); the recompute holds one block's intermediate activations at a time, in fp32, during the
backward. The gradients are those of the reference function, which the kernels match to rounding
(tests/kernels check that); they are differentiable again (double backward works).
"""

from __future__ import annotations

from typing import Callable

import torch


def register_reference_autograd(qualname: str, reference: Callable[..., torch.Tensor]) -> None:
    """Register ``backward = vjp(reference)`` for the op ``qualname`` (arguments as ``reference``'s).

    Non-tensor arguments (the stride) are passed through unchanged and get no gradient.
    """

    def setup_context(ctx, inputs, output) -> None:
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in inputs]
        ctx.constants = [None if t else a for a, t in zip(inputs, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a, t in zip(inputs, ctx.is_tensor) if t])

    def backward(ctx, grad_out: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if t else c for t, c in zip(ctx.is_tensor, ctx.constants)]
        wanted = [i for i, (t, need) in enumerate(zip(ctx.is_tensor, ctx.needs_input_grad)) if t and need]
        if not wanted:
            return (None,) * len(args)

        def block(*diff_args: torch.Tensor) -> torch.Tensor:
            full = list(args)
            for i, a in zip(wanted, diff_args):
                full[i] = a
            return reference(*full)

        _, vjp_fn = torch.func.vjp(block, *[args[i] for i in wanted])
        grads = vjp_fn(grad_out)
        out: list[torch.Tensor | None] = [None] * len(args)
        for i, g in zip(wanted, grads):
            out[i] = g
        return tuple(out)

    torch.library.register_autograd(qualname, backward, setup_context=setup_context)


def function_around(name: str, op: Callable, setup_context: Callable, backward: Callable) -> type:
    """An autograd.Function that runs ``op`` with the autograd ``register_autograd`` gave it
    (``setup_context(ctx, inputs, output)``, ``backward(ctx, *grads)``; a Tensor[] input's gradients
    must come back as one None). The model's blocks call this rather than the op: inside ``forward``
    grad mode is off, so the op skips its own autograd layer, whose schema-default filling is
    quadratic in the argument count in torch 2.11-2.14 (pytorch/pytorch pull request 195110): ~0.1-0.3 ms
    of host time per call of the 19- to 25-argument training ops (``scripts/host_time.py``). The op
    keeps its registration for direct callers."""

    def forward(ctx, *args):
        out = op(*args)
        setup_context(ctx, args, out)
        return out

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                     "backward": staticmethod(backward)})
