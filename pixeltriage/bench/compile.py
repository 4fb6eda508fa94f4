"""`pixeltriage bench compile`: every Triton kernel the CUDA forward launches, compiled for named GPU targets with no
GPU present, and what each costs the target in registers, spills, shared and local memory, and occupancy.

    pixeltriage bench compile [--target sm_80,sm_90] [--preset tiny|bench-small|2b]
                              [--dtype bfloat16|float16|float32] [--configs all|ran] [--json]

Per target, two processes of their own:

1. record: flash-linear-attention is made to see a GPU of the target (`emulation.emulate_target`: its autotune
   lists and block sizes follow the device it finds at import), then the CUDA forward runs on CPU tensors under the
   test switch in Triton's interpreter (`emulation.cuda_emulation`) and every launch is recorded as the compiler for
   the target sees it (`emulation.record_launches`): the kernel, its parameters' types and specialization
   attributes, its constexprs, its compile options, and for an autotuned kernel every config its autotuner would
   time (each as a launch of its own). The forward is the preset's model with one layer of each type (every layer
   of a type has the same shapes, so launches the same kernels with the same specializations), a one-block vision
   tower (the vision tower launches no Triton kernel) and a small vocabulary (read only by the embedding lookup, a
   torch op); a 64-px thumbnail keeps the interpreted forward short. Two forwards are recorded: one question alone
   through the static path a CUDA graph captures (a 64-token bucket), and two questions packed into one varlen
   forward.
2. compile: each distinct (kernel, specialization, options) is compiled by `triton.compile` for the target to PTX
   and cubin; ptxas (the one Triton ships) is run again with Triton's own flags and -v for registers, spill stores
   and loads, stack frame and static shared memory; the cubin's registers (cuobjdump --dump-resource-usage) must
   agree with that.

Per kernel and config: registers per thread, spill bytes, shared memory (Triton's dynamic plus ptxas' static) against
the target's per-block limit, local memory (stack frame), and the occupancy that follows (`occupancy`). The report
fails on a compile error, on shared memory over the limit, and on spills in any launched or autotunable config
unless `ALLOWED_SPILLS` names it with the reason. Its header names Triton, flash-linear-attention and the targets.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ("sm_80", "sm_90")
PRESETS = ("tiny", "bench-small", "2b")
DTYPES = ("bfloat16", "float16", "float32")
RECORD_BUCKET = 64          # the static path's buckets are multiples of this
THUMBNAIL = 64

# Per-SM resources of the targets, for occupancy (CUDA C Programming Guide, compute capability tables): registers
# per SM, warps per SM, blocks per SM, shared memory per SM (bytes), the opt-in maximum per block, what the driver
# reserves per block, and the register and shared-memory allocation units.
LIMITS = {
    "sm_80": dict(regs_per_sm=65536, max_regs=255, warps_per_sm=64, blocks_per_sm=32, smem_per_sm=167936,
                  smem_per_block=166912, smem_reserved=1024, reg_unit=256, smem_unit=128),
    "sm_90": dict(regs_per_sm=65536, max_regs=255, warps_per_sm=64, blocks_per_sm=32, smem_per_sm=233472,
                  smem_per_block=232448, smem_reserved=1024, reg_unit=256, smem_unit=128),
}
# (kernel name, target, num_warps) -> (the most spill bytes, stored plus loaded, accepted; why). Every other spill, and
# a listed one grown past its bytes, fails the report. Each is a config of fla's own autotune list that ptxas had to
# spill; the autotuner times it against configs of the same kernel that do not spill (the one the harness runs among
# them) and takes it only where it measured fastest on the GPU at hand, so a spill costs speed, never a result. Which
# config wins at the 2B shape waits for a GPU: gpu_check puts the profiled registers beside these configs. Measured at
# the 2b preset, bf16 (docs/performance.md#gpu); the bound is that plus a tenth.
_STATE_SPILL = ("the state recurrence with BV=64 on 2 warps keeps two [64, 64] float32 state blocks per program, 32 KiB "
                "over 64 threads: 128 registers a thread for the state alone, and ptxas spills ~700 B/thread at 255; "
                "BV=32 on 2 warps and the list's configs with more warps do not spill")
ALLOWED_SPILLS: dict[tuple[str, str, int], tuple[int, str]] = {
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "sm_80", 2): (1680, _STATE_SPILL),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "sm_90", 2): (1690, _STATE_SPILL),
    ("l2norm_fwd_kernel", "sm_80", 1): (1520, "one warp over a [128, 128] tile (BT=128 rows of BD=128) holds 512 "
                                              "floats a thread; the list's 2- to 32-warp configs of that tile and "
                                              "its smaller tiles do not spill"),
    ("l2norm_fwd_kernel", "sm_90", 1): (10900, "one warp over a [128, 128] tile (BT=128 rows of BD=128) holds 512 "
                                               "floats a thread (ptxas 13.4 keeps 72 registers and spills the rest); "
                                               "the list's 2- to 32-warp configs of that tile and its smaller tiles do "
                                               "not spill"),
    ("causal_conv1d_fwd_kernel", "sm_80", 32): (18, "8 bytes stored and loaded in one 32-warp config (BD=128); the "
                                                    "list's other configs do not spill"),
    ("causal_conv1d_fwd_kernel", "sm_90", 8): (18, "8 bytes stored and loaded in one 8-warp config (BD=64); the "
                                                   "list's other configs do not spill"),
}


class CompileReportError(RuntimeError):
    """A step of the report (recording, compiling) failed: the message says which and why."""


def occupancy(target: str, regs: int, smem: int, num_warps: int) -> dict:
    """Blocks of one kernel resident per SM, and the fraction of the SM's warps they fill, from registers per
    thread, shared memory per block (bytes) and warps per block; `limit` names what bounds it."""
    lim = LIMITS[target]
    per_warp = -(-max(regs, 1) * 32 // lim["reg_unit"]) * lim["reg_unit"]
    bounds = {"warps": lim["warps_per_sm"] // num_warps,
              "registers": (lim["regs_per_sm"] // per_warp) // num_warps,
              "blocks": lim["blocks_per_sm"]}
    if smem:
        block = -(-(smem + lim["smem_reserved"]) // lim["smem_unit"]) * lim["smem_unit"]
        bounds["shared memory"] = lim["smem_per_sm"] // block
    blocks = min(bounds.values())
    limit = min(bounds, key=lambda k: (bounds[k], k != "warps"))
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps,
            "occupancy": round(blocks * num_warps / lim["warps_per_sm"], 4), "limited_by": limit}


# --- record (a process of its own, TRITON_INTERPRET=1) ------------------------------------------------------------

def _record_preset(name: str):
    """The preset with one layer of each type, a one-block vision tower and a small vocabulary (module docstring)."""
    from pixeltriage.weights.demo import get_preset
    from pixeltriage.weights.tokenizer import SPECIAL_TOKENS

    preset = copy.deepcopy(get_preset(name))
    types = preset.text["layer_types"]
    text = dict(preset.text, layer_types=sorted(set(types), key=types.index), vocab_size=1024)
    vision = dict(preset.vision, depth=1)
    return type(preset)(text=text, vision=vision, head_dim=preset.head_dim,
                        bpe_vocab_size=1024 - len(SPECIAL_TOKENS), first_special_id=1024 - len(SPECIAL_TOKENS),
                        dtype=preset.dtype, tie_word_embeddings=preset.tie_word_embeddings)


def _questions():
    from PIL import Image

    from pixeltriage import Memory

    image = Image.new("RGB", (90, 60), (200, 30, 30))
    return [("Which one was first?", [Memory(image=image, note="a red card", dialogue="shared a picture")]),
            ("Is a picture needed?", [])]


def _record(preset_name: str, dtype_name: str, target: str, execute: bool = False) -> dict:
    from pixeltriage.bench import emulation

    emulation.emulate_target(target)
    import torch
    from triton.backends.compiler import GPUTarget

    from pixeltriage import Scorer
    from pixeltriage.config import TriageConfig
    from pixeltriage.errors import NonFiniteScoreError
    from pixeltriage.kernels import registry
    from pixeltriage.kernels.gated_delta import fla
    from pixeltriage.weights import demo

    dtype = getattr(torch, dtype_name)
    cuda_choices = registry.choices("cuda", dtype)
    with tempfile.TemporaryDirectory(prefix="pixeltriage-compile-") as tmp:
        path = Path(tmp) / "ckpt"
        preset = _record_preset(preset_name)
        os.makedirs(path)
        demo._write_files(path, preset, 0, dtype if dtype != torch.float16 else torch.bfloat16, False)
        triage = TriageConfig(head_dim=preset.head_dim, thumbnail_size=THUMBNAIL)
        (path / "pixeltriage.json").write_text(json.dumps(triage.to_dict()))
        with emulation.cuda_emulation():
            if dtype == torch.float32:
                # fla's kernels take bf16/fp16 (kernels.gated_delta registers them so); under the interpreter the
                # registry would stand float32 in for them: made unavailable, as they are to a float32 CUDA forward
                fla.available = lambda: False
                fla.conv_available = lambda: False
            scorer = Scorer.load(path, dtype=dtype)
            ran = scorer.kernels()
            differ = {op: (ran.get(op), want) for op, want in cuda_choices.items() if ran.get(op) != want}
            if differ:
                raise CompileReportError(f"the emulated forward would not run what a CUDA forward runs: {differ}")
            states = [scorer.pack(q, m) for q, m in _questions()]
            gpu = GPUTarget("cuda", int(target[3:]), 32)
            bucket = -(-states[0].num_tokens // RECORD_BUCKET) * RECORD_BUCKET
            # launches recorded without running them (`record_launches`): the head's outputs stay as allocated, so
            # the scores read from them may be non-finite; they are not what is recorded
            scores = contextlib.nullcontext if execute else functools.partial(contextlib.suppress, NonFiniteScoreError)
            with emulation.record_launches(gpu, execute=execute) as launches:
                scorer.enable_cuda_graphs(buckets=(bucket,), capture=False)
                with scores():
                    scorer.score_states(states[:1])
                if scorer.graphs.replays != {"graph": 1, "eager": 0}:
                    raise CompileReportError(f"the static path did not run: {scorer.graphs.replays}")
                scorer.disable_cuda_graphs()
                with scores():
                    scorer.score_states(states)
    return {"target": target, "preset": preset_name, "dtype": dtype_name, "kernels_by_op": ran,
            "fla_sees": emulation.fla_view(), "tokens": [s.num_tokens for s in states],
            "launches": [vars(launch) for launch in launches]}


# --- compile (a process of its own, no interpreter) ---------------------------------------------------------------

def _jit_function(module: str, name: str):
    import importlib

    from triton.runtime.jit import JITFunction

    fn = getattr(importlib.import_module(module), name, None)
    while fn is not None and not isinstance(fn, JITFunction):
        fn = getattr(fn, "fn", None)
    if fn is None:
        raise CompileReportError(f"{module}.{name}: no Triton kernel of that name")
    return fn


_PTXAS = {"registers": re.compile(r"Used (\d+) registers"), "smem_static": re.compile(r"(\d+) bytes smem"),
          "frame": re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")}


def _ptxas_usage(ptx: str, capability: int, fp_fusion: bool) -> dict:
    """ptxas -v on the PTX with the flags Triton compiles it with: registers, static shared memory, stack frame and
    spill bytes of its one entry function."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory(prefix="pixeltriage-ptxas-") as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(capability).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(capability)}", str(src),
               "-o", str(Path(tmp) / "k.cubin")]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise CompileReportError(f"ptxas failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    log = done.stderr + done.stdout
    registers, smem, frame = (_PTXAS[k].search(log) for k in ("registers", "smem_static", "frame"))
    if registers is None or frame is None:
        raise CompileReportError(f"ptxas -v said nothing of registers or spills: {log.strip()[-2000:]}")
    return {"registers": int(registers.group(1)), "smem_static": int(smem.group(1)) if smem else 0,
            "stack_frame": int(frame.group(1)), "spill_stores": int(frame.group(2)),
            "spill_loads": int(frame.group(3))}


def _cubin_registers(cubin: bytes) -> int:
    from triton import knobs

    cuobjdump = knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory(prefix="pixeltriage-cubin-") as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True)
    found = re.search(r"REG:(\d+)", done.stdout)
    if done.returncode or found is None:
        raise CompileReportError(f"cuobjdump --dump-resource-usage failed: {(done.stderr or done.stdout)[-1000:]}")
    return int(found.group(1))


def _compile_one(launch: dict, target: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    capability = int(target[3:])
    gpu = GPUTarget("cuda", capability, 32)
    backend = make_backend(gpu)
    spec = launch["specialization"]
    signature = {p: s[0] for p, s in zip(launch["params"], spec)}
    constexprs = {(i,): s[1] for i, s in enumerate(spec) if s[0] == "constexpr"}
    attrs = {(i,): backend.parse_attr(s[1]) for i, s in enumerate(spec) if s[0] != "constexpr" and isinstance(s[1], str)}
    options = backend.parse_options({**launch["options"], "debug": False})
    src = ASTSource(_jit_function(launch["module"], launch["name"]), signature, constexprs, attrs)
    kernel = triton.compile(src, target=gpu, options=options.__dict__)
    usage = _ptxas_usage(kernel.asm["ptx"], capability, options.enable_fp_fusion)
    cubin_registers = _cubin_registers(kernel.asm["cubin"])
    if cubin_registers != usage["registers"]:
        raise CompileReportError(f"{launch['name']}: ptxas -v says {usage['registers']} registers, Triton's cubin "
                                 f"{cubin_registers}")
    shared = int(kernel.metadata.shared) + usage["smem_static"]
    num_warps = options.num_warps * options.num_ctas
    return {**usage, "shared": shared, "num_warps": options.num_warps, "num_stages": options.num_stages,
            **occupancy(target, usage["registers"], shared, num_warps)}


def _compile(record: dict) -> dict:
    """Every distinct launch of `record` compiled for its target (module docstring), each with its figures or its
    error."""
    from pixeltriage.bench import emulation

    target = record["target"]
    emulation.emulate_target(target)
    seen, results = {}, []
    for launch in record["launches"]:
        key = (launch["module"], launch["name"], repr(launch["specialization"]),
               repr(sorted(launch["options"].items())))
        if key in seen:
            seen[key]["launches"] += 1
            seen[key]["ran"] = seen[key]["ran"] or launch["ran"]
            continue
        started = time.perf_counter()
        try:
            figures, error = _compile_one(launch, target), None
        except Exception as e:  # a compile error is a finding of the report, named with its kernel
            figures, error = {}, f"{type(e).__name__}: {str(e).strip()[-3000:]}"
        entry = {"kernel": launch["name"], "module": launch["module"], "autotuned": launch["autotuned"],
                 "config": launch["config"], "configs": launch["configs"], "ran": launch["ran"], "launches": 1,
                 "constexprs": {p: s[1] for p, s in zip(launch["params"], launch["specialization"])
                                if s[0] == "constexpr" and s[1] is not None},
                 "options": launch["options"], "grid": launch["grid"], "origin": launch["origin"],
                 "compile_s": round(time.perf_counter() - started, 2), "error": error, **figures}
        seen[key] = entry
        results.append(entry)
    return {**{k: v for k, v in record.items() if k != "launches"}, "compiled": results}


# --- the report ---------------------------------------------------------------------------------------------------

def problems(target_report: dict) -> tuple[list[str], list[str]]:
    """(what fails the report, the spills it accepts with their reasons) for one target's compiled launches."""
    target = target_report["target"]
    limit = LIMITS[target]["smem_per_block"]
    failures, allowed = [], []
    for e in target_report["compiled"]:
        what = f"{target} {e['kernel']} config {e['config'] + 1}/{e['configs']} {_options(e)}"
        if e["error"]:
            failures.append(f"{what}: does not compile: {e['error'].splitlines()[0][:300]}")
            continue
        if e["shared"] > limit:
            failures.append(f"{what}: {e['shared']} bytes of shared memory, over the {limit} a block may have")
        if e["spill_stores"] or e["spill_loads"]:
            spills = f"spills {e['spill_stores']} bytes stored, {e['spill_loads']} loaded"
            bound, reason = ALLOWED_SPILLS.get((e["kernel"], target, e["options"].get("num_warps", 4)), (0, None))
            if reason is not None and e["spill_stores"] + e["spill_loads"] > bound:
                failures.append(f"{what}: {spills}, over the {bound} bytes accepted ({reason})")
            elif reason is None:
                pickable = "the config the forward ran" if e["ran"] else "a config its autotuner could pick"
                failures.append(f"{what}: {spills} ({pickable})")
            else:
                allowed.append(f"{what}: {spills}: allowed: {reason}")
    return failures, allowed


def _options(e: dict) -> str:
    o = e["options"]
    return f"(warps {o.get('num_warps', 4)}, stages {o.get('num_stages', 3)})"


def headline(target_report: dict) -> dict:
    """Per target: kernels, compiled configs, the largest registers and shared memory (with their kernel), spills."""
    ok = [e for e in target_report["compiled"] if not e["error"]]
    regs = max(ok, key=lambda e: e["registers"], default=None)
    smem = max(ok, key=lambda e: e["shared"], default=None)
    return {"kernels": len({e["kernel"] for e in target_report["compiled"]}),
            "configs": len(target_report["compiled"]), "errors": sum(bool(e["error"]) for e in target_report["compiled"]),
            "max_registers": regs and [regs["registers"], regs["kernel"]],
            "max_shared": smem and [smem["shared"], smem["kernel"]],
            "smem_limit": LIMITS[target_report["target"]]["smem_per_block"],
            "spilling_configs": sum(bool(e["spill_stores"] or e["spill_loads"]) for e in ok),
            "min_occupancy_ran": min((e["occupancy"] for e in ok if e["ran"]), default=None)}


def _versions() -> dict:
    from triton import knobs

    found = {p: importlib.metadata.version(p) for p in ("triton", "flash-linear-attention", "torch")}
    for tool in ("ptxas", "ptxas_blackwell"):
        out = subprocess.run([getattr(knobs.nvidia, tool).path, "--version"], capture_output=True, text=True).stdout
        release = re.search(r"release ([\d.]+)", out)
        found[tool.replace("_", "-")] = release.group(1) if release else "unknown"
    return found


def _child(args: list[str], interpret: bool, timeout: float) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PIXELTRIAGE_EMULATE_CUDA")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "pixeltriage.bench.compile", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode:
        raise CompileReportError(f"{' '.join(args[:1])} step failed ({done.returncode}):\n{done.stderr[-4000:]}")


def compile_report(targets: list[str], preset: str, dtype: str, configs: str = "all", progress=lambda s: None,
                   timeout: float = 3600) -> dict:
    """The report (module docstring) for `targets`: per target its record, compiled launches, headline, failures and
    accepted spills; `ok` when nothing fails. configs: "all" (every config each autotuner would time) or "ran" (the
    launches the forward made, one config per autotuned kernel: a quicker check that covers less)."""
    if configs not in ("all", "ran"):
        raise ValueError(f"configs is 'all' or 'ran', not {configs!r}")
    for t in targets:
        if t not in LIMITS:
            raise ValueError(f"unknown target {t!r}; choose from {sorted(LIMITS)}")
    report = {"versions": _versions(), "targets": targets, "preset": preset, "dtype": dtype, "configs": configs,
              "results": []}
    with tempfile.TemporaryDirectory(prefix="pixeltriage-compile-report-") as tmp:
        for target in targets:
            recorded, compiled = Path(tmp) / f"{target}-record.json", Path(tmp) / f"{target}-compiled.json"
            started = time.perf_counter()
            progress(f"{target}: recording the emulated {preset} {dtype} forward")
            _child(["record", preset, dtype, target, str(recorded)], interpret=True, timeout=timeout)
            record_s = time.perf_counter() - started
            record = json.loads(recorded.read_text())
            if configs == "ran":
                record["launches"] = [launch for launch in record["launches"] if launch["ran"]]
                recorded.write_text(json.dumps(record))
            progress(f"{target}: compiling {len(record['launches'])} launches")
            _child(["compile", str(recorded), str(compiled)], interpret=False, timeout=timeout)
            result = json.loads(compiled.read_text())
            failures, allowed = problems(result)
            result.update(headline=headline(result), failures=failures, allowed_spills=allowed,
                          record_s=round(record_s, 1), compile_s=round(time.perf_counter() - started - record_s, 1))
            report["results"].append(result)
    report["ok"] = not any(r["failures"] for r in report["results"])
    return report


def print_report(report: dict, out=sys.stdout) -> None:
    v = report["versions"]
    print(f"bench compile: Triton {v['triton']}, flash-linear-attention {v['flash-linear-attention']}, ptxas "
          f"{v['ptxas']} (sm_80) / {v['ptxas-blackwell']} (sm_90); preset {report['preset']}, {report['dtype']}; "
          f"targets {', '.join(report['targets'])}; configs: {report['configs']}; no GPU: cubins from "
          f"triton.compile", file=out)
    for r in report["results"]:
        h = r["headline"]
        print(f"\n{r['target']}: {h['kernels']} kernels, {h['configs']} compiled configs ({h['errors']} errors), max "
              f"registers {h['max_registers'][0]} ({h['max_registers'][1]}), max shared memory {h['max_shared'][0]} "
              f"of {h['smem_limit']} bytes ({h['max_shared'][1]}), {h['spilling_configs']} spilling configs; "
              f"fla sees {r['fla_sees']}; states of {r['tokens']} tokens; record {r['record_s']} s, compile "
              f"{r['compile_s']} s", file=out)
        print(f"  {'kernel':<50} {'cfgs':>4} {'regs':>9} {'spill B':>7} {'stack':>5} {'smem max':>8} "
              f"{'ran: warps regs smem occupancy (limit)'}", file=out)
        by_kernel: dict[str, list[dict]] = {}
        for e in r["compiled"]:
            by_kernel.setdefault(e["kernel"], []).append(e)
        for name, entries in by_kernel.items():
            ok = [e for e in entries if not e["error"]]
            if not ok:
                print(f"  {name:<50} {len(entries):>4} does not compile", file=out)
                continue
            regs = f"{min(e['registers'] for e in ok)}-{max(e['registers'] for e in ok)}"
            spills = max(e["spill_stores"] + e["spill_loads"] for e in ok)
            ran = ", ".join(f"{e['num_warps']}w {e['registers']}r {e['shared']}B {e['occupancy']:.2f} "
                            f"({e['limited_by']})" for e in ok if e["ran"])
            print(f"  {name:<50} {len(entries):>4} {regs:>9} {spills:>7} {max(e['stack_frame'] for e in ok):>5} "
                  f"{max(e['shared'] for e in ok):>8} {ran}", file=out)
        for line in r["allowed_spills"]:
            print(f"  accepted: {line}", file=out)
        for line in r["failures"]:
            print(f"  FAIL: {line}", file=out)
    print(f"\n{'ok' if report['ok'] else 'FAILED'}", file=out)


def run_compile(args: argparse.Namespace) -> int:
    from pixeltriage.bench.timing import emit, progress_line

    report = compile_report(args.target, args.preset, args.dtype, args.configs,
                            progress=progress_line)
    emit(report, args.json, print_report)
    return 0 if report["ok"] else 1


def main(argv: list[str]) -> int:
    """The report's two steps as processes of their own: `record PRESET DTYPE TARGET OUT` (TRITON_INTERPRET=1) and
    `compile RECORD OUT` (without it)."""
    if argv[:1] == ["record"] and len(argv) == 5:
        Path(argv[4]).write_text(json.dumps(_record(*argv[1:4])))
    elif argv[:1] == ["compile"] and len(argv) == 3:
        Path(argv[2]).write_text(json.dumps(_compile(json.loads(Path(argv[1]).read_text()))))
    else:
        raise SystemExit("usage: python -m pixeltriage.bench.compile record PRESET DTYPE TARGET OUT | compile "
                         "RECORD OUT")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
