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
* the SASS listing (``nvdisasm``) as instructions, and its loops (backward branches) as a tree.

:func:`weighted_counts` then weights every SASS instruction by the trip counts of the loops around
it, matching the SASS loop tree against the loops the launcher declared (``KernelCost.loops``): the
per-warp dynamic instruction count that the issue-time estimate uses. Every instruction of the
listing counts once per trip of its enclosing loops, both sides of a runtime branch included, so the
count is an estimate of the issued instructions, not a measurement.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from convfirstnet.kernels._cost import Launch, Loop

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
    """The ``JITFunction`` behind a launch's kernel (under the interpreter, re-wrapped for binding only)."""
    from triton.runtime.jit import JITFunction

    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


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

    @property
    def family(self) -> str:
        return self.opcode.split(".")[0]


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


def parse_sass(text: str) -> tuple[list[Instruction], list[SassLoop]]:
    """Instructions of an ``nvdisasm -c`` listing and its loop forest (outermost first, in order).

    A loop is the range from a label to the last backward branch that targets it. The trailing
    ``BRA`` to itself after the last ``EXIT`` (a trap, never executed) is left out of the listing.
    """
    insns: list[Instruction] = []
    labels: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.match(line)
        if not m:
            continue
        opcode = m.group(3)
        t = _TARGET.search(line) if opcode.split(".")[0] == "BRA" else None
        if t and not m.group(2) and labels.get(t.group(1)) == len(insns):
            continue  # the trap after the last EXIT (an unconditional branch to itself): never executed
        insns.append(Instruction(int(m.group(1), 16), opcode, line.strip(), bool(m.group(2))))
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


def match_loops(sass: Sequence[SassLoop], declared: Sequence[Loop]) -> list[tuple[SassLoop, Loop, list]] | None:
    """Pair SASS loops with declared loops: same nesting, same order. A declared loop with one trip may be
    missing from the SASS (a bound the binder specialised to 1 lets the compiler drop the loop); its
    body then stands in its place. Returns nested ``(sass loop, declared loop, children pairs)`` or None."""
    if not sass and not declared:
        return []
    if not declared:
        return None
    first, rest = declared[0], list(declared[1:])
    if sass:
        inner = match_loops(sass[0].children, first.body)
        if inner is not None:
            tail = match_loops(sass[1:], rest)
            if tail is not None:
                return [(sass[0], first, inner)] + tail
    if first.trips == 1:  # elided: its body loops take its place
        return match_loops(sass, list(first.body) + rest)
    return None


def weighted_counts(
    insns: Sequence[Instruction], sass_loops: Sequence[SassLoop], declared: Sequence[Loop], what: str = "kernel"
) -> tuple[Counter, list[dict]]:
    """Per-warp dynamic count of each opcode: every instruction times the trips of its enclosing loops.

    The SASS loop tree must have the shape of the declared one (same nesting, same order; see
    :func:`match_loops`), else the declaration no longer describes the compiled code and this raises
    ``ValueError``. Returns the counts and one row per loop (name, trips, instructions in its body,
    nesting depth, executions of the body per program).
    """
    pairs = match_loops(sass_loops, declared)
    if pairs is None:
        raise ValueError(
            f"{what}: the compiled SASS has loops {_shape_text(sass_loops)} but the launcher declares "
            f"{_shape_text(declared)} ({', '.join(lp.name for lp in declared) or 'none'}); update the "
            "declaration (KernelCost.loops) beside the launcher"
        )
    weight = [1] * len(insns)
    rows: list[dict] = []

    def walk(level, outer: int, depth: int):
        for s, d, children in level:
            for i in range(s.start, s.end + 1):
                weight[i] *= d.trips
            rows.append(dict(name=d.name, trips=d.trips, instructions=s.size, depth=depth,
                             executions=outer * d.trips))
            walk(children, outer * d.trips, depth + 1)

    walk(pairs, 1, 0)
    counts: Counter = Counter()
    for ins, w in zip(insns, weight):
        counts[ins.opcode] += w
    return counts, rows


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
    import tempfile
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
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    res = {m.group(1): int(m.group(2)) for m in re.finditer(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    ptx = k.asm["ptx"]
    return dict(regs=res.get("REG", 0), stack=res.get("STACK", 0), local=res.get("LOCAL", 0),
                shared=max(int(k.metadata.shared), res.get("SHARED", 0)), num_warps=int(k.metadata.num_warps),
                ptx_wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
                ptx_mma_sync=len(re.findall(r"\bmma\.sync", ptx)), sass=sass, compile_s=seconds)


def _worker_main() -> None:  # python -m convfirstnet.analysis.compiled < variants.json > results.json
    out = []
    for v in json.load(sys.stdin):
        variant = Variant(v["module"], v["name"], tuple(map(tuple, v["signature"])),
                          tuple((tuple(p), x) for p, x in v["constexprs"]),
                          tuple((tuple(p), x) for p, x in v["attrs"]), tuple(map(tuple, v["options"])), v["arch"])
        try:
            out.append(dict(ok=True, **compile_one(variant)))
        except Exception as e:  # reported per variant by the parent
            out.append(dict(ok=False, error=f"{type(e).__name__}: {e}"))
    json.dump(out, sys.stdout)


def compile_variants(variants: Sequence[Variant], jobs: int | None = None) -> list[Compiled]:
    """Compile each variant (in ``jobs`` worker processes without the Triton interpreter), in order.

    Raises ``RuntimeError`` naming the variant if one fails to compile.
    """
    if not variants:
        return []
    jobs = max(1, min(jobs or min(2, os.cpu_count() or 1), len(variants)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    chunks = [list(range(i, len(variants), jobs)) for i in range(jobs)]
    procs = []
    for idx in chunks:
        p = subprocess.Popen([sys.executable, "-m", "convfirstnet.analysis.compiled"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        procs.append((idx, p, json.dumps([variants[i].to_json() for i in idx])))
    results: list[Compiled | None] = [None] * len(variants)
    for idx, p, payload in procs:
        stdout, stderr = p.communicate(payload)
        if p.returncode:
            raise RuntimeError(f"kernel compile worker failed (exit {p.returncode}):\n{stderr[-4000:]}")
        for i, r in zip(idx, json.loads(stdout)):
            if not r.pop("ok"):
                raise RuntimeError(f"{variants[i].name} {variants[i].meta} does not compile for "
                                   f"sm_{variants[i].arch}: {r['error']}")
            results[i] = Compiled(variant=variants[i], **r)
    return results  # type: ignore[return-value]


if __name__ == "__main__":
    _worker_main()
