"""The models to evaluate, each with its weights, label map and dataset, checked before any evaluation."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .data import build_dataset, label_map, read_real_labels, real_label_sets
from .options import EvalError


@dataclass
class Job:
    """One model to evaluate: its weights, labels and data, all checked before any evaluation starts."""

    name: str
    model: nn.Module  # training form, CPU, fp32, the checkpoint's weights
    path: Path
    weights: str  # which weights of the file, e.g. "EMA weights (state_dict_ema)"
    ema: bool | None
    mapping_how: str
    dataset: Any
    real: list[list[int]] | None


def model_names(models: list[str] | None) -> list[str | None]:
    """Canonical names for ``--model`` (``all``: every size); ``[None]`` when not given."""
    import convfirstnet
    from convfirstnet.registry import canonical_name

    if not models:
        return [None]
    names: list[str | None] = []
    for m in models:
        names += convfirstnet.list_models() if m.lower() == "all" else [canonical_name(m)]
    return names


def read_weights(name: str | None, checkpoint: Path | None, use_ema: bool):
    """(canonical name, weight file, checkpoint contents) for a model, checked to fit it."""
    from convfirstnet.weights import (
        WeightsNotFoundError,
        read_checkpoint,
        resolve_architecture,
        resolve_weights,
    )

    if checkpoint is None:
        try:
            path = resolve_weights(name)
        except WeightsNotFoundError as e:
            raise EvalError(f"{e} Or pass --checkpoint PATH.") from e
    else:
        path = checkpoint
    ckpt = read_checkpoint(path, use_ema=use_ema)
    return resolve_architecture(ckpt, name), path, ckpt


def prepare_jobs(args: argparse.Namespace, root: Path, classes: list[str]) -> list[Job]:
    import convfirstnet
    from convfirstnet.weights import load_checkpoint
    from torch.utils.data import Subset

    names = model_names(args.model)
    checkpoints: list[Path | None] = list(args.checkpoint or [])
    if names == [None]:
        if not checkpoints:
            raise EvalError("give --model (or 'all'), --checkpoint, or both")
        names = [None] * len(checkpoints)
    elif checkpoints and len(checkpoints) != len(names):
        raise EvalError(
            f"{len(names)} model(s) but {len(checkpoints)} --checkpoint file(s): give one per model, "
            "or none to look each model's weights up"
        )
    if args.predictions_file is not None and len(names) > 1:
        raise EvalError("--predictions-file takes one model")
    real_by_name = read_real_labels(args.real_labels) if args.real_labels is not None else None

    jobs, datasets = [], {}
    for name, checkpoint in zip(names, checkpoints or [None] * len(names), strict=True):
        name, path, ckpt = read_weights(name, checkpoint, args.use_ema)
        num_classes = ckpt.num_classes
        if num_classes is None:
            raise EvalError(
                f"checkpoint {str(path)!r} has no classifier (classifier.weight); it cannot be evaluated"
            )
        what = f"the {name} checkpoint {str(path)!r}"
        mapping, how = label_map(classes, num_classes, args.class_map, root, what)
        key = tuple(sorted(mapping.items()))
        if key not in datasets:
            dataset = build_dataset(root, mapping)
            if args.limit is not None and args.limit < len(dataset):
                dataset = Subset(dataset, range(args.limit))
            datasets[key] = dataset
        dataset = datasets[key]
        real = None
        if real_by_name is not None:
            real = real_label_sets(dataset, real_by_name, args.real_labels, num_classes)
        model = convfirstnet.create_model(name, num_classes=num_classes)
        load_checkpoint(model, ckpt, name)
        jobs.append(Job(name, model.eval(), path, ckpt.describe(), ckpt.ema, how, dataset, real))
    return jobs
