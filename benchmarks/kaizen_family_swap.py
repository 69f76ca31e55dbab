"""Does a selector's per-family choice pay? Each family under its own configuration and under the others' (issue #11).

A KV-Kaizen selector that returns different per-layer configurations for different task families (session 26's
seed-0 8x selector: trace one configuration, niah and recall another) claims that each family is served better by
its own. This measures that claim on the selector's own backbone. ``configs`` lists the configuration each family
mostly received (the ``configurations`` counts of the selector's ``kaizen`` rows), the evaluation part runs every
family under every listed configuration (``kvlearn eval --method kaizen_static --configuration C`` on the selector's
folder, the same prompts), and ``summary`` sets the two side by side:

    python benchmarks/kaizen_family_swap.py configs SELECTOR_ROWS.json [--extra 'b4 b4 b2 b2 share b4 share share']
    python benchmarks/kaizen_family_swap.py summary SELECTOR_ROWS.json STATIC_ROWS.json... --out SWAP.json

The summary has one row per (split, family): the configuration the selector chose for most of its prompts, the
accuracy of the selector's rows, and the accuracy under each configuration served statically to every prompt of
the family (``under``), with ``own_minus_best_other``: the static accuracy under the family's own configuration minus
the best other one (> 0: the choice paid on that family). ``benchmarks/device/kaizen_family_swap.sh`` trains a
selector and runs all three parts in one device call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.results import make_results, read_results, write_results  # noqa: E402


def dominant_configurations(rows: list[dict]) -> dict[tuple[str, str], str]:
    """``(split, family) -> the configuration most of that family's prompts received``, from the ``kaizen`` rows."""
    chosen = {}
    for row in rows:
        if row.get("method") != "kaizen":
            continue
        counts = row.get("configurations") or {}
        check(bool(counts), f"kaizen row {row.get('split')}/{row.get('task')} has no configurations counts: expected "
                            "rows of benchmarks/kaizen_table.py (kvlearn eval --method kaizen)")
        chosen[(row["split"], row["task"])] = max(sorted(counts), key=counts.get)
    check(bool(chosen), "no kaizen rows: expected the selector's rows of benchmarks/kaizen_table.py")
    return chosen


def configurations(rows: list[dict], extra: list[str] = ()) -> list[str]:
    """The distinct dominant configurations, then ``extra`` ones, each once, in first-seen order."""
    out: list[str] = []
    for c in [*dominant_configurations(rows).values(), *extra]:
        if c not in out:
            out.append(c)
    return out


def summary(selector_rows: list[dict], static_rows: list[dict]) -> list[dict]:
    """One row per (split, family) of the selector's rows; see the module docstring."""
    chosen = dominant_configurations(selector_rows)
    selector_acc = {(r["split"], r["task"]): r["accuracy"] for r in selector_rows if r.get("method") == "kaizen"}
    under: dict[tuple[str, str], dict[str, float]] = {}
    for row in static_rows:
        counts = row.get("configurations") or {}
        check(row.get("method") == "kaizen_static" and len(counts) == 1,
              f"static row {row.get('method')} {row.get('split')}/{row.get('task')}: expected kaizen_static rows of one "
              "configuration (kvlearn eval --method kaizen_static --configuration C)")
        under.setdefault((row["split"], row["task"]), {})[next(iter(counts))] = row["accuracy"]
    out = []
    for key, own in sorted(chosen.items()):
        served = under.get(key, {})
        check(own in served, f"{key[0]}/{key[1]}: no static row under its own configuration {own!r}: expected every "
                             "family evaluated under every listed configuration")
        others = {c: a for c, a in served.items() if c != own}
        out.append({"split": key[0], "task": key[1], "own_configuration": own, "selector_accuracy": selector_acc[key],
                    "under": served, "own_minus_best_other": (round(served[own] - max(others.values()), 6)
                                                              if others else None)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("configs", help="print the configurations to serve, one per line")
    c.add_argument("selector_rows")
    c.add_argument("--extra", action="append", default=[], help="one more configuration to serve (repeatable)")
    s = sub.add_parser("summary", help="write the per-family comparison")
    s.add_argument("selector_rows")
    s.add_argument("static_rows", nargs="+")
    s.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        rows = read_results(args.selector_rows)["rows"]
        if args.command == "configs":
            print("\n".join(configurations(rows, args.extra)))
            return 0
        static = [r for path in args.static_rows for r in read_results(path)["rows"]]
        result = make_results("kaizen_family_swap", summary(rows, static), selector_rows=args.selector_rows,
                              static_rows=args.static_rows)
        write_results(args.out, result)
        for r in result["rows"]:
            print(f"{r['split']:8s} {r['task']:7s} own {r['own_configuration']!r}: selector {r['selector_accuracy']:.3f}, "
                  + ", ".join(f"{cfg!r} {acc:.3f}" for cfg, acc in r["under"].items()))
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
