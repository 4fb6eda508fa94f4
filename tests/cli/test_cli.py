"""The command line as a user meets it: the main job (score, demo), fast help and usage errors, one-line errors
with exit 2 for every bad argument, input or file, exit 130 on interrupt, memories numbered from 1."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_inputs import ENV, run_cli, used_cache, write_episode
from PIL import Image

from pixeltriage import Cache
from pixeltriage.cli import COMMANDS, main

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)


def assert_one_line_error(err: str, *needles: str):
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(("error:", "pixeltriage")), err
    assert all(n in err for n in needles), err


# -- the main job ------------------------------------------------------------------------------------------------

def test_score_json(tiny_checkpoint, tmp_path, capsys):
    episode = write_episode(tmp_path)
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode), "--k", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["open"] for m in report["memories"]].count(True) == 1
    assert 0 <= report["p_vis"] <= 1
    assert [m["index"] for m in report["memories"]] == [1, 2]
    assert report["memories"][0]["image"] == str(tmp_path / "photos" / "mug.png")     # each memory's image
    vt = report["visual_tokens"]
    assert vt["open_all"] > vt["delivery"] > 0


def test_score_reorders_the_weights_only_for_episodes_enough_to_pay_for_it(tiny_checkpoint, tmp_path, capsys,
                                                                          monkeypatch):
    from pixeltriage.cli.score import REORDER_FROM
    from pixeltriage.engine.scorer import Scorer

    asked, load = [], Scorer.load.__func__
    monkeypatch.setattr(Scorer, "load", classmethod(lambda cls, *a, **kw: asked.append(kw["reorder_weights"])
                                                    or load(cls, *a, **kw)))
    one = json.loads(write_episode(tmp_path).read_text())
    for count in (1, REORDER_FROM - 1, REORDER_FROM):
        path = tmp_path / f"episodes{count}.json"
        path.write_text(json.dumps([one] * count))
        assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(path), "--json"]) == 0
    assert asked == [False, False, True]
    capsys.readouterr()


def test_score_table_and_bad_episode(tiny_checkpoint, tmp_path, capsys):
    episode = write_episode(tmp_path)
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode)]) == 0
    out = capsys.readouterr().out
    assert "p_vis" in out and "pixels" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"question": "q", "memories": [{"image": "photos/mug.png"},
                                                             {"image": "photos/missing.png"}]}))
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "memory 2: image file" in err and "missing.png not found" in err          # numbered from 1


def test_an_error_in_a_file_of_several_episodes_names_the_episode(tiny_checkpoint, tmp_path, capsys):
    write_episode(tmp_path)
    Image.new("RGB", (1000, 1)).save(tmp_path / "photos" / "line.png")                # scores nowhere: 1000:1
    good = {"question": "q", "memories": [{"image": "photos/mug.png"}]}
    bad = {"question": "q", "memories": [{"image": "photos/mug.png"}, {"image": "photos/line.png"}]}
    path = tmp_path / "many.json"
    path.write_text(json.dumps([good, bad]))
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1                                          # the first one scored
    assert f"{path}, episode 2 of 2: memory 2:" in err and "aspect ratio" in err
    path.write_text(json.dumps([good, {"question": 3}]))                               # shape errors: before loading
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(path)]) == 2
    assert f"{path}, episode 2 of 2: expected an object" in capsys.readouterr().err


def test_cached_notes_and_keys_are_shown(tiny_checkpoint, tmp_path, capsys):
    write_episode(tmp_path)
    db = tmp_path / "cache.db"
    with Cache(db) as cache:
        key = cache.put(tmp_path / "photos" / "mug.png", note="a red mug on a desk")
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"question": "q", "memories": [{"key": key, "date": "2026-01-02"}]}))
    args = ["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(path), "--cache", str(db)]
    assert main([*args, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memories"][0]
    assert memory["key"] == key and memory["note"] == "a red mug on a desk" and "image" not in memory
    assert main(args) == 0
    assert "a red mug on a desk" in capsys.readouterr().out


def test_a_key_memory_without_a_cache_is_a_usage_error(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"question": "q", "memories": [{"key": "ab" * 32}]}))
    monkeypatch.setattr("pixeltriage.engine.scorer.Scorer.load", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(path)]) == 2
    assert "memory 1 is given by cache key; pass the cache that holds it with --cache DB" in capsys.readouterr().err


def test_episode_from_stdin_with_options_after_the_subcommand(tiny_checkpoint, tmp_path):
    write_episode(tmp_path)
    episode = json.dumps({"question": "q", "memories": [{"image": str(tmp_path / "photos" / "mug.png")}]})
    out = run_cli("score", "--checkpoint", str(tiny_checkpoint), "--episode", "-", "--json", "--device", "cpu",
                  "-vv", stdin=episode)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["memories"][0]["index"] == 1
    assert "DEBUG" in out.stderr or "INFO" in out.stderr                               # -vv after the subcommand


def test_module_and_demo(tmp_path):
    # a cache with the C library built (tests/kernels/test_native.py builds it on first use), without the demo
    # checkpoint: the demo writes it, as on a user's first run
    out = subprocess.run([sys.executable, "-m", "pixeltriage", "demo", "--device", "cpu"], capture_output=True,
                         text=True, env={**ENV, "PIXELTRIAGE_CACHE": str(used_cache(tmp_path))}, timeout=900)
    assert out.returncode == 0, out.stderr
    assert "p_vis" in out.stdout and "k=1 opens memories" in out.stdout and "meaningless" in out.stdout
    # how to run it again: the interpreter as the shell reaches it from here (a relative path inside this directory,
    # as make's .venv/bin/python, else the absolute one)
    relative = os.path.relpath(sys.executable)
    python = sys.executable if relative.startswith("..") else relative
    assert f"{python} -m pixeltriage score --checkpoint DIR" in out.stdout


def test_the_demo_names_the_command_the_shell_can_run(tmp_path, monkeypatch):
    """After `make demo` the command is .venv/bin/pixeltriage, not on PATH: the demo's hint says that path."""
    from pixeltriage.cli.score import command_line

    command = tmp_path / "venv" / "bin" / "pixeltriage"
    command.parent.mkdir(parents=True)
    command.write_text("#!/bin/sh\n")
    command.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(command), "demo"])
    monkeypatch.setenv("PATH", str(tmp_path))
    assert command_line() == str(command)
    monkeypatch.setenv("PATH", str(command.parent))
    assert command_line() == "pixeltriage"
    monkeypatch.setattr(sys, "argv", ["/somewhere/pixeltriage/__main__.py", "demo"])
    assert command_line().endswith(" -m pixeltriage")


# -- help and usage errors: no torch, no model ------------------------------------------------------------------

HELP_PROBE = """
import contextlib, io, sys
from pixeltriage.cli import build_parser
commands = {commands!r}
for argv in commands:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            build_parser().parse_args(argv + ["--help"])
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    assert "usage:" in out.getvalue(), argv
heavy = sorted(m for m in ("torch", "transformers", "numpy", "PIL", "fastapi", "ray") if m in sys.modules)
print(heavy)
"""


def every_command() -> list[list[str]]:
    from pixeltriage.cli import build_parser

    found = [[]]

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found.append(prefix + [name])
                    walk(sub, prefix + [name])
    walk(build_parser(), [])
    return found


def test_help_of_every_command_imports_nothing_heavy():
    commands = every_command()
    assert {c[0] for c in commands if c} == set(COMMANDS) and ["bench", "cpu"] in commands
    out = subprocess.run([sys.executable, "-c", HELP_PROBE.format(commands=commands)], capture_output=True,
                         text=True, env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"                  # what makes --help answer at once: nothing heavy imported


@pytest.mark.parametrize("argv, needle", [
    (["score", "--checkpoint", "{ckpt}", "--episode", "{episode}", "--k", "-1"], "--k: must be at least 0"),
    (["score", "--checkpoint", "{ckpt}", "--episode", "{episode}", "--gate-rate", "1.5"], "--gate-rate: must be in"),
    (["score", "--checkpoint", "{ckpt}", "--episode", "{episode}", "--cache", "{file}/c.db"], "is not a directory"),
    (["score", "--checkpoint", "{tmp}/none", "--episode", "{episode}"], "none: no such file or directory"),
    (["score", "--checkpoint", "{ckpt}", "--episode", "{tmp}"], "(it is a directory)"),
    (["score", "--checkpoint", "{ckpt}", "--episode", "{episode}", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["demo", "--preset", "huge"], "invalid choice: 'huge'"),
    (["pack", "{ckpt}", "{tmp}"], "is a directory"),
    (["init-demo", "{ckpt}"], "is not an empty directory"),
    (["cache", "stats", "{tmp}/none.db"], "no such file"),
    (["bench", "cpu", "--repeats", "0"], "--repeats: must be at least 1"),
    (["scroe"], "invalid choice: 'scroe'"),
    (["score", "--checkpoint", "{ckpt}", "--episode", "{episode}", "--bogus"],
     "pixeltriage score: error: unrecognized arguments: --bogus (see 'pixeltriage score --help')"),
    (["cache", "put", "{tmp}/c.db", "{episode}", "--zz"], "pixeltriage cache put: error: unrecognized arguments"),
    (["bench", "cpu", "--zz"], "pixeltriage bench cpu: error: unrecognized arguments: --zz"),
    (["score", "--checkpoint", "{ckpt}", "--episode", "{episode}", "--cache", "{tmp}/typo/c.db"],
     "no such directory"),
    (["pack", "{ckpt}", "{tmp}/typo/packed.safetensors"], "no such directory"),
])
def test_usage_errors_are_one_line_and_load_nothing(argv, needle, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    episode = write_episode(tmp_path)
    values = {"ckpt": tiny_checkpoint, "episode": episode, "file": tmp_path / "file", "tmp": tmp_path}
    monkeypatch.setattr("pixeltriage.engine.scorer.Scorer.load", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exit_:
        main([a.format(**values) for a in argv])
    assert exit_.value.code == 2
    assert_one_line_error(capsys.readouterr().err, needle)
    assert not (tmp_path / "typo").exists()              # a misspelt folder is refused, not created


@pytest.mark.parametrize("content, needle", [
    ("[]", "an empty list holds no episode"),
    ('{"question": "q"}', "no 'memories'"),
    ('{"question": "q", "memory": []}', "unknown fields ['memory']"),
    ('[{"question": "q", "memories": []}, {"question": "r", "memorys": []}]', "episode 2 of 2 has unknown fields"),
])
def test_episode_shape_errors_come_before_loading(content, needle, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    path = tmp_path / "episode.json"
    path.write_text(content)
    monkeypatch.setattr("pixeltriage.engine.scorer.Scorer.load", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(path)]) == 2
    assert_one_line_error(capsys.readouterr().err, str(path), needle)


def test_what_is_not_a_checkpoint_is_named_as_such(tmp_path, capsys):
    episode = write_episode(tmp_path)
    assert main(["score", "--checkpoint", str(episode), "--episode", str(episode)]) == 2
    assert_one_line_error(capsys.readouterr().err, "not a safetensors file", "written by `pixeltriage pack`")
    assert main(["score", "--checkpoint", str(tmp_path), "--episode", str(episode)]) == 2
    assert_one_line_error(capsys.readouterr().err, "not a checkpoint directory (no config.json)")


def test_an_error_while_scoring_names_the_episode_file(tiny_checkpoint, tmp_path, capsys):
    episode = write_episode(tmp_path)
    (tmp_path / "photos" / "mug.png").write_bytes(b"not an image")
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode)]) == 2
    assert_one_line_error(capsys.readouterr().err, f"{episode}: memory 1:")


def test_a_missing_extra_is_named_with_its_install_command(tiny_checkpoint, tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "prometheus_client.py").write_text(
        'raise ModuleNotFoundError("No module named \'prometheus_client\'", name="prometheus_client")\n')
    out = subprocess.run([sys.executable, "-m", "pixeltriage", "serve", "--checkpoint", str(tiny_checkpoint),
                          "--port", "0"], capture_output=True, text=True, timeout=120,
                         env={**ENV, "PYTHONPATH": os.pathsep.join([str(hide), ENV["PYTHONPATH"]])})
    assert out.returncode == 2
    assert_one_line_error(out.stderr, "'pixeltriage serve' needs the serve extra", "pip install 'pixeltriage[serve]'")


def test_input_and_file_problems_are_one_line(tiny_checkpoint, tmp_path):
    out = run_cli("score", "--checkpoint", str(tiny_checkpoint), "--episode", "-", stdin="{not json")
    assert out.returncode == 2
    assert_one_line_error(out.stderr, "standard input: not valid JSON")
    out = run_cli("score", "--checkpoint", str(tiny_checkpoint), "--episode", str(write_episode(tmp_path)),
                  "--device", "cuda")
    assert out.returncode == 2
    assert_one_line_error(out.stderr, "CUDA is not available")
    # a directory nobody can create, root included (CI runs as root): procfs takes no new entries
    out = run_cli("init-demo", "/proc/pixeltriage-ckpt")
    assert out.returncode == 2
    assert_one_line_error(out.stderr, "error: /proc/")
    if os.geteuid() != 0:                  # root writes past permission bits: the /proc case above stands for it
        readonly = tmp_path / "ro"
        readonly.mkdir()
        readonly.chmod(0o500)
        out = run_cli("init-demo", str(readonly / "ckpt"))
        assert out.returncode == 2
        assert_one_line_error(out.stderr, "Permission denied")


def test_interrupt_exits_130_without_a_traceback(tmp_path):
    # a terminal's Ctrl-C: SIGINT at its default disposition in the child, whatever pytest inherited (a background
    # job of a non-interactive shell, as some CI runners start it, ignores SIGINT, and exec keeps that)
    proc = subprocess.Popen([sys.executable, "-m", "pixeltriage", "demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**ENV, "PIXELTRIAGE_CACHE": str(tmp_path)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    maps = Path(f"/proc/{proc.pid}/maps")
    while "libtorch" not in (maps.read_text() if maps.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.02)                   # interrupt while torch is being imported: the first seconds
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err


def test_choice_lists_agree_with_the_library():
    from pixeltriage.bench.models.prefill_cost import SCENARIOS
    from pixeltriage.bench.models.flops import ANSWERING_SHAPES, SYSTEM_ONE_CONFIGS
    from pixeltriage.bench.latency import ANSWERING_SCALES
    from pixeltriage.cli import bench, common
    from pixeltriage.weights.demo import PRESETS
    from pixeltriage.weights.layout import DTYPES

    assert sorted(common.DTYPE_NAMES) == sorted(DTYPES)
    assert sorted(common.DEMO_PRESETS) == sorted(PRESETS)
    assert list(bench.SCENARIOS) == list(SCENARIOS)
    assert list(bench.ANSWERING_CHECKPOINTS) == list(ANSWERING_SHAPES)
    assert list(bench.SYSTEM_ONE_CONFIGS) == list(SYSTEM_ONE_CONFIGS)
    assert sorted(bench.ANSWERING_SCALES) == sorted(ANSWERING_SCALES)


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("pixeltriage ")


def test_the_command_line_tunes_malloc(tiny_checkpoint, monkeypatch, tmp_path):
    from pixeltriage.cli import main
    from pixeltriage.engine import cpu_memory

    calls = []
    monkeypatch.setattr(cpu_memory, "tune_malloc", lambda: calls.append(1) or True)
    monkeypatch.setenv("PIXELTRIAGE_CACHE", str(tmp_path))
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(write_episode(tmp_path)),
                 "--json"]) == 0
    assert calls == [1]


def test_score_prices_images_for_the_answering_model_asked(tiny_checkpoint, tmp_path, capsys):
    from pixeltriage.delivery.cost import visual_tokens

    episode = write_episode(tmp_path)
    sizes = [(640, 480), (300, 500)]
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode), "--json",
                 "--answering-model", "internvl3"]) == 0
    tokens = json.loads(capsys.readouterr().out)["visual_tokens"]
    assert tokens["model"] == "internvl3"
    assert tokens["open_all"] == sum(visual_tokens(s, "internvl3") for s in sizes)
    processor = tmp_path / "gemma"
    processor.mkdir()
    (processor / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Gemma3ImageProcessor"}))
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode), "--json",
                 "--answering-model", str(processor)]) == 0
    assert json.loads(capsys.readouterr().out)["visual_tokens"]["open_all"] == 2 * 258


def test_score_by_hub_id_from_the_local_hub_cache(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from integrations.integration_inputs import guard_network, hub_cache

    hub_cache(tmp_path / "hub", "acme/system-one", tiny_checkpoint, refs=("main", "v1"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    connections = guard_network(monkeypatch)
    episode = write_episode(tmp_path)
    assert main(["score", "--checkpoint", str(tiny_checkpoint), "--episode", str(episode), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert main(["score", "--checkpoint", "acme/system-one", "--revision", "v1", "--episode", str(episode),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memories"] == expected["memories"]
    assert main(["score", "--checkpoint", "acme/absent", "--episode", str(episode)]) == 2
    assert "--allow-download" in capsys.readouterr().err
    assert connections == []


def test_pack_takes_a_hub_id_from_the_local_hub_cache(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from integrations.integration_inputs import guard_network, hub_cache

    hub_cache(tmp_path / "hub", "acme/system-one", tiny_checkpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    connections = guard_network(monkeypatch)
    assert main(["pack", "acme/system-one", str(tmp_path / "from-hub.safetensors"), "--quiet"]) == 0
    assert main(["pack", str(tiny_checkpoint), str(tmp_path / "from-dir.safetensors"), "--quiet"]) == 0
    capsys.readouterr()
    from pixeltriage.weights.packed import PackedCheckpoint

    assert PackedCheckpoint(tmp_path / "from-hub.safetensors").fingerprint == \
        PackedCheckpoint(tmp_path / "from-dir.safetensors").fingerprint
    assert connections == []
