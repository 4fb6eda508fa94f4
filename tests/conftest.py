import os

# Triton decorates its kernels when their module is first imported, and transformers imports it (through
# flash-linear-attention) before any test module runs: on a machine without CUDA the Triton kernels can only run
# in the interpreter, so it has to be switched on here, before anything imports triton.
if not os.path.exists("/dev/nvidiactl") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil

import pytest

from pixeltriage.weights.demo import write_demo_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny demo checkpoint (float32, random weights), written once per session."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", preset="tiny", seed=0)


@pytest.fixture
def tiny_copy(tiny_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint that a test may break."""
    return shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
