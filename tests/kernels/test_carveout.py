"""kernels/_carveout.py: the L1 / shared-memory split a kernel runs with, under Triton's default and under
the opt-in ``fit`` policy, checked against what Nsight Compute measured on an H200, and the one call
``fit`` makes per compiled kernel (libcuda stood in)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from convfirstnet.kernels import _carveout as co

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "benchmarks/results/ncu/20261126T150000Z_h200_float16_small_ncu.json"
SM90_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
KB = 1024


def test_triton_default_matches_the_measured_configuration():
    """Every launch of fused Small on the H200: the configured shared memory that ncu read equals the
    model's for Triton's default policy, from the launch's own shared memory and programs per SM."""
    summary = json.loads(RECORD.read_text())
    seen = 0
    for ln in summary["launches"]:
        m = ln["metrics"]
        if ln["extra"]:
            continue
        # ncu prints these in Kbyte (1000 bytes); the per-block figure includes the driver's reserved 1 KB
        shared = round(m["launch__shared_mem_per_block"] * 1000) - co.RESERVED_PER_BLOCK
        programs = co.resident_programs(shared, int(m["launch__block_size"]) // 32,
                                        int(m["launch__registers_per_thread"]), max_shared=228 * KB)
        configured = co.carveout_bytes(shared, programs, SM90_KB, "triton")
        assert configured == round(m["launch__shared_mem_config_size"] * 1000), ln["kernel"]
        seen += 1
    assert seen == 87


def test_fit_takes_the_smallest_carveout_that_holds_the_programs():
    hidden = 174080  # the 16x16 MBConv hidden kernel: 170 KB, one program per SM
    assert co.carveout_bytes(hidden, 1, SM90_KB, "triton") == 228 * KB  # 28 KB of L1 left
    assert co.carveout_bytes(hidden, 1, SM90_KB, "fit") == 196 * KB  # 60 KB of L1 left
    assert co.carveout_bytes(60 * KB, 1, SM90_KB, "fit") == 64 * KB  # ConvFirst stages.2.x: 192 KB of L1
    assert co.carveout_bytes(60 * KB, 3, SM90_KB, "fit") == 196 * KB  # three programs: 183 KB
    assert co.carveout_bytes(30 * KB, 3, SM90_KB, "fit") == 132 * KB  # below 48 KB Triton sets nothing
    assert co.fit_percent(hidden, 1, 228 * KB) == 75  # 171 KB of 228: the driver rounds up to 196 KB
    assert co.fit_percent(60 * KB, 1, 228 * KB) == 27


def test_resident_programs_by_each_limit():
    assert co.resident_programs(174080, 8, 227, max_shared=228 * KB) == 1  # shared and registers
    assert co.resident_programs(10 * KB, 4, 85, max_shared=228 * KB) == 5  # registers: 88 x 128 x 5
    assert co.resident_programs(0, 4, 32, max_shared=228 * KB) == 16  # threads
    assert co.resident_programs(1 * KB, 1, 16, max_shared=228 * KB) == 32  # the block limit


def _compiled(shared, handle=1234, warps=8, regs=227):
    return SimpleNamespace(metadata=SimpleNamespace(shared=shared, num_warps=warps), n_regs=regs,
                           function=handle)


class _Cuda:
    def __init__(self, rc=0):
        self.calls, self.rc = [], rc

    def cuFuncSetAttribute(self, handle, attr, value):
        self.calls.append((handle.value, attr, value.value))
        return self.rc


def test_fit_sets_the_attribute_once_per_kernel(monkeypatch):
    import torch

    cuda = _Cuda()
    monkeypatch.setattr(co, "_libcuda", lambda: cuda)
    monkeypatch.setattr(co, "_DONE", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(shared_memory_per_multiprocessor=228 * KB))
    monkeypatch.setattr(co, "POLICY", "triton")
    co.apply(_compiled(174080), "cuda")
    assert cuda.calls == []  # Triton's choice left alone
    monkeypatch.setattr(co, "POLICY", "fit")
    for _ in range(3):
        co.apply(_compiled(174080), "cuda")
    co.apply(_compiled(30 * KB, handle=99), "cuda")  # under 48 KB: Triton set nothing, neither does fit
    co.apply(SimpleNamespace(), "cpu")  # the interpreter's launch returns no compiled kernel
    assert cuda.calls == [(1234, co.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 75)]
    monkeypatch.setattr(co, "POLICY", "triton")  # back to Triton's largest carve-out, once
    for _ in range(2):
        co.apply(_compiled(174080), "cuda")
    assert cuda.calls[1:] == [(1234, co.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)]


def test_a_refused_attribute_warns(monkeypatch):
    import torch

    monkeypatch.setattr(co, "_libcuda", lambda: _Cuda(rc=1))
    monkeypatch.setattr(co, "_DONE", {})
    monkeypatch.setattr(co, "POLICY", "fit")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(shared_memory_per_multiprocessor=228 * KB))
    with pytest.warns(RuntimeWarning, match="keeps Triton's carve-out"):
        co.apply(_compiled(174080), "cuda")
