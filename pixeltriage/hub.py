"""Checkpoints by Hugging Face hub id: `org/name[@revision]` or a local path, resolved the way TEI, vLLM and Infinity
resolve `--model-id`.

    path = resolve_checkpoint("org/name")                       # the cached snapshot; no network
    path = resolve_checkpoint("org/name@v1", allow_download=True)

- A local file or directory of that spelling always wins over a hub id.
- A hub id is looked up in huggingface_hub's standard cache (`HF_HUB_CACHE`, read at each call, else
  huggingface_hub's default). Nothing is downloaded unless the caller passes `allow_download=True`, and never while
  `HF_HUB_OFFLINE=1` is set.
- Safetensors only: a download fetches the safetensors weights and the JSON / tokenizer files and nothing else
  (no `*.bin`, `*.pt`, pickles or code), and a repository without safetensors weights is refused before anything is
  downloaded; a cached snapshot without them is refused too.

Every refusal is a `CheckpointError` that says what was looked for, where, and how to allow the download.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pixeltriage.errors import CheckpointError

# what a checkpoint (System One's, or the SigLIP encoder's) is made of; everything else in a repository is left alone
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.txt", "*.model", "*.jinja"]
WEIGHT_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib", ".h5", ".msgpack", ".npz")
# the hub's own rule for a repo id: two names of letters, digits, '-', '_', '.', no '--' or '..', at most 96 each
_NAME = r"(?![^/@]*(?:--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
EMPTY = "empty checkpoint: give a local path or a Hugging Face hub id (org/name[@revision])"
_REPO_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[^\s@]+))?$")


@dataclass(frozen=True)
class HubId:
    """A parsed `org/name[@revision]`."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(text: str, revision: str | None = None) -> HubId | None:
    """`org/name[@revision]` as a HubId, None when `text` is not spelled as one. `revision` (e.g. from --revision)
    fills in a missing `@revision`; two different ones are an error."""
    match = _REPO_ID.match(text)
    if match is None:
        return None
    inline = match["revision"]
    if inline and revision and inline != revision:
        raise CheckpointError(f"{text}: revision {inline!r} in the id and revision={revision!r} disagree; give one")
    return HubId(match["repo"], inline or revision)


def check_checkpoint(text: str | os.PathLike) -> str:
    """`text` as given when it is an existing local path or spelled as a hub id (nothing is looked up); otherwise a
    CheckpointError. For argument parsers, which resolve later, once --revision and the download switch are known."""
    text = os.fspath(text)
    if not text:
        raise CheckpointError(EMPTY)
    if os.path.exists(os.path.expanduser(text)) or parse_hub_id(text) is not None:
        return text
    raise CheckpointError(f"{text}: no such file or directory, and not a Hugging Face hub id (org/name[@revision])")


def resolve_checkpoint(source: str | os.PathLike, revision: str | None = None, *, allow_download: bool = False,
                       cache_dir: str | os.PathLike | None = None, token: str | bool | None = None) -> Path:
    """The local path of a checkpoint given as a path or a hub id (see the module docstring). What is not spelled
    as a hub id is returned as a path, existing or not (the loader reports a missing checkpoint).

    revision: a branch, tag or commit of a hub id (also `org/name@revision`); refused for a local path.
    allow_download: fetch a hub id that is not cached (its safetensors and JSON / tokenizer files only); ignored,
    with the reason in the error, while HF_HUB_OFFLINE=1 is set.
    cache_dir: the hub cache to use instead of HF_HUB_CACHE / huggingface_hub's default.
    """
    text = os.fspath(source)
    if not text:
        raise CheckpointError(EMPTY)
    local = Path(os.path.expanduser(text))
    hub_id = None if local.exists() else parse_hub_id(text, revision)
    if hub_id is None:
        # a path: the loader names what is wrong with a missing or broken one, as for any local checkpoint
        if revision is not None:
            raise CheckpointError(f"{text}: a local path has no revision (revision={revision!r})"
                                  + ("; a hub id of the same spelling is not looked up while the path exists"
                                     if local.exists() else ""))
        return local
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    if cache_dir is None:
        cache_dir = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or None
    if allow_download and not offline:
        return _download(hub_id, cache_dir, token)
    return _cached(hub_id, cache_dir, offline)


def _cached(hub_id: HubId, cache_dir, offline: bool) -> Path:
    huggingface_hub, errors = _hub()
    where = os.fspath(cache_dir) if cache_dir is not None else huggingface_hub.constants.HF_HUB_CACHE
    try:
        folder = huggingface_hub.snapshot_download(hub_id.repo_id, revision=hub_id.revision, cache_dir=cache_dir,
                                                   local_files_only=True, allow_patterns=ALLOW_PATTERNS)
    except errors.LocalEntryNotFoundError as e:
        how = ("HF_HUB_OFFLINE=1 is set: unset it and allow the download (allow_download=True, --allow-download)"
               if offline else "allow the download (allow_download=True, --allow-download)")
        raise CheckpointError(f"{hub_id}: no local path of that name, not in the Hugging Face cache at {where} "
                              f"(revision {hub_id.revision or 'main'}), and downloads are off; {how}, or fetch it "
                              f"first with `hf download {hub_id.repo_id}"
                              + (f" --revision {hub_id.revision}" if hub_id.revision else "")
                              + " --include '*.safetensors' '*.json' '*.txt'`"
                              + f" ({type(e).__name__})") from None
    return _checked_snapshot(hub_id, Path(folder))


def _download(hub_id: HubId, cache_dir, token) -> Path:
    huggingface_hub, errors = _hub()
    try:
        # the listing first: a repository of pickles only is refused before any file is fetched
        files = huggingface_hub.HfApi().list_repo_files(hub_id.repo_id, revision=hub_id.revision, token=token)
        _check_files(hub_id, files, "repository")
        folder = huggingface_hub.snapshot_download(hub_id.repo_id, revision=hub_id.revision, cache_dir=cache_dir,
                                                   allow_patterns=ALLOW_PATTERNS, token=token)
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{hub_id}: the repository has no revision {hub_id.revision!r}") from None
    except errors.GatedRepoError:
        raise CheckpointError(f"{hub_id}: a gated repository; accept its terms on the hub and log in (HF_TOKEN or "
                              "`hf auth login`)") from None
    except errors.RepositoryNotFoundError:
        raise CheckpointError(f"{hub_id}: no such repository on the hub (or a private one: log in with HF_TOKEN or "
                              "`hf auth login`)") from None
    except errors.LocalEntryNotFoundError as e:
        raise CheckpointError(f"{hub_id}: the hub could not be reached and the checkpoint is not cached ({e})") \
            from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{hub_id}: download failed: {type(e).__name__}: {e}") from None
    return _checked_snapshot(hub_id, Path(folder))


def _checked_snapshot(hub_id: HubId, folder: Path) -> Path:
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    _check_files(hub_id, files, f"cached snapshot {folder}")
    return folder


def _check_files(hub_id: HubId, files: list[str], where: str) -> None:
    if any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        return
    pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
    found = f"; it holds {', '.join(pickles[:5])}, which are not loaded (pickle formats can run code)" if pickles \
        else ""
    raise CheckpointError(f"{hub_id}: the {where} has no safetensors weights{found}")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub():
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401  (a submodule: not an attribute until imported)
        from huggingface_hub import errors
    except ImportError as e:
        raise CheckpointError(f"a Hugging Face hub id needs huggingface_hub (pip install huggingface_hub): {e}") \
            from None
    return huggingface_hub, errors
