"""The service's life in a real server process over loopback HTTP: /ready is 200 only after the checkpoint loaded and
a warm-up forward at the full batch budget ran (/health answers meanwhile); a load that fails after opening the cache
closes it; /ready says "stalled" once the model worker stopped; validation errors name the request field.

The server is started through gated_serve.py (GatedServer): the load stays held until the test opens it, so the
"loading" answers are checked while the server is certainly loading, whatever the machine's speed."""
from pathlib import Path

import httpx
from serving import b64, image_bytes, wait_for

from pixeltriage import Cache


def test_ready_only_after_loading_and_a_warm_up_at_the_full_budget(gated, tmp_path):
    db = tmp_path / "cache.db"
    server = gated("server", "--max-batch-tokens", "1000", "--cache", str(db), hold=("load",)).wait_listening()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        assert http.post("/v1/score", json={"question": "q"}).status_code == 503
        assert http.get("/info").json()["status"] == "loading"
        assert server.forwards() == []                      # held before the model loaded
        server.open("load")
        wait_for("/ready to answer 200", lambda: http.get("/ready").status_code == 200)
        (warm_states, warm), (one_states, one_state) = server.forwards()
        assert 1000 - one_state < warm <= 1000 and warm_states > 1   # the full budget, in states that fit it
        assert one_states == 1                                       # then one question alone
        assert http.post("/v1/score", json={"question": "q", "memories": []}).status_code == 200
        assert len(server.forwards()) == 3
    assert server.stop() == 0                                # SIGTERM: drained, then the app's shutdown
    assert "pixeltriage serve: stopped" in server.output() and "Traceback" not in server.output()
    assert not Path(f"{db}-wal").exists()                   # the shutdown closed the service and its cache


def test_validation_errors_name_the_field(http):
    memories = [{"image": b64(image_bytes(seed=0))}, {"image": b64(image_bytes(seed=1))}, {"image": 5}]
    response = http.post("/v1/score", json={"question": "q", "memories": memories})
    assert response.status_code == 422 and response.json()["field"] == "memories[2].image", response.json()
    response = http.post("/v1/score/batch", json={"questions": [{"question": "q", "policy": {"k": "many"}}]})
    assert response.status_code == 422 and response.json()["field"] == "questions[0].policy.k", response.json()
    response = http.post("/v1/score", json=["not", "an", "object"])       # the body itself: no field
    assert response.status_code == 422 and response.json()["field"] is None, response.json()
    response = http.get("/v1/memories/not-a-key")                          # a path parameter, by its name
    assert response.status_code == 422 and response.json()["field"] == "key", response.json()


def test_a_load_that_fails_after_opening_the_cache_closes_it(gated, tmp_path):
    encoder = tmp_path / "encoder"                  # a region encoder that fails to load, after the scorer's cache
    encoder.mkdir()
    (encoder / "config.json").write_text('{"model_type": "bert"}')
    db = tmp_path / "cache.db"
    server = gated("server", "--cache", str(db), "--index-encoder", str(encoder))
    assert server.proc.wait(120) == 2
    last = server.output().strip().splitlines()[-1]
    assert last.startswith("error: ") and "not a SigLIP 2" in last, server.output()[-2000:]
    assert db.exists() and not Path(f"{db}-wal").exists()   # opened, then closed by the failed load
    with Cache(db) as cache:
        assert cache.integrity_check() == "ok"


def test_ready_says_stalled_when_the_model_worker_stopped(gated):
    server = gated("server", "--max-batch-tokens", "600").wait_ready()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/ready").status_code == 200
        server.send("close batcher")                        # its threads stop, as if they had died
        response = wait_for("/ready to answer 503", lambda: (r := http.get("/ready")).status_code == 503 and r)
        assert response.json()["status"] == "stalled"
        assert http.post("/v1/score", json={"question": "q"}).status_code == 503
