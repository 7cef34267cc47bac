"""Training form, timm conventions, the fused inference form and torch.compile (CPU)."""

from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn

import convfirstnet
from convfirstnet.blocks import FusedConvFirst, FusedHead, FusedMBConv, FusedStem
from convfirstnet.model import PAPER, SIZES
from convfirstnet.profile import count_macs, count_params

from ._models import rel_err, trained_like

NAMES = convfirstnet.list_models()
README = Path(__file__).resolve().parent.parent / "README.md"


def test_registry():
    assert sorted(timm.list_models("convfirstnet*")) == sorted(NAMES)
    assert NAMES == [f"convfirstnet_{s}" for s in ("pico", "nano", "tiny", "small")]
    model = timm.create_model("convfirstnet_pico")
    assert isinstance(model, convfirstnet.ConvFirstNet)
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (3, 256, 256) and cfg["interpolation"] == "bicubic"
    assert cfg["first_conv"] == "stem.conv" and cfg["classifier"] == "classifier"
    assert cfg["mean"] == timm.data.IMAGENET_DEFAULT_MEAN and 0 < cfg["crop_pct"] <= 1
    assert isinstance(model.get_submodule(cfg["first_conv"]), nn.Conv2d)
    assert isinstance(model.get_submodule(cfg["classifier"]), nn.Linear)


def test_unknown_name_lists_models():
    with pytest.raises(ValueError, match="convfirstnet_pico, convfirstnet_nano, convfirstnet_tiny, convfirstnet_small"):
        convfirstnet.create_model("convfirstnet_huge")


@pytest.mark.parametrize("size", list(SIZES))
def test_params_and_macs_match_paper(size):
    model = getattr(convfirstnet, size)()
    params = count_params(model) / 1e6
    gmacs = count_macs(model, (3, 256, 256)) / 1e9
    assert params == pytest.approx(PAPER[size]["params_m"], rel=0.005)
    assert gmacs == pytest.approx(PAPER[size]["gmacs"], rel=0.005)
    # The README's table states these same figures.
    paper = PAPER[size]
    row = f"| convfirstnet_{size} | {params:.3f} | {paper['params_m']:g} | {gmacs:.3f} | {paper['gmacs']:g} | {paper['top1']:g} |"
    assert row in README.read_text()


def test_architecture_rows():
    """Table 3 as built: stage widths, depths, block kinds and strides; SE width 0.25 of block input."""
    model = convfirstnet.small()
    widths = [info["num_chs"] for info in model.feature_info]
    assert widths == [32, 64, 96, 256, 256]
    assert [info["reduction"] for info in model.feature_info] == [2, 4, 8, 16, 32]
    assert [len(s) for s in model.stages] == [2, 5, 6, 18, 18]
    first_mb = model.stages[3][0]
    assert first_mb.stride == 2 and first_mb.conv_expand.out_channels == 4 * 96
    assert first_mb.se.fc1.out_channels == 24 and first_mb.conv_dw.groups == 4 * 96 // 8
    cf2 = model.stages[1][0]
    assert cf2.conv_expand.in_channels == 64 and cf2.conv_expand.out_channels == 6 * 32  # concat, R = tC


def test_timm_interface():
    model = timm.create_model("convfirstnet_pico", num_classes=10, drop_rate=0.2, drop_path_rate=0.1).eval()
    x = torch.randn(2, 3, 64, 96)
    feats = model.forward_features(x)
    assert feats.shape == (2, model.num_features, 2, 3) and model.num_features == 128
    assert model.forward_head(feats, pre_logits=True).shape == (2, model.head_hidden_size)
    assert model(x).shape == (2, 10)
    assert model.get_classifier().out_features == 10
    model.reset_classifier(5)
    assert model(x).shape == (2, 5)
    model.reset_classifier(0)
    assert model(x).shape == (2, 1280)
    assert model.no_weight_decay() == set()
    groups = timm.models.group_parameters(model, model.group_matcher())
    assert len(groups) > 5 and sum(len(v) for v in groups.values()) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(5, global_pool="max")


def test_in_chans_and_features_only():
    model = timm.create_model("convfirstnet_pico", in_chans=1).eval()
    assert model(torch.randn(1, 1, 64, 64)).shape == (1, 1000)
    fmodel = timm.create_model("convfirstnet_nano", features_only=True).eval()
    outs = fmodel(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [24, 48, 64, 160, 160]
    assert [o.shape[-1] for o in outs] == [32, 16, 8, 4, 2]
    assert fmodel.feature_info.reduction() == [2, 4, 8, 16, 32]


def test_training_backward_drop_path_and_checkpointing():
    model = convfirstnet.pico(drop_path_rate=0.2, drop_rate=0.2).train()
    assert any(type(m).__name__ == "DropPath" for m in model.modules())
    model.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 32, 32)
    loss = model(x).logsumexp(dim=1).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    "name, shape",
    [(n, (1, 3, 67, 45)) for n in NAMES] + [("convfirstnet_pico", (3, 3, 96, 64))],
)
def test_fused_matches_training_form(name, shape):
    """Batch 1 and sizes that are not multiples of 32 (odd maps at every stride-2 block)."""
    model = trained_like(name)
    fused = convfirstnet.fuse(model)
    x = torch.randn(shape)
    with torch.no_grad():
        ref, out = model(x), fused(x)
        assert rel_err(out, ref) < 1e-5
        # The same inference form through timm's generic re-parameterisation.
        assert rel_err(timm.utils.reparameterize_model(model).eval()(x), ref) < 1e-5


def test_fused_structure_and_layout():
    fused = convfirstnet.fuse(trained_like("pico"))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    assert isinstance(fused.stem, FusedStem) and isinstance(fused.head, FusedHead)
    kinds = [type(b) for stage in fused.stages for b in stage]
    assert kinds.count(FusedConvFirst) == 6 and kinds.count(FusedMBConv) == 22
    assert not fused.training
    feats = fused.forward_features(torch.randn(1, 3, 64, 64))  # NCHW in ...
    assert feats.is_contiguous(memory_format=torch.channels_last)  # ... NHWC activations out
    nhwc = torch.randn(1, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    assert fused(nhwc).shape == (1, 1000)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_models(dtype):
    model = trained_like("pico")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        fused = convfirstnet.fuse(model).to(dtype)
        out = fused(x.to(dtype))
        assert out.dtype == dtype
        # fp16 / bf16 weights and activations between blocks: ~1e-3 / ~1e-2 relative per rounding.
        assert rel_err(out, ref) < (2e-2 if dtype == torch.float16 else 8e-2)
        assert convfirstnet.fuse(model.to(dtype))(x.to(dtype)).dtype == dtype  # folding a low-precision model


def test_autocast():
    model = trained_like("pico")
    fused = convfirstnet.fuse(model)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused(x)
        ref = model(x)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref.float()) < 8e-2


def test_bad_input_errors():
    fused = convfirstnet.fuse(trained_like("pico"))
    with pytest.raises(ValueError, match="4-D"):
        fused(torch.randn(3, 64, 64))
    with pytest.raises(ValueError, match="3 input channels, got 4"):
        fused(torch.randn(1, 4, 64, 64))
    with pytest.raises(ValueError, match="at least 32x32"):
        fused(torch.randn(1, 3, 16, 64))
    with pytest.raises(TypeError, match="dtype"):
        fused(torch.randn(1, 3, 64, 64).half())  # fp16 input, fp32 weights
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        fused(torch.zeros(1, 3, 64, 64, dtype=torch.int32))


def test_op_errors_name_the_problem():
    block = convfirstnet.fuse(trained_like("pico")).stages[0][0]
    w = [getattr(block, n) for n in block.weight_names]
    op = torch.ops.convfirstnet.convfirst
    with pytest.raises(ValueError, match="has 24 channels, the block expects 16"):
        op(torch.randn(1, 24, 8, 8), *w, 1)
    with pytest.raises(ValueError, match="is on meta"):
        op(torch.randn(1, 16, 8, 8), *[t.to("meta") for t in w], 1)
    with pytest.raises(ValueError, match="stride must be 1 or 2"):
        op(torch.randn(1, 16, 8, 8), *w, 3)


@pytest.mark.parametrize("block_idx", [(0, 0), (1, 0), (3, 0), (3, 1)])
def test_opcheck(block_idx):
    stage, i = block_idx
    block = convfirstnet.fuse(trained_like("pico")).stages[stage][i]
    c = block.weight_names and getattr(block, block.weight_names[0])
    c_in = c.shape[0] if stage < 3 else c.shape[1]
    x = torch.randn(2, c_in, 9, 7).contiguous(memory_format=torch.channels_last)
    op = torch.ops.convfirstnet.convfirst if stage < 3 else torch.ops.convfirstnet.mbconv
    args = (x, *[getattr(block, n) for n in block.weight_names], block.stride)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_compile_fullgraph_cpu():
    fused = convfirstnet.fuse(trained_like("pico"))
    x = torch.randn(2, 3, 64, 80)
    seen = []

    def capture(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    with torch.no_grad():
        torch.compile(fused, backend=capture, fullgraph=True)(x)
        # fullgraph=True raises on any graph break; the block ops appear in the captured graph.
        assert {"convfirstnet.stem", "convfirstnet.convfirst", "convfirstnet.mbconv", "convfirstnet.head"} <= set(seen)
        eager = fused(x)
        compiled = torch.compile(fused, fullgraph=True)(x)
    # Inductor on CPU re-associates the fp32 convolutions: same function, rounding-level differences.
    assert rel_err(compiled, eager) < 1e-5


def test_batch_zero_and_one():
    fused = convfirstnet.fuse(trained_like("pico"))
    with torch.no_grad():
        assert fused(torch.randn(0, 3, 64, 64)).shape == (0, 1000)
        assert fused(torch.randn(1, 3, 33, 47)).shape == (1, 1000)
