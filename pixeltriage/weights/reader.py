"""Reading safetensors checkpoints: single files or index + shards, memory-mapped, every tensor accounted for."""
from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pixeltriage.errors import CheckpointError

log = logging.getLogger(__name__)

# Present in real checkpoints, deliberately never loaded: System One computes no vocabulary logits.
SKIPPED = re.compile(r"^(lm_head\.weight|mtp\..*|model\.mtp\..*)$")
# The dtypes the engine reads and writes, by their safetensors names.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def safetensors_header(entries, metadata: dict[str, str] | None = None, align: int = 8) -> tuple[bytes, int]:
    """The prefix of a safetensors file (8-byte length + JSON header) for tensors written back to back, in order.

    entries: (name, dtype, shape) per tensor. The header is space-padded so the data starts at a multiple of
    `align` bytes. Returns (prefix, total data bytes)."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % align)
    return struct.pack("<Q", len(blob)) + blob, offset


class TensorSource:
    """Names -> tensors across one or more safetensors files; tracks which names were consumed."""

    def __init__(self, files: list[Path], adapter=None):
        self.adapter = adapter          # a LoraAdapter merged into tensors as they are taken, or None
        self._files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._consumed: set[str] = set()
        for path in files:
            handle = open_safetensors(path)
            self._handles[path] = handle
            for name in handle.keys():
                if name in self._files:
                    raise CheckpointError(f"{path}: tensor '{name}' also stored in {self._files[name]}")
                self._files[name] = path

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def file_of(self, name: str) -> Path:
        return self._files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._files[name]].get_slice(name).get_shape())

    def take(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor `name` (memory-mapped where possible), checked against `shape`; consumed once."""
        if name not in self._files:
            raise CheckpointError(f"missing tensor '{name}' (expected shape {list(shape) if shape else '?'})")
        if name in self._consumed:
            raise CheckpointError(f"tensor '{name}' consumed twice")
        path = self._files[name]
        found = self.shape(name)
        if shape is not None and tuple(found) != tuple(shape):
            raise CheckpointError(f"{path}: tensor '{name}' expected shape {list(shape)}, found {list(found)}")
        try:
            tensor = self._handles[path].get_tensor(name)
        except (SafetensorError, RuntimeError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read tensor '{name}': {e}") from None
        self._consumed.add(name)
        return self.adapter.apply(name, tensor) if self.adapter is not None else tensor

    def finish(self) -> None:
        """Every tensor must have been consumed or be deliberately skipped."""
        left = [n for n in self._files if n not in self._consumed]
        skipped = [n for n in left if SKIPPED.match(n)]
        unknown = [n for n in left if not SKIPPED.match(n)]
        if skipped:
            log.debug("skipped %d tensors on purpose: %s", len(skipped), ", ".join(sorted(skipped)))
        if unknown:
            shown = ", ".join(f"'{n}' ({self._files[n].name})" for n in sorted(unknown)[:8])
            more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
            raise CheckpointError(f"unknown tensors in checkpoint: {shown}{more}")
        if self.adapter is not None:
            self.adapter.finish()

    def close(self) -> None:
        self._handles.clear()


def open_safetensors(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def weight_files(directory: Path) -> list[Path]:
    """The model's weight files: model.safetensors, or the shards an index names."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if os.sep in shard or shard.startswith(".."):
                raise CheckpointError(f"{index}: shard name '{shard}' must be a file in the checkpoint directory")
            if not (directory / shard).is_file():
                raise CheckpointError(f"{index}: names shard '{shard}', which does not exist")
        return [directory / s for s in shards]
    if single.is_file():
        return [single]
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(the JSON header, metadata included; the byte offset where the data starts); CheckpointError naming the
    file when it is not a readable safetensors file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short for one)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 256 * 2**20):
                raise CheckpointError(f"{path}: not a safetensors file, or a truncated one (its first 8 bytes give "
                                      f"a header of {n} bytes; the file has {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not an object")
    return header, 8 + n


def tensor_numels(path: Path) -> dict[str, int]:
    """Element count of every tensor stored in one safetensors file, from its header alone."""
    header, _ = read_safetensors_header(path)
    header.pop("__metadata__", None)
    return {name: math.prod(entry["shape"]) for name, entry in header.items()}
