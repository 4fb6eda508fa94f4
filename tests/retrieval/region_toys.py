"""A deterministic toy encoder for the region index: an image is the share of its pixels in each colour class
(red, green, blue, anything else), a text the class its colour word names, both L2-normalised. Whole-image
pooling averages a small object away exactly as a real encoder's does, in a way a test can compute by hand."""
from __future__ import annotations

import numpy as np
import torch

COLOURS = ("red", "green", "blue")


def colour_shares(image) -> np.ndarray:
    """[red, green, blue, other] pixel shares of an RGB image (sum 1)."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16).reshape(-1, 3)
    r, g, b = pixels[:, 0], pixels[:, 1], pixels[:, 2]
    red = (r > 150) & (g < 100) & (b < 100)
    green = (g > 150) & (r < 100) & (b < 100)
    blue = (b > 150) & (r < 100) & (g < 100)
    counts = np.array([red.sum(), green.sum(), blue.sum(), 0], dtype=np.float64)
    counts[3] = len(pixels) - counts[:3].sum()
    return counts / len(pixels)


class ColourEncoder:
    dim = 4

    def __init__(self, name: str = "colour-v1"):
        self.fingerprint = f"toy-{name}"
        self.images_encoded = 0

    def encode_images(self, images):
        self.images_encoded += len(images)
        shares = torch.tensor(np.stack([colour_shares(img) for img in images]), dtype=torch.float32) \
            if images else torch.zeros(0, 4)
        return torch.nn.functional.normalize(shares, dim=1)

    def encode_texts(self, texts):
        rows = torch.zeros(len(texts), 4)
        for i, text in enumerate(texts):
            words = [c for c in COLOURS if c in text.lower()]
            rows[i, COLOURS.index(words[0]) if words else 3] = 1.0
        return rows
