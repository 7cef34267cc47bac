"""Exact counting: top-1 / top-5 hits, the loss sum and ImageNet-ReaL hits over a loader, and their sums
over torchrun's processes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .options import EvalError

TOPK = 5


@dataclass
class Counts:
    top1: int = 0
    top5: int = 0
    images: int = 0
    loss: float = 0.0  # sum of per-image cross-entropy
    real_top1: int = 0
    real_top5: int = 0
    real_images: int = 0  # images with at least one ReaL label
    predictions: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [images, k]


def shard_size(num_images: int, rank: int, world_size: int) -> int:
    """Images of ``num_images`` that ``DistributedSampler(shuffle=False)`` gives rank ``rank`` before its
    padding: the sampler deals indices round robin, and padded repeats come last in every shard."""
    return len(range(rank, num_images, world_size))


def topk_hits(logits: torch.Tensor, target: torch.Tensor, k: int = TOPK) -> tuple[torch.Tensor, torch.Tensor]:
    """Number of samples whose label is the top-1 prediction, and among the top ``k`` (int64 tensors).

    With fewer than ``k`` classes, top-k covers all of them (as ``timm.utils.accuracy`` does)."""
    pred = logits.topk(min(k, logits.shape[1]), dim=1).indices
    hit = pred == target.reshape(-1, 1)
    return hit[:, 0].sum(), hit.any(dim=1).sum()


def real_hits(pred: torch.Tensor, real: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """ImageNet-ReaL hits of top-k predictions ``pred`` [n, k] against each image's set of real labels, as
    timm's ``RealLabelsImagenet``: (top-1 hits, top-5 hits, images with labels); unlabelled images skipped."""
    top1 = top5 = n = 0
    for row, labels in zip(pred.tolist(), real, strict=True):
        if labels:
            n += 1
            top1 += row[0] in labels
            top5 += any(p in labels for p in row[:TOPK])
    return top1, top5, n


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    num_images: int,
    dtype: torch.dtype = torch.float32,
    progress: Any = None,
    world_size: int = 1,
    pad_to: int | None = None,
    real: Sequence[Sequence[int]] | None = None,
    keep_predictions: bool = False,
) -> Counts:
    """Run ``model`` over ``loader``, counting exactly the first ``num_images`` samples it yields.

    Later samples (a ``DistributedSampler``'s padding) are dropped. ``pad_to``: zero-pad smaller batches
    to this size (and drop the extra outputs), so a compiled model sees one shape and never recompiles.
    ``real``: ImageNet-ReaL label sets of the counted samples, in loader order. ``keep_predictions``:
    return every sample's top-k class indices. ``progress``: a tqdm bar or None.
    """
    correct1 = correct5 = loss = None
    real1 = real5 = real_n = 0
    preds = []
    seen = 0
    start = last_postfix = time.perf_counter()
    for images, target in loader:
        keep = min(images.shape[0], num_images - seen)
        if keep <= 0:
            break
        images, target = images[:keep], target[:keep]
        if pad_to is not None and keep < pad_to:
            images = torch.cat([images, images.new_zeros((pad_to - keep, *images.shape[1:]))])
        images = images.to(dtype).contiguous(memory_format=torch.channels_last)
        logits = model(images)[:keep].float()
        c1, c5 = topk_hits(logits, target)
        batch_loss = F.cross_entropy(logits, target, reduction="sum").double()
        correct1 = c1 if correct1 is None else correct1 + c1
        correct5 = c5 if correct5 is None else correct5 + c5
        loss = batch_loss if loss is None else loss + batch_loss
        if real is not None or keep_predictions:
            top = logits.topk(min(TOPK, logits.shape[1]), dim=1).indices.cpu()
            if real is not None:
                r1, r5, rn = real_hits(top, real[seen : seen + keep])
                real1, real5, real_n = real1 + r1, real5 + r5, real_n + rn
            if keep_predictions:
                preds.append(top)
        seen += keep
        if progress is not None:
            progress.update(min(keep * world_size, progress.total - progress.n))
            now = time.perf_counter()
            if now - last_postfix < 1.0 and seen < num_images:
                continue  # the running top-1 needs a device sync: at most once a second
            last_postfix, rate = now, seen * world_size / max(now - start, 1e-9)
            progress.set_postfix_str(
                f"top1 {100.0 * int(correct1) / seen:.2f}% {rate:.1f} img/s", refresh=True
            )
    if seen != num_images:
        raise RuntimeError(f"the loader gave {seen} images, expected {num_images}")
    return Counts(
        int(correct1 or 0),
        int(correct5 or 0),
        seen,
        float(loss or 0.0),
        real1,
        real5,
        real_n,
        torch.cat(preds) if keep_predictions and preds else None,
    )


def init_distributed(device_arg: str | None) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment; initialises the process group if > 1."""
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_arg == "cuda" or (device_arg is None and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise EvalError("--device cuda, but no CUDA device is available")
    if use_cuda:
        device = torch.device("cuda", local_rank if world_size > 1 else torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if world_size > 1:
        if use_cuda:
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return rank, world_size, device


def all_reduce_counts(counts: Counts, device: torch.device, world_size: int) -> Counts:
    if world_size == 1:
        return counts
    import torch.distributed as dist

    ints = torch.tensor(
        [counts.top1, counts.top5, counts.images, counts.real_top1, counts.real_top5, counts.real_images],
        dtype=torch.int64,
        device=device,
    )
    loss = torch.tensor([counts.loss], dtype=torch.float64, device=device)
    dist.all_reduce(ints)
    dist.all_reduce(loss)
    t1, t5, n, r1, r5, rn = (int(v) for v in ints.tolist())
    return Counts(t1, t5, n, float(loss.item()), r1, r5, rn)


def gather_predictions(
    local: torch.Tensor | None, rank: int, world_size: int, num_images: int
) -> torch.Tensor | None:
    """Every image's predictions in dataset order (on rank 0), from each rank's shard: rank, rank + W, ..."""
    if world_size == 1:
        return local
    import torch.distributed as dist

    shards: list[Any] = [None] * world_size
    dist.all_gather_object(shards, local.tolist() if local is not None else [])
    if rank != 0:
        return None
    k = next((len(s[0]) for s in shards if s), TOPK)
    out = torch.empty(num_images, k, dtype=torch.int64)
    for r, shard in enumerate(shards):
        if shard:
            out[r::world_size] = torch.tensor(shard, dtype=torch.int64)
    return out
