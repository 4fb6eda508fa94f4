"""PEFT LoRA adapters, merged into the base weights as they are read (before any fusing or dtype cast).

An adapter directory is what peft's `save_pretrained` writes: `adapter_config.json` + `adapter_model.safetensors`.
Per targeted linear layer it holds `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r];
the merged weight is W + s * B @ A with s = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`; per-module
`rank_pattern` / `alpha_pattern` honoured). `modules_to_save` modules (e.g. the vision merger or the head) are
stored whole, `base_model.model.<module>.<param>`, and replace the base tensors.

`fan_in_fan_out` describes GPT-2 style Conv1D bases stored [in, out]; Qwen3.5's layers are all nn.Linear, for which
peft itself resets the flag to False with a warning. The merge does the same.

Every adapter tensor must land on a base tensor, with matching shapes, or loading fails naming the tensor.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from pixeltriage.errors import CheckpointError
from pixeltriage.weights.layout import LAYOUTS
from pixeltriage.weights.reader import open_safetensors

log = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# (transformers prefix, Valen prefix) pairs, text and vision, from the layouts the loader detects: an adapter
# trained on one layout applies to a checkpoint stored in the other
_LAYOUT_PREFIXES = tuple(zip(LAYOUTS["transformers"], LAYOUTS["valen"]))


def _in_other_layout(name: str) -> str | None:
    """A transformers-layout tensor name in Valen's layout or the reverse; None under neither prefix."""
    for a, b in _LAYOUT_PREFIXES:
        for src, dst in ((a, b), (b, a)):
            if name.startswith(src):
                return dst + name[len(src):]
    return None


def is_adapter_dir(path: Path) -> bool:
    return (path / CONFIG).is_file()


class LoraAdapter:
    """A loaded adapter: `apply(name, tensor)` returns the merged (or replaced) tensor for a base tensor name."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        config_path, weights_path = self.directory / CONFIG, self.directory / WEIGHTS
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: adapter config not found")
        if not weights_path.is_file():
            raise CheckpointError(f"{weights_path}: adapter weights not found (only safetensors adapters load)")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{config_path}: not a valid adapter config ({e})") from None
        self.weights_path = weights_path
        self._check_config(config)
        self.rank = int(config["r"])
        self.alpha = float(config.get("lora_alpha", self.rank))
        self.rslora = bool(config.get("use_rslora", False))
        self.rank_pattern = dict(config.get("rank_pattern") or {})
        self.alpha_pattern = dict(config.get("alpha_pattern") or {})
        if config.get("fan_in_fan_out"):
            log.warning("%s: fan_in_fan_out=true ignored: every targeted layer is an nn.Linear stored [out, in] "
                        "(peft resets it the same way)", config_path)
        handle = open_safetensors(weights_path)
        self._lora: dict[str, dict[str, torch.Tensor]] = {}     # base weight name -> {"A": ..., "B": ...}
        self._replace: dict[str, torch.Tensor] = {}             # base tensor name -> tensor
        for key in handle.keys():
            if not key.startswith(PREFIX):
                raise CheckpointError(f"{weights_path}: tensor '{key}' does not start with '{PREFIX}'")
            name = key[len(PREFIX):]
            tensor = handle.get_tensor(key)
            m = _LORA.match(name)
            if m:
                self._lora.setdefault(m["module"] + ".weight", {})[m["which"]] = tensor
            elif ".lora_" in name or ".lora_magnitude_vector" in name:
                raise CheckpointError(f"{weights_path}: tensor '{key}' is not a plain LoRA A/B weight (unsupported)")
            else:
                self._replace[name.replace(".modules_to_save.default.", ".")] = tensor
        if not self._lora and not self._replace:
            raise CheckpointError(f"{weights_path}: the adapter holds no LoRA or modules_to_save tensors")
        for name, pair in self._lora.items():
            if set(pair) != {"A", "B"}:
                missing = ({"A", "B"} - set(pair)).pop()
                raise CheckpointError(f"{weights_path}: '{name[:-len('.weight')]}' has no lora_{missing} weight")
            a, b = pair["A"], pair["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise CheckpointError(f"{weights_path}: '{name[:-len('.weight')]}': lora_A {list(a.shape)} and "
                                      f"lora_B {list(b.shape)} do not form a rank-r product")
            expected = self._rank_of(name)
            if a.shape[0] != expected:
                raise CheckpointError(f"{weights_path}: '{name[:-len('.weight')]}' has rank {a.shape[0]}, "
                                      f"{config_path.name} says r = {expected}")
        self._used: set[str] = set()
        self._aliases: dict[str, str] = {}

    @staticmethod
    def _check_config(config: dict) -> None:
        if config.get("peft_type", "LORA") != "LORA":
            raise CheckpointError(f"adapter peft_type {config.get('peft_type')!r} is not supported (LORA only)")
        if config.get("use_dora"):
            raise CheckpointError("DoRA adapters (use_dora=true) are not supported")
        if config.get("bias", "none") != "none":
            raise CheckpointError(f"adapter bias={config.get('bias')!r} is not supported (bias='none' only)")
        if "r" not in config:
            raise CheckpointError("adapter config has no rank 'r'")

    def _pattern_value(self, pattern: dict, name: str, default):
        module = name[:-len(".weight")]
        for key, value in pattern.items():
            if re.search(rf"(^|\.){key}$", module):
                return value
        return default

    def _rank_of(self, name: str) -> int:
        return int(self._pattern_value(self.rank_pattern, name, self.rank))

    def scale(self, name: str) -> float:
        r = self._rank_of(name)
        alpha = float(self._pattern_value(self.alpha_pattern, name, self.alpha))
        return alpha / (r ** 0.5 if self.rslora else r)

    def bind(self, base_names: list[str]) -> None:
        """Match adapter names to the checkpoint's names (either layout); an adapter tensor that matches no
        base tensor is an error, as is an adapter none of whose targets exist."""
        names = set(base_names)
        for adapter_name in [*self._lora, *self._replace]:
            if adapter_name in names:
                self._aliases[adapter_name] = adapter_name
                continue
            other = _in_other_layout(adapter_name)
            if other not in names:
                raise CheckpointError(f"{self.weights_path}: adapter tensor for '{adapter_name}' matches no tensor "
                                      "of the checkpoint (wrong base model?)")
            self._aliases[other] = adapter_name

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The base tensor `name` with the adapter merged in (float32 when merged), or unchanged."""
        adapter_name = self._aliases.get(name)
        if adapter_name is None:
            return tensor
        self._used.add(adapter_name)
        if adapter_name in self._replace:
            new = self._replace[adapter_name]
            if tuple(new.shape) != tuple(tensor.shape):
                raise CheckpointError(f"{self.weights_path}: modules_to_save tensor '{adapter_name}' has shape "
                                      f"{list(new.shape)}, the base '{name}' has {list(tensor.shape)}")
            return new
        a, b = self._lora[adapter_name]["A"], self._lora[adapter_name]["B"]
        if tensor.dim() != 2 or tuple(tensor.shape) != (b.shape[0], a.shape[1]):
            raise CheckpointError(f"{self.weights_path}: LoRA on '{name}' expects a base of shape "
                                  f"[{b.shape[0]}, {a.shape[1]}] (lora_B rows x lora_A columns), found "
                                  f"{list(tensor.shape)}")
        delta = b.float() @ a.float()
        return tensor.float().add_(delta, alpha=self.scale(adapter_name))

    def finish(self) -> None:
        unused = sorted((set(self._lora) | set(self._replace)) - self._used)
        if unused:
            raise CheckpointError(f"{self.weights_path}: adapter tensors never applied: {', '.join(unused[:6])}")
