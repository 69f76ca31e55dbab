"""The demo's two-panel plot, the Pareto plot and `kvlearn demo` end to end on a tiny teacher and KVpop student."""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVpopConfig, apply_kvpop
from kvlearn.cli import DEFAULT_KVPOP_MODEL, main
from kvlearn.eval.plots import by_selector, mean_accuracy, plot_accuracy, plot_pareto, series_legend
from kvlearn.kvpop.apply import kvpop_modules
from kvlearn.lineage import write_teacher_record
from kvlearn.testbed.tokenizer import VOCAB_SIZE


def rows():
    out = []
    for method, budget, cr, kv, accs in (("dense", 4096, 0.0, 16e6, (1.0, 1.0)), ("streaming", 1024, 0.75, 4e6, (0.0, 0.5))):
        for protocol in ("bounded", "context"):
            for task, acc in zip(("niah", "vt"), accs):
                out.append(dict(method=method, protocol=protocol, split="eval", budget=budget, compression=cr, context=4096,
                                task=task, accuracy=acc, n=6, kv_bytes=int(kv), incomplete=protocol == "context"))
    return out


def test_accuracy_plot_handles_exact_zeros_and_ones(tmp_path):
    r = [x for x in rows() if x["protocol"] == "bounded"]
    assert plot_accuracy(r, tmp_path / "a.png").stat().st_size > 5000


def test_pareto_plot_and_its_means(tmp_path):
    agg = mean_accuracy(rows())
    assert agg[("eval", "streaming", "bounded", 1024)]["accuracy"] == 0.25
    assert agg[("eval", "streaming", "context", 1024)]["incomplete"] is True
    assert plot_pareto(rows(), tmp_path / "p.png").stat().st_size > 5000


def test_factor_pareto_draws_one_line_per_selector(tmp_path):
    """Two selectors at the same factor are two series (by hand: their own means), baselines keep their method."""
    base = dict(protocol="bounded", split="eval", budget=4096, compression=0.75, context=4096, n=4, factor=4.0, target=4.0)
    r = [dict(base, method="control", task="niah", accuracy=1.0, factor=1.0, target=None, compression=0.0)]
    for sel, accs in (("a", (1.0, 0.5)), ("b", (0.0, 0.25))):
        r += [dict(base, method="kaizen", selector=sel, task=t, accuracy=acc) for t, acc in zip(("niah", "vt"), accs)]
    r += [dict(base, method="static", task=t, accuracy=0.5) for t in ("niah", "vt")]
    agg = by_selector(mean_accuracy(r, ("target", "selector")))
    assert agg[("eval", "kaizen [a]", "bounded", 4096, 4.0, "a")]["accuracy"] == 0.75
    assert agg[("eval", "kaizen [b]", "bounded", 4096, 4.0, "b")]["accuracy"] == 0.125
    assert agg[("eval", "static", "bounded", 4096, 4.0, None)]["accuracy"] == 0.5
    assert plot_pareto(r, tmp_path / "f.png", x="factor", reference="control").stat().st_size > 5000


def test_factor_pareto_draws_a_series_label_as_its_own_line(tmp_path, monkeypatch):
    """Rows of one method and factor from two students (a ``series`` label on one of them) are two points, not
    their average: the plot draws what :func:`by_selector` of the rows with ``series`` as their selector gives."""
    import kvlearn.eval.plots as plots

    base = dict(protocol="bounded", split="eval", budget=512, compression=0.97, context=4096, n=4, factor=32.0,
                target=32.0, method="kaizen+kvpop")
    r = [dict(base, method="control", task="vt", accuracy=1.0, factor=1.0, target=None, compression=0.0, budget=4096),
         dict(base, task="vt", accuracy=0.2), dict(base, task="vt", accuracy=1.0, series="retrofit_b4")]
    seen = {}
    real = plots.by_selector
    monkeypatch.setattr(plots, "by_selector", lambda agg: seen.setdefault("agg", real(agg)))
    plot_pareto(r, tmp_path / "s.png", x="factor", reference="control")
    assert seen["agg"][("eval", "kaizen+kvpop", "bounded", 512, 32.0, None)]["accuracy"] == 0.2
    assert seen["agg"][("eval", "kaizen+kvpop [retrofit_b4]", "bounded", 512, 32.0, "retrofit_b4")]["accuracy"] == 1.0


def test_selectors_of_one_method_share_a_colour_and_one_legend_entry():
    """Every ``kaizen [..]`` series gets the kaizen colour and only the first a label counting the selectors; the
    untrained backbone's series another colour; plain methods their own colour and their name."""
    style = series_legend(["kaizen [a]", "untrained_backbone [a]", "static", "kaizen [b]", "untrained_backbone [b]",
                           "kaizen [c]", "random"])
    assert style["kaizen [a]"] == (style["kaizen [b]"][0], "kaizen (3 lines)")
    assert style["kaizen [b]"][1] is None and style["kaizen [c]"] == (style["kaizen [a]"][0], None)
    assert style["untrained_backbone [a]"][1] == "untrained_backbone (2 lines)"
    assert style["untrained_backbone [b]"] == (style["untrained_backbone [a]"][0], None)
    assert style["static"][1] == "static" and style["random"][1] == "random"
    colours = [style[s][0] for s in ("kaizen [a]", "untrained_backbone [a]", "static", "random")]
    assert len(set(colours)) == 4
    assert series_legend(["kaizen [only]"])["kaizen [only]"][1] == "kaizen"
    style = series_legend(["kaizen+kvpop", "kaizen+kvpop [retrofit_b4]"])  # a plain series and a labelled one
    assert style["kaizen+kvpop"][1] == "kaizen+kvpop (2 lines)" and style["kaizen+kvpop [retrofit_b4]"][1] is None



def test_factor_pareto_highlights_named_series_and_fades_the_other_runs(tmp_path, monkeypatch):
    """``highlight``: the named series drawn bold under their labels (two series sharing a label: one legend entry,
    one marker), every other ``[...]`` series faded under one entry, plain methods as before; the legend lists the
    full cache, the highlighted series, the rest, then the faded runs; a name the rows lack is a one-line error."""
    import kvlearn.eval.plots as plots
    from kvlearn.errors import KVLearnError

    base = dict(protocol="bounded", split="eval", budget=4096, compression=0.75, context=4096, n=4, task="vt")
    r = [dict(base, method="control", accuracy=1.0, factor=1.0, compression=0.0)]
    r += [dict(base, method="kaizen", selector=s, accuracy=a, factor=f, target=f)
          for s, a, f in (("s0", 0.9, 8.0), ("s1", 0.8, 8.0), ("old", 0.3, 8.0), ("k4", 1.0, 4.0))]
    r += [dict(base, method="static", accuracy=0.5, factor=4.0, target=4.0)]
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    highlight = {"kaizen [s0]": "8x, 2 seeds", "kaizen [s1]": "8x, 2 seeds", "kaizen [k4]": "4x"}
    plot_pareto(r, tmp_path / "h.png", x="factor", reference="control", highlight=highlight)
    fig = figures[-1]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["control (full cache)", "kaizen: 8x, 2 seeds [bounded]", "kaizen: 4x [bounded]",
                      "static [bounded]", plots.FADED_LABEL]
    lines = {(round(ln.get_xdata()[0]), round(ln.get_ydata()[0], 2)): ln for ln in fig.axes[0].get_lines()
             if len(ln.get_xdata()) == 1}
    assert lines[(8, 0.3)].get_alpha() < 0.5 and lines[(8, 0.9)].get_alpha() > 0.9  # "old" faded, "s0" bold
    assert lines[(8, 0.9)].get_marker() == lines[(8, 0.8)].get_marker() != lines[(4, 1.0)].get_marker()
    assert lines[(8, 0.9)].get_color() == lines[(4, 1.0)].get_color()  # one colour per method
    plot_pareto(r, tmp_path / "p.png", x="factor", reference="control")  # no highlight: one entry per method
    assert [t.get_text() for t in figures[-1].legends[0].get_texts()] == [
        "control (full cache)", "kaizen (4 lines) [bounded]", "static [bounded]"]
    with pytest.raises(KVLearnError, match=r"highlight names series the rows lack: \['kaizen \[gone\]'\]"):
        plot_pareto(r, tmp_path / "e.png", x="factor", reference="control", highlight={"kaizen [gone]": "x"})

def tiny_model(seed=0):
    """A tiny random GQA model of the testbed's vocabulary."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=512, pad_token_id=0))


def tiny_teacher(path):
    tiny_model().save_pretrained(path)


def tiny_student(path):
    """A tiny KVpop student (MLP scorers, random weights; sinks 4 + window 16: budgets from 21), saved at ``path``."""
    model = tiny_model(seed=1)
    apply_kvpop(model, KVpopConfig(sinks=4, window=16, topk=44, scorer="mlp"))
    torch.manual_seed(2)
    scorers, _ = kvpop_modules(model)
    for p in scorers[0].parameters():  # non-zero scores: a ranking that is not recency alone
        torch.nn.init.normal_(p)
    model.save_pretrained(path)


def demo(tmp_path, *extra):
    out, plot = tmp_path / "d" / "demo.json", tmp_path / "d" / "demo.png"
    code = main(["demo", "--model", str(tmp_path / "tiny"), "--context", "256", "--budget", "64", "--n-per-task", "1",
                 "--device", "cpu", "--out", str(out), "--plot", str(plot), *extra])
    return code, out, plot


def test_demo_end_to_end_on_a_tiny_teacher_and_kvpop_student(tmp_path, capsys):
    tiny_teacher(tmp_path / "tiny")
    tiny_student(tmp_path / "student")
    code, out, plot = demo(tmp_path, "--tasks", "niah,vt", "--kvpop-model", str(tmp_path / "student"))
    assert code == 0
    data = json.loads(out.read_text())
    assert [(r["method"], r["task"]) for r in data["rows"]] == [
        ("dense", "niah"), ("dense", "vt"), ("streaming", "niah"), ("streaming", "vt"), ("kvpop", "niah"), ("kvpop", "vt"),
        ("kaizen+kvpop", "niah"), ("kaizen+kvpop", "vt")]
    models = {r["method"]: r["model"] for r in data["rows"]}
    assert models["dense"] == models["streaming"] == data["model"] and models["kvpop"] == data["kvpop_model"]
    # the student once more in 4-bit packed stores at the same budget: 16 / 4 x 256 / 64 = 16x in all, its K/V in
    # about a quarter of the KVpop cache's bytes (the 4-bit codes plus one scale per stored vector)
    composed = {r["task"]: r for r in data["rows"] if r["method"] == "kaizen+kvpop"}
    plain = {r["task"]: r for r in data["rows"] if r["method"] == "kvpop"}
    for task, r in composed.items():
        assert r["model"] == data["kvpop_model"] and r["budget"] == 64 and r["target"] == 16
        assert r["configurations"] == {"b4": 1}
        assert 0.2 < r["store_bytes"] / plain[task]["store_bytes"] < 0.35
    assert data["kvpop_model"].endswith("student") and data["model"].endswith("tiny")
    kvpop = [r for r in data["rows"] if r["method"] == "kvpop"]
    # the student's trained options (its window) are read from its config; the budget is --budget
    assert all(r["budget"] == 64 and r["options"]["window"] == 16 and r["options"]["scorer"] == "mlp" for r in kvpop)
    assert data["wall_seconds"] > 0 and data["split"] == "eval" and data["protocol"] == "bounded"
    assert plot.stat().st_size > 5000
    printed = capsys.readouterr().out
    assert "wall time" in printed and "kvpop      student" in printed and "dense      tiny" in printed


def test_demo_says_when_the_student_descends_from_another_teacher(tmp_path, capsys):
    tiny_teacher(tmp_path / "tiny")
    tiny_student(tmp_path / "student")
    tiny_model(seed=3).save_pretrained(tmp_path / "other")
    write_teacher_record(tmp_path / "student", tmp_path / "other")
    code, out, _ = demo(tmp_path, "--tasks", "niah", "--kvpop-model", str(tmp_path / "student"))
    assert code == 0 and json.loads(out.read_text())["kvpop_teacher_matches"] is False
    err = capsys.readouterr().err
    assert "warning: the student" in err and "was distilled from another teacher" in err
    write_teacher_record(tmp_path / "student", tmp_path / "tiny")
    code, out, _ = demo(tmp_path, "--tasks", "niah", "--kvpop-model", str(tmp_path / "student"))
    assert code == 0 and json.loads(out.read_text())["kvpop_teacher_matches"] is True
    assert "another teacher" not in capsys.readouterr().err


def test_demo_without_the_kvpop_student(tmp_path, capsys):
    tiny_teacher(tmp_path / "tiny")
    code, out, _ = demo(tmp_path, "--tasks", "niah", "--kvpop-model", "none")
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["rows"]] == ["dense", "streaming"] and data["kvpop_model"] is None


def test_demo_bad_kvpop_student_or_budget_is_a_one_line_error_before_evaluating(tmp_path, capsys):
    tiny_teacher(tmp_path / "tiny")
    tiny_student(tmp_path / "student")
    cases = [
        (["--kvpop-model", str(tmp_path / "nope")], f"--kvpop-model '{tmp_path / 'nope'}' does not exist"),
        (["--kvpop-model", str(tmp_path / "tiny")], f"--kvpop-model '{tmp_path / 'tiny'}' has no 'kvpop' block"),
        # below the student's sinks 4 + window 16 + 1 (streaming alone would take budget 20)
        (["--kvpop-model", str(tmp_path / "student"), "--budget", "20"], "budget=20 is invalid: expected an integer >= 21"),
    ]
    capsys.readouterr()  # the progress bars of saving the tiny models
    for extra, needle in cases:
        code, out, plot = demo(tmp_path, "--tasks", "niah", *extra)
        err = capsys.readouterr().err.strip()
        assert code == 2 and needle in err, (extra, err)
        assert len(err.splitlines()) == 1 and err.startswith("kvlearn: error:")
        assert not out.exists() and not plot.exists()


@pytest.mark.skipif(not (DEFAULT_KVPOP_MODEL / "config.json").exists(), reason="no shipped KVpop student in this checkout")
def test_demo_budget_below_the_shipped_students_minimum_is_a_one_line_error(tmp_path, capsys):
    """The shipped student keeps 4 sinks + a window of 256: --budget 260 is refused before anything loads."""
    code = main(["demo", "--budget", "260", "--device", "cpu", "--out", str(tmp_path / "d.json"),
                 "--plot", str(tmp_path / "d.png")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "budget=260 is invalid: expected an integer >= 261 (KVpop needs sinks=4 + window=256" in err
    assert not (tmp_path / "d.json").exists()


def test_eval_command_writes_protocol_and_split_rows(tmp_path, capsys):
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                                 pad_token_id=0)).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "e.json"
    code = main(["eval", "--model", str(tmp_path / "tiny"), "--method", "streaming", "--budget", "48", "--protocol",
                 "context", "--context", "256", "--n-per-task", "2", "--batch-size", "2", "--tasks", "recall",
                 "--device", "cpu", "--out", str(out), "--plot", str(tmp_path / "e.png")])
    assert code == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert (row["method"], row["protocol"], row["split"], row["budget"], row["n"]) == ("streaming", "context", "eval", 48, 2)
    assert data["protocol"] == "context" and (tmp_path / "e.png").exists()
