def pytest_ignore_collect(collection_path, config):
    """Benchmarks build large demo checkpoints: collect them only when benchmarks run (`make bench`)."""
    return bool(config.getoption("benchmark_skip", False))
