"""Every benchmark's questions and memories, from this one module, seeded (the same arguments give the same bits).

- `packed_episode`: one question whose memories (336-px photos, dialogue) pack to about a target state length, with
  that state: `bench cpu`, `bench workspace`, gpu_check and the pytest-benchmark suite time forwards of it;
- `episodes`: a stream of questions over photos of varied sizes (`PHOTO_SIZES`) with notes, dialogue and dates:
  `bench latency` (0 to 20 memories a question, the images in memory), `bench serve` and `bench soak` (a fixed
  number, the images as JPEG bytes, as a client sends them) and gpu_check's service; `request_body`: one of them as
  the /v1/score body a client sends;
- `photos`: such photos alone (`bench latency`'s answering prefill);
- `camera_jpegs` and `retrieval_questions`: `bench retrieval`'s photos to index and questions to search with;
- `first_score_question`: `bench load`'s first score, the sample episode's question over its first memory.
"""
from __future__ import annotations

import io
import json
import random
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from pixeltriage.engine.types import Memory
from pixeltriage.episode import sample_episode
from pixeltriage.media.policy import THUMBNAIL_SIDE

if TYPE_CHECKING:
    from pixeltriage.engine.state import State

WORDS = ("the market stall had orchids in painted pots and a vendor who talked about watering them twice a week "
         "while a cat slept by the crates of lemons and someone asked about the price of the blue vase").split()
# (width, height) of the photos, screenshots and scans of `episodes` and `photos`
PHOTO_SIZES = [(640, 480), (480, 640), (1024, 768), (800, 800), (336, 336), (1280, 720), (300, 200), (1920, 1080),
               (720, 1280), (512, 384)]
JPEG_QUALITY = 85                # `episodes(..., jpeg=True)`
RETRIEVAL_QUESTIONS = ["what did the sticker on the laptop say", "which shop was the receipt from",
                       "the red mug on the desk", "where was the bike parked",
                       "what time does the poster say the concert starts", "the label on the jar in the fridge",
                       "how much was the parking ticket", "the dog at the beach"]


# -- one question at a target state length ---------------------------------------------------------------------------
def market_photo(index: int, size: int = THUMBNAIL_SIDE) -> Image.Image:
    """The `index`-th photo of `packed_episode`: a square of one colour with eight ellipses, drawn from the index."""
    img = Image.new("RGB", (size, size), ((37 * index) % 256, (91 * index) % 256, (53 * index) % 256))
    draw = ImageDraw.Draw(img)
    for j in range(8):
        x, y = (index * 41 + j * 67) % size, (index * 29 + j * 83) % size
        draw.ellipse((x, y, x + 60, y + 40), fill=((x * 3) % 256, (y * 5) % 256, (j * 30) % 256))
    return img


class PackedEpisode(NamedTuple):
    question: str
    memories: list[Memory]
    images: list              # the memories' preprocessed images (StatePacker.images), for more packs
    state: "State"            # question and memories packed


def packed_episode(packer, num_memories: int = 10, target_tokens: int = 2300) -> PackedEpisode:
    """A question and `num_memories` memories whose packed state has about `target_tokens` tokens, with their
    preprocessed images and that state (found by packing, so nobody needs to preprocess or pack them again).
    packer: the Scorer's StatePacker (`Scorer.packer`)."""
    question = "Which of the photos I shared shows the blue vase, and what colour was the orchid's pot?"
    photos = [market_photo(i) for i in range(num_memories)]

    def episode(words_per_memory: int):
        return question, [Memory(image=photos[i], note=f"photo {i + 1} from the market",
                                 dialogue=" ".join(WORDS[(i + j) % len(WORDS)] for j in range(words_per_memory)),
                                 date=f"2026-03-{i + 1:02d}") for i in range(num_memories)]

    images = packer.images(episode(0)[1])             # the same photos at every step: preprocessed once
    lo, hi, state = 0, 400, None
    while lo < hi:                                         # the most words that stay within target_tokens
        mid = (lo + hi + 1) // 2
        packed = packer.pack(*episode(mid), images=images)
        if packed.num_tokens <= target_tokens:
            lo, state = mid, packed
        else:
            hi = mid - 1
    question, memories = episode(lo)
    if state is None:                                      # not even zero words fit: the shortest state
        state = packer.pack(question, memories, images=images)
    return PackedEpisode(question, memories, images, state)


# -- a stream of questions ---------------------------------------------------------------------------------------------
def photo(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    """A photo of `size`: one colour and five rectangles, drawn from `rng`."""
    img = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(5):
        x, y = rng.randrange(size[0]), rng.randrange(size[1])
        draw.rectangle((x, y, x + size[0] // 4, y + size[1] // 5), fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def photos(count: int, seed: int = 0) -> list[Image.Image]:
    """`count` photos of sizes drawn from PHOTO_SIZES."""
    rng = random.Random(seed)
    return [photo(rng, rng.choice(PHOTO_SIZES)) for _ in range(count)]


def _jpeg(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def episodes(count: int, memories: int, seed: int = 0, *, up_to: bool = False,
             jpeg: bool = False) -> list[tuple[str, list[Memory]]]:
    """`count` seeded (question, memories): each question with `memories` memories (up_to: a number drawn from 0 to
    `memories` per question), each memory a photo of a size from PHOTO_SIZES, a note, 5 to 60 words of dialogue and
    a date. jpeg: the photos as JPEG bytes (a request body's), else as images."""
    rng = random.Random(seed)
    out = []
    for q in range(count):
        n = rng.randint(0, memories) if up_to else memories
        mems = []
        for i in range(n):
            img = photo(rng, rng.choice(PHOTO_SIZES))
            mems.append(Memory(image=_jpeg(img) if jpeg else img, note=f"picture {i + 1}",
                               dialogue=" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))),
                               date=f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"))
        out.append((f"question {q}: which picture shows the {rng.choice(WORDS)}?", mems))
    return out


def request_body(question: str, memories: list[Memory], request_id: str) -> bytes:
    """The /v1/score body the client sends for (question, memories), with `id`."""
    from pixeltriage.serve.client import question_body      # the serve extra's (httpx), for the benches that serve

    return json.dumps(question_body(question, memories, id=request_id)).encode()


# -- region retrieval ------------------------------------------------------------------------------------------------
def camera_jpegs(count: int, size: tuple[int, int], seed: int = 0) -> list[bytes]:
    """JPEG photos (quality 90) with smooth colour fields and a few shapes: a camera photo's decode cost."""
    rng = np.random.default_rng(seed)
    width, height = size
    out = []
    for _ in range(count):
        field = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        draw = ImageDraw.Draw(field)
        for _ in range(6):
            x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
            w, h = int(rng.integers(8, width // 4)), int(rng.integers(8, height // 4))
            draw.rectangle([x, y, x + w, y + h], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        buffer = io.BytesIO()
        field.save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def retrieval_questions(count: int) -> list[str]:
    """`count` questions to search with, RETRIEVAL_QUESTIONS in turn."""
    return [RETRIEVAL_QUESTIONS[i % len(RETRIEVAL_QUESTIONS)] for i in range(count)]


# -- start-up ----------------------------------------------------------------------------------------------------------
def first_score_question() -> tuple[str, list[Memory]]:
    """The built-in sample episode's question over its first memory alone."""
    question, memories = sample_episode()
    return question, memories[:1]
