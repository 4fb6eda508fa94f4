"""`pixeltriage bench ...`: benchmark and cost-report subcommands (their work is in `pixeltriage.bench`)."""
from __future__ import annotations

import argparse

from pixeltriage.cli.common import (DEMO_PRESETS, DEVICES, VERBOSITY, add_threads_argument, existing_path,
                                    int_at_least, int_list, non_negative_float, positive_float)
from pixeltriage.delivery.profiles import CHECKPOINTS, DEFAULT_CHECKPOINT  # torch-free: the registry's names

# the choices of the library's tables (tests/test_cli.py checks that they agree)
SCENARIOS = ("dmv", "m3exam")                                        # pixeltriage.bench.models.prefill_cost.SCENARIOS
ANSWERING_CHECKPOINTS = tuple(CHECKPOINTS)                           # pixeltriage.bench.models.flops.ANSWERING_SHAPES
SYSTEM_ONE_CONFIGS = ("2b",)                                         # pixeltriage.bench.models.flops.SYSTEM_ONE_CONFIGS
ANSWERING_SCALES = ("7b", "small", "tiny")                           # pixeltriage.bench.latency.ANSWERING_SCALES
DEVICE_SPECS = ("a100", "h100", "h200")                              # pixeltriage.bench.models.roofline.DEVICE_SPECS
COMPILE_TARGETS = ("sm_80", "sm_90")                                 # pixeltriage.bench.compile.LIMITS
SOAK_KINDS = ("normal", "oversized", "malformed", "disconnect", "burst")  # pixeltriage.bench.soak.KINDS

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    for name, (help_text, add, _module) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[VERBOSITY])
        add(p)
        p.set_defaults(_bench=name)


def run(args: argparse.Namespace) -> int:
    import importlib

    from pixeltriage.engine.cpu_memory import tune_malloc

    if args._bench not in UNTUNED:
        tune_malloc()          # as the engine's other processes do; the figures are measured with it
    module = importlib.import_module(BENCHES[args._bench][2])
    return getattr(module, f"run_{args._bench}")(args)


def _add_demo_model(p: argparse.ArgumentParser) -> None:
    """--preset, --device, --dtype: the demo checkpoint the latency, serve and soak benches run."""
    p.add_argument("--preset", default="tiny", choices=DEMO_PRESETS)
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: float32 on the CPU, bfloat16 on CUDA")


def _add_cost(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=[*SCENARIOS, "custom"], default="dmv")
    p.add_argument("--answering", choices=ANSWERING_CHECKPOINTS, default=DEFAULT_CHECKPOINT)
    p.add_argument("--system-one", choices=SYSTEM_ONE_CONFIGS, default="2b")
    p.add_argument("--k", type=int_list(1), default=[1, 2, 3], help="budgets, e.g. 1,2,3")
    p.add_argument("--cached-vision", action="store_true",
                   help="System One's vision tower outputs are cached at write time (its FLOPs are skipped)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    custom = p.add_argument_group("custom scenario")
    custom.add_argument("--image-sizes", type=_image_sizes, help="retrieved images, ranked: WxH,WxH,...")
    custom.add_argument("--text-tokens", type=int_at_least(0), help="prompt tokens besides images and proxies")
    custom.add_argument("--proxy-tokens", type=int_at_least(0), default=20, help="tokens of one text proxy")
    custom.add_argument("--keep-proxy", action="store_true", help="an opened image keeps its text proxy")
    custom.add_argument("--state-text-tokens", type=int_at_least(0),
                        help="System One state tokens besides thumbnails (default: 128 per memory)")


def _add_cpu_state(p: argparse.ArgumentParser) -> None:
    """--preset, --dtype, --memories, --tokens: the demo checkpoint and packed state the CPU forward benches run."""
    p.add_argument("--preset", default="bench-small", choices=DEMO_PRESETS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--memories", type=int_at_least(0), default=10)
    p.add_argument("--tokens", type=int_at_least(1), default=2300, help="target state length (default 2300)")


def _add_cpu(p: argparse.ArgumentParser) -> None:
    _add_cpu_state(p)
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="timed engine runs after one warm-up (default 5)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true")


def _add_tune(p: argparse.ArgumentParser) -> None:
    p.add_argument("--again", action="store_true", help="forget this machine's kept choices and measure them anew")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true")


def _add_latency(p: argparse.ArgumentParser) -> None:
    _add_demo_model(p)
    p.add_argument("--batch", type=int_at_least(1), default=4, help="batch size of the batched run (default 4)")
    p.add_argument("--questions", type=int_at_least(1), default=24, help="timed questions (default 24)")
    p.add_argument("--k", type=int_list(1), default=[1, 2], help="budgets for ours@k (default 1,2)")
    p.add_argument("--answering-scale", default="tiny", choices=ANSWERING_SCALES)
    p.add_argument("--profile", metavar="DIR", default=None, help="write a profiler trace and a per-stage table")
    p.add_argument("--plot", metavar="PNG", default=None, help="draw latency and TFLOP (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    add_threads_argument(p)
    p.add_argument("--json", action="store_true")


def _add_load(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="2b", choices=DEMO_PRESETS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int_at_least(1), default=3)
    p.add_argument("--json", action="store_true")


def _add_retrieval(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encoder", metavar="DIR", type=existing_path, default=None,
                   help="SigLIP 2 checkpoint directory (default: the cached 'base' demo, siglip2-base-patch16-224's "
                        "shapes; written on first use, ~720 MB)")
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--images", type=int_at_least(1), default=8,
                   help="synthetic photos encoded at write time (default 8)")
    p.add_argument("--image-size", type=_image_size, default=(1280, 960), help="WIDTHxHEIGHT (default 1280x960)")
    p.add_argument("--batch", type=int_at_least(1), default=4,
                   help="images per batch of the batched write-time run (default 4: 20 crops per forward)")
    p.add_argument("--repeats", type=int_at_least(1), default=2, help="timed write-time runs (default 2)")
    p.add_argument("--stored", type=int_list(1), default=[10_000, 100_000],
                   help="stored images to search, e.g. 10000,100000 (default)")
    p.add_argument("--queries", type=int_at_least(1), default=30, help="timed questions per size (default 30)")
    p.add_argument("--load", type=int_at_least(0), default=10_000,
                   help="images whose vectors are read back from a cache file, cold (default 10000; 0: skip)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true")


def _image_size(text: str) -> tuple[int, int]:
    sizes = _image_sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"one WIDTHxHEIGHT, not a list: {text!r}")
    return sizes[0]


def _add_roofline(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-spec", required=True, choices=DEVICE_SPECS,
                   help="the GPU whose published peaks bound the prediction (SXM boards)")
    p.add_argument("--preset", default="2b", choices=SYSTEM_ONE_CONFIGS)
    p.add_argument("--memories", type=int_at_least(0), default=10, help="memories per question (default 10)")
    p.add_argument("--questions", type=int_at_least(1), default=16,
                   help="questions packed for the throughput figure (default 16)")
    p.add_argument("--text-tokens", type=int_at_least(1), default=None,
                   help="state tokens besides the thumbnails (default: 128 per memory)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _add_serve(p: argparse.ArgumentParser) -> None:
    _add_demo_model(p)
    p.add_argument("--clients", type=int_at_least(1), default=8, help="closed-loop concurrent clients (default 8)")
    p.add_argument("--rate", type=positive_float, default=None,
                   help="open-loop requests/s (default: twice the closed-loop throughput, a 2x overload)")
    p.add_argument("--duration", type=positive_float, default=10.0, help="seconds per phase at most (default 10)")
    p.add_argument("--requests", type=int_at_least(1), default=300, help="requests per phase at most (default 300)")
    p.add_argument("--episodes", type=int_at_least(1), default=24, help="distinct episodes (default 24)")
    p.add_argument("--memories", type=int_at_least(0), default=10, help="memories per question (default 10)")
    p.add_argument("--max-queued", type=int_at_least(1), default=32, help="the server's --max-queued (default 32)")
    p.add_argument("--max-wait-ms", type=non_negative_float, default=0.0, help="the server's --max-wait-ms (default 0)")
    p.add_argument("--max-batch-tokens", type=int_at_least(1), default=None, help="the server's --max-batch-tokens")
    p.add_argument("--no-overhead", action="store_true", help="skip the HTTP stack's trivial-endpoint timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def _add_soak(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=positive_float, required=True, help="seconds of mixed traffic")
    _add_demo_model(p)
    p.add_argument("--clients", type=int_at_least(1), default=4, help="concurrent normal clients (default 4)")
    p.add_argument("--baseline", type=positive_float, default=None,
                   help="seconds of normal requests alone before the mix (default: duration/10, 4 to 60)")
    p.add_argument("--max-queued", type=int_at_least(1), default=8, help="the server's --max-queued (default 8)")
    p.add_argument("--episodes", type=int_at_least(1), default=16, help="distinct episodes (default 16)")
    p.add_argument("--memories", type=int_at_least(0), default=4, help="memories per question (default 4)")
    p.add_argument("--no-latency-goal", action="store_true",
                   help="report the p99 goal without enforcing it (exit code from behaviour and memory alone: for a "
                        "machine shared with other work, such as CI)")
    p.add_argument("--kinds", type=_soak_kinds, default=None,
                   help="the traffic to send, comma-separated from normal, oversized, malformed, disconnect, burst "
                        "(default: all; without normal: no baseline and no p99 goal)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def _soak_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in SOAK_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"kinds are among {', '.join(SOAK_KINDS)}, not {text!r}")
    return kinds


def _add_workspace(p: argparse.ArgumentParser) -> None:
    _add_cpu_state(p)
    p.add_argument("--pairs", type=int_at_least(1), default=11, help="timed pairs of forwards (default 11)")
    p.add_argument("--tune-malloc", action="store_true",
                   help="tune malloc first (pixeltriage.tune_malloc); default: as a host that did not")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true")


def _target_list(text: str) -> list[str]:
    targets = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in targets if t not in COMPILE_TARGETS]
    if not targets or unknown:
        raise argparse.ArgumentTypeError(f"targets are some of {', '.join(COMPILE_TARGETS)}, got {text!r}")
    return list(dict.fromkeys(targets))


def _add_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=_target_list, default=list(COMPILE_TARGETS),
                   help=f"comma-separated GPU targets (default: {','.join(COMPILE_TARGETS)})")
    p.add_argument("--preset", default="tiny", choices=DEMO_PRESETS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the CUDA forward's dtype (default: bfloat16, what it runs by default)")
    p.add_argument("--configs", default="all", choices=["all", "ran"],
                   help="all: every config each autotuner would time (default); ran: the configs the forward ran, "
                        "a quicker check that covers less")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _image_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        try:
            width, height = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"image size {item!r} is not WIDTHxHEIGHT") from None
        if width <= 0 or height <= 0:
            raise argparse.ArgumentTypeError(f"image size {item!r} must be positive")
        sizes.append((width, height))
    return sizes


# name -> (help, the function adding its arguments, the module holding `run_{name}(args)`: the analytic models in
# pixeltriage.bench.models, the measurements in pixeltriage.bench)
BENCHES = {
    "cost": ("per-question TFLOP and visual tokens: System One + ours@k vs open-all prefill", _add_cost,
             "pixeltriage.bench.models.prefill_cost"),
    "compile": ("every Triton kernel of the CUDA forward compiled for GPU targets without a GPU: registers, spills, "
                "shared memory, occupancy per kernel and autotune config; exit 1 on a compile error, shared memory "
                "over the limit or a spill", _add_compile, "pixeltriage.bench.compile"),
    "cpu": ("engine vs transformers' eager forward on the same state, GEMM rate, stages", _add_cpu,
            "pixeltriage.bench.cpu"),
    "tune": ("the kernel choices this machine measured once and keeps (float32 GEMM library, attention); "
             "--again measures anew", _add_tune, "pixeltriage.bench.tune"),
    "latency": ("System One latency over an episode stream vs the answering prefill, --profile, --plot",
                _add_latency, "pixeltriage.bench.latency"),
    "load": ("start-up time and peak memory: packed file vs directory vs transformers", _add_load,
             "pixeltriage.bench.load"),
    "retrieval": ("region retrieval: images/s at write time, question and search latency at 10k and 100k images",
                  _add_retrieval, "pixeltriage.bench.retrieval_speed"),
    "roofline": ("predicted GPU time per stage at a device's published peaks: p50 per question, packed questions/s",
                 _add_roofline, "pixeltriage.bench.models.roofline"),
    "serve": ("the scoring service under closed- and open-loop load vs in-process Scorer.score", _add_serve,
              "pixeltriage.bench.serve_load"),
    "soak": ("one server for --duration s of normal, oversized, malformed, cut-off and overload traffic: statuses, "
             "p50/p99, RSS, lost or mixed-up answers; exit 1 when a goal is not met", _add_soak,
             "pixeltriage.bench.soak"),
    "workspace": ("the CPU forward with and without the Scorer's workspace, alternating in one process with malloc "
                  "as a host leaves it: time, page faults, system time", _add_workspace,
                  "pixeltriage.bench.workspace_ab"),
}
# the benches that leave malloc as they find it (they measure what tune_malloc would change)
UNTUNED = ("workspace", "compile")
