"""Fused ConvFirstNet blocks, shipped as ``convfirstnet.kernels``.

Each folder holds one block: ``reference.py`` (the block in plain PyTorch on folded weights, the
specification), ``kernel.py`` (the Triton kernels), ``launcher.py`` (the host side: tile choices,
checks, grid, launch, cost declaration) and ``op.py`` (the ``torch.ops.convfirstnet.<block>``
registration that picks one or the other). ``gconv/`` holds the training layer beside them: the
group-width-8 3x3 conv with its dgrad and wgrad. ``_activations.py`` holds the fused activations.
Importing this package registers the ops.

The design notes in these modules give, for each choice, the static-model figures it was weighed with.
Most were computed before the model was corrected against the first GPU measurements (2026-11-26, when
it was 2-6x low on latency-bound launches): they rank the alternatives of their time and are not
today's predictions. Today's are in the saved reports (``benchmarks/static/``), measurements in
``benchmarks/results/``; the stem, head, ConvFirst and MBConv headers quote both.
"""

from .convfirst import op as _convfirst_op  # noqa: F401
from .convfirst_train import op as _convfirst_train_op  # noqa: F401
from .gconv import op as _gconv_op  # noqa: F401
from .head import op as _head_op  # noqa: F401
from .mbconv import op as _mbconv_op  # noqa: F401
from .stem import op as _stem_op  # noqa: F401
