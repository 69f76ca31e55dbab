"""What does a KVpop model keep? Retention against its teacher policy, per layer, on testbed prompts.

    python benchmarks/kvpop_retention.py --model runs/kvpop-student --family vt --n 4 \\
        --out results/raw/NAME.json --heatmap results/raw/NAME.png

For ``n`` prompts of ``--family`` at ``--length`` (``--split``: eval, or the held-out haystacks), one teacher-forced
forward under the KVpop training attention (the running top-k of the model's learned priorities; the CPU dense-mask
twin) records, per layer, the learned ranks and cutoffs and the future-attention target. The *teacher policy* is
the running top-k of the target's effective scores (``kvlearn.kvpop.policy.teacher_policy``: what the boundary
loss trains the scorers towards). Reported per layer and KV head:

- ``recall``: the share of the teacher policy's retained eligible tokens that the learned policy retains too, at
  ``--queries`` query positions sampled as in training (the paper's Figure 7 analog; ``retention_recall`` of the
  trainer's log, per layer);
- ``needles``: at the query that starts the answer, the share of the example's needed prompt tokens
  (``Example.needed_spans``: needles and the final question) older than the window that the learned policy keeps,
  and that the teacher policy keeps (``needles_teacher``). Learned far below teacher: the scorers have not learned
  their target yet; teacher itself low: the target, or the decay's recency bias, does not single the needles out
  at this budget (the learned per-head decays ``gamma`` are in the row too).

An mLSTM student trained with ``state_in_budget`` is measured with the top-k it trained and serves with (its state's
bytes take some of the slots: ``kvlearn.kvpop.apply.model_budget_config`` in bf16, as the retrofit does).
``--window W`` re-splits the same budget (``topk = budget - sinks - W``), the target included. ``--decay G`` sets
every head's decay to ``G`` for both policies (a what-if: how much of the far needles does the teacher policy keep
without the learned decays' recency prior?). ``--target-aggregation`` / ``--count-normalize`` change the
future-attention target the teacher policy ranks by, and ``--target-reduction`` its reduction (default: the
checkpoint's; the learned ranking does not depend on them). ``--heatmap``: for
the first example, which prompt tokens each layer/KV head keeps at the answer query (the paper's Figure 6 analog),
needles marked. CPU; about a minute per example at length 4096 on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import kvlearn
from kvlearn.threads import THREADS_HELP, set_threads, thread_count
from kvlearn import KVpopConfig
from kvlearn.kvpop.apply import kvpop_modules, model_budget_config, recorded_config
from kvlearn.kvpop.policy import LearnedDecay, sample_query_positions, teacher_policy
from kvlearn.kvpop.train_attention import TrainForward, use_train_attention
from kvlearn.ops.masks import retention_mask_dense
from kvlearn.results import make_results, write_results
from kvlearn.testbed import tasks
from kvlearn.train.distill import retention_recall


def kept_row(ranks, cutoffs, config, query: int) -> torch.Tensor:
    """bool ``[kv_heads, T]``: the keys that query ``query`` attends under ``(ranks, cutoffs)`` (batch 1)."""
    return retention_mask_dense(ranks, cutoffs, config.sinks, config.window)[0, :, query]


def measure(model, config, example, queries: torch.Tensor) -> dict:
    """Per-layer ``[layers, kv_heads]`` recall / needles / needles_teacher and the answer-query rows of one example."""
    prompt_len = len(example.prompt_ids)
    needed = torch.tensor(tasks.needed_positions(example))
    needed = needed[needed < prompt_len - config.window]  # older than the window: only the policy keeps them
    state = TrainForward(config)
    model(input_ids=torch.tensor([example.prompt_ids + example.answer_ids]), kvpop_train=state, use_cache=False)
    recall, learned, teacher, rows = [], [], [], []
    for layer in sorted(state.records):
        r = state.records[layer]
        policy = teacher_policy(r.target, r.log_gamma, config.sinks, config.window, config.topk)
        recall.append(torch.stack([retention_recall(r.ranks[:, h:h + 1], r.cutoffs[:, h:h + 1],
                                                    policy.ranks[:, h:h + 1], policy.cutoffs[:, h:h + 1],
                                                    queries, config.sinks, config.window)
                                   for h in range(r.ranks.shape[1])]))
        row = kept_row(r.ranks, r.cutoffs, config, prompt_len - 1)
        learned.append(row[:, needed].float().mean(-1))
        teacher.append(kept_row(policy.ranks, policy.cutoffs, config, prompt_len - 1)[:, needed].float().mean(-1))
        rows.append(row[:, :prompt_len])
    return {"recall": torch.stack(recall), "needles": torch.stack(learned), "needles_teacher": torch.stack(teacher),
            "rows": torch.stack(rows), "needed": needed, "n_needed": len(needed)}


def plot_heatmap(rows: torch.Tensor, needed: torch.Tensor, path: str, title: str) -> None:
    """``rows`` bool ``[layers, kv_heads, P]`` as a layers x heads by position image; needles marked below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H, P = rows.shape
    fig, ax = plt.subplots(figsize=(12, 0.3 * L * H + 1.2))
    ax.imshow(rows.reshape(L * H, P).float().numpy(), aspect="auto", interpolation="nearest", cmap="Greys")
    ax.scatter(needed.numpy(), [L * H - 0.5 + 0.6] * len(needed), marker="^", s=12, color="tab:red", clip_on=False,
               label="needed tokens")
    ax.set_yticks(range(L * H), [f"L{i // H} H{i % H}" for i in range(L * H)], fontsize=6)
    ax.set_xlabel("prompt position (black: kept at the query that starts the answer)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rounded(t: torch.Tensor) -> list:
    return [[round(float(x), 3) for x in row] for row in t]


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a KVpop checkpoint folder (kvlearn retrofit's final/)")
    p.add_argument("--family", default="vt", choices=tasks.FAMILIES)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--split", default="eval", choices=("eval", "heldout"),
                   help="prompts of the eval split, or of the held-out haystack styles and depth regimes")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--window", type=int, default=None, help="re-split the budget with this window")
    p.add_argument("--decay", type=float, default=None, help="set every head's decay gamma to this value (both policies)")
    p.add_argument("--target-aggregation", default=None, choices=KVpopConfig.AGGREGATIONS,
                   help="the target's aggregation over future queries (default: the checkpoint's)")
    p.add_argument("--target-reduction", default=None, choices=KVpopConfig.REDUCTIONS,
                   help="the teacher policy's target reduction (default: the checkpoint's)")
    p.add_argument("--count-normalize", default=None, choices=("0", "1"),
                   help="1/0: divide the target's mass by the number of future queries or not (default: the checkpoint's)")
    p.add_argument("--queries", type=int, default=64, help="query positions for the retention recall")
    p.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)
    p.add_argument("--out", default=None)
    p.add_argument("--heatmap", default=None, help="PNG of the first example's retention")
    args = p.parse_args(argv)
    set_threads(args.threads)
    model = kvlearn.load(args.model, dtype=torch.float32, device="cpu")
    config = recorded_config(model)
    if config is None:
        print(f"kvpop_retention: error: {args.model!r} holds no KVpop modules: expected a kvlearn retrofit output",
              file=sys.stderr)
        return 2
    if args.decay is not None:
        for decay in kvpop_modules(model)[1]:
            if not decay.decay_min < args.decay < decay.decay_max:
                print(f"kvpop_retention: error: --decay={args.decay} is invalid: expected a decay strictly between "
                      f"{decay.decay_min} and {decay.decay_max} (the checkpoint's range)", file=sys.stderr)
                return 2
            decay.alpha.copy_(LearnedDecay(decay.alpha.numel(), decay.decay_min, decay.decay_max, init=args.decay).alpha)
    if args.target_aggregation is not None:
        config = dataclasses.replace(config, target_aggregation=args.target_aggregation)
    if args.count_normalize is not None:
        config = dataclasses.replace(config, target_count_normalize=args.count_normalize == "1")
    if args.target_reduction is not None:
        config = dataclasses.replace(config, target_reduction=args.target_reduction)
    if args.window is not None:
        budget = config.sinks + config.window + config.topk
        config = dataclasses.replace(config, window=args.window, topk=budget - config.sinks - args.window)
    # an mLSTM student trained with its state in the budget trains and serves with fewer top-k slots: measure those
    config = model_budget_config(model, config, torch.bfloat16)
    use_train_attention(model)
    if args.length > config.sinks + config.window + config.topk:  # as in training (a full long-range budget)
        queries = sample_query_positions(args.length, config.sinks, config.window, config.topk, args.queries,
                                         generator=torch.Generator().manual_seed(0))
    else:  # the budget holds the whole prompt: any query past the window
        queries = torch.linspace(config.sinks + config.window, args.length - 1, args.queries).long()
    examples, sums = [], {}
    for i in range(args.n):
        ex = tasks.generate(args.family, tasks.example_seed(args.family, args.split, i), args.length)
        m = measure(model, config, ex, queries)
        keys = ("recall", "needles", "needles_teacher") if m["n_needed"] else ("recall",)
        for k in keys:
            sums.setdefault(k, []).append(m[k])
        examples.append({"index": i, "style": ex.style, "regime": ex.regime, "needed_before_window": m["n_needed"],
                         **{k: round(float(m[k].mean()), 3) for k in keys}})
        print(examples[-1], flush=True)
        if i == 0 and args.heatmap:
            plot_heatmap(m["rows"], m["needed"], args.heatmap,
                         f"{args.family} example 0 ({ex.style}, {ex.regime}): kept keys at the answer query, "
                         f"budget {config.sinks}+{config.window}+{config.topk}")
    decays = [[round(float(g), 6) for g in torch.exp(d())] for d in kvpop_modules(model)[1]]  # gamma per layer, head
    row = {"model": args.model, "family": args.family, "split": args.split, "length": args.length,
           "decay_override": args.decay,
           "target_aggregation": config.target_aggregation, "target_count_normalize": config.target_count_normalize,
           "target_reduction": config.target_reduction, "sinks": config.sinks,
           "window": config.window, "topk": config.topk, "state_in_budget": config.state_in_budget,
           "queries": args.queries, "examples": examples,
           "decay_by_layer_head": decays,
           **{f"{k}_by_layer_head": rounded(torch.stack(v).mean(0)) for k, v in sums.items()},
           **{f"{k}_mean": round(float(torch.stack(v).mean()), 3) for k, v in sums.items()}}
    for k in sums:
        print(f"{k} [layer x kv head]:", row[f"{k}_by_layer_head"])
    if args.out:
        write_results(args.out, make_results("probe", [row], device="cpu", model=args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
