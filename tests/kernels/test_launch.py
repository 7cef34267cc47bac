"""How a launch reaches Triton: the kernel itself for plain tensors, wrap_triton while torch.compile
traces (FakeTensor arguments). wrap_triton's HOP dispatch outside a triton_op costs ~0.2-1 ms of host
time per launch: on a GPU it made a step of the fused training ops (~1,300 launches, most from custom
ops' bodies) host-bound, 354 ms a step against 87 ms of kernels."""

import os

import pytest
import torch

pytest.importorskip("triton")

from convfirstnet.kernels import _launch  # noqa: E402


def _jit_kernel():
    from triton.runtime.jit import JITFunction

    def k(x_ptr):
        pass

    return JITFunction(k)  # compiled on first launch only: nothing here needs a GPU


def test_plain_tensors_launch_the_kernel_itself():
    kernel = _jit_kernel()
    args = (torch.empty(4), torch.nn.Parameter(torch.empty(2)), 3, None)
    assert _launch.launchable(kernel, args) is kernel


def test_traced_tensors_go_through_wrap_triton():
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper
    from torch._subclasses.fake_tensor import FakeTensorMode

    kernel = _jit_kernel()
    with FakeTensorMode():
        fake = torch.empty(4)
    assert type(fake).__name__ == "FakeTensor"
    assert isinstance(_launch.launchable(kernel, (fake, 3)), TraceableTritonKernelWrapper)


def test_launch_routes_through_launchable(monkeypatch):
    """launch() asks launchable with the launch's arguments (what the GPU tests count launches by)."""
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append(("run", grid, a, k))

    kernel = Kernel()
    monkeypatch.setattr(_launch, "launchable", lambda k, args=(): seen.append(("ask", args)) or k)
    x = torch.empty(4)
    _launch.launch(kernel, (2,), x, 5, BLOCK=8)
    assert seen == [("ask", (x, 5)), ("run", (2,), (x, 5), {"BLOCK": 8})]


# ---------------------------------------------------------------------- what torch.compile needs of a kernel
def _jit_functions():
    """(file, function node, source) of every @triton.jit function under kernels/."""
    import ast
    from pathlib import Path

    root = Path(_launch.__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            decorators = node.decorator_list if isinstance(node, ast.FunctionDef) else []
            if any("jit" in ast.unparse(d) for d in decorators):
                yield path.relative_to(root.parent), node, src


def test_kernels_leave_no_constexpr_to_a_default():
    """Inductor's wrapper of a user-defined kernel drops defaulted arguments from the launch it generates
    (on an H200 with torch 2.11: ``launcher() missing ... 'MOMENTS'``): a kernel's constexprs are all
    passed at the launch. (jit helpers called from kernels may keep defaults.)"""
    found = [f"{path}:{node.name}" for path, node, _ in _jit_functions()
             if node.name.endswith("_kernel") and node.args.defaults]
    assert found == []


def test_kernels_call_no_method_on_a_scalar_argument():
    """A scalar argument becomes a Python constant when Triton specializes it (the value 1) and in torch
    2.11's analysis of which arguments a kernel writes; ``x.to(...)`` then fails (that analysis gave up,
    assumed every argument written, and a compiled training step stopped): ``tl.cast(x, ...)`` takes both."""
    import ast
    import re

    found = []
    for path, node, src in _jit_functions():
        scalars = [a.arg for a in node.args.args if not a.arg.endswith("ptr")
                   and not (a.annotation is not None and "constexpr" in ast.unparse(a.annotation))]
        if not node.name.endswith("_kernel"):
            continue  # helpers receive tensors from their kernels
        body = ast.get_source_segment(src, node)
        found += [f"{path}:{node.name}:{a}" for a in scalars
                  if re.search(rf"(?<![\w.]){a}\.to\(", body)]
    assert found == []


def test_host_code_sizes_launches_with_plain_integers():
    """Outside ``@triton.jit`` code the kernels' modules call ``kernels._launch.cdiv`` / ``next_power_of_2``:
    Triton's are constexpr functions whose Python call costs ~1.5 us (Triton 3.6-3.8), and the launchers of
    a training step call them thousands of times (scripts/host_time.py: part of 79 -> 57 ms of host time)."""
    import ast
    from pathlib import Path

    root = Path(_launch.__file__).resolve().parent
    jit_lines = {(path, n) for path, node, _ in _jit_functions()
                 for n in range(node.lineno, node.end_lineno + 1)}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "triton" and node.attr in ("cdiv", "next_power_of_2")
                    and (path.relative_to(root.parent), node.lineno) not in jit_lines):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert found == []


def test_plain_integer_helpers_equal_tritons():
    import triton

    for n in range(0, 2050):
        assert _launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 2, 3, 8, 64, 1000):
            assert _launch.cdiv(n, d) == triton.cdiv(n, d)


def test_selected_backend_sets_and_restores(monkeypatch):
    """The one place that sets CONVFIRSTNET_KERNELS for a stretch of code: set inside, restored after
    (unset again when it was unset), an unknown name refused."""
    monkeypatch.delenv("CONVFIRSTNET_KERNELS", raising=False)
    with _launch.selected_backend("reference"):
        assert _launch.backend() == "reference"
    assert "CONVFIRSTNET_KERNELS" not in os.environ
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "triton")
    with pytest.raises(RuntimeError), _launch.selected_backend("auto"):
        assert _launch.backend() == "auto"
        raise RuntimeError("restored on the way out")
    assert _launch.backend() == "triton"
    with pytest.raises(ValueError, match="expected one of"):
        with _launch.selected_backend("cuda"):
            pass


def test_interpreter_refuses_triton_3_6_with_numpy_2_4(monkeypatch):
    """Triton <= 3.6's interpreter fails every runtime loop under NumPy >= 2.4 (an int() of a one-element
    array): a Triton call on a CPU tensor says so before any launch, and newer pairs pass."""
    import numpy
    import triton

    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(1, 8, 4, 4)
    cases = [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
             ("3.8.0", "2.4.6", False)]
    try:
        for tv, nv, refused in cases:
            monkeypatch.setattr(triton, "__version__", tv)
            monkeypatch.setattr(numpy, "__version__", nv)
            _launch.interpreter_problem.cache_clear()
            if refused:
                match = r"Triton 3\.6\.0 fails with NumPy 2\.4\.6.*numpy<2\.4"
                with pytest.raises(RuntimeError, match=match):
                    _launch.use_triton(x)
            else:
                assert _launch.use_triton(x)
    finally:
        _launch.interpreter_problem.cache_clear()
