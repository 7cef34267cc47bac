"""``convfirstnet train``: prepare the run, then train in the output folder; a run that fails before its
first checkpoint removes what it created."""

from __future__ import annotations

import argparse
import contextlib

from .._cli import CreatedDirs, run_reporting
from .checkpoints import CHECKPOINT_EXT
from .loop import run_training
from .options import build_parser
from .output import RUN_FILES, run_files
from .prepare import prepare


@contextlib.contextmanager
def kernels_backend(kernels: str):
    """The backend switch of the fused ops (CONVFIRSTNET_KERNELS, read per call) for the run: ``triton``
    (the training form's blocks with fused training kernels run them) or ``reference`` (every layer in
    PyTorch), restored afterwards."""
    from convfirstnet.kernels._launch import selected_backend

    with selected_backend("triton" if kernels == "triton" else "reference"):
        yield


def train(args: argparse.Namespace) -> int:
    """Train; the output folder is created only after every input was checked, and a run that fails
    before its first checkpoint removes the files and folders it created."""
    run = prepare(args)
    dirs, created = CreatedDirs(), set()
    if run.primary and args.overwrite:
        removed = run_files(run.output, run.name)
        for p in removed:
            p.unlink()
        if removed:
            print(f"--overwrite: removed {len(removed)} file(s) of an earlier run from {run.output}",
                  flush=True)
    if run.primary:
        dirs.make(run.output)
        created = {f for f in RUN_FILES if not (run.output / f).exists()}
    try:
        with kernels_backend(run.kernels):
            return run_training(args, run)
    except BaseException:
        if run.primary and not any(run.output.glob(f"*{CHECKPOINT_EXT}")):
            for f in created:  # nothing to resume from: remove what this run wrote, and its folders
                (run.output / f).unlink(missing_ok=True)
            dirs.remove_empty()
        raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting("convfirstnet train", lambda: train(args))
