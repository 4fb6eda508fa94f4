"""`pixeltriage retrieve` (region retrieval over the write-time cache) and `pixeltriage init-encoder-demo`."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from pixeltriage.cli.common import DEVICES, existing_cache, existing_directory, int_at_least, new_directory

# the choices of the library's tables (tests/retrieval/test_retrieve_cli.py checks that they agree)
INDEX_BACKENDS = ("auto", "exact", "faiss")                # pixeltriage.retrieval.search.BACKENDS
ENCODER_PRESETS = ("base", "tiny", "tiny-naflex")          # pixeltriage.retrieval.demo.PRESETS
DEFAULT_OVERLAP = 0.25                                     # pixeltriage.retrieval.regions.DEFAULT_OVERLAP


def overlap(text: str) -> float:
    """An argparse type: the tiles' overlap, a number in [0, 1)."""
    value = float(text)
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


overlap.__name__ = "float"


def encoder_directory(text: str) -> str:
    """An argparse type: a directory holding a config.json (a checkpoint, checked in full when it loads), or a
    Hugging Face hub id (org/name[@revision]) that no local path spells, read from the local hub cache at load."""
    from pixeltriage.hub import parse_hub_id

    if not os.path.exists(text) and parse_hub_id(text) is not None:
        return text
    existing_directory(text)
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text}: no config.json; not a SigLIP 2 checkpoint directory")
    return text


def add_encoder_arguments(p: argparse.ArgumentParser, flag: str, required: bool) -> None:
    """The encoder options `retrieve` and `cache put` share."""
    p.add_argument(flag, metavar="DIR", type=encoder_directory, required=required, default=None,
                   help="SigLIP 2 checkpoint directory (transformers layout, safetensors), or a hub id in the local "
                        "hub cache (org/name[@revision]); 'pixeltriage init-encoder-demo DIR' writes a demo one")
    p.add_argument("--overlap", type=overlap, default=DEFAULT_OVERLAP,
                   help=f"share of each side the 2 x 2 tiles overlap by (default {DEFAULT_OVERLAP}); vectors are "
                        f"stored per overlap, so retrieve with the value they were indexed with")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where the encoder runs (default: cpu)")


def load_encoder(args: argparse.Namespace, path: str):
    from pixeltriage.retrieval.encoder import SiglipEncoder

    return SiglipEncoder.load(path, device=args.device)


def add_retrieve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", metavar="DB", required=True, type=existing_cache,
                   help="write-time cache (a file, or a postgresql:// URL) whose images were indexed (pixeltriage "
                        "cache put ... --index-encoder DIR)")
    add_encoder_arguments(p, "--encoder", required=True)
    p.add_argument("--question", metavar="TEXT", required=True, action="append",
                   help="what to retrieve images for; repeat for several questions")
    p.add_argument("--top", metavar="N", type=int_at_least(1), default=10, help="images per question (default 10)")
    p.add_argument("--whole-image", action="store_true",
                   help="score each image by its whole-image embedding only (the control), not by its best region")
    p.add_argument("--index", choices=INDEX_BACKENDS, default="auto",
                   help="exact brute force, the faiss index (an 8-bit scan, re-scored exactly) or auto (faiss from "
                        "5k indexed images on; default)")
    p.add_argument("--json", action="store_true", help="print one JSON object per question")


def run_retrieve(args: argparse.Namespace) -> int:
    from pixeltriage.store.cache import Cache
    from pixeltriage.retrieval.index import RegionIndex
    from pixeltriage.retrieval.regions import RegionGrid

    encoder = load_encoder(args, args.encoder)
    with Cache(args.cache) as cache:
        index = RegionIndex(cache, encoder, RegionGrid(args.overlap), backend=args.index)
        results = index.search_many(args.question, args.top, whole_image=args.whole_image)
        _warn_unindexed(cache, index)
        notes = {hit.key: _note(cache, hit.key) for hits in results for hit in hits}
    mode = "whole-image" if args.whole_image else "regions"
    for question, hits in zip(args.question, results):
        rows = [{"rank": rank, **hit.to_dict(), "note": notes[hit.key]} for rank, hit in enumerate(hits, start=1)]
        if args.json:
            print(json.dumps({"question": question, "mode": mode, "hits": rows}), flush=True)
        else:
            _print_table(question, mode, rows)
    return 0


def _note(cache, key: str) -> str:
    try:
        return cache.note(key)
    except KeyError:                        # deleted since the search
        return ""


def _warn_unindexed(cache, index) -> None:
    missing = index.unindexed()
    if not missing:
        return
    others = {fp: n for fp, n in index.store.fingerprints().items() if fp != index.fingerprint}
    hint = (f"; the cache holds region vectors of {len(others)} other encoder or overlap setting(s)" if others
            else "")
    print(f"warning: {len(missing)} of {len(cache)} cached images have no region vectors for this encoder and "
          f"overlap and cannot be retrieved (e.g. {missing[0]}); index them with 'pixeltriage cache put "
          f"{cache.location} IMAGE... --index-encoder DIR'{hint}", file=sys.stderr)


def _print_table(question: str, mode: str, rows: list[dict]) -> None:
    print(f"question: {question}  ({mode})")
    if not rows:
        print("  no indexed images")
    for row in rows:
        box = "" if row["box"] is None else "({}, {}, {}, {})".format(*row["box"])
        note = row["note"] if len(row["note"]) <= 60 else row["note"][:57] + "..."
        print(f"  {row['rank']:>3}  {row['score']:+.4f}  {row['region']:<12}  {box:<22}  {row['key']}  {note}")
    print(flush=True)


def add_init_encoder_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=new_directory, help="directory to create (absent or empty)")
    p.add_argument("--preset", choices=ENCODER_PRESETS, default="tiny",
                   help="tiny: 32 px, D=32 (the demo and tests); tiny-naflex: the NaFlex variant; base: the shapes of "
                        "siglip2-base-patch16-224, ~720 MB, for benchmarks (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")


def run_init_encoder_demo(args: argparse.Namespace) -> int:
    from pixeltriage.retrieval.demo import write_demo_encoder

    path = write_demo_encoder(args.dir, args.preset, args.seed)
    print(f"wrote demo SigLIP 2 encoder '{args.preset}' (seed {args.seed}, random weights: its rankings mean "
          f"nothing) to {path}")
    return 0
