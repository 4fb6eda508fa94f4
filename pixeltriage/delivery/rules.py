"""Visual-token rules: how many tokens an answering model spends on one image of a given (width, height).

One frozen dataclass per rule family, each a transcription of that family's own image processor and processing
class (transformers 5) or of a hosted model's published formula; docs/delivery.md names the source of each.

What a token count covers: the tokens the processing class puts in the prompt in place of one image placeholder,
each special token counted once: the image feature tokens plus the marker tokens around or between them (InternVL's
<img> and </img>, Gemma 3's <start_of_image> and <end_of_image>, Idefics3's <fake_token_around_image>,
<row_i_col_j> and <global-img>). Plain text the processor adds beside them (newlines, Gemma 3's pan-and-scan
sentence) is left out: its length depends on the tokenizer. Llama 3.2 Vision is the exception in kind: the prompt
holds one <|image|> token and the text cross-attends to the vision states, which are what its rule counts.

Every rule's `tokens` takes an image alone in its prompt; `prompt_tokens` takes the images a prompt holds together
(LLaVA-OneVision drops its any-resolution tiles when a prompt holds more than one image). Sizes are (width, height).
"""
from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction


def check_size(image_size) -> tuple[int, int]:
    """(width, height) as two positive ints; ValueError for anything else."""
    try:
        width, height = image_size
    except (TypeError, ValueError):
        raise ValueError(f"image size must be (width, height), found {image_size!r}") from None
    try:
        if isinstance(width, bool) or isinstance(height, bool):
            raise TypeError
        width, height = operator.index(width), operator.index(height)
    except TypeError:
        raise ValueError(f"image size must be two ints (width, height), found {image_size!r}") from None
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, found {image_size!r}")
    return width, height


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name} must be an int >= 1, found {value!r}")


class Rule(ABC):
    """The interface every rule family implements."""

    @abstractmethod
    def tokens(self, image_size: tuple[int, int]) -> int:
        """Visual tokens of one image of (width, height) px, alone in its prompt."""

    def prompt_tokens(self, image_sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Tokens of each image when one prompt holds all of them (the same as alone, for most families)."""
        return [self.tokens(size) for size in image_sizes]


# ---- Qwen2-VL resize grid: Qwen2.5-VL, Qwen3-VL, Qwen3.5 ----------------------------------------------------------


@dataclass(frozen=True)
class GridRule(Rule):
    """transformers' Qwen2VLImageProcessor: the image is resized (aspect ratio kept, `smart_resize`) to multiples of
    patch_size * merge_size within [min_pixels, max_pixels]; every merged block is one <|image_pad|> token."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    def __post_init__(self):
        _positive("GridRule", patch_size=self.patch_size, merge_size=self.merge_size, min_pixels=self.min_pixels,
                  max_pixels=self.max_pixels)
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"GridRule: need min_pixels <= max_pixels, found {self.min_pixels}, {self.max_pixels}")

    @property
    def factor(self) -> int:
        """Pixels per token along each side."""
        return self.patch_size * self.merge_size

    @property
    def min_tokens(self) -> int:
        """The fewest tokens any image costs: the processor up-sizes anything smaller."""
        return self.tokens((self.factor, self.factor))

    def resized(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(width, height) the processor feeds to the vision tower."""
        from pixeltriage.engine.patches import smart_resize   # the engine's one copy (imported here: names stay light)

        width, height = check_size(image_size)
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return w, h

    def tokens(self, image_size: tuple[int, int]) -> int:
        w, h = self.resized(image_size)
        return (w // self.factor) * (h // self.factor)


# ---- InternVL 2.5 / 3: GotOcr2 image processor, tiles + thumbnail ------------------------------------------------


def _tile_arrangements(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(columns, rows) with min_tiles <= columns * rows <= max_tiles, by tile count, columns-major within a count
    (got_ocr2's get_all_supported_aspect_ratios: the order decides ties)."""
    found = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]
    return sorted(found, key=lambda g: g[0] * g[1])


@dataclass(frozen=True)
class InternVLRule(Rule):
    """GotOcr2ImageProcessor with crop_to_patches (InternVLProcessor sets it): the tile grid whose aspect ratio is
    closest to the image's, min_tiles..max_tiles tiles of tile_size px, plus a thumbnail tile when there is more than
    one; InternVLProcessor writes <img> + tokens_per_tile <IMG_CONTEXT> per tile + </img>."""

    tile_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    tokens_per_tile: int = 256

    def __post_init__(self):
        _positive("InternVLRule", tile_size=self.tile_size, min_tiles=self.min_tiles, max_tiles=self.max_tiles,
                  tokens_per_tile=self.tokens_per_tile)
        if self.min_tiles > self.max_tiles:
            raise ValueError(f"InternVLRule: min_tiles {self.min_tiles} > max_tiles {self.max_tiles}")

    def grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(columns, rows) of the crop grid (got_ocr2's get_optimal_tiled_canvas)."""
        width, height = check_size(image_size)
        aspect, area = width / height, width * height
        best_diff, best = float("inf"), (1, 1)
        for grid in _tile_arrangements(self.min_tiles, self.max_tiles):
            diff = abs(aspect - grid[0] / grid[1])
            if diff < best_diff:
                best_diff, best = diff, grid
            elif diff == best_diff and area > 0.5 * self.tile_size * self.tile_size * grid[0] * grid[1]:
                best = grid
        return best

    def tiles(self, image_size: tuple[int, int]) -> int:
        """Tiles the vision tower sees: the grid's, plus the thumbnail when the grid has more than one."""
        if self.max_tiles <= 1:
            check_size(image_size)
            return 1
        columns, rows = self.grid(image_size)
        return 1 + columns * rows if columns * rows > 1 else 1

    def tokens(self, image_size: tuple[int, int]) -> int:
        return 2 + self.tokens_per_tile * self.tiles(image_size)


# ---- LLaVA-OneVision: any-resolution tiles, unpadded, capped ------------------------------------------------------

_ONEVISION_PINPOINTS = tuple((h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384))


@dataclass(frozen=True)
class AnyResRule(Rule):
    """LlavaOnevisionProcessor: the base image's features, plus the features of the best any-resolution canvas with
    the padding cropped off (and pooled down when above max_tiles base tiles), plus one newline token per row.
    A prompt with several images gets base features + 1 per image (the processor's multi-image path)."""

    base_size: int = 384
    features_per_side: int = 27           # sqrt(num_image_tokens): 729 = 27 x 27 for SigLIP-so400m/14 at 384 px
    pinpoints: tuple[tuple[int, int], ...] = _ONEVISION_PINPOINTS   # (height, width) canvases
    max_tiles: int = 9                    # vision_aspect_ratio "anyres_max_9"
    drop_cls: bool = False                # vision_feature_select_strategy "default" drops one token

    def __post_init__(self):
        _positive("AnyResRule", base_size=self.base_size, features_per_side=self.features_per_side,
                  max_tiles=self.max_tiles)
        if not self.pinpoints:
            raise ValueError("AnyResRule: pinpoints must not be empty")

    @property
    def base_features(self) -> int:
        return self.features_per_side ** 2

    def canvas(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(height, width) of the chosen canvas (transformers' select_best_resolution)."""
        width, height = check_size(image_size)
        best, best_effective, best_wasted = None, 0, float("inf")
        for h, w in self.pinpoints:
            scale = min(w / width, h / height)
            effective = min(int(width * scale) * int(height * scale), width * height)
            wasted = w * h - effective
            if effective > best_effective or (effective == best_effective and wasted < best_wasted):
                best, best_effective, best_wasted = (h, w), effective, wasted
        return best

    def tokens(self, image_size: tuple[int, int]) -> int:
        width, height = check_size(image_size)
        canvas_h, canvas_w = self.canvas(image_size)
        side = self.features_per_side
        current_h = side * (canvas_h // self.base_size)
        current_w = side * (canvas_w // self.base_size)
        if width / height > current_w / current_h:
            new_h = int(round(height * (current_w / width), 7))
            current_h -= (current_h - new_h) // 2 * 2
        else:
            new_w = int(round(width * (current_h / height), 7))
            current_w -= (current_w - new_w) // 2 * 2
        unpadded, newlines = current_h * current_w, current_h
        ratio = math.sqrt(current_h * current_w / (self.max_tiles * side ** 2))
        if ratio > 1.1:
            unpadded = int(current_h // ratio) * int(current_w // ratio)
            newlines = int(current_h // ratio)
        return unpadded + newlines + self.base_features - self.drop_cls

    def prompt_tokens(self, image_sizes: Sequence[tuple[int, int]]) -> list[int]:
        if len(image_sizes) <= 1:
            return [self.tokens(size) for size in image_sizes]
        for size in image_sizes:
            check_size(size)
        return [self.base_features + 1 - self.drop_cls] * len(image_sizes)


# ---- Gemma 3: a fixed count per view, pan-and-scan crops if enabled ----------------------------------------------


@dataclass(frozen=True)
class FixedRule(Rule):
    """Gemma3Processor: every view (the image, and each pan-and-scan crop when enabled) is <start_of_image> +
    tokens_per_view soft tokens + <end_of_image>; the crop count is Gemma3ImageProcessor's pan_and_scan."""

    tokens_per_view: int = 256
    markers_per_view: int = 2
    pan_and_scan: bool = False
    min_crop_size: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2

    def __post_init__(self):
        _positive("FixedRule", tokens_per_view=self.tokens_per_view, min_crop_size=self.min_crop_size,
                  max_crops=self.max_crops)
        if self.markers_per_view < 0 or not self.min_ratio > 0:
            raise ValueError("FixedRule: markers_per_view must be >= 0 and min_ratio > 0")

    def crops(self, image_size: tuple[int, int]) -> int:
        width, height = check_size(image_size)
        if not self.pan_and_scan:
            return 0
        long, short = (width, height) if width >= height else (height, width)
        if long / short < self.min_ratio:
            return 0
        count = min(int(math.floor(long / self.min_crop_size)), int(math.floor(long / short + 0.5)))
        count = min(self.max_crops, max(2, count))
        crop_long = int(math.ceil(long / count))
        if min(crop_long, short) < self.min_crop_size:
            return 0
        return count

    def tokens(self, image_size: tuple[int, int]) -> int:
        return (1 + self.crops(image_size)) * (self.tokens_per_view + self.markers_per_view)


# ---- Llama 3.2 Vision (Mllama): tiles on the best canvas, cross-attended ----------------------------------------


@dataclass(frozen=True)
class CanvasTileRule(Rule):
    """MllamaImageProcessor: the canvas of up to max_tiles tile_size tiles that needs the least up-scaling (or, if
    none up-scales, the least down-scaling; the smaller canvas on a tie); each tile gives (tile/patch)^2 + 1 vision
    states (patches and a class token), which the text cross-attends to."""

    tile_size: int = 560
    max_tiles: int = 4
    patch_size: int = 14

    def __post_init__(self):
        _positive("CanvasTileRule", tile_size=self.tile_size, max_tiles=self.max_tiles, patch_size=self.patch_size)

    def canvas(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(tiles down, tiles across) of the chosen canvas (mllama's get_optimal_tiled_canvas)."""
        width, height = check_size(image_size)
        options = []
        for a in range(1, self.max_tiles + 1):         # the processor's (a, b) pairs, read as (height, width) tiles
            for b in range(1, self.max_tiles + 1):
                if a * b <= self.max_tiles:
                    scale_h, scale_w = a * self.tile_size / height, b * self.tile_size / width
                    options.append((scale_h if scale_w > scale_h else scale_w, (a, b)))
        up = [s for s, _ in options if s >= 1]
        chosen = min(up) if up else max(s for s, _ in options)
        canvases = [g for s, g in options if s == chosen]
        return min(canvases, key=lambda g: g[0] * g[1])   # first of the smallest area, as np.argmin

    def tiles(self, image_size: tuple[int, int]) -> int:
        rows, columns = self.canvas(image_size)
        return rows * columns

    def tokens(self, image_size: tuple[int, int]) -> int:
        return self.tiles(image_size) * ((self.tile_size // self.patch_size) ** 2 + 1)


# ---- Idefics3 / SmolVLM: resize, split into square tiles, plus a global view --------------------------------------

_IDEFICS3_MAX_IMAGE_SIZE = 4096


@dataclass(frozen=True)
class SplitRule(Rule):
    """Idefics3ImageProcessor / SmolVLMImageProcessor with image splitting: the long edge is resized to longest_edge,
    both sides rounded up to multiples of tile_size; an image larger than one tile becomes rows x columns tiles plus a
    global view. The processing class writes <fake_token_around_image><row_i_col_j> + tokens_per_tile <image> per
    tile and <fake_token_around_image><global-img> + tokens_per_tile <image> + <fake_token_around_image> for the
    global view."""

    longest_edge: int = 4 * 364
    tile_size: int = 364
    tokens_per_tile: int = 169
    split: bool = True

    def __post_init__(self):
        _positive("SplitRule", longest_edge=self.longest_edge, tile_size=self.tile_size,
                  tokens_per_tile=self.tokens_per_tile)

    def grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of tiles; (0, 0) when the image is one tile (the processor's preprocess path)."""
        width, height = check_size(image_size)
        if not self.split:
            return 0, 0
        # resize: the long edge to longest_edge (an odd short side rounded up to even), then under 4096
        aspect = width / height
        if width >= height:
            width = self.longest_edge
            height = int(width / aspect)
            height += height % 2
        else:
            height = self.longest_edge
            width = int(height * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height and width > _IDEFICS3_MAX_IMAGE_SIZE:
            width = _IDEFICS3_MAX_IMAGE_SIZE
            height = int(width / aspect)
        elif height > width and height > _IDEFICS3_MAX_IMAGE_SIZE:
            height = _IDEFICS3_MAX_IMAGE_SIZE
            width = int(height * aspect)
        height, width = max(height, 1), max(width, 1)
        # resize_for_vision_encoder: sides up to multiples of the tile, the short one from the aspect ratio
        tile = self.tile_size
        aspect = width / height
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        if height > tile or width > tile:
            return (height - tile) // tile + 1, (width - tile) // tile + 1
        return 0, 0

    def tokens(self, image_size: tuple[int, int]) -> int:
        rows, columns = self.grid(image_size)
        return rows * columns * (self.tokens_per_tile + 2) + self.tokens_per_tile + 3


# ---- Phi-4-multimodal: dynamic HD crops with a padding mask -------------------------------------------------------


@dataclass(frozen=True)
class DynamicHDRule(Rule):
    """Phi4MultimodalImageProcessor: the image is resized into a grid of crop_size crops (up to max_crops; the grid
    closest in aspect ratio when more would be needed) and padded; the count is 256 + 1 global tokens, the valid
    cells of the 2x-downsampled crop mask, one newline per valid mask row, and 16 (the processor's formula)."""

    crop_size: int = 448
    patch_size: int = 14
    max_crops: int = 36

    def __post_init__(self):
        _positive("DynamicHDRule", crop_size=self.crop_size, patch_size=self.patch_size, max_crops=self.max_crops)
        if self.crop_size % self.patch_size:
            raise ValueError(f"DynamicHDRule: crop_size {self.crop_size} is not a multiple of {self.patch_size}")

    def grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(columns, rows) of crops (the processor's dynamic_preprocess)."""
        width, height = check_size(image_size)
        columns, rows = math.ceil(width / float(self.crop_size)), math.ceil(height / float(self.crop_size))
        if columns * rows <= self.max_crops:
            return columns, rows
        ratios = sorted({(i, j) for n in range(1, self.max_crops + 1) for i in range(1, n + 1)
                         for j in range(1, n + 1) if 1 <= i * j <= self.max_crops}, key=lambda x: x[0] * x[1])
        aspect, area = width / height, width * height
        best_diff, best = float("inf"), (1, 1)
        for ratio in ratios:
            diff = abs(aspect - ratio[0] / ratio[1])
            if diff < best_diff:
                best_diff, best = diff, ratio
            elif diff == best_diff and area > 0.5 * self.crop_size * self.crop_size * ratio[0] * ratio[1]:
                best = ratio
        return best

    def tokens(self, image_size: tuple[int, int]) -> int:
        width, height = check_size(image_size)
        columns, rows = self.grid(image_size)
        target_w, target_h = self.crop_size * columns, self.crop_size * rows
        if target_w / width < target_h / height:
            new_w, new_h = target_w, int(height * (target_w / width))
            pad_w, pad_h = 0, target_h - new_h
        else:
            new_w, new_h = int(width * (target_h / height)), target_h
            pad_w, pad_h = target_w - new_w, 0
        if min(new_h, target_h) < 10 or min(new_w, target_w) < 10:
            raise ValueError(f"image size {(width, height)}: the aspect ratio is too extreme for Phi-4-multimodal's "
                             f"processor (resized to {new_w}x{new_h})")
        mask_side = self.crop_size // self.patch_size
        valid_rows = mask_side * rows - pad_h // self.patch_size       # padding masked by whole patches
        valid_cols = mask_side * columns - pad_w // self.patch_size
        kept_rows, kept_cols = -(-valid_rows // 2), -(-valid_cols // 2)   # the mask's even rows and columns
        return 256 + 1 + kept_rows * kept_cols + kept_rows + 16


# ---- hosted models: published formulas ----------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenAITileRule(Rule):
    """OpenAI's GPT-4o image cost: detail "low" is a flat base_tokens; detail "high" fits the image in a
    fit_size square, scales it down so its shortest side is short_side, and adds tile_tokens per tile_size square
    tile that covers it to base_tokens."""

    detail: str = "high"
    base_tokens: int = 85
    tile_tokens: int = 170
    tile_size: int = 512
    fit_size: int = 2048
    short_side: int = 768

    def __post_init__(self):
        if self.detail not in ("high", "low"):
            raise ValueError(f"OpenAITileRule: detail must be 'high' or 'low', found {self.detail!r}")
        _positive("OpenAITileRule", base_tokens=self.base_tokens, tile_tokens=self.tile_tokens,
                  tile_size=self.tile_size, fit_size=self.fit_size, short_side=self.short_side)

    def scaled(self, image_size: tuple[int, int]) -> tuple[Fraction, Fraction]:
        """The (width, height) the tiles cover, exact: no rounding is published."""
        width, height = check_size(image_size)
        scale = min(Fraction(1), Fraction(self.fit_size, width), Fraction(self.fit_size, height))
        w, h = width * scale, height * scale
        shrink = min(Fraction(1), self.short_side / min(w, h))
        return w * shrink, h * shrink

    def tokens(self, image_size: tuple[int, int]) -> int:
        if self.detail == "low":
            check_size(image_size)
            return self.base_tokens
        w, h = self.scaled(image_size)
        return self.base_tokens + self.tile_tokens * math.ceil(w / self.tile_size) * math.ceil(h / self.tile_size)


@dataclass(frozen=True)
class AreaRule(Rule):
    """Anthropic's Claude image cost: width * height / pixels_per_token, after the image is scaled down (aspect ratio
    kept) until its long edge is at most max_edge and its cost at most max_tokens; rounded up."""

    pixels_per_token: int = 750
    max_edge: int = 1568
    max_tokens: int = 1600

    def __post_init__(self):
        _positive("AreaRule", pixels_per_token=self.pixels_per_token, max_edge=self.max_edge,
                  max_tokens=self.max_tokens)

    def scaled(self, image_size: tuple[int, int]) -> tuple[int, int]:
        width, height = check_size(image_size)
        scale = min(1.0, self.max_edge / max(width, height),
                    math.sqrt(self.max_tokens * self.pixels_per_token / (width * height)))
        if scale >= 1.0:
            return width, height
        return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))

    def tokens(self, image_size: tuple[int, int]) -> int:
        w, h = self.scaled(image_size)
        return min(self.max_tokens, -(-(w * h) // self.pixels_per_token))


@dataclass(frozen=True)
class GeminiTileRule(Rule):
    """Google's Gemini 2.x image cost: tile_tokens for an image with both sides <= 384 px; a larger one is cropped and
    scaled into tile_size square tiles of tile_tokens each, counted here as the tiles that cover it (which gives the
    small image's one tile too)."""

    tile_tokens: int = 258
    tile_size: int = 768

    def __post_init__(self):
        _positive("GeminiTileRule", tile_tokens=self.tile_tokens, tile_size=self.tile_size)

    def tokens(self, image_size: tuple[int, int]) -> int:
        width, height = check_size(image_size)
        return self.tile_tokens * -(-width // self.tile_size) * -(-height // self.tile_size)
