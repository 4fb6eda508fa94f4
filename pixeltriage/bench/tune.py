"""`pixeltriage bench tune`: the choices this machine measured once and keeps (`kernels.tuning`): float32's GEMM
library (`kernels.linear`), per dtype and mask the C attention kernel against SDPA (`kernels.attention`), and the
bf16 delta pass against the float32 pass (`kernels.gated_delta.bf16`), the weights reordered for oneDNN
against plain, per dtype (`kernels.prepack`); measured now where not yet kept, or anew
with --again. Also the MLP row blocks a forward measured per layer shape (`kernels.linear.in_row_blocks`), which
--again forgets too."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from pixeltriage.bench.timing import set_threads


GEMM, ATTENTION, BF16_ATTENTION, BF16_DELTA = "float32 GEMM", "float32 attention", "bf16 attention", "bf16 delta pass"
PREPACK, PREPACK_F32 = "bf16 prepacked weights", "float32 prepacked weights"


def kept_records(dtype: torch.dtype | None = None) -> tuple[dict, dict]:
    """This machine's kept choices, measured where not yet kept: ({name: record, or None where a forward in `dtype`
    (None: any) does not follow it}, {name: why not}). GEMM: unless PIXELTRIAGE_ONEDNN decides, or torch has no
    oneDNN primitive; float32 attention: where the C kernels are built; bf16 attention and the bf16 delta pass:
    where the CPU has AMX or AVX512-BF16 (the delta pass unless PIXELTRIAGE_DELTA_BF16 decides); prepacked
    weights: in bf16 where oneDNN has bf16 primitives for this CPU, in float32 where its projections run oneDNN's
    primitive, unless PIXELTRIAGE_PREPACK decides."""
    from pixeltriage.kernels import attention, linear, native, prepack
    from pixeltriage.kernels.gated_delta import bf16

    records, why = {GEMM: None, ATTENTION: None, BF16_ATTENTION: None, BF16_DELTA: None, PREPACK: None,
                    PREPACK_F32: None}, {}
    if dtype not in (None, torch.float32):
        why[GEMM] = why[ATTENTION] = f"{dtype} forward"
    else:
        if linear.switch() != "auto":
            why[GEMM] = f"{linear.ONEDNN_SWITCH}={linear.switch()} decides"
        elif not linear.onednn_available(torch.float32):
            why[GEMM] = "this torch has no oneDNN linear primitive"
        else:
            records[GEMM] = linear.float32_choice()
        if native.available():
            records[ATTENTION] = attention.attention_choice(torch.float32)
        else:
            why[ATTENTION] = f"no C kernels: {native.status()}"
    if dtype not in (None, torch.bfloat16):
        why[BF16_ATTENTION] = why[BF16_DELTA] = f"{dtype} forward"
    elif native.isa_emulated():
        why[BF16_ATTENTION] = why[BF16_DELTA] = ("AMX emulated (PIXELTRIAGE_NATIVE_ISA=emulated): its kernels run, at "
                                                 "no speed to measure")
    elif not native.available():
        why[BF16_ATTENTION] = why[BF16_DELTA] = f"no C kernels: {native.status()}"
    elif native.fast_bf16_engine() is None:
        why[BF16_ATTENTION] = "no bf16 units on this CPU (AMX, AVX512-BF16): bf16 attention is SDPA's"
        why[BF16_DELTA] = "no bf16 units on this CPU (AMX, AVX512-BF16): bf16 forwards take the float32 delta pass"
    else:
        records[BF16_ATTENTION] = attention.attention_choice(torch.bfloat16)
        if bf16.switch() != "auto":
            why[BF16_DELTA] = f"{bf16.SWITCH}={bf16.switch()} decides"
        else:
            records[BF16_DELTA] = bf16.delta_choice()
    for name, prepack_dtype in ((PREPACK, torch.bfloat16), (PREPACK_F32, torch.float32)):
        if dtype not in (None, prepack_dtype):
            why[name] = f"{dtype} forward"
        elif (reason := prepack.applies("cpu", prepack_dtype)) is not None:
            why[name] = reason
        elif prepack.switch() != "auto":
            why[name] = f"{prepack.SWITCH}={prepack.switch()} decides"
        else:
            records[name] = prepack.choice(prepack_dtype)
    return records, why


def tune_report(again: bool = False) -> dict:
    """{"machine": the records' key, "file": where they are kept, "forgotten": names dropped by `again`,
    "records": {name: record, or None where it does not apply here (and why, under "not_measured")}, "row_blocks":
    the MLP row blocks forwards measured here (`kernels.linear.in_row_blocks`), by layer}."""
    from pixeltriage.kernels import linear, tuning

    forgotten = tuning.forget() if again else []
    records, why = kept_records()
    return {"machine": tuning.machine_key(), "file": str(tuning.path()), "forgotten": forgotten, "records": records,
            "not_measured": why, "row_blocks": linear.row_block_records()}


def print_report(r: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    print(f"bench tune: {r['machine']}; kept in {r['file']}", file=out)
    if r["forgotten"]:
        print(f"  measured anew: {', '.join(r['forgotten'])}", file=out)
    for name, record in r["records"].items():
        if record is None:
            print(f"  {name:<18} not measured: {r['not_measured'][name]}", file=out)
        else:
            fields = ", ".join(f"{k} {v}" for k, v in record.items())
            print(f"  {name:<18} {fields}", file=out)
    for layer, record in r.get("row_blocks", {}).items():
        fields = ", ".join(f"{k} {v}" for k, v in record.items())
        print(f"  row blocks: {layer}: {fields}", file=out)
    if not r.get("row_blocks"):
        print("  row blocks         none kept yet: a forward measures them at its first MLP of each shape", file=out)


def run_tune(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    report = tune_report(args.again)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0
