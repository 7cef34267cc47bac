"""``convfirstnet`` without a command (or ``convfirstnet info``): the four models on this machine.

For each model: parameters, GMACs at the input size, a fused-vs-training-form check and the fused
model's throughput on the current device (median over enough timed iterations, with its spread).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time

import torch

import convfirstnet
from convfirstnet.kernels._launch import backend, use_triton
from convfirstnet.model import MIN_INPUT_SIZE
from convfirstnet.profile import count_macs, count_params
from convfirstnet.registry import canonical_name

from ._cli import ArgumentParser, run_reporting
from ._timing import summarize

# Timing of the main command: at least this many iterations and this many seconds (after warm-up).
MIN_ITERS = {"cuda": 20, "cpu": 7}
MIN_SECONDS = {"cuda": 1.0, "cpu": 5.0}
MAX_ITERS = 1000
WARMUP_SECONDS = 1.0


def _version_text() -> str:
    parts = [f"torch {torch.__version__}"]
    for mod in ("timm", "triton"):
        try:
            parts.append(f"{mod} {importlib.import_module(mod).__version__}")
        except ImportError:
            pass
    return f"convfirstnet {convfirstnet.__version__} ({', '.join(parts)})"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version_text())
        parser.exit()


def build_parser(epilog: str | None = None) -> argparse.ArgumentParser:
    """The parser of the default job; ``epilog``: the list of commands (``convfirstnet.commands.cli``)."""
    p = ArgumentParser(
        prog="convfirstnet",
        usage="convfirstnet [command] [options]",
        description="ConvFirstNet models: size, cost, fused-form check and throughput on this machine.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_Version, help="print the versions and exit")
    p.add_argument("--models", nargs="+", default=None, help="models (default: all four)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 128 on GPU, 4 on CPU")
    p.add_argument("--img-size", type=int, default=256)
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help=f"timed iterations (default: at least {MIN_ITERS['cuda']} and {MIN_SECONDS['cuda']:g} s on GPU, "
        f"{MIN_ITERS['cpu']} and {MIN_SECONDS['cpu']:g} s on CPU)",
    )
    return p


class InfoError(ValueError):
    """A bad argument of the main command."""


def _resolve_device(arg: str | None):
    if arg is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(arg)
    except RuntimeError as e:
        raise InfoError(f"--device {arg!r}: expected cpu or cuda") from e
    if device.type not in ("cpu", "cuda"):
        raise InfoError(f"--device {arg!r}: expected cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InfoError(f"--device {arg}, but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InfoError(f"--device {arg}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def info(argv: list[str], epilog: str | None = None) -> int:
    args = build_parser(epilog).parse_args(argv)
    # Every argument is checked before anything is printed.
    names = [canonical_name(n) for n in (args.models or convfirstnet.list_models())]
    device = _resolve_device(args.device)
    if args.img_size < MIN_INPUT_SIZE:
        raise InfoError(f"--img-size {args.img_size}: ConvFirstNet needs at least {MIN_INPUT_SIZE}")
    for flag, value in (("--batch-size", args.batch_size), ("--iters", args.iters)):
        if value is not None and value < 1:
            raise InfoError(f"{flag} must be at least 1")
    gpu = device.type == "cuda"
    batch = args.batch_size or (128 if gpu else 4)
    dtype = torch.float16 if gpu else torch.float32
    size = args.img_size
    probe = torch.empty(1, device=device)
    kernels = "Triton" if use_triton(probe) else "PyTorch reference"
    timing = (
        f"{args.iters} timed iterations"
        if args.iters
        else f"median of >= {MIN_ITERS[device.type]} iterations and >= {MIN_SECONDS[device.type]:g} s"
    )
    print(
        f"convfirstnet {convfirstnet.__version__}, torch {torch.__version__}, device {_device_name(device)}, "
        f"fused blocks run the {kernels} ops (CONVFIRSTNET_KERNELS={backend()}), {str(dtype)[6:]}, "
        f"batch {batch}, {size}x{size}, {timing}"
    )
    print(
        "| model | params (M) | GMACs | fused vs training form (max rel. err) | img/s (fused, median) "
        "| img/s p10-p90 | timed iterations |"
    )
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for name in names:
        model = convfirstnet.create_model(name).eval()
        params = count_params(model) / 1e6
        gmacs = count_macs(model, (3, size, size)) / 1e9
        fused = convfirstnet.fuse(model)
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            ref = model(x).double()
            out = fused.to(device)(x.to(device)).double().cpu()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        fused = fused.to(dtype)
        xb = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
        t = time_forward(fused, xb, args.iters)
        print(
            f"| {name} | {params:.3f} | {gmacs:.3f} | {err:.1e} | {batch / t['median']:,.1f} "
            f"| {batch / t['p90']:,.1f}-{batch / t['p10']:,.1f} | {t['n']} |",
            flush=True,
        )
    return 0


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def time_forward(
    model, x, iters: int | None = None, min_iters: int | None = None, min_seconds: float | None = None
) -> dict[str, float]:
    """Seconds per forward: median, p10, p90 and the number of timed calls.

    Warm-up: calls until ``WARMUP_SECONDS`` have passed (at least one). Then ``iters`` timed calls, or by
    default as many as it takes to reach both ``min_iters`` calls and ``min_seconds`` of timing (at most
    ``MAX_ITERS``), so a slow, noisy CPU still gets a stable median.
    """
    kind = "cuda" if x.is_cuda else "cpu"
    min_iters = iters or (min_iters if min_iters is not None else MIN_ITERS[kind])
    min_seconds = 0.0 if iters else (min_seconds if min_seconds is not None else MIN_SECONDS[kind])
    max_iters = iters or MAX_ITERS

    def call() -> float:
        if x.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    times: list[float] = []
    with torch.inference_mode():
        warm = call()
        while warm < WARMUP_SECONDS:
            warm += call()
        while len(times) < max_iters and (len(times) < min_iters or sum(times) < min_seconds):
            times.append(call())
    s = summarize(times)
    return dict(median=s["median"], p10=s["p10"], p90=s["p90"], n=s["n"])


def main(argv: list[str] | None = None, epilog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_reporting("convfirstnet", lambda: info(argv, epilog))
