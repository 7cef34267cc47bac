"""Every fused model end to end through the Triton kernels on a GPU, against the fp32 training form.

The training form (BatchNorm with random statistics, eval mode) runs in fp32 with TF32 off; the fused
form (BatchNorm folded, one Triton kernel per block) runs in fp16 or bf16 on the same input.

Tolerances come from measurements of the same comparison with the fused form's PyTorch reference
ops on CPU (256x256, batch 8, these seeds): max |fused - ref| / max |ref| was 5.6e-4 ... 1.4e-3 in
fp16 and 4.1e-3 ... 1.2e-2 in bf16 over the four sizes. The kernels round more often inside a block
(hidden activations to the dot operand type; SiLU through tanh.approx, max relative error 2^-11, about
one more fp16 rounding), so the bounds are 5x those figures: 7e-3 (fp16) and 6e-2 (bf16).

Top-1: these random models give every image nearly the same logits (the classifier's response to the
mean feature), with top-1 minus top-2 margins of 0.016 ... 0.22 of max |logit|. An error within the
bound cannot flip an image whose margin exceeds twice the bound, so top-1 must agree on every such
image; in fp16 every image is such an image (checked, so that the comparison cannot become empty),
in bf16 those of Nano and Small (margins 0.13 ... 0.22; Pico's and Tiny's are below bf16's error).
"""

import pytest
import torch

import convfirstnet
from convfirstnet.kernels import _launch

from ..conftest import cuda
from .._models import trained_like

MAX_REL = {torch.float16: 7e-3, torch.bfloat16: 6e-2}


@pytest.fixture
def no_tf32(monkeypatch):
    """The fp32 reference must be fp32: cuDNN convolutions and cuBLAS matmuls may use TF32 otherwise."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.fixture
def count_launches(monkeypatch):
    """Counts Triton kernel launches, to show that the fused model really ran its kernels."""
    launched = []
    real = _launch.launchable

    def counting(kernel, args=()):
        launched.append(kernel)
        return real(kernel, args)

    monkeypatch.setattr(_launch, "launchable", counting)
    return launched


def layerwise():
    """The training form layer by layer (cuDNN): with the Triton kernels selected, its ConvFirst blocks
    would otherwise run the fused training ops (convfirstnet.training_kernels)."""
    return _launch.selected_backend("reference")


def compare(name, batch, dtype, memory_format=torch.contiguous_format, seed=0):
    model = trained_like(name, seed=seed).cuda()
    fused = convfirstnet.fuse(model).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 256, 256, generator=gen).cuda()
    with torch.no_grad():
        with layerwise():
            ref = model(x).double()
        out = fused(x.to(dtype).contiguous(memory_format=memory_format))
    assert out.dtype == dtype and out.shape == ref.shape
    out = out.double()
    assert torch.isfinite(out).all()
    scale = ref.abs().max()
    max_rel = ((out - ref).abs().max() / scale).item()
    top2 = ref.topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * MAX_REL[dtype] * scale
    agree = out.argmax(1) == ref.argmax(1)
    return max_rel, agree, decided


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", convfirstnet.list_models())
def test_fused_model_matches_training_form(triton_backend, no_tf32, count_launches, name, dtype):
    """256x256, batch 8: every block through its Triton kernel."""
    max_rel, agree, decided = compare(name, 8, dtype)
    blocks = 2 + sum(len(s) for s in convfirstnet.fuse(trained_like(name)).stages)  # stem, stages, head
    assert len(count_launches) >= blocks, f"{len(count_launches)} Triton launches for {blocks} blocks"
    assert max_rel < MAX_REL[dtype], f"max relative error {max_rel:.2e}"
    flipped = (~agree & decided).nonzero().flatten().tolist()
    assert agree[decided].all(), f"top-1 differs for decided images {flipped}"
    if dtype == torch.float16:
        assert decided.all(), f"only {int(decided.sum())} of 8 images have a margin above twice the bound"


@cuda
@pytest.mark.gpu
def test_small_at_batch_128_fp16(triton_backend, no_tf32):
    """The paper's benchmark shape: Small, batch 128, 256x256, fp16, channels-last input."""
    max_rel, agree, decided = compare("small", 128, torch.float16, torch.channels_last, seed=1)
    assert max_rel < MAX_REL[torch.float16], f"max relative error {max_rel:.2e}"
    assert decided.all(), f"only {int(decided.sum())} of 128 images have a top-1 margin above twice the bound"
    assert agree.all(), f"top-1 differs for {(~agree).sum().item()} images"
