"""Where a GPU's time goes, kernel by kernel: ``python scripts/gpu_profile.py [--model small]``.

Profiles (torch.profiler, CUDA activity) a few steps of each case, after warm-up, and prints the kernels
by device time; with ``--out DIR`` it also writes one JSON per case (kernel name -> launches, total us):
- ``fused``: the fused inference model (the Triton kernels, eager launches, no CUDA graph);
- ``inductor``: torch.compile of the BatchNorm-folded form (default mode);
- ``train-fused`` and ``train-eager``: one training step (fp16 autocast, SGD), the Triton training
  ops and the layer-wise training form.
The device time per step is the sum over kernels; the difference to the wall time per step is host time
(launch gaps, synchronisations) that a CUDA graph or fewer launches would remove. Where that host time
goes: the same steps under cProfile (``host``: the functions by own time per step, and their own time
summed by package: convfirstnet, triton, torch, the rest), which adds its own overhead per Python call,
so its shares, not its totals, are the finding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CASES = ("fused", "inductor", "train-fused", "train-eager")
HOST_EVENTS = ("aten::", "cuda", "Torch-Compiled", "CompiledFunction", "ProfilerStep")  # not kernels


def kernel_table(prof, steps: int, cpu: bool = False) -> list[dict]:
    """Device kernels (and memcpy/memset) by total device time per step (CPU ops' self time on CPU)."""
    rows = []
    for e in prof.key_averages():
        us = e.self_cpu_time_total if cpu else e.self_device_time_total
        if us <= 0 or not cpu and e.key.startswith(HOST_EVENTS):
            continue
        rows.append(dict(kernel=e.key, launches=e.count / steps, us=us / steps))
    rows.sort(key=lambda r: -r["us"])
    return rows


def _package(filename: str) -> str:
    for name in ("convfirstnet", "triton", "torch"):
        if f"/{name}/" in filename:
            return name
    return "kernels" if "/kernels/" in filename else "other"


def host_profile(fn, steps: int, top: int = 25) -> dict:
    """cProfile of ``steps`` calls of ``fn``: own time per step by function (the ``top``) and by package."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    rows, by_package = [], {}
    for (filename, line, name), (_, calls, tottime, cumtime, _) in st.stats.items():
        pkg = _package(filename)
        by_package[pkg] = by_package.get(pkg, 0.0) + tottime * 1e3 / steps
        rows.append(dict(function=f"{Path(filename).name}:{line} {name}", package=pkg, calls=calls / steps,
                         own_ms=tottime * 1e3 / steps, cum_ms=cumtime * 1e3 / steps))
    rows.sort(key=lambda r: -r["own_ms"])
    return dict(total_ms=sum(by_package.values()), by_package=dict(sorted(by_package.items(),
                                                                          key=lambda kv: -kv[1])),
                top=rows[:top])


def profile_case(case: str, model_name: str, batch: int, img: int, steps: int, device: str = "cuda") -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from convfirstnet.commands.bench import prepare, prepare_train, train_kernels
    from convfirstnet.factory import create_model
    from convfirstnet.kernels._launch import selected_backend

    dev = torch.device(device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    train_model = create_model(model_name)
    x = torch.randn(batch, 3, img, img, device=dev).contiguous(memory_format=torch.channels_last)
    train = case.removeprefix("train-") if case.startswith("train-") else None  # bench's train backend
    with selected_backend(train_kernels(train, dev) if train else "auto"):
        if train:
            y = torch.randint(0, 1000, (batch,), device=dev)
            fn, _ = prepare_train(train, train_model, True, x, y, dtype)
        else:
            fn, _ = prepare(case, train_model, True, x.to(dtype))
        for _ in range(3):
            fn()
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        host = host_profile(fn, steps)
        sync()
        activity = ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for _ in range(steps):
                fn()
            sync()
    rows = kernel_table(prof, steps, cpu=dev.type == "cpu")
    return dict(case=case, model=model_name, batch=batch, img=img, steps=steps, wall_ms=wall_ms,
                device_ms=sum(r["us"] for r in rows) / 1e3, kernels=rows, host=host)


def print_case(r: dict, top: int) -> None:
    print(f"\n## {r['case']} {r['model']} b{r['batch']} {r['img']}x{r['img']}: "
          f"wall {r['wall_ms']:.2f} ms/step, "
          f"kernels {r['device_ms']:.2f} ms/step")
    print("| us/step | launches/step | kernel |")
    for k in r["kernels"][:top]:
        print(f"| {k['us']:.1f} | {k['launches']:.0f} | {k['kernel'][:150]} |")
    host = r.get("host")
    if host:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in host["by_package"].items())
        print(f"\nhost (cProfile, ms/step of own time, with its overhead): {host['total_ms']:.1f}: {parts}")
        print("| own ms/step | calls/step | function |")
        for h in host["top"][:15]:
            print(f"| {h['own_ms']:.2f} | {h['calls']:.0f} | {h['function'][:120]} |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--img-size", type=int, default=256)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default=None, help="folder for one JSON per case")
    p.add_argument("--device", default="cuda", help="cuda (cpu only to check this script: CPU op times)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here: nothing to profile")
        return 0
    for case in args.cases.split(","):
        t0 = time.perf_counter()
        try:
            r = profile_case(case, args.model, args.batch, args.img_size, args.steps, args.device)
        except Exception as e:  # one failing case must not lose the others
            print(f"\n## {case}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        r["seconds"] = round(time.perf_counter() - t0, 1)
        print_case(r, args.top)
        sys.stdout.flush()
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, f"profile_{case}_{args.model}.json").write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
