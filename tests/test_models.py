"""Training form, timm conventions, the fused inference form and torch.compile (CPU)."""

import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn as nn

import convfirstnet
from convfirstnet.blocks import (
    ConvFirst,
    FusedConvFirst,
    FusedHead,
    FusedMBConv,
    FusedStem,
    Head,
    MBConv,
    NonFiniteInputWarning,
    Stem,
    finite_check_enabled,
)
from convfirstnet.registry import PAPER, SIZES
from convfirstnet.profile import count_macs, count_params

from ._models import rel_err, trained_like

NAMES = convfirstnet.list_models()
README = Path(__file__).resolve().parent.parent / "README.md"
MODELS_DOC = README.parent / "docs" / "models.md"


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
    # docs/models.md and the README state these same figures.
    paper = PAPER[size]
    row = f"| convfirstnet_{size} | {params:.3f} | {paper['params_m']:g} | {gmacs:.3f} | {paper['gmacs']:g} | {paper['top1']:g} |"
    assert row in MODELS_DOC.read_text()
    assert f"| convfirstnet_{size} | {params:.3f} | {gmacs:.3f} | {paper['top1']:g} |" in README.read_text()


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


@pytest.mark.parametrize("form", ["training", "fused"])
def test_forward_intermediates_equal_features_only(form, one_thread):
    model = trained_like("pico")
    features = trained_like("pico", features_only=True)  # same seed: the same stem and stages
    if form == "fused":
        model, features = convfirstnet.fuse(model), convfirstnet.fuse(features)
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        expected = features(x)
        final, inter = model.forward_intermediates(x)
        assert len(inter) == 5 and all(torch.equal(a, b) for a, b in zip(inter, expected))
        assert torch.equal(final, model.forward_features(x))
        assert [t.shape[1] for t in inter] == [i["num_chs"] for i in model.feature_info]
        assert [64 // t.shape[2] for t in inter] == [i["reduction"] for i in model.feature_info]
        picked = model.forward_intermediates(x, indices=[0, -2], intermediates_only=True)
        assert [torch.equal(a, b) for a, b in zip(picked, (expected[0], expected[3]))] == [True, True]
        last2 = model.forward_intermediates(x, indices=2, intermediates_only=True)
        assert torch.equal(last2[0], expected[3]) and torch.equal(last2[1], expected[4])
        final, early = model.forward_intermediates(x, indices=[1], stop_early=True)
        assert torch.equal(early[0], expected[1]) and torch.equal(final, expected[1])  # stages 2-4 not run
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NHWC")
    with pytest.raises(AssertionError, match="out of range"):
        model.forward_intermediates(x, indices=[5])


def test_prune_intermediate_layers(one_thread):
    model = trained_like("pico")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model.forward_intermediates(x, intermediates_only=True)
        kept = model.prune_intermediate_layers(indices=[1, 2])
        assert kept == [1, 2] and len(model.stages) == 3 and model.num_features == 48
        assert isinstance(model.head, nn.Identity) and model.num_classes == 0
        final, inter = model.forward_intermediates(x, indices=[1, 2])
        assert torch.equal(inter[0], expected[1]) and torch.equal(inter[1], expected[2])
        assert torch.equal(model(x), expected[2])  # forward_head passes the map through
    full = trained_like("pico")
    full.prune_intermediate_layers(indices=1, prune_head=False)  # last stage kept: head and classifier stay
    assert len(full.stages) == 5 and full.num_classes == 1000 and full(x).shape == (1, 1000)


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


# Unit roundoff of the storage dtypes (half the gap between 1 and the next number).
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_models(dtype):
    model = trained_like("pico")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        fused = convfirstnet.fuse(model).to(dtype)
        out = fused(x.to(dtype))
        assert out.dtype == dtype
        # The ops compute in fp32; what differs from the fp32 model is rounding to `dtype` of the input,
        # the folded weights and each block's output, once each. Those errors do not compound (every
        # block sees a ~u-relative perturbation of its input): measured 1.1 u on the logits for both
        # dtypes, over 4 seeds. 3 u bounds that; a wrong cast or an fp16 accumulation would exceed it.
        assert rel_err(out, ref) < 3 * UNIT_ROUNDOFF[dtype]
        assert convfirstnet.fuse(model.to(dtype))(x.to(dtype)).dtype == dtype  # folding a low-precision model


def test_autocast():
    model = trained_like("pico")
    fused = convfirstnet.fuse(model)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)  # fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused(x)
            ref_autocast = model(x)
    assert out.dtype == torch.bfloat16
    # As above: bf16 rounding of input, weights and block outputs; measured 1.25 u against fp32, and
    # 1.7 u against the training form under autocast (both sides rounded), over 4 seeds.
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert rel_err(out, ref) < 3 * u
    assert rel_err(out, ref_autocast.float()) < 4 * u


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
    with pytest.raises(TypeError, match="floating-point"):
        fused(torch.zeros(1, 3, 64, 64, dtype=torch.int32))


@pytest.mark.parametrize("form", ["training", "fused"])
def test_input_type_errors(form):
    """What users pass by mistake gets a TypeError saying what is expected, in both forms."""
    model = trained_like("pico")
    model = convfirstnet.fuse(model) if form == "fused" else model
    with pytest.raises(TypeError, match=r"expects a torch.Tensor .* got numpy.ndarray; convert it with torch.from_"):
        model(np.zeros((1, 3, 64, 64), dtype=np.float32))
    with pytest.raises(TypeError, match=r"floating-point image batch .* got torch.uint8"):
        model(torch.zeros(1, 3, 64, 64, dtype=torch.uint8))  # a decoded image, not converted
    with pytest.raises(TypeError, match="input dtype torch.float64 differs from the model's torch.float32"):
        model(torch.zeros(1, 3, 64, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="input is on meta but the model is on cpu"):
        model(torch.zeros(1, 3, 64, 64, device="meta"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_classes=-1), r"num_classes must be an integer >= 0 \(0: no classifier\), got -1"),
        (dict(drop_path_rate=1.0), r"drop_path_rate must be in \[0, 1\), got 1.0"),
        (dict(drop_path_rate=-0.1), r"drop_path_rate must be in \[0, 1\), got -0.1"),
        (dict(drop_rate=1.0), r"drop_rate must be in \[0, 1\), got 1.0"),
        (dict(in_chans=0), "in_chans must be at least 1, got 0"),
    ],
)
def test_model_arguments_are_checked(kwargs, message):
    """Arguments that cannot make a model are refused where the model is built, by every entry point."""
    for build in (convfirstnet.pico, lambda **kw: timm.create_model("convfirstnet_pico", **kw)):
        with pytest.raises(ValueError, match=message):
            build(**kwargs)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 0"):
        convfirstnet.pico(num_classes=0).reset_classifier(-5)


def test_fuse_refuses_a_model_without_convfirstnet_blocks():
    with pytest.raises(TypeError, match=r"takes a ConvFirstNet .* got timm.models.resnet.ResNet"):
        convfirstnet.fuse(timm.create_model("resnet10t"))
    with pytest.raises(TypeError, match="got builtins.str"):
        convfirstnet.fuse("convfirstnet_pico")
    # a module built from its blocks fuses (the benchmark's block stages), and fusing is idempotent
    stage = nn.Sequential(ConvFirst(32, 32, 1, 3))
    assert isinstance(convfirstnet.fuse(stage)[0], FusedConvFirst)
    assert isinstance(convfirstnet.fuse(convfirstnet.fuse(stage))[0], FusedConvFirst)


@pytest.mark.parametrize("form", ["training", "fused"])
def test_non_finite_input_warns_once_per_model(form, monkeypatch):
    """NaN/Inf in the input: one NonFiniteInputWarning per model (checked on CPU tensors; the output is
    left as computed, NaN for those images), none for finite inputs."""
    monkeypatch.delenv("CONVFIRSTNET_CHECK_FINITE", raising=False)
    model = trained_like("pico")
    model = convfirstnet.fuse(model) if form == "fused" else model.eval()
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # finite: no warning
    x[1, 0, 5, 5] = float("inf")
    with pytest.warns(NonFiniteInputWarning, match="NaN or Inf values .*warned once per model") as record:
        out = model(x)
        model(x)
    assert len(record) == 1
    assert torch.isfinite(out[0]).all() and not torch.isfinite(out[1]).all()
    with pytest.warns(NonFiniteInputWarning):  # another model warns on its own
        trained_like("pico").eval()(x)


def test_non_finite_check_placement(monkeypatch):
    """Where the check runs: CPU tensors by default (on a GPU the branch would make the host wait on
    every forward and cannot be captured in a CUDA graph), every device with CONVFIRSTNET_CHECK_FINITE=1,
    never on meta tensors or while compiling."""
    monkeypatch.delenv("CONVFIRSTNET_CHECK_FINITE", raising=False)
    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")
    assert finite_check_enabled(cpu) and not finite_check_enabled(meta)
    monkeypatch.setenv("CONVFIRSTNET_CHECK_FINITE", "1")
    assert finite_check_enabled(cpu) and not finite_check_enabled(meta)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not finite_check_enabled(cpu)
    monkeypatch.undo()
    # inside torch.func transforms (per-sample gradients with vmap) the check stays out of the way
    model, x = trained_like("pico").eval(), torch.randn(2, 1, 3, 32, 32)
    x[1, 0, 0, 0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch.func.vmap(model)(x)
    with torch.no_grad():
        assert rel_err(out[0], model(x[0])) < 1e-5  # vmap batches the convolutions: rounding differs


def test_features_only_checks_input():
    """timm's features_only wrapper calls the stem and stages directly; the stem checks the input."""
    fmodel = timm.create_model("convfirstnet_pico", features_only=True).eval()
    for m in (fmodel, convfirstnet.fuse(fmodel)):
        with pytest.raises(ValueError, match="at least 32x32, got 16x16"):
            m(torch.randn(1, 3, 16, 16))
        with pytest.raises(TypeError, match="numpy.ndarray"):
            m(np.zeros((1, 3, 64, 64), dtype=np.float32))


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


def _block_op_args(block: nn.Module, c_in: int, requires_grad: bool = True):
    """The op and arguments of a fused block on a small NHWC input (weights as the block holds them)."""
    kind = type(block).__name__.removeprefix("Fused").lower()
    x = torch.randn(2, c_in, 9, 7).contiguous(memory_format=torch.channels_last).requires_grad_(requires_grad)
    args = (x, *[getattr(block, n) for n in block.weight_names])
    stride = (block.stride,) if kind in ("convfirst", "mbconv") else ()
    return getattr(torch.ops.convfirstnet, kind), args + stride


# (module path in the fused pico, input channels): every op, both strides of the two block kinds.
OP_BLOCKS = [
    ("stem", 3), ("stages.0.0", 16), ("stages.1.0", 16), ("stages.3.0", 48), ("stages.3.1", 128), ("head", 128)
]


@pytest.mark.parametrize("path, c_in", OP_BLOCKS)
def test_opcheck(path, c_in, one_thread):
    """Schema, fake tensors, autograd registration and AOT dispatch (forward and backward) of each op,
    with inputs and weights that require grad."""
    block = convfirstnet.fuse(trained_like("pico")).get_submodule(path)
    op, args = _block_op_args(block, c_in)
    assert all(a.requires_grad for a in args if isinstance(a, torch.Tensor))
    torch.library.opcheck(op, args)  # all of opcheck's tests


def _rand64(*shape):
    return (0.5 * torch.randn(*shape, dtype=torch.float64)).requires_grad_(True)


# op, arguments (fp64, small: gradcheck perturbs every element), stride
GRADCHECK_CASES = {
    "stem": lambda: ("stem", (_rand64(1, 3, 5, 6), _rand64(8, 3, 3, 3), _rand64(8))),
    "convfirst-s1": lambda: ("convfirst", (_rand64(1, 8, 5, 4), _rand64(8, 8, 3, 3), _rand64(8),
                                           _rand64(16, 8), _rand64(16), _rand64(8, 16), _rand64(8), 1)),
    "convfirst-s2": lambda: ("convfirst", (_rand64(1, 8, 5, 4), _rand64(8, 8, 3, 3), _rand64(8),
                                           _rand64(16, 16), _rand64(16), _rand64(16, 16), _rand64(16), 2)),
    "mbconv-s1": lambda: ("mbconv", (_rand64(1, 8, 4, 4), _rand64(16, 8), _rand64(16), _rand64(16, 8, 3, 3),
                                     _rand64(16), _rand64(2, 16), _rand64(2), _rand64(16, 2), _rand64(16),
                                     _rand64(8, 16), _rand64(8), 1)),
    "mbconv-s2": lambda: ("mbconv", (_rand64(1, 8, 5, 3), _rand64(16, 8), _rand64(16), _rand64(16, 8, 3, 3),
                                     _rand64(16), _rand64(2, 16), _rand64(2), _rand64(16, 2), _rand64(16),
                                     _rand64(16, 16), _rand64(16), 2)),
    "head": lambda: ("head", (_rand64(2, 8, 3, 4), _rand64(12, 8), _rand64(12))),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_fp64(case, one_thread):
    """The registered backward against finite differences, for the input and every weight and bias (fp64
    runs the PyTorch reference; odd sizes exercise the BlurPool reflection)."""
    torch.manual_seed(0)
    kind, args = GRADCHECK_CASES[case]()
    op = getattr(torch.ops.convfirstnet, kind)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    consts = args[len(tensors):]
    assert torch.autograd.gradcheck(lambda *t: op(*t, *consts), tensors)


# training block -> [(conv, bn, fused weight, fused bias)] for every folded pair; SE convs are not folded
FOLDED = {
    Stem: [("conv", "bn", "w", "b")],
    ConvFirst: [("conv_dw", "bn_dw", "w_conv", "b_conv"), ("conv_expand", "bn_expand", "w1", "b1"),
                ("conv_project", "bn_project", "w2", "b2")],
    MBConv: [("conv_expand", "bn_expand", "w_exp", "b_exp"), ("conv_dw", "bn_dw", "w_conv", "b_conv"),
             ("conv_project", "bn_project", "w_proj", "b_proj")],
    Head: [("conv", "bn", "w", "b")],
}


def test_fused_gradients_match_training_form(one_thread):
    """Input and weight gradients of the fused form equal the training form's in eval mode. A folded
    weight is W' = W * s (s = gamma / sqrt(var + eps) per output channel), so dL/dW = dL/dW' * s, and the
    folded bias gets BN's beta gradient; the SE weights are the same tensors in both forms."""
    model = trained_like("pico")
    fused = convfirstnet.fuse(model)
    x = torch.randn(2, 3, 64, 48)
    w = torch.randn(2, 1000)  # a loss that weighs every logit differently
    x_train, x_fused = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (model(x_train) * w).sum().backward()
    (fused(x_fused) * w).sum().backward()
    assert rel_err(x_fused.grad, x_train.grad) < 1e-5
    blocks = [(model.stem, fused.stem), (model.head, fused.head)]
    blocks += [(a, b) for sa, sb in zip(model.stages, fused.stages) for a, b in zip(sa, sb)]
    checked = 0
    for train_block, fused_block in blocks:
        for conv, bn, wname, bname in FOLDED[type(train_block)]:
            conv, bn = getattr(train_block, conv), getattr(train_block, bn)
            scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach()
            w_grad = getattr(fused_block, wname).grad.reshape(conv.weight.shape) * scale.reshape(-1, 1, 1, 1)
            where = (type(train_block).__name__, wname)
            assert rel_err(w_grad, conv.weight.grad) < 1e-5, where
            assert rel_err(getattr(fused_block, bname).grad, bn.bias.grad) < 1e-5, where
            checked += 1
        if isinstance(train_block, MBConv):
            assert rel_err(fused_block.w_se1.grad, train_block.se.fc1.weight.grad.flatten(1)) < 1e-5
            assert rel_err(fused_block.b_se2.grad, train_block.se.fc2.bias.grad) < 1e-5
    assert checked == 2 + 3 * 28


def test_fused_parameters_trainability(one_thread):
    """fuse() keeps requires_grad (as torch.nn.utils.fusion does): trainable by default, a block frozen
    before fusing stays frozen; the input gradient works either way."""
    model = trained_like("pico")
    fused = convfirstnet.fuse(model)
    assert all(p.requires_grad for p in fused.parameters())
    model.stages[0].requires_grad_(False)
    partly = convfirstnet.fuse(model)
    assert not any(p.requires_grad for p in partly.stages[0].parameters())
    assert all(p.requires_grad for p in partly.stages[1].parameters())
    frozen = convfirstnet.fuse(model.requires_grad_(False))
    assert not any(p.requires_grad for p in frozen.parameters())
    x = torch.randn(1, 3, 32, 32, requires_grad=True)
    frozen(x).logsumexp(dim=1).sum().backward()  # saliency on a frozen model
    assert x.grad is not None and x.grad.abs().sum() > 0
    # One SGD step on the fused form moves every folded weight.
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    before = [p.detach().clone() for p in fused.parameters()]
    torch.nn.functional.cross_entropy(fused(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, fused.parameters()))


def _block_op_counts(fn, *args) -> Counter:
    seen = Counter()

    def capture(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)  # fullgraph=True raises on any graph break
    return seen


def test_compile_fullgraph_cpu():
    fused = convfirstnet.fuse(trained_like("pico"))
    x = torch.randn(2, 3, 64, 80)
    # One op per block (1 stem, 6 ConvFirst, 22 MBConv, 1 head), nothing else but dropout and the classifier,
    # both with and without autograd recording (the fused weights require grad).
    expected = {
        "convfirstnet.stem": 1, "convfirstnet.convfirst": 6, "convfirstnet.mbconv": 22, "convfirstnet.head": 1
    }
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            seen = _block_op_counts(fused, x.clone().requires_grad_(grad))
        assert {k: v for k, v in seen.items() if k.startswith("convfirstnet.")} == expected
        assert sum(seen.values()) == sum(expected.values()) + 2, seen  # + dropout, linear
    with torch.no_grad():
        eager = fused(x)
        compiled = torch.compile(fused, fullgraph=True)(x)
    # Inductor on CPU re-associates the fp32 convolutions: same function, rounding-level differences.
    assert rel_err(compiled, eager) < 1e-5


@pytest.mark.parametrize("path, mbconv_ops", [("auto", 22), ("fused", 22), ("layer-wise", 0)])
def test_compiled_mbconv_path(monkeypatch, path, mbconv_ops):
    """Under torch.compile each MBConv block compiles its op or its layers as ``compiled_path`` says
    (auto: the op); fullgraph holds either way, the other blocks keep their
    ops, and the compiled model computes eager's result (eager always runs the op)."""
    monkeypatch.setenv("CONVFIRSTNET_COMPILED_MBCONV", path)
    fused = convfirstnet.fuse(trained_like("pico"))
    blocks = [m for m in fused.modules() if isinstance(m, FusedMBConv)]
    assert len(blocks) == 22 and {m.compiled_path for m in blocks} == {path}
    x = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        seen = _block_op_counts(fused, x)
        assert seen["convfirstnet.mbconv"] == mbconv_ops
        others = (seen["convfirstnet.convfirst"], seen["convfirstnet.stem"], seen["convfirstnet.head"])
        assert others == (6, 1, 1)
        eager = fused(x)
        torch._dynamo.reset()
        compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")(x)
    # fp32 on CPU: the layers run the reference's own ops, in the same order
    assert rel_err(compiled, eager) < 1e-6


def test_compiled_mbconv_rule():
    """auto and fused compile the op on every map and device (the fused blocks measured at least as fast
    as torch.compile's layer-wise code on every MBConv block of Small: blocks.py), layer-wise the
    layers. Decided on compiled_path only (fake CUDA tensors here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    block = convfirstnet.fuse(trained_like("pico")).stages[4][1]
    assert block.compiled_path == "auto"
    with FakeTensorMode():
        cases = [torch.empty(2, 128, h, w, device=dev)
                 for dev in ("cuda", "cpu") for h, w in ((32, 32), (16, 16), (8, 8))]
        for path, want in (("auto", False), ("fused", False), ("layer-wise", True)):
            block.compiled_path = path
            assert {block.compiles_layers(t) for t in cases} == {want}


def test_eager_runs_the_mbconv_op(monkeypatch):
    """Eager calls run the fused op even where compiled_path asks for the layers."""
    import convfirstnet.blocks as blocks

    monkeypatch.setenv("CONVFIRSTNET_COMPILED_MBCONV", "layer-wise")
    fused = convfirstnet.fuse(trained_like("pico"))

    def layers(*args):
        raise AssertionError("the layer-wise form ran outside torch.compile")

    monkeypatch.setattr(blocks, "mbconv_layerwise", layers)
    with torch.no_grad():
        assert fused(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_compiled_mbconv_layers_check_input(monkeypatch):
    """The layer-wise path runs the op's checks: a wrong channel count is the op's error, not a conv's."""
    monkeypatch.setenv("CONVFIRSTNET_COMPILED_MBCONV", "layer-wise")
    block = convfirstnet.fuse(trained_like("pico")).stages[4][1]
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"convfirstnet.mbconv: x has 96 channels, the block expects 128"):
        torch.compile(block, backend="aot_eager")(torch.randn(2, 96, 8, 8))


def test_export_keeps_the_mbconv_op(monkeypatch):
    """torch.export holds the op whatever compiled_path says (exported programs keep one op per block)."""
    monkeypatch.setenv("CONVFIRSTNET_COMPILED_MBCONV", "layer-wise")
    block = convfirstnet.fuse(trained_like("pico")).stages[4][1]
    x = torch.randn(2, 128, 8, 8).contiguous(memory_format=torch.channels_last)
    program = torch.export.export(block, (x,))
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert ops == ["convfirstnet.mbconv.default"]


def test_compiled_mbconv_path_from_environment(monkeypatch):
    monkeypatch.setenv("CONVFIRSTNET_COMPILED_MBCONV", "sometimes")
    with pytest.raises(ValueError, match="CONVFIRSTNET_COMPILED_MBCONV='sometimes': expected one of auto"):
        convfirstnet.fuse(trained_like("pico"))


def test_compile_backward_through_fused_block(one_thread):
    """A compiled forward + backward (AOTAutograd traces the registered backward) equals eager."""
    block = convfirstnet.fuse(trained_like("pico")).stages[3][0]
    x = torch.randn(2, 48, 8, 8).contiguous(memory_format=torch.channels_last)
    grads = []
    for fn in (block, torch.compile(block, backend="aot_eager", fullgraph=True)):
        block.zero_grad()
        xg = x.clone().requires_grad_(True)
        fn(xg).square().sum().backward()
        grads.append([xg.grad] + [getattr(block, n).grad.clone() for n in block.weight_names])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*grads))


def test_batch_zero_and_one():
    fused = convfirstnet.fuse(trained_like("pico"))
    with torch.no_grad():
        assert fused(torch.randn(0, 3, 64, 64)).shape == (0, 1000)
        assert fused(torch.randn(1, 3, 33, 47)).shape == (1, 1000)
