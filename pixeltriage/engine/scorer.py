"""The Scorer: owns the loaded checkpoint and runs memories -> state -> forward -> head -> Scores."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from pixeltriage.engine.config import ImageConfig, ModelConfig, TriageConfig
from pixeltriage.engine.model import decoder_forward
from pixeltriage.engine.state import State, StatePacker, TextEncoder
from pixeltriage.engine.types import Memory, Scores
from pixeltriage.engine.vision import vision_forward
from pixeltriage.errors import CheckpointError, NonFiniteScoreError
from pixeltriage.kernels.head import HeadOutput, decision_head_reference, final_norm_rows
from pixeltriage.weights.layout import EngineWeights
from pixeltriage.weights.loader import load_checkpoint

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class Scorer:
    """System One for one checkpoint. Thread-safe: `score` may be called from many threads at once."""

    def __init__(self, model_cfg: ModelConfig, image_cfg: ImageConfig, triage_cfg: TriageConfig,
                 encoder: TextEncoder, weights: EngineWeights, device: torch.device, dtype: torch.dtype):
        self.model_config = model_cfg
        self.image_config = image_cfg
        self.triage_config = triage_cfg
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.packer = StatePacker(encoder, model_cfg, image_cfg, triage_cfg)

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu",
             dtype: torch.dtype | str = torch.float32) -> "Scorer":
        """Load a System One checkpoint directory (see README: checkpoint format)."""
        path = Path(path)
        device = torch.device(device)
        dtype = parse_dtype(dtype)
        if not path.is_dir():
            raise CheckpointError(f"{path}: checkpoint directory not found")
        model_cfg = ModelConfig.from_file(path / "config.json")
        image_cfg = ImageConfig.from_file(path / "preprocessor_config.json")
        triage_cfg = TriageConfig.from_file(path / "pixeltriage.json")
        tokenizer = path / "tokenizer.json"
        if not tokenizer.is_file():
            raise CheckpointError(f"{tokenizer}: file not found")
        encoder = TextEncoder(tokenizer)
        weights = load_checkpoint(path, model_cfg, triage_cfg.head_dim, dtype, device)
        return cls(model_cfg, image_cfg, triage_cfg, encoder, weights, device, dtype)

    # -- state ---------------------------------------------------------------------------------
    def pack(self, question: str, memories: Sequence[Memory]) -> State:
        """Build the single fixed-order state for one question (see `pixeltriage.engine.state`)."""
        return self.packer.pack(question, memories)

    # -- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def visual_rows(self, state: State) -> torch.Tensor:
        """The merged vision-tower output for every image of the state: [num_image_tokens, hidden]."""
        if state.num_memories == 0:
            return torch.zeros(0, self.model_config.text.hidden_size, dtype=self.dtype, device=self.device)
        grids = [tuple(g) for g in state.image_grid_thw.tolist()]
        return vision_forward(state.pixel_values.to(self.device), grids, self.weights.vision, self.model_config.vision)

    @torch.inference_mode()
    def last_hidden(self, state: State, visual: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's last output, before the final norm: [T, hidden] in the engine dtype."""
        input_ids = state.input_ids.to(self.device)
        embeds = self.weights.text.embed.index_select(0, input_ids).float()
        if state.num_memories:
            visual = self.visual_rows(state) if visual is None else visual
            image_mask = input_ids == self.model_config.image_token_id
            embeds[image_mask] = visual.float()
        return decoder_forward(embeds, state.position_ids.to(self.device), self.weights.text, self.model_config.text)

    @torch.inference_mode()
    def hidden_states(self, state: State, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states (after the final norm) at `positions`: [len(positions), hidden] float32."""
        hidden = self.last_hidden(state)
        return final_norm_rows(hidden, positions.to(self.device), self.weights.text.norm,
                               self.model_config.text.rms_norm_eps)

    # -- scoring -------------------------------------------------------------------------------
    def score(self, question: str, memories: Sequence[Memory]) -> Scores:
        """p_vis, per-memory gains and relevance for one question and its retrieved memories."""
        return self.score_states([self.pack(question, memories)])[0]

    def score_batch(self, episodes: Sequence[tuple[str, Sequence[Memory]]]) -> list[Scores]:
        """Score several (question, memories) episodes; results in input order."""
        return self.score_states([self.pack(q, m) for q, m in episodes])

    @torch.inference_mode()
    def score_states(self, states: Sequence[State]) -> list[Scores]:
        if not states:
            return []
        hidden, offset = [], 0
        decision, binary, none, markers, counts = [], [], [], [], [0]
        for s in states:
            hidden.append(self.last_hidden(s))
            decision.append(s.decision_positions + offset)
            binary.append(torch.tensor([s.true_position, s.false_position]) + offset)
            none.append(torch.tensor([s.gain_none_position, s.relevance_none_position]) + offset)
            markers.append(s.marker_positions + offset)
            counts.append(counts[-1] + s.num_memories)
            offset += s.num_tokens
        dev = self.device
        out = decision_head_reference(
            torch.cat(hidden), self.weights.text.norm, self.model_config.text.rms_norm_eps,
            self.weights.head_decision, self.weights.head_candidate,
            torch.stack(decision).to(dev), torch.stack(binary).to(dev), torch.stack(none).to(dev),
            torch.cat(markers).to(dev), torch.tensor(counts, device=dev),
        )
        return _to_scores(out, counts)


def _to_scores(out: HeadOutput, counts: list[int]) -> list[Scores]:
    for name, tensor in zip(out._fields, out):
        if not torch.isfinite(tensor).all():
            raise NonFiniteScoreError(f"the forward produced non-finite {name}; the checkpoint or input is broken")
    p_vis, gains, rel, rel_none = (t.double().cpu().tolist() for t in out)
    return [Scores(p_vis=p_vis[b], gains=gains[counts[b]:counts[b + 1]], relevance=rel[counts[b]:counts[b + 1]],
                   relevance_none=rel_none[b]) for b in range(len(counts) - 1)]
