"""Region geometry: the whole image plus a 2 x 2 grid of overlapping tiles, exact integer boxes for any size, crops
of the displayed image (EXIF orientation applied, alpha composited on white)."""
import io
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

from pixeltriage.errors import InvalidMemoryError
from pixeltriage.retrieval.regions import REGION_NAMES, Box, RegionGrid, region_crops


def test_boxes_of_an_even_image_at_the_default_overlap():
    grid = RegionGrid()
    assert grid.overlap == 0.25 and grid.names == REGION_NAMES
    assert grid.names == ("whole", "top-left", "top-right", "bottom-left", "bottom-right")
    # tiles of ceil(640 * 1.25 / 2) = 400 by ceil(480 * 1.25 / 2) = 300, sharing 160 x 120: a quarter of each side
    assert grid.boxes(640, 480) == (Box(0, 0, 640, 480), Box(0, 0, 400, 300), Box(240, 0, 640, 300),
                                    Box(0, 180, 400, 480), Box(240, 180, 640, 480))


def test_no_overlap_halves_an_even_side_and_shares_one_pixel_of_an_odd_one():
    grid = RegionGrid(overlap=0.0)
    assert grid.boxes(100, 60)[1:] == (Box(0, 0, 50, 30), Box(50, 0, 100, 30), Box(0, 30, 50, 60),
                                       Box(50, 30, 100, 60))
    # 101 x 77: both tiles keep one size, ceil(101 / 2) = 51 and ceil(77 / 2) = 39, so the middle pixel is shared
    assert grid.boxes(101, 77)[1:] == (Box(0, 0, 51, 39), Box(50, 0, 101, 39), Box(0, 38, 51, 77),
                                       Box(50, 38, 101, 77))


def test_odd_sizes_at_the_default_overlap():
    # ceil(101 * 1.25 / 2) = ceil(63.125) = 64 and ceil(77 * 1.25 / 2) = ceil(48.125) = 49
    assert RegionGrid().boxes(101, 77)[1:] == (Box(0, 0, 64, 49), Box(37, 0, 101, 49), Box(0, 28, 64, 77),
                                              Box(37, 28, 101, 77))


def test_the_overlap_is_read_as_the_decimal_it_prints_as():
    # 20 * 1.1 / 2 is 11 exactly; the binary double nearest 0.1 is a hair above it and would round up to 12
    assert RegionGrid(overlap=0.1).tile_length(20) == 11
    assert RegionGrid(overlap=0.5).tile_length(10) == 8          # ceil(7.5)


@pytest.mark.parametrize("size", [(1, 1), (2, 1), (1, 3), (2, 2), (3, 1)])
def test_tiny_images_have_non_empty_tiles(size):
    width, height = size
    for box in RegionGrid().boxes(width, height):
        assert 0 <= box.left < box.right <= width and 0 <= box.top < box.bottom <= height
    assert RegionGrid().boxes(1, 1) == (Box(0, 0, 1, 1),) * 5
    assert RegionGrid().boxes(2, 1)[1] == Box(0, 0, 2, 1)        # ceil(2 * 1.25 / 2) = 2: the whole side


@settings(max_examples=300, deadline=None)
@given(width=st.integers(1, 5000), height=st.integers(1, 5000),
       overlap=st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.25, 0.3, 1 / 3, 0.5, 0.75, 0.99]))
def test_box_invariants(width, height, overlap):
    grid = RegionGrid(overlap)
    whole, *tiles = grid.boxes(width, height)
    assert whole == Box(0, 0, width, height)
    exact = Fraction(repr(overlap))
    for side, starts, ends in ((width, {t.left for t in tiles}, {t.right for t in tiles}),
                               (height, {t.top for t in tiles}, {t.bottom for t in tiles})):
        length = math.ceil(side * (1 + exact) / 2)
        assert starts == {0, side - length} and ends == {length, side}          # flush with both edges
        assert 2 * length - side >= exact * side                                  # at least the overlap asked
        assert 2 * length - side < exact * side + 2                               # and less than 2 px more
    tile_w, tile_h = grid.tile_length(width), grid.tile_length(height)
    assert {(t.right - t.left, t.bottom - t.top) for t in tiles} == {(tile_w, tile_h)}
    assert [(t.left, t.top) for t in tiles] == [(0, 0), (width - tile_w, 0), (0, height - tile_h),
                                                (width - tile_w, height - tile_h)]          # reading order


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf"), True, "0.2", None])
def test_bad_overlaps(bad):
    with pytest.raises(ValueError, match="overlap"):
        RegionGrid(bad)


def test_bad_sides():
    with pytest.raises(ValueError, match="at least 1"):
        RegionGrid().boxes(0, 10)


def _quadrants(width, height) -> Image.Image:
    """Red top-left, green top-right, blue bottom-left, white bottom-right (split at the middle)."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:height // 2, :width // 2] = (255, 0, 0)
    pixels[:height // 2, width // 2:] = (0, 255, 0)
    pixels[height // 2:, :width // 2] = (0, 0, 255)
    pixels[height // 2:, width // 2:] = (255, 255, 255)
    return Image.fromarray(pixels)


def _png(img: Image.Image, **params) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG", **params)
    return buffer.getvalue()


def test_crops_are_the_boxes_of_the_image():
    img = _quadrants(90, 61)
    crops = region_crops(_png(img))
    boxes = RegionGrid().boxes(90, 61)
    assert [c.size for c in crops] == [(b.right - b.left, b.bottom - b.top) for b in boxes]
    for crop, box in zip(crops, boxes):
        assert crop.mode == "RGB"
        assert crop.tobytes() == img.crop(box).tobytes()
    assert crops[1].getpixel((0, 0)) == (255, 0, 0) and crops[4].getpixel((crops[4].width - 1, 0)) == (0, 255, 0)


def test_crops_follow_the_exif_orientation():
    displayed = _quadrants(60, 40)                               # what a viewer shows: 60 wide, red top-left
    stored = displayed.transpose(Image.Transpose.ROTATE_90)      # the sensor's 40 x 60 pixels
    exif = Image.Exif()
    exif[0x0112] = 6                                             # rotate 90 degrees clockwise to display
    crops = region_crops(_png(stored, exif=exif.tobytes()))
    assert crops[0].size == (60, 40)
    for crop, box in zip(crops, RegionGrid().boxes(60, 40)):
        assert crop.tobytes() == displayed.crop(box).tobytes()


def test_alpha_is_composited_on_white():
    rgba = np.zeros((20, 30, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[:, 15:, 3] = 255                                        # left half transparent, right half opaque red
    crops = region_crops(_png(Image.fromarray(rgba, "RGBA")))
    assert crops[1].getpixel((0, 0)) == (255, 255, 255)
    assert crops[2].getpixel((crops[2].width - 1, 0)) == (200, 0, 0)
    assert all(c.mode == "RGB" for c in crops)


def test_unreadable_images_name_the_memory(tmp_path):
    with pytest.raises(InvalidMemoryError, match="memory 3: .*not a recognised image"):
        region_crops(b"not an image", index=2)
    with pytest.raises(InvalidMemoryError, match="not found"):
        region_crops(tmp_path / "missing.png")
