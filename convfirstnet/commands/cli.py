"""The ``convfirstnet`` command (also ``python -m convfirstnet``).

Each command is one module of ``convfirstnet.commands`` with ``main(argv) -> int`` (the same code as
``scripts/*.py``). Without a command (or with ``info``) it runs ``convfirstnet.commands.info``: the four
models' size, cost, fused-form check and throughput on this machine.

Errors in the inputs end with one ``convfirstnet[ <command>]: error: ...`` line and exit status 1; a
malformed command line (unknown option or subcommand) prints the usage before that line.
"""

from __future__ import annotations

import difflib
import importlib
import sys

from . import info

# command -> (module of convfirstnet.commands with main(argv) -> int, one line of help); imported on use
TOOLS = {
    "eval": ("eval", "evaluate a model on an ImageNet-style folder"),
    "convert": ("convert", "turn a training checkpoint into a weight file"),
    "train": ("train", "train with the paper's recipe"),
    "timm-script": ("timm_script", "run timm's validate.py / train.py / benchmark.py with these models"),
    "bench": ("bench", "throughput: fused kernels vs torch.compile"),
    "waterline": ("waterline", "waterline / efficiency-gap analysis of a model"),
    "results": ("results", "results table of docs/bench.md from benchmarks/results"),
    "export": ("export", "export for deployment: pt2 (fused, torch.export) or onnx (BN-folded)"),
    "kernels": ("kernels", "static cost report of the fused kernels compiled for a GPU"),
}


def _commands_text() -> str:
    width = max(len(k) for k in ("info", *TOOLS))
    lines = [f"  {'info':<{width}}  (default) size, cost, fused-form check and throughput of the models"]
    lines += [f"  {k:<{width}}  {v[1]}" for k, v in TOOLS.items()]
    return "commands:\n" + "\n".join(lines) + "\n\nRun `convfirstnet <command> --help` for each."


def _unknown_command(word: str) -> int:
    names = ["info", *TOOLS]
    close = difflib.get_close_matches(word, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(info.build_parser().format_usage().rstrip(), file=sys.stderr)
    print(
        f"convfirstnet: error: unknown command {word!r}{hint}; commands: {', '.join(names)}",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        module = importlib.import_module(f"{__package__}.{TOOLS[argv[0]][0]}")
        return module.main(argv[1:])
    if argv and argv[0] == "info":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        return _unknown_command(argv[0])
    return info.main(argv, epilog=_commands_text())


if __name__ == "__main__":
    raise SystemExit(main())
