"""Does a budget-conditioned KV-Kaizen selector follow its target? (issue #11 item 9: "one budget-conditioned
selector over {1, 2, 4}").

For a ``kvlearn kaizen-train`` folder trained with several targets (``--target 1,2,4``), run only the selector (no
generation) on ``--n-per-task`` prompts of every family at each ``--targets`` value and record the configuration it
chooses (what evaluation runs: the argmax, projected onto the budget when it lies over it), its realised factor
``C_ref / C`` (no metadata, as ``kvlearn eval`` reports it), how many distinct configurations it returns, and the raw
argmax's factor (``argmax_factor``, before the projection). A selector whose conditioning learned nothing has the
same argmax at every target (the projection then does all the work); one that follows its budget has
``argmax_factor`` near each target.

    PYTHONPATH=src python benchmarks/kaizen_conditioning.py --model runs/kaizen-t1_2_4/final --targets 1,2,4 \\
        --n-per-task 10 --out results/raw/kaizen_conditioning_<name>.json

writes ``kvlearn.results.v1`` rows (kind ``kaizen_conditioning``): one per target and family with ``factor`` (mean),
``factor_min``, ``factor_max``, ``argmax_factor`` (mean; ``argmax_factor_min``, ``argmax_factor_max``),
``projected`` (the prompts whose argmax lay over the budget), ``distinct_configurations`` and ``configurations``
(configuration -> count), and a
summary line per target. CPU is enough (the selector is a two-block transformer over the prompt).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.results import command_line, make_results, write_results  # noqa: E402
from kvlearn.testbed import tasks as testbed_tasks  # noqa: E402


def conditioning_rows(model, targets, families, n_per_task: int, context: int, split: str = "eval") -> list[dict]:
    """One row per (target, family): the selector's evaluation choice and raw argmax on ``n_per_task`` prompts of
    ``split``."""
    from kvlearn.kaizen.apply import select, selector_of

    prompts = {family: [torch.tensor([testbed_tasks.generate(family, testbed_tasks.example_seed(family, split, i),
                                                             context).prompt_ids]) for i in range(n_per_task)]
               for family in families}  # generated once, read at every target
    rows = []
    for target in targets:
        for family in families:
            chosen = [select(model, ids, target=target) for ids in prompts[family]]
            configs = [c[0][0] for c in chosen]
            raw = [selector_of(model).configs(logits.argmax(-1))[0] for _, logits in chosen]
            factors = [c.compression(metadata=False) for c in configs]
            raw_factors = [c.compression(metadata=False) for c in raw]
            counts = Counter(str(c) for c in configs)
            rows.append({"target": target, "task": family, "split": split, "context": context, "n": n_per_task,
                         "factor": sum(factors) / len(factors), "factor_min": min(factors),
                         "factor_max": max(factors), "argmax_factor": sum(raw_factors) / len(raw_factors),
                         "argmax_factor_min": min(raw_factors), "argmax_factor_max": max(raw_factors),
                         "projected": sum(str(a) != str(b) for a, b in zip(configs, raw)),
                         "distinct_configurations": len(counts),
                         "configurations": dict(counts.most_common())})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a kvlearn kaizen-train folder (its final/ or a step-<N>/)")
    ap.add_argument("--targets", default="1,2,4", help="comma list of target factors to condition on")
    ap.add_argument("--tasks", default="all", help="comma list of families or 'all'")
    ap.add_argument("--n-per-task", type=int, default=10)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--split", default="eval", choices=testbed_tasks.SPLITS)
    ap.add_argument("--out", required=True, help="results file")
    args = ap.parse_args(argv)
    try:
        import kvlearn
        from kvlearn.cli import parse_targets

        targets = parse_targets(args.targets, "--targets")
        families = testbed_tasks.FAMILIES if args.tasks == "all" else tuple(args.tasks.split(","))
        for f in families:
            check(f in testbed_tasks.FAMILIES, f"--tasks: unknown family {f!r}: expected one of "
                                               f"{', '.join(testbed_tasks.FAMILIES)}")
        check(args.n_per_task >= 1, f"--n-per-task {args.n_per_task} is invalid: expected >= 1")
        start = time.time()
        model = kvlearn.load(args.model).eval()
        rows = conditioning_rows(model, targets, families, args.n_per_task, args.context, args.split)
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_results(args.out, make_results("kaizen_conditioning", rows, device="cpu", command=command_line(),
                                         model=args.model, wall_seconds=round(time.time() - start, 1)))
    for t in targets:
        mine = [r for r in rows if r["target"] == t]
        configs = Counter()
        for r in mine:
            configs.update(r["configurations"])
        print(f"target {t:g}: factor {sum(r['factor'] for r in mine) / len(mine):.2f}, argmax "
              f"{sum(r['argmax_factor'] for r in mine) / len(mine):.2f}, projected {sum(r['projected'] for r in mine)} "
              f"({len(configs)} distinct: {', '.join(f'{c} x{k}' for c, k in configs.most_common(3))})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
