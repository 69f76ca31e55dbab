"""Acceptance evaluation of the testbed teacher (run on the device machine after `kvlearn pretrain`).

    PYTHONPATH=src python benchmarks/teacher_eval.py --model checkpoints/testbed-teacher \
        --n-per-task 100 --out results/testbed_teacher.json

Full cache (dense) and a sinks+window cache (4 sinks, budget 1024, CR 75%) on every family at context 4096, greedy
decoding through the real caches, on both evaluation splits (``eval``: training haystack styles and depth regimes on
unseen seeds; ``heldout``: a style and a regime training never saw); one results file with every row.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvlearn.checkpoint import serving_dtype
from kvlearn.eval.accuracy import EvalConfig, evaluate, format_table
from kvlearn.eval.plots import plot_accuracy
from kvlearn.results import make_results, write_results
from kvlearn import load_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/testbed-teacher")
    ap.add_argument("--n-per-task", type=int, default=100)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--splits", default="eval,heldout", help="comma list of eval, heldout")
    ap.add_argument("--out", default="results/testbed_teacher.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype = serving_dtype(args.device)  # the one serving rule: bf16 on CUDA, float32 elsewhere
    model = load_model(args.model, dtype=dtype, device=args.device)
    rows = []
    settings = [(split, method, budget) for split in args.splits.split(",")
                for method, budget in (("dense", None), ("streaming", args.budget))]
    for split, method, budget in settings:
        cfg = EvalConfig(method=method, budget=budget, n_per_task=args.n_per_task, context=args.context,
                         batch_size=args.batch_size, split=split)
        rows += evaluate(model, cfg, progress=False)
        print(format_table(rows), flush=True)
        results = make_results("accuracy", rows, device=args.device, model=args.model, context=args.context,
                               dtype=str(dtype).replace("torch.", ""))
        write_results(args.out, results)  # after each method, so a cut-off run keeps what it measured
    if args.plot:
        plot_accuracy(rows, args.plot, title=f"Testbed teacher, context {args.context}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
