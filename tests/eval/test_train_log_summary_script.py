"""benchmarks/train_log_summary.py: tenth means of a trainer's log against values written out by hand, plain and gzip
logs alike, and one-line errors for a missing metric or file."""

import gzip
import json

from benchmark_loader import load_benchmark


def test_tenth_means_match_a_hand_computed_log(tmp_path, capsys):
    script = load_benchmark("train_log_summary")
    rows = [{"step": i + 1, "kd": float(i), "beta": 1.0} for i in range(20)]  # two rows per tenth
    plain = tmp_path / "a.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    packed = tmp_path / "b.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write(plain.read_text())
    out = tmp_path / "s.json"
    assert script.main([str(plain), str(packed), "--metrics", "kd,beta", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for path in (plain, packed):
        s = data[str(path)]
        assert s["steps"] == 20
        assert s["metrics"]["kd"]["tenths"] == [0.5 + 2 * i for i in range(10)]  # (2i + 2i + 1) / 2
        assert s["metrics"]["kd"]["last_tenth"] == 18.5 and s["metrics"]["beta"]["last_tenth"] == 1.0
    assert "last tenth: kd 18.5, beta 1" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path, capsys):
    script = load_benchmark("train_log_summary")
    log = tmp_path / "a.jsonl"
    log.write_text(json.dumps({"step": 1, "kd": 0.1}) + "\n")
    assert script.main([str(log), "--metrics", "penalty"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'penalty' is not in the log" in err
    assert script.main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
