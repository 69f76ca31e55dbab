"""Why does a teacher miss trace's definition lookups? Error attribution, attention at the lookup, causal edits.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/trace_lookup_diag.py --model runs/teacher-68c180d \
        --format restated --n 30 --out results/raw/trace_diag_68c180d.json
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/trace_lookup_diag.py --model runs/teacher-42c37b8 \
        --format direct --n 30 --out results/raw/trace_diag_42c37b8.json

For ``n`` eval-split trace prompts (length 1024) the answer is teacher-forced (``--format`` as in
``trace_lookup_probe.py``) and, at every position where the model must write the value of a definition
(``let NAME = D .``), it reports:

* ``errors``: accuracy, and for wrong answers whose digit is the value of exactly one other definition, that
  definition's offset in prompt order (-1 = the definition just before the right one) with the null rate of a random
  other definition, plus accuracy by number of definitions, by regime and by distance;
* ``attention``: per layer and head, the mean attention mass from the lookup query (the token before the value)
  onto the right definition (its name and its digit), onto the other definitions, onto the program lines and onto
  the answer so far; ``name_match`` = mass on the right definition's 5 tokens / mass on all definitions' tokens
  (1 / n_defs is chance);
* ``causal``: the same lookups after editing the prompt: ``shuffle`` (the definitions' prompt slots permuted, answer
  unchanged), ``rename`` (a random permutation of the 26 letters everywhere), ``vt_names`` / ``key_names`` (every
  trace letter replaced by a distinct vt name / niah-recall key), ``spaced`` (the definitions moved apart to even spacing in the first half), and
  ``packed`` (all definitions moved into one contiguous block), ``colon`` / ``colon_keys`` (``let a : 7 .`` and, restated,
  ``a : 7 ;``: recall's separator instead of vt's ``=``, with letters / with niah-recall keys as names; the ``direct``
  answer keeps its ``=``). For ``shuffle`` it also reports whether a wrong
  digit follows the slot (positional) or the name of the definition it was copied from before the edit.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys

import torch
from transformers import AutoModelForCausalLM

from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import VOCAB, WORD_TO_ID
from kvlearn.testbed.vocab import KEYS, TRACE_NAMES, VT_NAMES

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from trace_lookup_probe import direct_answer, value_positions  # noqa: E402

_LET, _EQ, _DOT, _STEP = WORD_TO_ID["let"], WORD_TO_ID["="], WORD_TO_ID["."], WORD_TO_ID["step"]
_COLON = WORD_TO_ID[":"]
_PROGRAM = WORD_TO_ID["program"]
_TRACE = [WORD_TO_ID[n] for n in TRACE_NAMES]
_VT = [WORD_TO_ID[n] for n in VT_NAMES]
_KEYS = [WORD_TO_ID[n] for n in KEYS]
_DIGIT_IDS = [WORD_TO_ID[str(d)] for d in range(10)]


def def_slots(prompt: list[int]) -> list[int]:
    """Start index of every ``let NAME = D .`` in the prompt, in prompt order."""
    return [i for i in range(len(prompt) - 4)
            if prompt[i] == _LET and prompt[i + 2] in (_EQ, _COLON) and prompt[i + 4] == _DOT]


def lookups(prompt: list[int], answer: list[int], fmt: str):
    """``(query position in the full sequence, def index in prompt order)`` for each definition-value lookup."""
    slots = def_slots(prompt)
    name_at = {prompt[s + 1]: k for k, s in enumerate(slots)}
    p = len(prompt)
    return [(p + j - 1, name_at[n]) for j, n in value_positions(answer, fmt) if n in name_at]


def run(model, prompt, answer, fmt, attn=False):
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=attn)
    return out


def classify(logits, prompt, queries):
    """Per lookup: (right?, predicted digit, def index whose value it is if unique else None, n_defs, values)."""
    slots = def_slots(prompt)
    vals = [int(VOCAB[prompt[s + 3]]) for s in slots]
    rows = []
    for q, k in queries:
        got = VOCAB[int(logits[q].argmax())]
        d = int(got) if got.isdigit() else None
        owners = [i for i, v in enumerate(vals) if v == d]
        rows.append(dict(right=d == vals[k], got=d, k=k, owner=owners[0] if len(owners) == 1 else None,
                         n_defs=len(slots), unique_right=vals.count(vals[k]) == 1,
                         dist=q - slots[k], name=VOCAB[prompt[slots[k] + 1]]))
    return rows


def edit_prompt(e, kind, rng):
    """An edited (prompt, answer) with the same right answers; None if the edit does not apply."""
    prompt, answer = list(e.prompt_ids), list(e.answer_ids)
    slots = def_slots(prompt)
    items = [prompt[s : s + 5] for s in slots]
    if kind == "shuffle":
        if len(items) < 2:
            return None
        perm = list(range(len(items)))
        while perm == list(range(len(items))):
            rng.shuffle(perm)
        for s, j in zip(slots, perm):
            prompt[s : s + 5] = items[j]
        return prompt, answer, perm
    if kind in ("colon", "colon_keys"):  # "let a : 7 ." and (restated) "; a : 7 ; b : 3 ;": recall's separator
        for s in slots:
            prompt[s + 2] = _COLON
        for j, t in enumerate(answer):
            if t == _STEP:
                answer[j + 10] = answer[j + 14] = _COLON
        if kind == "colon":
            return prompt, answer, None
        kind = "key_names"
    if kind in ("rename", "vt_names", "key_names"):
        pool = {"rename": _TRACE, "vt_names": _VT, "key_names": _KEYS}[kind]
        m = dict(zip(_TRACE, rng.sample(pool, 26)))
        return [m.get(t, t) for t in prompt], [m.get(t, t) for t in answer], None
    if kind in ("spaced", "packed"):
        body = [t for i, t in enumerate(prompt) if not any(s <= i < s + 5 for s in slots)]
        # filler region: body[1 : prog], where prog is the start of "program :"
        prog = body.index(_PROGRAM)
        order = list(range(len(items)))
        if kind == "packed":
            at = [1 + (prog - 1) // 4] * len(items)
        else:
            at = [1 + int((i + 0.5) / len(items) * (prog - 1) / 2) for i in range(len(items))]
        # insert at sentence boundaries: move each insertion point forward to just after a "." (or keep if salad)
        out = []
        ins = collections.defaultdict(list)
        for o, a in zip(order, at):
            b = a
            while b < prog and body[b - 1] != _DOT and b - a < 14:
                b += 1
            ins[b].append(items[o])
        for i, t in enumerate(body):
            for it in ins.get(i, []):
                out.extend(it)
            out.append(t)
        return out, answer, None
    raise ValueError(kind)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--format", choices=("direct", "restated"), default="restated")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--edits", default="shuffle,rename,vt_names,spaced,packed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager").eval()
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    rows = []
    att = collections.defaultdict(lambda: torch.zeros(L, H))
    n_att = 0
    edits = [x for x in args.edits.split(",") if x]
    causal = {k: [] for k in edits}
    follow = collections.Counter()
    for i in range(args.n):
        e = tasks.generate("trace", tasks.example_seed("trace", "eval", i), args.length)
        answer = direct_answer(e.answer_ids) if args.format == "direct" else list(e.answer_ids)
        prompt = list(e.prompt_ids)
        qs = lookups(prompt, answer, args.format)
        out = run(model, prompt, answer, args.format, attn=not args.no_attention)
        base = classify(out.logits[0], prompt, qs)
        for r in base:
            r.update(regime=e.regime, style=e.style, ex=i)
        rows += base
        if not args.no_attention:
            slots = def_slots(prompt)
            p = len(prompt)
            prog = prompt.index(_PROGRAM)
            for q, k in qs:
                for l, a in enumerate(out.attentions):
                    row = a[0, :, q, :]  # [H, T]
                    right = row[:, slots[k] : slots[k] + 5].sum(-1)
                    alld = sum(row[:, s : s + 5].sum(-1) for s in slots)
                    att["right_def"][l] += right
                    att["right_name"][l] += row[:, slots[k] + 1]
                    att["right_digit"][l] += row[:, slots[k] + 3]
                    att["other_defs"][l] += alld - right
                    att["other_names"][l] += sum(row[:, s + 1] for j, s in enumerate(slots) if j != k)
                    att["program"][l] += row[:, prog:p].sum(-1)
                    att["answer"][l] += row[:, p : q + 1].sum(-1)
                    att["bos"][l] += row[:, 0]
                    att["name_match"][l] += right / alld.clamp_min(1e-9)
                    att["chance"][l] += 1.0 / len(slots)
                n_att += 1
        rng = random.Random(1000 + i)
        for kind in edits:
            ed = edit_prompt(e, kind, rng)
            if ed is None:
                continue
            p2, a2, perm = ed
            if args.format == "direct":
                a2 = direct_answer(a2)
            qs2 = lookups(p2, a2, args.format)
            lg = run(model, p2, a2, args.format).logits[0]
            res = classify(lg, p2, qs2)
            causal[kind] += [r["right"] for r in res]
            if kind == "shuffle":
                # prompt slot s now holds original def perm[s]; original def j sits at slot inv[j]
                inv = {j: s for s, j in enumerate(perm)}
                for r0, r1 in zip(base, res):
                    if r0["right"] or r0["owner"] is None:
                        continue
                    # before: the wrong digit came from original def r0.owner (at slot r0.owner)
                    if r1["right"]:
                        follow["now_right"] += 1
                    elif r1["owner"] == inv[r0["owner"]]:
                        follow["same_name_as_before"] += 1
                    elif r1["owner"] == r0["owner"]:
                        follow["same_slot_as_before"] += 1
                    else:
                        follow["other"] += 1
    acc = sum(r["right"] for r in rows) / len(rows)
    wrong_u = [r for r in rows if not r["right"] and r["owner"] is not None]
    offs = collections.Counter(r["owner"] - r["k"] for r in wrong_u)
    null = collections.Counter()
    for r in wrong_u:
        for j in range(r["n_defs"]):
            if j != r["k"]:
                null[j - r["k"]] += 1 / (r["n_defs"] - 1)
    by = lambda key: {str(k): (round(sum(r["right"] for r in g) / len(g), 3), len(g)) for k, g in sorted(
        collections.defaultdict(list, {kk: [r for r in rows if key(r) == kk] for kk in {key(r) for r in rows}}).items())}
    summary = {
        "model": args.model, "format": args.format, "n": args.n, "lookups": len(rows), "acc": round(acc, 3),
        "wrong_is_other_def_value": round(sum(1 for r in rows if not r["right"] and r["got"] is not None and r["owner"] is not None or False) / max(1, sum(not r["right"] for r in rows)), 3),
        "wrong_unique_owner_offsets": {str(k): v for k, v in sorted(offs.items())},
        "null_offsets": {str(k): round(v, 1) for k, v in sorted(null.items())},
        "acc_by_n_defs": by(lambda r: r["n_defs"]),
        "acc_by_regime": by(lambda r: r["regime"]),
        "acc_by_style": by(lambda r: r["style"]),
        "acc_by_dist": by(lambda r: min(r["dist"] // 200 * 200, 800)),
        "acc_by_def_index": by(lambda r: r["k"]),
        "acc_by_name": by(lambda r: r["name"]),
        "causal_acc": {k: (round(sum(v) / len(v), 3), len(v)) for k, v in causal.items() if v},
        "shuffle_wrong_follows": dict(follow),
    }
    if n_att:
        summary["attention"] = {k: (v / n_att).round(decimals=3).tolist() for k, v in att.items()}
    print(json.dumps({k: v for k, v in summary.items() if k != "attention"}, indent=1))
    if n_att:
        nm = att["name_match"] / n_att
        rd = att["right_def"] / n_att
        od = att["other_defs"] / n_att
        print("layer: top heads by name_match (name_match, mass on right def, mass on other defs)")
        for l in range(L):
            top = sorted(range(H), key=lambda h: -float(nm[l, h]))[:3]
            print(l, [(h, round(float(nm[l, h]), 2), round(float(rd[l, h]), 3), round(float(od[l, h]), 3)) for h in top])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
