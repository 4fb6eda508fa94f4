import pytest


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory):
    """The tiny fixed-resolution demo SigLIP 2 checkpoint (32 px, D=32, random weights), written once."""
    from pixeltriage.retrieval.demo import write_demo_encoder

    return write_demo_encoder(tmp_path_factory.mktemp("siglip") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def naflex_encoder_dir(tmp_path_factory):
    """The NaFlex variant (16-px patches, up to 256 of them)."""
    from pixeltriage.retrieval.demo import write_demo_encoder

    return write_demo_encoder(tmp_path_factory.mktemp("siglip") / "tiny-naflex", "tiny-naflex", seed=0)


@pytest.fixture(scope="session")
def tiny_encoder(tiny_encoder_dir):
    from pixeltriage.retrieval.encoder import SiglipEncoder

    return SiglipEncoder.load(tiny_encoder_dir, batch_size=4)
