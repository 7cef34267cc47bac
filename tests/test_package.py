"""The built wheel ships kernels/ as convfirstnet.kernels (never a top-level `kernels`) and imports."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.subprocess  # pip builds and installs the wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    out = tmp_path_factory.mktemp("wheel")
    # one build at a time: xdist workers that each run a test of this module build in the same ROOT/build
    # (two at once failed); the lock file sits in the temporary root the workers share
    lock = tmp_path_factory.getbasetemp().parent / "wheel-build.lock"
    with open(lock, "w") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:  # no flock (Windows): unserialized
            pass
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w",
             str(out)],
            check=True,
        )
    (whl,) = out.glob("convfirstnet-*.whl")
    return whl


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for block in ("stem", "convfirst", "mbconv", "head"):
        for part in ("reference.py", "op.py", "kernel.py"):
            assert f"convfirstnet/kernels/{block}/{part}" in names
    for block in ("gconv", "stem", "head", "convfirst_train"):
        for part in ("reference.py", "op.py", "kernel.py", "launcher.py"):
            assert f"convfirstnet/kernels/{block}/{part}" in names
    assert "convfirstnet/kernels/convfirst_train/finalize.py" in names
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
        "assert hasattr(torch.ops.convfirstnet, 'convfirst_s2_train_backward');"
        "from convfirstnet.training_kernels import fused_forward;"
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


def test_wheel_weights_not_found_names_only_installed_places(wheel, tmp_path):
    """A wheel has no weights/ folder beside site-packages and ships no weights/README.md: the message
    names the places that exist for the installed package and points to the docs."""
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)]
    subprocess.run(pip, check=True)
    code = (
        "import convfirstnet\n"
        "try:\n    convfirstnet.pico(pretrained=True)\n"
        "except convfirstnet.WeightsNotFoundError as e:\n    print(e)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "CONVFIRSTNET_WEIGHTS_DIR"}
    env.update(PYTHONPATH=str(target), CONVFIRSTNET_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    msg = res.stdout
    assert "no weights for convfirstnet_pico" in msg
    assert str(target / "weights") not in msg and "README" not in msg
    manifest = target / "convfirstnet" / "weights_manifest" / "manifest.json"
    assert f"the weight manifest {manifest} " in msg and manifest.is_file()
    assert str(tmp_path / "cache" / "convfirstnet_pico.safetensors") in msg
    assert "$CONVFIRSTNET_WEIGHTS_DIR (not set)" in msg and "docs/weights.md" in msg
