"""The built wheel ships kernels/ as convfirstnet.kernels (never a top-level `kernels`) and imports."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
    )
    (whl,) = out.glob("convfirstnet-*.whl")
    return whl


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for block in ("stem", "convfirst", "mbconv", "head"):
        for part in ("reference.py", "op.py", "kernel.py"):
            assert f"convfirstnet/kernels/{block}/{part}" in names
    for block in ("gconv", "stem", "head"):
        for part in ("reference.py", "op.py", "kernel.py", "launcher.py"):
            assert f"convfirstnet/kernels/{block}/{part}" in names
    assert "convfirstnet/kernels/_activations.py" in names
    assert "convfirstnet/kernels/_launch.py" in names
    assert "convfirstnet/weights_manifest/manifest.json" in names
    assert not [n for n in names if n.startswith("kernels/")], "kernels/ must not install as a top-level module"
    assert not [n for n in names if n.endswith(".safetensors")]


def test_wheel_imports_outside_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True
    )
    code = (
        "import importlib.util, torch, convfirstnet, convfirstnet.kernels as k;"
        "assert k.__file__.startswith(%r), k.__file__;"
        "assert importlib.util.find_spec('kernels') is None or 'convfirstnet' not in str(importlib.util.find_spec('kernels').origin);"
        "assert hasattr(torch.ops.convfirstnet, 'convfirst');"
        "assert hasattr(torch.ops.convfirstnet, 'gconv3x3_wgrad');"
        "from convfirstnet.gconv import GroupConv3x3;"
        "from convfirstnet.weights import manifest; assert manifest()['models'] == {};"
        "print('ok')"
    ) % str(target)
    # Run from an empty directory so the source checkout is not on the path.
    env_path = str(target)
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
        env={**__import__("os").environ, "PYTHONPATH": env_path},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")
