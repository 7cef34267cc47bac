"""Test-wide setup (docs/testing.md: markers, the full compile matrix, timings).

Without a GPU the Triton kernels can only run in the interpreter, and ``@triton.jit`` reads
TRITON_INTERPRET when a kernel is decorated, so it is set here, before any convfirstnet import.
With ``CONVFIRSTNET_KERNELS`` unset ("auto") CPU tensors still take the PyTorch reference; kernel
tests select the Triton path explicitly.

The whole run shares one compiled set (``compile_session``): a kernel variant compiled for sm_90 /
sm_80 by a kernel test is not compiled again by a report test, and the compile workers stay up.
Compile matrices are sampled (``sampled``) unless CONVFIRSTNET_FULL_MATRIX=1.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# CONVFIRSTNET_FULL_MATRIX=1: every case of the compile matrices (docs/testing.md), not the sample.
FULL_MATRIX = os.environ.get("CONVFIRSTNET_FULL_MATRIX", "0") not in ("", "0")

T = TypeVar("T")


def sampled(cases: Iterable[T], keep: Callable[[T], bool]) -> list[T]:
    """The cases of a compile matrix that a default run takes: those ``keep`` accepts, or all of them
    under CONVFIRSTNET_FULL_MATRIX=1. Choose the sample so that every assertion still has a case, and
    say in a comment which case covers which assertion."""
    cases = list(cases)
    return cases if FULL_MATRIX else [c for c in cases if keep(c)]


def pinned_triton() -> str:
    """The Triton the test extra pins (pyproject.toml): the compiler that the register, spill and SASS
    figures of the ``compile`` tests were measured with."""
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    return re.search(r'"triton==([^";\s]+)', text).group(1)


@functools.cache
def _triton_mismatch() -> str | None:
    """Why ``compile`` tests cannot run here (no Triton, or another version than the pin), or None."""
    try:
        import triton
    except ImportError:
        return "needs Triton"
    pinned, installed = pinned_triton(), triton.__version__.split("+")[0]
    if installed != pinned:
        return (f"register, spill and SASS figures measured with Triton {pinned} (the test extra's pin); "
                f"this is Triton {installed}: pip install -e '.[test]'")
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "interpreter_backend" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.interpreter)
        if item.get_closest_marker("compile") is not None and _triton_mismatch():
            item.add_marker(pytest.mark.skip(reason=_triton_mismatch()))


@pytest.fixture(scope="session", autouse=True)
def compile_session():
    """One compiled set and one pool of compile workers for the whole run (``analysis.compiled``)."""
    from convfirstnet.analysis.compiled import compile_session

    with compile_session() as session:
        yield session


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
