"""`pixeltriage bench tune`: the choices this machine measured once and keeps (`kernels.tuning`): float32's GEMM
library (`kernels.linear`) and the float32 attention kernel per mask (`kernels.attention`); measured now where not
yet kept, or anew with --again."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from pixeltriage.bench.timing import set_threads


GEMM, ATTENTION = "float32 GEMM", "float32 attention"


def float32_records(dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """This machine's kept float32 choices, measured where not yet kept: ({name: record, or None where a forward
    in `dtype` does not follow it}, {name: why not}). GEMM: unless PIXELTRIAGE_ONEDNN decides, or torch has no
    oneDNN primitive; attention: where the C kernels are built."""
    from pixeltriage.kernels import attention, linear, native

    records, why = {GEMM: None, ATTENTION: None}, {}
    if dtype != torch.float32:
        return records, {GEMM: f"{dtype} forward", ATTENTION: f"{dtype} forward"}
    if linear._switch() != "auto":
        why[GEMM] = f"{linear.ONEDNN_SWITCH}={linear._switch()} decides"
    elif not linear._fused_available(torch.float32):
        why[GEMM] = "this torch has no oneDNN linear primitive"
    else:
        records[GEMM] = linear.float32_choice()
    if native.available():
        records[ATTENTION] = attention.float32_choice()
    else:
        why[ATTENTION] = f"no C kernels: {native.status()}"
    return records, why


def tune_report(again: bool = False) -> dict:
    """{"machine": the records' key, "file": where they are kept, "forgotten": names dropped by `again`,
    "records": {name: record, or None where it does not apply here (and why, under "not_measured")}}."""
    from pixeltriage.kernels import tuning

    forgotten = tuning.forget() if again else []
    records, why = float32_records()
    return {"machine": tuning.machine_key(), "file": str(tuning.path()), "forgotten": forgotten, "records": records,
            "not_measured": why}


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


def run_tune(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    report = tune_report(args.again)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0
