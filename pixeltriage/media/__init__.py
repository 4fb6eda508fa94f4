"""An image in any form the engine takes (a PIL image, bytes, a local path) -> decoded, oriented RGB pixels and
thumbnails, under one set of checks."""
