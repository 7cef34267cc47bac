"""The `convfirstnet` command: the default job and the subcommand dispatch."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from convfirstnet import cli

ROOT = Path(__file__).resolve().parent.parent


def test_info_prints_every_model(capsys):
    assert cli.main(["--models", "pico", "nano", "--img-size", "64", "--batch-size", "2", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch reference" in out and "CPU" in out
    for name, params in (("convfirstnet_pico", "5.890"), ("convfirstnet_nano", "10.127")):
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == params
        assert float(cells[3]) < 1e-5  # fused vs training form
        assert float(cells[4].replace(",", "")) > 0


def test_python_dash_m_and_unknown_model():
    res = subprocess.run(
        [sys.executable, "-m", "convfirstnet", "--models", "huge", "--img-size", "32"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert res.returncode != 0 and "available: convfirstnet_pico" in res.stderr


@pytest.mark.parametrize("command", sorted(cli.TOOLS))
def test_subcommands_have_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert re.search(r"usage:", capsys.readouterr().out)
