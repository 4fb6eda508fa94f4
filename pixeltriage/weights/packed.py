"""The packed checkpoint: one safetensors file in the engine's fused layout, ready to map and run.

`pixeltriage pack SRC DST [--adapter DIR] [--dtype D]` loads a checkpoint directory the usual way (either
key layout, LoRA merged, fused, cast) and writes every engine tensor under its engine name (`text.layers.3.attn.
in_proj`, `vision.blocks.0.qkv_w`, `head_decision`, ...). The safetensors metadata carries everything else a
Scorer needs, so the file stands alone:

    format = "pixeltriage-packed", format_version = "1", dtype
    config, preprocessor_config, pixeltriage, tokenizer (+ tokenizer_config): the source files' JSON text
    structure: the weight dataclasses' shape (class names and fields), to rebuild EngineWeights
    fingerprint: SHA-256 over every tensor (name, dtype, shape, bytes) and the embedded configs
    vision_fingerprint: the key of cached vision features for this model at this dtype on the CPU

Loading maps the file (copy-on-write) and views each tensor in place: at the packed dtype nothing is copied or
transposed; another dtype costs one cast per tensor. A load reads no matrix: every value was checked (NaN/Inf)
when the file was written; at every load the header, offsets and sizes are checked and the tensors of at most
2^20 elements (norms, A_log, dt_bias, conv taps, biases, head) are read for NaN/Inf (`Scorer._load_packed`), so
a 4 GiB file starts in tens of milliseconds and pages in as the first forward touches it. `verify()`
(`Scorer.load(..., verify=True)`) re-reads everything: NaN/Inf, and the bytes against the fingerprint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from pixeltriage.config import ImageConfig, ModelConfig, TriageConfig
from pixeltriage.errors import CheckpointError
from pixeltriage.weights import layout as layout_mod
from pixeltriage.weights.layout import flatten, tensor_bytes, unflatten
from pixeltriage.weights.pages import drop_file_pages
from pixeltriage.weights.loader import check_finite, load_directory
from pixeltriage.weights.reader import SAFETENSORS_DTYPES, read_safetensors_header, safetensors_header, weight_files

log = logging.getLogger(__name__)

FORMAT = "pixeltriage-packed"
FORMAT_VERSION = "1"
_FROM_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}
# the source files embedded as metadata text (tokenizer_config only when the source has one)
TEXT_FILES = {"config": "config.json", "preprocessor_config": "preprocessor_config.json",
              "pixeltriage": "pixeltriage.json", "tokenizer": "tokenizer.json", "tokenizer_config": "tokenizer_config.json"}
_OPTIONAL_TEXTS = ("tokenizer_config",)


# -- writing ------------------------------------------------------------------------------------------------

def content_fingerprint(tensors: dict[str, torch.Tensor], texts: dict[str, str]) -> str:
    h = hashlib.sha256(b"pixeltriage-packed-v1")
    for key in sorted(texts):
        h.update(f"{key}={len(texts[key])}:".encode())
        h.update(texts[key].encode())
    for name, t in tensors.items():
        h.update(f"{name}|{SAFETENSORS_DTYPES[t.dtype]}|{list(t.shape)}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def vision_fingerprint(weights: layout_mod.EngineWeights, model_cfg: ModelConfig, image_cfg: ImageConfig,
                       triage_cfg: TriageConfig, device_type: str = "cpu") -> str:
    """SHA-256 over the vision weights as loaded (dtype included), the vision config, the image rules, the
    thumbnail size and the device type: what keys cached vision features."""
    tensors = list(flatten(weights.vision)[0].values())               # field order
    h = hashlib.sha256(b"pixeltriage-vision-features-v1")
    meta = {"device": device_type, "vision": dataclasses.asdict(model_cfg.vision), "image": image_cfg.to_dict(),
            "thumbnail": triage_cfg.thumbnail_size, "dtype": sorted({str(t.dtype) for t in tensors})}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def checkpoint_dtype(directory: str | os.PathLike) -> torch.dtype:
    """The dtype a checkpoint directory stores its weights in: the floating dtype holding most of its elements
    (a bfloat16 checkpoint may keep a few float32 vectors), from the safetensors headers alone."""
    elements: dict[str, int] = {}
    for file in weight_files(Path(directory)):
        header, _ = read_safetensors_header(file)
        header.pop("__metadata__", None)
        for entry in header.values():
            if entry.get("dtype") in _FROM_NAME:
                elements[entry["dtype"]] = elements.get(entry["dtype"], 0) + int(np.prod(entry["shape"], dtype=np.int64))
    if not elements:
        raise CheckpointError(f"{directory}: no float32, bfloat16 or float16 weights found")
    return _FROM_NAME[max(elements, key=elements.get)]


def narrowing(source: torch.dtype, target: torch.dtype) -> str | None:
    """Why writing `source` weights as `target` loses information, or None when it does not."""
    if source == target or target == torch.float32:
        return None
    if source == torch.float32:
        return f"rounds every float32 weight to {str(target).removeprefix('torch.')}"
    return "float16 has a narrower range than bfloat16" if target == torch.float16 else \
        "bfloat16 keeps fewer mantissa bits than float16"


def pack_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, adapter: str | os.PathLike | None = None,
                    dtype: torch.dtype | None = None, progress: bool = False) -> dict:
    """Write the packed file `dst` from the checkpoint directory `src`; returns its metadata (no tensors).

    dtype: of the packed weights; None (the default) keeps the checkpoint's own (`checkpoint_dtype`). A dtype that
    loses information (float32 -> bfloat16, say) is logged as a warning: its scores are the scores of a
    checkpoint at that dtype, not of the directory at its own."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise CheckpointError(f"{src}: checkpoint directory not found")
    if dst.exists() and dst.is_dir():
        raise CheckpointError(f"{dst}: is a directory; the packed checkpoint is a single file")
    stored = checkpoint_dtype(src)
    dtype = stored if dtype is None else dtype
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"cannot pack to {dtype}; choose one of {sorted(str(d) for d in SAFETENSORS_DTYPES)}")
    lost = narrowing(stored, dtype)
    if lost is not None:
        log.warning("packing %s (stored as %s) as %s %s; its scores will match the directory loaded at %s, not at "
                    "%s", src, _name(stored), _name(dtype), lost, _name(dtype), _name(stored))
    _say(progress, f"loading {src}" + (f" with adapter {adapter}" if adapter else "") + f" as {dtype}")
    ckpt = load_directory(src, dtype, torch.device("cpu"), Path(adapter) if adapter is not None else None,
                          verify=True)                                      # every value checked once, here
    tensors, structure = flatten(ckpt.weights)
    texts = {key: (src / name).read_text(encoding="utf-8") for key, name in TEXT_FILES.items()
             if key not in _OPTIONAL_TEXTS or (src / name).is_file()}
    _say(progress, f"fingerprinting {len(tensors)} tensors")
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "dtype": SAFETENSORS_DTYPES[dtype],
                "structure": json.dumps(structure, separators=(",", ":")),
                "fingerprint": content_fingerprint(tensors, texts),
                "vision_fingerprint": vision_fingerprint(ckpt.weights, ckpt.model_config, ckpt.image_config,
                                                         ckpt.triage_config),
                **texts}
    _write(dst, tensors, metadata, progress)
    return {k: v for k, v in metadata.items() if k not in texts and k != "structure"}


def _write(dst: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], progress: bool) -> None:
    """A valid safetensors file (no holes between tensors) whose tensors can all be viewed in place: the data
    starts 64-byte aligned and wider dtypes come first, so every offset is a multiple of its element size."""
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    prefix, offset = safetensors_header([(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in order], metadata,
                                        align=64)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.tmp-", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(prefix)
            bar = _progress(progress, offset, dst.name)
            for name in order:
                data = tensor_bytes(tensors[name])
                f.write(data)
                bar(len(data))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _say(progress, f"wrote {dst} ({(len(prefix) + offset) / 2**20:,.1f} MiB)")


# -- reading ------------------------------------------------------------------------------------------------

class PackedCheckpoint:
    """A packed file, mapped: its configs, tokenizer text, fingerprints and engine weights."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            header, self._data_start = read_safetensors_header(self.path)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; a System One checkpoint is a directory or a file written by "
                                  "`pixeltriage pack`") from None
        meta = header.pop("__metadata__", None) or {}
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{self.path}: not a packed System One checkpoint (metadata format "
                                  f"{meta.get('format')!r}); pass a checkpoint directory or a file written by "
                                  "`pixeltriage pack`")
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{self.path}: packed format version {meta.get('format_version')!r} is not "
                                  f"supported (this version reads {FORMAT_VERSION})")
        for key in [k for k in TEXT_FILES if k not in _OPTIONAL_TEXTS] + ["structure", "fingerprint", "dtype"]:
            if key not in meta:
                raise CheckpointError(f"{self.path}: packed metadata lacks '{key}'")
        self.metadata = meta
        self.header = header
        try:
            self.model_config = ModelConfig.from_dict(json.loads(meta["config"]), f"{self.path}:config")
            self.image_config = ImageConfig.from_dict(json.loads(meta["preprocessor_config"]),
                                                      f"{self.path}:preprocessor_config")
            self.triage_config = TriageConfig.from_dict(json.loads(meta["pixeltriage"]), f"{self.path}:pixeltriage")
            self.structure = json.loads(meta["structure"])
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.path}: packed metadata is not valid JSON ({e})") from None
        self.fingerprint = meta["fingerprint"]
        self.dtype = _FROM_NAME.get(meta["dtype"])
        if self.dtype is None:
            raise CheckpointError(f"{self.path}: packed dtype {meta['dtype']!r} unknown")

    @property
    def tokenizer_json(self) -> str:
        return self.metadata["tokenizer"]

    def vision_fingerprint(self, dtype: torch.dtype) -> str | None:
        return self.metadata.get("vision_fingerprint") if dtype == self.dtype else None

    def verify(self, mapped=None) -> None:
        """Read every value once: NaN/Inf anywhere, bytes that no longer hash to the fingerprint written at pack
        time (the file was modified or damaged since), or a vision_fingerprint that is not its vision weights', is
        a CheckpointError naming the file. `mapped`: this file's `mapped()` weights, when the caller has them.
        (It checks the file as it is now: one modified after this check is mapped as modified.)"""
        weights = self.mapped() if mapped is None else mapped
        check_finite(weights, self.path)
        tensors, _ = flatten(weights)
        texts = {key: self.metadata[key] for key in TEXT_FILES if key in self.metadata}
        if content_fingerprint(tensors, texts) != self.fingerprint:
            raise CheckpointError(f"{self.path}: contents do not match the fingerprint written at pack time; the file "
                                  "was modified or damaged after packing (pack it again)")
        stored = self.metadata.get("vision_fingerprint")     # keys cached vision features: it must be this model's
        if stored is not None and stored != vision_fingerprint(weights, self.model_config, self.image_config,
                                                               self.triage_config):
            raise CheckpointError(f"{self.path}: its vision_fingerprint does not match its vision weights; cached "
                                  "vision features would be looked up under the wrong key (pack it again)")

    def mapped(self):
        """EngineWeights viewing the mapped file (copy-on-write) at the packed dtype: no tensor is copied."""
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            buf = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        raw = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))      # keeps `buf` alive through its base
        tensors = {}
        for name, info in self.header.items():
            t_dtype = _FROM_NAME.get(info.get("dtype"))
            begin, end = (self._data_start + o for o in info["data_offsets"])
            shape = tuple(info["shape"])
            if t_dtype is None or end > size or begin > end:
                raise CheckpointError(f"{self.path}: tensor '{name}' has a bad entry (dtype {info.get('dtype')}, "
                                      f"bytes {begin}..{end} of a {size}-byte file); the file is truncated or corrupt")
            nbytes = int(np.prod(shape, dtype=np.int64)) * t_dtype.itemsize
            if end - begin != nbytes:
                raise CheckpointError(f"{self.path}: tensor '{name}' spans {end - begin} bytes, its shape {list(shape)} "
                                      f"needs {nbytes}")
            view = raw[begin:end]
            tensors[name] = view.view(t_dtype).view(shape) if begin % t_dtype.itemsize == 0 else \
                view.clone().view(t_dtype).view(shape)
        return unflatten(self.structure, tensors, source=str(self.path))

    def weights(self, dtype: torch.dtype, device: torch.device, mapped=None):
        """The weights at `dtype` on `device`: the `mapped()` views themselves at the packed dtype on the CPU, else
        one cast per tensor; the fields the layout keeps in float32 (`layout.FLOAT32_FIELDS`) stay float32."""
        mapped = self.mapped() if mapped is None else mapped
        if dtype == self.dtype and device.type == "cpu":
            return mapped
        tensors, structure = flatten(mapped)
        for name, t in tensors.items():
            target = layout_mod.field_dtype(name.rsplit(".", 1)[-1], dtype)
            if t.dtype != target or device.type != "cpu":
                tensors[name] = t.to(device=device, dtype=target)
                drop_file_pages([t])            # a copy now: the file's pages of it are not read again
        return unflatten(structure, tensors, source=str(self.path))


def _say(on: bool, message: str) -> None:
    if on:
        print(message, file=sys.stderr, flush=True)


def _progress(on: bool, total: int, label: str):
    if not on:
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda n: None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {label}", file=sys.stderr, leave=True)

    def update(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()
    return update


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
