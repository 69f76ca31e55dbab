"""benchmarks/mqa_prefill_attention.py --smoke on the CPU: a row per context, every MQA variant (fold, broadcast,
lower-right causal bias) equal to the fold, the SDPA call counts the bias bound gives, the results file written;
bad contexts and a missing CUDA device are one-line errors."""

import json

import torch
from benchmark_loader import load_benchmark


def test_smoke_rows_agree_and_bad_input_is_one_line(tmp_path, capsys):
    script = load_benchmark("mqa_prefill_attention")
    out = tmp_path / "m.json"
    assert script.main(["--smoke", "--iters", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["context"] for r in rows] == [96, 192] and data["shape"]["q_heads"] == 8
    for r in rows:
        assert "errors" not in r
        assert set(r["ms"]) == {"gqa_fold", "mqa_fold", "mqa_broadcast", "mqa_lower_right"}
        assert r["max_abs_diff_mqa_broadcast_vs_fold"] < 1e-5 and r["max_abs_diff_mqa_lower_right_vs_fold"] < 1e-5
        # CPU bound (every query head's scores): limit // (8 heads * C * 4) rows per call, 64 queries
        rows_cpu = data["max_mask_bytes"] // (8 * r["context"] * 4)
        assert r["sdpa_calls"]["mqa_fold"] == r["sdpa_calls"]["mqa_broadcast"] == -(-64 // rows_cpu) > 1
        assert r["sdpa_calls"]["mqa_lower_right"] == 1
    if not torch.cuda.is_available():
        capsys.readouterr()
        assert script.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err
