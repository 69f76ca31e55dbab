"""Where the GPU idles in one profiled step: the gaps between kernels in a Chrome trace, each named by the host
operator that launched the kernel ending it.

    python benchmarks/step_timeline_gaps.py PROFILE/retrofit_kvpop_mlp.trace.json.gz [--min-gap-us 5] [--top 15]

Reads a trace written by ``torch.profiler`` (``benchmarks/retrofit_step_speed.py --profile DIR`` writes one per
method as ``DIR/<method>.trace.json.gz``). The GPU's busy time is the union of its kernel, copy and memset intervals;
the idle time is the rest of the span from the first kernel's start to the last one's end. Each gap of at least
``--min-gap-us`` ends with a kernel whose launch (the runtime or driver call with the same ``correlation`` id) is
found on the host's timeline:

* launched after the gap began (``host_late``): the GPU had finished everything queued and waited for the host to
  issue this kernel. The gap is charged to the innermost host operator (``cpu_op``) running at the launch, on the
  launching thread: where the host was too slow;
* launched before the gap began (``queued``): the kernel was waiting in the queue for something other than the host
  (a stream wait, a copy, a dependency), charged to ``(queued)``.

Prints and (``--out``) writes ``{"span_us", "busy_us", "idle_us", "gaps", "host_late_us", "queued_us",
"by_operator": [[name, idle_us, gaps], ...]}``, the largest first.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvlearn.errors import KVLearnError, check  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
QUEUED = "(queued)"
UNKNOWN = "(no host operator)"


def _innermost_op(ops: list[tuple[float, float, str]], starts: list[float], t: float) -> str:
    """The name of the latest-starting operator of ``ops`` (``(ts, end, name)`` sorted by ``ts``; ``starts`` their
    ``ts``) whose interval holds ``t``: the innermost of the nested ones."""
    i = bisect.bisect_right(starts, t)
    for ts, end, name in reversed(ops[max(0, i - 5000):i]):  # the nearest starts first
        if ts <= t <= end:
            return name
    return UNKNOWN


def gpu_idle_gaps(events: list[dict], min_gap_us: float = 5.0, top: int = 15) -> dict:
    """The GPU's busy and idle time in ``events`` (a Chrome trace's ``traceEvents``) and its gaps of at least
    ``min_gap_us`` charged to the host operator that launched the kernel after each (see the module docstring)."""
    check(min_gap_us >= 0, f"--min-gap-us {min_gap_us} is invalid: expected a number >= 0")
    check(top >= 1, f"--top {top} is invalid: expected an integer >= 1")
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
                    key=lambda e: e["ts"])
    if not device:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": 0, "host_late_us": 0.0, "queued_us": 0.0,
                "by_operator": []}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    ops_by_thread: dict = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ops_by_thread[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"]))
    for ops in ops_by_thread.values():
        ops.sort()
    starts = {tid: [o[0] for o in ops] for tid, ops in ops_by_thread.items()}

    first = float(device[0]["ts"])
    busy, end = 0.0, first
    cur_start = first
    charged: dict = defaultdict(lambda: [0.0, 0])
    host_late = queued = 0.0
    gaps = 0
    for e in device:
        ts, stop = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if ts > end:  # a gap [end, ts)
            busy += end - cur_start
            gap = ts - end
            if gap >= min_gap_us:
                gaps += 1
                launch = launches.get(e.get("args", {}).get("correlation"))
                if launch is not None and float(launch["ts"]) > end:
                    tid = launch.get("tid")
                    name = _innermost_op(ops_by_thread.get(tid, []), starts.get(tid, []), float(launch["ts"]))
                    host_late += gap
                else:
                    name = QUEUED
                    queued += gap
                charged[name][0] += gap
                charged[name][1] += 1
            cur_start = ts
        end = max(end, stop)
    busy += end - cur_start
    span = end - first
    by_operator = sorted(([n, round(v[0], 3), v[1]] for n, v in charged.items()), key=lambda r: -r[1])[:top]
    return {"span_us": round(span, 3), "busy_us": round(busy, 3), "idle_us": round(span - busy, 3), "gaps": gaps,
            "host_late_us": round(host_late, 3), "queued_us": round(queued, 3), "by_operator": by_operator}


def read_trace(path: str) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace file (``.json`` or ``.json.gz``); one-line errors for a bad file."""
    p = Path(path)
    check(p.is_file(), f"trace {path!r} does not exist: expected a Chrome trace (.json or .json.gz)")
    try:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise KVLearnError(f"trace {path!r} could not be read as JSON ({type(err).__name__}): expected a Chrome "
                           "trace (.json or .json.gz)") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    check(isinstance(events, list), f"trace {path!r} has no traceEvents list: expected a torch.profiler Chrome trace")
    return events


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a Chrome trace, .json or .json.gz (retrofit_step_speed.py --profile DIR)")
    ap.add_argument("--min-gap-us", type=float, default=5.0, help="smallest gap counted, microseconds (default 5)")
    ap.add_argument("--top", type=int, default=15, help="operators listed (default 15)")
    ap.add_argument("--out", default=None, help="also write the summary as JSON here")
    args = ap.parse_args(argv)
    try:
        summary = gpu_idle_gaps(read_trace(args.trace), args.min_gap_us, args.top)
    except KVLearnError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"span {summary['span_us'] / 1e3:.2f} ms: busy {summary['busy_us'] / 1e3:.2f} ms, idle "
          f"{summary['idle_us'] / 1e3:.2f} ms in {summary['gaps']} gaps of >= {args.min_gap_us} us (host late "
          f"{summary['host_late_us'] / 1e3:.2f} ms, queued {summary['queued_us'] / 1e3:.2f} ms)")
    for name, us, n in summary["by_operator"]:
        print(f"  {us / 1e3:8.2f} ms  {n:5d} gaps  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps({"trace": args.trace, "min_gap_us": args.min_gap_us, **summary},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
