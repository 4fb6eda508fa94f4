import subprocess
import sys


def run(env_value):
    code = ("import os, sys; from pixeltriage.engine.cpu_memory import tune_malloc; "
            "print(tune_malloc(), tune_malloc())")
    env = {"PIXELTRIAGE_MALLOC_TUNING": env_value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_applied_once_on_linux_glibc_and_opt_out():
    on = run("1")
    assert on[0] == on[1]                      # idempotent
    if sys.platform.startswith("linux"):
        assert on == ["True", "True"]
    assert run("0") == ["False", "False"]
