"""Where does a teacher go wrong on ``trace``? Teacher-forced operand-value lookups, by depth regime.

    python benchmarks/trace_lookup_probe.py --model runs/teacher-a --format direct --out results/raw/NAME.json

For ``n`` eval-split trace prompts, the answer is fed to the model (teacher forcing) and, at every position where it
must write the value of a *definition* (``let NAME = D .`` in the prompt), the argmax is classified: right; the value
of the definition next to it in the prompt (``neighbour``); the value of another definition (``other_def``); or
anything else. ``--format direct`` feeds answers as the first testbed version wrote them (``step 1 : c = a + b ;
7 + 3 = 0 ; c = 0 .``: the value of ``a`` follows four tokens after its name), ``--format restated`` as they are now
(``step 1 : c = a + b ; a = 7 ; b = 3 ; 7 + 3 = 0 ; c = 0 .``: the value follows the bigram ``a =``). It also counts
how often the model predicts ``answer`` after the last step (knowing when the program is done).

``neighbour`` is tested before ``other_def``, and with 3-6 definitions most other definitions are neighbours, so a
model that writes a random other definition's value scores mostly ``neighbour``: ``trace_lookup_diag.py`` compares
the offsets with that null (``docs/notes/trace_diagnosis.md``).
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

from kvlearn import load_model
from kvlearn.results import make_results, write_results
from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import VOCAB, WORD_TO_ID

_STEP, _SEMI, _EQ, _COLON = WORD_TO_ID["step"], WORD_TO_ID[";"], WORD_TO_ID["="], WORD_TO_ID[":"]


def direct_answer(answer: list[int]) -> list[int]:
    """The answer without the restated bindings (``a = 7 ; b = 3 ;``) that follow each step's program line."""
    out, j = [], 0
    while j < len(answer):
        out.append(answer[j])
        if answer[j] == _STEP:  # "step N : x = a op b ;" is 9 tokens; the next 8 are the restatement
            out.extend(answer[j + 1 : j + 9])
            j += 9 + 8
            continue
        j += 1
    return out


def definitions(example) -> list[tuple[int, int]]:
    """``(name id, value)`` of every ``let NAME : D .`` (before the trace diagnosis: ``let NAME = D .``) of the prompt,
    in prompt order."""
    p, let = example.prompt_ids, WORD_TO_ID["let"]
    return [(p[i + 1], int(VOCAB[p[i + 3]])) for i in range(len(p) - 4) if p[i] == let and p[i + 2] in (_EQ, _COLON)]


def value_positions(answer: list[int], fmt: str) -> list[tuple[int, int]]:
    """``(answer index, operand name id)`` of every operand value the model writes."""
    out = []
    for j, t in enumerate(answer):
        if t != _STEP:
            continue
        a, b = answer[j + 5], answer[j + 7]  # step N : x = a op b ;
        if fmt == "direct":
            out += [(j + 9, a), (j + 11, b)]
        else:  # ; a = va ; b = vb ;
            out += [(j + 11, a), (j + 15, b)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder")
    ap.add_argument("--format", choices=("direct", "restated"), default="direct", help="answer format fed to the model")
    ap.add_argument("--n", type=int, default=40, help="trace prompts (eval split)")
    ap.add_argument("--length", type=int, default=1024, help="example length in tokens")
    ap.add_argument("--out", default=None, help="results file (.json)")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    kinds = collections.Counter()
    by_regime = collections.defaultdict(collections.Counter)
    stop_right = 0
    for i in range(args.n):
        e = tasks.generate("trace", tasks.example_seed("trace", "eval", i), args.length)
        answer = direct_answer(e.answer_ids) if args.format == "direct" else list(e.answer_ids)
        defs = definitions(e)
        value_of = dict(defs)
        order = [name for name, _ in defs]
        ids = torch.tensor([e.prompt_ids + answer])
        with torch.no_grad():
            pred = model(input_ids=ids).logits.argmax(-1)[0]
        p = len(e.prompt_ids)
        for j, name in value_positions(answer, args.format):
            if name not in value_of:  # a step result, not a definition
                continue
            got = VOCAB[int(pred[p + j - 1])]
            k = order.index(name)
            neighbours = {value_of[order[x]] for x in (k - 1, k + 1) if 0 <= x < len(order)}
            if got == str(value_of[name]):
                kind = "right"
            elif got.isdigit() and int(got) in neighbours:
                kind = "neighbour"
            elif got.isdigit() and int(got) in value_of.values():
                kind = "other_def"
            else:
                kind = "other"
            kinds[kind] += 1
            by_regime[e.regime][kind] += 1
        at = answer.index(WORD_TO_ID["answer"])
        stop_right += int(pred[p + at - 1]) == WORD_TO_ID["answer"]
    total = sum(kinds.values())
    row = {"format": args.format, "n": args.n, "length": args.length, "lookups": total,
           "right": kinds["right"] / total, "kinds": dict(kinds),
           "right_by_regime": {r: c["right"] / sum(c.values()) for r, c in sorted(by_regime.items())},
           "stop_right": stop_right / args.n}
    print(row)
    if args.out:
        write_results(args.out, make_results("probe", [row], device="cpu", model=args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
