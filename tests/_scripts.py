"""Shared test helper: a script of scripts/ loaded as a module (the scripts are not a package)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, module_name: str | None = None) -> ModuleType:
    """scripts/<name>.py as a module, registered in sys.modules under ``module_name`` (default
    ``_script_<name>``): dataclasses look their module up there."""
    module_name = module_name or f"_script_{name}"
    spec = importlib.util.spec_from_file_location(module_name, SCRIPTS / f"{name}.py")
    module = sys.modules[module_name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
