"""Applying a delivery in the host's own prompt format, as transformers chat-template messages.

Messages are `{"role": ..., "content": [{"type": "text", "text": ...}, {"type": "image", "image": ...}]}`
lists, ready for `processor.apply_chat_template`.

- `pixel_host_messages`: a host that delivers pixels (MuRAG-style). Every memory appears with
  its identifier ("[M3]" for the third retrieved) and its caption (the memory's note); an opened
  memory adds its pixels next to the caption, or instead of it with `replace_caption=True`.
- `text_host_messages`: a text-only host. Its messages stay as they are and the opened images
  are appended to the last user turn, each after its identifier.

DeliverMem's delivery decisions, as options of both:
- D2 (`tag_images=True`): the identifier is also stamped into the opened image's pixels (a
  label box in the top-left corner of a copy; the host's image is untouched) and the prompt
  tells the model that each image carries its tag.
- D3 (`seen_time=True`): every memory states when it was seen: "[seen 2024-03-05]" from its
  date, or "[seen #k of N]" from its append ordinal in the host's store (k = 1 is the oldest)
  when it has no date. Ordinals come from `seen_ordinals` (one per memory, 1-based) and
  `store_size` (N); an undated memory without them is an error, since retrieval order is not
  a time.

Pixels are always the original image the host holds, never the cached thumbnail: memory.image
(a path or PIL image passes through; bytes are decoded), or `images[memory.key]` for a memory
given by its cache key. A key memory whose note is None (its cached note) takes the note from
`notes[memory.key]`.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence

from PIL import Image, ImageDraw, ImageFont

from pixeltriage.delivery.cost import check_delivery
from pixeltriage.engine.types import Memory
from pixeltriage.errors import InvalidMemoryError
from pixeltriage.media.image import open_image, to_rgb
from pixeltriage.media.sources import ImageSource

TAG_NOTE = "Each image shows its memory's tag in its top-left corner; refer to memories by their tags."
ORDINAL_NOTE = "A smaller seen number means the memory was seen longer ago."


def memory_tag(index: int) -> str:
    """The identifier of the memory at 0-based retrieval position `index`: "[M1]", "[M2]", ..."""
    return f"[M{index + 1}]"


def stamp_tag(image: Image.Image, tag: str) -> Image.Image:
    """An RGB copy of `image` with `tag` in a legible label box (white on black) in its top-left corner.

    The font size follows the shorter side (about 1/14 of it, at least 12 px) so that the tag
    stays readable after the answering model's processor down-sizes the image.
    """
    stamped = to_rgb(image).copy()
    width, height = stamped.size
    size = max(12, min(width, height) // 14)
    font = ImageFont.load_default(size=size)
    draw = ImageDraw.Draw(stamped)
    pad = max(2, size // 4)
    left, top, right, bottom = draw.textbbox((pad, pad), tag, font=font)
    box = (0, 0, min(width, right + pad) - 1, min(height, bottom + pad) - 1)
    draw.rectangle(box, fill=(0, 0, 0))
    draw.text((pad, pad), tag, font=font, fill=(255, 255, 255))
    return stamped


def pixel_host_messages(question: str, memories: Sequence[Memory], delivery: Sequence[bool], *,
                        replace_caption: bool = False, tag_images: bool = False,
                        seen_time: bool = False, system: str | None = None,
                        images: Mapping[str, ImageSource] | None = None,
                        notes: Mapping[str, str] | None = None,
                        seen_ordinals: Sequence[int] | None = None,
                        store_size: int | None = None) -> list[dict]:
    """Messages for a host that delivers pixels: one user turn listing every retrieved memory.

    Per memory, in retrieval order: "[Mi]" (+ " [seen ...]" with seen_time), its dialogue when
    not empty, "Caption: <note>" (left out for an opened memory with replace_caption, and when
    the note is empty), then its image when delivery[i] is true. The question comes last.
    """
    opened = check_delivery(delivery, len(memories))
    seen = _seen_labels(memories, seen_ordinals, store_size, [True] * len(memories)) if seen_time \
        else [""] * len(memories)
    content: list[dict] = [_text(_intro(tag_images and any(opened), _uses_ordinals(memories, seen_time)))]
    for i, (memory, is_open) in enumerate(zip(memories, opened)):
        lines = [memory_tag(i) + seen[i]]
        if memory.dialogue:
            lines.append(f"Dialogue: {memory.dialogue}")
        caption = _note(memory, i, notes)
        if caption and not (is_open and replace_caption):
            lines.append(f"Caption: {caption}")
        if is_open:
            lines.append("Image:")
        content.append(_text("\n".join(lines)))
        if is_open:
            content.append(_image(memory, i, images, tag_images))
    content.append(_text(f"Question: {question}"))
    messages = [{"role": "system", "content": [_text(system)]}] if system is not None else []
    messages.append({"role": "user", "content": _merge_text(content)})
    return messages


def text_host_messages(host_text_messages: Sequence[dict], memories: Sequence[Memory],
                       delivery: Sequence[bool], *, tag_images: bool = False,
                       seen_time: bool = False, images: Mapping[str, ImageSource] | None = None,
                       seen_ordinals: Sequence[int] | None = None,
                       store_size: int | None = None) -> list[dict]:
    """A text-only host's messages (copied, never modified) with the opened images appended.

    The images go to the end of the last user turn, each after a text line "[Mi]" (+ seen-time):
    i is the memory's retrieval position, as in the host's own listing. With nothing opened the
    copy is returned unchanged.
    """
    opened = check_delivery(delivery, len(memories))
    messages = copy.deepcopy(list(host_text_messages))  # images are not in text messages
    if not any(opened):
        return messages
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise ValueError("host messages have no user turn to append images to")
    turn = messages[users[-1]]
    content = turn.get("content", "")
    content = [_text(content)] if isinstance(content, str) else list(content)
    seen = _seen_labels(memories, seen_ordinals, store_size, opened) if seen_time else [""] * len(memories)
    shown = [m for m, is_open in zip(memories, opened) if is_open]
    added = [_text(_appended_intro(tag_images, _uses_ordinals(shown, seen_time)))]
    for i, (memory, is_open) in enumerate(zip(memories, opened)):
        if is_open:
            added.append(_text(memory_tag(i) + seen[i] + ":"))
            added.append(_image(memory, i, images, tag_images))
    turn["content"] = content + _merge_text(added)
    return messages


def _intro(tagged: bool, ordinals: bool) -> str:
    return "\n".join(_notes_for_model(tagged, ordinals) + ["Retrieved memories:"])


def _appended_intro(tagged: bool, ordinals: bool) -> str:
    return "\n".join(["Images of the retrieved memories:"] + _notes_for_model(tagged, ordinals))


def _notes_for_model(tagged: bool, ordinals: bool) -> list[str]:
    return ([TAG_NOTE] if tagged else []) + ([ORDINAL_NOTE] if ordinals else [])


def _uses_ordinals(memories: Sequence[Memory], seen_time: bool) -> bool:
    return seen_time and any(not m.date for m in memories)


def _seen_labels(memories: Sequence[Memory], ordinals: Sequence[int] | None,
                 store_size: int | None, shown: list[bool]) -> list[str]:
    """" [seen <date>]" or " [seen #k of N]" per shown memory (D3); "" for the others."""
    if ordinals is not None and len(ordinals) != len(memories):
        raise ValueError(f"seen_ordinals has {len(ordinals)} entries for {len(memories)} memories")
    labels = []
    for i, memory in enumerate(memories):
        if not shown[i]:
            labels.append("")
        elif memory.date:
            labels.append(f" [seen {memory.date}]")
        else:
            labels.append(f" [seen #{_ordinal(ordinals, store_size, i)} of {store_size}]")
    return labels


def _ordinal(ordinals: Sequence[int] | None, store_size: int | None, index: int) -> int:
    if ordinals is None or store_size is None:
        raise InvalidMemoryError("has no date; seen_time needs seen_ordinals and store_size "
                                 "for undated memories", index=index)
    k = ordinals[index]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= store_size:
        raise ValueError(f"seen_ordinals[{index}] must be an int in [1, {store_size}], found {k!r}")
    return k


def _note(memory: Memory, index: int, notes: Mapping[str, str] | None) -> str:
    if memory.note is not None:
        return memory.note
    if memory.key is None:
        return ""
    if notes is None or memory.key not in notes:
        raise InvalidMemoryError(f"note=None asks for the cached note of key {memory.key}; "
                                 f"pass notes={{key: note}}", index=index)
    return notes[memory.key]


def _image(memory: Memory, index: int, images: Mapping[str, ImageSource] | None,
           tag_images: bool) -> dict:
    source = memory.image
    if source is None:
        if images is None or memory.key not in images:
            raise InvalidMemoryError(f"opened memory has only key {memory.key}; pass the original "
                                     f"image as images={{key: image}}", index=index)
        source = images[memory.key]
    if tag_images:
        source = stamp_tag(open_image(source, index), memory_tag(index))
    elif isinstance(source, (bytes, bytearray)):
        source = open_image(source, index)
    elif isinstance(source, os.PathLike):
        source = os.fspath(source)
    return {"type": "image", "image": source}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _merge_text(parts: list[dict]) -> list[dict]:
    """Join runs of adjacent text parts with newlines, so images sit between single text parts."""
    merged: list[dict] = []
    for part in parts:
        if part.get("type") == "text" and merged and merged[-1].get("type") == "text":
            merged[-1] = _text(merged[-1]["text"] + "\n" + part["text"])
        else:
            merged.append(part)
    return merged
