"""The ``convfirstnet`` command (also ``python -m convfirstnet``).

Without a subcommand (or with ``info``) it builds the four models and prints, for each, parameters,
GMACs at the input size, a fused-vs-training-form check and the fused model's throughput on the
current device. Other subcommands run the tools in ``convfirstnet/tools`` (the same code as
``scripts/*.py``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

# subcommand -> module with main(argv) -> int: in convfirstnet.tools, or a full module path
TOOLS = {
    "eval": ("eval_imagenet", "evaluate a model on an ImageNet-style folder"),
    "convert": ("convert_checkpoint", "turn a training checkpoint into a weight file"),
    "train": ("train_imagenet", "train with the paper's recipe"),
    "bench": ("benchmark", "throughput: fused kernels vs torch.compile"),
    "waterline": ("waterline", "waterline / efficiency-gap analysis of a model"),
    "results": ("bench_report", "README results table from benchmarks/results"),
    "kernels": ("convfirstnet.analysis.report", "static cost report of the fused kernels compiled for a GPU"),
}


def _info_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convfirstnet",
        description="ConvFirstNet models: size, cost, fused-form check and throughput on this machine.",
        epilog="subcommands: " + "; ".join(f"{k}: {v[1]}" for k, v in TOOLS.items())
        + ". Run `convfirstnet <subcommand> --help` for each.",
    )
    p.add_argument("--models", nargs="+", default=None, help="models (default: all four)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 128 on GPU, 4 on CPU")
    p.add_argument("--img-size", type=int, default=256)
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: 20 on GPU, 2 on CPU)")
    return p


def info(argv: list[str]) -> int:
    import torch

    import convfirstnet
    from convfirstnet.kernels._launch import backend, use_triton
    from convfirstnet.profile import count_macs, count_params

    args = _info_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    batch = args.batch_size or (128 if gpu else 4)
    iters = args.iters or (20 if gpu else 2)
    dtype = torch.float16 if gpu else torch.float32
    size = args.img_size
    probe = torch.empty(1, device=device)
    kernels = "Triton" if use_triton(probe) else "PyTorch reference"
    print(f"convfirstnet {convfirstnet.__version__}, torch {torch.__version__}, device {_device_name(device)}, "
          f"fused blocks run the {kernels} ops (CONVFIRSTNET_KERNELS={backend()}), {str(dtype)[6:]}, "
          f"batch {batch}, {size}x{size}")
    print("| model | params (M) | GMACs | fused vs training form (max rel. err) | img/s (fused) |")
    print("|---|---|---|---|---|")
    torch.manual_seed(0)
    for name in args.models or convfirstnet.list_models():
        model = convfirstnet.create_model(name).eval()
        name = model.pretrained_cfg["architecture"]
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
        ips = batch / _time_forward(fused, xb, iters)
        print(f"| {name} | {params:.3f} | {gmacs:.3f} | {err:.1e} | {ips:,.1f} |", flush=True)
    return 0


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _time_forward(model, x, iters: int) -> float:
    """Median seconds per forward, after one warm-up call."""
    import torch

    times = []
    with torch.inference_mode():
        model(x)
        for _ in range(iters):
            if x.is_cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            model(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        name = TOOLS[argv[0]][0]
        module = importlib.import_module(name if "." in name else f"convfirstnet.tools.{name}")
        return module.main(argv[1:])
    if argv and argv[0] == "info":
        argv = argv[1:]
    try:
        return info(argv)
    except (ValueError, TypeError, RuntimeError) as e:  # bad model name, size, device: one line, no traceback
        print(f"convfirstnet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
