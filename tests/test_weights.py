"""Weight resolution, checkpoint formats, pretrained loading and its errors (offline, CPU)."""

import argparse
import json
import socket
import struct
import warnings

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


def test_one_lookup_for_both_entry_points(isolated, pico_model, no_network, monkeypatch):
    """convfirstnet.pico(pretrained=True) goes through timm.create_model(pretrained=True): one lookup
    (model._create) for both. The package's entry point returns the fused form in eval mode, timm's the
    training form in train mode; checkpoint_path reaches the lookup as the pretrained_cfg_overlay file."""
    _write(pico_model, isolated / "weights" / "convfirstnet_pico.safetensors")
    calls = []
    real = convfirstnet.model.resolve_weights
    monkeypatch.setattr(convfirstnet.model, "resolve_weights", lambda *args: calls.append(args) or real(*args))
    fused = convfirstnet.pico(pretrained=True)
    trained = timm.create_model("convfirstnet_pico", pretrained=True)
    assert calls == [("convfirstnet_pico", None)] * 2
    assert not fused.training and not any(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules())
    assert trained.training and any(isinstance(m, torch.nn.BatchNorm2d) for m in trained.modules())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(trained.eval()(x), pico_model(x))
    path = _write(pico_model, isolated / "elsewhere.safetensors")
    assert convfirstnet.create_model("pico", checkpoint_path=path).training
    assert calls[-1] == ("convfirstnet_pico", str(path))


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


def test_shipped_manifest_lists_only_real_files(isolated, no_network):
    """The shipped manifest passes the same check as the generated ones below (files of remote URLs are
    checked when they are in the cache; ``verify_manifest(fetch=True)`` downloads them)."""
    assert weights.verify_manifest() == []


def test_verify_manifest_checks_files_and_sha256(isolated, pico_model):
    """A generated manifest: a good entry passes; a wrong sha256, a missing file, an unknown model, a
    missing key and an unpublished (url-less) entry are each reported."""
    good = _write(pico_model, isolated / "published" / "convfirstnet_pico.safetensors")
    digest = weights.sha256_file(good)

    def entry(path, sha=digest, **kw):
        return {"file": path.name, "url": path.as_uri(), "sha256": sha, "source": "test", "top1": None, **kw}

    assert weights.verify_manifest({"models": {"convfirstnet_pico": entry(good)}}) == []
    cached = isolated / "cache" / "convfirstnet_nano.safetensors"  # a remote URL is checked from the cache
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not the published file")
    data = {
        "models": {
            "convfirstnet_pico": entry(good, sha="0" * 64),
            "convfirstnet_tiny": entry(isolated / "nowhere.safetensors"),
            "convfirstnet_huge": entry(good),
            "convfirstnet_small": {k: v for k, v in entry(good).items() if k != "sha256"},
            "convfirstnet_nano": entry(good, url="https://example.invalid/convfirstnet_nano.safetensors",
                                       file="convfirstnet_nano.safetensors"),
        }
    }
    problems = "\n".join(weights.verify_manifest(data))
    assert f"convfirstnet_pico: {good} has sha256 {digest}, the manifest says {'0' * 64}" in problems
    assert "convfirstnet_tiny: " in problems and "nowhere.safetensors does not exist" in problems
    assert "convfirstnet_huge: not a registered model" in problems
    assert "convfirstnet_small: missing sha256" in problems
    assert f"convfirstnet_nano: {cached} has sha256" in problems
    assert len(problems.splitlines()) == 5
    unpublished = {"models": {"convfirstnet_pico": entry(good, url=None)}}
    assert weights.verify_manifest(unpublished) == [
        "convfirstnet_pico: no url (list a file only once it is published)"
    ]


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


def test_read_checkpoint_takes_the_weights_asked_for(isolated, pico_model):
    """One reader with an explicit use_ema (no default): EMA weights first with use_ema=True (timm's order:
    state_dict_ema, model_ema, state_dict, model), the raw ones with use_ema=False; it says which it took."""
    raw = trained_like("pico", seed=2)
    path = isolated / "last.pth.tar"
    torch.save(
        {
            "state_dict": {f"module.{k}": v for k, v in raw.state_dict().items()},
            "model_ema": {f"_orig_mod.{k}": v for k, v in pico_model.state_dict().items()},
            "args": argparse.Namespace(model="pico"),
        },
        path,
    )
    ema, plain = (weights.read_checkpoint(path, use_ema=use_ema) for use_ema in (True, False))
    assert (ema.key, ema.ema, ema.has_ema, ema.describe()) == ("model_ema", True, True, "EMA weights (model_ema)")
    assert (plain.key, plain.ema, plain.has_ema) == ("state_dict", False, True)
    assert plain.describe() == "raw weights (state_dict), the file also holds EMA weights"
    assert ema.architecture == plain.architecture == "convfirstnet_pico"  # timm's args.model
    assert weights.tensors_sha256(ema.state_dict) == weights.tensors_sha256(pico_model.state_dict())
    assert weights.tensors_sha256(plain.state_dict) == weights.tensors_sha256(raw.state_dict())
    with pytest.raises(TypeError, match="use_ema"):
        weights.read_checkpoint(path)  # every caller says which weights it takes
    st = _write(pico_model, isolated / "w.safetensors")
    for use_ema in (True, False):  # a weight file holds one set of weights and does not say which
        c = weights.read_checkpoint(st, use_ema=use_ema)
        assert (c.key, c.ema, c.architecture, c.num_classes) == (None, None, "convfirstnet_pico", 1000)


def test_other_num_classes_and_in_chans(isolated, pico_model):
    path = _write(pico_model, isolated / "w.safetensors")
    with pytest.warns(UserWarning, match="1000-class classifier but the model has num_classes=10"):
        model = convfirstnet.pico(checkpoint_path=path, num_classes=10, in_chans=1)
    assert model.classifier.out_features == 10
    sd, ref = model.state_dict(), pico_model.state_dict()
    assert torch.equal(sd["stages.3.0.conv_expand.weight"], ref["stages.3.0.conv_expand.weight"])
    assert sd["stem.conv.weight"].shape[1] == 1


def test_corrupt_checkpoint(isolated):
    """Files are recognised by their first bytes: one that is neither a torch.save file nor a safetensors
    file is "not a checkpoint" (what the commands say), whatever its name, through the API and timm."""
    not_one = "is not a checkpoint: neither a PyTorch file"
    bad = isolated / "broken.safetensors"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=not_one):
        convfirstnet.pico(checkpoint_path=bad)
    bad_pth = isolated / "broken.pth"
    bad_pth.write_bytes(b"not a zip file")  # a text file renamed .pth
    with pytest.raises(CheckpointError, match=not_one):
        convfirstnet.pico(checkpoint_path=bad_pth)
    with pytest.raises(CheckpointError, match=not_one):
        timm.create_model("convfirstnet_pico", pretrained=True, pretrained_cfg_overlay=dict(file=str(bad_pth)))
    with pytest.raises(CheckpointError, match=not_one):  # timm's checkpoint_path: the same reader
        timm.create_model("convfirstnet_pico", checkpoint_path=str(bad_pth))
    truncated = isolated / "truncated.safetensors"  # a safetensors header that does not parse
    truncated.write_bytes(struct.pack("<Q", 40) + b'{"a": ' + b"x" * 10)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        convfirstnet.pico(checkpoint_path=truncated)
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


# ------------------------------------------------------------------------------------ class count
@pytest.fixture(scope="module")
def three_class(tmp_path_factory):
    """A 3-class pico written the way `convfirstnet train` writes its weight file (convert_checkpoint:
    safetensors with num_classes metadata), and the same weights as a timm training checkpoint (.pth
    has no metadata: the class count comes from classifier.weight)."""
    from convfirstnet.commands.convert import convert_checkpoint

    model = trained_like("pico", seed=3, num_classes=3)
    out = tmp_path_factory.mktemp("three")
    convert_checkpoint({"state_dict_ema": model.state_dict()}, out / "convfirstnet_pico.safetensors", "pico")
    torch.save({"epoch": 1, "state_dict": model.state_dict()}, out / "last.pth.tar")
    return model, out / "convfirstnet_pico.safetensors", out / "last.pth.tar"


def test_class_count_comes_from_the_checkpoint(isolated, three_class, no_network, monkeypatch, one_thread):
    """Without num_classes, every way of loading gives the checkpoint's classifier, loaded."""
    ref, st, pth = three_class
    assert weights.checkpoint_num_classes(st) == 3 and weights.checkpoint_num_classes(pth) == 3
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = ref(x)
    monkeypatch.setenv("CONVFIRSTNET_WEIGHTS_DIR", str(st.parent))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        models = {
            "checkpoint_path": convfirstnet.create_model("pico", checkpoint_path=st),
            "checkpoint_path .pth": convfirstnet.create_model("pico", checkpoint_path=pth),
            "pretrained": convfirstnet.pico(pretrained=True),  # fused
            "timm file overlay": timm.create_model(
                "convfirstnet_pico", pretrained=True, pretrained_cfg_overlay=dict(file=str(st))
            ),
            "timm lookup": timm.create_model("convfirstnet_pico", pretrained=True),
        }
    for how, model in models.items():
        assert model.num_classes == 3, how
        with torch.no_grad():
            assert rel_err(model.eval()(x), expected) < 1e-6, how
    assert models["timm file overlay"].pretrained_cfg["num_classes"] == 3
    # timm's checkpoint_path loads after building the model, strictly (the package's reader, timm's
    # semantics): it needs num_classes, and says which tensor does not fit.
    with torch.no_grad():
        for path in (st, pth):
            timm_loaded = timm.create_model("convfirstnet_pico", num_classes=3, checkpoint_path=str(path))
            assert torch.equal(timm_loaded.eval()(x), expected)
    with pytest.raises(CheckpointError, match=r"classifier.weight: checkpoint \(3, 1280\) vs model \(1000, 1280\)"):
        timm.create_model("convfirstnet_pico", checkpoint_path=str(st))


def test_other_class_count_reinitialises_classifier_and_warns(isolated, three_class, no_network, one_thread):
    """Fine-tuning: num_classes != the checkpoint's keeps a fresh classifier (timm's behaviour for
    pretrained weights) and says so; everything else is loaded."""
    ref, st, pth = three_class
    torch.manual_seed(5)
    fresh = convfirstnet.create_model("pico", num_classes=10)
    for load in (
        lambda: convfirstnet.create_model("pico", checkpoint_path=st, num_classes=10),
        lambda: convfirstnet.create_model("pico", checkpoint_path=pth, num_classes=10),
        lambda: timm.create_model("convfirstnet_pico", pretrained=True, num_classes=10,
                                  pretrained_cfg_overlay=dict(file=str(st))),
    ):
        torch.manual_seed(5)
        with pytest.warns(UserWarning, match="has a 3-class classifier but the model has num_classes=10"):
            model = load()
        assert model.num_classes == 10
        assert torch.equal(model.classifier.weight, fresh.classifier.weight)  # its initialisation
        assert torch.equal(model.stages[4][0].conv_expand.weight, ref.stages[4][0].conv_expand.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # num_classes=0 asks for no classifier: nothing dropped by surprise
        assert convfirstnet.create_model("pico", checkpoint_path=st, num_classes=0).num_classes == 0


def test_num_classes_metadata_must_match_the_tensors(isolated, pico_model):
    path = isolated / "w.safetensors"
    save_weights(pico_model.state_dict(), path, {"architecture": "convfirstnet_pico", "num_classes": "3"})
    with pytest.raises(CheckpointError, match="says num_classes=3 but its classifier.weight has 1000 rows"):
        convfirstnet.pico(checkpoint_path=path)


def test_timm_pretrained_path_uses_the_package_loader(isolated, no_network):
    """timm.create_model(pretrained=True, pretrained_cfg_overlay=dict(file=...)) names a missing file and
    raises the package's errors for unreadable or mismatched files."""
    missing = isolated / "missing.safetensors"
    with pytest.raises(WeightsNotFoundError, match="missing.safetensors' does not exist"):
        timm.create_model("convfirstnet_pico", pretrained=True, pretrained_cfg_overlay={"file": str(missing)})
    bad = isolated / "broken.safetensors"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        timm.create_model("convfirstnet_pico", pretrained=True, pretrained_cfg_overlay=dict(file=str(bad)))
    nano = isolated / "nano.safetensors"
    save_weights(trained_like("nano").state_dict(), nano, {"architecture": "convfirstnet_nano"})
    with pytest.raises(CheckpointError, match="is for convfirstnet_nano, not convfirstnet_pico"):
        timm.create_model("convfirstnet_pico", pretrained=True, pretrained_cfg_overlay=dict(file=str(nano)))
