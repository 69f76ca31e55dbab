"""``RetrofitConfig.freeze_backbone`` / ``kvlearn retrofit --freeze-backbone``: a scorer-only KVpop retrofit. The
existing weights must come out bit for bit as built (the teacher's, or an ``init_student``'s), the scorers and
decays must take exactly the update an unfrozen run gives them on the same first batch (their gradient is the
boundary loss's alone either way: their inputs are detached), and what it cannot do is a one-line error.
Tiny random GQA Qwen3 (2 KV heads, 2 query heads per KV head), float32, CPU."""

import pytest
import torch

from kvlearn import KVLearnError
from kvlearn.checkpoint import load
from kvlearn.config import KVpopConfig
from kvlearn.train import parallel
from kvlearn.train.distill import RetrofitConfig, retrofit

KVPOP = dict(sinks=4, window=16, topk=32, scorer="mlp")
# no clipping: a clipped update depends on the norm over every trained tensor, backbone included
COMMON = dict(batch_size=2, seq_len=128, save_interval=10, warmup_steps=0, lr=1e-3, lr_new=1e-2, grad_clip=1e9)


def is_new(name: str) -> bool:
    return ".kvpop." in name


def run(teacher: str, out, steps: int, **kw) -> dict:
    """The final student's float32 state dict after ``steps`` steps."""
    result = retrofit(RetrofitConfig(model=teacher, out=str(out), steps=steps, kvpop=KVpopConfig(**KVPOP),
                                     **{**COMMON, **kw}), progress=False)
    return load(result["final"], dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def teacher_path(make_teacher):
    return make_teacher(2, 3)


def test_frozen_backbone_stays_and_the_scorers_take_the_unfrozen_first_update(teacher_path, tmp_path):
    frozen = run(teacher_path, tmp_path / "frozen", 1, freeze_backbone=True)
    trained = run(teacher_path, tmp_path / "trained", 1)
    teacher = load(teacher_path, dtype=torch.float32).state_dict()
    backbone = [k for k in frozen if not is_new(k)]
    assert backbone and set(backbone) == set(teacher)
    for k in backbone:  # bit for bit the teacher's
        torch.testing.assert_close(frozen[k], teacher[k], rtol=0, atol=0, msg=k)
    # the unfrozen run moved the backbone (else the check above could not fail)
    assert any(not torch.equal(trained[k], teacher[k]) for k in backbone)
    # the scorers and decays: the same first step in both runs, and a real one
    scorers = [k for k in frozen if is_new(k)]
    fresh = run(teacher_path, tmp_path / "fresh", 1, freeze_backbone=True, lr_new=1e-12, lr_decay=1e-12)
    assert any(not torch.allclose(frozen[k], fresh[k], rtol=0, atol=1e-6) for k in scorers)
    # the score's output bias is left out: the boundary loss hardly depends on a shift of every score, so its gradient
    # is float noise (~1e-8) that Adam's normalisation turns into an update of either sign
    compared = [k for k in scorers if not k.endswith(".scorer.b2")]
    assert any(k.endswith(".scorer.w2") for k in compared) and any(k.endswith(".decay.alpha") for k in compared)
    for k in compared:
        torch.testing.assert_close(frozen[k], trained[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_frozen_refit_keeps_the_init_students_backbone(teacher_path, tmp_path):
    from kvlearn.cli import main

    start = run(teacher_path, tmp_path / "start", 2)  # a trained student: its backbone is not the teacher's
    code = main(["retrofit", "--model", teacher_path, "--out", str(tmp_path / "refit"), "--init-student",
                 str(tmp_path / "start" / "final"), "--freeze-backbone", "--budget", "52", "--window", "16",
                 "--sinks", "4", "--steps", "2", "--seq-len", "128", "--batch-size", "2", "--lr-new", "1e-2"])
    assert code == 0
    refit = load(str(tmp_path / "refit" / "final"), dtype=torch.float32).state_dict()
    teacher = load(teacher_path, dtype=torch.float32).state_dict()
    assert any(not torch.equal(start[k], teacher[k]) for k in teacher)
    for k in teacher:
        torch.testing.assert_close(refit[k], start[k], rtol=0, atol=0, msg=k)
    assert any(not torch.equal(refit[k], start[k]) for k in refit if is_new(k))
    state = torch.load(tmp_path / "refit" / "final" / "trainer_state.pt", weights_only=False)
    assert state["config"]["freeze_backbone"] is True


def test_resume_checks_the_flag(teacher_path, tmp_path):
    cfg = dict(model=teacher_path, out=str(tmp_path / "r"), steps=2, kvpop=KVpopConfig(**KVPOP),
               **{**COMMON, "save_interval": 1})
    retrofit(RetrofitConfig(**cfg, freeze_backbone=True), stop_after=1, progress=False)
    with pytest.raises(KVLearnError, match="freeze_backbone") as err:
        retrofit(RetrofitConfig(**cfg, resume=True), progress=False)
    assert len(str(err.value).splitlines()) == 1
    assert retrofit(RetrofitConfig(**cfg, resume=True, freeze_backbone=True), progress=False)["step"] == 2


def test_what_it_cannot_do_is_one_line(teacher_path, tmp_path, monkeypatch):
    cases = [
        (dict(method="streaming_plus", streaming=dict(budget=40, sinks=4), freeze_backbone=True),
         "freeze_backbone=True is for method 'kvpop'"),
        (dict(freeze_backbone="yes"), "freeze_backbone='yes' is invalid: expected True or False"),
    ]
    for i, (change, match) in enumerate(cases):
        kw = {"model": teacher_path, "out": str(tmp_path / f"bad{i}"), "steps": 1, "kvpop": KVpopConfig(**KVPOP),
              **COMMON, **change}
        with pytest.raises(KVLearnError, match=match) as err:
            RetrofitConfig(**kw)
        assert len(str(err.value).splitlines()) == 1
    monkeypatch.setattr(parallel, "init_distributed", lambda device: parallel.DistInfo(0, 2, 0))
    with pytest.raises(KVLearnError, match="freeze_backbone=True with 2 processes") as err:
        retrofit(RetrofitConfig(model=teacher_path, out=str(tmp_path / "fsdp"), steps=1,
                                kvpop=KVpopConfig(**KVPOP), freeze_backbone=True, **COMMON), progress=False)
    assert len(str(err.value).splitlines()) == 1 and not (tmp_path / "fsdp").exists()


def test_resume_of_a_run_saved_before_newer_kvpop_fields(teacher_path, tmp_path):
    """A checkpoint whose saved KVpop config lacks fields added to :class:`KVpopConfig` since (here the mLSTM
    options and ``mlstm_skip``) resumes when this run's values are the ones those fields stood for (the defaults,
    ``mlstm_skip=False``), and a run with another value is still refused in one line."""
    from kvlearn.train.distill import STATE_FILE, latest_checkpoint

    cfg = dict(model=teacher_path, out=str(tmp_path / "r"), steps=2, **{**COMMON, "save_interval": 1})
    retrofit(RetrofitConfig(**cfg, kvpop=KVpopConfig(**KVPOP, mlstm_skip=False)), stop_after=1, progress=False)
    path = latest_checkpoint(tmp_path / "r") / STATE_FILE
    state = torch.load(path, weights_only=False)
    for name in ("mlstm_skip", "mlstm_use_norm", "mlstm_chunk_size", "mlstm_value_dim", "mlstm_gate_softcap"):
        del state["config"]["kvpop"][name]  # as an older version of the trainer saved it
    torch.save(state, path)
    with pytest.raises(KVLearnError, match="resume:") as err:  # mlstm_skip's record default is False
        retrofit(RetrofitConfig(**cfg, kvpop=KVpopConfig(**KVPOP), resume=True), progress=False)
    assert len(str(err.value).splitlines()) == 1
    resumed = retrofit(RetrofitConfig(**cfg, kvpop=KVpopConfig(**KVPOP, mlstm_skip=False), resume=True), progress=False)
    assert resumed["step"] == 2
