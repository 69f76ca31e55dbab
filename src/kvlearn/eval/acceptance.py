"""The accuracy acceptance of the KVpop and KV-Kaizen issues, read off their committed tables (no model is run).

    python -m kvlearn.eval.acceptance kvpop    # results/kvpop_table.json  -> results/kvpop_acceptance.json
    python -m kvlearn.eval.acceptance kaizen   # results/kaizen_table.json -> results/kaizen_acceptance.json
    python -m kvlearn.eval.acceptance kaizen --table T --out O

Every row is one verdict: a ``criterion``, the group it is about (``method``, its ``selector`` / ``series``
``label``, ``target`` or ``budget``), the ``split``, the number the bar applies to (``value``, named by
``value_name``), the ``bar`` and ``met``. A group missing one of the reference's families is ``incomplete`` and never
``met``. The summary lists, per criterion, the groups that meet it and those that do not. Means are over the task
families of the reference row set (the control or teacher) on that split.

KVpop (``kvpop``: the mLSTM student; ``kvpop_mlp`` gets the same verdicts, for comparison), against the teacher
(``dense``, or ``teacher`` as the reproduction names it) of the same split, under the ``bounded`` protocol:

- ``of_teacher``: mean over the teacher's mean, at CR 75% (budget = context / 4) >= 0.95 and at CR 88% (context / 8)
  >= 0.93 on the eval split; at CR 88% >= 0.90 on the held-out split; other budgets and splits, and every other
  method and protocol (the baselines' rows, for the tables): the fraction, no bar;
- ``ahead_of_baselines`` (eval split, CR 88% and 94%): its mean above every other method's at the same budget: every
  training-free baseline under its better protocol (``bounded`` or ``context``), ``streaming_plus`` and ``dms``.

KV-Kaizen, against the control (``control``) of the same split:

- ``selector_within_control``: a learned selector (``kaizen``) at 4x within 0.02 of the control's mean, at 8x within
  0.05 (other targets: the gap, no bar);
- ``selector_ahead_of_static_and_random``: its mean above the static and the random configuration's at the same
  target and split;
- ``composed_32x_niah_vt``: a composition with eviction (``kaizen+kvpop``, ``kaizen+snapkv``) at 32x keeps >= 0.90 of
  the control on ``niah`` and ``vt``; ``composed_64x_every_family``: at 64x >= 0.85 on every family;
- ``heldout_within_eval`` (one row per learned group, both splits): its held-out mean within 0.03 of its eval mean;
  the row also gives the difference's binomial ``standard_error`` (:func:`difference_se`) and ``z``, how much of it
  sampling alone explains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import KVLearnError, check
from ..results import FULL_CACHE_LABELS, command_line, make_results, read_results, repo_root, write_results

EPS = 1e-9  # accuracies are multiples of 1 / n: a bar met exactly is met
SELECTOR_BARS = {4.0: 0.02, 8.0: 0.05}  # target -> the largest allowed gap to the control's mean
COMPOSED_BARS = {32.0: (0.90, ("niah", "vt")), 64.0: (0.85, None)}  # target -> (ratio, families; None = every one)
HELDOUT_BAR = 0.03
KVPOP_METHODS = ("kvpop", "kvpop_mlp")
TRAINED_BASELINES = ("streaming_plus", "dms")
KVPOP_BARS = {(4, "eval"): 0.95, (8, "eval"): 0.93, (8, "heldout"): 0.90}  # (context / budget, split) -> of teacher


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _label(row: dict) -> str:
    return row.get("selector") or row.get("series") or ""


def _verdict(criterion: str, method: str, label: str, split: str, value, value_name: str, bar, met, **fields) -> dict:
    return dict(criterion=criterion, method=method, label=label, split=split, value=value, value_name=value_name,
                bar=bar, met=met, **fields)


def _families(accs: dict, reference: dict) -> tuple[dict, list]:
    """``accs`` restricted to the reference's families, and the families it lacks."""
    return {t: accs[t] for t in reference if t in accs}, sorted(set(reference) - set(accs))


def summarise(rows: list[dict]) -> dict:
    summary: dict = {}
    for r in rows:
        if r.get("met") is None:
            continue
        where = f"@{r['target']:g}x" if r.get("target") is not None else f"@{r['budget']}"
        name = f"{r['method']}[{r['label']}]{where}" + ("" if r["split"] == "eval+heldout" else f"/{r['split']}")
        summary.setdefault(r["criterion"], {"met": [], "not_met": []})["met" if r["met"] else "not_met"].append(name)
    return summary


def difference_se(first: list[tuple], second: list[tuple]):
    """Binomial standard error of ``mean(second) - mean(first)``, each a mean over families of ``(accuracy, n)``
    pairs sampled independently: ``sqrt(sum p(1-p)/n) / F`` per mean, combined in quadrature. None when an ``n`` is
    missing or there are no families. How far a held-out gap may stray by sampling alone: at n = 100 per family and
    accuracies near 0.9 it is about 0.02, so a 0.03 band is about 1.4 standard errors wide."""
    if not first or not second or any(not n for _, n in (*first, *second)):
        return None
    var = sum(p * (1 - p) / n for p, n in first) / len(first) ** 2 + sum(p * (1 - p) / n for p, n in second) / len(second) ** 2
    return var ** 0.5


# ---- KV-Kaizen ----------------------------------------------------------------------------------------------------
def kaizen_acceptance(table: dict) -> list[dict]:
    """The KV-Kaizen verdicts of an accuracy table holding ``control`` rows."""
    groups: dict = {}  # (method, label, target) -> split -> task -> accuracy
    counts: dict = {}  # the same keys -> examples behind each accuracy
    for r in table["rows"]:
        target = None if r["method"] == "control" or r.get("target") is None else float(r["target"])
        key, split = (r["method"], _label(r), target), r.get("split", "eval")
        groups.setdefault(key, {}).setdefault(split, {})[r["task"]] = r["accuracy"]
        counts.setdefault(key, {}).setdefault(split, {})[r["task"]] = r.get("n")
    control = groups.get(("control", "", None))
    check(control is not None, "the table has no control rows (method 'control'): nothing to compare with")
    out = []
    for (method, label, target), splits in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        for split, raw in sorted(splits.items()):
            if split not in control or method == "control":
                continue
            ref = control[split]
            accs, missing = _families(raw, ref)
            common = dict(target=target, accuracy=accs, reference=ref, incomplete=bool(missing), missing=missing)
            own = mean(accs.values()) if accs else None
            if method == "kaizen":
                gap = None if own is None else mean(ref.values()) - own
                bar = SELECTOR_BARS.get(target)
                out.append(_verdict("selector_within_control", method, label, split, gap, "control mean - mean", bar,
                                    None if bar is None else (not missing and gap <= bar + EPS), mean=own,
                                    reference_mean=mean(ref.values()),
                                    of_control=None if own is None else own / mean(ref.values()), **common))
                others = {m: groups.get((m, "", target), {}).get(split) for m in ("static", "random")}
                others = {m: mean(a[t] for t in ref) for m, a in others.items() if a and set(a) >= set(ref)}
                if others and not missing:
                    out.append(_verdict("selector_ahead_of_static_and_random", method, label, split, own, "mean", None,
                                        all(own > v + EPS for v in others.values()), baseline_means=others, **common))
            if method in ("kaizen+kvpop", "kaizen+snapkv") and target in COMPOSED_BARS:
                bar, families = COMPOSED_BARS[target]
                families = families or tuple(ref)
                ratios = {t: accs[t] / ref[t] for t in families if t in accs and ref.get(t)}
                complete = not missing and len(ratios) == len(families)
                low = min(ratios.values()) if ratios else None
                out.append(_verdict("composed_32x_niah_vt" if target == 32.0 else "composed_64x_every_family", method,
                                    label, split, low, "lowest accuracy / control's", bar,
                                    complete and low >= bar - EPS, ratio_to_control=ratios, mean=own,
                                    mean_over_control=None if own is None else own / mean(ref.values()), **common))
        if method in ("kaizen", "kaizen+kvpop") and {"eval", "heldout"} <= set(splits):
            ev, ho, ref = splits["eval"], splits["heldout"], control.get("eval", {})
            families = [t for t in ref if t in ev and t in ho]
            diff = mean(ho[t] for t in families) - mean(ev[t] for t in families) if families else None
            complete = len(families) == len(ref)
            n = counts[(method, label, target)]
            se = difference_se([(ev[t], n["eval"][t]) for t in families], [(ho[t], n["heldout"][t]) for t in families])
            out.append(_verdict("heldout_within_eval", method, label, "eval+heldout", diff, "heldout mean - eval mean",
                                HELDOUT_BAR, complete and abs(diff) <= HELDOUT_BAR + EPS, target=target,
                                eval_mean=mean(ev[t] for t in families) if families else None,
                                heldout_mean=mean(ho[t] for t in families) if families else None,
                                per_family={t: ho[t] - ev[t] for t in families}, incomplete=not complete,
                                standard_error=se, z=None if not se or diff is None else diff / se))
    return out


# ---- KVpop ----------------------------------------------------------------------------------------------------------
def kvpop_acceptance(table: dict) -> list[dict]:
    """The KVpop verdicts of an accuracy table holding the teacher's rows (method ``dense``, or ``teacher`` as
    ``benchmarks/kvpop_table.py`` and so ``kvlearn reproduce kvpop`` name them: :data:`FULL_CACHE_LABELS`)."""
    context = table.get("context") or 4096
    groups: dict = {}  # (method, protocol, budget) -> split -> task -> accuracy; the teacher's rows under "dense"
    for r in table["rows"]:
        full = r["method"] in FULL_CACHE_LABELS
        key = ("dense" if full else r["method"], r.get("protocol", "bounded"), None if full else r.get("budget"))
        groups.setdefault(key, {}).setdefault(r.get("split", "eval"), {})[r["task"]] = r["accuracy"]
    teacher = groups.get(("dense", "bounded", None))
    check(teacher is not None, "the table has no teacher rows (method 'dense' or 'teacher', bounded): nothing to "
                               "compare with")
    out = []
    for (method, protocol, budget), splits in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        if method == "dense":
            continue
        ratio_key = context // budget if budget and context % budget == 0 else None
        judged = method in KVPOP_METHODS and protocol == "bounded"  # every other row: its fraction, no bar
        for split, raw in sorted(splits.items()):
            if split not in teacher:
                continue
            ref = teacher[split]
            accs, missing = _families(raw, ref)
            own = mean(accs.values()) if accs else None
            common = dict(budget=budget, protocol=protocol, compression=1 - budget / context, accuracy=accs,
                          reference=ref, incomplete=bool(missing), missing=missing)
            of_teacher = None if own is None else own / mean(ref.values())
            bar = KVPOP_BARS.get((ratio_key, split)) if judged else None
            out.append(_verdict("of_teacher", method, "", split, of_teacher, "mean / teacher's mean", bar,
                                None if bar is None else (not missing and of_teacher >= bar - EPS), mean=own,
                                reference_mean=mean(ref.values()), **common))
            if not judged or split != "eval" or ratio_key not in (8, 16) or missing:
                continue
            rivals: dict = {}  # method -> its best mean over protocols at this budget
            for (m, p, b), sp in groups.items():
                if b != budget or m in KVPOP_METHODS or m == "dense" or "eval" not in sp:
                    continue
                if m in TRAINED_BASELINES and p != "bounded":
                    continue
                theirs, lacking = _families(sp["eval"], ref)
                if not lacking:
                    rivals[m] = max(rivals.get(m, 0.0), mean(theirs.values()))
            best = max(rivals.values()) if rivals else None
            out.append(_verdict("ahead_of_baselines", method, "", split, own, "mean", None,
                                bool(rivals) and all(own > v + EPS for v in rivals.values()),
                                rival_means=rivals, best_rival=max(rivals, key=rivals.get) if rivals else None,
                                best_rival_mean=best, **common))
    return out


ISSUES = {"kvpop": (kvpop_acceptance, "kvpop_table.json", "kvpop_acceptance.json"),
          "kaizen": (kaizen_acceptance, "kaizen_table.json", "kaizen_acceptance.json")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("issue", help="kvpop or kaizen")
    ap.add_argument("--table", default=None, help="default results/<issue>_table.json")
    ap.add_argument("--out", default=None, help="default results/<issue>_acceptance.json")
    args = ap.parse_args(argv)
    try:
        check(args.issue in ISSUES, f"issue={args.issue!r} is unknown: expected one of {', '.join(ISSUES)}")
        fn, table_name, out_name = ISSUES[args.issue]
        table_path = Path(args.table or repo_root() / "results" / table_name)
        check(table_path.is_file(), f"--table={str(table_path)!r} is not a file: expected an accuracy table")
        try:
            table = read_results(table_path)
        except ValueError as e:
            raise KVLearnError(str(e)) from None
        check(table.get("kind") == "accuracy",
              f"--table={str(table_path)!r} has kind {table.get('kind')!r}: expected an accuracy table")
        rows = fn(table)
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarise(rows)
    results = make_results("acceptance", rows, device="cpu", command=command_line(), table=table_path.name,
                           table_commit=table.get("commit"), summary=summary)
    results["device"] = f"none (read off {table_path.name}; each of its rows names the run it came from)"
    out = write_results(args.out or repo_root() / "results" / out_name, results)
    for criterion, s in summary.items():
        print(f"{criterion}: met by {len(s['met'])}, not by {len(s['not_met'])}")
        for name in s["met"]:
            print(f"  met      {name}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
