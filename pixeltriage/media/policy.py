"""The one policy every way in applies to an image: the library, the server, both clients and the framework
adapters; the thumbnail side, the pixel limit and the URL rule. Constants and a pattern only (no PIL), so the
clients and the configuration read them for nothing.

URLs: a string that `is_url` is never read as a file or fetched by the library, the server or the clients; a data
URI is decoded where base64 is accepted (`media.sources.decode_base64`); only the framework adapters fetch, and
only http(s), when built with `allow_url_images=True`.
"""
from __future__ import annotations

import re

# The longer side of the thumbnail System One reads: what the write-time cache stores, what the warm-up scores, and
# what a checkpoint's pixeltriage.json `thumbnail_size` defaults to.
THUMBNAIL_SIDE = 336

# The most pixels (width x height, as the header declares them) an image may have: a larger one is refused from its
# header, before any pixel is decoded, by this number and never by PIL's (`Image.MAX_IMAGE_PIXELS`, which a host
# may change). 89,478,485 (about 9459 x 9459, 358 MB as RGBA) is PIL's default, so a host's own PIL use agrees.
MAX_IMAGE_PIXELS = 89_478_485

# A scheme and "://" (http://, s3://, file:///...), or a scheme that needs no slashes (file:, data:, http:, ...).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://|(file|data|http|https|ftp):)", re.IGNORECASE)


def is_url(text: str) -> bool:
    """Whether `text` (a path or an image value as given) is a URL or a data URI rather than a file path."""
    return _URL.match(text) is not None
