"""The static cost of one training step (forward + backward), fused against layer-wise
(``convfirstnet kernels --train``).

Per block of the training-form model (``stem``, ``stages.i.j``, ``head``, ``classifier``):

* fused: a block the fused training ops run (``training_kernels.unsupported`` says which: today the
  ConvFirst blocks) is recorded on meta tensors, forward and backward, inside
  ``kernels._cost.recording()``; every launch is compiled for the target and estimated by the same
  model as the inference report (``launches.estimate_launches``: tensor, DRAM, L2, L1 pipe, issue, latency,
  waits, launch gap; low and high ends). The small aten ops between the launches (the per-channel
  arithmetic on (C,) to (R, C) tensors, gradient accumulation, the running-statistics update) are
  counted while recording and each costs one launch gap in a CUDA graph (torch.compile would fuse
  many of them). Blocks without a fused training op run layer-wise and are counted at their
  layer-wise bound (below), which is optimistic for them;
* recompute, layer-wise kernels: the MBConv + SE blocks in training mode (``training_kernels.recomputes``;
  convfirstnet/mbconv_recompute.py) store only their narrow input and recompute the wide activations
  in the backward with the layers' own kernels. They are counted as their layer-wise kernels (below)
  plus the forward kernels run again in the backward (expand, BatchNorm statistics and normalise + SiLU,
  grouped conv, BatchNorm, BlurPool, SE pool, fc1, fc2, gate, project, BatchNorm: ``_LayerWise.recompute``),
  plus one launch gap per small op of the path (``mbconv_recompute.SMALL_OPS_PER_STEP``: the running
  statistics' copies). Where the op's forward runs through the fused MBConv kernels
  (convfirstnet/mbconv_fused_forward.py: the BatchNorms with the batch statistics), the forward
  is counted instead as its recorded launches (``record_mbconv_forward``: x's Gram partials and their
  merge, BN_e's statistics, h by the expand kernel, the conv's output and BN_d's moments by the group-width-8
  conv (or a moments pass over that output), BN_d's statistics, the BN_d pass (+ BlurPool, the pool), the SE
  gates, the projection without residual, BN_p's statistics, merge and normalise + drop-path + residual
  (kernels/mbconv/narrow.py); estimated like the fused blocks') and one launch gap per other aten op.
  The backward runs the fused passes over the narrow input (convfirstnet/mbconv_fused_backward.py) and
  is counted the same way (``record_mbconv_backward``: BN_p's backward, h and the conv's output
  recomputed, the SE and BN_d passes (stride 2: g = BlurPool(SiLU(v_d)) recomputed, BN_d's backward
  through BlurPool's transpose), the conv's dgrad and wgrad, the BN_e passes, dx, and one launch gap per
  other aten op: the weights' casts); where it is not selected, the layer-wise bound's backward kernels
  plus the recompute;
* layer-wise training bound: every layer as its own kernels, each at max(tensor, DRAM, L2) time of
  its MACs and bytes plus one launch gap in a CUDA graph (``estimate.layerwise_time``, the waterline's
  rule with the report's constants). Kernels and bytes (activations in the report's dtype, every input
  read once and every output written once; weights read once per kernel, weight gradients written in
  fp32):

    conv / linear     forward (x, y), dgrad (dy, dx; not for the stem's image), wgrad (x, dy): 3 x MACs
    BatchNorm         forward: statistics (read v), normalise + activation (+ residual, drop-path)
                      (read v (+ x), write); backward: sums (read dout, v and the activation's saved
                      output when one follows), apply (the same plus a write)
    BlurPool          forward and its transpose, 9 MACs per output each
    SE                pool (read g), fc1, fc2 (convs), gate multiply (read g, write s); backward: read ds
                      and g, write dg (the pool's broadcast folded in)
    cat (stride-2 ConvFirst) forward copy of x and y; backward: the two gradients of x added
    residual          backward: dx = dout + dgrad (read 2, write 1)
    head pool         forward read, backward write

* stored activations: what autograd keeps for the backward, measured by ``saved_tensors_hooks`` on a
  batch-1 and a batch-2 forward pass on CPU of each form (tensors deduplicated by storage, parameters
  excluded), activations counted at the report's element size and the fused ops' fp32 statistics at 4
  bytes, and extrapolated linearly to the batch (the per-image part times the batch, plus what does not
  grow with it: the MBConv ops' saved statistics, W_exp times x's Gram matrix among them).

The figures are estimates from compiled code and declared work (fused) and a bound (layer-wise), not
measurements.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

import convfirstnet
from convfirstnet import mbconv_fused_forward, mbconv_recompute, training_kernels
from convfirstnet.blocks import ConvFirst, Head, MBConv, Stem
from convfirstnet.kernels._cost import recording

from .estimate import layerwise_time
from .hardware import ENDS, hardware
from .launches import estimate_launches
from .provenance import git_info
from .targets import target as get_target
from .waterline import _shape_hooks, _stage_label

FORMAT = "convfirstnet-training-report/1"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
BLOCK_TYPES = (Stem, ConvFirst, MBConv, Head, nn.Linear)
TARGETS = dict(step_over_layerwise=0.5, stored_over_layerwise=0.25)  # issue 20, item 3 (high end)
# how a block trains, by (fused, recompute)
PATHS = {(True, False): "fused", (False, True): "recompute, layer-wise kernels", (False, False): "layer-wise"}
FUSED_FORWARD_PATH = "fused forward; recompute backward, layer-wise kernels"
FUSED_BACKWARD_PATH = "fused forward; fused backward passes over the narrow input"
# names of the layer-wise kernels (_LayerWise.block) that belong to the forward
_FORWARD_KERNELS = (" forward", " statistics", " normalise", " pool", " gate")


def _is_forward(k: "TrainKernel") -> bool:
    return k.name.endswith(_FORWARD_KERNELS)


@dataclass(frozen=True)
class TrainKernel:
    """One layer-wise training kernel: whole-batch MACs and DRAM bytes (``layerwise_time`` reads
    ``ops`` and ``bytes``)."""

    name: str
    macs: int
    bytes: int

    @property
    def ops(self) -> int:
        return 2 * self.macs


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks in order: (module path, module)."""
    found = [(p, m) for p, m in model.named_modules() if p and isinstance(m, BLOCK_TYPES)]
    return [(p, m) for p, m in found if not any(p.startswith(q + ".") for q, _ in found)]


# ------------------------------------------------------------------------------ layer-wise kernels


class _LayerWise:
    """Layer-wise training kernels of one block, from the recorded batch-1 shapes."""

    def __init__(self, shapes: dict, batch: int, eb: int):
        self.shapes, self.n, self.eb = shapes, batch, eb
        self.kernels: list[TrainKernel] = []

    def elems(self, path: str, which: int) -> int:
        return self.n * math.prod(self.shapes[path][which][1:])

    def add(self, name: str, macs: int, read: int, write: int, extra_bytes: int = 0) -> None:
        self.kernels.append(TrainKernel(name, macs, (read + write) * self.eb + extra_bytes))

    def conv(self, path: str, conv: nn.Module, dgrad: bool = True) -> None:
        e_in, e_out = self.elems(path, 0), self.elems(path, 1)
        if isinstance(conv, nn.Linear):
            macs, w = self.n * conv.in_features * conv.out_features, conv.weight.numel()
        else:
            kh, kw = conv.kernel_size
            macs, w = e_out * (conv.in_channels // conv.groups) * kh * kw, conv.weight.numel()
        self.add(f"{path} forward", macs, e_in, e_out, w * self.eb)
        if dgrad:
            self.add(f"{path} dgrad", macs, e_out, e_in, w * self.eb)
        self.add(f"{path} wgrad", macs, e_in + e_out, 0, 4 * w)

    def batchnorm(self, path: str, act: bool, residual: bool = False) -> None:
        e = self.elems(path, 1)
        self.add(f"{path} statistics", 0, e, 0)
        self.add(f"{path} normalise", 0, e * (2 if residual else 1), e)
        saved = 3 if act else 2  # dout, the BatchNorm's input, the activation's saved output
        self.add(f"{path} backward sums", 0, saved * e, 0)
        self.add(f"{path} backward", 0, saved * e, e)

    def blur(self, path: str) -> None:
        e_in, e_out = self.elems(path, 0), self.elems(path, 1)
        self.add(f"{path} forward", 9 * e_out, e_in, e_out)
        self.add(f"{path} backward", 9 * e_out, e_out, e_in)

    def se(self, path: str, se: nn.Module) -> None:
        g = self.elems(path, 0)
        pooled = self.elems(f"{path}.fc1", 0)
        self.add(f"{path} pool", 0, g, pooled)
        self.conv(f"{path}.fc1", se.fc1)
        self.conv(f"{path}.fc2", se.fc2)
        self.add(f"{path} gate", 0, g + pooled, g)
        self.add(f"{path} gate backward", 0, 2 * g, g)

    def recompute(self, path: str, m: nn.Module) -> list[TrainKernel]:
        """The forward kernels an MBConv's recompute path runs again in the backward (module docstring):
        every output written again, so read back by the backward as the layer-wise one is."""
        self.kernels = []
        for conv, bn, act in ((m.conv_expand, "bn_expand", True), (m.conv_dw, "bn_dw", True),
                              (m.conv_project, "bn_project", False)):
            name = next(n for n, c in m.named_children() if c is conv)
            e_in, e_out = self.elems(f"{path}.{name}", 0), self.elems(f"{path}.{name}", 1)
            kh, kw = conv.kernel_size
            macs = e_out * (conv.in_channels // conv.groups) * kh * kw
            self.add(f"{path}.{name} recompute", macs, e_in, e_out, conv.weight.numel() * self.eb)
            e = self.elems(f"{path}.{bn}", 1)
            self.add(f"{path}.{bn} recompute statistics", 0, e, 0)
            self.add(f"{path}.{bn} recompute normalise", 0, e, e)
            if name == "conv_dw":
                if m.stride == 2:
                    e_in, e_out = self.elems(f"{path}.blur", 0), self.elems(f"{path}.blur", 1)
                    self.add(f"{path}.blur recompute", 9 * e_out, e_in, e_out)
                g, pooled = self.elems(f"{path}.se", 0), self.elems(f"{path}.se.fc1", 0)
                self.add(f"{path}.se pool recompute", 0, g, pooled)
                for fc in (m.se.fc1, m.se.fc2):
                    self.add(f"{path}.se fc recompute", self.n * fc.in_channels * fc.out_channels,
                             self.n * fc.in_channels, self.n * fc.out_channels, fc.weight.numel() * self.eb)
                self.add(f"{path}.se gate recompute", 0, g + pooled, g)
        return self.kernels

    def block(self, path: str, m: nn.Module) -> list[TrainKernel]:
        self.kernels = []
        if isinstance(m, Stem):
            self.conv(f"{path}.conv", m.conv, dgrad=False)
            self.batchnorm(f"{path}.bn", act=True)
        elif isinstance(m, ConvFirst):
            self.conv(f"{path}.conv_dw", m.conv_dw)
            self.batchnorm(f"{path}.bn_dw", act=False)
            if m.stride == 2:
                x = self.elems(f"{path}.conv_dw", 0)
                self.add(f"{path} cat", 0, 2 * x, 2 * x)
                self.blur(f"{path}.blur")
                self.add(f"{path} cat backward (x's gradients added)", 0, 2 * x, x)
            self.conv(f"{path}.conv_expand", m.conv_expand)
            self.batchnorm(f"{path}.bn_expand", act=True)
            self.conv(f"{path}.conv_project", m.conv_project)
            self.batchnorm(f"{path}.bn_project", act=False, residual=m.stride == 1)
            if m.stride == 1:
                x = self.elems(path, 0)
                self.add(f"{path} residual backward", 0, 2 * x, x)
        elif isinstance(m, MBConv):
            self.conv(f"{path}.conv_expand", m.conv_expand)
            self.batchnorm(f"{path}.bn_expand", act=True)
            self.conv(f"{path}.conv_dw", m.conv_dw)
            self.batchnorm(f"{path}.bn_dw", act=True)
            if m.stride == 2:
                self.blur(f"{path}.blur")
            self.se(f"{path}.se", m.se)
            self.conv(f"{path}.conv_project", m.conv_project)
            self.batchnorm(f"{path}.bn_project", act=False, residual=m.stride == 1)
            if m.stride == 1:
                x = self.elems(path, 0)
                self.add(f"{path} residual backward", 0, 2 * x, x)
        elif isinstance(m, Head):
            self.conv(f"{path}.conv", m.conv)
            self.batchnorm(f"{path}.bn", act=True)
            e, pooled = self.elems(f"{path}.conv", 1), self.elems(path, 1)
            self.add(f"{path} pool", 0, e, pooled)
            self.add(f"{path} pool backward", 0, pooled, e)
        elif isinstance(m, nn.Linear):
            self.conv(path, m)
        return self.kernels


# ------------------------------------------------------------------------------ stored activations


@contextlib.contextmanager
def _fused_dispatch(enabled: bool):
    """Run the supported blocks through the fused op (its reference branch on CPU) when ``enabled``."""
    saved = training_kernels.triton_selected
    training_kernels.triton_selected = (lambda x: True) if enabled else (lambda x: False)
    try:
        yield
    finally:
        training_kernels.triton_selected = saved


def stored_at(model: nn.Module, input_size: tuple[int, int, int], elem_bytes: int, fused: bool, batch: int
              ) -> dict[str, int]:
    """Bytes autograd keeps for the backward per block path at ``batch``: measured at batches 1 and 2,
    extrapolated linearly (module docstring)."""
    one = stored_bytes(model, input_size, elem_bytes, fused)
    two = stored_bytes(model, input_size, elem_bytes, fused, batch=2)
    return {p: one.get(p, 0) + (batch - 1) * (two.get(p, 0) - one.get(p, 0)) for p in set(one) | set(two)}


def stored_bytes(model: nn.Module, input_size: tuple[int, int, int], elem_bytes: int, fused: bool,
                 batch: int = 1) -> dict[str, int]:
    """Bytes autograd keeps for the backward per block path, at ``batch`` (module docstring)."""
    import warnings

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: set[int] = set()
    per_block: dict[str, int] = {}
    current = [""]
    blocks = blocks_of(model)
    handles = [m.register_forward_pre_hook(lambda mod, args, p=p: current.__setitem__(0, p))
               for p, m in blocks]

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            size = t.untyped_storage().nbytes() // t.element_size()
            eb = elem_bytes if t.dim() == 4 and t.is_floating_point() else t.element_size()
            per_block[current[0]] = per_block.get(current[0], 0) + size * eb
        return t

    was = model.training
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # running statistics restored after
    try:
        with _fused_dispatch(fused), warnings.catch_warnings(), torch.autograd.graph.saved_tensors_hooks(
                pack, lambda t: t):
            warnings.simplefilter("ignore")  # the fallback lines of blocks without a fused op
            model(torch.randn(batch, *input_size))
    finally:
        for h in handles:
            h.remove()
        model.load_state_dict(state)
        model.train(was)
    return per_block


# ------------------------------------------------------------------------------ fused launches


# aten ops that launch no kernel of their own: views, metadata, allocation, and the composite ops whose
# pieces are seen (and counted) as they dispatch (``to`` -> ``_to_copy`` when it copies, ``matmul`` ->
# ``mm``); a CPU scalar
_NO_LAUNCH = {"view", "_unsafe_view", "as_strided", "permute", "expand", "reshape", "select", "slice",
              "unsqueeze", "squeeze", "diagonal", "t", "transpose", "alias", "detach", "empty", "empty_like",
              "empty_strided", "new_empty", "lift_fresh", "unbind", "split", "split_with_sizes", "flatten",
              "contiguous", "to", "matmul", "outer", "numpy_T", "scalar_tensor", "float"}


class _CountLaunches(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that launch a kernel: the per-channel arithmetic between the Triton launches
    (tiny tensors, so each costs a launch gap; inside the fused ops' bodies too), autograd's gradient
    accumulation, the running-statistics update."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "convfirstnet":  # run the op's body below this mode, counting its aten ops
            x = next(a for a in args if isinstance(a, torch.Tensor))
            below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
            keys = torch._C._dispatch_keys(x) & below
            with self:
                return func.redispatch(keys, *args, **kwargs)
        if func.__name__.split(".")[0] not in _NO_LAUNCH:
            self.count += 1
        return func(*args, **kwargs)


def _gpu(tgt) -> dict:
    """The recording's target (``kernels._cost.recording``), all of it: the launchers size their tiles,
    grids and shared memory by the SM count, the L2, the shared memory per program and the arch (with
    the first two only, an sm_80 report recorded the H100's geometry)."""
    return dict(sms=tgt.sms, l2_bytes=tgt.l2_bytes, shared_per_block=tgt.smem_per_block, arch=tgt.arch)


def record_fused_block(block: nn.Module, in_shape: tuple, batch: int, dtype: torch.dtype, tgt
                       ) -> tuple[list, int]:
    """The Triton launches of one training step of ``block`` (forward + backward) on meta tensors, and the
    number of other kernel launches (small aten ops) the step makes."""
    import copy

    meta = copy.deepcopy(block).to(dtype).to("meta").train()
    x = torch.empty(batch, *in_shape[1:], device="meta", dtype=dtype).contiguous(
        memory_format=torch.channels_last).requires_grad_()
    counter = _CountLaunches()
    with recording(**_gpu(tgt)) as rec, counter:
        out = meta(x)
        out.backward(torch.empty_like(out))
    return rec.launches, counter.count


def _mbconv_on_meta(block: nn.Module, in_shape: tuple, batch: int, dtype: torch.dtype):
    """(a meta copy of the MBConv block in training mode, its weights in fp32 as autocast keeps them, a
    channels-last meta input of ``batch`` images in ``dtype``, the copy's weights in the op's order)."""
    import copy

    meta = copy.deepcopy(block).to("meta").train()
    x = torch.empty(batch, *in_shape[1:], device="meta", dtype=dtype).contiguous(
        memory_format=torch.channels_last)
    return meta, x, mbconv_recompute.op_weights(meta)


def record_mbconv_forward(block: nn.Module, in_shape: tuple, batch: int, dtype: torch.dtype, tgt
                          ) -> tuple[list, int] | None:
    """The Triton launches of an MBConv block's training forward through the fused kernels
    (mbconv_fused_forward.py) on meta tensors, with the block's weights in fp32 as autocast keeps them,
    and the number of its other aten ops; None where that forward is not selected."""
    meta, x, weights = _mbconv_on_meta(block, in_shape, batch, dtype)
    bns = (meta.bn_expand, meta.bn_dw, meta.bn_project)
    running = tuple(t.clone() for bn in bns for t in (bn.running_mean, bn.running_var))
    drop = torch.ones(batch, device="meta")  # the caller's (training_kernels._drop_scale)
    counter = _CountLaunches()
    with recording(**_gpu(tgt)) as rec:
        if not mbconv_fused_forward.selected(x, weights[0], weights[10], meta.stride):
            return None
        with counter:
            mbconv_fused_forward.forward(x, *weights, running, drop, meta.stride, (0.1,) * 3, bns[0].eps)
    return rec.launches, counter.count


def record_mbconv_backward(block: nn.Module, in_shape: tuple, batch: int, dtype: torch.dtype, tgt
                           ) -> tuple[list, int] | None:
    """The Triton launches of an MBConv block's backward through the fused passes
    (mbconv_fused_backward.py) on meta tensors, with the forward's saved o and statistics, and the number
    of its other aten ops (the weights' casts); None where it is not selected."""
    from convfirstnet import mbconv_fused_backward, mbconv_fused_forward

    meta, x, weights = _mbconv_on_meta(block, in_shape, batch, dtype)
    r, k = weights[0].shape[0], weights[10].shape[0]
    n, _, h, w = x.shape
    o = torch.empty((n, k, -(-h // meta.stride), -(-w // meta.stride)), device="meta", dtype=x.dtype)
    o = o.contiguous(memory_format=torch.channels_last)
    grad = torch.empty_like(o)
    stats = torch.empty(mbconv_fused_forward.stats_size(x.shape[1], r, k), device="meta")
    drop = torch.ones(batch, device="meta")
    counter = _CountLaunches()
    with recording(**_gpu(tgt)) as rec:
        if not mbconv_fused_backward.selected(x, weights[0], weights[10], meta.stride):
            return None
        with counter:
            mbconv_fused_backward.backward(grad, x, *weights, o, stats, drop, meta.stride, triton=True)
    return rec.launches, counter.count


def launches_floor(launches, small_ops: int, hw) -> float:
    """Seconds the launches cost at least, high end, CUDA graphs: each at the larger of its tensor and DRAM
    terms plus its launch gap, and a launch gap per small aten op; latency, issue, L1 and L2 fully hidden
    (the inference report's design floor, report.design_floor_ms)."""
    return (sum(max(e.terms["tensor"]["high"], e.terms["dram"]["high"]) + e.launch_gap["graph"]["high"]
                for e in launches) + small_ops * hw.launch_graph_us.pick("high") * 1e-6)


def build_training_report(model: nn.Module, input_size: tuple[int, int, int], *, batch: int,
                          dtype: str = "float16", arch: int | str = 90, jobs: int | None = None,
                          progress: Callable[[str], None] | None = None, name: str | None = None) -> dict:
    """The training-step report of a training-form ConvFirstNet as a JSON-able dict."""
    import triton

    say = progress or (lambda line: None)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    tgt = get_target(arch)
    hw = hardware(tgt.arch)
    torch_dtype = DTYPES[dtype]
    eb = torch.empty((), dtype=torch_dtype).element_size()
    model = model.train()
    shapes = _shape_hooks(model, input_size)
    lw = _LayerWise(shapes, batch, eb)
    blocks = blocks_of(model)

    # fused blocks: record, compile, estimate
    launches, owner = [], []
    fused_paths, glue, recomputed, fused_forward, fused_backward = [], {}, set(), {}, {}
    for path, m in blocks:
        if training_kernels.unsupported(m) is None and training_kernels.recomputes(m):
            recomputed.add(path)
            recorded = record_mbconv_forward(m, shapes[path][0], batch, torch_dtype, tgt)
            if recorded is not None:  # the forward through the fused MBConv kernels
                launches += recorded[0]
                owner += [path] * len(recorded[0])
                fused_forward[path] = recorded[1]
                recorded = record_mbconv_backward(m, shapes[path][0], batch, torch_dtype, tgt)
                if recorded is not None:  # and the backward through the fused passes
                    launches += recorded[0]
                    owner += [path + " backward"] * len(recorded[0])
                    fused_backward[path] = recorded[1]
        elif training_kernels.unsupported(m) is None:
            ls, glue[path] = record_fused_block(m, shapes[path][0], batch, torch_dtype, tgt)
            launches += ls
            owner += [path] * len(ls)
            fused_paths.append(path)
    say(f"recorded {len(launches)} launches of {len(fused_paths)} fused blocks")
    est = estimate_launches(launches, tgt.arch, jobs=jobs, progress=progress) if launches else None

    stored_lw = stored_at(model, input_size, eb, False, batch)
    stored_fused = stored_at(model, input_size, eb, True, batch)

    rows, forwards = [], {}
    for path, m in blocks:
        kernels = lw.block(path, m)
        layerwise = {end: sum(layerwise_time(k, hw, end) for k in kernels) for end in ENDS}
        fused = path in fused_paths
        if fused:
            mine = [e for e, o in zip(est.launches, owner) if o == path]
            # the small aten ops between the launches: one launch gap each (in a CUDA graph)
            predicted = {end: sum(e.predicted(end) for e in mine)
                         + glue[path] * hw.launch_graph_us.pick(end) * 1e-6 for end in ENDS}
            bounds = sorted({e.bound("high") for e in mine})
            n_launches = len(mine)
            spills = max(est.variants[e.variant]["stack_bytes"] for e in mine)
            kinds = {k for e in mine for k in est.variants[e.variant]["mma_kind"].split("+")}
            mma = sorted(kinds - {"none"})
            floor = launches_floor(mine, glue[path], hw)
        elif path in fused_forward:
            # forward: the fused launches and a launch gap per other aten op; backward: the fused passes'
            # launches and a launch gap per other aten op where they run, else the layer-wise bound's backward
            # kernels and the recompute, as below
            mine = [e for e, o in zip(est.launches, owner) if o == path]
            own_glue = fused_forward[path]
            glue[path] = own_glue + mbconv_recompute.SMALL_OPS_PER_STEP
            forward = {end: sum(e.predicted(end) for e in mine)
                       + own_glue * hw.launch_graph_us.pick(end) * 1e-6 for end in ENDS}
            forwards[path] = (forward, {end: sum(layerwise_time(k, hw, end) for k in kernels
                                                 if _is_forward(k)) for end in ENDS})
            if path in fused_backward:
                back = [e for e, o in zip(est.launches, owner) if o == path + " backward"]
                glue[path] += fused_backward[path]
                backward_time = {end: sum(e.predicted(end) for e in back)
                                 + fused_backward[path] * hw.launch_graph_us.pick(end) * 1e-6 for end in ENDS}
                bounds = sorted({e.bound("high") for e in mine + back})
                n_launches = len(mine) + len(back)
                mine = mine + back
                floor = launches_floor(mine, glue[path], hw)
            else:
                backward = [k for k in kernels if not _is_forward(k)] + lw.recompute(path, m)
                backward_time = {end: sum(layerwise_time(k, hw, end) for k in backward) for end in ENDS}
                bounds = sorted({e.bound("high") for e in mine}) + ["layer-wise backward + recompute"]
                n_launches = len(mine) + len(backward)
                floor = launches_floor(mine, glue[path], hw) + backward_time["high"]
            predicted = {end: forward[end] + backward_time[end]
                         + mbconv_recompute.SMALL_OPS_PER_STEP * hw.launch_graph_us.pick(end) * 1e-6
                         for end in ENDS}
            spills = max(est.variants[e.variant]["stack_bytes"] for e in mine)
            kinds = {k for e in mine for k in est.variants[e.variant]["mma_kind"].split("+")}
            mma = sorted(kinds - {"none"})
        elif path in recomputed:
            again = lw.recompute(path, m)
            predicted = {end: layerwise[end] + sum(layerwise_time(k, hw, end) for k in again)
                         + mbconv_recompute.SMALL_OPS_PER_STEP * hw.launch_graph_us.pick(end) * 1e-6
                         for end in ENDS}
            bounds, n_launches = ["layer-wise bound + recompute"], len(kernels) + len(again)
            glue[path] = mbconv_recompute.SMALL_OPS_PER_STEP
            spills, mma = None, []
            floor = predicted["high"]
        else:
            predicted, bounds, n_launches = layerwise, ["layer-wise bound"], len(kernels)
            spills, mma = None, []
            floor = predicted["high"]
        rows.append(dict(
            block=path, stage=_stage_label(path),
            kind=type(m).__name__ + (f" s{m.stride}" if hasattr(m, "stride") else ""),
            fused=fused, recompute=path in recomputed, fused_forward=path in fused_forward,
            path=(FUSED_BACKWARD_PATH if path in fused_backward
                  else FUSED_FORWARD_PATH if path in fused_forward else PATHS[(fused, path in recomputed)]),
            fused_backward=path in fused_backward,
            launches=n_launches, glue_launches=glue.get(path, 0),
            predicted_ms={k: v * 1e3 for k, v in predicted.items()}, floor_ms=floor * 1e3,
            layerwise_ms={k: v * 1e3 for k, v in layerwise.items()}, bounds=bounds, stack_bytes=spills,
            mma_kinds=mma, layerwise_kernels=len(kernels),
            stored_bytes=stored_fused.get(path, 0),
            layerwise_stored_bytes=stored_lw.get(path, 0),
        ))
        if path in forwards:  # the forward alone: the fused launches against layer-wise
            rows[-1].update(forward_ms={k: v * 1e3 for k, v in forwards[path][0].items()},
                            layerwise_forward_ms={k: v * 1e3 for k, v in forwards[path][1].items()})
    stages: dict[str, dict] = {}
    for r in rows:
        s = stages.setdefault(r["stage"], dict(stage=r["stage"], blocks=0, fused_blocks=0,
                                               recompute_blocks=0, predicted_ms={e: 0.0 for e in ENDS},
                                               floor_ms=0.0,
                                               layerwise_ms={e: 0.0 for e in ENDS}, stored_bytes=0,
                                               layerwise_stored_bytes=0))
        s["blocks"] += 1
        s["fused_blocks"] += r["fused"]
        s["recompute_blocks"] += r["recompute"]
        s["floor_ms"] += r["floor_ms"]
        for e in ENDS:
            s["predicted_ms"][e] += r["predicted_ms"][e]
            s["layerwise_ms"][e] += r["layerwise_ms"][e]
        s["stored_bytes"] += r["stored_bytes"]
        s["layerwise_stored_bytes"] += r["layerwise_stored_bytes"]
    total = dict(stage="total", blocks=len(rows), fused_blocks=sum(r["fused"] for r in rows),
                 recompute_blocks=sum(r["recompute"] for r in rows),
                 predicted_ms={e: sum(s["predicted_ms"][e] for s in stages.values()) for e in ENDS},
                 floor_ms=sum(s["floor_ms"] for s in stages.values()),
                 layerwise_ms={e: sum(s["layerwise_ms"][e] for s in stages.values()) for e in ENDS},
                 stored_bytes=sum(s["stored_bytes"] for s in stages.values()),
                 layerwise_stored_bytes=sum(s["layerwise_stored_bytes"] for s in stages.values()))
    # stored bytes outside any block (the input image kept by the stem's conv) go to the total
    total["stored_bytes"] += stored_fused.get("", 0)
    total["layerwise_stored_bytes"] += stored_lw.get("", 0)
    for s in [*stages.values(), total]:
        s["step_over_layerwise"] = {e: s["predicted_ms"][e] / s["layerwise_ms"][e] for e in ENDS}
        s["stored_over_layerwise"] = s["stored_bytes"] / max(1, s["layerwise_stored_bytes"])
    fused_rows = [r for r in rows if r["fused"]]
    fused_only = dict(
        blocks=len(fused_rows),
        predicted_ms={e: sum(r["predicted_ms"][e] for r in fused_rows) for e in ENDS},
        floor_ms=sum(r["floor_ms"] for r in fused_rows),
        layerwise_ms={e: sum(r["layerwise_ms"][e] for r in fused_rows) for e in ENDS},
        stored_bytes=sum(r["stored_bytes"] for r in fused_rows),
        layerwise_stored_bytes=sum(r["layerwise_stored_bytes"] for r in fused_rows),
    )
    return dict(
        format=FORMAT,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=name or type(model).__name__, batch=batch, input_size=list(input_size), dtype=dtype,
        target=dict(arch=tgt.arch, name=tgt.device.name if hasattr(tgt.device, "name") else str(tgt.arch)),
        versions=dict(convfirstnet=convfirstnet.__version__, torch=torch.__version__,
                      triton=triton.__version__),
        git=git_info(), targets=TARGETS, total=total, stages=list(stages.values()), fused_blocks=fused_only,
        blocks=rows, variants=est.variants if est else [],
        spilling_variants={v["index"]: v["stack_bytes"] for v in (est.variants if est else [])
                           if v["stack_bytes"]},
    )


def _ms(d: dict) -> str:
    return f"{d['low']:.3f}-{d['high']:.3f}"


def to_markdown(rep: dict) -> str:
    t = rep["total"]
    lines = [
        f"# Training step, {rep['model']}, batch {rep['batch']}, "
        f"{rep['input_size'][-1]}x{rep['input_size'][-1]}, {rep['dtype']}, sm_{rep['target']['arch']}",
        "",
        "Static estimate (fused blocks: compiled launches, low-high ends of the cost model, plus one "
        "launch gap per small aten op between them) against the layer-wise training bound (every layer's "
        "forward, dgrad, wgrad, the BatchNorm passes, stored activations written and read back; "
        "convfirstnet/analysis/training.py). MBConv blocks (only narrow tensors stored: the input, the "
        "projection before BN_p, the BatchNorms' statistics): the forward as the fused MBConv kernels' "
        "launches where they run (the BatchNorms with the batch statistics), else layer-wise; the "
        "backward as the launches of the fused passes over the narrow input "
        "(convfirstnet/mbconv_fused_backward.py) where they run, else the layer-wise bound's backward "
        "kernels plus the forward kernels recomputed; other blocks without a fused training op at their "
        "layer-wise bound. Estimates, not measurements.",
        "",
        "| stage | blocks (fused, recompute) | predicted ms | floor ms | layer-wise bound ms "
        "| ratio (low, high) | stored MB | layer-wise stored MB | stored ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in [*rep["stages"], t]:
        r = s["step_over_layerwise"]
        lines.append(
            f"| {s['stage']} | {s['blocks']} ({s['fused_blocks']}, {s['recompute_blocks']}) "
            f"| {_ms(s['predicted_ms'])} | {s['floor_ms']:.3f} "
            f"| {_ms(s['layerwise_ms'])} | {r['low']:.2f}, {r['high']:.2f} | {s['stored_bytes'] / 1e6:.0f} "
            f"| {s['layerwise_stored_bytes'] / 1e6:.0f} | {s['stored_over_layerwise']:.2f} |")
    f = rep["fused_blocks"]
    if f["blocks"]:
        lines += [
            "",
            f"Fused blocks only ({f['blocks']}): predicted {_ms(f['predicted_ms'])} ms (floor "
            f"{f['floor_ms']:.3f}) against a layer-wise bound of {_ms(f['layerwise_ms'])} ms (ratio "
            f"{f['predicted_ms']['high'] / f['layerwise_ms']['high']:.2f} at the high ends); stored "
            f"{f['stored_bytes'] / 1e6:.0f} MB against {f['layerwise_stored_bytes'] / 1e6:.0f} MB "
            f"({f['stored_bytes'] / max(1, f['layerwise_stored_bytes']):.2f}).",
        ]
    rc = [b for b in rep["blocks"] if b.get("recompute")]
    if rc:
        def total(key, end=None):
            return sum(b[key][end] if end else b[key] for b in rc)
        lines += [
            "",
            f"Recompute blocks only ({len(rc)}): predicted "
            f"{total('predicted_ms', 'low'):.3f}-{total('predicted_ms', 'high'):.3f} ms (floor "
            f"{total('floor_ms'):.3f}) against a layer-wise bound of "
            f"{total('layerwise_ms', 'low'):.3f}-{total('layerwise_ms', 'high'):.3f} ms (ratio "
            f"{total('predicted_ms', 'high') / total('layerwise_ms', 'high'):.2f} at the high ends); stored "
            f"{total('stored_bytes') / 1e6:.0f} MB against {total('layerwise_stored_bytes') / 1e6:.0f} MB "
            f"({total('stored_bytes') / max(1, total('layerwise_stored_bytes')):.2f}).",
        ]
        ff = [b for b in rc if "forward_ms" in b]
        if ff:
            def fsum(key, end):
                return sum(b[key][end] for b in ff)
            lines[-1] += (
                f" The forward of {len(ff)} of them runs through the fused MBConv kernels (with the "
                f"BatchNorms' batch statistics: x's Gram matrix, BN_e's statistics, the expand, the "
                f"grouped conv with BN_d's moments (or a pass over its output where its tiles do not cover "
                f"the map), BN_d's statistics, BN_d + SiLU (+ BlurPool) + pool over that output, SE gates, "
                f"projection and BN_p + residual launches): predicted {fsum('forward_ms', 'low'):.3f}-"
                f"{fsum('forward_ms', 'high'):.3f} ms "
                f"against {fsum('layerwise_forward_ms', 'low'):.3f}-"
                f"{fsum('layerwise_forward_ms', 'high'):.3f} ms for their layer-wise forward.")
        fb = [b for b in rc if b.get("fused_backward")]
        lines[-1] += (
            f" The backward of {len(fb)} of them runs the fused passes over the narrow input "
            "(BN_p backward, h and the conv's output recomputed, the SE and BN_d passes (stride 2: through "
            "BlurPool's transpose), the conv's dgrad and wgrad, the BN_e passes, dx)"
            + ("; the others' backward is the recompute with layer-wise kernels." if len(fb) < len(rc)
               else "."))
    tg = rep["targets"]
    r = t["step_over_layerwise"]["high"]
    target_ms = tg["step_over_layerwise"] * t["layerwise_ms"]["high"]
    lines += [
        "",
        f"Targets (high end): step <= {tg['step_over_layerwise']} x layer-wise: {r:.2f} "
        f"({'met' if r <= tg['step_over_layerwise'] else 'NOT met'}); stored <= "
        f"{tg['stored_over_layerwise']} x layer-wise: {t['stored_over_layerwise']:.2f} "
        f"({'met' if t['stored_over_layerwise'] <= tg['stored_over_layerwise'] else 'NOT met'}); "
        f"spilling variants: {len(rep['spilling_variants'])}.",
        "",
        f"Floor (the floor column): each fused launch at the larger of its tensor and DRAM terms plus its "
        f"launch gap (high end, CUDA graphs), a launch gap per small aten op, the other blocks at their "
        f"layer-wise bound's high end; latency, issue, L1 and L2 fully hidden. The step's floor is "
        f"{t['floor_ms']:.3f} ms against a target of {target_ms:.3f} ms "
        f"({tg['step_over_layerwise']} x {t['layerwise_ms']['high']:.3f})"
        + (": the target lies below the floor of these launches, so meeting it needs fewer DRAM bytes, "
           "tensor MACs or launches (another design), not only hidden latency." if t["floor_ms"] > target_ms
           else "."),
        "",
        "## Blocks",
        "",
        "| block | kind | path | launches (+ small aten ops) | predicted ms | layer-wise ms | bound | MMA "
        "| stack B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in rep["blocks"]:
        lines.append(
            f"| {b['block']} | {b['kind']} | {b.get('path', 'fused' if b['fused'] else 'layer-wise')} "
            f"| {b['launches']}{' (+ %d)' % b['glue_launches'] if b['fused'] or b.get('recompute') else ''} "
            f"| {_ms(b['predicted_ms'])} "
            f"| {_ms(b['layerwise_ms'])} | {', '.join(b['bounds'])} | {', '.join(b['mma_kinds']) or '-'} "
            f"| {'' if b['stack_bytes'] is None else b['stack_bytes']} |")
    return "\n".join(lines) + "\n"
