"""torch.compile(fullgraph=True) of an op's Triton branch on CPU, without a GPU.

Inductor analyses a user-defined Triton kernel (which arguments it reads and writes) when dynamo
traces the launch, from the kernel's TTIR: a kernel construct that analysis cannot follow fails here,
not only on a GPU. The interpreter's kernels cannot be traced (``@triton.jit`` then returns an
InterpretedFunction that wrap_triton hands back unwrapped), so the trace runs in a subprocess whose
kernels are real JITFunctions and stops before the captured graph would launch anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_TRACE_SCRIPT = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
import convfirstnet.kernels  # noqa: F401  (kernels decorated as JITFunctions: no interpreter)
from torch._dynamo.backends.common import aot_autograd

os.environ["TRITON_INTERPRET"] = "1"  # only so that use_triton() takes the Triton branch on CPU
os.environ["CONVFIRSTNET_KERNELS"] = "triton"
op, args = sys.argv[1], json.loads(sys.argv[2])
graphs = []

class Captured(Exception):
    pass

def capture(gm, example_inputs):
    graphs.append(gm)
    def run(*a):
        raise Captured  # the graph would launch CUDA kernels: stop after tracing
    return run

if op == "convfirst":
    from convfirstnet.blocks import tap_major
    n, c, r, k, h, w, stride, *dtype = args  # dtype: default float32 (the fused stride-1 kernel)
    dt = getattr(torch, dtype[0] if dtype else "float32")
    c1 = c if stride == 1 else 2 * c
    shapes = [(r, c1), (r,), (k, r), (k,)]
    ws = [tap_major(torch.randn(c, 8, 3, 3).to(dt)), torch.randn(c).to(dt),
          *(torch.randn(*shape).to(dt) for shape in shapes)]
    fn = lambda t: torch.ops.convfirstnet.convfirst(t.to(dt), *ws, stride)
elif op == "mbconv":
    n, c, k, h, w, stride = args
    r, s = 4 * c, c // 4
    shapes = [(r, c), (r,), (r, 8, 3, 3), (r,), (s, r), (s,), (r, s), (r,), (k, r), (k,)]
    ws = [torch.randn(*shape) for shape in shapes]
    fn = lambda t: torch.ops.convfirstnet.mbconv(t, *ws, stride)
else:
    n, c, h, w, f = args
    wt, b = torch.randn(f, c), torch.randn(f)
    fn = lambda t: torch.ops.convfirstnet.head(t, wt, b)
x = torch.randn(n, c, h, w).contiguous(memory_format=torch.channels_last)
compiled = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=capture))
try:
    compiled(x)
except Captured:
    pass
print(json.dumps([str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]))
"""


_GRAPHS_PRELUDE = r"""
import json, os
os.environ.pop("TRITON_INTERPRET", None)
import torch
import triton
import convfirstnet.kernels  # noqa: F401  (kernels decorated as JITFunctions: no interpreter)
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from triton.backends.compiler import GPUTarget

os.environ["TRITON_INTERPRET"] = "1"  # only so that use_triton() takes the Triton branch on CPU
os.environ["CONVFIRSTNET_KERNELS"] = "triton"


class TargetOnly:  # no GPU here: torch's mutation analysis of the kernels needs a target for the TTIR
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(TargetOnly())
graphs = {}


def capture(name):
    def compiler(gm, example_inputs):
        graphs[name] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        vals = [None if o is None else o.meta["val"] for o in outs]
        # the graph would launch CUDA kernels: give back empty tensors of the right metadata instead
        return make_boxed_func(lambda *a: [None if v is None else torch.empty_strided(v.shape, v.stride(),
                                                                                      dtype=v.dtype)
                                           for v in vals])
    return compiler

"""


def _run(script: str, *argv: str) -> str:
    """The last line ``script`` prints, run in a subprocess whose Triton kernels are JITFunctions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # torch's analysis of which kernel arguments are written failed for a kernel: it then assumes every
    # argument is, and AOT autograd copies the results back into the op's inputs: on torch 2.11 that
    # stopped a compiled training step ("a leaf Variable that requires grad is being used in an in-place
    # operation") when a kernel called .to() on a scalar argument, which the analysis makes a constant
    assert "identify_mutated_tensors" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def trace_triton_branch(op, args):
    """torch.compile(fullgraph=True) of the op's Triton branch on CPU, in a subprocess whose kernels
    are real JITFunctions; returns the call targets of the captured forward graph."""
    return json.loads(_run(_TRACE_SCRIPT, op, json.dumps(args)))


def trace_graphs(body: str) -> dict[str, list[str]]:
    """Forward and backward graphs on CPU: ``body`` runs after a prelude that defines ``capture(name)``
    (an aot_autograd compiler that records the graph's call targets under ``name`` and returns empty
    tensors instead of launching) and ``aot_autograd``; returns {name: call targets}."""
    return json.loads(_run(_GRAPHS_PRELUDE + body + "\nprint(json.dumps(graphs))\n"))
