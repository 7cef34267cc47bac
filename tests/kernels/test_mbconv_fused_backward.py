"""The stride-1 MBConv + SE training backward as passes over the narrow input
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

from convfirstnet import mbconv_fused_backward
from convfirstnet.blocks import MBConv
from convfirstnet.mbconv_fused_forward import stats_rows

CL = torch.channels_last
NAMES = ("x", "w_exp", "gamma_e", "beta_e", "w_dw", "gamma_d", "beta_d", "w_se1", "b_se1", "w_se2", "b_se2",
         "w_proj", "gamma_p", "beta_p")


def _block(c: int, dtype=torch.float64) -> MBConv:
    torch.manual_seed(0)
    m = MBConv(c, c, 1).to(dtype).train()
    for bn in (m.bn_expand, m.bn_dw, m.bn_project):
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return m


def _params(m: MBConv) -> list[torch.Tensor]:
    se = m.se
    return [m.conv_expand.weight, m.bn_expand.weight, m.bn_expand.bias, m.conv_dw.weight, m.bn_dw.weight,
            m.bn_dw.bias, se.fc1.weight, se.fc1.bias, se.fc2.weight, se.fc2.bias, m.conv_project.weight,
            m.bn_project.weight, m.bn_project.bias]


def _layers(m: MBConv, x: torch.Tensor, drop: torch.Tensor):
    """The training-form forward with drop-path scale ``drop``; (out, o, stats) as the op saves them."""
    e = m.conv_expand(x)
    h = m.act(m.bn_expand(e))
    d = m.conv_dw(h)
    g = m.act(m.bn_dw(d))
    o = m.conv_project(m.se(g))
    out = x + drop[:, None, None, None] * m.bn_project(o)
    r, k = e.shape[1], o.shape[1]
    stats = torch.empty(4 * r + 2 * k, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype)
    for rows, t in zip(stats_rows(stats, r, k), (e, d, o)):
        var, mean = torch.var_mean(t.detach().double(), (0, 2, 3), unbiased=False)
        rows[0], rows[1] = mean, (var + m.bn_expand.eps).rsqrt()
    return out, o.detach().contiguous(memory_format=CL), stats


def test_chain_of_reference_passes_is_autograd():
    """fp64, C = 32 (R = 128), 6x6 maps, drop-path scales 0 and 1.25: every gradient within 1e-12 of
    its maximum (observed ~1e-15: the passes are the same algebra in another order)."""
    m = _block(32)
    x = torch.randn(3, 32, 6, 6, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_()
    drop = torch.tensor([0.0, 1.25, 1.25], dtype=torch.float64)
    out, o, stats = _layers(m, x, drop)
    gout = torch.randn_like(out)
    want = torch.autograd.grad(out, [x, *_params(m)], gout)
    got = mbconv_fused_backward.backward(gout, x.detach(), *[p.detach() for p in _params(m)], o, stats, drop,
                                         triton=False)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= 1e-12, f"{name}: {err:.3g}"
