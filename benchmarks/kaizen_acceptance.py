"""Issue #11's accuracy acceptance, read off the KV-Kaizen table (no model is run): for every learned selector, every
composed student and every split, its families' accuracy against the control's.

    python benchmarks/kaizen_acceptance.py                       # results/kaizen_table.json -> results/kaizen_acceptance.json
    python benchmarks/kaizen_acceptance.py --table T --out O

The criteria, each a row per group (``method``, its ``selector`` or ``series`` label, ``target``) and split:

- ``selector_within_control``: a learned selector (``method`` ``kaizen``) at 4x within 0.02 of the control's mean
  accuracy over the families, at 8x within 0.05 (other targets: the gap is reported, no bar);
- ``selector_ahead_of_static_and_random``: its mean above both the static and the random configuration's at the same
  target and split (where the table has them);
- ``composed_32x_niah_vt``: a composition with eviction (``kaizen+kvpop``, ``kaizen+snapkv``) at 32x keeps >= 0.90 of
  the control on ``niah`` and ``vt``; ``composed_64x_every_family``: at 64x >= 0.85 of it on every family;
- ``heldout_within_eval`` (one row per group, both splits): a learned configuration's mean on the held-out split within
  0.03 of its mean on the eval split.

A group missing one of the control's families is ``incomplete`` and never ``met``. The summary lists, per criterion,
the groups that meet it and those that do not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.results import command_line, make_results, read_results, write_results  # noqa: E402

SELECTOR_BARS = {4.0: 0.02, 8.0: 0.05}  # target -> the largest allowed gap to the control's mean
COMPOSED_BARS = {32.0: (0.90, ("niah", "vt")), 64.0: (0.85, None)}  # target -> (ratio, families; None = every family)
HELDOUT_BAR = 0.03
LEARNED = ("kaizen", "kaizen+kvpop")
COMPOSED = ("kaizen+kvpop", "kaizen+snapkv")


def label(row: dict) -> str:
    return row.get("selector") or row.get("series") or ""


def accuracy_by_group(rows: list[dict]) -> dict:
    """``{(method, label, target): {split: {task: accuracy}}}``; the control's rows under ``("control", "", None)``."""
    groups: dict = {}
    for r in rows:
        target = None if r["method"] == "control" else r.get("target")
        key = (r["method"], label(r), None if target is None else float(target))
        groups.setdefault(key, {}).setdefault(r.get("split", "eval"), {})[r["task"]] = r["accuracy"]
    return groups


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def evaluate(table: dict) -> tuple[list[dict], dict]:
    """The acceptance rows and their summary for the accuracy rows of ``table``."""
    groups = accuracy_by_group(table["rows"])
    control = groups.get(("control", "", None))
    check(control is not None, "the table has no control rows (method 'control'): nothing to compare with")
    out = []

    def base(method, name, target, split, accs):
        families = control.get(split, {})
        missing = sorted(set(families) - set(accs))
        return dict(method=method, label=name, target=target, split=split,
                    accuracy={t: accs[t] for t in families if t in accs},
                    control={t: families[t] for t in families}, incomplete=bool(missing), missing=missing)

    for (method, name, target), splits in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        for split, accs in sorted(splits.items()):
            if split not in control:
                continue
            row = base(method, name, target, split, accs)
            if method == "kaizen":
                gap = mean(row["control"].values()) - mean(row["accuracy"].values()) if row["accuracy"] else None
                bar = SELECTOR_BARS.get(target)
                out.append({**row, "criterion": "selector_within_control", "mean": _mean_or_none(row["accuracy"]),
                            "control_mean": mean(row["control"].values()), "gap_to_control": gap, "bar": bar,
                            "met": None if bar is None else (not row["incomplete"] and gap <= bar + 1e-9)})
                others = {m: groups.get((m, "", target), {}).get(split) for m in ("static", "random")}
                others = {m: a for m, a in others.items() if a and set(a) >= set(row["control"])}
                if others and not row["incomplete"]:
                    own = mean(row["accuracy"].values())
                    other_means = {m: mean(a[t] for t in row["control"]) for m, a in others.items()}
                    out.append({**row, "criterion": "selector_ahead_of_static_and_random", "mean": own,
                                "baseline_means": other_means, "met": all(own > v for v in other_means.values())})
            if method in COMPOSED and target in COMPOSED_BARS:
                bar, families = COMPOSED_BARS[target]
                families = families or tuple(row["control"])
                ratios = {t: row["accuracy"][t] / row["control"][t] for t in families
                          if t in row["accuracy"] and row["control"].get(t)}
                complete = not row["incomplete"] and len(ratios) == len(families)
                own = _mean_or_none(row["accuracy"])
                out.append({**row, "criterion": "composed_32x_niah_vt" if target == 32.0 else "composed_64x_every_family",
                            "mean": own, "control_mean": mean(row["control"].values()),
                            "mean_over_control": None if own is None else own / mean(row["control"].values()),
                            "ratio_to_control": ratios, "min_ratio": min(ratios.values()) if ratios else None,
                            "bar": bar, "met": complete and min(ratios.values()) >= bar - 1e-9})
        if method in LEARNED and {"eval", "heldout"} <= set(splits):
            ev, ho = splits["eval"], splits["heldout"]
            families = [t for t in control.get("eval", {}) if t in ev and t in ho]
            complete = len(families) == len(control.get("eval", {}))
            diff = mean(ho[t] for t in families) - mean(ev[t] for t in families) if families else None
            out.append(dict(method=method, label=name, target=target, split="eval+heldout", criterion="heldout_within_eval",
                            eval_mean=_mean_or_none({t: ev[t] for t in families}),
                            heldout_mean=_mean_or_none({t: ho[t] for t in families}), heldout_minus_eval=diff,
                            per_family={t: ho[t] - ev[t] for t in families}, bar=HELDOUT_BAR, incomplete=not complete,
                            met=complete and abs(diff) <= HELDOUT_BAR + 1e-9))
    summary: dict = {}
    for r in out:
        if r.get("met") is None:
            continue
        name = f"{r['method']}[{r['label']}]@{r['target']:g}x" + ("" if r["split"] == "eval+heldout" else f"/{r['split']}")
        summary.setdefault(r["criterion"], {"met": [], "not_met": []})["met" if r["met"] else "not_met"].append(name)
    return out, summary


def _mean_or_none(accs: dict):
    return mean(accs.values()) if accs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", default=str(REPO / "results" / "kaizen_table.json"))
    ap.add_argument("--out", default=str(REPO / "results" / "kaizen_acceptance.json"))
    args = ap.parse_args(argv)
    try:
        check(Path(args.table).is_file(), f"--table={args.table!r} is not a file: expected a KV-Kaizen accuracy table")
        table = read_results(args.table)
        check(table.get("kind") == "accuracy",
              f"--table={args.table!r} has kind {table.get('kind')!r}: expected an accuracy table")
        rows, summary = evaluate(table)
    except (KVLearnError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = make_results("acceptance", rows, device="cpu", command=command_line(),
                           table=Path(args.table).name, table_commit=table.get("commit"), summary=summary)
    results["device"] = f"none (read off {Path(args.table).name}; each of its rows names the device it ran on)"
    write_results(args.out, results)
    for criterion, s in summary.items():
        print(f"{criterion}: met by {len(s['met'])}, not by {len(s['not_met'])}")
        for name in s["met"]:
            print(f"  met      {name}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
