import pytest


@pytest.fixture(scope="session", autouse=True)
def malloc_tuned():
    """The benchmarks run with the malloc settings the engine's own processes use (`pixeltriage.tune_malloc`)."""
    from pixeltriage.engine.cpu_memory import tune_malloc

    tune_malloc()


def pytest_ignore_collect(collection_path, config):
    """Benchmarks build large demo checkpoints: collect them only when benchmarks run (`make bench`)."""
    return bool(config.getoption("benchmark_skip", False))
