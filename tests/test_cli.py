"""The main job through the CLI: score an episode file, and the demo."""
import json
import os
import subprocess
import sys

from PIL import Image

from pixeltriage.cli import main


def write_episode(tmp_path):
    (tmp_path / "photos").mkdir()
    Image.new("RGB", (640, 480), (200, 40, 40)).save(tmp_path / "photos" / "mug.png")
    Image.new("RGB", (300, 500), (40, 200, 40)).save(tmp_path / "photos" / "bike.jpg")
    episode = {"question": "What colour was the mug?", "memories": [
        {"image": "photos/mug.png", "note": "a mug", "dialogue": "new mug", "date": "2026-01-02"},
        {"image": "photos/bike.jpg", "note": "a bike"},
    ]}
    path = tmp_path / "episode.json"
    path.write_text(json.dumps(episode))
    return path


def test_score_json(tiny_checkpoint, tmp_path, capsys):
    episode = write_episode(tmp_path)
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode), "--k", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["open"] for m in report["memories"]].count(True) == 1
    assert 0 <= report["p_vis"] <= 1
    vt = report["visual_tokens"]
    assert vt["open_all"] > vt["delivery"] > 0


def test_score_table_and_bad_episode(tiny_checkpoint, tmp_path, capsys):
    episode = write_episode(tmp_path)
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode)]) == 0
    out = capsys.readouterr().out
    assert "p_vis" in out and "pixels" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"question": "q", "memories": [{"image": "photos/missing.png"}]}))
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(bad)]) == 2
    assert "memory 0" in capsys.readouterr().err


def test_module_and_demo(tmp_path):
    env = {**os.environ, "PIXELTRIAGE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "pixeltriage", "demo"], capture_output=True, text=True, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stderr
    assert "p_vis" in out.stdout and "k=1 opens memories" in out.stdout and "meaningless" in out.stdout


def test_an_episode_path_that_is_a_directory_is_a_clear_error(tiny_checkpoint, tmp_path, capsys):
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(tmp_path)]) == 2
    assert f"{tmp_path}: cannot read" in capsys.readouterr().err
