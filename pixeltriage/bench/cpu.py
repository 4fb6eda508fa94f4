"""`pixeltriage bench cpu`: the engine against transformers' eager Qwen3.5 on the same checkpoint and state.

One run, one process: builds (or reuses) the demo checkpoint of a preset, packs one realistic state
(`workloads.packed_episode`: 10 memories, each a 336-px photo -> 320x320 -> 100 visual tokens, plus dialogue text up
to ~2.3k tokens in all), then prints
    engine median   Scorer.score_states on that state (vision + decoder + head), warm-up excluded;
    transformers    Qwen3_5Model forward on the same input ids, pixels and grids (its torch path forced);
                    the two are timed interleaved (engine, transformers, engine, ...) after one untimed run each;
    speed-up (the ratio of the medians, and each transformers run against the engine runs timed beside it), the
    machine's GEMM rate measured before the timed runs, beside each engine run and after them (their median; a
    note when the rates before and after differ by more than 25%), and the fraction of it the engine achieves
    (analytic FLOPs of the forward from pixeltriage.bench.models.flops / engine median); the ceiling: transformers'
    median over the time those FLOPs take at the GEMM rate, the speed-up of an engine whose only cost were matmuls
    (the achieved speed-up over it is the fraction above); per stage of the engine (`flops.PROFILER_STAGES`, the
    profiler's, pixeltriage.engine.profiling), its FLOPs (the FLOP model's parts, `flops.STAGE_OF_PART`), median
    time, TFLOP/s and fraction of the GEMM rate, and "other": the engine's median minus the stages' (embedding,
    rotary tables, packing the rows, Python); and the machine (`timing.cpu_machine`: CPU model, logical CPUs, bf16
    units, torch).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pixeltriage.bench import tune
from pixeltriage.bench.models.flops import (PROFILER_STAGES, UNSPLIT_STAGES, profiler_stage_flops, scorer_flops,
                                            total)
from pixeltriage.bench.timing import (cpu_machine, emit, flop_rate, gemm_tflops, machine_line, progress_line,
                                      set_threads, threads_label)
from pixeltriage.bench.transformers_baseline import force_transformers_torch_path, transformers_hidden
from pixeltriage.bench.workloads import packed_episode

OTHER = "other"      # the forward's time outside the profiler's stages


def stage_rows(flops: dict[str, int], seconds: dict[str, float], gemm_rate: float) -> list[dict]:
    """The per-stage table: for each of `PROFILER_STAGES` ("delta_conv" only where `flops` holds it), then any other
    stage recorded, then "other" (seconds only), {stage, name, flops, seconds, tflops, of_gemm}; tflops and of_gemm
    None where a stage took no time. Without "delta_conv", "delta_rule" is named as holding the conv too
    (`UNSPLIT_STAGES`)."""
    known = [k for k in PROFILER_STAGES if k != "delta_conv" or k in flops]
    names = [*known, *(k for k in seconds if k not in PROFILER_STAGES and k != OTHER), OTHER]
    labels = PROFILER_STAGES if "delta_conv" in flops else {**PROFILER_STAGES, **UNSPLIT_STAGES}
    rows = []
    for key in names:
        f, s = flops.get(key, 0), seconds.get(key, 0.0)
        tflops = f / s / 1e12 if s > 0 else None
        rows.append({"stage": key, "name": labels.get(key, key), "flops": f, "seconds": s, "tflops": tflops,
                     "of_gemm": None if tflops is None else tflops / gemm_rate})
    return rows


def cpu_report(preset: str = "bench-small", dtype: str = "bfloat16", repeats: int = 5, memories: int = 10,
               target_tokens: int = 2300, progress=print) -> dict:
    from pixeltriage.engine import profiling
    from pixeltriage.engine.scorer import Scorer
    from pixeltriage.weights.layout import parse_dtype
    from pixeltriage.weights.demo import demo_checkpoint

    torch_dtype = parse_dtype(dtype)
    path = demo_checkpoint(preset)
    progress(f"checkpoint {path}; {torch.get_num_threads()} threads")
    scorer = Scorer.load(path, dtype=torch_dtype)
    state = packed_episode(scorer.packer, memories, target_tokens).state
    parts = scorer_flops(scorer, state, split=True)
    flops = total(parts)

    from transformers import Qwen3_5ForConditionalGeneration

    progress("loading transformers (torch path)")
    force_transformers_torch_path()
    model = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch_dtype).eval()
    hf_repeats = max(2, repeats // 2)             # its forward is the slow one

    def engine() -> dict:
        """One forward's stage times, "other" the rest of its time."""
        t0 = time.perf_counter()
        with profiling.record() as stages:
            scorer.score_states([state])
        elapsed = time.perf_counter() - t0
        return {**stages, OTHER: elapsed - sum(stages.values()), "total": elapsed}

    progress(f"state: {state.num_tokens} tokens, {state.num_memories} memories; warm-up (untimed)")
    engine()
    transformers_hidden(model, state)
    progress("measuring the GEMM rate")
    rates = [gemm_tflops(dtype=torch_dtype)]
    # interleaved, so that this machine's drifting speed (its GEMM rate moves between runs) hits both alike
    progress(f"timing {repeats} engine and {hf_repeats} transformers runs, interleaved")
    counted = scorer.kernel_counts()
    engine_times, hf_times, stage_runs, beside = [], [], [], []
    for i in range(max(repeats, hf_repeats)):
        if i < repeats:
            beside.append(gemm_tflops(dtype=torch_dtype))
            run = engine()
            engine_times.append(run.pop("total"))
            stage_runs.append(run)
        if i < hf_repeats:
            t0 = time.perf_counter()
            transformers_hidden(model, state)
            hf_times.append(time.perf_counter() - t0)
    ran = scorer.kernel_counts().since(counted)
    rates.append(gemm_tflops(dtype=torch_dtype))
    stages = {k: statistics.median(r.get(k, 0.0) for r in stage_runs) for k in stage_runs[0]}
    # the GEMM rate of the run: the median of every measurement, before, beside each engine run and after. On a
    # shared machine it moved 0.485 -> 0.215 TFLOP/s between before and after within one run; the samples taken
    # beside the runs weigh the rate the engine runs actually met.
    rate = statistics.median([*rates, *beside])
    rows = stage_rows(profiler_stage_flops(parts, conv_apart=stages.get("delta_conv", 0.0) > 0), stages, rate)
    engine_s, hf_s = statistics.median(engine_times), statistics.median(hf_times)
    achieved = flop_rate(flops.total, engine_s, rate)
    # an engine that did the forward's FLOPs at the measured GEMM rate and nothing else: the speed-up it would reach
    gemm_bound_s = flops.total / (rate * 1e12)
    from pixeltriage.kernels import linear, native

    tuned = tune.kept_records(torch_dtype)[0]
    return {
        "preset": preset, "dtype": dtype, "threads": torch.get_num_threads(), "tokens": state.num_tokens,
        "memories": state.num_memories, "engine_s": engine_s, "transformers_s": hf_s, "speedup": hf_s / engine_s,
        "engine_times": engine_times, "transformers_times": hf_times,
        "paired_speedups": paired_speedups(engine_times, hf_times),
        "tflop": flops.total / 1e12, "gemm_tflops": rate, "gemm_tflops_before_after": rates,
        "gemm_tflops_beside_runs": beside,
        "achieved_tflops": achieved["tflops"], "fraction_of_gemm": achieved["of_gemm"], "stages_s": stages,
        "stages": rows,
        "gemm_bound_s": gemm_bound_s, "ceiling_speedup": hf_s / gemm_bound_s,
        # which implementation ran each op (the bf16 delta pass and the ViT's attention on AMX depend on the CPU
        # and on PIXELTRIAGE_DELTA_BF16; the weights the first forward reordered, `kernels.prepack`): a stage's
        # figure means little without it
        "kernels": scorer.kernels(),
        # what the timed engine runs ran, per op and kernel, and the calls a kernel declined, by reason
        # (`Scorer.kernel_counts`); the C library's build loaded (`kernels.native.variant`; None: none loaded)
        "kernels_ran": ran.to_dict(), "native_variant": native.variant(),
        # float32: the GEMM library measured faster on this machine (kernels.linear); float32 and bf16 (AMX): per
        # mask whether the C attention measured faster than SDPA (kernels.attention), with their ratios (bench.tune)
        "float32_gemm": tuned[tune.GEMM], "float32_attention": tuned[tune.ATTENTION],
        "bf16_attention": tuned[tune.BF16_ATTENTION], "bf16_delta": tuned[tune.BF16_DELTA],
        "bf16_prepack": tuned[tune.PREPACK], "float32_prepack": tuned[tune.PREPACK_F32],
        # the MLPs ran in row blocks or whole, as the warm-up measured (or found kept) per layer shape
        "row_blocks": linear.row_block_records(followed=True),
        # and the machine: figures from a CPU without bf16 units are not comparable with those from one with AMX
        "machine": cpu_machine(),
    }


DRIFT_WARNING = 1.25   # GEMM rates before and after the timed runs further apart than this: say so


def paired_speedups(engine_times: list[float], hf_times: list[float]) -> list[float]:
    """Per transformers run, its time over the mean of the engine runs timed just before and just after it.

    The runs go engine 0, transformers 0, engine 1, transformers 1, ...: a neighbouring pair saw nearly the same
    machine, so a drift of the machine's speed across the whole run (this one's GEMM rate moves by 2-3x) cancels
    in each pair, where it does not in the ratio of the two medians."""
    ratios = []
    for i, hf in enumerate(hf_times):
        around = engine_times[i:i + 2] if i < len(engine_times) else engine_times[-1:]
        ratios.append(hf / statistics.fmean(around))
    return ratios


def print_table(r: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    print(f"bench cpu: preset {r['preset']}, {r['dtype']}, {threads_label(r['threads'])}; state {r['tokens']} tokens, "
          f"{r['memories']} memories; {r['tflop']:.3f} TFLOP per forward", file=out)
    if r.get("machine"):
        print(f"  machine       {machine_line(r['machine'])}", file=out)
    print(f"  engine        median {r['engine_s'] * 1e3:9.1f} ms", file=out)
    print(f"  transformers  median {r['transformers_s'] * 1e3:9.1f} ms   (torch path, same state)", file=out)
    pairs = ", ".join(f"{x:.2f}x" for x in r["paired_speedups"])
    print(f"  speed-up      {r['speedup']:.2f}x   (each transformers run against the engine runs beside it: {pairs})",
          file=out)
    before, after = r["gemm_tflops_before_after"]
    beside = r.get("gemm_tflops_beside_runs") or []
    spread = f", {min(beside):.3f}-{max(beside):.3f} beside the engine runs" if beside else ""
    print(f"  GEMM rate     {r['gemm_tflops']:.3f} TFLOP/s measured (median; {before:.3f} before, {after:.3f} after "
          f"the timed runs{spread}); engine achieves {r['achieved_tflops']:.3f} TFLOP/s = "
          f"{100 * r['fraction_of_gemm']:.0f}% of it", file=out)
    print(f"  ceiling       {r['ceiling_speedup']:.2f}x   (transformers' median over the {r['tflop']:.3f} TFLOP done "
          f"at the measured GEMM rate, {r['gemm_bound_s'] * 1e3:.0f} ms: the speed-up of an engine with no cost but "
          "matmuls)", file=out)
    if max(before, after) > DRIFT_WARNING * min(before, after):
        print(f"  note          the machine's GEMM rate moved {max(before, after) / min(before, after):.1f}x during the "
              "timed runs: the speed-ups above are less reliable than usual; run again", file=out)
    kernels = r.get("kernels") or {}
    if "native_variant" in r:
        print(f"  {'C kernels build':<18} {r['native_variant'] or 'none loaded: torch runs their ops'}", file=out)
    for op, by_kernel in ((r.get("kernels_ran") or {}).get("declines") or {}).items():
        for kernel, reasons in by_kernel.items():
            for reason, n in reasons.items():
                print(f"  {'declined':<18} {op}: {kernel} declined {n} calls ({reason}); the next kernel ran them",
                      file=out)
    # those depending on the CPU and a switch
    for op, label in (("projection", "projection kernel"), ("prepacked", "weights"),
                      ("gated_delta", "gated_delta kernel"), ("attention", "attention kernel")):
        if op in kernels:
            print(f"  {label:<18} {kernels[op]}", file=out)
    gemm = r.get("float32_gemm")
    if gemm and "error" in gemm:
        print(f"  float32 GEMM       {gemm['library']}: oneDNN's primitive failed here ({gemm['error']})", file=out)
    elif gemm:
        q1, q3 = gemm["quartiles"]
        print(f"  float32 GEMM       {gemm['library']}: oneDNN's primitive took {gemm['onednn_over_f_linear']:.2f}x "
              f"F.linear's time here (pairs' quartiles {q1:.2f}-{q3:.2f}; measured {gemm['measured']}, kept per "
              "machine)", file=out)
    for key, label in (("float32_attention", "float32 attention"), ("bf16_attention", "bf16 attention")):
        att = r.get(key)
        if att:
            ratios = "; ".join(f"{mask} {att[mask]}" + (f" (C {att[mask + '_c_over_sdpa']:.2f}x SDPA's time)"
                                                         if mask + "_c_over_sdpa" in att else "")
                               for mask in ("causal", "segments"))
            engine = f"; on {att['engine']}" if att.get("engine") else ""
            print(f"  {label:<18} {ratios}{engine}; measured {att['measured']}, kept per machine", file=out)
    delta = r.get("bf16_delta")
    if delta:
        ratio = (f" (the bf16 pass {delta['bf16_over_float32']:.2f}x the float32 pass's time)"
                 if "bf16_over_float32" in delta else "")
        engine = f" on {delta['engine']}" if delta.get("engine") else ""
        print(f"  {'bf16 delta pass':<18} {delta['pass']}{ratio}{engine}; measured {delta['measured']}, kept per "
              "machine", file=out)
    for key, label in (("bf16_prepack", "bf16 weights"), ("float32_prepack", "float32 weights")):
        pre = r.get(key)
        if pre:
            ratio = f" (packed {pre['packed_over_plain']:.2f}x plain's time)" if "packed_over_plain" in pre else ""
            print(f"  {label:<18} {pre['layout']}{ratio}; measured {pre['measured']}, kept per machine", file=out)
    for layer, rec in (r.get("row_blocks") or {}).items():
        how = f"in blocks of {rec['rows']} rows" if rec["rows"] else "whole"
        print(f"  {'MLP rows':<18} {layer}: {how} (blocks {rec['blocks_over_whole']:.2f}x the whole's time at "
              f"{rec['tokens']} tokens; measured {rec['measured']}, kept per machine)", file=out)
    print(f"  engine stages (medians; FLOPs from the FLOP model; of GEMM: the stage's rate over the "
          f"{r['gemm_tflops']:.3f} TFLOP/s):", file=out)
    print(f"    {'stage':<32}{'GFLOP':>10}{'ms':>10}{'TFLOP/s':>10}{'of GEMM':>9}", file=out)
    for row in r["stages"]:
        rate = "" if row["tflops"] is None or not row["flops"] else f"{row['tflops']:.3f}"
        frac = "" if row["of_gemm"] is None or not row["flops"] else f"{100 * row['of_gemm']:.0f}%"
        print(f"    {row['name']:<32}{row['flops'] / 1e9:>10.2f}{row['seconds'] * 1e3:>10.1f}{rate:>10}{frac:>9}",
              file=out)


def run_cpu(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    r = cpu_report(args.preset, args.dtype, args.repeats, args.memories, args.tokens,
                   progress=progress_line)
    emit(r, args.json, print_table)
    return 0
