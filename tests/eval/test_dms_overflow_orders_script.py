"""benchmarks/dms_overflow_orders.py: one DMS student under each overflow order, checked on hand-made result files."""

import json

import pytest

from benchmark_loader import load_benchmark

TASKS = ("trace", "niah", "vt", "recall")


def row(method, split, budget, task, accuracy, order=None):
    options = {"window": 128, **({"overflow_evicts": order} if order else {})}
    return {"method": method, "protocol": "bounded", "split": split, "budget": budget, "task": task,
            "accuracy": accuracy, "n": 100, "options": options}


def write(path, rows, device="GPU X", model="student"):
    path.write_text(json.dumps({"schema": "kvlearn.results.v1", "kind": "accuracy", "device": device, "model": model,
                                "rows": rows}))
    return str(path)


@pytest.fixture
def files(tmp_path):
    accs = {("eval", None): (0.9, 0.9, 1.0, 0.2), ("eval", "oldest"): (0.9, 0.9, 0.5, 0.4),
            ("heldout", "highest_logit"): (0.8, 1.0, 1.0, 0.0), ("heldout", "newest"): (0.8, 1.0, 0.2, 0.2)}
    runs = [write(tmp_path / f"{s}_{o}.json", [row("dms", s, 256, t, a, o) for t, a in zip(TASKS, v)])
            for (s, o), v in accs.items()]
    table = [row("teacher", s, 4096, t, 1.0) for s in ("eval", "heldout") for t in TASKS]
    table += [row("kvpop", s, 256, t, 0.75) for s in ("eval", "heldout") for t in TASKS]
    table += [row("kvpop", "eval", 512, t, 0.1) for t in TASKS]  # another budget's rows are not read
    return tmp_path, runs, write(tmp_path / "table.json", table, model=None)


def test_rows_against_hand_computed_means(files):
    tmp, runs, table = files
    out = tmp / "cmp.json"
    assert load_benchmark("dms_overflow_orders").main(["--runs", *runs, "--table", table, "--out", str(out),
                                                       "--plot", str(tmp / "cmp.png")]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "comparison" and data["device"] == "GPU X" and data["model"] == "student"
    rows = {(r["split"], r.get("order") or r["reference"]): r for r in data["rows"]}
    assert list(rows) == [("eval", "highest_logit"), ("eval", "oldest"), ("eval", "teacher"), ("eval", "kvpop"),
                          ("heldout", "highest_logit"), ("heldout", "newest"), ("heldout", "teacher"),
                          ("heldout", "kvpop")]
    assert rows[("eval", "highest_logit")]["mean"] == 0.75 and "change" not in rows[("eval", "highest_logit")]
    assert rows[("eval", "oldest")]["mean"] == 0.675 and rows[("eval", "oldest")]["change"] == -0.075
    assert rows[("heldout", "newest")]["mean"] == 0.55 and rows[("heldout", "newest")]["change"] == -0.15
    # binomial se of the change: sqrt(sum p(1-p)/n over both runs' families) / 4
    want = (sum(p * (1 - p) / 100 for p in (0.8, 1.0, 1.0, 0.0, 0.8, 1.0, 0.2, 0.2)) ** 0.5) / 4
    assert rows[("heldout", "newest")]["change_se"] == round(want, 4)
    assert rows[("eval", "kvpop")]["mean"] == 0.75 and rows[("eval", "teacher")]["mean"] == 1.0
    assert (tmp / "cmp.png").stat().st_size > 1000


@pytest.mark.parametrize("bad, message", [
    (dict(budget=512), "budget 512 differs"), (dict(device="GPU Y"), "device 'GPU Y' differs"),
    (dict(model="other"), "model 'other' differs"), (dict(same=True), "given twice")])
def test_mixed_runs_are_refused(files, capsys, bad, message):
    tmp, runs, _ = files
    split, order = ("eval", None) if bad.get("same") else ("eval", "newest")
    extra = write(tmp / "extra.json", [row("dms", split, bad.get("budget", 256), t, 0.5, order) for t in TASKS],
                  device=bad.get("device", "GPU X"), model=bad.get("model", "student"))
    assert load_benchmark("dms_overflow_orders").main(["--runs", *runs, extra, "--out", str(tmp / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dms_overflow_orders: error:") and message in err and "\n" not in err.strip()
