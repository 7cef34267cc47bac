"""The README and the manual name only commands, options, scripts and pages that exist.

Every ``convfirstnet <command> ...`` invocation (in code blocks and in inline code, also as ``python -m
convfirstnet`` and ``scripts/<name>.py``) must name a real subcommand, and each of its options must be
one of that command's argparse options; every other ``--option`` in inline code must belong to the
commands of its page (or, on a page about no command in particular, to some command), unless it is an
option of another program listed in ``FOREIGN``. The parsers are the commands' own: each command's
``main`` is run until it parses its arguments, so the check follows an option wherever it is defined.
Relative links must point to files that exist.
"""

from __future__ import annotations

import argparse
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from convfirstnet.commands import cli

from ._scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "weights" / "README.md",
    ROOT / "benchmarks" / "static" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
COMMANDS = ("info", *cli.TOOLS)
# Modules with a command line of their own, run as `python -m <module>`.
MODULES = {"convfirstnet.analysis.calibration": "calibration"}
SCRIPTS = {  # scripts/<name>.py -> the command it runs
    "benchmark": "bench",
    "convert_checkpoint": "convert",
    "eval_imagenet": "eval",
    "results_table": "results",
    "train_imagenet": "train",
    "gpu_check": "gpu_check",  # a script with its own parser (scripts/gpu_check.py)
    "gpu_profile": "gpu_profile",  # likewise
    "host_time": "host_time",  # likewise
    "gpu_variants": "gpu_variants",  # likewise
    "gpu_ncu": "gpu_ncu",  # likewise
    "gpu_gconv": "gpu_gconv",  # likewise
}
# scripts whose command line is their own, not a convfirstnet subcommand
STANDALONE = {"gpu_check", "gpu_gconv", "gpu_ncu", "gpu_profile", "gpu_variants", "host_time"}
# The commands whose options a page's prose may name; pages not listed may name any command's.
PAGE_COMMANDS = {
    "docs/eval.md": ("eval",),
    "docs/train.md": ("train",),
    "docs/convert.md": ("convert",),
    "docs/export.md": ("export",),
    "docs/bench.md": ("bench", "results"),
    "docs/waterline.md": ("waterline",),
    "docs/cost-model.md": ("kernels", "waterline"),
}
# Options of other programs that the text names, with the program they belong to.
FOREIGN = {
    "--nproc_per_node": "torchrun",
    "--nnodes": "torchrun",
    "--rdzv-backend": "torchrun",
    "--rdzv-endpoint": "torchrun",
    "--no-python": "torchrun",
    "--reparam": "timm validate.py / benchmark.py",
    "--amp": "timm validate.py / train.py / benchmark.py",
    "--bench": "timm benchmark.py",
    "--durations": "pytest",
    "--index-url": "pip",
}
OPTION = re.compile(r"(?<![\w./-])(--?[A-Za-z][\w-]*)")


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@cache
def options(command: str) -> frozenset[str] | None:
    """The option strings of ``convfirstnet <command>``'s parser; None for a command without one
    (``timm-script`` passes its arguments on to the script)."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        if command == "calibration":
            from convfirstnet.analysis import calibration

            calibration.main(["--help"])
        elif command in STANDALONE:
            module = load_script(command, f"_docs_{command}")
            return frozenset(module.build_parser()._option_string_actions)
        else:
            cli.main([command, "--help"])
    except _Parsed as p:
        return frozenset(p.parser._option_string_actions)
    finally:
        argparse.ArgumentParser.parse_known_args = original
    return None


def _code_blocks(text: str) -> tuple[list[str], str]:
    """The shell-like fenced code blocks of ``text`` (python, json and console output left out), and the
    text outside all fenced blocks."""
    blocks, prose, inside, lang, body = [], [], False, "", []
    for line in text.splitlines():
        if line.startswith("```"):
            if inside:
                if lang in ("", "bash", "sh", "shell"):
                    blocks.append("\n".join(body))
                inside, body = False, []
            else:
                inside, lang = True, line[3:].strip()
            continue
        (body if inside else prose).append(line)
    return blocks, "\n".join(prose)


def _commands_in(line: str) -> list[tuple[str, list[str]]]:
    """(command, arguments) of every convfirstnet invocation in one shell line."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose: take the words as they are
        tokens = line.split()
    tokens = [t.strip("[]") for t in tokens]
    found = []
    for i, tok in enumerate(tokens):
        rest = tokens[i + 1 :]
        if tok == "convfirstnet":  # also `python -m convfirstnet`, `torchrun ... --no-python convfirstnet`
            word = rest[0].rstrip(":") if rest else ""
            if rest and not word.startswith("-"):
                found.append((word, rest[1:]))
            else:
                found.append(("info", rest))
        elif tok in MODULES and tokens[i - 1 : i] == ["-m"]:
            found.append((MODULES[tok], rest))
        elif tok.startswith("scripts/") and tok.endswith(".py"):
            assert (ROOT / tok).is_file(), f"{tok} does not exist"
            found.append((SCRIPTS[Path(tok).stem], rest))
    out = []
    for command, args in found:
        end = next((j for j, a in enumerate(args) if a in ("&&", "||", "|", ";")), len(args))
        out.append((command, args[:end]))
    return out


def _invocations(page: Path) -> list[tuple[str, list[str], str]]:
    text = page.read_text()
    blocks, prose = _code_blocks(text)
    lines = []
    for block in blocks:
        lines += block.replace("\\\n", " ").splitlines()
    lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [(c, a, line) for line in lines for c, a in _commands_in(line)]


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_invocations_use_real_commands_and_options(page):
    problems = []
    for command, args, line in _invocations(page):
        if command.startswith("<"):  # a placeholder: `convfirstnet <command> --help`
            continue
        if command not in COMMANDS and command not in MODULES.values() and command not in STANDALONE:
            problems.append(f"unknown command {command!r} in: {line}")
            continue
        known = options(command)
        if known is None:
            continue
        for arg in args:
            if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit() and arg != "--":
                if arg.split("=", 1)[0] not in known:
                    problems.append(f"convfirstnet {command} has no option {arg.split('=', 1)[0]}: {line}")
    assert not problems, f"{_rel(page)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_options_in_the_text_exist(page):
    """Options named in inline code outside invocations: those of the page's commands, or of a program
    in FOREIGN."""
    _, prose = _code_blocks(page.read_text())
    commands = PAGE_COMMANDS.get(_rel(page), (*COMMANDS, *STANDALONE))
    known = set().union(*(options(c) or () for c in commands))
    problems = []
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if _commands_in(span):
            continue  # an invocation: checked against its own command above
        for opt in OPTION.findall(span):
            if opt.startswith("--") and opt not in known and opt not in FOREIGN:
                problems.append(f"{opt} (in `{span}`) is not an option of convfirstnet {'/'.join(commands)}")
    assert not problems, f"{_rel(page)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_exist(page):
    text = page.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not missing, f"{_rel(page)} links to missing files: {missing}"


def test_the_readme_lists_every_command():
    """The README's list of subcommands is complete, and the README stays a front door."""
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"its subcommands \(([^)]*)\)", " ".join(readme.split())).group(1)
    assert [c.strip("` ") for c in listed.split(",")] == list(COMMANDS)
    assert len(readme.splitlines()) <= 200


def test_the_checker_catches_a_renamed_option():
    """A planted bug: an option the parser does not have, and a command that does not exist."""
    assert _commands_in("convfirstnet bench --batch-size 1") == [("bench", ["--batch-size", "1"])]
    assert "--batch-size" not in options("bench") and "--batch-sizes" in options("bench")
    assert _commands_in("python -m convfirstnet kernels --arch sm_80") == [("kernels", ["--arch", "sm_80"])]
    assert _commands_in("torchrun --nproc_per_node 8 scripts/train_imagenet.py --model pico") == [
        ("train", ["--model", "pico"])
    ]
    assert options("timm-script") is None and options("info") >= {"--version", "--models"}
