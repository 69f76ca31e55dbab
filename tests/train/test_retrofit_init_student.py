"""``RetrofitConfig.init_student`` / ``kvlearn retrofit --init-student``: a KVpop retrofit that starts from a trained
student's weights (backbone, scorers, decays) while the dense model stays the teacher, e.g. a full-precision student
refined under ``--kv-bits 4``. The built student must equal the trained one weight for weight (and differ from a
fresh build), the teacher must stay the dense model, and folders that do not fit are one-line errors. Tiny random
GQA Qwen3 (2 KV heads, 2 query heads per KV head), float32, CPU."""

import pytest
import torch

from kvlearn import KVLearnError
from kvlearn.checkpoint import load
from kvlearn.config import KVpopConfig
from kvlearn.train.distill import RetrofitConfig, build_models, retrofit

KVPOP = dict(sinks=4, window=16, topk=32, scorer="mlp")
COMMON = dict(batch_size=2, seq_len=128, save_interval=1, warmup_steps=0, lr=1e-3, lr_new=1e-2)


@pytest.fixture(scope="module")
def trained(make_teacher, tmp_path_factory):
    """``(teacher folder, trained student's final/ folder)``: 2 full-precision steps at lr 1e-3 (weights move)."""
    teacher = make_teacher(2, 3)
    out = tmp_path_factory.mktemp("student")
    result = retrofit(RetrofitConfig(model=teacher, out=str(out), steps=2, kvpop=KVpopConfig(**KVPOP), **COMMON),
                      progress=False)
    return teacher, result["final"]


def test_the_student_starts_as_the_trained_one_and_the_teacher_stays_dense(trained, tmp_path):
    teacher_path, final = trained
    config = RetrofitConfig(model=teacher_path, out=str(tmp_path / "r"), steps=1, kvpop=KVpopConfig(**KVPOP),
                            kv_bits=4, init_student=final, **COMMON)
    teacher, student = build_models(config, torch.device("cpu"))
    _, fresh = build_models(RetrofitConfig(model=teacher_path, out=str(tmp_path / "f"), steps=1,
                                           kvpop=KVpopConfig(**KVPOP), kv_bits=4, **COMMON), torch.device("cpu"))
    reference = load(final, dtype=torch.float32).state_dict()
    got, fresh_state = student.state_dict(), fresh.state_dict()
    assert got.keys() == reference.keys()
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=0, atol=0, msg=k)
    # the trained run moved both the backbone and the scorers away from a fresh build
    moved = [k for k in got if not torch.equal(got[k], fresh_state[k])]
    assert any(".kvpop." in k for k in moved) and any(".kvpop." not in k for k in moved)
    # the teacher is the dense model, not the student
    dense = load(teacher_path, dtype=torch.float32).state_dict()
    for k, v in teacher.state_dict().items():
        torch.testing.assert_close(v, dense[k], rtol=0, atol=0, msg=k)
    assert student.training and all(p.requires_grad for p in student.parameters())


def test_a_refined_run_trains_and_records_its_start(trained, tmp_path):
    from kvlearn.cli import main

    teacher_path, final = trained
    code = main(["retrofit", "--model", teacher_path, "--out", str(tmp_path / "cli"), "--init-student", final,
                 "--kv-bits", "4", "--budget", "52", "--window", "16", "--sinks", "4", "--steps", "1",
                 "--seq-len", "128", "--batch-size", "2"])
    assert code == 0
    state = torch.load(tmp_path / "cli" / "final" / "trainer_state.pt", weights_only=False)
    assert state["config"]["init_student"] == final and state["config"]["kv_bits"] == 4


def test_folders_that_do_not_fit_are_one_line_errors(trained, make_teacher, tmp_path):
    teacher_path, final = trained
    cases = [
        (dict(init_student=teacher_path), "has no KVpop modules"),
        (dict(init_student=final, kvpop=KVpopConfig(**{**KVPOP, "scorer": "linear"})),
         "has scorer 'mlp', this run 'linear'"),
        (dict(init_student=final, model=make_teacher(3, 3)), "does not fit this run's student: missing"),
        (dict(init_student=str(tmp_path / "nowhere")), "is not a model folder"),
        (dict(init_student=final, method="streaming_plus", streaming=dict(budget=40, sinks=4)),
         "is for method 'kvpop'"),
    ]
    for i, (change, match) in enumerate(cases):
        kw = {"model": teacher_path, "out": str(tmp_path / f"bad{i}"), "steps": 1, "kvpop": KVpopConfig(**KVPOP),
              **COMMON, **change}
        with pytest.raises(KVLearnError, match=match) as err:
            retrofit(RetrofitConfig(**kw), progress=False)
        assert len(str(err.value).splitlines()) == 1
