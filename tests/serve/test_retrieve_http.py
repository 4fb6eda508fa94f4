"""Region retrieval through the server: POST /v1/memories indexes at write time when the server has
--index-encoder, and POST /v1/retrieve ranks the cached images exactly as an in-process RegionIndex over the same
cache file does (scores within 1e-5, float32)."""
import subprocess
import sys

import httpx
from serving import ENV, image_bytes


def test_memories_are_indexed_and_retrieval_matches_the_library(indexed, encoder_dir):
    from pixeltriage import Cache
    from pixeltriage.retrieval import RegionIndex, SiglipEncoder
    from pixeltriage.serve import Client

    images = [image_bytes((160, 120), color, seed=i) for i, color in enumerate([(200, 40, 40), (40, 200, 40),
                                                                                (40, 40, 200), (220, 220, 30)])]
    with Client(indexed.url, retries=0) as client:
        keys = [client.put_memory(data, note=f"picture {i}") for i, data in enumerate(images)]
        assert all(client.memory(key)["regions_indexed"] for key in keys)
        served = {whole: client.retrieve("a red picture", top=3, whole_image=whole) for whole in (False, True)}
        assert client.info()["region_index"]["images"] == len(images)
    with Cache(indexed.db) as cache:
        index = RegionIndex(cache, SiglipEncoder.load(encoder_dir))
        for whole, hits in served.items():
            want = index.search("a red picture", top=3, whole_image=whole)
            assert [h.key for h in hits] == [h.key for h in want] and len(hits) == 3
            assert all(abs(a.score - b.score) <= 1e-5 for a, b in zip(hits, want))
            assert [(h.region, h.box) for h in hits] == [(h.region, h.box) for h in want]
            assert set(h.key for h in hits) <= set(keys)


def test_retrieve_without_an_index_is_501(served):
    response = httpx.post(served.url + "/v1/retrieve", json={"question": "q"},
                          headers={"authorization": f"Bearer {served.key}"}, timeout=30)
    assert response.status_code == 501 and "--index-encoder" in response.json()["error"]
    assert response.json()["error_type"] == "no_cache"


def test_index_encoder_needs_a_cache(tiny_checkpoint, encoder_dir):
    out = subprocess.run([sys.executable, "-m", "pixeltriage", "serve", "--checkpoint", str(tiny_checkpoint),
                          "--index-encoder", str(encoder_dir)], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 2 and "--index-encoder needs --cache DB" in out.stderr and "Traceback" not in out.stderr
