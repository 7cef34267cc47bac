"""What a SASS listing says beyond its opcodes: control codes (stalls, scoreboards) and memory traffic.

Control codes. Since Volta every SASS instruction is 128 bits, and the top bits of the word carry the
scheduling information ptxas computed for it (``nvdisasm -hex`` prints the two 64-bit halves; the
second is the high one). The 21 bits from bit 105 (bit 41 of the high half) are, from the lowest:

    stall (4) | yield (1) | write barrier (3) | read barrier (3) | wait mask (6) | reuse (4)

* stall: cycles the warp scheduler waits before it issues this warp's next instruction (the fixed
  latency ptxas knows, e.g. 4-5 between dependent FFMAs);
* yield: 0 lets the scheduler switch to another warp after this instruction;
* write / read barrier: the scoreboard (0-5, 7 = none) this variable-latency instruction (a load, MUFU,
  S2R, ...) releases when its result is written / its source registers are read;
* wait mask: the scoreboards this instruction waits on before it issues.

The layout is documented by Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
Microbenchmarking" (arXiv 1804.06826) and "... Turing ..." (arXiv 1903.07486), and decoded the same way
by cloudcores/CuAssembler (``CuAsm/common.py``, ``decodeCtrlCodes``) and NervanaSystems/maxas (wiki
"Control-Codes", Maxwell's form of the same fields). ``tests/test_kernel_report.py`` checks the
decoding on a compiled dependent FFMA chain.

From these the per-warp floors of :func:`latency_floor`: the sum of the stall counts weighted by loop
trips (the fixed-latency chain of one warp: it cannot finish sooner), and the exposed variable latency
where the code waits on a scoreboard (or a ``DEPBAR``) whose producer is a global load issued fewer
cycles before than an L2 hit takes, or waits for its own wgmma group (``WARPGROUP.DEPBAR``).

Memory traffic. :func:`memory_op` classifies every global memory instruction: loads (``LDG``) allocate
in L1 unless they are ``.STRONG`` (volatile / .cg); ``LDGSTS`` (cp.async) with ``.BYPASS`` is
``cp.async.cg`` and skips L1, without it ``cp.async.ca``; stores, reductions and atomics go to L2;
``LDL``/``STL`` are local memory (spills); TMA (``UTMALDG``/``UTMASTG``) moves a box whose size the
listing does not show. Bytes per execution are the vector width times 32 lanes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

WARP = 32
NO_BARRIER = 7


@dataclass(frozen=True)
class Control:
    """The scheduling fields of one instruction (module docstring)."""

    stall: int
    yield_: bool  # True: the scheduler may switch warps after it (the encoded bit is 0)
    write_barrier: int  # 0-5, or 7 (none)
    read_barrier: int
    wait_mask: int  # bit b: waits on scoreboard b
    reuse: int

    @classmethod
    def decode(cls, high: int) -> "Control":
        c = high >> 41
        return cls(c & 0xF, not (c >> 4) & 1, (c >> 5) & 7, (c >> 8) & 7, (c >> 11) & 0x3F, (c >> 17) & 0xF)

    def waits_on(self) -> list[int]:
        return [b for b in range(6) if self.wait_mask >> b & 1]


# ------------------------------------------------------------------------------------ memory traffic


@dataclass(frozen=True)
class MemoryOp:
    kind: str  # "load", "store", "atomic", "local", "tma"
    bytes_per_lane: int
    l1: bool  # a load that allocates in L1 (its re-reads can hit there)
    space: str = "global"


_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def _lane_bytes(parts: Sequence[str]) -> int:
    for p in parts:
        if p in _WIDTH:
            return _WIDTH[p]
    return 4


def memory_op(opcode: str) -> MemoryOp | None:
    """The global (or local) memory traffic of one SASS opcode, or None when it has none."""
    parts = opcode.split(".")
    fam = parts[0]
    if fam == "LDG":
        return MemoryOp("load", _lane_bytes(parts), "STRONG" not in parts)
    if fam == "LDGSTS":
        return MemoryOp("load", _lane_bytes(parts), "BYPASS" not in parts)
    if fam in ("STG",):
        return MemoryOp("store", _lane_bytes(parts), False)
    if fam in ("RED", "REDG", "ATOMG", "ATOM"):
        return MemoryOp("atomic", _lane_bytes(parts), False)
    if fam in ("LDL", "STL"):
        return MemoryOp("local", _lane_bytes(parts), True, "local")
    if fam in ("UTMALDG", "UTMASTG", "UBLKCP", "UTMAPF"):
        return MemoryOp("tma", 0, False)
    return None


def _is_global_load(opcode: str) -> bool:
    fam = opcode.split(".")[0]
    return fam in ("LDG", "LD", "ATOMG", "ATOM", "LDL")


def _is_shared_load(opcode: str) -> bool:
    return opcode.split(".")[0] in ("LDS", "LDSM", "ATOMS", "LDSM")


# ------------------------------------------------------------------------------- latency per warp


_DEPBAR = re.compile(r"\bDEPBAR\.LE SB(\d), (0x[0-9a-f]+|\d+)")
_WG_DEPBAR = re.compile(r"\bWARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+|\d+)")
_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\b")


@dataclass
class LatencyFloor:
    """Per-warp cycles of one listing weighted by loop trips (:func:`latency_floor`)."""

    stall_cycles: float  # sum of max(1, stall) over the executed instructions: the fixed-latency chain
    l2_waits: int  # weighted waits on a global load issued less than an L2 hit before
    wait_cycles: dict[str, float]  # "low"/"high": exposed variable latency (L2 and L1 waits, wgmma groups)
    # the same when L1-allocating global loads hit L1 (their declared working set stays there)
    wait_cycles_l1_hit: dict[str, float]
    wgmma_wait_cycles: dict[str, float]  # the part of wait_cycles spent waiting on the warp's wgmma group
    barriers: int  # weighted BAR.SYNC executions

    def to_json(self) -> dict:
        return dict(
            stall_cycles=self.stall_cycles,
            l2_waits=self.l2_waits,
            wait_cycles=self.wait_cycles,
            wait_cycles_l1_hit=self.wait_cycles_l1_hit,
            wgmma_wait_cycles=self.wgmma_wait_cycles,
            barriers=self.barriers,
        )


def _walk_back(i: int, loops: dict[int, tuple[int, int]], limit: float, stall: Sequence[int]):
    """Instruction indices before ``i`` in execution order, each with the stall cycles from it to ``i``:
    inside a loop, the loop's body backwards from ``i`` and then (the previous trip) from the loop's end
    back to ``i`` itself; outside loops, the listing backwards. Stops after ``limit`` cycles. A producer
    before the loop (met only on the first trip) is not searched for: the floor stays a floor."""
    if i in loops:
        start, end = loops[i]
        order = [*range(i - 1, start - 1, -1), *range(end, i - 1, -1)]
    else:
        order = range(i - 1, -1, -1)
    d = 0.0
    for j in order:
        d += max(1, stall[j])
        yield j, d
        if d >= limit:
            return


def innermost_loops(n: int, sass_loops) -> dict[int, tuple[int, int]]:
    """Instruction index -> (start, end) of the innermost SASS loop around it."""
    out: dict[int, tuple[int, int]] = {}

    def mark(lps):
        for lp in lps:
            for k in range(lp.start, lp.end + 1):
                out[k] = (lp.start, lp.end)
            mark(lp.children)

    mark(sass_loops)
    return out


def latency_floor(
    insns: Sequence,
    controls: Sequence[Control],
    weights: Sequence[float],
    sass_loops,
    *,
    l2_latency: dict[str, float],
    l1_latency: dict[str, float],
    wgmma_macs_per_cycle: dict[str, float],
    num_warps: int,
) -> LatencyFloor:
    """The per-warp fixed-latency chain and exposed waits of a listing (module docstring).

    ``weights``: executions of each instruction per warp (loop trips); ``l2_latency`` / ``l1_latency``:
    cycles of a load that hits L2 / L1 (or shared memory) at each end; ``wgmma_macs_per_cycle``: one
    SM's tensor MACs per cycle at each end (a warpgroup waiting for its own HGMMA group waits at least
    for those MACs at the whole SM's rate).

    A wait is exposed by the latency minus the cycles that passed since its producer issued. Those
    cycles are counted along the listing with the waits already exposed on the way (loads issued
    together and waited on one after another overlap: only the first wait is long); for a producer in
    the previous trip of the loop, by the stall cycles around the loop. A loop between a producer and
    its consumer counts one trip."""
    n = len(insns)
    stall = [c.stall for c in controls]
    loops = innermost_loops(n, sass_loops)
    chain = sum(w * max(1, s) for w, s in zip(weights, stall))
    limit = max(l2_latency.values())
    warpgroups = max(1, num_warps // 4)
    # what each instruction waits on: (kind, producer index, stall cycles if the producer is in the
    # previous trip else None, MACs for a wgmma group)
    sources: list[list[tuple]] = [[] for _ in range(n)]
    barriers = 0
    for i, (ins, ctl, w) in enumerate(zip(insns, controls, weights)):
        if not w:
            continue
        fam = ins.family
        if fam == "BAR":
            barriers += w
        for b in ctl.waits_on():
            for j, d in _walk_back(i, loops, limit, stall):
                if controls[j].wait_mask >> b & 1:
                    break  # an earlier instruction already waited for this scoreboard
                if controls[j].write_barrier == b:
                    op = insns[j].opcode
                    mem = memory_op(op)
                    if _is_global_load(op):
                        kind = "global_l1" if mem is not None and mem.l1 else "global"
                    elif _is_shared_load(op):
                        kind = "shared"
                    else:
                        break  # MUFU, S2R, ...: their latency is left to the stall counts
                    sources[i].append((kind, j, d if j >= i else None, 0))
                    break
        m = _DEPBAR.search(ins.text) if fam == "DEPBAR" else None
        if m:  # cp.async groups: DEPBAR.LE SBb, N waits until at most N committed groups are outstanding
            left = int(m.group(2), 0) + 1
            for j, d in _walk_back(i, loops, limit, stall):
                if insns[j].family == "LDGDEPBAR":
                    left -= 1
                    if left == 0:
                        sources[i].append(("global", j, d if j >= i else None, 0))
                        break
        m = _WG_DEPBAR.search(ins.text) if fam == "WARPGROUP" else None
        if m and int(m.group(1), 0) == 0:  # a warpgroup waiting for its own wgmma group
            macs, first = 0, None
            for j in range(i - 1, -1, -1):
                op = insns[j].opcode
                if op.startswith("WARPGROUP.DEPBAR") or insns[j].family == "BAR":
                    break
                if hm := _HGMMA.match(op):
                    macs += int(hm.group(1)) * int(hm.group(2)) * int(hm.group(3))
                    first = j
            if first is not None:
                sources[i].append(("wgmma", first, None, macs))

    def run(end: str, l1_hit: bool) -> tuple[float, float, int]:
        lat = {
            "global": l2_latency[end],
            "shared": l1_latency[end],
            "global_l1": (l1_latency if l1_hit else l2_latency)[end],
        }
        t = [0.0] * (n + 1)
        total = wg = 0.0
        exposed_loads = 0
        for i in range(n):
            e = 0.0
            for kind, j, d, macs in sources[i]:
                elapsed = d if d is not None else t[i] - t[j]
                if kind == "wgmma":
                    # the warpgroups of a program share the SM's tensor cores
                    x = macs * warpgroups / wgmma_macs_per_cycle[end] - elapsed
                    if x > 0:
                        wg += weights[i] * x
                else:
                    x = lat[kind] - elapsed
                    if x > 0 and kind.startswith("global"):
                        exposed_loads += weights[i]
                e = max(e, x)
            total += weights[i] * e
            t[i + 1] = t[i] + e + max(1, stall[i])
        return total, wg, exposed_loads

    waits, waits_hit, wgmma = {}, {}, {}
    l2_waits = 0
    for end in ("low", "high"):
        waits[end], wgmma[end], count = run(end, False)
        waits_hit[end] = run(end, True)[0]
        if end == "low":
            l2_waits = count
    return LatencyFloor(chain, int(l2_waits), waits, waits_hit, wgmma, int(barriers))


@dataclass
class Traffic:
    """Bytes one program moves between the SM and L2/L1, from its weighted memory instructions."""

    load_l1: float = 0.0  # L1-allocating loads (LDG, cp.async.ca), bytes requested
    load_bypass: float = 0.0  # loads that skip L1 (cp.async.cg, .STRONG): all to L2
    store: float = 0.0  # stores, to L2
    atomic: float = 0.0
    local: float = 0.0  # spill traffic (through L1)
    tma_instructions: float = 0.0  # executions of TMA copies (bytes not in the listing)
    # shared-memory wavefronts (128 bytes each) of LDS/STS/LDSM/STSM and of cp.async's writes to shared
    # memory (LDGSTS): as if conflict-free, and the extra of the stores and of the ldmatrix reads at the
    # conflict factors given (launches.store_conflict: per width, that of the variant's largest register
    # -> shared copy; launches.ldsm_conflict: that of its ldmatrix reads; analysis.shared)
    shared_wavefronts: float = 0.0
    shared_conflict_wavefronts: float = 0.0
    # the L1 data pipe's wavefronts of global and local accesses: one per 128 bytes a warp requests
    global_wavefronts: float = 0.0

    @property
    def lsu_wavefronts(self) -> float:
        """Wavefronts per program through the L1/shared data pipe (one per cycle per SM): shared
        accesses with their conflicts, and global and local accesses."""
        return self.shared_wavefronts + self.shared_conflict_wavefronts + self.global_wavefronts

    def to_json(self) -> dict:
        return dict(self.__dict__, lsu_wavefronts=self.lsu_wavefronts)


def shared_wavefronts(opcode: str) -> int:
    """Wavefronts of one warp's shared-memory instruction without bank conflicts (0: not one): LDS/STS move
    32 lanes x their width, 128 bytes per wavefront; LDSM/STSM one wavefront per 8x8 matrix (.1/.2/.4)."""
    parts = opcode.split(".")
    if parts[0] in ("LDSM", "STSM"):  # LDSM.16.M88.4: four 8x8 matrices
        return int(parts[-1]) if parts[-1] in ("1", "2", "4") else 1
    if parts[0] in ("LDS", "STS"):
        return max(1, WARP * _lane_bytes(parts) // 128)
    return 0


def traffic(
    insns: Sequence, weights: Sequence[float], num_warps: int,
    store_conflict: dict[int, float] | None = None, ldsm_conflict: float = 1.0,
) -> Traffic:
    """Per-program bytes of each class: executions per warp x bytes per lane x 32 lanes x warps; shared
    wavefronts per program, STS taking ``store_conflict[width in bytes]`` times theirs (a width not given
    stores conflict-free) and LDSM ``ldsm_conflict`` times theirs (the extra in
    ``shared_conflict_wavefronts``); global and local accesses' data-pipe wavefronts, one per 128 bytes
    of a warp's request."""
    store_conflict = store_conflict or {}
    t = Traffic()
    for ins, w in zip(insns, weights):
        if not w:
            continue
        sw = shared_wavefronts(ins.opcode)
        if sw:
            t.shared_wavefronts += w * sw * num_warps
            if ins.opcode.startswith("STS") and not ins.opcode.startswith("STSM"):
                f = store_conflict.get(_lane_bytes(ins.opcode.split(".")), 1.0)
                t.shared_conflict_wavefronts += w * sw * num_warps * (f - 1)
            elif ins.opcode.startswith("LDSM"):
                t.shared_conflict_wavefronts += w * sw * num_warps * (ldsm_conflict - 1)
            continue
        op = memory_op(ins.opcode)
        if op is None:
            continue
        lane_wf = max(1, WARP * op.bytes_per_lane // 128)
        if ins.opcode.startswith("LDGSTS"):  # cp.async: a global load whose data the LSU writes to shared
            t.shared_wavefronts += w * lane_wf * num_warps  # (Nsight Compute counts them there, once)
        elif op.kind != "tma":
            t.global_wavefronts += w * lane_wf * num_warps
        b = w * op.bytes_per_lane * WARP * num_warps
        if op.kind == "load":
            if op.l1:
                t.load_l1 += b
            else:
                t.load_bypass += b
        elif op.kind == "store":
            t.store += b
        elif op.kind == "atomic":
            t.atomic += b
        elif op.kind == "local":
            t.local += b
        else:
            t.tma_instructions += w * num_warps
    return t
