"""One DMS student served under each order of its full per-head budget (issue #10, docs/DESIGN.md section 9).

When a kept token leaves the window and a KV head's long-range slots are full, the DMS cache evicts one kept token:
the one with the highest eviction logit (``DMSConfig.overflow_evicts = "highest_logit"``, the default), the oldest
kept one or the newest (``kvlearn eval --method dms --dms-overflow ORDER``). The inputs are ``kvlearn eval`` files of
one student at one budget (one split each, the order in each row's ``options``, the default where absent), as
``benchmarks/device/dms_budget_check.sh OVERFLOW='oldest newest'`` writes them. Writes one JSON (kind
``comparison``): per split and order the per-family accuracies, their mean, and the change against the default order
with its binomial standard error; with ``--table`` (a Table 1 file of the same device) also the teacher's and
KVpop's (``kvpop``, the mLSTM) means at that budget for reference. ``--plot``: grouped bars per family, one panel
per split.

Every file must come from one device and one student (``model``) at one budget.

Usage:
  python benchmarks/dms_overflow_orders.py --runs results/raw/dms_overflow_256_head_*_h100_64c2c37.json \\
      --table results/reproduce_kvpop_1300_dms_head_h100.json \\
      --out results/dms_overflow_orders_h100.json --plot results/dms_overflow_orders_h100.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvlearn.config import DMS_OVERFLOW_ORDERS  # noqa: E402
from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.eval.acceptance import difference_se, mean  # noqa: E402
from kvlearn.results import make_results, portable_path, read_results, write_results  # noqa: E402

DEFAULT_ORDER = DMS_OVERFLOW_ORDERS[0]


def order_runs(paths: list[str]) -> tuple[dict[tuple[str, str], dict[str, tuple]], dict]:
    """``({(split, order): {task: (accuracy, n)}}, {"device", "model", "budget"})`` of the files; each holds one
    DMS budget, split and order, and all share device, model and budget."""
    runs, common = {}, {}
    for path in paths:
        data = read_results(path)
        rows = [r for r in data["rows"] if r["method"] == "dms"]
        check(bool(rows), f"{path} has no DMS rows: expected a kvlearn eval --method dms file")
        keys = {(r["budget"], r["split"], (r.get("options") or {}).get("overflow_evicts", DEFAULT_ORDER))
                for r in rows}
        check(len(keys) == 1, f"{path} holds {len(keys)} (budget, split, order) runs: expected one")
        budget, split, order = keys.pop()
        this = {"device": data.get("device"), "model": data.get("model"), "budget": budget}
        for name, value in this.items():
            check(common.get(name, value) == value,
                  f"{path}: {name} {value!r} differs from the other files' {common.get(name)!r}: expected one "
                  "student served at one budget on one device")
        common = this
        check((split, order) not in runs, f"{path}: split {split!r}, order {order!r} is given twice")
        runs[(split, order)] = {r["task"]: (r["accuracy"], r.get("n")) for r in rows}
    return runs, common


def order_rows(runs: dict, table: dict | None, budget: int) -> list[dict]:
    """One row per (split, order), the default order first; the others carry their change against it and its
    binomial standard error; with ``table``, one reference row per split and method (teacher, kvpop)."""
    rows = []
    for split in sorted({s for s, _ in runs}):
        orders = sorted((o for s, o in runs if s == split), key=DMS_OVERFLOW_ORDERS.index)
        base = runs.get((split, DEFAULT_ORDER))
        for order in orders:
            acc = runs[(split, order)]
            row = {"split": split, "order": order, "budget": budget, "tasks": {t: a for t, (a, _) in sorted(acc.items())},
                   "mean": round(mean(a for a, _ in acc.values()), 4)}
            if base is not None and order != DEFAULT_ORDER:
                check(set(base) == set(acc), f"split {split!r}: order {order!r} has families {sorted(acc)}, the "
                                             f"default {sorted(base)}")
                row["change"] = round(row["mean"] - mean(a for a, _ in base.values()), 4)
                se = difference_se(list(base.values()), list(acc.values()))
                row["change_se"] = None if se is None else round(se, 4)
            rows.append(row)
        for method in ("teacher", "kvpop") if table is not None else ():
            ref = {r["task"]: r["accuracy"] for r in table["rows"] if r["method"] == method and r["split"] == split
                   and r.get("protocol", "bounded") == "bounded" and (method == "teacher" or r["budget"] == budget)}
            if ref:
                rows.append({"split": split, "reference": method, "budget": None if method == "teacher" else budget,
                             "tasks": dict(sorted(ref.items())), "mean": round(mean(ref.values()), 4)})
    return rows


def plot(rows: list[dict], path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(r["split"] for r in rows))
    fig, axes = plt.subplots(1, len(splits), figsize=(5.5 * len(splits), 4.8), squeeze=False, sharey=True)
    for ax, split in zip(axes[0], splits):
        series = [r for r in rows if r["split"] == split]
        tasks = list(series[0]["tasks"])
        width = 0.8 / len(series)
        for i, r in enumerate(series):
            name = f"DMS, evicts {r['order']}" if "order" in r else r["reference"]
            xs = [t + (i - (len(series) - 1) / 2) * width for t in range(len(tasks))]
            ax.bar(xs, [r["tasks"].get(t, 0.0) for t in tasks], width=width, label=f"{name} (mean {r['mean']:.3f})",
                   color=f"C{i}", hatch="//" if "reference" in r else None, alpha=0.6 if "reference" in r else 1.0)
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_title(f"{split} split")
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)  # below: no bar hidden
    axes[0][0].set_ylabel("accuracy")
    budget = next(r["budget"] for r in rows if "order" in r)
    fig.suptitle(f"One DMS student at budget {budget}: which kept token a full head evicts ({device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, help="kvlearn eval --method dms files of one student")
    parser.add_argument("--table", default=None, help="a Table 1 file of the same device (teacher and KVpop rows)")
    parser.add_argument("--out", required=True, help="the comparison JSON to write")
    parser.add_argument("--plot", default=None, help="a PNG of the accuracies per family")
    args = parser.parse_args(argv)
    try:
        runs, common = order_runs(args.runs)
        table = read_results(args.table) if args.table else None
        check(table is None or table.get("device") == common["device"],
              f"{args.table} was measured on {None if table is None else table.get('device')!r} and the runs on "
              f"{common['device']!r}: compare one device's rows")
        rows = order_rows(runs, table, common["budget"])
    except (KVLearnError, FileNotFoundError, KeyError, ValueError) as err:
        print(f"dms_overflow_orders: error: {err}", file=sys.stderr)
        return 2
    extra = {"table": portable_path(args.table)} if args.table else {}
    results = make_results("comparison", rows, command=None, model=common["model"], **extra)
    results["device"] = common["device"]  # the rows' device, not this machine's
    write_results(args.out, results)
    for r in rows:
        name = r.get("order") or r["reference"]
        change = f" change {r['change']:+.4f} (se {r['change_se']})" if "change" in r else ""
        print(f"{r['split']:<8} {name:<14} mean {r['mean']:.4f}{change} {r['tasks']}")
    if args.plot:
        plot(rows, args.plot, results["device"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
