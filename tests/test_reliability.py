"""Reliability and security, end to end through the Scorer: whatever a user stores either scores or raises the
documented error naming the memory; hostile text never changes the state's structure; threads agree with serial
calls; no pickle, no network, no remote code.

The counts docs/reliability.md reports are the sizes of the case lists below (and of tests/media/test_image.py,
tests/engine/test_patches.py, tests/store/test_cache.py), asserted here so the two cannot drift silently.
"""
from __future__ import annotations

import io
import math
import re
import socket
import struct
import threading
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from pixeltriage import InvalidMemoryError, Memory, NonFiniteScoreError, Scorer
from pixeltriage.errors import CheckpointError

PACKAGE = Path(__file__).resolve().parents[1] / "pixeltriage"
QUESTION = "Which picture shows the receipt?"


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    return Scorer.load(tiny_checkpoint)


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (its pixel data is a stub)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(Image.new("RGB", (120, 60), (10, 120, 200)), "JPEG", exif=exif)


def animated_gif() -> bytes:
    frames = [Image.new("P", (48, 32), i * 40) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    return buf.getvalue()


def cmyk_jpeg() -> bytes:
    return encoded(Image.new("CMYK", (64, 40), (0, 128, 255, 10)), "JPEG")


PNG = encoded(Image.radial_gradient("L").convert("RGB").resize((80, 60)), "PNG")
JPEG = encoded(Image.radial_gradient("L").convert("RGB").resize((80, 60)), "JPEG")

# name -> (image source, None when it must score, else a regex the InvalidMemoryError reason must contain)
IMAGE_CASES = {
    "corrupt bytes": (lambda: b"\x00\x01garbage" * 10, "not a recognised image"),
    "truncated PNG": (lambda: PNG[: len(PNG) // 2], "cannot decode"),
    "truncated JPEG": (lambda: JPEG[: len(JPEG) // 2], "cannot (decode|read image header)"),
    "zero bytes": (lambda: b"", "empty"),
    "zero-size image": (lambda: Image.new("RGB", (0, 0)), "zero size"),
    "1x1": (lambda: Image.new("RGB", (1, 1), (255, 0, 0)), None),
    "20000x20000 header": (lambda: png_declaring(20000, 20000), "decompression bomb"),
    "bomb 12000x12000 header": (lambda: png_declaring(12000, 12000), "decompression bomb"),
    "16-bit PNG": (lambda: encoded(Image.linear_gradient("L").resize((70, 50)).convert("I;16"), "PNG"), None),
    "CMYK JPEG": (cmyk_jpeg, None),
    "palette": (lambda: Image.new("RGB", (50, 40), (9, 200, 9)).convert("P"), None),
    "RGBA": (lambda: Image.new("RGBA", (90, 60), (200, 30, 30, 100)), None),
    "LA": (lambda: Image.new("LA", (40, 90), (100, 50)), None),
    "EXIF-rotated JPEG": (exif_rotated, None),
    "animated GIF": (animated_gif, None),
    "extreme aspect 1000x1": (lambda: Image.new("RGB", (1000, 1)), "aspect ratio"),
    "URL": (lambda: "https://example.com/cat.png", "URLs are not accepted"),
    "not an image type": (lambda: 3.5, "unsupported image source"),
}


def good_memory(i=0):
    return Memory(image=Image.new("RGB", (64, 64), (i * 20 % 255, 90, 30)), note=f"memory {i}")


def assert_valid(scores, n):
    assert len(scores.gains) == n == len(scores.relevance)
    values = [scores.p_vis, scores.relevance_none, *scores.gains, *scores.relevance]
    assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values)
    assert sum(scores.relevance) + scores.relevance_none == pytest.approx(1.0, abs=1e-5)


def test_the_case_counts_readme_reports():
    assert len(IMAGE_CASES) == 18
    assert sum(expect is None for _, expect in IMAGE_CASES.values()) == 8


@pytest.mark.parametrize("name", sorted(IMAGE_CASES))
def test_every_stored_image_scores_or_names_the_memory(scorer, name):
    make, expect = IMAGE_CASES[name]
    memories = [good_memory(0), Memory(image=make(), note=name), good_memory(2)]
    if expect is None:
        assert_valid(scorer.score(QUESTION, memories), 3)
    else:
        with pytest.raises(InvalidMemoryError) as info:
            scorer.score(QUESTION, memories)
        assert info.value.index == 1 and re.search(expect, info.value.reason), str(info.value)
        assert str(info.value).startswith("memory 2: ")              # numbered from 1 in messages


# -- text --------------------------------------------------------------------------------------------------------

CONTROL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
           "<|endoftext|>", "<think>", "</think>"]
hostile = st.lists(st.one_of(
    st.text(max_size=40),
    st.sampled_from(CONTROL),
    st.sampled_from(["مرحبا بالعالم", "שלום", "🙂🧾🖼️", "\u202e reversed", "\x00\x1b[31m", "e\u0301", "\ufeff"]),
), max_size=6).map("".join)


@pytest.fixture(scope="module")
def packer(scorer):
    images = scorer.packer.images([good_memory(0), good_memory(1)])
    return scorer.packer, images


def structure(packer, state):
    special = set(packer.encoder.special.values())
    ids = state.input_ids.tolist()
    return {
        "special": [t for t in ids if t in special],                       # control tokens, in order
        "tail": ids[state.marker_positions[-1] + 1:],                       # the decision questions, unchanged
        "n": state.num_memories,
        "grids": state.image_grid_thw.tolist(),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(question=hostile, note=hostile, dialogue=hostile, date=hostile)
def test_hostile_text_never_changes_the_state_structure(packer, question, note, dialogue, date):
    pk, images = packer
    base = pk.pack("q", [Memory(image=b"x"), Memory(image=b"y")], images=images)
    memories = [Memory(image=b"x", note=note, dialogue=dialogue, date=date), Memory(image=b"y", note=date)]
    state = pk.pack(question, memories, images=images)
    assert structure(pk, state) == structure(pk, base)
    assert state.num_tokens <= base.num_tokens + pk.cfg.max_question_tokens + 2 * pk.cfg.max_memory_text_tokens + 2
    assert state.decision_positions.tolist()[-1] == state.num_tokens - 1


@pytest.mark.parametrize("field", ["question", "note", "dialogue", "date"])
def test_invalid_unicode_and_non_utf8_bytes_become_replacement_characters(scorer, field):
    def pack(text):
        question = text if field == "question" else QUESTION
        kwargs = {field: text} if field != "question" else {}
        return scorer.pack(question, [good_memory(), Memory(image=Image.new("RGB", (32, 32)), **kwargs)])

    expected = pack("abc\ufffddef").input_ids
    assert torch.equal(pack("abc\ud800def").input_ids, expected)          # a lone surrogate (not UTF-8 encodable)
    if field != "question":
        assert torch.equal(pack(b"abc\xffdef").input_ids, expected)       # bytes that are not UTF-8


@pytest.mark.parametrize("value", [3, ["a"], 2.5])
def test_non_string_text_is_a_clear_error(scorer, value):
    with pytest.raises(InvalidMemoryError, match="memory 1: note must be a string"):
        scorer.pack(QUESTION, [Memory(image=Image.new("RGB", (32, 32)), note=value)])


def test_empty_and_enormous_text(scorer):
    empty = scorer.score("", [Memory(image=Image.new("RGB", (40, 40)), note="", dialogue="", date="")])
    assert_valid(empty, 1)
    huge = "lorem ipsum " * 200_000                                     # ~2.4 MB of text per field
    state = scorer.pack(huge, [Memory(image=Image.new("RGB", (40, 40)), note=huge, dialogue=huge, date=huge)])
    cfg = scorer.triage_config
    assert state.num_tokens <= cfg.max_question_tokens + cfg.max_memory_text_tokens + 200


# -- sizes, numerics, concurrency ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 20, 50])
def test_memory_counts(scorer, n):
    memories = [Memory(image=Image.new("RGB", (32 + 8 * (i % 5), 32), (i, 2 * i, 3 * i)), note=f"m{i}")
                for i in range(n)]
    assert_valid(scorer.score(QUESTION, memories), n)


def test_non_finite_scores_are_an_error_never_returned(tiny_checkpoint):
    scorer = Scorer.load(tiny_checkpoint)
    scorer.weights.head_decision.fill_(float("nan"))
    with pytest.raises(NonFiniteScoreError, match="non-finite"):
        scorer.score(QUESTION, [good_memory()])


def test_threads_give_the_serial_results(scorer):
    episodes = [(f"question {i}?", [good_memory(j) for j in range(i % 4)]) for i in range(8)]
    serial = [scorer.score(q, m) for q, m in episodes]
    results: dict[tuple[int, int], object] = {}
    errors = []

    def worker(t):
        try:
            for r in range(3):
                i = (t + r) % len(episodes)
                results[(t, r)] = (i, scorer.score(*episodes[i]))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 24
    for i, got in results.values():
        assert got == serial[i]


# -- security ----------------------------------------------------------------------------------------------------

def test_no_pickle_no_remote_code_no_network_clients_in_the_package():
    forbidden = re.compile(r"torch\.load\(|\bimport pickle\b|\bpickle\.|trust_remote_code\s*=\s*True|"
                           r"\bimport (requests|urllib|http\.client|httpx)\b|from (urllib(?!\.parse\b)|http)\b|hf_hub_download")
    # the scoring service's client, its subprocess runner and the benchmarks that drive it speak HTTP by design (to
    # the service, never to a model hub); the framework adapters fetch an image URL only when the caller allowed it
    # (allow_url_images=True, tested with a loopback server)
    http_by_design = {Path("serve/client.py"): r"\s*import httpx", Path("serve/process.py"): r"\s*import httpx",
                      Path("bench/serve_load.py"): r"\s*import httpx", Path("bench/gpu_check.py"): r"\s*import httpx",
                      Path("bench/soak.py"): r"\s*import httpx",
                      Path("integrations/common.py"): r"import urllib\.(request|error)"}
    hits = [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}"
            for p in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if forbidden.search(line)
            and not re.fullmatch(http_by_design.get(p.relative_to(PACKAGE), "(?!)"), line)]
    assert hits == []


def test_a_pickle_checkpoint_is_refused(tiny_copy):
    for f in tiny_copy.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(CheckpointError, match="safetensors"):
        Scorer.load(tiny_copy)


def test_load_and_score_without_network(tiny_checkpoint, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    scorer = Scorer.load(tiny_checkpoint, dtype=torch.bfloat16)
    assert_valid(scorer.score(QUESTION, [good_memory(0), good_memory(1)]), 2)
