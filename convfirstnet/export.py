"""Deployment: the fused form as a ``torch.export`` program, the BatchNorm-folded layer-wise form as ONNX.

The command ``convfirstnet export`` (``convfirstnet/commands/export.py``) runs these on a named model.

* ``pt2`` (:func:`export_pt2`): ``torch.export`` of the fused inference form, saved with
  ``torch.export.save``. The graph holds one ``torch.ops.convfirstnet`` op per block (the Triton kernels
  on CUDA, the PyTorch reference on CPU); the batch, height and width are dynamic, the height and width
  from ``MIN_DYNAMIC_SIZE`` (33) up (see there). Load it with
  :func:`load_pt2` (``import convfirstnet`` then ``torch.export.load``: the ops must be registered).
  This is the form to deploy on NVIDIA GPUs through PyTorch; export it on the device and in the dtype
  it will run in (``--device cuda --dtype float16``).
* ``onnx`` (:func:`export_onnx`): the layer-by-layer form with every BatchNorm folded into its
  convolution (:func:`convfirstnet.folding.fold_batchnorm`), exported with ``torch.onnx.export``
  (standard ONNX operators only: the fused ops have no ONNX equivalent), dynamic batch, fp32. The file
  is checked with ONNX's checker and run with onnxruntime on CPU against the PyTorch model. ONNX,
  onnxscript and onnxruntime are the optional extra ``pip install "convfirstnet[onnx]"``.

Both exports are verified after writing: the saved file is loaded back and run at a batch size other
than the one traced (pt2: and at another height and width), and the maximum relative error against the
PyTorch model (``max |a - b| / max |b|``) is printed; above ``MAX_REL_ERR`` the export fails.
``torch.jit.script`` is not supported (the models use Python control flow and custom ops that
TorchScript cannot compile); ``torch.export`` replaces it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .blocks import MIN_INPUT_SIZE, FusedBlock
from .factory import fuse
from .folding import fold_batchnorm

FORMATS = ("pt2", "onnx")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TRACE_BATCH, CHECK_BATCH = 2, 3  # traced with one batch size, checked with another: the batch is dynamic
# pt2: height and width are dynamic from 33 up. At 32x32 the last stage's map is 1x1, and torch.export
# specialises size-1 dimensions (the program guards on the last map being larger than 1x1), so one
# program cannot cover 32 and larger sizes: an export traced at 32 keeps its size fixed.
MIN_DYNAMIC_SIZE = MIN_INPUT_SIZE + 1
CHECK_GROWTH = (32, 16)  # pt2 is checked at (height + 32, width + 16) when the size is dynamic
# fp32 in both programs: rounding-level differences only (ONNX Runtime's convolutions sum in another
# order, and the ONNX form folds BatchNorm the way the fused form does); fp16/bf16 pt2 checks compare
# like with like (the same ops in the same dtype).
MAX_REL_ERR = 1e-4
ONNX_HINT = 'ONNX export needs onnx, onnxscript and onnxruntime: pip install "convfirstnet[onnx]"'


class ExportError(RuntimeError):
    """An export that cannot be made, or whose file does not reproduce the model."""


def _is_fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedBlock) for m in model.modules())


def _input(model: nn.Module, batch: int, img_size: int | tuple[int, int], device, dtype) -> torch.Tensor:
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, model.in_chans, h, w, generator=g)
    return x.to(device=device, dtype=dtype)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` in fp64."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------ pt2
def export_pt2(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    img_size: int = 256,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Save ``torch.export`` of the fused form of ``model`` (a training-form or fused ConvFirstNet) to
    ``path``, traced at ``img_size`` with the batch, height and width dynamic (height and width from
    ``MIN_DYNAMIC_SIZE`` up; an ``img_size`` below that keeps the size fixed), load it back, run it at
    another batch size and height and width, and return the max relative error against the eager fused
    model. The program refuses a smaller input with PyTorch's guard error (``x.size()[2] >= 33``)."""
    fused = (model if _is_fused(model) else fuse(model)).eval().to(device=device, dtype=dtype)
    x = _input(fused, TRACE_BATCH, img_size, device, dtype)
    dims: dict[int, Any] = {0: torch.export.Dim("batch")}
    if dynamic_size(img_size):
        dims[2] = torch.export.Dim("height", min=MIN_DYNAMIC_SIZE)
        dims[3] = torch.export.Dim("width", min=MIN_DYNAMIC_SIZE)
    with torch.no_grad():
        program = torch.export.export(fused, (x,), dynamic_shapes={"x": dims})
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    ops = {t.split(".")[1] for t in targets if t.startswith("convfirstnet.")}
    if ops != {"stem", "convfirst", "mbconv", "head"}:
        raise ExportError(f"the exported graph holds the convfirstnet ops {sorted(ops)}, not every block kind")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    loaded = load_pt2(path).module()
    x = _input(fused, CHECK_BATCH, pt2_check_size(img_size), device, dtype)
    with torch.no_grad():
        err = max_rel_err(loaded(x), fused(x))
    if not err <= MAX_REL_ERR:
        raise ExportError(f"{path}: the loaded program differs from the model (max relative error {err:.2e})")
    return err


def dynamic_size(img_size: int) -> bool:
    """Whether an export traced at ``img_size`` keeps height and width dynamic (see ``MIN_DYNAMIC_SIZE``)."""
    return img_size >= MIN_DYNAMIC_SIZE


def pt2_check_size(img_size: int) -> tuple[int, int]:
    """The (height, width) :func:`export_pt2` checks the loaded program at."""
    if not dynamic_size(img_size):
        return img_size, img_size
    return img_size + CHECK_GROWTH[0], img_size + CHECK_GROWTH[1]


def load_pt2(path: str | os.PathLike) -> torch.export.ExportedProgram:
    """``torch.export.load`` of a ``.pt2`` written by :func:`export_pt2`; importing this package first
    registers the ``torch.ops.convfirstnet`` ops the program calls. Run it with ``.module()(x)``."""
    return torch.export.load(str(path))


# ------------------------------------------------------------------------------------------ onnx
def export_onnx(
    model: nn.Module, path: str | os.PathLike, *, img_size: int = 256, opset: int | None = None
) -> float:
    """Write the BatchNorm-folded layer-wise form of ``model`` (training form) as ONNX with a dynamic
    batch, check it with ``onnx.checker`` and return the max relative error of onnxruntime (CPU)
    against the PyTorch model."""
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401  (torch.onnx.export's exporter needs it)
    except ImportError as e:
        raise ExportError(f"{ONNX_HINT} ({e})") from e
    if _is_fused(model):
        raise ExportError(
            "ONNX export takes the training form (BatchNorm is folded into standard Conv operators); the "
            "fused ops have no ONNX equivalent: pass the model before convfirstnet.fuse"
        )
    model = model.float().cpu().eval()
    folded = fold_batchnorm(model)
    x = _input(model, TRACE_BATCH, img_size, "cpu", torch.float32)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = dict(
        input_names=["image"],
        output_names=["logits"],
        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
        dynamo=True,
        verbose=False,
    )
    if opset is not None:
        kwargs["opset_version"] = opset
    with torch.no_grad():
        torch.onnx.export(folded, (x,), str(path), **kwargs)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    foreign = sorted({n.domain for n in proto.graph.node if n.domain not in ("", "ai.onnx")})
    if foreign:
        raise ExportError(f"{path}: the graph uses non-standard operator domains {foreign}")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = _input(model, CHECK_BATCH, img_size, "cpu", torch.float32)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        err = max_rel_err(torch.from_numpy(out), model(x))
    if not err <= MAX_REL_ERR:
        raise ExportError(f"{path}: onnxruntime differs from the PyTorch model (max relative error {err:.1e})")
    return err
