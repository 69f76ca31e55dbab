"""benchmarks/cache_operator_count.py: the counter counts exactly the non-view operators of a hand-written case and
attributes them to the kvlearn frame that issued them; the script writes one row per method and chunk, the model
alone (dense) issuing none from kvlearn; bad input is one line."""

import json

import torch
from benchmark_loader import load_benchmark


def test_counter_counts_non_view_operators_by_hand():
    script = load_benchmark("cache_operator_count")
    counter = script.OperatorCounter()
    with counter:
        x = torch.ones(3)              # 1: ones (its fill may be one more operator: counted below from aten's own list)
        y = x.view(3).unsqueeze(0)     # views: none
        z = (y + 1) * 2                # 2: add, mul
        z.sum()                        # 1: sum
    ones = script.OperatorCounter()
    with ones:
        torch.ones(3)
    assert counter.total == ones.total + 3
    assert sum(counter.sites.values()) == 0  # issued here, outside kvlearn's package


def test_kvlearn_sites_are_attributed():
    script = load_benchmark("cache_operator_count")
    from kvlearn.cache.store import scatter_slots

    buf, slots, src = torch.zeros(1, 2, 4, 3), torch.tensor([[[1], [-1]]]), torch.ones(1, 2, 1, 3)
    counter = script.OperatorCounter()
    with counter:
        scatter_slots(buf, slots, src)
    assert counter.total > 0 and counter.sites == {"cache/store.py:scatter_slots": counter.total}
    assert buf[0, 0, 1].tolist() == [1.0, 1.0, 1.0] and buf[0, 1].abs().sum() == 0  # the write itself is unchanged


def test_script_rows(tmp_path, capsys):
    script = load_benchmark("cache_operator_count")
    out = tmp_path / "ops.json"
    assert script.main(["--methods", "dense,streaming,kvpop_mlp", "--chunks", "1,8", "--context", "96", "--budget",
                        "48", "--window", "8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "operator_count" and data["device"].startswith("cpu")
    rows = {(r["method"], r["chunk"]): r for r in data["rows"]}
    assert set(rows) == {(m, c) for m in ("dense", "streaming", "kvpop_mlp") for c in (1, 8)}
    for c in (1, 8):
        dense, stream, kvpop = rows["dense", c], rows["streaming", c], rows["kvpop_mlp", c]
        assert dense["kvlearn_ops_per_layer"] == 0 and dense["ops_per_layer"] > 0
        assert 0 < stream["kvlearn_ops_per_layer"] < kvpop["kvlearn_ops_per_layer"]
        assert kvpop["ops_per_layer"] > dense["ops_per_layer"]
        assert sum(kvpop["top_kvlearn_sites_per_layer"].values()) <= kvpop["kvlearn_ops_per_layer"]


def test_bad_input_is_one_line(capsys):
    script = load_benchmark("cache_operator_count")
    assert script.main(["--methods", "h2o"]) == 2
    assert "--methods: 'h2o' is unknown" in capsys.readouterr().err
    assert script.main(["--chunks", "0"]) == 2
    assert "--chunks value=0 is invalid" in capsys.readouterr().err
