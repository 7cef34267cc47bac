"""Helpers shared by the ``convfirstnet`` commands: one-line errors, worker counts, output files and folders.

Error convention of every command: a problem with the user's inputs (a path, a name, a value, a file that
is not what it should be, and a malformed command line: an unknown option, a missing or badly typed
argument) ends with one ``convfirstnet <command>: error: ...`` line on stderr and exit status 1 (a
malformed command line prints the usage line before it). Tracebacks are left for bugs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with command-line errors ending like every other user error: usage, one line, status 1."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


class ToolError(Exception):
    """A problem with a command's inputs, reported as one line without a traceback."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "bad input" for the commands: reported as one line, exit status 1.

    ``ValueError`` covers unknown model names and ``CheckpointError``; ``OSError`` covers missing files
    (``WeightsNotFoundError``), permissions and full disks.
    """
    return (ToolError, ValueError, OSError)


def one_line(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{text}: {e.filename}"
    return text or type(e).__name__


def report(prog: str, e: BaseException) -> int:
    print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
    return 1


def run_reporting(prog: str, fn: Callable[[], int | None]) -> int:
    """``fn()``; a user error becomes one line on stderr and exit status 1, Ctrl-C exit status 130."""
    try:
        code = fn()
    except user_errors() as e:
        return report(prog, e)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0 if code is None else code


# ------------------------------------------------------------------------------------- data loading
def available_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, as PyTorch's DataLoader counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers(cap: int) -> int:
    """Data-loading processes per training/eval process: ``cap``, or fewer when this machine has fewer
    cores per local process (under torchrun, ``LOCAL_WORLD_SIZE`` processes share the cores)."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(cap, available_cpus() // local))


# ---------------------------------------------------------------------------------- files, folders
def file_mode() -> int:
    """Mode of a new regular file under the current umask (0o644 under the usual umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def publish(tmp: Path, dst: Path, overwrite: bool = False) -> None:
    """Move a finished temporary file into place with the usual permissions (libraries that write through
    a temporary file of their own, safetensors among them, leave it 0600)."""
    if not overwrite and dst.exists():
        raise ToolError(f"{str(dst)!r} exists; pass --overwrite to replace it")
    os.chmod(tmp, file_mode())
    tmp.replace(dst)


class CreatedDirs:
    """``mkdir -p`` that remembers which folders it created, so a failed run can remove them again.

    ``remove_empty()`` removes those folders, deepest first, as long as they are empty: files a run
    wrote before failing (logs, checkpoints to resume from) are kept, and so are their folders.
    """

    def __init__(self) -> None:
        self.created: list[Path] = []

    def make(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        missing, p = [], path.absolute()
        while not p.exists():
            missing.append(p)
            p = p.parent
        path.mkdir(parents=True, exist_ok=True)
        self.created += missing  # deepest first
        return path

    def remove_empty(self) -> None:
        for d in sorted(self.created, key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:  # not empty, or already gone
                pass
        self.created = []


# ------------------------------------------------------------------------------------------- input
def read_json(path: str | os.PathLike, what: str) -> Any:
    """The JSON in ``path``; a missing or malformed file is a :class:`ToolError` naming ``what``."""
    path = Path(path)
    if not path.is_file():
        raise ToolError(f"{what} {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolError(f"{what} {str(path)!r} is not JSON ({e})") from e
