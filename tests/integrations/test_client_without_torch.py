"""pixeltriage-client (client/pyproject.toml, `pip install ./client`) in a fresh venv, installed by pip as a user
installs it, with the three frameworks and without torch: `import torch` fails there, and Client, AsyncClient,
Client.rerank and the three adapters in base_url mode score through a real server (started from the test
environment) what the library's Scorer scores (1e-5), importing none of the engine's modules."""
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from integration_inputs import COLORS, QUESTION, png

from pixeltriage import Memory

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
PIP_S = 600                                  # the install's own bound (the frameworks' dependencies included)


def pip_version() -> tuple[int, ...]:
    return tuple(int(part) for part in importlib.metadata.version("pip").split(".")[:2] if part.isdigit())


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory):
    """A venv with `pip install './client[integrations]'` from a copy of the sources (the build writes beside them)."""
    base = tmp_path_factory.mktemp("client-venv")
    # this interpreter's pip installs into the venv (`pip --python`, pip 22.3 on) where it has one: the venv then
    # needs no pip of its own, whose installation (ensurepip) took a fifth of the fixture's time
    outer_pip = importlib.util.find_spec("pip") is not None and pip_version() >= (22, 3)
    try:
        venv.EnvBuilder(with_pip=not outer_pip).create(base / "venv")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"a venv cannot be created here (python -m venv): {e}")
    source = base / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for part in ("client", "pixeltriage"):
        shutil.copytree(ROOT / part, source / part, ignore=ignore)
    python = base / "venv" / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)] if outer_pip else [str(python), "-m", "pip"]
    install = subprocess.run([*pip, "install", "-q", "--no-compile", "--disable-pip-version-check",
                              "./client[integrations]"], cwd=source, capture_output=True, text=True, timeout=PIP_S)
    assert install.returncode == 0, install.stdout + install.stderr
    return python


def test_the_client_and_the_adapters_score_without_torch(client_venv, server, scorer, tmp_path):
    no_torch = subprocess.run([str(client_venv), "-c", "import torch"], capture_output=True, text=True, cwd=tmp_path)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    paths = []
    for i, color in enumerate(COLORS[:3]):
        paths.append(tmp_path / f"m{i}.png")
        paths[-1].write_bytes(png(color))
    run = subprocess.run([str(client_venv), str(ROOT / "tests" / "integrations" / "torch_free_client.py"),
                          server.url, QUESTION, *map(str, paths)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(run.stdout)
    assert got["torch_found"] is False and got["engine_imported"] == [] and got["hit_type"] == "Hit"
    assert "pixeltriage.Scorer needs torch, which is not installed" in got["scorer_refused"]
    assert "pip install pixeltriage" in got["scorer_refused"]
    want = scorer.score(QUESTION, [Memory(image=p, note=f"note {i}") for i, p in enumerate(paths)]).gains
    order = sorted(range(len(want)), key=lambda i: (-want[i], i))
    for name in ("client", "async_client"):
        assert all(abs(g - w) <= TOL for g, w in zip(got[name], want, strict=True)), name
    rerank = {int(i): v for i, v in got["rerank"].items()}
    assert all(abs(rerank[i][0] - want[i]) <= TOL and rerank[i][1] == "scored" for i in range(len(want)))
    assert rerank[len(want)] == [0.0, "not_a_key_or_memory"]
    for name in ("llamaindex", "langchain", "mem0"):
        ids = [item_id for item_id, _ in got[name]]
        assert ids == [f"m{i}" for i in order] + ["text"], name
        assert all(abs(score - want[order[rank]]) <= TOL for rank, (_, score) in enumerate(got[name][:-1])), name
        assert got[name][-1][1] == 0.0, name
