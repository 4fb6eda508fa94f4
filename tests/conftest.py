import os

# Triton decorates its kernels when their module is first imported, and transformers imports it (through
# flash-linear-attention) before any test module runs: on a machine without CUDA the Triton kernels can only run
# in the interpreter, so it has to be switched on here, before anything imports triton.
if not os.path.exists("/dev/nvidiactl") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import atexit
import shutil
import tempfile

# The choices measured once per machine (kernels.tuning) go to a file of this test run's own, inherited by the
# processes it starts: measurements taken under a test run's load never become the records every later forward on
# this machine follows, and a record a test forces (row blocks, a library) stays in the run.
_tuning_dir = tempfile.mkdtemp(prefix="pixeltriage-test-tuning-")
atexit.register(shutil.rmtree, _tuning_dir, ignore_errors=True)
os.environ["PIXELTRIAGE_TUNING"] = os.path.join(_tuning_dir, "tuning.json")

import pytest

from pixeltriage import settings
from pixeltriage.weights.demo import write_demo_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny demo checkpoint (float32, random weights), written once per session."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", preset="tiny", seed=0)


@pytest.fixture
def tiny_copy(tiny_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint that a test may break."""
    return shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")


class _MonkeyPatch(pytest.MonkeyPatch):
    """pytest's MonkeyPatch whose changes to the environment `pixeltriage.settings` reads at once (`settings.reload`),
    on the way in and on the way out."""

    def setenv(self, name, value, prepend=None):
        super().setenv(name, value, prepend)
        settings.reload()

    def delenv(self, name, raising=True):
        super().delenv(name, raising)
        settings.reload()

    def undo(self):
        super().undo()
        settings.reload()


@pytest.fixture
def monkeypatch():
    """pytest's monkeypatch, the settings re-read after each environment change (a test sets a PIXELTRIAGE_*
    switch with monkeypatch.setenv and the engine follows it)."""
    patch = _MonkeyPatch()
    yield patch
    patch.undo()


def _native_paths():
    from pixeltriage.kernels import native

    return [pytest.param(False, id="torch"),
            pytest.param(None, id="native", marks=pytest.mark.skipif(not native.available(),
                                                                       reason=f"native kernels: {native.status()}"))]


NATIVE_PATHS = _native_paths()   # `native=` values: the torch path and the C kernels beside it


@pytest.fixture(params=NATIVE_PATHS)
def native(request, monkeypatch):
    """Run a CPU-kernel test once through the torch path (False) and once through the C kernels (None); in the
    second run, fail the test if no C kernel was called (a guard that declined would test torch twice)."""
    if request.param is False:
        yield False
        return
    from pixeltriage.kernels import native as native_kernels

    lib, called = native_kernels.library(), []

    class Counting:
        def __getattr__(self, name):
            called.append(name)
            return getattr(lib, name)

    monkeypatch.setattr(native_kernels, "library", lambda: Counting())
    yield None
    assert called, "native=None, but no C kernel ran"


@pytest.fixture(autouse=True)
def _isa_emulation(request):
    """A test marked `isa_emulated` (tests/isa.py's parameters for units this CPU lacks) runs on the emulated build
    of the native kernels; skipped where that build is not available (no compiler, PIXELTRIAGE_NATIVE=0)."""
    if request.node.get_closest_marker("isa_emulated") is None:
        yield
        return
    from pixeltriage.kernels import native as native_kernels

    with native_kernels.emulated_isa():
        if native_kernels.library() is None:
            pytest.skip(f"no emulated build of the native kernels: {native_kernels.status()}")
        yield


@pytest.fixture
def native_calls(monkeypatch):
    """Every C kernel call of the test, as (kernel name, its arguments), the calls still made."""
    from pixeltriage.kernels import native as native_kernels

    calls, real = [], native_kernels.call
    monkeypatch.setattr(native_kernels, "call", lambda name, *args: calls.append((name, args)) or real(name, *args))
    return calls
