"""Compile recorded kernel launches for a GPU target on a machine without one, and read the result.

A :class:`~convfirstnet.kernels._cost.Launch` (recorded by ``kernels._cost.recording``) holds the JIT
function and the arguments exactly as its launcher passed them. :func:`variant_of` binds them with
Triton's own binder for the target, so the signature, the integer specialisations (``== 1``,
divisible by 16) and the constexprs are those a real launch would compile. :func:`compile_variants`
compiles each distinct variant with ``triton.compile`` (ptxas included) in worker processes that run
without ``TRITON_INTERPRET`` (kernels decorated under the interpreter cannot be compiled), and
returns per variant:

* registers, stack bytes (> 0 means spills), local memory, shared memory (``cuobjdump
  --dump-resource-usage``), and occupancy on the target;
* the tensor-core instruction kind: ``wgmma`` (PTX ``wgmma.mma_async``, SASS HGMMA) or ``mma.sync``
  (HMMA), with counts;
* the SASS listing (``nvdisasm``) as instructions, and its loops (backward branches) as a tree;
* the PTX (``analysis.ordering`` checks the barrier ordering of global round trips in it).

:func:`weighted_counts` then weights every SASS instruction by the trip counts of the loops around
it, matching the SASS loop tree against the loops the launcher declared (``KernelCost.loops``): the
per-warp dynamic instruction count that the issue-time estimate uses. Every instruction of the
listing counts once per trip of its enclosing loops, both sides of a runtime branch included, so the
count is an estimate of the issued instructions, not a measurement. A small runtime loop that ptxas
unrolled (a main loop doing k source iterations per trip, then a remainder loop) is recognised from
its counter and weighted trips // k and trips % k.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from convfirstnet.kernels._cost import Launch, Loop

from .shared import shared_stores

# ------------------------------------------------------------------------------------------ variants


@dataclass(frozen=True)
class Variant:
    """One compile: the kernel (by module and name), its bound signature and the target. JSON-able."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]
    attrs: tuple[tuple[tuple[int, ...], Any], ...]
    options: tuple[tuple[str, Any], ...]  # launch options given explicitly (num_warps, num_stages, ...)
    arch: int

    @property
    def key(self) -> str:
        return json.dumps([self.module, self.name, self.signature, self.constexprs, self.attrs, self.options,
                           self.arch], default=str)

    @property
    def meta(self) -> dict:
        """Constexpr values by argument name plus the launch options: what tells variants apart."""
        names = [n for n, _ in self.signature]
        out = {names[path[0]]: v for path, v in self.constexprs if len(path) == 1}
        out.update(dict(self.options))
        return out

    def to_json(self) -> dict:
        return dict(module=self.module, name=self.name, signature=list(self.signature),
                    constexprs=[[list(p), v] for p, v in self.constexprs],
                    attrs=[[list(p), v] for p, v in self.attrs], options=list(self.options), arch=self.arch)


LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _jit_function(kernel):
    """The ``JITFunction`` behind a launch's kernel (under the interpreter, re-wrapped for binding only,
    with the options of its ``@triton.jit``, e.g. ``do_not_specialize``)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **getattr(kernel, "kwargs", {}))


def variant_of(launch: Launch, arch: int) -> Variant:
    """Bind a recorded launch's arguments for ``sm_<arch>`` with Triton's binder (what ``kernel[grid]``
    would compile on that GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = _jit_function(launch.kernel)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.meta)
    _, signature, constexprs, attrs = fn._pack_args(backend, launch.meta, bound, spec, opts)

    def plain(v):
        return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)

    return Variant(
        module=fn.fn.__module__,
        name=fn.fn.__name__,
        signature=tuple(signature.items()),
        constexprs=tuple((tuple(p), plain(v)) for p, v in sorted(constexprs.items())),
        attrs=tuple((tuple(p), v) for p, v in sorted(attrs.items())),
        options=tuple((k, launch.meta[k]) for k in LAUNCH_OPTIONS if k in launch.meta),
        arch=arch,
    )


# ------------------------------------------------------------------------------------------ SASS


@dataclass
class Instruction:
    addr: int
    opcode: str  # full mnemonic, e.g. "LDG.E.128"
    text: str
    predicated: bool
    high: int | None = None  # the high 64 bits of the encoding (``nvdisasm -hex``): the control codes

    @property
    def family(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def control(self):
        """The decoded scheduling fields (``analysis.sass.Control``), None for a listing without -hex."""
        from .sass import Control

        return None if self.high is None else Control.decode(self.high)


@dataclass
class SassLoop:
    start: int  # index of the first instruction of the body (the branch target)
    end: int  # index of the last backward branch to it
    children: list["SassLoop"] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.end - self.start + 1

    def shape(self) -> tuple:
        return tuple(c.shape() for c in self.children)


_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_HEX_ONLY = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")


def parse_sass(text: str) -> tuple[list[Instruction], list[SassLoop]]:
    """Instructions of an ``nvdisasm -c`` listing and its loop forest (outermost first, in order).
    With ``-hex`` the high half of each encoding is kept (``Instruction.high``: the control codes).

    A loop is the range from a label to the last backward branch that targets it. The trailing
    ``BRA`` to itself after the last ``EXIT`` (a trap, never executed) and the ``NOP`` padding after
    it are left out of the listing.
    """
    insns: list[Instruction] = []
    labels: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    padding = False  # after the trap: alignment NOPs up to the end of the function
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if line.lstrip().startswith(".section"):
            padding = False
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.match(line)
        if not m:
            continue
        opcode = m.group(3)
        if padding and opcode == "NOP":
            continue
        t = _TARGET.search(line) if opcode.split(".")[0] == "BRA" else None
        if t and not m.group(2) and labels.get(t.group(1)) == len(insns):
            padding = True
            continue  # the trap after the last EXIT (an unconditional branch to itself): never executed
        hx = _HEX_ONLY.match(lines[k + 1]) if k + 1 < len(lines) else None
        insns.append(Instruction(int(m.group(1), 16), opcode, line.strip(), bool(m.group(2)),
                                 int(hx.group(1), 16) if hx else None))
        if t:
            branches.append((len(insns) - 1, t.group(1)))
    ends: dict[int, int] = {}
    for at, label in branches:
        start = labels.get(label)
        if start is None or start > at:
            continue  # forward branch
        ends[start] = max(ends.get(start, at), at)
    loops = sorted((SassLoop(s, e) for s, e in ends.items()), key=lambda lp: (lp.start, -lp.end))
    roots: list[SassLoop] = []
    stack: list[SassLoop] = []
    for lp in loops:
        while stack and lp.start > stack[-1].end:
            stack.pop()
        if stack and lp.end > stack[-1].end:
            raise ValueError(f"irreducible loops in SASS at instructions {stack[-1].start}-{stack[-1].end} "
                             f"and {lp.start}-{lp.end}")
        (stack[-1].children if stack else roots).append(lp)
        stack.append(lp)
    return insns, roots


def _shape_text(loops) -> str:
    return "(" + ", ".join(_shape_text(lp.children if isinstance(lp, SassLoop) else lp.body) for lp in loops) + ")"


# ptxas unrolls a small runtime loop into a main loop that runs k source iterations per trip and a
# remainder loop after it (two sibling SASS loops for one source loop). The main loop counts the
# remaining source iterations down by k and repeats while more than k - 1 are left:
#     IADD3 R8, P1, R8, -0x4, RZ   ...   ISETP.GT.U32.AND P1, PT, R8, 0x3, PT   ...   @P1 BRA
_DECREMENT = re.compile(r"\bU?IADD3 (U?R\d+), (?:U?P\d+, )?\1, -0x([0-9a-f]+)\b")
_COMPARE = re.compile(r"\bU?ISETP\.(GT|GE)\.U32\.AND U?P\d+, U?PT, (U?R\d+), 0x([0-9a-f]+)\b")


def unroll_factor(insns: Sequence[Instruction], loop: SassLoop) -> int | None:
    """Source iterations per trip of a ptxas-unrolled main loop: the k by which it counts a register
    down and against which it compares that register (``> k - 1`` or ``>= k``), or None if the
    loop has no such counter."""
    body = [insns[i].text for i in range(loop.start, loop.end + 1)]
    decrements = {(m.group(1), int(m.group(2), 16)) for t in body for m in _DECREMENT.finditer(t)}
    for t in body:
        for m in _COMPARE.finditer(t):
            reg, k = m.group(2), int(m.group(3), 16) + (1 if m.group(1) == "GT" else 0)
            if k > 1 and (reg, k) in decrements:
                return k
    return None


@dataclass
class LoopMatch:
    """A declared loop and the SASS loop(s) compiled from it: one loop, or (``unroll`` > 1) the main
    loop ptxas unrolled ``unroll`` times followed by its remainder loop."""

    declared: Loop
    sass: tuple[SassLoop, ...]
    unroll: int = 1
    children: list["LoopMatch"] = field(default_factory=list)

    def trips(self) -> tuple[int, ...]:
        """Trips of each SASS loop: the declared trips, or (unrolled) trips // k and trips % k."""
        if self.unroll == 1:
            return (self.declared.trips,)
        return (self.declared.trips // self.unroll, self.declared.trips % self.unroll)


MAX_CANDIDATES = 256  # matchings of one listing considered (real loop trees have a handful)


def match_candidates(
    sass: Sequence[SassLoop], declared: Sequence[Loop], insns: Sequence[Instruction] | None = None
) -> list[tuple[list[LoopMatch], int]]:
    """Every way to pair the SASS loops with the declared loops (same nesting, same order), each with the
    number of declared loops of more than one trip it assumes the compiler unrolled away.

    * A declared loop may be missing from the SASS: one trip (a bound the binder specialised to 1), or
      a constant trip count the compiler unrolled completely; its body, repeated ``trips`` times,
      takes its place (straight-line code counts once per enclosing trip, as it should). Not a
      ``fixed`` one: its bound is a runtime value, so it is compiled as a loop whatever its trips.
    * A declared innermost loop may match two sibling innermost SASS loops when the first is a main
      loop that ptxas unrolled k times (:func:`unroll_factor`, needs ``insns``) and the second is its
      remainder loop.
    """
    def rec(sass: Sequence[SassLoop], declared: Sequence[Loop]) -> list[tuple[list[LoopMatch], int]]:
        if not declared:
            return [([], 0)] if not sass else []
        first, rest = declared[0], list(declared[1:])
        found: list[tuple[list[LoopMatch], int]] = []
        if sass:
            for inner, pen_in in rec(sass[0].children, first.body):
                for tail, pen_tail in rec(sass[1:], rest):
                    found.append(([LoopMatch(first, (sass[0],), 1, inner)] + tail, pen_in + pen_tail))
            if (insns is not None and not first.body and len(sass) >= 2 and not sass[0].children
                    and not sass[1].children):
                k = unroll_factor(insns, sass[0])
                if k is not None and unroll_factor(insns, sass[1]) is None:
                    for tail, pen_tail in rec(sass[2:], rest):
                        found.append(([LoopMatch(first, (sass[0], sass[1]), k)] + tail, pen_tail))
        if not first.fixed and first.trips >= 1 and len(first.body) * first.trips <= 64:  # unrolled away
            for m, pen in rec(sass, list(first.body) * first.trips + rest):
                found.append((m, pen + (first.trips > 1)))
        if len(found) > MAX_CANDIDATES:
            raise ValueError(f"more than {MAX_CANDIDATES} ways to match the SASS loops to the declared ones")
        return found

    return rec(sass, declared)


def match_loops(
    sass: Sequence[SassLoop], declared: Sequence[Loop], insns: Sequence[Instruction] | None = None
) -> list[LoopMatch] | None:
    """The structurally simplest pairing of SASS loops with declared loops (fewest declared loops assumed
    unrolled away; see :func:`match_candidates`), or None if there is none."""
    cands = match_candidates(sass, declared, insns)
    return min(cands, key=lambda c: c[1])[0] if cands else None


# Tensor-core instructions and the MACs each one performs: HGMMA (wgmma) per warpgroup of 4 warps,
# HMMA (mma.sync) per warp. Shapes from the mnemonic: HGMMA.64x128x16.F32, HMMA.16816.F32 (m16n8k16).
_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\b")
_HMMA = re.compile(r"^HMMA\.16(8)(4|8|16|32)\b")
TENSOR_FAMILIES = ("HGMMA", "HMMA", "IMMA", "QMMA", "OMMA", "UTCMMA", "UTCHMMA")


def tensor_macs_per_program(counts: Counter, num_warps: int) -> int | None:
    """Tensor-core MACs one program issues, from per-warp dynamic counts of its SASS instructions (every
    warp runs the same listing; a warpgroup of 4 executes each HGMMA once). None when a tensor-core
    instruction has a shape this does not know."""
    total = 0
    for opcode, n in counts.items():
        if not n:
            continue
        if m := _HGMMA.match(opcode):
            total += n * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) * max(1, num_warps // 4)
        elif m := _HMMA.match(opcode):
            total += n * 16 * int(m.group(1)) * int(m.group(2)) * num_warps
        elif opcode.split(".")[0] in TENSOR_FAMILIES:
            return None
    return total


def tensor_macs_by_kind(counts: Counter, num_warps: int) -> dict[str, int]:
    """Tensor-core MACs one program issues, split into ``wgmma`` (HGMMA) and ``mma.sync`` (HMMA); shapes
    this does not know count in neither."""
    out = {"wgmma": 0, "mma.sync": 0}
    for opcode, n in counts.items():
        if not n:
            continue
        if m := _HGMMA.match(opcode):
            out["wgmma"] += n * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) * max(1, num_warps // 4)
        elif m := _HMMA.match(opcode):
            out["mma.sync"] += n * 16 * int(m.group(1)) * int(m.group(2)) * num_warps
    return out


@dataclass
class Weighted:
    """The declared loops applied to one listing (:func:`weigh`)."""

    counts: Counter  # per-warp dynamic count of each opcode
    rows: list[dict]  # one per SASS loop: name, trips, instructions, depth, executions, unroll
    tensor_macs: int | None  # per program, from the weighted tensor-core instructions (None: unknown shape)
    candidates: int  # structurally valid matchings considered
    unrolled_away: list[str]  # declared loops of more than one trip taken as fully unrolled by the compiler
    weights: list[int] = field(default_factory=list)  # executions of each listed instruction per warp

    @property
    def per_warp(self) -> int:
        return sum(self.counts.values())


def _apply(insns: Sequence[Instruction], matches: list[LoopMatch]) -> tuple[Counter, list[dict], list[int]]:
    weight = [1] * len(insns)
    rows: list[dict] = []

    def walk(level: list[LoopMatch], outer: int, depth: int):
        for m in level:
            for part, (s, trips) in enumerate(zip(m.sass, m.trips())):
                for i in range(s.start, s.end + 1):
                    weight[i] *= trips
                name = m.declared.name
                if m.unroll > 1:
                    name += f" (unrolled x{m.unroll} by ptxas)" if part == 0 else " (remainder)"
                rows.append(dict(name=name, trips=trips, instructions=s.size, depth=depth,
                                 executions=outer * trips, unroll=m.unroll if part == 0 else 1))
            walk(m.children, outer * m.declared.trips, depth + 1)

    walk(matches, 1, 0)
    counts: Counter = Counter()
    for ins, w in zip(insns, weight):
        counts[ins.opcode] += w
    return counts, rows, weight


def _unrolled_away(declared: Sequence[Loop], matches: list[LoopMatch]) -> list[str]:
    kept: set[int] = set()

    def mark(level: list[LoopMatch]):
        for m in level:
            kept.add(id(m.declared))
            mark(m.children)

    mark(matches)
    gone: list[str] = []

    def scan(loops: Sequence[Loop]):
        for lp in loops:
            if id(lp) not in kept and lp.trips > 1 and lp.name not in gone:
                gone.append(lp.name)
            scan(lp.body)

    scan(declared)
    return gone


def weigh(
    insns: Sequence[Instruction], sass_loops: Sequence[SassLoop], declared: Sequence[Loop], *, num_warps: int,
    mma_macs_per_program: float | None = None, what: str = "kernel",
) -> Weighted:
    """Weight every SASS instruction by the trips of the loops around it, the loops matched to the
    launcher's declaration (:func:`match_candidates`).

    When several matchings fit the loop structure (a constant-trip loop the compiler may or may not have
    unrolled), the one whose weighted tensor-core instructions issue the declared ``mma_macs`` per
    program is taken, then the one assuming the fewest loops unrolled away; of two that remain and weigh
    the listing differently, none issuing the declared MACs exactly, the one nearest them (in ratio) is
    taken; a tie there is an error, as is no matching at all (``ValueError`` naming ``what`` and what to
    fix).
    """
    cands = match_candidates(sass_loops, declared, insns)
    if not cands:
        raise ValueError(
            f"{what}: the compiled SASS has loops {_shape_text(sass_loops)} but the launcher declares "
            f"{_shape_text(declared)} ({_names(declared)}); update the declaration (KernelCost.loops) "
            "beside the launcher: one Loop per runtime loop (range/tl.range whose bound is not a "
            "constexpr), outermost first, in program order, nested as in the source"
        )
    scored = []
    for matches, penalty in cands:
        counts, rows, weight = _apply(insns, matches)
        macs = tensor_macs_per_program(counts, num_warps)
        consistent = (mma_macs_per_program is not None and macs is not None
                      and math.isclose(macs, mma_macs_per_program, rel_tol=1e-9, abs_tol=0.5))
        scored.append(((not consistent, penalty), matches, counts, rows, macs, weight))
    best_key = min(s[0] for s in scored)
    best = [s for s in scored if s[0] == best_key]
    if len({sum(b[2].values()) for b in best}) > 1 and best_key[0] and mma_macs_per_program:
        # none issues the declared MACs exactly: the declaration counts the programs' average and the loops
        # the busiest program's trips where the work divides unevenly (Nano's 8x8 MBConv: 10 chunks in
        # groups of 3, 3, 3, 1). The matching closest to the declared MACs, if one is
        def off(b):
            return abs(math.log(b[4] / mma_macs_per_program)) if b[4] else math.inf

        nearest = min(off(b) for b in best)
        best = [b for b in best if math.isclose(off(b), nearest, rel_tol=1e-9, abs_tol=1e-12)]
    if len({sum(b[2].values()) for b in best}) > 1:
        raise ValueError(
            f"{what}: the declared loops ({_names(declared)}) fit the compiled SASS loops "
            f"{_shape_text(sass_loops)} in {len(best)} ways that weigh it differently; give the loops "
            "distinct trip counts or check which of them the compiler unrolled"
        )
    _, matches, counts, rows, macs, weight = best[0]
    return Weighted(counts, rows, macs, len(cands), _unrolled_away(declared, matches), weight)


def weighted_counts(
    insns: Sequence[Instruction], sass_loops: Sequence[SassLoop], declared: Sequence[Loop],
    what: str = "kernel",
) -> tuple[Counter, list[dict]]:
    """Per-warp dynamic count of each opcode and one row per SASS loop (:func:`weigh` without the
    tensor-core check: the structurally simplest matching)."""
    w = weigh(insns, sass_loops, declared, num_warps=4, what=what)
    return w.counts, w.rows


def _names(loops: Sequence[Loop]) -> str:
    parts = [lp.name + (f" [{_names(lp.body)}]" if lp.body else "") for lp in loops]
    return ", ".join(parts) or "no loops"


# Opcode families for the instruction mix (SASS base mnemonics).
MIX_GROUPS: dict[str, tuple[str, ...]] = {
    "tensor core": ("HGMMA", "HMMA", "IMMA", "WARPGROUP"),
    "global load": ("LDG", "LDGSTS", "LDGDEPBAR", "UTMALDG", "LD"),
    "global store/atomic": ("STG", "RED", "ATOM", "ATOMG", "ST", "UTMASTG"),
    "shared memory": ("LDS", "STS", "LDSM", "STSM", "ATOMS"),
    "local memory (spills)": ("LDL", "STL"),
    "shuffle": ("SHFL",),
    "fp32": ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "FCHK", "FSWZADD"),
    "fp16x2": ("HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2"),
    "special function": ("MUFU",),
    "conversion": ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP"),
    "integer/address": ("IMAD", "IADD3", "IADD", "LOP3", "SHF", "LEA", "ISETP", "IABS", "IMNMX", "UIMAD",
                        "UIADD3", "ULOP3", "USHF", "ULEA", "UISETP", "IMUL", "POPC", "FLO", "BMSK", "SGXT"),
    "move/select/permute": ("MOV", "SEL", "PRMT", "CS2R", "S2R", "S2UR", "UMOV", "R2UR", "ULDC", "LDC", "P2R",
                            "R2P", "PLOP3", "UPLOP3", "USEL", "VOTEU", "VOTE"),
    "barrier/sync": ("BAR", "DEPBAR", "WARPSYNC", "MEMBAR", "SYNCS", "ERRBAR", "CCTL", "FENCE", "ARRIVES"),
    "control": ("BRA", "EXIT", "BSSY", "BSYNC", "RET", "CALL", "NOP", "YIELD", "BPT", "ELECT", "ACQBULK"),
}
_FAMILY_GROUP = {fam: group for group, fams in MIX_GROUPS.items() for fam in fams}


def instruction_mix(counts: Counter) -> dict[str, int]:
    """Dynamic counts grouped into the families of ``MIX_GROUPS`` (unknown mnemonics under "other")."""
    mix: Counter = Counter()
    for opcode, n in counts.items():
        mix[_FAMILY_GROUP.get(opcode.split(".")[0], "other")] += n
    return dict(mix.most_common())


# ------------------------------------------------------------------------------------------ compiling


@dataclass
class Compiled:
    """What the target's compiler produced for one variant."""

    variant: Variant
    regs: int
    stack: int  # bytes per thread; > 0 means ptxas spilled registers
    local: int
    shared: int  # bytes per program (static + Triton's dynamic)
    num_warps: int
    ptx_wgmma: int  # wgmma.mma_async instructions in the PTX
    ptx_mma_sync: int  # mma.sync instructions in the PTX
    sass: str
    compile_s: float
    ptx: str = ""  # the PTX (convfirstnet.analysis.ordering reads the barrier ordering from it)
    # register -> shared copies of the TTGIR and their bank conflicts (convfirstnet.analysis.shared)
    shared_stores: list = field(default_factory=list)

    @property
    def mma_kind(self) -> str:
        if self.ptx_wgmma and self.ptx_mma_sync:
            return "wgmma+mma.sync"
        return "wgmma" if self.ptx_wgmma else "mma.sync" if self.ptx_mma_sync else "none"

    def listing(self) -> tuple[list[Instruction], list[SassLoop]]:
        return parse_sass(self.sass)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_one(variant: Variant) -> dict:
    """Compile ``variant`` in this process (which must not run the Triton interpreter)."""
    import importlib
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(variant.module), variant.name)
    constexprs = {tuple(p): v for p, v in variant.constexprs}
    attrs = {tuple(p): v for p, v in variant.attrs}
    t0 = time.perf_counter()
    k = triton.compile(ASTSource(fn, dict(variant.signature), constexprs, attrs),
                       target=GPUTarget("cuda", variant.arch, 32), options=dict(variant.options))
    seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        # -hex: the encodings, whose high halves carry the control codes (analysis.sass)
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-hex", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    res = {m.group(1): int(m.group(2)) for m in re.finditer(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    ptx = k.asm["ptx"]
    return dict(regs=res.get("REG", 0), stack=res.get("STACK", 0), local=res.get("LOCAL", 0),
                shared=max(int(k.metadata.shared), res.get("SHARED", 0)), num_warps=int(k.metadata.num_warps),
                ptx_wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
                ptx_mma_sync=len(re.findall(r"\bmma\.sync", ptx)), sass=sass, compile_s=seconds, ptx=ptx,
                shared_stores=[st.to_json() for st in shared_stores(k.asm.get("ttgir", ""))])


def _variant_from_json(v: dict) -> Variant:
    return Variant(v["module"], v["name"], tuple(map(tuple, v["signature"])),
                   tuple((tuple(p), x) for p, x in v["constexprs"]),
                   tuple((tuple(p), x) for p, x in v["attrs"]), tuple(map(tuple, v["options"])), v["arch"])


def _worker_main() -> None:
    """``python -m convfirstnet.analysis.compiled``: one JSON variant per stdin line in, one JSON result
    per stdout line out. Anything else written to stdout (by the compiler, say) goes to stderr."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        try:
            result = dict(ok=True, **compile_one(_variant_from_json(json.loads(line))))
        except Exception as e:  # reported per variant by the parent
            result = dict(ok=False, error=f"{type(e).__name__}: {e}")
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()


def _worker_env() -> dict:
    """The parent's environment without the interpreter, and its module search path, so that a worker
    imports every kernel module the parent can (a test's own kernels included)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if os.path.isdir(p)))
    return env


class _Worker:
    """One compile process (``python -m convfirstnet.analysis.compiled``) and its stderr log."""

    def __init__(self, env: dict) -> None:
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "convfirstnet.analysis.compiled"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def compile(self, variant: Variant) -> dict | None:
        """The worker's JSON answer for ``variant``; None if the worker died (see :meth:`failure`)."""
        try:
            self.proc.stdin.write(json.dumps(variant.to_json()) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def failure(self) -> tuple[str, str]:
        """What to report for a worker that died: its exit status and the end of its stderr."""
        self.proc.wait()
        self.log.seek(0)
        return f"kernel compile worker failed (exit {self.proc.returncode})", self.log.read()[-4000:]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait()
        self.log.close()


class CompileSession:
    """What :func:`compile_session` keeps: the variants compiled, by key, and the idle workers."""

    def __init__(self) -> None:
        self.compiled: dict[str, Compiled] = {}
        self.idle: list[_Worker] = []

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


_SESSION: CompileSession | None = None


@contextlib.contextmanager
def compile_session() -> Iterator[CompileSession]:
    """Within it, :func:`compile_variants` compiles each distinct variant once in this process (a later
    request gets the first result) and keeps its worker processes between calls instead of starting
    new ones (each imports torch and Triton: seconds). The test suite runs inside one, so the kernel
    tests and the report tests share one compiled set. Nested, the outer session is used."""
    global _SESSION
    outer = _SESSION
    session = outer or CompileSession()
    _SESSION = session
    try:
        yield session
    finally:
        _SESSION = outer
        if outer is None:
            session.close()


def compile_variants(
    variants: Sequence[Variant], jobs: int | None = None,
    progress: Callable[[int, int, Compiled], None] | None = None,
) -> list[Compiled]:
    """Compile each variant in ``jobs`` worker processes without the Triton interpreter (default: 2, or
    fewer CPUs); results in the order given, a variant given twice compiled once. Each worker takes
    the next variant when it is done with one, and ``progress(done, total, compiled)`` is called as
    each finishes. Inside :func:`compile_session`, variants compiled before are not compiled again.

    Raises ``RuntimeError`` naming the variant if one fails to compile.
    """
    session = _SESSION
    known: dict[str, Compiled] = session.compiled if session is not None else {}
    todo = list({v.key: v for v in variants if v.key not in known}.values())
    if todo:
        _compile(todo, jobs, progress, session, known)
    return [known[v.key] for v in variants]


def _compile(
    variants: list[Variant], jobs: int | None, progress: Callable[[int, int, Compiled], None] | None,
    session: CompileSession | None, results: dict[str, Compiled],
) -> None:
    """Compile ``variants`` into ``results`` (by key), with the session's idle workers if there is one."""
    jobs = max(1, min(jobs or min(2, os.cpu_count() or 1), len(variants)))
    env = _worker_env()
    pending = list(range(len(variants)))
    errors: list[tuple[int, str]] = []
    done = [0]
    lock = threading.Lock()

    def describe(i: int) -> str:
        return f"{variants[i].name} {variants[i].meta} for sm_{variants[i].arch}"

    def work(worker: _Worker) -> None:
        healthy = True
        try:
            while True:
                with lock:
                    if errors or not pending:
                        return
                    i = pending.pop(0)
                r = worker.compile(variants[i])
                if r is None:
                    healthy = False
                    what, log = worker.failure()
                    with lock:
                        errors.append((i, f"{what} compiling {describe(i)}:\n{log}"))
                    return
                if not r.pop("ok"):
                    with lock:
                        errors.append((i, f"{describe(i)} does not compile: {r['error']}"))
                    return
                c = Compiled(variant=variants[i], **r)
                with lock:
                    results[variants[i].key] = c
                    done[0] += 1
                    if progress is not None:
                        progress(done[0], len(variants), c)
        finally:
            if session is not None and healthy:
                with lock:
                    session.idle.append(worker)
            else:
                worker.close()

    idle = session.idle if session is not None else []
    workers = [idle.pop() if idle else _Worker(env) for _ in range(jobs)]
    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(min(errors)[1])


if __name__ == "__main__":
    _worker_main()
