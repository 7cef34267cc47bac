"""The source checkout the package runs from, if any: the home of ``weights/`` and ``benchmarks/``.

An editable install (``pip install -e .``) runs from its checkout; a wheel installs only the package
(``convfirstnet/``, with ``kernels/`` as ``convfirstnet.kernels`` and the weight manifest), so the
checkout's folders do not exist there and nothing is looked up or written beside ``site-packages``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout, or site-packages for a wheel install


def source_checkout() -> Path | None:
    """The root of the source checkout holding this package; None for a wheel install."""
    pyproject = ROOT / "pyproject.toml"
    if not (pyproject.is_file() and (ROOT / "kernels").is_dir()):
        return None
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    return ROOT if 'name = "convfirstnet"' in text else None
