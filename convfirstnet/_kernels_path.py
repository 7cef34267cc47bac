"""Make ``convfirstnet.kernels`` importable from a source checkout that was not pip-installed.

An install maps the top-level ``kernels/`` folder to ``convfirstnet.kernels`` (pyproject.toml); a
plain ``PYTHONPATH=.`` checkout has no such package, so load the folder under that name by hand.
"""

import importlib.util
import sys
from pathlib import Path


def ensure_kernels_package() -> None:
    if "convfirstnet.kernels" in sys.modules or importlib.util.find_spec("convfirstnet.kernels") is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    spec = importlib.util.spec_from_file_location(
        "convfirstnet.kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"convfirstnet.kernels not installed and no source folder at {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["convfirstnet.kernels"] = module
    spec.loader.exec_module(module)
