"""Bank conflicts of the stores that copy a register tile into shared memory (``ttg.local_alloc`` of a
``#ttg.blocked`` tensor into a ``#ttg.swizzled_shared`` buffer), read from the TTGIR.

Why: Nsight Compute on an H200 (``benchmarks/results/ncu/``) found half the shared-memory wavefronts of
the MBConv hidden and ConvFirst stride-1 kernels to be bank conflicts of stores, which the cost model
counted as conflict-free. The stores that Triton emits for such a copy follow from two layouts the TTGIR
names: the register layout (which elements each lane of a warp holds) and the shared one (where each
element lies, with its swizzle). This module places the first vector store of warp 0 by both and counts
the wavefronts the hardware needs for it:

- Register layout (``blocked``): lane ``l`` holds ``sizePerThread`` consecutive elements per dimension at
  coordinate ``(l's index along d) * sizePerThread[d]``, the lane index split over ``threadsPerWarp`` in
  the layout's ``order`` (fastest dimension first).
- Shared layout (``swizzled_shared``, Triton's ``SwizzledSharedEncodingAttr``): rows of the fastest
  dimension ``order[0]``, the other dimensions flattened in ``order``; the ``vec``-element group of a
  row's column index is XORed with ``(row // perPhase) % maxPhase``.
- A warp's store is served in phases of as many lanes as fill 128 bytes (8 lanes of 16-byte vectors);
  in a phase, lanes that touch different 4-byte words of the same bank take one wavefront each, so a
  phase needs max over banks of the distinct words in it.

Only ``local_alloc`` with a register source and a swizzled destination is counted (``nvmma_shared``
buffers for wgmma are written with their own swizzle, conflict-free by construction; ``convert_layout``
scratch is laid out by the compiler after the TTGIR). A figure from layouts, not a measurement.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_BLOCKED = re.compile(
    r"^#(\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
    r"warpsPerCTA = \[([\d, ]+)\], order = \[([\d, ]+)\]", re.M)
_SWIZZLED = re.compile(
    r"^#(\w+) = #ttg\.swizzled_shared<\{vec = (\d+), perPhase = (\d+), maxPhase = (\d+), "
    r"order = \[([\d, ]+)\]", re.M)
_ALLOC = re.compile(
    r"ttg\.local_alloc %\S+ : \(tensor<([\dx]+)x(f16|bf16|f32|i8|i16|i32|f8\w*), #(\w+)>\) -> "
    r"!ttg\.memdesc<[^,]+, #(\w+)")
_BITS = {"f16": 16, "bf16": 16, "f32": 32, "i8": 8, "i16": 16, "i32": 32}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(","))


@dataclass(frozen=True)
class SharedStore:
    """One ``local_alloc`` copy: its tensor, the two layouts, and the wavefronts of one warp store."""

    shape: tuple[int, ...]
    elem_bytes: int
    register: str
    shared: str
    vector_bytes: int  # bytes one lane stores per instruction
    wavefronts: int  # what the first store of warp 0 takes
    ideal: int  # without conflicts: 32 lanes x vector bytes / 128

    @property
    def conflict_factor(self) -> float:
        return self.wavefronts / self.ideal

    def to_json(self) -> dict:
        return dict(shape=list(self.shape), register=self.register, shared=self.shared,
                    vector_bytes=self.vector_bytes, wavefronts=self.wavefronts, ideal=self.ideal)


def lane_coords(lane: int, spt, tpw, order) -> list[int]:
    """The first element a lane holds (warp 0, first register) in a blocked layout."""
    coords = [0] * len(spt)
    for d in order:
        coords[d] = (lane % tpw[d]) * spt[d]
        lane //= tpw[d]
    return coords


def shared_offset(coords, shape, vec: int, per_phase: int, max_phase: int, order) -> int:
    """Element offset of ``coords`` in a swizzled shared buffer of ``shape``."""
    col_dim, row_dims = order[0], order[1:]
    row, stride = 0, 1
    for d in row_dims:
        row += coords[d] * stride
        stride *= shape[d]
    col = coords[col_dim]
    phase = (row // per_phase) % max_phase
    return row * shape[col_dim] + ((col // vec) ^ phase) * vec + col % vec


def store_wavefronts(shape, elem_bytes: int, spt, tpw, reg_order, vec: int, per_phase: int, max_phase: int,
                     sh_order) -> tuple[int, int, int]:
    """(wavefronts, ideal, vector bytes) of warp 0's first store of the copy."""
    lanes = math.prod(tpw)
    fast = reg_order[0]
    # a lane's vector: its elements along the register layout's fastest dimension, as long as they are
    # contiguous in shared memory too (same fastest dimension) and within one swizzle group
    n = min(spt[fast], vec) if fast == sh_order[0] else 1
    vbytes = max(1, n * elem_bytes)
    addrs = [shared_offset(lane_coords(lane, spt, tpw, reg_order), shape, vec, per_phase, max_phase, sh_order)
             * elem_bytes for lane in range(lanes)]
    ideal = max(1, math.ceil(lanes * vbytes / 128))
    return warp_wavefronts(addrs, vbytes), ideal, vbytes


def warp_wavefronts(addrs, vbytes: int) -> int:
    """Wavefronts of one warp access of ``vbytes`` per lane at byte addresses ``addrs`` (module
    docstring: phases of as many lanes as fill 128 bytes, each as long as its most-used bank)."""
    per_phase_lanes = max(1, 128 // vbytes)
    wavefronts = 0
    for p0 in range(0, len(addrs), per_phase_lanes):
        banks: dict[int, set[int]] = {}
        for a in addrs[p0:p0 + per_phase_lanes]:
            for w in range(a // 4, (a + vbytes - 1) // 4 + 1):
                banks.setdefault(w % 32, set()).add(w)
        wavefronts += max((len(words) for words in banks.values()), default=0)
    return wavefronts


def shared_stores(ttgir: str) -> list[SharedStore]:
    """Every distinct ``local_alloc`` copy from registers into a swizzled shared buffer in ``ttgir``."""
    blocked = {m.group(1): tuple(_ints(m.group(i)) for i in (2, 3, 4, 5)) for m in _BLOCKED.finditer(ttgir)}
    swizzled = {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4)), _ints(m.group(5)))
                for m in _SWIZZLED.finditer(ttgir)}
    out, seen = [], set()
    for m in _ALLOC.finditer(ttgir):
        shape = tuple(int(t) for t in m.group(1).split("x"))
        reg, sh = m.group(3), m.group(4)
        if reg not in blocked or sh not in swizzled or (m.group(1), reg, sh) in seen:
            continue
        seen.add((m.group(1), reg, sh))
        spt, tpw, _, reg_order = blocked[reg]
        vec, per_phase, max_phase, sh_order = swizzled[sh]
        eb = _BITS.get(m.group(2), 8) // 8
        wf, ideal, vb = store_wavefronts(shape, eb, spt, tpw, reg_order, vec, per_phase, max_phase, sh_order)
        out.append(SharedStore(shape, eb, reg, sh, vb, wf, ideal))
    return out


# ------------------------------------------------------------------ every shared access, from the PTX
# Copies that Triton lowers after the TTGIR (``convert_layout`` through shared memory) have no layout
# there to read; their addresses are in the PTX. Warp 0's integer arithmetic is run per lane (%tid.x =
# lane; parameters, loaded values and block indices 0; straight through, branches not taken: the
# addresses of a layout copy depend on the lane and on constants), and each shared access (st/ld.shared,
# ldmatrix/stmatrix: 8 lanes' 16-byte rows per 8x8 matrix) gets its wavefronts and the conflict-free count.
_INT_OPS = {
    "mov": lambda v: v[0], "cvt": lambda v: v[0], "add": lambda v: v[0] + v[1], "sub": lambda v: v[0] - v[1],
    "mul": lambda v: v[0] * v[1], "mad": lambda v: v[0] * v[1] + v[2], "and": lambda v: v[0] & v[1],
    "or": lambda v: v[0] | v[1], "xor": lambda v: v[0] ^ v[1], "shl": lambda v: v[0] << v[1],
    "shr": lambda v: v[0] >> v[1], "bfe": lambda v: (v[0] >> v[1]) & ((1 << v[2]) - 1),
    "min": lambda v: min(v[0], v[1]), "max": lambda v: max(v[0], v[1]),
}
_ADDR = re.compile(r"\[\s*(%\w+)\s*(?:\+\s*(-?\d+))?\s*\]")
_SHARED_OP = re.compile(r"^(?:(ldmatrix|stmatrix)\S*\.x(\d)|(?:st|ld)\.shared\S*?(?:\.v(\d))?\.[bfsu](\d+))")


@dataclass(frozen=True)
class SharedAccess:
    """One shared-memory instruction of a PTX listing, as warp 0 runs it."""

    line: int
    opcode: str
    wavefronts: int
    ideal: int


def _operand(text: str, regs: dict, lane: int) -> int:
    if text == "%tid.x":
        return lane
    if text.startswith("%"):
        return regs.get(text, 0)
    try:
        return int(text, 0)
    except ValueError:
        return 0  # a symbol (the shared base: 0), a float constant


def ptx_shared_accesses(ptx: str) -> list[SharedAccess]:
    """Every shared-memory access of ``ptx`` with warp 0's wavefronts (section comment above)."""
    lanes = [dict() for _ in range(32)]
    out = []
    for n, raw in enumerate(ptx.splitlines()):
        text = raw.strip().rstrip(";")
        if text.startswith("@"):
            text = text.split(None, 1)[-1]
        op, _, rest = text.partition(" ")
        args = [a.strip() for a in rest.split(",")]
        m = _SHARED_OP.match(op)
        if m and "shared" in op:
            a = _ADDR.search(rest)
            if not a:
                continue
            addrs = [(regs.get(a.group(1), 0) + int(a.group(2) or 0)) & 0xFFFFFFFF for regs in lanes]
            if m.group(1):  # ldmatrix / stmatrix: matrix i's rows from lanes 8i ... 8i + 7
                count = int(m.group(2))
                wf = sum(warp_wavefronts(addrs[8 * i:8 * i + 8], 16) for i in range(count))
                out.append(SharedAccess(n, op, wf, count))
            else:
                vbytes = int(m.group(3) or 1) * int(m.group(4)) // 8
                out.append(SharedAccess(n, op, warp_wavefronts(addrs, vbytes), max(1, 32 * vbytes // 128)))
            continue
        fn = _INT_OPS.get(op.split(".")[0])
        if fn is None or not args or not args[0].startswith("%"):
            continue
        bits = 16 if re.search(r"\.[bsu]16\b", op) else 64 if re.search(r"\.[bsu]64\b|\.wide\.", op) else 32
        for lane, regs in enumerate(lanes):
            try:
                v = fn([_operand(x, regs, lane) for x in args[1:]])
            except (IndexError, ValueError):
                v = 0
            regs[args[0]] = v & ((1 << bits) - 1)
    return out
