"""Summarise trainers' ``train_log.jsonl`` files (``kvlearn kaizen-train``, ``kvlearn retrofit``; plain or ``.gz``):
per file the steps, and for each logged metric the mean over each tenth of the steps and over the last tenth, so that
runs can be compared by how far they trained, not by one noisy step.

    python benchmarks/train_log_summary.py results/raw/kaizen_train_log_t8_*.jsonl.gz --metrics kd,factor

prints one line per file (the last tenth's means) and, with ``--out``, writes the summary as JSON
(``{file: {"steps", "metrics": {name: {"last_tenth", "tenths": [10 means]}}}}``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvlearn.errors import KVLearnError, check  # noqa: E402


def read_log(path: str | Path) -> list[dict]:
    """The rows of one ``train_log.jsonl`` (or ``.jsonl.gz``); one-line error for a file that is not one."""
    path = Path(path)
    check(path.is_file(), f"{path}: no such file (expected a trainer's train_log.jsonl)")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as err:
        raise KVLearnError(f"{path}: not a JSON-lines train log ({err})") from None
    check(len(rows) > 0, f"{path}: the log is empty")
    return rows


def summarise(rows: list[dict], metrics: list[str]) -> dict:
    """``{"steps", "metrics": {name: {"last_tenth", "tenths"}}}``: each tenth of the rows in order (the last tenths take
    the remainder), the mean of each metric over it; a metric no row logs is a one-line error."""
    n = len(rows)
    bounds = [round(i * n / 10) for i in range(11)]
    out = {"steps": n, "metrics": {}}
    for name in metrics:
        check(any(name in r for r in rows), f"metric {name!r} is not in the log: it has {', '.join(sorted(rows[0]))}")
        tenths = []
        for a, b in zip(bounds, bounds[1:]):
            values = [float(r[name]) for r in rows[a:max(b, a + 1)] if name in r]
            tenths.append(sum(values) / len(values) if values else None)
        out["metrics"][name] = {"last_tenth": tenths[-1], "tenths": tenths}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="train_log.jsonl files (plain or .gz)")
    ap.add_argument("--metrics", default="kd", help="comma list of logged metrics (default kd)")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)
    try:
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        check(len(metrics) > 0, f"--metrics {args.metrics!r}: expected a comma list of metric names")
        result = {str(p): summarise(read_log(p), metrics) for p in args.logs}
    except KVLearnError as err:
        print(f"train_log_summary: error: {err}", file=sys.stderr)
        return 2
    for path, s in result.items():
        last = ", ".join(f"{m} {v['last_tenth']:.4g}" for m, v in s["metrics"].items())
        print(f"{Path(path).name}: {s['steps']} steps; last tenth: {last}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
