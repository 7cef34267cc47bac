"""convfirstnet/commands/train/ on CPU: recipe defaults, a smoke run, exact resume, DDP (gloo)
and an end-to-end run whose weight file loads with ``pretrained=True`` and evaluates the same fused and
unfused."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convfirstnet.commands import train as train_imagenet
from convfirstnet.commands.train import loop

from ._graphs import EmulatedGraphs
from ._imagefolder import make_image_folder

REPO = Path(__file__).resolve().parent.parent
# Shrunk settings shared by the runs: 32x32 images, no AMP, data loading in the main process, a log
# record every step.
SMALL = "--model pico --img-size 32 --val-img-size 32 --workers 0 --device cpu --no-amp --log-interval 1"
SMALL = SMALL.split() + ["--no-progress"]


pytestmark = pytest.mark.usefixtures("one_thread")  # Pico steps on 32x32 images: 0.2 s, vs 2 s with two busy threads


def read_log(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]


def load(path: Path) -> dict:
    from timm.utils import load_checkpoint_metadata  # torch.load(weights_only=True), timm's args allowed

    return load_checkpoint_metadata(str(path))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """4 classes, 8 training and 4 validation images each, 32x32."""
    return make_image_folder(tmp_path_factory.mktemp("tiny"), 4, {"train": 8, "val": 4}, size=32)


def test_recipe_defaults():
    args = train_imagenet.build_parser().parse_args(["--model", "pico", "--data", "x"])
    assert (args.epochs, args.batch_size, args.lr, args.lr_base) == (600, 256, None, 0.128)
    assert train_imagenet.recipe_lr(8 * args.batch_size) == pytest.approx(0.128)  # paper: 8 GPUs x 256
    assert train_imagenet.recipe_lr(512) == pytest.approx(0.032)
    assert (args.opt, args.momentum, args.weight_decay) == ("rmsproptf", 0.9, 1e-5)
    assert (args.warmup_epochs, args.decay_epochs, args.decay_rate) == (3, 2.4, 0.97)
    assert (args.drop, args.drop_path) == (None, 0.2)  # None: the size's rate, 0.2 Pico / 0.3 others
    assert (args.aa, args.reprob, args.remode) == ("rand-m9-mstd0.5", 0.2, "pixel")
    assert (args.img_size, args.val_img_size, args.ema, args.channels_last) == (224, None, True, True)
    assert args.amp is None  # fp16 AMP whenever the device is CUDA


def test_timm_flags_and_defaults():
    args = train_imagenet.build_parser().parse_args("-m pico --data-dir d -b 16 -j 3".split())
    assert (args.model, str(args.data), args.batch_size, args.workers) == ("pico", "d", 16, 3)
    args = train_imagenet.build_parser().parse_args("-m pico --data d".split())
    assert args.workers is None  # the cores available, at most 8
    assert (args.mixup, args.cutmix, args.cutmix_minmax) == (0.0, 0.0, None)  # the paper's recipe: off
    assert (args.pretrained, args.initial_checkpoint) == (False, None)


def _user_errors(tmp_path: Path, data: Path) -> dict[str, tuple[list[str], str]]:
    flat = make_image_folder(tmp_path / "flat", 2, {"x": 2}, size=32) / "x"  # class folders, no train/
    other = make_image_folder(tmp_path / "other", 2, {"train": 2, "val": 1}, size=32)
    (other / "val" / "class_9").mkdir()
    garbage = tmp_path / "garbage.pth.tar"
    garbage.write_bytes(b"hello")  # torch.load(weights_only=True): KeyError 101
    d = ["--data", str(data)]
    return {
        "unknown model": (["--model", "foo", *d], "unknown model 'foo'"),
        "input too small": (["--model", "pico", *d, "--img-size", "16"], "--img-size 16: ConvFirstNet needs"),
        "missing data": (["--model", "pico", "--data", str(tmp_path / "missing")], "is not a directory"),
        "no train folder": (["--model", "pico", "--data", str(flat)], "has no train/ folder"),
        "val class not in train": (["--model", "pico", "--data", str(other)], "class_9"),
        "garbage resume": (["--model", "pico", *d, "--resume", str(garbage)], "is not a training checkpoint"),
        "garbage initial checkpoint": (
            ["--model", "pico", *d, "--initial-checkpoint", str(garbage)],
            "is not a checkpoint",
        ),
        "too few classes": (["--model", "pico", *d, "--num-classes", "2"], "less than the 4 training"),
        "odd batch with mixup": (["--model", "pico", *d, "--mixup", "0.2", "-b", "7"], "even --batch-size"),
        "unknown optimizer": (["--model", "pico", *d, "--opt", "nope", "-b", "8"], "--opt 'nope'"),
        "cuda without a gpu": (["--model", "pico", *d, "--device", "cuda"], "no CUDA device"),
    }


USER_ERRORS = [
    "unknown model", "input too small", "missing data", "no train folder", "val class not in train",
    "garbage resume", "garbage initial checkpoint", "too few classes", "odd batch with mixup",
    "unknown optimizer", "cuda without a gpu",
]


@pytest.mark.parametrize("case", USER_ERRORS)
def test_user_errors_are_one_line_and_create_nothing(case, tiny_data, tmp_path, capsys):
    if case == "cuda without a gpu" and torch.cuda.is_available():
        pytest.skip("tests the no-GPU message")
    argv, message = _user_errors(tmp_path, tiny_data)[case]
    out = tmp_path / "out" / "run"
    assert train_imagenet.main([*argv, "--output", str(out), "--workers", "0", "--no-amp"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("convfirstnet train: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "out").exists()


def test_failed_run_removes_what_it_created(tiny_data, tmp_path, monkeypatch, capsys):
    """A run that fails before its first checkpoint leaves no output folder; after one, everything stays."""
    argv = [*SMALL, "--data", str(tiny_data), "--aug", "none", "--batch-size", "8", "--no-ema"]
    argv.append("--no-weights")

    def failing_validate(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(loop, "validate", failing_validate)
    (tmp_path / "existing").mkdir()
    out = tmp_path / "existing" / "new" / "run"
    with pytest.raises(RuntimeError, match="simulated failure"):
        train_imagenet.main([*argv, "--epochs", "1", "--output", str(out)])
    assert list((tmp_path / "existing").iterdir()) == []  # new/run removed, the existing parent kept

    calls = []

    def fails_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated failure")
        return {"loss": 1.0, "top1": 50.0, "top5": 100.0}

    monkeypatch.setattr(loop, "validate", fails_second_time)
    with pytest.raises(RuntimeError, match="simulated failure"):
        train_imagenet.main([*argv, "--epochs", "2", "--output", str(out)])
    assert {"last.pth.tar", "args.yaml", "log.jsonl", "summary.csv"} <= {p.name for p in out.iterdir()}


def test_earlier_run_is_refused_unless_resumed_or_overwritten(tiny_data, tmp_path, capsys):
    """A second run into a folder holding a run is refused in one line, before any work, and nothing is
    touched; --overwrite starts clean (no stale checkpoint, one summary row) and keeps other files."""
    out = tmp_path / "run"
    argv = [*SMALL, "--data", str(tiny_data), "--output", str(out), "--no-weights", "--no-ema"]
    argv += "--aug none --batch-size 16 --warmup-epochs 0".split()
    assert train_imagenet.main([*argv, "--epochs", "2"]) == 0
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"checkpoint-0.pth.tar", "checkpoint-1.pth.tar", "summary.csv"} <= before.keys()
    capsys.readouterr()

    for extra, message in (
        ([], "holds an earlier run (args.yaml, checkpoint-0.pth.tar, checkpoint-1.pth.tar, last.pth.tar, "
             "...): continue it with --resume auto, or start over with --overwrite"),
        (["--resume", "auto", "--overwrite"], "give --resume or --overwrite, not both"),
    ):
        assert train_imagenet.main([*argv, "--epochs", "1", *extra]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    assert train_imagenet.main([*argv, "--epochs", "1", "--overwrite"]) == 0
    assert "--overwrite: removed" in capsys.readouterr().out
    assert {p.name for p in out.glob("*.pth.tar")} == {"last.pth.tar", "model_best.pth.tar",
                                                        "checkpoint-0.pth.tar"}
    assert (out / "summary.csv").read_text().count("\n") == 2  # header and epoch 0 of this run
    assert [r["epoch"] for r in read_log(out) if r["kind"] == "epoch"] == [0]
    assert (out / "notes.txt").read_text() == "mine"


def test_smoke(tiny_data, tmp_path, capsys):
    """One epoch with the recipe's augmentation (RandAugment, random erasing) and defaults otherwise."""
    out = tmp_path / "run"
    argv = [*SMALL, "--data", str(tiny_data), "--output", str(out)]
    argv += "--epochs 1 --batch-size 8 --warmup-epochs 0 --resume auto".split()
    old = os.umask(0o022)
    try:
        assert train_imagenet.main(argv) == 0
    finally:
        os.umask(old)
    printed = capsys.readouterr().out
    assert "no checkpoint" in printed and "dropout 0.2, drop-path 0.2" in printed
    assert "kernels torch" in printed  # the default on CPU: every layer in PyTorch
    records = read_log(out)
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["global_step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and r["lr"] > 0 and r["img_per_s"] > 0 for r in steps)
    epoch = records[-1]
    assert epoch["kind"] == "epoch" and 0 <= epoch["top1"] <= 100 and 0 <= epoch["ema_top1"] <= 100
    for key in ("top1", "top5", "ema_top1", "ema_top5"):  # exact counts over the 16 validation images
        assert (epoch[key] * 16 / 100) == pytest.approx(round(epoch[key] * 16 / 100))
    assert epoch["top1"] <= epoch["top5"] and epoch["val_loss"] > 0 and epoch["ema_val_loss"] > 0
    # timm's summary.csv columns, the EMA's beside the raw model's, the same numbers as the log
    import csv

    with open(out / "summary.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert list(row) == [
        "epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5",
        "eval_ema_loss", "eval_ema_top1", "eval_ema_top5", "lr",
    ]
    assert float(row["eval_top1"]) == epoch["top1"] and float(row["eval_ema_top5"]) == epoch["ema_top5"]
    assert float(row["eval_loss"]) == pytest.approx(epoch["val_loss"])
    import yaml

    saved = yaml.safe_load((out / "args.yaml").read_text())  # the arguments, as timm's train.py saves them
    assert (saved["model"], saved["batch_size"], saved["data"]) == ("pico", 8, str(tiny_data))
    files = {p.name for p in out.iterdir()}
    assert {"last.pth.tar", "checkpoint-0.pth.tar", "convfirstnet_pico.safetensors"} <= files
    umask = os.umask(0)
    os.umask(umask)
    for name in ("last.pth.tar", "convfirstnet_pico.safetensors", "args.yaml"):  # not safetensors' 0600
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    checkpoint = load(out / "last.pth.tar")
    assert checkpoint["position"] == {"epoch": 1, "step_in_epoch": 0, "global_step": 4}
    assert {"state_dict", "state_dict_ema", "optimizer", "scheduler", "args"} <= checkpoint.keys()
    # The weight file holds the EMA weights; the manifest entry is printed.
    from convfirstnet.weights import read_checkpoint

    loaded = read_checkpoint(out / "convfirstnet_pico.safetensors", use_ema=False)
    weights, metadata = loaded.state_dict, loaded.metadata
    assert metadata["architecture"] == "convfirstnet_pico"
    torch.testing.assert_close(weights, dict(checkpoint["state_dict_ema"]), rtol=0, atol=0)
    assert '"convfirstnet_pico": {' in printed and '"sha256"' in printed


def test_resume_continues_exactly(tiny_data, tmp_path, capsys):
    """Stopped after 3 of 8 steps and resumed, a run ends with the same weights, EMA and optimizer state as
    an uninterrupted one: the optimizer, EMA, scheduler and the position in the epoch were all restored."""
    common = [*SMALL, "--data", str(tiny_data)] + (
        "--epochs 2 --batch-size 8 --aug none --drop 0 --drop-path 0 --lr 0.01 --warmup-epochs 1 "
        "--decay-epochs 0.5 --ema-warmup --no-weights"
    ).split()
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train_imagenet.main(common + ["--output", str(straight)]) == 0

    assert train_imagenet.main(common + ["--output", str(split), "--max-steps", "3"]) == 0
    assert "stopped at --max-steps 3 (epoch 0, step 3)" in capsys.readouterr().out
    assert [p.name for p in split.glob("*.pth.tar")] == ["recovery-0-3.pth.tar"]
    recovery = load(split / "recovery-0-3.pth.tar")
    assert recovery["position"] == {"epoch": 0, "step_in_epoch": 3, "global_step": 3}
    assert recovery["optimizer"]["state"]  # RMSprop square averages and momentum buffers were saved

    assert train_imagenet.main(common + ["--output", str(split), "--resume", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    train_records = [r for r in read_log(split) if r["kind"] == "train"]
    steps = [(r["epoch"], r["step"], r["global_step"]) for r in train_records]
    assert steps == [(0, 1, 1), (0, 2, 2), (0, 3, 3), (0, 4, 4), (1, 1, 5), (1, 2, 6), (1, 3, 7), (1, 4, 8)]
    straight_lrs = {r["global_step"]: r["lr"] for r in read_log(straight) if r["kind"] == "train"}
    assert {r["global_step"]: r["lr"] for r in train_records} == straight_lrs
    assert not list(split.glob("recovery-*"))  # superseded by the epoch checkpoints

    a, b = load(straight / "last.pth.tar"), load(split / "last.pth.tar")
    assert a["position"] == b["position"] == {"epoch": 2, "step_in_epoch": 0, "global_step": 8}
    for key in ("state_dict", "state_dict_ema"):
        torch.testing.assert_close(dict(b[key]), dict(a[key]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b["optimizer"]["state"], a["optimizer"]["state"], rtol=1e-5, atol=1e-6)
    assert b["scheduler"] == a["scheduler"]


def test_summary_columns_stay_aligned_between_validations(tiny_data, tmp_path):
    """With --val-interval 2, epoch 0 has no validation: its eval cells are empty, not shifted."""
    out = tmp_path / "run"
    argv = [*SMALL, "--data", str(tiny_data), "--output", str(out), "--no-weights", "--aug", "none"]
    argv += "--epochs 2 --batch-size 16 --val-interval 2 --warmup-epochs 0".split()
    assert train_imagenet.main(argv) == 0
    import csv

    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:5] == ["epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5"]
    assert rows[0][-1] == "lr"
    assert all(len(r) == len(rows[0]) for r in rows)
    first, second = rows[1], rows[2]
    assert first[0] == "0" and first[2:-1] == [""] * (len(rows[0]) - 3) and float(first[-1]) > 0
    assert second[0] == "1" and all(float(v) >= 0 for v in second[2:-1])


def _weights_like_training(num_classes: int, seed: int) -> torch.nn.Module:
    from ._models import trained_like

    return trained_like("pico", seed=seed, num_classes=num_classes)


def test_finetune_from_pretrained_and_initial_checkpoint(tiny_data, tmp_path, monkeypatch, capsys):
    """--pretrained (the package's lookup) and --initial-checkpoint (a timm checkpoint: EMA preferred) start
    from those weights, with a new 4-class classifier for the 4 training folders."""
    from convfirstnet.weights import save_weights

    pretrained = _weights_like_training(7, seed=3)
    weights_dir = tmp_path / "weights"
    save_weights(pretrained.state_dict(), weights_dir / "convfirstnet_pico.safetensors",
                 {"architecture": "convfirstnet_pico"})
    raw, ema = _weights_like_training(7, seed=4), _weights_like_training(7, seed=5)
    timm_ckpt = tmp_path / "model_best.pth.tar"
    torch.save({"state_dict": raw.state_dict(), "state_dict_ema": ema.state_dict(), "epoch": 9}, timm_ckpt)
    monkeypatch.setenv("CONVFIRSTNET_WEIGHTS_DIR", str(weights_dir))
    # one step at a negligible learning rate: the weights after it are the starting weights
    one_step = [*SMALL, "--data", str(tiny_data), "--batch-size", "8", "--max-steps", "1", "--lr", "1e-9",
                "--warmup-epochs", "0", "--no-ema", "--aug", "none"]
    for label, start, expected in (
        ("pretrained", ["--pretrained"], pretrained),
        ("initial", ["--initial-checkpoint", str(timm_ckpt)], ema),
    ):
        out = tmp_path / label
        assert train_imagenet.main([*one_step, *start, "--output", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "new 4-class classifier (the checkpoint has 7)" in printed
        if label == "initial":
            assert "EMA weights (state_dict_ema)" in printed
        state = load(out / "recovery-0-1.pth.tar")["state_dict"]
        assert state["classifier.weight"].shape == (4, 1280)
        for key in ("stem.conv.weight", "stages.3.0.conv_expand.weight", "head.conv.weight"):
            torch.testing.assert_close(state[key], expected.state_dict()[key], rtol=0, atol=1e-6)
        assert not torch.allclose(state["stem.conv.weight"], raw.state_dict()["stem.conv.weight"], atol=1e-3)


def test_mixup_and_cutmix_mix_the_targets(tiny_data, tmp_path, monkeypatch, capsys):
    """--mixup / --cutmix: timm's Mixup on the batch and SoftTargetCrossEntropy on its soft targets."""
    from timm.loss import SoftTargetCrossEntropy

    seen = []
    forward = SoftTargetCrossEntropy.forward

    def recording_forward(self, x, target):
        seen.append(target.detach().clone())
        return forward(self, x, target)

    monkeypatch.setattr(SoftTargetCrossEntropy, "forward", recording_forward)
    argv = [*SMALL, "--data", str(tiny_data), "--output", str(tmp_path / "run"), "--batch-size", "8",
            "--max-steps", "2", "--no-ema", "--aug", "none", "--smoothing", "0", "--mixup", "0.8",
            "--cutmix", "1.0", "--warmup-epochs", "0"]
    assert train_imagenet.main(argv) == 0
    assert "mixup on" in capsys.readouterr().out
    assert len(seen) == 2 and all(t.shape == (8, 4) for t in seen)
    for t in seen:
        torch.testing.assert_close(t.sum(dim=1), torch.ones(8))
        assert ((t > 0).sum(dim=1) >= 2).any()  # some targets are mixtures of two classes


@pytest.mark.subprocess
@pytest.mark.slow
def test_distributed_gloo(tiny_data, tmp_path):
    """torchrun with two CPU processes (gloo): sharded batches, stop, resume, weight file."""
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*launcher, str(REPO / "scripts" / "train_imagenet.py"), *SMALL, "--data", str(tiny_data)]
    cmd += ["--output", str(out), *"--epochs 2 --batch-size 4 --aug none --warmup-epochs 0 --lr 5e-3".split()]

    first = subprocess.run(cmd + ["--max-steps", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 process(es) on cpu, global batch 8" in first.stdout and "4 steps/epoch" in first.stdout
    second = subprocess.run(cmd + ["--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "global step 3" in second.stdout
    assert [r["global_step"] for r in read_log(out) if r["kind"] == "train"] == list(range(1, 9))
    assert (out / "convfirstnet_pico.safetensors").is_file()


@pytest.mark.slow
def test_learns_and_weight_file_evaluates(tmp_path, capsys, monkeypatch):
    """Pico learns coloured shapes (4 classes) to >= 90 % top-1; the weight file loads with pretrained=True
    and the eval tool reports the same top-1 fused and unfused."""
    import convfirstnet
    from convfirstnet.commands import eval as eval_imagenet

    data = make_image_folder(tmp_path / "shapes", 4, {"train": 48, "val": 16}, size=32, seed=1)
    out = tmp_path / "run"
    # The recipe's optimizer (rmsproptf) and step schedule, tuned for a tiny task: no dropout, drop-path,
    # augmentation or label smoothing, a fast step decay (0.8 per epoch) and a fast EMA. Model seeds 1-3 and
    # 42 all reached 100 % EMA top-1 by epoch 8 with these settings; a constant lr of 5e-3 was unstable.
    tuned = (
        "--epochs 12 --batch-size 16 --lr 2e-3 --warmup-epochs 1 --decay-epochs 1 --decay-rate 0.8 "
        "--aug none --drop 0 --drop-path 0 --smoothing 0 --ema-decay 0.9 --ema-warmup --val-interval 4"
    ).split()
    assert train_imagenet.main([*SMALL, "--data", str(data), "--output", str(out), *tuned]) == 0
    capsys.readouterr()
    final = read_log(out)[-1]
    assert final["kind"] == "epoch" and final["ema_top1"] >= 90, final

    monkeypatch.setenv("CONVFIRSTNET_WEIGHTS_DIR", str(out))
    fused = convfirstnet.create_model("pico", pretrained=True, num_classes=4)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules())  # the inference form
    path = out / "convfirstnet_pico.safetensors"
    unfused = convfirstnet.create_model("pico", checkpoint_path=path, num_classes=4).eval()
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), unfused(x), rtol=1e-4, atol=1e-4)

    # The eval tool finds the file through $CONVFIRSTNET_WEIGHTS_DIR too.
    results = {}
    for label, extra in (("fused", []), ("unfused", ["--no-fuse"])):
        json_path = tmp_path / f"{label}.json"
        argv = "--model pico --img-size 32 --device cpu --workers 0 --batch-size 32 --no-progress".split()
        argv += ["--data", str(data), "--results-json", str(json_path), *extra]
        assert eval_imagenet.main(argv) == 0
        results[label] = json.loads(json_path.read_text())
    assert results["fused"]["fused"] and not results["unfused"]["fused"]
    assert results["fused"]["num_images"] == 64 and results["fused"]["checkpoint"] == str(path)
    assert results["fused"]["top1_correct"] == results["unfused"]["top1_correct"]
    assert results["fused"]["top1"] == results["unfused"]["top1"] >= 90


def test_kernels_triton_needs_cuda_or_the_interpreter(tiny_data, tmp_path, capsys, monkeypatch):
    """--kernels triton on CPU without Triton's interpreter is a one-line error before anything is made."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call by kernels._launch.interpreter_enabled
    out = tmp_path / "out" / "run"
    argv = [*SMALL, "--data", str(tiny_data), "--output", str(out), "--kernels", "triton"]
    assert train_imagenet.main(argv) == 1
    err = capsys.readouterr().err
    assert "--kernels triton needs CUDA" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_weight_file_under_kernels_triton(tmp_path, capsys, monkeypatch):
    """The weight file at the end of a --kernels triton run (CONVFIRSTNET_KERNELS=triton for the whole run)
    is verified on CPU tensors, which take the reference there: without Triton's interpreter the fused
    ops refuse CPU tensors (the end of a CUDA run failed so)."""
    from convfirstnet.kernels._launch import selected_backend

    from convfirstnet.commands.train.checkpoints import write_weights
    from convfirstnet.factory import create_model

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ckpt = tmp_path / "last.pth.tar"
    torch.save({"arch": "convfirstnet_pico", "state_dict": create_model("pico", num_classes=4).state_dict()},
               ckpt)
    with selected_backend("triton"):
        write_weights(ckpt, tmp_path / "convfirstnet_pico.safetensors", "convfirstnet_pico", ema=False)
    assert "wrote" in capsys.readouterr().out and (tmp_path / "convfirstnet_pico.safetensors").is_file()


@pytest.mark.interpreter
@pytest.mark.slow
def test_kernels_triton_runs_the_fused_training_blocks(tiny_data, tmp_path, capsys, monkeypatch):
    """--kernels triton (here in Triton's interpreter): the ConvFirst blocks run the fused training ops,
    the MBConv blocks the recompute path, with no fallback line; the checkpoint is the layer-wise
    state_dict; CONVFIRSTNET_KERNELS is restored after the run."""
    import warnings

    from convfirstnet import mbconv_fused_forward, mbconv_recompute, training_kernels

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("interpreter test: runs where there is no GPU")
    monkeypatch.delenv("CONVFIRSTNET_KERNELS", raising=False)
    monkeypatch.setattr(training_kernels, "_WARNED", set())
    # the MBConv recompute's gconv and its fused forward on their references here (22 blocks through the
    # interpreter take minutes; their Triton branches: tests/kernels/test_convfirst_train.py::
    # test_model_runs_convfirst_fused_and_..., tests/kernels/test_mbconv_fused_forward.py)
    monkeypatch.setattr(mbconv_recompute, "use_triton", lambda x: False)
    monkeypatch.setattr(mbconv_fused_forward, "use_triton", lambda x: False)
    calls = []
    fused = training_kernels.fused_forward
    monkeypatch.setattr(training_kernels, "fused_forward", lambda b, x: calls.append(b) or fused(b, x))
    out = tmp_path / "run"
    argv = [*SMALL, "--data", str(tiny_data), "--output", str(out), "--kernels", "triton"]
    argv += "--epochs 1 --batch-size 2 --warmup-epochs 0 --aug none --max-steps 1 --no-ema".split()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train_imagenet.main(argv) == 0
    assert "kernels triton" in capsys.readouterr().out
    assert len(calls) == 6 + 22  # Pico's six ConvFirst and 22 MBConv blocks, one training step
    assert [str(w.message).split(":")[0] for w in caught if "layer-wise" in str(w.message)] == []
    assert "CONVFIRSTNET_KERNELS" not in os.environ
    (ckpt,) = out.glob("recovery-*.pth.tar")
    state = load(ckpt)["state_dict"]
    assert "stages.0.0.bn_dw.running_var" in state and "stages.0.0.conv_dw.weight" in state


def test_cuda_graph_needs_cuda(tiny_data, tmp_path, capsys):
    """--cuda-graph on CPU is a one-line error before anything is made."""
    out = tmp_path / "out" / "run"
    assert train_imagenet.main([*SMALL, "--data", str(tiny_data), "--output", str(out), "--cuda-graph"]) == 1
    err = capsys.readouterr().err
    assert "--cuda-graph needs CUDA" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_graphed_step_trains_as_the_eager_loop():
    """--cuda-graph's step (3 eager warm-up steps, a capture, replays of forward + backward into static
    buffers, the optimizer outside) follows the eager loop's trajectory exactly: Pico on 32x32 batches,
    timm's rmsproptf, gradient clipping, drop-path: weights, BatchNorm statistics and losses after 7 steps
    bitwise equal to the eager loop's (the same ops in the same order; CUDA graphs emulated on CPU, which
    check that the gradients stay the captured tensors). A step that skipped copying a new batch into the
    static input, or one that set the gradients to None after the capture, would fail it."""
    import argparse
    import copy
    from contextlib import nullcontext

    from timm.optim import create_optimizer_v2

    from convfirstnet.commands.train.graphed import WARMUP, GraphedStep
    from convfirstnet.commands.train.options import TrainError
    from convfirstnet.factory import create_model

    torch.manual_seed(0)
    model = create_model("pico", num_classes=4, drop_path_rate=0.1).train()
    twin = copy.deepcopy(model)
    batches = [(torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last),
                torch.randint(0, 4, (4,))) for _ in range(7)]
    loss_fn = torch.nn.CrossEntropyLoss()
    args = argparse.Namespace(clip_grad=1.0)

    def optimizer(m):
        return create_optimizer_v2(m, opt="rmsproptf", lr=0.01, weight_decay=1e-5, momentum=0.9, eps=1e-3)

    graphs = EmulatedGraphs([p for p in model.parameters()])
    step = GraphedStep(model, loss_fn, optimizer(model), None, None, args.clip_grad, graphs)
    run = argparse.Namespace(optimizer=optimizer(twin), loss_scaler=None, model=twin)
    torch.manual_seed(1)
    got = [step(x, y).clone() for x, y in batches]
    torch.manual_seed(1)
    want = [loop.eager_step(args, run, twin, loss_fn, nullcontext, x, y) for x, y in batches]
    assert graphs.side == WARMUP and len(graphs.graphs) == 1
    assert graphs.graphs[0].replays == len(batches) - WARMUP
    assert [a.item() for a in got] == [b.detach().item() for b in want]
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(TrainError, match="the graph replays one shape"):
        step(torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2,)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_graphed_step_on_gpu(kernels, amp, monkeypatch):
    """--cuda-graph's step with real CUDA graphs (layer-wise and the fused training kernels; fp32, and fp16
    AMP with GradScaler): Pico at batch 16, 64x64, 7 steps (3 warm-up, the capture, 3 replays), each
    against an eager step from the same state (weights, BatchNorm statistics, momentum buffers, loss
    scale) on the same batch. Step by step: at lr 0.05 with momentum a rounding compounds, so two free
    runs part (on CPU two eager runs on different oneDNN thread counts, 4e-7 apart at the first loss, were
    1.5e-3 apart at the third and 4.5e-2 at the fifth). Not bitwise (cuDNN may pick other algorithms in
    the capture): the loss within 1e-3 relative (fp32 without TF32) or 1e-2 (fp16 autocast), the running
    statistics' change within the same bound in norm, num_batches_tracked equal; the parameters' change
    (all at once) within 1e-2 or 5e-2 in norm, a step's gradient being ill-conditioned (on CPU, in fp32:
    1.6e-4 off fp64, 1.3e-3 between the thread counts). A replay that trained on a stale batch or lost
    its gradients is off by 0.5 or more (0.55-0.75 with those bugs planted in the CPU emulation)."""
    import argparse
    import copy
    from contextlib import nullcontext

    from timm.utils import NativeScaler

    from convfirstnet.commands.train.graphed import CudaGraphs, GraphedStep
    from convfirstnet.factory import create_model

    monkeypatch.setenv("CONVFIRSTNET_KERNELS", kernels)
    if not amp:  # fp32 as fp32: cuDNN's convolutions take TF32 (10-bit mantissas) by default
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    model = create_model("pico", num_classes=10).cuda().to(memory_format=torch.channels_last).train()
    twin = copy.deepcopy(model)
    batches = [(torch.randn(16, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last),
                torch.randint(0, 10, (16,), device="cuda")) for _ in range(7)]
    loss_fn = torch.nn.CrossEntropyLoss()
    scalers = (NativeScaler(), NativeScaler()) if amp else (None, None)
    args = argparse.Namespace(clip_grad=None)
    step = GraphedStep(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       scalers[0]._scaler if amp else None, torch.float16 if amp else None, None,
                       CudaGraphs(torch.device("cuda")))
    run = argparse.Namespace(optimizer=torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9),
                             loss_scaler=scalers[1], model=twin)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.float16)) if amp else nullcontext
    tol = 1e-2 if amp else 1e-3
    groups = (([n for n, _ in model.named_parameters()], 5e-2 if amp else 1e-2),
              ([n for n, t in model.state_dict().items() if t.is_floating_point() and "running" in n], tol))
    for i, (x, y) in enumerate(batches):
        twin.load_state_dict(model.state_dict())  # the eager step starts where the graphed one does
        run.optimizer.load_state_dict(copy.deepcopy(step.optimizer.state_dict()))
        if amp:
            scalers[1].load_state_dict(scalers[0].state_dict())
        before = copy.deepcopy(model.state_dict())
        got = step(x, y).float().item()
        want = loop.eager_step(args, run, twin, loss_fn, autocast, x, y).float().item()
        assert abs(got - want) <= tol * abs(want), (i, got, want)
        a, b = model.state_dict(), twin.state_dict()
        for names, bound in groups:
            moved = [torch.cat([(sd[n].double() - before[n].double()).flatten() for n in names])
                     for sd in (a, b)]
            err = ((moved[0] - moved[1]).norm() / moved[1].norm().clamp_min(1e-30)).item()
            assert err <= bound, (i, names[0], err)
        assert all(torch.equal(a[n], t) for n, t in b.items() if not t.is_floating_point()), i


def test_graphed_step_under_ddp():
    """--cuda-graph with several processes (two gloo processes, CUDA graphs emulated): rank 0's weights
    copied once and the gradients averaged after each backward give, after 6 steps of Pico (SGD with
    momentum, drop-path), the parameters of DDP's eager loop bitwise on both processes, from processes that
    started with different weights (tests/_ddp_graphed_step.py). Averaging by the sum alone, or skipping
    the copy from rank 0, fails it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "_ddp_graphed_step.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replicas_equal"], result
    assert result["max_param_diff"] == 0.0, result
    assert result["losses_graphed"] == result["losses_ddp"]
    assert all(math.isfinite(v) for v in result["losses_ddp"]) and len(set(result["losses_ddp"])) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_cuda_graph_run_on_gpu(kernels, tiny_data, tmp_path, capsys):
    """`convfirstnet train --cuda-graph` end to end on a GPU (fp16 AMP with GradScaler, the EMA, the
    validations and checkpoints): 2 epochs of 4 steps, the last 5 replays of the step captured in the
    first epoch, across its validation; the loss is logged finite at every step and the run says it
    trains in a CUDA graph."""
    out = tmp_path / "run"
    argv = ["--model", "pico", "--data", str(tiny_data), "--output", str(out), "--img-size", "64",
            "--val-img-size", "64", "--workers", "0", "--device", "cuda", "--log-interval", "1",
            "--no-progress", "--epochs", "2", "--batch-size", "8", "--warmup-epochs", "0", "--aug", "none",
            "--cuda-graph", "--kernels", kernels]
    assert train_imagenet.main(argv) == 0
    assert f"kernels {kernels} in a CUDA graph" in capsys.readouterr().out
    losses = [r["loss"] for r in read_log(out) if r["kind"] == "train"]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses), losses
    assert (out / "convfirstnet_pico.safetensors").is_file()
