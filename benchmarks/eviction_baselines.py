"""Every registered eviction method against the full cache on the testbed: the baselines table and its Pareto plot.

On the device (H200, bf16, large batches):

    PYTHONPATH=src python benchmarks/eviction_baselines.py --n-per-task 100 --minutes 25

writes ``results/baselines_table.json`` (schema ``kvlearn.results.v1``, kind ``accuracy``; every row has ``method``,
``protocol``, ``split``, ``budget``, ``compression``, ``kv_bytes``) and ``results/baselines_table.png`` (mean
accuracy over families against the compression ratio, one line per method, one marker per protocol).

Runs, in this order so that the time guard cuts the least important ones: the full cache (``dense``) once per split
(its result does not depend on the protocol: both protocols keep every token), then for every budget (1024 then
512: CR 75% / 88% at context 4096), every eviction method and every protocol it defines. ``--minutes`` stops
cleanly: no batch starts after the deadline, rows cut short are marked ``"incomplete": true`` and runs never
started are listed under ``not_run``. The file is written before the model is loaded and rewritten after every run,
each time with every run not done yet under ``not_run``: a process killed mid-way leaves ``complete: false``.
Methods whose module is not in this checkout are listed under ``skipped``.

``--smoke`` runs the same code on the CPU with a tiny random model (context 256, budgets 96 and 48, 2 examples of
niah and vt) in seconds, writing under ``runs/smoke/`` unless ``--out`` / ``--plot`` say otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvlearn.checkpoint import serving_dtype  # noqa: E402
from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.eval.accuracy import EvalConfig, eval_splits, evaluate, format_table, tasks_not_started  # noqa: E402
from kvlearn.eval.plots import plot_pareto  # noqa: E402
from kvlearn.methods import EVICTION_METHODS, PROTOCOLS, get_method  # noqa: E402
from kvlearn.results import portable_path, make_results, run_key, settle_run, shell_word, write_results  # noqa: E402


def repo_relative(arg: str) -> str:
    """``arg`` relative to the repository when it is a path inside it; an absolute path elsewhere as
    :func:`kvlearn.results.portable_path` writes it (``$OUT/...``, ``$TMPDIR/...``), also after the last ``:`` of
    ``LABEL=METHOD:PATH`` and after the ``=`` of ``LABEL=PATH`` (kaizen_table.py's ``--selector``)."""
    head, sep, tail = arg.rpartition(":")
    if sep and os.path.isabs(tail):
        return head + sep + portable_path(tail)
    if os.path.isabs(arg) or os.path.isabs(arg.partition("=")[2]):  # portable_path splits LABEL=PATH itself
        return portable_path(arg)
    try:
        return str(Path(arg).resolve().relative_to(REPO)) if (os.sep in arg or Path(arg).exists()) else arg
    except ValueError:
        return arg


def recorded_command(argv: list[str]) -> str:
    """The command as typed, its paths as :func:`repo_relative` writes them and quoted for a shell, a ``$OUT`` /
    ``$TMPDIR`` it wrote left unquoted so that the recorded command still expands it."""
    return " ".join(["python", "benchmarks/eviction_baselines.py"] + [shell_word(repo_relative(a)) for a in argv])


def parse_list(text: str, allowed: tuple[str, ...], option: str) -> tuple[str, ...]:
    if text == "all":
        return allowed
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in allowed]
    check(names and not bad, f"{option} {text!r}: unknown {', '.join(bad) or '(none given)'}; expected a comma list of "
                             f"{', '.join(allowed)} or 'all'")
    return names


def parse_budgets(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise KVLearnError(f"--budgets {text!r}: expected a comma list of integers, e.g. 1024,512") from None
    return budgets


def tiny_model():
    """A random 1-layer-pair Qwen3 on the testbed vocabulary (``--smoke``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.testbed.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    return Qwen3ForCausalLM(cfg).eval()


def add_run_options(ap: argparse.ArgumentParser) -> None:
    """The evaluation options every table script shares (tasks, sizes, time guard, device)."""
    ap.add_argument("--tasks", default="all", help="comma list of task families or 'all'")
    ap.add_argument("--n-per-task", type=int, default=100, help="examples per family per run")
    ap.add_argument("--context", type=int, default=4096, help="tokens per example")
    ap.add_argument("--sinks", type=int, default=4, help="sinks of every compressing method")
    ap.add_argument("--batch-size", type=int, default=64, help="examples per batch")
    ap.add_argument("--chunk-size", type=int, default=512, help="prefill chunk of the bounded cache")
    ap.add_argument("--minutes", type=float, default=25.0, help="time guard: no batch starts after it")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")


def smoke_settings(args) -> None:
    """``--smoke``: the CPU, context 256, budgets 96 and 48, 2 examples of niah and vt (trace decodes ~100 tokens)."""
    args.device, args.context, args.budgets, args.n_per_task, args.batch_size, args.chunk_size = "cpu", 256, "96,48", 2, 4, 64
    args.tasks = "niah,vt" if args.tasks == "all" else args.tasks


def plan_runs(args) -> tuple[list[EvalConfig], dict[str, str]]:
    """The configs to run, in priority order, and ``{method: why skipped}``."""
    methods = parse_list(args.methods, EVICTION_METHODS, "--methods")
    protocols = parse_list(args.protocols, PROTOCOLS, "--protocols")
    splits = parse_list(args.splits, eval_splits(), "--splits")
    budgets = parse_budgets(args.budgets)
    common = dict(tasks=tuple(args.tasks.split(",")) if args.tasks != "all" else EvalConfig().tasks,
                  n_per_task=args.n_per_task, context=args.context, batch_size=args.batch_size,
                  chunk_size=args.chunk_size, sinks=args.sinks)
    skipped: dict[str, str] = {}
    available = []
    for m in methods:
        try:
            get_method(m)
            available.append(m)
        except KVLearnError as e:
            skipped[m] = str(e)
    runs = [EvalConfig(method="dense", split=s, protocol=protocols[0], **common) for s in splits]
    for split in splits:
        for budget in budgets:
            for m in available:
                for p in protocols:
                    if p in get_method(m).protocols:
                        runs.append(EvalConfig(method=m, budget=budget, split=split, protocol=p, **common))
    return runs, skipped


def describe(c: EvalConfig) -> str:
    """The run's name in ``not_run`` (:func:`kvlearn.results.run_key`)."""
    return run_key(c.method, c.protocol, c.split, None if c.method == "dense" else c.budget)



def print_summary(rows: list[dict], out, plot, title: str, start: float, **plot_options) -> None:
    """The end of a table script's run: the accuracy table, the files written (the Pareto plot only when there are
    rows; ``plot_options`` go to :func:`kvlearn.eval.plots.plot_pareto`) and the wall time since ``start``."""
    print(format_table(rows))
    print(f"wrote {out}")
    if rows:
        print(f"wrote {plot_pareto(rows, plot, title=title, **plot_options)}")
    print(f"wall time {time.monotonic() - start:.0f} s")

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "checkpoints" / "testbed-teacher"), help="checkpoint folder")
    ap.add_argument("--methods", default="all", help=f"comma list of {','.join(EVICTION_METHODS)} or 'all'")
    ap.add_argument("--budgets", default="1024,512", help="comma list of budgets (tokens per KV head)")
    ap.add_argument("--protocols", default="all", help=f"comma list of {','.join(PROTOCOLS)} or 'all'")
    ap.add_argument("--splits", default="eval", help=f"comma list of {','.join(eval_splits())} or 'all'")
    add_run_options(ap)
    ap.add_argument("--out", default=None, help="results file (default: results/baselines_table.json, "
                                                "runs/smoke/baselines_table.json with --smoke)")
    ap.add_argument("--plot", default=None, help="Pareto plot (default: next to --out, with its name: baselines_table.png)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, context 256, budgets 96,48, n 2, niah and vt")
    args = ap.parse_args(argv)
    if args.smoke:
        smoke_settings(args)
    out = Path(args.out or ("runs/smoke/baselines_table.json" if args.smoke else "results/baselines_table.json"))
    plot = Path(args.plot or out.with_suffix(".png"))
    try:
        runs, skipped = plan_runs(args)
    except KVLearnError as e:
        print(f"eviction_baselines: error: {e}", file=sys.stderr)
        return 2
    for m, why in skipped.items():
        print(f"skipped {m}: {why}")

    start = time.monotonic()
    deadline = start + 60 * args.minutes
    dtype = torch.float32 if args.smoke else serving_dtype(args.device)  # bf16 on CUDA, float32 elsewhere
    model_name = "tiny random Qwen3 (--smoke)" if args.smoke else repo_relative(args.model)
    rows: list[dict] = []
    command = recorded_command(argv)

    def save(not_run: list[str]) -> None:
        """Write the file as it stands; ``not_run``: every planned run not done yet (complete only when empty)."""
        results = make_results("accuracy", rows, device=args.device, command=command, model=model_name,
                               context=args.context, dtype=str(dtype).replace("torch.", ""), n_per_task=args.n_per_task,
                               wall_seconds=round(time.monotonic() - start, 1), skipped=skipped, not_run=not_run,
                               complete=not not_run and not any(r.get("incomplete") for r in rows))
        write_results(out, results)

    not_run = [describe(c) for c in runs]  # a process killed mid-way (or while loading) leaves an honest file
    save(not_run)
    if args.smoke:
        model = tiny_model()
    else:
        from kvlearn import load_model

        model = load_model(args.model, dtype=dtype, device=args.device)
    total = sum(len(c.tasks) * c.n_per_task for c in runs)
    # on the device the log is not a terminal: one progress line every 20 s instead of a live bar
    bar = tqdm(total=total, desc="baselines", unit="ex", mininterval=0.1 if sys.stderr.isatty() else 20.0)
    for config in runs:
        if time.monotonic() >= deadline:
            print(f"time guard ({args.minutes} min): {len(not_run)} run(s) not started", flush=True)
            break
        bar.set_description(describe(config))
        new = evaluate(model, config, progress=False, deadline=deadline, bar=bar)
        rows += new
        not_run = settle_run(not_run, describe(config), tasks_not_started(config, new))
        save(not_run)
    bar.close()
    save(not_run)
    print_summary(rows, out, plot, f"{model_name}, context {args.context}", start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
