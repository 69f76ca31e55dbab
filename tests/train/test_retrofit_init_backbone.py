"""``RetrofitConfig.init_backbone`` / ``kvlearn retrofit --init-backbone``: the student's backbone starts from another
model folder of the teacher's shape (here a kaizen-train ``final/``, which also holds a selector), the added modules
start as they would from the teacher, the teacher stays ``model``, and what does not fit is a one-line error. Tiny
random GQA Qwen3 (2 KV heads, 2 query heads per KV head), float32, CPU."""

import pytest
import torch
from safetensors.torch import load_file

from kvlearn import KVLearnError
from kvlearn.checkpoint import load
from kvlearn.cli import main
from kvlearn.config import KVpopConfig
from kvlearn.train.distill import RetrofitConfig, build_models, retrofit
from kvlearn.train.kaizen_train import KaizenTrainConfig, kaizen_train

KVPOP = dict(sinks=4, window=16, topk=32, scorer="mlp")
COMMON = dict(batch_size=2, seq_len=128, save_interval=10, warmup_steps=0, lr=1e-3, lr_new=1e-2)


@pytest.fixture(scope="module")
def donor(teacher_path, tmp_path_factory):
    """A kaizen-train ``final/`` from the teacher (2 steps at a high rate: its backbone moved; it holds a selector)."""
    out = tmp_path_factory.mktemp("kaizen")
    result = kaizen_train(KaizenTrainConfig(model=teacher_path, out=str(out), targets=(2.0,), steps=2, batch_size=2,
                                            seq_len=128, warmup_steps=0, lr=1e-2, lr_new=1e-2), progress=False)
    return result["final"]


def _config(teacher, out, **kw) -> RetrofitConfig:
    return RetrofitConfig(model=teacher, out=str(out), steps=1, kvpop=KVpopConfig(**KVPOP), **COMMON, **kw)


def test_the_backbone_comes_from_the_folder_and_the_rest_as_from_the_teacher(teacher_path, donor, tmp_path):
    teacher_weights = load(teacher_path, dtype=torch.float32).state_dict()
    donor_weights = load_file(f"{donor}/model.safetensors")
    assert any(k.startswith("kaizen_selector.") for k in donor_weights)  # more than a backbone
    moved = [k for k in teacher_weights if k in donor_weights and not torch.equal(teacher_weights[k], donor_weights[k])]
    assert moved  # the donor's backbone differs from the teacher's
    torch.manual_seed(0)  # the scorers' random initialisation, as retrofit seeds it
    teacher, student = build_models(_config(teacher_path, tmp_path / "a", init_backbone=donor), torch.device("cpu"))
    torch.manual_seed(0)
    _, plain = build_models(_config(teacher_path, tmp_path / "b"), torch.device("cpu"))
    got, fresh = student.state_dict(), plain.state_dict()
    for k, v in got.items():
        if k in teacher_weights:  # the backbone: the donor's (a tied head is the donor's embeddings)
            want = donor_weights.get(k, donor_weights.get("model.embed_tokens.weight"))
            assert torch.equal(v, want), k
        else:  # the KVpop modules: as a run from the teacher builds them
            assert torch.equal(v, fresh[k]), k
    assert all(torch.equal(v, teacher_weights[k]) for k, v in teacher.state_dict().items())  # the teacher is --model


def test_cli_trains_from_it_and_records_it(teacher_path, donor, tmp_path):
    out = tmp_path / "cli"
    assert main(["retrofit", "--model", teacher_path, "--out", str(out), "--budget", "52", "--window", "16", "--sinks",
                 "4", "--steps", "1", "--seq-len", "128", "--batch-size", "2", "--init-backbone", donor]) == 0
    state = torch.load(out / "final" / "trainer_state.pt", weights_only=False)
    assert state["config"]["init_backbone"] == donor


def test_what_does_not_fit_is_one_line(teacher_path, donor, make_teacher, tmp_path):
    other = make_teacher(3, 0)  # three layers: the teacher's two are there, the third is extra (left out)
    small = make_teacher(1, 0)  # one layer: the teacher's layer 1 is missing
    cases = [(dict(init_backbone=donor, init_student=donor), "exclude each other"),
             (dict(init_backbone=str(tmp_path)), "not a model folder")]
    for change, match in cases:
        with pytest.raises(KVLearnError, match=match) as err:
            _config(teacher_path, tmp_path / "x", **change)
        assert len(str(err.value).splitlines()) == 1
    with pytest.raises(KVLearnError, match=r"does not fit the teacher's shape: missing model\.layers\.1\.") as err:
        build_models(_config(teacher_path, tmp_path / "y", init_backbone=small), torch.device("cpu"))
    assert len(str(err.value).splitlines()) == 1
    build_models(_config(teacher_path, tmp_path / "z", init_backbone=other), torch.device("cpu"))  # extra keys: fine
    assert retrofit(_config(teacher_path, tmp_path / "r", init_backbone=donor), progress=False)["step"] == 1
