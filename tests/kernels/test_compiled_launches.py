"""Our kernels as torch.compile launches them, checked without a GPU.

Under torch.compile, a launch is a user-defined Triton kernel (``wrap_triton``): Inductor types its
Python float arguments ``fp64`` (Triton's launcher: ``fp32``), and functionalization clones every tensor
parameter the kernel writes (by Inductor's TTIR analysis) and then replaces each argument by its clone,
in parameter order. Two contracts follow, both broken once on an H200 (torch 2.11, Triton 3.6) by
``test_compiled_training_step_gpu``:

1. floats: ``_out_sums_kernel``'s fp32 loop accumulator met ``eps`` as fp64 and the compile stopped
   ("re-assigned to fp64 in loop"); every kernel now converts its floats first (kernels/_scalars.py);
2. no tensor passed for two parameters that the kernel writes: ``_bn_terms_kernel``'s unused slots were
   the first BatchNorm's tensors again, so BN1's terms were kept from an unwritten clone and the
   compiled step's conv weight gradient came out wrong (relative error 7e5; eager and the reference
   agreed).

The launches are those of a training step of each block kind of Small (ConvFirst stride 1 and 2,
MBConv stride 1 and 2: forward and backward) and of the fused inference model, recorded on meta tensors
at batch 8, 64x64 (the kernels' code does not depend on the size; their constexprs do, and these are
the variants those sizes take)."""

import dataclasses
import re

import pytest
import torch

from .._scripts import load_script

pytest.importorskip("triton")

FLOAT_TYPES = ("fp16", "bf16", "fp32", "fp64")
# every instruction with an .f64 operand type but the argument's conversion (cvt.rn.f32.f64) and a
# comparison of it (ptxas folds fp32(m) < 0 into an fp64 compare of the argument itself)
F64_ARITHMETIC = re.compile(r"^\s*(?!cvt\.|setp\.)[a-z][\w.]*\.f64\b", re.M)


@pytest.fixture(scope="module")
def launches():
    """Every recorded launch of the training steps and the inference forward (see the module doc)."""
    from convfirstnet.analysis import training
    from convfirstnet.analysis.report import record_launches
    from convfirstnet.analysis.targets import target
    from convfirstnet.factory import create_model, fuse

    block_inputs = load_script("gpu_check").block_inputs
    tgt = target(90)
    batch, img = 8, 64
    shapes = block_inputs(create_model("small"), batch, img)
    model = create_model("small")
    out = []
    for path in ("stages.1.0", "stages.1.1", "stages.3.0", "stages.3.1"):  # ConvFirst, MBConv; s2, s1
        block = model.get_submodule(path)
        if path.startswith("stages.1"):
            out += training.record_fused_block(block, shapes[path], batch, torch.float16, tgt)[0]
        else:
            for record in (training.record_mbconv_forward, training.record_mbconv_backward):
                out += record(block, shapes[path], batch, torch.float16, tgt)[0]
    out += record_launches(fuse(create_model("small").eval()).to("meta"),
                           torch.empty(batch, 3, img, img, device="meta"))
    assert len(out) > 50
    return out


@pytest.mark.compile
def test_float_arguments_compile_as_fp64_without_fp64_arithmetic(launches):
    """Each kernel that takes a float, compiled for sm_90 with its floats typed fp64 as Inductor passes
    them: it compiles, and its PTX holds no fp64 instruction but the conversion (or a comparison) of the
    argument (fp64 arithmetic over a tile would be a silent slowdown). Without ``fp32(eps)`` in
    ``_out_sums_kernel`` the compile fails as on the GPU."""
    from convfirstnet.analysis.compiled import compile_variants, variant_of

    picked = {}
    for launch in launches:
        v = variant_of(launch, 90)
        if any(t in FLOAT_TYPES for _, t in v.signature):
            sig = tuple((n, "fp64" if t in FLOAT_TYPES else t) for n, t in v.signature)
            picked.setdefault(v.key, (v.name, dataclasses.replace(v, signature=sig)))
    names = {name for name, _ in picked.values()}
    # the kernels known to take floats (BatchNorm eps and momenta, 1 / pixels): all must be found
    assert {"_out_sums_kernel", "_bn_terms_kernel", "_merge_moments_kernel", "_bn_running_kernel",
            "_bn_e_stats_kernel", "_grad_kernel", "_blur_bn_d_kernel"} <= names, names
    compiled = compile_variants([v for _, v in picked.values()])
    bad = {}
    for (name, _), c in zip(picked.values(), compiled):
        found = sorted(set(m.group(0).strip() for m in F64_ARITHMETIC.finditer(c.ptx)))
        if found:
            bad[name] = found
    assert not bad, f"fp64 arithmetic from float arguments typed fp64: {bad}"


# Run without the interpreter (the test process may have decorated the kernels under it): one JSON list of
# launches in, for each the parameters torch.compile's own TTIR analysis finds written (torch >= 2.12:
# identify_accessed_tensors; before: identify_mutated_tensors; where it gives up it answers every tensor,
# as functionalization then assumes). Triton's driver is replaced by one that names an sm_90 target: the
# analysis asks the driver for its target, and this machine need not have a GPU.
_WRITTEN_SCRIPT = r"""
import importlib, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops import triton_kernel_wrap as tkw

class Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_current_device(self):
        return 0

triton.runtime.driver.set_active(Sm90())
out = []
for item in json.load(sys.stdin):
    fn = getattr(importlib.import_module(item["module"]), item["name"])
    kwargs = {n: torch.empty(16, dtype=getattr(torch, a["tensor"])) if isinstance(a, dict) else a
              for n, a in item["args"].items()}
    if hasattr(tkw, "identify_accessed_tensors"):
        written = [d.name for d in tkw.identify_accessed_tensors(fn, kwargs, {}).read_writes.writes]
    else:
        written = list(tkw.identify_mutated_tensors(fn, kwargs, {}))
    out.append(sorted(written))
json.dump(out, sys.stdout)
"""


def _written(items: list[dict]) -> list[list[str]]:
    import json
    import os
    import subprocess
    import sys

    from convfirstnet.analysis.compiled import _worker_env

    proc = subprocess.run([sys.executable, "-c", _WRITTEN_SCRIPT], input=json.dumps(items),
                          capture_output=True, text=True, env=_worker_env(), timeout=600, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.compile
def test_no_tensor_is_passed_for_two_written_parameters(launches):
    """For each distinct launch that passes one tensor for several parameters: at most one of them is
    written, by the analysis torch.compile runs on the kernel. With the old padding of ``bn_terms``
    (``[bns[0]] * (3 - len(bns))``) this fails on vec1, vec2, vec3."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    from convfirstnet.analysis.compiled import _jit_function

    if not hasattr(tkw, "identify_accessed_tensors") and not hasattr(tkw, "identify_mutated_tensors"):
        pytest.skip("this torch has neither of torch.compile's Triton mutation analyses")
    items, groups, seen = [], [], set()
    for launch in launches:
        fn = _jit_function(launch.kernel)
        shared = [[fn.arg_names[i] for i in g] for g in launch.shared]
        args = {n: dict(tensor=str(a.dtype).removeprefix("torch.")) if isinstance(a, torch.Tensor) else a
                for n, a in zip(fn.arg_names, launch.args)}
        args.update({k: v for k, v in launch.meta.items() if k in fn.arg_names})
        key = (fn.fn.__name__, str(shared), str(sorted(args.items(), key=str)))
        if not shared or key in seen:
            continue
        seen.add(key)
        items.append(dict(module=fn.fn.__module__, name=fn.fn.__name__, args=args))
        groups.append(shared)
    assert len(items) >= 10  # the placeholders that constexprs switch off (read-only aliases) are many
    bad = {}
    for item, shared, written in zip(items, groups, _written(items)):
        for g in shared:
            if len([n for n in g if n in written]) > 1:
                bad[item["name"]] = (g, written)
    assert not bad, f"one tensor for several written parameters: {bad}"
