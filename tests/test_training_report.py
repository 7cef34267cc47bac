"""convfirstnet kernels --train (convfirstnet/analysis/training.py): the layer-wise training kernels and
the stored-activation count, without compiling (the fused launches' estimates are those of the
inference report's model, tested there)."""

from __future__ import annotations

import pytest
import torch

from convfirstnet.analysis.training import _LayerWise, blocks_of, stored_at, stored_bytes
from convfirstnet.analysis.waterline import _shape_hooks
from convfirstnet.blocks import ConvFirst, MBConv
from convfirstnet.factory import create_model

SIZE = (3, 64, 64)


@pytest.fixture(scope="module")
def pico():
    torch.manual_seed(0)
    model = create_model("pico").train()
    return model, _shape_hooks(model, SIZE)


def test_layerwise_kernels_do_each_layer_three_times(pico):
    """Forward, dgrad and wgrad of every conv: 3x the block's MACs (BlurPool: forward and its transpose)."""
    model, shapes = pico
    lw = _LayerWise(shapes, batch=4, eb=2)
    for path, m in blocks_of(model):
        if isinstance(m, ConvFirst) and m.stride == 1:
            n, c, h, w = shapes[path][0]
            r = m.conv_expand.out_channels
            assert sum(k.macs for k in lw.block(path, m)) == 3 * 4 * h * w * (72 * c + 2 * c * r)
        if isinstance(m, MBConv) and m.stride == 2:
            kernels = lw.block(path, m)
            blur = [k for k in kernels if ".blur" in k.name]
            assert len(blur) == 2 and blur[0].macs == blur[1].macs > 0


def test_stored_bytes_fused_block_keeps_three_narrow_maps(pico):
    """A stride-1 ConvFirst block run by the fused op keeps x, a and p (C channels each, at the report's
    element size) and per-channel statistics; the layer-wise block keeps x, a, y, z, h and p."""
    model, shapes = pico
    fused = stored_bytes(model, SIZE, 2, fused=True)
    layerwise = stored_bytes(model, SIZE, 2, fused=False)
    path = "stages.1.1"  # after a stride-2 block: its input is first kept by this block
    block = model.get_submodule(path)
    assert isinstance(block, ConvFirst) and block.stride == 1
    _, c, h, w = shapes[path][0]
    r = block.conv_expand.out_channels
    narrow = 2 * c * h * w
    assert 3 * narrow <= fused[path] <= 3 * narrow + 4 * (c * c + 6 * c + 2 * r) + 64
    assert layerwise[path] >= (4 * c + 2 * r) * h * w * 2
    # at a training batch (at batch 1 the fused ops' statistics, W_exp times x's Gram matrix, which do not
    # grow with the batch, outweigh one image's activations)
    lean, full = (sum(stored_at(model, SIZE, 2, f, 32).values()) for f in (True, False))
    assert lean < full
    # the model's state (running statistics) is left as it was
    bns = [b for b in model.modules() if isinstance(b, torch.nn.BatchNorm2d)]
    assert all(int(b.num_batches_tracked) == 0 for b in bns)


def test_stored_bytes_extrapolate_to_the_batch(pico):
    """The report's stored bytes at batch 3, extrapolated from batches 1 and 2, equal a batch-3 measurement
    per block: the MBConv ops' statistics (W_exp times x's Gram matrix among them) do not grow with the
    batch, so batch-1 bytes times the batch would overstate them."""
    model, _ = pico
    for fused in (True, False):
        want = stored_bytes(model, SIZE, 2, fused=fused, batch=3)
        got = stored_at(model, SIZE, 2, fused, 3)
        assert {p: v for p, v in got.items() if v} == {p: v for p, v in want.items() if v}
    one = stored_bytes(model, SIZE, 2, fused=True)
    assert any(3 * one[p] != want_p for p, want_p in stored_bytes(model, SIZE, 2, fused=True, batch=3).items())


def test_fused_block_recording_counts_launches_and_small_ops():
    """A fused stride-1 block's training step on meta tensors: the 19 Triton launches (forward 8: gconv,
    moments, their merge, BN2's statistics, FFN, the merge of p's moments, residual, running statistics;
    backward 11, with the finalize kernels, the conv's one dgrad + wgrad launch and both reductions) and
    the small aten ops between them, each
    of which the report charges one launch gap: none left but the drop-path scale's (ones without
    drop-path)."""
    from convfirstnet.analysis.targets import target
    from convfirstnet.analysis.training import record_fused_block

    block = ConvFirst(32, 32, 1, 3)
    launches, small = record_fused_block(block, (1, 32, 16, 16), 8, torch.float16, target(90))
    assert len(launches) == 19
    assert small <= 3, small  # 1 with torch 2.14 (121 before the finalize kernels)


def test_mbconv_recompute_counts_its_forward_twice_and_stores_its_input(pico):
    """An MBConv block on the recompute path: the report counts its layer-wise kernels plus the forward
    kernels run again in the backward (3 convs, 3 BatchNorms' statistics and normalise passes, the SE's
    pool, fc1, fc2 and gate, BlurPool at stride 2: the forward MACs once more), and stores narrow tensors
    only, measured through the same saved_tensors_hooks: its input and projection before BN_p, the (N,)
    drop-path scale, the three BatchNorms' mean and rstd, x's mean and W_exp G, G x's centred Gram matrix
    (4 R + 2 K + C + R C values, fp32)."""
    model, shapes = pico
    lw = _LayerWise(shapes, batch=4, eb=2)
    fused = stored_bytes(model, SIZE, 2, fused=True)
    layerwise = stored_bytes(model, SIZE, 2, fused=False)
    seen = set()
    for path, m in blocks_of(model):
        if not isinstance(m, MBConv) or m.stride in seen:
            continue
        seen.add(m.stride)
        again = lw.recompute(path, m)
        forward = [k for k in lw.block(path, m) if k.name.endswith(" forward")]
        assert len(again) == 13 + (m.stride == 2)
        assert sum(k.macs for k in again) == sum(k.macs for k in forward) > 0
        assert all(k.bytes > 0 for k in again)
        _, c, h, w = shapes[path][0]
        _, k, oh, ow = shapes[path][1]
        r = m.conv_expand.out_channels
        # x and o at 2 bytes, the drop-path scale and the statistics in fp32 (batch 1)
        assert fused[path] == 2 * c * h * w + 2 * k * oh * ow + 4 + 4 * (4 * r + 2 * k + c + r * c)
        # the layers keep wide (4C) tensors per image; the statistics (R C of them) do not grow with the batch
        assert layerwise[path] > 5 * (fused[path] - 4 * (4 * r + 2 * k + c + r * c))
    assert seen == {1, 2}


def test_training_recordings_take_the_target_geometry():
    """The training report records each block for its target, arch and shared memory included: at
    Small's 16x16 MBConv shape the projection takes 128-row tiles on sm_90 and 64-row tiles below it,
    and the expand's pixel splits follow the SM count (with only the SM count and L2 passed, sm_80
    recorded sm_90's)."""
    from convfirstnet.analysis.targets import target
    from convfirstnet.analysis.training import record_mbconv_forward

    block = MBConv(256, 256, 1)
    rows, grids = {}, {}
    for arch in (90, 80):
        launches, _ = record_mbconv_forward(block, (1, 256, 16, 16), 128, torch.float16, target(arch))
        assert launches[8].kernel.fn.__name__ == "_mbconv_project_kernel"
        rows[arch] = launches[8].meta["BM"]
        grids[arch] = launches[3].grid
    assert rows == {90: 128, 80: 64}
    assert grids[90] != grids[80]


@pytest.mark.parametrize("stride", [1, 2])
def test_mbconv_fused_forward_recording(stride):
    """An MBConv block's training forward through the fused kernels on meta tensors (the report's count):
    Triton launches (x's Gram partials and merge, BN_e's statistics, h by the expand kernel, the conv's output
    u by the group-width-8 conv with BN_d's moments, BN_d's statistics, the BN_d pass over u (stride 2: with
    the blur), the SE gates, the projection without residual, BN_p's statistics, merge and apply) and two aten
    ops: the six weights' copy to fp16 (autocast keeps them in fp32) and the projection's zero bias; the
    forward's and backward's layer-wise kernels split the block's kernels."""
    from convfirstnet.analysis.targets import target
    from convfirstnet.analysis.training import _is_forward, record_mbconv_forward

    c, k, side = (32, 32, 16) if stride == 1 else (32, 64, 16)
    launches, small = record_mbconv_forward(MBConv(c, k, stride), (1, c, side, side), 8, torch.float16,
                                            target(90))
    names = [lc.kernel.fn.__name__ if hasattr(lc.kernel, "fn") else lc.kernel.__name__ for lc in launches]
    assert names == ["_gram_partials_kernel", "_gram_merge_kernel", "_bn_e_stats_kernel", "_expand_kernel",
                     "_gconv_fwd_kernel", "_bn_d_stats_kernel", "_bn_silu_pool_kernel", "_se_gates_kernel",
                     "_mbconv_project_kernel", "_channel_partials_kernel", "_bn_merge_kernel",
                     "_bn_apply_kernel"]
    assert launches[4].meta["MOMENTS"] is True
    assert launches[-4].meta["RESIDUAL"] is False and launches[-1].meta["RESIDUAL"] is (stride == 1)
    assert small == 2, small
    model = torch.nn.Sequential(MBConv(c, k, stride)).train()
    shapes = _shape_hooks(model, (c, side, side))
    kernels = _LayerWise(shapes, batch=8, eb=2).block("0", model[0])
    forward = [kn.name for kn in kernels if _is_forward(kn)]
    # 3 x (conv, BatchNorm statistics, normalise), the SE's pool, fc1, fc2 and gate, the blur at stride 2
    assert len(forward) == 13 + (stride == 2), forward
    assert all(kn.name.endswith(("dgrad", "wgrad", "backward", "backward sums"))
               for kn in kernels if not _is_forward(kn))


def test_launches_floor_takes_the_larger_of_tensor_and_dram_plus_the_gaps():
    """The training step's floor: per launch max(tensor, DRAM) at the high end plus its graph launch gap
    (the low ends, L2, the L1 pipe, latency and waits do not enter), and a launch gap per small aten op."""
    from types import SimpleNamespace

    from convfirstnet.analysis.hardware import hardware
    from convfirstnet.analysis.training import launches_floor

    def est(tensor, dram, other, gap):
        terms = {k: {"low": 0.5 * v, "high": v} for k, v in
                 dict(tensor=tensor, dram=dram, l2=other, lsu=other, issue=other, latency=other,
                      waits=other).items()}
        return SimpleNamespace(terms=terms, launch_gap={"graph": {"low": 0.0, "high": gap},
                                                        "stream": {"low": 9.0, "high": 9.0}})

    hw = hardware(90)
    gap = hw.launch_graph_us.pick("high") * 1e-6
    launches = [est(3e-6, 2e-6, 50e-6, 1e-6), est(1e-6, 7e-6, 50e-6, 2e-6)]
    assert launches_floor(launches, 0, hw) == pytest.approx(3e-6 + 1e-6 + 7e-6 + 2e-6)
    assert launches_floor(launches, 4, hw) == pytest.approx(13e-6 + 4 * gap)
    assert launches_floor([], 2, hw) == pytest.approx(2 * gap)
