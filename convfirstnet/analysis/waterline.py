"""The paper's waterline model (Sections 4 and 5.3.2) for ConvFirstNet; ``convfirstnet waterline``
(``convfirstnet/commands/waterline.py``) prints and plots it.

A network runs as a sequence of kernels. Kernel ``i`` performs ``n_i`` operations (2 x MACs) and moves
``b_i`` bytes between DRAM and the chip; on a processor with peak ``R`` FLOP/s and DRAM bandwidth
``B`` its minimum latency is (paper Eq. 11-14)

    t_i = n_i / min(R, B * n_i / b_i) = max(n_i / R, b_i / B)
    T_min = sum_i t_i,     C_max = (sum_i n_i) / (T_min * R)

A kernel whose operational intensity ``n_i / b_i`` is below the op:byte ratio ``R / B`` (the
waterline) is memory bound. ``C_max`` is the best computational efficiency any implementation of
that kernel sequence can reach. The mediant intensity ``sum n / sum b`` is the roofline view of the
whole network (paper 4.3), which overestimates ``C_max`` when bound types mix.

Counting rules (the paper's, Section 4.1.2 and 4.2): every input element is read from DRAM once and
every output element written once; weights (and the folded bias) are read once per kernel; a
residual is one more read of the block input. Only convolutions (BlurPool and Squeeze-Excite
included) and the classifier contribute operations, so the MAC total equals
``convfirstnet.profile.count_macs``. Two executions are compared:

* layer-wise: one kernel per convolution with bias, activation and residual fused into it (what
  Inductor produces), plus the memory-only kernels the layers need: ``cat`` and BlurPool of the
  stride-2 ConvFirst block, Squeeze-Excite pool, SE MLP and gate multiply, the head's pool;
* block-fusion: one kernel per block that reads the block input and writes the block output only
  (stem, each ConvFirst and MBConv block, head with its pool; the classifier stays a GEMM).

Shapes come from the model itself: forward hooks on one batch-1 pass record every layer's input
and output shape, and the block structure (stride, residual, SE) is read from the block modules.
Numbers scale linearly with the batch (default 128, as in the paper).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn as nn
from timm.layers import BlurPool2d

from convfirstnet.blocks import ConvFirst, Head, MBConv, Stem
from convfirstnet.factory import create_model
from convfirstnet.profile import count_macs
from convfirstnet.registry import canonical_name

from .devices import DeviceSpec, device_by_key, lookup_device
from .paper import PAPER_BATCH, block_rows

KINDS = (
    "conv",
    "pointwise",
    "grouped",
    "pool/cat/multiply",
    "linear",
    "convfirst-fused",
    "mbconv-fused",
    "stem-fused",
    "head-fused",
)


@dataclass
class Kernel:
    name: str  # module path, e.g. "stages.1.0.conv_expand"
    kind: str  # one of KINDS
    stage: str  # "stem", "stage1".."stage5", "head", or "block"
    macs: int  # whole batch
    bytes: int  # DRAM bytes, whole batch

    @property
    def ops(self) -> int:
        return 2 * self.macs

    @property
    def intensity(self) -> float:
        return self.ops / self.bytes if self.bytes else math.inf

    def t_min(self, dev: DeviceSpec) -> float:
        """Minimum attainable latency in seconds: max(ops / R, bytes / B)."""
        return max(self.ops / (dev.peak_tflops * 1e12), self.bytes / (dev.bandwidth_tbs * 1e12))

    def memory_bound(self, dev: DeviceSpec) -> bool:
        return self.intensity < dev.op_byte


@dataclass
class Summary:
    kernels: int
    gops: float  # 1e9 operations, whole batch
    dram_gb: float  # 1e9 bytes
    mediant_intensity: float
    t_min_ms: float
    c_max: float  # fraction of peak
    roofline_c_max: float  # mediant (roofline) estimate, fraction of peak
    memory_bound_time: float  # fraction of T_min spent in memory-bound kernels
    img_per_s_bound: float


def summarize(kernels: Sequence[Kernel], dev: DeviceSpec, batch: int) -> Summary:
    ops = sum(k.ops for k in kernels)
    nbytes = sum(k.bytes for k in kernels)
    t = sum(k.t_min(dev) for k in kernels)
    t_mem = sum(k.t_min(dev) for k in kernels if k.memory_bound(dev))
    mediant = ops / nbytes
    return Summary(
        kernels=len(kernels),
        gops=ops / 1e9,
        dram_gb=nbytes / 1e9,
        mediant_intensity=mediant,
        t_min_ms=t * 1e3,
        c_max=ops / (t * dev.peak_tflops * 1e12),
        roofline_c_max=min(1.0, mediant / dev.op_byte),
        memory_bound_time=t_mem / t,
        img_per_s_bound=batch / t,
    )


def c_max_at(kernels: Sequence[Kernel], op_byte: float) -> tuple[float, float]:
    """(waterline C_max, roofline C_max) on a processor with this op:byte ratio (independent of R)."""
    ops = sum(k.ops for k in kernels)
    nbytes = sum(k.bytes for k in kernels)
    # t_i * R = max(n_i, b_i * op_byte)
    t_r = sum(max(k.ops, k.bytes * op_byte) for k in kernels)
    return ops / t_r, min(1.0, ops / (nbytes * op_byte))


# ------------------------------------------------------------------------------- shapes from hooks
def _shape_hooks(model: nn.Module, input_size: tuple[int, int, int]) -> dict[str, tuple[tuple, tuple]]:
    """Input and output shape of every module, from one batch-1 forward pass on CPU."""
    shapes: dict[str, tuple[tuple, tuple]] = {}
    handles = []
    for name, m in model.named_modules():

        def hook(mod, inp, out, name=name):
            if inp and isinstance(inp[0], torch.Tensor) and isinstance(out, torch.Tensor):
                shapes[name] = (tuple(inp[0].shape), tuple(out.shape))

        handles.append(m.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_size))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return shapes


def _per_image(shape: tuple) -> int:
    return math.prod(shape[1:])


def _stage_label(path: str) -> str:
    parts = path.split(".")
    if parts[0] == "stages" and len(parts) > 1:
        return f"stage{int(parts[1]) + 1}"  # paper numbering: stage 0 is the stem
    if parts[0] in ("stem", "head"):
        return parts[0]
    if parts[0] == "classifier":
        return "head"
    return "block"


class _Builder:
    """Turns recorded shapes into layer-wise and block-fusion kernel lists."""

    def __init__(self, shapes: dict, batch: int, elem_bytes: int):
        self.shapes, self.n, self.eb = shapes, batch, elem_bytes

    def elems(self, path: str, which: int) -> int:
        return self.n * _per_image(self.shapes[path][which])

    def conv_macs(self, path: str, conv: nn.Conv2d) -> int:
        kh, kw = conv.kernel_size
        return self.elems(path, 1) * (conv.in_channels // conv.groups) * kh * kw

    @staticmethod
    def conv_params(conv: nn.Conv2d) -> int:
        return conv.weight.numel() + conv.out_channels  # folded BN always leaves a bias

    @staticmethod
    def conv_kind(conv: nn.Conv2d) -> str:
        if conv.kernel_size == (1, 1) and conv.groups == 1:
            return "pointwise"
        return "conv" if conv.groups == 1 else "grouped"

    def conv(self, path: str, conv: nn.Conv2d, stage: str, residual: bool = False) -> Kernel:
        reads = self.elems(path, 0) + (self.elems(path, 1) if residual else 0)
        nbytes = (reads + self.elems(path, 1) + self.conv_params(conv)) * self.eb
        return Kernel(path, self.conv_kind(conv), stage, self.conv_macs(path, conv), nbytes)

    def blur(self, path: str, stage: str) -> Kernel:
        # depth-wise 3x3 stride 2 with a fixed filter: 9 MACs per output (counted as count_macs does)
        out = self.elems(path, 1)
        return Kernel(path, "pool/cat/multiply", stage, 9 * out, (self.elems(path, 0) + out) * self.eb)

    def memory_only(self, name: str, stage: str, read: int, write: int) -> Kernel:
        return Kernel(name, "pool/cat/multiply", stage, 0, (read + write) * self.eb)

    def linear(self, path: str, lin: nn.Linear, stage: str) -> Kernel:
        macs = self.n * lin.in_features * lin.out_features
        params = lin.weight.numel() + (lin.out_features if lin.bias is not None else 0)
        nbytes = (self.elems(path, 0) + self.elems(path, 1) + params) * self.eb
        return Kernel(path, "linear", stage, macs, nbytes)

    def se_kernels(self, path: str, se: nn.Module, stage: str) -> list[Kernel]:
        """Layer-wise Squeeze-Excite: pool, the two tiny 1x1 convs, and the gate multiply."""
        hidden = self.elems(path, 0)  # N x R x h x w
        pooled = self.elems(f"{path}.fc1", 0)  # N x R
        return [
            self.memory_only(f"{path}.pool", stage, hidden, pooled),
            self.conv(f"{path}.fc1", se.fc1, stage),
            self.conv(f"{path}.fc2", se.fc2, stage),
            self.memory_only(f"{path}.multiply", stage, hidden + pooled, hidden),
        ]

    def fused(self, path: str, kind: str, stage: str, parts: Iterable[Kernel], params: int) -> Kernel:
        """One block-fusion kernel: reads the block input, writes its output, reads its weights once."""
        macs = sum(k.macs for k in parts)
        nbytes = (self.elems(path, 0) + self.elems(path, 1) + params) * self.eb
        return Kernel(path, kind, stage, macs, nbytes)


def build_kernels(
    model: nn.Module, input_size: tuple[int, int, int], batch: int = PAPER_BATCH, elem_bytes: int = 2
) -> tuple[list[Kernel], list[Kernel]]:
    """(layer-wise kernels, block-fusion kernels) of a training-form ConvFirstNet or stack of blocks."""
    shapes = _shape_hooks(model, input_size)
    b = _Builder(shapes, batch, elem_bytes)
    layer: list[Kernel] = []
    fused: list[Kernel] = []
    for path, m in model.named_modules():
        stage = _stage_label(path)
        p = f"{path}." if path else ""
        if isinstance(m, Stem):
            k = b.conv(f"{p}conv", m.conv, stage)
            layer.append(k)
            fused.append(b.fused(path, "stem-fused", stage, [k], b.conv_params(m.conv)))
        elif isinstance(m, ConvFirst):
            ks = [b.conv(f"{p}conv_dw", m.conv_dw, stage)]
            if m.stride == 2:
                x_in, y = b.elems(f"{p}conv_dw", 0), b.elems(f"{p}conv_dw", 1)
                ks.append(b.memory_only(f"{p}cat", stage, x_in + y, x_in + y))
                ks.append(b.blur(f"{p}blur", stage))
            ks.append(b.conv(f"{p}conv_expand", m.conv_expand, stage))
            ks.append(b.conv(f"{p}conv_project", m.conv_project, stage, residual=m.stride == 1))
            params = sum(b.conv_params(c) for c in (m.conv_dw, m.conv_expand, m.conv_project))
            layer += ks
            fused.append(b.fused(path, "convfirst-fused", stage, ks, params))
        elif isinstance(m, MBConv):
            ks = [b.conv(f"{p}conv_expand", m.conv_expand, stage), b.conv(f"{p}conv_dw", m.conv_dw, stage)]
            if isinstance(m.blur, BlurPool2d):
                ks.append(b.blur(f"{p}blur", stage))
            ks += b.se_kernels(f"{p}se", m.se, stage)
            ks.append(b.conv(f"{p}conv_project", m.conv_project, stage, residual=m.stride == 1))
            params = sum(
                b.conv_params(c) for c in (m.conv_expand, m.conv_dw, m.se.fc1, m.se.fc2, m.conv_project)
            )
            layer += ks
            fused.append(b.fused(path, "mbconv-fused", stage, ks, params))
        elif isinstance(m, Head):
            k = b.conv(f"{p}conv", m.conv, stage)
            feat = b.elems(f"{p}conv", 1)
            pool = b.memory_only(f"{p}pool", stage, feat, b.elems(path, 1))
            layer += [k, pool]
            fused.append(b.fused(path, "head-fused", stage, [k], b.conv_params(m.conv)))
        elif isinstance(m, nn.Linear) and path in shapes:
            k = b.linear(path, m, stage)
            layer.append(k)
            fused.append(k)
    if not layer:
        raise ValueError(f"no ConvFirstNet blocks found in {type(model).__name__}")
    return layer, fused


# ------------------------------------------------------------------------------------------ analysis
@dataclass
class Analysis:
    model: str
    device: DeviceSpec
    batch: int
    resolution: int
    elem_bytes: int
    macs_per_image: int
    layerwise: list[Kernel] = field(repr=False)
    fused: list[Kernel] = field(repr=False)

    @property
    def summaries(self) -> dict[str, Summary]:
        return {
            "layer-wise": summarize(self.layerwise, self.device, self.batch),
            "block-fusion": summarize(self.fused, self.device, self.batch),
        }


def analyze(
    name: str,
    device: str | DeviceSpec = "h100",
    batch: int = PAPER_BATCH,
    resolution: int = 256,
    elem_bytes: int = 2,
    check_macs: bool = True,
) -> Analysis:
    """Waterline analysis of a ConvFirstNet size (``"small"`` or ``"convfirstnet_small"``)."""
    dev = device if isinstance(device, DeviceSpec) else device_by_key(device)
    model = create_model(name)
    size = (3, resolution, resolution)
    layer, fused = build_kernels(model, size, batch, elem_bytes)
    macs = count_macs(model, size)
    if check_macs:
        for label, ks in (("layer-wise", layer), ("block-fusion", fused)):
            total = sum(k.macs for k in ks)
            if total != macs * batch:
                raise AssertionError(f"{label} MACs {total} != count_macs {macs} x batch {batch}")
    return Analysis(canonical_name(name), dev, batch, resolution, elem_bytes, macs, layer, fused)


def block_wells(
    device: str | DeviceSpec, which: str = "all", batch: int = PAPER_BATCH, elem_bytes: int = 2
) -> list[dict]:
    """Paper Fig. 8 / Fig. 12: one stride-1 block of each Table 1 / Table 2 configuration."""
    dev = device if isinstance(device, DeviceSpec) else device_by_key(device)
    rows = []
    for row in block_rows(which):
        cls = ConvFirst if row.block == "convfirst" else MBConv
        block = nn.Sequential(cls(row.channels, row.channels, 1, row.expansion))
        layer, fused = build_kernels(block, (row.channels, row.size, row.size), batch, elem_bytes)
        sl, sf = summarize(layer, dev, batch), summarize(fused, dev, batch)
        rows.append(
            dict(
                block=row.block,
                channels=row.channels,
                expansion=row.expansion,
                size=row.size,
                layerwise_us=sl.t_min_ms * 1e3,
                fused_us=sf.t_min_ms * 1e3,
                layerwise_c_max=sl.c_max,
                fused_c_max=sf.c_max,
                fused_intensity=sf.mediant_intensity,
                bound_speedup=sl.t_min_ms / sf.t_min_ms,
                paper_measured_speedup=row.speedup,
                paper_fused_pct_peak=row.fused_pct_peak,
            )
        )
    return rows


# ------------------------------------------------------------------------------------ measurements
def measured_latencies(records_dir: str | Path, dev: DeviceSpec, batch: int) -> dict[str, dict]:
    """Best measured fused latency per ConvFirstNet model at ``batch`` on a device matching ``dev``,
    from benchmark JSON records (network mode). Keys are model names."""
    best: dict[str, dict] = {}
    for path in sorted(Path(records_dir).glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec.get("mode") != "network" or rec.get("device", {}).get("type") != "cuda":
            continue
        spec = lookup_device(rec["device"].get("name", ""))
        if spec is None or spec.key != dev.key:
            continue
        for r in rec.get("results", []):
            if (
                r.get("status") == "ok"
                and r.get("batch") == batch
                and r.get("backend") in ("fused", "fused-cudagraph")
                and r.get("resolution") == 256
            ):
                cur = best.get(r["model"])
                if cur is None or r["ms_per_batch"] < cur["ms_per_batch"]:
                    best[r["model"]] = dict(
                        ms_per_batch=r["ms_per_batch"], record=path.name, backend=r["backend"]
                    )
    return best
