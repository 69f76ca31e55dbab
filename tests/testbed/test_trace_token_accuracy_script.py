"""benchmarks/trace_token_accuracy.py: each digit of a trace answer gets the right kind (a hand-written answer), and the
counts follow a stand-in model's predictions exactly (one that predicts every next token, one that misses exactly
the definition lookups)."""

import torch
from benchmark_loader import load_benchmark

from kvlearn.testbed.tokenizer import VOCAB, WORD_TO_ID

ANSWER = ("step 1 : u = p - t ; p = 4 ; t = 9 ; 4 - 9 = 5 ; u = 5 . ok , that looks right . "
          "step 2 : s = u + p ; u = 5 ; p = 4 ; 5 + 4 = 9 ; s = 9 . answer : 9 <eos>").split()


def test_digit_kinds_by_hand():
    bench = load_benchmark("trace_token_accuracy")
    kinds = [bench.digit_kind(ANSWER, j, {"p", "t"}) for j, w in enumerate(ANSWER) if w.isdigit()]
    assert kinds == [
        "step_no", "lookup_def", "lookup_def", "arith_operand1", "arith_operand2", "arith_result", "result_bind",
        "step_no", "lookup_computed", "lookup_def", "arith_operand1", "arith_operand2", "arith_result", "result_bind",
        "final",
    ]


class _NextToken(torch.nn.Module):
    """Predicts the true next token everywhere, except (``miss_defs``) a wrong digit where the answer restates a
    defined name's value: ``p = [4] ;`` with ``let p = 4 .`` in the prompt."""

    def __init__(self, miss_defs: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.miss_defs = miss_defs

    def forward(self, input_ids):
        b, n = input_ids.shape
        logits = torch.zeros(b, n, len(VOCAB))
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
        logits.scatter_(2, nxt.unsqueeze(-1), 1.0)
        if self.miss_defs:
            for r in range(b):
                words = [VOCAB[t] for t in input_ids[r].tolist()]
                defined = {words[i + 1] for i in range(n - 3) if words[i] == "let" and words[i + 2] == "="}
                for i in range(2, n - 1):  # position i predicts token i + 1
                    if words[i] == "=" and words[i - 1] in defined and words[i + 1].isdigit() and words[i - 2] != "let" \
                            and i + 2 < n and words[i + 2] == ";":
                        logits[r, i] = 0.0
                        logits[r, i, WORD_TO_ID[str((int(words[i + 1]) + 1) % 10)]] = 1.0
        return type("Out", (), {"logits": logits})()


def test_counts_follow_the_predictions():
    bench = load_benchmark("trace_token_accuracy")
    right = bench.token_accuracy(_NextToken(False), 512, 6)
    assert all(c == t for c, t in right.values())
    assert right["lookup_def"][1] > 0 and right["arith_result"][1] > 0 and right["final"][1] == 6
    missed = bench.token_accuracy(_NextToken(True), 512, 6)
    assert missed["lookup_def"] == [0, right["lookup_def"][1]]
    assert all(missed[k] == right[k] for k in right if k != "lookup_def")


def test_bad_arguments_are_one_line(capsys):
    bench = load_benchmark("trace_token_accuracy")
    assert bench.main(["--length", "64", "--n", "0", "--split", "train"]) == 2
    err = capsys.readouterr().err
    assert "--length=64 is invalid: expected 128..16384" in err and "--n=0 is invalid" in err
    assert "--split='train' is invalid: expected eval or heldout" in err


def test_results_file_from_a_tiny_model(tmp_path):
    """The command line end to end on a tiny random GQA Qwen3 with the testbed tokenizer: one row per kind, counts that
    add up to the digits of the answers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.results import read_results
    from kvlearn.testbed import tasks
    from kvlearn.testbed.tokenizer import save_tokenizer

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    save_tokenizer(tmp_path / "m")
    bench = load_benchmark("trace_token_accuracy")
    out = tmp_path / "acc.json"
    assert bench.main(["--model", str(tmp_path / "m"), "--length", "256", "--n", "3", "--out", str(out)]) == 0
    res = read_results(out)
    assert res["kind"] == "trace_token_accuracy" and res["length"] == 256 and res["device"]
    digits = sum(sum(VOCAB[t].isdigit() for t in tasks.generate("trace", tasks.example_seed("trace", "eval", i), 256).answer_ids)
                 for i in range(3))
    assert [r["kind"] for r in res["rows"]] == list(bench.KINDS)
    assert sum(r["total"] for r in res["rows"]) == digits
    assert all(0 <= r["correct"] <= r["total"] for r in res["rows"])
