"""Where PixelTriage keeps what it generates: demo checkpoints, packed files, built native kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PIXELTRIAGE_CACHE, else ~/.cache/pixeltriage."""
    return Path(os.environ.get("PIXELTRIAGE_CACHE") or Path.home() / ".cache" / "pixeltriage")
