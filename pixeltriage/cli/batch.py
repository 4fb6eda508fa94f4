"""Offline batch scoring (`pixeltriage score --episodes FILE.jsonl --out FILE.jsonl [--ray]`): every episode of a
JSON Lines file scored once, its decision appended to the output as one line keyed by the episode's id, in this
process or over Ray Data (an actor pool, one Scorer per actor, on every node of a cluster).

Input: one episode per line, the episode JSON of docs/state.md with an `id` (a non-empty string, unique in the
file); blank lines are skipped. The whole file is checked before anything loads, as `score --episode` checks its
file. Image paths are relative to the file's folder (made absolute here, so that a Ray worker on another node
reads the same path: images given by path must be on every node, or given by cache key from a shared cache).

Output: one JSON object per line, `{"id": ..., <score --json's decision>}`, or `{"id": ..., "error": ...,
"error_type": ...}` for an episode that cannot be scored (a cache key the cache does not hold, a state too long):
the others are still scored, and the command exits 2 while the output holds such lines for the file's episodes
(a rerun does not score them again; remove their lines to have them scored). Lines are appended whole (one
write each) as results arrive, in the order they finish. A run that stops part-way (a crash, SIGKILL, Ctrl-C)
leaves only whole lines, except perhaps a last line cut short by a crash of the machine: the next run over the
same output drops such a line, skips every id the output already holds and scores the rest, so that a rerun
until exit 0 leaves each episode's line exactly once.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from pixeltriage.errors import PixelTriageError

ACTORS_START_TIMEOUT = 600  # seconds: a pool that fits the cluster has every actor's Scorer loaded before it scores
FSYNC_EVERY = 1.0          # seconds: the output is fsynced at most this often while results arrive, and at the end


class BatchError(PixelTriageError):
    """The episodes file or the output file cannot be used as they are: the message says which line and why."""


@dataclass(frozen=True)
class Episode:
    """One line of an episodes file: its id, line number and the episode as plain JSON (question, memories with
    absolute image paths), which is what crosses to a Ray actor."""

    id: str
    line: int
    episode: dict


@dataclass(frozen=True)
class Settings:
    """What each scorer needs: plain values, so that a Ray actor can be handed them."""

    checkpoint: str
    device: str
    dtype: str
    cache: str | None
    k: int
    answering_model: str
    verify: bool
    threads: int | None
    reorder_weights: bool


def read_episodes(path: str | os.PathLike) -> list[Episode]:
    """Every episode of a JSON Lines file, each checked as `score --episode` checks one (shape, fields, image
    files present), with an id that is a non-empty string and unique. BatchError / EpisodeError name the line."""
    from pixeltriage.episode import EpisodeError, parse_episode

    path = Path(path)
    base = path.parent.resolve()
    episodes, lines_of = [], {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path}, line {number}"
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise EpisodeError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(data, dict):
                raise EpisodeError(f"{where}: expected a JSON object, found {type(data).__name__}")
            data = dict(data)
            episode_id = data.pop("id", None)
            if not isinstance(episode_id, str) or not episode_id:
                raise EpisodeError(f"{where}: needs an 'id', a non-empty string that names the episode in --out")
            if episode_id in lines_of:
                raise EpisodeError(f"{where}: id {episode_id!r} is already the id of line {lines_of[episode_id]}")
            lines_of[episode_id] = number
            question, memories = parse_episode(data, base, where)
            episodes.append(Episode(episode_id, number, {
                "question": question,
                "memories": [{"image": m.image, "key": m.key, "note": m.note, "dialogue": m.dialogue, "date": m.date}
                             for m in memories]}))
    if not episodes:
        raise EpisodeError(f"{path}: holds no episode")
    return episodes


def memories_of(episode: dict) -> list:
    from pixeltriage.engine.types import Memory

    return [Memory(**m) for m in episode["memories"]]


@dataclass
class Done:
    """What an output file already holds: the ids of its lines, those of them that are errors, and the bytes of a
    cut-short last line dropped from it (0: none)."""

    ids: set[str]
    errors: set[str]
    cut: int


def done_ids(out: str | os.PathLike) -> Done:
    """Read what the output holds, dropping a cut-short last line. A whole line that is not one of ours is an
    error: the file is then left as it is."""
    path = Path(out)
    if not path.exists():
        return Done(set(), set(), 0)
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    done = Done(set(), set(), len(data) - whole)
    for number, line in enumerate(data[:whole].splitlines(), start=1):
        try:
            result = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            result = None
        if not isinstance(result, dict) or not isinstance(result.get("id"), str):
            raise BatchError(f"{path}, line {number}: not a result of `score --episodes` (a JSON object with an "
                             "id); give another --out, or remove the file to score everything again")
        done.ids.add(result["id"])
        if "error" in result:
            done.errors.add(result["id"])
    if done.cut:
        with open(path, "r+b") as f:
            f.truncate(whole)
            os.fsync(f.fileno())
    return done


class Output:
    """The output file, appended to one whole line per write, fsynced at most every FSYNC_EVERY s and at close."""

    def __init__(self, path: str | os.PathLike):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._synced = time.monotonic()

    def write(self, line: str) -> None:
        data = (line + "\n").encode()
        written = os.write(self.fd, data)
        if written != len(data):             # a full disk: say so rather than leave a cut line behind silently
            raise OSError(f"wrote {written} of {len(data)} bytes of a result line")
        if time.monotonic() - self._synced >= FSYNC_EVERY:
            os.fsync(self.fd)
            self._synced = time.monotonic()

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


class BatchScorer:
    """One Scorer and the decision settings: `__call__` scores a batch of episodes ({"id": [...], "episode":
    [JSON text, ...]}) into result lines ({"id": [...], "line": [JSON text, ...]}). This is the Ray Data actor
    (one per actor) and, called directly, the in-process path."""

    def __init__(self, settings: Settings):
        import torch

        from pixeltriage.delivery.profiles import answering_model
        from pixeltriage.engine.cpu_memory import tune_malloc
        from pixeltriage.engine.scorer import Scorer
        from pixeltriage.store.cache import Cache

        tune_malloc()
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.settings = settings
        self.node = _ray_node()
        self.answering = answering_model(settings.answering_model)
        self.cache = Cache(settings.cache) if settings.cache else None
        self.scorer = Scorer.load(settings.checkpoint, device=settings.device, dtype=settings.dtype,
                                  cache=self.cache, verify=settings.verify or None,
                                  reorder_weights=settings.reorder_weights)

    def __call__(self, batch: dict) -> dict:
        chunk = self.chunk(list(batch["id"]), [json.loads(text) for text in batch["episode"]])
        n = len(chunk.lines)
        return {"id": list(batch["id"]), "line": chunk.lines, "failed": chunk.failed, "started": [chunk.started] * n,
                "finished": [chunk.finished] * n, "node": [self.node] * n}

    def chunk(self, ids: list[str], episodes: list[dict]) -> "Chunk":
        started = time.time()
        lines, failed = self.lines(ids, episodes)
        return Chunk(lines, failed, started, time.time(), [self.node] * len(lines))

    def lines(self, ids: list[str], episodes: list[dict]) -> tuple[list[str], list[bool]]:
        """The result line of each episode, in order (its decision, or its error when it cannot be packed), and
        whether it is an error."""
        from pixeltriage.delivery.report import decision_report

        lines: list[str] = [""] * len(ids)
        failed = [False] * len(ids)
        states, packed = [], []
        for i, (episode_id, episode) in enumerate(zip(ids, episodes)):
            try:
                states.append(self.scorer.pack(episode["question"], memories_of(episode)))
                packed.append(i)
            except PixelTriageError as e:
                lines[i] = json.dumps({"id": episode_id, "error": str(e), "error_type": type(e).__name__})
                failed[i] = True
        for i, scores in zip(packed, self.scorer.score_states(states)):
            report = decision_report(episodes[i]["question"], memories_of(episodes[i]), scores, self.settings.k,
                                     None, self.answering, cache=self.cache)
            lines[i] = json.dumps({"id": ids[i], **report}, allow_nan=False)
        return lines, failed


def _ray_node() -> str | None:
    """The address of the Ray node this process runs on (a Ray actor's), None outside Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.util.get_node_ip_address()


@dataclass(frozen=True)
class Chunk:
    """The result lines of a batch of episodes, which of them are errors, when the scorer began and ended the
    batch (wall clock, seconds since the epoch: comparable across the processes and, clocks in step, the nodes),
    and the Ray node that scored each line (None in-process)."""

    lines: list[str]
    failed: list[bool]
    started: float
    finished: float
    nodes: list[str | None]


class Progress:
    """The progress bar on standard error (tqdm): episodes scored of those to score, questions/s, time left; on a
    terminal it redraws in place, elsewhere (a log) one line every 10 s."""

    def __init__(self, total: int, skipped: int):
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, unit="q", file=sys.stderr, mininterval=0.2 if tty else 10.0,
                        desc="scored", dynamic_ncols=tty, ascii=not tty,
                        postfix=f"{skipped} already in the output" if skipped else None)

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


@dataclass
class Summary:
    """What a run did: episodes scored, failed (an error line written), skipped (already in the output; of them
    failed_before with an error line)."""

    scored: int = 0
    failed: int = 0
    skipped: int = 0
    failed_before: int = 0
    seconds: float = 0.0               # the whole run: loading (on Ray: joining it, starting the actors) included
    busy_from: float | None = None     # when a scorer began its first batch (wall clock)
    busy_to: float | None = None       # when a scorer ended its last batch
    nodes: dict[str, int] = dataclasses.field(default_factory=dict)    # on Ray: episodes scored per node address

    @property
    def scoring_seconds(self) -> float:
        return (self.busy_to - self.busy_from) if self.busy_from is not None else 0.0

    @property
    def rate(self) -> float:
        """Questions/s while scoring: every episode of the run over the time from the first batch's start to the
        last batch's end on any scorer (loading the model and starting Ray or its actors excluded)."""
        seconds = self.scoring_seconds
        return (self.scored + self.failed) / seconds if seconds > 0 else 0.0


def run_batch(episodes: list[Episode], out: str | os.PathLike, settings: Settings, *, batch_size: int,
              ray_address: str | None = None, use_ray: bool = False, actors: int | None = None,
              cpus_per_actor: float = 1.0) -> Summary:
    """Score the episodes whose id `out` does not hold yet, appending their lines to `out`."""
    done = done_ids(out)
    if done.cut:
        print(f"score: dropped a cut-short last line ({done.cut} bytes) of {out}", file=sys.stderr)
    pending = [e for e in episodes if e.id not in done.ids]
    wanted = {e.id for e in episodes}
    summary = Summary(skipped=len(episodes) - len(pending), failed_before=len(done.errors & wanted))
    if not pending:
        return summary
    output, progress = Output(out), Progress(len(pending), summary.skipped)
    started = time.perf_counter()
    try:
        results = (_ray_results(pending, settings, batch_size, ray_address, actors, cpus_per_actor) if use_ray
                   else _local_results(pending, settings, batch_size))
        for chunk in results:
            for line in chunk.lines:
                output.write(line)
            summary.busy_from = min(summary.busy_from or chunk.started, chunk.started)
            summary.busy_to = max(summary.busy_to or chunk.finished, chunk.finished)
            summary.failed += sum(chunk.failed)
            summary.scored += len(chunk.lines) - sum(chunk.failed)
            for node in chunk.nodes:
                if node is not None:
                    summary.nodes[node] = summary.nodes.get(node, 0) + 1
            progress.update(len(chunk.lines))
            summary.seconds = time.perf_counter() - started
    finally:
        progress.close()
        output.close()
    return summary


def _batches(episodes: list[Episode], size: int) -> Iterator[list[Episode]]:
    for start in range(0, len(episodes), size):
        yield episodes[start:start + size]


def _local_results(pending: list[Episode], settings: Settings, batch_size: int) -> Iterable[Chunk]:
    scorer = BatchScorer(settings)
    try:
        for chunk in _batches(pending, batch_size):
            yield scorer.chunk([e.id for e in chunk], [e.episode for e in chunk])
    finally:
        if scorer.cache is not None:
            scorer.cache.close()


def _ray_results(pending: list[Episode], settings: Settings, batch_size: int, address: str | None,
                 actors: int | None, cpus_per_actor: float) -> Iterable[Chunk]:
    """Ray Data: the pending episodes as blocks of `batch_size`, mapped by a pool of `actors` BatchScorer actors
    (default: as many as the cluster's CPUs hold), each reserving `cpus_per_actor` CPUs and running torch on that
    many threads; results streamed back as each batch finishes."""
    import ray

    ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        import logging

        import ray.data

        logging.getLogger("ray.data").setLevel(logging.ERROR)    # its start and end lines: ours say it
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False            # ours is the one bar, in both modes
        context.print_on_execution_start = False
        cpus = ray.cluster_resources().get("CPU", 0)
        size = actors or max(1, int(cpus // cpus_per_actor))
        if size * cpus_per_actor > cpus:
            print(f"score: {size} actors of {cpus_per_actor:g} CPUs need {size * cpus_per_actor:g} CPUs; the Ray "
                  f"cluster has {cpus:g}: the rest wait for room", file=sys.stderr)
        else:       # every actor loaded before the first batch, so that each takes its share from the start
            context.wait_for_min_actors_s = ACTORS_START_TIMEOUT
        if settings.device == "cpu":
            settings = dataclasses.replace(settings, threads=settings.threads or max(1, math.floor(cpus_per_actor)))
        rows = [{"id": e.id, "episode": json.dumps(e.episode)} for e in pending]
        dataset = ray.data.from_items(rows, override_num_blocks=math.ceil(len(rows) / batch_size))
        scored = dataset.map_batches(BatchScorer, fn_constructor_args=(settings,), batch_size=batch_size,
                                     compute=ray.data.ActorPoolStrategy(size=size), num_cpus=cpus_per_actor,
                                     num_gpus=1 if settings.device == "cuda" else 0, batch_format="numpy")
        for batch in scored.iter_batches(batch_size=None, batch_format="numpy"):
            yield Chunk([str(line) for line in batch["line"]], [bool(f) for f in batch["failed"]],
                        float(min(batch["started"])), float(max(batch["finished"])), [str(n) for n in batch["node"]])
    finally:
        ray.shutdown()
