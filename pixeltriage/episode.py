"""Episode files (a question and its retrieved memories, as JSON) and the built-in sample episode.

Episode JSON (one object, or a list of such objects):

    {
      "question": "What colour was the orchid's stem?",
      "memories": [
        {"image": "photos/orchid.jpg", "note": "a potted orchid", "dialogue": "look what I bought",
         "date": "2026-03-02"},
        {"key": "3f5a...e1", "dialogue": "...", "date": "..."}
      ]
    }

Both fields are required (`"memories": []` is a question with no memories); other fields are refused, so a
misspelt one is not silently ignored. `image` is a local file path, relative to the episode file's folder (to the
working directory for an episode read from standard input); `key` names an image stored in a write-time cache
(`--cache DB`). `note`, `dialogue` and `date` are optional strings; a memory given by `key` without a `note` uses
the note cached with its image.
"""
from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import TextIO

from PIL import Image, ImageDraw

from pixeltriage.config import read_json
from pixeltriage.engine.types import Memory
from pixeltriage.errors import PixelTriageError


class EpisodeError(PixelTriageError, ValueError):
    """An episode file is missing, not JSON, or not in the documented shape."""


EPISODE_FIELDS = {"question", "memories"}
MEMORY_FIELDS = {"image", "key", "note", "dialogue", "date"}


def load_episodes(source: str | os.PathLike | TextIO) -> list[tuple[str, list[Memory]]]:
    """Every episode of a file (or of a text stream such as sys.stdin, whose image paths are relative to the
    working directory), checked before anything is scored: the shape, the field types and that every image file
    exists. Errors are EpisodeError naming the file, the episode (when the file holds a list) and the memory,
    numbered from 1."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        data, name, base = read_json(path, EpisodeError, (dict, list)), str(path), path.parent
    else:
        name = getattr(source, "name", "<stream>")
        name, base = "standard input" if name == "<stdin>" else name, Path.cwd()
        try:
            data = json.loads(source.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EpisodeError(f"{name}: not valid JSON ({e})") from None
        if not isinstance(data, (dict, list)):
            raise EpisodeError(f"{name}: expected a JSON object or array, found {type(data).__name__}")
    if isinstance(data, dict):
        return [parse_episode(data, base, name)]
    if not data:
        raise EpisodeError(f"{name}: an empty list holds no episode to score")
    return [parse_episode(item, base, f"{name}, episode {i} of {len(data)}") for i, item in enumerate(data, start=1)]


def parse_episode(data, base: Path, source: str) -> tuple[str, list[Memory]]:
    if not isinstance(data, dict) or not isinstance(data.get("question"), str):
        raise EpisodeError(f"{source}: expected an object with a string 'question'")
    unknown = set(data) - EPISODE_FIELDS
    if unknown:
        raise EpisodeError(f"{source} has unknown fields {sorted(unknown)} (known: {sorted(EPISODE_FIELDS)})")
    if "memories" not in data:
        raise EpisodeError(f"{source}: no 'memories' (a list; [] for a question without memories)")
    raw = data["memories"]
    if not isinstance(raw, list):
        raise EpisodeError(f"{source}: 'memories' must be a list")
    memories = []
    for number, m in enumerate(raw, start=1):
        where = f"{source}: memory {number}"
        if not isinstance(m, dict):
            raise EpisodeError(f"{where} must be an object")
        unknown = set(m) - MEMORY_FIELDS
        if unknown:
            raise EpisodeError(f"{where} has unknown fields {sorted(unknown)} (known: {sorted(MEMORY_FIELDS)})")
        for field in sorted(MEMORY_FIELDS):
            if field in m and m[field] is not None and not isinstance(m[field], str):
                raise EpisodeError(f"{where}: '{field}' must be a string, found {type(m[field]).__name__}")
        if (m.get("image") is None) == (m.get("key") is None):
            raise EpisodeError(f"{where} needs exactly one of 'image' (a file path) or 'key' (a cache key)")
        image = None
        if m.get("image") is not None:
            image = base / m["image"]
            if not image.is_file():
                relative = (" (paths in an episode read from standard input are relative to the working "
                            "directory)" if source.startswith("standard input") and not Path(m["image"]).is_absolute()
                            else "")
                raise EpisodeError(f"{where}: image file {image} not found"
                                   + (" (it is a directory)" if image.is_dir() else relative))
            image = str(image)
        memories.append(Memory(image=image, key=m.get("key"), note=m.get("note"),
                               dialogue=m.get("dialogue") or "", date=m.get("date") or ""))
    return data["question"], memories


SAMPLE_ITEMS = [
    ("orchid", "a potted orchid on a windowsill", "look at the orchid I bought at the market", (70, 40, 160)),
    ("chime", "a wind chime with blue chimes", "my neighbour hung this up", (40, 90, 200)),
    ("receipt", "a shop receipt", "keeping this for the refund", (235, 235, 225)),
    ("mug", "a red mug with a logo", "new mug for the office", (200, 40, 40)),
    ("bicycle", "a green bicycle by a fence", "finally fixed the bike", (40, 150, 60)),
    ("shelf", "a bookshelf in a living room", "reorganised everything today", (140, 100, 60)),
    ("lamp", "a desk lamp", "this lamp was on sale", (230, 200, 60)),
    ("cat", "a grey cat on a sofa", "she found the sunny spot again", (120, 120, 125)),
    ("chart", "a bar chart of monthly costs", "budget for the trip", (250, 250, 250)),
    ("poster", "a concert poster", "we should go to this", (20, 20, 60)),
]


def sample_image(index: int, color: tuple[int, int, int], seed: int = 0) -> Image.Image:
    """A synthetic photo-like picture: a background, shapes and a caption-like stripe, varied sizes."""
    rng = random.Random(seed * 1000 + index)
    width, height = rng.choice([(640, 480), (480, 640), (800, 600), (512, 512), (1024, 576)])
    img = Image.new("RGB", (width, height), color)
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        r = rng.randrange(20, max(21, min(width, height) // 4))
        fill = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            draw.ellipse((x0 - r, y0 - r, x0 + r, y0 + r), fill=fill)
        else:
            draw.rectangle((x0 - r, y0 - r // 2, x0 + r, y0 + r // 2), fill=fill)
    for x in range(0, width, 8):
        y = int(height * 0.8 + 10 * math.sin(x / 30 + index))
        draw.line((x, y, x + 8, y), fill=(255, 255, 255), width=3)
    draw.text((10, 10), f"memory {index + 1}", fill=(0, 0, 0))
    return img


def sample_episode(seed: int = 0) -> tuple[str, list[Memory]]:
    """The built-in episode: a question and ten memories with synthetic images, notes and dates."""
    memories = [
        Memory(image=sample_image(i, color, seed), note=note, dialogue=dialogue, date=f"2026-0{1 + i // 3}-{10 + i:02d}")
        for i, (_, note, dialogue, color) in enumerate(SAMPLE_ITEMS)
    ]
    return "What colour was the stem of the orchid I bought at the market?", memories
