"""``benchmarks/kvpop_ops.py --smoke --quick`` on the CPU: every row written, and the KVpop additions summed both with
the paper's mass target and with the target the retrofit trains with (``KVpopConfig().target_reduction``), each sum
equal to its rows (times mean nothing on the CPU; the sums and the acceptance keys are what is checked)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlearn.config import KVpopConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("ops") / "ops.json"
    run = subprocess.run([sys.executable, "benchmarks/kvpop_ops.py", "--smoke", "--quick", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


def test_additions_with_the_trained_target(smoke):
    reduction = KVpopConfig().target_reduction
    assert reduction == "peak"  # the retrofit's default target (if it changes, the row name follows it)
    ms = {r["name"]: r["ms"] for r in smoke["rows"]}
    trained = {r["name"]: r for r in smoke["rows"]}[f"target_pass_{reduction}"]
    assert trained["reduction"] == reduction and trained["ms"] > 0
    summary = smoke["summary"]
    assert summary["trained_target_reduction"] == reduction
    mlstm = ms["scorer_mlstm_fwd_bwd"]
    want_mass = mlstm + ms["cutoff_triton"] + ms["target_pass"]
    want_trained = mlstm + ms["cutoff_triton"] + ms[f"target_pass_{reduction}"]
    dense = ms["attn_dense_sdpa_fwd_bwd"]
    assert summary["kvpop_additions_ms"] == pytest.approx(want_mass)
    assert summary["kvpop_additions_trained_target_ms"] == pytest.approx(want_trained)
    assert summary["kvpop_additions_over_dense_fwd_bwd_trained_target"] == pytest.approx(want_trained / dense)
    acceptance = summary["acceptance"]
    assert acceptance["kvpop_additions_lt_0p45_dense_fwd_bwd"] == (want_mass / dense < 0.45)
    assert acceptance["kvpop_additions_trained_target_lt_0p45_dense_fwd_bwd"] == (want_trained / dense < 0.45)
    for row in (r for r in smoke["rows"] if "matmul_dtype" in r):  # per mLSTM operand dtype, with the same target
        assert row["kvpop_additions_trained_target_over_dense_fwd_bwd"] == pytest.approx(
            (row["ms"] + ms["cutoff_triton"] + ms[f"target_pass_{reduction}"]) / dense)
    assert smoke["checks"][f"target_{reduction}_finite"] > 0


def test_graphed_rows_are_absent_on_the_cpu(smoke):
    """The CUDA-graph replay rows exist only on CUDA: on the CPU neither the rows nor a made-up sum are written."""
    names = {r["name"] for r in smoke["rows"]}
    assert "scorer_mlstm_fwd_bwd_graphed" not in names and "attn_dense_sdpa_fwd_bwd_graphed" not in names
    summary = smoke["summary"]
    assert summary["kvpop_additions_trained_target_graphed_ms"] is None
    assert summary["kvpop_additions_over_dense_fwd_bwd_trained_target_graphed"] is None
    assert summary["acceptance"]["kvpop_additions_trained_target_graphed_lt_0p45_dense_fwd_bwd_graphed"] is None


@pytest.mark.gpu
def test_graphed_bench_replays_the_work():
    """``graphed_bench`` times a replay that really runs the captured work: a counter the function increments on the
    GPU counts every eager call and every replay (a replay of nothing would leave it at the eager calls)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kvpop_ops

    counter = torch.zeros((), device="cuda")
    x = torch.randn(256, 256, device="cuda", requires_grad=True)

    def fn():
        counter.add_(1)
        (x @ x).square().mean().backward()

    ms = kvpop_ops.graphed_bench(fn)
    torch.cuda.synchronize()
    assert ms is not None and ms > 0
    assert counter.item() > 4 + 5  # 3 eager calls + the capture's first replay + do_bench's (>= 5 estimate) replays
    assert x.grad is not None and torch.isfinite(x.grad).all()
