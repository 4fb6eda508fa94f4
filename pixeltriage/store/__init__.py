"""The write-time store: one SQLite file per cache, holding the scorer's rows (thumbnails, notes, sizes, vision
features: `cache`) and the region vectors of retrieval (`regions`) under one connection discipline, and one schema
for them both, with its version and migrations (`schema`)."""
