"""`pixeltriage pack`, `pixeltriage verify` and `pixeltriage init-demo`: checkpoints on disk."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pixeltriage.cli.common import (DEMO_PRESETS, DTYPE_NAMES, add_checkpoint_arguments, existing_path, new_directory,
                                    new_file, resolved_checkpoint)


def add_pack_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(p, "src", "a directory (transformers or Valen layout)")
    p.add_argument("dst", type=new_file, help="packed file to write (replaced atomically if it exists)")
    p.add_argument("--adapter", metavar="DIR", type=existing_path, default=None,
                   help="PEFT LoRA adapter directory to merge (default: one inside SRC, if any)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="dtype of the packed weights (default: the checkpoint's own; a narrower one is a warning, "
                        "since its scores are those of the checkpoint at that dtype)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run_pack(args: argparse.Namespace) -> int:
    from pixeltriage.weights.layout import parse_dtype
    from pixeltriage.weights.packed import pack_checkpoint

    info = pack_checkpoint(resolved_checkpoint(args, "src"), args.dst, adapter=args.adapter,
                           dtype=parse_dtype(args.dtype) if args.dtype else None, progress=not args.quiet)
    print(json.dumps({"path": str(args.dst), **info}, indent=2))
    return 0


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=existing_path,
                   help="packed file (every value read, bytes checked against its fingerprint) or checkpoint "
                        "directory (loaded with every value checked)")


def run_verify(args: argparse.Namespace) -> int:
    import torch

    from pixeltriage.weights.loader import load_directory
    from pixeltriage.weights.packed import PackedCheckpoint, checkpoint_dtype

    path = Path(args.path)
    if path.is_file():
        packed = PackedCheckpoint(path)
        packed.verify()
        info = {"path": str(path), "ok": True, "kind": "packed", "dtype": packed.metadata["dtype"],
                "fingerprint": packed.fingerprint}
    else:
        dtype = checkpoint_dtype(path)
        load_directory(path, dtype, torch.device("cpu"), verify=True)
        info = {"path": str(path), "ok": True, "kind": "directory", "dtype": str(dtype).removeprefix("torch.")}
    print(json.dumps(info, indent=2))
    return 0


def add_init_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=new_directory, help="directory to create (absent or empty)")
    p.add_argument("--preset", choices=DEMO_PRESETS, default="tiny", help="model shape (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="weight dtype (default: float32 for tiny, bfloat16 otherwise)")


def run_init_demo(args: argparse.Namespace) -> int:
    from pixeltriage.weights.demo import count_parameters, write_demo_checkpoint

    path = write_demo_checkpoint(args.dir, args.preset, args.seed, args.dtype, progress=True)
    counts = count_parameters(path)
    print(f"wrote demo checkpoint '{args.preset}' (seed {args.seed}) to {path}: "
          f"{counts['backbone'] + counts['head']:,} parameters "
          f"({counts['backbone']:,} backbone + {counts['head']:,} decision head)")
    return 0
