"""The group-width-8 3x3 conv op on a GPU: ``python scripts/gpu_gconv.py [--model small]``.

Times, at every stride-1 shape of a model's training step (``kernels/gconv/launcher.py`` MODEL_SHAPES,
scaled to ``--img-size``; batch 128, fp16 activations, fp32 master weights as under autocast):

- ``forward``: ``torch.ops.convfirstnet.gconv3x3`` (the MBConv backward's recompute of the conv output,
  and the drop-in ``GroupConv3x3``), and cuDNN's grouped ``F.conv2d`` on the same tensors;
- ``backward``: ``torch.ops.convfirstnet.gconv3x3_backward`` (dgrad and wgrad from one read of dy, with
  its deterministic reduction), and cuDNN's ``convolution_backward`` (dgrad + wgrad);

each Triton case with the tap pairs in order 0 (shipped before) and in the conflict-free order for the
installed Triton (``launcher.TAP_ORDER = None``, shipped on the H200's measurement of the same change in
the MBConv conv; this run is its check), and the forward once more with one tile per program
(``launcher.FWD_MAX_TPP = 1``, shipped before the tile loop, which the static model ranks slower in its
wait term and faster in its L1-pipe and latency terms; this run decides), and the forward and backward
once more on the 16 KB tap pairs shipped before ``launcher.FWD_TILE_ELEMS`` (64 pixels a tile at G = 8;
the static model ranks the 32 KB pairs faster in its wait and stall terms; this run decides), every
output checked against cuDNN's. Per case: the median of
``--iters`` timed calls (CUDA events, after ``--warmup``) and the bandwidth of its compulsory DRAM bytes
(forward: x and y; backward: dy, x and dx, once each). Writes a JSON record to ``--out-dir``
(default benchmarks/results/). On a machine without CUDA it says what it would run and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL_BACKWARD_BLOCK_M = {8: 64, 4: 64, 2: 128}  # the fused backward's tiles before the 32 KB tap pairs
KNOBS = ("TAP_ORDER", "FWD_MAX_TPP", "FWD_TILE_ELEMS", "BACKWARD_MAX_BLOCK_M")  # what a case sets


def shapes(model: str, img: int) -> list[tuple[int, int]]:
    from convfirstnet.kernels.gconv.launcher import MODEL_SHAPES

    return [(c, hw * img // 224) for c, hw in MODEL_SHAPES[model]]


def time_ms(fn, warmup: int, iters: int) -> float:
    import torch

    from convfirstnet.commands._timing import summarize, time_iterations

    return summarize(time_iterations(fn, torch.device("cuda"), warmup, iters))["median"]


def run(args) -> list[dict]:
    import torch

    from convfirstnet.kernels._launch import conflict_free_tap_order

    rows = []
    for c, hw in shapes(args.model, args.img_size):
        rows += time_shape(args, c, hw, [0, conflict_free_tap_order()])
        torch.cuda.empty_cache()
    return rows


def time_shape(args, c: int, hw: int, orders: list[int]) -> list[dict]:
    """The cases of one (channels, map) shape (module docstring)."""
    import torch
    import torch.nn.functional as F

    from convfirstnet.kernels.gconv import launcher

    ops = torch.ops.convfirstnet
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, c, hw, hw, device="cuda", generator=g).half()
    x = x.contiguous(memory_format=torch.channels_last)
    dy = torch.randn_like(x)
    w = torch.randn(c, 8, 3, 3, device="cuda", generator=g) / 72**0.5
    w16 = w.half()
    one = [1, 1]

    def cudnn_fwd():
        return F.conv2d(x, w16, None, 1, 1, 1, c // 8)

    def cudnn_bwd():
        return torch.ops.aten.convolution_backward(dy, x, w16, None, one, one, one, False, [0, 0], c // 8,
                                                   [True, True, False])

    y_ref = cudnn_fwd()
    dx_ref, dw_ref, _ = cudnn_bwd()

    def fwd():
        return ops.gconv3x3(x, w, 1, True)

    def bwd():
        return ops.gconv3x3_backward(dy, x, w, True)

    # (op, impl, tap order, FWD_MAX_TPP (None: as shipped), 16 KB tiles, function, tensors moved)
    cases = [("forward", "cudnn", None, None, False, cudnn_fwd, 2),
             ("backward", "cudnn", None, None, False, cudnn_bwd, 3)]
    for order in orders:
        cases += [("forward", "triton", order, None, False, fwd, 2),
                  ("backward", "triton", order, None, False, bwd, 3)]
    cases.append(("forward", "triton", orders[-1], 1, False, fwd, 2))
    cases += [("forward", "triton", orders[-1], None, True, fwd, 2),
              ("backward", "triton", orders[-1], None, True, bwd, 3)]
    rows = []
    for op, impl, order, max_tpp, small, fn, tensors in cases:
        saved = {k: getattr(launcher, k) for k in KNOBS}
        if order is not None:
            launcher.TAP_ORDER = order
        if max_tpp is not None:
            launcher.FWD_MAX_TPP = max_tpp
        if small:  # the 16 KB tap pairs shipped before FWD_TILE_ELEMS (64 pixels at G = 8)
            launcher.FWD_TILE_ELEMS = launcher.TILE_ELEMS
            launcher.BACKWARD_MAX_BLOCK_M = SMALL_BACKWARD_BLOCK_M
        try:
            err = 0.0
            if impl == "triton":  # a check against cuDNN, not the rounding bound (the GPU tests'): a
                # wrong kernel errs by whole elements, far above fp16 rounding and cuDNN's fp16 wgrad
                out = fn()
                got = (out,) if op == "forward" else out[:2]
                want = (y_ref,) if op == "forward" else (dx_ref, dw_ref)
                err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in
                          zip(got, want))
            ms = time_ms(fn, args.warmup, args.iters)
        finally:
            for k, v in saved.items():
                setattr(launcher, k, v)
        gbs = tensors * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
        rows.append(dict(op=op, impl=impl, tap_order=order, max_tiles_per_program=max_tpp, tiles_16kb=small,
                         channels=c, size=hw, batch=args.batch, ms=ms, gb_per_s=gbs, max_rel_err=err,
                         status="ok" if err <= 2e-2 else "mismatch"))
        label = impl if order is None else f"{impl} taps {order}"
        label += "" if max_tpp is None else f" tpp {max_tpp}"
        label += " 16KB" if small else ""
        print(f"  C {c:5d} {hw:3d}x{hw:<3d} {op:8s} {label:16s} {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s  "
              f"err {err:.1e}", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=("pico", "nano", "tiny", "small"))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--img-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    import convfirstnet  # noqa: F401  (registers the ops)

    if not torch.cuda.is_available():
        print(f"[gpu_gconv] no CUDA device: would time the group-width-8 conv (forward and fused backward, "
              f"tap orders 0 and conflict-free, the forward also at one tile per program, both also on the "
              f"16 KB tap pairs shipped before, against cuDNN) of "
              f"{args.model} at "
              f"{', '.join(f'C {c} {s}x{s}' for c, s in shapes(args.model, args.img_size))}, batch "
              f"{args.batch}, fp16")
        return 0
    from convfirstnet.analysis.provenance import command_line, device_info, git_info, software_info

    now = _dt.datetime.now(_dt.timezone.utc)
    rows = run(args)
    record = dict(schema=1, mode="gconv", date=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                  command=command_line("python scripts/gpu_gconv.py", list(argv or sys.argv[1:])),
                  git=git_info(), device=device_info(torch.device("cuda")), software=software_info(),
                  settings=dict(model=args.model, batch=args.batch, img_size=args.img_size, dtype="float16",
                                weights="float32", warmup=args.warmup, iters=args.iters, timer="cuda-events"),
                  results=rows)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = record["date"].replace("-", "").replace(":", "")[:15]
    name = f"{stamp}Z_{record['device']['name'].split()[-1].lower()}_float16_{args.model}_gconv.json"
    (out / name).write_text(json.dumps(record, indent=1) + "\n")
    print(f"[gpu_gconv] record: {out / name}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
