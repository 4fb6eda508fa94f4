"""What the command-line tests share: an environment that runs this checkout's package, a CLI runner, a two-photo
episode file and a cache as a user's is after a first run."""
import json
import os
import shutil
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


def used_cache(path: Path, demo_checkpoint: Path | None = None, emulated: bool = False) -> Path:
    """A cache directory (PIXELTRIAGE_CACHE) for a process a test starts, holding what a user's holds after a first
    run: this process's first-use builds of the C library (with `emulated`, the emulated build's too), under the
    names the other process looks up (it loads them instead of compiling them again), and, given `demo_checkpoint`
    (the tiny preset at seed 0, as `weights.demo.demo_checkpoint("tiny")` writes it), that checkpoint under its cache
    name. The first-use build and the demo checkpoint's first write have tests of their own
    (tests/kernels/test_native.py, tests/weights/test_demo_checkpoint.py)."""
    from pixeltriage.kernels import native

    for isa in (False, True) if emulated else (False,):
        with native.emulated_isa(isa):
            native.available()                         # built here on first use where nothing is prebuilt
    (path / "native").mkdir(parents=True, exist_ok=True)
    for library in native._build_dir().glob("pixeltriage_*.so"):
        shutil.copy2(library, path / "native" / library.name)
    if demo_checkpoint is not None:
        shutil.copytree(demo_checkpoint, path / "demo-tiny-seed0")
    return path
