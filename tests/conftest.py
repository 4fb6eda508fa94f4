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
