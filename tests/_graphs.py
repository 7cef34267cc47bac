"""CUDA graphs emulated on CPU for the tests of ``convfirstnet train --cuda-graph``
(convfirstnet/commands/train/graphed.py): ``EmulatedGraphs`` stands in for its ``CudaGraphs``."""

from __future__ import annotations

import contextlib


class EmulatedGraph:
    """A captured step on CPU, replayed as a CUDA graph replays: the capture (``EmulatedGraphs``) ran the
    step once, standing for the first replay, which is then a no-op; every later replay runs it again.
    What a real replay guarantees is checked or imitated: the parameters' ``.grad`` are the tensors the
    capture produced (the graph writes those; one set to None after the capture would never be written),
    overwritten rather than accumulated, and the captured loss tensor is refreshed in place."""

    def __init__(self, fn, out, params):
        self.fn, self.out, self.params = fn, out, params
        self.grads = [p.grad for p in params]
        self.replays = 0

    def replay(self):
        self.replays += 1
        if self.replays == 1:
            return
        same = all(p.grad is g for p, g in zip(self.params, self.grads))
        assert same, "a .grad was replaced after the capture"
        for g in self.grads:
            g.zero_()
        self.out.copy_(self.fn())
        assert all(p.grad is g for p, g in zip(self.params, self.grads))


class EmulatedGraphs:
    def __init__(self, params):
        self.params, self.graphs, self.side = params, [], 0

    def side_stream(self):
        self.side += 1
        return contextlib.nullcontext()

    def capture(self, fn):
        out = fn()
        self.graphs.append(EmulatedGraph(fn, out, self.params))
        return self.graphs[-1], out
