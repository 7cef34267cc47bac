"""Deployment exports (CPU): torch.export (.pt2) of the fused form, ONNX of the BatchNorm-folded form."""

import subprocess
import sys
from collections import Counter

import pytest
import torch

import convfirstnet
from convfirstnet import weights
from convfirstnet.commands import cli
from convfirstnet.export import ExportError, export_onnx, export_pt2, load_pt2
from convfirstnet.weights import save_weights

from ._models import rel_err, trained_like

pytestmark = pytest.mark.usefixtures("one_thread")  # small models: one thread is faster on 2 cores

BLOCK_OPS = {
    "convfirstnet.stem.default": 1,
    "convfirstnet.convfirst.default": 6,
    "convfirstnet.mbconv.default": 22,
    "convfirstnet.head.default": 1,
}


@pytest.fixture(scope="module")
def pico():
    return trained_like("pico", seed=4)


@pytest.fixture(scope="module")
def pt2_file(pico, tmp_path_factory):
    path = tmp_path_factory.mktemp("pt2") / "pico.pt2"
    err = export_pt2(pico, path, img_size=64)
    assert err == 0.0  # the loaded program runs the very same ops as the eager fused model
    return path


def test_pt2_keeps_one_op_per_block_and_dynamic_shapes(pico, pt2_file):
    program = load_pt2(pt2_file)
    targets = Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")
    assert {k: v for k, v in targets.items() if k.startswith("convfirstnet.")} == BLOCK_OPS
    assert not [t for t in targets if "convolution" in t or "batch_norm" in t]  # no layer outside the ops
    fused = convfirstnet.fuse(pico)
    # traced at 2x3x64x64: batch, height and width are dynamic (height and width from 33 up)
    for batch, h, w in ((1, 64, 64), (5, 64, 64), (2, 96, 40), (1, 33, 47)):
        x = torch.randn(batch, 3, h, w)
        with torch.no_grad():
            out = program.module()(x)
            assert torch.equal(out, fused(x))
            assert rel_err(out, pico(x)) < 1e-5  # and it is the model
    with pytest.raises(AssertionError, match=r"x.size\(\)\[2\] >= 33"):  # torch.export's guard, documented
        program.module()(torch.randn(1, 3, 32, 64))


@pytest.mark.subprocess  # starts a Python process
def test_export_pt2_needs_no_prior_import(tmp_path):
    """convfirstnet.export is usable on its own: importing it registers the ops and the timm models. A
    size of 32, whose last map is 1x1, keeps the size fixed; the check runs at 32x32 then."""
    code = (
        "import sys\n"
        "from convfirstnet.export import export_pt2, load_pt2, pt2_check_size\n"
        "import timm\n"
        "model = timm.create_model('convfirstnet_pico')\n"
        "print(export_pt2(model, sys.argv[1], img_size=32), pt2_check_size(32))\n"
        "print(load_pt2(sys.argv[1]).range_constraints)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "p.pt2")], capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    first, constraints = res.stdout.strip().splitlines()
    assert first == "0.0 (32, 32)"
    assert constraints.count("VR[") == 1  # the batch only


@pytest.mark.subprocess
def test_pt2_loads_in_a_fresh_process(pt2_file):
    """Deployment: another process imports convfirstnet (which registers the ops) and loads the file."""
    code = (
        "import sys, torch, convfirstnet.export as e;"
        "m = e.load_pt2(sys.argv[1]).module();"
        "print(tuple(m(torch.randn(4, 3, 64, 64)).shape))"
    )
    res = subprocess.run([sys.executable, "-c", code, str(pt2_file)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "(4, 1000)"


def test_onnx_standard_operators_checked_with_onnxruntime(pico, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    path = tmp_path / "pico.onnx"
    err = export_onnx(pico, path, img_size=64)
    assert err < 1e-5  # fp32 both sides; the ONNX form folds BatchNorm like the fused form
    # the exporter writes the weights as ONNX external data beside the graph (docs/export.md says so)
    assert (tmp_path / "pico.onnx.data").stat().st_size > 4 * 5_000_000
    proto = onnx.load(str(path))
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    assert {n.op_type for n in proto.graph.node} >= {"Conv", "Relu", "Sigmoid", "Pad", "Gemm"}
    assert not {n.op_type for n in proto.graph.node} & {"BatchNormalization"}  # folded
    (image,) = proto.graph.input
    assert image.type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(1, 3, 64, 64)
    (out,) = session.run(None, {"image": x.numpy()})
    with torch.no_grad():
        assert rel_err(torch.from_numpy(out), pico(x)) < 1e-5
    with pytest.raises(ExportError, match="training form"):
        export_onnx(convfirstnet.fuse(pico), tmp_path / "fused.onnx", img_size=64)


def test_export_command(pico, tmp_path, capsys):
    ckpt = tmp_path / "pico.safetensors"
    save_weights(pico.state_dict(), ckpt, {"architecture": "convfirstnet_pico", "num_classes": "1000"})
    out = tmp_path / "out" / "pico.pt2"
    argv = ["export", "--model", "pico", "--checkpoint", str(ckpt), "--format", "pt2", "--img-size", "64"]
    assert cli.main(argv + ["--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out} (convfirstnet_pico, weights {ckpt}" in printed
    assert "input (batch, 3, height, width), height and width >= 33, traced at 64)" in printed
    assert "checked with torch.export.load at batch 3, 96x80: max relative error vs PyTorch 0.00e+00" in (
        printed
    )
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(load_pt2(out).module()(x), pico(x)) < 1e-5


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no weights for convfirstnet_pico"),  # the pretrained lookup, and what to do instead
        (["--checkpoint", "x.safetensors", "--random-weights"], "exclude each other"),
        (["--random-weights", "--img-size", "16"], "needs at least 32"),
        (["--random-weights", "--dtype", "float16", "--format", "onnx"], "the ONNX export is float32"),
        (["--checkpoint", "missing.safetensors"], "missing.safetensors' does not exist"),
    ],
)
def test_export_command_errors(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONVFIRSTNET_WEIGHTS_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("CONVFIRSTNET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "SOURCE_WEIGHTS_DIR", tmp_path / "checkout-weights")
    monkeypatch.chdir(tmp_path)
    argv = ["export", "--model", "pico", *args]
    if "--format" not in args:
        argv += ["--format", "pt2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("convfirstnet export: error: ") and message in err and err.count("\n") == 1
    if not args:
        assert "--checkpoint PATH" in err and "--random-weights" in err
    assert not list(tmp_path.glob("*.pt2")) and not list(tmp_path.glob("*.onnx"))
