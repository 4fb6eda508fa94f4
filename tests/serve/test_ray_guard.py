"""The guard `serve --ray` installs in Ray Serve's proxies (serve/ray.py, `proxy_guard`), run here on the real Ray
Serve proxy module in this process: a request whose replica was lost before it answered gets 503 with Retry-After
(the answer the proxy then writes), every other failure Ray Serve's own status. The guard at work in a cluster
that loses a node: tests/cluster/test_serve_cluster.py."""
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pixeltriage[ray]')")


@pytest.fixture
def guarded():
    from ray.serve._private import proxy as ray_proxy

    from pixeltriage.serve.ray import proxy_guard

    original = ray_proxy.get_http_response_status
    try:
        assert proxy_guard(None) is True
        yield ray_proxy.get_http_response_status
    finally:
        ray_proxy.get_http_response_status = original


def _lost():
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    return [ActorDiedError(), ActorUnavailableError("Actor is unavailable.", None),
            RayTaskError("handle_request", "traceback", ActorDiedError())]


@pytest.mark.parametrize("index", range(3), ids=["died", "unavailable", "task-error-of-a-dead-actor"])
def test_a_lost_replica_is_answered_503_with_retry_after(guarded, index):
    from ray.serve._private.http_util import send_http_response_on_exception

    status = guarded(_lost()[index], None, "req-1")
    assert status.code == 503 and status.is_error
    assert status.headers == [(b"retry-after", b"1")]
    assert "req-1" in status.message and "lost before it answered" in status.message
    start, body = send_http_response_on_exception(status, response_started=False)   # what the proxy writes
    assert start["status"] == 503 and (b"retry-after", b"1") in [tuple(h) for h in start["headers"]]
    assert b"lost before it answered" in body["body"]


def test_other_failures_keep_ray_serves_status(guarded):
    from ray.exceptions import RayTaskError

    assert guarded(TimeoutError(), 5.0, "r").code == 408
    assert guarded(RuntimeError("boom"), None, "r").code == 500
    assert guarded(RayTaskError("handle_request", "traceback", ValueError("app")), None, "r").code == 500


def test_the_guard_is_installed_once(guarded):
    from ray.serve._private import proxy as ray_proxy

    from pixeltriage.serve.ray import proxy_guard

    assert proxy_guard(None) is True
    assert ray_proxy.get_http_response_status is guarded          # not wrapped twice
