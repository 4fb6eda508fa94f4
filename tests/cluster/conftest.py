"""The cluster tests: several Ray nodes on this machine, each in a network namespace of its own (netns.py), for
minutes. They are marked `slow`: CI runs them in its step for slow tests (`pytest -m slow`, after `make test`), and
any run that does not select the mark skips them, saying so; where this machine cannot create network namespaces
they skip with the reason."""
import pytest

import netns


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a cluster test (minutes, network namespaces): run with -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None and "cluster" in item.path.parts:
            item.add_marker(skip)


@pytest.fixture
def namespaces():
    """Network namespaces can be made here (or the test skips, saying why)."""
    try:
        netns.probe()
    except netns.NamespacesUnavailable as e:
        pytest.skip(f"no network namespaces on this machine: {e}")
