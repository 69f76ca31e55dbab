"""The teacher trainer: schedule functions and a tiny end-to-end run on the CPU that saves a loadable checkpoint."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvlearn import KVLearnError
from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import WORD_TO_ID
from kvlearn.train.pretrain import PretrainConfig, checked_answer_positions, lr_at, pretrain, stage_at


def test_stage_and_lr_schedule():
    cfg = PretrainConfig(stages=(256, 512, 1024), stage_fractions=(0.25, 0.25, 0.5), context=1024,
                         tokens_per_step=4096, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert [stage_at(cfg, f) for f in (0.0, 0.24, 0.25, 0.49, 0.5, 0.99, 1.5)] == [0, 0, 1, 1, 2, 2, 2]
    assert lr_at(cfg, 0, 0.0) == pytest.approx(1e-4)  # warm-up step 1 of 10
    assert lr_at(cfg, 100, 0.0) == pytest.approx(1e-3)
    assert lr_at(cfg, 100, 0.5) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(cfg, 100, 1.0) == pytest.approx(1e-4)


def test_config_validation():
    with pytest.raises(KVLearnError, match="must sum to 1"):
        PretrainConfig(stage_fractions=(0.5, 0.5, 0.5, 0.5, 0.5))
    with pytest.raises(KVLearnError, match="num_kv_heads=1"):
        PretrainConfig(num_kv_heads=1)
    with pytest.raises(KVLearnError, match="dense_fraction=1.2 is invalid"):
        PretrainConfig(dense_fraction=1.2)


@pytest.mark.parametrize("bad, message", [
    (dict(lr=-1.0), r"^lr=-1.0 is invalid: expected a finite number > 0$"),
    (dict(lr=0.0), r"^lr=0.0 is invalid: expected a finite number > 0$"),
    (dict(warmup_steps=-1), r"^warmup_steps=-1 is invalid: expected an integer >= 0$"),
    (dict(seed=-1), r"^seed=-1 is invalid: expected an integer >= 0$"),
    (dict(tokens_per_step=0), r"^tokens_per_step=0 is invalid: expected an integer >= 4096 \(a multiple of the longest stage 4096\)$"),
    (dict(tokens_per_step=-4096), r"^tokens_per_step=-4096 is invalid: expected an integer >= 4096"),
    (dict(resume="/nonexistent/run"), r"^resume='/nonexistent/run' is not a model folder \(no config.json\)"),
])
def test_bad_training_settings_are_one_line_errors_naming_the_value(bad, message, tmp_path):
    """Values torch would refuse deep inside the run (a negative learning rate), take silently (a zero learning
    rate, a negative warm-up) or report under another name (a negative seed or token count, as a derived one) are
    refused when the config is made, naming the value given and the valid range."""
    with pytest.raises(KVLearnError, match=message):
        PretrainConfig(out=str(tmp_path / "t"), **bad)


def test_cli_stage_lists_that_are_not_numbers_are_one_line_errors(tmp_path, capsys):
    from kvlearn.cli import main

    for flag, text in (("--stages", "a,b"), ("--stages", "256,,512"), ("--stage-fractions", "x")):
        assert main(["pretrain", "--out", str(tmp_path / "t"), "--device", "cpu", flag, text]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"kvlearn: error: {flag} {text!r} is invalid: expected a comma list"), err


def test_trace_checks_step_lines_and_answer_but_not_thinking():
    ex = tasks.generate("trace", tasks.example_seed("trace", "eval", 0), 400)
    checked = checked_answer_positions(ex)
    words = [next(w for w, i in WORD_TO_ID.items() if i == t) for t in ex.answer_ids]
    text = " ".join(words[j] for j in checked)
    assert text.startswith("step 1 :") and text.endswith("answer : " + words[-2] + " <eos>")
    skipped = [words[j] for j in range(len(words)) if j not in checked]
    assert skipped and "step" not in skipped and "=" not in skipped  # only the free sentences are skipped
    ex = tasks.generate("recall", tasks.example_seed("recall", "eval", 0), 400)
    assert checked_answer_positions(ex) == list(range(len(ex.answer_ids)))


def test_tiny_cpu_run_saves_a_plain_loadable_checkpoint(tmp_path):
    cfg = PretrainConfig(out=str(tmp_path / "t"), minutes=0.04, device="cpu", hidden_size=32, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, context=256,
                         stages=(256, 256), stage_fractions=(0.5, 0.5), tokens_per_step=1024, num_workers=0, eval_n=2,
                         log_every=1000, warmup_steps=2)
    log = pretrain(cfg)
    assert log["steps"] >= 1 and log["stages"][0]["accuracy"].keys() == {"eval", "heldout"}
    # adaptive family weights (the default): uniform first, then 1.25 - the first check's eval accuracy per family
    first = log["stages"][0]["accuracy"]["eval"]
    assert log["family_weights"] == [None, [1.25 - first[f] for f in tasks.FAMILIES]]
    assert log["stages"][0]["accuracy"]["heldout"].keys() == set(tasks.FAMILIES)
    card = (tmp_path / "t" / "README.md").read_text()
    assert "| 256 |" in card and "heldout" in card and f"{log['parameters']:,} parameters" in card
    assert "(adaptive: " in card and "256: uniform; 256: " + ", ".join(f"{1.25 - first[f]:g}" for f in tasks.FAMILIES) in card
    from kvlearn.results import git_commit

    assert log["commit"] == git_commit() and f"code of commit {log['commit']}" in card
    with pytest.raises(KVLearnError, match="already holds files: pass --overwrite"):
        PretrainConfig(out=str(tmp_path / "t"))
    PretrainConfig(out=str(tmp_path / "t"), overwrite=True)
    assert PretrainConfig().out.startswith("runs/testbed-teacher-")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    tok = AutoTokenizer.from_pretrained(tmp_path / "t")
    assert model.config.num_key_value_heads == 2 and len(tok) == model.config.vocab_size
    from safetensors import safe_open

    with safe_open(str(tmp_path / "t" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # committed checkpoints are bf16
    assert json.loads((tmp_path / "t" / "pretrain_log.json").read_text())["steps"] == log["steps"]
    # the early gate of the device chains reads this file: the stage check is there, with its trace accuracy
    from benchmark_loader import load_benchmark

    gate = load_benchmark("pretrain_early_gate")
    trace = log["stages"][0]["accuracy"]["eval"]["trace"]
    got = gate.verdict(gate.read_log(str(tmp_path / "t")), 0, "trace", 0.5)
    assert got.startswith(("pass" if trace >= 0.5 else "fail") + f" {trace:.3f}")
    assert gate.verdict(gate.read_log(str(tmp_path / "t")), 2, "trace", 0.5) is None


def test_family_weights_per_stage_and_narrowed_haystack(tmp_path):
    from kvlearn.cli import _family_weights
    from kvlearn.testbed.data import batch_examples
    from kvlearn.train.pretrain import stage_family_weights

    stages = dict(stages=(256, 512), stage_fractions=(0.5, 0.5), out=str(tmp_path / "a"))
    flat = PretrainConfig(family_weights=(1, 0, 0, 0), **stages)
    assert stage_family_weights(flat, 0) == stage_family_weights(flat, 1) == (1.0, 0.0, 0.0, 0.0)
    per = PretrainConfig(family_weights=_family_weights("3,1,1,1;1,1,1,1"), **stages)
    assert stage_family_weights(per, 0) == (3.0, 1.0, 1.0, 1.0) and stage_family_weights(per, 1) == (1.0,) * 4
    assert stage_family_weights(PretrainConfig(**stages), 1) is None
    for bad in ((1, 0, 0), ((1, 0, 0, 0),), (0, 0, 0, 0), ((1, 1, 1, 1), (1, 1, 1, -1))):
        with pytest.raises(KVLearnError, match="family_weights"):
            PretrainConfig(family_weights=bad, **stages)
    with pytest.raises(KVLearnError, match="--family-weights"):
        _family_weights("1,x,1,1")
    with pytest.raises(KVLearnError, match="family_weights='adaptiv' is invalid: expected numbers or one of adaptive, uniform"):
        PretrainConfig(family_weights="adaptiv", **stages)
    # a weight of 0 never draws the family; narrowed haystacks draw only the named style and regime
    rows = batch_examples(16, 256, 7, weights=stage_family_weights(flat, 0), styles=("salad",), regimes=("tail",))
    assert {(e.family, e.style, e.regime) for e in rows} == {("trace", "salad", "tail")}
    with pytest.raises(KVLearnError, match="verb_first"):
        PretrainConfig(train_styles=("verb_first",), **stages)


def test_plain_stages_draw_only_the_plain_haystack_then_the_training_ones(tmp_path):
    """The first ``plain_stages`` stages' rows are svo/uniform only; later stages draw every training style and
    regime (never a held-out one); ``plain_stages`` beyond the stage count covers all; a negative value is one line."""
    from kvlearn.testbed.data import batch_examples
    from kvlearn.testbed.filler import HELDOUT_STYLES, TRAIN_STYLES
    from kvlearn.testbed.tasks import HELDOUT_REGIMES
    from kvlearn.train.pretrain import stage_haystack

    stages = dict(stages=(256, 512, 1024), stage_fractions=(0.2, 0.3, 0.5), out=str(tmp_path / "a"))
    config = PretrainConfig(plain_stages=2, **stages)
    seen = []
    for stage in range(3):
        styles, regimes = stage_haystack(config, stage)
        rows = [e for seed in range(4) for e in batch_examples(64, 256, seed, styles=styles, regimes=regimes)]
        seen.append({(e.style, e.regime) for e in rows})
    assert seen[0] == seen[1] == {("svo", "uniform")}
    later_styles, later_regimes = {s for s, _ in seen[2]}, {r for _, r in seen[2]}
    assert later_styles == set(TRAIN_STYLES) and len(later_regimes) == 4
    assert not later_styles & set(HELDOUT_STYLES) and not later_regimes & set(HELDOUT_REGIMES)
    assert stage_haystack(PretrainConfig(plain_stages=9, **stages), 2) == (("svo",), ("uniform",))
    assert stage_haystack(PretrainConfig(plain_stages=0, train_styles=("salad",), **stages), 0) == (("salad",), None)
    with pytest.raises(KVLearnError, match="plain_stages"):
        PretrainConfig(plain_stages=-1, **stages)


def _log(**accuracy):
    return {"stages": [{"stage": 0, "accuracy": {"eval": {"trace": 0.0, "niah": 0.1, "vt": 0.0, "recall": 0.0}}},
                       {"stage": 1, "accuracy": accuracy}]}


def test_stage_check_gate_reads_the_last_stage_of_every_split():
    """The gate passes only when the last stage reached the threshold on niah, vt and recall on every split (trace,
    whose teacher-forced check stays near 0 for good teachers, is not judged); an empty log fails."""
    from kvlearn.train.pretrain import stage_check_passed

    good = {"trace": 0.0, "niah": 0.98, "vt": 1.0, "recall": 0.8}
    assert stage_check_passed(_log(eval=good, heldout=good))
    assert not stage_check_passed(_log(eval=good, heldout={**good, "recall": 0.79}))  # one split, one family short
    assert not stage_check_passed(_log(eval={**good, "vt": 0.0}))
    assert stage_check_passed(_log(eval={**good, "recall": 0.5}), threshold=0.5)
    assert not stage_check_passed({"stages": []}) and not stage_check_passed({})


def test_teacher_stage_gate_script_falls_back_on_a_failed_or_missing_teacher(tmp_path, capsys):
    import json

    from benchmark_loader import load_benchmark

    teacher_stage_gate = load_benchmark("teacher_stage_gate")

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    ok = {"trace": 0.0, "niah": 1.0, "vt": 1.0, "recall": 1.0}
    (good / "pretrain_log.json").write_text(json.dumps(_log(eval=ok, heldout=ok)))
    (bad / "pretrain_log.json").write_text(json.dumps(_log(eval={**ok, "recall": 0.0}, heldout=ok)))
    for folder, expected in ((good, good), (bad, "shipped"), (tmp_path / "missing", "shipped")):
        assert teacher_stage_gate.main([str(folder), "--fallback", "shipped"]) == 0
        assert capsys.readouterr().out.strip() == str(expected)
    assert teacher_stage_gate.main([str(good), "--fallback", "x", "--threshold", "1.5"]) == 2
    assert "--threshold=1.5 is invalid" in capsys.readouterr().err


def test_pretrain_early_gate_reads_the_stage_checks_the_trainer_writes(tmp_path, capsys):
    """The gate that stops a failing teacher trial reads the checkpoint's pretrain_log.json (rewritten by the
    trainer after every stage check): nothing while it is absent, half written or lacks the stage, then pass / fail
    by the family's accuracy on the chosen split."""
    from benchmark_loader import load_benchmark

    gate = load_benchmark("pretrain_early_gate")
    check = {"stage": 2, "length": 1024, "accuracy": {"eval": {"trace": 0.25, "niah": 0.5, "vt": 0.0, "recall": 0.0},
                                                     "heldout": {"trace": 0.1, "niah": 0.5, "vt": 0.0, "recall": 0.0}}}
    args = [str(tmp_path), "--stage", "2", "--family", "trace"]
    assert gate.main([*args, "--threshold", "0.2"]) == 0 and capsys.readouterr().out == ""  # no log yet
    (tmp_path / "pretrain_log.json").write_text('{"stages": [{"stage": 0')  # being rewritten
    assert gate.main([*args, "--threshold", "0.2"]) == 0 and capsys.readouterr().out == ""
    log = {"stages": [{**check, "stage": 1}]}  # after stage 1's check (the trainer's format: the tiny-run test)
    (tmp_path / "pretrain_log.json").write_text(json.dumps(log))
    assert gate.main([*args, "--threshold", "0.2"]) == 0 and capsys.readouterr().out == ""
    log["stages"].append(check)
    (tmp_path / "pretrain_log.json").write_text(json.dumps(log))
    assert gate.main([*args, "--threshold", "0.2"]) == 0
    assert capsys.readouterr().out.startswith("pass 0.250")
    assert gate.main([*args, "--threshold", "0.3"]) == 0
    assert capsys.readouterr().out.startswith("fail 0.250")
    assert gate.main([*args, "--threshold", "0.2", "--split", "heldout"]) == 0
    assert capsys.readouterr().out.startswith("fail 0.100")
    assert gate.main([*args, "--threshold", "1.5", "--family", "poem"]) == 2
    err = capsys.readouterr().err
    assert "--threshold=1.5 is invalid" in err and "--family='poem' is invalid" in err and "trace, niah" in err


def test_teacher_trial_chain_stops_a_failing_trial_and_keeps_a_passing_one(tmp_path):
    """benchmarks/device/teacher_trial_then_tables.sh as a dry run (fake pretrain log, sleeps for the GPU jobs): the
    gate's verdict decides whether the method tables run."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "teacher_trial_then_tables.sh"
    for trace, tables in (("0.0", True), ("0.5", False)):
        run_dir = tmp_path / f"trace{trace}"
        env = {**os.environ, "RUN_DIR": str(run_dir), "CKPT": str(run_dir / "ckpt"), "DRY_RUN": "1",
               "DRY_TRACE": trace, "PRE": "echo pre", "WITH_EVAL": "echo with-eval", "THEN": "echo then"}
        out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120,
                             cwd=script.parents[2]).stdout
        gate = (run_dir / "gate.txt").read_text()
        assert gate.startswith("fail" if tables else "pass"), (gate, out)
        assert (run_dir / "table512.log").exists() == tables and (run_dir / "baselines.log").exists() == tables, out
        assert ("== done" in out) == tables
        # PRE runs before every trial; WITH_EVAL and THEN only after a passed one, in that order
        assert "echo pre" in (run_dir / "pre.log").read_text() and out.index("== pre done") < out.index("== gate")
        assert (run_dir / "then.log").exists() == (run_dir / "with_eval.log").exists() == (not tables), out
        if not tables:
            assert out.index("== gate") < out.index("== with_eval done") < out.index("== then done"), out
    # another family and stage: the gate reads that family's check (the fake log has every family at DRY_TRACE)
    run_dir = tmp_path / "recall"
    env = {**os.environ, "RUN_DIR": str(run_dir), "CKPT": str(run_dir / "ckpt"), "DRY_RUN": "1", "DRY_TRACE": "0.6",
           "GATE_STAGE": "3", "GATE_FAMILY": "recall", "GATE_THRESHOLD": "0.5"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120,
                         cwd=script.parents[2]).stdout
    assert (run_dir / "gate.txt").read_text().startswith("pass 0.600: recall (eval) after stage 3"), out
    # FALLBACK replaces the tables of a failed trial
    run_dir = tmp_path / "fallback"
    env = {**os.environ, "RUN_DIR": str(run_dir), "CKPT": str(run_dir / "ckpt"), "DRY_RUN": "1", "DRY_TRACE": "0.0",
           "FALLBACK": "bash benchmarks/device/kaizen_overheads.sh"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120,
                         cwd=script.parents[2]).stdout
    assert "== fallback done" in out and "== done" in out, out
    assert "kaizen_overheads.sh" in (run_dir / "fallback.log").read_text()
    assert not (run_dir / "table512.log").exists() and not (run_dir / "baselines.log").exists()


def test_adaptive_family_weights_follow_the_last_stage_check(tmp_path):
    """Adaptive mode (the default): the first stage is uniform; later stages weight family f by 0.25 + 1 - its eval
    accuracy at the previous check, clipped to [0, 1] (hand-computed: a formed family 0.27, an unformed one 1.25);
    ``uniform`` and the CLI spellings map to the same configs."""
    from kvlearn.cli import _family_weights
    from kvlearn.train.pretrain import adaptive_family_weights, stage_family_weights

    stages = dict(stages=(256, 512), stage_fractions=(0.5, 0.5), out=str(tmp_path / "a"))
    config = PretrainConfig(**stages)
    assert config.family_weights == "adaptive" == PretrainConfig(family_weights=_family_weights("adaptive"), **stages).family_weights
    acc = {"trace": 0.98, "niah": 0.25, "vt": 0.84, "recall": 0.0}
    assert stage_family_weights(config, 0, acc) is None  # stage 0: no earlier check, uniform
    assert stage_family_weights(config, 1, acc) == pytest.approx((0.27, 1.0, 0.41, 1.25))
    assert stage_family_weights(config, 1, None) is None
    assert adaptive_family_weights({"trace": 1.5, "niah": -1}) == (0.25, 1.25, 1.25, 1.25)  # clipped; missing = 0
    uniform = PretrainConfig(family_weights=_family_weights("uniform"), **stages)
    assert uniform.family_weights is None and stage_family_weights(uniform, 1, acc) is None


PRETRAIN_DRIVER = """
import json, os, sys
from kvlearn.train.pretrain import PretrainConfig, pretrain
log = pretrain(PretrainConfig(out=sys.argv[1], minutes=0.08, device="cpu", hidden_size=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=8, intermediate_size=64, context=256, stages=(256, 256),
                              stage_fractions=(0.5, 0.5), tokens_per_step=1024, num_workers=0, eval_n=2,
                              log_every=1000, warmup_steps=2))
# one file per rank: two processes printing to one pipe can interleave their lines
with open(sys.argv[2] + "/weights_rank" + os.environ["RANK"] + ".json", "w") as f:
    json.dump(log["family_weights"], f)
"""


def test_adaptive_weights_reach_every_rank_under_torchrun(tmp_path):
    """2 gloo processes (DDP): only rank 0 runs the stage check, and both ranks draw the second stage with the
    weights computed from it (1.25 - rank 0's eval accuracy), not a rank's own uniform mixture."""
    from torchrun import run_two_processes

    driver = tmp_path / "driver.py"
    driver.write_text(PRETRAIN_DRIVER)
    run = run_two_processes(str(driver), str(tmp_path / "t"), str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    per_rank = [json.loads((tmp_path / f"weights_rank{r}.json").read_text()) for r in range(2)]
    saved = json.loads((tmp_path / "t" / "pretrain_log.json").read_text())
    first = saved["stages"][0]["accuracy"]["eval"]
    want = [None, [pytest.approx(1.25 - first[f]) for f in tasks.FAMILIES]]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1] == want and saved["world_size"] == 2


def test_multivalue_probes_are_opt_in_from_a_stage(tmp_path):
    """``multivalue_from``: None (default, the shipped teacher's recipe) gives every stage's stream share 0 (the rows
    of 1880c5c); a stage length gives the default share from that stage on; anything else is a one-line error."""
    from dataclasses import asdict

    from kvlearn.train.pretrain import model_card, stage_multivalue_share

    stages = dict(stages=(256, 512, 1024, 2048), stage_fractions=(0.1, 0.2, 0.3, 0.4), context=2048,
                  tokens_per_step=8192, out=str(tmp_path / "a"))
    default = PretrainConfig(**stages)
    assert default.multivalue_from is None and PretrainConfig().multivalue_from is None
    assert [stage_multivalue_share(default, s) for s in range(4)] == [0.0] * 4
    late = PretrainConfig(multivalue_from=1024, **stages)
    assert [stage_multivalue_share(late, s) for s in range(4)] == [0.0, 0.0, tasks.MULTIVALUE_PROBE_SHARE,
                                                                    tasks.MULTIVALUE_PROBE_SHARE]
    for bad in (768, 0, 4096):
        with pytest.raises(KVLearnError, match=rf"multivalue_from={bad} is invalid: expected None \(never\) or one of "
                                               r"the stage lengths 256, 512, 1024, 2048$"):
            PretrainConfig(multivalue_from=bad, **stages)
    # the model card states it when set, and says nothing of it otherwise
    def card(config):
        return model_card({"config": asdict(config), "parameters": 1, "world_size": 1, "stages": []})

    assert "multi-needle niah probes (a share 0.25 of the dense rows' probes) from the 1024 stage on" in card(late)
    assert "multi-needle" not in card(default)


def test_step_budget_runs_exactly_that_many_steps_with_stages_at_their_step_shares(tmp_path):
    """``steps``: the run takes exactly ``steps`` optimizer steps, each stage ends at its share of them (by hand:
    shares 0.4 / 0.6 of 5 steps -> stage 0 is steps 0 and 1), and the card says the budget was steps."""
    cfg = PretrainConfig(out=str(tmp_path / "t"), steps=5, device="cpu", hidden_size=32, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, context=512,
                         stages=(256, 512), stage_fractions=(0.4, 0.6), tokens_per_step=1024, num_workers=0, eval_n=1,
                         log_every=1000, warmup_steps=2)
    log = pretrain(cfg)
    assert log["steps"] == 5 and log["tokens"] == 5 * 1024
    assert [(s["length"], s["end_step"]) for s in log["stages"]] == [(256, 2), (512, 5)]
    assert "(a budget of 5 steps)" in (tmp_path / "t" / "README.md").read_text()
    for bad in (0, 2.5, True):
        with pytest.raises(KVLearnError, match=f"steps={bad!r} is invalid: expected None"):
            PretrainConfig(out=str(tmp_path / "u"), steps=bad)


@pytest.mark.parametrize("option, field, default, good, bad", [
    ("--multivalue-from", "multivalue_from", None, 2048, 300),  # 300: not a stage length
    ("--num-layers", "num_layers", 8, 2, 0),
    ("--steps", "steps", None, 9162, 0),
])
def test_cli_option_maps_into_the_config(option, field, default, good, bad, tmp_path, monkeypatch):
    from kvlearn import cli
    from kvlearn.train import pretrain as pretrain_module

    got = []
    monkeypatch.setattr(pretrain_module, "pretrain", got.append)
    base = ["pretrain", "--out", str(tmp_path / "t"), "--device", "cpu"]
    assert cli.main(base) == 0 and getattr(got[-1], field) == default
    assert cli.main([*base, option, str(good)]) == 0 and getattr(got[-1], field) == good
    assert cli.main([*base, option, str(bad)]) == 2 and len(got) == 2  # one-line error, pretrain not called
