"""The KVpop paper's Table 1 on the testbed: the teacher, every training-free eviction method and the retrofitted
students (KVpop with the MLP and the mLSTM scorer, StreamingLLM+, DMS) at budgets 1024, 512 and 256 (CR 75%, 88%,
94% at context 4096), every family, both splits, under the ``bounded`` protocol (``context`` too with
``--protocols all``).

On the device (H200, bf16), after the retrofits (``benchmarks/device/retrofit.sh``):

    PYTHONPATH=src python benchmarks/kvpop_table.py \\
        --student kvpop_mlp=kvpop:runs/kvpop-mlp --student kvpop=kvpop:runs/kvpop-mlstm \\
        --student streaming_plus=streaming_plus:runs/streaming-plus --student dms=dms:runs/dms \\
        --n-per-task 100 --minutes 9 --out results/kvpop_table.json

writes ``results/kvpop_table.json`` (schema ``kvlearn.results.v1``, kind ``accuracy``; every row has ``method`` =
the row's label, ``registry_method`` = the cache method it ran, ``model``, ``protocol``, ``split``, ``budget``,
``compression``, ``kv_bytes``) and ``results/kvpop_table.png`` (mean accuracy against compression, one line per
label). ``--student LABEL=METHOD:PATH`` adds a trained checkpoint evaluated with registered method ``METHOD``; a
student trained at one budget is evaluated at every budget of ``--budgets`` (its top-k follows the budget). Runs
go in priority order (the teacher; then per budget from the tightest, the students, then the baselines), the
file is written before the first run and rewritten after every run with every run not done yet under ``not_run``
(a process killed mid-way leaves a file that says ``complete: false``), and ``--minutes`` stops cleanly as in
``eviction_baselines.py``. A student's runs at a budget its trained options cannot take (e.g. below sinks + window
+ 1) are listed under ``skipped`` with the reason; a student with no valid budget at all is an error. As in the
paper's Table 1, a KVpop student's recurrent state (mLSTM) counts toward its budget: its cache keeps that many
fewer long-range tokens (``KVpopConfig.state_in_budget``), so its ``kv_bytes`` match the MLP scorer's;
``--state-in-budget 0`` gives those slots back (an ablation: what the state's share of the budget costs).

``--smoke`` runs the same code on the CPU in about a minute: a tiny random Qwen3 as the teacher and as an
untrained KVpop "student", context 256, budgets 96 and 48, 2 examples of niah and vt, into ``runs/smoke/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from eviction_baselines import (parse_budgets, parse_list, add_run_options, print_summary, recorded_command,  # noqa: E402
                                repo_relative, smoke_settings, tiny_model)

from kvlearn.checkpoint import serving_dtype  # noqa: E402
from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.eval.accuracy import EvalConfig, eval_splits, evaluate, tasks_not_started  # noqa: E402
from kvlearn.methods import EVICTION_METHODS, PROTOCOLS, get_method, trained_options  # noqa: E402
from kvlearn.results import make_results, run_key, settle_run, write_results  # noqa: E402


def parse_student(text: str) -> tuple[str, str, str]:
    """``LABEL=METHOD:PATH`` -> ``(label, method, path)``; one-line error otherwise."""
    label, _, rest = text.partition("=")
    method, _, path = rest.partition(":")
    check(label and method and path, f"--student {text!r}: expected LABEL=METHOD:PATH, e.g. kvpop=kvpop:runs/kvpop/final")
    get_method(method)  # one-line error for an unknown method
    return label, method, path


def plan_runs(args, students: list[tuple[str, str, str]]
              ) -> tuple[list[tuple[str, str, str | None, EvalConfig]], dict[str, str]]:
    """``[(label, registry method, model path or None = the teacher, config)]`` in priority order, and ``{run: why
    skipped}`` for a student's runs at a budget its trained options cannot take (e.g. below sinks + window + 1); a
    student with no valid run at all is a one-line error."""
    protocols = parse_list(args.protocols, PROTOCOLS, "--protocols")
    splits = parse_list(args.splits, eval_splits(), "--splits")
    baselines = parse_list(args.baselines, EVICTION_METHODS, "--baselines") if args.baselines != "none" else ()
    budgets = sorted(parse_budgets(args.budgets))  # tightest first: it separates the methods
    common = dict(tasks=tuple(args.tasks.split(",")) if args.tasks != "all" else EvalConfig().tasks,
                  n_per_task=args.n_per_task, context=args.context, batch_size=args.batch_size,
                  chunk_size=args.chunk_size, sinks=args.sinks)
    # each student under the pattern it was trained for; a KVpop student's recurrent state (mLSTM) counts toward
    # its budget, as in the paper's Table 1 (KVpopConfig.state_in_budget; no effect for a stateless scorer)
    # (--state-in-budget 0: the ablation that gives the state's slots back to the top-k)
    state_rule = {"state_in_budget": getattr(args, "state_in_budget", "1") == "1"}
    options = {label: {**trained_options(method, path), **(state_rule if method == "kvpop" else {})}
               or None for label, method, path in students}
    runs = [] if getattr(args, "no_teacher", False) else [
        ("teacher", "dense", None, EvalConfig(method="dense", split=s, protocol=protocols[0], **common)) for s in splits]
    skipped: dict[str, str] = {}
    for budget in budgets:
        for split in splits:
            for p in protocols:
                for label, method, path in students:  # each under the pattern it was trained for (its window, scorer)
                    if p in get_method(method).protocols:
                        try:
                            config = EvalConfig(method=method, budget=budget, split=split, protocol=p,
                                                options=options[label], **common)
                        except KVLearnError as e:
                            what = argparse.Namespace(method=method, budget=budget, split=split, protocol=p)
                            skipped[describe(label, what)] = str(e)
                            continue
                        runs.append((label, method, path, config))
                for m in baselines:
                    if p in get_method(m).protocols:
                        runs.append((m, m, None, EvalConfig(method=m, budget=budget, split=split, protocol=p, **common)))
    check_students_run(students, runs, skipped, args.budgets)
    return runs, skipped


def check_students_run(students, runs, skipped: dict[str, str], budgets: str) -> None:
    """A one-line error for a student none of whose planned runs is valid (with the largest budget's reason)."""
    for label, method, path in students:
        reasons = [why for what, why in skipped.items() if what.startswith(f"{label}/")]
        if reasons:
            check(any(r[:3] == (label, method, path) for r in runs),
                  f"--student {label}={method}: no budget of --budgets {budgets} is valid for it: {reasons[-1]}")


def describe(label: str, c) -> str:
    """``label/protocol/split[/B=budget]`` of an :class:`EvalConfig` (or anything with those fields and ``method``)."""
    return run_key(label, c.protocol, c.split, None if c.method == "dense" else c.budget)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "checkpoints" / "testbed-teacher"), help="the teacher's checkpoint folder")
    ap.add_argument("--student", action="append", default=[], metavar="LABEL=METHOD:PATH",
                    help="a trained checkpoint and the registered method it runs with (repeat the option)")
    ap.add_argument("--baselines", default="all", help=f"comma list of {','.join(EVICTION_METHODS)}, 'all' or 'none'")
    ap.add_argument("--budgets", default="1024,512,256", help="comma list of budgets (tokens per KV head)")
    ap.add_argument("--state-in-budget", default="1", choices=("0", "1"),
                    help="1: a KVpop student's recurrent state takes its bytes' worth of top-k slots (Table 1's rule); "
                         "0: it does not (an ablation)")
    ap.add_argument("--no-teacher", action="store_true",
                    help="skip the teacher's rows (when parallel parts of one table share them out)")
    ap.add_argument("--protocols", default="bounded", help=f"comma list of {','.join(PROTOCOLS)} or 'all'")
    ap.add_argument("--splits", default="all", help=f"comma list of {','.join(eval_splits())} or 'all'")
    add_run_options(ap)
    ap.add_argument("--out", default=None, help="results file (default: results/kvpop_table.json, "
                                                "runs/smoke/kvpop_table.json with --smoke)")
    ap.add_argument("--plot", default=None, help="plot (default: next to --out, kvpop_table.png)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random models, context 256, budgets 96,48, n 2")
    args = ap.parse_args(argv)
    if args.smoke:
        smoke_settings(args)
        args.baselines = "streaming,tova" if args.baselines == "all" else args.baselines
        args.student = args.student or ["kvpop_untrained=kvpop:smoke"]
    out = Path(args.out or ("runs/smoke/kvpop_table.json" if args.smoke else "results/kvpop_table.json"))
    plot = Path(args.plot or out.with_name("kvpop_table.png"))
    try:
        students = [parse_student(s) for s in args.student]
        check(len({s[0] for s in students}) == len(students), f"--student labels repeat: {[s[0] for s in students]}")
        runs, skipped = plan_runs(args, students)
    except KVLearnError as e:
        print(f"kvpop_table: error: {e}", file=sys.stderr)
        return 2
    for what, why in skipped.items():
        print(f"skipped {what}: {why}")

    start = time.monotonic()
    deadline = start + 60 * args.minutes
    dtype = serving_dtype(args.device)
    models: dict[str | None, torch.nn.Module] = {}

    def model_for(path: str | None):
        if path not in models:
            models.clear()  # one model in memory at a time (runs are grouped by budget, not by model)
            if args.smoke:
                models[path] = tiny_model()
            else:
                from kvlearn import load

                models[path] = load(path or args.model, dtype=dtype, device=args.device)
        return models[path]

    rows: list[dict] = []
    command = recorded_command(argv).replace("benchmarks/eviction_baselines.py", "benchmarks/kvpop_table.py")

    def save(not_run: list[str]) -> None:
        """Write the file as it stands; ``not_run``: every planned run not done yet (complete only when empty)."""
        results = make_results("accuracy", rows, device=args.device, command=command,
                               model="tiny random Qwen3 (--smoke)" if args.smoke else repo_relative(args.model),
                               students={label: f"{method}:{repo_relative(path)}" for label, method, path in students},
                               context=args.context, dtype=str(dtype).replace("torch.", ""), n_per_task=args.n_per_task,
                               wall_seconds=round(time.monotonic() - start, 1), skipped=skipped, not_run=not_run,
                               complete=not not_run and not any(r.get("incomplete") for r in rows))
        write_results(out, results)

    not_run = [describe(label, c) for label, _, _, c in runs]  # a process killed mid-way leaves an honest file
    save(not_run)
    total = sum(len(c.tasks) * c.n_per_task for *_, c in runs)
    bar = tqdm(total=total, desc="table", unit="ex", mininterval=0.1 if sys.stderr.isatty() else 20.0)
    for label, method, path, config in runs:
        if time.monotonic() >= deadline:
            print(f"time guard ({args.minutes} min): {len(not_run)} run(s) not started", flush=True)
            break
        bar.set_description(describe(label, config))
        new = evaluate(model_for(path), config, progress=False, deadline=deadline, bar=bar)
        for r in new:
            r["registry_method"], r["method"] = r["method"], label
            r["model"] = "teacher" if path is None else repo_relative(path)
        rows += new
        not_run = settle_run(not_run, describe(label, config), tasks_not_started(config, new))
        save(not_run)
    bar.close()
    save(not_run)
    print_summary(rows, out, plot, f"KVpop Table 1 analog, context {args.context}", start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
