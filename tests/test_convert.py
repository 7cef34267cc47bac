"""Checkpoint conversion (convfirstnet/commands/convert.py) and the tensor fingerprint."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

import convfirstnet
from convfirstnet import weights
from convfirstnet.commands import convert as convert_command
from convfirstnet.commands._cli import ToolError
from convfirstnet.commands.convert import convert_checkpoint, main
from convfirstnet.weights import CheckpointError, read_checkpoint, sha256_file, tensors_sha256

from ._models import trained_like

REPO = Path(__file__).resolve().parent.parent
NUM_CLASSES = 5


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int) -> torch.nn.Module:
    return trained_like("pico", seed=seed, num_classes=NUM_CLASSES)


@pytest.fixture(scope="module")
def timm_checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module, torch.nn.Module]:
    """A timm train.py-style checkpoint: DDP ``module.`` keys, EMA and raw weights, args Namespace."""
    ema, raw = _model(0), _model(1)
    path = tmp_path_factory.mktemp("ckpt") / "model_best.pth.tar"
    torch.save(
        {
            "epoch": 7,
            "arch": "convfirstnet_pico",
            "state_dict": {f"module.{k}": v for k, v in raw.state_dict().items()},
            "state_dict_ema": {f"module.{k}": v for k, v in ema.state_dict().items()},
            "args": argparse.Namespace(model="convfirstnet_pico", lr=0.1),
            "metric": 12.5,
        },
        path,
    )
    return path, ema, raw


@torch.no_grad()
def _outputs(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(123))
    return model.eval()(x)


def test_round_trip_prefers_ema_and_reproduces_outputs(tmp_path, timm_checkpoint):
    path, ema, raw = timm_checkpoint
    out = tmp_path / "weights" / "convfirstnet_pico.safetensors"
    entry = convert_checkpoint(path, out, "pico")

    assert entry == {
        "name": "convfirstnet_pico",
        "file": "convfirstnet_pico.safetensors",
        "url": None,
        "sha256": sha256_file(out),
        "source": "model_best.pth.tar",
        "top1": None,
        "note": "top1: measure with convfirstnet eval",
    }
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary file left

    loaded = read_checkpoint(out, use_ema=False)
    sd, meta = loaded.state_dict, loaded.metadata
    assert not any(k.startswith("module.") for k in sd)
    assert meta["architecture"] == "convfirstnet_pico" and meta["source"] == "model_best.pth.tar"
    assert meta["tensors_sha256"] == tensors_sha256(ema.state_dict()) == tensors_sha256(sd)
    assert meta["convfirstnet_version"] == convfirstnet.__version__ and meta["num_classes"] == str(
        NUM_CLASSES
    )
    created = datetime.fromisoformat(meta["created"])
    assert created.tzinfo is not None and created.utcoffset().total_seconds() == 0
    assert abs((datetime.now(timezone.utc) - created).total_seconds()) < 600

    loaded = convfirstnet.create_model("pico", checkpoint_path=out, num_classes=NUM_CLASSES)
    assert torch.equal(_outputs(loaded), _outputs(ema))  # the EMA weights, exactly
    assert not torch.equal(_outputs(loaded), _outputs(raw))
    fused = convfirstnet.create_model("pico", pretrained=True, checkpoint_path=out, num_classes=NUM_CLASSES)
    torch.testing.assert_close(_outputs(fused), _outputs(ema), rtol=1e-4, atol=1e-4)


def test_in_memory_state_dict_and_checkpoint_dict(tmp_path):
    model = _model(2)
    a = convert_checkpoint(
        model.state_dict(), tmp_path / "a.safetensors", "convfirstnet_pico", source="run 42"
    )
    b = convert_checkpoint({"state_dict": model.state_dict(), "epoch": 1}, tmp_path / "b.safetensors", "pico")
    assert a["source"] == "run 42" and b["source"] == ""
    a, b = (read_checkpoint(tmp_path / f"{n}.safetensors", use_ema=False) for n in "ab")
    sd_a, meta_a, meta_b = a.state_dict, a.metadata, b.metadata
    assert meta_a["tensors_sha256"] == meta_b["tensors_sha256"] == tensors_sha256(model.state_dict())
    assert all(torch.equal(sd_a[k], v) for k, v in model.state_dict().items())


def test_tensors_sha256_definition():
    sd = {
        "b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a": torch.tensor(3),
        "c": torch.ones(2, dtype=torch.bfloat16),
    }
    ref = tensors_sha256(sd)
    assert tensors_sha256(dict(reversed(list(sd.items())))) == ref  # key order does not matter
    assert tensors_sha256({**sd, "b": sd["b"].t().contiguous().t()}) == ref  # memory layout does not matter
    for changed in (
        {**sd, "b": sd["b"].reshape(3, 2)},  # shape
        {**sd, "c": torch.ones(2, dtype=torch.float16)},  # dtype
        {**sd, "b": sd["b"] + torch.tensor([[0, 0, 0], [0, 0, 1e-6]])},  # one value
        {"bb": sd["b"], "a": sd["a"], "c": sd["c"]},  # a key
    ):
        assert tensors_sha256(changed) != ref
    import hashlib

    def raw(t):  # bytes as stored; numpy has no bfloat16, so read those as int16
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).contiguous().numpy().tobytes()

    shape = lambda t: ",".join(map(str, t.shape))
    stream = b"".join(f"{k}\0{sd[k].dtype}\0{shape(sd[k])}\0".encode() + raw(sd[k]) for k in sorted(sd))
    assert hashlib.sha256(stream).hexdigest() == ref


def test_verification_failure_leaves_no_file(tmp_path, monkeypatch):
    """If the written file does not hold the weights, nothing is put at the output path, and the folders
    created for it are removed again."""
    save = weights.save_weights

    def corrupting_save(state_dict, path, metadata):
        state_dict = dict(state_dict)
        state_dict["classifier.bias"] = state_dict["classifier.bias"] + 1
        save(state_dict, path, metadata)

    monkeypatch.setattr(convert_command, "save_weights", corrupting_save)  # the name the command calls
    with pytest.raises(CheckpointError, match="does not hold the converted weights"):
        convert_checkpoint(_model(3).state_dict(), tmp_path / "x.safetensors", "pico")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="does not hold the converted weights"):
        convert_checkpoint(_model(3).state_dict(), tmp_path / "new" / "folder" / "x.safetensors", "pico")
    assert list(tmp_path.iterdir()) == []


def test_written_file_has_the_usual_permissions(tmp_path):
    """safetensors writes through a 0600 temporary file; the weight file gets the umask's mode."""
    old = os.umask(0o022)
    try:
        convert_checkpoint(_model(3).state_dict(), tmp_path / "x.safetensors", "pico")
    finally:
        os.umask(old)
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == 0o644


def test_existing_output_needs_overwrite(tmp_path, timm_checkpoint, capsys):
    path, _, _ = timm_checkpoint
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"someone else's file")
    assert main([str(path), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists; pass --overwrite to replace it" in err
    assert out.read_bytes() == b"someone else's file"
    with pytest.raises(ToolError, match="exists"):
        convert_checkpoint(path, out, "pico")
    assert main([str(path), str(out), "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["sha256"] == sha256_file(out)


def test_says_which_weights_and_no_ema(tmp_path, timm_checkpoint, capsys):
    """The command names the weights it took; --no-ema takes the raw state_dict."""
    path, ema, raw = timm_checkpoint
    assert main([str(path), str(tmp_path / "ema.safetensors")]) == 0
    err = capsys.readouterr().err
    assert "EMA weights (state_dict_ema) of" in err and "convfirstnet_pico (recorded in the file)" in err
    assert main([str(path), str(tmp_path / "raw.safetensors"), "--no-ema"]) == 0
    assert "raw weights (state_dict), the file also holds EMA weights" in capsys.readouterr().err
    raw_meta = read_checkpoint(tmp_path / "raw.safetensors", use_ema=False).metadata
    ema_meta = read_checkpoint(tmp_path / "ema.safetensors", use_ema=False).metadata
    assert (raw_meta["checkpoint_key"], ema_meta["checkpoint_key"]) == ("state_dict", "state_dict_ema")
    assert raw_meta["tensors_sha256"] == tensors_sha256(raw.state_dict()) != ema_meta["tensors_sha256"]


def test_architecture_inferred_without_model(tmp_path, capsys, monkeypatch):
    """Without --model: the architecture a file records, else the size its shapes fit."""
    nano = convfirstnet.create_model("nano", num_classes=3)
    plain = tmp_path / "nano_state_dict.pth"
    torch.save(nano.state_dict(), plain)  # no metadata at all: found from the shapes
    monkeypatch.chdir(tmp_path)
    assert main([str(plain)]) == 0  # output: ./<inferred name>.safetensors
    out, err = capsys.readouterr()
    assert json.loads(out)["name"] == "convfirstnet_nano" and "(from its shapes)" in err
    written = read_checkpoint(tmp_path / "convfirstnet_nano.safetensors", use_ema=False)
    assert written.metadata["architecture"] == "convfirstnet_nano"
    sd = nano.state_dict()
    sd["stem.conv.weight"] = torch.zeros(8, 3, 3, 3)  # no ConvFirstNet size has an 8-channel stem
    torch.save(sd, plain)
    assert main([str(plain), str(tmp_path / "x.safetensors")]) == 1
    assert "shapes fit no ConvFirstNet size; pass --model" in capsys.readouterr().err


def test_cli_prints_manifest_entry(tmp_path, timm_checkpoint, capsys, monkeypatch):
    path, _, _ = timm_checkpoint
    out = tmp_path / "p.safetensors"
    argv = [
        "--model",
        "pico",
        "--checkpoint",
        str(path),
        "--output",
        str(out),
        "--source",
        "timm train.py, 300 ep",
    ]
    assert main(argv) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["sha256"] == sha256_file(out) and entry["source"] == "timm train.py, 300 ep"
    assert entry["top1"] is None
    # Without --output: <name>.safetensors in the current directory, the name the weight lookup expects.
    monkeypatch.chdir(tmp_path)
    assert main([str(path), "--model", "pico"]) == 0
    assert json.loads(capsys.readouterr().out)["file"] == "convfirstnet_pico.safetensors"
    assert (tmp_path / "convfirstnet_pico.safetensors").is_file()


def test_cli_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "pico"])
    assert e.value.code == 1 and "a checkpoint is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["a.pth", "--checkpoint", "b.pth", "--model", "pico"])
    assert e.value.code == 1 and "checkpoint given twice" in capsys.readouterr().err


def _error_cases(tmp_path: Path, ckpt: Path) -> dict[str, tuple[list[str], str]]:
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"\x00not a checkpoint")
    out = str(tmp_path / "o.safetensors")
    return {
        "missing": ([str(tmp_path / "nope.pth"), out, "--model", "pico"], "does not exist"),
        "unreadable": ([str(garbage), out, "--model", "pico"], "is not a checkpoint"),
        "zip that is not a checkpoint": ([str(_zip(tmp_path)), out], "cannot read checkpoint"),
        "unknown model": ([str(ckpt), out, "--model", "resnet50"], "unknown model"),
        "other size": ([str(ckpt), out, "--model", "nano"], "does not fit convfirstnet_nano"),
        "output suffix": (
            [str(ckpt), str(tmp_path / "o.pth"), "--model", "pico"],
            "must end in .safetensors",
        ),
    }


def _zip(tmp_path: Path) -> Path:
    import zipfile

    path = tmp_path / "archive.pth"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("notes.txt", "not a torch.save archive")
    return path


@pytest.mark.parametrize(
    "case",
    ["missing", "unreadable", "zip that is not a checkpoint", "unknown model", "other size", "output suffix"],
)
def test_cli_errors_are_one_line(case, tmp_path, timm_checkpoint, capsys):
    argv, message = _error_cases(tmp_path, timm_checkpoint[0])[case]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convfirstnet convert: error: ") and message in err, err
    assert not (tmp_path / "o.safetensors").exists()


def test_safetensors_of_another_architecture(tmp_path):
    path = tmp_path / "in.safetensors"
    weights.save_weights(_model(4).state_dict(), path, {"architecture": "convfirstnet_nano"})
    with pytest.raises(CheckpointError, match="is for convfirstnet_nano, not convfirstnet_pico"):
        convert_checkpoint(path, tmp_path / "out.safetensors", "pico")


@pytest.mark.subprocess
def test_script_runs_from_a_checkout(tmp_path, timm_checkpoint):
    out = tmp_path / "w.safetensors"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "convert_checkpoint.py"),
            str(timm_checkpoint[0]),
            str(out),
            "--model",
            "pico",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sha256"] == sha256_file(out)
