"""benchmarks/kaizen_table.py --smoke: every row kind of the KV-Kaizen comparison, realised factors, honest not_run
and one-line errors for bad --selector values."""

import json

import pytest
from benchmark_loader import load_benchmark

KINDS = {"control", "kaizen", "untrained_backbone", "static", "random", "dp_search", "kivi", "posthoc_quant",
         "kaizen+snapkv", "kaizen+kvpop", "smaller_model"}


def load_script():
    return load_benchmark("kaizen_table")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    work = tmp_path_factory.mktemp("ktable")
    out = work / "table.json"
    assert load_script().main(["--smoke", "--smoke-dir", str(work), "--out", str(out)]) == 0
    return work, json.loads(out.read_text())


def test_smoke_has_every_row_kind_with_realised_factors(smoke):
    work, data = smoke
    rows = data["rows"]
    assert data["complete"] is True and data["not_run"] == [] and data["skipped"] == {}
    assert data["command"].startswith("python benchmarks/kaizen_table.py --smoke")
    assert "teacher itself" in data["control_model"]
    assert {r["method"] for r in rows} == KINDS
    assert {(r["split"], r["task"]) for r in rows} == {(s, t) for s in ("eval", "heldout") for t in ("niah", "vt")}
    registry = {r["method"]: r["registry_method"] for r in rows}
    assert registry == {"control": "dense", "kaizen": "kaizen", "untrained_backbone": "kaizen",
                        "static": "kaizen_static", "random": "kaizen_random", "dp_search": "kaizen_dp", "kivi": "kivi",
                        "posthoc_quant": "kaizen_static", "kaizen+snapkv": "kaizen+snapkv", "kaizen+kvpop": "kaizen+kvpop",
                        "smaller_model": "dense"}
    assert all(r["n"] == 2 and r["context"] == 256 and "factor" in r for r in rows)
    targets = {(r["method"], r.get("target")) for r in rows}
    assert {("static", 4.0), ("static", 8.0), ("kaizen", 4.0), ("untrained_backbone", 4.0), ("kaizen+snapkv", 16.0),
            ("kaizen+kvpop", 32.0)} <= targets
    # the selector's rows: trained folder vs the teacher's weights, same label
    sel = [r for r in rows if r["method"] in ("kaizen", "untrained_backbone")]
    assert {r["selector"] for r in sel} == {"kaizen4"}
    assert {r["model"] for r in sel if r["method"] == "untrained_backbone"} == {"teacher"}
    assert all(r["model"] != "teacher" for r in sel if r["method"] == "kaizen")

    def one(method, target, task="niah", split="eval"):
        (r,) = [r for r in rows if (r["method"], r.get("target"), r["task"], r["split"]) == (method, target, task, split)]
        return r

    dense = one("control", None)["store_bytes"]
    for f in (4.0, 8.0):  # bf16 smoke: the dense cache is the factor's reference; 4-bit/2-bit scales add 3%/6%
        assert one("static", f)["factor"] == pytest.approx(f) and one("random", f)["factor"] >= f
        assert one("static", f)["store_bytes"] == pytest.approx(dense / f, rel=0.07)
    assert one("static", 4.0)["store_bytes"] == pytest.approx(dense / 4, rel=0.05)
    assert one("posthoc_quant", 4.0)["options"] == {"axes": ["precision"]}
    for f in (16.0, 32.0):
        for m in ("kaizen+snapkv", "kaizen+kvpop"):
            r = one(m, f)
            assert r["factor"] == pytest.approx(f) and r["budget"] == 256 * 4 / f
    small = one("smaller_model", 2.0)  # half the layers: half the dense cache, by the config and by the bytes
    assert small["factor"] == 2.0 and small["store_bytes"] == pytest.approx(dense / 2, rel=0.01)
    assert small["model"].endswith("smaller") and data["smaller_model"].endswith("smaller")
    kivi = one("kivi", 4.0)
    assert 1 < kivi["factor"] < 4 and kivi["store_bytes"] == pytest.approx(dense / kivi["factor"], rel=0.05)
    assert (work / "kaizen_table.png").stat().st_size > 1000


def test_time_guard_lists_the_plan_in_priority_order(smoke, tmp_path):
    work, data = smoke
    selector = data["selectors"]["kaizen4"]["path"]
    out = tmp_path / "t.json"
    script = load_script()
    assert script.main(["--smoke", "--smoke-dir", str(tmp_path), "--selector", f"k4={work / 'kaizen-t4' / 'final'}",
                        "--minutes", "0", "--out", str(out)]) == 0
    cut = json.loads(out.read_text())
    assert cut["rows"] == [] and cut["complete"] is False and selector
    assert cut["not_run"][:6] == ["control/bounded/eval", "control/bounded/heldout", "kaizen[k4]/bounded/eval/F=4",
                                  "kaizen[k4]/bounded/heldout/F=4", "untrained_backbone[k4]/bounded/eval/F=4",
                                  "untrained_backbone[k4]/bounded/heldout/F=4"]
    assert cut["not_run"][6:10] == ["smaller_model/bounded/eval", "smaller_model/bounded/heldout",
                                    "static/bounded/eval/F=4", "static/bounded/heldout/F=4"]
    assert len(cut["not_run"]) == 2 * (1 + 2 + 1 + 5 * 2 + 2 * 2)
    assert cut["not_run"][-1] == "kaizen+kvpop/bounded/heldout/F=32"


def test_no_control_leaves_the_control_rows_out_of_the_plan(smoke, tmp_path):
    work, _ = smoke
    out = tmp_path / "t.json"
    assert load_script().main(["--smoke", "--smoke-dir", str(tmp_path), "--selector", f"k4={work / 'kaizen-t4' / 'final'}",
                               "--no-control", "--minutes", "0", "--out", str(out)]) == 0
    cut = json.loads(out.read_text())
    assert not any(r.startswith("control/") for r in cut["not_run"])
    assert cut["not_run"][:2] == ["kaizen[k4]/bounded/eval/F=4", "kaizen[k4]/bounded/heldout/F=4"]
    assert len(cut["not_run"]) == 2 * (2 + 1 + 5 * 2 + 2 * 2)  # --smoke adds its smaller model


def test_bad_selectors_are_one_line_errors(tmp_path, capsys):
    script = load_script()
    out = tmp_path / "t.json"
    assert script.main(["--smoke", "--smoke-dir", str(tmp_path), "--selector", "x", "--out", str(out)]) == 2
    assert script.main(["--smoke", "--smoke-dir", str(tmp_path), "--selector", f"x={tmp_path}", "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 2 and all(e.startswith("kaizen_table: error: --selector") for e in err)


def test_unreachable_factors_are_skipped_with_the_reason(smoke):
    """Precision alone stops at 8x and KIVI at 2 bits: their 16x runs are listed under ``skipped``, never started."""
    import argparse

    work, _ = smoke
    script = load_script()
    args = argparse.Namespace(model=str(work / "teacher"), control=None, kvpop=None, splits="eval", baselines="all",
                              factors="4,16", compose_factors="none", compose_rep=4.0, tasks="vt", n_per_task=1,
                              context=256, batch_size=1, chunk_size=64, sinks=4, method_options={}, first_factors="")
    runs, skipped = script.plan_runs(args, [])
    assert [r.describe() for r in runs] == ["control/bounded/eval", "static/bounded/eval/F=4",
                                            "dp_search/bounded/eval/F=4", "random/bounded/eval/F=4",
                                            "kivi/bounded/eval/F=4", "posthoc_quant/bounded/eval/F=4",
                                            "static/bounded/eval/F=16", "dp_search/bounded/eval/F=16",
                                            "random/bounded/eval/F=16"]
    assert set(skipped) == {"kivi/bounded/eval/F=16", "posthoc_quant/bounded/eval/F=16"}
    assert "outside the feasible range" in skipped["posthoc_quant/bounded/eval/F=16"]
    assert all("\n" not in why for why in skipped.values())
    # --first-factors: those factors' baselines run first (a baselines-only run beside the selectors' training)
    args.first_factors = "16"
    runs, _ = script.plan_runs(args, [])
    assert [r.describe() for r in runs][:4] == ["control/bounded/eval", "static/bounded/eval/F=16",
                                                "dp_search/bounded/eval/F=16", "random/bounded/eval/F=16"]


def test_a_process_killed_mid_table_leaves_a_file_listing_the_runs_not_done(smoke, tmp_path, monkeypatch,
                                                                          crashing_evaluate):
    """Every save lists the runs not done yet: a crash after the first run (a CUDA OOM, a kill) leaves a file that is
    not complete (it used to say ``complete: true, not_run: []``)."""
    work, _ = smoke
    script = load_script()
    monkeypatch.setattr(script, "evaluate", crashing_evaluate(script.evaluate, 1))
    out = tmp_path / "t.json"
    with pytest.raises(RuntimeError, match="out of memory"):
        script.main(["--smoke", "--smoke-dir", str(tmp_path), "--selector", f"k4={work / 'kaizen-t4' / 'final'}",
                     "--splits", "eval", "--baselines", "static", "--factors", "4", "--compose-factors", "none",
                     "--out", str(out)])
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["rows"]} == {"control"}
    assert data["complete"] is False and data["not_run"] == ["kaizen[k4]/bounded/eval/F=4",
                                                             "untrained_backbone[k4]/bounded/eval/F=4",
                                                             "smaller_model/bounded/eval",
                                                             "static/bounded/eval/F=4"]


def test_compose_selectors_runs_each_selector_under_eviction_with_grafted_scorers(smoke, tmp_path):
    """``--compose-selectors``: each selector's backbone and per-prompt choice at its training target (4x) under
    eviction at the total factor (16x: the eviction keeps 256 x 4 / 16 = 64 tokens); kaizen+kvpop with the scorers of
    ``--kvpop`` grafted onto the selector's backbone (load_kvpop), which the rows name; the configurations are the
    selector's own choice at 4x (its kaizen rows'), not the static one; the student is evaluated under its trained
    fields (``trained_options``: here its decay range); a factor not above the selector's target is skipped with the
    reason."""
    import torch

    from kvlearn import load
    from kvlearn.config import KVpopConfig
    from kvlearn.kvpop.apply import apply_kvpop, kvpop_modules

    work, data = smoke
    kvpop_dir = tmp_path / "kvpop"
    teacher = load(work / "teacher")
    apply_kvpop(teacher, KVpopConfig(sinks=4, window=16, topk=44, scorer="mlp", decay_min=0.99, decay_max=0.9999))
    torch.manual_seed(5)
    with torch.no_grad():
        for p in kvpop_modules(teacher)[0][0].parameters():
            p.normal_(0, 0.5)
    teacher.save_pretrained(kvpop_dir)
    out = tmp_path / "composed.json"
    selector = work / "kaizen-t4" / "final"
    assert load_script().main(["--smoke", "--smoke-dir", str(work), "--selector", f"kaizen4={selector}",
                               "--no-control", "--baselines", "none", "--compose-factors", "4,16",
                               "--compose-selectors", "--kvpop", str(kvpop_dir), "--splits", "eval",
                               "--out", str(out)]) == 0
    only = tmp_path / "only.json"  # --compose-methods and --no-untrained narrow the plan
    assert load_script().main(["--smoke", "--smoke-dir", str(work), "--selector", f"kaizen4={selector}",
                               "--no-control", "--baselines", "none", "--compose-factors", "16", "--compose-selectors",
                               "--compose-methods", "kaizen+kvpop", "--no-untrained", "--splits", "eval",
                               "--minutes", "0", "--out", str(only)]) == 0
    assert json.loads(only.read_text())["not_run"] == ["kaizen[kaizen4]/bounded/eval/F=4",
                                                       "smaller_model/bounded/eval",
                                                       "kaizen+kvpop/bounded/eval/F=16",
                                                       "kaizen+kvpop[kaizen4]/bounded/eval/F=16"]
    result = json.loads(out.read_text())
    mine = [r for r in result["rows"] if r["method"] in ("kaizen+snapkv", "kaizen+kvpop") and r.get("selector")]
    assert {(r["method"], r["target"], r["budget"]) for r in mine} == {("kaizen+snapkv", 16.0, 64),
                                                                     ("kaizen+kvpop", 16.0, 64)}
    kaizen_choice = {c for r in result["rows"] if r["method"] == "kaizen" for c in r["configurations"]}
    for r in mine:
        assert r["selector"] == "kaizen4" and r["model"] != "teacher" and r["factor"] >= 16.0 - 1e-9
        assert set(r["configurations"]) == kaizen_choice
    for r in mine:  # the grafted student's trained pattern (its decay range), the smoke's window option on top
        if r["method"] == "kaizen+kvpop":
            assert (r["options"]["decay_min"], r["options"]["decay_max"], r["options"]["window"]) == (0.99, 0.9999, 16)
    (scorers,) = {r["scorers"] for r in mine if r["method"] == "kaizen+kvpop"}
    assert scorers.endswith("/kvpop") and "pytest" in scorers
    assert not any("scorers" in r for r in mine if r["method"] == "kaizen+snapkv")
    assert "kaizen+kvpop[kaizen4]/F=4" in result["skipped"] and "no eviction left" in result["skipped"]["kaizen+kvpop[kaizen4]/F=4"]


def test_device_script_runs_the_baselines_beside_the_training_and_merges(tmp_path):
    """benchmarks/device/kaizen_table.sh as a dry run: the training-free rows run in their own process (no
    --selector) from the start, each selector's table after training runs in its own process with no baseline or
    composition or control (the first baseline part measures it), and the parts are merged into kaizen_table.json (the
    control once, every other row kept) with its plot."""
    import json
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHONPATH": str(repo / "src")}
    out = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    baselines = (tmp_path / "kaizen_table_baselines.log").read_text()
    assert "benchmarks/kaizen_table.py" in baselines and "--selector" not in baselines and "--baselines" not in baselines
    assert "--first-factors 4,8" in baselines and "--no-control" not in baselines
    for t in (4, 8):  # the control comes from the first baseline part alone
        selector = (tmp_path / f"kaizen_table_selector_t{t}.log").read_text()
        assert f"--selector kaizen{t}=" in selector and "--no-control --baselines none --compose-factors none" in selector
        train = (tmp_path / f"kaizen_train_t{t}.log").read_text()
        # no --num-workers: kaizen-train's own default decides (3 on a CUDA device; tests/train/test_distill.py)
        assert "kaizen-train" in train and "--device cuda" in train and "--num-workers" not in train
    merged = json.loads((tmp_path / "kaizen_table.json").read_text())
    assert sorted((r["method"], r["factor"]) for r in merged["rows"]) == [
        ("control", 1.0), ("kaizen", 4.0), ("kaizen", 8.0), ("static", 4.0)]
    assert (tmp_path / "kaizen_table.png").stat().st_size > 0


def test_device_script_splits_targets_and_baseline_parts(tmp_path):
    """TARGETS with a comma list (a budget-conditioned selector) and BASELINE_PARTS with two parts: one trainer and
    one table process per selector, one process per baseline part, only the first part measuring the control."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHONPATH": str(repo / "src"),
           "TARGETS": "16 1,2,4", "BASELINE_PARTS": "--factors 2 --compose-factors none;--factors 16 --baselines static"}
    out = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first = (tmp_path / "kaizen_table_baselines.log").read_text()
    second = (tmp_path / "kaizen_table_baselines1.log").read_text()
    assert "--factors 2 --compose-factors none" in first and "--no-control" not in first
    assert "--factors 16 --baselines static" in second and "--no-control" in second
    assert "--target 1,2,4" in (tmp_path / "kaizen_train_t1_2_4.log").read_text()
    assert "--selector kaizen1_2_4=" in (tmp_path / "kaizen_table_selector_t1_2_4.log").read_text()
    assert "--selector kaizen16=" in (tmp_path / "kaizen_table_selector_t16.log").read_text()


def test_device_script_trains_each_target_once_per_seed(tmp_path):
    """SEEDS: every target is trained once per seed (``--seed S``, folder and label suffixed ``_s<S>``), and each
    seed's selector gets its own table process and its own rows in the merged file; TRAIN_STEPS trains a fixed number
    of steps instead of minutes."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHONPATH": str(repo / "src"),
           "TARGETS": "8", "SEEDS": "1 2", "BASELINE_PARTS": "none", "NUM_WORKERS": "5", "TRAIN_STEPS": "4000",
           "SELECTOR_TABLE_ARGS": "--compose-selectors --compose-factors 64"}
    out = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for s in (1, 2):
        train = (tmp_path / f"kaizen_train_t8_s{s}.log").read_text()
        assert f"--out {tmp_path}/kaizen-t8_s{s} " in train and f"--seed {s}" in train and "--target 8 " in train
        assert "--num-workers 5 " in train  # NUM_WORKERS reaches every trainer
        assert "--steps 4000 " in train and "--minutes" not in train  # TRAIN_STEPS replaces the training minutes
        table = (tmp_path / f"kaizen_table_selector_t8_s{s}.log").read_text()
        assert f"--selector kaizen8_s{s}={tmp_path}/kaizen-t8_s{s}/final" in table
        assert "--compose-factors none --n-per-task" in table and table.rstrip().endswith(
            "--compose-selectors --compose-factors 64")
    assert not (tmp_path / "kaizen_train_t8.log").exists()
    merged = json.loads((tmp_path / "kaizen_table.json").read_text())
    assert sorted(r["selector"] for r in merged["rows"]) == ["kaizen8_s1", "kaizen8_s2"]
    # the selectors' logs are shown at the end, and BASELINE_PARTS=none's missing baselines log is no error
    assert all(f"kaizen_table_selector_t8_s{s}.log <==" in out.stdout for s in (1, 2))
    assert "cannot open" not in out.stderr and "baselines" not in out.stderr, out.stderr[-2000:]


def test_device_script_labels_a_run_of_record(tmp_path):
    """LABEL names the one selector's rows (a run of record needs no relabel afterwards); with more than one selector,
    or a label a shell word cannot carry, the script stops with one line before any process starts."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    base = {**os.environ, "DRY_RUN": "1", "PYTHONPATH": str(repo / "src"), "TARGETS": "8", "BASELINE_PARTS": "none"}
    label = "kaizen8_share02_ema_fw_alone4000_s3"
    env = {**base, "OUT": str(tmp_path / "ok"), "SEEDS": "3", "LABEL": label}
    out = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "ok" / "kaizen_table_selector_t8_s3.log").read_text()
    assert f"--selector {label}={tmp_path}/ok/kaizen-t8_s3/final " in table
    merged = json.loads((tmp_path / "ok" / "kaizen_table.json").read_text())
    assert [r["selector"] for r in merged["rows"]] == [label]
    for extra, message in (({"SEEDS": "3 4"}, "LABEL=x names one selector, but TARGETS='8' SEEDS='3 4' train 2"),
                           ({"TARGETS": "4 8"}, "LABEL=x names one selector, but TARGETS='4 8' SEEDS='' train 2"),
                           ({"LABEL": "a b"}, "LABEL=a b is invalid: expected letters, digits")):
        out_dir = tmp_path / "bad"
        env = {**base, "OUT": str(out_dir), "LABEL": "x", **extra}
        bad = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and message in bad.stdout, (extra, bad.stdout, bad.stderr)
        assert not out_dir.exists()  # stopped before anything ran


def test_pack_leaves_one_tar_without_the_selectors_weights(tmp_path):
    """PACK=1 (a device call returns at most 8 files of <= 16 MiB): the selectors' weights and trainer states are
    deleted and everything else is in $OUT/kaizen_table.tar, the only file left."""
    import os
    import subprocess
    import tarfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    final = tmp_path / "kaizen-t8_s1" / "final"  # what a trained selector leaves (the dry run trains none)
    final.mkdir(parents=True)
    for name, text in (("model.safetensors", "w"), ("trainer_state.pt", "s"), ("config.json", "{}")):
        (final / name).write_text(text)
    (tmp_path / "kaizen-t8_s1" / "share_sensitivity.json").write_text("{}")
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHONPATH": str(repo / "src"), "PACK": "1",
           "TARGETS": "8", "SEEDS": "1", "BASELINE_PARTS": "none"}
    out = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["kaizen_table.tar"]
    with tarfile.open(tmp_path / "kaizen_table.tar") as tar:
        names = {n.removeprefix("./") for n in tar.getnames() if tar.getmember(n).isfile()}
    assert {"kaizen_table.json", "kaizen_table.png", "kaizen_table_selector_t8_s1.json", "kaizen_train_t8_s1.log",
            "kaizen-t8_s1/final/config.json", "kaizen-t8_s1/share_sensitivity.json"} <= names, names
    assert not [n for n in names if n.endswith((".safetensors", ".pt"))], names


def test_export_writes_each_trained_selectors_bf16_tar_beside_the_pack(tmp_path):
    """EXPORT=1: every selector whose final/ has weights is exported (benchmarks/export_checkpoint.py into
    WORK_DIR/kaizen-t<tag>-export) and tarred as $OUT/kaizen_t<tag>_export.tar, which PACK=1 leaves out of its own tar;
    a selector without weights is named and skipped. The exports come before the rows, so that a call cut short during
    the rows still returns them. Dry run: the command lines, in order."""
    import os
    import subprocess
    import tarfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out, work = tmp_path / "out", tmp_path / "work"
    final = out / "kaizen-t8_s1" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_text("w")
    (out / "kaizen-t8_s2" / "final").mkdir(parents=True)  # a trainer that left no weights
    (out / "kaizen_t8_s1_export.tar").write_bytes(b"x" * 10)  # what the export writes (the dry run writes none)
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "WORK_DIR": str(work), "PYTHONPATH": str(repo / "src"),
           "EXPORT": "1", "PACK": "1", "TARGETS": "8", "SEEDS": "1 2", "BASELINE_PARTS": "none"}
    run = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    export = lines.index(f"dry run: python3 benchmarks/export_checkpoint.py --overwrite {final} {work}/kaizen-t8_s1-export")
    assert lines[export + 1] == f"dry run: tar -C {work} -cf {out}/kaizen_t8_s1_export.tar kaizen-t8_s1-export"
    assert lines[export + 2] == "export of kaizen8_s1 rc=0"
    assert "kaizen8_s2 has no final/ weights: nothing to export" in lines
    rows = next(i for i, line in enumerate(lines) if line.startswith("selectors' rows: "))
    assert export < rows and lines.index("kaizen8_s2 has no final/ weights: nothing to export") < rows
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["kaizen_t8_s1_export.tar", "kaizen_table.tar"]
    with tarfile.open(out / "kaizen_table.tar") as tar:  # PACK leaves the export out of its tar
        assert not [n for n in tar.getnames() if n.endswith("export.tar")]


def test_merge_across_runs_clears_the_runs_a_later_kaizen_table_measured(smoke, tmp_path):
    """A table cut by its guard (``--minutes 0``: every run under ``not_run``), merged across runs with a complete
    table of the same plan, leaves nothing under ``not_run``: :func:`kvlearn.results.row_run_key` names each Kaizen
    row as the script lists its run (``method[selector]/protocol/split/F=target``)."""
    from kvlearn.results import merge_results, row_run_key

    work, data = smoke
    out = tmp_path / "cut.json"
    assert load_script().main(["--smoke", "--smoke-dir", str(tmp_path), "--selector",
                               f"kaizen4={work / 'kaizen-t4' / 'final'}", "--minutes", "0", "--out", str(out)]) == 0
    cut = json.loads(out.read_text())
    assert {row_run_key(r) for r in data["rows"]} == set(cut["not_run"])
    assert row_run_key(next(r for r in data["rows"] if r["method"] == "untrained_backbone" and r["split"] == "eval")) \
        == "untrained_backbone[kaizen4]/bounded/eval/F=4"
    merged = merge_results([cut, data], "cut; full", across_runs=True)
    assert merged["not_run"] == [] and merged["complete"] is True and len(merged["rows"]) == len(data["rows"])
    half = {**data, "rows": [r for r in data["rows"] if r["method"] != "static"]}
    left = merge_results([cut, half], "cut; half", across_runs=True)["not_run"]
    assert left == [k for k in cut["not_run"] if k.startswith("static/")] and left


def test_smaller_model_factor_and_its_errors(tmp_path):
    """The factor by hand: 8 layers x 2 KV heads x 32 over 2 x 2 x 32 = 4; other vocabularies and larger caches are
    one-line errors."""
    from transformers import Qwen3Config

    from kvlearn.errors import KVLearnError

    def save(name, layers, vocab=300, kv=2):
        path = tmp_path / name
        Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=kv, head_dim=32).save_pretrained(path)
        return str(path)

    script = load_script()
    assert script.smaller_model_factor(save("t", 8), save("s", 2)) == 4.0
    assert script.smaller_model_factor(save("t2", 8), save("s2", 4, kv=1)) == 4.0
    for bad, expect in ((save("v", 2, vocab=301), "vocabulary"), (save("big", 16), "expected a smaller one")):
        with pytest.raises(KVLearnError) as e:
            script.smaller_model_factor(save("t3", 8), bad)
        assert expect in str(e.value) and "\n" not in str(e.value)


def test_replot_draws_the_recipes_of_record_present_and_fades_the_rest(tmp_path, monkeypatch, capsys):
    """``--replot TABLE`` runs nothing and redraws the plot: the :data:`RECORD_SERIES` the rows hold are highlighted
    under their labels (a record series the rows lack is left out), no other; a file that is not a results table is
    a one-line error."""
    from kvlearn.results import make_results, write_results

    script = load_script()
    base = dict(protocol="bounded", split="eval", budget=4096, compression=0.75, context=4096, n=4, task="vt")
    rows = [dict(base, method="control", accuracy=1.0, factor=1.0, compression=0.0),
            dict(base, method="kaizen", selector="kaizen4_share_auto", accuracy=1.0, factor=4.0, target=4.0),
            dict(base, method="kaizen", selector="other_run", accuracy=0.5, factor=4.0, target=4.0),
            dict(base, method="static", accuracy=0.9, factor=4.0, target=4.0)]
    table = tmp_path / "kaizen_table.json"
    write_results(table, make_results("accuracy", rows, device="cpu", command="test", commit="x"))
    seen = {}
    import kvlearn.eval.plots as plots
    real = plots.plot_pareto
    monkeypatch.setattr(plots, "plot_pareto", lambda r, path, **kw: seen.update(kw) or real(r, path, **kw))
    assert script.main(["--replot", str(table)]) == 0
    assert seen["highlight"] == {"kaizen [kaizen4_share_auto]": script.RECORD_SERIES["kaizen [kaizen4_share_auto]"]}
    assert seen["x"] == "factor" and seen["reference"] == "control"
    assert (tmp_path / "kaizen_table.png").stat().st_size > 5000
    assert seen["title"] == "KV-Kaizen comparison, context 4096"  # the rows' context
    assert script.plot_options([dict(r, selector=None) for r in rows], 4096)["highlight"] == {}  # a fresh run: none
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert script.main(["--replot", str(bad)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"kaizen_table: error: --replot {bad}: not a readable results")


def test_a_run_its_deadline_cut_between_families_stays_under_not_run(smoke, tmp_path, monkeypatch,
                                                                    deadline_between_families):
    """Session 41's selector parts: the untrained-backbone held-out run stopped after one family at the time guard,
    and the file said ``complete: true, not_run: []``. Such a run now stays under ``not_run``."""
    work, _ = smoke
    script = load_script()
    monkeypatch.setattr(script, "evaluate", deadline_between_families(script.evaluate, 1))
    out = tmp_path / "t.json"
    assert script.main(["--smoke", "--smoke-dir", str(tmp_path), "--selector", f"k4={work / 'kaizen-t4' / 'final'}",
                        "--splits", "eval", "--baselines", "static", "--factors", "4", "--compose-factors", "none",
                        "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len([r for r in data["rows"] if r["method"] == "kaizen"]) == 1
    later = [r["task"] for r in data["rows"] if r["method"] == "control"][1:]  # the families after the first
    assert data["complete"] is False and data["not_run"] == ["kaizen[k4]/bounded/eval/F=4:" + ",".join(later)]


@pytest.mark.parametrize("steps", ["0", "4k", "-5"])
def test_device_script_refuses_bad_train_steps_before_training(tmp_path, steps):
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHONPATH": str(repo / "src"), "TARGETS": "8",
           "BASELINE_PARTS": "none", "TRAIN_STEPS": steps}
    out = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert f"TRAIN_STEPS={steps} is invalid: expected a positive whole number of steps" in out.stdout
    assert not list(tmp_path.glob("kaizen_train_t*.log"))


def test_return_dir_gets_the_export_before_the_rows_and_every_tar_at_the_end(tmp_path):
    """RETURN_DIR (the device call's $OUT, OUT a work folder outside it): the export tar is copied there right after it
    is written, before the rows, and every tar of OUT (the pack's too) at the end; a folder that does not exist, or OUT
    itself, is a one-line error before anything runs."""
    import os
    import subprocess
    import tarfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out, work, ret = tmp_path / "out", tmp_path / "work", tmp_path / "ret"
    final = out / "kaizen-t8_s3" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_text("w")
    (out / "kaizen_t8_s3_export.tar").write_bytes(b"x" * 10)  # what the export writes (the dry run writes none)
    ret.mkdir()
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "WORK_DIR": str(work), "PYTHONPATH": str(repo / "src"),
           "EXPORT": "1", "PACK": "1", "TARGETS": "8", "SEEDS": "3", "BASELINE_PARTS": "none",
           "RETURN_DIR": str(ret)}
    run = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    copied = lines.index(f"copied kaizen_t8_s3_export.tar to {ret}")
    assert lines[copied - 1] == "export of kaizen8_s3 rc=0"
    assert copied < next(i for i, line in enumerate(lines) if line.startswith("selectors' rows: "))
    assert sorted(p.name for p in ret.iterdir()) == ["kaizen_t8_s3_export.tar", "kaizen_table.tar"]
    assert (ret / "kaizen_t8_s3_export.tar").read_bytes() == b"x" * 10
    with tarfile.open(ret / "kaizen_table.tar") as tar:
        assert "./kaizen_table.json" in tar.getnames()
    for bad, why in ((tmp_path / "missing", "expected an existing folder"), (out, "expected a folder other than OUT")):
        run = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env={**env, "RETURN_DIR": str(bad)},
                             cwd=repo, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and f"RETURN_DIR={bad} is invalid: {why}" in run.stdout, run.stdout[-500:]
        assert "dry run:" not in run.stdout  # nothing ran
    # OUT=X RETURN_DIR=$OUT/kz sets RETURN_DIR to X/kz (the shell expands $OUT after OUT=X): the error says so
    inside = out / "kz"
    run = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env={**env, "RETURN_DIR": str(inside)},
                         cwd=repo, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"RETURN_DIR={inside} is invalid: expected an existing folder" in run.stdout
    assert f"it lies inside OUT={out}" in run.stdout and "R=$OUT; OUT=" in run.stdout, run.stdout[-500:]
    assert "dry run:" not in run.stdout
