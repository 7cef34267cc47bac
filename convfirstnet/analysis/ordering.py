"""Read-after-write ordering of global round-trip buffers in a compiled kernel's PTX.

A kernel that writes a global buffer and reads it back within the same program (a per-program scratch
slot, a gate slot) relies on the threads that read an element being other threads than the one that
wrote it: the read is correct only if a CTA barrier (``bar.sync``, from ``tl.debug_barrier()``) lies
between every store and every load of that buffer that may follow it. Layout conversions put many
other ``bar.sync`` into the PTX, so counting barriers proves nothing; this module follows the control
flow instead.

:func:`round_trip_hazards` reads the PTX of one kernel and

1. finds the buffers: every pointer parameter is followed through the registers derived from it
   (``ld.param``, then any arithmetic, move or select whose operands include a derived register;
   values loaded from memory are data, not addresses), and a parameter that the kernel both stores to
   (``st``, ``red``, ``atom``) and loads from (``ld``, ``cp.async``, ``atom``; not the tensor-map
   copies ``cp.async.bulk``, whose addresses are descriptors) is a round-trip buffer;
2. builds the control-flow graph of the PTX instructions (labels, ``bra``, ``ret``/``exit``);
3. runs a forward data-flow analysis per buffer to a fixed point: the state is the set of its stores
   that may have executed since the last barrier on some path; a store adds itself, a CTA-wide barrier
   (``bar.sync``/``barrier.sync``/``bar.red`` without a thread count, or with the CTA's) clears the
   set, and a load reached with a non-empty set is a hazard. Loops are handled by the fixed point: a
   store at the end of one iteration reaches a load at the start of the next through the back edge.

A ``call`` of a function of the same PTX (a ``@triton.jit(noinline=True)`` helper) counts, at the call,
as a load of every buffer whose address it passes to a parameter the function loads from, and as a
store of every buffer passed to a parameter it stores to (the function's body is analysed the same
way, with its own parameters); the function's accesses are not ordered among themselves, and a
function that calls another is refused (``ValueError``).

The analysis is conservative: stores and loads are matched by the argument they derive from, not by
their addresses (two regions of one buffer that are never read after the other's stores, such as the
``h`` and ``g`` slots of a scratch, need their own arguments), and a predicated barrier does not
count. ``write_after_read=True`` also asks for a barrier between every load and a later store of the
same buffer (a slot overwritten while other threads may still read it); that is off by default,
because a scratch double-buffered inside one argument legitimately writes one half while the other
is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", re.S)
_FUNC = re.compile(r"^\.func\s+(?:\([^)]*\)\s*)?([\w$]+)\s*\(([^)]*)\)[^;{]*?(?=\n\{)", re.S | re.M)
_CALL = re.compile(r"([\w$]+)\s*,\s*\(([^)]*)\)\s*$")
_PARAM = re.compile(r"\.param\s+\.(\w+)(\s+\.ptr)?[^,]*?\s([\w$]+_param_(\d+))\s*$")
_LABEL = re.compile(r"^([\w$]+):")
_LOC = re.compile(r"^\.loc\s+(\d+)\s+(\d+)\s+\d+(?:.*inlined_at\s+(\d+)\s+(\d+)\s+\d+)?")
_FILE = re.compile(r'^\.file\s+(\d+)\s+"([^"]*)"')
_REQNTID = re.compile(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_GUARD = re.compile(r"^@(!?)(%[\w]+)\s+")
_REG = re.compile(r"%[A-Za-z_][\w]*")
_ADDR = re.compile(r"\[\s*([^\]]+?)\s*\]")


@dataclass(frozen=True)
class Access:
    """One global memory instruction of a round-trip buffer: its index, text and source location."""

    index: int
    text: str
    where: str


@dataclass(frozen=True)
class Hazard:
    """An access to ``buffer`` that an earlier access of the other kind may precede with no CTA
    barrier in between: a load after stores (``read after write``) or a store after loads
    (``write after read``)."""

    kernel: str
    buffer: str  # the parameter's name (or ``param_<i>``)
    kind: str  # "read after write" or "write after read"
    access: Access
    earlier: tuple[Access, ...]

    def __str__(self) -> str:
        what = "load" if self.kind == "read after write" else "store"
        other = "store" if what == "load" else "load"
        wheres = sorted({a.where for a in self.earlier})
        return (f"{self.kernel}: {self.buffer}: the {what} at {self.access.where} may follow a {other} at "
                f"{', '.join(wheres)} with no bar.sync in between ({self.kind}; `{self.access.text}` after "
                f"`{self.earlier[0].text}`)")


def summarize(hazards: list[Hazard]) -> list[str]:
    """One line per (kernel, buffer, kind, source line of the access, source lines of the earlier
    accesses): a vectorised tile access is many PTX instructions with the same location."""
    groups: dict[tuple, list[Hazard]] = {}
    for h in hazards:
        key = (h.kernel, h.buffer, h.kind, h.access.where, tuple(sorted({a.where for a in h.earlier})))
        groups.setdefault(key, []).append(h)
    lines = []
    for hs in groups.values():
        n = len(hs)
        lines.append(str(hs[0]) + (f" [{n} PTX instructions]" if n > 1 else ""))
    return lines


@dataclass
class _Insn:
    opcode: str
    operands: str
    guarded: bool
    text: str
    where: str


_BLOCK_OPEN = re.compile(r"^\{\s*(?=[.@A-Za-z_])")


def _split_statements(line: str) -> list[str]:
    """PTX statements of one line (inline asm may put several on a line, inside a ``{ ... }`` block)."""
    out = []
    for stmt in line.split("//", 1)[0].split(";"):
        stmt = _BLOCK_OPEN.sub("", stmt.strip()).strip()
        if stmt and stmt != "}" and stmt != "{":
            out.append(stmt.removeprefix("}").strip())
    return [s for s in out if s]


def _params(text: str) -> list[tuple[int, str, bool]]:
    params = []
    for part in text.split(","):
        pm = _PARAM.search(part.strip())
        if pm:
            params.append((int(pm.group(4)), pm.group(1), bool(pm.group(2))))
    return params


def parse_kernel(
    ptx: str,
) -> tuple[str, list[tuple[int, str, bool]], list[_Insn], dict[str, int], int | None]:
    """The entry's name, its parameters (index, PTX type, is a pointer), its instructions in order,
    the label -> instruction index map, and the CTA size from ``.reqntid`` (None when not declared)."""
    m = _ENTRY.search(ptx)
    if not m:
        raise ValueError("no .entry in the PTX")
    rest = ptx[m.end():]
    r = _REQNTID.search(rest.split("{", 1)[0])
    threads = None
    if r:
        threads = 1
        for g in r.groups():
            threads *= int(g) if g else 1
    insns, labels = _parse_body(ptx, rest)
    return m.group(1), _params(m.group(2)), insns, labels, threads


def parse_functions(ptx: str) -> dict[str, tuple[list[tuple[int, str, bool]], list[_Insn], dict[str, int]]]:
    """The functions defined in the PTX besides the entry (``.func`` with a body): name -> (parameters,
    instructions, labels)."""
    out = {}
    for m in _FUNC.finditer(ptx):
        insns, labels = _parse_body(ptx, ptx[m.end():])
        out[m.group(1)] = (_params(m.group(2)), insns, labels)
    return out


def _parse_body(ptx: str, rest: str) -> tuple[list[_Insn], dict[str, int]]:
    """The instructions and labels of the function body that ``rest`` starts with (up to its closing
    brace, a line of its own)."""
    files = {int(f.group(1)): PurePath(f.group(2)).name
             for f in map(_FILE.match, (s.strip() for s in ptx.splitlines())) if f}
    insns: list[_Insn] = []
    labels: dict[str, int] = {}
    where = "?"
    opened = False
    for raw in rest.splitlines():
        if raw.rstrip() == "{":
            opened = True
        elif raw.rstrip() == "}" and opened:
            break
        line = raw.strip()
        if not line:
            continue
        if line.startswith(".loc"):
            lm = _LOC.match(line)
            if lm:
                where = f"{files.get(int(lm.group(1)), lm.group(1))}:{lm.group(2)}"
                if lm.group(3):
                    where += f" (inlined at {files.get(int(lm.group(3)), lm.group(3))}:{lm.group(4)})"
            continue
        lm = _LABEL.match(line)
        if lm:
            labels[lm.group(1)] = len(insns)
            line = line[lm.end():].strip()
        for stmt in _split_statements(line):
            lm = _LABEL.match(stmt)  # a label inside an inline-asm block
            if lm:
                labels[lm.group(1)] = len(insns)
                stmt = stmt[lm.end():].strip()
            if not stmt or stmt.startswith("."):  # directives: .reg, .loc inside asm, .pragma, ...
                continue
            gm = _GUARD.match(stmt)
            guarded = bool(gm)
            if gm:
                stmt = stmt[gm.end():]
            parts = stmt.split(None, 1)
            insns.append(_Insn(parts[0], parts[1] if len(parts) > 1 else "", guarded, stmt, where))
    return insns, labels


def _is_load(op: str) -> bool:
    return (op.startswith("ld.") and not op.startswith(("ld.param", "ld.shared", "ld.local", "ld.const")) or
            op.startswith("cp.async.") and ".global" in op and not op.startswith("cp.async.bulk"))


def _is_store(op: str) -> bool:
    return op.startswith(("st.", "red.")) and not op.startswith(("st.shared", "st.local", "st.param"))


def _is_atomic(op: str) -> bool:
    return op.startswith("atom.") and not op.startswith("atom.shared")


def _global_address(insn: _Insn) -> str | None:
    """The register holding the global address of a memory instruction, or None."""
    addrs = _ADDR.findall(insn.operands)
    if not addrs:
        return None
    # cp.async.*.shared.global [smem], [global], ...: the second bracket is the global one
    addr = addrs[1] if insn.opcode.startswith("cp.async") and len(addrs) > 1 else addrs[0]
    reg = _REG.match(addr.split("+")[0].strip())
    return reg.group(0) if reg else addr.split("+")[0].strip()


_BARRIERS = ("bar.sync", "barrier.sync", "bar.red", "barrier.red", "bar.cta.sync", "barrier.cta.sync",
             "bar.cta.red", "barrier.cta.red")


def _is_barrier(insn: _Insn, threads: int | None) -> bool:
    """A barrier that every thread of the CTA waits at (bar.sync 0; barrier.sync 0; bar.red...)."""
    op = insn.opcode
    if insn.guarded or not (op.startswith(_BARRIERS) or op in ("bar", "barrier")):
        return False
    args = [a.strip() for a in insn.operands.split(",")]
    if ".red" in op:  # d, barrier, [thread count], predicate
        count = args[2] if len(args) == 4 else None
    else:  # barrier, [thread count]
        count = args[1] if len(args) > 1 else None
    if count is None:
        return True
    return threads is not None and count.isdigit() and int(count) == threads


def _derived(insns: list[_Insn], params: list[tuple[int, str, bool]], kernel: str) -> dict[str, set[int]]:
    """Register -> the pointer parameters its value is derived from (flow-insensitive, to a fixed point)."""
    ptr = {f"{kernel}_param_{i}": i for i, _, is_ptr in params if is_ptr}
    taint: dict[str, set[int]] = {}
    changed = True
    while changed:
        changed = False
        for insn in insns:
            op = insn.opcode
            if op.startswith(("st.", "red.", "bra", "bar", "barrier", "cp.", "wgmma", "mma", "setp", "ret",
                                               "exit", "fence", "membar", "call", "prefetch")):
                continue
            regs = _REG.findall(insn.operands)
            if not regs:
                continue
            dest, sources = regs[0], regs[1:]
            if op.startswith("ld.param"):
                a = _ADDR.findall(insn.operands)
                srcs = {ptr[a[0].split("+")[0].strip()]} if a and a[0].split("+")[0].strip() in ptr else set()
            elif op.startswith(("ld", "atom", "ldmatrix", "shfl", "vote", "tex", "suld")):
                continue  # loaded data is not an address
            else:
                srcs = set().union(*(taint.get(s, set()) for s in sources)) if sources else set()
            if srcs and not srcs <= taint.get(dest, set()):
                taint.setdefault(dest, set()).update(srcs)
                changed = True
    return taint


def _successors(insns: list[_Insn], labels: dict[str, int]) -> list[list[int]]:
    succ: list[list[int]] = []
    for i, insn in enumerate(insns):
        out: list[int] = []
        op = insn.opcode
        if op.startswith("bra") or op.startswith("brx"):
            target = insn.operands.split(",")[0].strip()
            if target in labels:
                out.append(labels[target])
            if (insn.guarded or target not in labels) and i + 1 < len(insns):
                out.append(i + 1)  # not taken; or a target not found: fall through rather than lose code
        elif op in ("ret", "exit") or op.startswith(("ret.", "exit.", "trap")):
            if insn.guarded and i + 1 < len(insns):
                out.append(i + 1)
        elif i + 1 < len(insns):
            out.append(i + 1)
        succ.append(out)
    return succ


def round_trip_hazards(
    ptx: str, names: list[str] | None = None, *, write_after_read: bool = False
) -> tuple[list[str], list[Hazard]]:
    """The round-trip buffers of the kernel in ``ptx`` and the loads of them that a store may precede
    without a CTA barrier in between (module docstring); with ``write_after_read`` also the stores that
    a load may precede so. ``names``: the kernel's non-constexpr argument names in order (PTX
    parameter i is ``names[i]``); parameters past them are the compiler's own (Triton's global and
    profile scratch)."""
    kernel, params, insns, labels, threads = parse_kernel(ptx)
    taint = _derived(insns, params, kernel)
    functions = parse_functions(ptx)

    def pname(i: int) -> str:
        return names[i] if names is not None and i < len(names) else f"param_{i}"

    loads: dict[int, list[int]] = {}
    stores: dict[int, list[int]] = {}
    for k, insn in enumerate(insns):
        op = insn.opcode
        if op.startswith("call"):
            for p, kinds in _call_accesses(insns, k, taint, functions).items():
                for kind in kinds:
                    (loads if kind == "load" else stores).setdefault(p, []).append(k)
            continue
        is_load, is_store = _is_load(op), _is_store(op)
        if _is_atomic(op):
            is_load = is_store = True
        if not (is_load or is_store):
            continue
        reg = _global_address(insn)
        for p in taint.get(reg, set()) if reg else set():
            if is_load:
                loads.setdefault(p, []).append(k)
            if is_store:
                stores.setdefault(p, []).append(k)
    buffers = sorted(p for p in loads if p in stores)
    succ = _successors(insns, labels)
    barrier = [_is_barrier(insn, threads) for insn in insns]
    hazards: list[Hazard] = []
    for p in buffers:
        pairs = [("read after write", stores[p], loads[p])]
        if write_after_read:
            pairs.append(("write after read", loads[p], stores[p]))
        for kind, first, second in pairs:
            reaching = _unordered(set(first), succ, barrier)
            for k in second:
                earlier = reaching[k] - {k}  # an atomic is both a load and a store; not a race with itself
                if earlier:
                    before = tuple(Access(e, insns[e].text, insns[e].where) for e in sorted(earlier))
                    access = Access(k, insns[k].text, insns[k].where)
                    hazards.append(Hazard(kernel, pname(p), kind, access, before))
    return [pname(p) for p in buffers], hazards


def _function_accesses(name: str, functions: dict) -> dict[int, set[str]]:
    """Parameter index -> {"load", "store"}: what a function of the PTX does through each pointer it is
    passed (module docstring)."""
    fparams, finsns, _ = functions[name]
    if any(i.opcode.startswith("call") for i in finsns):
        raise ValueError(f"{name}: a function that calls another is not followed by the ordering check")
    # a function's pointer parameters are plain .b64 (no .ptr qualifier): each one may be an address
    ftaint = _derived(finsns, [(i, t, True) for i, t, _ in fparams], name)
    out: dict[int, set[str]] = {}
    for insn in finsns:
        op = insn.opcode
        is_load, is_store = _is_load(op) or _is_atomic(op), _is_store(op) or _is_atomic(op)
        reg = _global_address(insn) if is_load or is_store else None
        for p in ftaint.get(reg, set()) if reg else set():
            if is_load:
                out.setdefault(p, set()).add("load")
            if is_store:
                out.setdefault(p, set()).add("store")
    return out


def _call_accesses(insns: list[_Insn], k: int, taint: dict[str, set[int]], functions: dict) -> dict[int, set[str]]:
    """Kernel parameter -> {"load", "store"}: the accesses the call at ``k`` makes through the buffers
    it is passed (the registers stored to its argument slots just before it)."""
    m = _CALL.search(insns[k].operands)
    if not m or m.group(1) not in functions:
        raise ValueError(f"a call the ordering check cannot follow: `{insns[k].text}`")
    args = [a.strip() for a in m.group(2).split(",")]
    stored: dict[str, str] = {}
    for j in range(k - 1, -1, -1):  # the argument slots' st.param, back to the call sequence's start
        if not insns[j].opcode.startswith("st.param"):
            break
        slot = _ADDR.findall(insns[j].operands)
        regs = _REG.findall(insns[j].operands)
        if slot and regs:
            stored[slot[0].strip()] = regs[-1]
    out: dict[int, set[str]] = {}
    for i, kinds in _function_accesses(m.group(1), functions).items():
        reg = stored.get(args[i]) if i < len(args) else None
        for p in taint.get(reg, set()) if reg else set():
            out.setdefault(p, set()).update(kinds)
    return out


def _unordered(first: set[int], succ: list[list[int]], barrier: list[bool]) -> list[frozenset[int]]:
    """Per instruction, the instructions of ``first`` that may have executed since the last CTA barrier
    on some path to it (a forward may-analysis to a fixed point, loop back edges included)."""
    state: list[frozenset[int]] = [frozenset()] * len(succ)
    reached = [False] * len(succ)
    reached[0] = True
    work = [0]
    while work:
        k = work.pop()
        out = frozenset() if barrier[k] else (state[k] | {k} if k in first else state[k])
        for j in succ[k]:
            if not reached[j] or not out <= state[j]:
                reached[j] = True
                state[j] = state[j] | out
                work.append(j)
    return state


def compiled_hazards(compiled, *, write_after_read: bool = False) -> tuple[list[str], list[Hazard]]:
    """:func:`round_trip_hazards` of a ``compiled.Compiled`` variant, its buffers named by the
    variant's signature (its non-constexpr arguments are the PTX parameters, in order)."""
    if not compiled.ptx:
        raise ValueError(f"{compiled.variant.name}: no PTX kept for this variant")
    names = [n for n, t in compiled.variant.signature if t != "constexpr"]
    return round_trip_hazards(compiled.ptx, names, write_after_read=write_after_read)
