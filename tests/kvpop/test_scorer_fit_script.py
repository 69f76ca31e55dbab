"""benchmarks/kvpop_scorer_fit.py (the scorer-only fit behind the mLSTM skip connection) on a tiny run: every arm
trained and evaluated on the eval and held-out splits, the shares it reports are shares, the skip arm has its skip
path, bad arms are one line."""

import json

from benchmark_loader import load_benchmark


def test_tiny_fit_reports_every_arm(tmp_path):
    fit = load_benchmark("kvpop_scorer_fit")
    out = tmp_path / "fit.json"
    assert fit.main(["--scorers", "mlp", "mlstm:skip=1", "--steps", "2", "--warmup", "1", "--train-rows", "2",
                     "--eval-n", "1", "--length", "512", "--layers", "1", "--batch", "1", "--threads", "1",
                     "--splits", "eval", "heldout", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["arm"] for r in results] == ["mlp", "mlstm:skip=1"]
    for r in results:
        last = r["history"][-1]
        assert last["step"] == 2 and 0.0 <= last["needles"] <= 1.0 and 0.0 <= last["kept_overlap"] <= 1.0
        assert 0.0 < last["needles_teacher"] <= 1.0
        held = last["heldout"]  # the held-out split's examples, measured apart from the eval split's
        assert set(held["needles_by_family"]) == {"niah", "vt", "recall"} and 0.0 <= held["needles"] <= 1.0
        assert held != {k: last[k] for k in held}
    assert "skip_w2" in results[1]["first_step_grad_norms_layer0"]  # the zero output layer gets the first gradient
    assert results[1]["first_step_grad_norms_layer0"]["skip_w2"] > 0


def test_bad_arms_are_one_line(capsys):
    fit = load_benchmark("kvpop_scorer_fit")
    assert fit.main(["--scorers", "lstm"]) == 2
    assert "scorer 'lstm' is unknown: expected one of mlp, linear, mlstm" in capsys.readouterr().err
    assert fit.main(["--scorers", "mlstm:skp=1"]) == 2
    assert "option 'skp=1' is invalid" in capsys.readouterr().err
    assert fit.main(["--splits", "eval", "eval"]) == 2
    assert "--splits eval eval: a split is named twice" in capsys.readouterr().err


def test_arms_mean_what_their_recorded_results_meant():
    """``mlstm`` is the paper's plain readout whatever KVpopConfig's default; ``mlstm:skip=1`` adds the skip path."""
    from kvlearn import KVpopConfig

    fit = load_benchmark("kvpop_scorer_fit")
    cfg = KVpopConfig(sinks=4, window=16, topk=8)
    plain = fit.build_modules("mlstm", {}, cfg, 2, 2, 8)
    skip = fit.build_modules("mlstm", {"skip": "1"}, cfg, 2, 2, 8)
    normed = fit.build_modules("mlstm", {"norm": "1", "skip": "1"}, cfg, 1, 2, 8)
    assert len(plain) == 2 and not any(m.scorer.skip for m in plain) and all(m.scorer.skip for m in skip)
    assert normed[0].scorer.skip and normed[0].scorer.use_norm
