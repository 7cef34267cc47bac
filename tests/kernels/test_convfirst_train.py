"""ConvFirst stride-1 training block through torch.ops.convfirstnet.convfirst_s1_train (+ _backward):
the Triton kernels (interpreter on CPU) against autograd of the training form (blocks.ConvFirst in
train() / eval() mode, fp64): the output (loss), the gradients of the input and of every parameter,
the running statistics. Also the reference's written-out backward, determinism, registration,
torch.compile, and the kernels compiled for sm_90.

Run: pytest tests/kernels/test_convfirst_train.py --durations=10

Coverage of the kernels' loops and masks (kernels/convfirst_train/kernel.py): the block widths of the
models (C = 16, 24, 48, 96: channels padded to CP = 16, 32 (masked), 64, 128; the weights pass takes 96
channels as parts of 64 + 32, input and output at stride 1, output at stride 2; stride 2: 2C -> 6C -> K
FFNs with 2C up to 128 and K = 96; the forward FFN pass takes the same parts), hidden widths R = 3C and
6C (2 to 36 hidden chunks per program, the last one partial for R = 48 and 144), 198 pixels per
channel (fp32 tiles of 64 rows: four tiles, the last one partial). Under the interpreter a share is
two tiles (launcher.INTERPRETER_SHARE_TILES), so the moments, output-sums and weights passes run
their tile loop twice per program over two shares, and their partials are merged across shares.
"""

from __future__ import annotations

import copy

import pytest
import torch
from convfirstnet.kernels.convfirst_train.reference import (
    convfirst_s1_train_backward_reference,
    convfirst_s1_train_reference,
    convfirst_s2_train_backward_reference,
    convfirst_s2_train_reference,
)

from convfirstnet.blocks import ConvFirst, Head, MBConv
from convfirstnet.training_kernels import fused_forward, unsupported

from ..conftest import FULL_MATRIX
from .._models import compiled_step_errors, randomize_bn
from ._traced import trace_graphs

OPS = torch.ops.convfirstnet
CL = torch.channels_last

# Tolerances: every compared tensor T (output, gradient, running statistic) within TOL[dtype] x max|T_ref|
# of the fp64 autograd of the training form on the same (rounded) input values.
# fp32: each value is a sum of at most M + R + 72 ~ 800 fp32 products (the weight gradients sum over the
#   M = 198 pixels, the 1x1 layers over C or R channels), and the BatchNorm backward subtracts batch
#   means from terms of the size of the result (a cancellation of up to ~10x at these sizes); the
#   kernels sum in another order than the reference. Rounding then stays below ~10 sqrt(800) 2^-24
#   ~ 2e-5 of the largest term; observed <= 6.9e-7. A planted bug (a dropped BatchNorm term, a skipped
#   partial sum, a wrong drop-path scale) changes a tensor by 1e-2 to 1 of its maximum.
# fp16: see test_fp16_matches_training_form.
# Running statistics (error / their maximum): fp32 sums of 198 values, then the momentum update: 1e-6
#   (the unbiased correction M / (M - 1) is 5e-3 here, times the momentum 0.1); fp16: the statistics of
#   fp16-rounded maps, 2^-11 relative, 1e-3.
TOL = {torch.float32: 2e-5}
RUNNING_TOL = {torch.float32: 1e-6, torch.float16: 1e-3}


def make_block(c: int, t: int, drop: float, seed: int = 0, k: int | None = None, stride: int = 1
               ) -> ConvFirst:
    """A ConvFirst block with BatchNorm parameters and running statistics away from their initial
    values (so that no term of the BatchNorm backward vanishes)."""
    torch.manual_seed(seed)
    block = ConvFirst(c, k or c, stride, t, drop_path=drop)
    return randomize_bn(block, seed)


def run_block(block, x, dout, seed, fused: bool):
    """out, grads (x and every parameter, by name) and buffers after one forward + backward."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out = fused_forward(block, x) if fused else block(x)
    out.backward(dout.to(out.dtype))
    grads = {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
    return out.detach(), grads, {n: b.clone() for n, b in block.named_buffers()}


def _scales(grads_ref: dict) -> dict:
    """The magnitude each compared tensor's error is measured against: its own maximum, except for a
    BatchNorm's beta gradient, sum(dout), measured against at least its gamma gradient, sum(dout v_hat),
    a sum of the same terms: beta's is zero in exact arithmetic when a conv and a training-mode
    BatchNorm follow (BN1's: BN2 makes sum(dz) = 0 and dy = dz W1; in a model, BN3's when the next
    block starts with conv + BatchNorm), so its own maximum is rounding noise."""
    scales = {name: ref.abs().max().item() for name, ref in grads_ref.items()}
    scales["bn_dw.bias"] = max(scales["bn_dw.bias"], scales["bn_dw.weight"])
    return scales


def compare(block, x, dout, dtype, seed=1):
    """The fused op on `block` (in dtype) against autograd of the same block in fp64: the relative errors
    (error / scale) by tensor name, after checking the running statistics."""
    ref_block = copy.deepcopy(block).double()
    fused_block = copy.deepcopy(block).to(dtype)
    xd = x.to(dtype)
    out, grads, bufs = run_block(fused_block, xd, dout, seed, fused=True)
    dout_ref = dout.to(dtype).double()
    out_ref, grads_ref, bufs_ref = run_block(ref_block, xd.double(), dout_ref, seed, fused=False)
    grads, grads_ref = {"out": out, **grads}, {"out": out_ref, **grads_ref}
    scales = _scales(grads_ref)
    errors = {}
    for name, ref in grads_ref.items():
        assert grads[name].shape == ref.shape and grads[name].dtype == dtype, name
        errors[name] = (grads[name].double() - ref).abs().max().item() / scales[name]
    for name, ref in bufs_ref.items():
        if name.endswith("num_batches_tracked"):
            assert torch.equal(bufs[name], ref), name
            continue
        err = (bufs[name].double() - ref.double()).abs().max().item() / ref.abs().max().item()
        assert err <= RUNNING_TOL[dtype], f"{name}: error {err:.3g} of its maximum"

    return errors


def assert_within(errors: dict, tol) -> None:
    for name, err in errors.items():
        bound = tol[name] if isinstance(tol, dict) else tol
        assert err <= bound, f"{name}: error {err:.3g} of its scale (tolerance {bound:.3g})"


# (C, K, stride, expansion t, train, drop-path, seed): the model's widths, channels padded to 16, 32 (24:
# masked), 64, 128; stride 2 with 2C -> 6 C -> K FFNs and odd / even maps (BlurPool's reflection at the
# last row and column only exists for odd sizes); the seeds of the drop-path cases draw a mask that drops
# one image and keeps the other
CASES = [
    pytest.param(16, 16, 1, 3, True, 0.5, 2, id="c16-t3-train-droppath"),
    pytest.param(24, 24, 1, 6, False, 0.0, 1, id="c24-t6-eval-masked"),
    pytest.param(48, 48, 1, 3, True, 0.2, 0, id="c48-t3-train-droppath"),
    pytest.param(96, 96, 1, 3, True, 0.0, 1, id="c96-t3-train"),
    pytest.param(16, 32, 2, 6, True, 0.0, 1, id="s2-c16-k32-train"),
    pytest.param(24, 48, 2, 6, False, 0.0, 1, id="s2-c24-k48-eval-masked"),
    pytest.param(64, 96, 2, 6, True, 0.0, 1, id="s2-c64-k96-train"),
]


@pytest.mark.parametrize("c,k,stride,t,train,drop,seed", CASES)
def test_fp32_matches_training_form(interpreter_backend, c, k, stride, t, train, drop, seed):
    block = make_block(c, t, drop, k=k, stride=stride).train(train)
    g = torch.Generator().manual_seed(2)
    h, w = (9, 11) if c != 24 else (10, 8)
    x = torch.randn(2, c, h, w, generator=g).contiguous(memory_format=CL)
    dout = torch.randn(2, k, -(-h // stride), -(-w // stride), generator=g).contiguous(memory_format=CL)
    if drop:
        torch.manual_seed(seed)
        mask = torch.empty(2, 1, 1, 1).bernoulli_(1 - drop)
        assert 0 < mask.sum() < 2
    assert_within(compare(block, x, dout, torch.float32, seed), TOL[torch.float32])


def test_fp16_forward_and_backward_match_the_reference(interpreter_backend):
    """fp16 kernels against the reference in fp16 (the same rounding points as a layer-wise fp16 network:
    reference.py), parameters exactly representable in fp16. The backward is given the reference
    forward's saved maps and statistics: ReLU's derivative is a step, so a one-ulp difference in the
    forward (one in a few hundred outputs here) flips the mask of pre-activations within a rounding
    error of zero, and each flip moves a gradient by a whole term, which says nothing about the kernels.
    Tolerances: the forward within 2 ulp of |out| <= 8 (2^-11 x 8 x 2) and the statistics within 2e-4
    of their maximum (sums of fp16-rounded maps); each gradient within 3e-3 of its scale (a few fp16
    roundings of the intermediate maps, summed over 198 pixels; observed <= 1.2e-3)."""
    block = make_block(32, 3, 0.0)
    with torch.no_grad():
        for t in [*block.parameters(), *block.buffers()]:
            if t.is_floating_point():
                t.copy_(t.half().float())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, 9, 11, generator=g).contiguous(memory_format=CL).half()
    dout = torch.randn(2, 32, 9, 11, generator=g).contiguous(memory_format=CL).half()
    args = _op_args(block, x, torch.ones(2), True)
    got = OPS.convfirst_s1_train(*args)
    want = convfirst_s1_train_reference(*args)
    assert (got[0].float() - want[0].float()).abs().max() <= 2 * 2**-11 * 8
    for a, b in zip(got[3:], want[3:]):
        assert (a - b).abs().max() <= 2e-4 * b.abs().max()
    saved = (dout, x, want[1], want[2], *args[1:10], *want[3:], args[16], True, 1e-5)
    grads = OPS.convfirst_s1_train_backward(*saved)
    expect = convfirst_s1_train_backward_reference(*saved)
    names = ["x", "conv_dw.weight", "conv_expand.weight", "conv_project.weight", "bn_dw.weight", "bn_dw.bias",
             "bn_expand.weight", "bn_expand.bias", "bn_project.weight", "bn_project.bias"]
    scales = _scales({n: e.double() for n, e in zip(names, expect)})
    errors = {n: (a.double() - e.double()).abs().max().item() / scales[n]
              for n, a, e in zip(names, grads, expect)}
    assert_within(errors, 3e-3)


# (C, expansion, train): the forward FFN launch of 16-bit stride-1 blocks (kernels/convfirst/staged.py
# ffn_train_forward): every hidden chunk resident in one channel part (16, 32; 24 padded to 32, with a
# masked last chunk of R = 144) or two (48 = 32 + 16), or streamed from L2 in two parts (96 = 64 + 32, 18
# chunks of 32; 72 -> 64 + 16, masked); eval mode (its folded weights formed by torch ops). 286 rows: 3 tiles of 128 or 5 of 64, the last partial; the
# interpreter runs two tiles a program (staged.TRAIN_INTERPRETER_TILES), so the moments merge across the
# tiles of a program and across 2-3 programs.
FFN_CASES = [
    pytest.param(16, 3, True, id="c16-t3-resident"),
    pytest.param(24, 6, True, id="c24-t6-masked-channels-and-chunk"),
    pytest.param(48, 6, True, id="c48-t6-parts32+16"),
    pytest.param(72, 6, True, id="c72-t6-streamed-parts64+16-masked"),
    pytest.param(96, 6, True, id="c96-t6-streamed-parts64+32"),
    pytest.param(32, 3, False, id="c32-t3-eval"),
]


@pytest.mark.parametrize("c,t,train", FFN_CASES)
def test_fp16_forward_ffn_launch_matches_the_reference(interpreter_backend, c, t, train):
    """The fp16 forward through the resident-weights FFN launch against the reference in fp16 (its
    rounding points), as test_fp16_forward_and_backward_match_the_reference: out within 2 ulp of
    |out| <= 8, p within 2 ulp of its maximum, BN1's and BN2's statistics within 2e-4 of their maximum
    and BN3's (p's) within 2^-11. BN2 is folded into the expand's weights (k2 W1, rounded once to fp16):
    a relative step of up to 2^-12 per weight where the reference rounds z per pixel, the same for every
    pixel, so it does not average out in p's mean and variance over the rows (observed up to 2.3e-4;
    1.7e-4 with the per-tile weights of the other launch). A planted bug (a tile's rows dropped from the
    moments, a wrong merge count) moves p's variance by 1e-2 or more."""
    from convfirstnet.kernels._cost import recording

    block = make_block(c, t, 0.0, seed=4).train(train)
    with torch.no_grad():
        for v in [*block.parameters(), *block.buffers()]:
            if v.is_floating_point():
                v.copy_(v.half().float())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, c, 13, 11, generator=g).contiguous(memory_format=CL).half()
    args = _op_args(block, x, torch.ones(2), train)
    got = OPS.convfirst_s1_train(*args)
    want = convfirst_s1_train_reference(*args)
    assert (got[0].float() - want[0].float()).abs().max() <= 2 * 2**-11 * 8
    assert (got[2].float() - want[2].float()).abs().max() <= 2 * 2**-11 * want[2].float().abs().max()
    for i, (a, b) in enumerate(zip(got[3:], want[3:])):  # m1, v1, m2, v2, m3, v3, BN1's batch mean, cov
        assert (a - b).abs().max() <= (2**-11 if i in (4, 5) else 2e-4) * b.abs().max(), i
    with recording() as rec:
        OPS.convfirst_s1_train(*(v.to("meta") if isinstance(v, torch.Tensor) else v for v in args))
    assert "_convfirst_ffn_kernel" in [lc.kernel.fn.__name__ for lc in rec.launches]


def test_two_steps_momentum_none_and_nchw_input(interpreter_backend):
    """Two training steps (running statistics updated twice), BatchNorm with momentum=None (the cumulative
    average, 1 / num_batches_tracked), an NCHW input (copied to channels-last by the launcher)."""
    block = make_block(16, 3, 0.0)
    for bn in (block.bn_dw, block.bn_expand, block.bn_project):
        bn.momentum = None
    ref = copy.deepcopy(block).double()
    for step in range(2):
        x = torch.randn(2, 16, 6, 7)
        out = fused_forward(block, x)
        out_ref = ref(x.double())
        assert (out.double() - out_ref).abs().max() <= TOL[torch.float32] * out_ref.abs().max()
    for (name, b), r in zip(block.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.double(), r.double(), rtol=RUNNING_TOL[torch.float32], atol=1e-7,
                                   msg=name)


def test_backward_is_deterministic(interpreter_backend):
    """Two identical backward calls give bitwise-equal gradients (every reduction in a fixed order)."""
    block = make_block(16, 3, 0.0)
    x = torch.randn(2, 16, 9, 11).contiguous(memory_format=CL)
    dout = torch.randn_like(x)
    _, g1, _ = run_block(copy.deepcopy(block), x, dout, 0, fused=True)
    _, g2, _ = run_block(copy.deepcopy(block), x, dout, 0, fused=True)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name


# ------------------------------------------------------------------------------------------------
# The reference (the CPU path and the kernels' specification) against autograd, fp64
# ------------------------------------------------------------------------------------------------


def _op_args(block, x, drop_scale, training):
    bns = (block.bn_dw, block.bn_expand, block.bn_project)
    params = [block.conv_dw.weight, block.conv_expand.weight.flatten(1), block.conv_project.weight.flatten(1)]
    params += [t for bn in bns for t in (bn.weight, bn.bias)]
    running = [t for bn in bns for t in (bn.running_mean, bn.running_var)]
    return (x, *[p.detach() for p in params], *[r.clone() for r in running], drop_scale, training, 1e-5)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("stride", [1, 2])
def test_reference_is_autograd_of_the_training_form(training, stride):
    """reference.py (the CPU path and the kernels' specification, backward written out) against autograd
    of the training form in fp64, odd map sizes (stride 2: BlurPool's reflection at both ends)."""
    block = make_block(16, 3 if stride == 1 else 6, 0.4 if stride == 1 else 0.0, k=16 * stride,
                       stride=stride).double().train(training)
    x = torch.randn(3, 16, 7, 9, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_()
    torch.manual_seed(5)
    out = block(x)
    torch.manual_seed(5)
    keep = 0.6
    scale = x.new_empty(3, 1, 1, 1).bernoulli_(keep).div_(keep).flatten() if training else x.new_ones(3)
    dout = torch.randn_like(out)
    out.backward(dout)
    args = _op_args(block, x.detach(), scale, training)
    if stride == 1:
        res = convfirst_s1_train_reference(*args)
        grads = convfirst_s1_train_backward_reference(dout, x.detach(), res[1], res[2], *args[1:10], *res[3:],
                                                      scale, training, 1e-5)
    else:
        args = (*args[:16], training, 1e-5)
        res = convfirst_s2_train_reference(*args)
        grads = convfirst_s2_train_backward_reference(dout, x.detach(), *res[1:4], *args[1:10], *res[4:],
                                                      training, 1e-5)
    torch.testing.assert_close(res[0], out.detach(), rtol=1e-12, atol=1e-12)
    expect = [x.grad, block.conv_dw.weight.grad, block.conv_expand.weight.grad.flatten(1),
              block.conv_project.weight.grad.flatten(1)]
    bns = (block.bn_dw, block.bn_expand, block.bn_project)
    expect += [t.grad for bn in bns for t in (bn.weight, bn.bias)]
    for got, want in zip(grads, expect):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------------
# Registration, torch.compile, bad input
# ------------------------------------------------------------------------------------------------


def test_opcheck(reference_backend):
    block = make_block(16, 3, 0.0)
    x = torch.randn(2, 16, 5, 6).contiguous(memory_format=CL)
    args = list(_op_args(block, x, torch.ones(2), True))
    for i in range(4):
        args[i] = args[i].clone().requires_grad_()
    torch.library.opcheck(OPS.convfirst_s1_train, tuple(args),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_compiled_training_step_cpu():
    """torch.compile(fullgraph=True) of forward + backward + SGD step through the fused op (the reference
    branch on CPU): the same loss, parameters and running statistics as the eager training form."""
    torch._dynamo.reset()
    block = make_block(16, 3, 0.0)
    ref = copy.deepcopy(block)
    step = torch.compile(lambda x: fused_forward(block, x).square().mean(), fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (block, ref)]
    for _ in range(2):
        x = torch.randn(2, 16, 7, 6).contiguous(memory_format=CL)
        losses = []
        for f, opt in ((step, opts[0]), (lambda x: ref(x).square().mean(), opts[1])):
            opt.zero_grad()
            loss = f(x)
            loss.backward()
            opt.step()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(block.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


_TRACED_BODY = """
from convfirstnet.blocks import ConvFirst

for stride, dtype, tag in ((1, torch.float32, ""), (2, torch.float32, ""), (1, torch.float16, " fp16")):
    block = ConvFirst(16, 16 * stride, stride, 3).train().to(dtype)
    x = torch.randn(2, 16, 8, 8, dtype=dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
    backend = aot_autograd(fw_compiler=capture(f"forward s{stride}{tag}"),
                           bw_compiler=capture(f"backward s{stride}{tag}"))
    torch.compile(block, fullgraph=True, backend=backend)(x).sum().backward()
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_torch_compile_traces_triton_branch():
    """torch.compile(fullgraph=True) of a training-form ConvFirst block's forward + backward through the
    fused ops' Triton branch (real JITFunctions, in a subprocess without the interpreter): every launch
    is a user-defined Triton kernel in the graph (what Inductor receives on a GPU), the per-channel
    arithmetic between them too (kernels/convfirst_train/finalize.py). Forward: gconv, moments, their
    merge (BN1), BN2's statistics, FFN, the merge of p's moments (BN3), BN3 + residual, the running
    statistics (stride 2: and BlurPool of the concat, moments of u and their merge); backward: output sums,
    BatchNorm terms, prep, weights pass, its reduction and finalize, input pass, BN1's terms, BN1 input
    gradient (stride 2: and the BlurPool transpose), the gconv's fused dgrad + wgrad and its reduction.
    fp16 stride 1: the same launches, the FFN the staged inference launch on the folded weights that BN2's
    statistics launch writes (no cast or product of its own in the graph)."""
    pytest.importorskip("triton")
    graphs = trace_graphs(_TRACED_BODY)
    launches = {name: targets.count("triton_kernel_wrapper_functional") for name, targets in graphs.items()}
    assert launches == {"forward s1": 8, "backward s1": 11, "forward s2": 11, "backward s2": 12,
                        "forward s1 fp16": 8, "backward s1 fp16": 11}, launches
    # the per-channel arithmetic runs in the finalize kernels: what else the graphs hold allocates,
    # views or unpacks (drop-path's ones without drop-path), no copy back of a partly written buffer
    bookkeeping = {"triton_kernel_wrapper_functional", "<built-in function getitem>",
                   "aten.empty.memory_format", "aten.empty_like.default", "aten.select.int",
                   "aten.view.default",
                   "aten.ones.default"}
    others = {name: sorted(set(targets) - bookkeeping) for name, targets in graphs.items()}
    assert not any(others.values()), others


def test_unsupported_blocks_are_named():
    block = make_block(16, 3, 0.0)
    assert unsupported(block, torch.randn(1, 16, 4, 4)) is None
    assert unsupported(ConvFirst(16, 32, 2, 6)) is None
    assert unsupported(MBConv(16, 16, 1)) is None  # the recompute path (tests/kernels/test_mbconv_train.py)
    assert "Head: no fused training op" in unsupported(Head(16))
    gn = copy.deepcopy(block)
    gn.bn_expand = torch.nn.GroupNorm(4, 48)
    assert "GroupNorm" in unsupported(gn)
    wide = copy.deepcopy(block)
    wide.conv_dw = torch.nn.Conv2d(16, 16, 3, 1, 1, groups=4, bias=False)
    assert "group width 4" in unsupported(wide)
    k5 = copy.deepcopy(block)
    k5.conv_dw = torch.nn.Conv2d(16, 16, 5, 1, 2, groups=2, bias=False)
    assert "kernel size" in unsupported(k5)
    assert "dtype torch.float64" in unsupported(block, torch.randn(1, 16, 4, 4, dtype=torch.float64))


def test_auto_keeps_training_layer_wise_on_cuda(monkeypatch):
    """``auto`` (the default) runs the training form's layers in train mode, for CUDA tensors too (the fused
    training step launched from Python measured 2x slower than layer-wise, training_kernels.triton_selected);
    ``triton`` asks for the fused training ops; the cost report always records them."""
    from types import SimpleNamespace

    from convfirstnet import training_kernels
    from convfirstnet.kernels._cost import recording
    from convfirstnet.kernels._launch import HAS_TRITON

    cuda_x = SimpleNamespace(device=torch.device("cuda"), is_cuda=True)  # only its device is read
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")
    assert not training_kernels.triton_selected(cuda_x)
    assert training_kernels.dispatch(make_block(16, 3, 0.0), cuda_x) is None  # decided before any check
    with recording():
        assert training_kernels.triton_selected(cuda_x) == HAS_TRITON
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "triton")
    assert training_kernels.triton_selected(cuda_x) == HAS_TRITON
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "reference")
    assert not training_kernels.triton_selected(cuda_x)


def test_op_refuses_bad_input_before_launch(interpreter_backend, monkeypatch):
    from convfirstnet.kernels.convfirst_train import launcher

    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a kernel was launched"))
    block = make_block(16, 3, 0.0)
    x = torch.randn(2, 16, 5, 6).contiguous(memory_format=CL)
    args = list(_op_args(block, x, torch.ones(2), True))
    cases = [
        (0, torch.randn(2, 12, 5, 6), ValueError, "multiple of 8"),
        (1, torch.randn(16, 4, 3, 3), ValueError, "group width 4"),
        (1, torch.randn(16, 8, 5, 5), ValueError, "kernel size 5x5"),
        (3, torch.randn(48, 8), ValueError, "w2 has shape"),
        (4, torch.ones(16, dtype=torch.float64), TypeError, "BatchNorm tensor gamma1"),
        (16, torch.ones(3), ValueError, "drop_scale has shape"),
        (0, x.to(torch.bfloat16), TypeError, "bfloat16 through the Triton interpreter"),
    ]
    for i, value, exc, match in cases:
        bad = list(args)
        bad[i] = value
        if i == 0 and value.dtype == torch.bfloat16:
            bad[1:4] = [t.float() for t in bad[1:4]]
        with pytest.raises(exc, match=match):
            OPS.convfirst_s1_train(*bad)
    with pytest.raises(ValueError, match="more than one value per channel"):
        OPS.convfirst_s1_train(torch.randn(1, 16, 1, 1), *args[1:16], torch.ones(1), True, 1e-5)


# ------------------------------------------------------------------------------------------------
# Compiled for sm_90 (no GPU needed): Small's widest block, fp16, batch 128, 28 x 28 (224 input)
# ------------------------------------------------------------------------------------------------


def record_s2_block(c: int, k: int, hw: int, n: int = 128, dtype=torch.float16):
    """The launches of one training step of a stride-2 C -> K block (R = 6C), through the module."""
    from convfirstnet.kernels._cost import recording

    block = ConvFirst(c, k, 2, 6).to(dtype).to("meta").train()
    x = torch.empty(n, c, hw, hw, device="meta", dtype=dtype).contiguous(memory_format=CL).requires_grad_()
    with recording() as rec:
        out = block(x)
        out.backward(torch.empty_like(out))
    return rec.launches


def record_block(c: int, r: int, hw: int, n: int = 128, dtype=torch.float16):
    """The launches of one training step (forward + backward) of a C -> C block, R hidden, on meta tensors."""
    from convfirstnet.kernels._cost import recording

    def meta(*shape, dt=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dt)

    x = meta(n, c, hw, hw, dt=dtype).contiguous(memory_format=CL)
    vec = [meta(k) for k in (c, c, r, r, c, c)]
    weights = (meta(c, 8, 3, 3), meta(r, c), meta(c, r))
    with recording() as rec:
        OPS.convfirst_s1_train(x, *weights, *vec, *vec, meta(n), True, 1e-5)
        OPS.convfirst_s1_train_backward(x, x, x, x, *weights, *vec, *[meta(k) for k in (c, c, r, r, c, c, c)],
                                        meta(c, c), meta(n), True, 1e-5)
    return rec.launches


@pytest.mark.compile
@pytest.mark.slow
def test_small_block_compiles_for_sm90_without_spills():
    """Every launch of a training step of Small's stage-3 block (C = 96, R = 576), the weights pass of its
    stage-1/2 widths and the BlurPool and FFN kernels of its stage-3 stride-2 block compile for sm_90
    without stack, within the shared memory of an H100, and the big dots (the FFN passes and the
    moments) run on wgmma."""
    from convfirstnet.analysis.compiled import compile_variants, variant_of
    from convfirstnet.analysis.hardware import hardware
    from convfirstnet.analysis.targets import target
    from tests.kernels._recorded import SMEM_LIMIT

    # sampled (conftest.sampled; CONVFIRSTNET_FULL_MATRIX=1 takes all): every kernel of Small's widest
    # stride-1 block (C = 96: CP = 128, the largest tiles and shared memory), the weights pass of C = 32
    # (the mma.sync weight dots), and the stride-2 block's BlurPool kernels and FFN forward (64 -> 96 at
    # 56 x 56; stride 1 runs the staged FFN launch, _convfirst_ffn_kernel); the full matrix adds the other
    # widths' passes
    launches = record_block(96, 576, 28)
    launches += [la for la in record_block(32, 96, 112) if la.kernel.__name__ == "_ffn_bwd_weights_kernel"]
    launches += [la for la in record_s2_block(64, 96, 56)
                 if "blur" in la.kernel.__name__ or la.kernel.__name__ == "_ffn_fwd_kernel"]
    if FULL_MATRIX:
        launches += [la for la in record_block(64, 384, 56) + record_s2_block(32, 64, 112)]
    variants, first = {}, {}
    for la in launches:
        v = variant_of(la, 90)
        variants.setdefault(v.key, v)
        first.setdefault(v.key, la)
    compiled = compile_variants(list(variants.values()))
    names = set()
    tgt, hw = target(90), hardware(90)
    for comp in compiled:
        name = f"{comp.variant.name} {dict(comp.variant.meta)}"
        names.add(comp.variant.name)
        assert comp.stack == 0, f"{name}: {comp.stack} B of stack (register spills)"
        assert comp.shared <= SMEM_LIMIT[90], f"{name}: {comp.shared} B of shared memory"
        cost = first[comp.variant.key].cost
        if cost.l1_working_set_bytes:
            # a declared L1 set (the gconv windows, the BlurPool transpose's candidates): plain L1-allocating
            # loads, no cp.async or L2-only loads, and the set fits in the L1 the compiled shared memory
            # leaves at the compiled occupancy (the report's rule for counting the re-reads as hits)
            opcodes = {i.opcode for i in comp.listing()[0]}
            assert any(op.startswith("LDG.E") for op in opcodes), name
            assert not any(op.startswith("LDGSTS") or (op.startswith("LDG") and "STRONG" in op)
                           for op in opcodes), name
            occ = tgt.occupancy(comp.num_warps, comp.regs, comp.shared)
            l1 = hw.l1_bytes(occ * (comp.shared + tgt.smem_reserved_per_block))
            assert cost.l1_working_set_bytes <= l1 / occ, f"{name}: {cost.l1_working_set_bytes} B > {l1 / occ}"
        meta = dict(comp.variant.meta)
        # padded widths and channel parts (a part of width 0 is absent)
        narrowest = min(meta.get(k) or 1 << 20 for k in ("CP", "CPI", "CPO", "CIA", "CIB", "COA", "COB"))
        big_moments = comp.variant.name == "_moments_kernel" and narrowest >= 64
        # (the finalize kernels' small tf32x3 W1 Cov products, M = 16 rows, run on mma.sync)
        ffn = comp.variant.name.startswith("_ffn") or comp.variant.name == "_convfirst_ffn_kernel"
        if (ffn and "finalize" not in comp.variant.name) or big_moments:
            # the weight-gradient dots of C = 32 and of a 32-channel part (C = 96 = 64 + 32) have M = 32 < 64
            # (mma.sync); all others are wgmma
            allowed = ("wgmma", "wgmma+mma.sync") if narrowest < 64 else ("wgmma",)
            assert comp.mma_kind in allowed, f"{name}: {comp.mma_kind}"
    assert {"_moments_kernel", "_convfirst_ffn_kernel", "_ffn_fwd_kernel", "_residual_kernel",
            "_out_sums_kernel", "_prep_kernel", "_ffn_bwd_weights_kernel", "_ffn_bwd_input_kernel",
            "_bn_input_grad_kernel", "_blur_cat_kernel",
            "_blur_bwd_kernel", "_merge_moments_kernel", "_linear_moments_kernel", "_bn_terms_kernel",
            "_ffn_weights_finalize_kernel"} <= names


@pytest.mark.parametrize("h, w, bm", [(64, 64, 64), (128, 128, 128), (32, 32, 32), (15, 9, 32), (7, 40, 16),
                                      (9, 70, 64)])
def test_blur_transpose_l1_declaration_covers_its_candidates(h, w, bm):
    """The BlurPool transpose's declared L1 bytes per tile hold every du pixel its pixels gather from (the
    kernel's candidates with a non-zero weight, reflection included), for the model's maps and odd ones."""
    from convfirstnet.kernels.convfirst_train.launcher import blur_cost

    ho, wo = (h + 1) // 2, (w + 1) // 2

    def taps(i, n, no):  # output positions o with a tap of o reading input i (kernel._blur_bwd_kernel)
        def reflect(v):
            return -v if v < 0 else (2 * (n - 1) - v if v >= n else v)
        return {o for o in (i // 2, i // 2 + 1) if o < no and any(reflect(2 * o + d - 1) == i for d in range(3))}

    c = 8
    tile = blur_cost("t", 1, c, h, w, 2, backward=True, l1=(bm, 1)).l1_working_set_bytes
    for t0 in range(0, h * w, bm):
        du = {(oh, ow) for q in range(t0, min(t0 + bm, h * w))
              for oh in taps(q // w, h, ho) for ow in taps(q % w, w, wo)}
        assert 2 * (bm * c + len(du) * 2 * c) <= tile, (t0, len(du))


# ------------------------------------------------------------------------------------------------
# The training-form model on the fused op
# ------------------------------------------------------------------------------------------------


def test_model_runs_convfirst_fused_and_mbconv_recomputed(interpreter_backend, monkeypatch):
    """With the Triton kernels selected, every ConvFirst block of a training-form model runs the fused
    ops and every MBConv block the recompute path (its gconv on the Triton kernels), with no fallback
    warning (same parameters and buffers: the state_dict is unchanged), and loss, gradients and running
    statistics equal the layer-wise model's."""
    import warnings

    from convfirstnet import training_kernels
    from convfirstnet.model import SIZES, ConvFirstNet

    size = SIZES["pico"]
    stages = [*size.stages[:3], size.stages[3].__class__(**{**size.stages[3].__dict__, "depth": 1})]
    torch.manual_seed(0)
    model = ConvFirstNet(size.stem, stages, num_classes=10).train()
    ref = copy.deepcopy(model)
    calls = []
    fused = training_kernels.fused_forward
    monkeypatch.setattr(training_kernels, "fused_forward", lambda b, x: calls.append(b) or fused(b, x))
    monkeypatch.setattr(training_kernels, "_WARNED", set())
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=CL)

    def step(m):
        torch.manual_seed(1)  # the classifier's dropout
        loss = m(x).square().mean()
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = step(model)
    reasons = sorted(str(w.message).split(":")[0] for w in caught if "layer-wise" in str(w.message))
    assert reasons == [], reasons
    blocks = [m for m in model.modules() if isinstance(m, (ConvFirst, MBConv))]
    assert calls == blocks and len(blocks) == 7  # Pico: 1 + 2 + 3 ConvFirst blocks, one MBConv here
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "reference")
    loss_ref = step(ref)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert list(model.state_dict()) == list(ref.state_dict())
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}
    for name, p in model.named_parameters():
        scale = ref_grads[name].abs().max().item()
        if ".bn" in name and name.endswith(".bias"):  # can be zero in exact arithmetic (see _scales)
            scale = max(scale, ref_grads[name[: -len("bias")] + "weight"].abs().max().item())
        err = (p.grad - ref_grads[name]).abs().max().item() / scale
        assert err <= TOL[torch.float32], f"{name}: error {err:.3g} of its scale"
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.subprocess
@pytest.mark.slow
def test_ddp_gloo_two_processes_equal_layerwise():
    """torch.distributed.run, 2 CPU processes (gloo): two DDP steps (SGD with momentum, drop-path, running
    statistics) of a net of stride-1 ConvFirst blocks and an MBConv block through the fused Triton
    kernels and the recompute path (interpreter) give the parameters and buffers of the same steps
    layer-wise under DDP, on both replicas."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("_ddp_fused_step.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replicas_equal"]
    worst = max(result["diffs"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-5, worst  # fp32 rounding through two steps (see TOL)


def test_mixed_batchnorm_modes_fall_back():
    """A block whose BatchNorms are in different modes (one frozen in eval) runs its layers."""
    block = make_block(16, 3, 0.0).train()
    block.bn_expand.eval()
    assert "differ in mode" in unsupported(block, torch.randn(1, 16, 4, 4))


# ------------------------------------------------------------------------------------------------
# GPU only (skipped without CUDA): fp16 / bf16 autocast against the fp32 training form at Small's shapes
# ------------------------------------------------------------------------------------------------

# (C, K, stride, t, map side): every ConvFirst block shape of ConvFirstNet-Small at 256 x 256
SMALL_BLOCKS = [(32, 32, 1, 3, 128), (32, 64, 2, 6, 128), (64, 64, 1, 6, 64), (64, 96, 2, 6, 64),
                (96, 96, 1, 6, 32)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _norm_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref||: a norm, since 16-bit rounding flips ReLU masks near zero (each flip moves
    one term of a gradient; see test_fp16_forward_and_backward_match_the_reference)."""
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("c,k,stride,t,side", SMALL_BLOCKS)
def test_small_blocks_autocast_gpu(monkeypatch, dtype, c, k, stride, t, side):
    """Batch 16 under autocast: the fused Triton block against the same block layer-wise in fp32: output,
    input and parameter gradients in norm within 16-bit rounding (fp16 2e-2, bf16 6e-2: a few roundings
    of u = 2^-11 / 2^-8 through the BatchNorm backwards) or within twice the error of the same block
    layer-wise under the same autocast, where rounding alone is larger: a gradient that sums terms which
    cancel (BN_dw's gamma) carries more relative error, whichever path computes it. BN_dw's beta gradient
    is zero in exact arithmetic (BN_expand follows its conv): it is measured against its gamma's (as the
    CPU tests' _scales). Running statistics within 1e-2."""
    block = make_block(c, t, 0.0, k=k, stride=stride).cuda().train()
    ref, lw = copy.deepcopy(block), copy.deepcopy(block)
    x = torch.randn(16, c, side, side, device="cuda").contiguous(memory_format=CL)
    dout = torch.randn(16, k, -(-side // stride), -(-side // stride), device="cuda")
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "triton")
    xa = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype):
        out = block(xa)
    out.float().backward(dout)
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "reference")
    xc = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype):
        out_lw = lw(xc)
    out_lw.float().backward(dout)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    xb = x.clone().requires_grad_()
    out_ref = ref(xb)
    out_ref.backward(dout)
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    got = {"out": out, "x": xa.grad, **{n: p.grad for n, p in block.named_parameters()}}
    want = {"out": out_ref, "x": xb.grad, **{n: p.grad for n, p in ref.named_parameters()}}
    layerwise = {"out": out_lw, "x": xc.grad, **{n: p.grad for n, p in lw.named_parameters()}}
    assert out.dtype == dtype and all(p.grad.dtype == torch.float32 for p in block.parameters())
    for name, a in got.items():
        b, scale = want[name], want[name].double().norm()
        if name == "bn_dw.bias":
            scale = max(scale, want["bn_dw.weight"].double().norm())
        err = ((a.double() - b.double()).norm() / scale).item()
        err_lw = ((layerwise[name].double() - b.double()).norm() / scale).item()
        assert err <= max(tol, 2 * err_lw), f"{name}: {err:.3g} (layer-wise {err_lw:.3g})"
    for (name, b), r in zip(block.named_buffers(), ref.buffers()):
        if b.is_floating_point():
            assert _norm_error(b, r) <= 1e-2, name


@cuda
@pytest.mark.gpu
def test_backward_bitwise_deterministic_gpu(monkeypatch):
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "triton")
    block = make_block(64, 6, 0.0).cuda().half().train()
    x = torch.randn(32, 64, 56, 56, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    dout = torch.randn_like(x)
    _, g1, _ = run_block(copy.deepcopy(block), x, dout, 0, fused=True)
    _, g2, _ = run_block(copy.deepcopy(block), x, dout, 0, fused=True)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name


@cuda
@pytest.mark.gpu
def test_compiled_training_step_gpu(monkeypatch):
    """torch.compile(fullgraph=True) of a training step through the fused Triton ops equals eager."""
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "triton")
    net = torch.nn.Sequential(make_block(32, 32, 0.0, k=64, stride=2), make_block(64, 6, 0.0)).cuda()
    x = torch.randn(8, 32, 64, 64, device="cuda").contiguous(memory_format=CL)
    loss, loss_ref, errors = compiled_step_errors(net, x)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-3, atol=1e-4)
    for name, err in errors.items():
        assert err <= 1e-2, name
