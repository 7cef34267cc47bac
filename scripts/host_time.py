"""Host time of the fused forms, kernels skipped: ``python scripts/host_time.py [--model small]``.

A GPU step of the fused ops costs the CPU the Python of every op and launcher, torch's dispatch and
autograd around them, and one Triton launch call per kernel. When that exceeds the kernels' device time
the step is host-bound (the first GPU run measured a fused training step at 371 ms of wall time against
87 ms of kernels). This script measures the CPU side without a GPU: it runs the Triton path on CPU
tensors (the interpreter's backend selected) with every kernel launch replaced by a counter, so what is
timed is the host code alone, at the configurations the launchers pick (the cost report's
``kernels._cost.recording`` also skips launches, but builds each launch's cost declaration and meta
copies of its arguments: host work a real step does not do). Small maps keep the remaining
CPU work (the aten ops that would be GPU launches: weight casts, concatenations, the optimizer) small;
it is still counted, so the figure is an upper bound of that part. Not counted: Triton's own launch call
per kernel (its argument binding and the driver call), which only a GPU can time.

Cases: ``train`` (forward and backward of the training form with the fused training ops; the
optimizer, a few ``foreach`` launches on CUDA, is left out: on CPU it would time the update itself) and
``infer`` (the fused inference form, eager, as without a CUDA graph).
``--out DIR`` writes a JSON record.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

CASES = ("train", "infer")


class _Counter:
    """Stands in for a kernel: ``kernel[grid](*args, **meta)`` counts the launch and runs nothing."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches += 1

        return launch


def measure(case: str, model_name: str, batch: int, img: int, steps: int) -> dict:
    import torch
    from convfirstnet.kernels import _launch

    from convfirstnet import fuse
    from convfirstnet.factory import create_model

    counter = _Counter()
    saved = _launch.launchable
    _launch.launchable = lambda kernel, args=(): counter
    try:
        torch.manual_seed(0)
        model = create_model(model_name).to(memory_format=torch.channels_last)
        x = torch.randn(batch, 3, img, img).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, model.num_classes, (batch,))
        with _launch.selected_backend("triton"):
            if case == "train":
                model.train()
                parts = {"forward": lambda: torch.nn.functional.cross_entropy(model(x), y)}
                parts["backward"] = lambda loss: (loss.backward(), model.zero_grad(set_to_none=True))
            else:
                fused = fuse(model.eval())
                parts = {"forward": lambda: fused(x)}
            times = {k: 0.0 for k in parts}
            launches = 0
            for i in range(steps + 2):  # two warm-up steps (first-call imports and caches)
                if i == 2:  # objects alive now leave the collections: a full one's pause is not the ops'
                    gc.collect()
                    gc.freeze()
                counter.launches = 0
                with torch.inference_mode(case == "infer"):
                    t0 = time.perf_counter()
                    out = parts["forward"]()
                    t1 = time.perf_counter()
                    if case == "train":
                        parts["backward"](out)
                        t2 = time.perf_counter()
                if i < 2:
                    continue
                times["forward"] += t1 - t0
                if case == "train":
                    times["backward"] += t2 - t1
                launches += counter.launches
    finally:
        _launch.launchable = saved
    ms = {k: round(v * 1e3 / steps, 2) for k, v in times.items()}
    total = sum(ms.values())
    per = launches / steps
    return {"case": case, "model": model_name, "batch": batch, "img": img, "steps": steps, "host_ms": ms,
            "host_ms_total": round(total, 2), "launches_per_step": per,
            "host_us_per_launch": round(1e3 * total / per, 1) if per else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=2, help="small: the CPU work left counts in the figure")
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: one host thread)")
    p.add_argument("--out", default=None, help="folder for a JSON record")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path on CPU tensors (its launches skipped)
    import torch

    torch.set_num_threads(args.threads)
    results = []
    for case in args.cases.split(","):
        if case not in CASES:
            print(f"host_time: unknown case {case!r} (expected {', '.join(CASES)})", file=sys.stderr)
            return 2
        r = measure(case, args.model, args.batch, args.img_size, args.steps)
        results.append(r)
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["host_ms"].items())
        print(f"{case} {args.model} b{args.batch} {args.img_size}x{args.img_size}: host "
              f"{r['host_ms_total']:.1f} ms per step ({parts}); {r['launches_per_step']:.0f} launches, "
              f"{r['host_us_per_launch']} us of host time per launch", flush=True)
    if args.out:
        from convfirstnet.analysis.provenance import command_line, device_info, git_info, software_info

        now = datetime.datetime.now(datetime.timezone.utc)
        command = command_line("python scripts/host_time.py", sys.argv[1:] if argv is None else argv)
        record = {"schema": 1, "mode": "host-time", "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "command": command, "git": git_info(), "device": device_info(torch.device("cpu")),
                  "software": software_info(),
                  "note": "launches replaced by a counter; Triton's own launch call per kernel not included",
                  "results": results}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out, f"{now.strftime('%Y%m%dT%H%M%SZ')}_cpu_host-time_{args.model}.json")
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
