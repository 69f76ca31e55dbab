"""Checkpoint selection of ``kvlearn kaizen-train`` (``select_every``): the iterates validated (every N steps from
``select_from`` of the run on, and the last), ``final/`` holding the best one's weights, the validation itself equal to
an independent evaluation of the saved iterate, a resumed run keeping its best, and one-line errors. Tiny random GQA
Qwen3 (2 KV heads, 2 query heads per KV head) for the mechanics, where the validation accuracies are scripted; the
shipped teacher for the validation itself (a tiny random model answers nothing, so its accuracies could not differ)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kvlearn
from kvlearn import KVLearnError
from kvlearn.cli import main
from kvlearn.eval.accuracy import EvalConfig, evaluate
from kvlearn.kaizen.apply import CONFIG_KEY
from kvlearn.train import kaizen_train as kt
from kvlearn.train import parallel

ROOT = Path(__file__).resolve().parents[2]
TEACHER = ROOT / "checkpoints" / "testbed-teacher"
COMMON = dict(targets=(2.0,), batch_size=2, seq_len=256, warmup_steps=0, lr=1e-3, lr_new=1e-2, save_interval=2,
              device="cpu")


def _scripted(monkeypatch, accuracies, weights):
    """Replace the validation by ``accuracies`` in call order, recording the student's weights at each call."""
    it = iter(accuracies)

    def fake(config, student, device):
        weights.append({k: v.detach().clone() for k, v in student.state_dict().items()})
        acc = next(it)
        return {"accuracy": acc, "per_task": {"vt": acc}, "factor": 2.0}

    monkeypatch.setattr(kt, "validate", fake)


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / kt.SELECT_LOG).read_text().splitlines()]


def _final_equals(out: Path, weights: dict) -> bool:
    final = load_file(str(out / "final" / "model.safetensors"))
    return all(torch.equal(final[k], weights[k]) for k in final)


@pytest.mark.parametrize("every, start, validated", [(1, 0.0, [1, 2, 3, 4]), (1, 0.5, [3, 4]), (3, 0.0, [3, 4])])
def test_the_iterates_validated(teacher_path, tmp_path, monkeypatch, every, start, validated):
    """Every ``every`` steps once the run is ``start`` through (the fraction before the step), and the last step."""
    _scripted(monkeypatch, [0.5] * 4, [])
    kt.kaizen_train(kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path), steps=4, select_every=every,
                                         select_from=start, **COMMON), progress=False)
    assert _steps(tmp_path) == validated


def test_final_holds_the_best_iterate(teacher_path, tmp_path, monkeypatch):
    weights = []
    _scripted(monkeypatch, [0.2, 0.6, 0.6, 0.4], weights)  # a tie keeps the earlier iterate
    result = kt.kaizen_train(kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path), steps=4, select_every=1,
                                                  select_from=0.0, **COMMON), progress=False)
    assert not torch.equal(weights[1]["model.layers.0.self_attn.k_proj.weight"],
                           weights[3]["model.layers.0.self_attn.k_proj.weight"])  # the iterates do differ
    assert _final_equals(tmp_path, weights[1]) and not _final_equals(tmp_path, weights[3])
    state = torch.load(tmp_path / "final" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4 and state["selected"]["step"] == 2 and state["selected"]["accuracy"] == 0.6
    assert torch.load(tmp_path / kt.BEST / "trainer_state.pt", weights_only=False)["selected"]["step"] == 2
    assert result["final"] == str(tmp_path / "final")
    assert result["selected"]["step"] == 2 and result["selected"]["accuracy"] == 0.6
    from kvlearn.cli import kaizen_final_message

    assert kaizen_final_message(result, 8.0, 16) == (
        f"wrote {tmp_path / 'final'} (trained 4 steps; holds step 2, whose validation read 0.600 on 16 prompts per "
        "family: the best of several small draws, so expect the evaluation to read lower); evaluate it with: "
        f"kvlearn eval --model {tmp_path / 'final'} --method kaizen --target 8.0")
    kvlearn.load(str(tmp_path / "final"))  # a loadable model folder


def test_without_selection_final_is_the_last_iterate(teacher_path, tmp_path, monkeypatch):
    weights = []
    _scripted(monkeypatch, [], weights)
    result = kt.kaizen_train(kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path), steps=2, **COMMON),
                             progress=False)
    assert result["selected"] is None
    from kvlearn.cli import kaizen_final_message

    assert kaizen_final_message(result, 4.0, 16) == (f"wrote {tmp_path / 'final'} (step 2); evaluate it with: kvlearn "
                                                     f"eval --model {tmp_path / 'final'} --method kaizen --target 4.0")
    assert not weights and not (tmp_path / kt.BEST).exists() and not (tmp_path / kt.SELECT_LOG).exists()
    assert "selected" not in torch.load(tmp_path / "final" / "trainer_state.pt", weights_only=False)


def test_a_resumed_run_keeps_its_best(teacher_path, tmp_path, monkeypatch):
    """Killed after step 3 (its best), resumed from step-2: the log holds each step once, and final/ is the first
    run's step-3 iterate (the resumed run's own step 3 ties it, step 4 is worse)."""
    cfg = dict(model=teacher_path, out=str(tmp_path), steps=4, select_every=1, select_from=0.0, **COMMON)
    first = []
    _scripted(monkeypatch, [0.1, 0.2, 0.9], first)
    kt.kaizen_train(kt.KaizenTrainConfig(**cfg), stop_after=3, progress=False)
    assert _steps(tmp_path) == [1, 2, 3]
    _scripted(monkeypatch, [0.9, 0.3], [])
    kt.kaizen_train(kt.KaizenTrainConfig(**cfg, resume=True), progress=False)
    assert _steps(tmp_path) == [1, 2, 3, 4]
    assert _final_equals(tmp_path, first[2])
    assert torch.load(tmp_path / "final" / "trainer_state.pt", weights_only=False)["selected"]["step"] == 3
    # a new run over the folder starts the selection afresh
    _scripted(monkeypatch, [0.1, 0.2], [])
    kt.kaizen_train(kt.KaizenTrainConfig(**{**cfg, "steps": 2}, overwrite=True), progress=False)
    assert _steps(tmp_path) == [1, 2]
    assert torch.load(tmp_path / kt.BEST / "trainer_state.pt", weights_only=False)["selected"]["step"] == 2


@pytest.mark.skipif(not (TEACHER / "model.safetensors").exists(), reason="no embedded teacher in this checkout")
def test_validation_equals_an_evaluation_of_the_saved_iterate(tmp_path):
    """The in-training validation of step 1 equals ``evaluate`` of ``best/`` loaded from disk (the same prompts:
    eval-format, from example index SELECT_SEED_OFFSET on), on the shipped teacher, which answers some of them; the
    student is left in training mode with its recorded config unchanged."""
    config = kt.KaizenTrainConfig(model=str(TEACHER), out=str(tmp_path), targets=(2.0,), steps=1, batch_size=2,
                                  seq_len=512, lr=1e-7, lr_new=1e-7, warmup_steps=0, select_every=1, select_n=3,
                                  device="cpu")
    kt.kaizen_train(config, progress=False)
    (logged,) = [json.loads(line) for line in (tmp_path / kt.SELECT_LOG).read_text().splitlines()]
    model = kvlearn.load(str(tmp_path / kt.BEST), dtype=torch.float32)
    rows = evaluate(model, EvalConfig(method="kaizen", n_per_task=3, context=512, batch_size=3, split="eval",
                                      seed_offset=kt.SELECT_SEED_OFFSET), progress=False)
    assert logged["per_task"] == {r["task"]: r["accuracy"] for r in rows}
    assert logged["accuracy"] > 0 and logged["factor"] == pytest.approx(sum(r["factor"] for r in rows) / len(rows))
    _, student, _ = kt.build_models(config, torch.device("cpu"))
    recorded = json.dumps(getattr(student.config, CONFIG_KEY), sort_keys=True)
    kt.validate(config, student, torch.device("cpu"))
    assert student.training and json.dumps(getattr(student.config, CONFIG_KEY), sort_keys=True) == recorded


@pytest.mark.skipif(not (TEACHER / "model.safetensors").exists(), reason="no embedded teacher in this checkout")
def test_validation_serves_the_iterate_as_a_checkpoint_in_the_serving_dtype(tmp_path, monkeypatch):
    """On CUDA a checkpoint is served in bf16 (``serving_dtype``); here that rule is made the CPU's, so the
    validation must load the iterate in bf16: it does (the load is watched), its accuracies equal ``evaluate`` of
    the same weights loaded in bf16 from ``best/`` (the independent path), it leaves no ``.validate/`` folder, and the
    float32 student it validated keeps its weights, dtype and training mode."""
    import kvlearn.checkpoint as checkpoint

    config = kt.KaizenTrainConfig(model=str(TEACHER), out=str(tmp_path), targets=(2.0,), steps=1, batch_size=2,
                                  seq_len=512, lr=1e-7, lr_new=1e-7, warmup_steps=0, select_every=1, select_n=3,
                                  device="cpu")
    kt.kaizen_train(config, progress=False)
    monkeypatch.setattr(checkpoint, "serving_dtype", lambda device: torch.bfloat16)
    loaded, real_load = [], checkpoint.load

    def watched(path, dtype=None, device="cpu"):
        loaded.append(dtype)
        return real_load(path, dtype=dtype, device=device)

    monkeypatch.setattr(checkpoint, "load", watched)
    student = real_load(str(tmp_path / kt.BEST), dtype=torch.float32)  # not watched (kvlearn.load resolves to it)
    student.train()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    result = kt.validate(config, student, torch.device("cpu"))
    assert loaded == [torch.bfloat16] and not (tmp_path / kt.VALIDATE_DIR).exists()
    assert student.training and all(torch.equal(v, before[k]) for k, v in student.state_dict().items())
    assert next(student.parameters()).dtype == torch.float32
    reference = real_load(str(tmp_path / kt.BEST), dtype=torch.bfloat16)
    rows = evaluate(reference, EvalConfig(method="kaizen", n_per_task=3, context=512, batch_size=3, split="eval",
                                          seed_offset=kt.SELECT_SEED_OFFSET), progress=False)
    assert result["per_task"] == {r["task"]: r["accuracy"] for r in rows} and result["accuracy"] > 0


def test_bad_settings_are_one_line_errors(teacher_path, tmp_path, monkeypatch):
    base = dict(model=teacher_path, out=str(tmp_path / "x"), steps=2, **{**COMMON, "targets": (2.0,)})
    for change, match in [(dict(select_every=-1), "select_every"), (dict(select_every=1, select_n=0), "select_n"),
                          (dict(select_every=1, select_from=1.5), "select_from=1.5"),
                          (dict(select_every=1, targets=(2.0, 4.0)), "single target")]:
        with pytest.raises(KVLearnError, match=match) as err:
            kt.KaizenTrainConfig(**{**base, **change})
        assert len(str(err.value).splitlines()) == 1
    assert main(["kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "cli"), "--target", "2,4",
                 "--select-every", "1", "--steps", "1", "--seq-len", "256"]) == 2
    monkeypatch.setattr(parallel, "init_distributed", lambda device: parallel.DistInfo(0, 2, 0))
    with pytest.raises(KVLearnError, match="select_every=1 with 2 processes") as err:
        kt.kaizen_train(kt.KaizenTrainConfig(**{**base, "select_every": 1}), progress=False)
    assert len(str(err.value).splitlines()) == 1
