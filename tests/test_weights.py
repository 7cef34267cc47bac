"""Weight resolution, checkpoint formats, pretrained loading and its errors (offline, CPU)."""

import json
import socket

import pytest
import timm
import torch

import convfirstnet
from convfirstnet import weights
from convfirstnet.weights import CheckpointError, WeightsNotFoundError, save_weights

from ._models import rel_err, trained_like


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """Empty weights dir and cache; the source checkout's weights/ folder not consulted."""
    monkeypatch.setenv("CONVFIRSTNET_WEIGHTS_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("CONVFIRSTNET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "SOURCE_WEIGHTS_DIR", tmp_path / "checkout-weights")
    (tmp_path / "weights").mkdir()
    return tmp_path


@pytest.fixture(scope="module")
def pico_model():
    return trained_like("pico", seed=1)


def _write(model, path, arch="convfirstnet_pico"):
    save_weights(model.state_dict(), path, {"architecture": arch})
    return path


def test_missing_weights_name_every_place(isolated, no_network):
    with pytest.raises(WeightsNotFoundError) as e:
        convfirstnet.pico(pretrained=True)
    msg = str(e.value)
    for place in ("weights/convfirstnet_pico.safetensors", "checkout-weights", "cache", "manifest.json"):
        assert place in msg
    assert "convfirstnet train" in msg  # how to produce weights
    with pytest.raises(WeightsNotFoundError):
        timm.create_model("convfirstnet_pico", pretrained=True)  # never a silent random init


def test_pretrained_from_weights_dir_is_fused(isolated, pico_model, no_network):
    _write(pico_model, isolated / "weights" / "convfirstnet_pico.safetensors")
    x = torch.randn(2, 3, 64, 64)
    model = convfirstnet.pico(pretrained=True)
    assert not model.training and not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    with torch.no_grad():
        assert rel_err(model(x), pico_model(x)) < 1e-5
    train_form = convfirstnet.pico(pretrained=True, fuse=False)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in train_form.modules())
    with torch.no_grad():
        assert torch.equal(train_form.eval()(x), pico_model(x))


def test_resolution_order(isolated, pico_model, monkeypatch):
    cache = isolated / "cache" / "convfirstnet_pico.safetensors"
    checkout = isolated / "checkout-weights" / "convfirstnet_pico.safetensors"
    env = isolated / "weights" / "convfirstnet_pico.safetensors"
    explicit = isolated / "mine.safetensors"
    for p in (cache, checkout, env, explicit):
        p.parent.mkdir(parents=True, exist_ok=True)
        _write(pico_model, p)
    assert weights.resolve_weights("convfirstnet_pico", explicit) == explicit
    assert weights.resolve_weights("convfirstnet_pico") == env
    env.unlink()
    assert weights.resolve_weights("convfirstnet_pico") == checkout
    checkout.unlink()
    assert weights.resolve_weights("convfirstnet_pico") == cache


def test_manifest_download_verifies_sha256(isolated, pico_model, monkeypatch):
    src = _write(pico_model, isolated / "published.safetensors")
    digest = weights.sha256_file(src)
    entry = {"file": "convfirstnet_pico.safetensors", "url": src.as_uri(), "sha256": digest}
    monkeypatch.setattr(weights, "manifest", lambda: {"models": {"convfirstnet_pico": entry}})
    path = weights.resolve_weights("convfirstnet_pico")
    assert path == isolated / "cache" / "convfirstnet_pico.safetensors" and weights.sha256_file(path) == digest
    path.unlink()
    entry["sha256"] = "0" * 64
    with pytest.raises(CheckpointError, match="sha256"):
        weights.resolve_weights("convfirstnet_pico")
    assert not path.exists()


def test_shipped_manifest_lists_only_real_files():
    data = weights.manifest()
    for name, entry in data["models"].items():
        assert name in convfirstnet.list_models()
        assert {"file", "url", "sha256", "source", "top1"} <= set(entry)


def test_timm_pretrained_file_overlay_offline(isolated, pico_model, no_network):
    path = _write(pico_model, isolated / "some-name.safetensors")
    model = timm.create_model("convfirstnet_pico", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), pico_model(x))


def test_timm_training_checkpoint_prefers_ema(isolated, pico_model, no_network):
    raw = trained_like("pico", seed=2)
    ckpt = {
        "epoch": 3,
        "arch": "convfirstnet_pico",
        "state_dict": {f"module.{k}": v for k, v in raw.state_dict().items()},
        "state_dict_ema": {f"module.{k}": v for k, v in pico_model.state_dict().items()},
        "args": __import__("argparse").Namespace(lr=0.1),
    }
    path = isolated / "model_best.pth.tar"
    torch.save(ckpt, path)
    model = convfirstnet.pico(checkpoint_path=path)  # training form, EMA weights
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), pico_model(x))


def test_other_num_classes_and_in_chans(isolated, pico_model):
    path = _write(pico_model, isolated / "w.safetensors")
    model = convfirstnet.pico(checkpoint_path=path, num_classes=10, in_chans=1)
    assert model.classifier.out_features == 10
    sd, ref = model.state_dict(), pico_model.state_dict()
    assert torch.equal(sd["stages.3.0.conv_expand.weight"], ref["stages.3.0.conv_expand.weight"])
    assert sd["stem.conv.weight"].shape[1] == 1


def test_corrupt_checkpoint(isolated):
    bad = isolated / "broken.safetensors"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        convfirstnet.pico(checkpoint_path=bad)
    bad_pth = isolated / "broken.pth"
    bad_pth.write_bytes(b"not a zip file")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        convfirstnet.pico(checkpoint_path=bad_pth)
    with pytest.raises(WeightsNotFoundError, match="does not exist"):
        convfirstnet.pico(checkpoint_path=isolated / "nope.safetensors")


def test_checkpoint_for_another_model(isolated):
    nano = trained_like("nano")
    path = isolated / "nano.safetensors"
    save_weights(nano.state_dict(), path, {"architecture": "convfirstnet_nano"})
    with pytest.raises(CheckpointError, match="is for convfirstnet_nano, not convfirstnet_pico"):
        convfirstnet.pico(checkpoint_path=path)
    # Without metadata the mismatch is found from the tensors, and the message names them.
    torch.save(nano.state_dict(), isolated / "nano.pth")
    with pytest.raises(CheckpointError, match=r"shape mismatches: stem.conv.weight: checkpoint \(24, 3, 3, 3\)"):
        convfirstnet.pico(checkpoint_path=isolated / "nano.pth")


def test_missing_keys_are_named(isolated, pico_model):
    sd = dict(pico_model.state_dict())
    del sd["head.bn.running_var"]
    sd["extra.weight"] = torch.zeros(1)
    path = isolated / "partial.safetensors"
    save_weights(sd, path, {"architecture": "convfirstnet_pico"})
    with pytest.raises(CheckpointError, match=r"1 missing keys: head.bn.running_var; 1 unexpected keys: extra.weight"):
        convfirstnet.pico(checkpoint_path=path)


def test_manifest_json_is_valid():
    text = (weights.SOURCE_WEIGHTS_DIR / "manifest.json").read_text()
    assert json.loads(text)["models"] == {}  # no published weights today: none are invented
