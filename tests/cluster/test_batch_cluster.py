"""`pixeltriage score --episodes --ray --ray-address` on Ray clusters of 1, 2 and 3 nodes, each node in its own network
namespace with one Ray CPU (so one scoring actor each), every actor reading one write-time cache in PostgreSQL on a
fourth host: every run's lines are the in-process run's (each id once, the same decision within 1e-5) and every node
scored some of them; a run SIGKILLed midway (the driver, its actors with it) leaves whole lines and the rerun scores
only what is missing. Questions/s per cluster size are printed (-s): on this machine's two shared cores they show
that the work is spread over the nodes and answered correctly, not how it scales."""
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from database import postgres_on
from images import encoded, random_image
from netns import Hosts, kill_session
from PIL import Image
from raynodes import ENV, Cluster

from pixeltriage.store.cache import Cache

pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'pixeltriage[ray]')")
pytestmark = pytest.mark.slow

EPISODES = 320
TOL = 1e-5
RUN_TIMEOUT = 600.0


def _write_episodes(tmp_path, cache_url):
    """EPISODES episodes of 1-3 memories: photos by path (the same path on every node: one file system here)
    and photos by key from the shared cache."""
    (tmp_path / "photos").mkdir()
    for i in range(4):
        Image.new("RGB", (96 + 16 * i, 72), (60 * i, 120, 200 - 40 * i)).save(tmp_path / "photos" / f"p{i}.png")
    with Cache(cache_url) as cache:
        keys = [cache.put(encoded(random_image("RGB", (72, 54 + 6 * i), seed=i), "PNG"), note=f"card {i}")
                for i in range(4)]
    path = tmp_path / "episodes.jsonl"
    with open(path, "w") as f:
        for n in range(EPISODES):
            memories = [{"image": f"photos/p{(n + j) % 4}.png", "note": f"photo {j}"} for j in range(n % 2 + 1)]
            memories += [{"key": keys[(n + j) % 4]} for j in range(n % 3)]
            f.write(json.dumps({"id": f"ep-{n}", "question": f"question {n}: which one is blue?",
                                "memories": memories}) + "\n")
    return path


def _lines(path) -> dict[str, dict]:
    data = path.read_text()
    assert data == "" or data.endswith("\n"), "a cut line left behind"
    results = [json.loads(line) for line in data.splitlines()]
    counts = Counter(r["id"] for r in results)
    assert not [i for i, c in counts.items() if c > 1], counts
    return {r["id"]: r for r in results}


def _same(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert set(got) == set(want)
    for episode_id, line in got.items():
        other = want[episode_id]
        assert abs(line["p_vis"] - other["p_vis"]) <= TOL
        assert [m["open"] for m in line["memories"]] == [m["open"] for m in other["memories"]]
        for a, b in zip(line["memories"], other["memories"]):
            assert abs(a["gain"] - b["gain"]) <= TOL and abs(a["relevance"] - b["relevance"]) <= TOL


def test_batch_scoring_over_one_two_and_three_nodes(namespaces, tiny_checkpoint, tmp_path):
    figures = {}
    with Hosts(["head", "w1", "w2", "db"]) as hosts, postgres_on(hosts, "db") as database:
        episodes = _write_episodes(tmp_path, database.local_url)
        reference = tmp_path / "in-process.jsonl"
        common = ["--checkpoint", str(tiny_checkpoint), "--episodes", str(episodes)]
        done = subprocess.run([sys.executable, "-m", "pixeltriage", "score", *common, "--cache", database.local_url,
                               "--out", str(reference), "--threads", "1"], capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, env=ENV)
        assert done.returncode == 0, done.stderr[-4000:]
        print("in-process, 1 thread:", done.stderr.strip().splitlines()[-1])
        want = _lines(reference)
        assert len(want) == EPISODES

        cluster = Cluster(hosts, tmp_path)
        try:
            def score(out, log):
                return hosts.popen("head", [sys.executable, "-m", "pixeltriage", "score", *common, "--cache",
                                            database.url, "--out", str(out), "--ray", "--ray-address",
                                            cluster.address, "--batch-size", "4"], log=log, env=cluster.env)

            cluster.start_head("head", cpus=1)
            for size, name in ((1, None), (2, "w1"), (3, "w2")):
                if name is not None:
                    cluster.join(name, cpus=1)
                    cluster.wait_nodes(size)
                out, log = tmp_path / f"nodes-{size}.jsonl", tmp_path / f"nodes-{size}.log"
                proc = score(out, log)
                assert proc.wait(RUN_TIMEOUT) == 0, log.read_text()[-4000:]
                summary = log.read_text().strip().splitlines()[-1]
                assert f"{EPISODES} scored, 0 failed, 0 already in" in summary, summary
                _same(_lines(out), want)
                nodes = dict(re.findall(r"(198\.18\.0\.\d+): (\d+)", summary))
                assert f" on {size} Ray node" in summary and len(nodes) == size, summary     # every node scored
                assert sum(int(n) for n in nodes.values()) == EPISODES, summary
                figures[size] = re.search(r" in ([\d.]+) s, of which ([\d.]+) s scoring \(([\d.]+) questions/s\)",
                                          summary).groups()
                print(f"{size} node(s), {size} actor(s): {EPISODES} questions in {figures[size][0]} s, of which "
                      f"{figures[size][1]} s scoring: {figures[size][2]} questions/s; per node {nodes}")

            # the driver SIGKILLed midway on three nodes: whole lines only, and the rerun completes them
            out, log = tmp_path / "killed.jsonl", tmp_path / "killed.log"
            proc = score(out, log)
            deadline = time.monotonic() + RUN_TIMEOUT
            while not (out.exists() and len(out.read_bytes().splitlines()) >= 8):
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.05)
            kill_session(proc.pid, signal.SIGKILL)
            proc.wait(30)
            partial = _lines(out)
            assert 8 <= len(partial) < EPISODES, len(partial)
            again = score(out, tmp_path / "rerun.log")
            assert again.wait(RUN_TIMEOUT) == 0, (tmp_path / "rerun.log").read_text()[-4000:]
            summary = (tmp_path / "rerun.log").read_text().strip().splitlines()[-1]
            assert f"{EPISODES - len(partial)} scored, 0 failed, {len(partial)} already in" in summary, summary
            _same(_lines(out), want)
            print(f"killed after {len(partial)} of {EPISODES} lines; the rerun: {summary}")
        finally:
            cluster.stop()
