"""An image in any form (a PIL image, bytes, a local path, base64 or a data URI, a path under a served folder) ->
decoded, oriented RGB pixels and thumbnails, under one set of checks."""
