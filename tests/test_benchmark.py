"""The benchmark tool on CPU: statistics, peak table, JSON records, Markdown tables, README results."""

import json
from pathlib import Path

import pytest
import torch

from convfirstnet.blocks import FusedMBConv
from convfirstnet.commands import bench as benchmark
from convfirstnet.commands import results as bench_report
from convfirstnet.analysis.devices import DEVICES, device_by_key, lookup_device
from convfirstnet.analysis.paper import TABLE1, TABLE2
from convfirstnet.commands._timing import percentile, summarize, throughput


# ------------------------------------------------------------------------------------- statistics
def test_percentile_interpolates_like_numpy():
    xs = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 10) == pytest.approx(1.9)  # 1 + 0.9 * (2 - 1)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(list(reversed(xs)), 0) == 1 and percentile(xs, 100) == 10
    assert percentile([3.0], 37) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize():
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert s == dict(
        median=2.5, p10=pytest.approx(1.3), p90=pytest.approx(3.7), mean=2.5, min=1.0, max=4.0, n=4
    )
    with pytest.raises(ValueError, match="no timed"):
        summarize([])


def test_throughput_arithmetic():
    # 128 images in 10 ms at 1 GMAC/image: 12,800 img/s, 2 * 1e9 * 12,800 = 25.6 TFLOP/s
    t = throughput(batch=128, ms_per_batch=10.0, macs_per_image=10**9, peak_tflops=989.4)
    assert t["img_per_s"] == pytest.approx(12_800)
    assert t["tflops"] == pytest.approx(25.6)
    assert t["pct_peak"] == pytest.approx(100 * 25.6 / 989.4)
    assert throughput(1, 1.0, 10, None)["pct_peak"] is None


# ------------------------------------------------------------------------------------- peak table
@pytest.mark.parametrize(
    "name, key, peak",
    [
        ("NVIDIA H100 80GB HBM3", "h100", 989.4),
        ("NVIDIA H100 PCIe", "h100-pcie", 756.0),
        ("NVIDIA H100 NVL", "h100-nvl", 835.5),
        ("NVIDIA H200", "h200", 989.4),
        ("NVIDIA A100-SXM4-80GB", "a100", 312.0),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312.0),
        ("NVIDIA RTX A5000", "a5000", 76.7),
        ("NVIDIA GeForce RTX 4090", "rtx4090", 165.2),
        ("NVIDIA L40S", "l40s", 362.0),
        ("NVIDIA L4", "l4", 121.0),
    ],
)
def test_peak_lookup(name, key, peak):
    spec = lookup_device(name)
    assert spec is not None and spec.key == key and spec.peak_tflops == peak


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA L40", "Some Future GPU", ""])
def test_peak_lookup_unknown(name):
    assert lookup_device(name) is None


def test_device_table():
    assert device_by_key("h100").bandwidth_tbs == 3.35 and device_by_key("H200").bandwidth_tbs == 4.8
    assert device_by_key("a5000-paper").op_byte == pytest.approx(76.7 / 0.48)
    assert len({d.key for d in DEVICES}) == len(DEVICES)
    with pytest.raises(ValueError, match="unknown device"):
        device_by_key("tpu")


def test_paper_tables_are_consistent():
    for row in TABLE1 + TABLE2:  # speed-up = Inductor / fused, within the rounding of the printed times
        lo = (row.inductor_ms - 0.005) / (row.fused_ms + 0.005)
        hi = (row.inductor_ms + 0.005) / (row.fused_ms - 0.005)
        assert lo - 0.05 <= row.speedup <= hi + 0.05, row
    assert len(TABLE1) == 8 and len(TABLE2) == 10
    assert min(r.speedup for r in TABLE2) == 3.0 and max(r.speedup for r in TABLE2) == 5.4


# ------------------------------------------------------------------------------------ CPU runs
def _only_record(tmp_path):
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1, files
    return files[0], json.loads(files[0].read_text())


def test_cpu_network_run_writes_record(tmp_path, capsys):
    argv = [
        "pico",
        "resnet10t@32",
        "--resolution",
        "32",
        "--batch-sizes",
        "2",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--backends",
        "fused,eager,fused-cudagraph",
        "--device",
        "cpu",
        "--out-dir",
        str(tmp_path),
    ]
    assert benchmark.main(argv) == 0
    path, rec = _only_record(tmp_path)
    assert path.name.endswith("_cpu_float32_pico-resnet10t.json")
    assert rec["mode"] == "network" and rec["schema"] == benchmark.SCHEMA
    assert rec["device"]["type"] == "cpu" and rec["settings"]["dtype"] == "float32"
    assert rec["command"].startswith("convfirstnet bench pico")
    for key in ("python", "torch", "triton", "timm"):
        assert key in rec["software"]
    assert "commit" in rec["git"] and rec["date"].endswith("Z")
    by = {(r["model"], r["backend"], r["batch"]): r for r in rec["results"]}
    assert len(by) == 2 * 3
    ok = by[("convfirstnet_pico", "fused", 2)]
    assert ok["status"] == "ok" and ok["kernels"] == "reference" and ok["times_ms"]["n"] == 2
    assert ok["times_ms"]["p10"] <= ok["times_ms"]["median"] <= ok["times_ms"]["p90"]
    assert ok["img_per_s"] == pytest.approx(2 / (ok["ms_per_batch"] / 1e3))
    assert ok["tflops"] == pytest.approx(2 * ok["macs_per_image"] * ok["img_per_s"] / 1e12)
    assert ok["pct_peak"] is None  # no peak known for a CPU
    assert by[("resnet10t", "eager", 2)]["status"] == "ok"
    assert by[("resnet10t", "fused", 2)]["status"] == "skipped"
    assert "only for ConvFirstNet" in by[("resnet10t", "fused", 2)]["reason"]
    assert "CUDA" in by[("convfirstnet_pico", "fused-cudagraph", 2)]["reason"]
    out = capsys.readouterr().out
    assert "| model | backend | batch | img/s |" in out and "convfirstnet_pico@32 | fused | 2 |" in out
    assert "skipped: CUDA graphs need a CUDA device" in out


def test_cpu_fused_inductor_rows(tmp_path, monkeypatch):
    """fused-inductor compiles the fused model with each MBConv block's compiled_path as made (auto);
    fused-inductor-ops sets every block to its op. Inductor's codegen is swapped for aot_eager (the
    same graphs, run eagerly) to keep the test short."""
    compile_ = torch.compile
    models = []

    def compile_aot(model, **kwargs):
        models.append(model)
        return compile_(model, backend="aot_eager", dynamic=False)

    monkeypatch.setattr(torch, "compile", compile_aot)
    argv = ["pico", "--resolution", "32", "--batch-sizes", "2", "--iters", "1", "--warmup", "0",
            "--backends", "fused-inductor,fused-inductor-ops", "--device", "cpu", "--out-dir", str(tmp_path)]
    assert benchmark.main(argv) == 0
    _, rec = _only_record(tmp_path)
    by = {r["backend"]: r for r in rec["results"]}
    assert all(r["status"] == "ok" for r in rec["results"]), rec["results"]
    assert by["fused-inductor"]["compiled_mbconv"] == ["auto"]
    assert by["fused-inductor-ops"]["compiled_mbconv"] == ["fused"]
    assert by["fused-inductor"]["kernels"] == "reference" and "compile_s" in by["fused-inductor"]
    paths = [{m.compiled_path for m in model.modules() if isinstance(m, FusedMBConv)} for model in models]
    assert paths == [{"auto"}, {"fused"}]


def test_cpu_block_mode_and_peak(tmp_path, capsys):
    argv = [
        "--blocks",
        "mbconv",
        "--block-limit",
        "1",
        "--block-depth",
        "1",
        "--batch-sizes",
        "1",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--backends",
        "fused,eager",
        "--measure-peak",
        "--peak-size",
        "64",
        "--device",
        "cpu",
        "--out-dir",
        str(tmp_path),
        "--tag",
        "ci check",
    ]
    assert benchmark.main(argv) == 0
    path, rec = _only_record(tmp_path)
    assert path.name.endswith("_cpu_float32_blocks-mbconv_ci-check.json")
    assert rec["mode"] == "blocks" and rec["device"]["measured_peak"]["size"] == 64
    assert rec["device"]["peak_source"] == "measured matmul"
    fused = next(r for r in rec["results"] if r["backend"] == "fused")
    assert (fused["block"], fused["channels"], fused["expansion"], fused["size"]) == ("mbconv", 128, 4, 16)
    assert fused["paper"]["inductor_ms"] == 11.46 and fused["pct_peak"] is not None
    # one stride-1 MBConv 128 -> 512 -> 128 at 16x16 with SE 512 -> 32 -> 512
    assert fused["macs_per_image"] == 256 * (128 * 512 * 2 + 512 * 8 * 9) + 2 * 512 * 32
    out = capsys.readouterr().out
    assert (
        "| block | C | t | HxW | batch | fused ms | eager ms |" in out
        and "| 11.46 | 2.48 | 46.2 | 4.6x |" in out
    )


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--backends", "tensorrt"])
    with pytest.raises(SystemExit):
        benchmark.main(["--batch-sizes", "0"])
    capsys.readouterr()
    for argv, message in (
        (["--device", "tpu"], "--device 'tpu': expected auto, cpu, cuda or cuda:N"),
        (["pico@big", "--device", "cpu"], "bad model spec 'pico@big'"),
        (["--iters", "0", "--device", "cpu"], "--iters must be >= 1"),
    ):
        assert benchmark.main(argv) == 1
        out, err = capsys.readouterr()
        assert err.startswith("convfirstnet bench: error: ") and err.count("\n") == 1 and message in err


def test_dtype_note_only_when_asked(tmp_path, capsys):
    """On CPU the default dtype is float32 without a word; an explicit --dtype float16 gets the note."""
    from convfirstnet.commands.bench import resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) == (torch.float32, None)
    assert resolve_dtype("float32", cpu) == (torch.float32, None)
    assert resolve_dtype("float16", cpu) == (torch.float32, "--dtype float16 ignored: CPU runs use float32")
    assert resolve_dtype(None, torch.device("cuda")) == (torch.float16, None)
    argv = [
        "pico",
        "--resolution",
        "32",
        "--batch-sizes",
        "1",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--backends",
        "eager",
        "--device",
        "cpu",
        "--no-save",
    ]
    assert benchmark.main(argv) == 0
    assert "ignored" not in capsys.readouterr().err
    assert benchmark.main(argv + ["--dtype", "float16"]) == 0
    assert "[bench] --dtype float16 ignored: CPU runs use float32" in capsys.readouterr().err


def test_unknown_model_is_an_error_before_any_work(tmp_path, capsys):
    """A name that is neither a ConvFirstNet nor a timm model stops the run before anything is built,
    timed, printed or written."""
    argv = ["pico", "no_such_model_xyz", "--device", "cpu", "--batch-sizes", "1", "--iters", "1"]
    assert benchmark.main(argv + ["--out-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and not list(tmp_path.iterdir())
    assert err == (
        "convfirstnet bench: error: unknown model 'no_such_model_xyz': not a ConvFirstNet size (pico, nano, "
        "tiny, small) nor a timm model (timm.list_models() lists those)\n"
    )


@pytest.fixture
def no_timing(monkeypatch):
    """bench.run with the timing left out: the arguments it would time, and no results."""
    seen = {}

    def run_network(args, device, dtype, peak, measured):
        seen.update(vars(args))
        return []

    monkeypatch.setattr(benchmark, "run_network", run_network)
    return seen


def test_cpu_run_warns_and_takes_cpu_sized_defaults(no_timing, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(benchmark, "default_out_dir", lambda: tmp_path / "checkout-results")
    assert benchmark.main(["--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert (
        "[bench] warning: CPU run: the fused backend times PyTorch's reference ops in float32, not the GPU "
        "kernels; CPU-sized defaults --batch-sizes 1 --warmup 1 --iters 5" in err
    )
    assert (no_timing["batch_sizes"], no_timing["warmup"], no_timing["iters"]) == ([1], 1, 5)
    assert no_timing["backends"] == ["fused", "eager"]
    assert len(list((tmp_path / "checkout-results").glob("*.json"))) == 1  # a source checkout keeps it
    # what the user sets stays set, and only the rest is named as defaulted
    assert benchmark.main(["--device", "cpu", "--iters", "3", "--batch-sizes", "2,4", "--no-save"]) == 0
    assert "CPU-sized defaults --warmup 1\n" in capsys.readouterr().err
    assert (no_timing["batch_sizes"], no_timing["warmup"], no_timing["iters"]) == ([2, 4], 1, 3)


def test_record_outside_a_source_checkout(no_timing, tmp_path, capsys, monkeypatch):
    """Installed from a wheel there is no benchmarks/results: no record unless --out-dir, and the output
    says so; nothing is written into the working directory."""
    monkeypatch.setattr(benchmark, "default_out_dir", lambda: None)
    monkeypatch.chdir(tmp_path)
    assert benchmark.main(["pico", "--device", "cpu"]) == 0
    assert "record not written: no source checkout (benchmarks/results) to keep it in; pass --out-dir DIR" in (
        capsys.readouterr().out
    )
    assert not list(tmp_path.iterdir())
    assert benchmark.main(["pico", "--device", "cpu", "--out-dir", "mine"]) == 0
    (record,) = (tmp_path / "mine").glob("*.json")
    assert f"record: mine/{record.name}" in capsys.readouterr().out


def test_default_record_folder_is_the_checkouts():
    root = Path(__file__).resolve().parent.parent  # the tests run from a source checkout
    assert benchmark.default_out_dir() == root / "benchmarks" / "results"


# -------------------------------------------------------------------------------- README results
def _gpu_record(date, mode, results, name="NVIDIA H100 80GB HBM3"):
    return dict(
        schema=1,
        mode=mode,
        date=date,
        command="convfirstnet bench small",
        git=dict(commit="abc1234", dirty=False),
        device=dict(type="cuda", name=name, peak_tflops=989.4),
        software=dict(torch="2.11", triton="3.6"),
        settings=dict(dtype="float16"),
        results=results,
    )


def _net(backend, ms, batch=128, pct=None):
    return dict(
        model="convfirstnet_small",
        backend=backend,
        batch=batch,
        resolution=256,
        dtype="float16",
        status="ok",
        ms_per_batch=ms,
        img_per_s=batch / ms * 1e3,
        pct_peak=pct,
    )


def test_results_table_from_records(tmp_path):
    (tmp_path / "a.json").write_text(
        json.dumps(
            _gpu_record(
                "2026-01-01T00:00:00Z",
                "network",
                [
                    _net("fused", 20.0, pct=30.0),
                    _net("inductor", 60.0),
                    dict(backend="eager", status="skipped", reason="x"),
                ],
            )
        )
    )
    # a newer record replaces the fused figure, keeps the older inductor one
    (tmp_path / "b.json").write_text(
        json.dumps(_gpu_record("2026-02-01T00:00:00Z", "network", [_net("fused", 16.0, pct=35.0)]))
    )
    blk = dict(
        block="convfirst",
        channels=16,
        expansion=3,
        size=128,
        batch=128,
        dtype="float16",
        status="ok",
        paper=dict(speedup=14.2, fused_pct_peak=35.1),
    )
    (tmp_path / "c.json").write_text(
        json.dumps(
            _gpu_record(
                "2026-02-02T00:00:00Z",
                "blocks",
                [
                    dict(blk, backend="fused", ms_per_batch=0.5, pct_peak=40.0),
                    dict(blk, backend="inductor", ms_per_batch=4.0),
                ],
            )
        )
    )
    (tmp_path / "cpu.json").write_text(
        json.dumps(
            dict(
                _gpu_record("2026-03-01T00:00:00Z", "network", [_net("fused", 999.0)]),
                device=dict(type="cpu", name="x86"),
            )
        )
    )
    (tmp_path / "broken.json").write_text("{")
    records = bench_report.load_records(tmp_path)
    assert [n for n, _ in records] == ["a.json", "b.json", "c.json", "cpu.json"]
    text = bench_report.results_markdown(records)
    # columns only for backends with figures; fused from b.json (newer), inductor from a.json: 60 / 16 ms
    assert (
        "| NVIDIA H100 80GB HBM3 | float16 | small@256 | 128 | 8,000 | 2,133 | 16.00 | 35.0 | 3.8x "
        "| `a.json`, `b.json` |" in text
    )
    assert "| convfirst | 16 | 3 | 128x128 | 128 | 0.500 | 4.000 | 8.0x | 40.0 | 14.2x | 35.1 |" in text
    assert "cpu.json" not in text and "999" not in text
    assert "`c.json`: NVIDIA H100 80GB HBM3 (cuda), 2026-02-02T00:00:00Z" in text

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{bench_report.START}\nold\n{bench_report.END}\n\nafter\n")
    assert bench_report.main(["--records", str(tmp_path), "--write", str(readme)]) == 0
    content = readme.read_text()
    assert (
        "old" not in content and "small@256" in content and content.endswith(f"{bench_report.END}\n\nafter\n")
    )
    readme.write_text("no markers\n")
    assert bench_report.main(["--records", str(tmp_path), "--write", str(readme)]) == 1


def test_results_table_without_gpu_records(tmp_path, capsys):
    assert "No GPU records yet" in bench_report.results_markdown([])
    assert bench_report.main(["--records", str(tmp_path / "missing")]) == 0
    assert "No GPU records yet" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_backends_smoke(tmp_path, monkeypatch):
    # the fused rows must time the Triton kernels, whatever CONVFIRSTNET_KERNELS says outside the test
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")
    # the benchmark turns cuDNN autotuning on for the process; restore it for the tests that follow
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    argv = [
        "pico",
        "--batch-sizes",
        "8",
        "--iters",
        "5",
        "--warmup",
        "2",
        "--backends",
        "fused,fused-cudagraph,eager",
        "--out-dir",
        str(tmp_path),
    ]
    assert benchmark.main(argv) == 0
    _, rec = _only_record(tmp_path)
    assert rec["device"]["type"] == "cuda" and rec["settings"]["dtype"] == "float16"
    by = {r["backend"]: r for r in rec["results"]}
    assert set(by) == {"fused", "fused-cudagraph", "eager"}
    assert all(r["status"] == "ok" for r in rec["results"]), rec["results"]
    assert by["fused"]["kernels"] == "triton" and by["fused-cudagraph"]["kernels"] == "triton"
    assert "capture_s" in by["fused-cudagraph"]
    for r in rec["results"]:  # five timed iterations each, and the throughput is the batch over their median
        assert r["times_ms"]["n"] == 5 and 0 < r["times_ms"]["p10"] <= r["times_ms"]["median"] <= r["times_ms"]["p90"]
        assert r["img_per_s"] == pytest.approx(8 / (r["ms_per_batch"] / 1e3))
        assert r["peak_mem_mb"] > 0


def test_cpu_train_cudagraph_backends_are_skipped_with_the_reason(tmp_path):
    """The CUDA-graph training backends on CPU: skipped, saying why, and the run goes on."""
    argv = ["pico", "--train", "--resolution", "32", "--batch-sizes", "2", "--iters", "1", "--warmup", "0",
            "--device", "cpu", "--train-backends", "fused-cudagraph,eager-cudagraph,eager",
            "--out-dir", str(tmp_path)]
    assert benchmark.main(argv) == 0
    _, rec = _only_record(tmp_path)
    by = {r["backend"]: r for r in rec["results"]}
    assert by["eager"]["status"] == "ok"
    for name in ("fused-cudagraph", "eager-cudagraph"):
        assert by[name]["status"] == "skipped" and "CUDA graphs need a CUDA device" in by[name]["reason"]


def test_cpu_train_run_writes_record(tmp_path, capsys):
    """--train: one training step per iteration, fused and eager side by side, a record of mode train; on
    CPU the fused training ops are not selected and the record says so."""
    argv = ["pico", "--train", "--resolution", "32", "--batch-sizes", "2", "--iters", "1", "--warmup", "0",
            "--device", "cpu", "--out-dir", str(tmp_path)]
    assert benchmark.main(argv) == 0
    path, rec = _only_record(tmp_path)
    assert path.name.endswith("_cpu_float32_train-pico.json") and rec["mode"] == "train"
    by = {r["backend"]: r for r in rec["results"]}
    assert set(by) == {"fused", "eager"} and all(r["status"] == "ok" for r in by.values())
    assert by["fused"]["kernels"].startswith("layer-wise")
    eager = by["eager"]
    assert eager["tflops"] == pytest.approx(2 * 3 * eager["macs_per_image"] * eager["img_per_s"] / 1e12)
    assert "| convfirstnet_pico@32 | fused | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark.build_parser().parse_args(["--train", "--train-backends", "fused,bogus"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_train_backends_smoke(tmp_path, monkeypatch):
    """--train on a GPU: the fused training ops take their Triton kernels; img/s and peak memory per backend."""
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    argv = ["pico", "--train", "--batch-sizes", "8", "--iters", "3", "--warmup", "1", "--train-backends",
            "fused,eager,fused-cudagraph,eager-cudagraph", "--out-dir", str(tmp_path)]
    assert benchmark.main(argv) == 0
    _, rec = _only_record(tmp_path)
    by = {r["backend"]: r for r in rec["results"]}
    assert all(r["status"] == "ok" for r in by.values()), rec["results"]
    assert by["fused"]["kernels"] == "triton" and all(r["peak_mem_mb"] > 0 for r in by.values())
    assert by["fused-cudagraph"]["kernels"] == "triton"  # the whole fused step captured and replayed


def test_documented_results_match_committed_records():
    """The results block of docs/bench.md is exactly what the generator makes of benchmarks/results/."""
    root = Path(__file__).resolve().parent.parent
    text = bench_report.results_markdown(bench_report.load_records(root / "benchmarks" / "results"))
    readme = (root / "docs" / "bench.md").read_text()
    block = readme.split(bench_report.START, 1)[1].split(bench_report.END, 1)[0]
    assert text.strip() in block
