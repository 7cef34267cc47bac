"""One command for a session with a GPU: ``python scripts/gpu_check.py`` (about 9 minutes by default).

Fits a GPU job limited to 10 minutes: the default budget is 9 minutes
(``--budget-min`` changes it). In one run, in this order:

1. the GPU tests (``pytest -m gpu``, on parallel workers when pytest-xdist is installed: the kernels'
   compiles dominate), while the static cost report (``convfirstnet kernels``, the same code, sm_90,
   batch 128, 256x256, fp16) is computed for each size in a second process;
2. each fused model (CUDA graph) and each of its distinct fused blocks (CUDA graph, the block alone on
   an input of its shape), Small first, then Tiny, Nano, Pico; then each model again with its MBConv
   blocks as the hidden kernel (``kernels/mbconv/launcher.py`` ``STAGED = False``: the one-kernel form the
   staged launches replaced on the static model's ranking, which no GPU has timed yet), with its
   stride-1 ConvFirst blocks as the fused kernel (``kernels/convfirst/launcher.py`` ``STAGED = False``:
   the form the conv + FFN launches replaced, likewise untimed), and with the L1 / shared split of every
   kernel as Triton's loader leaves it
   (``kernels/_carveout.py`` policy ``triton``; the default fits it to the programs);
   then ``torch.compile`` of the first fused model (``fused-inductor``: every block's fused op, as users
   get it);
3. a training step of the first model (``convfirstnet bench --train``: the fused training ops against
   the layer-wise training form, fp16 autocast, batch 128, each also with the whole step in a CUDA
   graph), which writes its own record, then a
   profile of the fused step (``scripts/gpu_profile.py``): its wall time against the sum of its
   kernels' device time, the difference being host time;
4. each model under ``torch.compile`` of its BatchNorm-folded form (``--inductor``: the default mode,
   or ``inductor-max-autotune`` with Triton templates and CUDA graphs when the budget allows minutes of
   autotuning), in a child process with a time limit, then its distinct blocks the same way while
   budget remains;
5. prints predicted (low/high, the static report's CUDA-graph figures for the same shapes) against
   measured, per block and per model, and writes two JSON records under ``benchmarks/results/`` with
   ``convfirstnet bench``'s record machinery: the whole models (mode ``network``, which
   ``scripts/results_table.py`` reads) and the blocks (mode ``model-blocks``).

What does not fit in the budget is skipped and listed as skipped in the output and the records: the
max-autotune compiles are the risk (minutes per model), so each one runs in a child process that is
stopped at its share of what is left. Without a GPU the script prints what it would run and exits 0.

Runs from a source checkout without installing it: the top-level ``kernels/`` folder ships as
``convfirstnet.kernels`` (pyproject.toml's package-dir), so when ``convfirstnet`` is not installed
from this checkout the script lays the package out that way in a temporary folder (links to this
checkout, per pyproject.toml's mapping) and runs itself, its tests and its compile workers from there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("small", "tiny", "nano", "pico")  # the size the targets are set for first
BATCH, IMG, DTYPE = 128, 256, "float16"
BUDGET_MIN = 9.0  # fits a 10-minute GPU job
TESTS_CAP_S = 240  # the GPU tests (they compile their kernels; 127 s on an H200 with 14 workers)
TRAIN_CAP_S = 150  # the training step, fused and layer-wise (compiles, then 5 + 20 steps each)
# the training step as it runs, and with the whole step in a CUDA graph (the host's time taken out)
TRAIN_BACKENDS = "fused,eager,fused-cudagraph,eager-cudagraph"
GCONV_CAP_S = 75  # the group-width-8 conv op, both tap orders and cuDNN (scripts/gpu_gconv.py)
PROFILE_CAP_S = 90  # the fused training step's kernels against its wall time (scripts/gpu_profile.py)
STATIC_CAP_S = 600  # the four static reports, beside the tests (a second process, CPU only)
FUSED_CAP_S = 300  # every fused model and distinct block (Triton compiles its variants on first use)
# torch.compile of the fused first model: with FusedMBConv's rule (its large-map MBConv blocks compile
# their layers) and with every block's op; one child process each
COMPILED_BACKENDS = ("fused-inductor",)  # -ops is the same model now that auto keeps the MBConv op
COMPILED_CAP_S = 240
RESERVE_S = 30  # kept back for the tables and the records at the end
WARMUP, ITERS = 10, 50  # as convfirstnet bench on a GPU
VIEW_ENV = "CONVFIRSTNET_SOURCE_VIEW"
INDUCTOR = ["inductor"]  # the compiled baseline's bench backend (--inductor)


def _label() -> str:
    """The baseline's short name in tables and messages: max-autotune, or inductor (default mode)."""
    return INDUCTOR[0].removeprefix("inductor-")


# ------------------------------------------------------------------------------------ import path
def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """pyproject.toml's ``[tool.setuptools.package-dir]``: package name -> folder in the checkout."""
    import tomllib

    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def source_view(root: Path, dest: Path) -> Path:
    """Lay the checkout out as the installed package under ``dest`` (links, nothing copied): the root
    package's folder entry by entry, and each mapped subpackage (``convfirstnet.kernels`` ->
    ``kernels/``) at its place inside it. Returns ``dest`` (put it first on the module search path)."""
    dirs = package_dirs(root)
    top = [name for name in dirs if "." not in name]
    for name in top:
        pkg = dest / name
        pkg.mkdir(parents=True, exist_ok=True)
        mapped = {sub.split(".", 1)[1].split(".")[0] for sub in dirs if sub.startswith(name + ".")}
        for entry in (root / dirs[name]).iterdir():
            if entry.name not in mapped and entry.name != "__pycache__":
                (pkg / entry.name).symlink_to(entry)
        for sub, folder in dirs.items():
            if sub.startswith(name + ".") and sub.count(".") == 1:
                (pkg / sub.split(".", 1)[1]).symlink_to(root / folder, target_is_directory=True)
    return dest


def _importable_here() -> bool:
    """True when ``convfirstnet`` (with its kernels) imports from this checkout."""
    try:
        import convfirstnet
        import convfirstnet.kernels  # noqa: F401
    except ImportError:
        return False
    here = Path(convfirstnet.__file__).resolve()
    return here.is_relative_to(ROOT.resolve())


def ensure_importable() -> None:
    """Re-run this script on the package laid out from this checkout when it is not installed from it.
    PYTHONSAFEPATH keeps the raw checkout (whose convfirstnet/ lacks kernels/) off the front of the
    search path of this process and every child (pytest, compile workers)."""
    if _importable_here():
        return
    if os.environ.get(VIEW_ENV):
        raise SystemExit(f"gpu_check: convfirstnet does not import from {os.environ[VIEW_ENV]}")
    view = source_view(ROOT, Path(tempfile.mkdtemp(prefix="convfirstnet-src-")))
    env = dict(os.environ, PYTHONSAFEPATH="1", **{VIEW_ENV: str(view)})
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(view)] + rest)
    print(f"[gpu_check] convfirstnet is not installed from {ROOT}: running from {view}", file=sys.stderr)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


# ------------------------------------------------------------------------------------------- plan
@dataclass
class Budget:
    """A wall-clock deadline shared by the steps; each step asks for a share of what is left."""

    total_s: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start) - RESERVE_S

    def share(self, cap: float, parts: int = 1) -> float:
        """Seconds for the next of ``parts`` steps: at most ``cap``, at most an even share of what is left."""
        return max(0.0, min(cap, self.left() / max(1, parts)))


def plan_lines(models: Sequence[str], budget_min: float, tests: bool, train: bool = True) -> list[str]:
    """What the run does, in order, with the time each step may take."""
    lines = [f"budget: {budget_min:g} min on one GPU ({RESERVE_S} s kept for the tables and records)"]
    if tests:
        workers = " ".join(parallel_args())
        lines.append(f"1. GPU tests: {sys.executable} -m pytest -m gpu -q tests {workers} "
                     f"(at most {TESTS_CAP_S} s)")
    lines.append(
        f"   beside them, on the CPU: convfirstnet kernels --model M --arch sm_90 --batch {BATCH} "
        f"--img-size {IMG} --dtype {DTYPE} for M in {', '.join(models)} (at most {STATIC_CAP_S} s in all)"
    )
    lines.append(
        f"2. per model ({', '.join(models)}), batch {BATCH}, {IMG}x{IMG}, {DTYPE}: the fused model and each "
        f"distinct fused block in a CUDA graph, {WARMUP} warm-up and {ITERS} timed iterations (CUDA events); "
        "then each model with its MBConv blocks as the hidden kernel (kernels/mbconv/launcher.py STAGED "
        "False), with its stride-1 ConvFirst blocks as the fused kernel (kernels/convfirst/launcher.py STAGED "
        "False), and with every kernel's L1 / shared split as Triton "
        "leaves it (kernels/_carveout.py)"
    )
    jobs = autotune_jobs(models)
    total = sum(w for _, _, w in jobs)
    order = ", ".join(f"{m} {what} ({w}/{total})" for m, what, w in jobs)
    lines.append(f"   (at most {FUSED_CAP_S} s; what does not fit is skipped); then torch.compile of the "
                 f"fused {models[0]}: {' and '.join(COMPILED_BACKENDS)} (convfirstnet bench backends; "
                 f"at most {COMPILED_CAP_S} s for both, each in a child process)")
    if train:
        lines.append(f"3. a training step of {models[0]}: convfirstnet bench --train {models[0]} "
                     f"--batch-sizes {BATCH} --train-backends {TRAIN_BACKENDS} (at most {TRAIN_CAP_S} s; "
                     "its own record), then scripts/gpu_profile.py --cases train-fused: the step's wall time "
                     f"against its kernels' (at most {PROFILE_CAP_S} s), then scripts/gpu_gconv.py: the "
                     "group-width-8 conv op at its training shapes, tap orders 0 and conflict-free, against "
                     f"cuDNN (at most {GCONV_CAP_S} s; its own record)")
    mode = "mode='max-autotune'" if INDUCTOR[0] == "inductor-max-autotune" else "the default mode"
    lines.append(
        f"4. torch.compile(fold_batchnorm(...)) in {mode} of each model and of its distinct blocks, "
        "each group in a child process stopped at its share of the time left (a compile that does not finish "
        f"is reported as skipped), in this order with these shares: {order}"
    )
    lines.append("5. predicted (static report, low/high) against measured per block and model; JSON records "
                 "(modes network and model-blocks) under benchmarks/results/")
    return lines


def autotune_jobs(models: Sequence[str]) -> list[tuple[str, str, int]]:
    """The max-autotune child processes in order of importance, each with its weight in the split of the
    time that is left: the first model (the targets' size) whole and its blocks, then the other models
    whole, then their blocks (the blocks reuse the autotuning of their model's layers, cached on disk)."""
    first, rest = models[0], list(models[1:])
    return ([(first, "model", 8), (first, "blocks", 3)] + [(m, "model", 2) for m in rest]
            + [(m, "blocks", 1) for m in rest])


# ------------------------------------------------------------------------------------------ blocks
def block_inputs(model, batch: int, img: int) -> dict[str, tuple[int, ...]]:
    """Input shape of every fused block of ``model`` (paths as in the static report: ``stem``,
    ``stages.i.j``, ``head``), from a forward pass on meta tensors."""
    import torch

    from convfirstnet.blocks import Head, Stem

    wanted = {path: m for path, m in model.named_modules()
              if isinstance(m, (Stem, Head)) or (path.count(".") == 2 and path.startswith("stages."))}
    shapes: dict[str, tuple[int, ...]] = {}

    def hook(path):
        def record(module, args):
            shapes.setdefault(path, tuple(args[0].shape))  # returns None: the inputs stay as they are

        return record

    hooks = [m.register_forward_pre_hook(hook(path)) for path, m in wanted.items()]
    try:
        with torch.no_grad():
            model.to("meta")(torch.empty(batch, 3, img, img, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return shapes


def distinct_blocks(model, batch: int, img: int) -> list[dict]:
    """Blocks grouped by configuration (class, input shape, layers): each group is timed once. Keys:
    ``paths`` (every block of the group, in order), ``shape`` and ``kind``."""
    shapes = block_inputs(model, batch, img)
    groups: dict[tuple, dict] = {}
    for path, shape in shapes.items():
        m = model.get_submodule(path)
        key = (type(m).__name__, shape, repr(m))
        groups.setdefault(key, dict(paths=[], shape=list(shape), kind=type(m).__name__))["paths"].append(path)
    return list(groups.values())


def time_case(backend: str, module, shape: Sequence[int], dtype) -> dict:
    """One timed case through ``convfirstnet bench``'s ``run_case`` (preparation, CUDA-graph capture or
    compile, warm-up, CUDA-event timing, statistics)."""
    import torch

    from convfirstnet.commands.bench import run_case

    x = torch.randn(*shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    row = run_case(backend, module, True, x, WARMUP, ITERS)
    if row.get("status") == "ok":
        row["ms_per_batch"] = row["times_ms"]["median"]
    return row


def _as_block(model, path: str):
    import torch.nn as nn

    return nn.Sequential(model.get_submodule(path))  # fuse() and fold_batchnorm() rewrite children


@contextlib.contextmanager
def overridden(values: dict):
    """Module constants of the kernels set to ``values`` for the duration, restored after: a key
    "module.NAME" names kernels/<module>.py's NAME, a bare "NAME" kernels/mbconv/launcher.py's (the
    variants of scripts/gpu_variants.py)."""

    def target(key: str):
        module, _, name = key.rpartition(".")
        mod = importlib.import_module(f"convfirstnet.kernels.{module or 'mbconv.launcher'}")
        if not hasattr(mod, name):
            raise AttributeError(f"{mod.__name__} has no constant {name}")
        return mod, name

    targets = {k: target(k) for k in values}
    saved = {k: getattr(*t) for k, t in targets.items()}
    for k, v in values.items():
        setattr(*targets[k], v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(*targets[k], v)


# Each whole model timed again with one setting changed back to the form the shipped one replaced on the
# static model's ranking, which no GPU has timed yet: record key -> (label, overrides)
RETIMES = {
    # the MBConv blocks as the hidden kernel instead of the staged launches
    "mbconv_hidden": ("MBConv hidden kernel", {"mbconv.launcher.STAGED": False}),
    # the stride-1 ConvFirst blocks as the fused kernel instead of the conv + FFN launches
    "convfirst_fused": ("ConvFirst fused kernel", {"convfirst.launcher.STAGED": False}),
    # every kernel's L1 / shared split as Triton's loader leaves it (28 KB of L1 to any kernel over 48 KB of
    # shared memory) instead of the smallest carve-out that holds its programs (kernels/_carveout.py)
    "l1_carveout_triton": ("Triton's L1 carve-out", {"_carveout.POLICY": "triton"}),
}


def time_models_with(model_rows: list[dict], until: float, dtype, key: str) -> dict:
    """Each whole model in a CUDA graph again with ``RETIMES[key]``'s setting (restored after): {model:
    row}, a model past ``until`` skipped."""
    import torch

    from convfirstnet.factory import create_model

    label, values = RETIMES[key]
    out = {}
    with overridden(values):
        for r in model_rows:
            if time.monotonic() > until:
                out[r["model"]] = dict(status="skipped", reason="budget")
                continue
            out[r["model"]] = time_case("fused-cudagraph", create_model(r["model"]), r["shape"], dtype)
            print(f"  {r['model']} model, {label}: {_ms(out[r['model']])} ms", flush=True)
            torch.cuda.empty_cache()
    return out


# -------------------------------------------------------------------------------- child processes
def worker_main(spec: dict) -> None:
    """Child process: time ``spec["backend"]`` on the whole model and/or its distinct blocks, one JSON
    line per case on stdout as each finishes (the parent keeps what came before a time limit)."""
    import torch

    from convfirstnet.factory import create_model

    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, spec["dtype"])
    model = create_model(spec["model"])
    for case in spec["cases"]:
        module = model if case["path"] == "model" else _as_block(model, case["path"])
        t0 = time.perf_counter()
        row = time_case(spec["backend"], module, case["shape"], dtype)
        row.update(path=case["path"], wall_s=round(time.perf_counter() - t0, 1))
        print(json.dumps(row), flush=True)


def run_worker(spec: dict, timeout_s: float) -> tuple[list[dict], str | None]:
    """Run ``worker_main(spec)`` in a child process for at most ``timeout_s``: the rows it finished and,
    if it was stopped or failed, why."""
    if timeout_s < 20:
        return [], f"no budget left ({timeout_s:.0f} s)"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        out, err, why = proc.stdout, proc.stderr, None if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        why = f"stopped at its time limit of {timeout_s:.0f} s"
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if why and err.strip():
        why += ": " + err.strip().splitlines()[-1][:200]
    return rows, why


class StaticReports(threading.Thread):
    """The static reports of every model, one ``convfirstnet kernels`` process after another, beside the
    GPU work (CPU only); ``reports[model]`` is the report dict, ``errors[model]`` why there is none."""

    def __init__(self, models: Sequence[str], out: Path, cap_s: float):
        super().__init__(daemon=True)
        self.models, self.out, self.deadline = list(models), out, time.monotonic() + cap_s
        self.reports: dict[str, dict] = {}
        self.errors: dict[str, str] = {}

    def run(self) -> None:
        jobs = str(max(1, min(6, (os.cpu_count() or 2) // 2)))
        for m in self.models:
            left = self.deadline - time.monotonic()
            if left < 10:
                self.errors[m] = "no time left for its static report"
                continue
            path = self.out / f"static_{m}.json"
            cmd = [sys.executable, "-m", "convfirstnet", "kernels", "--model", m, "--arch", "sm_90",
                   "--batch", str(BATCH), "--img-size", str(IMG), "--dtype", DTYPE, "--jobs", jobs, "--quiet",
                   "--json", str(path)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, cwd=ROOT)
            except subprocess.TimeoutExpired:
                self.errors[m] = f"static report stopped after {left:.0f} s"
                continue
            if proc.returncode != 0:
                self.errors[m] = (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]
            else:
                self.reports[m] = json.loads(path.read_text())


def run_child(cmd: Sequence[str], timeout_s: float) -> tuple[subprocess.CompletedProcess | None, dict]:
    """``cmd`` in the checkout with a time limit: (the finished process, or None when the limit stopped
    it; the seconds it took, and for a stopped one its status, summary and the tail of its output)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "").strip().splitlines()
        return None, dict(status="stopped", seconds=round(time.monotonic() - t0),
                          summary=f"stopped at {timeout_s:.0f} s", tail=tail[-20:])
    return proc, dict(seconds=round(time.monotonic() - t0))


def run_tests(timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short",
           "--import-mode=append", "tests", *parallel_args()]
    proc, info = run_child(cmd, timeout_s)
    if proc is None:
        return info
    lines = proc.stdout.strip().splitlines()
    return dict(info, status="passed" if proc.returncode == 0 else "failed", returncode=proc.returncode,
                summary=lines[-1] if lines else "", tail=lines[-30:],
                failures=[ln for ln in lines if ln.startswith(("FAILED", "ERROR"))],
                errors=[ln for ln in lines if ln.startswith("E ")][:200])


def parallel_args() -> list[str]:
    """pytest-xdist workers when it is installed (each compiles its tests' kernels: the tests' time is
    mostly compiling), and no pytest-benchmark (it refuses to time under xdist, with a warning per worker)."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return []
    args = ["-n", str(max(1, min(14, (os.cpu_count() or 2) - 2)))]
    return args + (["-p", "no:benchmark"] if importlib.util.find_spec("pytest_benchmark") else [])


def run_train(model: str, out_dir: str, timeout_s: float) -> dict:
    """``convfirstnet bench --train`` of ``model`` (fused and layer-wise) in a child process; it writes its
    own record into ``out_dir``. Returns the status and the lines it printed."""
    cmd = [sys.executable, "-m", "convfirstnet", "bench", "--train", model, "--batch-sizes", str(BATCH),
           "--resolution", str(IMG), "--dtype", DTYPE, "--train-backends", TRAIN_BACKENDS, "--warmup", "5",
           "--iters", "20", "--out-dir", out_dir, "--tag", "gpu-check-train"]
    proc, info = run_child(cmd, timeout_s)
    info["command"] = " ".join(cmd[1:])
    if proc is None:
        return info
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    timed = [ln for ln in lines if ln.startswith("[bench] train")]
    return dict(info, status="ok" if proc.returncode == 0 else "failed",
                summary="; ".join(timed) or (lines[-1] if lines else ""), tail=lines[-10:])


def run_gconv(model: str, out_dir: str, timeout_s: float) -> dict:
    """``scripts/gpu_gconv.py`` in a child process (it writes its own record into ``out_dir``): the
    group-width-8 conv op's forward and fused backward at ``model``'s training shapes, tap order 0 and the
    conflict-free order, against cuDNN. Returns the status and the lines it printed."""
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_gconv.py"), "--model", model, "--batch", str(BATCH),
           "--img-size", str(IMG), "--out-dir", out_dir]
    proc, info = run_child(cmd, timeout_s)
    if proc is None:
        return info
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return dict(info, status="ok" if proc.returncode == 0 else "failed",
                summary=lines[-1] if lines else "", lines=[ln for ln in lines if ln.startswith("  C ")])


def run_profile(model: str, timeout_s: float) -> dict:
    """``scripts/gpu_profile.py`` of the fused training step in a child process: its wall time per step
    against the sum of its kernels' device time (the difference is host time) and the top kernels."""
    out = Path(tempfile.mkdtemp(prefix="gpu-check-profile-"))
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_profile.py"), "--model", model, "--batch", str(BATCH),
           "--img-size", str(IMG), "--cases", "train-fused", "--steps", "3", "--out", str(out)]
    proc, info = run_child(cmd, timeout_s)
    if proc is None:
        return info
    found = sorted(out.glob("profile_*.json"))
    if proc.returncode != 0 or not found:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        return dict(info, status="failed", summary=lines[-1] if lines else "")
    r = json.loads(found[0].read_text())
    return dict(info, status="ok", wall_ms=r["wall_ms"],
                kernels_ms=r["device_ms"], top=r["kernels"][:12], host=r.get("host"),
                summary=f"fused training step: wall {r['wall_ms']:.1f} ms, "
                f"kernels {r['device_ms']:.1f} ms per step")


# ------------------------------------------------------------------------------------------ tables
def predicted_of(report: dict | None, path: str) -> dict | None:
    """The static report's CUDA-graph prediction (low/high ms) and layer-wise bound of one block, or of
    the whole model for ``path == "model"``."""
    if not report:
        return None
    if path == "model":
        return dict(low=report["predicted_low_ms"], high=report["predicted_high_ms"],
                    layerwise_low=report.get("layerwise_low_ms"),
                    layerwise_high=report.get("layerwise_high_ms"))
    for b in report.get("blocks", []):
        if b["path"] == path:
            return dict(low=b["predicted_ms"]["low"], high=b["predicted_ms"]["high"],
                        layerwise_low=b["layerwise_ms"]["low"], layerwise_high=b["layerwise_ms"]["high"])
    return None


def _ms(row: dict | None) -> str:
    if not row:
        return "-"
    if row.get("status") != "ok":
        return "skipped"
    v = row["ms_per_batch"]
    return f"{v:.3f}" if v < 10 else f"{v:.2f}"


def comparison_table(rows: Sequence[dict]) -> str:
    """Markdown: one line per model or distinct block. Each row: model, path(s), count, predicted
    {low, high} or None, fused and inductor results (``status``, ``ms_per_batch``)."""
    head = ("| model | block | count | predicted ms (low-high) | fused ms (CUDA graph) "
            f"| measured / predicted high | {_label()} ms | fused speed-up |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pred, fused, ind = r.get("predicted"), r.get("fused"), r.get("inductor")
        ok = fused and fused.get("status") == "ok"
        ratio = f"{fused['ms_per_batch'] / pred['high']:.2f}" if ok and pred else "-"
        speed = (f"{ind['ms_per_batch'] / fused['ms_per_batch']:.2f}x"
                 if ok and ind and ind.get("status") == "ok" else "-")
        pred_text = f"{pred['low']:.3f}-{pred['high']:.3f}" if pred else "-"
        where = r["path"] if len(r.get("paths", [r["path"]])) == 1 else f"{r['path']} ..."
        lines.append(f"| {r['model']} | {where} | {r.get('count', 1)} | {pred_text} | {_ms(fused)} | {ratio} "
                     f"| {_ms(ind)} | {speed} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- records
def _backends(row: dict) -> list[tuple[str, dict]]:
    """(record backend name, result) of a table row's timed cases."""
    pairs = (("fused-cudagraph", row.get("fused")), (INDUCTOR[0], row.get("inductor")),
             *((b, row.get(b)) for b in COMPILED_BACKENDS))
    return [(b, res) for b, res in pairs if res is not None]


def network_results(rows: Sequence[dict], macs: dict[str, int], params: dict[str, int], peak) -> list[dict]:
    """The whole-model rows as ``convfirstnet bench`` network results (fused-cudagraph and
    inductor-max-autotune), the fused ones with the static prediction beside."""
    from convfirstnet.commands.bench import _figures

    out = []
    for r in rows:
        if r["path"] != "model":
            continue
        key = f"convfirstnet_{r['model']}"
        for backend, res in _backends(r):
            row = dict(model=key, backend=backend, batch=BATCH, resolution=IMG, dtype=DTYPE,
                       macs_per_image=macs[r["model"]], params=params[r["model"]])
            row.update({k: v for k, v in res.items() if k not in ("path", "ms_per_batch")})
            _figures(row, BATCH, macs[r["model"]], peak, None)
            if backend == "fused-cudagraph" and r.get("predicted"):
                row["predicted_ms"] = r["predicted"]
            out.append(row)
    return out


def block_results(rows: Sequence[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["path"] == "model":
            continue
        for backend, res in _backends(r):
            row = dict(model=f"convfirstnet_{r['model']}", block=r["path"], paths=r["paths"], kind=r["kind"],
                       input_shape=r["shape"], backend=backend, batch=BATCH, dtype=DTYPE,
                       predicted_ms=r.get("predicted"))
            row.update({k: v for k, v in res.items() if k != "path"})
            out.append(row)
    return out


def make_record(mode: str, results: list[dict], argv: Sequence[str], dev: dict, extra: dict) -> dict:
    """A record in ``convfirstnet bench``'s format (schema, provenance, settings, results)."""
    import datetime

    from convfirstnet.analysis.provenance import command_line, git_info, software_info
    from convfirstnet.commands.bench import SCHEMA

    return dict(
        schema=SCHEMA, mode=mode,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=command_line("python scripts/gpu_check.py", argv),
        tag="gpu-check" if mode == "network" else "gpu-check-blocks",
        git=git_info(), device=dev, software=software_info(),
        settings=dict(models=[f"convfirstnet_{m}" for m in extra["models"]], blocks=None,
                      backends=["fused-cudagraph", INDUCTOR[0], *COMPILED_BACKENDS], batch_sizes=[BATCH],
                      resolution=IMG, dtype=DTYPE, warmup=WARMUP, iters=ITERS, channels_last=True,
                      cudnn_benchmark=True, timer="cuda-events"),
        gpu_check=extra, results=results,
    )


# -------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list (default small,tiny,nano,pico)")
    p.add_argument("--budget-min", type=float, default=BUDGET_MIN, help="wall-clock budget (default 9)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the GPU tests")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"), help="where the records go")
    p.add_argument("--inductor", default=INDUCTOR[0], choices=("inductor-max-autotune", "inductor"),
                   help="the torch.compile baseline: its default mode (default), or max-autotune with CUDA "
                   "graphs (minutes of autotuning per model: give it a budget of 20 minutes or more)")
    p.add_argument("--skip-train", action="store_true", help="do not time the training step")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return p


def parse_models(text: str) -> list[str]:
    from convfirstnet.registry import canonical_name

    names = [canonical_name(m.strip()).removeprefix("convfirstnet_") for m in text.split(",") if m.strip()]
    if not names:
        raise ValueError("--models: no model given")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    INDUCTOR[0] = args.inductor
    if args._worker:
        worker_main(json.loads(args._worker))
        return 0
    try:
        models = parse_models(args.models)
    except ValueError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 1
    import torch

    lines = plan_lines(models, args.budget_min, not args.skip_tests, not args.skip_train)
    if args.dry_run or not torch.cuda.is_available():
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here: nothing is run. On a machine with a GPU this would run:")
        print("\n".join(lines))
        return 0
    return run(args, argv, models, lines)


def device_record() -> tuple[dict, float | None]:
    """The record's device entry (as ``convfirstnet bench`` writes it) and its dense fp16 peak."""
    import torch

    from convfirstnet.analysis.devices import lookup_device
    from convfirstnet.analysis.provenance import device_info

    dev = device_info(torch.device("cuda", torch.cuda.current_device()))
    spec = lookup_device(dev["name"])
    peak = spec.peak_tflops if spec else None
    dev.update(peak_tflops=peak, peak_source=f"table: {spec.name}" if spec else None,
               table_key=spec.key if spec else None)
    return dev, peak


def run(args, argv, models: list[str], plan: list[str]) -> int:
    import torch

    from convfirstnet.commands.bench import write_record
    from convfirstnet.factory import create_model
    from convfirstnet.profile import count_macs, count_params

    budget = Budget(args.budget_min * 60)
    print("\n".join(plan), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    static = StaticReports(models, tmp, min(STATIC_CAP_S, budget.left()))
    static.start()
    skipped: list[str] = []
    tests = None
    if not args.skip_tests:
        print("\n[gpu_check] GPU tests ...", flush=True)
        tests = run_tests(budget.share(TESTS_CAP_S))
        print(f"[gpu_check] tests: {tests['status']} in {tests['seconds']} s: {tests['summary']}", flush=True)

    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, DTYPE)
    rows: list[dict] = []
    macs, params = {}, {}
    for m in models:
        train = create_model(m)
        macs[m], params[m] = count_macs(train, (3, IMG, IMG)), count_params(train)
        groups = distinct_blocks(create_model(m), BATCH, IMG)
        rows.append(dict(model=m, path="model", paths=["model"], count=1, kind="model",
                         shape=[BATCH, 3, IMG, IMG]))
        rows += [dict(model=m, path=g["paths"][0], paths=g["paths"], count=len(g["paths"]), kind=g["kind"],
                      shape=g["shape"]) for g in groups]
    print("\n[gpu_check] fused models and blocks (CUDA graphs) ...", flush=True)
    fused_until = time.monotonic() + budget.share(FUSED_CAP_S)
    for r in rows:
        if time.monotonic() > fused_until:
            r["fused"] = dict(status="skipped", reason="budget")
            skipped.append(f"fused {r['model']} {r['path']}: budget")
            continue
        train = create_model(r["model"])
        module = train if r["path"] == "model" else _as_block(train, r["path"])
        r["fused"] = time_case("fused-cudagraph", module, r["shape"], dtype)
        print(f"  {r['model']} {r['path']}: {_ms(r['fused'])} ms", flush=True)
        del module, train
        torch.cuda.empty_cache()
    model_rows = [r for r in rows if r["path"] == "model"]
    retimed = {key: time_models_with(model_rows, fused_until, dtype, key) for key in RETIMES}
    first = next(r for r in rows if r["model"] == models[0] and r["path"] == "model")
    print(f"\n[gpu_check] torch.compile of the fused {models[0]} ...", flush=True)
    for backend in COMPILED_BACKENDS:
        spec = dict(model=models[0], backend=backend, dtype=DTYPE,
                    cases=[dict(path="model", shape=first["shape"])])
        got, why = run_worker(spec, budget.share(COMPILED_CAP_S / len(COMPILED_BACKENDS)))
        first[backend] = got[0] if got else dict(status="skipped", reason=why or "not reached")
        print(f"  {models[0]} model, {backend}: {_ms(first[backend])} ms" + (f" ({why})" if why else ""),
              flush=True)
        if why:
            skipped.append(f"{backend} {models[0]}: {why}")

    train = None
    if not args.skip_train:
        print(f"\n[gpu_check] training step of {models[0]} (fused, layer-wise) ...", flush=True)
        train = run_train(models[0], args.out_dir, budget.share(TRAIN_CAP_S))
        print(f"[gpu_check] train: {train['status']} in {train['seconds']} s: {train['summary']}", flush=True)
        if train["status"] != "ok":
            skipped.append(f"training step {models[0]}: {train['status']} ({train['summary']})")
        train["profile"] = run_profile(models[0], budget.share(PROFILE_CAP_S))
        print(f"[gpu_check] profile: {train['profile']['status']}: {train['profile']['summary']}", flush=True)
        train["gconv"] = run_gconv(models[0], args.out_dir, budget.share(GCONV_CAP_S))
        print(f"[gpu_check] gconv: {train['gconv']['status']}: {train['gconv']['summary']}", flush=True)

    print(f"\n[gpu_check] {INDUCTOR[0]} (child processes with time limits) ...", flush=True)
    jobs = autotune_jobs(models)
    for i, (m, what, weight) in enumerate(jobs):
        todo = [r for r in rows if r["model"] == m and (r["path"] == "model") == (what == "model")]
        spec = dict(model=m, backend=INDUCTOR[0], dtype=DTYPE,
                    cases=[dict(path=r["path"], shape=r["shape"]) for r in todo])
        limit = budget.left() * weight / sum(w for _, _, w in jobs[i:])
        got, why = run_worker(spec, limit)
        by_path = {g["path"]: g for g in got}
        for r in todo:
            r["inductor"] = by_path.get(r["path"], dict(status="skipped", reason=why or "not reached"))
        done = f"{len(got)} of {len(todo)} timed"
        print(f"  {m} {what}: {done} in at most {limit:.0f} s" + (f" ({why})" if why else ""), flush=True)
        if why:
            skipped.append(f"{_label()} {m} {what}: {done} ({why})")

    static.join(timeout=max(1.0, budget.left()))
    for m, e in static.errors.items():
        skipped.append(f"static report {m}: {e}")
    if static.is_alive():
        skipped.append("static reports: not finished in the budget")
    for r in rows:
        r["predicted"] = predicted_of(static.reports.get(r["model"]), r["path"])

    dev, peak = device_record()
    print(f"\n**{dev['name']}**, batch {BATCH}, {IMG}x{IMG}, {DTYPE}; predicted: static report for sm_90 "
          "(H100 SXM), CUDA-graph figures\n")
    print(comparison_table(rows))
    if skipped:
        print("\nSkipped:\n" + "\n".join(f"- {s}" for s in skipped))
    extra = dict(models=models, budget_min=args.budget_min, elapsed_s=round(time.monotonic() - budget.start),
                 tests=tests, train=train, skipped=skipped, plan=plan, **retimed,
                 static_reports={m: dict(created=r["created"], versions=r.get("versions"), git=r.get("git"))
                                 for m, r in static.reports.items()})
    paths = [write_record(make_record("network", network_results(rows, macs, params, peak), argv, dev, extra),
                          args.out_dir),
             write_record(make_record("model-blocks", block_results(rows), argv, dev, extra), args.out_dir)]
    print("\nrecords: " + ", ".join(str(p) for p in paths))
    return 0 if tests is None or tests["status"] == "passed" else 1


if __name__ == "__main__":
    if "--_worker" not in sys.argv:  # a worker runs on its parent's import path
        ensure_importable()
        if os.environ.get(VIEW_ENV):  # the links laid out for this run go when it ends
            import atexit
            import shutil

            atexit.register(shutil.rmtree, os.environ[VIEW_ENV], True)
    sys.exit(main())
