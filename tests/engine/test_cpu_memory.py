import subprocess
import sys


def run(env_value):
    code = ("import os, sys; from pixeltriage.engine.cpu_memory import tune_malloc; "
            "from pixeltriage.kernels import tuning; before = tuning.malloc_condition(); "
            "print(tune_malloc(), tune_malloc(), repr(before), repr(tuning.malloc_condition()))")
    env = {"PIXELTRIAGE_MALLOC_TUNING": env_value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_applied_once_on_linux_glibc_and_opt_out():
    """Applied once (idempotent) where glibc has mallopt, not with PIXELTRIAGE_MALLOC_TUNING=0; the condition the
    row-block records are kept under (`kernels.tuning.malloc_condition`) follows it."""
    on = run("1")
    assert on[0] == on[1]                      # idempotent
    if sys.platform.startswith("linux"):
        assert on[:2] == ["True", "True"]
        assert on[2:] == ["'malloc", "as", "is'", "'malloc", "tuned'"]
    assert run("0") == ["False", "False", "'malloc", "as", "is'", "'malloc", "as", "is'"]


def test_cpu_path_never_imports_gpu_kernels(tiny_checkpoint):
    """Loading and scoring on the CPU imports neither Triton nor fla (nor transformers, which pulls Triton in)."""
    code = ("import sys; from pixeltriage import Scorer; from pixeltriage.episode import sample_episode; "
            f"Scorer.load({str(tiny_checkpoint)!r}).score(*sample_episode()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'fla', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_loading_and_scoring_leave_malloc_alone(tiny_checkpoint):
    """A host that embeds the engine keeps its process-wide malloc settings unless it calls tune_malloc itself."""
    code = ("from pixeltriage import Scorer; from pixeltriage.episode import sample_episode; "
            "from pixeltriage.engine.cpu_memory import tune_malloc; "
            f"Scorer.load({str(tiny_checkpoint)!r}).score(*sample_episode()); "
            "info = tune_malloc.cache_info(); print(info.hits + info.misses)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0"           # never called
