"""What ran, as a server's users see it: /info names the kernel each op's call starts with and counts what ran;
/metrics exports the same counts as pixeltriage_kernel_calls_total and pixeltriage_kernel_declines_total. Real server
processes, a real HTTP client."""
import re

import httpx
import pytest
from serving import ENV, ServerProcess, episode

from pixeltriage.kernels import native
from pixeltriage.serve import Client

SAMPLE = re.compile(r'^(pixeltriage_kernel_(?:calls|declines)_total)\{(.*)\} (\S+)$')


def kernel_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(metric name, its labels sorted): value} of the kernel counters on a /metrics page."""
    found = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2))))
            found[m.group(1), labels] = float(m.group(3))
    return found


def calls(samples, op: str, kernel: str) -> float:
    return samples.get(("pixeltriage_kernel_calls_total", (("kernel", kernel), ("op", op))), 0.0)


def test_info_and_metrics_count_the_kernels_that_ran(client, http):
    question, memories = episode(11, memories=2)
    client.score(question, memories)
    info = http.get("/info").json()
    samples = kernel_samples(http.get("/metrics").text)
    chosen, ran = info["kernels"], info["kernels_ran"]
    assert ran["calls"]["gated_delta"] and ran["calls"]["add_norm"], ran
    for op, kernels in ran["calls"].items():                   # /metrics exports what /info counts
        for kernel, n in kernels.items():
            assert n >= 1 and calls(samples, op, kernel) == n, (op, kernel)
    if native.available():                                     # the C kernels the forward starts with ran
        assert chosen["native"] == native.variant()
        for op, kernel in (("gated_delta", "native C pt_delta_chunked"), ("add_norm", "native C pt_add_norm")):
            assert chosen[op] == kernel and ran["calls"][op][kernel] >= 1, (op, ran["calls"][op])
            assert not ran["declines"].get(op, {}).get(kernel), ran["declines"]


@pytest.fixture
def declining(tiny_checkpoint, tmp_path):
    """A server whose C pt_add_norm declines every call (the test switch)."""
    if not native.available():
        pytest.skip(f"no C kernels here: {native.status()}")
    env = {**ENV, "PIXELTRIAGE_TEST_DECLINE": "pt_add_norm"}
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", env=env).wait_ready()
    yield server
    server.stop()


def test_a_declining_c_kernel_is_counted_exported_and_logged_once(declining, tmp_path):
    with Client(declining.url, retries=0) as client:
        for seed in range(2):
            client.score(*episode(seed, memories=2))
    info = httpx.get(declining.url + "/info", timeout=30).json()
    samples = kernel_samples(httpx.get(declining.url + "/metrics", timeout=30).text)
    reason = "pt_add_norm: forced by PIXELTRIAGE_TEST_DECLINE"
    declined = info["kernels_ran"]["declines"]["add_norm"]["native C pt_add_norm"][reason]
    assert declined >= 1 and "native C pt_add_norm" not in info["kernels_ran"]["calls"].get("add_norm", {})
    labels = (("kernel", "native C pt_add_norm"), ("op", "add_norm"), ("reason", reason))
    assert samples["pixeltriage_kernel_declines_total", labels] == declined
    # each declined call ran on the next kernel
    assert calls(samples, "add_norm", "torch") == info["kernels_ran"]["calls"]["add_norm"]["torch"] >= declined
    declining.stop()
    warnings = [line for line in (tmp_path / "server.log").read_text().splitlines()
                if "WARNING" in line and "declined a call" in line]
    assert len(warnings) == 1 and "pt_add_norm" in warnings[0], warnings
