"""`pixeltriage cache put DB IMAGES... [--notes FILE] [--index-encoder DIR]` and `pixeltriage cache stats DB`: the
write-time cache."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from pixeltriage.cli.common import VERBOSITY, cache_target, existing_cache, existing_file
from pixeltriage.media.policy import THUMBNAIL_SIDE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pixeltriage.cli.retrieve import add_encoder_arguments      # stdlib only, as this module

    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION")
    sub.required = True
    put = sub.add_parser("put", help="store thumbnails (and notes) of images", parents=[VERBOSITY],
                         description=f"Store the {THUMBNAIL_SIDE}-px thumbnail of each image, and its note, "
                                     "and print 'KEY<TAB>PATH' per image.")
    put.add_argument("db", type=cache_target, help="cache file (created if missing), or a postgresql:// URL")
    put.add_argument("images", nargs="+", type=existing_file, help="image files")
    put.add_argument("--notes", metavar="FILE", type=existing_file,
                     help="JSON object {image: note}; an image is matched by its path as given "
                          "on the command line, else by its file name")
    index = put.add_argument_group("region index (pixeltriage retrieve)")
    add_encoder_arguments(index, "--index-encoder", required=False)
    stats = sub.add_parser("stats", help="print the cache's counts and sizes as JSON", parents=[VERBOSITY])
    stats.add_argument("db", type=existing_cache, help="cache file, or a postgresql:// URL")


def run(args: argparse.Namespace) -> int:
    from pixeltriage.store.cache import Cache

    if args.cache_command == "stats":
        from pixeltriage.store.regions import RegionStore

        with Cache(args.db) as cache:
            stats = cache.stats()
            stats.update(RegionStore(cache).stats())       # the region vectors kept in the same file
        print(json.dumps(stats, indent=2))
        return 0
    notes = _read_notes(args.notes) if args.notes else {}
    used = set()
    chosen = []
    for path in args.images:
        name = path if path in notes else os.path.basename(path)
        chosen.append(notes.get(name, ""))
        if name in notes:
            used.add(name)
    with Cache(args.db) as cache:
        if args.index_encoder:
            _put_indexed(cache, args, chosen)
        else:
            for path, note in zip(args.images, chosen):
                with _naming(path):
                    key = cache.put(path, note)
                print(f"{key}\t{path}", flush=True)
    unused = sorted(set(notes) - used)
    if unused:
        print(f"warning: {len(unused)} notes match no image given, e.g. {unused[0]!r}", file=sys.stderr)
    return 0


def _put_indexed(cache, args: argparse.Namespace, notes: list[str]) -> None:
    """Put the images and store their region vectors, a batch of images encoded at a time."""
    from pixeltriage.cli.retrieve import load_encoder
    from pixeltriage.errors import InvalidMemoryError
    from pixeltriage.retrieval.index import RegionIndex
    from pixeltriage.retrieval.regions import RegionGrid

    def printed(start: int, keys: list[str]) -> None:              # each batch's keys as soon as it is stored
        for key, path in zip(keys, args.images[start:]):
            print(f"{key}\t{path}", flush=True)

    index = RegionIndex(cache, load_encoder(args, args.index_encoder), RegionGrid(args.overlap))
    try:
        index.add_many(args.images, notes, on_batch=printed)
    except InvalidMemoryError as e:
        with _naming(args.images[e.index]):
            raise


@contextlib.contextmanager
def _naming(path: str):
    """An unreadable image's error names its file (the cache words errors about the bytes it read)."""
    from pixeltriage.errors import InvalidMemoryError, PixelTriageError

    try:
        yield
    except InvalidMemoryError as e:
        raise PixelTriageError(e.reason if path in e.reason else f"{path}: {e.reason}") from None


def _read_notes(path: str) -> dict[str, str]:
    from pixeltriage.config import read_json
    from pixeltriage.errors import PixelTriageError

    notes = read_json(path, PixelTriageError)
    if not all(isinstance(v, str) for v in notes.values()):
        raise PixelTriageError(f"{path}: notes file must be a JSON object of strings {{image: note}}")
    return notes
