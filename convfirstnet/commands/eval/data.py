"""The evaluation data: the data folder, its class folders and their labels (class map, ImageNet-1k
synsets or sorted order, ImageNet-ReaL), the dataset and timm's evaluation loader."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .._cli import read_json
from .options import EvalError

SPLIT_FOLDERS = ("val", "validation")
REAL_NAME = "ILSVRC2012_val_{:08d}.JPEG"  # ImageNet-ReaL's labels are listed in this file order


def resolve_data_root(data: Path) -> Path:
    if not data.exists():
        raise EvalError(f"data directory {str(data)!r} does not exist")
    if not data.is_dir():
        raise EvalError(f"--data {str(data)!r} is not a directory")
    for name in SPLIT_FOLDERS:
        if (data / name).is_dir():
            return data / name
    return data


def class_folders(root: Path) -> list[str]:
    """Class folder names in index order (timm's order: sorted, numbers inside names compared as numbers)."""
    from timm.utils.misc import natural_key

    names = [d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    return sorted(names, key=natural_key)


def has_images(root: Path, classes: list[str]) -> bool:
    """Whether any class folder holds an image file (what timm's folder reader would find)."""
    from timm.data.readers.img_extensions import get_img_extensions

    extensions = get_img_extensions(as_set=True)
    for c in classes:
        for _, _, files in os.walk(root / c, followlinks=True):
            if any(os.path.splitext(f)[1].lower() in extensions for f in files):
                return True
    return False


def imagenet_synsets() -> list[str]:
    """The 1000 ImageNet-1k synsets in class-index order (shipped with timm)."""
    from timm.data import ImageNetInfo

    return list(ImageNetInfo("imagenet-1k").label_names())


def read_class_map(path: Path) -> dict[str, int]:
    """A class map in timm's format: ``.txt`` (one name per line, index = line number) or ``.pkl`` dict."""
    from timm.data.readers.class_map import load_class_map

    if not path.is_file():
        raise EvalError(f"--class-map {str(path)!r} does not exist")
    if path.suffix.lower() not in (".txt", ".pkl"):
        raise EvalError(f"--class-map {str(path)!r}: expected a .txt or .pkl file (timm's class map formats)")
    try:
        mapping = load_class_map(str(path))
    except Exception as e:  # unpickling and decoding errors
        raise EvalError(f"--class-map {str(path)!r} cannot be read ({type(e).__name__}: {e})") from e
    if not all(isinstance(k, str) and isinstance(v, int) for k, v in mapping.items()):
        raise EvalError(f"--class-map {str(path)!r} is not a mapping of class names to integer indices")
    return mapping


def label_map(
    classes: list[str], num_classes: int, class_map: Path | None, root: Path, what: str
) -> tuple[dict[str, int], str]:
    """Class folder -> label index for a checkpoint with ``num_classes`` outputs, and how it was chosen."""
    if class_map is not None:
        mapping = read_class_map(class_map)
        missing = [c for c in classes if c not in mapping]
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise EvalError(
                f"--class-map {str(class_map)!r} has no entry for the class folder(s) "
                f"{', '.join(missing[:5])}{more} of {str(root)!r}"
            )
        bad = [f"{c}: {mapping[c]}" for c in classes if not 0 <= mapping[c] < num_classes]
        if bad:
            raise EvalError(
                f"--class-map {str(class_map)!r} maps {', '.join(bad[:5])} outside the {num_classes} classes "
                f"of {what}"
            )
        return {c: mapping[c] for c in classes}, f"class map {class_map.name}"
    if num_classes == 1000:
        index = {s: i for i, s in enumerate(imagenet_synsets())}
        if all(c in index for c in classes):
            return {c: index[c] for c in classes}, "imagenet-1k synsets"
    if len(classes) == num_classes:
        return {c: i for i, c in enumerate(classes)}, "sorted folders"
    hint = "; map the folders to its classes with --class-map FILE" + (
        " (ImageNet-1k synset folders map by themselves)" if num_classes == 1000 else ""
    )
    raise EvalError(
        f"{str(root)!r} has {len(classes)} class folder{'s' * (len(classes) != 1)}, but {what} "
        f"classifies {num_classes} classes{hint}"
    )


def build_dataset(root: Path, mapping: dict[str, int]):
    """timm ``ImageDataset`` over ``root``, label = ``mapping[class folder]``."""
    from timm.data import create_dataset

    try:
        return create_dataset("", root=str(root), split="validation", search_split=False, class_map=mapping)
    except RuntimeError as e:  # timm: "Found 0 images in subfolders of ..."
        raise EvalError(f"no images in {str(root)!r}: {e}") from e


def read_real_labels(path: Path) -> dict[str, list[int]]:
    """ImageNet-ReaL labels (``real.json``: one list of class indices per validation image, in file-name
    order) by file name, ``ILSVRC2012_val_00000001.JPEG`` first, as timm's ``RealLabelsImagenet``."""
    data = read_json(path, "--real-labels")
    if not isinstance(data, list) or not all(
        isinstance(v, list) and all(isinstance(i, int) for i in v) for v in data
    ):
        raise EvalError(
            f"--real-labels {str(path)!r} is not a list of label lists (ImageNet-ReaL's real.json)"
        )
    return {REAL_NAME.format(i + 1): labels for i, labels in enumerate(data)}


def real_label_sets(dataset, real: dict[str, list[int]], path: Path, num_classes: int) -> list[list[int]]:
    """The ReaL label set of every image of ``dataset``, in dataset order."""
    from torch.utils.data import Subset

    if num_classes != 1000:
        raise EvalError(
            f"--real-labels needs a 1000-class (ImageNet-1k) checkpoint, not {num_classes} classes"
        )
    base, indices = (dataset.dataset, dataset.indices) if isinstance(dataset, Subset) else (dataset, None)
    names = base.filenames(basename=True)
    names = [names[i] for i in indices] if indices is not None else list(names)
    missing = [n for n in names if n not in real]
    if missing:
        raise EvalError(
            f"{len(missing)} image(s), e.g. {missing[0]!r}, have no entry in --real-labels {str(path)!r} "
            "(ImageNet-ReaL covers the ImageNet-1k validation files ILSVRC2012_val_*.JPEG)"
        )
    return [real[n] for n in names]


def build_loader(
    dataset,
    data_config: dict[str, Any],
    batch_size: int,
    workers: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
):
    """timm's evaluation loader (``create_loader`` with the prefetcher), sharded by a ``DistributedSampler``.

    Images reach the device as uint8 and are normalised there in fp32 (``timm.data.PrefetchLoader``).
    """
    from timm.data import create_transform
    from timm.data.loader import PrefetchLoader, fast_collate
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    base.transform = create_transform(
        data_config["input_size"],
        is_training=False,
        interpolation=data_config["interpolation"],
        mean=data_config["mean"],
        std=data_config["std"],
        crop_pct=data_config["crop_pct"],
        crop_mode=data_config.get("crop_mode"),
        use_prefetcher=True,
    )
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=False) if world_size > 1 else None
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        sampler=sampler,
        num_workers=workers,
        collate_fn=fast_collate,
        pin_memory=device.type == "cuda",
        drop_last=False,
    )
    return PrefetchLoader(
        loader,
        mean=data_config["mean"],
        std=data_config["std"],
        channels=data_config["input_size"][0],
        device=device,
        img_dtype=torch.float32,
    )
