"""Does the straight-through scorer distillation teach KVpop's scorers what the loss needs? A CPU check on a frozen
backbone (issue #10, CR 94%; docs/DESIGN.md section 5, "Scorers through the distillation loss").

    python benchmarks/kvpop_scorer_kd_check.py --weights 0 1 --out results/raw/kvpop_scorer_kd_check_cpu.json

Per arm (a ``--scorer-kd`` weight; 0 is the boundary loss alone), ``kvlearn retrofit --freeze-backbone`` from the
shipped teacher: only the scorers and decays train, on the same batches and seed for every arm, so the arms differ
in the scorers' gradient and nothing else. Then each arm's student is measured under its own hard retention:

- ``kd_eval``: the distillation loss of its (hard) forward against the teacher on ``--eval-batches`` fresh training
  batches (seeds no training batch uses), the quantity the scorer distillation descends;
- ``needed_kept_<split>_<family>``: at the answer query (the last prompt token) of the first ``--needed-n`` examples
  of each of ``--tasks``, the share of the needed prompt tokens (``testbed.needed_positions``) that are eligible for
  eviction (past the sinks, older than the window) and that the student's running top-k keeps, over every layer and
  KV head: what the ranking keeps of what the answer needs, before any decoding;
- ``accuracy``: the testbed's bounded-protocol accuracy at ``--length`` on ``--tasks``, eval split and the held-out
  haystack split (styles and depth regimes training never drew), ``--n`` examples per family.

Before training, ``init_gradients`` records on one training batch the norm of the scorers' and decays' gradient from
each source at the scorers' initialisation: the boundary loss's, and the distillation loss's through the soft
retention at weight 1 (what ``--scorer-kd`` adds), so a weight can be read against the boundary term's scale.

The frozen backbone isolates the scorers: a lower ``kd`` for weight > 0 shows the gradient reaches the ranking in the
direction the loss wants. The retrofit itself (backbone and scorers together, 1,300 steps at 4096) is the device
experiment ``benchmarks/device/kvpop_scorer_kd.sh``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import kvlearn  # noqa: E402
from kvlearn.threads import THREADS_HELP, set_threads, thread_count  # noqa: E402
from kvlearn import KVpopConfig  # noqa: E402
from kvlearn.errors import check  # noqa: E402
from kvlearn.eval.accuracy import EvalConfig, evaluate  # noqa: E402
from kvlearn.results import command_line, git_commit, make_results, write_results  # noqa: E402
from kvlearn.kvpop.train_attention import use_train_attention  # noqa: E402
from kvlearn.ops.distill_loss import kd_loss  # noqa: E402
from kvlearn.testbed import example_seed, generate, needed_positions  # noqa: E402
from kvlearn.testbed.data import training_batch  # noqa: E402
from kvlearn.kvpop.policy import sample_query_positions  # noqa: E402
from kvlearn.kvpop.scorer_kd import ScorerKD, scorer_kd_rows  # noqa: E402
from kvlearn.train.distill import (RetrofitConfig, build_models, distill_losses, retrofit,  # noqa: E402
                                   student_forward, training_kvpop)

EVAL_SEED = 7_000_000  # training_batch seeds of the KD evaluation (the retrofit's stream starts at 0)


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/testbed-teacher")
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 1.0], help="--scorer-kd weight of each arm")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--queries", type=int, default=256, help="scorer-distillation rows per step")
    ap.add_argument("--scorer", default="mlp", choices=("linear", "mlp", "mlstm"))
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=96)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr-new", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--tasks", nargs="+", default=["trace", "niah"])
    ap.add_argument("--n", type=int, default=16, help="examples per family and split")
    ap.add_argument("--needed-n", type=int, default=4, help="examples per family and split of needed_kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    check(len(set(args.weights)) == len(args.weights), f"--weights {args.weights}: expected distinct weights")
    check(all(w >= 0 for w in args.weights), f"--weights {args.weights}: expected weights >= 0")
    check(args.sinks + args.window < args.budget < args.length,
          f"--budget {args.budget}: expected sinks + window ({args.sinks + args.window}) < budget < --length "
          f"({args.length})")
    return args


def eval_kd(student, teacher, kv: KVpopConfig, length: int, batches: int, batch_size: int) -> float:
    """Mean KD loss of the student's hard-retention forward on ``batches`` fresh training batches."""
    use_train_attention(student)
    total = 0.0
    with torch.no_grad():
        for i in range(batches):
            ids, labels = training_batch(batch_size, length, EVAL_SEED + i)
            logits, _ = student_forward(student, ids, kv)
            total += float(kd_loss(logits, teacher(input_ids=ids).logits, labels, 256))
    return total / batches


def needed_kept(student, kv: KVpopConfig, family: str, split: str, n: int, length: int) -> float:
    """Share of the eligible needed prompt tokens the student's running top-k keeps at the answer query, over ``n``
    examples of ``family`` in ``split`` at ``length``, every layer and KV head (the training attention's ranks and
    cutoffs on the prompt)."""
    use_train_attention(student)
    kept = total = 0
    with torch.no_grad():
        for i in range(n):
            ex = generate(family, example_seed(family, split, i), length)
            q = len(ex.prompt_ids) - 1
            needed = torch.tensor([p for p in needed_positions(ex) if kv.sinks <= p <= q - kv.window], dtype=torch.long)
            if len(needed) == 0:
                continue
            _, state = student_forward(student, torch.tensor([ex.prompt_ids]), kv)
            for rec in state.records.values():  # ranks, cutoffs [1, Hkv, P]
                keep = rec.ranks[0, :, needed] <= rec.cutoffs[0, :, q, None]  # [Hkv, needed]
                kept += int(keep.sum())
                total += keep.numel()
    return kept / max(total, 1)


def init_gradients(config: RetrofitConfig, queries: int, temperature: float) -> dict:
    """Gradient norms of the fresh scorers (``scorer``) and decays (``decay``) from the boundary loss and from the KD
    loss through the soft retention at weight 1, on one training batch of ``config``'s shape."""
    torch.manual_seed(config.seed)
    teacher, student = build_models(config, torch.device("cpu"))
    kv = training_kvpop(config, student)
    ids, labels = training_batch(config.batch_size, config.seq_len, EVAL_SEED - 1)
    gen = torch.Generator().manual_seed(config.seed)
    boundary_queries = sample_query_positions(config.seq_len, kv.sinks, kv.window, kv.topk, config.queries_per_step,
                                              config.late_fraction, generator=gen)
    rows, scale = scorer_kd_rows(config.seq_len, kv.sinks, kv.window, kv.topk, queries, gen)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids).logits
    logits, state = student_forward(student, ids, kv, scorer_kd=ScorerKD(rows, scale, temperature, config.seq_len))
    named = [(n, p) for n, p in student.named_parameters() if ".kvpop." in n]
    losses = {"kd_through_soft_retention": kd_loss(logits, teacher_logits, labels, config.kd_topk),
              "boundary": distill_losses(state, boundary_queries)["boundary"]}
    out = {}
    for name, loss in losses.items():
        grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True)
        for part in ("scorer", "decay"):
            sq = sum(float(g.pow(2).sum()) for (n, _), g in zip(named, grads) if g is not None and f".{part}" in n)
            out[f"{part}_{name}"] = sq ** 0.5
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    set_threads(args.threads)
    commit, command, start = git_commit(), command_line(), time.time()
    teacher = kvlearn.load(args.model)
    teacher.eval()
    kv = KVpopConfig(sinks=args.sinks, window=args.window, topk=args.budget - args.sinks - args.window,
                     scorer=args.scorer, decay_init=0.99999, target_reduction="peak")
    rows, arms = [], []
    with tempfile.TemporaryDirectory() as tmp:
        grads = init_gradients(RetrofitConfig(model=args.model, out=f"{tmp}/g", kvpop=kv, batch_size=args.batch_size,
                                              seq_len=args.length, seed=args.seed), args.queries, args.temperature)
        print("gradient norms at initialisation: " + ", ".join(f"{k} {v:.4g}" for k, v in grads.items()), flush=True)
        for w in args.weights:
            t0 = time.time()
            kd_kw = dict(scorer_kd=w, scorer_kd_temperature=args.temperature, scorer_kd_queries=args.queries) if w else {}
            config = RetrofitConfig(model=args.model, out=f"{tmp}/w{w}", kvpop=kv, freeze_backbone=True,
                                    steps=args.steps, batch_size=args.batch_size, seq_len=args.length,
                                    lr_new=args.lr_new, warmup_steps=max(1, args.steps // 10),
                                    save_interval=args.steps, seed=args.seed, **kd_kw)
            result = retrofit(config, progress=False)
            student = kvlearn.load(result["final"])
            student.eval()
            train_kv = training_kvpop(config, student)
            kd = eval_kd(student, teacher, train_kv, args.length, args.eval_batches, args.batch_size)
            arm = {"scorer_kd": w, "kd_eval": kd, "train_seconds": round(time.time() - t0, 1)}
            for split in ("eval", "heldout"):
                for task in args.tasks:
                    arm[f"needed_kept_{split}_{task}"] = needed_kept(student, train_kv, task, split, args.needed_n,
                                                                     args.length)
            student = kvlearn.load(result["final"])  # the serving attention again, for the cache's evaluation
            student.eval()
            for split in ("eval", "heldout"):
                ec = EvalConfig(method="kvpop", budget=args.budget, sinks=args.sinks, tasks=tuple(args.tasks),
                                n_per_task=args.n, context=args.length, split=split, batch_size=8,
                                options={"window": args.window, "scorer": args.scorer})
                for r in evaluate(student, ec, progress=False):
                    rows.append({**r, "method": f"kvpop_{args.scorer}_frozen", "scorer_kd": w})
                    arm[f"{split}_{r['task']}"] = r["accuracy"]
            arms.append(arm)
            print(f"scorer_kd={w}: kd_eval {kd:.4f} | " + " ".join(f"{k} {v:.3f}" for k, v in arm.items()
                                                                  if k.startswith(("eval_", "heldout_", "needed_"))),
                  flush=True)
    if args.out:
        write_results(args.out, make_results(
            "accuracy", rows, device="cpu", command=command, commit=commit, model=args.model, context=args.length,
            arms=arms, init_gradients=grads, settings={k: v for k, v in vars(args).items() if k not in ("out", "threads")},
            wall_seconds=round(time.time() - start, 1),
            note="Scorer-only retrofits on the frozen shipped teacher (kvlearn retrofit --freeze-backbone), one per "
                 "--scorer-kd weight, same batches and seed; kd_eval: each student's hard-retention KD loss on "
                 "fresh training batches; rows: bounded-protocol accuracy on the eval and held-out splits."))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
