"""Waterline model: one layer by hand, totals against count_macs, the paper's figures, plots, CLI."""

import json

import pytest

from convfirstnet.profile import count_macs
from convfirstnet.tools import waterline
from convfirstnet.tools.bench_devices import device_by_key

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


def test_totals_match_count_macs(pico):
    from convfirstnet import create_model

    macs = count_macs(create_model("pico"), (3, 128, 128))
    assert pico.macs_per_image == macs
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
    text = waterline.summary_table(pico)
    assert "| layer-wise | " in text and "| block-fusion | " in text and "op:byte 295" in text
    assert "| stage1 |" in waterline.stage_table(pico)
    assert "| stages.0.0.conv_expand | pointwise |" in waterline.kernel_table(pico.layerwise, H100)


def test_plots(pico, tmp_path):
    pytest.importorskip("matplotlib")
    png = waterline.plot_waterline(pico, tmp_path / "w.png")
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
    gap = waterline.plot_efficiency_gap([pico], tmp_path / "gap.png", measured)
    assert gap.read_bytes()[:4] == b"\x89PNG"


def test_cli(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert (
        waterline.main(["pico", "--device", "a100", "--batch", "8", "--resolution", "64", "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "convfirstnet_pico @ 64x64, batch 8" in text and "| stage5 |" in text
    data = json.loads(out.read_text())["model"]
    assert data["device"]["key"] == "a100" and len(data["fused"]) == 31
    assert waterline.main(["pico", "--device", "tpu"]) == 2
    assert waterline.main([]) == 2
    assert waterline.main(["resnet50"]) == 2  # the block structure is known for ConvFirstNet only
