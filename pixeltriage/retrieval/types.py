"""What a search returns, in plain Python: importing this module (as the serve client does) costs no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Box(NamedTuple):
    """A pixel rectangle [left, right) x [top, bottom), PIL's crop order."""

    left: int
    top: int
    right: int
    bottom: int


@dataclass(frozen=True)
class Hit:
    """One retrieved image: its cache key, its score (the cosine similarity of the question and the winning
    region), the winning region's name and its box in the displayed image (None when the cache does not know
    the image's size)."""

    key: str
    score: float
    region: str
    box: Box | None

    def to_dict(self) -> dict:
        return {"key": self.key, "score": self.score, "region": self.region,
                "box": None if self.box is None else list(self.box)}
