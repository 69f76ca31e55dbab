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
from kvlearn.kaizen.share_sensitivity import (allowed_share_layers, calibration_rows, increase_stats,
                                              share_increases, share_sensitivity)
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


def test_increase_stats_by_hand():
    """Three rows, one layer that can share: increases 1, 2, 3 on rows of 1, 1 and 2 supervised tokens."""
    increases, errors = increase_stats(torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]]), torch.tensor([1, 1, 2]))
    # weights 1/4, 1/4, 1/2: mean 2.25; variance 3/2 * (1.25^2 / 16 + 0.25^2 / 16 + 0.75^2 / 4) = 0.36328125
    assert increases == [None, pytest.approx(2.25)] and errors == [None, pytest.approx(0.36328125 ** 0.5)]
    assert increase_stats(torch.tensor([[0.0], [0.7]]), torch.tensor([5]))[1] == [None, 0.0]  # one row: no spread


def test_share_sensitivity_errors_follow_the_rows_measured_one_by_one(teacher4):
    """The standard errors come from each row's own increase: measured here by running the pass on each row alone
    (:func:`share_increases` of one row), then reduced by the formula by hand."""
    model = attach(kvlearn.load(teacher4, dtype=torch.float32)).eval()
    ids, labels = calibration_rows(3, SEQ, seed=1)
    increases, errors = share_sensitivity(model, ids, labels, kd_topk=VOCAB_SIZE, batch_size=2)
    assert increases == pytest.approx(share_increases(model, ids, labels, VOCAB_SIZE, batch_size=3), abs=1e-6)
    per_row = [share_increases(model, ids[r:r + 1], labels[r:r + 1], VOCAB_SIZE) for r in range(3)]
    tokens = [int((labels[r, 1:] != -100).sum()) for r in range(3)]
    w = [t / sum(tokens) for t in tokens]
    for layer in range(1, 4):
        d = [row[layer] for row in per_row]
        mean = sum(wi * di for wi, di in zip(w, d))
        se = (1.5 * sum(wi ** 2 * (di - mean) ** 2 for wi, di in zip(w, d))) ** 0.5
        assert increases[layer] == pytest.approx(mean, abs=1e-5) and errors[layer] == pytest.approx(se, abs=1e-5)
        assert errors[layer] > 1e-5  # the rows differ: the check has teeth


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
    errors = report["standard_errors"]
    assert errors[0] is None and all(e > 0 for e in errors[1:])
    assert report["near_threshold"] == [l for l in range(1, 4) if abs(report["increases"][l] - threshold) <= 2 * errors[l]]
    setter = min(range(1, 4), key=lambda l: abs(increases[l] - threshold))
    assert setter in report["near_threshold"]  # the layer that sets the threshold lies on it
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


def test_the_spread_script_pools_the_seeds_rows(teacher4, tmp_path, capsys):
    """``benchmarks/kaizen_share_sensitivity_spread.py``: each seed's report is the pass on that seed's rows, the
    pooled one the pass on every seed's rows together, and a layer is listed as differing when the seeds' masks
    disagree on it; bad seeds are one line."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kaizen_share_sensitivity_spread.py"
    spec = importlib.util.spec_from_file_location("spread_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "s.json"
    assert script.main(["--model", str(teacher4), "--seeds", "0,1", "--rows", "2", "--seq-len", str(SEQ),
                        "--threshold", "0.5", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    model = attach(kvlearn.load(teacher4, dtype=torch.float32)).eval()
    rows = [calibration_rows(2, SEQ, seed) for seed in (0, 1)]
    for report, (ids, labels) in zip(data["per_seed"], rows):
        assert report["increases"][1:] == pytest.approx(share_increases(model, ids, labels)[1:], abs=1e-5)
    ids, labels = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    pooled = share_increases(model, ids, labels)
    assert data["pooled"]["increases"][1:] == pytest.approx(pooled[1:], abs=1e-5) and data["pooled"]["rows"] == 4
    assert data["pooled"]["allowed"] == list(allowed_share_layers(pooled, 0.5))
    masks = [set(r["allowed"]) for r in data["per_seed"]]
    assert data["layers_whose_mask_differs_between_seeds"] == sorted(masks[0] ^ masks[1])
    assert script.main(["--seeds", "0,x", "--out", str(out)]) == 2
    assert "--seeds '0,x' is invalid: expected a comma list of integers >= 0" in capsys.readouterr().err


def test_share_seed_fixes_the_calibration_rows_whatever_the_training_seed(teacher4, tmp_path):
    """``share_seed``: the mask of runs with different ``seed`` comes from the same rows (the default, 0); ``None``
    takes each run's own seed's rows, the rule before session 41."""
    from kvlearn.train.kaizen_train import resolve_share_layers

    model = attach(kvlearn.load(teacher4, dtype=torch.float32)).eval()
    common = dict(model=teacher4, targets=(4.0,), steps=1, batch_size=2, seq_len=SEQ, share_layers="auto",
                  share_threshold=0.3, share_rows=2)
    reports = {}
    assert KaizenTrainConfig(out=str(tmp_path / "d"), **common).share_seed == 0  # the default: one seed for all
    for seed, share_seed in ((3, 0), (5, 0), (5, None)):
        config = KaizenTrainConfig(out=str(tmp_path / f"r{seed}_{share_seed}"), seed=seed, share_seed=share_seed,
                                   **common)
        reports[seed, share_seed] = resolve_share_layers(config, model, torch.device("cpu"))[1]
    assert reports[3, 0]["seed"] == reports[5, 0]["seed"] == 0 and reports[5, None]["seed"] == 5
    assert reports[3, 0]["increases"] == reports[5, 0]["increases"]
    assert reports[5, None]["increases"] != reports[5, 0]["increases"]
    ids, labels = calibration_rows(2, SEQ, seed=0)
    assert reports[3, 0]["increases"][1:] == pytest.approx(share_increases(model, ids, labels)[1:], abs=1e-5)
    with pytest.raises(KVLearnError, match="share_seed=-1 is invalid"):
        KaizenTrainConfig(out=str(tmp_path / "bad"), share_seed=-1, **common)

