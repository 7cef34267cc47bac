"""Test-wide setup.

Without a GPU the Triton kernels can only run in the interpreter, and ``@triton.jit`` reads
TRITON_INTERPRET when a kernel is decorated, so it is set here, before any convfirstnet import.
With ``CONVFIRSTNET_KERNELS`` unset ("auto") CPU tensors still take the PyTorch reference; kernel
tests select the Triton path explicitly.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture
def triton_backend(monkeypatch):
    """Run the ops through the Triton kernels (GPU tests, or CPU tensors in the interpreter)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "triton")


@pytest.fixture
def interpreter_backend(triton_backend):
    """Triton kernels on CPU tensors, in Triton's interpreter. On a GPU machine the kernels are compiled
    for the GPU instead (TRITON_INTERPRET unset), so these tests skip there and the CUDA ones run."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("interpreter test: runs where there is no GPU (TRITON_INTERPRET=1)")


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of small models: on a 2-core machine that also runs subprocesses
    (torchrun workers, data loaders), two threads per process spin against each other (~10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def reference_backend(monkeypatch):
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "reference")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
