"""Does a teacher's key -> value lookup select the key, or copy any pair? Teacher-forced recall lookups.

    python benchmarks/recall_lookup_errors.py --model runs/teacher-a --n 20 --out results/raw/NAME.json

For ``n`` eval-split recall prompts at ``--length``, the expected answer (``KEY : D D D , KEY : ...``) is fed to the
model (teacher forcing) and, at the first value digit of every queried key, the argmax is classified: ``right``;
the first digit of another pair's value in the prompt and not the right one (``other_pair``); anything else
(``other``). A model without name-selective retrieval writes the first digit of a random pair: with ``m`` pairs
whose first digits are spread over 0-9, about 0.1 ``right`` by chance and most of the rest ``other_pair``. The
whole-value line (all three digits right) is reported too.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

from kvlearn import load_model
from kvlearn.results import make_results, write_results
from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import WORD_TO_ID

_COLON, _DOT = WORD_TO_ID[":"], WORD_TO_ID["."]


def prompt_pairs(prompt: list[int]) -> dict[int, list[int]]:
    """``{key: [d, d, d]}`` of the prompt's ``KEY : D D D .`` items."""
    pairs = {}
    for i in range(1, len(prompt) - 4):
        if prompt[i] == _COLON and prompt[i + 4] == _DOT:
            pairs[prompt[i - 1]] = prompt[i + 1 : i + 4]
    return pairs


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--split", default="eval", choices=tasks.SPLITS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = load_model(args.model, dtype=torch.float32, device="cpu")
    counts, whole, total = collections.Counter(), 0, 0
    for i in range(args.n):
        ex = tasks.generate("recall", tasks.example_seed("recall", args.split, i), args.length)
        pairs = prompt_pairs(ex.prompt_ids)
        ids = torch.tensor([ex.prompt_ids + ex.answer_ids])
        pred = model(input_ids=ids).logits[0].argmax(-1)
        P = len(ex.prompt_ids)
        for j, tok in enumerate(ex.answer_ids[:-3]):
            if tok != _COLON or ex.answer_ids[j - 1] not in pairs:
                continue
            key, pos = ex.answer_ids[j - 1], P + j  # logits at the colon predict the first digit
            want = pairs[key]
            got = int(pred[pos])
            firsts = {v[0] for k, v in pairs.items() if k != key} - {want[0]}
            counts["right" if got == want[0] else "other_pair" if got in firsts else "other"] += 1
            whole += all(int(pred[pos + t]) == want[t] for t in range(3))
            total += 1
    shares = {k: round(counts[k] / total, 3) for k in ("right", "other_pair", "other")}
    row = {"model": args.model, "split": args.split, "length": args.length, "examples": args.n, "lookups": total,
           "first_digit": shares, "whole_value_right": round(whole / total, 3)}
    print(row)
    if args.out:
        write_results(args.out, make_results("probe", [row], device="cpu", model=args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
