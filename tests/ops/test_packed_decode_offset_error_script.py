"""``benchmarks/packed_decode_offset_error.py``: with float64 accumulation the magic path's algebra (codes offset by
``OFF``, the offset taken off the logits per row and the values per tile) equals the converting path exactly; with
float32 accumulation the two differ, by less for bf16's offset 128 than for fp16's 1024; bad arguments are one line."""

import json

import pytest
from benchmark_loader import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("packed_decode_offset_error")


def test_exact_in_float64_and_offset_sized_in_float32(script, tmp_path):
    for bits in (2, 4):
        exact = script.offset_error(256, 32, 3, bits, "bfloat16", 0, 64, script.torch.float64)
        assert exact["logit_max_abs_diff"] < 1e-12 and exact["out_max_abs_diff"] < 1e-12
    rows = {}
    for dtype in ("bfloat16", "float16"):
        rows[dtype] = script.offset_error(1024, 64, 5, 4, dtype, 1, 64, script.torch.float32)
        assert 0 < rows[dtype]["out_max_abs_diff"] < 1e-2 * rows[dtype]["out_max_abs"]
    assert rows["bfloat16"]["logit_max_abs_diff"] < rows["float16"]["logit_max_abs_diff"]
    out = tmp_path / "e.json"
    assert script.main(["--context", "128", "--head-dim", "32", "--seeds", "1", "--bits", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["bits"], r["dtype"]) for r in data["rows"]] == [(4, "bfloat16"), (4, "float16")]
    assert data["device"] and data["command"] and data["kind"] == "analysis"


@pytest.mark.parametrize("argv,needle", [(["--bits", "8"], "--bits '8' is invalid"),
                                         (["--dtypes", "float32"], "--dtypes 'float32' is invalid"),
                                         (["--context", "0"], "--context=0 is invalid")])
def test_bad_arguments_are_one_line(script, capsys, argv, needle):
    assert script.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
