"""Scorer-only fit: how well does each KVpop scorer learn the boundary target of the frozen teacher? (CPU)

    python benchmarks/kvpop_scorer_fit.py --scorers mlp mlstm --steps 300 --length 1024 --out /tmp/fit.json

The teacher (``--model``) runs dense once over a pool of training rows (``kvlearn.testbed.training_batch``, the
retrofit's data) and over eval-split examples of niah / vt / recall; every layer's post-RoPE keys, values and the
future-attention target (``--reduction``, default the retrofit's peak; dense normalisers) are kept. Then, per
scorer arm, fresh per-layer KVpop modules (scorer + learned decay, ``--decay-init``) are trained on the boundary
loss alone, exactly as the retrofit's ``distill_losses`` builds it (teacher policy on the target with the layer's
decay, ``--queries`` sampled query positions per step, AdamW(0.9, 0.95) at ``lr_new`` for the scorer, warm-up then
cosine to 0.1, gradient clip 1). Two simplifications keep it cheap on a CPU: the decay is frozen at ``--decay-init``
(so each row's teacher policy is computed once), and ``--layers`` may train a subset of the (independent) layers.
The backbone is frozen, so the target does not move: this isolates what the scorer can learn from what the
backbone adapts to.

Reported per arm, at a few checkpoints of training, on the examples of the first of ``--splits`` (default eval;
every further split, e.g. ``heldout``, the haystack styles and depth regimes training never sees, is reported the
same way under its own key):

- ``boundary`` / ``accuracy``: the boundary loss and agreement over every valid decision (all query positions);
- ``needles``: at the answer query (the last prompt token), the share of the needed prompt tokens older than the
  window (``testbed.needed_positions``) that the learned running top-k keeps (``needles_teacher``: the teacher
  policy's share, the ceiling of the target);
- ``kept_overlap``: the share of the teacher policy's kept tokens at that query that the learned policy keeps;
- ``score_std``: the within-sequence standard deviation of the raw scores (0 = a constant scorer), and the
  gradient norm of each scorer parameter at the first step.

Arms are ``NAME`` or ``NAME:key=value,...`` with NAME in ``mlp``, ``linear``, ``mlstm`` and keys ``lr`` (lr_new
override), ``forget`` (mLSTM forget-gate bias range ``lo/hi``), ``delayed`` (0/1), ``skip`` (0/1: the mLSTM's skip
path, :class:`kvlearn.kvpop.scorers.MLSTMScorer` ``skip``), ``norm`` (0/1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import kvlearn
from kvlearn.threads import THREADS_HELP, set_threads, thread_count
from kvlearn import KVpopConfig
from kvlearn.errors import KVLearnError, check
from kvlearn.kvpop.loss import boundary_loss
from kvlearn.kvpop.modules import KVpopModules
from kvlearn.kvpop.policy import (LearnedDecay, TeacherPolicy, boundary_decisions, sample_query_positions,
                                  static_priorities, teacher_policy)
from kvlearn.kvpop.scorers import MLSTMScorer
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.future_target import causal_lse, future_attention_target
from kvlearn.ops.masks import retention_mask_dense
from kvlearn.train.schedule import warmup_cosine
from kvlearn.testbed import example_seed, generate, needed_positions, training_batch

RECORD = "kvfit_record"


def record_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, kvfit=None, **kwargs):
    """SDPA attention that also stores the layer's post-RoPE ``(query, key, value, scaling)`` in ``kvfit``."""
    if kvfit is not None:
        kvfit[module.layer_idx] = (query.detach(), key.detach(), value.detach(), scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@torch.no_grad()
def collect(model, input_ids: torch.Tensor, window: int, reduction: str) -> list[tuple]:
    """Per layer ``(key [B,H,T,D], value, target [B,H,T])`` of one dense teacher forward (dense normalisers)."""
    rec: dict = {}
    model(input_ids=input_ids, kvfit=rec, use_cache=False)
    out = []
    for layer in sorted(rec):
        q, k, v, scale = rec[layer]
        lse = causal_lse(q, k, scale=scale)
        target = future_attention_target(q, k, lse, window, eps=1e-6, scale=scale, reduction=reduction)
        out.append((k.float(), v.float(), target.float()))
    return out


TEACHER_FIELDS = [f.name for f in dataclasses.fields(TeacherPolicy)]


def add_teacher(per_layer, cfg: KVpopConfig, layers) -> list[tuple]:
    """``(key, value, target, TeacherPolicy)`` of the kept ``layers``; the policy at the initial decay."""
    log_gamma = LearnedDecay(per_layer[0][0].shape[1], cfg.decay_min, cfg.decay_max, cfg.decay_init)().detach()
    return [(k, v, t, teacher_policy(t, log_gamma, cfg.sinks, cfg.window, cfg.topk))
            for i, (k, v, t) in enumerate(per_layer) if i in layers]


def parse_arm(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    opts = dict(kv.split("=") for kv in rest.split(",") if kv)
    return name, opts


def build_modules(name: str, opts: dict, cfg: KVpopConfig, layers: int, heads: int, head_dim: int) -> list:
    """Fresh KVpop modules of one arm, one per layer. ``mlstm`` is the paper's plain delayed readout unless the arm
    says ``skip=1`` (not KVpopConfig's default, so that an arm means what it meant when its results were recorded)."""
    delayed = opts.get("delayed", "1") == "1"
    mods = []
    for _ in range(layers):
        m = KVpopModules(KVpopConfig(**{**cfg.__dict__, "scorer": name, "delayed_readout": delayed,
                                        "mlstm_skip": opts.get("skip", "0") == "1"}), heads, head_dim)
        if name == "mlstm" and any(k in opts for k in ("forget", "norm")):  # options KVpopConfig does not carry
            lo, hi = (float(x) for x in opts.get("forget", "3/6").split("/"))
            m.scorer = MLSTMScorer(heads, head_dim, window=cfg.window, delayed_readout=delayed,
                                   use_norm=opts.get("norm", "0") == "1", forget_bias_range=(lo, hi),
                                   skip=opts.get("skip", "0") == "1")
        mods.append(m)
    return mods


def layer_loss(mod, k, v, target, cfg, queries, teacher=None):
    raw = mod.scorer(k, v)
    log_gamma = mod.decay()
    pri = static_priorities(raw, log_gamma)
    if teacher is None:
        teacher = teacher_policy(target, log_gamma.detach(), cfg.sinks, cfg.window, cfg.topk)
    dec = boundary_decisions(teacher, queries, cfg.sinks, cfg.window, cfg.topk)
    res = boundary_loss(pri, teacher.priorities, dec, temperature=cfg.loss_temperature,
                        margin_weighting=cfg.margin_weighting, margin_min_weight=cfg.margin_min_weight,
                        margin_temperature=cfg.margin_temperature, balance=cfg.balance,
                        balance_clip=tuple(cfg.balance_clip))
    return res, raw, pri, teacher


@torch.no_grad()
def evaluate(mods, eval_data, cfg) -> dict:
    """Means over eval examples, layers and heads of the metrics in the module docstring."""
    sums = {"boundary": 0.0, "accuracy": 0.0, "kept_overlap": 0.0, "score_std": 0.0}
    n = 0
    learned: dict = {}
    teacher_kept: dict = {}
    for fam, layers, needed, qpos in eval_data:
        T = layers[0][0].shape[2]
        allq = torch.arange(cfg.sinks + cfg.window + cfg.topk, T)
        for mod, (k, v, target, teacher) in zip(mods, layers):
            res, raw, pri, teacher = layer_loss(mod, k, v, target, cfg, allq, teacher)
            ranks, cut = running_topk_cutoff(pri, cfg.sinks, cfg.window, cfg.topk)
            row = retention_mask_dense(ranks, cut, cfg.sinks, cfg.window)[0, :, qpos]  # [H, T]
            trow = retention_mask_dense(teacher.ranks, teacher.cutoffs, cfg.sinks, cfg.window)[0, :, qpos]
            elig = torch.zeros(T, dtype=torch.bool)
            elig[cfg.sinks:qpos - cfg.window + 1] = True
            sums["boundary"] += float(res.loss)
            sums["accuracy"] += float(res.accuracy)
            tk = trow & elig
            sums["kept_overlap"] += float((row & tk).sum() / tk.sum().clamp(min=1))
            sums["score_std"] += float(raw[..., : qpos + 1].std(dim=-1).mean())
            n += 1
            if len(needed):
                learned.setdefault(fam, []).append(row[:, needed].float().mean().item())
                teacher_kept.setdefault(fam, []).append(trow[:, needed].float().mean().item())
    out = {k: round(v / n, 4) for k, v in sums.items()}
    out["needles_by_family"] = {f: round(sum(x) / len(x), 4) for f, x in learned.items()}
    out["needles"] = round(sum(out["needles_by_family"].values()) / max(1, len(learned)), 4)
    out["needles_teacher"] = round(sum(sum(x) / len(x) for x in teacher_kept.values()) / max(1, len(teacher_kept)), 4)
    return out


def evaluate_splits(mods, eval_sets: dict, cfg) -> dict:
    """:func:`evaluate` on the first split's examples, and on each further split's under its name."""
    (_, data), *rest = eval_sets.items()
    out = evaluate(mods, data, cfg)
    for split, more in rest:
        out[split] = evaluate(mods, more, cfg)
    return out


def train_arm(spec: str, train_data, eval_sets: dict, cfg, args) -> dict:
    name, opts = parse_arm(spec)
    torch.manual_seed(args.seed)
    layers = len(train_data[0])
    heads, head_dim = train_data[0][0][0].shape[1], train_data[0][0][0].shape[3]
    mods = build_modules(name, opts, cfg, layers, heads, head_dim)
    lr_new = float(opts.get("lr", args.lr_new))
    scorer_params = [p for m in mods for p in m.scorer.parameters()]
    for m in mods:  # the decay stays at --decay-init: the teacher policies are computed once (see add_teacher)
        m.decay.requires_grad_(False)
    opt = torch.optim.AdamW([{"params": scorer_params, "lr": lr_new}], weight_decay=0.0, betas=(0.9, 0.95))
    T = train_data[0][0][0].shape[2]
    history, first_grads = [], None
    checkpoints = sorted(set([0] + [int(args.steps * f) for f in (0.25, 0.5, 1.0)]))
    t0 = time.time()
    train_loss = []
    for step in range(args.steps + 1):
        if step in checkpoints:
            ev = evaluate_splits(mods, eval_sets, cfg)
            ev.update(step=step, train_boundary=round(sum(train_loss[-50:]) / max(1, len(train_loss[-50:])), 4),
                      seconds=round(time.time() - t0, 1))
            history.append(ev)
            print(f"[{spec}] {json.dumps(ev)}", flush=True)
        if step == args.steps:
            break
        opt.param_groups[0]["lr"] = warmup_cosine(lr_new, step, step / args.steps, args.warmup, 0.1)
        batch = [train_data[(step * args.batch + i) % len(train_data)] for i in range(args.batch)]
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        queries = sample_query_positions(T, cfg.sinks, cfg.window, cfg.topk, args.queries, 0.5, generator=gen)
        losses = []
        for li, mod in enumerate(mods):
            k = torch.cat([b[li][0] for b in batch])
            v = torch.cat([b[li][1] for b in batch])
            target = torch.cat([b[li][2] for b in batch])
            teacher = TeacherPolicy(*(torch.cat([getattr(b[li][3], f) for b in batch])
                                      if isinstance(getattr(batch[0][li][3], f), torch.Tensor)
                                      else getattr(batch[0][li][3], f) for f in TEACHER_FIELDS))
            losses.append(layer_loss(mod, k, v, target, cfg, queries, teacher)[0].loss)
        loss = torch.stack(losses).mean()
        loss.backward()
        if first_grads is None:
            first_grads = {n: round(float(p.grad.norm()), 6) if p.grad is not None else None
                           for n, p in mods[0].scorer.named_parameters()}
        torch.nn.utils.clip_grad_norm_(scorer_params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_loss.append(float(loss))
    return {"arm": spec, "history": history, "first_step_grad_norms_layer0": first_grads}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/testbed-teacher")
    ap.add_argument("--scorers", nargs="+", default=["mlp", "mlstm"])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--decay-init", type=float, default=0.99999)
    ap.add_argument("--reduction", default="peak")
    ap.add_argument("--train-rows", type=int, default=48)
    ap.add_argument("--eval-n", type=int, default=4, help="evaluation examples per family (niah, vt, recall) and split")
    ap.add_argument("--splits", nargs="+", default=["eval"], choices=("eval", "heldout"),
                    help="evaluation splits (the first one's metrics at the top level, each further one under its "
                         "name)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--lr-new", type=float, default=1e-3)
    ap.add_argument("--lr-decay", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="layers to train (default all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except KVLearnError as err:
        print(f"kvpop_scorer_fit: error: {err}", file=sys.stderr)
        return 2


ARMS = ("mlp", "linear", "mlstm")
ARM_KEYS = ("lr", "forget", "delayed", "skip", "norm")


def check_arm(spec: str) -> None:
    """One-line error for an arm that is not ``NAME`` or ``NAME:key=value,...`` (module docstring)."""
    name, _, rest = spec.partition(":")
    check(name in ARMS, f"arm {spec!r}: scorer {name!r} is unknown: expected one of {', '.join(ARMS)}")
    for item in filter(None, rest.split(",")):
        key, eq, _ = item.partition("=")
        check(eq == "=" and key in ARM_KEYS,
              f"arm {spec!r}: option {item!r} is invalid: expected key=value with key in {', '.join(ARM_KEYS)}")


def run(args) -> int:
    for spec in args.scorers:
        check_arm(spec)
    check(len(set(args.splits)) == len(args.splits), f"--splits {' '.join(args.splits)}: a split is named twice")
    check(args.steps >= 1 and args.train_rows >= 1 and args.eval_n >= 1,
          f"--steps {args.steps}, --train-rows {args.train_rows}, --eval-n {args.eval_n}: expected each >= 1")
    set_threads(args.threads)

    cfg = KVpopConfig(sinks=args.sinks, window=args.window, topk=args.topk, decay_init=args.decay_init,
                      target_reduction=args.reduction)
    model = kvlearn.load(args.model, dtype=torch.float32, device="cpu")
    AttentionInterface.register(RECORD, record_attention)
    AttentionMaskInterface.register(RECORD, sdpa_mask)
    model.set_attn_implementation(RECORD)

    layers = set(args.layers) if args.layers else set(range(model.config.num_hidden_layers))
    t0 = time.time()
    train_data = []
    for b in range(0, args.train_rows, 8):
        ids, _ = training_batch(min(8, args.train_rows - b), args.length, seed=1000 + b, dense=0.75)
        per_layer = collect(model, ids, args.window, args.reduction)
        for r in range(ids.shape[0]):
            train_data.append(add_teacher([(k[r:r + 1], v[r:r + 1], t[r:r + 1]) for k, v, t in per_layer], cfg,
                                          layers))
    eval_sets = {}
    for split in args.splits:
        eval_data = eval_sets.setdefault(split, [])
        for fam in ("niah", "vt", "recall"):
            for i in range(args.eval_n):
                ex = generate(fam, example_seed(fam, split, i), args.length)
                plen = len(ex.prompt_ids)
                needed = torch.tensor([p for p in needed_positions(ex) if p < plen - args.window and p >= args.sinks],
                                      dtype=torch.long)
                ids = torch.tensor([ex.prompt_ids + ex.answer_ids])
                eval_data.append((fam, add_teacher(collect(model, ids, args.window, args.reduction), cfg, layers),
                                  needed, plen - 1))
    print(f"collected {len(train_data)} train rows, {sum(map(len, eval_sets.values()))} evaluation examples "
          f"({', '.join(args.splits)}) in {time.time() - t0:.0f}s", flush=True)

    results = [train_arm(spec, train_data, eval_sets, cfg, args) for spec in args.scorers]
    for r in results:
        print(json.dumps({"arm": r["arm"], "final": r["history"][-1], "grads": r["first_step_grad_norms_layer0"]}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "command": " ".join(sys.argv), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
