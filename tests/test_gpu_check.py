"""scripts/gpu_check.py on a machine without a GPU: the plan it prints, the import path it sets up for
an uninstalled checkout, the blocks it would time, and the formatting of its tables and records (fed
with made-up timings: these tests check the formatting, they claim no result)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ._scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    yield load_script("gpu_check", "gpu_check")
    del sys.modules["gpu_check"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_prints_the_plan_and_exits_0(gc, capsys, monkeypatch):
    """As a script (its own process); its options in this process (an interpreter start saved)."""
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("gpu_check: no CUDA device here: nothing is run.")
    assert "-m pytest -m gpu" in out and "in the default mode" in out and "budget: 9 min" in out
    assert "3. a training step of small: convfirstnet bench --train small" in out
    assert "small, tiny, nano, pico" in out and "benchmarks/results/" in out
    monkeypatch.setattr(gc, "INDUCTOR", list(gc.INDUCTOR))  # main() sets the backend for the module
    assert gc.main(["--inductor", "inductor-max-autotune", "--budget-min", "20", "--skip-train"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpu_check: no CUDA device here: nothing is run.")
    assert "mode='max-autotune'" in out and "budget: 20 min" in out and "training step" not in out


def test_bad_model_is_one_line(gc, capsys):
    assert gc.main(["--models", "huge"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: error: unknown model 'huge'") and err.count("\n") == 1


def test_source_view_is_the_installed_layout(gc, tmp_path):
    """The checkout laid out as pyproject.toml maps it: convfirstnet.kernels is kernels/; a child process
    with the view first on its path (and PYTHONSAFEPATH, as the script sets) imports from it."""
    view = gc.source_view(ROOT, tmp_path)
    assert (view / "convfirstnet" / "kernels").resolve() == (ROOT / "kernels").resolve()
    init = (view / "convfirstnet" / "__init__.py").resolve()
    assert init == (ROOT / "convfirstnet" / "__init__.py").resolve()
    env = dict(os.environ, PYTHONPATH=str(view), PYTHONSAFEPATH="1")
    code = ("import convfirstnet.kernels.head.kernel as k, convfirstnet; print(convfirstnet.__file__); "
            "print(k.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    init, head = proc.stdout.split()
    assert init == str(view / "convfirstnet" / "__init__.py")
    assert Path(head).resolve() == (ROOT / "kernels" / "head" / "kernel.py").resolve()


def test_budget_shares(gc):
    b = gc.Budget(gc.RESERVE_S + 600)
    assert 599 < b.left() <= 600
    assert b.share(240) == 240  # the cap
    assert 149 < b.share(240, parts=4) <= 150  # an even share of what is left
    assert gc.Budget(gc.RESERVE_S - 5).share(100) == 0


def test_distinct_blocks_of_pico_match_the_report_paths(gc):
    import convfirstnet

    groups = gc.distinct_blocks(convfirstnet.create_model("pico"), 2, 256)
    paths = [p for g in groups for p in g["paths"]]
    assert paths[0] == "stem" and paths[-1] == "head" and len(paths) == len(set(paths))
    assert all(p.startswith("stages.") for p in paths[1:-1])
    stem = next(g for g in groups if g["paths"] == ["stem"])
    assert stem["shape"] == [2, 3, 256, 256] and stem["kind"] == "Stem"
    # the stride-1 blocks of a stage share one configuration (timed once), its first block differs
    assert any(len(g["paths"]) > 1 for g in groups)
    assert {g["kind"] for g in groups} == {"Stem", "ConvFirst", "MBConv", "Head"}


def test_predictions_come_from_the_static_report(gc):
    """Every distinct block of Small has a prediction in the saved static report of Small (the same
    paths), and the model row has the report's low/high."""
    import convfirstnet

    rep = json.loads((ROOT / "benchmarks" / "static" / "small_b128_sm90.json").read_text())
    for g in gc.distinct_blocks(convfirstnet.create_model("small"), 128, 256):
        pred = gc.predicted_of(rep, g["paths"][0])
        assert pred is not None and 0 < pred["low"] <= pred["high"], g["paths"][0]
    assert gc.predicted_of(rep, "model")["high"] == rep["predicted_high_ms"]
    assert gc.predicted_of(None, "stem") is None and gc.predicted_of(rep, "nowhere") is None


def _fake_rows():
    """Made-up timings, to check the formatting only."""
    pred = dict(low=1.0, high=2.0, layerwise_low=3.0, layerwise_high=4.0)
    timed = dict(status="ok", times_ms=dict(median=2.5, p10=2.4, p90=2.6), ms_per_batch=2.5)
    return [
        dict(model="pico", path="model", paths=["model"], count=1, kind="model", shape=[128, 3, 256, 256],
             predicted=pred, fused=timed, inductor=dict(timed, ms_per_batch=5.0, times_ms=dict(median=5.0))),
        dict(model="pico", path="stages.1.1", paths=["stages.1.1", "stages.1.2"], count=2, kind="ConvFirst",
             shape=[128, 32, 64, 64], predicted=None, fused=timed,
             inductor=dict(status="skipped", reason="stopped at its time limit of 90 s")),
    ]


def test_comparison_table_formatting(gc):
    lines = gc.comparison_table(_fake_rows()).splitlines()
    assert lines[0].startswith("| model | block | count | predicted ms (low-high) | fused ms (CUDA graph) |")
    assert lines[2] == "| pico | model | 1 | 1.000-2.000 | 2.500 | 1.25 | 5.000 | 2.00x |"
    assert lines[3] == "| pico | stages.1.1 ... | 2 | - | 2.500 | - | skipped | - |"


def test_records_use_the_bench_format(gc, tmp_path):
    """The whole-model record is a ``convfirstnet bench`` network record that the README table reads;
    the block record keeps predicted and measured per block."""
    from convfirstnet.commands import bench, results

    rows = _fake_rows()
    dev = dict(name="NVIDIA H100 80GB HBM3", type="cuda", peak_tflops=989.4)
    extra = dict(models=["pico"], tests=None, skipped=["max-autotune blocks of pico: 0 of 1 timed"])
    results_net = gc.network_results(rows, {"pico": 10**9}, {"pico": 10**6}, 989.4)
    net = gc.make_record("network", results_net, [], dev, extra)
    blk = gc.make_record("model-blocks", gc.block_results(rows), [], dev, extra)
    assert net["schema"] == bench.SCHEMA and net["command"] == "python scripts/gpu_check.py"
    fused = next(r for r in net["results"] if r["backend"] == "fused-cudagraph")
    assert fused["predicted_ms"]["high"] == 2.0 and fused["img_per_s"] == pytest.approx(128 / 2.5e-3)
    assert {r["backend"] for r in net["results"]} == {"fused-cudagraph", "inductor"}
    assert [(r["block"], r["backend"], r["status"]) for r in blk["results"]] == [
        ("stages.1.1", "fused-cudagraph", "ok"), ("stages.1.1", "inductor", "skipped")]
    p1, p2 = bench.write_record(net, tmp_path), bench.write_record(blk, tmp_path)
    assert p1.name.endswith("_h100_float16_pico_gpu-check.json") and p2.name.endswith("gpu-check-blocks.json")
    table = results.network_markdown(results.load_records(tmp_path))
    assert "pico@256" in table and "2.500" in table


def test_run_orchestration_with_fake_timings(gc, tmp_path, monkeypatch, capsys):
    """``run`` end to end with the GPU parts replaced by made-up timings (nothing is measured): every
    model and distinct block gets a row, the child-process time limits are handed out in order, a
    stopped child is listed as skipped, and both records are written."""
    import argparse

    rep = json.loads((ROOT / "benchmarks" / "static" / "small_b128_sm90.json").read_text())

    class FakeStatic:
        def __init__(self, models, out, cap_s):
            self.reports, self.errors = {"small": rep}, {"pico": "no static report (made up)"}

        def start(self):
            pass

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return False

    limits = []

    def fake_worker(spec, limit):
        limits.append((spec["model"], len(spec["cases"]), round(limit), spec["backend"]))
        rows = [dict(path=c["path"], status="ok", times_ms=dict(median=2.0), ms_per_batch=2.0)
                for c in spec["cases"]]
        if spec["model"] == "pico" and rows[0]["path"] != "model":
            return rows[:1], "stopped at its time limit of 10 s"
        return rows, None

    monkeypatch.setattr(gc, "StaticReports", FakeStatic)
    monkeypatch.setattr(gc, "run_tests", lambda t: dict(status="passed", seconds=1, summary="3 passed"))
    monkeypatch.setattr(gc, "time_case", lambda backend, module, shape, dtype: dict(
        status="ok", times_ms=dict(median=1.0), ms_per_batch=1.0))
    monkeypatch.setattr(gc, "run_worker", fake_worker)
    monkeypatch.setattr(gc, "device_record", lambda: (dict(name="NVIDIA H100 80GB HBM3", type="cuda"), 989.4))
    trained = []
    monkeypatch.setattr(gc, "run_train", lambda model, out, t: trained.append((model, out, t)) or dict(
        status="stopped", seconds=t, summary=f"stopped at {t:.0f} s"))
    monkeypatch.setattr(gc, "run_profile", lambda model, t: dict(
        status="ok", seconds=1, wall_ms=90.0, kernels_ms=87.0, summary="wall 90.0 ms, kernels 87.0 ms"))
    gconv_runs = []
    monkeypatch.setattr(gc, "run_gconv", lambda model, out, t: gconv_runs.append((model, out)) or dict(
        status="ok", seconds=1, summary="[gpu_gconv] record: x.json", lines=[]))
    args = argparse.Namespace(budget_min=20.0, skip_tests=False, skip_train=False, out_dir=str(tmp_path))
    assert gc.run(args, [], ["small", "pico"], ["plan"]) == 0
    out = capsys.readouterr().out
    # first torch.compile of the fused first model, within COMPILED_CAP_S; then the baseline in order: small whole (8 of 14 weights of the time left), small
    # blocks, pico whole, pico blocks; the children here return at once, so what they leave flows on
    compiled, limits = limits[:1], limits[1:]
    assert [(m, n, b) for m, n, _, b in compiled] == [("small", 1, "fused-inductor")]
    assert all(0 < t <= gc.COMPILED_CAP_S for _, _, t, _ in compiled)
    order = [(m, n > 1) for m, n, _, _ in limits]
    assert order == [("small", False), ("small", True), ("pico", False), ("pico", True)]
    assert {b for *_, b in limits} == {"inductor"}
    assert 0 < limits[0][2] <= (20 * 60 - gc.RESERVE_S) * 8 / 14 and limits[-1][2] > limits[0][2]
    assert "| small | model | 1 | " in out and "| small | stages.3.1 ... | 17 |" in out
    assert "- inductor pico blocks: 1 of " in out and "- static report pico: no static report" in out
    assert [(m, o) for m, o, _ in trained] == [("small", str(tmp_path))]
    assert 0 < trained[0][2] <= gc.TRAIN_CAP_S
    assert "- training step small: stopped" in out
    records = sorted(tmp_path.glob("*.json"))
    assert len(records) == 2
    blocks = json.loads(next(p for p in records if "blocks" in p.name).read_text())
    small_rows = [r for r in blocks["results"] if r["model"] == "convfirstnet_small"]
    assert all(r["predicted_ms"] for r in small_rows)  # every distinct block of Small has its prediction
    network = json.loads(next(p for p in records if "blocks" not in p.name).read_text())
    assert {r["backend"] for r in network["results"] if r["model"] == "convfirstnet_small"} == {
        "fused-cudagraph", "inductor", "fused-inductor"}
    assert "small model, fused-inductor: 2.000 ms" in out
    assert blocks["gpu_check"]["tests"]["summary"] == "3 passed"
    # each model again with the stride-1 ConvFirst blocks as the fused kernel, the staged launches
    # restored after
    from convfirstnet.kernels.convfirst import launcher as convfirst_launcher

    assert "small model, ConvFirst fused kernel: " in out and convfirst_launcher.STAGED is None
    assert set(blocks["gpu_check"]["convfirst_fused"]) == {"small", "pico"}
    # and with the MBConv blocks as the hidden kernel, the staged launches restored after
    from convfirstnet.kernels.mbconv import launcher as mbconv_launcher

    assert "small model, MBConv hidden kernel: " in out and mbconv_launcher.STAGED is None
    assert set(blocks["gpu_check"]["mbconv_hidden"]) == {"small", "pico"}
    assert blocks["gpu_check"]["train"]["status"] == "stopped"
    assert blocks["gpu_check"]["train"]["profile"]["kernels_ms"] == 87.0 and "[gpu_check] profile: ok" in out
    # the group-width-8 conv op of the first model, its record beside the others
    assert gconv_runs == [("small", str(tmp_path))] and "[gpu_check] gconv: ok" in out


def test_gpu_gconv_plan_without_cuda(capsys, monkeypatch):
    """scripts/gpu_gconv.py on a machine without CUDA: the shapes it would time (Small's training
    shapes at 256x256, from the launcher's MODEL_SHAPES), exit status 0, no record."""
    gg = load_script("gpu_gconv")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gg.main(["--model", "small"]) == 0
    out = capsys.readouterr().out
    assert "C 32 128x128" in out and "C 1024 8x8" in out and "tap orders 0 and conflict-free" in out
