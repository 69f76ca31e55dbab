"""docs/RESULTS.md is built from results files: the ops table shows every row with its provenance and notes."""

import json

from kvlearn.eval.report import build


def write_accuracy(path, rows):
    """An accuracy results file of ``rows`` (context 4096) at ``path``."""
    data = {"schema": "kvlearn.results.v1", "kind": "accuracy", "command": "x", "commit": "abc", "date": "d",
            "device": "cpu", "context": 4096, "rows": rows}
    path.write_text(json.dumps(data))


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


def test_accuracy_section_ratios_to_dense_per_split_with_and_without_bookkeeping(tmp_path):
    row = dict(protocol="bounded", compression=0.0, accuracy=1.0, n=10, task="vt", variants={})
    rows = [
        {**row, "method": "dense", "split": "eval", "budget": 4096, "kv_bytes": 1000, "store_bytes": 1000},
        {**row, "method": "dense", "split": "heldout", "budget": 4096, "kv_bytes": 2000, "store_bytes": 2000},
        {**row, "method": "h2o", "split": "heldout", "budget": 1024, "compression": 0.75, "kv_bytes": 530,
         "store_bytes": 500},
    ]
    write_accuracy(tmp_path / "t.json", rows)
    text = build(tmp_path)
    # the heldout h2o row is compared with the heldout dense row: 530 / 2000 in all, 500 / 2000 keys/values alone
    assert "| h2o | bounded | heldout | 1024 | 75% | vt | 1.000 | 1.00 | 10 | 530 | 0.265 | 0.250 |" in text
    assert "![" not in text  # no plot file next to it


def test_accuracy_relative_to_a_full_cache_row_labelled_teacher_and_the_plot(tmp_path):
    """A table whose full-cache rows are labelled (``teacher``, cache method ``dense``): accuracy and bytes relative
    to them per task and split (0.45 / 0.90 = 0.50; a dense accuracy of 0 leaves the ratio blank), and the plot
    named after the file shown under its table."""
    row = dict(protocol="bounded", compression=0.0, n=10, split="eval", variants={})
    rows = [
        {**row, "method": "teacher", "registry_method": "dense", "budget": 4096, "task": "vt", "accuracy": 0.9,
         "kv_bytes": 1000},
        {**row, "method": "teacher", "registry_method": "dense", "budget": 4096, "task": "trace", "accuracy": 0.0,
         "kv_bytes": 1000},
        {**row, "method": "kvpop_mlp", "registry_method": "kvpop", "budget": 512, "compression": 0.875, "task": "vt",
         "accuracy": 0.45, "kv_bytes": 125},
        {**row, "method": "kvpop_mlp", "registry_method": "kvpop", "budget": 512, "compression": 0.875,
         "task": "trace", "accuracy": 0.1, "kv_bytes": 125},
    ]
    write_accuracy(tmp_path / "kvpop_table.json", rows)
    (tmp_path / "kvpop_table.png").write_bytes(b"png")
    text = build(tmp_path)
    assert "| kvpop_mlp | bounded | eval | 512 | 88% | vt | 0.450 | 0.50 | 10 | 125 | 0.125 |" in text
    assert "| kvpop_mlp | bounded | eval | 512 | 88% | trace | 0.100 |  | 10 | 125 | 0.125 |" in text
    assert "![kvpop_table.png](../results/kvpop_table.png)" in text


def test_other_kinds_get_a_plain_table_and_time_guard_cuts_are_listed(tmp_path):
    other = {"schema": "kvlearn.results.v1", "kind": "mla_conversion_error", "command": "python b.py", "commit": "c1",
             "date": "d", "device": "cpu", "rows": [{"model": "qwen3", "error": 0.25}, {"model": "llama", "width": 8}]}
    cut = {"schema": "kvlearn.results.v1", "kind": "accuracy", "command": "x", "commit": "c2", "date": "d",
           "device": "cpu", "context": 4096, "not_run": ["tova/bounded/eval/B=512"], "rows": []}
    (tmp_path / "m.json").write_text(json.dumps(other))
    (tmp_path / "t.json").write_text(json.dumps(cut))
    text = build(tmp_path)
    assert "## mla_conversion_error: m" in text and "| model | error | width |" in text
    assert "| qwen3 | 0.25 |  |" in text and "| llama |  | 8 |" in text
    assert "Not run (planned, no row): tova/bounded/eval/B=512." in text  # a guard or a kill: the file says which


def test_kaizen_memory_section_rows_ratios_not_run_and_summary(tmp_path):
    row = dict(cache_over_cost_model=1.001, peak_bytes=2 * 2**20, cost_model_bytes=1, store_bytes=1)
    rows = [
        {**row, "config": "bf16", "context": 16384, "cache_bytes": 3 * 2**20, "decode_ms_per_token": 60.0,
         "ratio_to_bf16": {"cache_bytes": 1.0, "peak_bytes": 1.0, "decode_ms_per_token": 1.0}},
        {**row, "config": "int4", "context": 16384, "cache_bytes": 2**20, "cache_over_cost_model": 1.0038,
         "decode_ms_per_token": 180.0, "ratio_to_bf16": {"cache_bytes": 0.2585, "peak_bytes": 0.825,
                                                         "decode_ms_per_token": 3.0}},
        {"config": "kivi2", "context": 16384, "error": "OutOfMemoryError: x"},
    ]
    data = {"schema": "kvlearn.results.v1", "kind": "kaizen_memory", "command": "python benchmarks/kaizen_memory.py",
            "commit": "20c786f", "date": "2026-12-01T15:49:02Z", "device": "NVIDIA H200",
            "model": {"family": "qwen2 (random weights)", "layers": 48, "kv_heads": 8, "head_dim": 128},
            "not_run": ["bf16@131072", "int4@131072"], "complete": False,
            "summary": {"cache_bytes_within_5pct_of_cost_model": True, "int4_decode_over_bf16_at_131072": None},
            "rows": rows}
    (tmp_path / "kaizen_memory_h200.json").write_text(json.dumps(data))
    text = build(tmp_path)
    assert "## KV-Kaizen memory and decode speed: kaizen_memory_h200" in text and "commit: `20c786f`" in text
    assert "Model: qwen2 (random weights), layers 48, kv_heads 8, head_dim 128." in text
    assert "| bf16 | 16384 | 3.0 | 1.0010 | 2.0 | 60.00 | 1 | 1.000 | 1.00 |" in text
    assert "| int4 | 16384 | 1.0 | 1.0038 | 2.0 | 180.00 | 0.2585 | 0.825 | 3.00 |" in text
    assert "| kivi2 | 16384 | error: OutOfMemoryError: x |" in text
    assert "Not run (planned, no row): bf16@131072, int4@131072." in text
    assert '"int4_decode_over_bf16_at_131072": null' in text
    assert "| config | error |" not in text  # not the plain table of other kinds


def test_per_variant_rows_name_their_split(tmp_path):
    row = dict(method="dense", protocol="bounded", compression=0.0, n=4, task="niah", budget=4096, kv_bytes=1, accuracy=0.5)
    rows = [{**row, "split": "eval", "variants": {"single": {"accuracy": 1.0, "n": 2}, "multivalue": {"accuracy": 0.0, "n": 2}}},
            {**row, "split": "heldout", "variants": {"single": {"accuracy": 0.5, "n": 2}, "multivalue": {"accuracy": 0.5, "n": 2}}}]
    write_accuracy(tmp_path / "t.json", rows)
    text = build(tmp_path)
    assert "| dense | eval | niah | multivalue | 0.000 | 2 |" in text
    assert "| dense | heldout | niah | multivalue | 0.500 | 2 |" in text


def test_accuracy_section_names_each_rows_selector_or_series(tmp_path):
    """Rows of two selectors and a retrofitted student at one factor are told apart by a ``series`` column (the
    ``selector``, else the ``series`` label); a file without either keeps the plain columns (tests above)."""
    row = dict(protocol="bounded", split="eval", n=10, task="vt", variants={}, kv_bytes=100)
    rows = [{**row, "method": "control", "registry_method": "dense", "budget": 4096, "compression": 0.0,
             "accuracy": 1.0, "kv_bytes": 1000},
            {**row, "method": "kaizen", "selector": "kaizen8_s0", "budget": 4096, "compression": 0.875, "accuracy": 0.9},
            {**row, "method": "kaizen", "selector": "kaizen8_s1", "budget": 4096, "compression": 0.875, "accuracy": 0.8},
            {**row, "method": "kaizen+kvpop", "series": "retrofit_b4", "budget": 512, "compression": 0.96875,
             "accuracy": 0.5}]
    write_accuracy(tmp_path / "kaizen_table.json", rows)
    text = build(tmp_path)
    assert "| method | series | protocol |" in text
    assert "| control |  | bounded | eval | 4096 | 0% | vt | 1.000 | 1.00 |" in text
    assert "| kaizen | kaizen8_s1 | bounded | eval | 4096 | 88% | vt | 0.800 | 0.80 | 10 | 100 | 0.100 |" in text
    assert "| kaizen+kvpop | retrofit_b4 | bounded | eval | 512 | 97% | vt | 0.500 | 0.50 |" in text


def test_accuracy_relative_to_the_control_not_to_a_later_full_cache_baseline(tmp_path):
    """A Kaizen table holds the control and a smaller model's rows, both with cache method ``dense``: every ratio is
    to the control whichever comes first (0.9 / 0.9 = 1.00 and 0.45 / 0.9 = 0.50, not / 0.3)."""
    row = dict(protocol="bounded", compression=0.0, n=10, split="eval", task="vt", variants={}, budget=4096)
    smaller = {**row, "method": "smaller_model", "registry_method": "dense", "accuracy": 0.3, "kv_bytes": 250}
    kaizen = {**row, "method": "kaizen", "registry_method": "kaizen", "accuracy": 0.45, "kv_bytes": 100}
    control = {**row, "method": "control", "registry_method": "dense", "accuracy": 0.9, "kv_bytes": 1000}
    for order in ([smaller, kaizen, control], [control, kaizen, smaller]):
        write_accuracy(tmp_path / "k.json", order)
        text = build(tmp_path)
        assert "| kaizen | bounded | eval | 4096 | 0% | vt | 0.450 | 0.50 | 10 | 100 | 0.100 |" in text
        assert "| smaller_model | bounded | eval | 4096 | 0% | vt | 0.300 | 0.33 | 10 | 250 | 0.250 |" in text


def test_acceptance_section_one_line_per_verdict(tmp_path):
    data = {"schema": "kvlearn.results.v1", "kind": "acceptance", "command": "python -m kvlearn.eval.acceptance kaizen",
            "commit": "abc", "date": "d", "device": "none", "summary": {"composed_64x_every_family": {"met": ["x"]}},
            "rows": [{"criterion": "composed_64x_every_family", "method": "kaizen+kvpop", "label": "s", "target": 64.0,
                      "split": "eval", "value": 0.8421, "value_name": "lowest", "bar": 0.85, "met": False,
                      "incomplete": False},
                     {"criterion": "ahead_of_baselines", "method": "kvpop", "label": "", "budget": 512,
                      "split": "eval", "value": 0.9, "value_name": "mean", "bar": None,
                      "rival_means": {"dms": 0.5, "snapkv": 0.7}, "met": True},
                     {"criterion": "selector_within_control", "method": "kaizen", "label": "k8", "target": 8.0,
                      "split": "heldout", "value": 0.0425, "value_name": "control mean - mean", "bar": 0.05,
                      "of_control": 0.9575, "met": True, "incomplete": False}]}
    (tmp_path / "kaizen_acceptance.json").write_text(json.dumps(data))
    text = build(tmp_path)
    assert "| composed_64x_every_family | kaizen+kvpop | s | 64x | eval | 0.842 | lowest | 0.85 | no |" in text
    assert "| ahead_of_baselines | kvpop |  | 512 | eval | 0.900 (best other: snapkv 0.700) | mean |  | yes |" in text
    assert ("| selector_within_control | kaizen | k8 | 8x | heldout | 0.043 (0.958 of the control) | control mean - mean "
            "| 0.05 | yes |") in text


def test_graphed_compare_section_one_line_per_run(tmp_path):
    """A graphed-against-eager retrofit file: each run's step time, loss terms over the last tenth and accuracy per
    family in one line (not the nested fields dumped), then the comparison."""
    def run(name, ms, kd, trace):
        return {"run": name, "steps": 400, "step_ms_median": ms,
                "metrics": {"kd": {"last_tenth": kd, "tenths": [1.0, kd]},
                            "boundary": {"last_tenth": 0.58, "tenths": [0.8, 0.58]}},
                "accuracy": {"trace": trace, "niah": 0.5, "mean": (trace + 0.5) / 2}}

    data = {"schema": "kvlearn.results.v1", "kind": "graphed_retrofit_compare", "command": "bash x.sh",
            "commit": "abc", "date": "d", "device": "NVIDIA H100 80GB HBM3",
            "comparison": {"graphed_over_eager_step_time": 0.81},
            "rows": [run("eager", 84.0000000000014, 0.06002, 0.95), run("graphed", 67.99999999999784, 0.06173, 0.97)]}
    (tmp_path / "graphed_retrofit_compare_h100.json").write_text(json.dumps(data))
    text = build(tmp_path)
    assert "| run | steps | median step ms | kd (last tenth) | boundary (last tenth) | trace | niah | mean |" in text
    assert "| eager | 400 | 84.0 | 0.0600 | 0.5800 | 0.95 | 0.50 | 0.7250 |" in text
    assert "| graphed | 400 | 68.0 | 0.0617 | 0.5800 | 0.97 | 0.50 | 0.7350 |" in text
    assert '"graphed_over_eager_step_time": 0.81' in text and "tenths" not in text
