"""What the command-line tests share: an environment that runs this checkout's package, a CLI runner and a
two-photo episode file."""
import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                    os.environ.get("PYTHONPATH", "")])}


def write_episode(tmp_path):
    (tmp_path / "photos").mkdir(exist_ok=True)
    Image.new("RGB", (640, 480), (200, 40, 40)).save(tmp_path / "photos" / "mug.png")
    Image.new("RGB", (300, 500), (40, 200, 40)).save(tmp_path / "photos" / "bike.jpg")
    episode = {"question": "What colour was the mug?", "memories": [
        {"image": "photos/mug.png", "note": "a mug", "dialogue": "new mug", "date": "2026-01-02"},
        {"image": "photos/bike.jpg", "note": "a bike"},
    ]}
    path = tmp_path / "episode.json"
    path.write_text(json.dumps(episode))
    return path


def run_cli(*argv, stdin=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "pixeltriage", *argv], capture_output=True, text=True,
                          input=stdin, env=ENV, timeout=timeout)
