"""Offline batch scoring, `pixeltriage score --episodes FILE.jsonl --out FILE.jsonl [--ray]` (pixeltriage.cli.batch),
as a user meets it: every episode's decision keyed by its id and equal to the library's; a run SIGKILLed midway
leaves only whole lines, and the rerun scores exactly what is missing (no duplicate, none lost), also after a
machine crash cut the last line short; bad input and bad flags are one-line errors before anything loads; an
episode that cannot be scored gets an error line and the rest are scored; on Ray Data (a real local Ray, two
actors) the lines are the same. The same on a cluster of network-namespace nodes: tests/cluster."""
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from cli_inputs import ENV
from PIL import Image

from pixeltriage import Cache, Memory, Scorer
from pixeltriage.cli import main

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

TOL = 1e-5


def write_episodes(tmp_path, count: int, *, keys=()) -> Path:
    """`count` episodes of 1-3 photos (by path), each with an id; `keys`: cache keys added as memories."""
    (tmp_path / "photos").mkdir(exist_ok=True)
    for i in range(5):
        Image.new("RGB", (96 + 16 * i, 72), (50 * i, 120, 220 - 40 * i)).save(tmp_path / "photos" / f"p{i}.png")
    path = tmp_path / "episodes.jsonl"
    with open(path, "w") as f:
        for n in range(count):
            memories = [{"image": f"photos/p{(n + j) % 5}.png", "note": f"photo {j}", "date": f"2026-01-{j + 1:02d}"}
                        for j in range(1 + n % 3)]
            memories += [{"key": k} for k in keys]
            f.write(json.dumps({"id": f"ep-{n}", "question": f"question {n}: which photo is blue?",
                                "memories": memories}) + "\n")
            if n % 7 == 3:
                f.write("\n")                               # blank lines are skipped
    return path


def expected(tiny_checkpoint, episodes_path, cache=None) -> dict:
    """{id: Scores} from the library, episode by episode."""
    scorer = Scorer.load(tiny_checkpoint, cache=cache)
    out = {}
    for line in episodes_path.read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            memories = [Memory(image=str(episodes_path.parent / m["image"]) if "image" in m else None,
                               key=m.get("key"), note=m.get("note"), date=m.get("date", "")) for m in e["memories"]]
            out[e["id"]] = scorer.score(e["question"], memories)
    return out


def read_out(path) -> list[dict]:
    data = path.read_text()
    assert data == "" or data.endswith("\n"), "a cut line left behind"
    return [json.loads(line) for line in data.splitlines()]


def assert_matches(results: list[dict], want: dict) -> None:
    counts = Counter(r["id"] for r in results)
    assert set(counts) == set(want) and set(counts.values()) == {1}, counts     # every id, exactly once
    for r in results:
        scores = want[r["id"]]
        assert abs(r["p_vis"] - scores.p_vis) <= TOL
        assert abs(r["relevance_none"] - scores.relevance_none) <= TOL
        assert [m["index"] for m in r["memories"]] == list(range(1, len(scores.gains) + 1))
        assert all(abs(m["gain"] - g) <= TOL for m, g in zip(r["memories"], scores.gains))
        assert all(abs(m["relevance"] - x) <= TOL for m, x in zip(r["memories"], scores.relevance))


def test_every_episode_is_scored_once_keyed_by_its_id(tiny_checkpoint, tmp_path, capsys):
    episodes = write_episodes(tmp_path, 11)
    out = tmp_path / "out.jsonl"
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episodes", str(episodes), "--out", str(out),
                 "--k", "1", "--batch-size", "4"]) == 0
    results = read_out(out)
    assert_matches(results, expected(tiny_checkpoint, episodes))
    first = next(r for r in results if r["id"] == "ep-2")
    assert first["question"] == "question 2: which photo is blue?" and first["k"] == 1
    assert [m["open"] for m in first["memories"]].count(True) == 1
    assert first["memories"][0]["image"] == str(tmp_path / "photos" / "p2.png")
    err = capsys.readouterr().err
    assert "score: 11 scored, 0 failed, 0 already in" in err

    # a second run has nothing left to do and leaves the file as it was
    before = out.read_bytes()
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episodes", str(episodes), "--out", str(out)]) == 0
    assert out.read_bytes() == before
    assert "0 scored, 0 failed, 11 already in" in capsys.readouterr().err


def test_a_run_killed_midway_resumes_without_duplicates_or_losses(tiny_checkpoint, tmp_path):
    episodes = write_episodes(tmp_path, 24)
    out, log = tmp_path / "out.jsonl", tmp_path / "run.log"
    command = [sys.executable, "-m", "pixeltriage", "score", "--checkpoint", str(tiny_checkpoint),
               "--episodes", str(episodes), "--out", str(out), "--batch-size", "2", "--threads", "1"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + 180
    while not (out.exists() and len(out.read_bytes().splitlines()) >= 4):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    partial = read_out(out)                                       # whole lines only
    assert 4 <= len(partial) < 24, len(partial)

    # a crash of the machine may leave a last line cut short: the rerun drops it
    with open(out, "ab") as f:
        f.write(b'{"id": "ep-23", "question": "question 23: wh')
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dropped a cut-short last line" in done.stderr
    assert f"{24 - len(partial)} scored, 0 failed, {len(partial)} already in" in done.stderr
    results = read_out(out)
    assert results[:len(partial)] == partial                       # what was there stays as it was
    assert_matches(results, expected(tiny_checkpoint, episodes))


@pytest.fixture(params=["sqlite", "postgresql"])
def cache_path(request, tmp_path) -> str:
    """A write-time cache on each backend: a file, or a database of the tests' PostgreSQL server by its URL."""
    return str(tmp_path / "cache.db") if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def test_an_episode_that_cannot_be_scored_gets_an_error_line_and_the_rest_are_scored(tiny_checkpoint, tmp_path,
                                                                                    cache_path, capsys):
    with Cache(cache_path) as cache:
        key = cache.put(Image.new("RGB", (64, 48), (9, 9, 200)), note="a blue card")
    episodes = write_episodes(tmp_path, 4, keys=[key])
    with open(episodes, "a") as f:                                 # a key this cache does not hold
        f.write(json.dumps({"id": "missing", "question": "q?", "memories": [{"key": "0" * 64}]}) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["score", "--checkpoint", str(tiny_checkpoint), "--episodes", str(episodes), "--out", str(out),
            "--cache", cache_path]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "4 scored, 1 failed" in err and "1 episodes could not be scored" in err
    results = read_out(out)
    failed = [r for r in results if "error" in r]
    assert [r["id"] for r in failed] == ["missing"] and failed[0]["error_type"] == "InvalidMemoryError"
    assert failed[0]["error"] == f"memory 1: key '{'0' * 64}' is not in the cache"
    with Cache(cache_path) as cache:
        want = expected(tiny_checkpoint, _without(episodes, "missing"), cache)
    assert_matches([r for r in results if "error" not in r], want)
    assert main(argv) == 2                                         # still there, not scored twice
    assert "0 scored, 0 failed, 5 already in" in capsys.readouterr().err
    assert len(read_out(out)) == 5


def _without(episodes, episode_id):
    path = episodes.with_name("without.jsonl")
    path.write_text("".join(line + "\n" for line in episodes.read_text().splitlines()
                            if line.strip() and json.loads(line)["id"] != episode_id))
    return path


@pytest.mark.parametrize("lines, needle", [
    (['{"question": "q", "memories": []}'], "line 1: needs an 'id'"),
    (['{"id": 7, "question": "q", "memories": []}'], "line 1: needs an 'id', a non-empty string"),
    (['{"id": "a", "question": "q", "memories": []}', '', '{"id": "a", "question": "r", "memories": []}'],
     "line 3: id 'a' is already the id of line 1"),
    (['{"id": "a", "question": "q", "memories": []', ], "line 1: not valid JSON"),
    (['["a"]'], "line 1: expected a JSON object"),
    (['{"id": "a", "question": "q", "memories": [{"image": "none.png"}]}'], "line 1: memory 1: image file"),
    (['{"id": "a", "question": "q", "memories": [], "extra": 1}'], "line 1 has unknown fields ['extra']"),
    (['{"id": "a", "question": "q", "memories": [{"key": "' + "0" * 64 + '"}]}'], "line 1: a memory is given by "
                                                                               "cache key; pass the cache"),
    ([''], "holds no episode"),
])
def test_bad_episode_lines_are_one_line_errors_before_loading(lines, needle, tiny_checkpoint, tmp_path,
                                                             monkeypatch, capsys):
    monkeypatch.setattr("pixeltriage.engine.scorer.Scorer.load", lambda *a, **k: pytest.fail("loaded a model"))
    episodes = tmp_path / "e.jsonl"
    episodes.write_text("\n".join(lines) + "\n")
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episodes", str(episodes),
                 "--out", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and needle in err and err.startswith("error: "), err
    assert not (tmp_path / "out.jsonl").exists()


def test_an_output_that_is_not_ours_is_left_alone(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("pixeltriage.engine.scorer.Scorer.load", lambda *a, **k: pytest.fail("loaded a model"))
    episodes = write_episodes(tmp_path, 2)
    out = tmp_path / "notes.txt"
    out.write_text("my notes\nmore notes\n")
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episodes", str(episodes), "--out", str(out)]) == 2
    assert "notes.txt, line 1: not a result of `score --episodes`" in capsys.readouterr().err
    assert out.read_text() == "my notes\nmore notes\n"


@pytest.mark.parametrize("argv, needle", [
    (["--episodes", "{e}"], "--episodes needs --out FILE.jsonl"),
    (["--episode", "{e}", "--out", "{o}"], "--out is for offline batch scoring"),
    (["--episode", "{e}", "--ray"], "--ray is for offline batch scoring"),
    (["--episodes", "{e}", "--out", "{o}", "--gate-rate", "0.5"], "--gate-rate ranks a stream's questions"),
    (["--episodes", "{e}", "--out", "{o}", "--json"], "--json is for --episode"),
    (["--episodes", "{e}", "--out", "{o}", "--ray-address", "auto"], "--ray-address needs --ray"),
    (["--episodes", "{e}", "--out", "{o}", "--actors", "2"], "--actors needs --ray"),
    (["--episodes", "{e}", "--out", "{o}", "--ray", "--threads", "2"], "--threads is for in-process scoring"),
    (["--episodes", "{e}", "--out", "{e}"], "--out is the --episodes file itself"),
    (["--episodes", "{e}", "--out", "{o}", "--ray", "--actors", "0"], "--actors: must be at least 1"),
    (["--episodes", "{e}", "--episode", "{e}", "--out", "{o}"], "not allowed with argument"),
    (["--episodes", "{t}/none.jsonl", "--out", "{o}"], "no such file"),
    (["--episodes", "{e}", "--out", "{t}/nowhere/o.jsonl"], "no such directory"),
])
def test_score_batch_usage_errors(argv, needle, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("pixeltriage.engine.scorer.Scorer.load", lambda *a, **k: pytest.fail("loaded a model"))
    episodes = write_episodes(tmp_path, 1)
    values = {"e": episodes, "o": tmp_path / "out.jsonl", "t": tmp_path}
    try:
        code = main(["score", "--checkpoint", str(tiny_checkpoint), *(a.format(**values) for a in argv)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and needle in err, err
    assert err.strip().splitlines()[-1].startswith(("error:", "pixeltriage score: error:")), err
    assert not (tmp_path / "out.jsonl").exists()


def test_on_ray_data_the_lines_are_the_same(tiny_checkpoint, tmp_path):
    """A real local Ray (started by the command, as without --ray-address), two actors of one CPU each."""
    pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'pixeltriage[ray]')")
    episodes = write_episodes(tmp_path, 10)
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "pixeltriage", "score", "--checkpoint", str(tiny_checkpoint),
                           "--episodes", str(episodes), "--out", str(out), "--ray", "--actors", "2",
                           "--batch-size", "3"], capture_output=True, text=True, timeout=400,
                          env={**ENV, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "10 scored, 0 failed, 0 already in" in done.stderr
    assert re.search(r"questions/s\) on 1 Ray node \([\d.]+: 10\)", done.stderr), done.stderr[-2000:]
    assert_matches(read_out(out), expected(tiny_checkpoint, episodes))
