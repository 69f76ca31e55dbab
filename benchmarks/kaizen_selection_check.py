"""Why does checkpoint selection's validation read a KV-Kaizen student higher than the table does? (issue #11)

    PYTHONPATH=src python benchmarks/kaizen_selection_check.py --model OUT/final --out check.json

Session 39's two 8x selectors read trace at 16 / 16 and 12 / 16 in their validation (``kvlearn kaizen-train
--select-every``) where ``benchmarks/kaizen_table.py`` measured 0.75 and 0.56 on its 100 prompts. The two
measurements differ in three ways, and this script crosses them on one saved student (a ``kaizen-train`` folder):

- the prompts: the validation's (eval-split format from example index ``SELECT_SEED_OFFSET`` on, ``--n-select`` per
  family) or the table's (index 0 on, ``--n-eval`` per family);
- the weights and activations: ``train_copy`` loads the weights in float32 and runs under bf16 autocast on CUDA, as
  the validation ran the training copy until session 39; ``served`` loads them in bf16, as the table and ``kvlearn
  eval`` serve a checkpoint on CUDA, and as the validation has served the iterate since (on the CPU both are float32
  without autocast);
- the batch: the validation's ``min(n_select, 16)`` or the table's 64 (``--batch-sizes``).

Each cell is one ``evaluate`` with method ``kaizen`` (the selector's choice per prompt, the compact cache of that
choice). The rows carry ``serving``, ``prompts``, ``batch_size`` and the usual accuracy fields; the summary gives each
cell's mean and, per family, the largest spread across servings on the same prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from eviction_baselines import parse_list  # noqa: E402
from kvlearn.errors import KVLearnError, check, check_int  # noqa: E402
from kvlearn.eval.accuracy import EvalConfig, evaluate  # noqa: E402
from kvlearn.results import make_results, portable_path, write_results  # noqa: E402
from kvlearn.testbed import tasks as testbed_tasks  # noqa: E402

SERVINGS = ("train_copy", "served")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a kaizen-train folder (final/, best/ or step-N/)")
    ap.add_argument("--tasks", default="trace,niah", help="comma list of task families, or 'all'")
    ap.add_argument("--n-select", type=int, default=16, help="validation prompts per family (kaizen-train's select_n)")
    ap.add_argument("--n-eval", type=int, default=100, help="the table's prompts per family")
    ap.add_argument("--batch-sizes", default="16,64", help="comma list of batch sizes crossed with the rest")
    ap.add_argument("--servings", default=",".join(SERVINGS), help=f"comma list of {', '.join(SERVINGS)}")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="kaizen_selection_check.json")
    return ap.parse_args(argv)


def parse_batches(text: str) -> tuple[int, ...]:
    """``--batch-sizes``: a comma list of integers >= 1, else a one-line error naming the bad value."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    check(items and all(x.isdigit() and int(x) >= 1 for x in items),
          f"--batch-sizes={text!r} is invalid: expected a comma list of integers >= 1, e.g. 16,64")
    return tuple(int(x) for x in items)


def load_student(path: str, serving: str, device: torch.device):
    """The student as ``serving`` runs it: float32 weights (``train_copy``) or bf16 weights on CUDA (``served``)."""
    import kvlearn

    from kvlearn.checkpoint import serving_dtype

    dtype = serving_dtype(device) if serving == "served" else torch.float32
    return kvlearn.load(path, dtype=dtype, device=device)


def autocast_for(serving: str, device: torch.device):
    """bf16 autocast for the training copy on CUDA (as ``kaizen_train.validate`` runs it), nothing otherwise."""
    if serving == "train_copy" and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run(args) -> dict:
    from kvlearn.train.kaizen_train import SELECT_SEED_OFFSET

    tasks = parse_list(args.tasks, tuple(testbed_tasks.FAMILIES), "--tasks")
    servings = parse_list(args.servings, SERVINGS, "--servings")
    batches = parse_batches(args.batch_sizes)
    check_int("n_select", args.n_select, 1)
    check_int("n_eval", args.n_eval, 1)
    check(Path(args.model).is_dir(), f"--model {args.model!r} is not a folder: expected a kaizen-train folder")
    device = torch.device(args.device)
    prompt_sets = (("selection", SELECT_SEED_OFFSET, args.n_select), ("table", 0, args.n_eval))
    rows, t0 = [], time.time()
    for serving in servings:
        model = load_student(args.model, serving, device)
        model.eval()
        for prompts, offset, n in prompt_sets:
            for batch in batches:
                config = EvalConfig(method="kaizen", tasks=tasks, n_per_task=n, context=args.context,
                                    batch_size=batch, split="eval", seed_offset=offset)
                with torch.no_grad(), autocast_for(serving, device):
                    cell = evaluate(model, config, progress=False)
                for r in cell:
                    rows.append({**r, "serving": serving, "prompts": prompts, "seed_offset": offset,
                                 "batch_size": batch})
                print(f"{serving:10s} {prompts:9s} batch {batch:3d}: "
                      + ", ".join(f"{r['task']} {r['accuracy']:.3f}" for r in cell), flush=True)
        del model
    return {"rows": rows, "summary": summarize(rows), "wall_seconds": round(time.time() - t0, 1)}


def summarize(rows: list[dict]) -> dict:
    """Each cell's mean accuracy over its families, and per (prompts, family) the accuracies of every serving and
    batch with their spread (largest minus smallest)."""
    cells: dict[str, list[float]] = {}
    per_family: dict[str, dict[str, float]] = {}
    for r in rows:
        cell = f"{r['serving']}/{r['prompts']}/batch{r['batch_size']}"
        cells.setdefault(cell, []).append(r["accuracy"])
        per_family.setdefault(f"{r['prompts']}/{r['task']}", {})[f"{r['serving']}/batch{r['batch_size']}"] = r["accuracy"]
    return {"cell_mean": {k: sum(v) / len(v) for k, v in cells.items()},
            "per_family": {k: {**v, "spread": max(v.values()) - min(v.values())} for k, v in per_family.items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = run(args)
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = make_results("kaizen_selection_check", out["rows"], device=args.device, model=portable_path(args.model),
                           context=args.context, summary=out["summary"], wall_seconds=out["wall_seconds"])
    print(f"wrote {write_results(args.out, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
