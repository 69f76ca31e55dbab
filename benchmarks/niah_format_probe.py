"""Why does a teacher miss niah answers? Teacher-forced answers on eval-format vs dense training-format prompts.

    python benchmarks/niah_format_probe.py --model checkpoints/testbed-teacher --length 4096 --n 24

For each niah variant (single, multikey) and prompt format (``dense=False``: the evaluation format, no earlier
answer in the prompt; ``dense=True``: the training format with in-context question/answer pairs), prints how many
of ``n`` held-out examples get every answer token right under teacher forcing, the index of the first wrong answer
token (1 = the separator after the key, ``is`` vs ``:``; 6 = the terminator), and a few wrong answers.
``results/raw/niah_format_probe_0c5393e.txt`` is its output for the run-2 teacher (commit 0c5393e), which led to the
format fix of run 3 (docs/TESTBED.md, "Teacher recipe"). CPU, a few minutes.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import ids_to_text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/testbed-teacher")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--show", type=int, default=6, help="wrong answers printed per row")
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for variant in ("single", "multikey"):
        for dense in (False, True):
            correct, first_wrong, shown = 0, {}, 0
            for i in range(args.n):
                ex = tasks.generate("niah", tasks.example_seed("niah", "eval", 500 + i), args.length, variant, dense=dense)
                with torch.no_grad():
                    pred = model(input_ids=torch.tensor([ex.prompt_ids + ex.answer_ids])).logits.argmax(-1)[0]
                p = len(ex.prompt_ids)
                got = [int(pred[p + j - 1]) for j in range(len(ex.answer_ids))]
                wrong = [j for j, (g, w) in enumerate(zip(got, ex.answer_ids)) if g != w]
                correct += not wrong
                if wrong:
                    first_wrong[wrong[0]] = first_wrong.get(wrong[0], 0) + 1
                    if shown < args.show:
                        shown += 1
                        print(f"{variant} dense={dense} want {ids_to_text(ex.answer_ids)} | got {ids_to_text(got)}")
            print(f"length={args.length} {variant} dense={dense}: {correct}/{args.n} correct; "
                  f"first wrong answer index: counts {sorted(first_wrong.items())}", flush=True)


if __name__ == "__main__":
    main()
