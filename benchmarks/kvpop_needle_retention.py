"""Does a KVpop model keep the tokens a testbed answer needs? Needle retention, learned policy vs its own target.

    python benchmarks/kvpop_needle_retention.py --model runs/kvpop-student --family vt --n 4 --out results/raw/NAME.json

For ``n`` eval-split prompts of ``--family`` at ``--length``, one teacher-forced forward under the KVpop training
attention (the running top-k of the model's learned priorities, the CPU dense-mask twin) gives, per layer and KV
head, which keys are attended at the **last prompt token** (the query that starts the answer). Over the example's
needed prompt tokens (``Example.needed_spans``: the needles and the final question) that lie before the recent
window, it reports the share kept (a) by the learned policy and (b) by the *oracle*: the same running top-k
applied to the future-attention target ``r^tgt`` that the scorers are trained to predict. (b) bounds what
training towards that target can reach at this budget; (a) far below (b) means the scorers have not learned it
yet. ``--window W`` re-splits the same budget (``topk = budget - sinks - W``), the target included.

Numbers in ``docs/notes/kvpop_retrofit_smoke.md``. CPU; a few minutes per example at length 4096.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import kvlearn
from kvlearn.kvpop.apply import recorded_config
from kvlearn.kvpop.train_attention import TrainForward, use_train_attention
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.masks import retention_mask_dense
from kvlearn.results import make_results, write_results
from kvlearn.testbed import tasks


def kept_at_answer(records, config, answer_query: int, needed: torch.Tensor, oracle: bool) -> torch.Tensor:
    """``[layers, kv_heads]`` share of ``needed`` key positions attended by query ``answer_query``."""
    rows = []
    for layer in sorted(records):
        r = records[layer]
        ranks, cutoffs = (running_topk_cutoff(r.target.float().contiguous(), config.sinks, config.window, config.topk)
                          if oracle else (r.ranks, r.cutoffs))
        row = retention_mask_dense(ranks, cutoffs, config.sinks, config.window)[0, :, answer_query]  # [H, T]
        rows.append(row[:, needed].float().mean(-1))
    return torch.stack(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a KVpop checkpoint folder (kvlearn retrofit's final/)")
    p.add_argument("--family", default="vt", choices=tasks.FAMILIES)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--window", type=int, default=None, help="re-split the budget with this window")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = kvlearn.load(args.model, dtype=torch.float32, device="cpu")
    config = recorded_config(model)
    if config is None:
        raise SystemExit(f"kvlearn: error: {args.model!r} holds no KVpop modules: expected a kvlearn retrofit output")
    if args.window is not None:
        budget = config.sinks + config.window + config.topk
        config = dataclasses.replace(config, window=args.window, topk=budget - config.sinks - args.window)
    use_train_attention(model)
    per_example, learned_sum, oracle_sum, used = [], None, None, 0
    for i in range(args.n):
        ex = tasks.generate(args.family, tasks.example_seed(args.family, "eval", i), args.length)
        prompt_len = len(ex.prompt_ids)
        needed = torch.tensor(tasks.needed_positions(ex))
        needed = needed[needed < prompt_len - config.window]  # older than the window: only the policy keeps them
        state = TrainForward(config)
        model(input_ids=torch.tensor([ex.prompt_ids + ex.answer_ids]), kvpop_train=state, use_cache=False)
        learned = kept_at_answer(state.records, config, prompt_len - 1, needed, oracle=False)
        oracle = kept_at_answer(state.records, config, prompt_len - 1, needed, oracle=True)
        per_example.append({"index": i, "style": ex.style, "regime": ex.regime, "needed_before_window": len(needed),
                            "learned": round(float(learned.mean()), 3), "oracle": round(float(oracle.mean()), 3)})
        print(per_example[-1], flush=True)
        if len(needed):
            learned_sum = learned if learned_sum is None else learned_sum + learned
            oracle_sum = oracle if oracle_sum is None else oracle_sum + oracle
            used += 1
    row = {"model": args.model, "family": args.family, "length": args.length, "sinks": config.sinks,
           "window": config.window, "topk": config.topk, "examples": per_example,
           "learned_by_layer_head": (learned_sum / used).round(decimals=3).tolist() if used else None,
           "oracle_by_layer_head": (oracle_sum / used).round(decimals=3).tolist() if used else None}
    print("learned [layer x kv head]:", row["learned_by_layer_head"])
    print("oracle  [layer x kv head]:", row["oracle_by_layer_head"])
    if args.out:
        write_results(args.out, make_results("probe", [row], device="cpu", model=args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
