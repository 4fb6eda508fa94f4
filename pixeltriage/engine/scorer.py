"""The Scorer: owns the loaded checkpoint and runs memories -> state -> forward -> head -> Scores."""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from pixeltriage.config import ImageConfig, ModelConfig, TriageConfig
from pixeltriage.engine.model import Varlen, decoder_forward
from pixeltriage.engine.profiling import stage
from pixeltriage.engine.state import EXTRA_HEAD_ROWS, HeadRows, State, StatePacker, TextEncoder
from pixeltriage.engine.types import Memory, Scores, memory_list
from pixeltriage.engine.vision import vision_forward
from pixeltriage.errors import (CacheMissError, CheckpointError, CorruptEntryError, InvalidMemoryError,
                                NonFiniteScoreError)
from pixeltriage.kernels import prepack, registry
from pixeltriage.kernels.head import TORCH as HEAD_TORCH
from pixeltriage.kernels.head import TRITON as HEAD_TRITON
from pixeltriage.kernels.head import HeadOutput, decision_head, final_norm_rows, resolve_head_backend
from pixeltriage.kernels.workspace import Workspace
from pixeltriage.weights.layout import EngineWeights, parse_dtype
from pixeltriage.weights.loader import check_finite, load_directory
from pixeltriage.weights.packed import PackedCheckpoint, vision_fingerprint
from pixeltriage.weights.pages import drop_file_pages

if TYPE_CHECKING:
    from pixeltriage.store.cache import Cache
    from pixeltriage.engine.graphs import DecoderGraphs

log = logging.getLogger(__name__)

SMALL_TENSOR = 1 << 20     # elements: the weights a packed load reads on every load (all but the matrices)


def _recorded(method):
    """A Scorer method whose kernel calls are counted in the scorer's record too (`Scorer.kernel_counts`)."""
    @functools.wraps(method)
    def recorded(self, *args, **kwargs):
        with registry.recording(self._kernel_record):
            return method(self, *args, **kwargs)

    return recorded


class Scorer:
    """System One for one checkpoint. Thread-safe: `score` may be called from many threads at once.

    With a write-time `cache` (pixeltriage.Cache), memories may be given by cache key, every image is read as its
    cached thumbnail (an image given by value is put into the cache first), and the vision tower's output
    is stored per (image key, `vision_fingerprint`), so a later question with the same memory skips the ViT for it.
    """

    def __init__(self, model_cfg: ModelConfig, image_cfg: ImageConfig, triage_cfg: TriageConfig,
                 encoder: TextEncoder, weights: EngineWeights, device: torch.device, dtype: torch.dtype,
                 cache: "Cache | None" = None, head_backend: str = "auto"):
        self.model_config = model_cfg
        self.image_config = image_cfg
        self.triage_config = triage_cfg
        self.weights = weights
        self.device = device
        self.dtype = dtype
        if cache is not None:
            from pixeltriage.media.policy import THUMBNAIL_SIDE

            if triage_cfg.thumbnail_size != THUMBNAIL_SIDE:
                raise CheckpointError(f"{triage_cfg.source}: state.thumbnail_size is {triage_cfg.thumbnail_size}, but the "
                                      f"write-time cache keeps {THUMBNAIL_SIDE}-px thumbnails; rescaling them would "
                                      "not give the thumbnails this checkpoint was trained on")
        self.cache = cache
        resolve_head_backend(head_backend, device)            # an unavailable choice is an error here
        self.head_backend = head_backend
        self.packer = StatePacker(encoder, model_cfg, image_cfg, triage_cfg)
        self.vision_counts = {"cached": 0, "computed": 0}   # images whose ViT output was reused / computed
        # score_batch packs states into varlen forwards of at most this many tokens. On the CPU longer forwards only
        # add memory traffic: bench-small bf16, six questions of 109-3274 tokens, 0.68 questions/s at 4096 vs 0.52
        # at 32768 and 0.64 one question per forward (two runs; the tiny preset ~13.5 q/s at any cap)
        self.max_batch_tokens = 32768 if device.type == "cuda" else 4096
        self._fingerprint: str | None = None
        self.checkpoint_fingerprint: str | None = None     # the packed file's content fingerprint, when packed
        self.graphs: "DecoderGraphs | None" = None         # enable_cuda_graphs()
        # the CPU decoder's widest intermediates, kept warm between layers and forwards (`kernels.workspace`);
        # `workspace.release()` gives them back
        self.workspace = Workspace()
        # the decoder's weights to reorder for oneDNN on the first forward (`kernels.prepack`; the load decides)
        self._prepack = prepack.OnFirstForward()
        # the kernels this scorer's forwards ran and the calls they declined (`kernel_counts`)
        self._kernel_record = registry.Record()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu",
             dtype: torch.dtype | str = torch.float32, *, cache: "Cache | None" = None,
             head_backend: str = "auto", adapter: str | os.PathLike | None = None,
             allow_slow: bool = False, verify: bool | None = None,
             cuda_graphs: bool | Sequence[int] = False, revision: str | None = None,
             allow_download: bool = False, reorder_weights: bool = True) -> "Scorer":
        """Load a System One checkpoint: a directory, a packed file, or a Hugging Face hub id (docs/checkpoints.md).

        Weights in transformers' layout or Valen's export layout (auto-detected). adapter: a PEFT LoRA adapter
        directory merged at load; by default one is used when the checkpoint directory itself holds
        `adapter_config.json`.

        cache: a `pixeltriage.Cache` for thumbnails, notes and vision features (see the class docstring).
        head_backend: "auto" (the fused Triton head on CUDA when Triton is installed, else torch), "triton" or
        "torch"; an unavailable choice raises BackendUnavailableError here, not at the first score.
        allow_slow: on CUDA, the fast kernels (flash-linear-attention's gated delta rule, Triton) are required
        unless this is True; scores never silently come from a slower path.
        verify: read every weight value at load, NaN/Inf being an error. Default: yes for a directory (its values
        pass through the conversion anyway); for a packed file only the tensors of at most 2^20 elements (checked
        when written; its header and sizes are still checked, and scores are never returned non-finite), where
        True reads them all and re-hashes the file against its fingerprint.
        cuda_graphs: on CUDA, capture the decoder as CUDA graphs at load (True: `graphs.DEFAULT_BUCKETS` of state
        length; or the bucket lengths), replayed by single-question scoring; see `enable_cuda_graphs`.
        reorder_weights: on the CPU (bf16 where oneDNN has bf16 primitives, float32 where the projections run its
        primitive), the first forward reorders the weights for oneDNN in place where that measured faster on this
        machine (`kernels.prepack`): later forwards faster, the first slower by the reorder (what each costs and
        after how many questions it pays: docs/api.md). False for a process that scores fewer.
        revision, allow_download: for a hub id ("org/name" or "org/name@revision", when no local path of that name
        exists), read from huggingface_hub's local cache; it is downloaded (safetensors and JSON files only) only
        with allow_download=True, and never while HF_HUB_OFFLINE=1 (`pixeltriage.hub.resolve_checkpoint`).
        """
        from pixeltriage.hub import resolve_checkpoint

        if cuda_graphs and torch.device(device).type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, not {device!r}")
        path = resolve_checkpoint(path, revision, allow_download=allow_download)
        with _gc_paused():
            scorer = cls._load(path, device, dtype, cache, head_backend, adapter, allow_slow, verify, reorder_weights)
        # every op's kernel decided here, not in the first forward: in float32 on the CPU that may time the two GEMM
        # libraries and the two attentions once on a new machine (~3 s; kernels.linear and kernels.attention, kept
        # by kernels.tuning)
        log.info("kernels: %s", scorer.kernels())
        if cuda_graphs:
            scorer.enable_cuda_graphs(None if cuda_graphs is True else cuda_graphs)
        return scorer

    def with_cache(self, cache: "Cache | None") -> "Scorer":
        """Another Scorer on the same loaded weights and workspace (nothing is read or copied) using `cache`."""
        scorer = type(self)(self.model_config, self.image_config, self.triage_config, self.packer.encoder,
                            self.weights, self.device, self.dtype, cache, self.head_backend)
        scorer._fingerprint, scorer.checkpoint_fingerprint = self._fingerprint, self.checkpoint_fingerprint
        scorer.workspace, scorer._prepack, scorer._kernel_record = self.workspace, self._prepack, self._kernel_record
        return scorer

    def enable_cuda_graphs(self, buckets: Sequence[int] | None = None, capture: bool | None = None) -> None:
        """Capture the text decoder once per bucket of state length (static buffers, one shared memory pool); a
        single question whose state fits a bucket then replays it, a longer one runs eagerly, batches of several
        questions (varlen) stay eager. Takes a few seconds per bucket: call it before serving. capture=False runs
        the same padded static path eagerly (the CPU; tests)."""
        from pixeltriage.engine.graphs import DEFAULT_BUCKETS, DecoderGraphs

        self.graphs = DecoderGraphs(self.weights.text, self.model_config.text, self.device,
                                    DEFAULT_BUCKETS if buckets is None else buckets, capture)
        log.info("decoder CUDA graphs: buckets %s (captured: %s)", list(self.graphs.buckets), self.graphs.capture)

    def disable_cuda_graphs(self) -> None:
        """Back to eager decoder forwards; the graphs and their static buffers are released."""
        self.graphs = None

    def kernels(self) -> dict[str, str]:
        """op -> the name of the kernel a call of it starts with in this scorer's forward (`kernels.registry.choices`
        for its device and dtype; the head as this scorer was asked for it): what would be chosen, for logs, /info,
        gpu_check and profiles. What ran: `kernel_counts`."""
        names = registry.choices(self.device, self.dtype)
        if self.head_backend != "auto":
            names["head"] = {"triton": HEAD_TRITON.name, "torch": HEAD_TORCH.name}[self.head_backend]
        if registry.kernel_device(self.device) == "cpu":
            from pixeltriage.kernels import native

            names["native"] = native.variant() or "none"     # the C library's build in use (kernels.native.variants)
        if self._prepack.roles:
            names["prepacked"] = f"oneDNN's layout, reordered by the first forward: {', '.join(self._prepack.roles)}"
        return names

    def kernel_counts(self) -> registry.KernelCounts:
        """What this scorer's forwards ran (this one's and those of the scorers `with_cache` made from it): calls per
        (op, kernel) and declined calls per (op, kernel, reason) since the load (`registry.KernelCounts`; the
        process's: `registry.counts()`)."""
        return self._kernel_record.snapshot()

    @classmethod
    def _load(cls, path: Path, device, dtype, cache, head_backend, adapter, allow_slow, verify,
              reorder_weights: bool = True) -> "Scorer":
        device = torch.device(device)
        dtype = parse_dtype(dtype)
        resolve_head_backend(head_backend, device)             # an unavailable choice fails before any loading
        check_device_dtype(device, dtype, path)
        registry.check_fast(device, dtype, allow_slow)         # a slow fallback on CUDA: refused before loading
        if registry.kernel_device(device) == "cpu":
            from pixeltriage.kernels import native

            native.library()            # built (first time on this machine) or found now, not in the first forward
            log.info("native CPU kernels: %s", native.status())
        log.info("kernels: %s", registry.choices(device, dtype))
        # the weights the first forward reorders for oneDNN, where this machine measured that faster
        # (`kernels.prepack`; the first load on a machine times it, ~0.5 s)
        roles = prepack.chosen_roles(device, dtype) if reorder_weights else ()
        if path.is_file():
            scorer = cls._load_packed(path, device, dtype, cache, head_backend, adapter, bool(verify))
        else:
            ckpt = load_directory(path, dtype, device, Path(adapter) if adapter is not None else None,
                                  verify is not False)
            scorer = cls(ckpt.model_config, ckpt.image_config, ckpt.triage_config, TextEncoder(ckpt.tokenizer_file),
                         ckpt.weights, device, dtype, cache, head_backend)
        # each weight reordered, where it was a view of the checkpoint's file, gives its pages back as it goes
        scorer._prepack = prepack.OnFirstForward(roles, release=lambda plain: drop_file_pages([plain]))
        return scorer

    @classmethod
    def _load_packed(cls, path: Path, device, dtype, cache, head_backend, adapter, verify: bool) -> "Scorer":
        if adapter is not None:
            raise CheckpointError(f"{path}: a packed checkpoint has its adapter merged already; merge another at "
                                  "pack time (pixeltriage pack SRC DST --adapter DIR)")
        packed = PackedCheckpoint(path)
        mapped = packed.mapped()
        if verify:
            packed.verify(mapped)
        else:
            # the small tensors are read anyway (microseconds, on the mapped CPU views: no device sync per tensor):
            # a non-finite A_log or dt_bias would not show as a NaN score (an infinite decay is a valid, if wrong,
            # decay), so they are checked at every load
            check_finite(mapped, path, max_numel=SMALL_TENSOR)
        encoder = TextEncoder(json_text=packed.tokenizer_json, source=f"{path} (embedded tokenizer)")
        weights = packed.weights(dtype, device, mapped)
        scorer = cls(packed.model_config, packed.image_config, packed.triage_config, encoder, weights, device, dtype,
                     cache, head_backend)
        scorer._fingerprint = packed.vision_fingerprint(dtype) if device.type == "cpu" else None  # CPU-computed
        scorer.checkpoint_fingerprint = packed.fingerprint
        return scorer

    # -- state ---------------------------------------------------------------------------------
    def pack(self, question: str, memories: Sequence[Memory]) -> State:
        """Build the single fixed-order state for one question (see `pixeltriage.engine.state`)."""
        memories = memory_list(memories)
        if self.cache is None:
            for i, m in enumerate(memories):
                if m.key is not None:
                    raise InvalidMemoryError("given by cache key, but the Scorer has no cache "
                                             "(Scorer.load(..., cache=Cache(PATH)))", i)
            with stage("preprocess"):
                images = self.packer.images(memories)
            with stage("pack"):
                return self.packer.pack(question, memories, images=images)
        keys, thumbnails, notes = [], [], []
        with stage("preprocess"):
            for i, m in enumerate(memories):
                key, (thumbnail, note) = self._cached_entry(m, i)
                keys.append(key)
                thumbnails.append(thumbnail)
                notes.append(note if m.note is None else m.note)
            images = self.packer.images(memories, thumbnails)
        with stage("pack"):
            return self.packer.pack(question, memories, images=images, notes=notes, keys=keys)

    def _cached_entry(self, memory: Memory, index: int):
        """(key, (thumbnail, note)) of one memory from the cache, putting an image given by value first."""
        cache = self.cache
        if memory.key is None:
            return cache.entry_of(memory.image, index)      # usually one read, one checksum, one decode
        try:
            return memory.key, cache.entry(memory.key)
        except CorruptEntryError as e:
            # no file path in these messages: the caller knows its cache, and a server's paths stay private
            raise InvalidMemoryError(f"{e}; the cache cannot rebuild it without the image", index) from None
        except CacheMissError:
            raise InvalidMemoryError(f"key {memory.key!r} is not in the cache", index) from None

    @property
    def vision_fingerprint(self) -> str:
        """SHA-256 over everything that decides the vision tower's output for a thumbnail: the vision weights as
        loaded (dtype included), the vision config, the image preprocessing, the thumbnail size and the device
        type (a CPU and a GPU round differently, so neither reuses the other's features)."""
        with self._lock:
            if self._fingerprint is None:
                self._fingerprint = vision_fingerprint(self.weights, self.model_config, self.image_config,
                                                       self.triage_config, self.device.type)
            return self._fingerprint

    # -- forward -------------------------------------------------------------------------------
    @_recorded
    @torch.inference_mode()
    def visual_rows(self, state: State) -> torch.Tensor:
        """The merged vision-tower output for every image of the state: [num_image_tokens, hidden].

        With a cache, images whose features are stored for this model's fingerprint skip the ViT; the others run
        through it together in one call and are stored."""
        hidden = self.model_config.text.hidden_size
        if state.num_memories == 0:
            return torch.zeros(0, hidden, dtype=self.dtype, device=self.device)
        grids = [tuple(g) for g in state.image_grid_thw.tolist()]
        keys = state.image_keys if len(state.image_keys) == len(grids) else [None] * len(grids)
        if self.cache is None or not any(keys):
            self.vision_counts["computed"] += len(grids)
            return vision_forward(state.pixel_values.to(self.device), grids, self.weights.vision,
                                  self.model_config.vision)
        merge2 = self.model_config.vision.spatial_merge_size ** 2
        rows = [t * h * w // merge2 for t, h, w in grids]
        fingerprint = self.vision_fingerprint
        features: list[torch.Tensor | None] = []
        for key, n in zip(keys, rows):
            f = self.cache.get_features(key, fingerprint) if key else None
            if f is not None and (tuple(f.shape) != (n, hidden) or f.dtype != self.dtype):
                log.warning("cache %s: features of %s have shape %s %s, expected (%d, %d) %s; recomputing",
                            self.cache.location, key, tuple(f.shape), f.dtype, n, hidden, self.dtype)
                f = None
            features.append(f)
        missing = [i for i, f in enumerate(features) if f is None]
        if missing:
            patches = state.pixel_values.split([t * h * w for t, h, w in grids])
            computed = vision_forward(torch.cat([patches[i] for i in missing]).to(self.device),
                                      [grids[i] for i in missing], self.weights.vision, self.model_config.vision)
            for i, f in zip(missing, computed.split([rows[i] for i in missing])):
                features[i] = f
                if keys[i]:
                    self.cache.put_features(keys[i], fingerprint, f)
        self.vision_counts["cached"] += len(grids) - len(missing)
        self.vision_counts["computed"] += len(missing)
        return torch.cat([f.to(self.device) for f in features])

    def _embeds(self, state: State, visual: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with the vision tower's rows scattered into the image placeholders: [T, hidden] fp32."""
        input_ids = state.input_ids.to(self.device)
        embeds = self.weights.text.embed.index_select(0, input_ids).float()
        if state.num_memories:
            visual = self.visual_rows(state) if visual is None else visual
            # placeholder rows found on the host (the state lives there): a boolean-mask scatter on the device
            # would synchronise it to count the mask
            rows = (state.input_ids == self.model_config.image_token_id).nonzero().squeeze(1).to(self.device)
            embeds.index_copy_(0, rows, visual.float())
        return embeds

    @_recorded
    @torch.inference_mode()
    def last_hidden(self, state: State, visual: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's last output, before the final norm: [T, hidden] float32."""
        self._prepack.apply(self.weights, self.model_config.text)
        embeds, positions = self._embeds(state, visual), state.position_ids.to(self.device)
        if self.graphs is not None:
            return self.graphs.run(embeds, positions)
        with self.workspace.active():
            return decoder_forward(embeds, positions, self.weights.text, self.model_config.text)

    @_recorded
    @torch.inference_mode()
    def last_hidden_packed(self, states: Sequence[State], rows: torch.Tensor | None = None) -> torch.Tensor:
        """Several states in one varlen forward (packed along the token axis, no attention, conv or recurrence
        across them): the concatenation of their `last_hidden` rows, [sum T, hidden] float32.

        rows: only these rows of that concatenation ([R] indices on the scorer's device) -> [R, hidden], with the
        last layer computed at them only (see `decoder_forward`; a CUDA graph replay computes every row and
        returns these, see `DecoderGraphs.run`)."""
        self._prepack.apply(self.weights, self.model_config.text)
        if len(states) == 1 and self.graphs is not None:
            state = states[0]
            return self.graphs.run(self._embeds(state), state.position_ids.to(self.device), rows)
        varlen = None
        if len(states) > 1:             # the boundaries on the device before the forward, which then uploads nothing
            bounds = [0]
            for s in states:
                bounds.append(bounds[-1] + s.num_tokens)
            varlen = Varlen.prepare(bounds, self.device)
        embeds = torch.cat([self._embeds(s) for s in states]) if len(states) > 1 else self._embeds(states[0])
        positions = torch.cat([s.position_ids for s in states], dim=1).to(self.device)
        with self.workspace.active():
            return decoder_forward(embeds, positions, self.weights.text, self.model_config.text, cu_seqlens=varlen,
                                   rows=rows)

    @torch.inference_mode()
    def hidden_states(self, state: State, positions) -> torch.Tensor:
        """Final hidden states (after the final norm) at `positions` (token indices: a tensor or a sequence of
        ints): [len(positions), hidden] float32."""
        hidden = self.last_hidden(state)
        positions = torch.as_tensor(positions, dtype=torch.long)
        return final_norm_rows(hidden, positions.to(self.device), self.weights.text.norm,
                               self.model_config.text.rms_norm_eps)

    # -- scoring -------------------------------------------------------------------------------
    def score(self, question: str, memories: Sequence[Memory]) -> Scores:
        """p_vis, per-memory gains and relevance for one question and its retrieved memories."""
        return self.score_states([self.pack(question, memories)])[0]

    def score_batch(self, episodes: Sequence[tuple[str, Sequence[Memory]]]) -> list[Scores]:
        """Score several (question, memories) episodes; results in input order."""
        return self.score_states([self.pack(q, m) for q, m in episodes])

    @_recorded
    @torch.inference_mode()
    def score_states(self, states: Sequence[State]) -> list[Scores]:
        if not states:
            return []
        # Only the head's rows leave each forward: per state, in `State.head_positions` order (`HeadRows`)
        rows, decision, binary, none, markers, counts = [], [], [], [], [], [0]
        base = 0
        for group in self._token_groups(states):
            index, token_offset = [], 0
            for s in group:
                n = s.num_memories
                index.append(s.head_positions() + token_offset)
                layout = HeadRows.at(base, n)
                markers.append(layout.markers)
                decision.append(layout.decision)
                binary.append(layout.binary)
                none.append(layout.none)
                counts.append(counts[-1] + n)
                base += n + EXTRA_HEAD_ROWS
                token_offset += s.num_tokens
            rows.append(self.last_hidden_packed(group, torch.cat(index).to(self.device)))
        with stage("head"):
            out = self._head(torch.cat(rows), decision, binary, none, markers, counts)
        return _to_scores(out, counts)

    def _token_groups(self, states: Sequence[State]) -> list[list[State]]:
        """Consecutive states packed into varlen forwards of at most `max_batch_tokens` tokens each."""
        groups: list[list[State]] = [[]]
        tokens = 0
        for s in states:
            if groups[-1] and tokens + s.num_tokens > self.max_batch_tokens:
                groups.append([])
                tokens = 0
            groups[-1].append(s)
            tokens += s.num_tokens
        return groups

    def _head(self, hidden, decision, binary, none, markers, counts) -> HeadOutput:
        dev = self.device
        return decision_head(
            self.head_backend, hidden, self.weights.text.norm, self.model_config.text.rms_norm_eps,
            self.weights.head_decision, self.weights.head_candidate,
            torch.stack(decision).to(dev), torch.stack(binary).to(dev), torch.stack(none).to(dev),
            torch.cat(markers).to(dev), torch.tensor(counts, device=dev),
        )


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection while loading (process-wide: gc.disable is global; the previous state is
    restored after, collection merely postponed). Decoding the weights' headers allocates thousands of dicts,
    which triggers full collections over everything the process holds (torch alone is ~170k objects): measured
    ~90 ms of a ~110 ms packed load. Loading creates no reference cycles worth collecting."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def check_device_dtype(device: torch.device, dtype: torch.dtype, path: Path) -> None:
    """A device/dtype pair the machine cannot run is an error at load, naming the checkpoint."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(f"{path}: cannot load onto {device}: CUDA is not available here")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise CheckpointError(f"{path}: {torch.cuda.get_device_name(device)} cannot run bfloat16; "
                                  "load with dtype=torch.float16 or torch.float32")
    elif device.type == "cpu":
        try:
            torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
        except RuntimeError as e:
            raise CheckpointError(f"{path}: this CPU build of torch cannot run {dtype} matmuls ({e})") from None
    else:
        raise CheckpointError(f"{path}: device type {device.type!r} is not supported (cpu or cuda)")


def _to_scores(out: HeadOutput, counts: list[int]) -> list[Scores]:
    # one download for all four outputs, checked on the host: on a GPU, one synchronisation instead of eight (an
    # isfinite().all() read and a copy per output)
    host = torch.cat([t.reshape(-1) for t in out]).double().cpu().split([t.numel() for t in out])
    for name, tensor in zip(out._fields, host):
        if not torch.isfinite(tensor).all():
            raise NonFiniteScoreError(f"the forward produced non-finite {name}; the checkpoint or input is broken")
    p_vis, gains, rel, rel_none = (t.tolist() for t in host)
    return [Scores(p_vis=p_vis[b], gains=gains[counts[b]:counts[b + 1]], relevance=rel[counts[b]:counts[b + 1]],
                   relevance_none=rel_none[b]) for b in range(len(counts) - 1)]
