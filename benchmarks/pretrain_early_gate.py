"""Has a running ``kvlearn pretrain`` passed an early stage check on one family? For device chains that stop a failing
teacher trial before it spends its whole time budget (``benchmarks/device/teacher_trial_then_tables.sh``).

    python benchmarks/pretrain_early_gate.py /tmp/testbed-teacher --stage 2 --family trace --threshold 0.2

Reads the checkpoint folder's ``pretrain_log.json``, which ``kvlearn pretrain`` rewrites after every stage check
(its ``stages`` list), and prints one line: ``pass <accuracy> ...`` when the check of curriculum stage ``--stage``
has ``--family``'s teacher-forced accuracy on ``--split`` (default ``eval``) >= ``--threshold``, ``fail <accuracy>
...`` when below, and nothing while that stage's check is not in the log yet (no file, or one being rewritten).
Exit status 0 in all three cases; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlearn.testbed.tasks import FAMILIES


def verdict(log: dict, stage: int, family: str, threshold: float, split: str = "eval") -> str | None:
    """``"pass ..."`` / ``"fail ..."`` for stage ``stage``'s check in a ``pretrain_log.json`` dict, or None while the
    check is not there."""
    record = next((s for s in log.get("stages") or [] if s.get("stage") == stage), None)
    if record is None:
        return None
    accuracy = record.get("accuracy", {})
    accuracy = accuracy.get(split, accuracy)  # older logs have no split level
    value = accuracy.get(family)
    if value is None:
        return f"fail {family} missing from stage {stage}'s check {accuracy}"
    word = "pass" if value >= threshold else "fail"
    return f"{word} {value:.3f}: {family} ({split}) after stage {stage} (length {record.get('length')}), threshold {threshold}"


def read_log(folder: str) -> dict:
    """The folder's ``pretrain_log.json``, or ``{}`` while it is absent or half written."""
    try:
        return json.loads((Path(folder) / "pretrain_log.json").read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="the pretrain's output folder (kvlearn pretrain --out)")
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
    result = verdict(read_log(args.checkpoint), args.stage, args.family, args.threshold, args.split)
    if result is not None:
        print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
