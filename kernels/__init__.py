"""Fused ConvFirstNet blocks, shipped as ``convfirstnet.kernels``.

Each folder holds one block: ``reference.py`` (the block in plain PyTorch on folded weights, the
specification), ``kernel.py`` (the Triton kernels; for the stem, the head and gconv the host side is
in ``launcher.py``, elsewhere still in ``kernel.py``) and ``op.py`` (the ``torch.ops.convfirstnet.<block>``
registration that picks one or the other). ``gconv/`` holds the training layer beside them: the
group-width-8 3x3 conv with its dgrad and wgrad. ``_activations.py`` holds the fused activations.
Importing this package registers the ops.
"""

from .convfirst import op as _convfirst_op  # noqa: F401
from .convfirst_train import op as _convfirst_train_op  # noqa: F401
from .gconv import op as _gconv_op  # noqa: F401
from .head import op as _head_op  # noqa: F401
from .mbconv import op as _mbconv_op  # noqa: F401
from .stem import op as _stem_op  # noqa: F401
