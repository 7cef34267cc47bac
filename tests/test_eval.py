"""ImageNet evaluation tool (convfirstnet/tools/eval_imagenet.py) on small generated ImageFolders.

The real Pico runs at 32x32 with a few images per class; models are built with ``num_classes`` equal to
the folder count and passed as checkpoint files. Exact metrics come from a checkpoint whose classifier
weight is zero: every image gets the classifier bias as logits, so top-1 / top-5 are known by hand.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import convfirstnet
from convfirstnet.tools import eval_imagenet
from convfirstnet.tools.eval_imagenet import Counts, evaluate, main, shard_size
from convfirstnet.weights import save_weights, sha256_file

REPO = Path(__file__).resolve().parent.parent
FAST = ["--img-size", "32", "--workers", "0", "--no-progress"]
# Seven classes created out of order; the empty folder must still take its sorted index (2).
CLASS_COUNTS = {"n05": 1, "n10": 3, "n01": 2, "n03": 0, "n07": 5, "n02": 4, "n04": 6}  # 21 images
SORTED = ["n01", "n02", "n03", "n04", "n05", "n07", "n10"]
# Classifier bias, by class index: ranking 3 > 0 > 5 > 6 > 2 > 1 > 4.
BIAS = [5.0, 1.0, 2.0, 6.0, 0.0, 4.0, 3.0]


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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    random7 = convfirstnet.create_model("pico", num_classes=7)
    for m in random7.modules():  # non-trivial BatchNorm statistics, so folding matters
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 2.0)
    bias7 = convfirstnet.create_model("pico", num_classes=7)
    with torch.no_grad():
        bias7.classifier.weight.zero_()
        bias7.classifier.bias.copy_(torch.tensor(BIAS))
    return {
        "random7": save_model(random7, d / "random7.safetensors"),
        "bias7": save_model(bias7, d / "bias7.safetensors"),
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


# ----------------------------------------------------------------------------------------- metrics
def test_exact_metrics_and_label_order(capsys, tmp_path, checkpoints, data7):
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
    assert r["num_classes"] == 7


def test_topk_hits_and_fewer_classes_than_k():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.3], [0.2, 0.3, 0.5]])
    c1, c5 = eval_imagenet.topk_hits(logits, torch.tensor([1, 2, 0]))
    assert (int(c1), int(c5)) == (1, 3)  # 3 classes: top-5 covers all
    c1, c2 = eval_imagenet.topk_hits(logits, torch.tensor([1, 2, 0]), k=2)
    assert (int(c1), int(c2)) == (1, 2)


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
    assert evaluate(stub, loader, num_images=5) == Counts(top1=4, top5=5, images=5)
    assert stub.batches == [3, 2]
    stub = _Stub()
    assert evaluate(stub, loader, num_images=7, pad_to=3) == Counts(top1=5, top5=7, images=7)
    assert stub.batches == [3, 3, 3]  # the last batch of 1 ran padded to 3


# ----------------------------------------------------------------------------------------- options
def test_results_json_fields(capsys, tmp_path, checkpoints, data7):
    ckpt = checkpoints["random7"]
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
    )
    required = {
        "model",
        "checkpoint",
        "checkpoint_sha256",
        "top1",
        "top5",
        "num_images",
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
    assert r["model"] == "convfirstnet_pico"
    assert r["checkpoint"] == str(ckpt) and r["checkpoint_sha256"] == sha256_file(ckpt)
    assert r["num_images"] == 21 and 0 <= r["top1"] <= r["top5"] <= 100
    assert (r["img_size"], r["crop_pct"], r["interpolation"]) == (
        32,
        0.95,
        "bicubic",
    )  # pretrained_cfg, size overridden
    assert (r["dtype"], r["device"], r["fused"], r["compiled"]) == ("float32", "cpu", True, False)
    assert r["img_per_sec"] > 0
    assert r["torch"] == torch.__version__ and r["convfirstnet"] == convfirstnet.__version__
    import triton

    assert r["triton"] == triton.__version__


def test_fused_unfused_compiled_agree(capsys, tmp_path, checkpoints, data7, monkeypatch):
    """Fused (default), --no-fuse and --compile give the same counts on the same weights. Compilation
    uses the "eager" dynamo backend here (Inductor on CPU takes minutes); the wiring is what is tested."""
    args = ("--model", "pico", "--data", data7, "--checkpoint", checkpoints["random7"], "--batch-size", "8")
    fused = eval_json(capsys, tmp_path, *args, name="fused.json")
    unfused = eval_json(capsys, tmp_path, *args, "--no-fuse", name="unfused.json")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    compiled = eval_json(capsys, tmp_path, *args, "--compile", name="compiled.json")
    assert (fused["fused"], unfused["fused"], compiled["compiled"]) == (True, False, True)
    for r in (unfused, compiled):
        assert (r["top1_correct"], r["top5_correct"], r["num_images"]) == (
            fused["top1_correct"],
            fused["top5_correct"],
            fused["num_images"],
        )


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


# ----------------------------------------------------------------------------------------- errors
def _errors(tmp_path: Path, checkpoints: dict[str, Path], data7: Path) -> dict[str, tuple[list, str]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_images" / "n01").mkdir(parents=True)
    (tmp_path / "file.txt").write_text("x")
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    three = make_image_folder(tmp_path / "three", {"a": 1, "b": 1, "c": 1})
    pico = ["--model", "pico", "--checkpoint", checkpoints["random7"]]
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
            "cannot read checkpoint",
        ),
        "checkpoint of another model": (
            ["--model", "nano", "--data", data7, "--checkpoint", checkpoints["random7"]],
            "is for convfirstnet_pico, not convfirstnet_nano",
        ),
        "wrong class count": (
            pico + ["--data", three],
            "has 3 class folders, but the convfirstnet_pico checkpoint",
        ),
        "input too small": (pico + ["--data", data7, "--img-size", "16"], "needs at least 32"),
        "bad batch size": (pico + ["--data", data7, "--batch-size", "0"], "--batch-size must be at least 1"),
    }


ERROR_CASES = [
    "missing data",
    "data is a file",
    "empty data",
    "no images",
    "unknown model",
    "missing checkpoint",
    "unreadable checkpoint",
    "checkpoint of another model",
    "wrong class count",
    "input too small",
    "bad batch size",
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
    code, _, err = run_eval(
        capsys,
        "--model",
        "pico",
        "--data",
        data7,
        "--checkpoint",
        checkpoints["random7"],
        "--device",
        "cuda",
        *FAST,
    )
    assert code == 1 and err.count("\n") == 1 and "no CUDA device" in err


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
def test_two_process_gloo_equals_single_process(capsys, tmp_path, checkpoints):
    """torchrun, 2 CPU processes (gloo): 13 images in batches of 2 leave one padded sample on rank 1."""
    data = make_image_folder(
        tmp_path / "data", {"n01": 3, "n02": 1, "n03": 2, "n04": 0, "n05": 4, "n06": 1, "n07": 2}, seed=1
    )
    args = ["--model", "pico", "--data", data, "--checkpoint", checkpoints["random7"], "--batch-size", "2"]
    single = eval_json(capsys, tmp_path, *args, name="single.json")
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
    assert dist["num_images"] == 13


def test_same_counts_as_timm_pipeline(capsys, tmp_path, checkpoints):
    """The counts equal a plain loop over timm's own create_dataset / create_loader (what timm's
    validate.py runs) with the model loaded by timm.create_model(checkpoint_path=...)."""
    import timm
    from timm.data import create_dataset, create_loader, resolve_data_config

    data = make_image_folder(
        tmp_path / "data", {"n01": 2, "n02": 3, "n03": 1, "n04": 2, "n05": 1, "n06": 2, "n07": 1}, seed=2
    )
    ckpt = checkpoints["random7"]
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
    top1 = top5 = n = 0
    with torch.no_grad():
        for x, y in loader:
            pred = model(x).topk(5, dim=1).indices
            top1 += int((pred[:, 0] == y).sum())
            top5 += int((pred == y[:, None]).any(1).sum())
            n += len(y)
    assert (r["top1_correct"], r["top5_correct"], r["num_images"]) == (top1, top5, n) == (top1, top5, 12)
