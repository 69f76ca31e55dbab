"""Does a DMS student's per-head budget bind? The tokens its gates keep, per layer and KV head, against the slots.

    python benchmarks/dms_head_load.py --model runs/dms-student --budget 1024 --n 8 \\
        --out results/raw/NAME.json --heatmap results/raw/NAME.png

DMS trains its gates against one compression target, the mean closed fraction over layers, KV heads and keys
(``kvlearn.dms.attention.compression_loss``), so it may give some heads many tokens and others none (the KVpop paper's
appendix H: at CR 75% a few heads stay almost dense and many keep only the window). kvlearn serves DMS at a budget
``B`` per KV head (``DMSPolicy``: sinks, the window, and ``topk = B - sinks - window`` long-range slots; a kept token
over that evicts the kept token with the highest logit). A head whose gates keep more than ``topk`` tokens loses
some of them to the cap: this script measures how often, and what it costs the needed tokens.

For ``--n`` prompts of each ``--families`` member (``--split``, ``--length``), one teacher-forced forward under the
hard DMS rule with no budget (``DMSTrainForward(hard=True)``: what the gates keep) records every layer's gate logits
``alpha [kv_heads, T]``. At the query that starts the answer (the prompt's last token, ``q``), per layer and KV head:

- ``eligible``: the keys older than the window, ``sinks <= k <= q - window``;
- ``kept``: those whose decision logit ``alpha[k + 1]`` is <= 0 (the gates keep them); ``eviction_ratio`` =
  1 - kept / eligible (the appendix's quantity: 0 dense, 1 the window alone);
- ``load`` = kept / topk, ``binds`` = kept > topk: the cap evicts ``kept - topk`` tokens the gates kept;
- ``needles_gates``: the share of the example's needed tokens older than the window (``tasks.needed_positions``)
  that the gates keep, and ``needles_capped``: the share that the capped set keeps. The capped set is the ``topk``
  kept tokens with the lowest logits (earlier first on ties): the cache's online rule, run over these logits, ends
  with exactly that set (``capped_keep``, tested against a query-by-query simulation). The logits are the unbudgeted
  forward's: under the cap the later layers' inputs differ, so this is the first-order estimate of what the cap
  costs, not the served run itself.

Reported per family and over all: the share of (prompt, layer, head) triples whose budget binds, the median load per
layer and head, and the two needle shares (their means, and per layer and KV head: ``needles_*_by_layer_head``).
``--budget`` (default the checkpoint's) serves the same gates at another budget, so one run may compare e.g. 1024
and 2048 (``--budget 1024,2048``). ``--heatmap``: the median load per layer and KV head for the first budget (the
appendix's figure 8 analog, with the line at 1 where the cap binds). About 5 s an example at length 4096 on two CPU
cores for the testbed teacher's shape (32 prompts in 2.8 minutes, session 47; the dense bias is ``B * Hq * T^2``
floats per layer);
``--device cuda`` runs the same dense execution on the GPU (a bias of ``Hq * T^2`` bf16 per layer: 128 MiB at 4096).
"""

from __future__ import annotations

import argparse
import sys
import textwrap

import torch

import kvlearn
from kvlearn.threads import THREADS_HELP, set_threads, thread_count
from kvlearn.dms.apply import recorded_config
from kvlearn.dms.attention import DMSTrainForward, shift_left, use_train_attention
from kvlearn.results import make_results, write_results
from kvlearn.testbed import tasks


def capped_keep(alpha_next: torch.Tensor, eligible_end: int, sinks: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys the gates keep and which the capped cache holds, at a query whose eligible keys are
    ``sinks <= k < eligible_end``.

    ``alpha_next [heads, T]``: key ``k``'s decision logit (``alpha[k + 1]``, the logit of the next token) at index
    ``k``. Returns ``(kept, capped)``, bool ``[heads, T]``: ``kept`` = eligible and logit <= 0; ``capped`` = the
    ``topk`` kept keys with the lowest logits, the earlier key first among equal logits (the cache evicts the highest
    logit, the later key on ties; a streaming top-k keeps the top-k of all it has seen)."""
    heads, T = alpha_next.shape
    pos = torch.arange(T)
    eligible = (pos >= sinks) & (pos < eligible_end)
    kept = eligible[None, :] & (alpha_next <= 0)
    # rank by (logit, position): a stable sort on the logit after ordering by position
    order_key = torch.where(kept, alpha_next.double(), torch.full_like(alpha_next, float("inf"), dtype=torch.double))
    order = torch.argsort(order_key, dim=-1, stable=True)  # positions ascending among equal logits
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(T).expand(heads, T).contiguous())
    capped = kept & (rank < topk)
    return kept, capped


def example_load(alphas: dict[int, torch.Tensor], prompt_len: int, needed: list[int], sinks: int, window: int,
                 topk: int) -> dict:
    """Per layer and KV head of one example (``alphas``: layer -> ``[kv_heads, T]`` gate logits): ``kept``,
    ``eligible``, ``binds``, and the needle shares (None without needed tokens older than the window)."""
    q = prompt_len - 1
    end = q - window + 1  # keys k <= q - window are out of the window at query q
    need = torch.tensor([t for t in needed if sinks <= t < end], dtype=torch.long)
    kept_l, needles_g, needles_c = [], [], []
    for layer in sorted(alphas):
        a = alphas[layer]
        nxt = shift_left(a, float("inf"))  # key k <- alpha[k + 1]; the last key has no decision yet
        kept, capped = capped_keep(nxt, end, sinks, topk)
        kept_l.append(kept.sum(-1))
        if len(need):
            needles_g.append(kept[:, need].float().mean(-1))
            needles_c.append(capped[:, need].float().mean(-1))
    kept_t = torch.stack(kept_l)  # [layers, heads]
    return {"kept": kept_t, "eligible": max(end - sinks, 0), "binds": kept_t > topk,
            "needles_gates": torch.stack(needles_g) if needles_g else None,
            "needles_capped": torch.stack(needles_c) if needles_c else None, "n_needed": len(need)}


def plot_load(load: list[list[float]], path: str, title: str) -> None:
    """Median load ``[layers][kv_heads]`` as an image, the colour scale centred on 1 (where the cap binds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    t = torch.tensor(load)
    L, H = t.shape
    width = 2.4 + 0.9 * H  # inches: the colour bar's label and a title wrapped to fit (about 10 characters an inch)
    fig, ax = plt.subplots(figsize=(width, 1.4 + 0.45 * L))
    top = max(float(t.max()), 1.01)
    im = ax.imshow(t.numpy(), cmap="RdBu_r", norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top), aspect="auto")
    for i in range(L):
        for j in range(H):
            ax.text(j, i, f"{load[i][j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(H), [f"KV head {j}" for j in range(H)], fontsize=7)
    ax.set_yticks(range(L), [f"layer {i}" for i in range(L)], fontsize=7)
    fig.colorbar(im, ax=ax, label="kept / long-range slots (median; > 1: the cap evicts kept tokens)")
    ax.set_title(textwrap.fill(title, width=int(10 * width)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def median_grid(values: list[torch.Tensor]) -> list[list[float]]:
    return [[round(float(x), 3) for x in row] for row in torch.stack(values).float().median(dim=0).values]


def summarize(per_example: list[dict], topk: int) -> dict:
    """Shares and medians over examples for one budget."""
    binds = torch.stack([e["binds"] for e in per_example]).float()
    kept = [e["kept"] for e in per_example]
    out = {"topk": topk, "binds_share": round(float(binds.mean()), 4),
           "binds_share_by_layer_head": [[round(float(x), 3) for x in row] for row in binds.mean(0)],
           "kept_median_by_layer_head": median_grid(kept),
           "load_median_by_layer_head": median_grid([k.float() / topk for k in kept]),
           "eviction_ratio_median_by_layer_head": median_grid(
               [1 - k.float() / max(e["eligible"], 1) for k, e in zip(kept, per_example)]),
           "excess_mean": round(float(torch.stack([(k - topk).clamp(min=0).float() for k in kept]).mean()), 2)}
    with_needles = [e for e in per_example if e["n_needed"]]
    for key in ("needles_gates", "needles_capped"):
        out[f"{key}_mean"] = (round(float(torch.stack([e[key].mean() for e in with_needles]).mean()), 4)
                              if with_needles else None)
        # per layer and KV head, mean over the examples with needed tokens: which heads' caps take them
        out[f"{key}_by_layer_head"] = ([[round(float(x), 3) for x in row]
                                        for row in torch.stack([e[key] for e in with_needles]).mean(0)]
                                       if with_needles else None)
    return out


def parse_budgets(text: str | None, default: int | None, sinks: int, window: int) -> list[int]:
    """``--budget``: one or more comma-separated budgets, each > sinks + window (one-line ValueError otherwise)."""
    if text is None:
        if default is None:
            raise ValueError("the checkpoint records no budget: pass --budget B (tokens per KV head)")
        return [default]
    try:
        budgets = [int(b) for b in text.split(",")]
    except ValueError:
        raise ValueError(f"--budget {text!r}: expected one or more integers, comma-separated") from None
    for b in budgets:
        if b <= sinks + window:
            raise ValueError(f"--budget {b} is invalid: expected > sinks + window = {sinks + window} (at least one "
                             "long-range slot)")
    return budgets


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a DMS checkpoint folder (kvlearn retrofit --method dms's final/)")
    p.add_argument("--budget", default=None, help="tokens per KV head, or several comma-separated (default: the "
                                                  "checkpoint's)")
    p.add_argument("--families", default=",".join(tasks.FAMILIES), help="comma-separated testbed families")
    p.add_argument("--n", type=int, default=4, help="prompts per family")
    p.add_argument("--split", default="eval", choices=("eval", "heldout"))
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)
    p.add_argument("--out", default=None)
    p.add_argument("--heatmap", default=None, help="PNG of the median load per layer and KV head (first budget)")
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in tasks.FAMILIES]
    if bad or not families:
        print(f"dms_head_load: error: --families {args.families!r}: expected one or more of "
              f"{','.join(tasks.FAMILIES)}", file=sys.stderr)
        return 2
    if args.n < 1:
        print(f"dms_head_load: error: --n {args.n} is invalid: expected >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("dms_head_load: error: --device cuda requested but CUDA is not available: use --device cpu",
              file=sys.stderr)
        return 2
    set_threads(args.threads)
    model = kvlearn.load(args.model, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16,
                         device=args.device)
    config = recorded_config(model)
    if config is None:
        print(f"dms_head_load: error: {args.model!r} holds no DMS gates: expected a kvlearn retrofit --method dms "
              "output", file=sys.stderr)
        return 2
    try:
        budgets = parse_budgets(args.budget, config.budget, config.sinks, config.window)
    except ValueError as err:
        print(f"dms_head_load: error: {err}", file=sys.stderr)
        return 2
    use_train_attention(model)
    per_budget = {b: {f: [] for f in families} for b in budgets}
    examples = []
    for family in families:
        for i in range(args.n):
            ex = tasks.generate(family, tasks.example_seed(family, args.split, i), args.length)
            state = DMSTrainForward(config, hard=True, noise=False, backend="dense")  # the reference execution
            ids = torch.tensor([ex.prompt_ids], device=args.device)
            model(input_ids=ids, dms_train=state, use_cache=False)
            alphas = {layer: r.alpha[0].float().cpu() for layer, r in state.records.items()}
            needed = tasks.needed_positions(ex)
            for b in budgets:
                topk = b - config.sinks - config.window
                per_budget[b][family].append(example_load(alphas, len(ex.prompt_ids), needed, config.sinks,
                                                          config.window, topk))
            first = per_budget[budgets[0]][family][-1]
            examples.append({"family": family, "index": i, "style": ex.style, "regime": ex.regime,
                             "prompt_tokens": len(ex.prompt_ids), "eligible": first["eligible"],
                             "kept_max": int(first["kept"].max()), "kept_min": int(first["kept"].min()),
                             "binds_share": round(float(first["binds"].float().mean()), 3)})
            print(examples[-1], flush=True)
    rows = []
    for b in budgets:
        topk = b - config.sinks - config.window
        every = [e for f in families for e in per_budget[b][f]]
        rows.append({"model": args.model, "budget": b, "family": "all", "split": args.split, "length": args.length,
                     "sinks": config.sinks, "window": config.window, "trained_budget": config.budget,
                     "target_cr": config.target_cr, "n": len(every), **summarize(every, topk)})
        for f in families:
            rows.append({"model": args.model, "budget": b, "family": f, "split": args.split, "length": args.length,
                         "n": len(per_budget[b][f]), **summarize(per_budget[b][f], topk)})
    for r in rows:
        if r["family"] == "all":
            print(f"budget {r['budget']} (topk {r['topk']}): the cap binds for {r['binds_share']:.1%} of (prompt, layer, "
                  f"head); needed tokens kept by the gates {r['needles_gates_mean']}, under the cap "
                  f"{r['needles_capped_mean']}; median load [layer x kv head]: {r['load_median_by_layer_head']}")
    if args.heatmap:
        first = rows[0]
        plot_load(first["load_median_by_layer_head"], args.heatmap,
                  f"DMS {args.model}: kept / slots at budget {first['budget']} (topk {first['topk']}), "
                  f"{args.split}, median of {first['n']} prompts")
    if args.out:
        write_results(args.out, make_results("probe", rows, device=args.device, model=args.model,
                                             examples=examples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
