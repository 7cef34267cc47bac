"""``convfirstnet kernels``: the static cost report of the fused kernels (``convfirstnet.analysis.report``),
compiled for a GPU target on a machine without one."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from convfirstnet.analysis.report import DTYPES, FORMAT, build_report, diagnosis, to_markdown
from convfirstnet.analysis.targets import TARGETS, target as get_target
from convfirstnet.factory import create_model
from convfirstnet.registry import canonical_name

from ._cli import ArgumentParser, report as report_error


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="convfirstnet kernels",
        description="Static cost report of the fused Triton kernels: record the launches the fused model "
        "makes, compile each distinct variant for a GPU target (no GPU needed) and estimate per variant, "
        "block, stage and model: registers, spills, occupancy, MMA kind, SASS instruction mix, issued vs "
        "useful tensor-core work, and every time term (tensor core, DRAM, L2, issue, latency, waits, launch "
        "gap; low/high) beside the layer-wise bound. Estimates, not measurements.",
    )
    p.add_argument("--model", default="small", help="pico|nano|tiny|small or convfirstnet_* (default small)")
    p.add_argument("--batch", type=int, default=128, help="batch size (default 128, as the paper)")
    p.add_argument("--img-size", type=int, default=256, help="input resolution (default 256)")
    p.add_argument("--dtype", default="float16", choices=sorted(DTYPES), help="activations and weights")
    p.add_argument(
        "--arch", default="sm_90", help=f"target: {', '.join(f'sm_{a}' for a in TARGETS)} (default sm_90)"
    )
    p.add_argument("--json", default=None, help="write the full report as JSON here")
    p.add_argument("--markdown", default=None, help="write the Markdown report here")
    p.add_argument(
        "--jobs", type=int, default=None, help="compile worker processes (default 2 or the CPU count)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--diagnosis",
        default=None,
        metavar="OUT.md",
        help="also write the per-block diagnosis (what binds, the redesign targets) as Markdown here",
    )
    p.add_argument(
        "--train",
        action="store_true",
        help="one training step (forward + backward) instead of inference: the fused training blocks' "
        "launches against the layer-wise training bound, and the activation bytes stored for the backward "
        "(convfirstnet/analysis/training.py)",
    )
    p.add_argument(
        "--render",
        default=None,
        metavar="JSON",
        help="only print (and --markdown) the Markdown of a saved report; nothing is compiled",
    )
    return p


def _error(e: BaseException) -> int:
    return report_error("convfirstnet kernels", e)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # Triton 3.9's default, stated (as the compile workers do) so that binding launches does not warn
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    if args.render:
        try:
            rep = json.loads(Path(args.render).read_text())
            if not isinstance(rep, dict) or rep.get("format") != FORMAT:
                raise ValueError(f"{args.render} is not a report of `convfirstnet kernels --json` ({FORMAT})")
            text = to_markdown(rep)
        except (OSError, json.JSONDecodeError, ValueError) as e:
            return _error(e)
        print(text, end="")
        if args.markdown:
            Path(args.markdown).write_text(text)
        if args.diagnosis:
            Path(args.diagnosis).write_text(diagnosis(rep))
        return 0
    try:
        name = canonical_name(args.model)
        get_target(args.arch)
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
        if args.img_size < 32:
            raise ValueError(f"--img-size must be at least 32 (five stride-2 stages), got {args.img_size}")
        model = create_model(name)
        if args.train:
            return _train_report(model, name, args, argv, say)
        rep = build_report(
            model,
            (model.in_chans, args.img_size, args.img_size),
            batch=args.batch,
            dtype=args.dtype,
            arch=args.arch,
            jobs=args.jobs,
            progress=say,
            name=name,
        )
    except (ValueError, RuntimeError) as e:
        # bad arguments, a model that cannot be recorded, declarations that do not match the compiled
        # code, a variant that does not compile: one line, status 1 (the commands' convention)
        return _error(e)
    rep["command"] = "convfirstnet kernels " + shlex.join(argv)
    text = to_markdown(rep)
    print(text, end="")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
        say(f"JSON: {args.json}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
        say(f"Markdown: {args.markdown}")
    if args.diagnosis:
        Path(args.diagnosis).parent.mkdir(parents=True, exist_ok=True)
        Path(args.diagnosis).write_text(diagnosis(rep))
        say(f"diagnosis: {args.diagnosis}")
    return 0


def _train_report(model, name: str, args, argv: list[str], say) -> int:
    from convfirstnet.analysis.training import build_training_report, to_markdown as train_markdown

    if args.diagnosis or args.render:
        raise ValueError("--diagnosis and --render apply to the inference report, not to --train")
    rep = build_training_report(model, (model.in_chans, args.img_size, args.img_size), batch=args.batch,
                                dtype=args.dtype, arch=args.arch, jobs=args.jobs, progress=say, name=name)
    rep["command"] = "convfirstnet kernels " + shlex.join(argv)
    text = train_markdown(rep)
    print(text, end="")
    for path, content in ((args.json, json.dumps(rep, indent=1) + "\n"), (args.markdown, text)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
            say(f"written: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
