"""Compare a retrofit on one GPU with the same retrofit under FSDP2 on several (issue #10 item 2): same data, same
steps, same global batch. Reads the two runs' ``train_log.jsonl`` and, optionally, each student's evaluation JSON,
and writes one results file and a plot of the two loss curves.

    PYTHONPATH=src python benchmarks/retrofit_fsdp_compare.py --one RUN1 --sharded RUN2 --world 2 \\
        --eval-one EVAL1.json --eval-sharded EVAL2.json --out results/retrofit_fsdp_h200x2.json

Rows (``kind: retrofit_fsdp``), one per run (``processes`` 1 and ``world``):

- ``step_ms_median``: the median wall time of one optimizer step over the steps after ``--skip`` (compiles and
  the data workers' start excluded), from the log's cumulative ``seconds``; ``speedup``: the one-process median
  over this run's (the same global batch, so > 1 means the sharded run trains faster);
- ``loss_mean_last``, ``kd_mean_last``, ``boundary_mean_last``: means over the last ``--last`` logged steps;
- ``loss_rel_diff_mean``: (sharded run only) the mean over steps of |loss_sharded - loss_one| / loss_one. The runs
  see the same examples in the same order, but bf16 autocast rounds differently in each (every process's matmuls
  have other shapes), so the curves part by round-off that training amplifies; the means over the last steps and
  the students' accuracy are what must agree;
- ``accuracy`` per task and ``mean_accuracy`` from the evaluation JSONs (``kvlearn eval`` rows), when given.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script train_log_summary
from train_log_summary import read_log as read_train_log  # noqa: E402

from kvlearn.errors import KVLearnError  # noqa: E402
from kvlearn.results import make_results, portable_path, read_results, write_results  # noqa: E402


def read_log(run: Path) -> list[dict]:
    """The rows of the run folder's ``train_log.jsonl`` (:func:`train_log_summary.read_log`: its one-line errors)."""
    return read_train_log(run / "train_log.jsonl")


def step_ms(log: list[dict], skip: int) -> float:
    seconds = [r["seconds"] for r in log]
    gaps = [1e3 * (b - a) for a, b in zip(seconds[skip:], seconds[skip + 1:])]
    if not gaps:
        sys.exit(f"error: --skip {skip} leaves no steps of {len(log)}: expected --skip < {len(log) - 1}")
    return statistics.median(gaps)


def tail_mean(log: list[dict], key: str, last: int) -> float | None:
    values = [r[key] for r in log[-last:] if key in r]
    return round(statistics.fmean(values), 6) if values else None


def accuracy(path: str | None) -> dict:
    if not path:
        return {}
    rows = read_results(path)["rows"]
    per_task = {r["task"]: r["accuracy"] for r in rows}
    return {"accuracy": per_task, "mean_accuracy": round(statistics.fmean(per_task.values()), 4),
            "n_per_task": min(r["n"] for r in rows), "split": rows[0].get("split"), "eval_method": rows[0]["method"],
            "budget": rows[0].get("budget")}


def plot(one: list[dict], sharded: list[dict], world: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for log, label in ((one, "1 GPU"), (sharded, f"FSDP2, {world} GPUs")):
        steps = [r["step"] for r in log]
        axes[0].plot(steps, [r["loss"] for r in log], label=label, lw=0.8)
        axes[1].plot(steps, [r["seconds"] for r in log], label=label)
    axes[0].set(xlabel="step", ylabel="loss (KD + boundary)", yscale="log", title="same data, same global batch")
    axes[1].set(xlabel="step", ylabel="elapsed seconds", title="wall clock")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", required=True, help="retrofit output folder of the one-process run")
    ap.add_argument("--sharded", required=True, help="retrofit output folder of the torchrun run")
    ap.add_argument("--world", type=int, required=True, help="processes (GPUs) of the sharded run")
    ap.add_argument("--eval-one", help="kvlearn eval JSON of the one-process student")
    ap.add_argument("--eval-sharded", help="kvlearn eval JSON of the sharded run's student")
    ap.add_argument("--skip", type=int, default=20, help="first steps left out of the step time (compiles)")
    ap.add_argument("--last", type=int, default=100, help="steps averaged for the final loss terms")
    ap.add_argument("--command", help="the command that made the runs (recorded in the file)")
    ap.add_argument("--out", required=True, help="results JSON; the plot is written beside it (.png)")
    args = ap.parse_args(argv)
    if args.world < 2:
        sys.exit(f"error: --world {args.world} is invalid: the sharded run has >= 2 processes")
    try:
        one, sharded = read_log(Path(args.one)), read_log(Path(args.sharded))
    except KVLearnError as err:
        sys.exit(f"error: {err}")
    if [r["step"] for r in one] != [r["step"] for r in sharded]:
        sys.exit(f"error: the runs logged different steps ({len(one)} and {len(sharded)} lines): "
                 "expected the same --steps")
    base_ms = step_ms(one, args.skip)
    rows = []
    for log, processes, ev in ((one, 1, args.eval_one), (sharded, args.world, args.eval_sharded)):
        ms = step_ms(log, args.skip)
        row = {"processes": processes, "steps": len(log), "step_ms_median": round(ms, 2),
               "speedup": round(base_ms / ms, 3), "seconds_total": log[-1]["seconds"],
               **{f"{k}_mean_last": tail_mean(log, k, args.last) for k in ("loss", "kd", "boundary")}}
        if processes > 1:
            diffs = [abs(b["loss"] - a["loss"]) / max(abs(a["loss"]), 1e-12) for a, b in zip(one, sharded)]
            row["loss_rel_diff_mean"] = round(statistics.fmean(diffs), 4)
            row["loss_rel_diff_first10_max"] = round(max(diffs[:10]), 4)
        row.update(accuracy(ev))
        rows.append(row)
    out = Path(args.out)
    results = make_results("retrofit_fsdp", rows, command=args.command, world=args.world, skip=args.skip,
                           last=args.last, runs=[portable_path(args.one), portable_path(args.sharded)])
    write_results(out, results)
    plot(one, sharded, args.world, out.with_suffix(".png"))
    for r in rows:
        print({k: v for k, v in r.items() if k != "accuracy"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
