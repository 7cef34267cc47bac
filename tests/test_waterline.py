"""Waterline model: one layer by hand, totals against count_macs, the paper's figures, plots, CLI."""

import json
import sys

import pytest

from convfirstnet.profile import count_macs
from convfirstnet.analysis import waterline
from convfirstnet.analysis.devices import device_by_key
from convfirstnet.commands import waterline as waterline_command

H100 = device_by_key("h100")
A5000_PAPER = device_by_key("a5000-paper")


@pytest.fixture(scope="module")
def pico():
    return waterline.analyze("pico", "h100", batch=128, resolution=128)


def _kernel(kernels, name):
    return next(k for k in kernels if k.name == name)


def test_one_layer_by_hand(pico):
    # Pico stage 1 at a 128x128 input: ConvFirst(16, t=3) on 64x64 maps; expand 1x1 16 -> 48, batch 128, fp16
    p = 128 * 64 * 64
    k = _kernel(pico.layerwise, "stages.0.0.conv_expand")
    assert k.kind == "pointwise" and k.stage == "stage1"
    assert k.macs == p * 16 * 48
    assert k.bytes == 2 * (p * 16 + p * 48 + 48 * 16 + 48)  # input, output, weights, folded bias
    assert k.intensity == pytest.approx(2 * p * 16 * 48 / k.bytes)
    t = max(k.ops / 989.4e12, k.bytes / 3.35e12)
    assert k.t_min(H100) == pytest.approx(t) and k.memory_bound(H100)
    # the projection reads the residual too
    proj = _kernel(pico.layerwise, "stages.0.0.conv_project")
    assert proj.bytes == 2 * (p * 48 + p * 16 + p * 16 + 16 * 48 + 16)
    # block fusion: the whole block reads its input and writes its output once
    fused = _kernel(pico.fused, "stages.0.0")
    weights = (16 * 8 * 9 + 16) + (48 * 16 + 48) + (16 * 48 + 16)
    assert fused.kind == "convfirst-fused" and fused.bytes == 2 * (2 * p * 16 + weights)
    assert fused.macs == p * (16 * 8 * 9 + 2 * 16 * 48)


def macs_by_hand(size: str, res: int, num_classes: int = 1000) -> int:
    """MACs per image of a ConvFirstNet, from the SPEC's block definitions and the size table alone:
    grouped 3x3 convs have group width 8 (8 x 9 MACs per output), BlurPool is a depth-wise 3x3 stride-2
    filter (9 MACs per output), SE reduces to C/4 of the block input channels, spatial sizes halve at
    every stride-2 stage."""
    from convfirstnet.registry import SIZES

    spec = SIZES[size]
    h = res // 2
    macs = h * h * spec.stem * 3 * 9  # stem: dense 3x3, stride 2
    c = spec.stem
    for st in spec.stages:
        for j in range(st.depth):
            stride, k = (st.stride if j == 0 else 1), st.channels
            if st.block == "convfirst":
                hid = st.expansion * c
                macs += h * h * c * 8 * 9  # grouped conv at the input resolution
                if stride == 2:
                    h //= 2
                    macs += h * h * 2 * c * 9  # BlurPool of cat([x, y])
                    macs += h * h * (2 * c * hid + hid * k)  # FFN on the concatenation
                else:
                    macs += h * h * (c * hid + hid * k)
            else:
                hid = st.expansion * c
                macs += h * h * (c * hid + hid * 8 * 9)  # expand, grouped conv (input resolution)
                if stride == 2:
                    h //= 2
                    macs += h * h * hid * 9  # BlurPool
                macs += 2 * hid * (c // 4)  # Squeeze-Excite MLP on the pooled vector
                macs += h * h * hid * k  # project
            c = k
    return macs + h * h * c * 1280 + 1280 * num_classes  # head 1x1 conv, classifier


def test_cost_by_hand_matches_the_documented_table():
    """The hand count reproduces the GMACs at 256x256 of docs/models.md and SPEC: it can be the reference."""
    for size, gmacs in (("pico", 0.863), ("nano", 1.816), ("tiny", 3.230), ("small", 5.498)):
        assert round(macs_by_hand(size, 256) / 1e9, 3) == gmacs


def test_totals_match_count_macs(pico):
    from convfirstnet import create_model

    macs = count_macs(create_model("pico"), (3, 128, 128))
    assert pico.macs_per_image == macs_by_hand("pico", 128) == macs  # an independent count
    assert sum(k.macs for k in pico.layerwise) == 128 * macs
    assert sum(k.macs for k in pico.fused) == 128 * macs
    s = pico.summaries
    assert s["layer-wise"].gops == pytest.approx(2 * 128 * macs / 1e9)
    assert s["block-fusion"].dram_gb < s["layer-wise"].dram_gb / 5
    assert s["block-fusion"].t_min_ms < s["layer-wise"].t_min_ms
    # C_max = N / (T_min R); the op:byte sweep agrees with the summary at the device's own ratio
    for label, ks in (("layer-wise", pico.layerwise), ("block-fusion", pico.fused)):
        c, roof = waterline.c_max_at(ks, H100.op_byte)
        assert c == pytest.approx(s[label].c_max) and roof == pytest.approx(s[label].roofline_c_max)
        assert c <= roof + 1e-12  # roofline (mediant) never underestimates


def test_block_count_and_stages(pico):
    # stem + 1 + 2 + 3 + 11 + 11 blocks + head + classifier
    assert len(pico.fused) == 1 + 28 + 2
    assert {k.stage for k in pico.layerwise} == {
        "stem",
        "stage1",
        "stage2",
        "stage3",
        "stage4",
        "stage5",
        "head",
    }
    kinds = {k.kind for k in pico.layerwise}
    assert {"conv", "pointwise", "grouped", "pool/cat/multiply", "linear"} <= kinds


# The paper's Fig. 8 and Fig. 12 (minimum latencies in microseconds, layer-wise and block-fusion,
# A5000 at its benchmark clocks, batch 128, fp16), read from the figures' labels.
PAPER_WELLS = {
    ("convfirst", 16, 3, 128): (1538, 280),
    ("convfirst", 32, 3, 128): (3076, 559),
    ("convfirst", 32, 6, 64): (1188, 199),
    ("convfirst", 48, 6, 64): (1783, 425),
    ("convfirst", 64, 6, 64): (2377, 735),
    ("convfirst", 48, 6, 32): (446, 106),
    ("convfirst", 64, 6, 32): (594, 184),
    ("convfirst", 96, 6, 32): (892, 402),
    ("mbconv", 128, 4, 16): (544, 144),
    ("mbconv", 144, 4, 16): (612, 178),
    ("mbconv", 160, 4, 16): (680, 215),
    ("mbconv", 192, 4, 16): (816, 300),
    ("mbconv", 256, 4, 16): (1150, 512),
    ("mbconv", 128, 4, 8): (137, 36),
    ("mbconv", 144, 4, 8): (155, 45),
    ("mbconv", 160, 4, 8): (172, 54),
    ("mbconv", 192, 4, 8): (207, 75),
    ("mbconv", 256, 4, 8): (290, 128),
}


def test_reproduces_paper_block_wells():
    rows = waterline.block_wells(A5000_PAPER, "all")
    assert len(rows) == len(PAPER_WELLS)
    for r in rows:
        layer, fused = PAPER_WELLS[(r["block"], r["channels"], r["expansion"], r["size"])]
        assert r["layerwise_us"] == pytest.approx(layer, abs=1.0), r
        assert r["fused_us"] == pytest.approx(fused, abs=1.5), r


def test_small_matches_paper_fig15():
    # paper 6.2: ConvFirstNet-Small on the A5000, max efficiency 36 % layer-wise, 97 % block-fusion
    a = waterline.analyze("small", A5000_PAPER)
    s = a.summaries
    assert s["layer-wise"].c_max == pytest.approx(0.36, abs=0.015)
    assert s["block-fusion"].c_max == pytest.approx(0.97, abs=0.01)


def test_markdown_tables(pico):
    text = waterline_command.summary_table(pico)
    assert "| layer-wise | " in text and "| block-fusion | " in text and "op:byte 295" in text
    assert "| stage1 |" in waterline_command.stage_table(pico)
    assert "| stages.0.0.conv_expand | pointwise |" in waterline_command.kernel_table(pico.layerwise, H100)


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures the plot functions draw, kept when they close them."""
    plt = pytest.importorskip("matplotlib.pyplot")
    kept = []
    close = plt.close

    def keep(fig=None):
        kept.append(fig)
        return close(fig)

    monkeypatch.setattr(plt, "close", keep)
    return kept


def _bars(ax):
    from matplotlib.patches import Rectangle

    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_width() > 0]


def _renderer(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the closed figure gets a canvas again
    canvas.draw()
    return canvas.get_renderer()


def _inside(ax, artist, fig) -> bool:
    """Whether ``artist``'s box on the canvas overlaps the axes' plotting area."""
    renderer = _renderer(fig)
    return artist.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


def test_waterline_plot_shows_every_bar_with_labels(pico, tmp_path, figures):
    from PIL import Image

    png = waterline_command.plot_waterline(pico, tmp_path / "w.png")
    assert Image.open(png).size[0] > 1000  # a real image, as wide as the figure
    fig = figures[-1]
    layer_ax, fused_ax, sweep_ax = fig.axes
    for ax, kernels in ((layer_ax, pico.layerwise), (fused_ax, pico.fused)):
        bars = _bars(ax)
        assert len(bars) == len(kernels)
        top = max(b.get_y() + b.get_height() for b in bars)
        assert top == pytest.approx(max(k.intensity for k in kernels))  # the true height, not clipped
        assert top < ax.get_ylim()[1]  # and inside the axes
        assert not _inside(ax, ax.get_legend(), fig)  # the legend covers no bar
    # each panel's intensity axis fits its own bars: the layer-wise one is not squashed by the fused one's
    assert layer_ax.get_ylim()[1] < 0.5 * fused_ax.get_ylim()[1]
    assert sweep_ax.get_title() and "op:byte" in sweep_ax.get_title()
    labels = [t.get_text() for t in sweep_ax.get_legend().get_texts()]
    assert any(f"op:byte {H100.op_byte:.0f}" in t for t in labels)  # the device's vertical line is named


def test_efficiency_gap_plot_labels_the_latency_axis(pico, tmp_path, figures):
    gap = waterline_command.plot_efficiency_gap([pico], tmp_path / "gap.png", None)
    fig = figures[-1]
    ax = fig.axes[0]
    _renderer(fig)
    lo, hi = ax.get_xlim()
    shown = [t.get_text() for t in ax.get_xticklabels() if t.get_text() and lo <= t.get_position()[0] <= hi]
    assert len(shown) >= 3, shown  # a log axis within about a decade gets 1-2-5 labels, not one lone label
    assert gap.is_file()


def test_plots(pico, tmp_path, figures):
    png = waterline_command.plot_waterline(pico, tmp_path / "w.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rec = dict(
        mode="network",
        device=dict(type="cuda", name="NVIDIA H100 80GB HBM3"),
        results=[
            dict(
                model="convfirstnet_pico",
                backend="fused",
                batch=128,
                resolution=256,
                status="ok",
                ms_per_batch=9.0,
            ),
            dict(
                model="convfirstnet_pico",
                backend="fused-cudagraph",
                batch=128,
                resolution=256,
                status="ok",
                ms_per_batch=8.0,
            ),
            dict(
                model="convfirstnet_pico",
                backend="inductor",
                batch=128,
                resolution=256,
                status="ok",
                ms_per_batch=1.0,
            ),
        ],
    )
    (tmp_path / "r.json").write_text(json.dumps(rec))
    measured = waterline.measured_latencies(tmp_path, H100, 128)
    assert measured["convfirstnet_pico"]["ms_per_batch"] == 8.0
    assert waterline.measured_latencies(tmp_path, device_by_key("a100"), 128) == {}
    gap = waterline_command.plot_efficiency_gap([pico], tmp_path / "gap.png", measured)
    assert gap.read_bytes()[:4] == b"\x89PNG"
    ax = figures[-1].axes[0]
    red = next(line for line in ax.get_lines() if line.get_label() == "measured")
    assert list(red.get_xdata()) == [8.0]  # the faster of the two fused records
    ideal = 2 * pico.macs_per_image * 128 / 989.4e12 * 1e3
    assert any(t.get_text() == f"{100 * ideal / 8.0:.0f} %" for t in ax.texts)  # labelled with its efficiency


def test_cli(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert (
        waterline_command.main(["pico", "--device", "a100", "--batch", "8", "--resolution", "64", "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "convfirstnet_pico @ 64x64, batch 8" in text and "| stage5 |" in text
    data = json.loads(out.read_text())["model"]
    assert data["device"]["key"] == "a100" and len(data["fused"]) == 31
    for argv, message in (
        (["pico", "--device", "tpu"], "unknown device 'tpu'"),
        ([], "give a MODEL, --blocks or --gap-plot"),
        (["resnet50"], "unknown model 'resnet50'"),  # the block structure is known for ConvFirstNet only
        (["pico", "--resolution", "16"], "needs at least 32"),
    ):
        assert waterline_command.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("convfirstnet waterline: error: ") and err.count("\n") == 1 and message in err


def test_plot_errors_come_before_any_output(tmp_path, capsys, monkeypatch):
    """Without matplotlib, --plot / --gap-plot end with one line before any table is printed or file
    written; --plot without a model is refused the same way."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    for flag in ("--plot", "--gap-plot"):
        argv = ["pico", "--resolution", "64", flag, str(tmp_path / "w.png"), "--json", str(tmp_path / "w.json")]
        assert waterline_command.main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and not list(tmp_path.iterdir())
        assert err == "convfirstnet waterline: error: plots need matplotlib: pip install 'convfirstnet[plot]'\n"
    assert waterline_command.main(["--blocks", "all", "--plot", str(tmp_path / "w.png")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "--plot draws one model: give a MODEL" in err
