"""benchmarks/retrofit_step_speed.py on the CPU: ``--smoke`` (a tiny random GQA Qwen3) times every method on one
batch and writes the results file (provenance, one row per method with its parameters, steps and exact config, the
ratios and the acceptance); bad input is a one-line error, never a traceback."""

import gzip
import json

import pytest
import torch
from benchmark_loader import load_benchmark

ALL = "retrofit_kvpop_mlp,retrofit_kvpop_mlstm,retrofit_dms,retrofit_streaming_plus"


def test_smoke_writes_every_row_and_the_summary(tmp_path, capsys):
    script = load_benchmark("retrofit_step_speed")
    out = tmp_path / "speed.json"
    assert script.main(["--smoke", "--methods", ALL, "--out", str(out), "--profile", str(tmp_path / "prof"),
                        "--host-profile", str(tmp_path / "host")]) == 0
    for name in ["distill_dense", *ALL.split(",")]:  # one profiled step per method, its operators by self time
        text = (tmp_path / "prof" / f"{name}.txt").read_text()
        assert text.startswith(f"# {name}: one step under the profiler") and "aten::" in text and "Self CPU" in text
        with gzip.open(tmp_path / "prof" / f"{name}.trace.json.gz", "rt") as f:  # the step's timeline
            assert any(e.get("name", "").startswith("aten::") for e in json.load(f)["traceEvents"])
        # and three steps under cProfile: the Python functions by own and cumulative time, the step's own among them
        host = (tmp_path / "host" / f"{name}.host.txt").read_text()
        assert host.startswith(f"# {name}: 3 steps under cProfile") and "Ordered by: internal time" in host
        assert "Ordered by: cumulative time" in host and "distill.py" in host
    # a variant row's profile gets a file name the device tool returns (no "+")
    assert script.profile_file_stem("retrofit_kvpop_mlstm+bf16_mlstm_matmuls") == "retrofit_kvpop_mlstm__bf16_mlstm_matmuls"
    data = json.loads(out.read_text())
    for key in ("schema", "kind", "command", "commit", "date", "device", "torch", "rows", "summary"):
        assert key in data, key
    assert data["command"].startswith("python benchmarks/retrofit_step_speed.py --smoke")
    assert data["partial"] is False and data["smoke"] is True
    assert (data["seq_len"], data["batch_size"], data["budget"], data["window"]) == (256, 2, 64, 16)
    assert data["model_shape"]["num_attention_heads"] == 2 * data["model_shape"]["num_key_value_heads"] >= 4
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["distill_dense", *ALL.split(",")]
    for name, r in rows.items():
        assert "error" not in r and r["steps_timed"] == 2 and r["ms"] > 0 and r["parameters"] > 0, name
        assert r["ratio_to_distill_dense"] == pytest.approx(r["ms"] / rows["distill_dense"]["ms"])
    assert rows["distill_dense"]["new_parameters"] == 0 and rows["distill_dense"]["last_step"]["kd"] >= 0
    assert rows["retrofit_kvpop_mlp"]["new_parameters"] > 0 and rows["retrofit_streaming_plus"]["new_parameters"] == 0
    mlstm = rows["retrofit_kvpop_mlstm"]["kvpop"]
    assert mlstm["scorer"] == "mlstm" and mlstm["mlstm_skip"] and mlstm["delayed_readout"]  # KVpopConfig defaults
    assert mlstm["sinks"] + mlstm["window"] + mlstm["topk"] == 64 and mlstm["window"] == 16
    assert rows["retrofit_kvpop_mlp"]["kvpop"]["scorer"] == "mlp" and rows["retrofit_dms"]["dms"]["budget"] == 64
    assert "boundary" in rows["retrofit_kvpop_mlstm"]["last_step"]
    summary = data["summary"]
    ratio = summary["retrofit_kvpop_mlstm_over_distill_dense"]
    assert ratio == pytest.approx(rows["retrofit_kvpop_mlstm"]["ratio_to_distill_dense"])
    assert summary["retrofit_kvpop_mlp_over_distill_dense"] > 0
    assert summary["acceptance"] == {"retrofit_step_le_1p5x_distill_step": ratio <= 1.5}


def test_smoke_variants_are_extra_rows(tmp_path):
    """``--variants``: after the default rows, ``<method>+foreach_adamw`` of every method (AdamW not fused: on the
    CPU neither is any row), ``retrofit_kvpop_mlstm+bf16_mlstm_matmuls`` (the config's bf16 mLSTM operands) and
    ``retrofit_kvpop_mlstm+mlstm_cudagraphs`` (the config's CUDA-graph compile mode);
    every variant row's ratio to the default reference, and to the reference's own variant where it has one."""
    script = load_benchmark("retrofit_step_speed")
    out = tmp_path / "variants.json"
    assert script.main(["--smoke", "--variants", "foreach_adamw,bf16_mlstm_matmuls,foreach_adamw,mlstm_cudagraphs",
                        "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["variants"] == ["foreach_adamw", "bf16_mlstm_matmuls", "mlstm_cudagraphs"]
    rows = {r["name"]: r for r in data["rows"]}
    base = ["distill_dense", "retrofit_kvpop_mlp", "retrofit_kvpop_mlstm"]
    assert list(rows) == [*base, *(f"{m}+foreach_adamw" for m in base), "retrofit_kvpop_mlstm+bf16_mlstm_matmuls",
                          "retrofit_kvpop_mlstm+mlstm_cudagraphs"]
    graphs = rows["retrofit_kvpop_mlstm+mlstm_cudagraphs"]["kvpop"]
    assert graphs["mlstm_compile_mode"] == "reduce-overhead" and graphs["mlstm_matmul_dtype"] == "float32"
    assert rows["retrofit_kvpop_mlstm"]["kvpop"]["mlstm_compile_mode"] == "default"
    ref = rows["distill_dense"]["ms"]
    for name, r in rows.items():
        assert "error" not in r and r["steps_timed"] == 2 and r["adamw_fused"] is False, name
        assert r["ratio_to_distill_dense"] == pytest.approx(r["ms"] / ref)
        assert ("variant" in r) == ("+" in name) and name == (f"{r['base']}+{r['variant']}" if "+" in name else name)
    assert "variant" not in rows["retrofit_kvpop_mlstm"] and rows["retrofit_kvpop_mlstm"]["kvpop"]["mlstm_matmul_dtype"] == "float32"
    bf16 = rows["retrofit_kvpop_mlstm+bf16_mlstm_matmuls"]
    assert bf16["kvpop"]["mlstm_matmul_dtype"] == "bfloat16" and bf16["kvpop"]["scorer"] == "mlstm"
    assert "ratio_to_reference_variant" not in bf16 and "ratio_to_reference_variant" not in rows["distill_dense+foreach_adamw"]
    foreach = rows["retrofit_kvpop_mlstm+foreach_adamw"]
    assert foreach["ratio_to_reference_variant"] == pytest.approx(foreach["ms"] / rows["distill_dense+foreach_adamw"]["ms"])
    summary = data["summary"]
    assert set(summary["variants"]) == {n for n in rows if "+" in n}
    assert summary["variants"]["retrofit_kvpop_mlstm+foreach_adamw"]["ratio_to_reference_variant"] == pytest.approx(
        foreach["ratio_to_reference_variant"])
    assert summary["acceptance"] == {"retrofit_step_le_1p5x_distill_step":
                                     summary["retrofit_kvpop_mlstm_over_distill_dense"] <= 1.5}


@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--methods", "retrofit_kvpop,retrofit_dms"], "--methods: 'retrofit_kvpop' is unknown"),
    (["--smoke", "--variants", "fused_adamw"], "--variants: 'fused_adamw' is unknown: expected some of foreach_adamw"),
    (["--smoke", "--budget", "256"], "--seq-len=256 is invalid for --budget=256"),
    (["--smoke", "--budget", "20"], "--budget=20 is invalid: expected > sinks + window = 20"),
    (["--shape", "qwen3-4b"], "--shape='qwen3-4b' is unknown: expected qwen3-0.6b, qwen3-1.7b"),
    (["--shape", "qwen3-0.6b", "--model", "checkpoints/testbed-teacher"], "--model and --shape exclude each other"),
    (["--smoke", "--steps", "0"], "--steps=0 is invalid"),
    (["--smoke", "--seq-len", "64", "--budget", "32"], "--seq-len=64 is invalid"),
    (["--model", "no/such/folder", "--device", "cpu"], "does not exist"),
    (["--smoke", "--sync-sites"], "--sync-sites needs a CUDA device (CUDA's sync debug mode), not --device=cpu"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    script = load_benchmark("retrofit_step_speed")
    assert script.main([*argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("retrofit_step_speed: error: "), err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_no_cuda_is_one_line(capsys):
    assert load_benchmark("retrofit_step_speed").main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err


def test_smoke_dms_score_mod_variant(tmp_path):
    """``--variants dms_score_mod``: a ``retrofit_dms+dms_score_mod`` row whose DMS config names its execution
    (``flex`` on CUDA; ``dense_channel`` on the CPU, where FlexAttention has no backward) beside the default DMS row
    (``auto``: the penalty channel on CUDA)."""
    script = load_benchmark("retrofit_step_speed")
    out = tmp_path / "dms.json"
    assert script.main(["--smoke", "--methods", "retrofit_dms", "--variants", "dms_score_mod",
                        "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["distill_dense", "retrofit_dms", "retrofit_dms+dms_score_mod"]
    assert rows["retrofit_dms"]["dms"]["train_attention"] == "auto"
    assert rows["retrofit_dms+dms_score_mod"]["dms"]["train_attention"] == "dense_channel"
    assert all("error" not in r for r in rows.values())


def test_smoke_scorer_kd_variant(tmp_path):
    """``--variants scorer_kd,scorer_kd_compiled``: a row of each per KVpop method, its settings recorded; the
    default rows carry none."""
    script = load_benchmark("retrofit_step_speed")
    out = tmp_path / "kd.json"
    assert script.main(["--smoke", "--methods", "distill_dense,retrofit_kvpop_mlp", "--variants",
                        "scorer_kd,scorer_kd_compiled", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["distill_dense", "retrofit_kvpop_mlp", "retrofit_kvpop_mlp+scorer_kd",
                          "retrofit_kvpop_mlp+scorer_kd_compiled"]
    for name, compiled in (("retrofit_kvpop_mlp+scorer_kd", False), ("retrofit_kvpop_mlp+scorer_kd_compiled", True)):
        assert rows[name]["scorer_kd"] == 1.0 and rows[name]["scorer_kd_queries"] == 256
        assert rows[name]["scorer_kd_compile"] is compiled
    assert "scorer_kd" not in rows["retrofit_kvpop_mlp"]
    assert all("error" not in r for r in rows.values())



def test_sync_sites_counts_the_sync_warnings_by_where_they_were_issued():
    """``sync_sites``: the debug mode is set to warn around the call and reset after (also when it raises); only
    torch's sync warnings count, grouped by the issuing line, most frequent first (by hand: 2 at one line, 1 at
    another; an unrelated warning is not counted)."""
    import warnings

    script = load_benchmark("retrofit_step_speed")
    modes = []

    def step():
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation")  # line A, twice
        warnings.warn("called a synchronizing CUDA operation")  # line B
        warnings.warn("something else")

    info = script.sync_sites(step, set_mode=modes.append)
    assert modes == ["warn", "default"] and info["host_syncs_per_step"] == 3
    (site_a, n_a), (site_b, n_b) = info["host_sync_sites"].items()
    assert (n_a, n_b) == (2, 1) and site_a.startswith("tests/train/test_retrofit_step_speed_script.py:")
    assert int(site_b.rsplit(":", 1)[1]) == int(site_a.rsplit(":", 1)[1]) + 1

    def broken():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError):
        script.sync_sites(broken, set_mode=modes.append)
    assert modes[-2:] == ["warn", "default"]


def test_device_busy_ratio_by_hand():
    """``--profile`` on CUDA: each row's ``device_busy_ms`` (the summed self time of the device events, user
    annotations and CPU events left out) and its ratio to the distillation step's, row by row and in the summary."""
    from types import SimpleNamespace as NS

    script = load_benchmark("retrofit_step_speed")

    def event(kind, us, annotation=False):
        return NS(device_type=NS(name=kind), self_device_time_total=us, is_user_annotation=annotation)

    events = [event("CUDA", 1500.0), event("CUDA", 500.0), event("CPU", 9000.0), event("CUDA", 7000.0, True)]
    assert script.device_busy_ms(events) == 2.0
    rows = [{"name": "distill_dense", "ms": 50.0, "device_busy_ms": 40.0},
            {"name": "retrofit_kvpop_mlp", "ms": 100.0, "device_busy_ms": 50.0},
            {"name": "retrofit_kvpop_mlstm", "ms": 120.0}]  # not profiled: no device ratio
    summary = script.summarize(rows)
    assert rows[1]["device_busy_ratio"] == 1.25 and rows[0]["device_busy_ratio"] == 1.0
    assert "device_busy_ratio" not in rows[2]
    assert summary["device_busy_ratio"] == {"retrofit_kvpop_mlp": 1.25}
    assert summary["retrofit_kvpop_mlp_over_distill_dense"] == 2.0
    assert "device_busy_ratio" not in script.summarize([{"name": "distill_dense", "ms": 50.0}])


def test_summary_judges_the_graphed_step_like_for_like():
    """With ``--variants graphed_step`` the acceptance also holds the graphed mLSTM step over the graphed and over the
    eager distillation step, and the bar judged graphed to graphed."""
    script = load_benchmark("retrofit_step_speed")
    rows = [{"name": "distill_dense", "ms": 50.0}, {"name": "retrofit_kvpop_mlstm", "ms": 100.0},
            {"name": "distill_dense+graphed_step", "ms": 30.0, "variant": "graphed_step"},
            {"name": "retrofit_kvpop_mlstm+graphed_step", "ms": 48.0, "variant": "graphed_step"}]
    acceptance = script.summarize(rows)["acceptance"]
    assert acceptance == {"retrofit_step_le_1p5x_distill_step": False, "graphed_over_graphed_distill_step": 1.6,
                          "graphed_over_eager_distill_step": 0.96,
                          "graphed_retrofit_step_le_1p5x_graphed_distill_step": False}
    rows[3]["ms"] = 42.0
    assert script.summarize(rows)["acceptance"]["graphed_retrofit_step_le_1p5x_graphed_distill_step"] is True
    assert set(script.summarize(rows[:2])["acceptance"]) == {"retrofit_step_le_1p5x_distill_step"}


@pytest.mark.parametrize("shape, out, params", [("qwen3-0.6b", "results/retrofit_step_speed_0p6b_h200.json", 0.44e9),
                                                 ("qwen3-1.7b", "results/retrofit_step_speed_1p7b_h200.json", 1.41e9)])
def test_each_shape_has_its_defaults_and_results_file(shape, out, params):
    """``--shape``: seq 8192, batch 1, its own results file; the random model has that Qwen3's layers (the testbed's
    small vocabulary makes it smaller than the named model: 0.44 B and 1.41 B parameters, counted on the meta
    device)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.testbed.tokenizer import VOCAB_SIZE

    args = load_benchmark("retrofit_step_speed").parse(["--shape", shape, "--device", "cpu"])
    assert (args.out, args.seq_len, args.batch_size) == (out, 8192, 1)
    fields = load_benchmark("step_timing").SHAPES[shape]
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, tie_word_embeddings=True, **fields))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01)


def test_the_model_source_has_its_defaults_and_results_file():
    """Without ``--shape`` or ``--smoke`` (the committed teacher, the real retrofit): seq 4096, batch 8, the results
    file results/retrofit_step_speed_h200.json (this default used to raise an AttributeError)."""
    args = load_benchmark("retrofit_step_speed").parse(["--device", "cpu"])
    assert (args.out, args.seq_len, args.batch_size, args.source) == ("results/retrofit_step_speed_h200.json", 4096, 8,
                                                                      None)
    assert args.model.endswith("checkpoints/testbed-teacher")


def test_one_resident_builds_one_student_at_a_time(tmp_path, monkeypatch):
    """``--one-resident``: phases reference, mlp, reference, mlstm, reference, each with its own warm-up and
    ``--steps`` timed steps (the reference 3 x 2 steps over its phases), and never two students alive at once: every
    student is built after the previous phase's was dropped (a weak reference to each is dead by the next build)."""
    import gc
    import weakref

    script = load_benchmark("retrofit_step_speed")
    built, order = [], []
    original = script.timed_method

    def spying(name, config, teacher, *args, **kwargs):
        gc.collect()
        alive = [ref() for ref in built if ref() is not None]
        assert alive == [], f"{name}: {len(alive)} student(s) of earlier phases still alive"
        t = original(name, config, teacher, *args, **kwargs)
        student = t.fn.__closure__  # the step closure holds the student: find it among the captured cells
        models = [c.cell_contents for c in student if isinstance(c.cell_contents, torch.nn.Module)
                  and c.cell_contents is not teacher]
        built.extend(weakref.ref(m) for m in models)
        order.append(name)
        return t

    monkeypatch.setattr(script, "timed_method", spying)
    out = tmp_path / "resident.json"
    assert script.main(["--smoke", "--one-resident", "--out", str(out)]) == 0
    assert order == ["distill_dense", "retrofit_kvpop_mlp", "distill_dense", "retrofit_kvpop_mlstm", "distill_dense"]
    assert len(built) == 5  # one student found per phase
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["distill_dense", "retrofit_kvpop_mlp", "retrofit_kvpop_mlstm"]
    assert rows["distill_dense"]["steps_timed"] == 6 and rows["retrofit_kvpop_mlp"]["steps_timed"] == 2
    for r in rows.values():
        assert "error" not in r and r["ratio_to_distill_dense"] == pytest.approx(r["ms"] / rows["distill_dense"]["ms"])
    assert data["resident"].startswith("one row's student at a time") and data["partial"] is False


def test_one_resident_refuses_the_after_timing_passes(tmp_path, capsys):
    script = load_benchmark("retrofit_step_speed")
    assert script.main(["--smoke", "--one-resident", "--profile", str(tmp_path), "--out", str(tmp_path / "x.json")]) != 0
    err = capsys.readouterr().err
    assert "--one-resident cannot be combined with --profile" in err and "Traceback" not in err


def test_graphed_step_needs_cuda(capsys):
    script = load_benchmark("retrofit_step_speed")
    assert script.main(["--smoke", "--variants", "graphed_step"]) == 2
    err = capsys.readouterr().err
    assert "--variants graphed_step needs a CUDA device" in err and "Traceback" not in err


def test_step_tensors_and_read_back_are_the_train_step(tmp_path):
    """train_step = step_draws + step_tensors + read_back: the same step on two copies of one student gives the
    same logged values and the same weights (float32 on the CPU), and the draws depend on the seed and step only."""
    import copy

    from kvlearn.config import KVpopConfig
    from kvlearn.train.distill import (RetrofitConfig, build_models, make_optimizer, read_back, step_draws,
                                       step_tensors, train_step, training_kvpop)

    script = load_benchmark("retrofit_step_speed")
    folder = script.random_model_folder("tiny", tmp_path / "tiny", str(script.REPO / "checkpoints" / "testbed-teacher"),
                                        torch.device("cpu"))
    config = RetrofitConfig(model=str(folder), out=str(tmp_path / "o"), batch_size=2, seq_len=256, device="cpu",
                            kvpop=KVpopConfig(sinks=4, window=16, topk=44, scorer="mlp"), steps=4)
    torch.manual_seed(0)
    teacher, student = build_models(config, torch.device("cpu"))
    twin = copy.deepcopy(student)
    ids = torch.randint(3, 200, (2, 256))
    labels = ids.clone()
    kv = training_kvpop(config, student)
    a = train_step(config, teacher, student, make_optimizer(config, student, torch.device("cpu")), ids, labels, 1, 0.25, kv)
    opt = make_optimizer(config, twin, torch.device("cpu"))
    for i, lr in enumerate((a["lr"], a["lr_new"], a["lr_decay"])):
        opt.param_groups[i]["lr"] = lr
    draws = step_draws(config, kv, 1, torch.device("cpu"))
    assert torch.equal(draws.queries, step_draws(config, kv, 1, torch.device("cpu")).queries)
    assert not torch.equal(draws.queries, step_draws(config, kv, 2, torch.device("cpu")).queries)
    summed, means, grad_norm = step_tensors(config, teacher, twin, opt, ids, labels, kv, draws, 1, 0.25)
    b = {**read_back(summed, means, torch.device("cpu")), "grad_norm": float(grad_norm)}
    assert b == {k: a[k] for k in b}
    for p, q in zip(student.parameters(), twin.parameters()):
        assert torch.equal(p, q)



SYNC_PRIMITIVES = ("__bool__", "item", "__int__", "__float__", "tolist", "nonzero", "__index__")


@pytest.mark.parametrize("method", ["dense", "mlp", "mlstm"])
def test_step_device_part_never_reads_the_device(tmp_path, monkeypatch, method):
    """What ``--variants graphed_step`` captures (``step_tensors`` / ``dense_step_tensors``) reads nothing back on the
    CPU path: every sync primitive raises during the step (the optimizer is plain SGD: AdamW's non-capturable step
    reads its step counts, the graphed step's capturable AdamW does not). Transformers' mask construction used to
    read a device boolean in the teacher's and the student's forward (``find_packed_sequence_indices``: two host
    syncs per eager step; it skips the read under CUDA-graph capture); ``hf.unpadded_causal_masks`` hands the
    forwards the prepared mapping instead. The step's values equal those of the same step with transformers building
    the masks."""
    import copy

    from kvlearn.config import KVpopConfig
    from kvlearn.train import distill
    from kvlearn.train.distill import (RetrofitConfig, build_models, dense_student, read_back, step_draws,
                                       step_tensors, training_kvpop)

    script = load_benchmark("retrofit_step_speed")
    folder = script.random_model_folder("tiny", tmp_path / "tiny", str(script.REPO / "checkpoints" / "testbed-teacher"),
                                        torch.device("cpu"))
    config = RetrofitConfig(model=str(folder), out=str(tmp_path / "o"), batch_size=2, seq_len=256, device="cpu",
                            kvpop=KVpopConfig(sinks=4, window=16, topk=44, scorer=method if method != "dense" else "mlp"),
                            steps=4)
    torch.manual_seed(0)
    teacher, student = build_models(config, torch.device("cpu"))
    if method == "dense":
        student = dense_student(teacher)
    twin = copy.deepcopy(student)
    ids = torch.randint(3, 200, (2, 256))
    kv = training_kvpop(config, student) if method != "dense" else None
    draws = step_draws(config, kv, 0, torch.device("cpu")) if method != "dense" else None

    def step(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if method == "dense":
            return distill.dense_step_tensors(config, teacher, model, opt, ids, ids.clone())
        summed, means, _ = step_tensors(config, teacher, model, opt, ids, ids.clone(), kv, draws, 0, 0.0)
        return summed, means

    with monkeypatch.context() as m:  # the reference: transformers builds every mask (and reads the device)
        m.setattr(distill, "unpadded_causal_masks", lambda model: None)
        expected = step(twin)

    def forbidden(*args, **kwargs):
        raise AssertionError("a host read of a device value in the step's device part")

    with monkeypatch.context() as m:
        for attr in SYNC_PRIMITIVES:
            m.setattr(torch.Tensor, attr, forbidden)
        m.setattr(torch, "nonzero", forbidden)
        got = step(student)
    if method == "dense":
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    else:
        assert read_back(*got, torch.device("cpu")) == read_back(*expected, torch.device("cpu"))
    for p, q in zip(student.parameters(), twin.parameters()):
        assert torch.equal(p, q)

def test_count_operators_adds_each_rows_count(tmp_path):
    """``--count-operators``: every row gains the operators one step dispatches; a retrofit step dispatches more than
    the plain distillation step it adds work to, and its KVpop sites are named."""
    script = load_benchmark("retrofit_step_speed")
    out = tmp_path / "ops.json"
    assert script.main(["--smoke", "--count-operators", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    dense, mlp = rows["distill_dense"], rows["retrofit_kvpop_mlp"]
    assert 0 < dense["operators_per_step"] < mlp["operators_per_step"] < rows["retrofit_kvpop_mlstm"]["operators_per_step"]
    assert any(site.startswith("ops/") or site.startswith("kvpop/") for site in mlp["operator_sites"])
    assert sum(mlp["operator_sites"].values()) <= mlp["kvlearn_operators_per_step"] <= mlp["operators_per_step"]


@pytest.mark.gpu
def test_graphed_rows_on_cuda_record_the_graph_pool(tmp_path):
    """On CUDA the graphed rows run (the reference's and a retrofit's) and each records the memory its capture reserved
    (``graph_pool_gib``), which their replays' ``peak_memory_gib`` cannot see."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    script = load_benchmark("retrofit_step_speed")
    out = tmp_path / "graphed.json"
    assert script.main(["--smoke", "--device", "cuda", "--methods", "retrofit_kvpop_mlp", "--variants", "graphed_step",
                        "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("distill_dense+graphed_step", "retrofit_kvpop_mlp+graphed_step"):
        assert "error" not in rows[name] and rows[name]["ms"] > 0, rows[name]
        assert rows[name]["graph_pool_gib"] > 0
    assert "graph_pool_gib" not in rows["distill_dense"]
