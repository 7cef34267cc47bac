"""The static cost model: three time bounds per kernel launch, summed per block, stage and model.

For one launch of ``P`` programs (``P`` = product of the grid) on a target with ``S`` SMs:

    waves factor   q        = ceil(P / S) * S / P        (the busiest SM runs ceil(P / S) programs)
    tensor core    t_tensor = q * mma_macs * 2 / peak FLOP/s
    DRAM           t_dram   = dram_bytes / DRAM bandwidth
    issue          t_issue  = q * P * warps * (SASS instructions per warp) / (4 * S * clock)
    predicted               = max(t_tensor, t_dram, t_issue)

``dram_bytes`` is the launcher's declaration (``KernelCost``). ``mma_macs`` are the tensor-core MACs
the compiled code issues: its HGMMA/HMMA instructions weighted by the declared loop trips, times
their shapes (``compiled.tensor_macs_per_program``); the launcher's declared ``mma_macs`` are kept
beside them (they differ where the compiler repeats a dot, e.g. in both warpgroups of an 8-warp
program, and then the compiled figure is the one that costs time). The instructions per warp are
the compiled SASS weighted by the declared loop trips (``compiled.weigh``); peak, bandwidth, SMs and
clock are the target's (``targets.Target``; peak and bandwidth are those of the waterline's device,
so the two compare like with like). Each bound assumes its unit runs at its peak
for the whole launch and the other two are hidden under it: a launch cannot be faster than its
largest bound, and it can be slower (latency, bank conflicts, L2 misses, imperfect overlap). A
block's predicted time is the sum of its launches' (launches run one after another); a stage's and
the model's are the sums of their blocks'. Everything here is arithmetic on declared and compiled
figures: an estimate, not a measurement.

Blocks, stages and the comparison figures come from the waterline model
(``convfirstnet.analysis.waterline.build_kernels``): a block is a block-fusion kernel (its name is the
block's module path), its layer-wise bound is the sum of the minimum times of the layer-wise kernels
whose names start with that path, and its block-fusion ideal is the block-fusion kernel's own
minimum time. A waterline block that no Triton kernel implements (the classifier, a cuBLAS GEMM) is
counted with its waterline bound as predicted time and labelled so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from convfirstnet.kernels._cost import KernelCost

from .targets import Target

BOUNDS = ("tensor", "dram", "issue")


def waves_factor(programs: int, sms: int) -> float:
    """``ceil(P / S) * S / P``: how much longer the busiest SM works than an even share (>= 1)."""
    if programs <= 0:
        raise ValueError(f"a launch needs at least one program, got {programs}")
    return math.ceil(programs / sms) * sms / programs


@dataclass
class LaunchEstimate:
    """One recorded launch with its declaration, its compiled variant's figures and its three bounds."""

    index: int  # position in the recording
    block: str  # module path of the block that launched it (forward pre-hook label)
    kernel: str  # "module.function"
    variant: int  # index into the report's variants
    grid: tuple[int, ...]
    programs: int
    num_warps: int
    waves: float
    insns_per_warp: int  # weighted SASS instructions per warp (one program)
    mma_macs: int  # tensor-core MACs the compiled code issues, whole grid (declared where shapes are unknown)
    cost: KernelCost
    dram_bytes: int  # declared DRAM bytes, plus l2_bytes when the scratch cannot stay in L2
    scratch_in_l2: bool
    t_tensor: float  # seconds
    t_dram: float
    t_issue: float

    @property
    def predicted(self) -> float:
        return max(self.t_tensor, self.t_dram, self.t_issue)

    @property
    def bound(self) -> str:
        return max(zip((self.t_tensor, self.t_dram, self.t_issue), BOUNDS))[1]

    def to_json(self) -> dict:
        cost = asdict(self.cost)
        return dict(
            index=self.index,
            block=self.block,
            kernel=self.kernel,
            variant=self.variant,
            grid=list(self.grid),
            programs=self.programs,
            num_warps=self.num_warps,
            waves_factor=self.waves,
            insns_per_warp=self.insns_per_warp,
            useful_macs=self.cost.useful_macs,
            mma_macs=self.mma_macs,
            declared_mma_macs=self.cost.mma_macs,
            dram_bytes=self.dram_bytes,
            scratch_in_l2=self.scratch_in_l2,
            declaration=cost,
            t_tensor_us=self.t_tensor * 1e6,
            t_dram_us=self.t_dram * 1e6,
            t_issue_us=self.t_issue * 1e6,
            predicted_us=self.predicted * 1e6,
            bound=self.bound,
        )


def estimate_launch(
    *,
    index: int,
    block: str,
    kernel: str,
    variant: int,
    grid: Sequence[int],
    num_warps: int,
    occupancy: int,
    insns_per_warp: int,
    cost: KernelCost,
    target: Target,
    tensor_macs_per_program: int | None = None,
) -> LaunchEstimate:
    """The three bounds of one launch (module docstring). ``tensor_macs_per_program`` is what the
    compiled code issues per program (None: use the declared ``mma_macs``). ``occupancy`` (resident
    programs per SM) decides whether the declared per-program scratch (and the declared L2-resident
    intermediate) fits in L2; if it does not, its ``l2_bytes`` are counted as DRAM traffic."""
    programs = math.prod(grid)
    mma = cost.mma_macs if tensor_macs_per_program is None else tensor_macs_per_program * programs
    q = waves_factor(programs, target.sms)
    dev = target.device
    resident = min(programs, occupancy * target.sms)
    scratch_in_l2 = cost.scratch_bytes_per_program * resident + cost.l2_footprint_bytes <= target.l2_bytes
    dram = cost.dram_bytes + (0 if scratch_in_l2 else cost.l2_bytes)
    return LaunchEstimate(
        index=index,
        block=block,
        kernel=kernel,
        variant=variant,
        grid=tuple(grid),
        programs=programs,
        num_warps=num_warps,
        waves=q,
        insns_per_warp=insns_per_warp,
        mma_macs=mma,
        cost=cost,
        dram_bytes=dram,
        scratch_in_l2=scratch_in_l2,
        t_tensor=q * mma * 2 / (dev.peak_tflops * 1e12),
        t_dram=dram / (dev.bandwidth_tbs * 1e12),
        t_issue=q
        * programs
        * num_warps
        * insns_per_warp
        / (target.issue_per_clock_sm * target.sms * target.clock_hz),
    )


# ------------------------------------------------------------------------------------ aggregation


@dataclass
class Totals:
    """Sums over launches (or over blocks)."""

    launches: int = 0
    useful_macs: int = 0
    mma_macs: int = 0  # as compiled
    declared_mma_macs: int = 0
    dram_bytes: int = 0
    t_tensor: float = 0.0
    t_dram: float = 0.0
    t_issue: float = 0.0
    predicted: float = 0.0
    layerwise: float = 0.0
    fusion_ideal: float = 0.0

    def add(self, other: "Totals") -> None:
        for f in (
            "launches",
            "useful_macs",
            "mma_macs",
            "declared_mma_macs",
            "dram_bytes",
            "t_tensor",
            "t_dram",
            "t_issue",
            "predicted",
            "layerwise",
            "fusion_ideal",
        ):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def to_json(self) -> dict:
        return dict(
            launches=self.launches,
            useful_macs=self.useful_macs,
            mma_macs=self.mma_macs,
            issued_over_useful=self.mma_macs / self.useful_macs if self.useful_macs else None,
            declared_mma_macs=self.declared_mma_macs,
            declared_over_useful=self.declared_mma_macs / self.useful_macs if self.useful_macs else None,
            dram_bytes=self.dram_bytes,
            t_tensor_ms=self.t_tensor * 1e3,
            t_dram_ms=self.t_dram * 1e3,
            t_issue_ms=self.t_issue * 1e3,
            predicted_ms=self.predicted * 1e3,
            layerwise_ms=self.layerwise * 1e3,
            predicted_over_layerwise=self.predicted / self.layerwise if self.layerwise else None,
            fusion_ideal_ms=self.fusion_ideal * 1e3,
        )


@dataclass
class BlockEstimate:
    path: str  # module path, the waterline block-fusion kernel's name
    kind: str  # waterline kind: stem-fused, convfirst-fused, mbconv-fused, head-fused, linear
    stage: str
    totals: Totals
    launches: list[int] = field(default_factory=list)  # indices of its LaunchEstimates
    layerwise_kernels: list[str] = field(default_factory=list)
    implemented_by: str = "triton"  # or "waterline bound" (no Triton kernel: the classifier GEMM)

    def to_json(self) -> dict:
        return dict(
            path=self.path,
            kind=self.kind,
            stage=self.stage,
            implemented_by=self.implemented_by,
            launch_indices=self.launches,
            layerwise_kernels=self.layerwise_kernels,
            **self.totals.to_json(),
        )


UNCOMPILED_KINDS = {"linear": "waterline bound (cuBLAS GEMM, not a Triton kernel)"}


def _owner(label: str, paths: Sequence[str]) -> str | None:
    """The block path that is ``label`` or the longest dotted prefix of it."""
    best = None
    for p in paths:
        if (label == p or label.startswith(p + ".") or p == "") and (best is None or len(p) > len(best)):
            best = p
    return best


def _under(name: str, path: str) -> bool:
    return name == path or name.startswith(path + ".") or path == ""


def aggregate(
    launches: Sequence[LaunchEstimate], layerwise: Sequence, fused: Sequence, target: Target
) -> dict:
    """Blocks, stages and the model total from launch estimates and the waterline kernel lists
    (``build_kernels``: layer-wise and block-fusion :class:`~convfirstnet.analysis.waterline.Kernel`).

    Raises ``ValueError`` (naming the kernel or block and what to fix) when a launch belongs to no
    waterline block, when a block other than the classifier has no launch, or when the useful MACs a
    block's launches declare differ from the block's MACs in the waterline model (= ``count_macs``).
    """
    dev = target.device
    paths = [k.name for k in fused]
    blocks = {
        k.name: BlockEstimate(k.name, k.kind, k.stage, Totals(fusion_ideal=k.t_min(dev))) for k in fused
    }
    for e in launches:
        owner = _owner(e.block, paths)
        if owner is None:
            raise ValueError(
                f"kernel {e.kernel} was launched from module {e.block!r}, which is inside no block the "
                f"waterline model knows ({', '.join(paths)}); launch kernels from the block modules' forward"
            )
        b = blocks[owner]
        b.launches.append(e.index)
        t = b.totals
        t.launches += 1
        t.useful_macs += e.cost.useful_macs
        t.mma_macs += e.mma_macs
        t.declared_mma_macs += e.cost.mma_macs
        t.dram_bytes += e.dram_bytes
        t.t_tensor += e.t_tensor
        t.t_dram += e.t_dram
        t.t_issue += e.t_issue
        t.predicted += e.predicted
    for k in fused:
        b = blocks[k.name]
        members = [lk for lk in layerwise if _under(lk.name, k.name)]
        b.layerwise_kernels = [lk.name for lk in members]
        b.totals.layerwise = sum(lk.t_min(dev) for lk in members)
        if not b.launches:
            if k.kind not in UNCOMPILED_KINDS:
                raise ValueError(
                    f"block {k.name} ({k.kind}) made no kernel launch while recording; a fused block "
                    "must launch its kernels through kernels._launch.launch"
                )
            b.implemented_by = UNCOMPILED_KINDS[k.kind]
            t = b.totals
            t.useful_macs, t.mma_macs, t.declared_mma_macs, t.dram_bytes = k.macs, k.macs, k.macs, k.bytes
            t.t_tensor, t.t_dram = k.ops / (dev.peak_tflops * 1e12), k.bytes / (dev.bandwidth_tbs * 1e12)
            t.predicted = k.t_min(dev)
        elif b.totals.useful_macs != k.macs:
            own = set(b.launches)
            names = ", ".join(sorted({e.kernel for e in launches if e.index in own}))
            raise ValueError(
                f"block {k.name}: its launches ({names}) declare {b.totals.useful_macs:,} useful MACs but "
                f"the block computes {k.macs:,} (waterline model, = count_macs); fix useful_macs in the "
                "KernelCost declarations beside the launchers"
            )
    stages: dict[str, Totals] = {}
    stage_blocks: dict[str, list[str]] = {}
    total = Totals()
    for b in blocks.values():
        stages.setdefault(b.stage, Totals()).add(b.totals)
        stage_blocks.setdefault(b.stage, []).append(b.path)
        total.add(b.totals)
    return dict(
        blocks=[b.to_json() for b in blocks.values()],
        stages=[dict(stage=s, blocks=stage_blocks[s], **t.to_json()) for s, t in stages.items()],
        total=total.to_json(),
    )
