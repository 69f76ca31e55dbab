"""benchmarks/step_timeline_gaps.py: the GPU's idle gaps in a hand-built Chrome trace, each charged to the host
operator that launched the kernel ending it (or to the queue), against totals computed by hand."""

import gzip
import json

import pytest
from benchmark_loader import load_benchmark


def op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def launch(corr, ts, tid=1, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "args": {"correlation": corr}}


def kernel(corr, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}


EVENTS = [
    op("outer", 0, 1000), op("aten::mul", 100, 200), op("aten::add", 500, 400),
    launch(1, 10), launch(2, 200), launch(3, 600), launch(4, 50, cat="cuda_driver"), launch(5, 40), launch(6, 60),
    kernel(1, 20, 100),        # busy [20, 120)
    kernel(2, 250, 50),        # gap 130 us; launched at 200 (> 120) inside aten::mul: host late
    kernel(4, 300, 2),         # no gap (starts where the last ended)
    kernel(9, 301, 9, "gpu_memcpy"),  # overlaps: busy to 310; no launch recorded
    kernel(3, 700, 100),       # gap 390 us; launched at 600 inside aten::add (nested in outer): host late
    kernel(5, 803, 2),         # gap 3 us: under the threshold, idle but not a counted gap
    kernel(6, 900, 50),        # gap 95 us; launched at 60, before the gap began: queued
    {"ph": "i", "cat": "instant", "name": "marker", "ts": 5},
]


def test_gaps_of_a_hand_built_trace():
    script = load_benchmark("step_timeline_gaps")
    got = script.gpu_idle_gaps(EVENTS, min_gap_us=5.0)
    busy = 100 + (310 - 250) + 100 + 2 + 50
    assert got["span_us"] == 950 - 20 and got["busy_us"] == busy and got["idle_us"] == 930 - busy == 130 + 390 + 3 + 95
    assert got["gaps"] == 3 and got["host_late_us"] == 520 and got["queued_us"] == 95
    assert got["by_operator"] == [["aten::add", 390, 1], ["aten::mul", 130, 1], ["(queued)", 95, 1]]
    # a zero threshold counts the 3 us gap too (its kernel was queued); --top keeps the largest
    assert script.gpu_idle_gaps(EVENTS, min_gap_us=0.0)["queued_us"] == 98
    assert script.gpu_idle_gaps(EVENTS, top=1)["by_operator"] == [["aten::add", 390, 1]]
    assert script.gpu_idle_gaps([op("x", 0, 5)])["busy_us"] == 0.0  # no device events


def test_cli_reads_a_gzipped_trace_and_rejects_bad_files(tmp_path, capsys):
    script = load_benchmark("step_timeline_gaps")
    path = tmp_path / "step.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    out = tmp_path / "gaps.json"
    assert script.main([str(path), "--out", str(out)]) == 0
    assert "aten::add" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["gaps"] == 3 and written["by_operator"][0] == ["aten::add", 390, 1]
    (tmp_path / "bad.json").write_text("{not json")
    for bad, message in ((tmp_path / "missing.json", "does not exist"), (tmp_path / "bad.json", "could not be read")):
        assert script.main([str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err
    with pytest.raises(Exception, match="--min-gap-us -1"):
        script.gpu_idle_gaps(EVENTS, min_gap_us=-1)
