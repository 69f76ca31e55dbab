"""Which part of a trace answer does a model get wrong? Teacher-forced argmax accuracy of each kind of digit in the
``trace`` answers (``step 1 : u = p - t ; p = 4 ; t = 9 ; 4 - 9 = 5 ; u = 5 . ... answer : 5 <eos>``):

    PYTHONPATH=src python benchmarks/trace_token_accuracy.py --model checkpoints/testbed-teacher --length 1024 --n 20

Kinds (by the digit's place in the step line, read from the answer's words):
``lookup_def`` the value restated after a definition's name (``p = 4 ;``, where the prompt has ``let p = 4 .``: a
retrieval from the haystack); ``lookup_computed`` the same for a variable an earlier step computed (``u = 5 ;`` in a
later step: a copy from the answer itself); ``arith_operand1`` / ``arith_operand2`` the operands of ``4 - 9``;
``arith_result`` the digit after ``4 - 9 =`` (the sum or difference mod 10); ``result_bind`` the ``5`` of
``u = 5 .``; ``step_no`` the step number; ``final`` the digit after ``answer :``. Every example is a fresh
evaluation-format prompt of the ``--split`` (examples 0.. of it), in float32 on the CPU by default. One line per kind,
and with ``--out`` a results file (``kvlearn.results.v1``, kind ``trace_token_accuracy``) with a row per kind. It separates "retrieval is missing" from "arithmetic is missing": the
shipped teacher of 68c180d gets everything but ``lookup_def`` right (docs/TESTBED.md).
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvlearn.testbed import tasks
from kvlearn.testbed.checkers import _definitions as definitions  # the checker's own parse of ``let X = D .``
from kvlearn.testbed.tokenizer import VOCAB
from kvlearn.train.pretrain import answer_predictions

KINDS = ("lookup_def", "lookup_computed", "arith_operand1", "arith_operand2", "arith_result", "result_bind",
         "step_no", "final")


def digit_kind(words: list[str], j: int, defined: set[str]) -> str:
    """The kind of the digit ``words[j]`` of a trace answer (``words``: the answer's words); ``defined``: the names
    the prompt defines with ``let X = D .``."""
    prev = words[j - 1] if j >= 1 else ""
    prev2 = words[j - 2] if j >= 2 else ""
    nxt = words[j + 1] if j + 1 < len(words) else ""
    if prev == ":" and prev2 == "answer":
        return "final"
    if prev == "step":
        return "step_no"
    if prev == "=" and prev2.isdigit():
        return "arith_result"
    if prev == "=" and nxt == ";":
        return "lookup_def" if prev2 in defined else "lookup_computed"
    if prev == "=" and nxt == ".":
        return "result_bind"
    if prev in ("+", "-"):
        return "arith_operand2"
    if nxt in ("+", "-"):
        return "arith_operand1"
    raise ValueError(f"unrecognised digit in a trace answer: ... {' '.join(words[max(0, j - 3) : j + 2])} ...")


@torch.no_grad()
def token_accuracy(model, length: int, n: int, split: str = "eval", batch_size: int = 4) -> dict[str, list[int]]:
    """``{kind: [correct, total]}`` over the answer digits of ``n`` trace examples of ``split`` at ``length``
    (predictions: :func:`kvlearn.train.pretrain.answer_predictions`, what the stage checks use)."""
    counts = {k: [0, 0] for k in KINDS}
    examples = [tasks.generate("trace", tasks.example_seed("trace", split, i), length) for i in range(n)]
    for e, pred in answer_predictions(model, examples, next(model.parameters()).device, batch_size):
        words = [VOCAB[t] for t in e.answer_ids]
        defined = set(definitions(e.prompt_text))
        for j, w in enumerate(words):
            if w.isdigit():
                kind = digit_kind(words, j, defined)
                counts[kind][0] += pred[j] == e.answer_ids[j]
                counts[kind][1] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/testbed-teacher", help="checkpoint folder")
    ap.add_argument("--length", type=int, default=1024, help=f"example length, {tasks.MIN_LENGTH}..{tasks.MAX_LENGTH}")
    ap.add_argument("--n", type=int, default=20, help="examples (>= 1)")
    ap.add_argument("--split", default="eval", help="eval or heldout")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--out", default=None, help="JSON file for the counts")
    args = ap.parse_args(argv)
    problems = []
    if not tasks.MIN_LENGTH <= args.length <= tasks.MAX_LENGTH:
        problems.append(f"--length={args.length} is invalid: expected {tasks.MIN_LENGTH}..{tasks.MAX_LENGTH}")
    if args.n < 1:
        problems.append(f"--n={args.n} is invalid: expected an integer >= 1")
    if args.split not in ("eval", "heldout"):
        problems.append(f"--split={args.split!r} is invalid: expected eval or heldout")
    if problems:
        print("trace_token_accuracy.py: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    from kvlearn import load_model

    model = load_model(args.model, dtype=torch.float32, device=args.device).eval()
    counts = token_accuracy(model, args.length, args.n, args.split)
    for kind, (right, total) in counts.items():
        if total:
            print(f"{kind:16s} {right}/{total} = {right / total:.3f}")
    if args.out:
        from kvlearn.results import make_results, write_results

        rows = [{"kind": k, "correct": r, "total": t, "accuracy": r / t if t else None} for k, (r, t) in counts.items()]
        write_results(args.out, make_results("trace_token_accuracy", rows, device=args.device, model=args.model,
                                             length=args.length, n=args.n, split=args.split))
    return 0


if __name__ == "__main__":
    sys.exit(main())
