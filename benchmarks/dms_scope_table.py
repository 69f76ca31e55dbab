"""DMS's two compression scopes side by side at every budget, on one device (issue #10, docs/DESIGN.md section 9).

The model scope (the reference's hinge, the DMS rows of a Table 1 file such as ``results/reproduce_kvpop_1300_h100.json``)
against the head scope (``kvlearn retrofit --method dms --compression-scope head``: each KV head held to its own
long-range slots), each student trained for its budget with the same recipe and served under the ``bounded`` protocol.
The head-scope rows are ``kvlearn eval --method dms`` files (one budget and split each, as
``benchmarks/device/dms_budget_check.sh`` writes them); the teacher's rows come from the table. Writes one JSON
(kind ``comparison``): per budget, scope and split the per-family accuracies, their mean and the mean relative to
the teacher's, and the head scope's gain with its binomial standard error; with ``--plot``, the means against the
budget.

Every file must come from the same device (rows measured on two GPUs are not one comparison) and each head-scope
file must hold one budget and one split that the table also has.

Usage:
  python benchmarks/dms_scope_table.py --table results/reproduce_kvpop_1300_h100.json \\
      --head results/raw/dms_budget_check_*_head_eval_b{1024,512,256}_h100_e132782.json \\
             results/raw/dms_budget_check_*_head_heldout_b*_h100_e132782.json \\
      --out results/dms_scope_h100.json --plot results/dms_scope_h100.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.eval.acceptance import difference_se, mean  # noqa: E402
from kvlearn.results import make_results, portable_path, read_results, write_results  # noqa: E402

SCOPES = ("model", "head")


def family_accuracies(rows: list[dict], method: str, split: str, budget: int | None) -> dict[str, tuple[float, int]]:
    """``{task: (accuracy, n)}`` of the ``bounded`` rows of ``method`` on ``split`` at ``budget`` (None: any
    budget)."""
    return {r["task"]: (r["accuracy"], r.get("n")) for r in rows
            if r["method"] == method and r.get("protocol", "bounded") == "bounded" and r["split"] == split
            and (budget is None or r["budget"] == budget)}


def head_scope_runs(paths: list[str], device: str) -> dict[tuple[int, str], tuple[dict[str, tuple], str]]:
    """``{(budget, split): ({task: (accuracy, n)}, file)}`` of the head-scope eval files; each holds one DMS budget
    and split, measured on ``device``."""
    runs = {}
    for path in paths:
        data = read_results(path)
        check(data.get("device") == device,
              f"{path} was measured on {data.get('device')!r} and the table on {device!r}: compare one device's rows")
        rows = [r for r in data["rows"] if r["method"] == "dms"]
        keys = {(r["budget"], r["split"]) for r in rows}
        check(len(keys) == 1, f"{path} holds {len(keys)} DMS (budget, split) runs: expected one, as kvlearn eval "
                              "--method dms --budget B --split S writes")
        key = keys.pop()
        check(key not in runs, f"{path}: budget {key[0]}, split {key[1]!r} is given twice ({runs.get(key, (0, ''))[1]})")
        runs[key] = ({r["task"]: (r["accuracy"], r.get("n")) for r in rows}, path)
    return runs


def scope_rows(table: dict, head: dict) -> list[dict]:
    """One row per (budget, split, scope) for every head-scope run; the model scope's from the table's DMS rows. The
    head row also carries its gain over the model row and the binomial standard error of that gain
    (:func:`kvlearn.eval.acceptance.difference_se`, the families sampled independently)."""
    rows = []
    for (budget, split), (head_acc, path) in sorted(head.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        teacher = family_accuracies(table["rows"], "teacher", split, None)
        model = family_accuracies(table["rows"], "dms", split, budget)
        check(bool(teacher), f"the table has no teacher rows on split {split!r}")
        check(bool(model), f"the table has no DMS rows at budget {budget} on split {split!r} (from {path}): "
                           f"expected a Table 1 file with that budget")
        check(set(model) == set(head_acc) == set(teacher),
              f"budget {budget}, split {split!r}: the families differ (model scope {sorted(model)}, head scope "
              f"{sorted(head_acc)}, teacher {sorted(teacher)})")
        teacher_mean = mean(a for a, _ in teacher.values())
        for scope, acc in (("model", model), ("head", head_acc)):
            m = mean(a for a, _ in acc.values())
            rows.append({"budget": budget, "split": split, "scope": scope,
                         "tasks": {t: a for t, (a, _) in sorted(acc.items())}, "mean": round(m, 4),
                         "relative": round(m / teacher_mean, 4),
                         "source": portable_path(path) if scope == "head" else "table"})
        rows[-1]["gain_over_model"] = round(rows[-1]["mean"] - rows[-2]["mean"], 4)
        se = difference_se(list(model.values()), list(head_acc.values()))
        rows[-1]["gain_se"] = None if se is None else round(se, 4)
    return rows


def plot(rows: list[dict], path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({r["split"] for r in rows})
    fig, axes = plt.subplots(1, len(splits), figsize=(4.5 * len(splits), 3.6), squeeze=False, sharey=True)
    for ax, split in zip(axes[0], splits):
        for scope, style in (("model", "o--"), ("head", "s-")):
            pts = sorted((r["budget"], r["relative"]) for r in rows if r["split"] == split and r["scope"] == scope)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{scope} scope")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["budget"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(f"{split} split")
        ax.set_xlabel("budget (tokens per KV head, context 4096)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("DMS mean accuracy / teacher")
    axes[0][-1].legend(loc="lower right")
    fig.suptitle(f"DMS compression scope, each student trained for its budget ({device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", required=True, help="a Table 1 results file with the model-scope DMS rows")
    parser.add_argument("--head", nargs="+", required=True, help="kvlearn eval files of head-scope DMS students")
    parser.add_argument("--out", required=True, help="the comparison JSON to write")
    parser.add_argument("--plot", default=None, help="a PNG of the means against the budget")
    args = parser.parse_args(argv)
    try:
        table = read_results(args.table)
        head = head_scope_runs(args.head, table.get("device"))
        rows = scope_rows(table, head)
    except (KVLearnError, FileNotFoundError, KeyError, ValueError) as err:
        print(f"dms_scope_table: error: {err}", file=sys.stderr)
        return 2
    results = make_results("comparison", rows, command=None, table=portable_path(args.table))
    results["device"] = table.get("device")  # the rows' device, not this machine's
    write_results(args.out, results)
    for r in rows:
        gain = f" gain {r['gain_over_model']:+.4f} (se {r['gain_se']})" if "gain_over_model" in r else ""
        print(f"budget {r['budget']:>5} {r['split']:<8} {r['scope']:<6} mean {r['mean']:.4f} relative "
              f"{r['relative']:.4f}{gain} {r['tasks']}")
    if args.plot:
        plot(rows, args.plot, results["device"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
