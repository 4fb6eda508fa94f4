"""`pixeltriage cache put DB IMAGES... [--notes FILE]` and `pixeltriage cache stats DB`: the write-time cache."""
from __future__ import annotations

import argparse
import json
import os
import sys

from pixeltriage.cli.common import VERBOSITY, existing_file, new_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION")
    sub.required = True
    put = sub.add_parser("put", help="store thumbnails (and notes) of images", parents=[VERBOSITY],
                         description="Store the 336-px thumbnail of each image, and its note, "
                                     "and print 'KEY<TAB>PATH' per image.")
    put.add_argument("db", type=new_file, help="cache file (created if missing)")
    put.add_argument("images", nargs="+", type=existing_file, help="image files")
    put.add_argument("--notes", metavar="FILE", type=existing_file,
                     help="JSON object {image: note}; an image is matched by its path as given "
                          "on the command line, else by its file name")
    stats = sub.add_parser("stats", help="print the cache's counts and sizes as JSON", parents=[VERBOSITY])
    stats.add_argument("db", type=existing_file, help="cache file")


def run(args: argparse.Namespace) -> int:
    from pixeltriage.engine.cache import Cache

    if args.cache_command == "stats":
        with Cache(args.db) as cache:
            print(json.dumps(cache.stats(), indent=2))
        return 0
    notes = _read_notes(args.notes) if args.notes else {}
    used = set()
    with Cache(args.db) as cache:
        for path in args.images:
            name = path if path in notes else os.path.basename(path)
            note = notes.get(name, "")
            if name in notes:
                used.add(name)
            print(f"{cache.put(path, note)}\t{path}", flush=True)
    unused = sorted(set(notes) - used)
    if unused:
        print(f"warning: {len(unused)} notes match no image given, e.g. {unused[0]!r}", file=sys.stderr)
    return 0


def _read_notes(path: str) -> dict[str, str]:
    from pixeltriage.config import read_json
    from pixeltriage.errors import PixelTriageError

    notes = read_json(path, PixelTriageError)
    if not all(isinstance(v, str) for v in notes.values()):
        raise PixelTriageError(f"{path}: notes file must be a JSON object of strings {{image: note}}")
    return notes
