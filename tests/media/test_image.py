"""Image decoding, colour modes, thumbnails, the refusals and canonical PNG (pixeltriage.media.image)."""
from __future__ import annotations

import io
import re
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from images import encoded, random_image
from pixeltriage.errors import InvalidMemoryError
from pixeltriage.media import image as image_mod
from pixeltriage.media import policy
from pixeltriage.media.image import IMAGE_FORMATS, encode_png, make_thumbnail, open_image, to_rgb


# -- thumbnails --------------------------------------------------------------------------------

@pytest.mark.parametrize("size,expected", [
    ((1000, 750), (336, 252)), ((750, 1000), (252, 336)), ((337, 1), (336, 1)), ((1000, 1), (336, 1)),
    ((2000, 3), (336, 1)), ((672, 673), (336, 336)), ((336, 100), (336, 100)), ((20, 10), (20, 10)),
    ((1, 1), (1, 1)),
])
def test_thumbnail_size(size, expected):
    thumbnail = make_thumbnail(Image.new("RGB", size, (10, 20, 30)))
    assert thumbnail.size == expected
    assert thumbnail.mode == "RGB"


def test_thumbnail_never_upscales_and_converts():
    img = random_image("L", (100, 50))
    thumbnail = make_thumbnail(img, max_side=336)
    assert thumbnail.size == (100, 50) and thumbnail.mode == "RGB"
    assert make_thumbnail(Image.new("RGB", (500, 500)), max_side=64).size == (64, 64)
    with pytest.raises(ValueError):
        make_thumbnail(img, max_side=0)


def test_thumbnail_is_deterministic():
    img = random_image("RGB", (1200, 900), seed=9)
    assert make_thumbnail(img).tobytes() == make_thumbnail(img.copy()).tobytes()


# -- decoding and colour modes -----------------------------------------------------------------

def test_exif_orientation_6_is_applied():
    stored = Image.new("RGB", (40, 20), (255, 0, 0))
    stored.paste((0, 0, 255), (20, 0, 40, 20))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed after rotating 90 degrees clockwise
    img = to_rgb(open_image(encoded(stored, "JPEG", quality=95, exif=exif.tobytes())))
    assert img.size == (20, 40)
    top, bottom = img.getpixel((10, 5)), img.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 60
    assert bottom[2] > 200 and bottom[0] < 60


def test_transparent_pixels_become_white():
    img = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    img.putpixel((0, 0), (0, 0, 0, 0))
    img.putpixel((1, 0), (0, 0, 0, 128))
    rgb = to_rgb(open_image(encoded(img, "PNG")))
    assert rgb.mode == "RGB"
    assert rgb.getpixel((0, 0)) == (255, 255, 255)
    assert rgb.getpixel((1, 0)) == (127, 127, 127)
    assert rgb.getpixel((2, 2)) == (255, 0, 0)


def test_palette_with_transparency():
    img = Image.new("P", (4, 4), 1)
    img.putpalette([0, 0, 0, 0, 255, 0] + [0] * (256 * 3 - 6))
    img.putpixel((0, 0), 0)
    opened = open_image(encoded(img, "PNG", transparency=0))
    assert opened.mode == "P"
    rgb = to_rgb(opened)
    assert rgb.getpixel((0, 0)) == (255, 255, 255)
    assert rgb.getpixel((3, 3)) == (0, 255, 0)


def test_16_bit_png_keeps_top_bits():
    samples = np.array([[0, 100 * 256 + 255, 65535, 256]], dtype=np.uint16)
    opened = open_image(encoded(Image.fromarray(samples), "PNG"))
    assert opened.mode.startswith("I")
    rgb = to_rgb(opened)
    assert [rgb.getpixel((x, 0)) for x in range(4)] == [(0, 0, 0), (100, 100, 100), (255, 255, 255), (1, 1, 1)]


def test_cmyk_jpeg():
    img = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # red
    opened = open_image(encoded(img, "JPEG", quality=95))
    assert opened.mode == "CMYK"
    r, g, b = to_rgb(opened).getpixel((8, 8))
    assert r > 230 and g < 30 and b < 30


def test_animated_gif_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)
    for source in (path, str(path), path.read_bytes()):
        assert to_rgb(open_image(source)).getpixel((4, 4)) == (255, 0, 0)


@pytest.mark.parametrize("mode", ["1", "L", "I", "I;16B", "F", "CMYK", "YCbCr", "HSV", "LAB", "La", "RGBa",
                                  "PA", "RGBX"])
def test_every_mode_converts_to_rgb(mode):
    img = Image.new(mode, (5, 3))
    rgb = to_rgb(img)
    assert rgb.mode == "RGB" and rgb.size == (5, 3)


def test_float_and_int_scaling():
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    assert [to_rgb(unit).getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    wide = Image.fromarray(np.array([[-5.0, 100.0, 300.0]], dtype=np.float32))
    assert [to_rgb(wide).getpixel((x, 0))[0] for x in range(3)] == [0, 100, 255]
    ints = Image.fromarray(np.array([[-1, 512, 70000]], dtype=np.int32))
    assert ints.mode == "I"
    assert [to_rgb(ints).getpixel((x, 0))[0] for x in range(3)] == [0, 2, 255]


def test_large_jpeg_is_drafted():
    img = random_image("RGB", (2000, 1500), seed=1)
    data = encoded(img, "JPEG", quality=80)
    assert open_image(data).size == (2000, 1500)
    drafted = open_image(data, max_side=336)
    assert drafted.size == (1000, 750)  # DCT scale 1/2 keeps the long side >= 2 * 336
    assert make_thumbnail(to_rgb(drafted)).size == (336, 252)


# -- errors ------------------------------------------------------------------------------------

def _png() -> bytes:
    return encoded(random_image("RGB", (64, 64)), "PNG")


def _jpeg() -> bytes:
    return encoded(random_image("RGB", (64, 64)), "JPEG", quality=90)


def _empty_file(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims width x height (1-bit grey); the pixel data is absent."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("make_source,needle", [
    (lambda tmp: b"definitely not an image", "not a recognised image"),
    (lambda tmp: b"", "empty"),
    (lambda tmp: _png()[: len(_png()) // 2], "cannot decode"),
    (lambda tmp: _png()[:40], "image bytes"),
    (lambda tmp: _jpeg()[: len(_jpeg()) // 2], "cannot decode"),
    (lambda tmp: str(tmp / "missing.png"), "missing.png: image file not found"),
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: "https://example.com/cat.png", "URLs are not accepted"),
    (lambda tmp: "file:///etc/passwd", "URLs are not accepted"),
    (lambda tmp: _empty_file(tmp / "empty.png"), "empty.png: image file is empty"),
    (lambda tmp: 12345, "unsupported image source of type int"),
    (lambda tmp: Image.new("RGB", (0, 0)), "zero size"),
    (lambda tmp: encoded(Image.new("RGB", (8, 8)), "PCX"), "not a recognised image"),
])
def test_invalid_images_raise_with_index(tmp_path, make_source, needle):
    source = make_source(tmp_path)
    with pytest.raises(InvalidMemoryError) as info:
        image_mod.thumbnail(source, index=7)
    assert info.value.index == 7
    assert needle in info.value.reason
    assert str(info.value).startswith("memory 8: ")                  # messages number memories from 1


def _declaring(fmt: str, width: int, height: int) -> bytes:
    """A small image of `fmt` whose header claims width x height: its size fields rewritten, its pixel data the
    small image's (or, for PNG, absent)."""
    if fmt == "PNG":
        return _png_declaring(width, height)
    if fmt == "TIFF":
        return _tiff_declaring(width, height)
    data = bytearray(encoded(Image.new("RGB", (8, 8)), fmt, **({"lossless": True} if fmt == "WEBP" else {})))
    if fmt == "GIF":                                              # the logical screen
        struct.pack_into("<HH", data, 6, width, height)
    elif fmt == "BMP":                                            # BITMAPINFOHEADER
        struct.pack_into("<ii", data, 18, width, height)
    elif fmt == "JPEG":                                           # the baseline frame header
        struct.pack_into(">HH", data, data.index(b"\xff\xc0") + 5, height, width)
    elif fmt == "WEBP":                                           # VP8L: 14 bits each of width - 1, height - 1
        at = data.index(b"VP8L") + 9
        bits = int.from_bytes(data[at:at + 4], "little") & ~((1 << 28) - 1)
        data[at:at + 4] = (bits | (width - 1) | (height - 1) << 14).to_bytes(4, "little")
    return bytes(data)


def _tiff_declaring(width: int, height: int) -> bytes:
    """A little-endian TIFF whose IFD claims width x height (1-bit grey, one strip of 1 byte)."""
    entries = [(256, 4, width), (257, 4, height), (258, 3, 1), (259, 3, 1), (262, 3, 1), (273, 4, 8),
               (278, 4, height), (279, 4, 1)]
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", tag, kind, 1, value)
                                                      for tag, kind, value in entries) + struct.pack("<I", 0)
    return b"II*\0" + struct.pack("<I", 9) + b"\0" + ifd


# 10000 x 10000 lies between PIL's default limit and twice it (where PIL only warns), 16384 x 16384 above twice it
# (where PIL raises, quoting twice its limit); both are refused by the one limit, in the same words, whether PIL's
# own check is on or off
@pytest.mark.parametrize("pil_limit", [Image.MAX_IMAGE_PIXELS, None], ids=["PIL default", "PIL off"])
@pytest.mark.parametrize("side", [10000, 16384])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"])
def test_the_pixel_limit_is_ours_and_refuses_before_pil_warns(fmt, side, pil_limit, recwarn, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pil_limit)
    warnings.simplefilter("always")
    with pytest.raises(InvalidMemoryError) as info:
        open_image(_declaring(fmt, side, side), index=2)
    assert info.value.index == 2
    assert info.value.reason.endswith(f"{side}x{side} = {side * side:,} pixels exceeds the limit of 89,478,485 "
                                      f"pixels (possible decompression bomb)")
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


@pytest.mark.parametrize("pil_limit", [None, 10 ** 12], ids=["PIL off", "PIL higher"])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"])
def test_a_header_at_the_limit_is_read_whatever_pil_is_set_to(fmt, pil_limit, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pil_limit)
    assert 9459 * 9459 <= policy.MAX_IMAGE_PIXELS < 9460 * 9460
    assert image_mod.display_size(_declaring(fmt, 9459, 9459)) == (9459, 9459)
    with pytest.raises(InvalidMemoryError, match="exceeds the limit of 89,478,485 pixels"):
        image_mod.display_size(_declaring(fmt, 9460, 9460))


def test_headers_are_read_as_pil_reads_them(tmp_path):
    """The format search without PIL's size check against Image.open itself: the same format, mode, size and
    pixels for an image of every accepted format (and an MPO, an animated GIF, a CMYK JPEG)."""
    rgb = random_image("RGB", (40, 30), seed=6)
    sources = {fmt: encoded(rgb, fmt) for fmt in IMAGE_FORMATS}
    sources["MPO"] = encoded(rgb, "MPO", save_all=True, append_images=[rgb.transpose(Image.Transpose.ROTATE_180)])
    sources["animated GIF"] = encoded(rgb, "GIF", save_all=True, append_images=[random_image("RGB", (40, 30))])
    sources["CMYK JPEG"] = encoded(rgb.convert("CMYK"), "JPEG")
    for label, data in sources.items():
        ours, pils = open_image(data), Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        assert (ours.format, ours.mode, ours.size) == (pils.format, pils.mode, pils.size), label
        assert ours.tobytes() == pils.tobytes(), label


def test_bomb_refused_before_decoding_even_without_pil_limit(monkeypatch, tmp_path):
    def load_forbidden(self):
        raise AssertionError("pixel data must not be decoded")

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    monkeypatch.setattr(ImageFile.ImageFile, "load", load_forbidden)
    path = tmp_path / "bomb.png"
    path.write_bytes(_png_declaring(30000, 30000))
    with pytest.raises(InvalidMemoryError, match=re.escape(f"{path}: 30000x30000")):
        open_image(path, index=1)


def test_own_pixel_limit_is_honoured(monkeypatch):
    monkeypatch.setattr(policy, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(InvalidMemoryError, match="exceeds the limit of 100 pixels"):
        open_image(encoded(Image.new("RGB", (20, 20)), "PNG"))
    assert open_image(encoded(Image.new("RGB", (10, 10)), "PNG")).size == (10, 10)


# -- canonical PNG -----------------------------------------------------------------------------

def test_encode_png_is_canonical():
    img = random_image("RGB", (33, 17), seed=4)
    with_metadata = Image.open(io.BytesIO(encoded(img, "PNG", dpi=(300, 300), icc_profile=b"fake-icc")))
    with_metadata.load()
    assert "icc_profile" in with_metadata.info
    data = encode_png(img)
    assert data == encode_png(with_metadata) == encode_png(img.copy())
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    for chunk in (b"tEXt", b"iTXt", b"zTXt", b"pHYs", b"iCCP", b"eXIf", b"tIME"):
        assert chunk not in data
    decoded = Image.open(io.BytesIO(data))
    assert decoded.mode == "RGB" and decoded.tobytes() == img.tobytes()
    assert encode_png(img.convert("RGBA")) == data


def test_path_like_sources(tmp_path):
    path = Path(tmp_path) / "x.png"
    path.write_bytes(encoded(Image.new("RGB", (3, 2), (1, 2, 3)), "PNG"))
    assert open_image(path).size == open_image(str(path)).size == (3, 2)


def test_display_size_accepts_and_refuses_what_open_image_does(tmp_path):
    refused = [encoded(Image.new("RGB", (8, 8)), "PCX"), b"", "https://example.com/a.png", str(tmp_path / "no.png"),
               _png_declaring(10000, 10000)]           # between 1x and 2x PIL's limit: PIL itself only warns
    for source in refused:
        with pytest.raises(InvalidMemoryError) as a:
            image_mod.open_image(source, index=4)
        with pytest.raises(InvalidMemoryError) as b:
            image_mod.display_size(source, index=4)
        assert a.value.reason == b.value.reason and b.value.index == 4
    assert image_mod.display_size(encoded(Image.new("RGB", (30, 20)), "PNG")) == (30, 20)
