"""Which layers the KV-Kaizen selector may share (``share_layers``) and the sensitivity pass that picks them
(``kvlearn kaizen-train --share-layers auto``), on tiny random GQA Qwen3 models (float32; 4 layers, 2 KV heads,
4 query heads of dim 16):

- the action mask and the feasible range follow ``share_layers``, the range checked against brute-force enumeration
  of every allowed configuration;
- a selector never chooses ``share`` outside ``share_layers``, however hard its biases push toward it;
- ``share_increases`` equals an independent computation: the ``kaizen_config=`` forward of each one-shared-layer
  configuration against a plain forward of an un-attached copy, with the KL written out over the full vocabulary;
- a ``--share-layers auto`` run writes the pass's report, allows exactly the layers at or under the threshold, and
  its saved selector (recorded ``share_layers``) never shares elsewhere; records written before the field load as
  every layer; a resume with other layers is refused; bad values are one-line errors naming the valid range.
"""

import json
import sys
from itertools import product
from pathlib import Path

import pytest
import torch

import kvlearn
from kvlearn import KVLearnError
from kvlearn.cli import main
from kvlearn.kaizen.actions import (Backbone, KaizenConfig, LayerAction, action_bits, action_mask, action_space,
                                    feasible_range)
from kvlearn.kaizen.apply import KaizenMethodConfig, apply_kaizen, selector_of
from kvlearn.kaizen.selector import KaizenSelector, gumbel_straight_through
from kvlearn.kaizen.share_sensitivity import allowed_share_layers, calibration_rows, share_increases
from kvlearn.kaizen.sharing import attach
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from kvlearn.train.kaizen_train import SHARE_REPORT, KaizenTrainConfig, kaizen_train

sys.path.insert(0, str(Path(__file__).parent))
from test_cache_sharing import tiny  # noqa: E402

SEQ = 128
BB = Backbone(num_layers=4, kv_heads=2, head_dim=16)


def one_line(err) -> str:
    message = str(err.value)
    assert message and "\n" not in message
    return message


@pytest.fixture(scope="module")
def teacher4(make_teacher):
    """A 4-layer tiny GQA Qwen3 with the testbed vocabulary, saved (the trainer reads a folder)."""
    return make_teacher(4, 3)


def test_mask_and_feasible_range_follow_share_layers():
    space = action_space(BB)
    share = space.index(LayerAction.shared())
    for layers in (None, (2,), (1, 3), ()):
        mask = action_mask(BB, None, layers)
        allowed = range(1, 4) if layers is None else layers
        assert [row[share] for row in mask] == [l in allowed for l in range(4)]
        assert all(all(ok for a, ok in zip(space, row) if not a.share) for row in mask)
        # brute force: every allowed configuration's bits
        bits = [sum(action_bits(space[a], BB, metadata=False) for a in combo)
                for combo in product(range(len(space)), repeat=4) if all(mask[l][a] for l, a in enumerate(combo))]
        lo, hi = feasible_range(BB, None, False, layers)
        assert lo == pytest.approx(BB.reference_bits / max(bits))
        assert hi == pytest.approx(BB.reference_bits / min(bits))
    assert feasible_range(BB, None, False, ())[1] == pytest.approx(8.0)  # precision alone: 2 bits everywhere
    assert feasible_range(BB, None, False, (2,))[1] == pytest.approx(64 / 6)  # three 2-bit layers


def test_selector_never_shares_outside_share_layers():
    sel = KaizenSelector(VOCAB_SIZE, BB, share_layers=(2,))
    share = sel.space.index(LayerAction.shared())
    with torch.no_grad():
        sel.head_bias.zero_()
        sel.head_bias[:, share] = 100.0  # every layer pushed toward share
    ids = torch.randint(1, VOCAB_SIZE, (5, 20), generator=torch.Generator().manual_seed(1))
    logits = sel(ids)
    assert logits[:, [0, 1, 3], share].isneginf().all() and logits[:, 2, share].isfinite().all()
    choice = sel.choose(ids)
    assert (choice[:, 2] == share).all() and (choice[:, [0, 1, 3]] != share).all()
    for _ in range(5):
        w = gumbel_straight_through(logits, 1.0)
        assert (w[:, [0, 1, 3], share] == 0).all()
    assert [str(c) for c in sel.configs(choice)][0].split()[2] == "share"


def test_bad_share_layers_are_one_line_errors(teacher4, tmp_path):
    model = tiny(0)
    for bad in ((0,), (4,), (2, 2), ("1",), (True,)):
        with pytest.raises(KVLearnError) as e:
            apply_kaizen(model, KaizenMethodConfig(share_layers=bad))
        msg = one_line(e)
        assert "share_layers" in msg and "[1, 3]" in msg
    with pytest.raises(KVLearnError) as e:
        KaizenMethodConfig(share_layers=3)
    assert "share_layers=3" in one_line(e)
    with pytest.raises(KVLearnError) as e:  # no sharing: precision alone reaches 8x at most
        KaizenTrainConfig(model=teacher4, out=str(tmp_path / "o"), targets=(10.0,), share_layers=(), steps=1,
                          seq_len=SEQ)
    msg = one_line(e)
    assert "[1x, 8x]" in msg and "sharing only at layers none" in msg
    with pytest.raises(KVLearnError) as e:
        KaizenTrainConfig(model=teacher4, out=str(tmp_path / "o"), share_layers="some", steps=1, seq_len=SEQ)
    one_line(e)
    with pytest.raises(KVLearnError) as e:  # no depth axis: nothing to restrict
        KaizenTrainConfig(model=teacher4, out=str(tmp_path / "o"), share_layers="auto", axes=("precision",), steps=1,
                          seq_len=SEQ)
    assert "depth" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        allowed_share_layers([None, 0.1], threshold=-1)
    assert ">= 0" in one_line(e)


def test_cli_share_layers_errors(teacher4, tmp_path, capsys):
    for value, expect in (("a,b", "--share-layers"), ("0,2", "[1, 3]"), ("9", "[1, 3]")):
        code = main(["kaizen-train", "--model", teacher4, "--out", str(tmp_path / "o"), "--share-layers", value,
                     "--seq-len", str(SEQ), "--steps", "1"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and expect in err, err


def _plain_kl(student_logits, teacher_logits, labels):
    """KL(teacher || student) per supervised token over the full vocabulary, written out."""
    p = torch.softmax(teacher_logits[:, :-1].double(), -1)
    kl = (p * (torch.log(p) - torch.log_softmax(student_logits[:, :-1].double(), -1))).sum(-1)
    mask = labels[:, 1:] != -100
    return float(kl[mask].sum() / mask.sum())


def test_share_increases_equal_an_independent_forward(teacher4):
    model = kvlearn.load(teacher4, dtype=torch.float32)
    plain_model = kvlearn.load(teacher4, dtype=torch.float32)  # never attached: the independent reference
    model.eval(), plain_model.eval()
    attach(model)
    ids, labels = calibration_rows(3, SEQ, seed=0)
    assert bool((labels != -100).any())
    got = share_increases(model, ids, labels, kd_topk=VOCAB_SIZE, batch_size=2)  # chunks of 2 + 1 rows
    bb = Backbone.from_model(model)
    with torch.no_grad():
        reference = plain_model(input_ids=ids, use_cache=False).logits
        base = _plain_kl(model(input_ids=ids, kaizen_config=KaizenConfig(bb, (LayerAction(16),) * 4),
                               use_cache=False).logits, reference, labels)
        want = [None]
        for l in range(1, 4):
            actions = tuple(LayerAction.shared() if j == l else LayerAction(16) for j in range(4))
            logits = model(input_ids=ids, kaizen_config=KaizenConfig(bb, actions), use_cache=False).logits
            want.append(_plain_kl(logits, reference, labels) - base)
    assert got[0] is None and abs(base) < 1e-6
    assert got[1:] == pytest.approx(want[1:], abs=1e-5)
    assert all(v > 1e-4 for v in want[1:])  # sharing a random layer is never free: the check has teeth
    assert share_increases(model, ids, labels, VOCAB_SIZE, batch_size=3) == pytest.approx(got, abs=1e-6)


def test_auto_share_layers_training_records_and_respects_them(teacher4, tmp_path):
    model = attach(kvlearn.load(teacher4, dtype=torch.float32))
    ids, labels = calibration_rows(4, SEQ, seed=0)
    increases = share_increases(model, ids, labels)
    threshold = sorted(increases[1:])[1]  # the two least sensitive layers
    expected = tuple(l for l in range(1, 4) if increases[l] <= threshold)
    assert len(expected) == 2
    out = tmp_path / "run"
    config = KaizenTrainConfig(model=teacher4, out=str(out), targets=(4.0,), steps=3, batch_size=2, seq_len=SEQ,
                               save_interval=2, warmup_steps=0, lr=1e-3, lr_new=0.2, beta=50.0, eta=0.0,
                               share_layers="auto", share_threshold=threshold, share_rows=4)
    result = kaizen_train(config, progress=False)
    report = json.loads((out / SHARE_REPORT).read_text())
    assert report["allowed"] == list(expected) and report["threshold"] == threshold
    assert report["increases"][1:] == pytest.approx(increases[1:], abs=1e-5)
    trained = kvlearn.load(result["final"])
    assert trained.config.kaizen["share_layers"] == list(expected)
    sel = selector_of(trained)
    share = sel.space.index(LayerAction.shared())
    with torch.no_grad():
        sel.head_bias[:, share] = 100.0
    choice = sel.choose(ids)
    forbidden = [l for l in range(4) if l not in expected]
    assert (choice[:, list(expected)] == share).all() and (choice[:, forbidden] != share).all()
    # a record from before the field: every layer may share
    cfg_path = Path(result["final"]) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["kaizen"]["share_layers"]
    cfg_path.write_text(json.dumps(cfg))
    old = selector_of(kvlearn.load(result["final"]))
    assert old.share_layers is None and old.mask[1:, share].all()
    # resuming with other layers is refused, in one line
    with pytest.raises(KVLearnError) as e:
        kaizen_train(KaizenTrainConfig(**{**config.__dict__, "resume": True, "share_layers": (1,)}), progress=False)
    assert "share_layers" in one_line(e)
