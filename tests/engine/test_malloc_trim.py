"""`trim_malloc` gives freed memory back under the engine's malloc settings (the server calls it when idle:
tests/serve/test_idle_trim.py)."""
import subprocess
import sys

import pytest

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's, on Linux")

FREED_THEN_TRIMMED = """
import re
from pixeltriage.engine.cpu_memory import trim_malloc, tune_malloc

def rss_mib():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\\s+(\\d+)", f.read()).group(1)) / 1024

tuned = tune_malloc()
base = rss_mib()
blocks = [b"x" * 2 ** 20 for _ in range(300)]       # 300 MiB written, from malloc's heap (no mmap once tuned)
held = rss_mib()
del blocks
freed = rss_mib()
trimmed = trim_malloc()
print(tuned, trimmed, round(base), round(held), round(freed), round(rss_mib()))
"""


def run(code: str, **env) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@linux
def test_freed_memory_stays_under_the_tuning_until_trimmed():
    """Under `tune_malloc` (no mmap, a 1 GiB trim threshold) 300 MiB freed stay in RSS; `trim_malloc` gives them
    back. Turned off (PIXELTRIAGE_MALLOC_TRIM=0) it does nothing and says so."""
    tuned, trimmed, base, held, freed, after = run(FREED_THEN_TRIMMED)
    assert (tuned, trimmed) == ("True", "True")
    base, held, freed, after = map(int, (base, held, freed, after))
    assert held - base >= 290 and freed - base >= 290           # freed, still held by malloc
    assert after - base <= 30                                   # given back
    tuned, trimmed, base, held, freed, after = run(FREED_THEN_TRIMMED, PIXELTRIAGE_MALLOC_TRIM="0")
    assert trimmed == "False" and int(after) - int(base) >= 290
