"""The cluster tests: several Ray nodes on this machine, each in a network namespace of its own (netns.py), for
minutes. They run in CI's second step (`pytest -m cluster`, .ci/run) and are skipped, saying so, in any run that
does not select the `cluster` mark; where this machine cannot create network namespaces they skip with the reason."""
import pytest

import netns


def pytest_collection_modifyitems(config, items):
    if "cluster" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a cluster test (minutes, network namespaces): run with -m cluster")
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(skip)


@pytest.fixture
def namespaces():
    """Network namespaces can be made here (or the test skips, saying why)."""
    try:
        netns.probe()
    except netns.NamespacesUnavailable as e:
        pytest.skip(f"no network namespaces on this machine: {e}")
