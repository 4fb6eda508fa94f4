"""examples/: the committed episode loads and stays small; examples/host.py runs as README shows it, and
examples/frameworks.py gives the library's gains and decisions through LlamaIndex, LangChain and mem0."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_inputs import used_cache

from pixeltriage.episode import load_episodes

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def test_the_example_episode_loads_and_its_images_are_kilobytes():
    (question, memories), = load_episodes(EXAMPLES / "episode.json")
    assert question and len(memories) == 4
    for memory in memories:
        assert Path(memory.image).stat().st_size < 32 * 1024


def test_host_example_scores_and_builds_a_pixel_prompt(tiny_checkpoint, tmp_path):
    env = {**os.environ, "PIXELTRIAGE_CACHE": str(used_cache(tmp_path, tiny_checkpoint)),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(EXAMPLES / "host.py"), "--k", "2"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    first, second, rest = out.stdout.split("\n", 2)
    assert first.startswith("p_vis ") and second.startswith("open as pixels: [")
    messages = json.loads(rest)
    images = [part for part in messages[-1]["content"] if part["type"] == "image"]
    assert len(images) == 2 and all(Path(part["image"]).is_file() for part in images)


def test_host_example_reports_bad_input_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for argv, needle in ([["--k", "-1"], "--k must be >= 0"], [["--checkpoint", str(tmp_path / "none")],
                                                                "checkpoint not found"]):
        out = subprocess.run([sys.executable, str(EXAMPLES / "host.py"), *argv], capture_output=True, text=True,
                             env=env, timeout=300)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_frameworks_example_runs_both_pipelines_with_the_librarys_gains(tiny_checkpoint, tmp_path, monkeypatch):
    import pytest

    pytest.importorskip("llama_index.core", reason="llama-index-core (the integrations extra) is not installed")
    pytest.importorskip("langchain_core", reason="langchain-core (the integrations extra) is not installed")
    pytest.importorskip("mem0", reason="mem0ai (the integrations extra) is not installed")
    from pixeltriage import Scorer, top_k
    from pixeltriage.weights.demo import demo_checkpoint

    env = {**os.environ, "PIXELTRIAGE_CACHE": str(used_cache(tmp_path, tiny_checkpoint)),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(EXAMPLES / "frameworks.py"), "--k", "2"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("LlamaIndex") and lines[5].startswith("LangChain") and lines[10].startswith("mem0")
    (question, memories), = load_episodes(EXAMPLES / "episode.json")
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path))      # the demo checkpoint the example scored with
    scores = Scorer.load(demo_checkpoint("tiny")).score(question, memories)
    order = sorted(range(len(memories)), key=lambda i: -scores.gains[i])
    opened = top_k(scores, 2)
    expected = [f"  {memories[i].note!r:40} {scores.gains[i]:.3f}  {'pixels' if opened[i] else 'text'}" for i in order]
    assert lines[1:5] == expected and lines[6:10] == expected and lines[11:15] == expected
