"""`pixeltriage bench serve` end to end, as small as it goes (2 episodes of 2 memories, 3 requests and 1 s per
phase): the server starts, every phase runs, every response is checked, the server exits 0 on SIGTERM. No figure
is asserted, only that the benchmark measures what it says."""
import json
import subprocess
import sys

from serving import ENV


def test_bench_serve_runs_every_phase_and_checks_every_response():
    out = subprocess.run([sys.executable, "-m", "pixeltriage", "bench", "serve", "--preset", "tiny", "--dtype",
                          "float32", "--episodes", "2", "--memories", "2", "--clients", "2", "--duration", "1",
                          "--requests", "3", "--no-overhead", "--json"],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert [p["phase"].split()[0] for p in report["phases"]] == ["1", "2", "open"]
    for phase in report["phases"]:
        assert 1 <= phase["requests"] <= 3 and phase["lost"] == 0 and phase["mixed_up"] == 0, phase
        assert set(phase["statuses"]) <= {"200", "429"}, phase
    one = report["in_process"]
    low, high = one["paired_difference_median_ci95"]
    assert low <= one["paired_difference"]["p50"] <= high
    assert report["transport"]["loop"] in ("uvloop", "asyncio") and report["server_exit_code"] == 0
