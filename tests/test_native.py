"""The native C kernels (kernels/native) against the torch paths beside them, and the build's fallbacks.

Tolerance: conv1d + SiLU <= 1e-6 relative to the reference, as its torch path (tests/test_fast_paths.py); the
kernel's exp differs from torch's by at most a few ulp.
"""
import os
import subprocess
import sys

import pytest
import torch

from pixeltriage.kernels import native
from pixeltriage.kernels.conv import causal_conv1d_silu, causal_conv1d_silu_reference

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@needs_native
@pytest.mark.parametrize("seq_len,width", [(1, 4), (3, 4), (4, 4), (97, 4), (50, 2), (20, 1), (200, 6), (33, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_conv_matches_reference_and_torch_path(seq_len, width, dtype):
    g = torch.Generator().manual_seed(seq_len * 10 + width)
    x = torch.randn(seq_len, 40, generator=g).mul_(3).to(dtype)       # SiLU's both tails, not just its middle
    w = torch.randn(40, width, generator=g).to(dtype)
    out = causal_conv1d_silu(x, w)
    assert out.dtype == torch.float32 and out.shape == (seq_len, 40)
    assert rel(out, causal_conv1d_silu_reference(x, w)) <= 1e-6
    assert rel(out, causal_conv1d_silu(x, w, native=False)) <= 1e-6


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_conv_reads_strided_rows_and_packed_sequences(dtype):
    """The layer hands the conv a column slice of its projection (row stride > C), several sequences packed."""
    g = torch.Generator().manual_seed(5)
    full = torch.randn(120, 50, generator=g).to(dtype)
    x, w = full[:, 7:37], torch.randn(30, 4, generator=g).to(dtype)
    bounds = [0, 1, 1, 40, 41, 120]
    out = causal_conv1d_silu(x, w, bounds)
    for b, e in zip(bounds, bounds[1:]):
        if e > b:
            assert rel(out[b:e], causal_conv1d_silu_reference(x[b:e], w)) <= 1e-6


@needs_native
def test_native_silu_extremes_match_torch():
    """Inputs far into SiLU's tails (the exp's clamp) and exact zeros: finite, and as torch's SiLU."""
    x = torch.tensor([[-200.0], [-90.0], [-30.0], [-1e-30], [0.0], [1e-30], [30.0], [90.0], [3e38]])
    w = torch.ones(1, 1)
    out = causal_conv1d_silu(x, w)
    want = torch.nn.functional.silu(x)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-30)


def _library_in_subprocess(env_extra: dict, tmp_path) -> str:
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from pixeltriage.kernels import native; print(native.available()); print(native.status())")
    env = {**os.environ, "PIXELTRIAGE_CACHE": str(tmp_path), **env_extra}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def test_native_off_switch(tmp_path):
    out = _library_in_subprocess({"PIXELTRIAGE_NATIVE": "0"}, tmp_path)
    assert out.startswith("False") and "disabled by PIXELTRIAGE_NATIVE=0" in out
    assert not (tmp_path / "native").exists()                        # nothing built


def test_missing_compiler_falls_back_with_a_warning(tmp_path):
    out = _library_in_subprocess({"CC": str(tmp_path / "no-such-cc")}, tmp_path)
    assert out.startswith("False") and "using the torch implementations" in out


def test_conv_without_native_library_takes_the_torch_path(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(30, 8, generator=g), torch.randn(8, 4, generator=g)
    assert torch.equal(causal_conv1d_silu(x, w), causal_conv1d_silu(x, w, native=False))


@needs_native
def test_build_is_cached_per_source_compiler_and_cpu(tmp_path):
    """A second process loads the same file instead of building again."""
    first = _library_in_subprocess({}, tmp_path)
    built = sorted((tmp_path / "native").glob("*.so"))
    assert first.startswith("True") and len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    second = _library_in_subprocess({}, tmp_path)
    assert second.startswith("True") and sorted((tmp_path / "native").glob("*.so")) == built
    assert built[0].stat().st_mtime_ns == mtime
    assert not list((tmp_path / "native").glob("*.tmp"))
