"""CUDA graphs of the text decoder: one per bucket of state length, replayed when scoring one question.

A question's decoder forward launches a few hundred kernels (per Gated DeltaNet layer: projections, conv, norms,
fla's chunked delta rule; per attention layer: projections, norms, rotary, SDPA); at microseconds of launch
overhead each they cost milliseconds on a GPU whose arithmetic for the whole forward takes ~10 ms. A captured
graph replays them all with one launch.

`DecoderGraphs` owns static buffers sized for the largest bucket: the embeddings [T_max, hidden] float32 (as the
decoder takes them), position ids [3, T_max] and the output [T_max, hidden] float32; bucket T_b's graph reads
and writes their first T_b rows. `run(embeds, position_ids)` copies a state of T <= T_b tokens into the first T
rows, zeroes rows T..T_b, replays the smallest bucket that fits and returns a copy of the first T output rows.
Every op of the decoder is causal along the tokens (attention, the conv, the delta rule): masked entries reach
rows < T only multiplied by zero, so the padding leaves them as they are provided it is finite, which is why
rows T..T_b are zeroed on every run rather than left holding the previous state. States longer than the largest
bucket run eagerly.

Each bucket is captured once (largest first, all sharing one memory pool, as nano-vllm does) right after one
eager run of the same shapes, so that Triton's autotuning and every lazy import happen outside the capture;
capture and replay run under the scorer's device (not the current one). Capture before serving: it takes a
few seconds per bucket. Runs are serialised by a lock, and each run's stream waits on the previous run's
completion event, so threads on different CUDA streams cannot overwrite a replay's buffers mid-flight.
A replay records no per-stage profile (the decoder's stages run inside the graph).
With `capture=False` (the CPU, and the tests) the same padded static path runs eagerly.

What a capture needs is checked without a GPU on that eager path, the CUDA branch's kernels included (Triton's
interpreter): two states of one bucket run the same ops on the same shapes, read nothing but the static buffers,
the weights and what the forward made, make no host sync or upload, and leave the buffers where they were
(tests/engine/test_graphs.py, tests/engine/test_cuda_branch.py). The capture itself, the shared pool and replays
on the device wait for a GPU run (docs/performance.md).
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from pixeltriage.engine import profiling
from pixeltriage.config import TextConfig
from pixeltriage.engine.model import TextWeights, decoder_forward

DEFAULT_BUCKETS = (512, 1024, 2048, 3072, 4096, 6144, 8192)


class DecoderGraphs:
    def __init__(self, weights: TextWeights, cfg: TextConfig, device: str | torch.device,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, capture: bool | None = None):
        buckets = tuple(sorted({int(b) for b in buckets}))
        if not buckets or buckets[0] <= 0:
            raise ValueError(f"CUDA graph buckets must be positive token counts, got {list(buckets)}")
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.weights, self.cfg, self.buckets = weights, cfg, buckets
        t_max = buckets[-1]
        self.embeds = torch.zeros(t_max, cfg.hidden_size, dtype=torch.float32, device=self.device)
        self.positions = torch.zeros(3, t_max, dtype=torch.long, device=self.device)
        self.out = torch.zeros(t_max, cfg.hidden_size, dtype=torch.float32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = {"graph": 0, "eager": 0}            # how each run went (a long state runs eagerly)
        self._lock = threading.Lock()                      # one run at a time: the buffers are shared
        self._done: torch.cuda.Event | None = None         # the last run's completion, on its stream
        if self.capture:
            with torch.cuda.device(self.device):
                self._capture_all()

    def _forward(self, t_b: int) -> None:
        self.out[:t_b] = decoder_forward(self.embeds[:t_b], self.positions[:, :t_b], self.weights, self.cfg)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with profiling.paused():                           # a recording stage would synchronize mid-capture
            self._capture_buckets()

    def _capture_buckets(self) -> None:
        pool = None
        for t_b in reversed(self.buckets):
            self._forward(t_b)                             # warm-up outside the capture: autotuning, imports
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads during the capture is theirs, not an error of this capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._forward(t_b)
            if pool is None:
                pool = graph.pool()
            self.graphs[t_b] = graph
        torch.cuda.synchronize(self.device)

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding `num_tokens` tokens; None above the largest."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    @torch.inference_mode()
    def run(self, embeds: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """decoder_forward(embeds, position_ids, rows=rows) for one state: [T or R, hidden] float32 (a new tensor).
        A replay computes every row (its shapes are static) and returns the asked ones; a state longer than the
        largest bucket runs eagerly, with the last layer at the rows only."""
        num_tokens = embeds.shape[0]
        t_b = self.bucket(num_tokens)
        if t_b is None:
            self.replays["eager"] += 1
            return decoder_forward(embeds, position_ids, self.weights, self.cfg, rows=rows)
        with self._lock:
            if not self.capture:
                return self._run(embeds, position_ids, t_b, rows)
            with torch.cuda.device(self.device):
                stream = torch.cuda.current_stream(self.device)
                if self._done is not None:
                    stream.wait_event(self._done)          # a previous run on another stream has finished
                out = self._run(embeds, position_ids, t_b, rows)
                self._done = torch.cuda.Event()
                self._done.record(stream)
                return out

    def _run(self, embeds: torch.Tensor, position_ids: torch.Tensor, t_b: int,
             rows: torch.Tensor | None) -> torch.Tensor:
        num_tokens = embeds.shape[0]
        self.embeds[:num_tokens].copy_(embeds)
        self.embeds[num_tokens:t_b].zero_()
        self.positions[:, :num_tokens].copy_(position_ids)
        self.positions[:, num_tokens:t_b].zero_()
        if self.capture:
            self.graphs[t_b].replay()
        else:
            self._forward(t_b)
        self.replays["graph"] += 1
        return self.out[:num_tokens].clone() if rows is None else self.out.index_select(0, rows)
