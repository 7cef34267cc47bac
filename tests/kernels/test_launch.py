"""How a launch reaches Triton: the kernel itself for plain tensors, wrap_triton while torch.compile
traces (FakeTensor arguments). wrap_triton's HOP dispatch outside a triton_op costs ~0.2-1 ms of host
time per launch: on a GPU it made a step of the fused training ops (~1,300 launches, most from custom
ops' bodies) host-bound, 354 ms a step against 87 ms of kernels."""

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
