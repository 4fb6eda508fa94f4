"""The service in-process (FastAPI's TestClient, in addition to the HTTP tests): /ready is 200 only after the
checkpoint loaded and a warm-up forward at the full batch budget ran; /health answers meanwhile."""
import threading
import time

from fastapi.testclient import TestClient

from pixeltriage import Scorer
from pixeltriage.serve.app import create_app, field_path
from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.service import Service


def test_ready_only_after_loading_and_a_warm_up_at_the_full_budget(tiny_checkpoint, monkeypatch):
    forwards, release = [], threading.Event()
    real = Scorer.score_states

    def recording(self, states):
        forwards.append(sum(s.num_tokens for s in states))
        return real(self, states)

    monkeypatch.setattr(Scorer, "score_states", recording)

    def load():
        assert release.wait(60)
        return Scorer.load(tiny_checkpoint)

    service = Service(ServeConfig(max_batch_tokens=1000), load)
    failures = []
    with TestClient(create_app(service)) as http:
        service.start_loading(failures.append)
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 503 and http.get("/ready").json()["status"] == "loading"
        assert http.post("/v1/score", json={"question": "q"}).status_code == 503
        assert http.get("/info").json()["status"] == "loading"
        release.set()
        deadline = time.monotonic() + 60
        while http.get("/ready").status_code != 200:
            assert time.monotonic() < deadline and not failures, failures
            time.sleep(0.02)
        warm = forwards[0]
        one_state = forwards[1]                                  # then one question alone
        assert 1000 - one_state < warm <= 1000                    # the full budget, in states that fit it
        assert http.post("/v1/score", json={"question": "q", "memories": []}).status_code == 200
        assert len(forwards) == 3
    assert service.status == "stopped"                            # the app's shutdown closed the service


def test_field_paths():
    assert field_path(("body", "memories", 2, "image")) == "memories[2].image"
    assert field_path(("body", "questions", 0, "policy", "k")) == "questions[0].policy.k"
    assert field_path(("body",)) is None


def test_a_load_that_fails_after_opening_the_cache_closes_it(tiny_checkpoint, tmp_path):
    import pytest

    from pixeltriage import Cache

    cache = Cache(tmp_path / "cache.db")

    def broken_index(_cache):
        raise RuntimeError("the encoder did not load")

    service = Service(ServeConfig(), lambda: Scorer.load(tiny_checkpoint, cache=cache), index_loader=broken_index)
    with pytest.raises(RuntimeError, match="encoder"):
        service.load()
    with pytest.raises(ValueError, match="closed"):
        len(cache)


def test_ready_says_stalled_when_the_model_worker_stopped(tiny_checkpoint):
    service = Service(ServeConfig(max_batch_tokens=600), lambda: Scorer.load(tiny_checkpoint))
    service.load()
    with TestClient(create_app(service)) as http:
        assert http.get("/ready").status_code == 200
        service.batcher.close()                            # as if its threads had died
        response = http.get("/ready")
        assert response.status_code == 503 and response.json()["status"] == "stalled"
        assert http.post("/v1/score", json={"question": "q"}).status_code == 503
