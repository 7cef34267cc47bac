"""Accelerators known to the benchmark and the waterline model: dense fp16/bf16 tensor-core peak and
DRAM bandwidth.

``peak_tflops`` is the dense (no structured sparsity) fp16/bf16 tensor-core throughput with fp32
accumulation, from the vendor's datasheet at boost clock, except where a note says otherwise.
``bandwidth_tbs`` is the datasheet DRAM bandwidth. The benchmark matches a CUDA device by the name
``torch.cuda.get_device_name()`` returns; the waterline command takes the short key.

The paper's baseline (SPEC 3) is an A5000 at base clock (1.17 GHz): 64 SMs x 1024 fp16 FLOP/clock
x 1.17 GHz = 76.7 TFLOP/s, with the memory clock lowered to 1.25 GHz of 2.0 GHz, i.e.
768 x 1.25 / 2 = 480 GB/s. The paper's waterline figures (Fig. 8 and 12) are reproduced with those
480 GB/s (``a5000-paper``), not with the datasheet's 768 GB/s (``a5000``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    key: str  # short name for the command line: "h100", "a5000-paper", ...
    name: str  # human-readable name
    peak_tflops: float  # dense fp16/bf16 tensor-core TFLOP/s (fp32 accumulate)
    bandwidth_tbs: float  # DRAM bandwidth, TB/s
    patterns: tuple[str, ...] = ()  # lower-case substrings of torch.cuda.get_device_name()
    note: str = ""

    @property
    def op_byte(self) -> float:
        """Peak arithmetic throughput over DRAM bandwidth (OPs per byte): the waterline."""
        return self.peak_tflops / self.bandwidth_tbs


# Order matters for name matching: specific variants (PCIe, NVL) before the generic name.
DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("h100-pcie", "NVIDIA H100 PCIe", 756.0, 2.0, ("h100 pcie",)),
    DeviceSpec("h100-nvl", "NVIDIA H100 NVL", 835.5, 3.9, ("h100 nvl",)),
    DeviceSpec("h100", "NVIDIA H100 SXM", 989.4, 3.35, ("h100",), "SXM5 80 GB (HBM3)"),
    DeviceSpec("h200-nvl", "NVIDIA H200 NVL", 835.5, 4.8, ("h200 nvl",)),
    DeviceSpec("h200", "NVIDIA H200 SXM", 989.4, 4.8, ("h200", "gh200")),
    DeviceSpec(
        "a100-40gb", "NVIDIA A100 40GB", 312.0, 1.555, ("a100-sxm4-40gb", "a100-pcie-40gb", "a100 40gb")
    ),
    DeviceSpec("a100", "NVIDIA A100 80GB", 312.0, 2.0, ("a100",), "SXM4 2.04 TB/s, PCIe 1.94 TB/s"),
    DeviceSpec(
        "a5000",
        "NVIDIA RTX A5000",
        76.7,
        0.768,
        ("rtx a5000",),
        "peak at base clock, as the paper uses (SPEC 3); datasheet memory bandwidth",
    ),
    DeviceSpec(
        "a5000-paper",
        "NVIDIA RTX A5000 (paper clocks)",
        76.7,
        0.48,
        (),
        "the paper's benchmark clocks: 1.17 GHz core, 1.25 GHz memory (Section 3.2)",
    ),
    DeviceSpec("a6000", "NVIDIA RTX A6000", 154.8, 0.768, ("rtx a6000",)),
    DeviceSpec("rtx4090", "NVIDIA GeForce RTX 4090", 165.2, 1.008, ("rtx 4090",)),
    DeviceSpec("rtx3090", "NVIDIA GeForce RTX 3090", 71.0, 0.936, ("rtx 3090",)),
    DeviceSpec("l40s", "NVIDIA L40S", 362.0, 0.864, ("l40s",)),
    DeviceSpec("l4", "NVIDIA L4", 121.0, 0.3, ("nvidia l4",)),
    DeviceSpec("a10", "NVIDIA A10", 125.0, 0.6, ("nvidia a10",), "A10 only; the A10G is not listed"),
    DeviceSpec("t4", "NVIDIA Tesla T4", 65.0, 0.32, ("tesla t4",)),
    DeviceSpec("v100", "NVIDIA V100 SXM2", 125.0, 0.9, ("v100",)),
)

DEVICE_KEYS = tuple(d.key for d in DEVICES)


def device_by_key(key: str) -> DeviceSpec:
    k = key.strip().lower()
    aliases = {"h100-sxm": "h100", "h200-sxm": "h200", "a100-80gb": "a100", "4090": "rtx4090"}
    k = aliases.get(k, k)
    for d in DEVICES:
        if d.key == k:
            return d
    raise ValueError(f"unknown device {key!r}; known: {', '.join(DEVICE_KEYS)}")


def lookup_device(cuda_name: str) -> DeviceSpec | None:
    """The table entry for a ``torch.cuda.get_device_name()`` string, or None when unknown.

    A10G must not match "nvidia a10": names are compared up to a word boundary.
    """
    name = " ".join(cuda_name.lower().replace("_", " ").split())
    for d in DEVICES:
        for p in d.patterns:
            i = name.find(p)
            if i < 0:
                continue
            end = i + len(p)
            if end == len(name) or not name[end].isalnum():
                return d
    return None
