"""``convfirstnet timm-script PATH [ARGS...]``: run one of timm's scripts with the ConvFirstNet models.

timm's ``validate.py``, ``train.py`` and ``benchmark.py`` (in timm's git repository, not in the wheel)
know a model only once the module that registers it has been imported, so ``validate.py --model
convfirstnet_pico`` alone fails with "Unknown model". This command imports ``convfirstnet`` (which
registers ``convfirstnet_{pico,nano,tiny,small}`` with timm), then runs the script as ``python PATH
ARGS...`` would: with ``__name__ == "__main__"``, ``sys.argv = [PATH, *ARGS]`` and the script's folder
first on ``sys.path``; its exit status is the command's.

    convfirstnet timm-script pytorch-image-models/validate.py --data-dir /data/imagenet \\
        --model convfirstnet_pico --checkpoint convfirstnet_pico.safetensors
    torchrun --nproc_per_node 8 --no-python convfirstnet timm-script pytorch-image-models/train.py ...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ._cli import ToolError, report

USAGE = "usage: convfirstnet timm-script PATH [ARGS...]"


def run_script(path: str | Path, args: list[str]) -> int:
    """Run the script at ``path`` as ``__main__`` with ``args``; its exit status."""
    import convfirstnet  # noqa: F401  (registers the models with timm)

    path = Path(path)
    if not path.is_file():
        raise ToolError(f"script {str(path)!r} does not exist")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:  # sys.exit(code) in the script: the same status as `python PATH`
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        print("convfirstnet timm-script: error: give the path of a timm script", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1].rstrip())
        return 0
    try:
        return run_script(argv[0], argv[1:])
    except ToolError as e:
        return report("convfirstnet timm-script", e)
