"""``--cuda-graph``: the forward, the loss and the backward of a training step captured once in a CUDA
graph and replayed for every batch (PyTorch's whole-network capture, ``torch.cuda.graphs``); the
optimizer step, GradScaler's unscale/step/update, gradient clipping, the EMA and the schedule run after
each replay, outside the graph (GradScaler skips a step on a flag it reads on the host).

Why: launched from Python, a step of the fused training kernels is bound by the host's work per launch
(Small, batch 128, fp16, one H200: 211 ms a step for 84 ms of kernels); captured, that work is paid once.
``convfirstnet bench --train`` measured the whole step captured at 84 ms fused against 99 ms layer-wise
(benchmarks/results/20261126T145122Z_h200_float16_train-small_gpu-check-train.json; that capture held
the SGD step too, which here stays outside).

The step keeps the eager loop's semantics:

* the first ``WARMUP`` steps run eagerly on a side stream (torch.cuda.graphs' recipe: every kernel is
  compiled and warmed, cuDNN's benchmark has chosen, the optimizer has built its state);
* the next step captures the graph (a capture runs nothing), then replays it for that batch and every
  later one; each batch is first copied into the graph's static input and target (the loader drops the
  last partial batch, so their shapes do not change; a batch of another shape is refused);
* the parameters' ``.grad`` tensors are the graph's outputs: each replay overwrites them (they are not
  accumulated), and they are never set to None after the capture;
* autocast runs without its weight-cast cache (casts cached before the capture would be stale in it);
* drop-path draws new random numbers at each replay (PyTorch's CUDA generator is graph-safe), and
  BatchNorm's running statistics are updated in place at each replay.

With several processes the model is not wrapped in DDP (its gradient all-reduce runs in backward hooks,
which a capture would have to hold): ``broadcast_state`` copies rank 0's parameters and buffers to every
process once, as DDP's construction does, and after each backward (eager or replayed) ``all_reduce_mean``
averages the gradients, as DDP's default hook does (divided by the process count, then summed), before
the optimizer step; the all-reduce is not overlapped with the backward. BatchNorm's running statistics
stay each process's own until the loop's ``distribute_bn`` averages them at the end of the epoch (DDP
would copy rank 0's to the others at every forward). ``graphs`` is the capture API (``CudaGraphs``); the
CPU tests stand in for it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn

from .options import TrainError

WARMUP = 3  # eager steps before the capture (torch.cuda.graphs' whole-network example uses 3)


class CudaGraphs:
    """The CUDA side of :class:`GraphedStep`: a side stream for the warm-up steps, and the capture."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def side_stream(self):
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the batch was copied to the GPU on the current stream
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """``fn`` captured (not run) in a CUDA graph, and its output, which each replay refreshes."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out


def broadcast_state(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every process (what DDP's construction does)."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=0)


def all_reduce_mean(grads: list[torch.Tensor]) -> None:
    """``grads`` averaged over the processes in place, as DDP's default hook averages them (each divided
    by the process count, then summed): one all-reduce of a flat copy per dtype."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same).div_(dist.get_world_size())
        dist.all_reduce(flat)
        for g, r in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(r)


class GraphedStep:
    """One optimizer step per call, ``step(images, target) -> loss`` (module docstring). The caller does
    the rest of its loop (EMA, schedule, logging) after it, as for an eager step."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: nn.Module,
        optimizer: Any,
        scaler: Any,  # torch.amp.GradScaler, or None without AMP
        autocast_dtype: torch.dtype | None,
        clip_grad: float | None,
        graphs: Any,
        reduce: Callable[[list[torch.Tensor]], None] | None = None,  # all_reduce_mean with several processes
    ) -> None:
        self.model, self.loss_fn, self.optimizer, self.scaler = model, loss_fn, optimizer, scaler
        self.autocast_dtype, self.clip_grad, self.graphs = autocast_dtype, clip_grad, graphs
        self.reduce = reduce
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.steps = 0
        self.graph = None
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None
        self.static_loss: torch.Tensor | None = None

    def forward_backward(self, images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        dtype = self.autocast_dtype
        autocast = (torch.autocast(images.device.type, dtype=dtype, cache_enabled=False) if dtype
                    else contextlib.nullcontext())
        with autocast:
            loss = self.loss_fn(self.model(images), target)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach()

    def update(self) -> None:
        """Average the gradients over the processes, unscale and clip them if asked, the optimizer step,
        the scaler's update."""
        if self.reduce is not None:
            self.reduce([p.grad for p in self.params if p.grad is not None])
        if self.scaler is not None:
            if self.clip_grad:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.params, self.clip_grad)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.clip_grad:
                nn.utils.clip_grad_norm_(self.params, self.clip_grad)
            self.optimizer.step()

    def __call__(self, images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.steps < WARMUP:
            with self.graphs.side_stream():
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.forward_backward(images, target)
                self.update()
        else:
            if self.graph is None:
                self._capture(images, target)
            else:
                self._load(images, target)
            self.graph.replay()
            self.update()
            loss = self.static_loss
        self.steps += 1
        return loss

    def _capture(self, images: torch.Tensor, target: torch.Tensor) -> None:
        self.static = (images.clone(memory_format=torch.preserve_format), target.clone())
        # the backward assigns fresh .grad tensors inside the capture: those become the graph's outputs
        self.optimizer.zero_grad(set_to_none=True)
        try:
            self.graph, self.static_loss = self.graphs.capture(lambda: self.forward_backward(*self.static))
        except Exception as e:  # a host sync or an op that cannot be captured
            raise TrainError(f"--cuda-graph: the training step cannot be captured in a CUDA graph "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); run without "
                             "--cuda-graph") from e

    def _load(self, images: torch.Tensor, target: torch.Tensor) -> None:
        for new, static, name in ((images, self.static[0], "images"), (target, self.static[1], "targets")):
            if new.shape != static.shape or new.dtype != static.dtype:
                raise TrainError(f"--cuda-graph: a batch of {name} {tuple(new.shape)} {new.dtype} after "
                                 f"a capture with {tuple(static.shape)} {static.dtype}: the graph replays "
                                 "one shape")
            static.copy_(new)

