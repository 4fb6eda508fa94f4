"""Test parameters for the native kernels' AVX-512 and AMX paths on any CPU: a path whose units this CPU has runs
on them; one it lacks runs on the emulated build (`kernels.native.emulated_isa`, isa_emulation.h), marked
`isa_emulated` (the root conftest enters the emulation around such a test) and named "<unit>-emulated"."""
import pytest


def has(unit: str) -> bool:
    """Whether this CPU's own build runs `unit`: a bf16 engine of the delta pass and the attention kernels ("fma",
    "avx512_bf16", "amx"), "avx512" (vec_math.h's functions) or "simd" (kernels/simd.py's AVX512-BF16 passes)."""
    import torch

    from pixeltriage.kernels import native, simd

    with native.emulated_isa(False):
        if unit == "avx512":
            return native.vec_math("exp", torch.zeros(1)) is not None
        if unit == "simd":
            return simd.available()
        if unit in native.BF16_ENGINES:
            return unit in native.bf16_engines()
    raise ValueError(f"unknown unit {unit!r}")


def params(*units: str) -> list:
    """One pytest parameter per unit, its value the unit's name: on this CPU where it has the unit, else emulated."""
    return [pytest.param(unit, id=unit) if has(unit) else
            pytest.param(unit, id=f"{unit}-emulated", marks=pytest.mark.isa_emulated) for unit in units]


def with_emulated(unit: str) -> list:
    """Parameters for a test of a whole path (e.g. the forward) that takes `unit` where the CPU has it: "cpu" (as
    the CPU is), and where the CPU lacks the unit, "<unit>-emulated" too (the same test with the unit emulated)."""
    return [pytest.param("cpu", id="cpu")] + ([] if has(unit) else [
        pytest.param(f"{unit}-emulated", id=f"{unit}-emulated", marks=pytest.mark.isa_emulated)])
