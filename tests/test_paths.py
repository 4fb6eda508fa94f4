"""The generated-directory writers every demo artifact goes through: all or nothing, one writer at a time."""
import threading

import pytest

from pixeltriage.errors import CheckpointError
from pixeltriage.paths import cached_directory, write_directory


def _write_two(staging):
    (staging / "a").write_text("1")
    (staging / "b").write_text("2")


def test_write_directory_renames_a_finished_directory_into_place(tmp_path):
    out = write_directory(tmp_path / "x" / "ckpt", _write_two)
    assert out == (tmp_path / "x" / "ckpt").absolute()
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert [p.name for p in out.parent.iterdir()] == ["ckpt"]        # no staging left beside it


def test_write_directory_accepts_an_empty_directory_and_refuses_anything_else(tmp_path):
    (tmp_path / "empty").mkdir()
    write_directory(tmp_path / "empty", _write_two)
    with pytest.raises(CheckpointError, match="already exists"):
        write_directory(tmp_path / "empty", _write_two)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        write_directory(tmp_path / "file", _write_two)


def test_a_failed_write_leaves_nothing(tmp_path):
    def fail(staging):
        (staging / "half").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_directory(tmp_path / "ckpt", fail)
    assert list(tmp_path.iterdir()) == []


def test_cached_directory_writes_once_across_threads_and_clears_leftovers(tmp_path, monkeypatch):
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path))
    (tmp_path / ".thing.tmp-killed").mkdir()                          # left by a writer that was killed
    calls, results = [], []

    def write(target):
        calls.append(1)
        return write_directory(target, _write_two)

    threads = [threading.Thread(target=lambda: results.append(cached_directory("thing", write))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and results[0] == tmp_path / "thing"
    assert not (tmp_path / ".thing.tmp-killed").exists()


def test_cached_directory_under_a_root_of_its_own(tmp_path, monkeypatch):
    """With `root`, the directory is made there (the test run's shared checkpoint), not in the cache."""
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path / "cache"))
    made = cached_directory("thing", lambda target: write_directory(target, _write_two), root=tmp_path / "run")
    assert made == tmp_path / "run" / "thing" and made.is_dir() and not (tmp_path / "cache" / "thing").exists()
    assert cached_directory("thing", lambda target: pytest.fail("written twice"), root=tmp_path / "run") == made
