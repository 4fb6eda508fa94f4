"""Package names imported on first use (PEP 562): `import pixeltriage` and its subpackages cost nothing until a
name that needs torch, FastAPI or transformers is touched (the command line's `--help` relies on it)."""
from __future__ import annotations

import importlib
import sys
from typing import Callable

# what to install for a name whose module needs a package this environment lacks (pixeltriage-client, `pip install
# ./client`, holds the server's clients and the adapters only)
_ENGINE_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "huggingface_hub", "pixeltriage")
_SERVER_PACKAGES = ("fastapi", "uvicorn", "httptools", "prometheus_client")
_ENGINE_HINT = ("the engine (torch, transformers) comes with the full distribution: pip install pixeltriage "
                "(pixeltriage-client holds the server's clients and the framework adapters only)")
_SERVER_HINT = "the server comes with pip install 'pixeltriage[serve]'"


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose public names `exports` maps to their defining modules."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as e:
            missing = (e.name or "").split(".")[0]
            if missing not in _ENGINE_PACKAGES + _SERVER_PACKAGES:
                raise
            hint = _SERVER_HINT if missing in _SERVER_PACKAGES else _ENGINE_HINT
            raise ModuleNotFoundError(f"{package}.{name} needs {e.name}, which is not installed: {hint}",
                                      name=e.name) from e
        setattr(sys.modules[package], name, value)           # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
