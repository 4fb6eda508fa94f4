import copy
import io

import numpy as np
import pytest
from PIL import Image

from pixeltriage.delivery.host import (
    ORDINAL_NOTE,
    TAG_NOTE,
    memory_tag,
    pixel_host_messages,
    stamp_tag,
    text_host_messages,
)
from pixeltriage.engine.types import Memory
from pixeltriage.errors import InvalidMemoryError


def photo(color=(40, 120, 200), size=(320, 240)) -> Image.Image:
    img = Image.new("RGB", size, color)
    img.putpixel((size[0] - 1, size[1] - 1), (1, 2, 3))
    return img


def memories():
    return [
        Memory(image=photo((200, 30, 30)), note="a red car", dialogue="look at my car", date="2024-03-05"),
        Memory(image=photo((30, 200, 30)), note="a green field", date="2024-04-01"),
        Memory(image=photo((30, 30, 200)), note="", dialogue="blue!", date="2024-05-09"),
    ]


def parts(message, kind):
    return [p for p in message["content"] if p["type"] == kind]


def all_text(messages):
    return "\n".join(p["text"] for m in messages for p in m["content"] if p["type"] == "text")


# --- pixel hosts ---------------------------------------------------------------------------------

def test_pixel_host_structure():
    mems = memories()
    msgs = pixel_host_messages("What color was the car?", mems, [False, True, False])
    assert [m["role"] for m in msgs] == ["user"]
    content = msgs[0]["content"]
    assert [p["type"] for p in content] == ["text", "image", "text"]
    assert content[1]["image"] is mems[1].image  # the host's own image, not a copy
    before, after = content[0]["text"], content[2]["text"]
    assert before.startswith("Retrieved memories:")
    assert "[M1]\nDialogue: look at my car\nCaption: a red car" in before
    assert before.endswith("[M2]\nCaption: a green field\nImage:")
    assert after.startswith("[M3]\nDialogue: blue!")
    assert after.endswith("Question: What color was the car?")
    assert "Caption: \n" not in after  # an empty note adds no caption line
    assert "seen" not in all_text(msgs) and TAG_NOTE not in all_text(msgs)


def test_pixel_host_replace_caption_and_system():
    msgs = pixel_host_messages("q?", memories(), [True, True, False], replace_caption=True, system="Be brief.")
    assert msgs[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    text = all_text(msgs)
    assert "a red car" not in text and "a green field" not in text
    assert len(parts(msgs[1], "image")) == 2
    kept = pixel_host_messages("q?", memories(), [True, True, False])
    assert "Caption: a red car" in all_text(kept)


def test_pixel_host_nothing_or_everything_opened():
    none = pixel_host_messages("q?", memories(), [0, 0, 0])
    assert [p["type"] for p in none[0]["content"]] == ["text"]
    assert "Image:" not in all_text(none)
    every = pixel_host_messages("q?", memories(), [1, 1, 1])
    assert len(parts(every[0], "image")) == 3
    assert pixel_host_messages("q?", [], [])[0]["content"][-1]["text"].endswith("Question: q?")


def test_image_sources(tmp_path):
    path = tmp_path / "m.png"
    photo().save(path)
    buffer = io.BytesIO()
    photo((9, 9, 9)).save(buffer, format="PNG")
    mems = [Memory(image=str(path)), Memory(image=path), Memory(image=buffer.getvalue())]
    images = parts(pixel_host_messages("q", mems, [1, 1, 1])[0], "image")
    assert images[0]["image"] == str(path) and images[1]["image"] == str(path)
    assert isinstance(images[2]["image"], Image.Image) and images[2]["image"].getpixel((0, 0)) == (9, 9, 9)


def test_key_memories_need_the_original_image_and_note():
    original = photo()
    mems = [Memory(key="k1", note="cached?"), Memory(key="k2")]
    with pytest.raises(InvalidMemoryError, match="images=") as info:
        pixel_host_messages("q", mems, [1, 0], notes={"k2": "n2"})
    assert info.value.index == 0
    with pytest.raises(InvalidMemoryError, match="notes="):
        pixel_host_messages("q", mems, [1, 0], images={"k1": original})
    msgs = pixel_host_messages("q", mems, [1, 0], images={"k1": original}, notes={"k2": "n2"})
    assert parts(msgs[0], "image")[0]["image"] is original
    assert "Caption: n2" in all_text(msgs) and "Caption: cached?" in all_text(msgs)


def test_delivery_must_match():
    with pytest.raises(ValueError, match="entries"):
        pixel_host_messages("q", memories(), [1, 0])
    with pytest.raises(ValueError):
        pixel_host_messages("q", memories(), [1, 0, 2])


# --- D2: readable identity tags ----------------------------------------------------------------

def test_stamp_tag_changes_only_the_corner_of_a_copy():
    original = photo(size=(400, 300))
    before = np.asarray(original).copy()
    stamped = stamp_tag(original, "[M3]")
    assert np.array_equal(np.asarray(original), before)  # the host's image is untouched
    assert stamped is not original and stamped.size == original.size and stamped.mode == "RGB"
    diff = np.any(np.asarray(stamped) != before, axis=2)
    ys, xs = np.nonzero(diff)
    assert ys.min() == 0 and xs.min() == 0  # a box in the top-left corner
    assert ys.max() < 300 // 3 and xs.max() < 400 // 2
    corner = np.asarray(stamped)[: ys.max() + 1, : xs.max() + 1]
    assert (corner == 255).all(axis=2).sum() > 20  # white text
    assert (corner == 0).all(axis=2).sum() > 20  # on a black box


def test_stamp_tag_scales_with_the_image_and_handles_modes():
    small = stamp_tag(Image.new("L", (40, 30), 128), "[M1]")
    assert small.mode == "RGB" and small.size == (40, 30)
    big = stamp_tag(Image.new("RGBA", (2000, 1500), (0, 0, 0, 0)), "[M10]")
    big_box = np.nonzero(np.any(np.asarray(big) != 255, axis=2))[0].max()
    small_img = stamp_tag(Image.new("RGB", (400, 300), (255, 255, 255)), "[M10]")
    small_box = np.nonzero(np.any(np.asarray(small_img) != 255, axis=2))[0].max()
    assert big_box > 3 * small_box  # the label grows with the image


def test_tag_images_stamps_opened_images_and_says_so():
    mems = memories()
    originals = [np.asarray(m.image).copy() for m in mems]
    msgs = pixel_host_messages("q?", mems, [False, True, True], tag_images=True)
    images = parts(msgs[0], "image")
    for img, i in zip(images, (1, 2)):
        assert img["image"] is not mems[i].image
        expected = np.asarray(stamp_tag(mems[i].image, memory_tag(i)))
        assert np.array_equal(np.asarray(img["image"]), expected)
    for m, before in zip(mems, originals):
        assert np.array_equal(np.asarray(m.image), before)
    text = all_text(msgs)
    assert TAG_NOTE in text and "[M2]" in text and "[M3]" in text
    assert memory_tag(0) == "[M1]" and memory_tag(9) == "[M10]"


# --- D3: seen-times ------------------------------------------------------------------------------

def test_seen_time_uses_dates():
    msgs = pixel_host_messages("when?", memories(), [1, 0, 0], seen_time=True)
    text = all_text(msgs)
    assert "[M1] [seen 2024-03-05]\n" in text
    assert "[M2] [seen 2024-04-01]\n" in text and "[M3] [seen 2024-05-09]\n" in text
    assert ORDINAL_NOTE not in text


def test_seen_time_ordinals_for_undated_memories():
    mems = [Memory(image=photo(), note="x"), Memory(image=photo(), note="y", date="2023-01-01")]
    with pytest.raises(InvalidMemoryError, match="seen_ordinals") as info:
        pixel_host_messages("q", mems, [1, 1], seen_time=True)
    assert info.value.index == 0
    msgs = pixel_host_messages("q", mems, [1, 1], seen_time=True, seen_ordinals=[7, 3], store_size=40)
    text = all_text(msgs)
    assert "[M1] [seen #7 of 40]" in text and "[M2] [seen 2023-01-01]" in text
    assert ORDINAL_NOTE in text
    with pytest.raises(ValueError):
        pixel_host_messages("q", mems, [1, 1], seen_time=True, seen_ordinals=[41, 1], store_size=40)
    with pytest.raises(ValueError):
        pixel_host_messages("q", mems, [1, 1], seen_time=True, seen_ordinals=[1], store_size=40)


# --- text hosts ----------------------------------------------------------------------------------

HOST = [
    {"role": "system", "content": "You answer from memory."},
    {"role": "user", "content": "Earlier turn"},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": [{"type": "text", "text": "Memories: ... Question: what color?"}]},
]


def test_text_host_appends_opened_images_to_last_user_turn():
    host = copy.deepcopy(HOST)
    mems = memories()
    msgs = text_host_messages(host, mems, [False, True, True], seen_time=True)
    assert host == HOST  # the host's messages are not modified
    assert msgs[:3] == HOST[:3]
    content = msgs[3]["content"]
    assert content[0] == HOST[3]["content"][0]  # the host's text, unchanged
    assert [p["type"] for p in content] == ["text", "text", "image", "text", "image"]
    assert content[1]["text"].startswith("Images of the retrieved memories:")
    assert content[1]["text"].endswith("[M2] [seen 2024-04-01]:")
    assert content[2]["image"] is mems[1].image
    assert content[3]["text"] == "[M3] [seen 2024-05-09]:"


def test_text_host_string_content_tags_and_no_opening():
    host = [{"role": "user", "content": "Question: what color?"}]
    msgs = text_host_messages(host, memories(), [True, False, False], tag_images=True)
    content = msgs[0]["content"]
    assert content[0] == {"type": "text", "text": "Question: what color?"}
    assert TAG_NOTE in content[1]["text"]
    assert np.array_equal(np.asarray(content[2]["image"]),
                          np.asarray(stamp_tag(memories()[0].image, "[M1]")))
    assert text_host_messages(host, memories(), [0, 0, 0]) == host
    with pytest.raises(ValueError, match="user turn"):
        text_host_messages([{"role": "system", "content": "x"}], memories(), [1, 0, 0])


def test_text_host_seen_time_only_for_opened_memories():
    mems = [Memory(image=photo(), note="undated, closed"), Memory(image=photo(), date="2024-01-02")]
    msgs = text_host_messages([{"role": "user", "content": "q"}], mems, [0, 1], seen_time=True)
    assert msgs[0]["content"][-2]["text"].endswith("\n[M2] [seen 2024-01-02]:")
    assert ORDINAL_NOTE not in all_text(msgs)
    with pytest.raises(InvalidMemoryError):
        text_host_messages([{"role": "user", "content": "q"}], mems, [1, 1], seen_time=True)
