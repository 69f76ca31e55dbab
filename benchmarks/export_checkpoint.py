"""Export a trained checkpoint folder in another dtype (bf16 by default), as the device scripts bring students and
selectors back: ``kvlearn.load`` (the method's added modules restored: KVpop scorers, DMS gates, a KV-Kaizen selector)
then ``save_pretrained``, with the folder's tokenizer files and its ``teacher.json`` (the lineage record,
:mod:`kvlearn.lineage`) and a kaizen-train folder's ``kaizen_budget.json`` (the budget multiplier its run reached,
where a refinement's starts) copied beside the weights when it has them. Nothing else of the run's trainer state is
exported.

Usage: ``python benchmarks/export_checkpoint.py SRC DST [--dtype bfloat16|float16|float32] [--overwrite]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import kvlearn  # noqa: E402
from kvlearn.errors import KVLearnError, check  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# copied beside the weights when the source folder has them (a teacher saved without a tokenizer has none)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "teacher.json",
              "kaizen_budget.json")  # the last: where a kaizen-train run left its budget multiplier (a refinement's start)


def export_checkpoint(src: str, dst: str, dtype: str = "bfloat16", overwrite: bool = False) -> list[str]:
    """Writes the model of folder ``src`` to the folder ``dst`` in ``dtype`` (a new or empty folder; ``overwrite``:
    an existing ``dst`` is replaced); returns the side files copied."""
    check(dtype in DTYPES, f"dtype={dtype!r} is invalid: expected one of {', '.join(DTYPES)}")
    check(os.path.isdir(src), f"{src!r} is not a folder: expected a checkpoint folder (config.json and weights)")
    check(os.path.realpath(src) != os.path.realpath(dst), f"{dst!r} is the source folder: expected another folder")
    if os.path.isdir(dst) and os.listdir(dst):
        check(overwrite, f"{dst!r} exists and is not empty: expected a new folder (or --overwrite to replace it)")
        shutil.rmtree(dst)
    kvlearn.load(src, dtype=DTYPES[dtype]).save_pretrained(dst)
    copied = [f for f in SIDE_FILES if os.path.isfile(os.path.join(src, f))]
    for f in copied:
        shutil.copy2(os.path.join(src, f), dst)
    return copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a checkpoint folder (e.g. a retrofit's or kaizen-train's final/)")
    ap.add_argument("dst", help="the new folder")
    ap.add_argument("--dtype", default="bfloat16", help=f"one of {', '.join(DTYPES)} (default bfloat16)")
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists (a rerun on the same machine)")
    args = ap.parse_args(argv)
    try:
        copied = export_checkpoint(args.src, args.dst, args.dtype, args.overwrite)
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.src} -> {args.dst} ({args.dtype}; with {', '.join(copied) or 'no side files'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
