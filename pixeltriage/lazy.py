"""Package names imported on first use (PEP 562): `import pixeltriage` and its subpackages cost nothing until a
name that needs torch, FastAPI or transformers is touched (the command line's `--help` relies on it)."""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose public names `exports` maps to their defining modules."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)           # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
