"""A full retrofit run with ``--cuda-graph-step`` against the same run eager (issue #10 item 8: the step as one CUDA
graph must train the same student, not only time well).

Reads the two runs' ``train_log.jsonl`` (same model, data, seed and steps; ``benchmarks/device/graphed_retrofit_compare.sh``
trains them one after the other on the GPU) and, if given, their students' accuracy files (``kvlearn eval``), and
writes one results file whose rows are the two runs, each with: the steps, the median wall time of a step after the first ``--skip`` steps (both runs
measured in the same call, so their ratio is the comparison), the mean of each loss term over each tenth and over the
last tenth, and the mean accuracy per family. The comparison: the graphed run's time per step over the eager run's,
the largest per-tenth difference of each loss term (relative to the eager run's), and the accuracy difference.

    python benchmarks/graphed_retrofit_compare.py --eager RUN_E/train_log.jsonl --graphed RUN_G/train_log.jsonl \\
        --eager-eval eager_eval.json --graphed-eval graphed_eval.json --out graphed_retrofit_compare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.results import make_results, write_results  # noqa: E402
from train_log_summary import read_log, summarise  # noqa: E402

METRICS = ("kd", "boundary", "recall")


def step_seconds(rows: list[dict], skip: int) -> float:
    """Median wall seconds of one step after the first ``skip`` (``seconds`` is cumulative in the log); one-line error
    when the log has too few steps to measure."""
    secs = [r["seconds"] for r in rows]
    diffs = [b - a for a, b in zip(secs[skip:], secs[skip + 1:])]
    check(len(diffs) >= 10, f"the log has {len(rows)} steps: expected more than skip + 10 = {skip + 10} to time a step")
    return statistics.median(diffs)


def family_accuracy(path: str | Path) -> dict[str, float]:
    """``{task: accuracy}`` of one ``kvlearn eval`` file, plus ``mean`` over its tasks."""
    data = json.loads(Path(path).read_text())
    rows = data.get("rows") or []
    check(len(rows) > 0, f"{path}: no accuracy rows")
    acc = {r["task"]: r["accuracy"] for r in rows}
    acc["mean"] = sum(acc.values()) / len(acc)
    return acc


def compare(eager_log, graphed_log, skip: int, eager_eval=None, graphed_eval=None) -> dict:
    """The comparison described in the module docstring: ``{"runs": {"eager": row, "graphed": row}, "comparison"}``."""
    e_rows, g_rows = read_log(eager_log), read_log(graphed_log)
    check(len(e_rows) == len(g_rows), f"the runs logged {len(e_rows)} and {len(g_rows)} steps: expected the same "
                                      "number (the same --steps)")
    metrics = [m for m in METRICS if any(m in r for r in e_rows) and any(m in r for r in g_rows)]
    check(len(metrics) > 0, f"neither log has any of {', '.join(METRICS)}")
    runs = {}
    for name, rows in (("eager", e_rows), ("graphed", g_rows)):
        runs[name] = {"steps": len(rows), "step_ms_median": 1000 * step_seconds(rows, skip),
                      **summarise(rows, metrics)}
    comparison = {"graphed_over_eager_step_time": runs["graphed"]["step_ms_median"] / runs["eager"]["step_ms_median"]}
    for m in metrics:
        e_t, g_t = runs["eager"]["metrics"][m]["tenths"], runs["graphed"]["metrics"][m]["tenths"]
        comparison[f"{m}_max_tenth_rel_diff"] = max(abs(g - e) / max(abs(e), 1e-12) for e, g in zip(e_t, g_t))
        comparison[f"{m}_last_tenth"] = {"eager": e_t[-1], "graphed": g_t[-1]}
    # the first steps run eagerly in both runs (the graphed trainer's warm-up), so their losses agree closely
    comparison["kd_first_step_abs_diff"] = abs(e_rows[0]["kd"] - g_rows[0]["kd"])
    if eager_eval and graphed_eval:
        ea, ga = family_accuracy(eager_eval), family_accuracy(graphed_eval)
        runs["eager"]["accuracy"], runs["graphed"]["accuracy"] = ea, ga
        comparison["mean_accuracy_diff"] = ga["mean"] - ea["mean"]
        comparison["max_family_accuracy_abs_diff"] = max(abs(ga[t] - ea[t]) for t in ea if t in ga and t != "mean")
    return {"runs": runs, "comparison": comparison}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eager", required=True, help="the eager run's train_log.jsonl")
    p.add_argument("--graphed", required=True, help="the graphed run's train_log.jsonl")
    p.add_argument("--eager-eval", help="the eager student's kvlearn eval file")
    p.add_argument("--graphed-eval", help="the graphed student's kvlearn eval file")
    p.add_argument("--skip", type=int, default=20, help="steps left out of the step time (compilation, capture)")
    p.add_argument("--device", default="cuda", help="the device both runs used (cuda or cpu), recorded by name")
    p.add_argument("--command", default="", help="the command that produced the runs, recorded in the file")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        check(args.skip >= 0, f"--skip={args.skip} is invalid: expected >= 0")
        check((args.eager_eval is None) == (args.graphed_eval is None),
              "only one of --eager-eval/--graphed-eval given: expected both or neither")
        result = compare(args.eager, args.graphed, args.skip, args.eager_eval, args.graphed_eval)
    except KVLearnError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = [{"run": name, **row} for name, row in result["runs"].items()]
    write_results(args.out, make_results("graphed_retrofit_compare", rows, device=args.device,
                                         command=args.command or None, comparison=result["comparison"]))
    c = result["comparison"]
    print(f"graphed/eager step time {c['graphed_over_eager_step_time']:.3f}; kd last tenth "
          f"{c['kd_last_tenth']['eager']:.4f} / {c['kd_last_tenth']['graphed']:.4f}"
          + (f"; mean accuracy diff {c['mean_accuracy_diff']:+.3f}" if "mean_accuracy_diff" in c else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
