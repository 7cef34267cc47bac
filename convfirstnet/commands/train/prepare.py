"""Everything a training run needs, built and checked before its output folder exists: the data, the
model and its initial weights, the optimizer, schedule, EMA and loaders."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from convfirstnet.kernels._launch import interpreter_enabled

from .._cli import default_workers
from .checkpoints import check_resume_file, find_resume, initial_weights
from .data import ResumableSampler, data_folders, datasets, eval_transforms, loaders, mixup, train_transforms
from .options import WORKERS, TrainError, check_args, recipe_lr
from .output import check_output


@dataclass
class Run:
    """Everything a training run needs, built and checked by :func:`prepare` before the output exists."""

    name: str
    output: Path
    resume_path: Path | None
    device: torch.device
    rank: int
    world_size: int
    distributed: bool
    use_amp: bool
    num_classes: int
    drop: float
    lr: float
    model: nn.Module
    model_ema: nn.Module | None
    optimizer: Any
    loss_scaler: Any
    scheduler: Any
    num_epochs: int
    steps_per_epoch: int
    sampler: ResumableSampler
    train_loader: DataLoader
    val_loader: DataLoader
    num_train_images: int
    mixup_fn: Any
    start: str  # where the weights came from: "random init", or the initial checkpoint
    kernels: str = "torch"  # "triton": the fused training kernels where a block has them (command.train)

    @property
    def primary(self) -> bool:
        return self.rank == 0

    @property
    def global_batch(self) -> int:
        return self.sampler.num_replicas * self.train_loader.batch_size


def prepare(args: argparse.Namespace) -> Run:
    """Check every input and build the run: data, model (and its initial weights), optimizer, schedule."""
    import timm
    from timm.data import resolve_data_config
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3, NativeScaler, random_seed
    from timm.utils.distributed import init_distributed_device_so

    import convfirstnet  # noqa: F401  (registers the models with timm)
    from convfirstnet.registry import SIZES, canonical_name
    from convfirstnet.weights import load_checkpoint

    name = canonical_name(args.model)
    check_args(args)
    output = args.output or Path("output") / "train" / name
    check_output(args, output, name)
    train_dir, val_dir = data_folders(args)
    init_ckpt = initial_weights(args, name)
    resume_path = find_resume(args.resume, output)
    if resume_path is not None and args.resume != "auto":
        check_resume_file(resume_path)

    dist_info = init_distributed_device_so(
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(dist_info["device"])
    rank, world_size = dist_info["global_rank"], dist_info["world_size"]
    use_amp = device.type == "cuda" if args.amp is None else args.amp
    if use_amp and device.type != "cuda":
        raise TrainError("--amp (fp16 + GradScaler) needs CUDA; use --no-amp on CPU")
    # layer-wise unless asked: measured on an H200 (Small, batch 128, fp16), the fused training step took
    # 153 ms against 103 ms layer-wise, bound by its ~1,300 launches' host time (docs/train.md)
    kernels = args.kernels or "torch"
    if kernels == "triton" and device.type != "cuda" and not interpreter_enabled():
        raise TrainError("--kernels triton needs CUDA (on CPU the Triton kernels run only in Triton's "
                         "interpreter, TRITON_INTERPRET=1, very slowly); use --kernels torch")
    if args.cuda_graph and device.type != "cuda":
        raise TrainError("--cuda-graph needs CUDA (it captures the step in a CUDA graph)")
    workers = args.workers if args.workers is not None else default_workers(WORKERS)
    random_seed(args.seed, rank)

    train_set, val_set, class_to_idx = datasets(args, train_dir, val_dir)
    num_classes = args.num_classes or len(class_to_idx)
    if num_classes < len(class_to_idx):
        raise TrainError(f"--num-classes {num_classes} is less than the {len(class_to_idx)} training classes")

    # model and its initial weights
    size = name.removeprefix("convfirstnet_")
    drop = SIZES[size].drop_rate if args.drop is None else args.drop
    model = timm.create_model(name, num_classes=num_classes, drop_rate=drop, drop_path_rate=args.drop_path)
    start = "random init"
    if init_ckpt is not None:
        kept = load_checkpoint(model, init_ckpt, name, new_classifier_ok=True)
        start = f"{init_ckpt.path}, {init_ckpt.describe()}"
        if kept:
            start += f"; new {num_classes}-class classifier (the checkpoint has {init_ckpt.num_classes})"
    data_cfg = resolve_data_config(model=model)
    if args.val_img_size:
        data_cfg["input_size"] = (3, args.val_img_size, args.val_img_size)
    try:
        train_set.transform = train_transforms(args, data_cfg)
    except (ValueError, AssertionError, KeyError) as e:  # e.g. an --aa string timm cannot parse
        raise TrainError(f"augmentation settings (--aa {args.aa!r}, --remode {args.remode!r}): {e}") from e
    val_set.transform = eval_transforms(data_cfg)
    model.to(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if args.channels_last:
        model.to(memory_format=torch.channels_last)

    # optimizer, schedule, EMA, loaders
    lr = args.lr if args.lr is not None else recipe_lr(args.batch_size * world_size, args.lr_base)
    try:
        optimizer = create_optimizer_v2(
            model,
            opt=args.opt,
            lr=lr,
            weight_decay=args.weight_decay,
            momentum=args.momentum,
            eps=args.opt_eps,
        )
    except (ValueError, AssertionError, KeyError) as e:  # unknown optimizer name
        raise TrainError(f"--opt {args.opt!r}: {e}") from e
    loss_scaler = NativeScaler(device="cuda") if use_amp else None
    model_ema = ModelEmaV3(model, decay=args.ema_decay, use_warmup=args.ema_warmup) if args.ema else None
    sampler, steps_per_epoch, train_loader, val_loader = loaders(
        args, train_set, val_set, rank, world_size, workers, device
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
    return Run(
        name,
        output,
        resume_path,
        device,
        rank,
        world_size,
        dist_info["distributed"],
        use_amp,
        num_classes,
        drop,
        lr,
        model,
        model_ema,
        optimizer,
        loss_scaler,
        scheduler,
        num_epochs,
        steps_per_epoch,
        sampler,
        train_loader,
        val_loader,
        len(train_set),
        mixup(args, num_classes),
        start,
        kernels,
    )
