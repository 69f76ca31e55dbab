"""Has a running ``kvlearn pretrain`` passed an early stage check on one family? For device chains that stop a failing
teacher trial before it spends its whole time budget (``benchmarks/device/teacher_trial_then_tables.sh``).

    python benchmarks/pretrain_early_gate.py /tmp/session_out/teacher/pretrain.log --stage 2 --family trace --threshold 0.2

Reads the stage-check lines (one JSON object per line with a ``"stage"`` key) that ``kvlearn pretrain`` prints, and
prints one line: ``pass <accuracy> ...`` when the check of curriculum stage ``--stage`` has ``--family``'s
teacher-forced accuracy on ``--split`` (default ``eval``) >= ``--threshold``, ``fail <accuracy> ...`` when below, and
nothing while that stage's check has not been printed yet (the log may still be growing). Exit status 0 in all
three cases; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlearn.testbed.tasks import FAMILIES


def stage_checks(log_text: str) -> dict[int, dict]:
    """The stage checks of a pretrain log, by stage index. Lines that are not a complete JSON object with a
    ``"stage"`` key (progress bars, a line still being written) are skipped."""
    checks = {}
    for line in log_text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"stage"' in line):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("stage"), int):
            checks[record["stage"]] = record
    return checks


def verdict(log_text: str, stage: int, family: str, threshold: float, split: str = "eval") -> str | None:
    """``"pass ..."`` / ``"fail ..."`` for stage ``stage``'s check, or None while it is not in the log."""
    record = stage_checks(log_text).get(stage)
    if record is None:
        return None
    accuracy = record.get("accuracy", {})
    accuracy = accuracy.get(split, accuracy)  # older logs have no split level
    value = accuracy.get(family)
    if value is None:
        return f"fail {family} missing from stage {stage}'s check {accuracy}"
    word = "pass" if value >= threshold else "fail"
    return f"{word} {value:.3f}: {family} ({split}) after stage {stage} (length {record.get('length')}), threshold {threshold}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="the pretrain log (stdout of kvlearn pretrain)")
    ap.add_argument("--stage", type=int, required=True, help="curriculum stage index (0 = the first)")
    ap.add_argument("--family", default="trace", help=f"one of {', '.join(FAMILIES)} (default trace)")
    ap.add_argument("--split", default="eval", help="eval or heldout (default eval)")
    ap.add_argument("--threshold", type=float, required=True, help="teacher-forced accuracy to reach, in [0, 1]")
    args = ap.parse_args(argv)
    problems = []
    if args.family not in FAMILIES:
        problems.append(f"--family={args.family!r} is invalid: expected one of {', '.join(FAMILIES)}")
    if args.split not in ("eval", "heldout"):
        problems.append(f"--split={args.split!r} is invalid: expected eval or heldout")
    if not 0.0 <= args.threshold <= 1.0:
        problems.append(f"--threshold={args.threshold} is invalid: expected a number in [0, 1]")
    if args.stage < 0:
        problems.append(f"--stage={args.stage} is invalid: expected >= 0")
    if problems:
        print(f"pretrain_early_gate: error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    path = Path(args.log)
    result = verdict(path.read_text(errors="replace"), args.stage, args.family, args.threshold, args.split) \
        if path.is_file() else None
    if result is not None:
        print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
