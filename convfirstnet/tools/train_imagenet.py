"""Train a ConvFirstNet with the paper's ImageNet recipe (Section 6.3), built from timm's components.

    torchrun --nproc_per_node 8 scripts/train_imagenet.py --model pico --data /data/imagenet --output out/pico
    convfirstnet train --model pico --data /data/imagenet --output out/pico --resume auto   # after a stop

Recipe defaults (paper 6.3, which trained with timm on 8 GPUs x 256 images), flags in brackets:

- 600 epochs [--epochs]; global batch 2048 at lr 0.128, the lr scaled linearly with the global batch
  [--batch-size per process, --lr-base, --lr absolute];
- 3 warm-up epochs [--warmup-epochs], then step decay 0.97 every 2.4 epochs (timm ``step`` scheduler,
  stepped per update) [--decay-epochs, --decay-rate];
- RMSprop with TensorFlow-style epsilon (timm ``rmsproptf``), momentum 0.9, weight decay 1e-5
  [--opt, --momentum, --weight-decay];
- dropout 0.2 Pico / 0.3 others (``SIZES[size].drop_rate``) [--drop], drop-path 0.2 [--drop-path];
- RandAugment ``rand-m9-mstd0.5`` [--aa], random erasing 0.2 in "pixel" mode [--reprob, --remode];
  ``--aug none`` turns all augmentation off;
- EMA of the weights, timm ``ModelEmaV3`` with decay 0.9999 [--ema-decay, --no-ema];
- fp16 autocast + GradScaler on CUDA [--no-amp], channels-last [--no-channels-last];
- training at 224x224 [--img-size], evaluation at the model's ``pretrained_cfg`` size, 256 with
  crop_pct 0.95 [--val-img-size].

Not stated by the paper, taken from timm's EfficientNet recipe (which the paper says inspired its
settings): ``--opt-eps 1e-3``, ``--smoothing 0.1`` (timm ``train.py``'s default), ``--warmup-lr 1e-6``.

Data: an ImageFolder tree with ``train/`` and ``val/`` (or ``validation/``) class folders (timm
``create_dataset``). Several GPUs or nodes: ``torchrun`` (DDP; nccl on CUDA, gloo on CPU).

Output folder: ``last.pth.tar`` (every epoch), ``checkpoint-<epoch>.pth.tar`` (best few by top-1),
``recovery-<epoch>-<step>.pth.tar`` (every ``--recovery-interval`` steps and when ``--max-steps`` stops
the run; removed at the next epoch checkpoint), ``summary.csv`` (timm, one row per epoch), ``log.jsonl``
(loss, lr, img/s, top-1), ``args.json``, and at the end ``<model_name>.safetensors``: the EMA weights,
written by ``convert_checkpoint`` and ready for ``create_model(name, pretrained=True)`` via
``$CONVFIRSTNET_WEIGHTS_DIR``. A checkpoint holds the model, EMA, optimizer, GradScaler and scheduler
states and the position (epoch, step in the epoch, global step); ``--resume auto`` continues from the
most advanced one, mid-epoch included, with the same sample order.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, Subset


class TrainError(Exception):
    """A problem with the command's inputs, reported as one line without a traceback."""


LR_BASE, LR_BASE_SIZE = 0.128, 2048  # paper 6.3: lr 0.128 at a global batch of 2048 (8 x 256)
CHECKPOINT_EXT = ".pth.tar"  # timm CheckpointSaver's extension


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convfirstnet train",
        description="Train a ConvFirstNet with the paper's ImageNet recipe (timm components). Several GPUs: "
        "torchrun --nproc_per_node=N scripts/train_imagenet.py ...",
    )
    p.add_argument("--model", required=True, help="pico, nano, tiny, small (or convfirstnet_<size>)")
    p.add_argument(
        "--data", required=True, type=Path, help="folder with train/ and val/ (ImageFolder layout)"
    )
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="validation", help="timm also finds val/ for 'validation'")
    p.add_argument("--output", type=Path, help="output folder (default: output/train/<model_name>)")
    p.add_argument("--num-classes", type=int, help="default: the number of class folders in the train split")
    g = p.add_argument_group("schedule and optimizer")
    g.add_argument("--epochs", type=int, default=600)
    g.add_argument("--batch-size", type=int, default=256, help="per process; global = batch x world size")
    g.add_argument(
        "--lr", type=float, help="absolute learning rate (default: --lr-base scaled to the global batch)"
    )
    g.add_argument("--lr-base", type=float, default=LR_BASE, help=f"lr at a global batch of {LR_BASE_SIZE}")
    g.add_argument("--warmup-epochs", type=int, default=3)
    g.add_argument("--warmup-lr", type=float, default=1e-6)
    g.add_argument("--decay-epochs", type=float, default=2.4)
    g.add_argument("--decay-rate", type=float, default=0.97)
    g.add_argument("--opt", default="rmsproptf", help="timm optimizer name")
    g.add_argument("--opt-eps", type=float, default=1e-3)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=1e-5)
    g.add_argument("--clip-grad", type=float, help="gradient-norm clipping (off by default)")
    g.add_argument("--smoothing", type=float, default=0.1, help="label smoothing")
    g = p.add_argument_group("regularization and augmentation")
    g.add_argument("--drop", type=float, help="dropout before the classifier (default: 0.2 Pico, 0.3 others)")
    g.add_argument("--drop-path", type=float, default=0.2)
    g.add_argument(
        "--aug",
        choices=("recipe", "none"),
        default="recipe",
        help="none: resize + center crop only, no RandAugment, flips, erasing",
    )
    g.add_argument("--aa", default="rand-m9-mstd0.5", help="timm auto-augment string ('' for none)")
    g.add_argument("--reprob", type=float, default=0.2, help="random-erasing probability")
    g.add_argument("--remode", default="pixel", help="random-erasing mode")
    g.add_argument("--ema", action=argparse.BooleanOptionalAction, default=True, help="EMA of the weights")
    g.add_argument("--ema-decay", type=float, default=0.9999)
    g.add_argument("--ema-warmup", action="store_true", help="ModelEmaV3 decay warm-up (for short runs)")
    g = p.add_argument_group("resolution, device, precision")
    g.add_argument("--img-size", type=int, default=224, help="training size")
    g.add_argument(
        "--val-img-size", type=int, help="evaluation size (default: the model's pretrained_cfg, 256)"
    )
    g.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    g.add_argument(
        "--amp",
        action=argparse.BooleanOptionalAction,
        help="fp16 autocast + GradScaler (default: on with CUDA)",
    )
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--workers", type=int, default=8, help="data-loading processes per training process")
    g.add_argument("--seed", type=int, default=42)
    g = p.add_argument_group("checkpoints, validation, logging")
    g.add_argument("--resume", default="", help="'auto' (the most advanced checkpoint in --output) or a path")
    g.add_argument(
        "--max-steps",
        type=int,
        help="stop after this many optimizer steps in all (a later --resume continues)",
    )
    g.add_argument(
        "--recovery-interval", type=int, default=0, help="also checkpoint every N steps (0: epoch ends only)"
    )
    g.add_argument("--checkpoint-hist", type=int, default=3, help="best epoch checkpoints kept")
    g.add_argument("--val-interval", type=int, default=1, help="validate every N epochs (and after the last)")
    g.add_argument("--log-interval", type=int, default=50, help="steps between log.jsonl records")
    g.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, help="progress bar (default: on a terminal)"
    )
    g.add_argument(
        "--no-weights", action="store_true", help="do not write <model_name>.safetensors at the end"
    )
    return p


def recipe_lr(global_batch: int, lr_base: float = LR_BASE) -> float:
    """The paper's learning rate scaled linearly to ``global_batch`` (0.128 at 2048)."""
    return lr_base * global_batch / LR_BASE_SIZE


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (order fixed by seed + epoch) that can start an epoch after its first steps.

    ``skip`` samples of this rank's shard are dropped, so a run resumed mid-epoch sees exactly the batches
    the interrupted run had not reached, without loading the others.
    """

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


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


def train_transforms(args: argparse.Namespace, data_cfg: dict[str, Any]):
    from timm.data import create_transform

    no_aug = args.aug == "none"
    return create_transform(
        args.img_size,
        is_training=True,
        no_aug=no_aug,
        auto_augment=(args.aa or None) if not no_aug else None,
        re_prob=args.reprob if not no_aug else 0.0,
        re_mode=args.remode,
        interpolation="random" if not no_aug else data_cfg["interpolation"],
        mean=data_cfg["mean"],
        std=data_cfg["std"],
    )


def eval_transforms(data_cfg: dict[str, Any]):
    from timm.data import create_transform

    return create_transform(
        data_cfg["input_size"],
        is_training=False,
        interpolation=data_cfg["interpolation"],
        mean=data_cfg["mean"],
        std=data_cfg["std"],
        crop_pct=data_cfg["crop_pct"],
    )


@torch.no_grad()
def validate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    autocast,
    channels_last: bool,
    distributed: bool,
) -> float:
    """Top-1 in percent over the whole split (exact counts, summed over processes)."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with autocast():
            logits = model(images)
        counts[0] += (logits.argmax(dim=1) == target).sum()
        counts[1] += target.numel()
    if distributed:
        torch.distributed.all_reduce(counts)
    correct, total = counts.tolist()
    return 100.0 * correct / max(total, 1)


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def _log(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train(args: argparse.Namespace) -> int:
    import timm
    from timm.data import create_dataset, resolve_data_config
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.models import load_checkpoint, resume_checkpoint
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import (
        AverageMeter,
        CheckpointSaver,
        ModelEmaV3,
        NativeScaler,
        distribute_bn,
        random_seed,
        reduce_tensor,
        update_summary,
    )
    from timm.utils.distributed import init_distributed_device_so
    from tqdm import tqdm

    import convfirstnet  # noqa: F401  (registers the models with timm)
    from convfirstnet.factory import _canonical
    from convfirstnet.model import SIZES

    name = _canonical(args.model)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda, but no CUDA device is available")
    dist_info = init_distributed_device_so(
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(dist_info["device"])
    rank, world_size, distributed = (
        dist_info["global_rank"],
        dist_info["world_size"],
        dist_info["distributed"],
    )
    primary = rank == 0
    use_amp = device.type == "cuda" if args.amp is None else args.amp
    if use_amp and device.type != "cuda":
        raise TrainError("--amp (fp16 + GradScaler) needs CUDA; use --no-amp on CPU")
    output = args.output or Path("output") / "train" / name
    output.mkdir(parents=True, exist_ok=True)
    random_seed(args.seed, rank)

    # data ---------------------------------------------------------------------------------------
    if not args.data.is_dir():
        raise TrainError(f"--data {str(args.data)!r} is not a directory")
    try:
        train_set = create_dataset("", root=str(args.data), split=args.train_split, is_training=True)
        val_set = create_dataset("", root=str(args.data), split=args.val_split)
    except RuntimeError as e:  # timm: "Found 0 images in subfolders of ..."
        raise TrainError(
            f"no {args.train_split}/{args.val_split} images under {str(args.data)!r}: {e}"
        ) from e
    num_classes = args.num_classes or len(train_set.reader.class_to_idx)

    # model, optimizer, schedule, EMA --------------------------------------------------------------
    size = name.removeprefix("convfirstnet_")
    drop = SIZES[size].drop_rate if args.drop is None else args.drop
    model = timm.create_model(name, num_classes=num_classes, drop_rate=drop, drop_path_rate=args.drop_path)
    data_cfg = resolve_data_config(model=model)
    if args.val_img_size:
        data_cfg["input_size"] = (3, args.val_img_size, args.val_img_size)
    model.to(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if args.channels_last:
        model.to(memory_format=torch.channels_last)

    global_batch = args.batch_size * world_size
    lr = args.lr if args.lr is not None else recipe_lr(global_batch, args.lr_base)
    optimizer = create_optimizer_v2(
        model, opt=args.opt, lr=lr, weight_decay=args.weight_decay, momentum=args.momentum, eps=args.opt_eps
    )
    loss_scaler = NativeScaler(device="cuda") if use_amp else None
    model_ema = ModelEmaV3(model, decay=args.ema_decay, use_warmup=args.ema_warmup) if args.ema else None

    train_set.transform = train_transforms(args, data_cfg)
    val_set.transform = eval_transforms(data_cfg)
    sampler = ResumableSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    steps_per_epoch = sampler.num_samples // args.batch_size
    if steps_per_epoch == 0:
        raise TrainError(
            f"{len(train_set)} training images per process are fewer than one batch ({args.batch_size})"
        )
    loader_kw = dict(
        num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0
    )
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, **loader_kw
    )
    val_loader = DataLoader(
        Subset(val_set, range(rank, len(val_set), world_size)),
        batch_size=args.batch_size,
        shuffle=False,
        **loader_kw,
    )

    scheduler, num_epochs = create_scheduler_v2(
        optimizer,
        sched="step",
        num_epochs=args.epochs,
        decay_epochs=args.decay_epochs,
        decay_rate=args.decay_rate,
        warmup_epochs=args.warmup_epochs,
        warmup_lr=args.warmup_lr,
        step_on_epochs=False,
        updates_per_epoch=steps_per_epoch,
    )
    state = TrainState(model, model_ema, scheduler)

    # resume -------------------------------------------------------------------------------------
    resume_path = find_resume(args.resume, output)
    if resume_path is not None:
        resume_checkpoint(model, str(resume_path), optimizer, loss_scaler, log_info=False)
        if model_ema is not None:
            load_checkpoint(model_ema.module, str(resume_path), use_ema=True)
        from timm.utils import load_checkpoint_metadata

        meta = load_checkpoint_metadata(str(resume_path))
        if "scheduler" in meta:
            scheduler.load_state_dict(meta["scheduler"])
        pos = meta.get("position") or {
            "epoch": meta.get("epoch", -1) + 1,
            "step_in_epoch": 0,
            "global_step": (meta.get("epoch", -1) + 1) * steps_per_epoch,
        }
        state.epoch, state.step_in_epoch, state.global_step = (
            pos["epoch"],
            pos["step_in_epoch"],
            pos["global_step"],
        )
        if primary:
            print(
                f"resumed from {resume_path}: epoch {state.epoch}, step {state.step_in_epoch} of "
                f"{steps_per_epoch}, global step {state.global_step}",
                flush=True,
            )
    elif args.resume == "auto" and primary:
        print(f"--resume auto: no checkpoint in {output}, starting from scratch", flush=True)
    scheduler.step_update(num_updates=state.global_step)

    saver = None
    if primary:
        # Plain types only in the saved args, so the checkpoints load with torch.load(weights_only=True).
        saved_args = argparse.Namespace(**_plain(vars(args)))
        saver = CheckpointSaver(
            model,
            optimizer,
            args=saved_args,
            model_ema=model_ema,
            amp_scaler=loss_scaler,
            checkpoint_dir=str(output),
            recovery_dir=str(output),
            max_history=args.checkpoint_hist,
            task=state,
        )
        last = output / ("last" + CHECKPOINT_EXT)
        if resume_path is not None and last.is_file():
            saver.load_state_dict_from_checkpoint(str(last))
        (output / "args.json").write_text(json.dumps(_plain(vars(args)), indent=2) + "\n")
        print(
            f"{name}: {num_classes} classes, {len(train_set)} training images, {world_size} process(es) on "
            f"{device.type}, global batch {global_batch}, lr {lr:g}, {steps_per_epoch} steps/epoch, "
            f"{num_epochs} epochs, dropout {drop:g}, drop-path {args.drop_path:g}, amp {use_amp}, "
            f"output {output}",
            flush=True,
        )

    train_model = model
    if distributed:
        train_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    train_loss_fn = (
        LabelSmoothingCrossEntropy(args.smoothing) if args.smoothing > 0 else nn.CrossEntropyLoss()
    )

    def autocast():
        return torch.autocast("cuda", dtype=torch.float16) if use_amp else nullcontext()

    log_path = output / "log.jsonl"
    show_progress = primary and (sys.stderr.isatty() if args.progress is None else args.progress)
    stopped = False

    # train --------------------------------------------------------------------------------------
    for epoch in range(state.epoch, num_epochs):
        first_step = state.step_in_epoch if epoch == state.epoch else 0
        sampler.set_epoch(epoch)
        sampler.skip = first_step * args.batch_size
        state.epoch, state.step_in_epoch = epoch, first_step
        train_model.train()
        loss_meter = AverageMeter()
        window_loss, window_steps, window_start = torch.zeros((), device=device), 0, time.perf_counter()
        bar = tqdm(
            total=steps_per_epoch,
            initial=first_step,
            desc=f"epoch {epoch}",
            disable=not show_progress,
            dynamic_ncols=True,
        )
        for images, target in train_loader:
            images = images.to(device, non_blocking=True)
            if args.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with autocast():
                loss = train_loss_fn(train_model(images), target)
            optimizer.zero_grad(set_to_none=True)
            if loss_scaler is not None:
                loss_scaler(loss, optimizer, clip_grad=args.clip_grad or None, parameters=model.parameters())
            else:
                loss.backward()
                if args.clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()
            state.global_step += 1
            state.step_in_epoch += 1
            if model_ema is not None:
                model_ema.update(model, step=state.global_step)
            scheduler.step_update(num_updates=state.global_step)
            window_loss += loss.detach()
            window_steps += 1
            bar.update(1)

            at_end = state.step_in_epoch == steps_per_epoch
            if window_steps == args.log_interval or at_end:
                mean_loss = window_loss / window_steps
                if distributed:
                    mean_loss = reduce_tensor(mean_loss, world_size)
                mean_loss = mean_loss.item()
                elapsed = time.perf_counter() - window_start
                lr_now = optimizer.param_groups[0]["lr"]
                loss_meter.update(mean_loss, window_steps)
                record = dict(
                    kind="train",
                    epoch=epoch,
                    step=state.step_in_epoch,
                    global_step=state.global_step,
                    loss=mean_loss,
                    lr=lr_now,
                    img_per_s=window_steps * global_batch / elapsed,
                )
                if primary:
                    _log(log_path, record)
                    bar.set_postfix(
                        loss=f"{mean_loss:.4f}",
                        lr=f"{lr_now:.3g}",
                        img_s=f"{record['img_per_s']:.0f}",
                        refresh=False,
                    )
                window_loss.zero_()
                window_steps, window_start = 0, time.perf_counter()
            if (
                primary
                and args.recovery_interval
                and state.global_step % args.recovery_interval == 0
                and not at_end
            ):
                saver.save_recovery(epoch, batch_idx=state.step_in_epoch)
            if args.max_steps and state.global_step >= args.max_steps:
                stopped = True
                break
        bar.close()

        if state.step_in_epoch < steps_per_epoch:  # stopped mid-epoch by --max-steps
            if primary:
                saver.save_recovery(epoch, batch_idx=state.step_in_epoch)
                print(
                    f"stopped at --max-steps {args.max_steps} (epoch {epoch}, step {state.step_in_epoch}); "
                    f"continue with --resume auto",
                    flush=True,
                )
            break

        # end of epoch: validate, log, checkpoint ------------------------------------------------------
        if distributed:
            distribute_bn(model, world_size, reduce=True)
        metrics: dict[str, float] = {}
        if (epoch + 1) % args.val_interval == 0 or epoch + 1 == num_epochs or stopped:
            metrics["top1"] = validate(model, val_loader, device, autocast, args.channels_last, distributed)
            if model_ema is not None:
                metrics["ema_top1"] = validate(
                    model_ema.module, val_loader, device, autocast, args.channels_last, distributed
                )
        state.epoch, state.step_in_epoch = epoch + 1, 0
        if primary:
            lr_now = optimizer.param_groups[0]["lr"]
            _log(
                log_path,
                dict(
                    kind="epoch",
                    epoch=epoch,
                    global_step=state.global_step,
                    loss=loss_meter.avg,
                    lr=lr_now,
                    **metrics,
                ),
            )
            update_summary(epoch, {"loss": loss_meter.avg}, metrics, str(output / "summary.csv"), lr=lr_now)
            shown = ", ".join(f"{k} {v:.2f}" for k, v in metrics.items())
            print(
                f"epoch {epoch}: loss {loss_meter.avg:.4f}, lr {lr_now:.3g}"
                + (f", {shown}" if shown else ""),
                flush=True,
            )
            saver.save_checkpoint(epoch, metric=metrics.get("ema_top1", metrics.get("top1")))
            for stale in output.glob(f"recovery-*{CHECKPOINT_EXT}"):  # all older than this epoch's checkpoint
                stale.unlink(missing_ok=True)
        if stopped:
            if primary and epoch + 1 < num_epochs:
                print(
                    f"stopped at --max-steps {args.max_steps} (end of epoch {epoch}); "
                    "continue with --resume auto",
                    flush=True,
                )
            break

    completed = state.epoch >= num_epochs
    if completed and primary and not args.no_weights:
        write_weights(output / ("last" + CHECKPOINT_EXT), output / f"{name}.safetensors", name, args.ema)
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def write_weights(checkpoint: Path, path: Path, name: str, ema: bool = True) -> dict[str, Any]:
    """The checkpoint's EMA weights (the raw weights of a run without EMA) as a verified weight file, by
    ``convert_checkpoint``; prints and returns the ``weights/manifest.json`` entry."""
    from convfirstnet.tools.convert_checkpoint import convert_checkpoint

    which = "EMA weights" if ema else "weights"
    entry = convert_checkpoint(
        checkpoint, path, name, source=f"convfirstnet train, {which} of {checkpoint.name}"
    )
    print(
        f'wrote {path}\nmanifest entry (weights/manifest.json, "models"):\n'
        + json.dumps({entry["name"]: entry}, indent=2),
        flush=True,
    )
    return entry


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except TrainError as e:
        print(f"convfirstnet train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
