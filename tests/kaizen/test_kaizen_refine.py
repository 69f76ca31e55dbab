"""A refinement of a trained KV-Kaizen selector (``kvlearn kaizen-train --init-student``, ``KaizenTrainConfig.init_student``):
the student starts from the trained folder's weights (backbone and selector), not the teacher's; the trained
selector's sharing mask is kept without a sensitivity pass and recorded again; its settings must fit (one-line errors
otherwise); the CLI's ``--tau-start`` sets the first step's temperature; a resumed refinement must name the same
folder. Tiny random GQA Qwen3 (2 KV heads, 2 query heads per KV head) of 3 layers, so that a mask can leave a layer
out."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvlearn import KVLearnError
from kvlearn.cli import main
from kvlearn.kaizen.apply import CONFIG_KEY
from kvlearn.train import kaizen_train as kt

COMMON = dict(targets=(2.0,), batch_size=2, seq_len=256, warmup_steps=0, lr=1e-3, lr_new=1e-2, save_interval=100,
              device="cpu")


@pytest.fixture(scope="module")
def trained(make_teacher, tmp_path_factory):
    """``(teacher, final)``: a 3-layer tiny teacher and the final/ of a 3-step kaizen-train run from it whose selector
    may share layer 2 only."""
    teacher = make_teacher(3, 1)
    out = tmp_path_factory.mktemp("first")
    result = kt.kaizen_train(kt.KaizenTrainConfig(model=teacher, out=str(out), steps=3, share_layers=(2,), **COMMON),
                             progress=False)
    return teacher, result["final"]


def _weights(folder: str) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def test_the_student_starts_from_the_trained_weights(trained, tmp_path):
    teacher_path, final = trained
    config = kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path), steps=1, init_student=final, **COMMON)
    teacher, student, report = kt.build_models(config, torch.device("cpu"))
    saved, mine = _weights(final), student.state_dict()
    assert any(k.startswith("kaizen_selector.") for k in saved)  # the selector's weights are among them
    for k, v in saved.items():
        assert torch.equal(mine[k], v.to(mine[k].dtype)), k
    # and not the teacher's: the first run moved the backbone
    backbone = [k for k in saved if not k.startswith("kaizen_selector.")]
    t = teacher.state_dict()
    assert any(not torch.equal(t[k], mine[k]) for k in backbone)
    assert report is None  # no sensitivity pass


def test_the_trained_mask_is_kept_and_recorded(trained, tmp_path, monkeypatch):
    teacher_path, final = trained

    def no_pass(*args, **kwargs):
        raise AssertionError("a refinement runs no sensitivity pass")

    monkeypatch.setattr(kt, "share_sensitivity", no_pass)
    for share in (None, "auto", (2,)):
        out = tmp_path / str(share)
        result = kt.kaizen_train(kt.KaizenTrainConfig(model=teacher_path, out=str(out), steps=1, init_student=final,
                                                      share_layers=share, seed=7, **COMMON), progress=False)
        recorded = json.loads(Path(result["final"], "config.json").read_text())[CONFIG_KEY]
        assert recorded["share_layers"] == [2]
        assert not (out / kt.SHARE_REPORT).exists()


def test_a_refinement_may_aim_at_another_target(trained, tmp_path):
    teacher_path, final = trained
    result = kt.kaizen_train(kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path), steps=1, init_student=final,
                                                  **{**COMMON, "targets": (3.0,)}), progress=False)
    recorded = json.loads(Path(result["final"], "config.json").read_text())[CONFIG_KEY]
    assert recorded["train_targets"] == [3.0]


def test_cli_tau_start_and_init_student(trained, tmp_path):
    teacher_path, final = trained
    out = tmp_path / "cli"
    assert main(["kaizen-train", "--model", teacher_path, "--out", str(out), "--target", "2", "--init-student", final,
                 "--tau-start", "0.1", "--tau-end", "0.05", "--steps", "2", "--seq-len", "256", "--batch-size", "2",
                 "--device", "cpu", "--seed", "3"]) == 0
    taus = [json.loads(line)["tau"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert taus[0] == pytest.approx(0.1)  # step 1 at fraction 0
    assert taus[1] == pytest.approx(0.1 * (0.05 / 0.1) ** 0.5)  # step 2 at fraction 1/2: geometric


def test_a_resumed_refinement_names_the_same_folder(trained, tmp_path):
    teacher_path, final = trained
    other = tmp_path / "copy"
    shutil.copytree(final, other)
    base = dict(model=teacher_path, out=str(tmp_path / "run"), steps=2, **{**COMMON, "save_interval": 1})
    kt.kaizen_train(kt.KaizenTrainConfig(init_student=final, **base), stop_after=1, progress=False)
    with pytest.raises(KVLearnError, match="init_student") as err:
        kt.kaizen_train(kt.KaizenTrainConfig(init_student=str(other), resume=True, **base), progress=False)
    assert len(str(err.value).splitlines()) == 1
    result = kt.kaizen_train(kt.KaizenTrainConfig(init_student=final, resume=True, **base), progress=False)
    assert result["step"] == 2


def test_bad_init_student_is_a_one_line_error(trained, make_teacher, tmp_path):
    teacher_path, final = trained
    base = dict(model=teacher_path, out=str(tmp_path / "x"), steps=1, **COMMON)
    wider = tmp_path / "wider"
    shutil.copytree(final, wider)
    cfg = json.loads((wider / "config.json").read_text())
    cfg[CONFIG_KEY]["width"] = 2 * cfg[CONFIG_KEY]["width"]
    (wider / "config.json").write_text(json.dumps(cfg))
    for change, match in [(dict(init_student=str(tmp_path / "nowhere")), "no config.json"),
                          (dict(init_student=teacher_path), "no KV-Kaizen selector"),
                          (dict(init_student=final, share_layers=(1, 2)), r"may share layers \[2\]"),
                          (dict(init_student=str(wider)), "width=128")]:
        with pytest.raises(KVLearnError, match=match) as err:
            kt.KaizenTrainConfig(**{**base, **change})
        assert len(str(err.value).splitlines()) == 1
    # a selector trained from a teacher of another shape (2 layers, this teacher 3): refused when its weights load
    two_layers = kt.kaizen_train(kt.KaizenTrainConfig(model=make_teacher(2, 2), out=str(tmp_path / "two"), steps=1,
                                                      **COMMON), progress=False)["final"]
    config = kt.KaizenTrainConfig(**{**base, "init_student": two_layers})
    with pytest.raises(KVLearnError, match="init_student=.*does not fit the teacher's shape: missing model.layers.2") as err:
        kt.build_models(config, torch.device("cpu"))
    assert len(str(err.value).splitlines()) == 1
    assert main(["kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "cli"), "--init-student",
                 str(tmp_path / "nowhere"), "--steps", "1", "--seq-len", "256"]) == 2


def test_a_refinement_starts_its_multiplier_where_the_run_left_it(trained, tmp_path, capsys):
    """Every kaizen-train checkpoint records its budget multiplier (``kaizen_budget.json``: the last step's
    ``beta_next`` and the targets); a refinement from that folder starts there (its first step's ``beta``, and a line
    saying so), unless ``beta`` is given or it aims at another target (then 0); the bf16 export keeps the record; a
    broken record is a one-line error naming the file."""
    teacher_path, _ = trained
    first = tmp_path / "first"  # a run whose multiplier moves: over budget from step 1 (factor 1 against 2)
    result = kt.kaizen_train(kt.KaizenTrainConfig(model=teacher_path, out=str(first), steps=3, share_layers=(2,),
                                                  eta=0.5, **COMMON), progress=False)
    log = [json.loads(line) for line in (first / "train_log.jsonl").read_text().splitlines()]
    record = json.loads(Path(result["final"], kt.BUDGET_RECORD).read_text())
    assert record == {"beta": log[-1]["beta_next"], "step": 3, "targets": [2.0]} and record["beta"] > 0

    def first_beta(out, **kw):
        kt.kaizen_train(kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path / out), steps=1,
                                             **{**COMMON, **kw}), progress=True)
        return json.loads((tmp_path / out / "train_log.jsonl").read_text().splitlines()[0])["beta"]

    capsys.readouterr()
    assert first_beta("carried", init_student=result["final"]) == pytest.approx(record["beta"])
    assert f"the budget multiplier starts at {record['beta']:.4g}, where {result['final']}'s run left it" in \
        capsys.readouterr().out
    assert first_beta("given", init_student=result["final"], beta=0.0) == 0.0
    assert first_beta("other_target", init_student=result["final"], targets=(3.0,)) == 0.0
    assert first_beta("fresh") == 0.0  # no init_student: 0 as before
    assert kt.initial_beta(kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path / "c"), init_student=result["final"],
                                                budget_cap=0.01, **COMMON)) == (0.01, result["final"])  # capped

    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[2]
    export = tmp_path / "export"
    run = subprocess.run([sys.executable, "benchmarks/export_checkpoint.py", result["final"], str(export)], cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((export / kt.BUDGET_RECORD).read_text()) == record
    assert first_beta("from_export", init_student=str(export)) == pytest.approx(record["beta"])

    for broken in ("{not json", json.dumps({"beta": -1.0, "targets": [2.0]}), json.dumps({"beta": "x"}),
                   json.dumps({"beta": 1.0, "targets": "2"}), json.dumps([1.0])):
        (export / kt.BUDGET_RECORD).write_text(broken)
        with pytest.raises(KVLearnError, match="kaizen_budget.json") as err:
            kt.initial_beta(kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path / "b"), init_student=str(export),
                                                 **COMMON))
        assert len(str(err.value).splitlines()) == 1
