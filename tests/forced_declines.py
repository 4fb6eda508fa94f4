"""Every test that claims a C entry point fails when that entry point declines: the check, repeatable.

    python tests/forced_declines.py                   # every entry point a registered kernel calls
    python tests/forced_declines.py pt_add_norm ...   # these only
    python tests/forced_declines.py --baseline        # first, the claiming tests with nothing forced (all pass)

For each entry point, runs the tests that claim a kernel calling it (`@claims`, tests/kernel_claims.py; collected from
tests/kernels and tests/engine) in a pytest process of their own with PIXELTRIAGE_TEST_DECLINE naming it, so that
`kernels.native.call` declines every call of it; prints per entry point how many claiming tests passed, failed and
were skipped. Exit status 1 when any claiming test passed with its entry point forced to decline (or, with
--baseline, failed without), or when an entry point has no claiming test. The same module is the pytest plugin
those processes load (`-p forced_declines`: `--claiming ENTRY` keeps the tests claiming ENTRY, `--outcomes FILE`
writes each test's outcome).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_DIRS = ("tests/kernels", "tests/engine")


# ---- the pytest plugin ------------------------------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--claiming", action="append", default=[], help="keep only the tests claiming a kernel that "
                     "calls this C entry point (repeatable)")
    parser.addoption("--outcomes", default=None, help="write {test id: outcome} here as JSON")


def _entries(item) -> set[str]:
    return {kernel.entry for marker in item.iter_markers("claims") for kernel in marker.args if kernel.entry}


def pytest_collection_modifyitems(config, items):
    wanted = set(config.getoption("claiming"))
    if not wanted:
        return
    keep = [item for item in items if _entries(item) & wanted]
    config.hook.pytest_deselected(items=[item for item in items if not _entries(item) & wanted])
    items[:] = keep


_OUTCOMES: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":        # a setup skip or error is the test's outcome
        _OUTCOMES.setdefault(report.nodeid, report.outcome)
        if report.when == "call":
            _OUTCOMES[report.nodeid] = report.outcome


def pytest_sessionfinish(session):
    path = session.config.getoption("outcomes")
    if path:
        Path(path).write_text(json.dumps(_OUTCOMES, indent=1))


# ---- the check --------------------------------------------------------------------------------------------------

def entry_points() -> list[str]:
    """The C entry points the registered kernels call, sorted."""
    sys.path.insert(0, str(ROOT))
    from pixeltriage.kernels import registry

    return sorted({kernel.entry for op in registry.ops().values() for kernel in op.kernels if kernel.entry})


def run(entry: str, forced: bool) -> dict[str, str]:
    """{test id: outcome} of the tests claiming `entry`, with it forced to decline (forced) or not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("PIXELTRIAGE_TEST_DECLINE", None)
    if forced:
        env["PIXELTRIAGE_TEST_DECLINE"] = entry
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "forced_declines",
               "--claiming", entry, "--outcomes", str(out), *TEST_DIRS]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"pytest for {entry} wrote no outcomes (exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entries", nargs="*", help="C entry points (default: every one a registered kernel calls)")
    parser.add_argument("--baseline", action="store_true", help="also run the claiming tests with nothing forced")
    args = parser.parse_args(argv)
    entries = args.entries or entry_points()
    bad = False
    print(f"{'entry point':<28} {'claiming':>8} {'passed':>7} {'failed':>7} {'skipped':>8}"
          + ("  baseline passed/failed/skipped" if args.baseline else ""))
    for entry in entries:
        outcomes = run(entry, forced=True)
        counts = {o: sum(v == o for v in outcomes.values()) for o in ("passed", "failed", "skipped")}
        line = (f"{entry:<28} {len(outcomes):>8} {counts['passed']:>7} {counts['failed']:>7} "
                f"{counts['skipped']:>8}")
        bad |= counts["passed"] > 0 or not outcomes
        if args.baseline:
            base = run(entry, forced=False)
            base_counts = [sum(v == o for v in base.values()) for o in ("passed", "failed", "skipped")]
            line += "  " + "/".join(map(str, base_counts))
            bad |= base_counts[1] > 0
        print(line, flush=True)
        for test, outcome in sorted(outcomes.items()):
            if outcome == "passed":
                print(f"    passed while forced: {test}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
