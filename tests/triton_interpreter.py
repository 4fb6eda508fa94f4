"""Running the CUDA path's Triton and flash-linear-attention kernels on CPU tensors, in Triton's interpreter.

The one place that holds the workarounds, written against triton 3.9.0 and flash-linear-attention 0.6.0 (the
versions the `test` extra pins). Two interpreter gaps are bridged while `fla_interpreter_mode()` is active:

- Autotune benchmarks every config through a GPU driver (`RuntimeError: 0 active drivers`): `Autotuner.prune_configs`
  is cut to its first surviving config, and a single config is run without benchmarking (Autotuner.run's own
  single-config path). Which config runs does not change the result, only the launch geometry.
- A `for x in range(...)` loop variable arrives in the kernel as a Python int, where compiled Triton gives a tensor,
  so `i_t.to(tl.int64)` (fla/ops/common/chunk_delta_h.py) fails with `'int' object has no attribute 'to'`: the
  interpreter's AST rewrite gets a `visit_For` that rebinds the variable as an interpreter tensor at the top of the
  body, and the cache of rewritten kernels is cleared on entry and on exit, so kernels rewritten inside (and only
  those) carry it.

The mode also sets PIXELTRIAGE_EMULATE_CUDA=1 for its duration, so the kernel registry gives CPU tensors the CUDA
kernels. bf16 does not run in the interpreter (`tl.dot` on raw bits, triton issue 11584): runs are float32.

Importing this module checks the pinned versions and the internals the patches rely on, and raises
InterpreterHarnessError naming what changed: a mismatch fails loudly, it is never skipped.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import inspect
import pytest

from pixeltriage import settings

TRITON_VERSION = "3.9.0"
FLA_VERSION = "0.6.0"
EMULATE_CUDA = "PIXELTRIAGE_EMULATE_CUDA"


class InterpreterHarnessError(RuntimeError):
    """The installed triton / flash-linear-attention are not what the interpreter workarounds were written for."""


def _check_versions() -> None:
    found = {}
    for package in ("triton", "flash-linear-attention", "fla-core"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    wanted = {"triton": TRITON_VERSION, "flash-linear-attention": FLA_VERSION, "fla-core": FLA_VERSION}
    wrong = [f"{p} {found[p] or 'not installed'} (expected {v})" for p, v in wanted.items() if found[p] != v]
    if wrong:
        raise InterpreterHarnessError(
            f"tests/triton_interpreter.py was written against triton {TRITON_VERSION} and flash-linear-attention "
            f"{FLA_VERSION}; found {', '.join(wrong)}. Re-check its two workarounds against the new versions, then "
            f"update the pins here and in pyproject.toml's test extra")


def _check_internals() -> None:
    """The names and behaviours the patches rely on, each failure naming the one that changed."""
    from triton.runtime import autotuner, interpreter

    problems = []
    if not hasattr(interpreter, "ASTTransformer") or not issubclass(interpreter.ASTTransformer, ast.NodeTransformer):
        problems.append("triton.runtime.interpreter.ASTTransformer (an ast.NodeTransformer) is gone")
    elif "visit_For" in vars(interpreter.ASTTransformer):
        problems.append("triton's interpreter now rewrites for loops itself (ASTTransformer.visit_For): the range "
                        "workaround may be obsolete or conflict")
    if not isinstance(getattr(getattr(interpreter, "InterpretedFunction", None), "rewritten_fn", None), dict):
        problems.append("triton.runtime.interpreter.InterpretedFunction.rewritten_fn (the rewrite cache) is gone")
    semantic = getattr(interpreter, "interpreter_semantic", None)
    if semantic is None or not callable(getattr(semantic, "to_tensor", None)):
        problems.append("triton.runtime.interpreter.interpreter_semantic.to_tensor is gone")
    prune = getattr(autotuner.Autotuner, "prune_configs", None)
    if prune is None or list(inspect.signature(prune).parameters) != ["self", "kwargs"]:
        problems.append("triton.runtime.autotuner.Autotuner.prune_configs(self, kwargs) changed")
    if "len(pruned_configs) == 1" not in inspect.getsource(autotuner.Autotuner.run):
        problems.append("triton.runtime.autotuner.Autotuner.run no longer runs a single pruned config unbenchmarked")
    from fla.ops.utils.cache import CachedAutotuner

    if not issubclass(CachedAutotuner, autotuner.Autotuner):
        problems.append("fla.ops.utils.cache.CachedAutotuner no longer extends triton's Autotuner")
    if problems:
        raise InterpreterHarnessError("tests/triton_interpreter.py: triton/fla internals changed: " + "; ".join(problems))


_check_versions()
_check_internals()


def interpreting() -> bool:
    """Whether Triton's kernels run in the interpreter in this process (TRITON_INTERPRET=1 was set before triton was
    first imported: tests/conftest.py sets it on machines without a GPU)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def _visit_for(self, node: ast.For) -> ast.For:
    node = self.generic_visit(node)
    call = node.iter
    is_range = isinstance(call, ast.Call) and (
        (isinstance(call.func, ast.Name) and call.func.id == "range")
        or (isinstance(call.func, ast.Attribute) and call.func.attr == "range"))     # tl.range
    if is_range and isinstance(node.target, ast.Name):
        name = node.target.id
        to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                  ctx=ast.Load())
        rebind = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                            value=ast.Call(func=to_tensor, args=[ast.Name(id=name, ctx=ast.Load()),
                                                                 ast.Constant(value=False)], keywords=[]))
        node.body.insert(0, ast.copy_location(rebind, node))
    return node


def _first_config(original):
    def prune_configs(self, kwargs):
        return original(self, kwargs)[:1]
    return prune_configs


@contextlib.contextmanager
def fla_interpreter_mode():
    """The CUDA path's kernels on CPU tensors, in Triton's interpreter, for the block's duration: the two workarounds
    above, and PIXELTRIAGE_EMULATE_CUDA=1 (so `kernels.registry` picks the CUDA kernels). Raises
    InterpreterHarnessError when triton is not interpreting (TRITON_INTERPRET=1 must be set before triton is first
    imported). Restores everything on exit."""
    if not interpreting():
        raise InterpreterHarnessError("Triton is not interpreting: set TRITON_INTERPRET=1 before triton is first "
                                      "imported (tests/conftest.py does on a machine without a GPU)")
    from triton.runtime import autotuner, interpreter

    if vars(interpreter.ASTTransformer).get("visit_For") is _visit_for:     # nested: the outer block restores
        yield
        return

    original_prune = autotuner.Autotuner.prune_configs
    interpreter.ASTTransformer.visit_For = _visit_for
    interpreter.InterpretedFunction.rewritten_fn.clear()
    autotuner.Autotuner.prune_configs = _first_config(original_prune)
    try:
        with settings.environment(**{EMULATE_CUDA: "1", "TRITON_INTERPRET": "1"}):
            yield
    finally:
        autotuner.Autotuner.prune_configs = original_prune
        del interpreter.ASTTransformer.visit_For
        interpreter.InterpretedFunction.rewritten_fn.clear()


@pytest.fixture
def fla_interpreter():
    """pytest fixture: the test body runs under `fla_interpreter_mode()`. On a machine where Triton is not
    interpreting (a GPU machine: conftest leaves TRITON_INTERPRET unset there), the test is skipped with that
    reason: those kernels run on the GPU itself there (python -m pixeltriage.bench.gpu_check)."""
    if not interpreting():
        pytest.skip("Triton is not interpreting here (a GPU machine): the interpreter tests run where there is none")
    with fla_interpreter_mode():
        yield
