"""How good can a KVpop scorer get on the testbed? Accuracy of a dense model run under the *teacher policy* itself.

    python benchmarks/kvpop_target_oracle.py --model checkpoints/testbed-teacher --n 12 \\
        --out results/raw/kvpop_target_oracle_NAME.json

The scorers are trained to rank tokens like the teacher policy: the running top-k of the future-attention target's
static priorities ``r_t - t log γ`` (``kvlearn.kvpop.policy``). This what-if skips the scorer: for each prompt,

1. a dense forward records, per layer, the post-RoPE queries and keys and the exact causal log-normaliser
   (``kvlearn.ops.future_target.causal_lse``);
2. per *arm*, every layer attends under a fixed-budget retention (sinks ``s``, window ``w``, top ``k``) whose ranks
   come from that layer's target (``future_attention_target`` with the arm's aggregation and count normalisation,
   decay ``γ`` for every head); ``streaming`` keeps the sinks and a window of ``B - s`` recent tokens;
3. the answer is teacher-forced; an example is right when every checked answer token is the argmax (the stage
   check's rule, ``kvlearn.train.pretrain.checked_answer_positions``).

The target sees the whole sequence, the question and the answer included, so the teacher-policy arms are an upper
bound on what a scorer distilled on that target can keep (a scorer sees only the past). An arm far below dense at a
budget where the needles fit says the *target* does not single out what the answer needs on this testbed, not the
scorer. ``maxq`` is a what-if target outside the paper: the largest single future attention probability a token
receives (max over future queries and the query heads of its group) instead of the mean mass. CPU, float32;
about 10 s per example and arm at length 4096 on two cores.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import kvlearn
from kvlearn.threads import THREADS_HELP, set_threads, thread_count
from kvlearn.ops.masks import retention_mask_dense
from kvlearn.kvpop.policy import static_priorities
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.future_target import causal_lse, future_attention_target
from kvlearn.results import git_commit, make_results, write_results
from kvlearn.testbed import tasks
from kvlearn.train.pretrain import checked_answer_positions

ORACLE_ATTENTION = "kvpop_target_oracle"
DEFAULT_ARMS = ("streaming", "max:1:0.99999", "max:1:0.9995", "max:0:0.99999", "maxq:-:0.99999")


class OracleForward:
    """Per-forward state: ``mode="record"`` attends densely and stores per layer the future-attention statistics of
    :func:`future_statistics`; ``mode="plan"`` attends under ``plans[layer] = (ranks, cutoffs)`` at budget
    ``(sinks, window, topk)``."""

    def __init__(self, mode: str, window: int, plans: dict | None = None,
                 budget: tuple[int, int, int] | None = None, check_layer: int | None = None) -> None:
        self.mode, self.window, self.plans, self.budget = mode, window, plans or {}, budget
        self.check_layer = check_layer  # compare this layer's statistics with the library's target op
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def future_statistics(query, key, window: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force, float32, chunked over queries: ``(mass [B, Hq, T], peak [B, Hq, T])``, the total and the largest
    dense causal attention probability token ``t`` receives from the queries ``d >= t + window`` of each query head
    (query head ``i`` reads KV head ``i // (Hq / Hkv)``)."""
    B, Hq, T, _ = query.shape
    group = Hq // key.shape[1]
    mass, peak = torch.zeros(B, Hq, T), torch.zeros(B, Hq, T)
    pos = torch.arange(T)
    for qi in range(Hq):
        k = key[:, qi // group].float()
        for s in range(0, T, 1024):
            logits = scale * query[:, qi, s:s + 1024].float() @ k.transpose(-1, -2)  # [B, c, T]
            logits = logits.masked_fill(pos[None, None, :] > pos[s:s + 1024, None], float("-inf"))
            p = torch.softmax(logits, -1)
            p = p * (pos[s:s + 1024, None] >= pos[None, :] + window)  # query d counts for t iff d >= t + w
            mass[:, qi] += p.sum(1)
            peak[:, qi] = torch.maximum(peak[:, qi], p.amax(1))
    return mass, peak


def arm_target(arm: str, mass: torch.Tensor, peak: torch.Tensor, kv_heads: int, window: int,
               eps: float) -> torch.Tensor:
    """The target ``[B, kv_heads, T]`` of ``arm`` (``AGG:COUNT:GAMMA``) from :func:`future_statistics`."""
    aggregation, count, _ = arm.split(":")
    B, Hq, T = mass.shape
    if aggregation == "maxq":
        return torch.log(eps + peak.view(B, kv_heads, -1, T).amax(2))
    m = mass
    if count == "1":
        m = m / (T - (torch.arange(T) + window)).clamp(min=1)
    m = m.view(B, kv_heads, -1, T)
    return torch.log(eps + (m.amax(2) if aggregation == "max" else m.mean(2)))


def oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, oracle=None, **kwargs):
    """Attention function (transformers' signature; ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]``)."""
    if oracle is None or oracle.mode == "record":
        if oracle is not None:
            scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
            mass, peak = future_statistics(query, key, oracle.window, scale)
            oracle.records[module.layer_idx] = (mass, peak)
            if oracle.check_layer == module.layer_idx:  # the brute force agrees with the training op
                lib = future_attention_target(query, key, causal_lse(query, key, scale=scale), oracle.window,
                                              eps=1e-6, scale=scale)
                mine = arm_target("max:1:1", mass, peak, key.shape[1], oracle.window, 1e-6)
                err = float((lib.exp() - mine.exp()).abs().max())
                if err > 1e-5:
                    raise RuntimeError(f"brute-force target differs from future_attention_target by {err:.2e}")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    ranks, cutoffs = oracle.plans[module.layer_idx]
    sinks, window, _ = oracle.budget
    group = query.shape[1] // key.shape[1]
    keep = retention_mask_dense(ranks, cutoffs, sinks, window)  # bool [B, Hkv, T, T], the CPU twin's mask
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
                                         attn_mask=keep.repeat_interleave(group, 1), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def arm_plans(arm: str, records: dict, kv_heads: int, sinks: int, window: int, topk: int, eps: float) -> dict:
    """Per layer ``(ranks, cutoffs)`` of one arm, every layer's running top-k in one batched call."""
    layers = sorted(records)
    B, _, T = records[layers[0]][0].shape
    if arm == "streaming":
        ranks, cutoffs = running_topk_cutoff(torch.zeros(B * len(layers), kv_heads, T), sinks, window + topk, 0)
    else:
        gamma = float(arm.split(":")[2])
        log_gamma = torch.full((kv_heads,), math.log(gamma) if gamma < 1 else 0.0)
        prio = torch.cat([static_priorities(arm_target(arm, *records[i], kv_heads, window, eps), log_gamma)
                          for i in layers])
        ranks, cutoffs = running_topk_cutoff(prio, sinks, window, topk)
    return {i: (ranks[j * B:(j + 1) * B], cutoffs[j * B:(j + 1) * B]) for j, i in enumerate(layers)}


def correct(logits: torch.Tensor, example) -> bool:
    p = len(example.prompt_ids)
    pred = logits[0].argmax(-1)
    return all(int(pred[p + j - 1]) == example.answer_ids[j] for j in checked_answer_positions(example))


def check_arm(arm: str) -> str:
    if arm == "streaming":
        return arm
    parts = arm.split(":")
    ok = len(parts) == 3 and parts[0] in ("max", "mean", "maxq") and parts[1] in ("0", "1", "-")
    try:
        ok = ok and 0.0 < float(parts[2]) <= 1.0
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"kvpop_target_oracle: error: --arms entry {arm!r} is invalid: expected 'streaming' or "
                         "'AGG:COUNT:GAMMA' with AGG in max, mean, maxq, COUNT 1 or 0 ('-' for maxq), 0 < GAMMA <= 1")
    return arm


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/testbed-teacher")
    p.add_argument("--families", default="niah,vt,recall")
    p.add_argument("--splits", default="eval,heldout")
    p.add_argument("--n", type=int, default=12, help="examples per family and split")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help="comma-separated: streaming, or AGG:COUNT:GAMMA (AGG max/mean/maxq, COUNT 1/0)")
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in tasks.FAMILIES]
    if bad or not families:
        print(f"kvpop_target_oracle: error: --families={args.families!r} is invalid: expected names from "
              f"{', '.join(tasks.FAMILIES)}", file=sys.stderr)
        return 2
    splits = [s for s in args.splits.split(",") if s]
    if not splits or any(s not in ("eval", "heldout") for s in splits):
        print(f"kvpop_target_oracle: error: --splits={args.splits!r} is invalid: expected eval and/or heldout",
              file=sys.stderr)
        return 2
    topk = args.budget - args.sinks - args.window
    if args.sinks < 0 or args.window < 1 or topk < 0 or args.budget >= args.length:
        print(f"kvpop_target_oracle: error: --budget={args.budget} --sinks={args.sinks} --window={args.window} is "
              f"invalid: expected sinks >= 0, window >= 1, sinks + window <= budget < length={args.length}",
              file=sys.stderr)
        return 2
    arms = [check_arm(a) for a in args.arms.split(",") if a]
    commit = git_commit()  # the code that runs: read now, not when the file is written at the end of a long run
    set_threads(args.threads)
    model = kvlearn.load(args.model, dtype=torch.float32, device="cpu")
    kv_heads = model.config.num_key_value_heads
    AttentionInterface.register(ORACLE_ATTENTION, oracle_attention)
    AttentionMaskInterface.register(ORACLE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(ORACLE_ATTENTION)
    hits = {(s, f, a): 0 for s in splits for f in families for a in ["dense", *arms]}
    start = time.time()
    for split in splits:
        for family in families:
            for i in range(args.n):
                ex = tasks.generate(family, tasks.example_seed(family, split, i), args.length)
                ids = torch.tensor([ex.prompt_ids + ex.answer_ids])
                rec = OracleForward("record", args.window, check_layer=0 if i == 0 else None)
                hits[(split, family, "dense")] += correct(model(input_ids=ids, oracle=rec, use_cache=False).logits, ex)
                for arm in arms:
                    plans = arm_plans(arm, rec.records, kv_heads, args.sinks, args.window, topk, args.eps)
                    window = args.window + topk if arm == "streaming" else args.window
                    plan = OracleForward("plan", args.window, plans, (args.sinks, window, topk))
                    hits[(split, family, arm)] += correct(model(input_ids=ids, oracle=plan, use_cache=False).logits, ex)
                done = {a: hits[(split, family, a)] for a in ["dense", *arms]}
                print(f"{split} {family} {i + 1}/{args.n} ({time.time() - start:.0f} s): {done}", flush=True)
    rows = [{"split": s, "task": f, "arm": a, "budget": args.length if a == "dense" else args.budget,
             "sinks": args.sinks, "window": args.window, "topk": topk, "accuracy": round(h / args.n, 4), "n": args.n}
            for (s, f, a), h in hits.items()]
    for r in rows:
        print(f"{r['split']:8s} {r['task']:7s} {r['arm']:16s} {r['accuracy']:.3f}")
    if args.out:
        write_results(args.out, make_results("probe", rows, device="cpu", commit=commit, model=args.model,
                                              context=args.length,
                                              teacher_forced=True, wall_seconds=round(time.time() - start, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
