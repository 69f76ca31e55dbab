"""``benchmarks/kvpop_prefill_attention.py --smoke``: the script runs on the CPU, its sparse and chunked rows equal
the mask row (logits, held positions), and bad options are one-line errors."""

import json

import pytest

from tests.benchmark_loader import load_benchmark


def test_smoke_rows_agree_with_the_mask(tmp_path):
    bench = load_benchmark("kvpop_prefill_attention")
    out = tmp_path / "prefill.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["command"].startswith("python benchmarks/kvpop_prefill_attention.py --smoke")
    rows = {(r["context"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {(c, m) for c in (96, 160) for m in ("mask", "sparse", "chunked256")}
    for (context, mode), row in rows.items():
        assert row["same_held_positions_as_mask"] is True and row["leading_layers_holding_the_mask_positions"] == 2
        assert row["max_abs_diff_last_logits_vs_mask"] < 1e-4
        if mode == "sparse":
            assert row["max_abs_diff_logits_vs_mask"] < 1e-4 and row["greedy_agreement_vs_mask"] == 1.0
    assert data["summary"]["sparse_same_held_positions_at_160"] is True and data["partial"] is False


@pytest.mark.parametrize("argv, message", [
    (["--contexts", "512"], "--contexts value 512 is invalid: expected more than --budget=1024 tokens"),
    (["--contexts", "4k"], "--contexts='4k' is invalid: expected comma-separated integers"),
    (["--window", "1022"], "--window=1022 is invalid: expected <= budget - 4 = 1020"),
    (["--shape", "qwen9"], "--shape='qwen9' is unknown"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys):
    bench = load_benchmark("kvpop_prefill_attention")
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err
