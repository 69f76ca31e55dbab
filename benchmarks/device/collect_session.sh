#!/usr/bin/env bash
# The collecting call of a detached device chain (teacher_then_retrofit.sh, method_tables.sh): wait until DONE
# (default /tmp/session.done) or WAIT_S seconds (default 420: keep the call inside the session's device time left),
# print the chain's log LOG (default /tmp/session.log), then bring RUN_DIR (default /tmp/session_out) back in at most
# 8 files, the device tool's limit: every small file (logs, JSON, PNG, TXT) in one tar, the teacher and student
# checkpoints (every *.tar in RUN_DIR or one folder down, seven at most) as their own files. Runs still going are left running (a later call may
# collect again); their partial results files say what they did not reach.
# Usage on the device:  WAIT_S=400 bash benchmarks/device/collect_session.sh   (then extract session_small.tar here)
set -u
RUN_DIR=${RUN_DIR:-/tmp/session_out}; OUT=${OUT:-out}; mkdir -p "$OUT"
DONE=${DONE:-/tmp/session.done}; LOG=${LOG:-/tmp/session.log}
for _ in $(seq $(( ${WAIT_S:-420} / 5 ))); do [ -e "$DONE" ] && break; sleep 5; done
[ -e "$DONE" ] && echo "chain finished" || echo "chain still running after ${WAIT_S:-420} s: collecting what is there"
cat "$LOG" 2>/dev/null | tr '\r' '\n' | grep -v "it/s\|ex/s\|step/s" | tail -n 60
(cd "$RUN_DIR" && find . -type f \( -name '*.json' -o -name '*.log' -o -name '*.png' -o -name '*.txt' \) -size -16M -print0 \
    | tar --null -cf "$OUT/session_small.tar" -T -)
find "$RUN_DIR" -maxdepth 2 -type f -name '*.tar' | head -n 7 | while read -r t; do cp "$t" "$OUT/"; done
ls -la "$OUT"
