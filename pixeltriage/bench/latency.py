"""`pixeltriage bench latency`: per-question latency of System One over a stream of episodes, against the
answering model's prefill with all images opened vs ours@k, on the same device in the same run.

    pixeltriage bench latency [--preset tiny|bench-small|2b] [--device cpu|cuda] [--dtype ...] [--batch N]
                              [--questions Q] [--k 1,2] [--answering-scale tiny|small|7b] [--profile DIR]
                              [--plot out.png] [--json]

System One: a seeded stream of Q questions (`workloads.episodes`), each with 0-20 memories of varied image sizes
(photos, screenshots, scans) and dialogue text; latency = `Scorer.score` end to end (preprocessing, packing, forward,
head), warm-up questions excluded; p50/p90/p99 at batch 1, and per batch of N with `score_batch` (questions/s).

Answering prefill: transformers' Qwen2.5-VL architecture (`Qwen2_5_VLForConditionalGeneration`, random weights)
at the stated `--answering-scale` (the real 7B does not fit a CPU run; `7b` is the FLOP model's shape of it), fed
one 10-image episode drawn like the stream's (same image sizes) through transformers' own Qwen2-VL image
processor: every image opened (open-all), or only the k highest-gain ones with a short text proxy for the rest
(ours@k), timed as one forward each.

`--profile DIR`: a torch profiler trace (DIR/trace.json, chrome://tracing) of a few System One questions and a
per-stage table (preprocess, pack, vision, vision_attention, gated_delta, delta_conv where the C delta pass ran,
delta_rule, attention, mlp, head) with each stage's analytic FLOPs, achieved TFLOP/s, and its fraction of the GEMM
rate measured in the run and of the device's peak (A100 312, H100/H200 989 dense bf16 TFLOP/s) when the device is
one of those.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from PIL import Image

from pixeltriage.bench import workloads
from pixeltriage.bench.models.flops import ANSWERING_SHAPES, profiler_stage_flops, scorer_flops
from pixeltriage.bench.models.prefill_cost import cost_report
from pixeltriage.bench.timing import (cpu_machine, device_peak_tflops, emit, flop_rate, gemm_tflops, machine_line,
                                      percentiles, progress_line, set_threads, threads_label, timed)
from pixeltriage.config import default_dtype
from pixeltriage.delivery.profiles import DEFAULT_CHECKPOINT

def _scale_of(shape) -> dict:
    lang, vis = shape.language, shape.vision
    return dict(text=(lang.hidden_size, len(lang.layer_types), lang.num_attention_heads, lang.num_key_value_heads,
                      lang.intermediate_size),
                vision=(vis.depth, vis.hidden_size, vis.num_heads, vis.intermediate_size))


ANSWERING_SCALES = {
    # text: hidden, layers, heads, kv heads, ffn; vision: depth, hidden, heads, ffn
    "tiny": dict(text=(256, 4, 4, 2, 704), vision=(4, 256, 4, 512)),
    "small": dict(text=(1024, 8, 8, 2, 2816), vision=(8, 640, 10, 1280)),
    "7b": _scale_of(ANSWERING_SHAPES["qwen2.5-vl-7b"]),         # the FLOP model's Qwen2.5-VL-7B
}
PROXY_WORDS = 30
STREAM_MEMORIES = 20     # a question of the stream has 0 to this many memories
ANSWERING_IMAGES = 10    # the answering prefill's episode


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


WARMUP_QUESTIONS = 2     # the stream's first questions, run untimed before the measured ones


def system_one_latency(scorer, episodes, batch: int, warmup: int = WARMUP_QUESTIONS) -> dict:
    dev = scorer.device
    for q, m in episodes[:warmup]:
        scorer.score(q, m)
    rest = episodes[warmup:]
    single = [timed(lambda: scorer.score(q, m), 1, warmup=0, device=dev)[0] for q, m in rest]
    out = {"batch_1": {**percentiles(single), "questions": len(single), "questions_per_s": len(single) / sum(single)}}
    if batch > 1:
        batches = [rest[i:i + batch] for i in range(0, len(rest) - batch + 1, batch)]
        lat = [timed(lambda: scorer.score_batch(b), 1, warmup=0, device=dev)[0] for b in batches]
        out[f"batch_{batch}"] = {**percentiles(lat), "batches": len(lat),
                                 "questions_per_s": batch * len(lat) / sum(lat) if lat else float("nan")}
    return out


def random_answering_model(scale: str, device: torch.device, dtype: torch.dtype):
    """transformers' Qwen2.5-VL architecture at one of ANSWERING_SCALES, random weights (seed 0): (model, config)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    (h, layers, heads, kv, ffn), (depth, vh, vheads, vffn) = ANSWERING_SCALES[scale]["text"], \
        ANSWERING_SCALES[scale]["vision"]
    half = h // heads // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=8192, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=65536,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
                         bos_token_id=8004, eos_token_id=8005),
        vision_config=dict(depth=depth, hidden_size=vh, intermediate_size=vffn, num_heads=vheads, out_hidden_size=h,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[i for i in range(depth) if i % 8 == 7] or [depth - 1]),
        image_token_id=8000, video_token_id=8001, vision_start_token_id=8002, vision_end_token_id=8003)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(device=device, dtype=dtype).eval()
    return model, cfg


def _prefill_inputs(cfg, images: list[Image.Image], opened: list[bool], text_tokens: int, device, dtype):
    """input ids / pixels for one answering call: question text, then per memory its image (when opened) or a
    PROXY_WORDS-token text proxy."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 3136, "longest_edge": 12845056})
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 7000, (text_tokens,), generator=g)]
    shown = [im for im, o in zip(images, opened) if o]
    grids = None
    pixels = None
    if shown:
        out = proc(images=shown, return_tensors="pt")
        pixels, grids = out["pixel_values"].to(device=device, dtype=dtype), out["image_grid_thw"].to(device)
    k = 0
    for o in opened:
        if o:
            n = int(grids[k].prod()) // 4
            ids += [torch.tensor([cfg.vision_start_token_id]), torch.full((n,), cfg.image_token_id),
                    torch.tensor([cfg.vision_end_token_id])]
            k += 1
        else:
            ids.append(torch.randint(0, 7000, (PROXY_WORDS,), generator=g))
    input_ids = torch.cat(ids)[None].to(device)
    kwargs = {"pixel_values": pixels, "image_grid_thw": grids} if shown else {}
    return input_ids, kwargs


@torch.inference_mode()
def prefill_latency(model, cfg, images, opened, device, dtype, repeats: int = 2, text_tokens: int = 64) -> dict:
    input_ids, kwargs = _prefill_inputs(cfg, images, opened, text_tokens, device, dtype)
    ts = timed(lambda: model.model(input_ids=input_ids, **kwargs), repeats, warmup=1, device=device)
    return {"tokens": int(input_ids.shape[1]), "visual_tokens": int((input_ids == cfg.image_token_id).sum()),
            "seconds": statistics.median(ts)}


def profile_stages(scorer, episodes, out_dir: Path, gemm_rate: float) -> dict:
    """Profiler trace + per-stage time, FLOPs, TFLOP/s and fractions of the GEMM rate and of the device peak."""
    from pixeltriage.engine import profiling

    out_dir.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if scorer.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    states = []
    with torch.profiler.profile(activities=activities) as prof, profiling.record(sync=_sync(scorer.device)) as stages:
        for q, m in episodes:
            states.append(scorer.pack(q, m))
            scorer.score_states(states[-1:])
    flops: dict[str, float] = {}                       # counted after the profiled block, not inside it
    for state in states:                               # each FLOP of the model in the one stage that times it
        parts = scorer_flops(scorer, state, split=True)
        for stage, f in profiler_stage_flops(parts, conv_apart="delta_conv" in stages).items():
            flops[stage] = flops.get(stage, 0.0) + f
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    peak = device_peak_tflops(scorer.device)
    rows = {}
    for name, seconds in stages.items():
        f = flops.get(name, 0.0)
        rows[name] = {"seconds": seconds, "tflop": f / 1e12, **flop_rate(f, seconds, gemm_rate, peak)}
    total_s, total_f = sum(stages.values()), sum(flops.values())
    rows["total"] = {"seconds": total_s, "tflop": total_f / 1e12, **flop_rate(total_f, total_s, gemm_rate, peak)}
    return {"trace": str(trace), "questions": len(episodes), "stages": rows, "peak_tflops": peak}


def latency_report(preset="tiny", device="cpu", dtype="float32", batch=4, questions=24, ks=(1, 2),
                   answering_scale="tiny", profile: str | None = None, seed: int = 0, progress=print) -> dict:
    from pixeltriage.delivery.policy import top_k
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.weights.layout import parse_dtype
    from pixeltriage.weights.demo import demo_checkpoint

    dev, tdtype = torch.device(device), parse_dtype(dtype)
    scorer = Scorer.load(demo_checkpoint(preset), device=dev, dtype=tdtype)
    episodes = workloads.episodes(questions + WARMUP_QUESTIONS, STREAM_MEMORIES, seed, up_to=True)
    progress(f"System One ({preset}, {dtype}, {dev}): {questions} questions after {WARMUP_QUESTIONS} warm-up, "
             f"batch 1 and {batch}")
    # the machine the figures come from (the CPU's, and the GPU's name when the run is on one)
    machine = {**cpu_machine(), **({"gpu": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {})}
    report = {"preset": preset, "device": str(dev), "dtype": dtype, "threads": torch.get_num_threads(),
              "machine": machine, "system_one": system_one_latency(scorer, episodes, batch)}
    # the answering model on one 10-image episode drawn like the stream's
    images = workloads.photos(ANSWERING_IMAGES, seed + 1)
    from pixeltriage.engine.types import Memory

    scores = scorer.score("which picture shows the receipt?", [Memory(image=im) for im in images])
    progress(f"answering prefill: Qwen2.5-VL architecture at scale '{answering_scale}', {ANSWERING_IMAGES} images")
    model, cfg = random_answering_model(answering_scale, dev, tdtype)
    answering = {"scale": answering_scale, "shape": ANSWERING_SCALES[answering_scale],
                 "open_all": prefill_latency(model, cfg, images, [True] * ANSWERING_IMAGES, dev, tdtype)}
    for k in ks:
        answering[f"ours@{k}"] = prefill_latency(model, cfg, images, top_k(scores, k), dev, tdtype)
    report["answering"] = answering
    s1 = report["system_one"]["batch_1"]["p50"]
    report["per_question_s"] = {"open_all": answering["open_all"]["seconds"],
                                **{f"ours@{k}": s1 + answering[f"ours@{k}"]["seconds"] for k in ks}}
    del model
    if profile:
        progress("measuring the GEMM rate and profiling")
        gemm = gemm_tflops(dev, tdtype)
        report["gemm_tflops"] = gemm
        report["profile"] = profile_stages(scorer, episodes[WARMUP_QUESTIONS:WARMUP_QUESTIONS + min(4, questions)],
                                           Path(profile), gemm)
    return report


def print_report(r: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    print(f"bench latency: System One {r['preset']} ({r['dtype']}, {r['device']}, {threads_label(r['threads'])})",
          file=out)
    if r.get("machine"):
        print(f"  machine  {machine_line(r['machine'])}", file=out)
    for name, row in r["system_one"].items():
        print(f"  {name:<8} p50 {row['p50'] * 1e3:8.1f} ms  p90 {row['p90'] * 1e3:8.1f} ms  p99 "
              f"{row['p99'] * 1e3:8.1f} ms  {row['questions_per_s']:.2f} questions/s", file=out)
    a = r["answering"]
    t, v = a["shape"]["text"], a["shape"]["vision"]
    print(f"answering prefill: Qwen2.5-VL architecture, random weights, scale '{a['scale']}' (text {t[0]} x {t[1]} "
          f"layers, vision {v[0]} x {v[1]}), one 10-image episode:", file=out)
    for name in [k for k in a if k not in ("scale", "shape")]:
        row = a[name]
        total = r["per_question_s"][name]
        extra = f"  + System One p50 = {total * 1e3:8.1f} ms" if name != "open_all" else ""
        print(f"  {name:<9} {row['visual_tokens']:6d} visual / {row['tokens']:6d} tokens  prefill "
              f"{row['seconds'] * 1e3:8.1f} ms{extra}", file=out)
    if "profile" in r:
        p = r["profile"]
        print(f"profile ({p['questions']} questions; trace {p['trace']}); GEMM rate {r['gemm_tflops']:.3f} TFLOP/s"
              + (f", peak {p['peak_tflops']} TFLOP/s" if p["peak_tflops"] else ""), file=out)
        print(f"  {'stage':<12} {'ms':>9} {'TFLOP':>8} {'TFLOP/s':>8} {'of GEMM':>8} {'MFU':>6}", file=out)
        for name, row in p["stages"].items():
            gem = f"{100 * row['of_gemm']:.0f}%" if row["of_gemm"] is not None and row["tflop"] else "-"
            mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None and row["tflop"] else "-"
            print(f"  {name:<12} {row['seconds'] * 1e3:9.1f} {row['tflop']:8.4f} {row['tflops']:8.3f} {gem:>8} "
                  f"{mfu:>6}", file=out)


def plot(r: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from pixeltriage.errors import PixelTriageError
        raise PixelTriageError("--plot needs matplotlib: pip install 'pixeltriage[plot]'") from None
    names = list(r["per_question_s"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, [r["per_question_s"][n] * 1e3 for n in names], color=["#999"] + ["#2a7"] * (len(names) - 1))
    ax1.set_ylabel("ms per question (measured)")
    ax1.set_title(f"latency, answering scale '{r['answering']['scale']}'")
    ks = [int(n.split("@")[1]) for n in names if n.startswith("ours@")]
    cost = cost_report("dmv", DEFAULT_CHECKPOINT, ks)
    tf = [cost["tflop"]["open_all"]] + [cost["tflop"]["ours"][str(k)] for k in ks]
    ax2.bar(names, tf, color=["#999"] + ["#2a7"] * len(ks))
    ax2.set_ylabel("TFLOP per question (analytic)")
    ax2.set_title("DMV scenario, Qwen2.5-VL-7B")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_latency(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    dtype = args.dtype or default_dtype(args.device)
    ks = tuple(args.k)
    r = latency_report(args.preset, args.device, dtype, args.batch, args.questions, ks, args.answering_scale,
                       args.profile, args.seed, progress=progress_line)
    emit(r, args.json, print_report)
    if args.plot:
        plot(r, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
