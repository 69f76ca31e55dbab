"""``RetrofitConfig.readout_penalty`` / ``kvlearn retrofit --readout-penalty``: ``readout_penalty_term`` against a
hand computation (value and gradient), the penalty in the logged loss and the direction it moves the readout
weights in a real step, the resume check, and one-line errors for what it does not apply to. Tiny random GQA Qwen3
(2 KV heads, 2 query heads per KV head), float32, CPU."""

import json

import pytest
import torch

from kvlearn import KVLearnError
from kvlearn.checkpoint import load
from kvlearn.config import KVpopConfig
from kvlearn.kvpop.apply import kvpop_modules
from kvlearn.train.distill import RetrofitConfig, readout_penalty_term, retrofit

KVPOP = dict(sinks=4, window=16, topk=32, scorer="mlstm")
COMMON = dict(batch_size=2, seq_len=128, save_interval=10, warmup_steps=0, lr=1e-3, lr_new=1e-2, grad_clip=1e9)


@pytest.fixture(scope="module")
def teacher_path(make_teacher):
    return make_teacher(2, 5)


@pytest.fixture(scope="module")
def trained_student(teacher_path, tmp_path_factory):
    """An mLSTM student after 2 steps: its readout weights are no longer 0."""
    out = tmp_path_factory.mktemp("start")
    result = retrofit(RetrofitConfig(model=teacher_path, out=str(out), steps=2, kvpop=KVpopConfig(**KVPOP), **COMMON),
                      progress=False)
    return result["final"]


def readout_weights(folder) -> list[torch.Tensor]:
    scorers, _ = kvpop_modules(load(folder, dtype=torch.float32))
    return [sc.a.detach().clone() for sc in scorers]


def test_term_is_the_mean_squared_norm_per_head_and_layer(trained_student):
    student = load(trained_student, dtype=torch.float32)
    scorers, _ = kvpop_modules(student)
    a = [sc.a for sc in scorers]  # [H, Dv] per layer
    assert len(a) == 2 and all(x.shape[0] == 2 for x in a) and all(bool((x != 0).any()) for x in a)
    by_hand = sum(float((x.detach().double() ** 2).sum()) for x in a) / (len(a) * a[0].shape[0])
    term = readout_penalty_term(student)
    assert abs(float(term.detach()) - by_hand) < 1e-6 * max(1.0, by_hand)
    term.backward()
    for x in a:  # d/da of mean_l mean_h ||a_h||^2 = 2 a / (layers x heads)
        torch.testing.assert_close(x.grad, 2 * x.detach() / (len(a) * x.shape[0]), rtol=1e-6, atol=1e-9)


def test_a_step_under_a_large_penalty_moves_every_readout_weight_toward_zero(teacher_path, trained_student, tmp_path):
    before = readout_weights(trained_student)
    moved = {}
    for weight in (0.0, 1e6):
        out = tmp_path / f"w{weight:g}"
        retrofit(RetrofitConfig(model=teacher_path, out=str(out), steps=1, kvpop=KVpopConfig(**KVPOP),
                                init_student=trained_student, readout_penalty=weight, **{**COMMON, "lr_new": 1e-4}),
                 progress=False)
        after = readout_weights(out / "final")
        moved[weight] = torch.cat([(torch.sign(n - o) == -torch.sign(o)).flatten() for n, o in zip(after, before)])
        log = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])
        if weight:
            expected = weight * float(readout_penalty_term(load(trained_student, dtype=torch.float32)))
            assert log["readout_penalty"] == pytest.approx(expected, rel=1e-5)
            assert log["loss"] == pytest.approx(log["kd"] + log["boundary"] + expected, rel=1e-5)
        else:
            assert "readout_penalty" not in log
    assert bool(moved[1e6].all())  # the penalty's gradient dominates: every weight steps toward 0
    assert not bool(moved[0.0].all())  # without it the boundary loss moves some away (else the check is empty)


def test_resume_checks_the_weight(teacher_path, tmp_path):
    cfg = dict(model=teacher_path, out=str(tmp_path / "r"), steps=2, kvpop=KVpopConfig(**KVPOP),
               **{**COMMON, "save_interval": 1})
    retrofit(RetrofitConfig(**cfg, readout_penalty=0.5), stop_after=1, progress=False)
    with pytest.raises(KVLearnError, match="readout_penalty") as err:
        retrofit(RetrofitConfig(**cfg, resume=True), progress=False)
    assert len(str(err.value).splitlines()) == 1
    assert retrofit(RetrofitConfig(**cfg, resume=True, readout_penalty=0.5), progress=False)["step"] == 2


def test_what_it_does_not_apply_to_is_one_line(teacher_path, tmp_path):
    from kvlearn.cli import main

    cases = [
        (dict(kvpop=KVpopConfig(**{**KVPOP, "scorer": "mlp"}), readout_penalty=1.0),
         "readout_penalty=1.0 is for method 'kvpop' with scorer 'mlstm'"),
        (dict(readout_penalty=-1.0), "readout_penalty"),
    ]
    for i, (change, match) in enumerate(cases):
        kw = {"model": teacher_path, "out": str(tmp_path / f"bad{i}"), "steps": 1, "kvpop": KVpopConfig(**KVPOP),
              **COMMON, **change}
        with pytest.raises(KVLearnError, match=match) as err:
            RetrofitConfig(**kw)
        assert len(str(err.value).splitlines()) == 1
    base = ["retrofit", "--model", teacher_path, "--out", str(tmp_path / "cli"), "--budget", "52", "--window", "16",
            "--sinks", "4", "--steps", "1", "--seq-len", "128", "--batch-size", "2"]
    assert main([*base, "--readout-penalty", "1"]) == 2  # the MLP scorer (the default): one-line error
    assert not (tmp_path / "cli").exists()
    # under FSDP the penalty is supported: tests/train/test_distill_fsdp.py compares it with one process
