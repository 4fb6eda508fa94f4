"""`pixeltriage retrieve`, `cache put --index-encoder` and `init-encoder-demo` as a user meets them."""
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from pixeltriage.cli import main
from pixeltriage.cli import retrieve as retrieve_cli
from pixeltriage.store.cache import Cache


def write_images(directory, count=3):
    directory.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = directory / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (40 + 10 * i, 60, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines and lines[-1].startswith(("error:", "pixeltriage")), err
    assert all(n in err for n in needles), err


def test_index_then_retrieve(tiny_encoder_dir, tmp_path, capsys):
    paths = write_images(tmp_path / "photos")
    notes = tmp_path / "notes.json"
    notes.write_text(json.dumps({"img1.png": "a receipt on the table"}))
    db = tmp_path / "cache.db"
    assert main(["cache", "put", str(db), *paths, "--notes", str(notes), "--index-encoder", str(tiny_encoder_dir)]) == 0
    printed = [line.split("\t") for line in capsys.readouterr().out.strip().splitlines()]
    assert [path for _, path in printed] == paths
    keys = [key for key, _ in printed]
    with Cache(db) as cache:
        assert cache.note(keys[1]) == "a receipt on the table"
    assert main(["cache", "stats", str(db)]) == 0                     # the cache's counts and the region rows'
    stats = json.loads(capsys.readouterr().out)
    assert stats["images"] == 3 and stats["region_rows"] == 3 and stats["region_bytes"] == 3 * 5 * 32 * 4

    args = ["retrieve", "--cache", str(db), "--encoder", str(tiny_encoder_dir), "--question", "the receipt"]
    assert main([*args, "--json", "--top", "2"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    result = json.loads(out)
    assert result["question"] == "the receipt" and result["mode"] == "regions"
    assert [h["rank"] for h in result["hits"]] == [1, 2] and {h["key"] for h in result["hits"]} <= set(keys)
    for hit in result["hits"]:
        assert set(hit) == {"rank", "key", "score", "region", "box", "note"} and len(hit["box"]) == 4
    scores = [h["score"] for h in result["hits"]]
    assert scores == sorted(scores, reverse=True)

    assert main([*args, "--question", "a dog", "--whole-image", "--json", "--index", "exact"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["question"] for r in lines] == ["the receipt", "a dog"]
    assert all(r["mode"] == "whole-image" and len(r["hits"]) == 3 for r in lines)
    assert {h["region"] for r in lines for h in r["hits"]} == {"whole"}

    assert main(args) == 0                                                      # the table
    out = capsys.readouterr().out
    assert "question: the receipt  (regions)" in out and all(key in out for key in keys)
    assert "a receipt on the table" in out


def test_images_without_vectors_are_reported(tiny_encoder_dir, tmp_path, capsys):
    paths = write_images(tmp_path / "photos", 2)
    db = tmp_path / "cache.db"
    assert main(["cache", "put", str(db), paths[0], "--index-encoder", str(tiny_encoder_dir)]) == 0
    assert main(["cache", "put", str(db), paths[1]]) == 0                       # stored, not indexed
    capsys.readouterr()
    args = ["retrieve", "--cache", str(db), "--encoder", str(tiny_encoder_dir), "--question", "q", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["hits"]) == 1
    assert "warning: 1 of 2 cached images have no region vectors" in err and "--index-encoder" in err
    assert main([*args, "--overlap", "0.1"]) == 0                               # vectors are stored per overlap
    out, err = capsys.readouterr()
    assert json.loads(out)["hits"] == [] and "2 of 2" in err and "1 other encoder or overlap setting" in err


def test_init_encoder_demo(tmp_path, capsys):
    assert main(["init-encoder-demo", str(tmp_path / "enc"), "--preset", "tiny-naflex", "--seed", "3"]) == 0
    assert "random weights" in capsys.readouterr().out
    assert json.loads((tmp_path / "enc" / "config.json").read_text())["model_type"] == "siglip2"


def test_choices_agree_with_the_library():
    from pixeltriage.retrieval.demo import PRESETS
    from pixeltriage.retrieval.regions import DEFAULT_OVERLAP
    from pixeltriage.retrieval.search import BACKENDS

    assert retrieve_cli.INDEX_BACKENDS == BACKENDS
    assert retrieve_cli.ENCODER_PRESETS == tuple(sorted(PRESETS))
    assert retrieve_cli.DEFAULT_OVERLAP == DEFAULT_OVERLAP


@pytest.mark.parametrize("argv, needle", [
    (["retrieve", "--cache", "{db}", "--encoder", "{enc}", "--question", "q", "--top", "0"],
     "--top: must be at least 1"),
    (["retrieve", "--cache", "{db}", "--encoder", "{enc}", "--question", "q", "--overlap", "1"], "must be in [0, 1)"),
    (["retrieve", "--cache", "{db}", "--encoder", "{tmp}/none", "--question", "q"], "none: no such directory"),
    (["retrieve", "--cache", "{db}", "--encoder", "{tmp}", "--question", "q"], "no config.json"),
    (["retrieve", "--cache", "{tmp}/none.db", "--encoder", "{enc}", "--question", "q"], "none.db: no such file"),
    (["retrieve", "--cache", "{db}", "--encoder", "{enc}"], "--question"),
    (["retrieve", "--cache", "{db}", "--encoder", "{enc}", "--question", "q", "--index", "annoy"], "invalid choice"),
    (["cache", "put", "{db}", "{db}", "--index-encoder", "{db}"], "(it is a file)"),
    (["init-encoder-demo", "{enc}"], "is not an empty directory"),
    (["init-encoder-demo", "{tmp}/x", "--preset", "huge"], "invalid choice: 'huge'"),
])
def test_usage_errors_are_one_line_and_load_nothing(argv, needle, tiny_encoder_dir, tmp_path, capsys, monkeypatch):
    db = tmp_path / "c.db"
    Cache(db).close()
    values = {"db": db, "enc": tiny_encoder_dir, "tmp": tmp_path}
    monkeypatch.setattr("pixeltriage.retrieval.encoder.SiglipEncoder.load",
                        lambda *a, **k: pytest.fail("loaded an encoder"))
    with pytest.raises(SystemExit) as exit_:
        main([a.format(**values) for a in argv])
    assert exit_.value.code == 2
    one_line_error(capsys.readouterr().err, needle)


def test_input_problems_are_one_line(tiny_encoder_dir, tmp_path, capsys):
    bad = tmp_path / "fake.png"
    bad.write_text("not an image")
    db = tmp_path / "c.db"
    assert main(["cache", "put", str(db), str(bad), "--index-encoder", str(tiny_encoder_dir)]) == 2
    one_line_error(capsys.readouterr().err, "fake.png: image bytes (12 B): not a recognised image")
    assert main(["cache", "put", str(db), str(bad)]) == 2                          # without the index too
    one_line_error(capsys.readouterr().err, "fake.png: image bytes (12 B): not a recognised image")
    broken = shutil.copytree(tiny_encoder_dir, tmp_path / "broken")
    (broken / "config.json").write_text(json.dumps({"model_type": "clip"}))
    assert main(["retrieve", "--cache", str(db), "--encoder", str(broken), "--question", "q"]) == 2
    one_line_error(capsys.readouterr().err, "model_type 'clip' is not a SigLIP 2 checkpoint")
