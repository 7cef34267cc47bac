"""MBConv + SE training through the recompute path (convfirstnet/mbconv_recompute.py): only the block's
narrow input is stored, the wide activations are recomputed in the backward. Checked against autograd
of the layer-wise training form (blocks.MBConv in train(), fp32 on CPU): outputs, the input gradient
and every parameter gradient over two steps, the running statistics and num_batches_tracked after
them, the drop-path mask, the bytes autograd stores, eval mode, refusals, torch.compile.

Tolerance: both forms run the same aten kernels (conv2d, native_batch_norm, silu, mean, sigmoid) on
the same values and the backward applies aten's backward of each layer, as autograd does; only the
order in which a gradient's two branches are added can differ (the SE gate's input: dq * gate + the
pool's broadcast), one fp32 rounding of a sum, 2^-24 relative per step. Compared within 1e-6 of each
tensor's maximum (observed: bitwise equal). Planted bugs (running statistics updated a second time by
the recompute, the drop-path mask redrawn in the backward, the recompute normalising with the running
statistics) change a tensor by 1e-3 to 1 of its maximum.
"""

from __future__ import annotations

import copy

import pytest
import torch

from convfirstnet import training_kernels
from convfirstnet.blocks import MBConv

from .._models import compiled_step_errors, randomize_bn

CL = torch.channels_last
TOL = 1e-6


def make_block(c: int, k: int, stride: int, drop: float) -> MBConv:
    """A model-width MBConv with BatchNorm parameters and running statistics off their initial values."""
    torch.manual_seed(0)
    block = MBConv(c, k, stride, drop_path=drop).train()
    return randomize_bn(block, 0)


@pytest.fixture
def recompute(monkeypatch):
    """Select the Triton path for CPU tensors (as auto does for CUDA ones), with the gconv on its
    PyTorch reference: MBConv blocks in training mode take the recompute path."""
    monkeypatch.setattr(training_kernels, "triton_selected", lambda x: True)
    monkeypatch.setattr(training_kernels, "_WARNED", set())


def _step(block, x, dout, seed):
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out = block(x)
    out.backward(dout)
    return {"out": out.detach(), "x": x.grad, **{n: p.grad.clone() for n, p in block.named_parameters()}}


def _assert_close(got: dict, ref: dict, what: str) -> None:
    for name, r in ref.items():
        scale = max(r.abs().max().item(), 1e-30)
        err = (got[name] - r).abs().max().item() / scale
        assert err <= TOL, f"{what} {name}: error {err:.3g} of its maximum"


# stride 1 with drop-path (8 images: seeds 11, 12 draw masks that drop some and keep others), stride 2
# (C -> 2C, an odd map: BlurPool's reflection at the last row and column)
@pytest.mark.parametrize("c,k,stride,drop,side", [(32, 32, 1, 0.3, 6), (32, 64, 2, 0.0, 7)],
                         ids=["s1-c32-droppath", "s2-c32-k64"])
def test_two_steps_match_the_layerwise_training_form(recompute, monkeypatch, c, k, stride, drop, side):
    block = make_block(c, k, stride, drop)
    ref = copy.deepcopy(block)
    calls = []
    real = training_kernels.recompute_forward
    monkeypatch.setattr(training_kernels, "recompute_forward", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(1)
    for step in range(2):
        x = torch.randn(8, c, side, side).contiguous(memory_format=CL)
        dout = torch.randn(8, k, (side + stride - 1) // stride, (side + stride - 1) // stride)
        got = _step(block, x, dout, seed=11 + step)
        with monkeypatch.context() as m:
            m.setattr(training_kernels, "triton_selected", lambda x: False)  # the layers, with autograd
            want = _step(ref, x, dout, seed=11 + step)
            block.zero_grad(), ref.zero_grad()
        _assert_close(got, want, f"step {step}")
        if drop:  # the mask really drops some images and keeps others (so a redrawn mask shows)
            kept = (want["out"] - x).flatten(1).abs().amax(1) > 0
            assert 0 < int(kept.sum()) < 8
    assert len(calls) == 2
    assert list(block.state_dict()) == list(ref.state_dict())
    for (name, b), r in zip(block.named_buffers(), ref.buffers()):
        if name.endswith("num_batches_tracked"):
            assert int(b) == int(r) == 2, name
        else:
            err = (b - r).abs().max().item() / r.abs().max().item()
            assert err <= TOL, f"{name}: error {err:.3g} of its maximum"


def test_stores_only_the_narrow_input(recompute):
    """Autograd keeps x and the projection before BN_p o (C channels), the (N,) drop-path scale, the three
    BatchNorms' batch mean and rstd, x's mean and W_exp G, G x's centred Gram matrix (4 R + 2 C + C +
    R C = 4704 values), no hidden tensor (4C channels)."""
    block = make_block(32, 32, 1, 0.2)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def saved(run) -> list[torch.Tensor]:
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            run(torch.randn(4, 32, 8, 8).contiguous(memory_format=CL).requires_grad_())
        return [t for t in kept if t.untyped_storage().data_ptr() not in params]

    lean = saved(block)
    assert sorted(tuple(t.shape) for t in lean) == [(4,), (4, 32, 8, 8), (4, 32, 8, 8), (4704,)]
    training_kernels.triton_selected = lambda x: False  # (restored by the fixture) the layers
    layerwise = saved(block)
    assert any(t.dim() == 4 and t.shape[1] == 128 for t in layerwise)
    lean_bytes = sum(t.untyped_storage().nbytes() for t in lean)
    assert lean_bytes * 10 < sum(t.untyped_storage().nbytes() for t in layerwise)


def test_step_makes_no_tensor_from_host_data(recompute, monkeypatch):
    """An fp32 step of a stride-2 block (forward and backward through the layers of the recompute path, as
    fp32 runs on CUDA, where the MBConv kernels take 16-bit maps only) makes no tensor from Python data
    (torch.tensor, as_tensor): on CUDA that copies from host memory, which a CUDA graph capture refuses
    (--cuda-graph with --kernels triton in fp32). BlurPool's filter made so failed it. (The functions are
    patched: a TorchFunctionMode does not reach into the custom ops' bodies.)"""
    block = make_block(32, 64, 2, 0.0)
    x = torch.randn(4, 32, 7, 7).contiguous(memory_format=CL).requires_grad_()
    made = []
    for name in ("tensor", "as_tensor", "asarray"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _f=real, **k: made.append(_f.__name__) or _f(*a, **k))
    block(x).square().mean().backward()
    assert x.grad is not None and made == []


def test_eval_mode_runs_the_layers(recompute, monkeypatch):
    block = make_block(32, 32, 1, 0.2).eval()
    monkeypatch.setattr(training_kernels, "recompute_forward", lambda *a: pytest.fail("recompute in eval"))
    x = torch.randn(2, 32, 6, 6)
    state = copy.deepcopy(block.state_dict())
    with torch.no_grad():
        block(x)
    for name, t in block.state_dict().items():
        assert torch.equal(t, state[name]), name


def test_refuses_what_it_does_not_implement():
    block = make_block(32, 32, 1, 0.0)
    assert training_kernels.unsupported(block, torch.randn(1, 32, 4, 4)) is None
    assert training_kernels.unsupported(MBConv(32, 64, 2)) is None
    gn = copy.deepcopy(block)
    gn.bn_dw = torch.nn.GroupNorm(4, 128)
    assert "norm layer GroupNorm" in training_kernels.unsupported(gn)
    wide = copy.deepcopy(block)
    wide.conv_dw = torch.nn.Conv2d(128, 128, 3, 1, 1, groups=8, bias=False)
    assert "group width 16" in training_kernels.unsupported(wide)
    k5 = copy.deepcopy(block)
    k5.conv_dw = torch.nn.Conv2d(128, 128, 5, 1, 2, groups=16, bias=False)
    assert "kernel size" in training_kernels.unsupported(k5)
    relu = copy.deepcopy(block)
    relu.act = torch.nn.ReLU()
    assert "activation ReLU" in training_kernels.unsupported(relu)
    assert "dtype torch.float64" in training_kernels.unsupported(block, torch.randn(1, 32, 4, 4).double())


def test_unsupported_block_warns_once_and_runs_the_layers(recompute, monkeypatch):
    block = make_block(32, 32, 1, 0.0)
    block.act = torch.nn.GELU()
    monkeypatch.setattr(training_kernels, "recompute_forward", lambda *a: pytest.fail("ran the recompute"))
    with pytest.warns(UserWarning, match="activation GELU.*layer-wise training form"):
        block(torch.randn(2, 32, 4, 4))


def test_compiled_training_step_fullgraph(recompute):
    """torch.compile(fullgraph=True) of forward + backward + SGD step (the ops are opaque custom ops):
    the loss, parameters and buffers of the eager layer-wise training form; one BatchNorm with momentum
    None (the cumulative average: its factor 1 / num_batches_tracked is read inside the op)."""
    torch._dynamo.reset()
    block = make_block(32, 32, 1, 0.25)
    block.bn_dw.momentum = None
    ref = copy.deepcopy(block)
    step = torch.compile(lambda x: block(x).square().mean(), fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (block, ref)]
    for i in range(2):
        x = torch.randn(4, 32, 6, 6).contiguous(memory_format=CL)
        losses = []
        for f, opt in ((step, opts[0]), (lambda x: ref(x).square().mean(), opts[1])):
            opt.zero_grad()
            torch.manual_seed(i)
            training_kernels.triton_selected = (lambda x: True) if f is step else (lambda x: False)
            loss = f(x)
            loss.backward()
            opt.step()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(block.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_opcheck():
    """Schema, fake-tensor implementation (the layers on fake tensors) and AOT dispatch of the op."""
    block = make_block(32, 32, 1, 0.0)
    bns = (block.bn_expand, block.bn_dw, block.bn_project)
    se = block.se
    x = torch.randn(2, 32, 4, 4).contiguous(memory_format=CL).requires_grad_()
    args = (x, block.conv_expand.weight, bns[0].weight, bns[0].bias, block.conv_dw.weight, bns[1].weight,
            bns[1].bias, se.fc1.weight, se.fc1.bias, se.fc2.weight, se.fc2.bias, block.conv_project.weight,
            bns[2].weight, bns[2].bias, *(t for bn in bns for t in (bn.running_mean, bn.running_var)),
            torch.ones(2), 1, [0.1, -1.0, 0.1], 1e-5, [bn.num_batches_tracked + 1 for bn in bns])
    torch.library.opcheck(torch.ops.convfirstnet.mbconv_recompute_train, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ------------------------------------------------------------------------------------------------
# 16-bit autocast against the fp32 training form: on CPU at a small size (fp16), on a GPU (skipped
# without one) at ConvFirstNet-Small's MBConv shapes with the gconv on the Triton kernels
# ------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _autocast_errors(c: int, k: int, stride: int, side: int, n: int, device: str, dtype: torch.dtype,
                     monkeypatch) -> dict:
    """||got - ref|| / ||ref|| of the output and every gradient: the recompute path under autocast
    against the layer-wise block in fp32 on the same (16-bit rounded) input and drop-path mask."""
    block = make_block(c, k, stride, 0.2 if stride == 1 else 0.0).to(device)
    ref = copy.deepcopy(block)
    x = torch.randn(n, c, side, side, device=device).to(dtype).float().contiguous(memory_format=CL)
    out_side = (side + stride - 1) // stride
    dout = torch.randn(n, k, out_side, out_side, device=device)
    monkeypatch.setattr(training_kernels, "triton_selected", lambda t: True)
    with torch.autocast(device, dtype=dtype):
        got = _step(block, x, dout, seed=5)
    monkeypatch.setattr(training_kernels, "triton_selected", lambda t: False)
    want = _step(ref, x, dout, seed=5)
    errors = {name: ((got[name].double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()
              for name, r in want.items()}
    assert got["out"].dtype == dtype and got["x"].dtype == torch.float32
    assert all(int(b) == 1 for name, b in block.named_buffers() if name.endswith("num_batches_tracked"))
    return errors


def test_fp16_autocast_cpu(recompute, monkeypatch):
    """fp16 (2^-11) against fp32: errors of a few 2^-11 through a block (observed <= 2e-3)."""
    errors = _autocast_errors(32, 32, 1, 6, 4, "cpu", torch.float16, monkeypatch)
    assert max(errors.values()) <= 1e-2, errors


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("c,k,stride,side", [(96, 256, 2, 32), (256, 256, 1, 16), (256, 256, 1, 8)])
def test_small_mbconv_autocast_gpu(monkeypatch, dtype, c, k, stride, side):
    """Small's MBConv shapes (stage 4's first block, stage 4, stage 5), batch 8, the gconv on the Triton
    kernels: norm errors against fp32 within a few units of the dtype's rounding (bf16: 2^-8)."""
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")
    errors = _autocast_errors(c, k, stride, side, 8, "cuda", dtype, monkeypatch)
    assert max(errors.values()) <= (1e-2 if dtype == torch.float16 else 5e-2), errors


@cuda
@pytest.mark.gpu
def test_compiled_small_mbconv_step_gpu(monkeypatch):
    """torch.compile(fullgraph=True) of a training step of Small's 16x16 MBConv block (batch 8, fp16
    autocast, the fused training ops on CUDA) against the same step in eager mode: the same kernels run
    either way (the ops are opaque to the compiler), so loss and gradients agree to a few fp16 roundings
    in norm; a lost write (an output the compiled graph drops or clones away) shows as an O(1) error.
    CONVFIRSTNET_KERNELS=triton: with auto a training-form block runs its layers (training_kernels.
    triton_selected), which the compiler fuses and rounds otherwise than eager fp16 autocast."""
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "triton")
    block = make_block(256, 256, 1, 0.0).cuda()
    x = torch.randn(8, 256, 16, 16, device="cuda").contiguous(memory_format=CL)
    loss, loss_ref, errors = compiled_step_errors(block, x)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-3, atol=1e-5)
    for name, err in errors.items():
        assert err <= 1e-2, (name, err)
