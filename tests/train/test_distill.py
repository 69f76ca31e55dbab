"""The KVpop retrofit trainer on a tiny random GQA Qwen3 (float32, 2 layers, 2 KV heads, 4 query heads, head_dim 16,
the testbed vocabulary, sequences of 128 tokens): a few steps run with finite loss terms; the KD loss trains only
the backbone and the boundary loss only the scorers/decays; the training attention with a budget covering the
sequence is dense attention; a stopped run resumes and matches an uninterrupted one; the final checkpoint
round-trips through ``kvlearn.load``; bad input gives one-line errors (API and CLI); ``train_step`` driven by hand
takes the loop's steps; the plain distillation step of a copy of the teacher has the hand-computed KD loss."""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import kvlearn
from kvlearn import KVLearnError, KVpopConfig
from kvlearn.cli import main
from kvlearn.kvpop.apply import kvpop_modules, make_kvpop_cache
from kvlearn.kvpop.policy import sample_query_positions
from kvlearn.kvpop.train_attention import TrainForward
from kvlearn.testbed.data import training_batch
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from kvlearn.ops.distill_loss import kd_loss
from kvlearn.train.distill import (
    LOG_FILE,
    RetrofitConfig,
    build_models,
    dense_distill_step,
    dense_student,
    distill_losses,
    fused_adamw_applies,
    latest_checkpoint,
    make_optimizer,
    retrofit,
    student_forward,
    train_step,
    training_kvpop,
)

SEQ = 128
KV = dict(sinks=4, window=16, topk=32, scorer="mlp")


def make_config(teacher_path, out, **kw):
    base = dict(model=teacher_path, out=str(out), kvpop=KVpopConfig(**KV), steps=3, batch_size=2, seq_len=SEQ,
                save_interval=2, queries_per_step=16, warmup_steps=1, lr=1e-3, lr_new=1e-2)
    return RetrofitConfig(**{**base, **kw})


def one_line(err) -> str:
    message = str(err.value)
    assert message and "\n" not in message
    return message


def test_few_steps_finite(teacher_path, tmp_path):
    result = retrofit(make_config(teacher_path, tmp_path / "run"), progress=False)
    assert result["step"] == 3
    lines = [json.loads(ln) for ln in (tmp_path / "run" / LOG_FILE).read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3]
    for ln in lines:
        for key in ("loss", "kd", "boundary", "boundary_accuracy", "keep_fraction", "recall", "grad_norm"):
            assert math.isfinite(ln[key]), (key, ln)
        assert 0 <= ln["recall"] <= 1 and 0 <= ln["keep_fraction"] <= 1
        assert ln["boundary"] > 0 and ln["kd"] >= 0
    assert (tmp_path / "run" / "final" / "trainer_state.pt").is_file()
    assert latest_checkpoint(tmp_path / "run").name == "step-2"


def _losses(teacher, student, config):
    ids, labels = training_batch(2, SEQ, 7)
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits
    logits, state = student_forward(student, ids, config.kvpop)
    kv = config.kvpop
    queries = sample_query_positions(SEQ, kv.sinks, kv.window, kv.topk, 16)
    return kd_loss(logits, t_logits, labels, config.kd_topk), distill_losses(state, queries)["boundary"]


def _grads(student):
    new = {n: p.grad for n, p in student.named_parameters() if ".kvpop." in n}
    old = {n: p.grad for n, p in student.named_parameters() if ".kvpop." not in n}
    nonzero = lambda g: g is not None and bool(g.abs().sum() > 0)  # noqa: E731
    return {n: nonzero(g) for n, g in new.items()}, {n: nonzero(g) for n, g in old.items()}


def test_gradients_reach_only_the_intended_parameters(teacher_path, tmp_path):
    config = make_config(teacher_path, tmp_path / "g")
    teacher, student = build_models(config, torch.device("cpu"))
    scorers, _ = kvpop_modules(student)
    for sc in scorers:  # a non-zero output layer, so the scorer's first layer gets a gradient too
        torch.nn.init.normal_(sc.w2, std=0.5) if hasattr(sc, "w2") else None
    kd, bnd = _losses(teacher, student, config)
    kd.backward()
    new, old = _grads(student)
    assert not any(new.values()), "the KD loss reached the KVpop modules"
    assert any(old.values())
    student.zero_grad(set_to_none=True)
    kd, bnd = _losses(teacher, student, config)
    bnd.backward()
    new, old = _grads(student)
    assert not any(old.values()), "the boundary loss reached the backbone"
    assert any(v for n, v in new.items() if "scorer" in n) and any(v for n, v in new.items() if "decay" in n)
    assert all(p.grad is None for p in teacher.parameters())
    # one AdamW step on the boundary loss alone moves the KVpop weights and leaves the backbone as it was
    from kvlearn.train.distill import make_optimizer

    opt = make_optimizer(config, student, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    opt.step()
    for n, p in student.named_parameters():
        if ".kvpop." not in n:
            assert torch.equal(p, before[n]), n
    assert any(not torch.equal(p, before[n]) for n, p in student.named_parameters() if ".kvpop." in n)


def test_full_budget_attention_is_dense(teacher_path, tmp_path):
    config = make_config(teacher_path, tmp_path / "d")
    teacher, student = build_models(config, torch.device("cpu"))
    for sc in kvpop_modules(student)[0]:
        for p in sc.parameters():
            torch.nn.init.normal_(p)
    ids, _ = training_batch(2, SEQ, 3)
    full = KVpopConfig(sinks=4, window=16, topk=SEQ, scorer="mlp")  # every eligible token fits the top-k
    with torch.no_grad():
        dense = teacher(input_ids=ids).logits
        sparse, state = student_forward(student, ids, full)
        small, _ = student_forward(student, ids, config.kvpop)
    assert sorted(state.records) == [0, 1]
    assert (sparse - dense).abs().max() < 1e-4
    assert (small - dense).abs().max() > 1e-3  # a real budget does change the logits
    # the per-forward state lives on the TrainForward only: nothing on the modules, and a forward without it is dense
    assert not any(isinstance(v, TrainForward) for m in student.modules() for v in vars(m).values())
    with torch.no_grad():
        plain = student(input_ids=ids).logits
    assert (plain - dense).abs().max() < 1e-4


def _params(path):
    model = kvlearn.load(path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_resume_matches_uninterrupted(teacher_path, tmp_path):
    whole = retrofit(make_config(teacher_path, tmp_path / "a", steps=4), progress=False)
    stopped = retrofit(make_config(teacher_path, tmp_path / "b", steps=4), stop_after=3, progress=False)
    assert stopped["final"] is None and latest_checkpoint(tmp_path / "b").name == "step-2"
    resumed = retrofit(make_config(teacher_path, tmp_path / "b", steps=4, resume=True), progress=False)
    assert resumed["step"] == 4
    a, b = _params(whole["final"]), _params(resumed["final"])
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-6, msg=n)
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "b" / LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # step 3 of the stopped run was dropped and redone


def test_final_checkpoint_round_trip(teacher_path, tmp_path):
    config = make_config(teacher_path, tmp_path / "r", steps=2)
    result = retrofit(config, progress=False)
    model = kvlearn.load(result["final"])
    assert model.config.kvpop["topk"] == KV["topk"] and model.config.kvpop["scorer"] == "mlp"
    # the loaded weights (backbone and KVpop modules) are the trained ones, not the teacher's
    teacher = kvlearn.load(teacher_path)
    from safetensors.torch import load_file

    saved = load_file(f"{result['final']}/model.safetensors")
    state = model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert any(".kvpop." in k for k in saved)
    # it names its teacher by the digest of the teacher's weights (kvlearn.lineage)
    record = json.loads((Path(result["final"]) / "teacher.json").read_text())
    assert record["weights_sha256"] == hashlib.sha256((Path(teacher_path) / "model.safetensors").read_bytes()).hexdigest()
    assert any(not torch.equal(p, teacher.state_dict()[n]) for n, p in model.state_dict().items() if ".kvpop." not in n)
    # it decodes through its KVpop cache
    ids, _ = training_batch(1, SEQ, 5)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=make_kvpop_cache(model), use_cache=True)
    assert torch.isfinite(out.logits).all()


def test_bad_input_one_line(teacher_path, tmp_path):
    with pytest.raises(KVLearnError) as err:
        make_config(teacher_path, tmp_path / "x", kvpop=KVpopConfig(sinks=4, window=16, topk=108), seq_len=SEQ)
    assert "budget" in one_line(err) and "seq_len=128" in one_line(err)
    with pytest.raises(KVLearnError) as err:
        make_config(str(tmp_path / "missing"), tmp_path / "x")
    assert "does not exist" in one_line(err)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_embd=32, n_layer=1, n_head=2)).save_pretrained(gpt2)
    with pytest.raises(KVLearnError) as err:
        make_config(str(gpt2), tmp_path / "x")
    assert "not supported" in one_line(err)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f.txt").write_text("x")
    with pytest.raises(KVLearnError) as err:
        make_config(teacher_path, tmp_path / "full")
    assert "already holds files" in one_line(err)
    with pytest.raises(KVLearnError) as err:
        make_config(teacher_path, tmp_path / "empty", resume=True)
    assert "no step-<N> checkpoint" in one_line(err)


def test_cli_errors_and_run(teacher_path, tmp_path, capsys):
    def run(*args):
        code = main(["retrofit", *args])
        return code, capsys.readouterr()

    code, cap = run("--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert code == 2 and cap.err.count("\n") == 1 and "does not exist" in cap.err
    code, cap = run("--model", teacher_path, "--out", str(tmp_path / "o"), "--budget", "128", "--window", "16",
                    "--seq-len", "128")
    assert code == 2 and cap.err.count("\n") == 1 and "budget" in cap.err
    code, cap = run("--model", teacher_path, "--out", str(tmp_path / "o"), "--budget", "10", "--window", "16")
    assert code == 2 and cap.err.count("\n") == 1 and "--budget=10" in cap.err
    code, cap = run("--model", teacher_path, "--out", str(tmp_path / "o"), "--budget", "52", "--window", "16",
                    "--seq-len", "128", "--steps", "1", "--batch-size", "1", "--device", "cpu")
    assert code == 0, cap.err
    assert "kvlearn eval --model" in cap.out
    assert kvlearn.load(tmp_path / "o" / "final").config.kvpop["topk"] == 32


def test_cli_default_window_is_256_from_budget_512_and_half_the_budget_below(teacher_path, tmp_path, capsys):
    """Without ``--window`` the retrofit keeps the KVpop paper's 256 at budgets >= 512 (unchanged) and half the budget
    below, so a small budget trains instead of failing on a window larger than itself; ``--window`` still wins, and a
    window that leaves no long-range slot is still one line naming it."""
    from kvlearn.config import retrofit_window

    assert [retrofit_window(b) for b in (4096, 1024, 512, 511, 256, 48, 2)] == [256, 256, 256, 255, 128, 24, 1]
    common = ["--model", teacher_path, "--seq-len", "128", "--steps", "1", "--batch-size", "1", "--device", "cpu"]
    assert main(["retrofit", *common, "--out", str(tmp_path / "a"), "--budget", "48"]) == 0
    saved = kvlearn.load(tmp_path / "a" / "final").config.kvpop
    assert (saved["sinks"], saved["window"], saved["topk"]) == (4, 24, 20)
    assert main(["retrofit", *common, "--out", str(tmp_path / "b"), "--budget", "48", "--window", "8"]) == 0
    assert kvlearn.load(tmp_path / "b" / "final").config.kvpop["window"] == 8
    capsys.readouterr()
    assert main(["retrofit", *common, "--out", str(tmp_path / "c"), "--budget", "48", "--window", "44"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "window=44" in err and "--budget=48" in err


def test_kd_loss_by_hand():
    torch.manual_seed(1)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, 3, -100, 4, 5], [-100, -100, -100, -100, 7]])
    got = kd_loss(s, t, labels, topk=4)
    want, n = 0.0, 0
    for b in range(2):
        for i in range(4):
            if labels[b, i + 1] == -100:
                continue
            top = t[b, i].topk(4)
            p = torch.softmax(top.values, -1)
            logq = torch.log_softmax(s[b, i], -1)[top.indices]
            want += float((p * (p.log() - logq)).sum())
            n += 1
    assert abs(float(got) - want / n) < 1e-5
    assert float(kd_loss(t, t, labels, topk=11)) < 1e-6  # a student equal to the teacher: KL 0
    assert float(kd_loss(s, t, torch.full_like(labels, -100), topk=4)) == 0.0


@pytest.mark.parametrize("scorer", ["linear", "mlstm"])
def test_other_scorers_run(teacher_path, tmp_path, scorer):
    config = make_config(teacher_path, tmp_path / scorer, steps=1, kvpop=KVpopConfig(**{**KV, "scorer": scorer}))
    result = retrofit(config, progress=False)
    assert math.isfinite(result["log"]["loss"])
    assert kvlearn.load(result["final"]).config.kvpop["scorer"] == scorer


def test_minutes_budget_and_leftover_temp_folder(teacher_path, tmp_path):
    out = tmp_path / "m"
    result = retrofit(make_config(teacher_path, out, steps=None, minutes=0.001), progress=False)
    assert result["final"] is not None and result["step"] >= 0
    # a crash while writing leaves a .tmp- folder: resume ignores it, and the next save replaces it
    retrofit(make_config(teacher_path, tmp_path / "k", steps=4), stop_after=2, progress=False)
    (tmp_path / "k" / ".tmp-step-4").mkdir()
    assert latest_checkpoint(tmp_path / "k").name == "step-2"
    resumed = retrofit(make_config(teacher_path, tmp_path / "k", steps=4, resume=True), progress=False)
    assert resumed["step"] == 4 and not (tmp_path / "k" / ".tmp-step-4").exists()
    assert sorted(p.name for p in (tmp_path / "k").iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]
    with pytest.raises(KVLearnError) as err:  # resuming with another budget is refused
        retrofit(make_config(teacher_path, tmp_path / "k", steps=4, resume=True,
                             kvpop=KVpopConfig(**{**KV, "topk": 40})), progress=False)
    assert "topk" in one_line(err) and "resume" in one_line(err)


def test_training_attention_computes_the_configured_target(teacher_path, tmp_path):
    """``KVpopConfig.target_reduction`` / ``target_count_normalize`` reach the recorded targets. With a budget that
    holds everything the attention is dense, so each future probability is <= 1: the peak target stays <= log(1 +
    eps), the mean mass too, while the total mass of a token many queries attend exceeds 1 (target > 0)."""
    import dataclasses

    config = make_config(teacher_path, tmp_path / "t")
    _, student = build_models(config, torch.device("cpu"))
    ids, _ = training_batch(2, SEQ, 3)
    full = KVpopConfig(sinks=4, window=16, topk=SEQ, scorer="mlp")
    targets = {}
    for name, kw in {"mean": {"target_reduction": "mass"},
                     "total": {"target_reduction": "mass", "target_count_normalize": False},
                     "peak": {}}.items():  # the peak is the default
        with torch.no_grad():
            _, state = student_forward(student, ids, dataclasses.replace(full, **kw))
        targets[name] = torch.stack([state.records[i].target for i in sorted(state.records)])
    ceiling = math.log(1 + 1e-6) + 1e-6
    assert targets["peak"].max() <= ceiling and targets["mean"].max() <= ceiling
    assert targets["total"].max() > 0.5  # some token collects more than e^0.5 of total future probability
    assert not torch.equal(targets["peak"], targets["mean"])
    assert KVpopConfig().target_reduction == "peak" and KVpopConfig().target_count_normalize  # the paper's count
    with pytest.raises(KVLearnError, match="target_reduction='sum' is unknown") as err:
        KVpopConfig(target_reduction="sum")
    one_line(err)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_train_step_by_hand_takes_the_loops_steps(teacher_path, tmp_path, scorer):
    """``train_step`` called by hand, on the trainer's student, optimizer and batches, logs what ``retrofit`` logged
    for its first two steps (bit for bit: the loop is this call)."""
    from kvlearn.testbed.data import TestbedStream

    config = make_config(teacher_path, tmp_path / "loop", kvpop=KVpopConfig(**{**KV, "scorer": scorer}))
    retrofit(config, stop_after=2, progress=False)
    logged = [json.loads(ln) for ln in (tmp_path / "loop" / LOG_FILE).read_text().splitlines()]
    torch.manual_seed(config.seed)  # as retrofit() seeds before build_models
    teacher, student = build_models(config, torch.device("cpu"))
    optimizer = make_optimizer(config, student, torch.device("cpu"))
    kv = training_kvpop(config, student)
    batches = iter(TestbedStream(length=SEQ, batch_size=2, seed=config.seed, dense=config.dense_fraction))
    for step in range(2):
        ids, labels = next(batches)
        got = train_step(config, teacher, student, optimizer, ids, labels, step, step / config.steps, kv)
        assert got == {k: v for k, v in logged[step].items() if k not in ("step", "seconds")}, step


def test_dense_distill_step_of_a_teacher_copy(teacher_path, tmp_path):
    """A student equal to the teacher: with ``kd_topk`` covering the vocabulary the first step's KD loss is KL(p || p)
    = 0 (and so is the gradient); with a smaller top-k it is -log(teacher top-k mass), averaged over the supervised
    tokens (the renormalised teacher against the full-vocabulary student). The teacher never gets a gradient."""
    ids, labels = training_batch(2, SEQ, 7)
    config = make_config(teacher_path, tmp_path / "dense", kd_topk=VOCAB_SIZE)
    teacher, _ = build_models(config, torch.device("cpu"))
    student = dense_student(teacher)
    log = dense_distill_step(config, teacher, student, make_optimizer(config, student, torch.device("cpu")), ids,
                             labels)
    assert abs(log["kd"]) < 1e-6 and log["loss"] == log["kd"] and log["grad_norm"] < 1e-4
    assert all(p.grad is None for p in student.parameters()) and all(p.grad is None for p in teacher.parameters())

    config = make_config(teacher_path, tmp_path / "dense", kd_topk=16)
    student = dense_student(teacher)
    log = dense_distill_step(config, teacher, student, make_optimizer(config, student, torch.device("cpu")), ids,
                             labels)
    with torch.no_grad():
        probs = torch.softmax(teacher(input_ids=ids).logits[:, :-1], -1)  # [B, T-1, V]
    mass = probs.topk(16, dim=-1).values.sum(-1)[labels[:, 1:] != -100]  # [N]
    assert abs(log["kd"] - float(-mass.log().mean())) < 1e-5


def test_kd_loss_without_the_mask_gather_equals_the_masked_rows(monkeypatch):
    """Up to ``KD_DENSE_ELEMENTS`` logits ``kd_loss`` computes every position's KL and zeroes the unsupervised ones
    (no boolean-mask index, whose ``nonzero`` waits for the device); above it it gathers the supervised rows by the mask. Same value
    and gradient; the unsupervised positions' logits get no gradient either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvlearn.ops import distill_loss

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__.split(".")[0])
            if func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
                self.names.add("bool_index")  # a boolean mask index: its nonzero syncs with the device
            return func(*args, **(kwargs or {}))

    labels = torch.tensor([[-100, 3, -100, 4, 5, -100], [-100, -100, 9, -100, -100, 7]])
    out = {}
    for limit in (distill_loss.KD_DENSE_ELEMENTS, 0):
        monkeypatch.setattr(distill_loss, "KD_DENSE_ELEMENTS", limit)
        s = torch.randn(2, 6, 13, generator=torch.Generator().manual_seed(2), requires_grad=True)
        t = torch.randn(2, 6, 13, generator=torch.Generator().manual_seed(3))
        with Ops() as ops:
            loss = kd_loss(s, t, labels, topk=5)
        (grad,) = torch.autograd.grad(loss, s)
        out[limit] = (loss, grad, ops.names)
    (dense, g_dense, ops_dense), (masked, g_masked, ops_masked) = out.values()
    assert "bool_index" not in ops_dense and "nonzero" not in ops_dense and "bool_index" in ops_masked
    torch.testing.assert_close(dense, masked, rtol=1e-6, atol=1e-7)  # float32 (kd_loss's), summed in another order
    torch.testing.assert_close(g_dense, g_masked, rtol=1e-6, atol=1e-8)
    assert (g_dense[0, 1] == 0).all() and (g_dense[:, -1] == 0).all()  # unsupervised positions: no gradient


def test_fused_adamw_selection_and_state_dicts_across_kinds(teacher_path, tmp_path, monkeypatch):
    """AdamW is fused only when every parameter is a plain CUDA floating tensor (never on the CPU, never for a tensor
    subclass such as FSDP2's DTensor); ``fused=`` forces either kind. A fused and a default AdamW take the same
    steps (to rounding), and the checkpoint's optimizer state of one kind resumes in the other."""
    from kvlearn.train import distill, parallel

    config = make_config(teacher_path, tmp_path / "f")
    _, student = build_models(config, torch.device("cpu"))
    assert not fused_adamw_applies(student.parameters()) and not fused_adamw_applies([])

    class Sub(torch.Tensor):  # a tensor subclass that says it is on CUDA: still not fused (the type decides)
        is_cuda = True

    assert torch.zeros(2).as_subclass(Sub).is_cuda and not fused_adamw_applies([torch.zeros(2).as_subclass(Sub)])
    assert not make_optimizer(config, student, torch.device("cpu")).defaults["fused"]  # the CPU path: unchanged
    monkeypatch.setattr(distill, "fused_adamw_applies", lambda params: True)  # as on CUDA
    assert make_optimizer(config, student, torch.device("cpu")).defaults["fused"]
    assert not make_optimizer(config, student, torch.device("cpu"), fused=False).defaults["fused"]
    monkeypatch.undo()

    def run(fused_first: bool, fused_then: bool, steps=(2, 2)):
        torch.manual_seed(0)
        _, model = build_models(config, torch.device("cpu"))
        opt = make_optimizer(config, model, torch.device("cpu"), fused=fused_first)
        g = torch.Generator().manual_seed(5)
        grads = [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(sum(steps))]
        for i in range(sum(steps)):
            if i == steps[0]:  # "resume": the checkpoint's optimizer state into a new optimizer of the other kind
                state = parallel.full_optimizer_state_dict(model, opt)
                opt = make_optimizer(config, model, torch.device("cpu"), fused=fused_then)
                parallel.load_optimizer_state_dict(model, opt, state)
            for p, gr in zip(model.parameters(), grads[i]):
                p.grad = gr.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()]

    plain = run(False, False)
    for kinds in ((True, True), (True, False), (False, True)):
        for a, b in zip(run(*kinds), plain):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_retrofit_takes_fused_adamw_and_resumes(teacher_path, tmp_path):
    """On CUDA the trainer's AdamW is fused, and a fused and a foreach AdamW take the same steps (to float
    rounding, on the same gradients); a stopped CUDA run's checkpoint holds the fused optimizer state, which a
    new fused optimizer loads as saved, and the run resumes to its end."""
    from kvlearn.train import parallel
    from kvlearn.train.distill import load_trainer_state

    config = make_config(teacher_path, tmp_path / "g", device="cuda")
    _, student = build_models(config, torch.device("cuda"))
    assert fused_adamw_applies(student.parameters())
    assert make_optimizer(config, student, torch.device("cuda")).defaults["fused"]
    assert not make_optimizer(config, student, torch.device("cuda"), fused=False).defaults["fused"]

    models = []
    for fused in (True, False):
        torch.manual_seed(0)
        _, model = build_models(config, torch.device("cuda"))
        opt = make_optimizer(config, model, torch.device("cuda"), fused=fused)
        g = torch.Generator(device="cuda").manual_seed(5)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda")
            opt.step()
            opt.zero_grad(set_to_none=True)
        models.append([p.detach() for p in model.parameters()])
    for a, b in zip(*models):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    kw = dict(device="cuda", steps=4)
    retrofit(make_config(teacher_path, tmp_path / "b", **kw), stop_after=3, progress=False)
    resume = make_config(teacher_path, tmp_path / "b", resume=True, **kw)
    _, model = build_models(resume, torch.device("cuda"))
    trainer = load_trainer_state(latest_checkpoint(tmp_path / "b"), model, resume)
    opt = make_optimizer(resume, model, torch.device("cuda"))
    parallel.load_optimizer_state_dict(model, opt, trainer["optimizer"])
    loaded = parallel.full_optimizer_state_dict(model, opt)["state"]
    saved = trainer["optimizer"]["state"]
    assert opt.defaults["fused"] and loaded.keys() == saved.keys() and int(trainer["step"]) == 2
    for name, state in saved.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(loaded[name][key].cpu().float(), state[key].cpu().float(), rtol=0, atol=0)
    assert retrofit(resume, progress=False)["step"] == 4


def test_distill_losses_of_all_layers_at_once_equal_the_loop_over_layers(teacher_path, tmp_path):
    """``distill_losses`` computes every layer in one pass; a loop over the layers (each layer's own teacher policy,
    decisions, ``boundary_loss`` and recall, then the means: what it computed before) gives the same terms, and
    the same gradient into every scorer and decay parameter. The layers differ (own scorers, targets and decay)."""
    from kvlearn.kvpop.loss import boundary_loss
    from kvlearn.kvpop.policy import boundary_decisions, teacher_policy
    from kvlearn.train.distill import retention_recall

    config = make_config(teacher_path, tmp_path / "l", kvpop=KVpopConfig(**{**KV, "margin_temperature": 0.5}))
    _, student = build_models(config, torch.device("cpu"))
    scorers, decays = kvpop_modules(student)
    torch.manual_seed(4)
    for sc, dc in zip(scorers, decays):  # layers with different, non-neutral scorers and decays
        torch.nn.init.normal_(sc.w2, std=0.5)
        torch.nn.init.normal_(dc.alpha, std=1.0)
    ids, _ = training_batch(2, SEQ, 9)
    _, state = student_forward(student, ids, config.kvpop)
    assert len(state.records) == 2
    kv = config.kvpop
    queries = sample_query_positions(SEQ, kv.sinks, kv.window, kv.topk, 16, generator=torch.Generator().manual_seed(1))
    params = [p for n, p in student.named_parameters() if ".kvpop." in n]

    got = distill_losses(state, queries)
    got_grads = torch.autograd.grad(got["boundary"], params, retain_graph=True)

    parts = {"boundary": [], "boundary_accuracy": [], "keep_fraction": [], "recall": []}
    for layer in sorted(state.records):
        rec = state.records[layer]
        teacher = teacher_policy(rec.target, rec.log_gamma, kv.sinks, kv.window, kv.topk)
        dec = boundary_decisions(teacher, queries, kv.sinks, kv.window, kv.topk)
        res = boundary_loss(rec.priorities, teacher.priorities, dec, temperature=kv.loss_temperature,
                            margin_weighting=kv.margin_weighting, margin_min_weight=kv.margin_min_weight,
                            margin_temperature=kv.margin_temperature, balance=kv.balance,
                            balance_clip=tuple(kv.balance_clip))
        parts["boundary"].append(res.loss)
        parts["boundary_accuracy"].append(res.accuracy)
        parts["keep_fraction"].append((((dec.y > 0) & dec.valid).sum() / dec.valid.sum().clamp(min=1)).float())
        parts["recall"].append(retention_recall(rec.ranks, rec.cutoffs, teacher.ranks, teacher.cutoffs, queries,
                                                kv.sinks, kv.window))
    want = {key: torch.stack(v).mean() for key, v in parts.items()}
    assert len({float(x.detach()) for x in parts["boundary"]}) == 2 and len({float(x) for x in parts["recall"]}) == 2
    want_grads = torch.autograd.grad(want["boundary"], params)
    torch.testing.assert_close(got["boundary"], want["boundary"], rtol=1e-6, atol=1e-7)
    for key in ("boundary_accuracy", "keep_fraction", "recall"):  # counts: the same numbers exactly
        assert torch.equal(got[key], want[key].detach()), key
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def trainer_cli(teacher_path, tmp_path, monkeypatch):
    """``(got, retrofit argv, kaizen-train argv)``: both trainers replaced by recorders of the config they get
    (``got``), and the argument lists of a small run of each on the CPU."""
    from kvlearn.train import distill as distill_module
    from kvlearn.train import kaizen_train as kaizen_module

    got = []
    monkeypatch.setattr(distill_module, "retrofit", lambda c: got.append(c) or {"final": "f", "step": 0})
    monkeypatch.setattr(kaizen_module, "kaizen_train", lambda c: got.append(c) or {"final": "f", "step": 0})
    common = ["--model", teacher_path, "--seq-len", "128", "--device", "cpu"]
    retro = ["retrofit", *common, "--out", str(tmp_path / "r"), "--budget", "52", "--window", "16"]
    return got, retro, ["kaizen-train", *common, "--out", str(tmp_path / "k")]


def test_dense_fraction_flag_reaches_both_trainers(teacher_path, tmp_path, monkeypatch, capsys):
    """``--dense-fraction`` of ``kvlearn retrofit`` and ``kvlearn kaizen-train`` lands in the config the trainer gets
    (default 0.75); a share outside [0, 1] is a one-line error naming the value and the range."""
    from kvlearn import cli

    got, retro, kaizen = trainer_cli(teacher_path, tmp_path, monkeypatch)
    assert cli.main(retro) == 0 and got[-1].dense_fraction == 0.75
    assert cli.main([*retro, "--dense-fraction", "0.25"]) == 0 and got[-1].dense_fraction == 0.25
    assert cli.main([*kaizen, "--dense-fraction", "0"]) == 0 and got[-1].dense_fraction == 0.0
    assert type(got[-1]).__name__ == "KaizenTrainConfig"
    capsys.readouterr()
    assert cli.main([*kaizen, "--dense-fraction", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dense_fraction=1.5 is invalid: expected True, False or a share of dense rows in [0, 1]" in err


def test_zero_steps_are_refused_not_replaced_by_the_default(teacher_path, tmp_path, monkeypatch, capsys):
    """``--steps 0`` of ``kvlearn retrofit`` and ``kvlearn kaizen-train`` is a one-line error (it once became the
    default 1000 steps: a real run on a nonsensical value); no ``--steps`` and no ``--minutes`` is still 1000."""
    from kvlearn import cli

    got, retro, kaizen = trainer_cli(teacher_path, tmp_path, monkeypatch)
    for argv in (retro, kaizen):
        assert cli.main(argv) == 0 and got[-1].steps == 1000
        capsys.readouterr()
        assert cli.main([*argv, "--steps", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "steps=0 is invalid: expected an integer >= 1" in err, err
    assert len(got) == 2


def test_family_weights_draw_the_retrofits_batches(teacher_path, tmp_path, monkeypatch, capsys):
    """``family_weights`` (``kvlearn retrofit --family-weights``) set the family mixture of the retrofit's training
    stream: with all weight on vt, the batches the loop trains on are the testbed's vt-only batches of the same seeds
    (and not the uniform ones); a resume with other weights, weights of the wrong length and negative weights are
    one-line errors naming the values; the flag reaches the config."""
    from kvlearn import cli
    from kvlearn.testbed.data import batch_examples
    from kvlearn.testbed.tasks import FAMILIES
    from kvlearn.train import distill as distill_module

    weights = (0.0, 0.0, 1.0, 0.0)  # trace, niah, vt, recall
    seen = []
    real_step = distill_module.train_step

    def recording_step(config, teacher, student, optimizer, input_ids, *rest, **kw):
        seen.append(input_ids.clone())
        return real_step(config, teacher, student, optimizer, input_ids, *rest, **kw)

    monkeypatch.setattr(distill_module, "train_step", recording_step)
    config = make_config(teacher_path, tmp_path / "w", steps=2, family_weights=list(weights))
    assert config.family_weights == weights  # a tuple of floats
    retrofit(config, progress=False)
    assert len(seen) == 2
    for b, ids in enumerate(seen):
        seed = (config.seed << 40) | b  # the stream's batch seed
        want, _ = training_batch(2, SEQ, seed, FAMILIES, list(weights), config.dense_fraction)
        uniform, _ = training_batch(2, SEQ, seed, FAMILIES, None, config.dense_fraction)
        assert torch.equal(ids, want) and not torch.equal(ids, uniform)
        assert {e.family for e in batch_examples(2, SEQ, seed, FAMILIES, list(weights), config.dense_fraction)} == {"vt"}
    # a resume must keep the mixture it was trained with
    retrofit(make_config(teacher_path, tmp_path / "r", steps=4, family_weights=weights), stop_after=3, progress=False)
    with pytest.raises(KVLearnError) as err:
        retrofit(make_config(teacher_path, tmp_path / "r", steps=4, resume=True), progress=False)
    assert "family_weights" in one_line(err) and "resume with the same settings" in one_line(err)
    for bad in ((1.0, 1.0), (1.0, -1.0, 1.0, 1.0)):
        with pytest.raises(KVLearnError) as err:
            make_config(teacher_path, tmp_path / "x", family_weights=bad)
        assert "weights=" in one_line(err) and "non-negative numbers with a positive sum" in one_line(err)
    got = []
    monkeypatch.setattr(distill_module, "retrofit", lambda c: got.append(c) or {"final": "f", "step": 0})
    common = ["retrofit", "--model", teacher_path, "--seq-len", "128", "--device", "cpu", "--out", str(tmp_path / "c"),
              "--budget", "52", "--window", "16"]
    assert cli.main(common) == 0 and got[-1].family_weights is None
    assert cli.main([*common, "--family-weights", "2,1,1,1"]) == 0 and got[-1].family_weights == (2.0, 1.0, 1.0, 1.0)
    capsys.readouterr()
    assert cli.main([*common, "--family-weights", "2,x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--family-weights '2,x'" in err


def test_cuda_graph_scorer_under_several_processes_is_one_line(teacher_path, tmp_path, monkeypatch):
    """``mlstm_compile_mode="reduce-overhead"`` is refused under FSDP (a world of 2 processes), before any output is
    written, with a message naming the mode and the fix; one process, or the MLP scorer, takes it."""
    from kvlearn.train import parallel

    monkeypatch.setattr(parallel, "init_distributed", lambda device: parallel.DistInfo(0, 2, 0))
    kv = KVpopConfig(**{**KV, "scorer": "mlstm", "mlstm_compile_mode": "reduce-overhead"})
    with pytest.raises(KVLearnError) as err:
        retrofit(make_config(teacher_path, tmp_path / "a", kvpop=kv))
    assert "mlstm_compile_mode='reduce-overhead' with 2 processes (FSDP) is not supported" in one_line(err)
    assert "expected mlstm_compile_mode='default'" in one_line(err) and not (tmp_path / "a").exists()
    monkeypatch.setattr(parallel, "init_distributed", lambda device: parallel.DistInfo(0, 1, 0))
    assert retrofit(make_config(teacher_path, tmp_path / "b", kvpop=kv, steps=1), progress=False)["step"] == 1


def test_options_a_method_does_not_read_are_warned_about(teacher_path, tmp_path, monkeypatch, capsys):
    """``kvlearn retrofit`` names the method-specific options set away from their defaults that the chosen method
    ignores (one warning line; the run goes on, as the Table 1 chain passes ``--window`` to every method), and says
    nothing when every option given is read."""
    from kvlearn import cli

    got, retro, _ = trainer_cli(teacher_path, tmp_path, monkeypatch)
    base = [a for a in retro if a not in ("--window", "16")]  # ["retrofit", ..., "--budget", "52"]
    assert cli.main([*base, "--window", "16", "--decay-init", "0.9999"]) == 0 and got[-1].method == "kvpop"
    assert capsys.readouterr().err == ""
    assert cli.main([*base, "--method", "streaming_plus", "--window", "16", "--scorer", "mlstm"]) == 0
    err = capsys.readouterr().err
    assert err == "warning: --window 16, --scorer mlstm: not read by --method streaming_plus (ignored)\n"
    assert cli.main([*base, "--window", "16", "--target-cr", "8", "--gate-hidden", "4"]) == 0
    assert capsys.readouterr().err == "warning: --target-cr 8.0, --gate-hidden 4: not read by --method kvpop (ignored)\n"
    assert cli.main([*base, "--method", "dms", "--window", "16", "--gate-hidden", "4"]) == 0
    assert capsys.readouterr().err == ""


def test_num_workers_default_follows_the_device(teacher_path, tmp_path, monkeypatch, capsys):
    """``num_workers`` of both trainers' configs (and ``--num-workers`` of ``kvlearn retrofit`` / ``kaizen-train``):
    left out, 0 on the CPU (the CLI path) and ``GPU_DATA_WORKERS`` on a CUDA device, capped at the cores less one
    shared among ``torchrun``'s processes on the host (checked on the rule itself, this machine having no GPU); given,
    it is kept, and a negative count is a one-line error."""
    from kvlearn import KaizenTrainConfig, cli
    from kvlearn.train import distill

    got, retro, kaizen = trainer_cli(teacher_path, tmp_path, monkeypatch)
    for argv in (retro, kaizen):
        assert cli.main(argv) == 0 and got[-1].num_workers == 0
        assert cli.main([*argv, "--num-workers", "2"]) == 0 and got[-1].num_workers == 2
        capsys.readouterr()
        assert cli.main([*argv, "--num-workers", "-1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "num_workers=-1 is invalid: expected an integer >= 0" in err
    assert make_config(teacher_path, tmp_path / "r2").num_workers == 0  # the Python API: the same rule
    assert make_config(teacher_path, tmp_path / "r3", num_workers=4).num_workers == 4
    assert KaizenTrainConfig(model=teacher_path, seq_len=128).num_workers == 0
    help_text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["kaizen-train"].format_help().split())
    assert f"(default: {distill.GPU_DATA_WORKERS} on a CUDA device" in help_text  # the help states the rule's number
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cores, want in ((16, 3), (3, 2), (1, 0), (None, 0)):
        monkeypatch.setattr(distill.os, "cpu_count", lambda c=cores: c)
        assert distill.default_num_workers("cuda") == want and distill.default_num_workers("cuda:1") == want
        assert distill.default_num_workers("cpu") == 0
    for cores, ranks, want in ((16, "8", 1), (16, "2", 3), (8, "4", 1), (4, "8", 0), (16, "x", 3), (16, "0", 3)):
        monkeypatch.setattr(distill.os, "cpu_count", lambda c=cores: c)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)  # torchrun: the host's cores shared among its processes
        assert distill.default_num_workers("cuda") == want
