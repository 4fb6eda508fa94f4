"""`import pixeltriage.integrations` imports no framework (nor torch); a class imports its framework when first
touched; a framework that is not installed is an ImportError that names the package to install. Each in a fresh
interpreter, whose sys.modules this test's process has not filled."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_package_imports_no_framework_until_a_class_is_touched():
    pytest.importorskip("llama_index.core", reason="llama-index-core is not installed")
    pytest.importorskip("langchain_core", reason="langchain-core is not installed")
    done = run("""
import sys
import pixeltriage.integrations as integrations
heavy = [m for m in ("llama_index", "langchain_core", "mem0", "torch") if m in sys.modules]
assert not heavy, heavy
assert sorted(dir(integrations)) == ["PixelTriageCompressor", "PixelTriagePostprocessor", "PixelTriageReranker"]
integrations.PixelTriagePostprocessor
assert "llama_index.core" in sys.modules and "langchain_core" not in sys.modules
integrations.PixelTriageCompressor
assert "langchain_core" in sys.modules
print("ok")
""")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("name, framework, package", [("PixelTriagePostprocessor", "llama_index", "llama-index-core"),
                                                      ("PixelTriageCompressor", "langchain_core", "langchain-core"),
                                                      ("PixelTriageReranker", "mem0", "mem0ai")])
def test_a_missing_framework_names_the_package(name, framework, package):
    done = run(f"""
import sys
sys.modules[{framework!r}] = None          # as if it were not installed
import pixeltriage.integrations as integrations
try:
    integrations.{name}
except ImportError as e:
    print(e)
""")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"pip install {package}" in done.stdout
