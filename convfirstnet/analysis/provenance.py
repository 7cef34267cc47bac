"""Where a record comes from: the source commit, the software versions, the device, the command line.

Benchmark records (``convfirstnet bench``) and static cost reports (``convfirstnet kernels``) carry these
so that a figure can be traced to the code and the machine that produced it.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Sequence

import torch

import convfirstnet

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict:
    commit = _run(["git", "rev-parse", "HEAD"], REPO_ROOT)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], REPO_ROOT)
    return dict(commit=commit, dirty=bool(status) if status is not None else None)


def software_info() -> dict:
    info = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    )
    for mod in ("triton", "timm"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    info["convfirstnet"] = convfirstnet.__version__
    info["env"] = {k: os.environ[k] for k in ("CONVFIRSTNET_KERNELS", "TRITON_INTERPRET") if k in os.environ}
    return info


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = _run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index or 0}"]
        )
        return dict(
            type="cuda",
            name=torch.cuda.get_device_name(device),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            memory_gb=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            driver=driver,
        )
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(
        type="cpu",
        name=name,
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        platform=platform.platform(),
    )


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The command as typed (quoted for a shell), for the record."""
    return " ".join([prog, shlex.join(list(argv))]).strip()
