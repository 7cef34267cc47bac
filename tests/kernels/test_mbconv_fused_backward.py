"""The MBConv + SE training backward (stride 1 and 2) as passes over the narrow input
(convfirstnet/mbconv_fused_backward.py; each pass stated in kernels/mbconv/backward_reference.py and
tested against its Triton launches in test_mbconv_gate_backward.py, test_mbconv_expand_backward.py and
test_mbconv_bn_p_backward.py):

* the chain of the PyTorch passes equals autograd of the training-form layers in fp64 (a wrong term in
  the chain shows far above fp64 rounding);
* the op's backward through the Triton passes (interpreter) against autograd of the layers in fp32.
"""

from __future__ import annotations

import pytest
import torch
from convfirstnet.kernels.mbconv.backward_reference import x_moments_reference

from convfirstnet import mbconv_fused_backward
from convfirstnet.blocks import MBConv
from convfirstnet.mbconv_fused_forward import stats_rows, stats_size, x_rows
from convfirstnet.mbconv_recompute import op_weights

CL = torch.channels_last
NAMES = ("x", "w_exp", "gamma_e", "beta_e", "w_dw", "gamma_d", "beta_d", "w_se1", "b_se1", "w_se2", "b_se2",
         "w_proj", "gamma_p", "beta_p")


def _block(c: int, dtype=torch.float64, k: int | None = None, stride: int = 1) -> MBConv:
    torch.manual_seed(0)
    m = MBConv(c, k or c, stride).to(dtype).train()
    for bn in (m.bn_expand, m.bn_dw, m.bn_project):
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return m


def _layers(m: MBConv, x: torch.Tensor, drop: torch.Tensor):
    """The training-form forward with drop-path scale ``drop``; (out, o, stats) as the op saves them."""
    e = m.conv_expand(x)
    h = m.act(m.bn_expand(e))
    d = m.conv_dw(h)
    g = m.blur(m.act(m.bn_dw(d)))
    o = m.conv_project(m.se(g))
    out = x + drop[:, None, None, None] * m.bn_project(o) if m.stride == 1 else m.bn_project(o)
    r, k = e.shape[1], o.shape[1]
    c = x.shape[1]
    stats = torch.empty(stats_size(c, r, k), dtype=torch.float32 if x.dtype != torch.float64 else x.dtype)
    for rows, t in zip(stats_rows(stats, r, k), (e, d, o)):
        var, mean = torch.var_mean(t.detach().double(), (0, 2, 3), unbiased=False)
        rows[0], rows[1] = mean, (var + m.bn_expand.eps).rsqrt()
    xr = x.detach().double().permute(0, 2, 3, 1).reshape(-1, c)
    for dst, src in zip(x_rows(stats, c, r, k), x_moments_reference(xr, m.conv_expand.weight.reshape(r, c))):
        dst.copy_(src.detach())
    return out, o.detach().contiguous(memory_format=CL), stats


def _check_chain(m: MBConv, x: torch.Tensor, drop: torch.Tensor) -> None:
    """The chain of the reference passes (fp64) against autograd of the layers: every gradient within 1e-12
    of its maximum."""
    out, o, stats = _layers(m, x, drop)
    gout = torch.randn_like(out)
    want = torch.autograd.grad(out, [x, *op_weights(m)], gout)
    weights = [p.detach() for p in op_weights(m)]
    got = mbconv_fused_backward.backward(gout, x.detach(), *weights, o, stats, drop, m.stride, triton=False)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= 1e-12, f"{name}: {err:.3g}"


def test_chain_of_reference_passes_is_autograd():
    """fp64, C = 32 (R = 128), 6x6 maps, drop-path scales 0 and 1.25: every gradient within 1e-12 of
    its maximum (observed ~1e-15: the passes are the same algebra in another order)."""
    m = _block(32)
    x = torch.randn(3, 32, 6, 6, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_()
    drop = torch.tensor([0.0, 1.25, 1.25], dtype=torch.float64)
    _check_chain(m, x, drop)


@pytest.mark.parametrize("hw", [(6, 6), (7, 5)])
def test_stride2_chain_of_reference_passes_is_autograd(hw):
    """Stride 2, fp64, C = 32 -> K = 48 (R = 128), 6x6 -> 3x3 and 7x5 -> 4x3 (BlurPool's reflection on
    both sides of odd maps): every gradient within 1e-12 of its maximum, as for stride 1."""
    m = _block(32, k=48, stride=2)
    x = torch.randn(3, 32, *hw, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_()
    drop = torch.ones(3, dtype=torch.float64)
    _check_chain(m, x, drop)


# ------------------------------------------------------------------------------------------------ the op

def _op_grads(block: MBConv, x: torch.Tensor, drop: torch.Tensor, dt: torch.dtype, gout: torch.Tensor):
    """The op's output and the gradients of x and the 13 weights for ``gout``."""
    from .test_mbconv_fused_forward import _op_args

    args = list(_op_args(block, x, drop, dt))
    leaves = [args[0].detach().requires_grad_()] + [t.detach().requires_grad_() for t in args[1:14]]
    args[:14] = leaves
    out = torch.ops.convfirstnet.mbconv_recompute_train(*args)[0]
    return out, torch.autograd.grad(out, leaves, gout.to(out.dtype))


# stride 1 at C = 96 only: its masked channel chunks take every path that full ones do, and each pass's
# own tests run the model's other widths (C = 128 here took 42 s of the suite for no path of its own)
@pytest.mark.parametrize("c, k, stride, side", [(96, 96, 1, 8), (64, 96, 2, 9)])
def test_op_backward_through_the_fused_passes(interpreter_backend, monkeypatch, c, k, stride, side):
    """The op (fused forward and the fused backward passes in the interpreter, fp32, N = 3, 8x8 maps, one
    image dropped and two scaled by 1.25; C = 96 has masked channel chunks; stride 2, N = 2, on 9x9 -> 5x5,
    BlurPool's reflection on both sides) against the layer-wise op in fp64 (the layers' autograd): each
    gradient within 1e-4 of its maximum. fp32 rounding differs between the two forms (the BatchNorm
    statistics, the summation orders); the BatchNorm backwards subtract means of the same size as the terms,
    which amplifies it (observed <= 2e-5)."""
    from .test_mbconv_fused_forward import _block as block_of

    calls = []
    real = mbconv_fused_backward.backward
    monkeypatch.setattr(mbconv_fused_backward, "backward", lambda *a, **k: calls.append(k) or real(*a, **k))
    block = block_of(c, k, stride)
    gen = torch.Generator().manual_seed(4)
    n = 3 if stride == 1 else 2  # stride 2 has no residual, so no drop-path: two images are enough
    x = (torch.randn(n, c, side, side, generator=gen) + 0.5).contiguous(memory_format=CL)
    so = -(-side // stride)
    gout = torch.randn(n, k, so, so, generator=gen).contiguous(memory_format=CL)
    drop = torch.tensor([0.0, 1.25, 1.25]) if stride == 1 else torch.ones(n)
    _, got = _op_grads(block, x, drop, torch.float32, gout)
    assert calls == [{"triton": True}]
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "reference")
    _, want = _op_grads(block, x.double(), drop, torch.float64, gout)
    assert len(calls) == 1
    for name, a, b in zip(NAMES, got, want):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err <= 1e-4, f"{name}: {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("c, k, stride, side", [(256, 256, 1, 16), (256, 256, 1, 8), (96, 192, 2, 32),
                                                (192, 256, 2, 16)])
def test_small_backward_on_gpu(monkeypatch, dtype, c, k, stride, side):
    """Small's MBConv blocks (stride 1: C = 256 at 16x16 and 8x8; its two stride-2 blocks), batch 16, fused
    forward and backward through the compiled kernels against the layer-wise op in fp32 on the same 16-bit
    input: every gradient within a few units of the dtype's rounding in norm (fp16 2^-11, bf16 2^-8,
    through four 16-bit round trips of wide tensors), or within twice the error of the layer-wise op in
    the same 16-bit dtype where rounding alone is larger (the SE weights' gradients sum over every pixel
    terms that cancel: w_se1's was 0.026 in fp16 at 16x16 on an H200)."""
    from .test_mbconv_fused_forward import _block as block_of

    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "auto")
    calls = []
    real = mbconv_fused_backward.backward
    monkeypatch.setattr(mbconv_fused_backward, "backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    block = block_of(c, k, stride).cuda()
    x = (torch.randn(16, c, side, side, device="cuda") + 0.5).to(dtype).contiguous(memory_format=CL)
    gout = torch.randn(16, k, side // stride, side // stride, device="cuda").contiguous(memory_format=CL)
    drop = torch.tensor([0.0] + [1.25] * 15, device="cuda") if stride == 1 else torch.ones(16, device="cuda")
    _, got = _op_grads(block, x, drop, dtype, gout)
    assert calls == [1]
    monkeypatch.setenv("CONVFIRSTNET_KERNELS", "reference")
    _, want = _op_grads(block, x.float(), drop, torch.float32, gout)
    _, layerwise = _op_grads(block, x, drop, dtype, gout)
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    for name, a, b, c in zip(NAMES, got, want, layerwise):
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        err_lw = ((c.double() - b.double()).norm() / b.double().norm()).item()
        assert err <= max(tol, 2 * err_lw), f"{name}: {err:.3g} (layer-wise {err_lw:.3g})"


@pytest.mark.compile
@pytest.mark.parametrize("stage, index, shape",
                         [(3, 1, (1, 256, 16, 16)), (3, 0, (1, 96, 32, 32)), (4, 0, (1, 256, 16, 16))],
                         ids=["s1-16x16", "s2-32x32", "s2-16x16"])
def test_small_backward_launches_fit_an_a100(stage, index, shape):
    """The backward's launches at Small's 16x16 stride-1 shape and its two stride-2 blocks (batch 128,
    fp16) compile for sm_80 within its 163 KB of shared memory per block (the tiles are chosen for sm_90,
    whose limit is 227 KB; the chain is selected on any CUDA GPU). Compiled: at most 160 KB; the BN_d passes
    (gate_backward) keep 8-344 B of stack there (slower, not wrong), the BN_e passes none."""
    pytest.importorskip("triton")
    import convfirstnet
    from convfirstnet.analysis.compiled import compile_variants, variant_of
    from convfirstnet.analysis.targets import target
    from convfirstnet.analysis.training import record_mbconv_backward

    from .test_mbconv import SHARED_LIMIT

    block = convfirstnet.small().stages[stage][index].train()
    launches, _ = record_mbconv_backward(block, shape, 128, torch.float16, target(80))
    variants = {}
    for lc in launches:
        v = variant_of(lc, 80)
        variants.setdefault(v.key, v)
    compiled = compile_variants(list(variants.values()))
    limit = SHARED_LIMIT[80]
    over = [f"{v.name}: {c.shared} B" for v, c in zip(variants.values(), compiled) if c.shared > limit]
    assert not over, over


@pytest.mark.compile
def test_weight_chunk_loaded_before_the_pixel_loop():
    """gate_backward's and expand_backward's headers say each program loads its chunk of W_proj / W_exp
    once, before its pixel loop, into shared memory. Compiled for sm_90 at Small's 16x16 shape (fp16):
    the [RB, C] weight tile's load and its ``ttg.local_alloc`` come before the first ``scf.for``, and,
    where the loop's own tiles have another shape (BM != RB), no load of that shape is inside the loop."""
    pytest.importorskip("triton")
    import re

    import convfirstnet
    from convfirstnet.analysis.compiled import variant_of
    from convfirstnet.analysis.targets import target
    from convfirstnet.analysis.training import record_mbconv_backward

    from ._asm import compile_asm

    block = convfirstnet.small().stages[3][1].train()
    launches, _ = record_mbconv_backward(block, (1, 256, 16, 16), 128, torch.float16, target(90))
    picked = [variant_of(lc, 90) for lc in launches
              if lc.kernel.fn.__name__ in ("_gate_backward_kernel", "_expand_kernel")]
    assert len(picked) == 4  # dgate_pool, bn_d_backward; expand_hidden, bn_e_weights
    for v, asm in zip(picked, compile_asm(picked)):
        lines = asm["ttgir"].splitlines()
        loop = next(i for i, line in enumerate(lines) if "scf.for" in line)
        shape = f"tensor<{v.meta['RB']}x256x"
        where = f"{v.name} MODE={v.meta['MODE']}"
        loads = [i for i, line in enumerate(lines) if "tt.load" in line and shape in line]
        allocs = [i for i, line in enumerate(lines) if "ttg.local_alloc" in line and shape in line]
        assert loads and min(loads) < loop and allocs and min(allocs) < loop, where
        if v.meta["BM"] != v.meta["RB"]:
            assert max(loads) < loop, f"{where}: the weight tile is loaded inside the pixel loop"
        assert re.search(r"warp_group_dot", asm["ttgir"]), where
