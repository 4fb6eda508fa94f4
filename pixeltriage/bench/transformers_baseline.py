"""transformers' Qwen3.5 as the baseline a user could pick instead: its torch path, fed the engine's state."""
from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch


def force_transformers_torch_path(module=None) -> None:
    """With flash-linear-attention installed, transformers binds Qwen3.5's gated-delta and conv functions
    to fla at import time, even on the CPU where fla cannot run. Rebind the module globals to the
    plain torch functions they wrap. module: transformers' modeling module (default modeling_qwen3_5; also
    modeling_qwen3_5_moe)."""
    if module is None:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn = getattr(module, name, None)
        if fn is not None:
            setattr(module, name, inspect.unwrap(fn))


def state_packer(directory: str | os.PathLike):
    """The engine's StatePacker for a checkpoint directory, without loading any weight."""
    from pixeltriage.config import ImageConfig, ModelConfig, TriageConfig
    from pixeltriage.engine.state import StatePacker, TextEncoder

    d = Path(directory)
    return StatePacker(TextEncoder(d / "tokenizer.json"), ModelConfig.from_file(d / "config.json"),
                       ImageConfig.from_file(d / "preprocessor_config.json"), TriageConfig.from_file(d / "pixeltriage.json"))


@torch.inference_mode()
def transformers_hidden(model, state) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) for an engine State: [T, hidden]."""
    ids = state.input_ids[None]
    dtype = next(model.parameters()).dtype
    mm = (ids == model.config.image_token_id).int()
    kwargs = {}
    if state.num_memories:
        kwargs = {"pixel_values": state.pixel_values.to(dtype), "image_grid_thw": state.image_grid_thw,
                  "mm_token_type_ids": mm}
    return model.model(input_ids=ids, **kwargs).last_hidden_state[0]
