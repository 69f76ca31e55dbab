"""Which layer's per-head cap costs a DMS student its accuracy? Serve it at a budget with the cap lifted on some layers.

    python benchmarks/dms_cap_lift.py --model runs/dms-student --budget 1024 --lift none,1,4,5 \\
        --tasks niah,recall --n-per-task 20 --out results/raw/NAME.json

kvlearn serves DMS at a budget ``B`` per KV head (``DMSPolicy``: the sinks, the window, and ``B - sinks - window``
long-range slots; a kept token over that evicts the kept token with the highest logit). A student trained with
the model-scope compression target may keep far more than that in a few heads (``benchmarks/dms_head_load.py``
measures the load). This script asks which of those caps matters: for each entry of ``--lift`` (a layer index, a
``+``-joined set of layers such as ``1+5``, ``none`` or ``all``) it evaluates the student (``kvlearn eval``'s
greedy exact match, ``bounded`` protocol) with the layers named served at ``--lifted-budget`` (default
``context - 1``: every key the gates keep fits, the paper's rule alone) and every other layer at ``--budget``.
``none`` is ``kvlearn eval --method dms --budget B`` (the student's trained window, as ``kvlearn eval`` serves it);
``all`` is the same at the lifted budget.

Each row is an accuracy row of ``kvlearn eval`` with ``lifted_layers`` (the layers served without the cap) and
``lifted_budget`` added. On two CPU cores about 2 s an example at 4096 tokens with no layer lifted, about 6 with
every layer lifted.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

import kvlearn
from kvlearn.threads import THREADS_HELP, set_threads, thread_count
from kvlearn.dms.apply import recorded_config
from kvlearn.dms.cache import DMSLayer
from kvlearn.errors import KVLearnError, check
from kvlearn.methods import make_config, trained_options
from kvlearn.eval.accuracy import EvalConfig, evaluate, format_table
from kvlearn.results import make_results, write_results
from kvlearn.testbed import tasks


@dataclass(frozen=True)
class LiftedEvalConfig(EvalConfig):
    """``EvalConfig`` of method ``dms`` whose caches serve the layers ``lifted`` at ``lifted_budget`` tokens per KV
    head and every other layer at ``budget``."""

    lifted: tuple[int, ...] = ()
    lifted_budget: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.method == "dms", f"method={self.method!r}: the cap lift serves DMS students only (method 'dms')")
        check(not self.lifted or self.lifted_budget is not None,
              f"lifted={self.lifted!r} needs lifted_budget: the tokens per KV head of the lifted layers")
        # the lifted layers' config, made (and checked, in the harness's words) as method_config is
        object.__setattr__(self, "lifted_config", None if self.lifted_budget is None else make_config(
            "dms", budget=self.lifted_budget, sinks=self.sinks, context=self.context, **(self.options or {})))

    def make_cache(self, model):
        cache = super().make_cache(model)
        for layer in self.lifted:
            cache.layers[layer] = DMSLayer(self.lifted_config)
        return cache


def parse_lift(spec: str, num_layers: int) -> list[tuple[int, ...]]:
    """``--lift`` -> one tuple of layer indices per entry (``none``: ``()``, ``all``: every layer, ``1+5``: two);
    a bad entry is a ``ValueError`` naming it and the valid range."""
    sets = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry == "none":
            sets.append(())
        elif entry == "all":
            sets.append(tuple(range(num_layers)))
        else:
            try:
                layers = tuple(sorted({int(x) for x in entry.split("+")}))
            except ValueError:
                raise ValueError(f"--lift entry {entry!r} is invalid: expected none, all, a layer index or indices "
                                 f"joined by '+' (0 to {num_layers - 1})") from None
            bad = [x for x in layers if not 0 <= x < num_layers]
            if bad:
                raise ValueError(f"--lift entry {entry!r}: layer(s) {bad} outside 0 to {num_layers - 1} (the model "
                                 f"has {num_layers} decoder layers)")
            sets.append(layers)
    if not sets:
        raise ValueError(f"--lift {spec!r} names no layer set: expected e.g. none,1,4+5,all")
    return sets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a DMS checkpoint folder (kvlearn retrofit --method dms's final/)")
    p.add_argument("--budget", type=int, default=None, help="tokens per KV head of the capped layers (default: the "
                                                            "checkpoint's)")
    p.add_argument("--lift", default="none,all", help="comma list of layer sets served without the cap: none, all, "
                                                      "an index, or indices joined by '+' (default: none,all)")
    p.add_argument("--lifted-budget", type=int, default=None, help="tokens per KV head of the lifted layers "
                                                                   "(default: context - 1, every key fits)")
    p.add_argument("--tasks", default=",".join(tasks.FAMILIES), help="comma list of testbed families")
    p.add_argument("--n-per-task", type=int, default=20)
    p.add_argument("--split", default="eval", choices=("eval", "heldout"))
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("dms_cap_lift: error: --device cuda requested but CUDA is not available: use --device cpu",
              file=sys.stderr)
        return 2
    set_threads(args.threads)
    try:
        model = kvlearn.load(args.model, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16,
                             device=args.device)
        config = recorded_config(model)
        if config is None:
            raise KVLearnError(f"{args.model!r} holds no DMS gates: expected a kvlearn retrofit --method dms output")
        budget = args.budget if args.budget is not None else config.budget
        lifted_budget = args.lifted_budget if args.lifted_budget is not None else args.context - 1
        sets = parse_lift(args.lift, model.config.num_hidden_layers)
        family_list = tuple(t for t in args.tasks.split(",") if t)
        # the student is served under the pattern it was trained for (its window), as kvlearn eval serves it
        options = trained_options("dms", args.model)
        configs = [LiftedEvalConfig(method="dms", budget=budget, tasks=family_list, n_per_task=args.n_per_task,
                                    context=args.context, batch_size=args.batch_size, split=args.split,
                                    options=options, lifted=layers, lifted_budget=lifted_budget) for layers in sets]
    except (KVLearnError, ValueError) as err:
        print(f"dms_cap_lift: error: {err}", file=sys.stderr)
        return 2
    model.eval()
    rows = []
    for cfg in configs:
        with torch.inference_mode():
            measured = evaluate(model, cfg)
        for r in measured:
            r.update(lifted_layers=list(cfg.lifted), lifted_budget=lifted_budget)
        rows += measured
        mean = sum(r["accuracy"] for r in measured) / len(measured)
        print(f"lifted {list(cfg.lifted) or 'none'}: " + ", ".join(f"{r['task']} {r['accuracy']:.3f}" for r in measured)
              + f" (mean {mean:.3f})", flush=True)
    print(format_table(rows))
    if args.out:
        write_results(args.out, make_results("accuracy", rows, device=args.device, model=args.model,
                                             budget=budget, lifted_budget=lifted_budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
