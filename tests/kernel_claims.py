"""Tests that claim a fast kernel prove it ran.

`@claims(kernel, ...)` (the pytest marker "claims", with `kernels.registry.Kernel`s) marks a test that claims those
kernels: the root conftest runs the test inside a fresh `registry.recording()` and fails it, after its own
assertions passed, unless the record shows every claimed kernel called at least once and declining none of its
calls. A kernel that declined (its `accepts` refused, or its C entry point returned non-zero, e.g. forced by
PIXELTRIAGE_TEST_DECLINE) and left the call to the next kernel fails the test even where the next kernel's result
passes its comparison.

`paths(torch_kernel, native_kernel)`: the parameters "torch" and "native" of a test that runs (`registry.run`) an
op's torch kernel and, beside it, its C or SIMD kernel: each claims its kernel; "native" is skipped where its kernel
is not available here.

tests/forced_declines.py runs, per C entry point, the tests claiming it with that entry point forced to decline: none
may pass.
"""
from __future__ import annotations

import pytest


def claims(*kernels):
    """The marker of a test that claims `kernels` (see the module)."""
    if not kernels:
        raise ValueError("claims() names the kernels the test claims")
    return pytest.mark.claims(*kernels)


def paths(torch_kernel, native_kernel) -> list:
    """[torch, native] parameters, the kernels themselves, for a test of `native_kernel` beside its op's torch
    kernel (see the module)."""
    return [pytest.param(torch_kernel, id="torch", marks=claims(torch_kernel)),
            pytest.param(native_kernel, id="native", marks=[claims(native_kernel), pytest.mark.skipif(
                not native_kernel.available(), reason=f"{native_kernel.label} is not available here")])]


def problems(counts, kernels) -> list[str]:
    """What the record `counts` (`registry.KernelCounts`) lacks for the claimed `kernels`: one line per kernel that
    never ran or declined a call."""
    found = []
    for kernel in kernels:
        ran, declined = counts.ran(kernel.op, kernel.name), counts.declined(kernel.op, kernel.name)
        if not ran or declined:
            found.append(f"{kernel.op}: {kernel.name!r} ran {ran} time(s)"
                         + (f", declined {declined}" if declined else ""))
    return found
