"""Checkpoints: the initial weights (--pretrained, --initial-checkpoint), the checkpoint to resume from
and its state, timm's ``CheckpointSaver`` with this command's extra state, and the final weight file."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from .options import TrainError

if TYPE_CHECKING:
    from .prepare import Run

CHECKPOINT_EXT = ".pth.tar"  # timm CheckpointSaver's extension
# The checkpoints a run writes: timm CheckpointSaver's last, model_best, checkpoint-<epoch>,
# recovery-<epoch>-<step> and the temporary files it renames from.
CHECKPOINT_NAME = re.compile(r"(last|model_best|tmp|recovery_tmp|checkpoint-\d+|recovery-\d+-\d+)\.pth\.tar")


class TrainState:
    """Checkpoint contents beyond timm's defaults, given to ``CheckpointSaver`` through its ``task`` hook.

    The saver stores what this returns next to the optimizer, GradScaler, args and epoch: the model and EMA
    state dicts (under timm's keys), the scheduler state and ``position``, where training continues.
    """

    def __init__(self, model: nn.Module, model_ema: nn.Module | None, scheduler: Any):
        self.model, self.model_ema, self.scheduler = model, model_ema, scheduler
        self.epoch = self.step_in_epoch = self.global_step = 0

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step}

    def get_checkpoint_state(self, ema: bool = False, unwrap_fn=None) -> dict[str, Any]:
        from timm.utils import get_state_dict, unwrap_model

        unwrap_fn = unwrap_fn or unwrap_model
        if ema:
            return (
                {}
                if self.model_ema is None
                else {"state_dict_ema": get_state_dict(self.model_ema, unwrap_fn)}
            )
        return {
            "state_dict": get_state_dict(self.model, unwrap_fn),
            "scheduler": self.scheduler.state_dict(),
            "position": self.position(),
        }


def checkpoint_position(path: Path) -> dict[str, int] | None:
    """``position`` of a checkpoint written by this script (None for another file)."""
    from timm.utils import load_checkpoint_metadata

    try:
        meta = load_checkpoint_metadata(str(path))
    except Exception:  # unreadable or partial file: not a candidate
        return None
    return meta.get("position") if isinstance(meta, dict) else None


def find_resume(resume: str, output: Path) -> Path | None:
    """The checkpoint to resume from: a path, or for 'auto' the most advanced one in ``output``."""
    if not resume:
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_file():
            raise TrainError(f"--resume {resume!r} does not exist")
        return path
    best, best_key = None, None
    for path in output.glob(f"*{CHECKPOINT_EXT}"):
        if not (path.name == "last" + CHECKPOINT_EXT or path.name.startswith("recovery-")):
            continue
        pos = checkpoint_position(path)
        if pos is None:
            continue
        key = (pos["global_step"], path.name == "last" + CHECKPOINT_EXT)  # a tie goes to the epoch checkpoint
        if best_key is None or key > best_key:
            best, best_key = path, key
    return best


def check_resume_file(path: Path) -> None:
    """A ``--resume`` path must be a training checkpoint (one line instead of a pickle error)."""
    from timm.utils import load_checkpoint_metadata

    from convfirstnet.weights import file_format

    if file_format(path) != "torch":
        raise TrainError(f"--resume {str(path)!r} is not a training checkpoint (torch.save file)")
    try:
        meta = load_checkpoint_metadata(str(path))
    except Exception as e:  # pickle, zip and weights_only errors
        raise TrainError(f"--resume {str(path)!r} cannot be read ({type(e).__name__})") from e
    if not isinstance(meta, dict) or "state_dict" not in meta or "optimizer" not in meta:
        raise TrainError(
            f"--resume {str(path)!r} is not a training checkpoint (no state_dict and optimizer); to start "
            "from its weights use --initial-checkpoint"
        )


def initial_weights(args: argparse.Namespace, name: str):
    """The checkpoint to start from (``--pretrained`` / ``--initial-checkpoint``), checked; or None."""
    from convfirstnet.weights import (
        WeightsNotFoundError,
        read_checkpoint,
        resolve_architecture,
        resolve_weights,
    )

    if args.pretrained:
        try:
            path = resolve_weights(name)
        except WeightsNotFoundError as e:
            raise TrainError(f"--pretrained: {e} Or start from a file with --initial-checkpoint PATH.") from e
    elif args.initial_checkpoint is not None:
        path = args.initial_checkpoint
    else:
        return None
    ckpt = read_checkpoint(path, use_ema=True)  # timm's load_checkpoint prefers EMA weights too
    resolve_architecture(ckpt, name)  # a file recorded as another size is an error
    return ckpt


def write_weights(checkpoint: Path, path: Path, name: str, ema: bool = True) -> dict[str, Any]:
    """The checkpoint's EMA weights (the raw weights of a run without EMA) as a verified weight file, by
    ``convert_checkpoint`` (replacing the file of an earlier run in the same folder); prints and returns
    the ``weights/manifest.json`` entry."""
    from convfirstnet.kernels._launch import selected_backend

    from ..convert import convert_checkpoint

    which = "EMA weights" if ema else "weights"
    # the file is verified on CPU tensors, where the run's --kernels triton (CONVFIRSTNET_KERNELS, set for
    # the whole run) would need Triton's interpreter: the reference there
    with selected_backend("reference"):
        entry = convert_checkpoint(
            checkpoint, path, name, source=f"convfirstnet train, {which} of {checkpoint.name}", overwrite=True
        )
    print(
        f'wrote {path}\nmanifest entry (weights/manifest.json, "models"):\n'
        + json.dumps({entry["name"]: entry}, indent=2),
        flush=True,
    )
    return entry


def restore(run: Run, state: TrainState) -> None:
    """Load ``run.resume_path`` (model, EMA, optimizer, GradScaler, scheduler) and set ``state`` to where
    it stopped; a timm checkpoint without ``position`` continues after its epoch."""
    from timm.models import load_checkpoint, resume_checkpoint
    from timm.utils import load_checkpoint_metadata

    path = run.resume_path
    resume_checkpoint(run.model, str(path), run.optimizer, run.loss_scaler, log_info=False)
    if run.model_ema is not None:
        load_checkpoint(run.model_ema.module, str(path), use_ema=True)
    meta = load_checkpoint_metadata(str(path))
    if "scheduler" in meta:
        run.scheduler.load_state_dict(meta["scheduler"])
    pos = meta.get("position") or {
        "epoch": meta.get("epoch", -1) + 1,
        "step_in_epoch": 0,
        "global_step": (meta.get("epoch", -1) + 1) * run.steps_per_epoch,
    }
    state.epoch, state.step_in_epoch, state.global_step = (
        pos["epoch"],
        pos["step_in_epoch"],
        pos["global_step"],
    )


def make_saver(args: argparse.Namespace, run: Run, state: TrainState, saved_args: argparse.Namespace):
    """timm's ``CheckpointSaver`` into the output folder, storing ``state`` with each checkpoint; on resume
    it takes over the ranking of the best checkpoints from ``last.pth.tar``."""
    from timm.utils import CheckpointSaver

    saver = CheckpointSaver(
        run.model,
        run.optimizer,
        args=saved_args,
        model_ema=run.model_ema,
        amp_scaler=run.loss_scaler,
        checkpoint_dir=str(run.output),
        recovery_dir=str(run.output),
        max_history=args.checkpoint_hist,
        task=state,
    )
    last = run.output / ("last" + CHECKPOINT_EXT)
    if run.resume_path is not None and last.is_file():
        saver.load_state_dict_from_checkpoint(str(last))
    return saver
