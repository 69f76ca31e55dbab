"""Which teacher should a device chain measure methods on: a freshly pretrained one, or the shipped one?

    python benchmarks/teacher_stage_gate.py /tmp/testbed-teacher --fallback checkpoints/testbed-teacher

Prints one line, the folder to use: ``CANDIDATE`` when its ``pretrain_log.json``'s last stage check reached
``--threshold`` (teacher-forced, both splits) on niah, vt and recall (``kvlearn.train.pretrain.stage_check_passed``),
else ``--fallback``; the reason goes to stderr. A failed teacher then costs only its own training: the retrofit and
the baselines that follow it in ``benchmarks/device/teacher_then_retrofit.sh`` still measure something usable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlearn.train.pretrain import STAGE_GATE_FAMILIES, stage_check_passed


def choose(candidate: str, fallback: str, threshold: float) -> tuple[str, str]:
    """``(folder, reason)``: ``candidate`` if its last stage check passed, else ``fallback``."""
    log_path = Path(candidate) / "pretrain_log.json"
    if not log_path.is_file():
        return fallback, f"{log_path} is missing: using {fallback}"
    log = json.loads(log_path.read_text())
    last = (log.get("stages") or [{}])[-1].get("accuracy")
    if stage_check_passed(log, threshold):
        return candidate, f"{candidate} passed the stage check (>= {threshold} on {', '.join(STAGE_GATE_FAMILIES)}): {last}"
    return fallback, f"{candidate} failed the stage check (>= {threshold} on {', '.join(STAGE_GATE_FAMILIES)}): {last}; using {fallback}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidate", help="the freshly pretrained checkpoint folder")
    ap.add_argument("--fallback", required=True, help="the folder to use when the candidate fails")
    ap.add_argument("--threshold", type=float, default=0.8, help="teacher-forced accuracy to reach (default 0.8)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.threshold <= 1.0:
        print(f"teacher_stage_gate: error: --threshold={args.threshold} is invalid: expected a number in [0, 1]",
              file=sys.stderr)
        return 2
    folder, reason = choose(args.candidate, args.fallback, args.threshold)
    print(reason, file=sys.stderr)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
