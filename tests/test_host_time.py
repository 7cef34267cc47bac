"""scripts/host_time.py: the Triton path's host code runs with every launch counted, none run."""

import pytest

pytest.importorskip("triton")

from convfirstnet.kernels import _launch

from ._scripts import load_script


def _script():
    return load_script("host_time")


@pytest.mark.parametrize("case, launches", [("infer", 98), ("train", None)])
def test_host_time_counts_launches_and_restores(monkeypatch, case, launches):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launchable = _launch.launchable
    r = _script().measure(case, "pico", 2, 32, 1)
    assert _launch.launchable is launchable
    assert r["host_ms_total"] > 0
    assert set(r["host_ms"]) == ({"forward"} if case == "infer" else {"forward", "backward"})
    if launches is None:  # training: every block's forward and backward passes launch several kernels
        assert r["launches_per_step"] > 10 * 52
    else:  # the fused inference form: the stem, 6 ConvFirst blocks (one launch each), 22 MBConv blocks
        # (staged: 20 of stride 1, four launches each, 2 of stride 2, five each), the head
        assert r["launches_per_step"] == launches
