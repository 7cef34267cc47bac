"""``convfirstnet bench``: inference throughput of ConvFirstNet (and timm models) per backend.

Network mode (default) times whole models; block mode (``--blocks``) times stages of 8 stride-1
blocks with the configurations of the paper's Tables 1 and 2 and prints them beside the paper's
A5000 numbers. Every run prints a Markdown table and writes one JSON record: to ``--out-dir`` when
given, else to ``benchmarks/results/`` of the source checkout the package runs from (an editable
install); a wheel install has no such folder, so there the record is written only to ``--out-dir``.

Backends (``--backends``):

* ``fused``: ``convfirstnet.fuse(model)``, one ``torch.ops.convfirstnet`` op per block (Triton
  kernels on CUDA; the PyTorch reference on CPU, recorded as ``kernels: reference``).
* ``fused-cudagraph``: the fused model captured once in a CUDA graph (kernels are compiled and
  warmed up before capture) and replayed: no launch overhead. CUDA only.
* ``fused-inductor``: ``torch.compile`` (static shapes, default mode) of the fused model, as a user
  compiles it: each block's op, except MBConv blocks whose ``FusedMBConv.compiled_path``
  (``CONVFIRSTNET_COMPILED_MBCONV``) asks for their layers.
  ``fused-inductor-ops``: the same with every block's op (``compiled_path = "fused"``).
* ``eager``: the training form (BatchNorm) in eval mode, channels-last, plain PyTorch.
* ``inductor``: ``torch.compile`` (static shapes) of the BN-folded, unfused model from
  ``fold_batchnorm`` (for timm models: the model as is), channels-last: the layer-by-layer baseline.
* ``inductor-max-autotune``: the same with ``mode="max-autotune"`` (Triton GEMM/conv templates, and
  CUDA graphs on GPU).

Models are cast to ``--dtype`` (no autocast); activations are channels-last. Timing: ``--warmup``
untimed iterations, then ``--iters`` iterations each timed with CUDA events (``perf_counter`` on
CPU); the record keeps median, p10 and p90. A CPU run times PyTorch's reference ops, not the Triton
kernels, and says so; its defaults are CPU-sized (``CPU_DEFAULTS``: batch 1, 1 + 5 iterations), since
the GPU defaults (batch 1 to 256, 10 + 50 iterations) take a CPU far longer. Throughput is batch /
median; achieved TFLOP/s is 2 x MACs x img/s with MACs counted by ``convfirstnet.profile.count_macs``
(PyTorch's FLOP counter on the unfused model); % of peak uses the device's dense fp16/bf16
tensor-core peak from ``convfirstnet.analysis.devices`` (or ``--peak-tflops``, or the matmul peak
measured with ``--measure-peak``).

Training mode (``--train``) times one training step per iteration (zero_grad, forward under autocast
to ``--dtype`` with fp32 master weights, cross-entropy, backward, SGD step) of the training form in
train mode, channels-last, with ``--train-backends``:

* ``fused``: the fused training ops for the blocks that have them (``convfirstnet.training_kernels``:
  Triton forward and backward on CUDA, ``CONVFIRSTNET_KERNELS=triton``), the other layers in PyTorch;
* ``fused-inductor``: the same under ``torch.compile``;
* ``eager``: the layer-wise training form (``CONVFIRSTNET_KERNELS=reference``: cuDNN's grouped convs);
* ``inductor``: ``torch.compile`` of the layer-wise training step;
* ``fused-cudagraph`` and ``eager-cudagraph``: ``fused`` and ``eager`` as ``convfirstnet train
  --cuda-graph`` runs them (``commands/train/graphed.py``): forward, loss and backward captured once in
  a CUDA graph and replayed, the SGD step after each replay outside the graph (three eager warm-up
  steps on a side stream, autocast without its weight cache): the same kernels without the host's
  Python and launch calls per kernel, which bound the fused step on an H200 (153 ms a step for 87.5 ms
  of kernels). The records of 2026-11-26 captured the SGD step in the graph too. CUDA only; a step
  that cannot be captured is reported with the reason.

Images/s and peak memory (CUDA) per backend, side by side; TFLOP/s counts 3 x the forward MACs per image
(forward, input gradient, weight gradient). On CPU ``fused`` runs the same layers as ``eager`` (the
fused training ops take the Triton path on CUDA only), which the record's ``kernels`` note states.

A backend that cannot run here (CUDA graphs on CPU, fused kernels for a non-ConvFirstNet model, an
out-of-memory batch, a compiler error) is reported as skipped with the reason; the run goes on.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

from convfirstnet.analysis.devices import lookup_device
from convfirstnet.analysis.paper import PAPER_BATCH, PAPER_DEVICE, PAPER_STAGE_DEPTH, BlockRow, block_rows
from convfirstnet.analysis.provenance import command_line, device_info, git_info, software_info
from convfirstnet.paths import source_checkout
from convfirstnet.registry import canonical_name

from ._cli import ArgumentParser, ToolError, run_reporting
from ._timing import measure_matmul_peak, summarize, throughput, time_iterations

NETWORK_BACKENDS = ("fused", "fused-cudagraph", "fused-inductor", "fused-inductor-ops", "eager", "inductor",
                    "inductor-max-autotune")
TRAIN_BACKENDS = ("fused", "fused-inductor", "eager", "inductor", "fused-cudagraph", "eager-cudagraph")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_MODELS = ("convfirstnet_pico", "convfirstnet_nano", "convfirstnet_tiny", "convfirstnet_small")
# option -> (CUDA default, CPU default); block mode times batch PAPER_BATCH on either
GPU_DEFAULTS = dict(batch_sizes=[1, 32, 128, 256], warmup=10, iters=50)
CPU_DEFAULTS = dict(batch_sizes=[1], warmup=1, iters=5)
SCHEMA = 1


class Skip(Exception):
    """A backend that cannot run in this configuration; the message says why."""


# ------------------------------------------------------------------------------------------ parsing
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _train_backend_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in TRAIN_BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown training backend(s) {bad or text!r}; choose from "
                                         f"{', '.join(TRAIN_BACKENDS)}")
    return names


def _backend_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in NETWORK_BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend(s) {bad}; choose from {', '.join(NETWORK_BACKENDS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="convfirstnet bench",
        description="Inference benchmark: fused Triton kernels vs eager PyTorch vs torch.compile/Inductor.",
    )
    p.add_argument(
        "models",
        nargs="*",
        help="model names: pico|nano|tiny|small (or convfirstnet_*) and any timm model; NAME@RES sets "
        "that model's resolution (e.g. convnext_small@288). Default: the four ConvFirstNet sizes.",
    )
    p.add_argument(
        "--backends",
        type=_backend_list,
        default=None,
        help=f"comma list of {', '.join(NETWORK_BACKENDS)} (default: fused,fused-cudagraph,eager,"
        "inductor on CUDA; fused,eager on CPU; block mode: fused,inductor on CUDA)",
    )
    p.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=None,
        help="comma list (default 1,32,128,256 on CUDA, 1 on CPU; block mode 128)",
    )
    p.add_argument("--resolution", type=int, default=256, help="input height = width (default 256)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="float16 (default) or bfloat16 on CUDA; CPU runs use float32",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cuda, cuda:N or cpu")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations before timing (default 10; CPU: 1)"
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed iterations (default 50, use >= 50 on GPU; CPU: 5)"
    )
    p.add_argument(
        "--blocks",
        choices=("convfirst", "mbconv", "all"),
        default=None,
        help="block mode: stages of the paper's Table 1 (convfirst) / Table 2 (mbconv) configurations",
    )
    p.add_argument(
        "--block-depth",
        type=int,
        default=PAPER_STAGE_DEPTH,
        help=f"blocks per timed stage in block mode (default {PAPER_STAGE_DEPTH}, as the paper)",
    )
    p.add_argument(
        "--block-limit",
        type=int,
        default=None,
        help="block mode: only the first N configurations (for quick checks)",
    )
    p.add_argument(
        "--measure-peak",
        action="store_true",
        help="also measure a dense matmul peak on this device and report %% of it",
    )
    p.add_argument("--peak-size", type=int, default=None, help="matrix size for --measure-peak")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense fp16/bf16 peak TFLOP/s to use instead of the device table",
    )
    p.add_argument(
        "--train",
        action="store_true",
        help="time training steps (forward + backward + SGD step) instead of inference",
    )
    p.add_argument(
        "--train-backends",
        type=_train_backend_list,
        default=None,
        help=f"with --train: comma list of {', '.join(TRAIN_BACKENDS)} (default: fused,eager,inductor on "
        "CUDA; fused,eager on CPU)",
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="where the JSON record goes (default: benchmarks/results of the source checkout; a wheel "
        "install writes a record only here)",
    )
    p.add_argument("--no-save", action="store_true", help="print the table only, write no record")
    p.add_argument("--tag", default="", help="free text stored in the record and its file name")
    return p


# ------------------------------------------------------------------------------------------ setup
def resolve_device(arg: str) -> torch.device:
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(arg)
    except RuntimeError as e:
        raise ToolError(f"--device {arg!r}: expected auto, cpu, cuda or cuda:N") from e
    if device.type not in ("cpu", "cuda"):
        raise ToolError(f"--device {arg!r}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ToolError(f"--device {arg}, but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ToolError(f"--device {arg}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str | None, device: torch.device) -> tuple[torch.dtype, str | None]:
    """The dtype to run (``None``: float16 on CUDA, float32 on CPU) and a note when a requested one is not
    used: only an explicit ``--dtype`` gets one."""
    if device.type == "cpu":
        note = f"--dtype {name} ignored: CPU runs use float32" if name not in (None, "float32") else None
        return torch.float32, note
    return DTYPES[name or "float16"], None


def parse_model_spec(spec: str, default_resolution: int) -> tuple[str, int]:
    name, _, res = spec.partition("@")
    if res:
        try:
            return name, int(res)
        except ValueError as e:
            raise ToolError(f"bad model spec {spec!r}: expected NAME or NAME@RESOLUTION") from e
    return name, default_resolution


def canonical_convfirstnet(name: str) -> str | None:
    """The registered name of a ConvFirstNet; None for any other (timm) model."""
    try:
        return canonical_name(name)
    except ValueError:
        return None


def _option_value(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def check_model_name(name: str) -> None:
    """A ConvFirstNet size or a registered timm model; anything else is a :class:`ToolError`, raised
    before any model is built or timed."""
    import timm

    if canonical_convfirstnet(name) is None and not timm.is_model(name):
        raise ToolError(
            f"unknown model {name!r}: not a ConvFirstNet size (pico, nano, tiny, small) nor a timm model "
            "(timm.list_models() lists those)"
        )


def default_out_dir() -> Path | None:
    """``benchmarks/results`` of the source checkout the package runs from; None for a wheel install."""
    root = source_checkout()
    return root / "benchmarks" / "results" if root is not None else None


def build_model(name: str) -> tuple[nn.Module, str, bool]:
    """(training-form model on CPU in fp32, canonical name, is ConvFirstNet)."""
    key = canonical_convfirstnet(name)
    if key is not None:
        from convfirstnet.factory import create_model

        return create_model(key), key, True
    import timm

    try:
        return timm.create_model(name, pretrained=False), name, False
    except RuntimeError as e:  # timm: "Unknown model"
        raise Skip(f"unknown model {name!r}: {e}") from e


def model_cost(model: nn.Module, input_size: tuple[int, int, int]) -> tuple[int, int]:
    from convfirstnet.profile import count_macs, count_params

    return count_macs(model, input_size), count_params(model)


def kernels_path(device: torch.device) -> str:
    """Which implementation the fused ops take on this device (from CONVFIRSTNET_KERNELS)."""
    from convfirstnet.kernels._launch import HAS_TRITON, backend, interpreter_enabled

    name = backend()
    if name == "reference" or not HAS_TRITON:
        return "reference"
    if device.type == "cuda":
        return "triton"
    if name == "triton" and interpreter_enabled():
        return "triton-interpreter"
    return "reference"


# ---------------------------------------------------------------------------------------- backends
def _to(model: nn.Module, device: torch.device, dtype: torch.dtype, channels_last: bool = True) -> nn.Module:
    model = model.to(device=device, dtype=dtype)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _fused(train_model: nn.Module, device: torch.device, dtype: torch.dtype, notes: dict) -> nn.Module:
    """The fused form of ``train_model`` on ``device`` in ``dtype``; notes["kernels"]: what its ops run."""
    from convfirstnet.factory import fuse

    notes["kernels"] = kernels_path(device)
    # Fused weights keep their own layout (the ops take NCHW-shaped weights); only x is NHWC.
    return _to(fuse(train_model), device, dtype, channels_last=False)  # fuse() works on a copy


def prepare(
    backend: str, train_model: nn.Module, is_convfirstnet: bool, x: torch.Tensor
) -> tuple[Callable[[], object], dict]:
    """A zero-argument callable that runs one forward pass of ``backend`` on ``x``, plus notes.

    Raises ``Skip`` when the backend cannot run here. Compilation and CUDA-graph capture happen here
    (their wall time goes to the notes), so the caller's warm-up only settles clocks and caches.
    """
    device, dtype = x.device, x.dtype
    notes: dict = {}
    if backend in ("fused", "fused-cudagraph"):
        if not is_convfirstnet:
            raise Skip("fused kernels exist only for ConvFirstNet models")
        if backend == "fused-cudagraph" and device.type != "cuda":
            raise Skip("CUDA graphs need a CUDA device")
        model = _fused(train_model, device, dtype, notes)
        if backend == "fused":
            return (lambda: model(x)), notes
        t0 = time.perf_counter()
        graph, static_out = _capture(lambda: model(x), device)
        notes["capture_s"] = round(time.perf_counter() - t0, 3)
        notes["_keep"] = (graph, static_out, model)  # keep graph memory alive while timing
        return graph.replay, notes
    if backend == "eager":
        model = _to(copy.deepcopy(train_model).eval(), device, dtype)
        return (lambda: model(x)), notes
    if backend in ("fused-inductor", "fused-inductor-ops"):
        # torch.compile of the fused form, as a user compiles it: the MBConv blocks compile their layers
        # where FusedMBConv.compiled_path (auto) says; -ops keeps every block's fused op
        if not is_convfirstnet:
            raise Skip("fused kernels exist only for ConvFirstNet models")
        from convfirstnet.blocks import FusedMBConv

        base = _fused(train_model, device, dtype, notes)
        blocks = [m for m in base.modules() if isinstance(m, FusedMBConv)]
        if backend == "fused-inductor-ops":
            for m in blocks:
                m.compiled_path = "fused"
        notes["compiled_mbconv"] = sorted({m.compiled_path for m in blocks})
    elif backend in ("inductor", "inductor-max-autotune"):
        if is_convfirstnet:
            from convfirstnet.folding import fold_batchnorm

            base = fold_batchnorm(train_model)
            notes["baseline"] = "fold_batchnorm (BN folded, unfused layers)"
        else:
            base = copy.deepcopy(train_model).eval()
            notes["baseline"] = "timm model as is (BN not folded)"
        base = _to(base, device, dtype)
    if backend in ("fused-inductor", "fused-inductor-ops", "inductor", "inductor-max-autotune"):
        mode = "max-autotune" if backend == "inductor-max-autotune" else None
        torch._dynamo.reset()
        compiled = torch.compile(base, mode=mode, dynamic=False)
        mark_step = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
        uses_graphs = mode == "max-autotune" and device.type == "cuda" and mark_step is not None

        def run() -> object:
            if uses_graphs:
                mark_step()  # each call is a new step for CUDA-graph trees
            return compiled(x)

        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        notes["compile_s"] = round(time.perf_counter() - t0, 3)
        return run, notes
    raise ValueError(f"unknown backend {backend!r}")


# the fused rows ask for the fused training kernels (CONVFIRSTNET_KERNELS=triton) on CUDA; elsewhere
# "auto", which runs the layer-wise training form (the interpreter would time Python, not kernels)
_TRAIN_KERNELS = {"fused": "triton", "fused-inductor": "triton", "eager": "reference",
                  "inductor": "reference", "fused-cudagraph": "triton", "eager-cudagraph": "reference"}


def train_kernels(backend: str, device: torch.device) -> str:
    """The CONVFIRSTNET_KERNELS value that a training backend runs under on ``device``."""
    kernels = _TRAIN_KERNELS[backend]
    return kernels if kernels != "triton" or device.type == "cuda" else "auto"


def prepare_train(backend: str, train_model: nn.Module, is_convfirstnet: bool, x: torch.Tensor,
                  y: torch.Tensor, dtype: torch.dtype) -> tuple[Callable[[], object], dict]:
    """A zero-argument callable that runs one training step of ``backend``, plus notes (module docstring).
    Runs under the backend's CONVFIRSTNET_KERNELS (set by the caller)."""
    device = x.device
    notes: dict = {}
    graphed = backend.endswith("-cudagraph")
    if graphed and device.type != "cuda":
        raise Skip("CUDA graphs need a CUDA device")
    if backend.startswith("fused"):
        if not is_convfirstnet:
            raise Skip("fused training ops exist only for ConvFirstNet models")
        from convfirstnet.training_kernels import triton_selected

        on = triton_selected(x)
        notes["kernels"] = "triton" if on else "layer-wise (the fused training ops run on CUDA)"
    model = copy.deepcopy(train_model).to(device).to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    forward = model
    if backend in ("inductor", "fused-inductor"):
        torch._dynamo.reset()
        forward = torch.compile(model, dynamic=False)
    autocast = dtype != torch.float32

    def step() -> object:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    keep: tuple = ()
    if graphed:  # what `convfirstnet train --cuda-graph` runs: its warm-up steps, then capture and replays
        from convfirstnet.commands.train.graphed import WARMUP, CudaGraphs, GraphedStep
        from convfirstnet.commands.train.options import TrainError

        graphed_step = GraphedStep(model, nn.CrossEntropyLoss(), opt, None, dtype if autocast else None, None,
                                   CudaGraphs(device))
        for _ in range(WARMUP):
            graphed_step(x, y)
        t0 = time.perf_counter()
        try:
            graphed_step(x, y)  # the capture, and its first replay
        except TrainError as e:  # a host sync or an unsupported op inside the step
            raise Skip(str(e.__cause__ or e)[:200]) from e
        torch.cuda.synchronize(device)
        notes["capture_s"] = round(time.perf_counter() - t0, 3)
        keep = (graphed_step,)

        def replay() -> object:  # copies x, y into the graph's inputs (as for each batch) and replays
            return graphed_step(x, y)

        step = replay

    if backend in ("inductor", "fused-inductor"):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        notes["compile_s"] = round(time.perf_counter() - t0, 3)
    notes["_keep"] = (model, opt, *keep)
    return step, notes


def _capture(fn: Callable[[], object], device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn()`` captured in a CUDA graph, and the output of the captured call (refreshed by each replay).
    Three calls on a side stream first, as torch.cuda.graphs recommends: every kernel is compiled and
    warmed, and lazy state (an optimizer's buffers) built, outside the capture (autotuning or a first
    launch during capture breaks it)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def run_train_case(backend: str, train_model: nn.Module, is_convfirstnet: bool, x: torch.Tensor,
                   y: torch.Tensor, dtype: torch.dtype, warmup: int, iters: int) -> dict:
    """Prepare, warm up and time one training backend; a dict with status ok or skipped."""
    from convfirstnet.kernels._launch import selected_backend

    device = x.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with selected_backend(train_kernels(backend, device)):
            fn, notes = prepare_train(backend, train_model, is_convfirstnet, x, y, dtype)
            times = time_iterations(fn, device, warmup, iters)
    except Skip as e:
        return dict(status="skipped", reason=str(e))
    except torch.cuda.OutOfMemoryError as e:
        return dict(status="skipped", reason=f"out of memory: {_short_error(e)}")
    except Exception as e:  # a compiler or kernel failure must not end the whole run
        print(f"[bench] {backend} (train) failed:\n{traceback.format_exc(limit=4)}", file=sys.stderr)
        return dict(status="skipped", reason=f"failed: {_short_error(e)}")
    finally:
        gc.collect()
    return _timed_result(times, notes, device)


def run_train(args, device, dtype, peak, measured) -> list[dict]:
    results = []
    for spec in args.models or list(DEFAULT_MODELS):
        name, res = parse_model_spec(spec, args.resolution)
        try:
            train_model, key, is_cfn = build_model(name)
        except Skip as e:
            results.append(dict(model=name, status="skipped", reason=str(e)))
            continue
        macs, params = model_cost(train_model, (3, res, res))
        classes = getattr(train_model, "num_classes", 1000)
        for backend in args.train_backends:
            for batch in args.batch_sizes:
                g = torch.Generator().manual_seed(0)
                x = torch.randn(batch, 3, res, res, generator=g).to(device)
                x = x.contiguous(memory_format=torch.channels_last)
                y = torch.randint(0, classes, (batch,), generator=g).to(device)
                row = dict(model=key, backend=backend, batch=batch, resolution=res,
                           dtype=str(dtype).removeprefix("torch."), macs_per_image=macs, params=params,
                           train_macs_per_image=3 * macs)
                row.update(run_train_case(backend, train_model, is_cfn, x, y, dtype, args.warmup, args.iters))
                _figures(row, batch, 3 * macs, peak, measured)
                results.append(row)
                print(f"[bench] train {_progress(row)}", file=sys.stderr)
                del x, y
    return results


def _timed_result(times: list[float], notes: dict, device: torch.device) -> dict:
    """A case's result: the timing summary, the public notes of its preparation, the CUDA peak memory."""
    result = dict(status="ok", times_ms=summarize(times))
    result.update({k: v for k, v in notes.items() if not k.startswith("_")})
    if device.type == "cuda":
        result["peak_mem_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return result


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def run_case(
    backend: str, train_model: nn.Module, is_convfirstnet: bool, x: torch.Tensor, warmup: int, iters: int
) -> dict:
    """Prepare, warm up and time one (backend, input) case; a dict with status ok or skipped."""
    device = x.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        # no_grad rather than inference_mode: module copies made here hold normal tensors, which
        # torch.compile and CUDA-graph capture handle on every torch version
        with torch.no_grad():
            fn, notes = prepare(backend, train_model, is_convfirstnet, x)
            times = time_iterations(fn, device, warmup, iters)
    except Skip as e:
        return dict(status="skipped", reason=str(e))
    except torch.cuda.OutOfMemoryError as e:
        return dict(status="skipped", reason=f"out of memory: {_short_error(e)}")
    except Exception as e:  # a compiler or kernel failure must not end the whole run
        tb = traceback.format_exc(limit=4)
        print(f"[bench] {backend} failed:\n{tb}", file=sys.stderr)
        return dict(status="skipped", reason=f"failed: {_short_error(e)}")
    finally:
        gc.collect()
    return _timed_result(times, notes, device)


def _figures(result: dict, batch: int, macs: int, peak: float | None, measured: float | None) -> None:
    if result.get("status") != "ok":
        return
    med = result["times_ms"]["median"]
    result["ms_per_batch"] = med
    result.update(throughput(batch, med, macs, peak))
    if measured:
        result["pct_measured_peak"] = 100 * result["tflops"] / measured


# -------------------------------------------------------------------------------------------- runs
def run_network(args, device, dtype, peak, measured) -> list[dict]:
    results = []
    specs = args.models or list(DEFAULT_MODELS)
    for spec in specs:
        name, res = parse_model_spec(spec, args.resolution)
        try:
            train_model, key, is_cfn = build_model(name)
        except Skip as e:
            results.append(dict(model=name, status="skipped", reason=str(e)))
            continue
        macs, params = model_cost(train_model, (3, res, res))
        for backend in args.backends:
            for batch in args.batch_sizes:
                x = torch.randn(batch, 3, res, res, device=device, dtype=dtype).contiguous(
                    memory_format=torch.channels_last
                )
                row = dict(
                    model=key,
                    backend=backend,
                    batch=batch,
                    resolution=res,
                    dtype=str(dtype).removeprefix("torch."),
                    macs_per_image=macs,
                    params=params,
                )
                row.update(run_case(backend, train_model, is_cfn, x, args.warmup, args.iters))
                _figures(row, batch, macs, peak, measured)
                results.append(row)
                print(f"[bench] {_progress(row)}", file=sys.stderr)
                del x
    return results


def build_stage(row: BlockRow, depth: int) -> nn.Module:
    """``depth`` stride-1 blocks of the row's configuration, training form, BN statistics perturbed so
    folding is not an identity."""
    from convfirstnet.blocks import ConvFirst, MBConv

    cls = ConvFirst if row.block == "convfirst" else MBConv
    stage = nn.Sequential(*[cls(row.channels, row.channels, 1, row.expansion) for _ in range(depth)])
    g = torch.Generator().manual_seed(0)
    for m in stage.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=g))
            m.running_var.copy_(1 + 0.1 * torch.rand(m.num_features, generator=g))
    return stage.eval()


def run_blocks(args, device, dtype, peak, measured) -> list[dict]:
    from convfirstnet.profile import count_macs, count_params

    rows = block_rows(args.blocks)
    if args.block_limit is not None:
        rows = rows[: args.block_limit]
    results = []
    for row in rows:
        stage = build_stage(row, args.block_depth)
        macs = count_macs(stage, (row.channels, row.size, row.size))
        params = count_params(stage)
        for backend in args.backends:
            for batch in args.batch_sizes:
                x = torch.randn(
                    batch, row.channels, row.size, row.size, device=device, dtype=dtype
                ).contiguous(memory_format=torch.channels_last)
                rec = dict(
                    block=row.block,
                    channels=row.channels,
                    expansion=row.expansion,
                    size=row.size,
                    depth=args.block_depth,
                    backend=backend,
                    batch=batch,
                    dtype=str(dtype).removeprefix("torch."),
                    macs_per_image=macs,
                    params=params,
                    paper=_paper_fields(row),
                )
                rec.update(run_case(backend, stage, True, x, args.warmup, args.iters))
                if rec.get("kernels") == "triton":
                    rec["kernel_config"] = kernel_config(row, dtype)
                _figures(rec, batch, macs, peak, measured)
                results.append(rec)
                print(f"[bench] {_progress(rec)}", file=sys.stderr)
                del x
    return results


def kernel_config(row: BlockRow, dtype: torch.dtype) -> dict | None:
    """The fused kernel's tile configuration for a stride-1 block of ``row`` (best effort: the kernel
    modules' ``convfirst_config`` / ``mbconv_config`` tables), or None when it cannot be read."""
    import dataclasses

    try:
        if row.block == "convfirst":
            from convfirstnet.kernels.convfirst.launcher import convfirst_config as fn

            args = (row.channels, row.channels, 1)
        else:
            from convfirstnet.kernels.mbconv.launcher import mbconv_config as fn

            c = row.channels
            args = (c, row.expansion * c, c, row.size, row.size, 1)
        try:
            cfg = fn(*args, dtype=dtype)
        except TypeError:
            cfg = fn(*args)
    except Exception:  # noqa: BLE001 - a changed kernel table must not stop the benchmark
        return None
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {"repr": repr(cfg)}


def _paper_fields(row: BlockRow) -> dict:
    return dict(
        inductor_ms=row.inductor_ms,
        fused_ms=row.fused_ms,
        fused_pct_peak=row.fused_pct_peak,
        inductor_pct_peak=row.inductor_pct_peak,
        speedup=row.speedup,
        device=PAPER_DEVICE,
        batch=PAPER_BATCH,
    )


def _progress(r: dict) -> str:
    what = r.get("model") or f"{r.get('block')} C={r.get('channels')} t={r.get('expansion')} {r.get('size')}"
    head = f"{what} {r.get('backend')} batch={r.get('batch')}"
    if r.get("status") != "ok":
        return f"{head}: skipped ({r.get('reason')})"
    return f"{head}: {r['ms_per_batch']:.3f} ms, {r['img_per_s']:.1f} img/s"


# ----------------------------------------------------------------------------------------- tables
def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _tf(v: float) -> str:
    return f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def _fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def network_table(results: Sequence[dict]) -> str:
    lines = [
        "| model | backend | batch | img/s | ms/batch (median) | p10-p90 ms | TFLOP/s | % peak "
        "| peak mem MB | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if r.get("status") != "ok":
            lines.append(
                f"| {r.get('model', '-')} | {r.get('backend', '-')} | {r.get('batch', '-')} "
                f"| - | - | - | - | - | - | skipped: {r.get('reason', '')} |"
            )
            continue
        t = r["times_ms"]
        notes = ", ".join(f"{k}={r[k]}" for k in ("kernels", "compile_s", "capture_s") if k in r)
        lines.append(
            f"| {r['model']}@{r['resolution']} | {r['backend']} | {r['batch']} | {r['img_per_s']:.1f} "
            f"| {_fmt_ms(t['median'])} | {_fmt_ms(t['p10'])}-{_fmt_ms(t['p90'])} | {_tf(r['tflops'])} "
            f"| {_fmt(r.get('pct_peak'))} | {_fmt(r.get('peak_mem_mb'), '.0f')} | {notes} |"
        )
    return "\n".join(lines)


def block_table(results: Sequence[dict]) -> str:
    """One line per configuration and batch: fused vs Inductor beside the paper's A5000 figures."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in results:
        key = (r["block"], r["channels"], r["expansion"], r["size"], r["batch"])
        groups.setdefault(key, {})[r["backend"]] = r
    backends = []
    for r in results:
        if r["backend"] not in backends:
            backends.append(r["backend"])
    head = ["block", "C", "t", "HxW", "batch"] + [f"{b} ms" for b in backends]
    head += [
        "fused TFLOP/s",
        "fused % peak",
        "speed-up vs inductor",
        "paper inductor ms",
        "paper fused ms",
        "paper fused % peak",
        "paper speed-up",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 5 + "---:|" * (len(head) - 5)]
    for (block, c, t, s, batch), by in groups.items():
        cells = [block, str(c), str(t), f"{s}x{s}", str(batch)]
        for b in backends:
            r = by.get(b)
            cells.append(_fmt_ms(r["ms_per_batch"]) if r and r.get("status") == "ok" else "skipped")
        fused = by.get("fused-cudagraph") if _ok(by.get("fused-cudagraph")) else by.get("fused")
        ind = by.get("inductor")
        cells.append(_tf(fused["tflops"]) if _ok(fused) else "-")
        cells.append(_fmt(fused.get("pct_peak")) if _ok(fused) else "-")
        speed = ind["ms_per_batch"] / fused["ms_per_batch"] if _ok(fused) and _ok(ind) else None
        cells.append(f"{speed:.1f}x" if speed else "-")
        paper = next(iter(by.values()))["paper"]
        cells += [
            f"{paper['inductor_ms']:.2f}",
            f"{paper['fused_ms']:.2f}",
            f"{paper['fused_pct_peak']:.1f}",
            f"{paper['speedup']:.1f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    skipped = sorted({f"{r['backend']}: {r.get('reason')}" for r in results if r.get("status") != "ok"})
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    return "\n".join(lines)


def _ok(r: dict | None) -> bool:
    return bool(r) and r.get("status") == "ok"


# ----------------------------------------------------------------------------------------- record
def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")[:60] or "x"


def record_filename(record: dict) -> str:
    dev = record["device"]
    spec = lookup_device(dev["name"]) if dev["type"] == "cuda" else None
    device_slug = spec.key if spec else ("cpu" if dev["type"] == "cpu" else _slug(dev["name"]))
    stamp = record["date"].replace("-", "").replace(":", "")[:15] + "Z"
    if record["mode"] == "blocks":
        what = f"blocks-{record['settings']['blocks']}"
    else:
        models = record["settings"]["models"]
        what = (
            "-".join(m.removeprefix("convfirstnet_") for m in models)
            if len(models) <= 4
            else f"{len(models)}models"
        )
        if record["mode"] == "train":
            what = f"train-{what}"
    parts = [stamp, device_slug, record["settings"]["dtype"], _slug(what)]
    if record.get("tag"):
        parts.append(_slug(record["tag"]))
    return "_".join(parts) + ".json"


def write_record(record: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / record_filename(record)
    n = 1
    while path.exists():
        path = out / f"{path.stem.rsplit('~', 1)[0]}~{n}.json"
        n += 1
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return path


# ------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return run_reporting("convfirstnet bench", lambda: run(args, argv))


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import convfirstnet  # noqa: F401  (registers the ops and the timm models)

    device = resolve_device(args.device)
    dtype, dtype_note = resolve_dtype(args.dtype, device)
    if dtype_note:
        print(f"[bench] {dtype_note}", file=sys.stderr)
    if args.backends is None:
        if args.blocks:
            args.backends = ["fused", "inductor"] if device.type == "cuda" else ["fused", "eager"]
        else:
            args.backends = (
                ["fused", "fused-cudagraph", "eager", "inductor"]
                if device.type == "cuda"
                else ["fused", "eager"]
            )
    if args.train and args.blocks:
        raise ToolError("--train times whole models; it does not combine with --blocks")
    if args.train_backends is not None and not args.train:
        raise ToolError("--train-backends needs --train")
    if args.train and args.train_backends is None:
        args.train_backends = ["fused", "eager", "inductor"] if device.type == "cuda" else ["fused", "eager"]
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    defaulted = [k for k in ("batch_sizes", "warmup", "iters") if getattr(args, k) is None]
    if (args.blocks or args.train) and args.batch_sizes is None:
        args.batch_sizes = [PAPER_BATCH]
        defaulted.remove("batch_sizes")
    for key in defaulted:
        setattr(args, key, defaults[key])
    if args.iters < 1 or args.warmup < 0:
        raise ToolError("--iters must be >= 1 and --warmup >= 0")
    for spec in args.models:  # a malformed NAME@RES or an unknown name is an error before any work
        check_model_name(parse_model_spec(spec, args.resolution)[0])
    out_dir = None if args.no_save else Path(args.out_dir) if args.out_dir else default_out_dir()
    if device.type == "cpu":
        what = {
            "reference": "PyTorch's reference ops",
            "triton-interpreter": "the Triton kernels in Triton's interpreter (very slow)",
        }.get(kernels_path(device), "PyTorch's reference ops")
        why = " (no CUDA device)" if args.device == "auto" else ""
        sized = " ".join(f"--{k.replace('_', '-')} {_option_value(getattr(args, k))}" for k in defaulted)
        print(
            f"[bench] warning: CPU run{why}: the fused backend times {what} in float32, not the GPU kernels"
            + (f"; CPU-sized defaults {sized}" if sized else ""),
            file=sys.stderr,
        )
    if device.type == "cuda" and args.iters < 50:
        print(f"[bench] note: --iters {args.iters} < 50 timed iterations", file=sys.stderr)

    if device.type == "cuda":
        # as timm's benchmark does: let cuDNN pick its fastest algorithms for the eager baseline
        torch.backends.cudnn.benchmark = True
    dev = device_info(device)
    spec = lookup_device(dev["name"]) if device.type == "cuda" else None
    peak, peak_source = None, None
    if args.peak_tflops:
        peak, peak_source = args.peak_tflops, "--peak-tflops"
    elif spec is not None and dtype in (torch.float16, torch.bfloat16):
        peak, peak_source = spec.peak_tflops, f"table: {spec.name}"
    dev.update(peak_tflops=peak, peak_source=peak_source, table_key=spec.key if spec else None)
    measured = None
    if args.measure_peak:
        m = measure_matmul_peak(device, dtype, args.peak_size)
        measured = m["tflops"]
        dev["measured_peak"] = m
        print(
            f"[bench] measured matmul peak: {measured:.2f} TFLOP/s ({m['size']}^3 {m['dtype']})",
            file=sys.stderr,
        )
        if peak is None:
            peak, dev["peak_source"] = measured, "measured matmul"
            dev["peak_tflops"] = peak
    if peak is None:
        print(
            "[bench] no peak known for this device: % of peak is left empty "
            "(use --peak-tflops or --measure-peak)",
            file=sys.stderr,
        )

    now = _dt.datetime.now(_dt.timezone.utc)
    if args.blocks:
        results = run_blocks(args, device, dtype, peak, measured)
        table = block_table(results)
    elif args.train:
        results = run_train(args, device, dtype, peak, measured)
        table = network_table(results)
    else:
        results = run_network(args, device, dtype, peak, measured)
        table = network_table(results)

    record = dict(
        schema=SCHEMA,
        mode="blocks" if args.blocks else "train" if args.train else "network",
        date=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=command_line("convfirstnet bench", argv),
        tag=args.tag,
        git=git_info(),
        device=dev,
        software=software_info(),
        settings=dict(
            models=[parse_model_spec(s, args.resolution)[0] for s in (args.models or DEFAULT_MODELS)]
            if not args.blocks
            else [],
            blocks=args.blocks,
            block_depth=args.block_depth if args.blocks else None,
            backends=args.train_backends if args.train else args.backends,
            batch_sizes=args.batch_sizes,
            resolution=args.resolution,
            dtype=str(dtype).removeprefix("torch."),
            warmup=args.warmup,
            iters=args.iters,
            channels_last=True,
            cudnn_benchmark=device.type == "cuda",
            timer="cuda-events" if device.type == "cuda" else "perf_counter",
        ),
        results=results,
    )
    if dtype_note:
        record["settings"]["note"] = dtype_note
    header = (
        f"**{dev['name']}** ({device.type}), {record['settings']['dtype']}, "
        f"peak {_fmt(peak, '.4g')} TFLOP/s ({peak_source or 'unknown'}), {record['date']}"
    )
    print(header)
    print()
    print(table)
    if out_dir is not None:
        print(f"\nrecord: {write_record(record, out_dir)}")
    elif not args.no_save:
        print(
            "\nrecord not written: no source checkout (benchmarks/results) to keep it in; "
            "pass --out-dir DIR to keep it"
        )
    ok = [r for r in results if r.get("status") == "ok"]
    return 0 if ok or not results else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
