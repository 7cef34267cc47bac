"""scripts/gpu_profile.py on the CPU (its --device cpu mode, which exists to check the script): the case
record carries the host profile, whose per-package own times add up to its total and whose rows name the
project's own code."""

import pytest

from tests._scripts import load_script


def test_host_profile_of_a_training_step():
    gp = load_script("gpu_profile")
    r = gp.profile_case("train-eager", "pico", 2, 64, 1, device="cpu")
    host = r["host"]
    assert host["total_ms"] > 0
    assert sum(host["by_package"].values()) == pytest.approx(host["total_ms"])
    # the model's forward is ours, autograd torch's
    assert {"torch", "convfirstnet"} <= set(host["by_package"])
    assert host["top"] == sorted(host["top"], key=lambda h: -h["own_ms"])
    assert all(h["calls"] > 0 for h in host["top"])


def test_package_of_a_file():
    gp = load_script("gpu_profile")
    assert gp._package("/x/site-packages/torch/nn/modules/conv.py") == "torch"
    assert gp._package("/work/main/convfirstnet/blocks.py") == "convfirstnet"
    assert gp._package("/work/main/kernels/_launch.py") == "kernels"  # the source checkout's kernels/
    assert gp._package("/usr/lib/python3.11/abc.py") == "other"
