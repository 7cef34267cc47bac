"""The calibration table of the static cost model (benchmarks/calibration/h100.json): recomputed with the
same record -> compile for sm_90 -> weigh -> estimate path, it matches the committed table, every
measured time lies within the calibrated band, and the report's band is the table's.

Ten cases, nine compiled variants (Liger-Kernel forward ops pinned in the test extra, and this
package's tutorial-tiled GEMM), about a minute on two cores.
"""

import json
from pathlib import Path

import pytest

from convfirstnet.analysis import calibration

TABLE = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration" / "h100.json"


@pytest.fixture(scope="module")
def table():
    import importlib.metadata

    assert importlib.metadata.version("liger-kernel") == calibration.LIGER_VERSION, "the test extra pins it"
    return calibration.predict()


@pytest.mark.compile
def test_predictions_match_the_committed_table(table):
    committed = json.loads(TABLE.read_text())
    assert committed["format"] == table["format"] == calibration.FORMAT
    assert [c["name"] for c in table["cases"]] == [c["name"] for c in committed["cases"]]
    for new, old in zip(table["cases"], committed["cases"]):
        assert new["measured_ms"] == old["measured_ms"] and new["source"] == old["source"]
        for key in ("predicted_low_ms", "predicted_high_ms"):
            assert new[key] == pytest.approx(old[key], rel=1e-6), (new["name"], key)
        assert new["bound"] == old["bound"]
    assert table["band"] == pytest.approx(committed["band"], rel=1e-6)


@pytest.mark.compile
def test_measured_times_lie_within_the_band(table):
    band = table["band"]
    # the report's constants: the table's band rounded outwards to two decimals
    assert band["low_factor"] - 0.01 < calibration.BAND_SM90["low_factor"] <= band["low_factor"]
    assert band["high_factor"] <= calibration.BAND_SM90["high_factor"] < band["high_factor"] + 0.01
    for c in table["cases"]:
        lo, hi = c["predicted_low_ms"], c["predicted_high_ms"]
        assert lo < hi
        b = calibration.calibrated(lo, hi)
        assert b["low"] <= c["measured_ms"] <= b["high"], c["name"]
        # the low end is a floor for every case measured so far (no kernel ran faster than it)
        assert c["measured_ms"] >= lo, c["name"]
    # at least three memory-bound kernels and one compute-bound one, several sizes each
    kinds = {c["op"] for c in table["cases"]}
    assert {"fused_add_rms_norm", "relu_squared", "tvd", "gemm"} <= kinds
    # memory-bound: DRAM binds, except the smallest relu_squared (11 us), where the summed stall and wait
    # chains of the warps sharing a scheduler do (as in our own kernels)
    assert all(c["bound"] == "dram" for c in table["cases"] if c["op"] != "gemm" and c["measured_ms"] > 0.015)
    assert all(c["bound"] in ("dram", "latency") for c in table["cases"] if c["op"] != "gemm")


def test_the_report_carries_the_band():
    text = calibration.band_text(calibration.BAND_SM90)
    assert "calibrated band = [low x 1.00, high x 1.38]" in text
    assert calibration.calibrated(2.0, 3.0) == pytest.approx({"low": 2.0, "high": 3.0 * 1.38})
