"""GPU targets of the static cost report: the facts about each chip that the estimates use.

Peak and DRAM bandwidth are the waterline's (``convfirstnet.analysis.devices``), so the report and
the waterline compare like with like. The clock is derived from the peak, so that
``SMs x tensor FLOP/clock/SM x clock`` equals the datasheet peak. Limits per SM are from NVIDIA's
CUDA C++ Programming Guide (compute capabilities 8.0 and 9.0).
"""

from __future__ import annotations

from dataclasses import dataclass

from .devices import DeviceSpec, device_by_key


@dataclass(frozen=True)
class Target:
    arch: int  # 90 = sm_90 (Hopper), 80 = sm_80 (Ampere)
    device_key: str  # the waterline device this target is costed as
    sms: int
    tensor_flop_per_clock_sm: int  # dense fp16/bf16, fp32 accumulate
    issue_per_clock_sm: int  # warp-instructions issued per clock per SM (one per scheduler)
    regs_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int  # bytes, shared memory per SM usable by resident blocks
    smem_per_block: int  # bytes, opt-in maximum for one block
    smem_reserved_per_block: int  # bytes the driver reserves per block
    l2_bytes: int

    @property
    def device(self) -> DeviceSpec:
        return device_by_key(self.device_key)

    @property
    def clock_hz(self) -> float:
        return self.device.peak_tflops * 1e12 / (self.sms * self.tensor_flop_per_clock_sm)

    @property
    def name(self) -> str:
        return f"sm_{self.arch} ({self.device.name})"

    def occupancy(self, num_warps: int, regs: int, shared: int) -> int:
        """Resident programs per SM, from registers (allocated per warp in units of 256), warps,
        shared memory and the block limit."""
        regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
        by_regs = self.regs_per_sm // (regs_per_warp * num_warps)
        by_warps = self.max_warps_per_sm // num_warps
        by_smem = self.smem_per_sm // (shared + self.smem_reserved_per_block) if shared else self.max_blocks_per_sm
        return max(0, min(by_regs, by_warps, by_smem, self.max_blocks_per_sm))


TARGETS: dict[int, Target] = {
    # H100 SXM5: 132 SMs, 4th-gen tensor cores 4096 dense fp16 FLOP/clock/SM (-> 1.83 GHz at 989.4 TFLOP/s),
    # 64 K registers, 64 warps, 32 blocks, 228 KB shared per SM (227 KB per block), 50 MB L2.
    90: Target(90, "h100", 132, 4096, 4, 65536, 64, 32, 228 * 1024, 227 * 1024, 1024, 50 * 1024**2),
    # A100 SXM4 80 GB: 108 SMs, 2048 dense fp16 FLOP/clock/SM (-> 1.41 GHz at 312 TFLOP/s),
    # 64 K registers, 64 warps, 32 blocks, 164 KB shared per SM (163 KB per block), 40 MB L2.
    80: Target(80, "a100", 108, 2048, 4, 65536, 64, 32, 164 * 1024, 163 * 1024, 1024, 40 * 1024**2),
}


def target(arch: int | str) -> Target:
    """``90``, ``"90"``, ``"sm_90"`` or ``"sm90"`` -> the target."""
    text = str(arch).strip().lower().removeprefix("sm_").removeprefix("sm")
    key = int(text) if text.isdigit() else None
    if key not in TARGETS:
        raise ValueError(f"unknown GPU target {arch!r}; known: {', '.join(f'sm_{a}' for a in TARGETS)}")
    return TARGETS[key]
