"""``kvlearn retrofit --method streaming_plus|dms`` on a tiny random GQA Qwen3 (float32, 2 layers, 2 KV heads, 4
query heads, head_dim 16, sequences of 128 tokens): a 2-step CPU run writes a final checkpoint that ``kvlearn.load``
reloads with identical logits (through the method's cache); the DMS gates receive gradient and the target ramps;
KVpop stays the default; bad input is one line (API and CLI)."""

import json

import pytest
import torch
from safetensors.torch import load_file

import kvlearn
from kvlearn import KVLearnError, StreamingConfig
from kvlearn.cli import main
from kvlearn.config import DMSConfig
from kvlearn.dms.apply import dms_gates, has_dms
from kvlearn.methods import get_method, make_config
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from kvlearn.train.distill import LOG_FILE, STATE_FILE, RetrofitConfig, retrofit

SEQ = 128


def cli_retrofit(teacher_path, out, method, *extra):
    return main(["retrofit", "--model", teacher_path, "--out", str(out), "--method", method, "--budget", "48",
                 "--window", "16", "--steps", "2", "--batch-size", "2", "--seq-len", str(SEQ), "--device", "cpu",
                 "--save-interval", "1", "--warmup-steps", "1", "--lr", "1e-3", "--lr-new", "1e-2", *extra])


def logits_through_cache(model, name, ids):
    method = get_method(name)
    config = make_config(name, budget=48, sinks=4, context=SEQ, **({"window": 16} if name == "dms" else {}))
    method.prepare(model, config)
    cache = method.new_cache(model, config)
    with torch.no_grad():
        out = [model(input_ids=ids[:, :40], past_key_values=cache, use_cache=True).logits]
        for t in range(40, ids.shape[1]):
            out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1)


def reference_student(teacher_path, final, name):
    """The trained student rebuilt by hand: the teacher, the method applied, every saved tensor loaded strictly."""
    model = kvlearn.load(teacher_path)
    saved = json.loads((final / "config.json").read_text())
    if name == "dms":
        from kvlearn.dms.apply import apply_dms

        apply_dms(model, DMSConfig(**saved["dms"]))
    state = load_file(final / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # tied embeddings are saved once
    return model.eval()


@pytest.mark.parametrize("name", ["streaming_plus", "dms"])
def test_two_step_retrofit_writes_a_loadable_checkpoint(teacher_path, tmp_path, name):
    assert cli_retrofit(teacher_path, tmp_path / "run", name) == 0
    lines = [json.loads(ln) for ln in (tmp_path / "run" / LOG_FILE).read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2] and all(ln["kd"] >= 0 for ln in lines)
    final = tmp_path / "run" / "final"
    saved = json.loads((final / "config.json").read_text())
    teacher = kvlearn.load(teacher_path)
    loaded = kvlearn.load(final)
    if name == "dms":
        slots = 48 - 4 - 16  # the head scope (the default): each KV head held to its long-range slots
        assert saved["dms"]["budget"] == 48 and saved["dms"]["target_cr"] == SEQ / slots
        assert has_dms(loaded)
        assert any(torch.count_nonzero(g.proj.weight) > 0 for g in dms_gates(loaded))  # the gates were trained
        assert lines[0]["target_fraction"] == 0.0 and 0 < lines[1]["target_fraction"] < 1 - slots / SEQ
        assert all(0 <= ln["closed_fraction"] <= 1 and ln["compression"] >= 0 for ln in lines)
        assert all(0 <= ln["closed_head_min"] <= ln["closed_fraction"] <= ln["closed_head_max"] <= 1 for ln in lines)
    else:
        assert saved["streaming_plus"] == {"budget": 48, "sinks": 4, "window": 44}
        assert not has_dms(loaded) and "dms" not in saved and "kvpop" not in saved
    # the backbone was trained (lr 1e-3): the student differs from its teacher
    t_state = teacher.state_dict()
    assert any(not torch.equal(v, t_state[k]) for k, v in loaded.state_dict().items() if k in t_state)
    ids = torch.randint(1, VOCAB_SIZE, (1, 70))
    got = logits_through_cache(loaded, name, ids)
    want = logits_through_cache(reference_student(teacher_path, final, name), name, ids)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference_student(teacher_path, final, name)(input_ids=ids).logits)


def test_resume_refuses_another_method(teacher_path, tmp_path):
    out = tmp_path / "run"
    config = RetrofitConfig(model=teacher_path, out=str(out), method="streaming_plus",
                            streaming=StreamingConfig(budget=48, sinks=4), steps=2, batch_size=2, seq_len=SEQ,
                            save_interval=1)
    retrofit(config, stop_after=1, progress=False)
    other = RetrofitConfig(model=teacher_path, out=str(out), method="streaming_plus", resume=True,
                           streaming=StreamingConfig(budget=40, sinks=4), steps=2, batch_size=2, seq_len=SEQ,
                           save_interval=1)
    with pytest.raises(KVLearnError) as err:
        retrofit(other, progress=False)
    assert "\n" not in str(err.value) and "streaming" in str(err.value)


def test_bad_input_is_one_line(teacher_path, tmp_path, capsys):
    base = dict(model=teacher_path, out=str(tmp_path / "x"), steps=2, batch_size=2, seq_len=SEQ)
    for kw, expect in ((dict(method="h2o"), "method='h2o' is unknown"),
                       (dict(method="streaming_plus"), "needs streaming=StreamingConfig"),
                       (dict(method="dms"), "needs dms=DMSConfig"),
                       (dict(method="dms", dms=DMSConfig(sinks=4, window=16, budget=200)), "budget = 200"),
                       (dict(method="streaming_plus", streaming=StreamingConfig(budget=128, sinks=4)), "budget = 128"),
                       (dict(method="dms", dms=DMSConfig(), compression_weight=-1), "compression_weight=-1")):
        with pytest.raises(KVLearnError) as err:
            RetrofitConfig(**base, **kw)
        assert expect in str(err.value) and "\n" not in str(err.value)
    for args, expect in ((["--method", "bogus"], "invalid choice: 'bogus'"),
                         (["--method", "streaming_plus", "--budget", "4"], "--budget=4 is invalid"),
                         (["--method", "dms", "--budget", "20", "--window", "16"], "--budget=20 is invalid")):
        argv = ["retrofit", "--model", teacher_path, "--out", str(tmp_path / "y"), "--seq-len", str(SEQ),
                "--device", "cpu", "--steps", "1", *args]
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err.strip()
        assert code == 2 and expect in err and len(err.splitlines()) == 1, err
    try:
        code = main(["retrofit", "--model", teacher_path, "--out", str(tmp_path / "z"), "--method", "dms",
                     "--budget", "48", "--window", "16", "--seq-len", str(SEQ), "--device", "cpu", "--steps", "1",
                     "--target-cr", "0.5"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "target_cr=0.5" in err and len(err.splitlines()) == 1, err


def test_dms_resume_matches_uninterrupted(teacher_path, tmp_path):
    """The Gumbel noise is drawn per step from (seed, step): a stopped and resumed run ends where an uninterrupted
    one does."""
    def config(out, **kw):
        return RetrofitConfig(model=teacher_path, out=str(out), method="dms",
                              dms=DMSConfig(sinks=4, window=16, budget=48, target_cr=SEQ / 48), steps=3,
                              batch_size=2, seq_len=SEQ, save_interval=1, warmup_steps=1, lr=1e-3, lr_new=1e-2, **kw)

    whole = retrofit(config(tmp_path / "a"), progress=False)
    retrofit(config(tmp_path / "b"), stop_after=2, progress=False)
    resumed = retrofit(config(tmp_path / "b", resume=True), progress=False)
    a = load_file(f"{whole['final']}/model.safetensors")
    b = load_file(f"{resumed['final']}/model.safetensors")
    assert a.keys() == b.keys() and any(".dms." in k for k in a)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-6, msg=n)
    logs = [(tmp_path / d / LOG_FILE).read_text().splitlines() for d in ("a", "b")]
    assert [json.loads(x)["closed_fraction"] for x in logs[0]] == [json.loads(x)["closed_fraction"] for x in logs[1]]


@pytest.mark.parametrize("name", ["kvpop", "streaming_plus", "dms"])
def test_training_forward_under_bf16_autocast(teacher_path, name):
    """The trainer runs the student under bf16 autocast on CUDA, where a Qwen3 layer hands its attention float32
    queries and keys (its q/k RMSNorms return float32) next to bf16 values. The same mix arises under CPU autocast:
    every method's training attention must accept it, and its logits must stay near the float32 forward's."""
    from kvlearn.train.distill import build_models, method_forward, student_forward

    from kvlearn import KVpopConfig

    config = RetrofitConfig(model=teacher_path, out="unused", method=name, seq_len=SEQ, steps=1, device="cpu",
                            kvpop=KVpopConfig(sinks=4, window=16, topk=28, scorer="mlp"),
                            streaming=StreamingConfig(budget=48, sinks=4) if name == "streaming_plus" else None,
                            dms=DMSConfig(sinks=4, window=16, budget=48) if name == "dms" else None)
    _, student = build_models(config, torch.device("cpu"))
    student.eval()  # no dropout; DMS draws its noise from the seeded generator in both forwards
    ids = torch.randint(3, VOCAB_SIZE, (2, SEQ), generator=torch.Generator().manual_seed(1))

    def forward():
        if name == "kvpop":
            return student_forward(student, ids, config.kvpop)[0]
        return method_forward(config, student, ids, step=0, fraction=0.5)[0]

    with torch.no_grad():
        reference = forward().float()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            mixed = forward().float()
    assert torch.isfinite(mixed).all()
    assert (mixed - reference).abs().max() < 0.05 * reference.abs().max() + 0.05


def test_target_options_reach_the_saved_kvpop_config(teacher_path, tmp_path, capsys):
    """``--target-aggregation`` / ``--target-count-normalize`` / ``--target-reduction`` set the KVpop target of the
    run (saved with the checkpoint); left out, the config's defaults stay; a bad value is argparse's one-line
    error."""
    assert cli_retrofit(teacher_path, tmp_path / "a", "kvpop", "--target-aggregation", "mean",
                        "--target-count-normalize", "0", "--target-reduction", "peak") == 0
    saved = json.loads((tmp_path / "a" / "final" / "config.json").read_text())["kvpop"]
    assert (saved["target_aggregation"], saved["target_count_normalize"], saved["target_reduction"]) == (
        "mean", False, "peak")
    assert cli_retrofit(teacher_path, tmp_path / "b", "kvpop") == 0
    saved = json.loads((tmp_path / "b" / "final" / "config.json").read_text())["kvpop"]
    default = kvlearn.KVpopConfig()
    assert (saved["target_aggregation"], saved["target_count_normalize"], saved["target_reduction"]) == (
        default.target_aggregation, default.target_count_normalize, default.target_reduction)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_retrofit(teacher_path, tmp_path / "c", "kvpop", "--target-count-normalize", "2")
    assert "--target-count-normalize: invalid choice: '2'" in capsys.readouterr().err


@pytest.mark.parametrize("flag, trained_topk", [("1", 28 - 10), ("0", 28)])
def test_readout_and_state_in_budget_options_reach_training_and_the_checkpoint(teacher_path, tmp_path, monkeypatch,
                                                                              flag, trained_topk):
    """``--readout immediate`` and ``--state-in-budget`` are saved with the checkpoint, and with the flag the
    training pattern holds the top-k the bf16 cache will hold. Hand count: budget 48 = 4 sinks + 16 window + top-28;
    the mLSTM state of the tiny model (head_dim 16, value width 8) is 4 * (16 * 8 + 16 + 1) = 580 bytes per KV head,
    a bf16 token's key and value 2 * 16 * 2 = 64 bytes: ceil(580 / 64) = 10 slots, so the run trains top-18."""
    import kvlearn.train.distill as distill

    seen = []
    original = distill.student_forward

    def spy(student, input_ids, kvpop, *rest):
        seen.append(kvpop.topk)
        return original(student, input_ids, kvpop, *rest)

    monkeypatch.setattr(distill, "student_forward", spy)
    assert cli_retrofit(teacher_path, tmp_path / "a", "kvpop", "--scorer", "mlstm", "--readout", "immediate",
                        "--state-in-budget", flag) == 0
    assert seen == [trained_topk, trained_topk]
    saved = json.loads((tmp_path / "a" / "final" / "config.json").read_text())["kvpop"]
    assert (saved["delayed_readout"], saved["state_in_budget"], saved["topk"]) == (False, flag == "1", 28)
    model = kvlearn.load(tmp_path / "a" / "final")
    scorer = kvlearn.kvpop.apply.kvpop_modules(model)[0][0]
    assert scorer.readout_delay == 0 and scorer.state_bytes_per_head() == 580


def test_mlstm_options_with_another_scorer_are_one_line(teacher_path, tmp_path, capsys):
    """--readout / --state-in-budget / --mlstm-skip change only the mLSTM scorer: with another scorer or method they
    would be ignored silently, so they are a one-line error naming them."""
    assert cli_retrofit(teacher_path, tmp_path / "a", "kvpop", "--scorer", "mlp", "--readout", "immediate") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--readout immediate: options of the mLSTM scorer, given with --method kvpop " \
        "--scorer mlp: expected --method kvpop --scorer mlstm" in err, err
    assert cli_retrofit(teacher_path, tmp_path / "b", "dms", "--state-in-budget", "1") == 2
    assert "--state-in-budget 1: options of the mLSTM scorer, given with --method dms" in capsys.readouterr().err
    assert cli_retrofit(teacher_path, tmp_path / "c", "kvpop", "--mlstm-compile-mode", "reduce-overhead") == 2
    assert "--mlstm-compile-mode reduce-overhead: options of the mLSTM scorer, given with --method kvpop --scorer mlp" \
        in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "abc")


def test_mlstm_compile_mode_reaches_the_saved_config_and_the_scorer(teacher_path, tmp_path):
    """``--mlstm-compile-mode reduce-overhead`` is saved with the checkpoint and built into the loaded scorer (on the
    CPU the scorer runs eagerly whatever the mode, so the run itself is the default's)."""
    assert cli_retrofit(teacher_path, tmp_path / "a", "kvpop", "--scorer", "mlstm", "--mlstm-compile-mode",
                        "reduce-overhead") == 0
    saved = json.loads((tmp_path / "a" / "final" / "config.json").read_text())["kvpop"]
    assert saved["mlstm_compile_mode"] == "reduce-overhead"
    scorer = kvlearn.kvpop.apply.kvpop_modules(kvlearn.load(tmp_path / "a" / "final"))[0][0]
    assert scorer.compile_mode == "reduce-overhead"


def test_mlstm_scorer_options_reach_the_saved_config_and_the_scorer_and_fix_the_resume(teacher_path, tmp_path, capsys):
    """``--mlstm-use-norm 1 --mlstm-chunk-size 32 --mlstm-value-dim 4 --mlstm-gate-softcap none`` are saved with the
    checkpoint and built into the loaded scorer; resuming the run with another value width is one line (the whole
    KVpop config must match, as for --mlstm-skip); bad values and the options with another scorer are one line."""
    flags = ("--mlstm-use-norm", "1", "--mlstm-chunk-size", "32", "--mlstm-value-dim", "4", "--mlstm-gate-softcap", "none")
    assert cli_retrofit(teacher_path, tmp_path / "a", "kvpop", "--scorer", "mlstm", *flags) == 0
    saved = json.loads((tmp_path / "a" / "final" / "config.json").read_text())["kvpop"]
    assert (saved["mlstm_use_norm"], saved["mlstm_chunk_size"], saved["mlstm_value_dim"], saved["mlstm_gate_softcap"]) \
        == (True, 32, 4, None)
    scorer = kvlearn.kvpop.apply.kvpop_modules(kvlearn.load(tmp_path / "a" / "final"))[0][0]
    assert (scorer.use_norm, scorer.chunk_size, scorer.value_dim, scorer.gate_softcap) == (True, 32, 4, None)
    assert scorer.w_v.shape[-1] == 4 and scorer.norm_weight is not None
    capsys.readouterr()
    assert cli_retrofit(teacher_path, tmp_path / "a", "kvpop", "--scorer", "mlstm", "--resume", *flags[:-4],
                        "--mlstm-value-dim", "6", "--mlstm-gate-softcap", "none") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loaders' progress lines
    assert err.startswith("kvlearn: error: resume:") and "'mlstm_value_dim': 4" in err and "'mlstm_value_dim': 6" in err, err
    for extra, needle in ((("--mlstm-gate-softcap", "-1"), "mlstm_gate_softcap=-1.0 is invalid: expected None"),
                          (("--mlstm-gate-softcap", "big"), "--mlstm-gate-softcap 'big' is invalid: expected a number"),
                          (("--mlstm-chunk-size", "0"), "mlstm_chunk_size=0 is invalid: expected an integer >= 1"),
                          (("--mlstm-value-dim", "0"), "mlstm_value_dim=0 is invalid: expected None")):
        assert cli_retrofit(teacher_path, tmp_path / "b", "kvpop", "--scorer", "mlstm", *extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err
    assert cli_retrofit(teacher_path, tmp_path / "b", "kvpop", "--mlstm-value-dim", "4", "--mlstm-gate-softcap",
                        "none") == 2
    assert "--mlstm-value-dim 4, --mlstm-gate-softcap none: options of the mLSTM scorer, given with --method kvpop " \
        "--scorer mlp" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_lr_default_is_the_configs(teacher_path, tmp_path):
    """Without ``--lr`` the run takes ``RetrofitConfig.lr`` (1e-4: the rate of Table 1's students), recorded in the
    checkpoint's trainer state; ``--lr`` overrides it."""
    from kvlearn.train.distill import STATE_FILE, RetrofitConfig

    base = ["retrofit", "--model", teacher_path, "--method", "kvpop", "--budget", "48", "--window", "16", "--steps", "1",
            "--batch-size", "2", "--seq-len", str(SEQ), "--device", "cpu", "--save-interval", "1"]
    assert RetrofitConfig.lr == 1e-4
    for out, extra, want in (("a", [], 1e-4), ("b", ["--lr", "3e-5"], 3e-5)):
        assert main([*base, "--out", str(tmp_path / out), *extra]) == 0
        state = torch.load(tmp_path / out / "step-1" / STATE_FILE, map_location="cpu", weights_only=False)
        assert state["config"]["lr"] == want


def test_compression_scope_head_holds_each_head_to_the_target(teacher_path, tmp_path, monkeypatch):
    """``--compression-scope head`` is saved with the DMS checkpoint, and the trainer's DMS loss is then the hinge
    per (row, layer, KV head), recounted here from the forward's recorded decisions; ``model`` (the reference's) is the
    hinge on each row's mean. A value outside the two is argparse's one-line error."""
    from kvlearn.dms import attention as dms_attention
    from kvlearn.train.distill import build_models, method_forward

    assert cli_retrofit(teacher_path, tmp_path / "h", "dms", "--compression-scope", "head") == 0
    saved = json.loads((tmp_path / "h" / "final" / "config.json").read_text())["dms"]
    assert saved["compression_scope"] == "head" and saved["target_cr"] == SEQ / (48 - 4 - 16)  # the long-range slots
    assert cli_retrofit(teacher_path, tmp_path / "h8", "dms", "--compression-scope", "head", "--target-cr", "8") == 0
    assert json.loads((tmp_path / "h8" / "final" / "config.json").read_text())["dms"]["target_cr"] == 8.0
    with pytest.raises(SystemExit):
        cli_retrofit(teacher_path, tmp_path / "x", "dms", "--compression-scope", "layer")

    states = []

    class Recording(dms_attention.DMSTrainForward):  # a subclass: the gate hook checks the state's type
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            states.append(self)

    monkeypatch.setattr(dms_attention, "DMSTrainForward", Recording)
    ids = torch.randint(3, VOCAB_SIZE, (2, SEQ), generator=torch.Generator().manual_seed(2))
    losses = {}
    for scope in ("model", "head"):
        config = RetrofitConfig(model=teacher_path, out="unused", method="dms", seq_len=SEQ, steps=1, device="cpu",
                                dms=DMSConfig(sinks=4, window=16, budget=48, compression_scope=scope))
        _, student = build_models(config, torch.device("cpu"))
        for gate in dms_gates(student):  # KV head 0 closes about 0.4 of its keys, KV head 1 almost none
            torch.nn.init.normal_(gate.proj.weight, std=0.05, generator=torch.Generator().manual_seed(4))
            with torch.no_grad():
                gate.proj.weight[1] *= 0.01
        with torch.no_grad():  # at 0.15 of the run the target (1/3: cr 1.5 of 4) lies between the two heads'
            _, loss, log = method_forward(config, student, ids, step=0, fraction=0.15)
        target = config.dms.target_fraction(0.15)
        assert target == pytest.approx(1 / 3)
        d = torch.stack([states[-1].records[i].decisions.float() for i in sorted(states[-1].records)])  # [L,B,H,T-1]
        per_head = d.mean(-1)  # [L, B, H]
        if scope == "model":
            want = (target - per_head.mean(dim=(0, 2))).clamp(min=0).mean()
        else:
            want = (target - per_head).clamp(min=0).mean()
        assert float(loss) == pytest.approx(float(want), abs=1e-6)
        assert log["closed_fraction"] == pytest.approx(float(per_head.mean()), abs=1e-6)
        by_head = per_head.mean(dim=1)  # [L, H]: the batch's closed fraction of each layer's KV head
        assert float(log["closed_head_min"]) == pytest.approx(float(by_head.min()), abs=1e-6)
        assert float(log["closed_head_max"]) == pytest.approx(float(by_head.max()), abs=1e-6)
        assert float(log["closed_head_max"]) > 0.3 > float(log["closed_head_min"])  # head 0 against head 1
        losses[scope] = float(loss)
    assert losses["head"] > losses["model"] + 0.01  # in the model scope head 0's closing pays for head 1


def test_a_dms_run_from_before_compression_scope_resumes_and_another_scope_is_refused(teacher_path, tmp_path,
                                                                                      capsys):
    """A trainer state saved before ``compression_scope`` existed (its DMS config lacks the field) resumes under the
    model scope, which is what it trained with, when ``--resume`` names no scope; resuming it with
    ``--compression-scope head`` is a one-line error."""
    out = tmp_path / "run"
    assert cli_retrofit(teacher_path, out, "dms", "--compression-scope", "model") == 0
    import shutil

    shutil.rmtree(out / "step-2")  # resume from step 1, whose state lacks the field
    shutil.rmtree(out / "final")
    state_path = out / "step-1" / "trainer_state.pt"
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    del state["config"]["dms"]["compression_scope"]
    torch.save(state, state_path)
    capsys.readouterr()
    assert cli_retrofit(teacher_path, out, "dms", "--compression-scope", "head", "--resume") == 2
    (err,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kvlearn: error")]
    assert "was trained with dms=" in err and "'compression_scope': 'model'" in err and "'head'" in err
    assert cli_retrofit(teacher_path, out, "dms", "--resume") == 0
    assert [json.loads(x)["step"] for x in (out / LOG_FILE).read_text().splitlines()] == [1, 2]
    assert (out / "final" / "config.json").is_file()


def test_a_fresh_dms_run_defaults_to_the_head_scope_and_a_resume_keeps_the_checkpoints(teacher_path, tmp_path):
    """Without ``--compression-scope`` a new DMS run trains each KV head for the budget's long-range slots (target CR
    seq-len / (budget - sinks - window)); ``--resume`` without it continues whichever scope the checkpoint has."""
    assert cli_retrofit(teacher_path, tmp_path / "new", "dms") == 0
    saved = json.loads((tmp_path / "new" / "final" / "config.json").read_text())["dms"]
    assert saved["compression_scope"] == "head" and saved["target_cr"] == SEQ / (48 - 4 - 16)
    for scope in ("model", "head"):
        out = tmp_path / scope
        assert cli_retrofit(teacher_path, out, "dms", "--compression-scope", scope) == 0
        import shutil

        shutil.rmtree(out / "step-2")
        shutil.rmtree(out / "final")
        assert cli_retrofit(teacher_path, out, "dms", "--resume") == 0  # refused if the scope (or its target) differed
        state = torch.load(out / "step-2" / STATE_FILE, map_location="cpu", weights_only=False)
        assert state["config"]["dms"]["compression_scope"] == scope
