"""The `convfirstnet` command: the default job, the subcommand dispatch, errors, timm-script."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import convfirstnet
from convfirstnet.commands import cli, info

ROOT = Path(__file__).resolve().parent.parent


def test_info_prints_every_model(capsys, monkeypatch):
    monkeypatch.setattr(info, "WARMUP_SECONDS", 0.0)  # one warm-up call
    assert (
        cli.main(["--models", "pico", "nano", "--img-size", "64", "--batch-size", "2", "--iters", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert "PyTorch reference" in out and "CPU" in out and "3 timed iterations" in out
    for name, params in (("convfirstnet_pico", "5.890"), ("convfirstnet_nano", "10.127")):
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == params
        assert float(cells[3]) < 1e-5  # fused vs training form
        median = float(cells[4].replace(",", ""))
        low, high = (float(v.replace(",", "")) for v in cells[5].split("-"))
        assert 0 < low <= median <= high  # the p10-p90 spread brackets the median
        assert cells[6] == "3"


class _Sleeper(torch.nn.Module):
    """Takes 2 ms per call, so timing tests run fast and their expected counts are known."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        import time

        self.calls += 1
        time.sleep(0.002)
        return x


def test_time_forward_times_enough_iterations(monkeypatch):
    """By default the timing runs until both a minimum count and a minimum time are reached (a median of
    2 iterations on a noisy CPU was the old default), and reports the spread."""
    monkeypatch.setattr(info, "WARMUP_SECONDS", 0.01)
    model = _Sleeper()
    t = info.time_forward(model, torch.zeros(1), min_iters=7, min_seconds=0.1)
    # 0.1 s of calls of at least 2 ms: more than the 7 minimum calls, at most 51 (a loaded machine stretches
    # the sleeps, so no tighter lower bound)
    assert 7 < t["n"] <= 51
    assert t["p10"] <= t["median"] <= t["p90"] and t["median"] >= 0.002
    assert model.calls >= t["n"] + 1  # warm-up calls are not timed
    assert info.time_forward(_Sleeper(), torch.zeros(1), iters=3)["n"] == 3
    assert info.MIN_ITERS["cpu"] >= 5 and info.MIN_SECONDS["cpu"] >= 1  # the defaults on CPU


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"convfirstnet {convfirstnet.__version__} (torch {torch.__version__}")


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("info", *cli.TOOLS):
        assert re.search(rf"^  {re.escape(command)} ", out, re.M), command


def test_unknown_command_lists_the_commands(capsys):
    assert cli.main(["trian", "--model", "pico"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "convfirstnet: error: unknown command 'trian' (did you mean 'train'?); commands: "
        + ", ".join(["info", *cli.TOOLS])
    )


@pytest.mark.subprocess
def test_python_dash_m_and_unknown_model():
    res = subprocess.run(
        [sys.executable, "-m", "convfirstnet", "--models", "huge", "--img-size", "32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "available: convfirstnet_pico" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU message")
def test_cuda_without_a_gpu_is_one_line_before_any_output(capsys):
    assert cli.main(["--device", "cuda"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "convfirstnet: error: --device cuda, but no CUDA device is available\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "--device 'tpu': expected cpu or cuda"),
        (["--img-size", "16"], "--img-size 16: ConvFirstNet needs at least 32"),
        (["--iters", "0"], "--iters must be at least 1"),
    ],
)
def test_info_errors_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("command", sorted(set(cli.TOOLS) - {"timm-script"}))
def test_malformed_command_line_is_one_line_and_status_1(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--no-such-option"])
    assert e.value.code == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"convfirstnet {command}: error: ")  # the first problem argparse finds


@pytest.mark.parametrize("command", sorted(cli.TOOLS))
def test_subcommands_have_help(command, capsys):
    if command == "timm-script":
        assert cli.main([command, "--help"]) == 0
    else:
        with pytest.raises(SystemExit) as e:
            cli.main([command, "--help"])
        assert e.value.code == 0
    assert re.search(r"usage:", capsys.readouterr().out)


# A small script written the way timm's validate.py / train.py are: argparse with timm's flags, the model
# built by name through timm, the work under `if __name__ == "__main__"`.
TIMM_STYLE_SCRIPT = textwrap.dedent(
    """
    import argparse
    import sys

    import timm
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", "-m", default="resnet50")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--exit-code", type=int, default=0)


    def main():
        args = parser.parse_args()
        model = timm.create_model(args.model, num_classes=args.num_classes).eval()
        with torch.no_grad():
            out = model(torch.zeros(1, 3, 32, 32))
        file = __file__.rsplit("/", 1)[-1]
        print(f"argv={sys.argv[1:]} name={__name__} file={file} out={tuple(out.shape)}")
        if args.exit_code:
            sys.exit(args.exit_code)


    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.subprocess
def test_timm_script_runs_a_timm_style_script_with_the_models(tmp_path, capsys):
    script = tmp_path / "validate.py"
    script.write_text(TIMM_STYLE_SCRIPT)
    # On its own, timm does not know the model: the script fails as timm's validate.py does.
    alone = subprocess.run(
        [sys.executable, str(script), "-m", "convfirstnet_pico"], cwd=tmp_path, capture_output=True, text=True
    )
    assert alone.returncode != 0 and "Unknown model" in alone.stderr
    # Through `convfirstnet timm-script` the models are registered, and the script runs as __main__.
    argv = [str(script), "-m", "convfirstnet_pico", "--num-classes", "5"]
    assert cli.main(["timm-script", *argv]) == 0
    assert capsys.readouterr().out.strip() == (
        "argv=['-m', 'convfirstnet_pico', '--num-classes', '5'] name=__main__ file=validate.py out=(1, 5)"
    )
    saved = list(sys.argv)
    assert cli.main(["timm-script", *argv, "--exit-code", "3"]) == 3  # the script's exit status
    assert sys.argv == saved  # restored
    assert cli.main(["timm-script", str(tmp_path / "missing.py")]) == 1
    assert "script" in capsys.readouterr().err


@pytest.mark.subprocess
def test_timm_script_as_installed_command(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(TIMM_STYLE_SCRIPT)
    res = subprocess.run(
        [sys.executable, "-m", "convfirstnet", "timm-script", str(script), "--model", "convfirstnet_nano"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "name=__main__ file=bench.py out=(1, 1000)" in res.stdout
