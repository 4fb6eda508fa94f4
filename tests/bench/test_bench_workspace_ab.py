"""`pixeltriage bench workspace`: the forward with and without the Scorer's workspace, alternating in one process,
with malloc left as the process found it (a host's condition) unless --tune-malloc. No timing is asserted."""
import json
import os
import subprocess
import sys

import pytest

from pixeltriage.bench.workspace_ab import print_report, workspace_report
from pixeltriage.cli import main
from pixeltriage.paths import cache_dir


def test_the_report_pairs_the_two_ways_on_one_scorer(capsys):
    r = workspace_report("tiny", "float32", pairs=2, memories=2, tokens=500)
    assert r["pairs"] == 2 and r["memories"] == 2 and 0 < r["tokens"] <= 500
    for way in ("with", "without"):
        assert set(r[way]) == {"ms", "faults", "system_s"} and r[way]["ms"] > 0 and r[way]["faults"] >= 0
    assert r["quartiles"][0] <= r["ratio"] <= r["quartiles"][1]
    assert r["same_scores"] is True and r["workspace_bytes"] > 0      # "without" keeps nothing, "with" its buffers
    assert r["machine"]["workspace"] == "workspace on"
    print_report(r)
    text = capsys.readouterr().out
    assert "with/without" in text and "scores the same bits" in text and "minor faults" in text
    with pytest.raises(ValueError, match="pairs"):
        workspace_report("tiny", "float32", pairs=0)


@pytest.mark.parametrize("flags, malloc", [([], "malloc as is"), (["--tune-malloc"], "malloc tuned")])
def test_the_command_leaves_malloc_as_it_found_it_unless_asked(flags, malloc, tmp_path):
    """Every other bench tunes malloc first (as the engine's processes do); this one measures a host's condition.
    The command runs without the test run's environment (no malloc switch inherited) but with its cache (the built C
    kernels, the demo checkpoint), its kept kernel choices and its thread count, so that it builds and measures
    nothing the run already has."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIXELTRIAGE_CACHE": str(cache_dir()),
           **{k: os.environ[k] for k in ("PIXELTRIAGE_TUNING", "OMP_NUM_THREADS") if k in os.environ}}
    out = subprocess.run([sys.executable, "-m", "pixeltriage", "bench", "workspace", "--preset", "tiny",
                          "--dtype", "float32", "--pairs", "1", "--memories", "1", "--tokens", "300", *flags,
                          "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["machine"]["malloc"] == (malloc if sys.platform.startswith("linux") else "malloc as is")
    assert r["same_scores"] is True


def test_pairs_below_one_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "workspace", "--pairs", "0"])
    assert exit_.value.code == 2 and "--pairs: must be at least 1, got 0" in capsys.readouterr().err
