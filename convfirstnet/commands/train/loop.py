"""The training loop: epochs of optimizer steps (AMP, EMA, the step schedule, mixup), the log records, a
stop at --max-steps, and at each epoch's end validation, the summary row and the checkpoint."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from .checkpoints import CHECKPOINT_EXT, TrainState, make_saver, restore, write_weights
from .graphed import CudaGraphs, GraphedStep, all_reduce_mean, broadcast_state
from .output import append_log, plain_args, summary_columns, write_args, write_summary
from .prepare import Run


def run_training(args: argparse.Namespace, run: Run) -> int:
    """Resume if asked, then train until the last epoch or --max-steps; the weight file after the last."""
    state = TrainState(run.model, run.model_ema, run.scheduler)
    if run.resume_path is not None:
        restore(run, state)
        if run.primary:
            print(
                f"resumed from {run.resume_path}: epoch {state.epoch}, step {state.step_in_epoch} of "
                f"{run.steps_per_epoch}, global step {state.global_step}",
                flush=True,
            )
    elif args.resume == "auto" and run.primary:
        print(f"--resume auto: no checkpoint in {run.output}, starting from scratch", flush=True)
    run.scheduler.step_update(num_updates=state.global_step)

    saver = None
    if run.primary:
        # Plain types only in the saved args, so the checkpoints load with torch.load(weights_only=True).
        saver = make_saver(args, run, state, argparse.Namespace(**plain_args(vars(args))))
        write_args(args, run.output)
        print(
            f"{run.name}: {run.num_classes} classes, {run.num_train_images} training images, "
            f"{run.world_size} process(es) on {run.device.type}, global batch {run.global_batch}, "
            f"lr {run.lr:g}, {run.steps_per_epoch} steps/epoch, {run.num_epochs} epochs, dropout {run.drop:g}, drop-path {args.drop_path:g}, "
            f"amp {run.use_amp}, kernels {run.kernels}{' in a CUDA graph' if args.cuda_graph else ''}, "
            f"mixup {'on' if run.mixup_fn else 'off'}, "
            f"weights from {run.start}, "
            f"output {run.output}",
            flush=True,
        )

    train_model = run.model
    if run.distributed and args.cuda_graph:  # no DDP wrapper: the graphed step averages the gradients
        broadcast_state(run.model)
    elif run.distributed:
        train_model = nn.parallel.DistributedDataParallel(
            run.model, device_ids=[run.device.index] if run.device.type == "cuda" else None
        )
    loss_fn = train_loss(args, run)
    columns = summary_columns(run.model_ema is not None)
    show_progress = run.primary and (sys.stderr.isatty() if args.progress is None else args.progress)

    # --cuda-graph: one capture for the whole run
    graphed = graphed_step(args, run, train_model, loss_fn) if args.cuda_graph else None
    for epoch in range(state.epoch, run.num_epochs):
        loss_meter, stopped = train_epoch(args, run, state, saver, train_model, loss_fn, epoch, show_progress,
                                          graphed)
        if state.step_in_epoch < run.steps_per_epoch:  # stopped mid-epoch by --max-steps
            if run.primary:
                saver.save_recovery(epoch, batch_idx=state.step_in_epoch)
                print(
                    f"stopped at --max-steps {args.max_steps} (epoch {epoch}, step {state.step_in_epoch}); "
                    f"continue with --resume auto",
                    flush=True,
                )
            break
        end_epoch(args, run, state, saver, epoch, loss_meter.avg, columns, stopped)
        if stopped:
            if run.primary and epoch + 1 < run.num_epochs:
                print(
                    f"stopped at --max-steps {args.max_steps} (end of epoch {epoch}); "
                    "continue with --resume auto",
                    flush=True,
                )
            break

    completed = state.epoch >= run.num_epochs
    if completed and run.primary and not args.no_weights:
        write_weights(
            run.output / ("last" + CHECKPOINT_EXT), run.output / f"{run.name}.safetensors", run.name, args.ema
        )
    if run.distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def train_loss(args: argparse.Namespace, run: Run) -> nn.Module:
    """Soft-target cross-entropy on mixup's targets (which carry the label smoothing), else label-smoothed
    or plain cross-entropy."""
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    if run.mixup_fn is not None:
        return SoftTargetCrossEntropy()
    if args.smoothing > 0:
        return LabelSmoothingCrossEntropy(args.smoothing)
    return nn.CrossEntropyLoss()


def autocast_for(run: Run) -> Callable[[], Any]:
    """The forward's precision context: fp16 autocast with --amp, else none."""
    return lambda: torch.autocast("cuda", dtype=torch.float16) if run.use_amp else nullcontext()


def eager_step(args: argparse.Namespace, run: Run, train_model: nn.Module, loss_fn: nn.Module, autocast,
               images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One optimizer step launched from Python; returns the loss."""
    with autocast():
        loss = loss_fn(train_model(images), target)
    run.optimizer.zero_grad(set_to_none=True)
    if run.loss_scaler is not None:
        run.loss_scaler(loss, run.optimizer, clip_grad=args.clip_grad or None,
                        parameters=run.model.parameters())
    else:
        loss.backward()
        if args.clip_grad:
            nn.utils.clip_grad_norm_(run.model.parameters(), args.clip_grad)
        run.optimizer.step()
    return loss


def graphed_step(args: argparse.Namespace, run: Run, train_model: nn.Module,
                 loss_fn: nn.Module) -> GraphedStep:
    """--cuda-graph's step (graphed.py)."""
    return GraphedStep(
        train_model, loss_fn, run.optimizer, run.loss_scaler._scaler if run.loss_scaler is not None else None,
        torch.float16 if run.use_amp else None, args.clip_grad or None, CudaGraphs(run.device),
        all_reduce_mean if run.distributed else None,
    )


def train_epoch(
    args: argparse.Namespace,
    run: Run,
    state: TrainState,
    saver: Any,
    train_model: nn.Module,
    loss_fn: nn.Module,
    epoch: int,
    show_progress: bool,
    graphed: GraphedStep | None = None,
) -> tuple[Any, bool]:
    """The optimizer steps of one epoch, from ``state.step_in_epoch`` on a resumed epoch (each by
    ``graphed`` with --cuda-graph, else launched from Python); a log record every --log-interval steps,
    recovery checkpoints every --recovery-interval. Returns the epoch's loss meter and whether
    --max-steps stopped it."""
    from timm.utils import AverageMeter, reduce_tensor
    from tqdm import tqdm

    device, optimizer, mixup_fn = run.device, run.optimizer, run.mixup_fn
    autocast = autocast_for(run)
    log_path = run.output / "log.jsonl"
    first_step = state.step_in_epoch if epoch == state.epoch else 0
    run.sampler.set_epoch(epoch)
    run.sampler.skip = first_step * args.batch_size
    state.epoch, state.step_in_epoch = epoch, first_step
    if mixup_fn is not None and args.mixup_off_epoch and epoch >= args.mixup_off_epoch:
        mixup_fn.mixup_enabled = False
    train_model.train()
    loss_meter = AverageMeter()
    window_loss, window_steps, window_start = torch.zeros((), device=device), 0, time.perf_counter()
    bar = tqdm(
        total=run.steps_per_epoch,
        initial=first_step,
        desc=f"epoch {epoch}",
        disable=not show_progress,
        dynamic_ncols=True,
    )
    stopped = False
    for images, target in run.train_loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if mixup_fn is not None:
            images, target = mixup_fn(images, target)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if graphed is not None:
            loss = graphed(images, target)
        else:
            loss = eager_step(args, run, train_model, loss_fn, autocast, images, target)
        state.global_step += 1
        state.step_in_epoch += 1
        if run.model_ema is not None:
            run.model_ema.update(run.model, step=state.global_step)
        run.scheduler.step_update(num_updates=state.global_step)
        window_loss += loss.detach()
        window_steps += 1
        bar.update(1)

        at_end = state.step_in_epoch == run.steps_per_epoch
        if window_steps == args.log_interval or at_end:
            mean_loss = window_loss / window_steps
            if run.distributed:
                mean_loss = reduce_tensor(mean_loss, run.world_size)
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
                img_per_s=window_steps * run.global_batch / elapsed,
            )
            if run.primary:
                append_log(log_path, record)
                bar.set_postfix(
                    loss=f"{mean_loss:.4f}",
                    lr=f"{lr_now:.3g}",
                    img_s=f"{record['img_per_s']:.0f}",
                    refresh=False,
                )
            window_loss.zero_()
            window_steps, window_start = 0, time.perf_counter()
        recovery = args.recovery_interval and state.global_step % args.recovery_interval == 0
        if run.primary and recovery and not at_end:
            saver.save_recovery(epoch, batch_idx=state.step_in_epoch)
        if args.max_steps and state.global_step >= args.max_steps:
            stopped = True
            break
    bar.close()
    return loss_meter, stopped


def end_epoch(
    args: argparse.Namespace,
    run: Run,
    state: TrainState,
    saver: Any,
    epoch: int,
    epoch_loss: float,
    columns: list[str],
    stopped: bool,
) -> None:
    """Validate (every --val-interval epochs, after the last and at a stop), then log, append the summary
    row, print, checkpoint (ranked by the EMA's top-1 if there is an EMA) and drop the recovery files."""
    from timm.utils import distribute_bn

    if run.distributed:
        distribute_bn(run.model, run.world_size, reduce=True)
    evals: dict[str, dict[str, float]] = {}  # "": the model, "ema_": its EMA; each loss, top1, top5
    if (epoch + 1) % args.val_interval == 0 or epoch + 1 == run.num_epochs or stopped:
        autocast = autocast_for(run)
        for who, model in (("", run.model), ("ema_", run.model_ema.module if run.model_ema else None)):
            if model is not None:
                evals[who] = validate(
                    model, run.val_loader, run.device, autocast, args.channels_last, run.distributed
                )
    state.epoch, state.step_in_epoch = epoch + 1, 0
    if not run.primary:
        return
    optimizer, output = run.optimizer, run.output
    lr_now = sum(g["lr"] for g in optimizer.param_groups) / len(optimizer.param_groups)
    logged = {f"{who}{'val_loss' if k == 'loss' else k}": v for who, m in evals.items() for k, v in m.items()}
    append_log(
        output / "log.jsonl",
        dict(kind="epoch", epoch=epoch, global_step=state.global_step, loss=epoch_loss, lr=lr_now, **logged),
    )
    summary = {f"eval_{who}{k}": v for who, m in evals.items() for k, v in m.items()}
    write_summary(
        output / "summary.csv", {"epoch": epoch, "train_loss": epoch_loss, **summary, "lr": lr_now}, columns
    )
    shown = ", ".join(f"{k} {v:.2f}" for k, v in logged.items() if "top" in k)
    print(f"epoch {epoch}: loss {epoch_loss:.4f}, lr {lr_now:.3g}" + (f", {shown}" if shown else ""),
          flush=True)
    saver.save_checkpoint(epoch, metric=logged.get("ema_top1", logged.get("top1")))
    for stale in output.glob(f"recovery-*{CHECKPOINT_EXT}"):  # all older than this epoch's checkpoint
        stale.unlink(missing_ok=True)


@torch.no_grad()
def validate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    autocast,
    channels_last: bool,
    distributed: bool,
) -> dict[str, float]:
    """Loss (cross-entropy, no smoothing, as timm's validation), top-1 and top-5 in percent over the whole
    split: exact sums over images and processes."""
    model.eval()
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # top-1 hits, top-5 hits, images
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with autocast():
            logits = model(images)
        logits = logits.float()
        loss_sum += nn.functional.cross_entropy(logits, target, reduction="sum").double()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hit = top == target[:, None]
        counts[0] += hit[:, 0].sum()
        counts[1] += hit.any(dim=1).sum()
        counts[2] += target.numel()
    if distributed:
        torch.distributed.all_reduce(counts)
        torch.distributed.all_reduce(loss_sum)
    top1, top5, total = counts.tolist()
    total = max(total, 1)
    return {"loss": loss_sum.item() / total, "top1": 100.0 * top1 / total, "top5": 100.0 * top5 / total}
