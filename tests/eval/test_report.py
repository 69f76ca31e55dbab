"""docs/RESULTS.md is built from results files: the ops table shows every row with its provenance and notes."""

import json

from kvlearn.eval.report import build


def test_ops_section_rows_notes_and_provenance(tmp_path):
    data = {
        "schema": "kvlearn.results.v1", "kind": "ops", "command": "python benchmarks/kvpop_ops.py --quick",
        "commit": "abc1234", "date": "2026-11-30T00:00:00Z", "device": "NVIDIA H200",
        "rows": [
            {"name": "attn_dense_sdpa_fwd", "ms": 4.0},
            {"name": "attn_sparse_fwd_k1792", "ms": 1.5, "over_dense": 0.375, "block_sparsity": 0.8691,
             "layout": "gathered", "backend": "triton"},
            {"name": "target_pass", "ms": 2.25, "backend": "triton",
             "launch": {"block_t": 128, "block_d": 64, "num_warps": 4, "num_stages": 3}},
        ],
        "summary": {"acceptance": {"cutoff_triton_le_1ms": True}},
    }
    (tmp_path / "kvpop_ops_h200.json").write_text(json.dumps(data))
    text = build(tmp_path)
    assert "commit: `abc1234`" in text and "NVIDIA H200" in text and "python benchmarks/kvpop_ops.py --quick" in text
    assert "| attn_sparse_fwd_k1792 | 1.500 | 0.38 | 0.869 | gathered; backend: triton |" in text
    assert "| target_pass | 2.250 |  |  | backend: triton; launch: block_t=128, block_d=64, num_warps=4, num_stages=3 |" in text
    assert '"cutoff_triton_le_1ms": true' in text
