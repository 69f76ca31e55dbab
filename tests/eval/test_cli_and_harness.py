"""The evaluation harness, the CLI's one-line errors and the shipped teacher."""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, Qwen3Config, Qwen3ForCausalLM

from kvlearn.cli import DEFAULT_MODEL, main
from kvlearn.eval.accuracy import EvalConfig, evaluate
from kvlearn.eval.plots import plot_accuracy
from kvlearn.results import SCHEMA, make_results, write_results
from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import build_tokenizer


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["eval", "--method", "bogus"], "invalid choice: 'bogus' (choose from 'dense', 'streaming', 'tova'"),
        (["eval", "--method", "dense", "--budget", "512"], "method 'dense' keeps every token: it takes no budget"),
        (["eval", "--method", "dense", "--protocol", "sideways"], "invalid choice: 'sideways'"),
        (["eval", "--method", "dense", "--split", "nowhere"], "invalid choice: 'nowhere'"),
        (["eval", "--method", "dense", "--context", "20000"], "context=20000 is invalid: expected an integer in [256, 16384]"),
        (["eval", "--method", "dense", "--plot", "p.png"], "--plot needs --out"),
        (["eval", "--method", "dense", "--out", "r.txt"], "expected a file path ending in .json"),
        (["eval", "--method", "dense", "--threads", "-1"],
         "argument --threads: '-1' is invalid: expected 0 (torch's default) or a positive number of threads"),
        (["testbed", "--family", "poems"], "invalid choice: 'poems'"),
        (["eval", "--method", "dense", "--tasks", "niah,poems"], "unknown task(s) poems"),
        (["eval", "--method", "streaming", "--budget", "4", "--sinks", "4"], "budget=4 is invalid"),
        (["eval", "--method", "streaming", "--budget", "4096", "--context", "4096"], "budget=4096 is invalid"),
        (["eval", "--method", "streaming"], "needs a budget"),
        (["eval", "--method", "dense", "--n-per-task", "0"], "n_per_task=0 is invalid"),
        (["eval", "--method", "dense", "--tasks", "niah,vt,niah"], "--tasks 'niah,vt,niah': task(s) niah given more than once"),
        (["eval", "--method", "dense", "--sinks", "-1"], "sinks=-1 is invalid: expected an integer >= 0"),
        (["eval", "--method", "kaizen_static", "--window", "16"],
         "unexpected keyword argument 'window'); its config takes axes, configuration, seed, target"),
    ],
)
def test_bad_arguments_give_one_line_errors(capsys, tmp_path, argv, needle):
    if argv[0] == "eval":
        argv = [*argv, "--model", str(tmp_path), "--device", "cpu"]
    try:
        code, err = run_cli(capsys, *argv)
    except SystemExit as e:  # argparse's own errors (one line too, through kvlearn's parser)
        code, err = e.code, capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("kvlearn: error:")
    assert needle in err


def test_cuda_device_names_are_checked_against_the_machine(capsys, tmp_path, monkeypatch):
    """``--device`` takes ``cuda`` or ``cuda:N`` with N below the device count (checked before any model loads): a
    malformed name or a missing index is a one-line error naming it and the valid range, not a torch error later."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device, needle in (("cuda:abc", "device='cuda:abc' is invalid: expected auto, cpu or cuda[:N]"),
                           ("cudafoo", "device='cudafoo' is invalid: expected auto, cpu or cuda[:N]"),
                           ("cuda:1", "device='cuda:1' is invalid: this machine has 1 CUDA device(s), expected cuda "
                                      "or cuda:N with N in [0, 0]")):
        code, err = run_cli(capsys, "eval", "--method", "dense", "--model", str(tmp_path / "nope"), "--device", device)
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_missing_checkpoint_and_unsupported_architecture(capsys, tmp_path):
    code, err = run_cli(capsys, "eval", "--method", "dense", "--model", str(tmp_path / "nope"), "--device", "cpu")
    assert code == 2 and "does not exist" in err and "nope" in err and len(err.splitlines()) == 1
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")
    code, err = run_cli(capsys, "eval", "--method", "dense", "--model", str(tmp_path / "gpt2"), "--device", "cpu")
    assert code == 2 and "'gpt2' " in err and "qwen3, qwen2, llama, mistral" in err


def test_output_paths_and_model_limits_are_checked_before_evaluating(capsys, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "file").write_text("")
    cases = [
        (["--out", str(tmp_path / "sub")], "is a directory"),
        (["--out", str(tmp_path / "file" / "r.json")], "is not a directory"),
        (["--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "sub")], "is a directory"),
        (["--context", "1024", "--model", str(tmp_path / "tiny")], "exceeds the model's max_position_embeddings=512"),
    ]
    Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, max_position_embeddings=512).save_pretrained(tmp_path / "tiny")
    for extra, needle in cases:
        code, err = run_cli(capsys, "eval", "--method", "dense", "--device", "cpu", "--model", str(tmp_path), *extra)
        assert code == 2 and needle in err and len(err.splitlines()) == 1, (extra, err)
    assert not (tmp_path / "r.json").exists()


def test_version_help_defaults_and_methods_listing(capsys):
    from kvlearn import __version__
    from kvlearn.methods import method_names

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"kvlearn {__version__}"
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("--n-per-task N_PER_TASK examples per task family (default: 10)", "(default: bounded)",
                   "{" + ",".join(method_names()) + "}", "(default: 4096)"):
        assert needle in text
    # an unset default or an off flag adds nothing: the help states what happens (e.g. "default: the method's")
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: the method's)" in text
    for command in ("retrofit", "kaizen-train", "reproduce", "pretrain", "convert-mla", "demo", "testbed"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        sub = " ".join(capsys.readouterr().out.split())
        assert "(default: None)" not in sub and "(default: False)" not in sub, command
    with pytest.raises(SystemExit):
        main(["retrofit", "--help"])
    assert "steps between checkpoints (default: 200)" in " ".join(capsys.readouterr().out.split())  # a set one shows
    assert main(["methods"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(method_names())
    assert lines[1].split()[1] == "bounded,context"


def tiny_testbed_model():
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).eval()


def test_harness_rows_schema_and_real_memory_saving(tmp_path):
    model = tiny_testbed_model()
    rows = []
    for method, budget in (("dense", None), ("streaming", 64)):
        rows += evaluate(model, EvalConfig(method=method, budget=budget, tasks=("niah", "recall"), n_per_task=2,
                                           context=256, batch_size=2), progress=False)
    assert [(r["method"], r["task"]) for r in rows] == [("dense", "niah"), ("dense", "recall"), ("streaming", "niah"), ("streaming", "recall")]
    for r in rows:
        assert set(r) >= {"method", "protocol", "split", "budget", "compression", "task", "accuracy", "n", "kv_bytes"}
        assert r["protocol"] == "bounded" and r["split"] == "eval"
        assert r["n"] == 2 and 0.0 <= r["accuracy"] <= 1.0
    dense = {r["task"]: r["kv_bytes"] for r in rows if r["method"] == "dense"}
    for r in rows:
        if r["method"] == "streaming":
            assert r["compression"] == pytest.approx(0.75)
            # at most budget/context of the dense bytes (+5% for slot positions and the generated tokens)
            assert r["kv_bytes"] <= 64 / 256 * dense[r["task"]] * 1.05
    path = write_results(tmp_path / "r.json", make_results("accuracy", rows, device="cpu", model="tiny", context=256))
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["kind"] == "accuracy" and data["context"] == 256
    assert {"command", "commit", "date", "device", "model", "rows"} <= set(data)
    assert plot_accuracy(rows, tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded teacher in this checkout")
def test_greedy_harness_matches_hand_scoring():
    """The harness's accuracy (batched, left-padded, through the cache) equals scoring each example's greedy
    generation by hand, one at a time; the teacher solves some of them, so the comparison is not 0 == 0."""
    from kvlearn.hf import load_model

    model = load_model(DEFAULT_MODEL)
    rows = evaluate(model, EvalConfig(method="dense", tasks=("vt",), n_per_task=3, context=4096, batch_size=3), progress=False)
    examples = [tasks.generate("vt", tasks.example_seed("vt", "eval", i), 4096) for i in range(3)]
    assert len({len(ex.prompt_ids) for ex in examples}) > 1  # the batch is really left-padded
    correct = 0
    for ex in examples:
        ids = torch.tensor([ex.prompt_ids])
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=len(ex.answer_ids), do_sample=False, pad_token_id=0,
                                 eos_token_id=model.config.eos_token_id)
        correct += tasks.score(ex, out[0, ids.shape[1]:].tolist())
    assert correct > 0
    assert rows[0]["accuracy"] == pytest.approx(correct / 3)


@pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded teacher in this checkout")
def test_shipped_teacher_loads_plainly_and_answers_a_sample():
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    assert model.config.model_type == "qwen3"
    assert model.config.num_key_value_heads >= 2 and model.config.num_attention_heads // model.config.num_key_value_heads >= 2
    assert sum(p.numel() for p in model.parameters()) * 2 <= 16 * 2**20
    solved = 0
    for family in ("vt", "recall"):
        ex = tasks.generate(family, tasks.example_seed(family, "eval", 0), 4096)  # the teacher's context
        assert tok.decode(ex.prompt_ids).split()[0] == "<bos>"
        ids = torch.tensor([ex.prompt_ids])
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=len(ex.answer_ids), do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        solved += tasks.score(ex, out[0, ids.shape[1]:].tolist())
    assert solved == 2


def test_results_commit_comes_from_the_environment_when_given(monkeypatch):
    from kvlearn.results import git_commit, make_results

    monkeypatch.setenv("KVLEARN_COMMIT", "abc1234")
    assert git_commit() == "abc1234" and make_results("ops", [])["commit"] == "abc1234"
    monkeypatch.delenv("KVLEARN_COMMIT")
    head = git_commit()
    assert head == "unknown" or len(head.split("+")[0]) == 40


def test_testbed_prints_the_training_format_with_its_supervised_spans(capsys):
    """`kvlearn testbed --dense`: the in-context answers between [[ ]], exactly the generator's supervised spans."""
    from kvlearn.cli import main

    assert main(["testbed", "--family", "trace", "--length", "1024", "--split", "train", "--index", "3", "--dense"]) == 0
    out = capsys.readouterr().out
    prompt = out.splitlines()[1]
    spans = re.findall(r"\[\[ (.*?) \]\]", prompt)
    assert len(spans) == tasks.trace_lookup_count(1024) == prompt.count("[[") == prompt.count("]]")
    ex = tasks.generate("trace", tasks.example_seed("trace", "train", 3), 1024, dense=True)
    tok = build_tokenizer()
    want, run = [], []
    for t, sup in zip(ex.prompt_ids + [0], ex.loss_mask_prompt + [False]):
        if sup:
            run.append(t)
        elif run:
            want.append(tok.decode(run))
            run = []
    assert spans == want and all(re.fullmatch(r"(\S) = (\d) \. answer : \2 <eos>", s) for s in spans)
    assert prompt.replace("[[ ", "").replace(" ]]", "") == tok.decode(ex.prompt_ids)
    assert main(["testbed", "--family", "trace", "--length", "1024"]) == 0
    assert "[[" not in capsys.readouterr().out


def test_learned_methods_on_a_model_without_their_modules_are_warned_about(capsys):
    """``kvlearn eval`` names it when a learned method would run freshly initialised modules (the plain teacher under
    ``--method kvpop``, ``dms`` or ``kaizen``), and stays quiet once the model carries them or for a rule-based
    method."""
    from kvlearn import DMSConfig, KVpopConfig, apply_dms, apply_kvpop
    from kvlearn.cli import untrained_modules_warning

    model = tiny_testbed_model()
    for method, what in (("kvpop", "KVpop scorers"), ("kaizen+kvpop", "KVpop scorers"), ("dms", "DMS gates"),
                         ("kaizen", "KV-Kaizen selector")):
        warning = untrained_modules_warning(method, model, "teacher/")
        assert warning.startswith(f"--model teacher/ carries no trained {what}: --method {method} runs ")
        assert "freshly initialised" in warning
    for method in ("dense", "streaming", "snapkv", "kaizen_static", "kivi"):
        assert untrained_modules_warning(method, model, "teacher/") is None
    apply_kvpop(model, KVpopConfig(sinks=4, window=16, topk=44))
    assert untrained_modules_warning("kvpop", model, "s/") is None
    assert untrained_modules_warning("kaizen+kvpop", model, "s/") is None
    other = tiny_testbed_model()
    apply_dms(other, DMSConfig(sinks=4, window=16))
    assert untrained_modules_warning("dms", other, "d/") is None
