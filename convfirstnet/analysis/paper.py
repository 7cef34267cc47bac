"""The paper's published figures, as data (Lavin 2024, arXiv 2404.03617; SPEC 1 and 3).

All timings are the paper's: NVIDIA RTX A5000, 76.7 TFLOP/s fp16 peak (base clock), batch 128,
float16. Block stages are 8 stride-1 blocks (paper 5.5.3). Nothing here was measured by this package.
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER_DEVICE = "NVIDIA RTX A5000 (76.7 TFLOP/s fp16, paper clocks)"
PAPER_BATCH = 128
PAPER_STAGE_DEPTH = 8


@dataclass(frozen=True)
class BlockRow:
    block: str  # "convfirst" or "mbconv"
    channels: int
    expansion: int
    size: int  # feature map height = width
    inductor_ms: float
    fused_ms: float
    fused_pct_peak: float
    speedup: float
    inductor_pct_peak: float

    @property
    def label(self) -> str:
        return f"{self.block} C={self.channels} t={self.expansion} {self.size}x{self.size}"


# Paper Table 1: ConvFirst, stride 1 (Inductor ms, fused ms, fused % of peak, speed-up, Inductor % of peak).
TABLE1 = (
    BlockRow("convfirst", 16, 3, 128, 5.88, 0.42, 35.1, 14.2, 2.5),
    BlockRow("convfirst", 32, 3, 128, 9.89, 0.99, 46.6, 9.9, 4.7),
    BlockRow("convfirst", 32, 6, 64, 3.94, 0.30, 66.9, 13.2, 5.1),
    BlockRow("convfirst", 48, 6, 64, 5.06, 0.59, 71.6, 8.6, 8.4),
    BlockRow("convfirst", 64, 6, 64, 6.75, 0.96, 76.2, 7.0, 10.9),
    BlockRow("convfirst", 48, 6, 32, 1.33, 0.16, 67.0, 8.4, 8.0),
    BlockRow("convfirst", 64, 6, 32, 1.70, 0.25, 74.0, 6.8, 10.8),
    BlockRow("convfirst", 96, 6, 32, 2.60, 0.58, 68.7, 4.5, 15.4),
)

# Paper Table 2: MBConv + SE (ratio 0.25), stride 1, t = 4. Its prose: fused 3.0x-5.4x faster than
# Inductor, 46.2 % of peak at 128 channels and 51.4 % at 256.
TABLE2 = (
    BlockRow("mbconv", 128, 4, 16, 11.46, 2.48, 46.2, 4.6, 10.0),
    BlockRow("mbconv", 144, 4, 16, 13.38, 3.19, 44.4, 4.2, 10.6),
    BlockRow("mbconv", 160, 4, 16, 14.81, 4.09, 41.9, 3.6, 11.6),
    BlockRow("mbconv", 192, 4, 16, 17.78, 5.39, 44.4, 3.3, 13.5),
    BlockRow("mbconv", 256, 4, 16, 24.30, 8.01, 51.0, 3.0, 16.8),
    BlockRow("mbconv", 128, 4, 8, 3.43, 0.64, 45.0, 5.4, 8.4),
    BlockRow("mbconv", 144, 4, 8, 4.03, 1.09, 32.5, 3.7, 8.8),
    BlockRow("mbconv", 160, 4, 8, 4.36, 1.37, 31.3, 3.2, 9.8),
    BlockRow("mbconv", 192, 4, 8, 5.18, 1.39, 43.1, 3.7, 11.6),
    BlockRow("mbconv", 256, 4, 8, 7.56, 1.99, 51.4, 3.8, 13.5),
)


def block_rows(which: str) -> tuple[BlockRow, ...]:
    if which == "convfirst":
        return TABLE1
    if which == "mbconv":
        return TABLE2
    if which == "all":
        return TABLE1 + TABLE2
    raise ValueError(f"--blocks must be convfirst, mbconv or all, got {which!r}")


@dataclass(frozen=True)
class ModelRow:
    model: str
    gmacs: float  # paper, 256x256 (ConvNeXt at 288)
    top1: float  # ImageNet-1k top-1, %
    img_per_s: float  # paper Table 4 (fused kernels for ConvFirstNet, Inductor for the others)
    pct_peak: float


# Paper Table 4 (SPEC 1 and 3). ConvFirstNet rows ran the paper's block-fusion kernels (partly
# estimated, paper Appendix A); the others ran PyTorch Inductor.
TABLE4 = {
    "convfirstnet_pico": ModelRow("convfirstnet_pico", 0.86, 79.858, 21059.6, 47.2),
    "convfirstnet_nano": ModelRow("convfirstnet_nano", 1.812, 81.834, 9447.2, 44.6),
    "convfirstnet_tiny": ModelRow("convfirstnet_tiny", 3.227, 82.752, 5311.0, 44.7),
    "convfirstnet_small": ModelRow("convfirstnet_small", 5.493, 83.312, 3851.0, 55.2),
    "convnext_small.288": ModelRow("convnext_small.288", 14.4, 83.7, 925.1, 34.7),
    "efficientnet_b5": ModelRow("efficientnet_b5", 9.6, 83.6, 332.4, 8.3),
    "efficientnetv2_s": ModelRow("efficientnetv2_s", 8.4, 83.9, 876.8, 19.3),
}
