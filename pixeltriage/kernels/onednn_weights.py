"""Weights kept in oneDNN's blocked layout (`Packed`), or in row parts some of which are (`Rows`): the types that
`kernels.linear` runs and the forward slices (`row_slice`). Which weights are kept so, when, and why:
`kernels.prepack`."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


class Packed:
    """A bf16 or float32 weight [N, K] reordered for oneDNN's linear primitive; `packed(x)` is x @ weight^T, as
    `F.linear`."""

    __slots__ = ("weight", "shape", "dtype", "device")

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu":
            raise ValueError(f"Packed takes a 2-D bf16 or float32 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        self.weight = _reorder(weight)            # opaque: oneDNN's blocked layout, read by the primitive only
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, attr: str = "none",
                 algorithm: str = "") -> torch.Tensor:
        """x @ weight^T + bias, then oneDNN's post-op `attr` (with `algorithm`) in the primitive's epilogue."""
        if x.dtype != self.dtype or x.shape[-1] != self.shape[1]:
            raise ValueError(f"input {tuple(x.shape)} {x.dtype} for a packed weight {tuple(self.shape)} {self.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, attr, [], algorithm)

    def plain(self) -> torch.Tensor:
        """The weight in its plain [N, K] layout again (a copy): for the reference paths and fingerprints."""
        return self.weight.to_dense()

    def __repr__(self) -> str:
        return f"Packed({list(self.shape)}, {self.dtype})"


class Rows:
    """A weight the forward uses in row ranges (`row_slice`): each range at `bounds` kept as given, packed or plain
    (parts: the same order). `rows(x)` over all of them is their products side by side."""

    __slots__ = ("bounds", "parts", "shape", "dtype", "device")

    def __init__(self, bounds: Sequence[int], parts: Sequence["Packed | torch.Tensor"]) -> None:
        if len(bounds) != len(parts) + 1 or bounds[0] != 0 or any(e <= b for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"Rows: bounds {list(bounds)} for {len(parts)} parts")
        for (b, e), part in zip(zip(bounds, bounds[1:]), parts):
            if part.shape[0] != e - b:
                raise ValueError(f"Rows: a part of {part.shape[0]} rows at [{b}, {e})")
        self.bounds, self.parts = list(bounds), list(parts)
        self.shape = torch.Size([bounds[-1], parts[0].shape[1]])
        self.dtype, self.device = parts[0].dtype, parts[0].device

    def part(self, start: int, stop: int) -> "Packed | torch.Tensor":
        """The part covering rows [start, stop) exactly; ValueError for any other range."""
        for (b, e), part in zip(zip(self.bounds, self.bounds[1:]), self.parts):
            if (b, e) == (start, stop):
                return part
        raise ValueError(f"rows [{start}, {stop}) of a weight kept in parts at {self.bounds}")

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([part(x) if isinstance(part, Packed) else F.linear(x, part) for part in self.parts], dim=-1)
        return out if bias is None else out + bias

    def plain(self) -> torch.Tensor:
        """The whole weight in its plain layout (a copy)."""
        return torch.cat([part.plain() if isinstance(part, Packed) else part for part in self.parts])

    def __repr__(self) -> str:
        return f"Rows({self.bounds}, {self.parts})"


def packed_label(*weights) -> str:
    """" packed" where any of a layer's `weights` is kept in oneDNN's layout, else "": for the names of records
    measured on the layer (its row blocks, `kernels.linear.in_row_blocks`), whose choice may differ between
    layouts."""
    return " packed" if any(isinstance(w, (Packed, Rows)) for w in weights) else ""


def row_slice(weight: "torch.Tensor | Rows", start: int, stop: int | None = None) -> "torch.Tensor | Packed":
    """Rows [start, stop) of a weight: a view of a tensor, or the part of a `Rows` kept at that range."""
    if isinstance(weight, Rows):
        return weight.part(start, weight.shape[0] if stop is None else stop)
    return weight[start:stop]
