"""The machine constants of the static cost model, each as a band with its public source.

Every constant is a :class:`Band`: ``fast`` is the value that gives the lower (optimistic) time and
``slow`` the value that gives the higher one, so a bandwidth's ``fast`` is the larger figure and a
latency's the smaller. The estimate carries both ends through to a low/high prediction
(``estimate.estimate_launch``). Where two public sources differ, the band spans them; where only one
exists, both ends are that figure unless a note says how the other end was derived.

Sources (cited per constant below):

* NVIDIA H100 / A100 datasheets: dense fp16 tensor peak (989.4 / 312 TFLOP/s), DRAM bandwidth
  (3.35 / 2.04 TB/s). The clock that makes ``SMs x 4096 (2048) FLOP/clock x clock`` equal the peak is
  1.83 GHz (1.41 GHz on the A100).
* te42kyfo/gpu-benches at commit 1c36d509ee717dca9215c27135fa1e611bb03ed1 (raw data files):
  ``gpu-l2-cache/h200.txt`` (H200, the H100 SXM die with HBM3e: 9.7-10.2 TB/s from L2 for 2-40 MB
  working sets, 3.89 TB/s from DRAM = 81 % of its 4.8 TB/s datasheet figure),
  ``gpu-l2-cache/h100_pcie.txt`` (H100 PCIe: 6.9-7.8 TB/s from L2), ``gpu-l2-cache/a100_80.txt``
  (A100 80 GB: 5.2-5.5 TB/s from L2, 1.9 TB/s from DRAM), ``gpu-latency/h100_pcie.txt`` (pointer
  chase at 1755 MHz: L1 34 cycles, near L2 265, far L2 403-484, DRAM 650),
  ``cuda-latency/a100_80.txt`` at commit 2f9158840909a373a52a7ec7b0acddbc2ccf10b0 (A100: L1 36,
  L2 211-425 cycles), ``gpu-small-kernels/h200.txt`` and ``h200_graph.txt`` (10,000 queued 64 KiB
  SCALE kernels: 26-27 GB/s from a stream = 2.43-2.52 us per launch, 48-52 GB/s in a CUDA graph =
  1.26-1.37 us per launch).
* stas00/ml-engineering (compute/accelerator README, as quoted in this project's KERNEL-NOTES): the
  best measured BF16 matmul on an H100 SXM is 794.5 TFLOP/s, 80 % of the datasheet peak.
* Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture", arXiv 2402.13499 (as
  quoted in KERNEL-NOTES): on Hopper, ``mma.sync`` reaches about 63 % of the tensor peak where
  ``wgmma`` exceeds 95 %.
* NVIDIA CUDA C++ Programming Guide, compute capabilities 8.0 and 9.0: unified L1/shared memory of
  192 KB (8.0) and 256 KB (9.0) per SM, and the shared-memory carve-outs the driver can pick.
* Issue 18 of this project and the H100 PCIe runs above (1755 MHz): about 1.75 GHz sustained under
  load, against the 1.83 GHz the datasheet peak implies.
"""

from __future__ import annotations

from dataclasses import dataclass

from convfirstnet.kernels._carveout import smallest_carveout


@dataclass(frozen=True)
class Band:
    """A constant as the value that gives the lower time (``fast``) and the higher one (``slow``)."""

    fast: float
    slow: float
    unit: str
    source: str

    def pick(self, end: str) -> float:
        """``end`` is "low" (the optimistic prediction) or "high"."""
        return self.fast if end == "low" else self.slow

    def to_json(self) -> dict:
        return dict(fast=self.fast, slow=self.slow, unit=self.unit, source=self.source)


ENDS = ("low", "high")


@dataclass(frozen=True)
class Hardware:
    """The banded constants of one target (see the module docstring for the sources)."""

    clock_hz: Band  # SM clock: issue, stall cycles and latencies in cycles are converted with it
    tensor_tflops: Band  # dense 16-bit tensor throughput of the best instruction (wgmma on sm_90)
    mma_sync_fraction: float  # mma.sync throughput as a fraction of tensor_tflops (sm_90; 1 on sm_80)
    dram_tbs: Band  # achievable DRAM bandwidth
    l2_tbs: Band  # L2 <-> SM bandwidth, all SMs
    l2_latency_cycles: Band  # a load that hits L2 (near partition .. far partition)
    l1_latency_cycles: Band  # a load that hits L1 or shared memory
    launch_stream_us: Band  # gap per dependent launch from a stream
    launch_graph_us: Band  # gap per launch inside a CUDA graph
    l1_shared_bytes: int  # unified L1 + shared memory per SM
    carveouts_kb: tuple[int, ...]  # shared-memory capacities per SM the driver can configure
    # the L1/shared data pipe: 128-byte wavefronts per SM per clock (shared accesses, one per bank-
    # conflict pass; global and local accesses through L1); the estimate's "lsu" term
    lsu_wavefronts_per_clock: float = 1.0
    lsu_source: str = ""

    def to_json(self) -> dict:
        out = {}
        for name in (
            "clock_hz",
            "tensor_tflops",
            "dram_tbs",
            "l2_tbs",
            "l2_latency_cycles",
            "l1_latency_cycles",
            "launch_stream_us",
            "launch_graph_us",
        ):
            out[name] = getattr(self, name).to_json()
        out.update(
            mma_sync_fraction=self.mma_sync_fraction,
            l1_shared_bytes=self.l1_shared_bytes,
            carveouts_kb=list(self.carveouts_kb),
            lsu_wavefronts_per_clock=self.lsu_wavefronts_per_clock,
            lsu_source=self.lsu_source,
        )
        return out

    def l1_bytes(self, shared_per_sm: int) -> int:
        """L1 left per SM when the resident programs take ``shared_per_sm`` bytes of shared memory: the
        driver picks the smallest carve-out that holds them, the rest of the unified array is L1."""
        carveout = smallest_carveout(shared_per_sm, self.carveouts_kb)
        return 0 if carveout is None else self.l1_shared_bytes - carveout


GPU_BENCHES = "te42kyfo/gpu-benches@1c36d50"
# shared memory at 128 B per clock per SM on A100 and H100 (23,101 and 32,348 GB/s at 1410 and 1755 MHz
# with 128 and 144 SMs): Table 3 of PMC10448217 (Ultrasonics Sonochemistry 99, 106546, 2023)
_LSU_TABLE = "PMC10448217 Table 3: shared memory 128 B/clock/SM"
_LAUNCH_STREAM = Band(2.43, 2.52, "us", f"{GPU_BENCHES} gpu-small-kernels/h200.txt: 64 KiB at 26-27 GB/s")
_LAUNCH_GRAPH = Band(
    1.26, 1.37, "us", f"{GPU_BENCHES} gpu-small-kernels/h200_graph.txt: 64 KiB at 48-52 GB/s"
)

HARDWARE: dict[int, Hardware] = {
    90: Hardware(
        clock_hz=Band(
            989.4e12 / (132 * 4096),
            1.755e9,
            "Hz",
            "datasheet peak / (132 SMs x 4096 FLOP/clock); sustained ~1.75 GHz "
            f"(issue 18; {GPU_BENCHES} gpu-latency/h100_pcie.txt runs at 1755 MHz)",
        ),
        tensor_tflops=Band(
            989.4,
            794.5,
            "TFLOP/s",
            "H100 SXM datasheet; best measured BF16 matmul (stas00/ml-engineering, via KERNEL-NOTES)",
        ),
        mma_sync_fraction=0.63,
        dram_tbs=Band(
            3.35,
            3.35 * 0.81,
            "TB/s",
            "H100 SXM datasheet; x 0.81, the fraction of its datasheet "
            f"bandwidth the H200 (same die) reaches in {GPU_BENCHES} gpu-l2-cache/h200.txt",
        ),
        l2_tbs=Band(
            10.2,
            6.9,
            "TB/s",
            f"{GPU_BENCHES} gpu-l2-cache/h200.txt (2-40 MB sets: 9.7-10.2); "
            "gpu-l2-cache/h100_pcie.txt (6.9-7.8)",
        ),
        l2_latency_cycles=Band(265, 484, "cycles", f"{GPU_BENCHES} gpu-latency/h100_pcie.txt: near / far L2"),
        l1_latency_cycles=Band(34, 34, "cycles", f"{GPU_BENCHES} gpu-latency/h100_pcie.txt: L1 hit"),
        launch_stream_us=_LAUNCH_STREAM,
        launch_graph_us=_LAUNCH_GRAPH,
        l1_shared_bytes=256 * 1024,
        carveouts_kb=(0, 8, 16, 32, 64, 100, 132, 164, 196, 228),
        lsu_wavefronts_per_clock=1.0,
        lsu_source=f"{_LSU_TABLE}; Nsight Compute's peak of l1tex__data_pipe_lsu_wavefronts on the H200 "
        "(benchmarks/results/ncu/20261126T150000Z: wavefronts / cycles / % of peak = 1.00, 88 launches)",
    ),
    80: Hardware(
        clock_hz=Band(
            312e12 / (108 * 2048),
            312e12 / (108 * 2048),
            "Hz",
            "datasheet peak / (108 SMs x 2048 FLOP/clock); cuda-latency/a100_80.txt runs at 1410 MHz",
        ),
        tensor_tflops=Band(
            312.0,
            312.0 * 794.5 / 989.4,
            "TFLOP/s",
            "A100 datasheet; slow end: the H100's "
            "best-measured fraction of peak (80 %), no A100 figure at hand",
        ),
        mma_sync_fraction=1.0,  # mma.sync is the A100's full-rate tensor instruction
        dram_tbs=Band(2.04, 1.89, "TB/s", f"A100 80 GB datasheet; {GPU_BENCHES} gpu-l2-cache/a100_80.txt"),
        l2_tbs=Band(5.45, 5.2, "TB/s", f"{GPU_BENCHES} gpu-l2-cache/a100_80.txt"),
        l2_latency_cycles=Band(211, 425, "cycles", "te42kyfo/gpu-benches@2f91588 cuda-latency/a100_80.txt"),
        l1_latency_cycles=Band(36, 36, "cycles", "te42kyfo/gpu-benches@2f91588 cuda-latency/a100_80.txt"),
        launch_stream_us=_LAUNCH_STREAM,  # no A100 figure at hand: the H200's (same driver path)
        launch_graph_us=_LAUNCH_GRAPH,
        l1_shared_bytes=192 * 1024,
        carveouts_kb=(0, 8, 16, 32, 64, 100, 132, 164),
        lsu_wavefronts_per_clock=1.0,
        lsu_source=_LSU_TABLE,
    ),
}


def hardware(arch: int) -> Hardware:
    return HARDWARE[arch]
