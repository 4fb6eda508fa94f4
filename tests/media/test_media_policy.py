"""One policy for every way an image comes in: the library, the client, the server's image root and the framework
adapters refuse the same strings as URLs and read the same strings as paths; one thumbnail side."""
import pytest
from PIL import Image

from pixeltriage.config import TriageConfig
from pixeltriage.engine.types import Memory
from pixeltriage.errors import InvalidMemoryError, InvalidRequestError
from pixeltriage.integrations.common import image_value
from pixeltriage.media.image import make_thumbnail, open_image, thumbnail
from pixeltriage.media.policy import THUMBNAIL_SIDE, is_url
from pixeltriage.media.sources import ImageRoot
from pixeltriage.serve.client import encode_memories
from pixeltriage.store.cache import Cache

URLS = ["https://example.com/cat.png", "HTTP://EXAMPLE.COM/CAT.PNG", "s3://bucket/cat.png", "file:///etc/passwd",
        "file:/etc/passwd", "http:cat.png", "ftp:cat.png", "git+ssh://host/repo", "data:image/png;base64,iVBORw0K"]
PATHS = ["cat.png", "photos/cat.png", "/srv/photos/cat.png", "./http.png", "a:b.png", "C:\\photos\\cat.png",
         "c:/photos/cat.png", "https.png", "data/cat.png"]


@pytest.mark.parametrize("text", URLS)
def test_urls(text):
    assert is_url(text)


@pytest.mark.parametrize("text", PATHS)
def test_paths(text):
    assert not is_url(text)


@pytest.mark.parametrize("text", URLS)
def test_every_way_in_refuses_a_url_as_a_url(text, tmp_path):
    with pytest.raises(InvalidMemoryError, match="URLs are not accepted"):
        open_image(text, index=0)
    with pytest.raises(InvalidMemoryError, match="URLs are not accepted"):
        encode_memories([Memory(image=text)])
    with pytest.raises(InvalidRequestError, match="URLs are not accepted"):
        ImageRoot(tmp_path, 1 << 20).resolve(text, "path")
    if not text.lower().startswith("data:"):         # the adapters decode a data URI as base64
        with pytest.raises(InvalidMemoryError, match="is a URL"):
            image_value(text, 0, "image", allow_urls=False)


@pytest.mark.parametrize("text", ["a:b.png", "https.png", "data/cat.png"])
def test_every_way_in_reads_a_path_as_a_path(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidMemoryError, match="image file not found"):
        open_image(text, index=0)
    with pytest.raises(InvalidMemoryError, match="image file not found"):
        encode_memories([Memory(image=text)])
    with pytest.raises(InvalidRequestError, match="is not a file under the image root"):
        ImageRoot(tmp_path, 1 << 20).read(text, "path")
    with pytest.raises(InvalidMemoryError, match="no such file"):
        image_value(text, 0, "image", allow_urls=False)


def test_the_thumbnail_side_is_the_one_every_part_uses(tmp_path):
    assert TriageConfig().thumbnail_size == THUMBNAIL_SIDE
    wide = Image.new("RGB", (2 * THUMBNAIL_SIDE + 7, THUMBNAIL_SIDE), (40, 90, 160))
    assert make_thumbnail(wide).width == thumbnail(wide).width == THUMBNAIL_SIDE
    with Cache(tmp_path / "cache.db") as cache:
        assert cache.thumbnail(cache.put(wide)).width == THUMBNAIL_SIDE
