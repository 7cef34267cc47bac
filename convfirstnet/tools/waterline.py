"""``convfirstnet waterline``: the paper's waterline model (Sections 4 and 5.3.2) for ConvFirstNet.

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

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn as nn

from ._cli import ArgumentParser
from .bench_devices import DEVICE_KEYS, DeviceSpec, device_by_key
from .bench_paper import PAPER_BATCH, TABLE4, block_rows

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
    from timm.layers import BlurPool2d

    from convfirstnet.blocks import ConvFirst, Head, MBConv, Stem

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
    from convfirstnet.factory import create_model
    from convfirstnet.profile import count_macs

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
    key = name if name.startswith("convfirstnet_") else f"convfirstnet_{name}"
    return Analysis(key, dev, batch, resolution, elem_bytes, macs, layer, fused)


def block_wells(
    device: str | DeviceSpec, which: str = "all", batch: int = PAPER_BATCH, elem_bytes: int = 2
) -> list[dict]:
    """Paper Fig. 8 / Fig. 12: one stride-1 block of each Table 1 / Table 2 configuration."""
    from convfirstnet.blocks import ConvFirst, MBConv

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


# ---------------------------------------------------------------------------------------- markdown
def summary_table(a: Analysis) -> str:
    d = a.device
    lines = [
        f"Waterline, {a.model} @ {a.resolution}x{a.resolution}, batch {a.batch}, "
        f"{a.elem_bytes} bytes/element, "
        f"{d.name}: {d.peak_tflops:g} TFLOP/s, {d.bandwidth_tbs:g} TB/s, op:byte {d.op_byte:.0f}. "
        f"MACs/image {a.macs_per_image / 1e9:.3f} G (= count_macs).",
        "",
        "| execution | kernels | GOPs | DRAM GB | mediant OP/B | min latency ms | max efficiency (waterline) "
        "| roofline estimate | time memory-bound | img/s bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, s in a.summaries.items():
        lines.append(
            f"| {label} | {s.kernels} | {s.gops:.1f} | {s.dram_gb:.2f} | {s.mediant_intensity:.0f} "
            f"| {s.t_min_ms:.3f} "
            f"| {100 * s.c_max:.1f} % | {100 * s.roofline_c_max:.1f} % | {100 * s.memory_bound_time:.0f} % "
            f"| {s.img_per_s_bound:,.0f} |"
        )
    ideal_ms = 2 * a.macs_per_image * a.batch / (d.peak_tflops * 1e12) * 1e3
    lines.append("")
    lines.append(f"Ideal latency (all operations at peak): {ideal_ms:.3f} ms per batch of {a.batch}.")
    return "\n".join(lines)


def stage_table(a: Analysis) -> str:
    stages: list[str] = []
    for k in a.layerwise:
        if k.stage not in stages:
            stages.append(k.stage)
    lines = [
        "| stage | GOPs | layer-wise: kernels | DRAM GB | min ms "
        "| block-fusion: kernels | DRAM GB | min ms | OP/B (fused) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for st in stages:
        lk = [k for k in a.layerwise if k.stage == st]
        fk = [k for k in a.fused if k.stage == st]
        ops = sum(k.ops for k in fk)
        fb = sum(k.bytes for k in fk)
        lines.append(
            f"| {st} | {ops / 1e9:.1f} | {len(lk)} | {sum(k.bytes for k in lk) / 1e9:.3f} "
            f"| {sum(k.t_min(a.device) for k in lk) * 1e3:.3f} | {len(fk)} | {fb / 1e9:.3f} "
            f"| {sum(k.t_min(a.device) for k in fk) * 1e3:.3f} | {ops / fb:.0f} |"
        )
    return "\n".join(lines)


def kernel_table(kernels: Sequence[Kernel], dev: DeviceSpec) -> str:
    lines = [
        "| kernel | kind | MOPs | DRAM MB | OP/B | min µs | bound |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for k in kernels:
        bound = "memory" if k.memory_bound(dev) else "compute"
        lines.append(
            f"| {k.name} | {k.kind} | {k.ops / 1e6:.1f} | {k.bytes / 1e6:.2f} | {k.intensity:.1f} "
            f"| {k.t_min(dev) * 1e6:.1f} | {bound} |"
        )
    return "\n".join(lines)


def wells_table(rows: Sequence[dict], dev: DeviceSpec) -> str:
    lines = [
        f"Single stride-1 blocks, batch {PAPER_BATCH}, {dev.name} (op:byte {dev.op_byte:.0f}); the paper's "
        "Fig. 8 and 12 use the A5000 at its benchmark clocks (`--device a5000-paper`).",
        "",
        "| block | C | t | HxW | layer-wise min µs | block-fusion min µs | bound speed-up | fused OP/B "
        "| fused max eff. | paper measured speed-up (A5000) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['block']} | {r['channels']} | {r['expansion']} | {r['size']}x{r['size']} "
            f"| {r['layerwise_us']:.0f} "
            f"| {r['fused_us']:.0f} | {r['bound_speedup']:.1f}x | {r['fused_intensity']:.0f} "
            f"| {100 * r['fused_c_max']:.0f} % | {r['paper_measured_speedup']:.1f}x |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- plots
_COLORS = {
    "conv": "#8c564b",
    "pointwise": "#1f77b4",
    "grouped": "#ff7f0e",
    "pool/cat/multiply": "#7f7f7f",
    "linear": "#9467bd",
    "convfirst-fused": "#2ca02c",
    "mbconv-fused": "#d62728",
    "stem-fused": "#8c564b",
    "head-fused": "#e377c2",  # not the classifier's colour: both are in the block-fusion panel
}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        from ._cli import ToolError

        raise ToolError("plots need matplotlib: pip install 'convfirstnet[plot]'") from e
    return plt


def plot_waterline(a: Analysis, path: str | Path) -> Path:
    """Paper Fig. 15 (two waterline panels: layer-wise and block-fusion) plus Fig. 16 (max efficiency
    vs processor op:byte, waterline and roofline).

    Each kernel is a bar as wide as its minimum latency and as high as its operational intensity; both
    panels share the latency axis (so their widths compare), each has its own intensity axis, and the
    legends sit outside the axes, beside the bars they explain.
    """
    plt = _pyplot()
    dev = a.device
    fig = plt.figure(figsize=(12, 10.5))
    grid = fig.add_gridspec(3, 1, height_ratios=[1, 1, 0.9], hspace=0.55)
    t_max = max(sum(k.t_min(dev) for k in ks) for ks in (a.layerwise, a.fused)) * 1e3
    waterline_color = "#17becf"
    for i, (label, ks) in enumerate((("layer-wise", a.layerwise), ("block-fusion", a.fused))):
        ax = fig.add_subplot(grid[i])
        ymax = 1.15 * max(dev.op_byte, max(k.intensity for k in ks))
        x = 0.0
        seen = set()
        for k in ks:
            w = k.t_min(dev) * 1e3
            ax.bar(
                x,
                k.intensity,
                width=w,
                align="edge",
                color=_COLORS.get(k.kind, "k"),
                edgecolor="white",
                linewidth=0.2,
                label=k.kind if k.kind not in seen else None,
            )
            seen.add(k.kind)
            x += w
        ax.axhline(
            dev.op_byte, color=waterline_color, lw=2, label=f"waterline: {dev.name} op:byte {dev.op_byte:.0f}"
        )
        ax.text(
            t_max, dev.op_byte, f"op:byte {dev.op_byte:.0f}", ha="right", va="bottom", color=waterline_color
        )
        s = summarize(ks, dev, a.batch)
        ax.set_title(
            f"{a.model}, {label}: min latency {s.t_min_ms:.2f} ms, max efficiency {100 * s.c_max:.0f} %"
            f" (batch {a.batch}, {a.resolution}px)"
        )
        ax.set_xlim(0, t_max * 1.01)
        ax.set_ylim(0, ymax)
        ax.set_ylabel("operational intensity [OP/B]")
        ax.set_xlabel("minimum attainable latency [ms]")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax = fig.add_subplot(grid[2])
    ratios = [r for r in range(10, 801, 10)]
    for label, ks, color in (("layer-wise", a.layerwise, "#1f77b4"), ("block-fusion", a.fused, "#2ca02c")):
        w, r = zip(*(c_max_at(ks, q) for q in ratios), strict=True)
        ax.plot(ratios, [100 * v for v in w], color=color, label=f"{label}: waterline")
        ax.plot(ratios, [100 * v for v in r], color=color, ls="--", label=f"{label}: roofline (mediant)")
    ax.axvline(dev.op_byte, color=waterline_color, lw=1.5, label=f"{dev.name}: op:byte {dev.op_byte:.0f}")
    ax.set_title(f"{a.model}: maximum efficiency vs processor op:byte (peak / DRAM bandwidth)")
    ax.set_xlabel("processor op:byte [OP/B]")
    ax.set_ylabel("max efficiency [%]")
    ax.set_xlim(0, ratios[-1])
    ax.set_ylim(0, 105)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def measured_latencies(records_dir: str | Path, dev: DeviceSpec, batch: int) -> dict[str, dict]:
    """Best measured fused latency per ConvFirstNet model at ``batch`` on a device matching ``dev``,
    from benchmark JSON records (network mode). Keys are model names."""
    from .bench_devices import lookup_device

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


def plot_efficiency_gap(
    analyses: Sequence[Analysis], path: str | Path, measured: dict[str, dict] | None = None,
    static: dict[str, float] | None = None,
) -> Path:
    """Paper Fig. 1(d)/17(d): accuracy vs ideal latency, waterline minimum latencies and (when
    benchmark records exist) measured latency, log latency axis; gaps labelled with efficiency."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    dev = analyses[0].device
    series: dict[str, list] = {"ideal": [], "layer-wise bound": [], "block-fusion bound": [], "measured": []}
    for a in analyses:
        acc = TABLE4[a.model].top1
        ideal = 2 * a.macs_per_image * a.batch / (dev.peak_tflops * 1e12) * 1e3
        s = a.summaries
        series["ideal"].append((ideal, acc, a.model))
        series["layer-wise bound"].append((s["layer-wise"].t_min_ms, acc, a.model))
        series["block-fusion bound"].append((s["block-fusion"].t_min_ms, acc, a.model))
        m = (measured or {}).get(a.model)
        if m:
            series["measured"].append((m["ms_per_batch"], acc, a.model))
            eff = ideal / m["ms_per_batch"]
            ax.plot([ideal, m["ms_per_batch"]], [acc, acc], color="0.6", lw=1)
            ax.annotate(
                f"{100 * eff:.0f} %",
                (m["ms_per_batch"], acc),
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=8,
            )
    styles = {
        "ideal": ("o", "k"),
        "layer-wise bound": ("v", "#1f77b4"),
        "block-fusion bound": ("^", "#2ca02c"),
        "measured": ("s", "#d62728"),
    }
    for label, pts in series.items():
        if pts:
            mk, col = styles[label]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mk, color=col, label=label)
    # predicted ms per model from `convfirstnet kernels` reports (analysis.report.static_latencies)
    static_pts = [(static[a.model], TABLE4[a.model].top1) for a in analyses if a.model in (static or {})]
    if static_pts:
        ax.plot(*zip(*static_pts, strict=True), marker="x", color="#8c564b", ls="--",
                label="fused kernels as compiled (static estimate)")
    if dev.key.startswith("a5000") and analyses[0].batch == PAPER_BATCH:
        # the paper's own measurement (Table 4), on the paper's device
        pts = [(PAPER_BATCH / TABLE4[a.model].img_per_s * 1e3, TABLE4[a.model].top1) for a in analyses]
        ax.plot(
            *zip(*pts, strict=True), marker="D", color="#ff7f0e", ls=":", label="paper Table 4 (A5000, fused)"
        )
    for t, acc, name in series["ideal"]:
        ax.annotate(
            name.removeprefix("convfirstnet_"),
            (t, acc),
            textcoords="offset points",
            xytext=(-6, 6),
            fontsize=8,
            ha="right",
        )
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    # ticks at 1, 2, 5 x 10^k: a log axis spanning less than two decades gets several labels, not just "1"
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.08, y=0.08)
    ax.set_xlabel(f"latency per batch of {analyses[0].batch} [ms] ({dev.name}, {dev.peak_tflops:g} TFLOP/s)")
    ax.set_ylabel("ImageNet top-1 [%] (paper)")
    note = "" if series["measured"] else " - no measured records for this device yet"
    ax.set_title(f"Efficiency gap: ConvFirstNet{note}")
    ax.legend(fontsize=8, loc="lower right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="convfirstnet waterline",
        description="Waterline analysis (paper Sections 4-5): minimum latency and maximum efficiency of "
        "layer-wise vs block-fusion execution on a device.",
    )
    p.add_argument(
        "model", nargs="?", default=None, help="pico|nano|tiny|small (or convfirstnet_*); omit with --blocks"
    )
    p.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICE_KEYS)} (default h100)")
    p.add_argument("--batch", type=int, default=PAPER_BATCH, help="batch size (default 128, as the paper)")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument(
        "--bytes", type=int, default=2, dest="elem_bytes", help="bytes per element (2 = fp16/bf16)"
    )
    p.add_argument("--kernels", action="store_true", help="also print every kernel (both executions)")
    p.add_argument(
        "--blocks",
        choices=("convfirst", "mbconv", "all"),
        default=None,
        help="single blocks of the paper's Table 1/2 configurations (Fig. 8 and 12)",
    )
    p.add_argument("--plot", default=None, help="waterline PNG (layer-wise, block-fusion, op:byte sweep)")
    p.add_argument("--gap-plot", default=None, help="efficiency-gap PNG over the four sizes")
    p.add_argument(
        "--records",
        default="benchmarks/results",
        help="benchmark records for measured latency in --gap-plot (default benchmarks/results)",
    )
    p.add_argument(
        "--static-records",
        default="benchmarks/static",
        help="static cost reports (`convfirstnet kernels --json`) for --gap-plot: a folder of them or one "
        "file (default benchmarks/static); the newest report per model for this device, batch and bytes "
        "is drawn",
    )
    p.add_argument("--json", default=None, help="write the numbers as JSON here")
    p.add_argument("--markdown", default=None, help="also write the printed tables to this file")
    return p


def _analysis_json(a: Analysis) -> dict:
    return dict(
        model=a.model,
        device=asdict(a.device),
        batch=a.batch,
        resolution=a.resolution,
        elem_bytes=a.elem_bytes,
        macs_per_image=a.macs_per_image,
        summary={k: asdict(v) for k, v in a.summaries.items()},
        layerwise=[dict(asdict(k), t_min_us=k.t_min(a.device) * 1e6) for k in a.layerwise],
        fused=[dict(asdict(k), t_min_us=k.t_min(a.device) * 1e6) for k in a.fused],
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    from ._cli import run_reporting

    return run_reporting("convfirstnet waterline", lambda: run(args))


def run(args: argparse.Namespace) -> int:
    import convfirstnet  # noqa: F401
    from convfirstnet.factory import _canonical
    from convfirstnet.model import MIN_INPUT_SIZE

    from ._cli import ToolError

    dev = device_by_key(args.device)  # ValueError naming the known devices
    if args.model is None and args.blocks is None and args.gap_plot is None:
        raise ToolError("give a MODEL, --blocks or --gap-plot")
    if args.model is not None:
        _canonical(args.model)  # the block structure is known for ConvFirstNet only
    if args.batch < 1 or args.elem_bytes < 1:
        raise ToolError("--batch and --bytes must be at least 1")
    if args.resolution < MIN_INPUT_SIZE:
        raise ToolError(f"--resolution {args.resolution}: ConvFirstNet needs at least {MIN_INPUT_SIZE}")
    out: dict = {}
    text: list[str] = []
    if args.blocks:
        rows = block_wells(dev, args.blocks, args.batch, args.elem_bytes)
        text += [wells_table(rows, dev), ""]
        out["blocks"] = rows
    if args.model:
        a = analyze(args.model, dev, args.batch, args.resolution, args.elem_bytes)
        text += [summary_table(a), "", stage_table(a)]
        if args.kernels:
            for label, ks in (("layer-wise", a.layerwise), ("block-fusion", a.fused)):
                text += ["", f"{label} kernels:", "", kernel_table(ks, dev)]
        out["model"] = _analysis_json(a)
    print("\n".join(text))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(text).rstrip() + "\n")
    if args.model and args.plot:
        print(f"\nplot: {plot_waterline(a, args.plot)}")
    if args.gap_plot:
        analyses = [
            analyze(n, dev, args.batch, 256, args.elem_bytes) for n in ("pico", "nano", "tiny", "small")
        ]
        measured = measured_latencies(args.records, dev, args.batch) if Path(args.records).is_dir() else {}
        print(f"\nmeasured latencies used: {measured or 'none (no matching benchmark records)'}")
        from convfirstnet.analysis.report import static_latencies

        reports = static_latencies(args.static_records, dev.key, args.batch, 256, args.elem_bytes)
        used = {m: f"{r['predicted_ms']:.3f} ms ({r['file']})" for m, r in reports.items()}
        print(f"static estimates used: {used or 'none (no matching static cost reports)'}")
        static = {m: r["predicted_ms"] for m, r in reports.items()}
        print(f"plot: {plot_efficiency_gap(analyses, args.gap_plot, measured, static=static)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
