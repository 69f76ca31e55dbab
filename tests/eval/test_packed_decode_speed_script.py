"""benchmarks/packed_decode_speed.py --smoke on the CPU: rows for every context and bit-width, the fused path equal
to read-then-attend up to float rounding, the results file written; without CUDA the GPU run is one line."""

import json

import pytest
from benchmark_loader import load_benchmark



def load_script():
    return load_benchmark("packed_decode_speed")


def test_smoke_rows_and_agreement(tmp_path, capsys):
    import torch

    script = load_script()
    out = tmp_path / "s.json"
    assert script.main(["--smoke", "--iters", "1", "--bits", "4,2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["bits"]) for r in rows] == [(64, 4), (64, 2), (128, 4), (128, 2)]
    assert all(r["max_abs_diff_fused_vs_read"] < 1e-5 and r["fused_over_bf16"] > 0 for r in rows)
    if not torch.cuda.is_available():
        capsys.readouterr()
        assert script.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_graph_replay_times_every_variant_on_cuda():
    """``--graph`` on CUDA: each variant captured in a CUDA graph and replayed, a positive time each."""
    import torch

    script = load_script()
    r = script.row(4096, 4, 8, 2, 128, iters=3, device=torch.device("cuda"), backend="triton", graph=True)
    assert all(isinstance(r["ms_graph"][k], float) and r["ms_graph"][k] > 0 for k in ("bf16", "read_then_attend", "fused"))
    assert r["fused_over_bf16_graph"] > 0
