"""What a teacher gets wrong in niah's multivalue answers: greedy, through the dense cache, classified per prompt.

    python benchmarks/niah_multivalue_errors.py --model checkpoints/testbed-teacher --out results/raw/NAME.json

The multivalue prompts among the first ``--n`` niah examples of ``--split`` (the harness's examples, so the same
prompts as ``results/testbed_teacher.json``) are answered greedily; each answer is ``right``, ``order`` (the key's
values, each once, in another order), ``repeated`` (only values of the key, one of them twice or more) or
``other``. The model's values are read from its answer's ``KEY is D D D D`` groups.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

from kvlearn import load_model
from kvlearn.eval.accuracy import EvalConfig, answer_batch, examples_for
from kvlearn.results import make_results, write_results
from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import ids_to_text


def groups(text: str) -> list[str]:
    """The values of ``KEY is D D D D , KEY is D D D D <eos>``: ``["D D D D", ...]``."""
    return [g.split(" is ", 1)[1].strip() for g in text.replace("<eos>", "").split(" , ") if " is " in g]


def classify(want: list[str], got: list[str]) -> str:
    if got == want:
        return "right"
    if sorted(got) == sorted(want):
        return "order"
    if got and set(got) <= set(want):
        return "repeated"
    return "other"


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/testbed-teacher")
    p.add_argument("--split", default="eval")
    p.add_argument("--n", type=int, default=100, help="niah examples of the split to look through")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load_model(args.model, dtype=dtype, device=args.device)
    cfg = EvalConfig(method="dense", budget=None, n_per_task=args.n, context=args.context,
                     batch_size=args.batch_size, split=args.split)
    examples = [e for e in examples_for(cfg, "niah") if e.variant == "multivalue"]
    rows, counts = [], collections.Counter()
    for start in range(0, len(examples), args.batch_size):
        batch = examples[start:start + args.batch_size]
        for ex, answer in zip(batch, answer_batch(model, cfg, batch, 0, model.config.eos_token_id)):
            want, got = groups(ids_to_text(ex.answer_ids)), groups(ids_to_text(answer.tokens))
            kind = classify(want, got)
            assert (kind == "right") == bool(tasks.score(ex, answer.tokens)), (ex.seed, want, got)
            counts[kind] += 1
            rows.append({"seed": ex.seed, "style": ex.style, "regime": ex.regime, "kind": kind, "want": want, "got": got})
            print(f"seed {ex.seed:5d} {ex.style:13s} {ex.regime:9s} {kind}", flush=True)
    print(dict(counts))
    if args.out:
        write_results(args.out, make_results("niah_multivalue_errors", rows, device=args.device, model=args.model,
                                             split=args.split, context=args.context, counts=dict(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
