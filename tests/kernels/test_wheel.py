"""The package as a user installs it: a wheel built from this checkout (setup.py compiles the C kernels into it),
installed into a fresh virtual environment beside torch from pip, and run with no C compiler on PATH. It loads the
prebuilt build this CPU runs, its C kernels run (not torch's), and it scores the tiny checkpoint as this checkout's
own build does, to the bit, in float32 and bf16. Slow: the wheel's build compiles every variant (minutes)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pixeltriage.kernels import native

ROOT = Path(__file__).parents[2]
# Scores the checkpoint argv[1] in both dtypes inside a kernel record (kernels.registry): the C entry points whose
# kernels ran, and every decline, as JSON on stdout
SCRIPT = r"""
import json, shutil, sys
import torch
from pixeltriage import Scorer
from pixeltriage.episode import sample_episode
from pixeltriage.kernels import native, registry

torch.set_num_threads(2)
scores = {}
with registry.recording() as record:
    for dtype in ("float32", "bfloat16"):
        s = Scorer.load(sys.argv[1], dtype=getattr(torch, dtype)).score(*sample_episode())
        scores[dtype] = [v.hex() for v in (s.p_vis, *s.gains, *s.relevance, s.relevance_none)]
counts = record.snapshot()
entries = {(op.name, k.name): k.entry for op in registry.ops().values() for k in op.kernels if k.entry}
ran = sorted({entries[key] for key in counts.calls if key in entries})
declines = sorted(" / ".join(key) for key in counts.declines)
print(json.dumps({"scores": scores, "ran": ran, "declines": declines, "status": native.status(),
                  "variant": native.variant(), "package": native.__file__,
                  "compilers": [shutil.which(c) for c in ("cc", "gcc", "clang")]}))
"""
# what runs in a float32 forward on every CPU with the library (bf16's engines and AVX-512 passes depend on the CPU)
EVERYWHERE = {"pt_add_norm", "pt_delta_chunked", "pt_gelu_tanh", "pt_rms_norm_gated", "pt_rotary", "pt_silu_mul"}


def _run(cmd: list[str], **kw) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, **kw)
    assert r.returncode == 0, f"$ {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r.stdout


def _score(python: str, checkpoint: Path, env: dict, cwd: Path) -> dict:
    return json.loads(_run([python, "-c", SCRIPT, str(checkpoint)], env=env, cwd=cwd).strip().splitlines()[-1])


@pytest.mark.slow
def test_a_wheel_runs_its_prebuilt_kernels_with_no_compiler(tiny_checkpoint, tmp_path):
    if sys.platform != "linux" or native._compiler() is None:
        pytest.skip("the wheel's C kernels build on Linux with a C compiler")
    if not native.available():
        pytest.skip(f"no native build here to compare with: {native.status()}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CC", native.ISA_SWITCH)}
    # both follow the choices measured once (the first run measures, running the kernels it times)
    env["PIXELTRIAGE_TUNING"] = str(tmp_path / "tuning.json")
    source = {**env, "PYTHONPATH": str(ROOT)}
    _score(sys.executable, tiny_checkpoint, source, tmp_path)
    here = _score(sys.executable, tiny_checkpoint, source, tmp_path)

    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path / "dist")], env=env)
    wheel = next((tmp_path / "dist").glob("pixeltriage-*.whl"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, f"torch=={torch.__version__.split('+')[0]}"], env=env)
    _run([*pip, str(wheel)], env=env)
    empty = tmp_path / "no-compilers"
    empty.mkdir()
    bare = {**env, "PATH": f"{venv / 'bin'}:{empty}", "PIXELTRIAGE_CACHE": str(tmp_path / "cache")}
    installed = _score(str(venv / "bin" / "python"), tiny_checkpoint, bare, tmp_path)

    assert installed["compilers"] == [None, None, None]
    assert Path(installed["package"]).is_relative_to(venv)
    assert installed["variant"] == here["variant"] is not None
    assert installed["status"].startswith(f"loaded {here['variant']} (prebuilt): {venv}")
    assert not (tmp_path / "cache" / "native").exists()                  # nothing built on first use
    assert EVERYWHERE <= set(installed["ran"]) and installed["ran"] == here["ran"]
    assert installed["declines"] == here["declines"]
    assert installed["scores"] == here["scores"]
    shutil.rmtree(venv)
