"""Variants of the MBConv kernels' launch constants at one of Small's blocks, each timed on a GPU beside
the static model's prediction: ``python scripts/gpu_variants.py [--block stages.3.1]``.

On an H200 (Triton 3.6) the 16x16 stride-1 MBConv block measured 0.427 ms with 16-warp hidden
programs, 0.403 with 8 (loading the conv's tap pairs one dot ahead changed nothing measurable, 0.427
against 0.429 "pairs not ahead"), 0.321 with the conflict-free tap order and 0.311 with it and the
fitted L1 carve-out, both now shipped ("taps 0", "L1 carveout triton": the orders before), against 0.350
for ``torch.compile``'s layer-wise code. ``--block model`` times the whole of Small. Each variant
overrides constants of ``kernels/mbconv/launcher.py`` (warps, hidden channels per chunk, resident x
tile or tiled items, the conv's load order) or of another kernels module (``"_carveout.POLICY"``: the
L1 / shared split of every kernel) for one run; per variant it prints and records:
- the static prediction of the block (``build_report``, low-high, CUDA graphs), computed on the CPU;
- on a GPU: the block alone in a CUDA graph (``convfirstnet bench``'s ``run_case``), and its output
  against the fused op's PyTorch reference on the same input (max |error| / max |reference|; fp16);
- a variant that does not compile, or does not fit, says why and the run goes on.
Without a GPU it prints the predictions only. ``--out DIR`` writes one JSON record of the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import block_inputs, overridden  # noqa: E402

BATCH, IMG = 128, 256
VARIANTS = {  # name -> overrides of kernels/mbconv/launcher.py's constants
    "shipped": {},
    "pairs not ahead": {"PAIRS_AHEAD": False},  # the conv's tap pairs loaded just before their dots
    "hidden 16 warps": {"HIDDEN_WARPS": 16},  # shipped until measured slower (0.426 against 0.403 ms)
    "RB 32": {"RB": 32},
    "hidden 16 warps + RB 32": {"HIDDEN_WARPS": 16, "RB": 32},
    "hidden 4 warps": {"HIDDEN_WARPS": 4},
    # items of one image and one chunk, x streamed per chunk instead of resident (XM below every map)
    "tiled 16 warps": {"XM": 16},
    "tiled 8 warps": {"XM": 16, "HIDDEN_WARPS_TILED": 8},
    "tiled 4 warps": {"XM": 16, "HIDDEN_WARPS_TILED": 4},
    # every kernel's L1 / shared split as Triton's loader leaves it (28 KB of L1 to any kernel over 48 KB of
    # shared memory) instead of the smallest carve-out that holds its programs (kernels/_carveout.py)
    "L1 carveout triton": {"_carveout.POLICY": "triton"},
    # the conv's tap pairs loaded in a given order (launcher.TAP_ORDER; the shipped None takes the one
    # whose copies to shared memory are free of bank conflicts with this Triton: 1 on 3.6, 2 on 3.8)
    "taps 0": {"TAP_ORDER": 0},
    "taps 1": {"TAP_ORDER": 1},
    "taps 2": {"TAP_ORDER": 2},
    # the ConvFirst stride-1 conv's tap pairs in order 0, shipped before the conflict-free order
    # (kernels/convfirst/launcher.py TAP_ORDER None): with "convfirst fused" at a ConvFirst block (--block
    # stages.1.1) or the model; the shipped conv + FFN launches do not run that conv
    "convfirst taps 0": {"convfirst.launcher.TAP_ORDER": 0, "convfirst.launcher.STAGED": False},
    # stride-1 ConvFirst blocks as the fused kernel instead of the conv + FFN launches (kernels/convfirst/
    # launcher.py STAGED; shipped: staged for 16-bit)
    "convfirst fused": {"convfirst.launcher.STAGED": False},
    # the staged ConvFirst FFN where every hidden chunk is resident (C <= 64) without the software-pipelined
    # tile loop, two programs per SM (kernels/convfirst/staged.py RESIDENT_STAGES; shipped: 3 stages, one)
    "ffn unpipelined": {"convfirst.staged.RESIDENT_STAGES": 1},
    # the group-width-8 conv on 8x8 and 7x7 maps with G = 8 (64-pixel tiles) instead of G = 16
    # (kernels/gconv/launcher.py SMALL_MAP_G16): --block stages.4.1
    "conv G 8 small maps": {"gconv.launcher.SMALL_MAP_G16": False},
    # the ConvFirst blocks' conv forward without the register limit (kernels/gconv/launcher.py FWD_MAXNREG;
    # Triton 3.8 then takes 167 registers at 64 channels 64x64, Triton 3.6 255 either way): --block stages.1.1
    "conv no register limit": {"gconv.launcher.FWD_MAXNREG": None},
    # 128-pixel conv tiles (32 KB tap pairs) at 16x16 stride 1 and in tiled programs: the static model's
    # high end ranks them faster through its wait term only (kernels/mbconv/launcher.py WIDE_CONV_TILES)
    "conv tiles 128": {"WIDE_CONV_TILES": True},
    # the block as the staged launches (kernels/mbconv/staged.py; h and g through DRAM) or as the hidden
    # kernel (launcher.STAGED; shipped: staged wherever the expand's 32-bit offsets hold)
    "staged": {"STAGED": True},
    "hidden": {"STAGED": False},
}


def block_of(path: str):
    """(Small's block at ``path`` as a one-block Sequential, its input shape at batch 128, 256x256);
    ``model``: the whole of Small and its input."""
    import torch.nn as nn

    from convfirstnet.factory import create_model

    if path == "model":
        return create_model("small"), (BATCH, 3, IMG, IMG)

    model = create_model("small")
    shape = block_inputs(create_model("small"), BATCH, IMG)[path]
    return nn.Sequential(model.get_submodule(path)), shape


def predict(seq, shape) -> dict:
    from convfirstnet.analysis.report import build_report

    rep = build_report(seq, tuple(shape[1:]), batch=shape[0], arch=90, name="block")
    return dict(low=rep["predicted_low_ms"], high=rep["predicted_high_ms"],
                launches=[dict(kernel=e["kernel"].split(".")[-1], warps=e["num_warps"],
                               us_high=e["predicted_us"]["high"]) for e in rep["launches"]])


def measure(seq, shape) -> dict:
    import torch
    from convfirstnet.kernels._launch import selected_backend

    from convfirstnet.commands.bench import _to, run_case
    from convfirstnet.factory import fuse

    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    fused = _to(fuse(seq), torch.device("cuda"), torch.float16, channels_last=False)
    with torch.no_grad(), selected_backend("auto"):
        out = fused(x).float()
    with torch.no_grad(), selected_backend("reference"):
        ref = fused(x).float()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    row = run_case("fused-cudagraph", seq, True, x, 10, 50)
    return dict(status=row.get("status"), ms=row.get("times_ms", {}).get("median"), max_rel_error=err,
                reason=row.get("reason"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", default="stages.3.1", help="a module path of Small (default stages.3.1), or model")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    p.add_argument("--skip-predict", action="store_true",
                   help="time only (the predictions compile on the CPU: minutes of a short GPU job)")
    p.add_argument("--out", default=None, help="folder for the JSON record")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        print(f"gpu_variants: error: unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 1
    seq, shape = block_of(args.block)
    gpu = torch.cuda.is_available()
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = dict(variant=name, overrides=VARIANTS[name])
        try:
            with overridden(VARIANTS[name]):
                if not args.skip_predict:
                    row["predicted_ms"] = predict(seq, shape)
                if gpu:
                    row["measured"] = measure(seq, shape)
        except Exception as e:  # a variant that does not compile or fit: say why, go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        pr, me = row.get("predicted_ms"), row.get("measured") or {}
        text = f"predicted {pr['low']:.3f}-{pr['high']:.3f} ms" if pr else "no prediction"
        if me.get("ms"):
            text += f", measured {me['ms']:.3f} ms, max rel error {me['max_rel_error']:.1e}"
        elif me:
            text += f", not measured ({me.get('reason')})"
        print(f"{args.block} {name}: {text}" + (f"; {row['error']}" if "error" in row else ""), flush=True)
    if args.out:
        from convfirstnet.analysis.provenance import device_info

        Path(args.out).mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dev = device_info(torch.device("cuda")) if gpu else dict(type="cpu")
        command = "python scripts/gpu_variants.py " + " ".join(sys.argv[1:] if argv is None else argv)
        rec = dict(mode="variants", date=stamp, command=command, block=args.block, shape=list(shape),
                   device=dev, variants=rows,
                   versions=dict(torch=torch.__version__, triton=__import__("triton").__version__))
        path = Path(args.out) / f"{stamp}_variants_{args.block}.json"
        path.write_text(json.dumps(rec, indent=1))
        print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
