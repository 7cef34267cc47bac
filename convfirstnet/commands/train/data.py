"""The training data: the train and validation folders (the validation folder labelled with the training
folder's classes), timm's transforms, the resumable sampler and the loaders."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from .options import TrainError, mixup_active


def split_folder(data: Path, split: str) -> Path | None:
    """``data/<split>``, or for timm's synonyms (validation: val, valid, eval, ...) the one that exists;
    None when there is none (timm would then silently use ``data`` itself)."""
    from timm.data.dataset_factory import _EVAL_SYNONYM, _TRAIN_SYNONYM

    candidates = [split]
    for synonyms in (_TRAIN_SYNONYM, _EVAL_SYNONYM):
        if split in synonyms:
            candidates += [s for s in synonyms if s != split]
    return next((data / c for c in candidates if (data / c).is_dir()), None)


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


def data_folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """The training and validation folders under ``--data``: both must exist and differ, so that the
    model is never validated on its training images."""
    if not args.data.is_dir():
        raise TrainError(f"--data {str(args.data)!r} is not a directory")
    train_dir = split_folder(args.data, args.train_split)
    val_dir = split_folder(args.data, args.val_split)
    if train_dir is None or val_dir is None:
        which = args.train_split if train_dir is None else args.val_split
        raise TrainError(
            f"--data {str(args.data)!r} has no {which}/ folder: expected DIR/{args.train_split}/<class>/... "
            f"and DIR/{args.val_split}/<class>/... (or val/), so that training and validation images differ"
        )
    if train_dir.resolve() == val_dir.resolve():
        raise TrainError(f"--train-split and --val-split are the same folder {str(train_dir)!r}")
    return train_dir, val_dir


def datasets(args: argparse.Namespace, train_dir: Path, val_dir: Path) -> tuple[Any, Any, dict[str, int]]:
    """timm datasets of both folders (no transforms yet), the validation folder labelled with the training
    folder's classes; and that class map."""
    from timm.data import create_dataset

    try:
        train_set = create_dataset(
            "", root=str(train_dir), split=args.train_split, search_split=False, is_training=True
        )
    except RuntimeError as e:  # timm: "Found 0 images in subfolders of ..."
        raise TrainError(f"no training images in {str(train_dir)!r}: {e}") from e
    class_to_idx = dict(train_set.reader.class_to_idx)
    val_classes = sorted(d.name for d in val_dir.iterdir() if d.is_dir() and not d.name.startswith("."))
    unknown = [c for c in val_classes if c not in class_to_idx]
    if unknown:
        raise TrainError(
            f"{str(val_dir)!r} has class folder(s) {', '.join(unknown[:5])} that {str(train_dir)!r} has not"
        )
    try:
        val_set = create_dataset(
            "", root=str(val_dir), split=args.val_split, search_split=False, class_map=class_to_idx
        )
    except RuntimeError as e:
        raise TrainError(f"no validation images in {str(val_dir)!r}: {e}") from e
    return train_set, val_set, class_to_idx


def loaders(
    args: argparse.Namespace,
    train_set,
    val_set,
    rank: int,
    world_size: int,
    workers: int,
    device: torch.device,
) -> tuple[ResumableSampler, int, DataLoader, DataLoader]:
    """The sampler of this process's training shard, the steps per epoch, and the training and validation
    loaders (validation: every ``world_size``-th image)."""
    sampler = ResumableSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    steps_per_epoch = sampler.num_samples // args.batch_size
    if steps_per_epoch == 0:
        raise TrainError(
            f"{len(train_set)} training images per process are fewer than one batch ({args.batch_size})"
        )
    loader_kw = dict(num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0)
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, **loader_kw
    )
    val_loader = DataLoader(
        Subset(val_set, range(rank, len(val_set), world_size)),
        batch_size=args.batch_size,
        shuffle=False,
        **loader_kw,
    )
    return sampler, steps_per_epoch, train_loader, val_loader


def mixup(args: argparse.Namespace, num_classes: int):
    """timm's ``Mixup`` for --mixup / --cutmix (label smoothing included in its targets), or None."""
    from timm.data import Mixup

    if not mixup_active(args):
        return None
    return Mixup(
        mixup_alpha=args.mixup,
        cutmix_alpha=args.cutmix,
        cutmix_minmax=args.cutmix_minmax,
        prob=args.mixup_prob,
        switch_prob=args.mixup_switch_prob,
        mode=args.mixup_mode,
        label_smoothing=args.smoothing,
        num_classes=num_classes,
    )
