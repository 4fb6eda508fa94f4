"""Running the CUDA path's Triton and flash-linear-attention kernels on CPU tensors, in Triton's interpreter.

The harness itself is `pixeltriage.bench.emulation` (the interpreter workarounds, `tl.dot` on bf16 / fp16 as tensor
cores compute it, the launch recorder `bench compile` uses); this module is its pytest side: the `fla_interpreter`
fixture, and the version and internals checks run at import, so a triton or fla other than the pinned ones fails
every test that uses the harness, naming what changed: it is never skipped.
"""
from __future__ import annotations

import pytest

from pixeltriage.bench.emulation import (EMULATE_CUDA, FLA_VERSION, TRITON_VERSION,  # noqa: F401  (re-exported)
                                         InterpreterHarnessError, interpreting)
from pixeltriage.bench.emulation import check_internals as _check_internals
from pixeltriage.bench.emulation import check_versions as _check_versions
from pixeltriage.bench.emulation import cuda_emulation as fla_interpreter_mode

_check_versions()
_check_internals()


@pytest.fixture
def fla_interpreter():
    """pytest fixture: the test body runs under `fla_interpreter_mode()`. On a machine where Triton is not
    interpreting (a GPU machine: conftest leaves TRITON_INTERPRET unset there), the test is skipped with that
    reason: those kernels run on the GPU itself there (python -m pixeltriage.bench.gpu_check)."""
    if not interpreting():
        pytest.skip("Triton is not interpreting here (a GPU machine): the interpreter tests run where there is none")
    with fla_interpreter_mode():
        yield
