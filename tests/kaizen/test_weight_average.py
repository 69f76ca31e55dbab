"""Weight averaging in ``kvlearn kaizen-train`` (``ema_decay``): ``final/`` equals the exponential moving average of
the iterates, computed here by hand from each step's recorded weights (the average starting at the first step at or
after ``ema_from``); a run killed and resumed ends on the same average as one that ran through; one-line errors. Tiny
random GQA Qwen3 (2 KV heads, 2 query heads per KV head)."""


import pytest
import torch
from safetensors.torch import load_file

from kvlearn import KVLearnError
from kvlearn.cli import kaizen_final_message, main
from kvlearn.train import kaizen_train as kt

COMMON = dict(targets=(2.0,), batch_size=2, seq_len=256, warmup_steps=0, lr=1e-3, lr_new=1e-2, save_interval=2,
              device="cpu")


def _recording(monkeypatch) -> list[dict]:
    """Record the student's parameters after every training step."""
    iterates, step_fn = [], kt.kaizen_train_step

    def recorded(config, teacher, joint, *args, **kwargs):
        values = step_fn(config, teacher, joint, *args, **kwargs)
        iterates.append({k: p.detach().clone() for k, p in joint.student.named_parameters()})
        return values

    monkeypatch.setattr(kt, "kaizen_train_step", recorded)
    return iterates


def test_final_is_the_average_of_the_iterates_from_ema_from_on(teacher_path, tmp_path, monkeypatch):
    iterates = _recording(monkeypatch)
    result = kt.kaizen_train(kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path), steps=5, ema_decay=0.75,
                                                  ema_from=0.4, **COMMON), progress=False)
    # the fraction before steps 3, 4, 5 is 2/5, 3/5, 4/5 >= 0.4: the average starts at step 3's iterate
    assert result["averaged_since"] == 3 and len(iterates) == 5
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    checked = 0
    for name, last in iterates[-1].items():
        if name not in final:  # tied weights are saved once
            continue
        expected = iterates[2][name]
        for w in iterates[3:]:
            expected = 0.75 * expected + 0.25 * w[name]
        assert torch.allclose(final[name], expected, atol=1e-6), name
        if not torch.allclose(iterates[2][name], last):
            checked += 1
            assert not torch.allclose(final[name], last, atol=1e-6), name  # not the last iterate
    assert checked > 0  # the weights did move, so the average differs from each iterate
    state = torch.load(tmp_path / "final" / "trainer_state.pt", weights_only=False)
    assert state["weight_average"] == {"decay": 0.75, "since": 3, "average": None}
    assert kaizen_final_message(result, 2.0, 16).startswith(
        f"wrote {tmp_path / 'final'} (trained 5 steps; holds the average of its weights from step 3 on)")


def test_a_resumed_run_continues_the_same_average(teacher_path, tmp_path, monkeypatch):
    """Killed after step 4 (step-4 checkpoint; the average started at step 3, the first whose run fraction before it,
    2/6, is >= 0.2), resumed: the same final/ as a run
    that went through, to float tolerance."""
    cfg = dict(model=teacher_path, steps=6, ema_decay=0.5, ema_from=0.2, **COMMON)
    kt.kaizen_train(kt.KaizenTrainConfig(out=str(tmp_path / "through"), **cfg), progress=False)
    kt.kaizen_train(kt.KaizenTrainConfig(out=str(tmp_path / "cut"), **cfg), stop_after=4, progress=False)
    saved = torch.load(tmp_path / "cut" / "step-4" / "trainer_state.pt", weights_only=False)["weight_average"]
    assert saved["since"] == 3 and saved["average"] is not None
    result = kt.kaizen_train(kt.KaizenTrainConfig(out=str(tmp_path / "cut"), resume=True, **cfg), progress=False)
    assert result["averaged_since"] == 3
    through = load_file(str(tmp_path / "through" / "final" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "cut" / "final" / "model.safetensors"))
    assert through.keys() == resumed.keys()
    for name in through:
        assert torch.allclose(through[name], resumed[name], atol=1e-5), name


@pytest.mark.parametrize("bad, message", [
    (dict(ema_decay=1.0), "ema_decay=1.0 is invalid: expected 0 (off) or a decay per step in (0, 1)"),
    (dict(ema_decay=-0.1), "ema_decay=-0.1 is invalid"),
    (dict(ema_decay=0.9, ema_from=1.0), "ema_from=1.0 is invalid: expected a fraction of the run in [0, 1)"),
    (dict(ema_decay=0.9, select_every=2), "ema_decay=0.9 with select_every=2: final/ holds either"),
])
def test_bad_settings_are_one_line(teacher_path, tmp_path, bad, message):
    with pytest.raises(KVLearnError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        kt.KaizenTrainConfig(model=teacher_path, out=str(tmp_path), steps=2, **{**COMMON, **bad})


def test_cli_ema_from_without_ema_decay_is_one_line(teacher_path, tmp_path, capsys):
    code = main(["kaizen-train", "--model", str(teacher_path), "--out", str(tmp_path / "o"), "--target", "2",
                 "--steps", "2", "--ema-from", "0.3"])
    err = capsys.readouterr().err
    assert code != 0 and "--ema-from 0.3: an option of weight averaging, read only with --ema-decay" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
