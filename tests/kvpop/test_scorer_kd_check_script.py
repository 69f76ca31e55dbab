"""``benchmarks/kvpop_scorer_kd_check.py`` end to end on a tiny GQA Qwen3 (CPU): one frozen-backbone arm per weight,
each with its KD loss on fresh batches and accuracy rows on both splits, the initial gradient norms of both sources,
and one-line errors for bad arguments."""

import json
import math

import pytest
from benchmark_loader import load_benchmark

from kvlearn import KVLearnError


def test_check_writes_arms_rows_and_gradients(make_teacher, tmp_path):
    script = load_benchmark("kvpop_scorer_kd_check")
    out = tmp_path / "check.json"
    assert script.main(["--model", make_teacher(2, 0), "--weights", "0", "1", "--length", "256", "--budget", "40",
                        "--window", "8", "--sinks", "2", "--steps", "2", "--batch-size", "1", "--queries", "16",
                        "--tasks", "vt", "--n", "1", "--eval-batches", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [a["scorer_kd"] for a in data["arms"]] == [0.0, 1.0]
    assert all(math.isfinite(a["kd_eval"]) and a["kd_eval"] >= 0 for a in data["arms"])
    for a in data["arms"]:  # a share of the needed tokens, on both splits
        assert all(0 <= a[f"needed_kept_{s}_vt"] <= 1 for s in ("eval", "heldout"))
    assert {(r["scorer_kd"], r["split"], r["task"]) for r in data["rows"]} == \
        {(w, s, "vt") for w in (0.0, 1.0) for s in ("eval", "heldout")}
    assert all(r["budget"] == 40 and r["method"] == "kvpop_mlp_frozen" for r in data["rows"])
    grads = data["init_gradients"]
    assert set(grads) == {f"{p}_{s}" for p in ("scorer", "decay") for s in ("kd_through_soft_retention", "boundary")}
    assert grads["scorer_kd_through_soft_retention"] > 0 and grads["scorer_boundary"] > 0


@pytest.mark.parametrize("argv, match", [(["--weights", "1", "1"], "distinct"), (["--weights", "-1"], ">= 0"),
                                         (["--budget", "20", "--window", "32"], "--budget 20")])
def test_bad_arguments(argv, match):
    script = load_benchmark("kvpop_scorer_kd_check")
    with pytest.raises(KVLearnError, match=match) as err:
        script.parse(argv)
    assert "\n" not in str(err.value)


def test_needed_kept_limits(make_teacher, tmp_path):
    """A top-k that holds every eligible token keeps every needed one (share 1); a top-k of one keeps at most one per
    layer and head, so at most 1 / (needed tokens) of them (share < 0.5 with several needed tokens)."""
    import torch

    from kvlearn import KVpopConfig
    from kvlearn.testbed import example_seed, generate, needed_positions
    from kvlearn.train.distill import RetrofitConfig, build_models

    script = load_benchmark("kvpop_scorer_kd_check")
    kv = KVpopConfig(sinks=2, window=8, topk=30, scorer="mlp")
    _, student = build_models(RetrofitConfig(model=make_teacher(2, 0), out=str(tmp_path / "s"), kvpop=kv,
                                             seq_len=256, batch_size=1), torch.device("cpu"))
    ex = generate("vt", example_seed("vt", "eval", 0), 256)
    q = len(ex.prompt_ids) - 1
    assert len([p for p in needed_positions(ex) if 2 <= p <= q - 8]) >= 3
    assert script.needed_kept(student, KVpopConfig(sinks=2, window=8, topk=256, scorer="mlp"), "vt", "eval", 1,
                              256) == 1.0
    assert script.needed_kept(student, KVpopConfig(sinks=2, window=8, topk=1, scorer="mlp"), "vt", "eval", 1,
                              256) < 0.5
