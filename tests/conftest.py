import os

# Triton decorates its kernels when their module is first imported, and transformers imports it (through
# flash-linear-attention) before any test module runs: on a machine without CUDA the Triton kernels can only run
# in the interpreter, so it has to be switched on here, before anything imports triton.
if not os.path.exists("/dev/nvidiactl") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Parallel workers (pytest-xdist, `make test`) share the machine's cores: each worker, and every process it starts,
# runs torch's intra-op pool on its share of them, not on all of them (a pool per worker as wide as the machine spins
# its idle threads against the other workers': a quarter of the suite's CPU time). The kernels' own thread partitions
# are checked at several thread counts by the tests that set them (tests/engine/test_threads.py).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

import atexit
import shutil
import tempfile
from pathlib import Path

# The test run's own directory, shared by xdist's workers (they take the one their controller made: it outlives
# them and removes it). The choices measured once per machine (kernels.tuning) go to a file there, inherited by the
# processes the tests start: measurements taken under a test run's load never become the records every later forward
# on this machine follows, a record a test forces (row blocks, a library) stays in the run, and the run measures each
# choice once, not once per worker (a first measurement under the other workers' load takes ~30 s).
_RUN_DIR = "_PIXELTRIAGE_TEST_RUN_DIR"
if not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_RUN_DIR)):
    os.environ[_RUN_DIR] = tempfile.mkdtemp(prefix="pixeltriage-test-run-")
    atexit.register(shutil.rmtree, os.environ[_RUN_DIR], ignore_errors=True)
RUN_DIR = Path(os.environ[_RUN_DIR])
os.environ["PIXELTRIAGE_TUNING"] = str(RUN_DIR / "tuning.json")

import pytest

from pixeltriage import settings
from pixeltriage.paths import cached_directory
from pixeltriage.weights.demo import write_demo_checkpoint
from postgres import postgres_server, postgres_url  # noqa: F401  (fixtures: a real PostgreSQL, tests/postgres.py)


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The tiny demo checkpoint (float32, random weights), written once per run in the run's directory
    (`paths.cached_directory`: the first worker to need it writes it, the others read it). Read-only: a test that
    breaks one takes `tiny_copy`."""
    return cached_directory("tiny", lambda target: write_demo_checkpoint(target, preset="tiny", seed=0), root=RUN_DIR)


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


def pytest_configure(config):
    config.addinivalue_line("markers", "claims(*kernels): the test claims these registry kernels; it fails unless "
                                       "each ran and declined nothing (tests/kernel_claims.py)")


def pytest_collection_modifyitems(config, items):
    """The files marked `long` first, each file's tests in their order, the rest after them in collection order: with
    `make test`'s workers taking whole files in this order (xdist's --dist loadfile --no-loadscope-reorder), the files
    of tens of seconds start early and the run ends on short ones, where xdist's own order (most tests first) left a
    one-test file of 40 s to run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test marked `claims` runs inside its own kernel record and fails unless each kernel it claims ran and
    declined no call (tests/kernel_claims.py)."""
    claimed = [kernel for marker in item.iter_markers("claims") for kernel in marker.args]
    if not claimed:
        return (yield)
    from kernel_claims import problems

    from pixeltriage.kernels import registry

    with registry.recording() as record:
        result = yield
    missing = problems(record.snapshot(), claimed)
    if missing:
        raise AssertionError("the kernels this test claims did not run as claimed:\n  " + "\n  ".join(missing))
    return result


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
