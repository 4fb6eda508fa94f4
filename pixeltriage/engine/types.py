"""The engine's value types: what a host passes in (Memory) and gets back (Scores)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pixeltriage.errors import InvalidMemoryError
from pixeltriage.media.sources import ImageSource


@dataclass(frozen=True)
class Memory:
    """One retrieved memory: an image (or a write-time cache key), its note, dialogue and session date.

    `note=None` means "the cached note" for a memory given by `key`, and "" otherwise.
    """

    image: ImageSource | None = None
    note: str | None = None
    dialogue: str = ""
    date: str = ""
    key: str | None = None

    def __post_init__(self):
        if (self.image is None) == (self.key is None):
            raise TypeError("Memory needs exactly one of image=... or key=...")


@dataclass(frozen=True)
class Scores:
    """System One's outputs for one question.

    p_vis: probability that answering needs any retrieved image's pixels.
    gains: per memory, sigmoid(l_i - l_none) of the gain question (retrieval order).
    relevance: per memory, its share of the relevance softmax over (memories + none).
    relevance_none: the `none` share of that softmax.
    """

    p_vis: float
    gains: list[float] = field(default_factory=list)
    relevance: list[float] = field(default_factory=list)
    relevance_none: float = 1.0

    def __len__(self) -> int:
        return len(self.gains)


def memory_list(memories) -> list[Memory]:
    """`memories` as a list, each checked to be a `Memory` (InvalidMemoryError naming the first that is not)."""
    memories = list(memories)
    for i, m in enumerate(memories):
        if not isinstance(m, Memory):
            raise InvalidMemoryError(f"expected a pixeltriage.Memory, got {type(m).__name__}", i)
    return memories


def user_text(value, what: str, index: int | None) -> str:
    """User text as a str the tokenizer accepts: bytes are decoded as UTF-8 and a str holding lone surrogates
    (e.g. from a surrogateescape'd file name) is repaired: each lone surrogate becomes U+FFFD, a split pair is joined."""
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if not isinstance(value, str):
        raise InvalidMemoryError(f"{what} must be a string, got {type(value).__name__}", index)
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-16", errors="surrogatepass").decode("utf-16", errors="replace")
    return value
