"""What a launcher declares about each launch, for the static cost report (``convfirstnet kernels``).

Every launcher launches through :func:`convfirstnet.kernels._launch.launch` and passes
``cost=lambda: KernelCost(...)`` computed from the very values it launches with (tile sizes, grid,
trip counts). The lambda runs only inside :func:`recording`, so ordinary launches pay nothing, and
the report reads the declarations instead of re-typing them: the report cannot drift from the code.

Counting rules (one launch, whole grid):

* ``useful_macs``: the multiply-accumulates of the block's math that this launch performs, counted
  as the paper counts them (grouped conv 72 per output element at the resolution it runs, 1x1 layers
  C_in x C_out per pixel, SE and BlurPool included where the launch does them). The launches of one
  block sum to the block's ``count_macs``.
* ``mma_macs``: tensor-core MACs as issued: every ``tl.dot`` as M x N x K of its tile shapes
  (padding, block-diagonal zeros, halo rows and recompute included) times its trips and programs.
* ``dram_bytes``: the DRAM traffic the design cannot avoid: inputs read once, outputs written once,
  weights once per launch, and any intermediate the design writes to and reads back from global
  memory (counted in full unless it is per-program scratch declared in ``l2_bytes``).
* ``loops``: the runtime loops of one program, outermost first and in program order, with their
  trip counts; the report matches them against the loops it finds in the compiled SASS (backward
  branches) and weights each instruction by the trips of the loops around it.
  Mark a loop ``fixed`` when the compiler cannot see its bound, so that a one-trip loop is not read as
  unrolled away.
* ``l2_bytes``: traffic to per-program scratch that is re-read by the same program shortly after it
  is written (it stays in L1/L2), and reads of an intermediate the previous launch wrote just before
  (its write is counted in that launch's ``dram_bytes``); ``scratch_bytes_per_program`` and
  ``l2_footprint_bytes`` (the intermediate's size) are their footprint, which the report checks
  against the L2 capacity before believing it.
* ``l1_unique_bytes_per_program``: the bytes one program's L1-allocating loads (``LDG``,
  ``cp.async.ca``) fetch from L2 when their re-reads hit L1 (e.g. a tile's halo window read once for
  nine taps; a persistent program's scratch slot once per image), and ``l1_working_set_bytes`` what
  must stay in L1 at one time for that (default: the unique bytes). The report counts the L2 traffic
  of those loads as the unique bytes when the working set fits in the L1 that the resident programs'
  shared memory leaves, and as every requested byte otherwise (or when nothing is declared).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class Loop:
    """A runtime loop of one program: iterations per entry, and the loops nested in its body. ``fixed``:
    its bound is a value the compiler cannot see, so the loop is in the compiled code even at one trip
    (the cost report never takes it as unrolled away)."""

    name: str
    trips: int
    body: tuple["Loop", ...] = ()
    fixed: bool = False


@dataclass(frozen=True)
class KernelCost:
    """The declaration of one launch (see the module docstring for the counting rules)."""

    useful_macs: int
    mma_macs: int
    dram_bytes: int
    loops: tuple[Loop, ...] = ()
    l2_bytes: int = 0
    scratch_bytes_per_program: int = 0
    l2_footprint_bytes: int = 0
    l1_unique_bytes_per_program: int = 0
    l1_working_set_bytes: int = 0
    note: str = ""


@dataclass
class Launch:
    """One recorded launch: the JIT function, its grid and arguments exactly as the launcher passed them."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    meta: dict  # constexprs and launch options (num_warps, num_stages)
    cost: KernelCost | None
    block: str | None  # label of the block being recorded (set by the caller of ``recording``)
    # argument positions that held one tensor object (the recorded args are copies of their own):
    # torch.compile keeps only one parameter's writes of such a tensor
    # (tests/kernels/test_compiled_launches.py)
    shared: tuple[tuple[int, ...], ...] = ()


@dataclass
class Recording:
    launches: list[Launch] = field(default_factory=list)
    block: str | None = None  # the caller sets this around each block's forward
    # the GPU the launches are sized for (meta tensors carry no device properties); None: the
    # launchers' defaults (an H100)
    sms: int | None = None
    l2_bytes: int | None = None
    shared_per_block: int | None = None  # bytes of shared memory one program may use (opt-in maximum)
    arch: int | None = None  # compute capability as 10 major + minor (90: Hopper)

    def add(self, kernel: Any, grid: tuple, args: tuple, meta: dict, cost: Callable[[], KernelCost] | None):
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        positions: dict[int, list[int]] = {}
        for i, a in enumerate(args):
            if hasattr(a, "untyped_storage"):  # a tensor
                positions.setdefault(id(a), []).append(i)
        shared = tuple(tuple(p) for p in positions.values() if len(p) > 1)
        args = tuple(_metadata_only(a) for a in args)
        self.launches.append(Launch(kernel, grid, args, dict(meta), cost() if cost else None, self.block,
                                    shared))


def _metadata_only(a: Any) -> Any:
    """A meta tensor with ``a``'s dtype, shape, strides and storage offset on a storage of its own: the
    recording keeps what binding a launch needs, not the op's tensors (a reference kept to a gradient
    would stop autograd from taking it over, and the counted step would copy it)."""
    import torch

    if not isinstance(a, torch.Tensor) or a.device.type != "meta":
        return a
    base = torch.empty(a.untyped_storage().nbytes() // a.element_size(), dtype=a.dtype, device="meta")
    return base.as_strided(a.shape, a.stride(), a.storage_offset())


_RECORDING: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("convfirstnet_recording", default=None)


def active_recording() -> Recording | None:
    import torch

    if torch.compiler.is_compiling():  # recording is eager, on meta tensors; dynamo cannot trace a ContextVar
        return None
    return _RECORDING.get()


@contextlib.contextmanager
def recording(
    *, sms: int | None = None, l2_bytes: int | None = None, shared_per_block: int | None = None,
    arch: int | None = None,
) -> Iterator[Recording]:
    """Record launches instead of running them. Inside, every op takes its Triton path whatever the
    device (meta tensors are the intended input: shapes without memory), and each ``launch`` appends
    a :class:`Launch` with its cost declaration. ``sms``, ``l2_bytes``, ``shared_per_block``, ``arch``:
    the target GPU, for launchers that size their grids, tiles or batch slices by it."""
    rec = Recording(sms=sms, l2_bytes=l2_bytes, shared_per_block=shared_per_block, arch=arch)
    token = _RECORDING.set(rec)
    try:
        yield rec
    finally:
        _RECORDING.reset(token)
