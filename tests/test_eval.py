"""ImageNet evaluation tool (convfirstnet/commands/eval/) on small generated ImageFolders.

The real Pico runs at 32x32 with a few images per class; models are built with ``num_classes`` equal to
the folder count and passed as checkpoint files. Two kinds of checkpoints:

* exact metrics come from checkpoints whose classifier weight is zero: every image gets the classifier
  bias as logits, so top-1 / top-5 / loss are known by hand;
* comparisons between execution paths (fused, unfused, compiled, sharded, timm's own loop) use a model
  whose output depends on the image (BatchNorm statistics measured on data, as after training), and
  compare every image's predictions, written by ``--predictions-file``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import convfirstnet
from convfirstnet.commands.eval import build_parser, main
from convfirstnet.commands.eval.jobs import model_names
from convfirstnet.commands.eval.loop import Counts, evaluate, real_hits, shard_size, topk_hits
from convfirstnet.weights import save_weights, sha256_file

REPO = Path(__file__).resolve().parent.parent
FAST = ["--img-size", "32", "--workers", "0", "--no-progress"]
# Seven classes created out of order; the empty folder must still take its sorted index (2).
CLASS_COUNTS = {"n05": 1, "n10": 3, "n01": 2, "n03": 0, "n07": 5, "n02": 4, "n04": 6}  # 21 images
SORTED = ["n01", "n02", "n03", "n04", "n05", "n07", "n10"]
# Classifier bias, by class index: ranking 3 > 0 > 5 > 6 > 2 > 1 > 4.
BIAS = [5.0, 1.0, 2.0, 6.0, 0.0, 4.0, 3.0]
# ImageNet-1k synsets and their class indices (the first two and the last of the 1000).
TENCH, GOLDFISH, TOILET_TISSUE = ("n01440764", 0), ("n01443537", 1), ("n15075141", 999)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_image_folder(root: Path, counts: dict[str, int], seed: int = 0) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, n in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            h, w = rng.integers(32, 64, size=2)
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"img_{i}.{'png' if i % 2 else 'jpg'}")
    return root


def save_model(model: torch.nn.Module, path: Path) -> Path:
    save_weights(model.state_dict(), path, {"architecture": "convfirstnet_pico"})
    return path


def bias_model(bias: list[float]) -> torch.nn.Module:
    """Pico whose logits are ``bias`` for every image (zero classifier weight)."""
    model = convfirstnet.create_model("pico", num_classes=len(bias))
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor(bias))
    return model


def image_dependent_model(num_classes: int, seed: int = 0) -> torch.nn.Module:
    """Pico whose predictions differ from image to image, like a trained model's: at initialisation the
    BatchNorm layers are identities and the residual branches end in zero-scaled BatchNorms, so every
    image gets nearly the same logits. Here every BatchNorm has scale 1 and statistics measured on a
    batch of random inputs, with variances floored at 0.01 (so no nearly constant channel is amplified
    without bound): each layer passes on normalised, image-dependent activations. On the test folders
    its logits are O(1), the top-1 margins at least ~1e-3 and fused vs unfused differences ~1e-5."""
    torch.manual_seed(seed)
    model = convfirstnet.create_model("pico", num_classes=num_classes)
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batch
        with torch.no_grad():
            m.weight.fill_(1.0)
    with torch.no_grad():
        model.train()(torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(seed)))
        for m in bns:
            m.running_var.clamp_(min=0.01)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ckpt")
    bias1000 = [0.0] * 1000
    bias1000[TOILET_TISSUE[1]], bias1000[GOLDFISH[1]], bias1000[TENCH[1]] = 10.0, 9.0, -1.0
    bias1000[2:5] = [8.0, 7.0, 6.0]  # top-5: 999, 1, 2, 3, 4 (no ties among the first five)
    return {
        "image7": save_model(image_dependent_model(7), d / "image7.safetensors"),
        "bias7": save_model(bias_model(BIAS), d / "bias7.safetensors"),
        "bias1000": save_model(bias_model(bias1000), d / "bias1000.safetensors"),
    }


@pytest.fixture(scope="module")
def data7(tmp_path_factory) -> Path:
    """A dataset root holding ``val/`` with the seven classes (21 images)."""
    root = tmp_path_factory.mktemp("imagenet")
    make_image_folder(root / "val", CLASS_COUNTS)
    (root / "train").mkdir()  # ignored: the val/ split is used
    return root


def run_eval(capsys, *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def eval_json(capsys, tmp_path: Path, *args: str | Path, name: str = "r.json") -> dict:
    path = tmp_path / name
    code, out, err = run_eval(capsys, *args, "--results-json", path, *FAST)
    assert code == 0, err
    assert " * Acc@1 " in out
    return json.loads(path.read_text())


def read_predictions(path: Path) -> list[dict]:
    """Rows of a --predictions-file: index, file, label and pred1..predK as ints / str."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [
        {
            "index": int(r["index"]),
            "file": r["file"],
            "label": int(r["label"]),
            "preds": [int(r[k]) for k in r if k.startswith("pred")],
        }
        for r in rows
    ]


def hand_loss(bias: list[float], labels: list[int]) -> float:
    """Mean cross-entropy of constant logits ``bias`` against ``labels``."""
    lse = math.log(sum(math.exp(b) for b in bias))
    return sum(lse - bias[y] for y in labels) / len(labels)


# ----------------------------------------------------------------------------------------- metrics
def test_exact_metrics_loss_and_label_order(capsys, tmp_path, checkpoints, data7):
    """Every image's logits are BIAS: top-1 is class 3 (n04), top-5 classes {3, 0, 5, 6, 2}."""
    r = eval_json(
        capsys,
        tmp_path,
        "--model",
        "pico",
        "--data",
        data7,
        "--checkpoint",
        checkpoints["bias7"],
        "--batch-size",
        "4",
    )
    n = sum(CLASS_COUNTS.values())
    top1 = CLASS_COUNTS[SORTED[3]]
    top5 = sum(CLASS_COUNTS[SORTED[i]] for i in (3, 0, 5, 6, 2))
    assert (r["num_images"], r["top1_correct"], r["top5_correct"]) == (21, 6, 16) == (n, top1, top5)
    assert r["top1"] == 100.0 * 6 / 21 and r["top5"] == 100.0 * 16 / 21
    assert r["top1_err"] == 100.0 - r["top1"] and r["top5_err"] == 100.0 - r["top5"]
    labels = [i for i, c in enumerate(SORTED) for _ in range(CLASS_COUNTS[c])]
    assert r["loss"] == pytest.approx(hand_loss(BIAS, labels), rel=1e-6)
    assert r["num_classes"] == 7 and r["labels"] == "sorted folders"


def test_topk_hits_and_fewer_classes_than_k():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.3], [0.2, 0.3, 0.5]])
    c1, c5 = topk_hits(logits, torch.tensor([1, 2, 0]))
    assert (int(c1), int(c5)) == (1, 3)  # 3 classes: top-5 covers all
    c1, c2 = topk_hits(logits, torch.tensor([1, 2, 0]), k=2)
    assert (int(c1), int(c2)) == (1, 2)


def test_real_hits_skip_unlabelled_images():
    pred = torch.tensor([[1, 2, 3, 4, 5], [7, 1, 2, 3, 4], [9, 8, 7, 6, 5], [0, 1, 2, 3, 4]])
    real = [[1], [1, 2], [], [6]]
    assert real_hits(pred, real) == (1, 2, 3)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_images", [0, 1, 5, 11, 12])
def test_shards_cover_every_image_once(num_images, world_size):
    """The first shard_size() indices of each DistributedSampler shard partition the dataset exactly."""
    from torch.utils.data import DistributedSampler

    seen = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(num_images), world_size, rank, shuffle=False)
        indices = list(sampler)
        assert len(indices) >= shard_size(num_images, rank, world_size)
        seen += indices[: shard_size(num_images, rank, world_size)]
    assert sorted(seen) == list(range(num_images))


class _Stub(torch.nn.Module):
    """Logits = the first pixel of each image, one class per channel; records the batch sizes."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def forward(self, x):
        self.batches.append(x.shape[0])
        return x[:, :, 0, 0].float()


def test_evaluate_counts_exactly_and_drops_padding():
    images = torch.zeros(7, 3, 2, 2)
    target = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    images[torch.arange(7), torch.tensor([0, 1, 1, 0, 1, 2, 2]), 0, 0] = 1.0  # predictions
    loader = [(images[i : i + 3], target[i : i + 3]) for i in range(0, 7, 3)]
    stub = _Stub()
    # Only the first 5 samples are real (as if the last two were sampler padding); 4 of them are right.
    c = evaluate(stub, loader, num_images=5, keep_predictions=True)
    assert (c.top1, c.top5, c.images) == (4, 5, 5) and stub.batches == [3, 2]
    expected_loss = torch.nn.functional.cross_entropy(images[:5, :, 0, 0], target[:5], reduction="sum")
    assert c.loss == pytest.approx(expected_loss.item())
    assert c.predictions[:, 0].tolist() == [0, 1, 1, 0, 1]
    stub = _Stub()
    c = evaluate(stub, loader, num_images=7, pad_to=3, real=[[0], [], [1], [2], [1], [2], [0, 2]])
    assert (c.top1, c.top5, c.images) == (5, 7, 7) and stub.batches == [3, 3, 3]  # the last batch padded
    # predicted 0 1 1 0 1 2 2: right for images 0, 2, 4, 5, 6; image 1 has no real label
    assert (c.real_top1, c.real_images) == (5, 6)
    assert c == Counts(5, 7, 7, c.loss, 5, 6, 6)


# ----------------------------------------------------------------------------------------- options
def test_results_json_fields(capsys, tmp_path, checkpoints, data7):
    ckpt = checkpoints["image7"]
    preds = tmp_path / "p.csv"
    r = eval_json(
        capsys,
        tmp_path,
        "--model",
        "convfirstnet_pico",
        "--data",
        data7 / "val",
        "--checkpoint",
        ckpt,
        "--batch-size",
        "8",
        "--device",
        "cpu",
        "--predictions-file",
        preds,
    )
    required = {
        "model",
        "top1",
        "top1_err",
        "top5",
        "top5_err",
        "loss",
        "checkpoint",
        "checkpoint_sha256",
        "ema",
        "num_images",
        "labels",
        "img_size",
        "crop_pct",
        "interpolation",
        "dtype",
        "device",
        "fused",
        "compiled",
        "img_per_sec",
        "torch",
        "triton",
        "convfirstnet",
    }
    assert required <= r.keys()
    assert r["model"] == "convfirstnet_pico" and r["ema"] is None  # a weight file does not say
    assert r["checkpoint"] == str(ckpt) and r["checkpoint_sha256"] == sha256_file(ckpt)
    # The counts are those of the per-image predictions, which differ from image to image.
    rows = read_predictions(preds)
    assert r["num_images"] == len(rows) == 21
    assert r["top1_correct"] == sum(p["preds"][0] == p["label"] for p in rows)
    assert r["top5_correct"] == sum(p["label"] in p["preds"] for p in rows)
    assert r["top1"] == 100.0 * r["top1_correct"] / 21
    assert len({p["preds"][0] for p in rows}) >= 3
    assert [p["label"] for p in rows] == [i for i, c in enumerate(SORTED) for _ in range(CLASS_COUNTS[c])]
    assert (r["img_size"], r["crop_pct"], r["interpolation"]) == (32, 0.95, "bicubic")  # size overridden
    assert (r["dtype"], r["device"], r["fused"], r["compiled"]) == ("float32", "cpu", True, False)
    assert r["img_per_sec"] > 0
    assert r["torch"] == torch.__version__ and r["convfirstnet"] == convfirstnet.__version__
    import triton

    assert r["triton"] == triton.__version__


def test_fused_unfused_compiled_agree_per_image(capsys, tmp_path, checkpoints, data7, monkeypatch):
    """Fused (default), --no-fuse and --compile predict the same classes for every image, on a model whose
    predictions vary between images. Compilation uses the "eager" dynamo backend here (Inductor on CPU
    takes minutes); the wiring is what is tested."""
    args = ("--model", "pico", "--data", data7, "--checkpoint", checkpoints["image7"], "--batch-size", "8")
    runs = {}
    for label, extra in (("fused", []), ("unfused", ["--no-fuse"]), ("compiled", ["--compile"])):
        if label == "compiled":
            monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
        preds = tmp_path / f"{label}.csv"
        r = eval_json(capsys, tmp_path, *args, *extra, "--predictions-file", preds, name=f"{label}.json")
        runs[label] = (r, read_predictions(preds))
    fused, unfused, compiled = (runs[k][0] for k in ("fused", "unfused", "compiled"))
    assert (fused["fused"], unfused["fused"], compiled["compiled"]) == (True, False, True)
    reference = runs["fused"][1]
    assert len({p["preds"][0] for p in reference}) >= 3, "the model must not predict one class for all"
    for label in ("unfused", "compiled"):
        rows = runs[label][1]
        assert [(p["file"], p["preds"][0]) for p in rows] == [(p["file"], p["preds"][0]) for p in reference]
        assert [set(p["preds"]) for p in rows] == [set(p["preds"]) for p in reference], label
        assert runs[label][0]["loss"] == pytest.approx(fused["loss"], rel=1e-4)


def test_bfloat16_and_limit(capsys, tmp_path, checkpoints, data7):
    r = eval_json(
        capsys,
        tmp_path,
        "--model",
        "pico",
        "--data",
        data7,
        "--checkpoint",
        checkpoints["bias7"],
        "--dtype",
        "bfloat16",
        "--limit",
        "7",
        "--batch-size",
        "3",
    )
    # The first 7 images in sorted file order: n01 (2), n02 (4), n03 (0), n04 (1 of 6); top-1 is class 3.
    assert (r["dtype"], r["num_images"], r["top1_correct"], r["top5_correct"]) == ("bfloat16", 7, 1, 3)


def test_imagenet_synset_subset_uses_1000_class_indices(capsys, tmp_path, checkpoints):
    """Three ImageNet synset folders with a 1000-class checkpoint: each folder gets its synset's
    ImageNet-1k index (not 0, 1, 2), as timm's validate.py with the ImageNet class map."""
    data = make_image_folder(tmp_path / "subset", {TENCH[0]: 2, GOLDFISH[0]: 3, TOILET_TISSUE[0]: 1})
    r = eval_json(
        capsys, tmp_path, "--model", "pico", "--data", data, "--checkpoint", checkpoints["bias1000"]
    )
    # Logits: top-1 999, top-5 {999, 1, 2, 3, 4}; tench (index 0) is in neither.
    assert (r["num_images"], r["top1_correct"], r["top5_correct"]) == (6, 1, 4)
    assert r["labels"] == "imagenet-1k synsets" and r["num_classes"] == 1000


def test_class_map_file(capsys, tmp_path, checkpoints):
    """--class-map in timm's .txt format: line number = class index, for folders named anything."""
    data = make_image_folder(tmp_path / "named", {"cat": 2, "dog": 3, "fox": 4})
    class_map = tmp_path / "classes.txt"
    class_map.write_text(
        "\n".join(["owl", "fox", "eel", "cat", "ant", "dog", "bee"]) + "\n"
    )  # cat 3, dog 5, fox 1
    r = eval_json(
        capsys,
        tmp_path,
        "--model",
        "pico",
        "--data",
        data,
        "--checkpoint",
        checkpoints["bias7"],
        "--class-map",
        class_map,
    )
    # BIAS ranks 3 > 0 > 5 > 6 > 2 > 1 > 4: cat (3) is top-1, dog (5) top-5, fox (1) neither.
    assert (r["num_images"], r["top1_correct"], r["top5_correct"]) == (9, 2, 5)
    assert r["labels"] == "class map classes.txt"
    assert r["loss"] == pytest.approx(hand_loss(BIAS, [3, 3, 5, 5, 5, 1, 1, 1, 1]), rel=1e-6)
    # A folder the map does not name, or an index beyond the checkpoint's classes: one line each.
    class_map.write_text("cat\ndog\n")
    code, _, err = run_eval(
        capsys,
        "--model",
        "pico",
        "--data",
        data,
        "--checkpoint",
        checkpoints["bias7"],
        "--class-map",
        class_map,
        *FAST,
    )
    assert code == 1 and err.count("\n") == 1 and "no entry for the class folder(s) fox" in err
    class_map.write_text("\n".join(f"c{i}" for i in range(7)) + "\ncat\ndog\nfox\n")
    code, _, err = run_eval(
        capsys,
        "--model",
        "pico",
        "--data",
        data,
        "--checkpoint",
        checkpoints["bias7"],
        "--class-map",
        class_map,
        *FAST,
    )
    assert code == 1 and err.count("\n") == 1 and "outside the 7 classes" in err


def test_real_labels_match_timm(capsys, tmp_path, checkpoints):
    """--real-labels gives the accuracy timm's RealLabelsImagenet computes for the same outputs."""
    from PIL import Image
    from timm.data import RealLabelsImagenet

    root = tmp_path / "val"
    layout = {1: TENCH, 2: TENCH, 3: GOLDFISH, 4: GOLDFISH, 5: GOLDFISH, 6: TOILET_TISSUE}
    for i, (synset, _) in layout.items():
        (root / synset).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 36), (10 * i, 100, 200)).save(root / synset / f"ILSVRC2012_val_{i:08d}.JPEG")
    real = [[999], [], [1], [5, 999], [0], [999, 1]]  # image 2 has no real label: not counted
    real_json = tmp_path / "real.json"
    real_json.write_text(json.dumps(real))
    r = eval_json(
        capsys,
        tmp_path,
        "--model",
        "pico",
        "--data",
        root,
        "--checkpoint",
        checkpoints["bias1000"],
        "--real-labels",
        real_json,
    )
    # Predictions (every image): top-1 999, top-5 {999, 1, 2, 3, 4}.
    assert (r["real_num_images"], r["real_top1"], r["real_top5"]) == (5, 100.0 * 3 / 5, 100.0 * 4 / 5)
    assert (r["top1_correct"], r["top5_correct"]) == (1, 4)  # the folder labels are still counted too
    bias = torch.zeros(1000)
    bias[999], bias[1], bias[0] = 10.0, 9.0, -1.0
    bias[2:5] = torch.tensor([8.0, 7.0, 6.0])
    timm_real = RealLabelsImagenet(
        [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, 7)], real_json=str(real_json)
    )
    timm_real.add_result(bias.expand(6, 1000))
    assert r["real_top1"] == pytest.approx(timm_real.get_accuracy(k=1))
    assert r["real_top5"] == pytest.approx(timm_real.get_accuracy(k=5))
    # Files ReaL does not cover are an error, not silently skipped.
    real_json.write_text(json.dumps(real[:3]))
    code, _, err = run_eval(
        capsys,
        "--model",
        "pico",
        "--data",
        root,
        "--checkpoint",
        checkpoints["bias1000"],
        "--real-labels",
        real_json,
        *FAST,
    )
    assert code == 1 and "3 image(s), e.g. 'ILSVRC2012_val_00000004.JPEG', have no entry" in err


def test_use_ema_chooses_the_weights_as_timm(capsys, tmp_path, data7):
    """A timm training checkpoint: its raw weights by default (as timm's validate.py), EMA with --use-ema."""
    raw, ema = bias_model(BIAS), bias_model([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    path = tmp_path / "last.pth.tar"
    torch.save(
        {
            "epoch": 3,
            "arch": "convfirstnet_pico",
            "state_dict": raw.state_dict(),
            "state_dict_ema": {f"module.{k}": v for k, v in ema.state_dict().items()},
            "args": argparse.Namespace(model="pico"),
        },
        path,
    )
    code, out, _ = run_eval(capsys, "--data", data7, "--checkpoint", path, *FAST)  # model from the file
    assert code == 0 and "raw weights (state_dict)" in out and "--use-ema takes the EMA weights" in out
    default = eval_json(capsys, tmp_path, "--data", data7, "--checkpoint", path, name="raw.json")
    with_ema = eval_json(
        capsys, tmp_path, "--data", data7, "--checkpoint", path, "--use-ema", name="ema.json"
    )
    assert (default["ema"], default["top1_correct"], default["top5_correct"]) == (False, 6, 16)  # BIAS
    # EMA logits rank 6 > 5 > 4 > 3 > 2: top-1 n10 (3 images), top-5 n10, n07, n05, n04, n03 (15)
    assert (with_ema["ema"], with_ema["top1_correct"], with_ema["top5_correct"]) == (True, 3, 15)


def test_results_file_csv_json_and_several_models(capsys, tmp_path, checkpoints, data7):
    """One row per model in timm's validate.py results formats; the models are read from the files."""
    csv_path = tmp_path / "results.csv"
    args = ["--data", data7, "--checkpoint", checkpoints["bias7"], checkpoints["image7"], *FAST]
    code, out, err = run_eval(capsys, *args, "--results-file", csv_path)
    assert code == 0, err
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:6] == ["model", "top1", "top1_err", "top5", "top5_err", "loss"]
    assert [(r["model"], r["checkpoint"]) for r in rows] == [
        ("convfirstnet_pico", str(checkpoints["bias7"])),
        ("convfirstnet_pico", str(checkpoints["image7"])),
    ]
    assert float(rows[0]["top1"]) == pytest.approx(100 * 6 / 21) and int(rows[0]["top5_correct"]) == 16
    assert out.count(" * Acc@1 ") == 2 and "| model | top-1 |" in out
    json_path = tmp_path / "one.json"
    assert main([str(a) for a in args[:4]] + FAST + ["--results-file", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["top1_correct"] == 6  # one model: a dict, as timm writes it
    # 'all' is every size; a model list and a checkpoint list of different lengths is an error.
    assert model_names(["all"]) == convfirstnet.list_models()
    assert model_names(["small", "pico"]) == ["convfirstnet_small", "convfirstnet_pico"]
    capsys.readouterr()
    code, _, err = run_eval(
        capsys, "--model", "pico", "nano", "--data", data7, "--checkpoint", checkpoints["bias7"], *FAST
    )
    assert code == 1 and "2 model(s) but 1 --checkpoint file(s)" in err


def test_default_workers_fit_the_machine(monkeypatch):
    """--workers defaults to at most the cores available per process (no DataLoader warning on 2 cores)."""
    from convfirstnet.commands import _cli

    assert build_parser().parse_args(["--data", "x"]).workers is None
    monkeypatch.setattr(_cli, "available_cpus", lambda: 2)
    assert _cli.default_workers(4) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two torchrun processes share the two cores
    assert _cli.default_workers(4) == 1
    monkeypatch.setattr(_cli, "available_cpus", lambda: 64)
    assert _cli.default_workers(4) == 4


def test_timm_short_flags():
    args = build_parser().parse_args("-m pico nano --data-dir d -b 8 -j 2".split())
    assert (args.model, str(args.data), args.batch_size, args.workers) == (["pico", "nano"], "d", 8, 2)


# ----------------------------------------------------------------------------------------- errors
def _errors(tmp_path: Path, checkpoints: dict[str, Path], data7: Path) -> dict[str, tuple[list, str]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_images" / "n01").mkdir(parents=True)
    (tmp_path / "file.txt").write_text("x")
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    hello = tmp_path / "hello.pth.tar"  # torch.load(weights_only=True) of this raises KeyError: 101
    hello.write_bytes(b"hello")
    three = make_image_folder(tmp_path / "three", {"a": 1, "b": 1, "c": 1})
    pico = ["--model", "pico", "--checkpoint", checkpoints["image7"]]
    return {
        "missing data": (pico + ["--data", tmp_path / "nope"], "does not exist"),
        "data is a file": (pico + ["--data", tmp_path / "file.txt"], "is not a directory"),
        "empty data": (pico + ["--data", tmp_path / "empty"], "no class folders"),
        "no images": (pico + ["--data", tmp_path / "no_images"], "no images"),
        "unknown model": (["--model", "resnet50", "--data", data7], "unknown model 'resnet50'"),
        "missing checkpoint": (
            ["--model", "pico", "--data", data7, "--checkpoint", tmp_path / "x.pth"],
            "does not exist",
        ),
        "unreadable checkpoint": (
            ["--model", "pico", "--data", data7, "--checkpoint", garbage],
            "is not a checkpoint: neither a PyTorch file (torch.save) nor a safetensors file",
        ),
        "text file as checkpoint": (
            ["--model", "pico", "--data", data7, "--checkpoint", hello],
            "is not a checkpoint",
        ),
        "checkpoint of another model": (
            ["--model", "nano", "--data", data7, "--checkpoint", checkpoints["image7"]],
            "is for convfirstnet_pico, not convfirstnet_nano",
        ),
        "wrong class count": (
            pico + ["--data", three],
            "has 3 class folders, but the convfirstnet_pico checkpoint",
        ),
        "input too small": (pico + ["--data", data7, "--img-size", "16"], "needs at least 32"),
        "bad batch size": (pico + ["--data", data7, "--batch-size", "0"], "--batch-size must be at least 1"),
        "bad interpolation": (pico + ["--data", data7, "--interpolation", "foo"], "--interpolation 'foo'"),
        "missing class map": (pico + ["--data", data7, "--class-map", tmp_path / "no.txt"], "does not exist"),
        "real labels of another shape": (
            pico + ["--data", data7, "--real-labels", tmp_path / "file.txt"],
            "is not JSON",
        ),
        "real labels for 7 classes": (
            pico + ["--data", data7, "--real-labels", _write(tmp_path / "real.json", "[[1]]")],
            "needs a 1000-class",
        ),
    }


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


ERROR_CASES = [
    "missing data",
    "data is a file",
    "empty data",
    "no images",
    "unknown model",
    "missing checkpoint",
    "unreadable checkpoint",
    "text file as checkpoint",
    "checkpoint of another model",
    "wrong class count",
    "input too small",
    "bad batch size",
    "bad interpolation",
    "missing class map",
    "real labels of another shape",
    "real labels for 7 classes",
]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_are_one_line(case, capsys, tmp_path, checkpoints, data7):
    args, message = _errors(tmp_path, checkpoints, data7)[case]
    code, _, err = run_eval(capsys, *args, "--workers", "0", "--no-progress")
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("convfirstnet eval: error: "), err
    assert message in err and "Traceback" not in err


def test_checkpoint_that_does_not_fit(capsys, tmp_path, data7):
    """A weight file without architecture metadata but the wrong shapes names the mismatching keys."""
    path = tmp_path / "other.safetensors"
    sd = convfirstnet.create_model("pico", num_classes=7).state_dict()
    sd["stem.conv.weight"] = torch.zeros(8, 3, 3, 3)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    code, _, err = run_eval(capsys, "--model", "pico", "--data", data7, "--checkpoint", path, *FAST)
    assert code == 1 and err.count("\n") == 1
    assert "does not fit" in err and "stem.conv.weight" in err


def test_no_weights_without_checkpoint(capsys, tmp_path, data7, monkeypatch):
    from convfirstnet import weights

    monkeypatch.setenv("CONVFIRSTNET_WEIGHTS_DIR", str(tmp_path / "w"))
    monkeypatch.setenv("CONVFIRSTNET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "SOURCE_WEIGHTS_DIR", tmp_path / "src")
    monkeypatch.setattr(weights, "manifest", lambda: {"models": {}})
    code, _, err = run_eval(capsys, "--model", "pico", "--data", data7, *FAST)
    assert code == 1 and err.count("\n") == 1
    assert "no weights for convfirstnet_pico" in err and "--checkpoint PATH" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU message")
def test_cuda_requested_without_gpu(capsys, checkpoints, data7):
    code, out, err = run_eval(
        capsys,
        "--model",
        "pico",
        "--data",
        data7,
        "--checkpoint",
        checkpoints["image7"],
        "--device",
        "cuda",
        *FAST,
    )
    assert code == 1 and err.count("\n") == 1 and "no CUDA device" in err and out == ""


@pytest.mark.subprocess
def test_script_error_exit_without_traceback(tmp_path):
    """The scripts/ wrapper, as a user runs it: exit status 1, one line on stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "eval_imagenet.py"),
            "--model",
            "pico",
            "--data",
            str(tmp_path / "nope"),
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------- distributed
@pytest.mark.subprocess
def test_two_process_gloo_equals_single_process(capsys, tmp_path, checkpoints):
    """torchrun, 2 CPU processes (gloo): 13 images in batches of 2 leave one padded sample on rank 1.
    Every image gets the same predictions as in one process."""
    data = make_image_folder(
        tmp_path / "data", {"n01": 3, "n02": 1, "n03": 2, "n04": 0, "n05": 4, "n06": 1, "n07": 2}, seed=1
    )
    args = ["--model", "pico", "--data", data, "--checkpoint", checkpoints["image7"], "--batch-size", "2"]
    single = eval_json(
        capsys, tmp_path, *args, "--predictions-file", tmp_path / "single.csv", name="single.json"
    )
    out = tmp_path / "dist.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "scripts" / "eval_imagenet.py"),
            *map(str, args),
            "--device",
            "cpu",
            "--results-json",
            str(out),
            "--predictions-file",
            str(tmp_path / "dist.csv"),
            *FAST,
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist = json.loads(out.read_text())
    assert dist["world_size"] == 2 and single["world_size"] == 1
    keys = ("num_images", "top1_correct", "top5_correct", "top1", "top5")
    assert [dist[k] for k in keys] == [single[k] for k in keys]
    assert dist["num_images"] == 13 and dist["loss"] == pytest.approx(single["loss"], rel=1e-5)
    one, two = read_predictions(tmp_path / "single.csv"), read_predictions(tmp_path / "dist.csv")
    assert [(p["index"], p["file"], p["label"], p["preds"][0]) for p in two] == [
        (p["index"], p["file"], p["label"], p["preds"][0]) for p in one
    ]
    assert [set(p["preds"]) for p in two] == [set(p["preds"]) for p in one]
    assert len({p["preds"][0] for p in one}) >= 3


def test_same_predictions_as_timm_pipeline(capsys, tmp_path, checkpoints):
    """Every image's top-5 equals a plain loop over timm's own create_dataset / create_loader (what timm's
    validate.py runs) with the model loaded by timm.create_model(checkpoint_path=...)."""
    import timm
    from timm.data import create_dataset, create_loader, resolve_data_config

    data = make_image_folder(
        tmp_path / "data", {"n01": 2, "n02": 3, "n03": 1, "n04": 2, "n05": 1, "n06": 2, "n07": 1}, seed=2
    )
    ckpt = checkpoints["image7"]
    preds = tmp_path / "p.csv"
    r = eval_json(
        capsys,
        tmp_path,
        "--model",
        "pico",
        "--data",
        data,
        "--checkpoint",
        ckpt,
        "--no-fuse",
        "--batch-size",
        "4",
        "--predictions-file",
        preds,
    )
    model = timm.create_model("convfirstnet_pico", num_classes=7, checkpoint_path=str(ckpt)).eval()
    cfg = resolve_data_config({"img_size": 32}, model=model, use_test_size=True)
    loader = create_loader(
        create_dataset("", root=str(data), split="validation"),
        input_size=cfg["input_size"],
        batch_size=4,
        interpolation=cfg["interpolation"],
        mean=cfg["mean"],
        std=cfg["std"],
        crop_pct=cfg["crop_pct"],
        crop_mode=cfg["crop_mode"],
        num_workers=0,
        device=torch.device("cpu"),
    )
    top5, labels = [], []
    with torch.no_grad():
        for x, y in loader:
            top5 += model(x).topk(5, dim=1).indices.tolist()
            labels += y.tolist()
    rows = read_predictions(preds)
    assert [p["label"] for p in rows] == labels and len(rows) == 12
    assert [p["preds"][0] for p in rows] == [t[0] for t in top5]
    assert [set(p["preds"]) for p in rows] == [set(t) for t in top5]
    assert r["top1_correct"] == sum(t[0] == y for t, y in zip(top5, labels))
    assert r["top5_correct"] == sum(y in t for t, y in zip(top5, labels))
