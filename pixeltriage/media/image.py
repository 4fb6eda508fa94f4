"""Memory images -> RGB thumbnails: decoding under one set of checks, orientation, mode conversion, thumbnails and
canonical PNG bytes.

open_image -> to_rgb -> make_thumbnail, chained by `thumbnail`: the one recipe for fresh and write-time-cached
thumbnails. Bytes and local files are opened from their header with the format allow-list and the pixel limit
checked before any pixel data is decoded; URLs are refused.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import struct

import numpy as np
from PIL import Image, ImageOps, TiffImagePlugin, UnidentifiedImageError, WebPImagePlugin  # noqa: F401

from pixeltriage.errors import InvalidMemoryError
from pixeltriage.media import policy
from pixeltriage.media.sources import local_path

# Formats a header is read as, in this order. Keeps exotic decoders (EPS runs Ghostscript, FITS, PSD, ...) away
# from untrusted bytes; MPO (multi-picture camera JPEGs) is reached through the JPEG opener. The TIFF and WebP
# plugins are imported above so that PIL need not load every plugin to find them.
IMAGE_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")

PNG_COMPRESS_LEVEL = 6

_ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")
_INT_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N")
# PIL decoders raise any of these on malformed or hostile data (and the processor's resize, engine.patches).
DECODE_ERRORS = (
    OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError, TypeError, struct.error,
    MemoryError, Image.DecompressionBombError, Image.DecompressionBombWarning,
)


def open_image(source, index: int | None = None, *, max_side: int | None = None) -> Image.Image:
    """Open and fully decode one memory image; frame 0 of an animated image.

    source: a PIL image, the encoded bytes, or a local file path (str / os.PathLike; URLs refused).
    max_side: when given, JPEG bytes or files are decoded at a reduced DCT scale that keeps the long
        side at least 2 * max_side (the thumbnail is made from it); PIL image sources are left as given.
    Returns the decoded image in its own mode and size (at most `policy.MAX_IMAGE_PIXELS` pixels).
    Raises InvalidMemoryError(reason, index) for anything that is not a readable image.
    """
    if isinstance(source, Image.Image):
        _check_size(source.size, "image", index)
        return _decode(source, "image", index, max_side=None)
    with _opened(source, index) as (img, name):
        return _decode(img, name, index, max_side)


def display_size(source, index: int | None = None) -> tuple[int, int]:
    """(width, height) of the image as displayed (EXIF orientation applied), read from its header only: what an
    answering model's processor sees, for visual-token costs. Accepts and refuses what `open_image` does."""
    if isinstance(source, Image.Image):
        _check_size(source.size, "image", index)
        return _oriented_size(source)
    with _opened(source, index) as (img, _):
        return _oriented_size(img)


@contextlib.contextmanager
def _opened(source, index: int | None):
    """Bytes or a local path -> (the PIL image with only its header read, a name for messages); the file stays
    open inside the block. The one place that checks the source, the path and the format allow-list."""
    if isinstance(source, (bytes, bytearray)):
        if not source:
            raise InvalidMemoryError("image bytes are empty", index)
        name = f"image bytes ({len(source)} B)"
        yield _open_stream(io.BytesIO(bytes(source)), name, index), name
        return
    if isinstance(source, (str, os.PathLike)):
        path = local_path(source, index)
        try:
            f = open(path, "rb")
        except OSError as e:
            raise InvalidMemoryError(f"{path}: cannot read file ({e.strerror or e})", index) from e
        with f:
            yield _open_stream(f, path, index), path
        return
    raise InvalidMemoryError(f"unsupported image source of type {type(source).__name__}; expected a PIL image, "
                             f"bytes or a local file path", index)


def _oriented_size(img: Image.Image) -> tuple[int, int]:
    width, height = img.size
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:  # a damaged EXIF block: PIL's exif_transpose would ignore it too
        orientation = 1
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def _open_stream(fp, name: str, index: int | None) -> Image.Image:
    """The image with only its header read (`Image.open(fp, formats=IMAGE_FORMATS)` less PIL's own size check),
    its size checked against the one limit. Every reader of a header (open_image, display_size) refuses alike."""
    try:
        img = _read_header(fp, name, index)
    except InvalidMemoryError:
        raise                                                      # a WebP canvas past the limit
    except UnidentifiedImageError as e:
        raise InvalidMemoryError(f"{name}: not a recognised image (accepted formats: "
                                 f"{', '.join(IMAGE_FORMATS)})", index) from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # PIL's check inside a format's own parser (a GIF frame past its screen, a WebP canvas past twice PIL's
        # limit where a host lowered it), or its warning where warnings are errors
        raise InvalidMemoryError(f"{name}: refused as a possible decompression bomb ({e})", index) from e
    except DECODE_ERRORS as e:
        raise InvalidMemoryError(f"{name}: cannot read image header ({e})", index) from e
    _check_size(img.size, name, index)
    return img


def _read_header(fp, name: str, index: int | None) -> Image.Image:
    """Image.open's format search without its decompression-bomb check, which compares the size with PIL's own,
    process-wide `Image.MAX_IMAGE_PIXELS` (a host may change it), warns above it and raises above twice it: the
    size is checked by the caller against the one limit of ours instead, and a refused image leaves no PIL warning
    behind. (No `warnings.catch_warnings` around Image.open instead: it swaps the process-wide filter list, which
    is not thread-safe, so a host's own filters could be lost when two threads decode at once.)"""
    fp.seek(0)
    head = fp.read(30)
    Image.preinit()
    for fmt in IMAGE_FORMATS:
        if fmt not in Image.OPEN:
            Image.init()
        factory, accept = Image.OPEN[fmt]
        accepted = accept is None or accept(head[:16])
        if isinstance(accepted, str) or not accepted:              # a str: the plugin's reason to decline
            continue
        if fmt == "WEBP" and (canvas := _webp_canvas(head)) is not None:
            _check_size(canvas, name, index)                       # its parser allocates the canvas
        fp.seek(0)
        try:
            return factory(fp, "")
        except (SyntaxError, IndexError, TypeError, struct.error):
            continue                                               # not this format after all, as in Image.open
    raise UnidentifiedImageError(f"cannot identify image file {name}")


def _webp_canvas(head: bytes) -> tuple[int, int] | None:
    """The canvas a WebP file's first chunk declares (lossy VP8, lossless VP8L or extended VP8X), None if unread."""
    chunk = head[12:16]
    if chunk == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
    if chunk == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, (bits >> 14 & 0x3FFF) + 1
    if chunk == b"VP8X" and len(head) >= 30:
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


def _check_size(size: tuple[int, int], name: str, index: int | None) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidMemoryError(f"{name}: image has zero size ({width}x{height})", index)
    if width * height > policy.MAX_IMAGE_PIXELS:
        raise InvalidMemoryError(f"{name}: {width}x{height} = {width * height:,} pixels exceeds the limit of "
                                 f"{policy.MAX_IMAGE_PIXELS:,} pixels (possible decompression bomb)", index)


def _decode(img: Image.Image, name: str, index: int | None, max_side: int | None) -> Image.Image:
    if max_side is not None:
        _draft(img, max_side)
    try:
        img.load()
    except DECODE_ERRORS as e:
        raise InvalidMemoryError(f"{name}: cannot decode image ({e})", index) from e
    return img


def _draft(img: Image.Image, max_side: int) -> None:
    # Only JPEG implements draft (the base class ignores it): DCT scaling by 1/2, 1/4 or 1/8.
    width, height = img.size
    scale = 2 * max_side / max(width, height)
    if scale < 1:
        img.draft("RGB", (max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))))


def to_rgb(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation, then convert any mode to RGB (alpha composited on white).

    16-bit and "I" samples keep their top 8 bits (v >> 8, clipped to [0, 65535] first); "F" samples
    are scaled by 255 when all lie in [0, 1], else clipped to [0, 255].
    Returns a new RGB image of the displayed size [W', H'] (W and H swapped by 90 degree rotations).
    """
    return _convert_rgb(ImageOps.exif_transpose(img))


def _convert_rgb(img: Image.Image) -> Image.Image:
    if img.mode in _INT_MODES:
        img = _int_to_gray(img)
    elif img.mode == "F":
        img = _float_to_gray(img)
    elif img.mode == "La":
        img = img.convert("LA")
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        return _composite_on_white(img)
    return img if img.mode == "RGB" else img.convert("RGB")


def _int_to_gray(img: Image.Image) -> Image.Image:
    samples = np.asarray(img).astype(np.int64)
    return Image.fromarray((np.clip(samples, 0, 65535) >> 8).astype(np.uint8))


def _float_to_gray(img: Image.Image) -> Image.Image:
    samples = np.nan_to_num(np.asarray(img, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
    if samples.min() >= 0.0 and samples.max() <= 1.0:
        samples = samples * 255.0
    return Image.fromarray(np.clip(np.rint(samples), 0, 255).astype(np.uint8))


def _composite_on_white(img: Image.Image) -> Image.Image:
    # The same compositing transformers' convert_to_rgb does, so RGBA inputs agree with it exactly.
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def make_thumbnail(img: Image.Image, max_side: int = policy.THUMBNAIL_SIDE) -> Image.Image:
    """Scale the longer side to max_side, keeping the aspect ratio; never upscale.

    The short side is rounded half up (at least 1 px). Filter: PIL BICUBIC with reducing_gap=3.0
    (a box-filter integer reduction first when shrinking more than 3x, then bicubic), deterministic.
    Non-RGB inputs are converted with the mode rules of `to_rgb`; EXIF orientation is not applied here.
    Returns an RGB image whose longer side is min(max_side, longer input side).
    """
    if max_side <= 0:
        raise ValueError(f"max_side must be positive, got {max_side}")
    img = _convert_rgb(img)
    width, height = img.size
    long_side = max(width, height)
    if long_side <= max_side:
        return img
    size = (_scaled_side(width, max_side, long_side), _scaled_side(height, max_side, long_side))
    return img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)


def _scaled_side(side: int, max_side: int, long_side: int) -> int:
    return max(1, (2 * side * max_side + long_side) // (2 * long_side))


def thumbnail(source, side: int = policy.THUMBNAIL_SIDE, index: int | None = None) -> Image.Image:
    """The RGB thumbnail System One reads: decoded (JPEG at a reduced scale), oriented, converted to RGB, the
    longer side scaled to `side`. The one recipe for fresh and write-time-cached thumbnails."""
    img = open_image(source, index, max_side=side)
    try:
        return make_thumbnail(to_rgb(img), side)
    except DECODE_ERRORS as e:
        raise InvalidMemoryError(f"{describe(source)}: cannot preprocess image ({e})", index) from e


def describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fsdecode(os.fspath(source))
    if isinstance(source, (bytes, bytearray)):
        return f"image bytes ({len(source)} B)"
    return "image"


def encode_png(img: Image.Image) -> bytes:
    """Canonical PNG bytes of an image's pixels, as RGB: no metadata, fixed compression level.

    Non-RGB images are converted with the mode rules of `to_rgb`; EXIF orientation is not applied
    (metadata, EXIF included, is dropped). Same pixels -> same bytes for a given Pillow/zlib build.
    """
    rgb = _convert_rgb(img)
    clean = Image.frombytes("RGB", rgb.size, rgb.tobytes())
    buffer = io.BytesIO()
    clean.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL, optimize=False)
    return buffer.getvalue()
