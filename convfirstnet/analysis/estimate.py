"""The static cost model: per kernel launch, every term that bounds its time, as a low/high pair.

For one launch of ``P`` programs of ``w`` warps on a target with ``S`` SMs, occupancy ``o`` resident
programs per SM, and each machine constant taken at its fast end (the low prediction) or its slow end
(the high one; ``hardware.Band``):

    waves factor  q       = ceil(P / S) * S / P          (the busiest SM runs ceil(P / S) programs)
    rounds        r       = ceil(ceil(P / S) / o)        (programs one SM slot runs one after another)
    tensor        t_tensor = q * (wgmma MACs + mma.sync MACs / f_mma) * 2 / tensor FLOP/s
    DRAM          t_dram   = declared DRAM bytes / DRAM bandwidth
    L2            t_l2     = L2<->SM bytes (from the SASS) / L2 bandwidth
    L1 pipe       t_lsu    = ceil(P / S) * (L1/shared data-pipe wavefronts of one program) / clock
    issue         t_issue  = q * P * w * (SASS instructions per warp) / (4 * S * clock)
    sharing       s       = min(o, ceil(P / S)) * w / 4    (resident warps per warp scheduler)
    latency       t_latency = r * s * (stall cycles of one warp) / clock
    waits         t_waits   = r * s * (exposed load and wgmma-group waits of one warp) / clock
    launch        t_launch  = the gap per launch, in a CUDA graph or from a stream

    predicted = max(t_tensor, t_dram, t_l2, t_lsu, t_issue, t_latency + t_waits) + t_launch

How the terms combine, and why. Tensor cores, DRAM, L2 and instruction issue are separate units that
work at the same time for different warps, so a launch takes at least the largest of them (and can
take longer when they do not overlap perfectly: the calibration measures by how much). The stall
cycles and the exposed waits lie on one warp's own critical path, one after the other, so they add;
and the warps that share a scheduler do not hide one another's paths: measured on an H200
(``benchmarks/results/20261126T051713Z_h200_float16_small_gpu-check-blocks.json``), 10 of the 11
distinct fused blocks of Small took 2.1-5.6x the high end of what one warp's path predicts; the sum
over the ``s`` warps of a scheduler brackets 8 of them (the other three at 0.87-0.97 of its low end),
and leaves the public calibration kernels' band as it was (memory-bound there). An SM slot runs its
programs one after another, hence ``r`` times. The waits are priced at the L2 round trip even for
loads whose declared working set fits L1: priced at an L1 hit, most of the same blocks sat 1.3-2.0x
above the low end. The launch gap is time in which the kernel does not run at all: it
adds. The MACs are those the compiled tensor-core instructions issue (HGMMA/HMMA weighted by the
declared loop trips); ``mma.sync`` runs at ``f_mma`` of the wgmma rate on sm_90 (hardware).

L2<->SM bytes come from the compiled code (``sass.traffic``): every global load, store and atomic,
weighted by loop trips, times 32 lanes and the vector width, per program, times the programs. Loads
that bypass L1 (``cp.async.cg``) and stores count in full. L1-allocating loads count as the program's
declared unique bytes (``KernelCost.l1_unique_bytes_per_program``) when those fit in the L1 that the
resident programs' shared memory leaves at the smallest carve-out that holds it
(``hardware.Hardware.l1_bytes``: the L1 the launchers were designed for), and in full otherwise. What
the driver configures is reported beside it (``l1_configured_bytes``, ``kernels/_carveout.py``): Triton's
loader leaves 28 KB of L1 to every kernel above 48 KB of shared memory (measured), less than most
declared working sets. Measured on an H200 against this accounting (docs/cost-model.md): the ConvFirst
kernels of stages.1-2, which keep weight chunks in L1, moved 1.6-2.4x the L2 bytes; the MBConv hidden
kernels 0.7-0.9x (their taps re-read rows of a tile that a few KB hold, not the whole slot).
Spill traffic (local memory) counts at the high end only (at the low end it hits L1).

The L1/shared data pipe moves one 128-byte wavefront per cycle per SM (``hardware.Hardware
.lsu_wavefronts_per_clock``). A program's wavefronts (``sass.Traffic.lsu_wavefronts``): every shared
access of the weighted SASS at its conflict-free count, the stores at the conflict factor of the
variant's largest register -> shared copy of their width (TTGIR; ``launches.store_conflict``) and the
ldmatrix reads at that of its PTX's ldmatrix (``launches.ldsm_conflict``), cp.async's shared writes,
and one per 128 bytes of each warp's global or local request. Against Nsight Compute on an H200
(docs/cost-model.md) this counts 0.74-1.01x of the measured wavefronts of the ConvFirst stride-1 and
MBConv hidden kernels, and under two thirds of those of the ConvFirst stride-2 kernels and the head
(not bank conflicts: their PTX's shared accesses are conflict-free; the rest is not yet found): a
floor. The layer-wise bound has no such term: a layer-wise kernel moves each of its bytes through the
pipe about once, at 128 B per cycle per SM (29.6 TB/s on 132 SMs at 1.755 GHz), well above the L2
term's rate.

Blocks, stages and the comparison figures come from the waterline model
(``convfirstnet.analysis.waterline.build_kernels``): a block's predicted time is the sum of its
launches'; its layer-wise bound is the sum, over the layer-wise kernels of the block, of
``max(tensor, DRAM, L2) + launch`` with the same constants (every DRAM byte also crosses L2 once;
tensor work at the datasheet peak at the low end and at the best measured matmul rate at the high
end), so fused/layer-wise is like for like. A waterline block that no Triton kernel implements (the
classifier GEMM) is counted with its layer-wise figures and labelled so. Everything here is
arithmetic on declared and compiled figures: an estimate, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from convfirstnet.kernels import _carveout
from convfirstnet.kernels._cost import KernelCost

from .hardware import ENDS, Hardware, hardware
from .sass import LatencyFloor, Traffic
from .targets import Target

TERMS = ("tensor", "dram", "l2", "lsu", "issue", "latency", "waits")
BOUNDS = ("tensor", "dram", "l2", "lsu", "issue", "latency")  # latency = latency + waits
GAPS = ("graph", "stream")


def waves_factor(programs: int, sms: int) -> float:
    """``ceil(P / S) * S / P``: how much longer the busiest SM works than an even share (>= 1)."""
    if programs <= 0:
        raise ValueError(f"a launch needs at least one program, got {programs}")
    return math.ceil(programs / sms) * sms / programs


def _pair(f) -> dict[str, float]:
    return {end: f(end) for end in ENDS}


def combine(terms: dict[str, dict[str, float]], end: str) -> tuple[float, str]:
    """(time without the launch gap, binding term) at one end (module docstring)."""
    vals = {
        "tensor": terms["tensor"][end],
        "dram": terms["dram"][end],
        "l2": terms["l2"][end],
        "lsu": terms["lsu"][end],
        "issue": terms["issue"][end],
        "latency": terms["latency"][end] + terms["waits"][end],
    }
    bound = max(BOUNDS, key=lambda k: vals[k])
    return vals[bound], bound


@dataclass
class LaunchEstimate:
    """One recorded launch with its declaration, its compiled variant's figures and its terms."""

    index: int  # position in the recording
    block: str  # module path of the block that launched it (forward pre-hook label)
    kernel: str  # "module.function"
    variant: int  # index into the report's variants
    grid: tuple[int, ...]
    programs: int
    num_warps: int
    occupancy: int  # resident programs per SM
    waves: float
    rounds: int
    insns_per_warp: int  # weighted SASS instructions per warp (one program)
    mma_macs: int  # tensor-core MACs the compiled code issues, whole grid (declared where shapes are unknown)
    mma_sync_macs: int  # the part of them on mma.sync
    cost: KernelCost
    dram_bytes: int  # declared DRAM bytes, plus l2_bytes when the scratch cannot stay in L2
    scratch_in_l2: bool
    l2_bytes: dict[str, float]  # L2<->SM bytes, whole grid, per end
    traffic: Traffic | None  # per program
    l1_fits: bool | None  # declared L1-resident bytes fit the designed L1 (None: nothing declared)
    latency: LatencyFloor | None  # per warp
    terms: dict[str, dict[str, float]]  # seconds, term -> end -> value
    launch_gap: dict[str, dict[str, float]]  # seconds, "graph"/"stream" -> end -> value
    # L1 per SM that the driver configures under the package's carve-out policy (kernels/_carveout.py;
    # measured: Triton's loader leaves 28 KB to every kernel above 48 KB of shared memory)
    l1_configured_bytes: int | None = None

    @property
    def warps_per_scheduler(self) -> float:
        return min(self.occupancy, math.ceil(self.programs / max(1, self._sms))) * self.num_warps / 4

    _sms: int = 132

    def predicted(self, end: str = "low", gap: str | None = "graph") -> float:
        t, _ = combine(self.terms, end)
        return t + (self.launch_gap[gap][end] if gap else 0.0)

    def bound(self, end: str = "high") -> str:
        return combine(self.terms, end)[1]

    # the previous model's three terms at the low end (datasheet constants), for readers of old fields
    @property
    def t_tensor(self) -> float:
        return self.terms["tensor"]["low"]

    @property
    def t_dram(self) -> float:
        return self.terms["dram"]["low"]

    @property
    def t_issue(self) -> float:
        return self.terms["issue"]["low"]

    def to_json(self) -> dict:
        us = {k: {end: v * 1e6 for end, v in d.items()} for k, d in self.terms.items()}
        return dict(
            index=self.index,
            block=self.block,
            kernel=self.kernel,
            variant=self.variant,
            grid=list(self.grid),
            programs=self.programs,
            num_warps=self.num_warps,
            programs_per_sm=self.occupancy,
            warps_per_scheduler=self.warps_per_scheduler,
            waves_factor=self.waves,
            rounds=self.rounds,
            insns_per_warp=self.insns_per_warp,
            useful_macs=self.cost.useful_macs,
            mma_macs=self.mma_macs,
            mma_sync_macs=self.mma_sync_macs,
            declared_mma_macs=self.cost.mma_macs,
            dram_bytes=self.dram_bytes,
            scratch_in_l2=self.scratch_in_l2,
            l2_bytes=self.l2_bytes,
            l2_over_dram=self.l2_bytes["high"] / self.dram_bytes if self.dram_bytes else None,
            traffic_per_program=self.traffic.to_json() if self.traffic else None,
            l1_fits=self.l1_fits,
            l1_configured_bytes=self.l1_configured_bytes,
            latency_per_warp=self.latency.to_json() if self.latency else None,
            declaration=asdict(self.cost),
            terms_us=us,
            launch_gap_us={g: {end: v * 1e6 for end, v in d.items()} for g, d in self.launch_gap.items()},
            predicted_us={end: self.predicted(end) * 1e6 for end in ENDS},
            predicted_stream_us={end: self.predicted(end, "stream") * 1e6 for end in ENDS},
            bound=self.bound("high"),
            bound_low=self.bound("low"),
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
    mma_sync_macs_per_program: int = 0,
    traffic: Traffic | None = None,
    latency: LatencyFloor | None = None,
    shared_bytes: int = 0,
    hw: Hardware | None = None,
) -> LaunchEstimate:
    """Every term of one launch (module docstring). ``tensor_macs_per_program`` is what the compiled
    code issues per program (None: the declared ``mma_macs``), ``mma_sync_macs_per_program`` the part of
    it on mma.sync; ``traffic`` (per program) and ``latency`` (per warp) come from the SASS (None: the
    L2, latency and wait terms are 0). ``occupancy`` (resident programs per SM) sets the rounds, the L1
    check and whether the declared scratch fits in L2 (if not, its ``l2_bytes`` count as DRAM)."""
    hw = hw or hardware(target.arch)
    programs = math.prod(grid)
    mma = cost.mma_macs if tensor_macs_per_program is None else tensor_macs_per_program * programs
    mma_sync = mma_sync_macs_per_program * programs
    q = waves_factor(programs, target.sms)
    per_sm = math.ceil(programs / target.sms)
    rounds = math.ceil(per_sm / max(1, occupancy))
    resident = min(programs, occupancy * target.sms)
    scratch_in_l2 = cost.scratch_bytes_per_program * resident + cost.l2_footprint_bytes <= target.l2_bytes
    dram = cost.dram_bytes + (0 if scratch_in_l2 else cost.l2_bytes)

    l1_fits = None
    l2 = {"low": 0.0, "high": 0.0}
    r = max(1, min(occupancy, per_sm))
    l1_configured = hw.l1_shared_bytes - _carveout.carveout_bytes(shared_bytes, r, hw.carveouts_kb,
                                                                  _carveout.POLICY)
    if traffic is not None:
        l1_per_program = hw.l1_bytes(r * (shared_bytes + target.smem_reserved_per_block)) / r
        unique = cost.l1_unique_bytes_per_program
        l1_loads = traffic.load_l1
        if unique:
            l1_fits = (cost.l1_working_set_bytes or unique) <= l1_per_program
            if l1_fits:
                l1_loads = min(l1_loads, unique)
        base = traffic.load_bypass + l1_loads + traffic.store + traffic.atomic
        l2 = {"low": base * programs, "high": (base + traffic.local) * programs}

    # the warps sharing a scheduler add their stall and wait chains (module docstring: measured)
    sharing = min(occupancy, per_sm) * num_warps / target.issue_per_clock_sm
    stall = sharing * latency.stall_cycles if latency else 0.0
    waits = {end: 0.0 for end in ENDS}
    if latency:  # at the L2 round trip, also for L1-resident loads (module docstring: measured)
        waits = {end: sharing * latency.wait_cycles[end] for end in ENDS}

    def tensor(end: str) -> float:
        rate = hw.tensor_tflops.pick(end) * 1e12
        return q * 2 * ((mma - mma_sync) + mma_sync / hw.mma_sync_fraction) / rate

    def issue(end: str) -> float:
        return (
            q
            * programs
            * num_warps
            * insns_per_warp
            / (target.issue_per_clock_sm * target.sms * hw.clock_hz.pick(end))
        )

    lsu = traffic.lsu_wavefronts if traffic is not None else 0.0
    terms = {
        "tensor": _pair(tensor),
        "dram": _pair(lambda end: dram / (hw.dram_tbs.pick(end) * 1e12)),
        "l2": _pair(lambda end: l2[end] / (hw.l2_tbs.pick(end) * 1e12)),
        "lsu": _pair(lambda end: per_sm * lsu / (hw.lsu_wavefronts_per_clock * hw.clock_hz.pick(end))),
        "issue": _pair(issue),
        "latency": _pair(lambda end: rounds * stall / hw.clock_hz.pick(end)),
        "waits": _pair(lambda end: rounds * waits[end] / hw.clock_hz.pick(end)),
    }
    gaps = {
        "graph": _pair(lambda end: hw.launch_graph_us.pick(end) * 1e-6),
        "stream": _pair(lambda end: hw.launch_stream_us.pick(end) * 1e-6),
    }
    e = LaunchEstimate(
        index=index,
        block=block,
        kernel=kernel,
        variant=variant,
        grid=tuple(grid),
        programs=programs,
        num_warps=num_warps,
        occupancy=occupancy,
        waves=q,
        rounds=rounds,
        insns_per_warp=insns_per_warp,
        mma_macs=mma,
        mma_sync_macs=mma_sync,
        cost=cost,
        dram_bytes=dram,
        scratch_in_l2=scratch_in_l2,
        l2_bytes=l2,
        traffic=traffic,
        l1_fits=l1_fits,
        latency=latency,
        terms=terms,
        launch_gap=gaps,
        l1_configured_bytes=l1_configured,
    )
    e._sms = target.sms
    return e


def layerwise_terms(kernel, hw: Hardware) -> dict[str, dict[str, float]]:
    """A waterline layer-wise kernel with the same constants: tensor work at the tensor rate of each
    end, its DRAM bytes at the DRAM bandwidth and again at the L2 bandwidth (each byte crosses L2)."""
    return {
        "tensor": _pair(lambda end: kernel.ops / (hw.tensor_tflops.pick(end) * 1e12)),
        "dram": _pair(lambda end: kernel.bytes / (hw.dram_tbs.pick(end) * 1e12)),
        "l2": _pair(lambda end: kernel.bytes / (hw.l2_tbs.pick(end) * 1e12)),
    }


def layerwise_time(kernel, hw: Hardware, end: str, gap: str | None = "graph") -> float:
    t = layerwise_terms(kernel, hw)
    g = (hw.launch_graph_us if gap == "graph" else hw.launch_stream_us).pick(end) * 1e-6 if gap else 0.0
    return max(t[k][end] for k in t) + g


# ------------------------------------------------------------------------------------ aggregation


def _zero_pair() -> dict[str, float]:
    return {end: 0.0 for end in ENDS}


@dataclass
class Totals:
    """Sums over launches (or over blocks): counts, bytes, and every time as a low/high pair."""

    launches: int = 0
    useful_macs: int = 0
    mma_macs: int = 0  # as compiled
    mma_sync_macs: int = 0
    declared_mma_macs: int = 0
    dram_bytes: int = 0
    l2_bytes: dict = field(default_factory=_zero_pair)
    terms: dict = field(default_factory=lambda: {t: _zero_pair() for t in TERMS})
    predicted: dict = field(default_factory=_zero_pair)  # with CUDA graphs
    predicted_stream: dict = field(default_factory=_zero_pair)
    launch_gap: dict = field(default_factory=_zero_pair)  # the launch gaps inside ``predicted``
    layerwise: dict = field(default_factory=_zero_pair)  # with CUDA graphs
    layerwise_stream: dict = field(default_factory=_zero_pair)
    layerwise_kernels: int = 0
    fusion_ideal: float = 0.0
    bound_time: dict = field(default_factory=dict)  # binding term (high end) -> seconds it binds

    def add(self, other: "Totals") -> None:
        for f in (
            "launches",
            "useful_macs",
            "mma_macs",
            "mma_sync_macs",
            "declared_mma_macs",
            "dram_bytes",
            "layerwise_kernels",
            "fusion_ideal",
        ):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for f in ("l2_bytes", "predicted", "predicted_stream", "launch_gap", "layerwise", "layerwise_stream"):
            for end in ENDS:
                getattr(self, f)[end] += getattr(other, f)[end]
        for t in TERMS:
            for end in ENDS:
                self.terms[t][end] += other.terms[t][end]
        for k, v in other.bound_time.items():
            self.bound_time[k] = self.bound_time.get(k, 0.0) + v

    def add_launch(self, e: LaunchEstimate) -> None:
        self.launches += 1
        self.useful_macs += e.cost.useful_macs
        self.mma_macs += e.mma_macs
        self.mma_sync_macs += e.mma_sync_macs
        self.declared_mma_macs += e.cost.mma_macs
        self.dram_bytes += e.dram_bytes
        for end in ENDS:
            self.l2_bytes[end] += e.l2_bytes[end]
            self.predicted[end] += e.predicted(end, "graph")
            self.predicted_stream[end] += e.predicted(end, "stream")
            self.launch_gap[end] += e.launch_gap["graph"][end]
            for t in TERMS:
                self.terms[t][end] += e.terms[t][end]
        b = e.bound("high")
        self.bound_time[b] = self.bound_time.get(b, 0.0) + e.predicted("high", None)

    @property
    def bound(self) -> str:
        return max(self.bound_time, key=self.bound_time.get) if self.bound_time else "-"

    def to_json(self) -> dict:
        ms = lambda d: {end: v * 1e3 for end, v in d.items()}  # noqa: E731
        ratio = {
            end: self.predicted[end] / self.layerwise[end] if self.layerwise[end] else None for end in ENDS
        }
        return dict(
            launches=self.launches,
            useful_macs=self.useful_macs,
            mma_macs=self.mma_macs,
            mma_sync_macs=self.mma_sync_macs,
            issued_over_useful=self.mma_macs / self.useful_macs if self.useful_macs else None,
            declared_mma_macs=self.declared_mma_macs,
            declared_over_useful=self.declared_mma_macs / self.useful_macs if self.useful_macs else None,
            dram_bytes=self.dram_bytes,
            l2_bytes=self.l2_bytes,
            l2_over_dram=self.l2_bytes["high"] / self.dram_bytes if self.dram_bytes else None,
            terms_ms={t: ms(self.terms[t]) for t in TERMS},
            predicted_ms=ms(self.predicted),
            predicted_stream_ms=ms(self.predicted_stream),
            launch_gap_ms=ms(self.launch_gap),
            layerwise_ms=ms(self.layerwise),
            layerwise_stream_ms=ms(self.layerwise_stream),
            layerwise_kernels=self.layerwise_kernels,
            predicted_over_layerwise=ratio,
            fusion_ideal_ms=self.fusion_ideal * 1e3,
            bound=self.bound,
            bound_ms={k: v * 1e3 for k, v in sorted(self.bound_time.items(), key=lambda kv: -kv[1])},
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
            layerwise_kernel_names=self.layerwise_kernels,
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
    launches: Sequence[LaunchEstimate],
    layerwise: Sequence,
    fused: Sequence,
    target: Target,
    hw: Hardware | None = None,
) -> dict:
    """Blocks, stages and the model total from launch estimates and the waterline kernel lists
    (``build_kernels``: layer-wise and block-fusion :class:`~convfirstnet.analysis.waterline.Kernel`).

    Raises ``ValueError`` (naming the kernel or block and what to fix) when a launch belongs to no
    waterline block, when a block other than the classifier has no launch, or when the useful MACs a
    block's launches declare differ from the block's MACs in the waterline model (= ``count_macs``).
    """
    hw = hw or hardware(target.arch)
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
        b.totals.add_launch(e)
    for k in fused:
        b = blocks[k.name]
        members = [lk for lk in layerwise if _under(lk.name, k.name)]
        b.layerwise_kernels = [lk.name for lk in members]
        t = b.totals
        t.layerwise_kernels = len(members)
        for end in ENDS:
            t.layerwise[end] = sum(layerwise_time(lk, hw, end, "graph") for lk in members)
            t.layerwise_stream[end] = sum(layerwise_time(lk, hw, end, "stream") for lk in members)
        if not b.launches:
            if k.kind not in UNCOMPILED_KINDS:
                raise ValueError(
                    f"block {k.name} ({k.kind}) made no kernel launch while recording; a fused block "
                    "must launch its kernels through kernels._launch.launch"
                )
            b.implemented_by = UNCOMPILED_KINDS[k.kind]
            t.useful_macs, t.mma_macs, t.declared_mma_macs, t.dram_bytes = k.macs, k.macs, k.macs, k.bytes
            lt = layerwise_terms(k, hw)
            for end in ENDS:
                for name in ("tensor", "dram", "l2"):
                    t.terms[name][end] = lt[name][end]
                t.l2_bytes[end] = k.bytes
                t.predicted[end] = layerwise_time(k, hw, end, "graph")
                t.predicted_stream[end] = layerwise_time(k, hw, end, "stream")
                t.launch_gap[end] = hw.launch_graph_us.pick(end) * 1e-6
            t.bound_time = {max(("tensor", "dram", "l2"), key=lambda n: lt[n]["high"]): t.predicted["high"]}
        elif t.useful_macs != k.macs:
            own = set(b.launches)
            names = ", ".join(sorted({e.kernel for e in launches if e.index in own}))
            raise ValueError(
                f"block {k.name}: its launches ({names}) declare {t.useful_macs:,} useful MACs but "
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
