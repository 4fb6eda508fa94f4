"""`pixeltriage bench retrieval`: what region retrieval (DeliverMem R1) costs at write time and at query time.

One encoder (--encoder DIR, else the cached "base" demo: siglip2-base-patch16-224's shapes, random weights,
which cost what the real ones do), in one run, warm-up excluded from every figure:

write time, on --images synthetic photos of --image-size (JPEG, `workloads.camera_jpegs`), each into a fresh cache:
    stages    per image, medians: cache.put (decode, thumbnail, SQLite), crop (decode at full size, orient,
              the five crops), preprocess (the five crops to pixel values), encode (preprocess + the vision
              forward of the five crops), store (the vectors' SQLite write, RegionStore.put)
    add       RegionIndex.add_many end to end, images_per_batch 1 (5 crops per forward) and --batch (5 x batch
              crops per forward): images/s from the median of --repeats runs, and their ratio
query time:
    text      the question's embedding (median over --queries questions)
    search    per stored size (--stored), random unit vectors [N, 5, D]: exact and faiss ms per question
              (medians), faiss's build seconds and its recall@10 against exact on the same questions
    refresh   the per-search check for new rows (RegionStore.state) and a cold load of --load images'
              vectors from a cache file (rows/s)
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pixeltriage.bench.timing import set_threads, threads_label, timed
from pixeltriage.bench.workloads import camera_jpegs, retrieval_questions


def _ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def write_stages(encoder, photos: list[bytes], workdir: Path) -> dict:
    from pixeltriage.store.cache import Cache
    from pixeltriage.retrieval.encoder import preprocess_images
    from pixeltriage.retrieval.regions import region_crops
    from pixeltriage.store.regions import RegionStore

    times: dict[str, list[float]] = {"put": [], "crop": [], "preprocess": [], "encode": [], "store": []}
    rules = getattr(encoder, "image_rules", None)
    with Cache(workdir / "stages.db") as cache:
        store = RegionStore(cache)
        for i, photo in enumerate([photos[0], *photos]):          # the first image warms up, untimed
            t0 = time.perf_counter()
            key = cache.put(photo)
            t1 = time.perf_counter()
            crops = region_crops(photo)
            t2 = time.perf_counter()
            if rules is not None:
                preprocess_images(crops, rules)
            t3 = time.perf_counter()
            vectors = encoder.encode_images(crops)
            t4 = time.perf_counter()
            store.put(key, "bench", vectors)
            t5 = time.perf_counter()
            if i:
                for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    times[name].append(seconds)
    stages = {f"{name}_ms": _ms(seconds) for name, seconds in times.items()}
    if rules is None:
        del stages["preprocess_ms"]
    stages["total_ms"] = sum(stages[f"{name}_ms"] for name in ("put", "crop", "encode", "store"))
    return stages


def write_throughput(encoder, photos: list[bytes], batch: int, repeats: int, workdir: Path) -> dict:
    from pixeltriage.store.cache import Cache
    from pixeltriage.retrieval.index import RegionIndex

    out = {}
    for per_batch in sorted({1, batch}):
        if hasattr(encoder, "batch_size"):
            encoder.batch_size = 5 * per_batch                  # one vision forward per batch of images
        runs = []
        for run in range(repeats + 1):                           # run 0 warms up on one image, untimed
            with Cache(workdir / f"add-{per_batch}-{run}.db") as cache:
                index = RegionIndex(cache, encoder, images_per_batch=per_batch)
                t0 = time.perf_counter()
                index.add_many(photos[:1] if run == 0 else photos)
                if run:
                    runs.append(time.perf_counter() - t0)
        out[f"images_per_batch_{per_batch}"] = {"images_per_s": len(photos) / statistics.median(runs),
                                                "crops_per_forward": 5 * per_batch}
    rates = [v["images_per_s"] for v in out.values()]
    out["batched_speedup"] = rates[-1] / rates[0]
    return out


def text_latency(encoder, queries: int) -> dict:
    questions = retrieval_questions(queries)
    encoder.encode_texts(questions[:1])
    seconds = []
    for question in questions:
        t0 = time.perf_counter()
        encoder.encode_texts([question])
        seconds.append(time.perf_counter() - t0)
    return {"text_ms": _ms(seconds)}


def search_latency(stored: int, dim: int, queries: int, seed: int = 0) -> dict:
    from pixeltriage.retrieval.search import QuantizedSearch, exact_search, faiss_available

    gen = torch.Generator().manual_seed(seed)
    vectors = torch.nn.functional.normalize(torch.randn(stored, 5, dim, generator=gen), dim=-1)
    questions = torch.nn.functional.normalize(torch.randn(queries, dim, generator=gen), dim=-1)
    out: dict = {"stored": stored, "vector_bytes": vectors.numel() * 4}
    exact = [exact_search(vectors, q[None], 10) for q in questions]
    out["exact_ms"] = _ms(_each(lambda q: exact_search(vectors, q[None], 10), questions))
    out["exact_whole_image_ms"] = _ms(_each(lambda q: exact_search(vectors, q[None], 10, True), questions))
    if faiss_available():
        index = QuantizedSearch()
        t0 = time.perf_counter()
        index.sync(vectors)
        out["faiss_build_s"] = time.perf_counter() - t0
        found = [index.search(vectors, q[None], 10) for q in questions]
        out["faiss_ms"] = _ms(_each(lambda q: index.search(vectors, q[None], 10), questions))
        hits = sum(len(set(f.rows[0].tolist()) & set(e.rows[0].tolist())) for f, e in zip(found, exact))
        out["faiss_recall_at_10"] = hits / (10 * queries)
        out["faiss_speedup"] = out["exact_ms"] / out["faiss_ms"]
    return out


def _each(fn, questions) -> list[float]:
    fn(questions[0])                                             # warm-up
    seconds = []
    for q in questions:
        t0 = time.perf_counter()
        fn(q)
        seconds.append(time.perf_counter() - t0)
    return seconds


class _StoredOnly:
    """Reading stored vectors needs only the encoder's fingerprint and D; nothing is encoded."""

    def __init__(self, dim: int):
        self.fingerprint, self.dim = "bench-stored-vectors", dim


def load_and_refresh(stored: int, dim: int, workdir: Path) -> dict:
    """A cache of `stored` tiny images with random vectors: the per-search check and a cold load."""
    from pixeltriage.store.cache import Cache
    from pixeltriage.retrieval.index import RegionIndex

    rng = np.random.default_rng(0)
    with Cache(workdir / f"load-{stored}.db") as cache:
        index = RegionIndex(cache, _StoredOnly(dim))
        step = 1000
        for start in range(0, stored, step):
            keys = [cache.put(Image.new("RGB", (1, 1), (i % 256, i // 256 % 256, i // 65536)))
                    for i in range(start, min(start + step, stored))]
            index.store.put_many(index.fingerprint, [(k, rng.standard_normal((5, dim), dtype=np.float32))
                                                     for k in keys])
        seconds = timed(lambda: RegionIndex(cache, _StoredOnly(dim)).refresh(), 3, warmup=1)
        index.refresh()
        check = timed(index.refresh, 200, warmup=5)
    return {"stored": stored, "cold_load_s": statistics.median(seconds),
            "rows_per_s": stored / statistics.median(seconds), "refresh_check_us": 1e6 * statistics.median(check)}


def run_retrieval(args: argparse.Namespace) -> int:
    from pixeltriage.retrieval.demo import demo_encoder
    from pixeltriage.retrieval.encoder import SiglipEncoder

    set_threads(args.threads)
    path = Path(args.encoder) if args.encoder else demo_encoder("base")
    encoder = SiglipEncoder.load(path, device=args.device)
    photos = camera_jpegs(args.images, args.image_size)
    report: dict = {"encoder": encoder.describe(), "device": args.device, "threads": torch.get_num_threads(),
                    "images": args.images, "image_size": list(args.image_size)}
    with tempfile.TemporaryDirectory(prefix="pixeltriage-bench-") as tmp:
        workdir = Path(tmp)
        _say(args, "write-time stages")
        report["stages"] = write_stages(encoder, photos, workdir)
        _say(args, "write-time throughput")
        report["add"] = write_throughput(encoder, photos, args.batch, args.repeats, workdir)
        _say(args, "question embeddings")
        report["query"] = text_latency(encoder, args.queries)
        report["search"] = []
        for stored in args.stored:
            _say(args, f"search over {stored:,} images")
            report["search"].append(search_latency(stored, encoder.dim, args.queries))
        if args.load:
            _say(args, f"cold load of {args.load:,} images")
            report["load"] = load_and_refresh(args.load, encoder.dim, workdir)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def _say(args: argparse.Namespace, what: str) -> None:
    if not args.json:
        print(f"... {what}", flush=True)


def print_report(r: dict) -> None:
    print(f"\n{r['encoder']} on {r['device']}, {threads_label(r['threads'])}; "
          f"{r['images']} photos of {r['image_size'][0]}x{r['image_size'][1]}")
    s = r["stages"]
    parts = ", ".join(f"{name.removesuffix('_ms')} {value:.1f}" for name, value in s.items() if name != "total_ms")
    print(f"write time per image (median ms): {parts}; total {s['total_ms']:.1f}")
    for name, value in r["add"].items():
        if name.startswith("images_per_batch"):
            print(f"  add_many, {value['crops_per_forward']} crops per forward: {value['images_per_s']:.2f} images/s")
    print(f"  batched / one image at a time: {r['add']['batched_speedup']:.2f}x")
    print(f"query: question embedding {r['query']['text_ms']:.1f} ms")
    for s in r["search"]:
        line = (f"  {s['stored']:>7,} images ({s['vector_bytes'] / 2**20:.0f} MiB): exact {s['exact_ms']:.2f} ms "
                f"(whole-image {s['exact_whole_image_ms']:.2f} ms)")
        if "faiss_ms" in s:
            line += (f", faiss {s['faiss_ms']:.2f} ms ({s['faiss_speedup']:.2f}x, recall@10 "
                     f"{s['faiss_recall_at_10']:.3f}, built in {s['faiss_build_s']:.2f} s)")
        print(line)
    if "load" in r:
        ld = r["load"]
        print(f"  cold load of {ld['stored']:,} images from the cache: {ld['cold_load_s']:.2f} s "
              f"({ld['rows_per_s']:,.0f} rows/s); per-search check for new rows {ld['refresh_check_us']:.0f} us")
