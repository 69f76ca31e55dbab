"""Measured properties of the testbed: oracle token counts, window-cache coverage, generation speed.

``python -m kvlearn.testbed.stats [--length 4096] [--n 200] [--out results/testbed_stats.json]`` prints the
markdown tables quoted in ``docs/TESTBED.md`` and writes them as a results file: one row per split (``eval``,
``heldout``), family and variant, with the window cache's loss broken down by haystack style and depth regime.
"""

from __future__ import annotations

import argparse
import statistics

from .data import measure_throughput
from .tasks import FAMILIES, VARIANTS, example_seed, generate, informative_positions, needed_positions


def oracle_rows(length: int = 4096, n: int = 200, sinks: int = 4, window_budget: int = 1024,
                splits=("eval", "heldout")) -> list[dict]:
    """Per split/family/variant over ``n`` examples: needed / informative prompt tokens (mean, max), answer
    length (mean, max), and how a sinks + recent-window cache of ``window_budget`` tokens fares: the mean
    fraction of needed item tokens it loses and the fraction of examples where it keeps them all, overall and
    per haystack style and depth regime (``window_lost_by_style``, ``window_lost_by_regime``)."""
    rows = []
    for split, family in ((s, f) for s in splits for f in FAMILIES):
        for variant in VARIANTS[family]:
            need, info, ans, lost, kept_all = [], [], [], [], 0
            by_style: dict[str, list[float]] = {}
            by_regime: dict[str, list[float]] = {}
            for i in range(n):
                e = generate(family, example_seed(family, split, i), length, variant)
                positions = needed_positions(e)
                need.append(len(positions))
                info.append(len(informative_positions(e)))
                ans.append(len(e.answer_ids))
                question_start = e.needed_spans[-1][0]
                items = [p for p in positions if 0 < p < question_start]
                kept = [p for p in items if p < sinks or p >= length - (window_budget - sinks)]
                lost.append(1 - len(kept) / len(items))
                kept_all += len(kept) == len(items)
                by_style.setdefault(e.style, []).append(lost[-1])
                by_regime.setdefault(e.regime, []).append(lost[-1])
            rows.append(
                {
                    "split": split,
                    "family": family,
                    "variant": variant,
                    "needed_mean": statistics.mean(need),
                    "needed_max": max(need),
                    "informative_mean": statistics.mean(info),
                    "informative_max": max(info),
                    "answer_mean": statistics.mean(ans),
                    "answer_max": max(ans),
                    "window_lost": statistics.mean(lost),
                    "window_keeps_all": kept_all / n,
                    "window_lost_by_style": {k: round(statistics.mean(v), 4) for k, v in sorted(by_style.items())},
                    "window_lost_by_regime": {k: round(statistics.mean(v), 4) for k, v in sorted(by_regime.items())},
                }
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--out", default=None, help="also write a kvlearn.results.v1 file (kind 'testbed')")
    args = parser.parse_args(argv)
    print(f"length {args.length}, {args.n} eval examples per row; window cache = 4 sinks + {1024 - 4} recent tokens\n")
    print("| split | family | variant | needed tokens mean / max | informative mean / max | answer tokens mean / max "
          "| window loses (mean share of needed items) | window keeps all |")
    print("|---|---|---|---|---|---|---|---|")
    rows = oracle_rows(args.length, args.n)
    for r in rows:
        print(
            f"| {r['split']} | {r['family']} | {r['variant']} | {r['needed_mean']:.0f} / {r['needed_max']} "
            f"| {r['informative_mean']:.0f} / {r['informative_max']} | {r['answer_mean']:.0f} / {r['answer_max']} "
            f"| {r['window_lost']:.2f} | {r['window_keeps_all']:.2f} |"
        )
    t = measure_throughput(length=args.length, batch_size=16, n_batches=16)
    print(f"\ntraining_batch throughput, one process, length {args.length}: {t['tokens_per_s']:,} tokens/s "
          f"({t['ms_per_example']} ms per example)")
    if args.out:
        from ..results import make_results, write_results

        results = make_results("testbed", rows, device="cpu", context=args.length, n_per_row=args.n,
                               window_cache={"sinks": 4, "budget": 1024}, throughput=t)
        print(f"wrote {write_results(args.out, results)}")


if __name__ == "__main__":
    main()
