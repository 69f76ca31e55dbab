#!/usr/bin/env bash
# The collecting call of a detached device chain (teacher_then_retrofit.sh, method_tables.sh): wait until /tmp/session.done or WAIT_S
# seconds (default 420: keep the call inside the session's device time left), then bring RUN_DIR (default
# /tmp/session_out) back in at most 8 files, the device tool's limit: every small file (logs, JSON, PNG, TXT) in one
# tar, the teacher and student checkpoints as their own tars. Runs still going are left running (a later call may
# collect again); their partial results files say what they did not reach.
# Usage on the device:  WAIT_S=400 bash benchmarks/device/collect_session.sh   (then extract session_small.tar here)
set -u
RUN_DIR=${RUN_DIR:-/tmp/session_out}; OUT=${OUT:-out}; mkdir -p "$OUT"
for _ in $(seq $(( ${WAIT_S:-420} / 5 ))); do [ -e /tmp/session.done ] && break; sleep 5; done
[ -e /tmp/session.done ] && echo "chain finished" || echo "chain still running after ${WAIT_S:-420} s: collecting what is there"
cat /tmp/session.log 2>/dev/null | tr '\r' '\n' | grep -v "it/s\|ex/s\|step/s" | tail -n 60
(cd "$RUN_DIR" && find . -type f \( -name '*.json' -o -name '*.log' -o -name '*.png' -o -name '*.txt' \) -size -16M -print0 \
    | tar --null -cf "$OUT/session_small.tar" -T -)
for t in "$RUN_DIR"/teacher/teacher.tar "$RUN_DIR"/retrofit/kvpop_*.tar; do [ -f "$t" ] && cp "$t" "$OUT/"; done
ls -la "$OUT"
