"""benchmarks/kaizen_memory.py --smoke: a row per configuration and context, cache bytes within 5% of the cost model,
the expected compression against bf16, the time guard, honest not_run / complete in every write (a run killed between
two rows, a file or merge with missing rows re-summarised), the summary rewrite, and one-line errors for bad flags."""

import json

import pytest
from benchmark_loader import load_benchmark



def load_script():
    return load_benchmark("kaizen_memory")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    script = load_script()
    out = tmp_path_factory.mktemp("kzmem") / "kaizen_memory.json"
    assert script.main(["--smoke", "--out", str(out)]) == 0
    return script, out, json.loads(out.read_text())


def test_smoke_rows_for_every_configuration_and_context(smoke):
    script, _, data = smoke
    assert data["schema"] == "kvlearn.results.v1" and data["kind"] == "kaizen_memory" and data["complete"] is True
    assert data["command"].startswith("python benchmarks/kaizen_memory.py --smoke")
    assert all(data[k] for k in ("commit", "date", "device"))
    assert data["not_run"] == [] and data["contexts"] == [256, 512]
    keys = [(r["config"], r["context"]) for r in data["rows"]]
    assert keys == [(c, t) for t in (256, 512) for c in script.CONFIGS]
    for r in data["rows"]:
        assert "error" not in r
        for field in ("peak_bytes", "cache_bytes", "cost_model_bytes", "decode_ms_per_token", "ratio_to_bf16"):
            assert field in r
        assert r["method"] == r["config"] and r["budget"] == r["context"]
        assert r["capacity"] == r["context"] + r["decode_steps"] + r["warmup_steps"]
        assert r["decode_ms_per_token"] > 0 and r["cache_bytes"] >= r["store_bytes"] > 0
        # the prefill runs in --progress-tokens segments (smoke: 256) into the cache the earlier ones filled
        progress = r["prefill_progress"]
        assert [t for t, _ in progress] == list(range(256, r["context"] + 1, 256))
        assert all(a <= b for (_, a), (_, b) in zip(progress, progress[1:])) and progress[-1][1] <= r["prefill_s"] + 0.01
    assert data["model"]["kv_heads"] == 4 and data["model"]["head_dim"] == 128


def test_cache_bytes_within_five_percent_of_the_cost_model(smoke):
    _, _, data = smoke
    for r in data["rows"]:
        assert r["cache_over_cost_model"] == r["cache_bytes"] / r["cost_model_bytes"]
        assert abs(r["cache_over_cost_model"] - 1) <= 0.05, (r["config"], r["cache_over_cost_model"])
        if r["config"] != "kivi2":  # a Kaizen store allocates exactly the cost model; the rest is slot positions
            assert r["store_bytes"] == r["cost_model_bytes"]
    assert data["summary"]["cache_bytes_within_5pct_of_cost_model"] is True


def test_compression_against_bf16(smoke):
    _, _, data = smoke
    d = data["model"]["head_dim"]
    for context in (256, 512):
        rows = {r["config"]: r for r in data["rows"] if r["context"] == context}
        bf16 = rows["bf16"]["store_bytes"]
        # 4 bits: a quarter of bf16 plus one bf16 scale per stored vector of d elements
        assert rows["int4"]["store_bytes"] / bf16 == pytest.approx((4 * d + 16) / (16 * d), rel=1e-9)
        assert 0.25 < rows["int4"]["ratio_to_bf16"]["cache_bytes"] < 0.27
        # groups of 4 layers: one anchor in four keeps a cache
        assert rows["share4"]["store_bytes"] / bf16 == pytest.approx(0.25, rel=1e-9)
        assert rows["share4"]["ratio_to_bf16"]["cache_bytes"] == pytest.approx(0.25, rel=1e-3)
        # MLA r + d_R = 192 elements per token and layer against 2 n_kv d_h = 1024 (smoke shape)
        assert rows["mla_r128"]["store_bytes"] / bf16 == pytest.approx(192 / 1024, rel=1e-9)
        composed = (192 * 4 + 32) / (4 * 1024 * 16)
        assert rows["composed"]["store_bytes"] / bf16 == pytest.approx(composed, rel=1e-9)
        assert rows["kivi2"]["ratio_to_bf16"]["cache_bytes"] < 0.5
        assert rows["bf16"]["ratio_to_bf16"] == {"cache_bytes": 1.0, "peak_bytes": None, "decode_peak_bytes": None,
                                                 "decode_ms_per_token": 1.0}


def test_summary_rewrite(smoke, tmp_path):
    script, out, data = smoke
    copy = tmp_path / "merged.json"
    data = dict(data, summary={})
    copy.write_text(json.dumps(data))
    assert script.main(["--summarise", str(copy)]) == 0
    summary = json.loads(copy.read_text())["summary"]
    assert summary["cache_bytes_within_5pct_of_cost_model"] is True
    assert summary["int4_decode_over_bf16_at_512"] > 0


def test_time_guard_lists_rows_not_run(tmp_path):
    script = load_script()
    out = tmp_path / "t.json"
    assert script.main(["--smoke", "--minutes", "0", "--contexts", "256", "--configs", "int4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["complete"] is False
    assert data["not_run"] == ["bf16@256", "int4@256"]  # bf16 always runs first: the ratios' reference


def test_pending_lists_planned_rows_without_a_row_in_plan_order():
    script = load_script()
    plan = [(16, "bf16"), (16, "int4"), (32, "bf16"), (32, "int4")]
    rows = [{"context": 16, "config": "bf16"}, {"context": 32, "config": "int4", "error": "OutOfMemoryError: x"}]
    assert script.pending(plan, []) == ["bf16@16", "int4@16", "bf16@32", "int4@32"]
    assert script.pending(plan, rows) == ["int4@16", "bf16@32"]  # a failed row ran: it is not "not run"
    assert script.is_complete(plan, rows) is False
    assert script.is_complete(plan, [{"context": c, "config": n} for c, n in plan]) is True
    assert script.is_complete(plan, [{"context": c, "config": n} for c, n in plan] + rows[1:]) is False  # an error


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_run_killed_after_some_rows_leaves_a_file_listing_the_rest(stop, tmp_path, monkeypatch):
    """The file written before the kill names every row not measured and is not complete (it used to say
    ``not_run: []`` and ``complete: true`` after a kill from outside)."""
    script = load_script()
    real, calls = script.measure, []

    def measure(name, context, *a, **k):
        calls.append((context, name))
        if len(calls) > 4:
            raise stop()
        return real(name, context, *a, **k)

    monkeypatch.setattr(script, "measure", measure)
    out = tmp_path / "killed.json"
    with pytest.raises(stop):
        script.main(["--smoke", "--contexts", "256,512", "--configs", "int4,kivi2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [(r["context"], r["config"]) for r in data["rows"]] == [(256, "bf16"), (256, "int4"), (256, "kivi2"),
                                                                     (512, "bf16")]
    assert data["not_run"] == ["int4@512", "kivi2@512"] and data["complete"] is False


def test_a_run_killed_before_its_first_row_leaves_a_file_listing_every_row(tmp_path, monkeypatch):
    script = load_script()

    def build_model(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "build_model", build_model)
    out = tmp_path / "early.json"
    with pytest.raises(KeyboardInterrupt):
        script.main(["--smoke", "--contexts", "256", "--configs", "int4", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["not_run"] == ["bf16@256", "int4@256"] and data["complete"] is False


def test_summarise_lists_the_rows_a_file_lacks(smoke, tmp_path, capsys):
    """A file that claims to be complete without its last rows (as the first device run's did) is corrected."""
    _, _, data = smoke
    rows = [r for r in data["rows"] if (r["context"], r["config"]) not in {(512, "kivi2"), (512, "composed")}]
    path = tmp_path / "claims_complete.json"
    path.write_text(json.dumps(dict(data, rows=rows, not_run=[], complete=True)))
    assert load_script().main(["--summarise", str(path)]) == 0
    fixed = json.loads(path.read_text())
    assert fixed["not_run"] == ["kivi2@512", "composed@512"] and fixed["complete"] is False
    assert fixed["contexts"] == [256, 512] and fixed["rows"] == rows
    assert "not run: kivi2@512, composed@512, complete: False" in capsys.readouterr().out
    # every row there (and one with an error): not_run empty, complete only without the error
    path.write_text(json.dumps(dict(data, not_run=["kivi2@512"], complete=False)))
    assert load_script().main(["--summarise", str(path)]) == 0
    fixed = json.loads(path.read_text())
    assert fixed["not_run"] == [] and fixed["complete"] is True
    failed = [dict(r, error="OutOfMemoryError: x") if r["config"] == "int4" and r["context"] == 512 else r
              for r in data["rows"]]
    path.write_text(json.dumps(dict(data, rows=failed)))
    assert load_script().main(["--summarise", str(path)]) == 0
    fixed = json.loads(path.read_text())
    assert fixed["not_run"] == [] and fixed["complete"] is False


def test_summarise_after_a_merge_of_parts(smoke, tmp_path):
    """``kvlearn.results merge`` keeps the first part's contexts and configs and unites the parts' not_run; the
    summary rewrite plans the whole grid: a part's not_run row that another part measured is dropped, a row no
    part measured stays, and a context only another part ran is planned."""
    from kvlearn.results import merge_results

    _, _, data = smoke
    at = lambda ctx, *names: [r for r in data["rows"] if r["context"] == ctx and r["config"] in names]  # noqa: E731
    part_a = dict(data, contexts=[256], configs=list(data["configs"]), rows=at(256, *data["configs"]), not_run=[],
                  complete=True)
    part_b = dict(data, contexts=[512], configs=["bf16", "int4", "kivi2"], rows=at(512, "bf16", "int4"),
                  not_run=["kivi2@512"], complete=False)  # cut by its guard
    part_c = dict(data, contexts=[512], configs=["bf16", "kivi2", "share4"], rows=at(512, "bf16", "kivi2", "share4"),
                  not_run=[], complete=True)  # kivi2 again; mla_r128 and composed at 512 never ran
    merged = merge_results([part_a, part_b, part_c], "a && b && c")
    assert merged["contexts"] == [256] and merged["not_run"] == ["kivi2@512"] and merged["complete"] is False
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(merged))
    assert load_script().main(["--summarise", str(path)]) == 0
    fixed = json.loads(path.read_text())
    assert fixed["contexts"] == [256, 512] and fixed["configs"] == list(data["configs"])
    assert fixed["not_run"] == ["mla_r128@512", "composed@512"] and fixed["complete"] is False
    assert fixed["summary"]["int4_decode_over_bf16_at_512"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--configs", "int3"], "--configs 'int3': unknown int3"),
    (["--contexts", "16k"], "--contexts '16k' is invalid"),
    (["--contexts", "0"], "--contexts '0' is invalid"),
    (["--decode", "0"], "--decode=0 is invalid"),
    (["--kivi-group", "32", "--kivi-residual", "48"], "--kivi-residual=48 is invalid"),
    (["--mla-rank", "100"], "rank=100 is invalid"),
    (["--rope-dim", "3"], "rope_dim=3 is invalid"),
])
def test_bad_flags_are_one_line_errors(flags, message, tmp_path, capsys):
    script = load_script()
    assert script.main(["--smoke", *flags, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kaizen_memory: error:") and message in err
    assert not (tmp_path / "x.json").exists()


def test_missing_summarise_file_is_a_one_line_error(tmp_path, capsys):
    assert load_script().main(["--summarise", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kaizen_memory: error:")
