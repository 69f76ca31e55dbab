"""Results files (schema ``kvlearn.results.v1``): every number in the docs comes from one of these."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMA = "kvlearn.results.v1"


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """The checked-out commit, with ``+dirty`` when tracked files differ from it; ``"unknown"`` outside git.

    ``KVLEARN_COMMIT`` in the environment wins: the device machine receives a copy of the working tree whose
    ``.git`` need not match it, so device scripts pass the commit they were sent from."""
    if os.environ.get("KVLEARN_COMMIT"):
        return os.environ["KVLEARN_COMMIT"]
    cwd = cwd or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str | None = None) -> str:
    """A human-readable device description, e.g. ``"NVIDIA H200"`` or ``"cpu (x86_64, 2 threads)"``."""
    import torch

    if (device is None or str(device).startswith("cuda")) and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def repo_root() -> Path:
    """The repository root (the folder holding ``pyproject.toml`` above ``src/kvlearn``); the working directory
    when kvlearn runs from an installed copy."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else Path.cwd().resolve()


def portable_path(arg: str) -> str:
    """``arg`` without this machine's absolute paths: a path inside the repository relative to its root, one under
    ``$OUT`` (the device scripts' output folder) or the temporary folder as ``$OUT/...`` / ``$TMPDIR/...``;
    anything else, ``--name=PATH`` and ``LABEL=PATH`` (``--selector kaizen8=PATH``) included, with only its path part
    rewritten. Relative paths are left as typed."""
    if "=" in arg and not os.path.isabs(arg):  # --name=PATH, or a LABEL=PATH value (--selector kaizen8=PATH)
        name, value = arg.split("=", 1)
        return f"{name}={portable_path(value)}"
    if not os.path.isabs(arg):
        return arg
    path = Path(os.path.normpath(arg))
    for base, label in ((repo_root(), None), (os.environ.get("OUT"), "$OUT"), (tempfile.gettempdir(), "$TMPDIR")):
        if not base or not os.path.isabs(base):
            continue
        base = Path(os.path.normpath(base))
        if path == base or base in path.parents:
            rel = path.relative_to(base).as_posix()
            if label is None:
                return rel if rel != "." else "."
            return label if rel == "." else f"{label}/{rel}"
    return arg


def command_line(args: list[str] | None = None) -> str:
    """The command that is running, as typed (``kvlearn ...`` or ``python script.py ...``), with every absolute
    path made portable by :func:`portable_path` (``python benchmarks/kvpop_ops.py --out $OUT/ops.json``); ``args``
    in place of its arguments (``sys.argv[1:]``) where given."""
    prog = os.path.basename(sys.argv[0])
    package = Path(__file__).resolve().parent  # src/kvlearn
    script = Path(sys.argv[0]).resolve() if sys.argv[0] else None
    if prog in ("kvlearn", "__main__.py", "cli.py"):
        prog = "kvlearn"
    elif script is not None and script.suffix == ".py" and package in script.parents:  # python -m kvlearn.x.y
        prog = "python -m " + ".".join(("kvlearn",) + script.relative_to(package).with_suffix("").parts)
    else:
        prog = "python " + shell_word(portable_path(sys.argv[0]))
    return " ".join([prog] + [shell_word(portable_path(a)) for a in (sys.argv[1:] if args is None else args)])


def shell_word(arg: str) -> str:
    """``arg`` quoted for a POSIX shell, leaving a ``$OUT`` / ``$TMPDIR`` written by :func:`portable_path` unquoted
    (so the command still expands it)."""
    for label in ("$OUT", "$TMPDIR"):
        head, sep, tail = arg.partition(label)
        if sep and (not tail or tail.startswith("/")):
            return (shlex.quote(head) if head else "") + label + (shlex.quote(tail) if tail else "")
    return shlex.quote(arg)


def make_results(kind: str, rows: list[dict], device: str | None = None, command: str | None = None, **fields) -> dict:
    """Assemble a results dict with the provenance fields every file carries."""
    return {
        "schema": SCHEMA,
        "kind": kind,
        "command": command or command_line(),
        "commit": fields.pop("commit", None) or git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_name(device),
        **fields,
        "rows": rows,
    }


def write_results(path: str | os.PathLike, results: dict) -> Path:
    """Write ``results`` as indented JSON (creating parent folders); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def read_results(path: str | os.PathLike) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r} is not {SCHEMA!r}")
    return data


FULL_CACHE_LABELS = ("dense", "teacher")  # how table rows name the full cache (no budget in their run key)


def run_key(method: str, protocol: str, split: str, budget: int | None) -> str:
    """``method/protocol/split[/B=budget]``: the name under which a table script lists a run (every task of one
    method, protocol, split and budget) in ``not_run``; ``budget`` None for the full cache."""
    return f"{method}/{protocol}/{split}" + ("" if budget is None else f"/B={budget}")


def row_run_key(row: dict) -> str:
    """:func:`run_key` of the run a results row belongs to; for a KV-Kaizen table row (it carries the realised
    ``factor``) the name ``benchmarks/kaizen_table.py`` lists it under, ``method[selector]/protocol/split/F=target``
    (no ``F=`` for the full cache or a row without a target)."""
    if "factor" in row:
        who = str(row.get("method")) + (f"[{row['selector']}]" if row.get("selector") else "")
        target = row.get("target")
        factor = "" if row.get("registry_method") == "dense" or target is None else f"/F={float(target):g}"
        return f"{who}/{row.get('protocol')}/{row.get('split')}{factor}"
    full = row.get("method") in FULL_CACHE_LABELS
    return run_key(row.get("method"), row.get("protocol"), row.get("split"), None if full else row.get("budget"))


def settle_run(not_run: list[str], run: str, tasks_not_started: list[str]) -> list[str]:
    """``not_run`` after a table script ran ``run`` (one of its entries): without it when every family was measured;
    else with the entry ``run:task,task`` naming the families its deadline left unstarted (the file is then not
    complete, and :func:`split_not_run` reads the entry back)."""
    rest = list(not_run)
    i = rest.index(run)
    if tasks_not_started:
        rest[i] = f"{run}:{','.join(tasks_not_started)}"
    else:
        del rest[i]
    return rest


def split_not_run(entry: str) -> tuple[str, tuple[str, ...]]:
    """A ``not_run`` entry as ``(run key, families)``: ``families`` empty for a run not started at all, else the
    families of a run its deadline cut between families (:func:`settle_run`'s ``run:task,task``)."""
    run, _, tasks = entry.partition(":")
    return run, tuple(t for t in tasks.split(",") if t)


def merge_key(row: dict) -> tuple:
    """What makes a results row one measurement when parts are merged: ``(method, protocol, split, budget, task)``,
    and for rows that carry them (KV-Kaizen's) the ``selector``, the ``model`` weights, the realised ``factor`` (to 4
    decimals) and the ``series`` label: two selectors, one baseline at two factors, or two runs of one chain whose
    students were written to the same temporary path (series ``fromsel_1300`` and ``fromsel_2600``) share the first
    five and are different rows."""
    factor = row.get("factor")
    return (row.get("method"), row.get("protocol"), row.get("split"), row.get("budget"), row.get("task"),
            row.get("selector"), row.get("model"), None if factor is None else round(float(factor), 4),
            row.get("series"))


def merge_results(parts: list[dict], command: str, across_runs: bool = False, replace: tuple[str, ...] = (),
                  settings: dict | None = None, device_per_row: bool = False) -> dict:
    """One results file from the files of runs split over processes or GPUs (same kind, commit and device).

    Rows are concatenated in order; a row whose :func:`merge_key` already appeared (the full cache, which every part
    measures first) is dropped, unless the kept one is an ``error`` row and this one
    is not (a part that reran a failed row wins), or the kept one is ``incomplete`` (a time guard stopped it inside
    its family) and this one is whole. ``not_run``, ``skipped`` and ``students`` are united, ``complete``
    holds when every part is complete, ``wall_seconds`` is the longest part's.

    ``across_runs``: the parts may come from different runs (commits, dates): every row gets its run's ``commit``,
    ``date`` and ``n_per_task`` (where the part has them), ``runs`` lists each part's ``commit``, ``date`` and
    ``command`` (a part that is itself such a merge contributes its own ``runs``), and the file's ``commit`` names every commit once (comma-separated, in order; a merged part's list is split); a ``not_run`` entry that
    another part measured is dropped (one cut between families, ``run:task,task``, once those families are measured
    whole) (:func:`row_run_key`), and so is a ``skipped`` one, and ``complete`` holds when
    no ``not_run`` entry, no ``error`` row and no ``incomplete`` row is left. Same kind and device still.

    ``replace``: methods whose rows an earlier part replaces whatever ``model`` the rows name: for them the
    ``model`` is left out of the key, so a student retrained elsewhere (``dms`` trained in another scope) takes the
    places of the old student's rows in a table of record, and the old rows of a measurement the new parts lack
    stay; such a row without a ``model`` gets its part's (a ``kvlearn eval`` file names its model at the top). ``settings``: top-level fields to set on the merged file (e.g. ``{"dms_scope": "head"}``), after the first
    part's.

    ``device_per_row`` (with ``across_runs``): a part measured on another device than the first part's may join (a
    table of record on the H200 and a run on an H100); each of its rows that names no ``device`` gets its part's, so
    every row says where it was measured, and the file's ``device`` stays the first part's."""
    from .errors import check

    check(len(parts) > 0, "merge_results: no results to merge")
    check(across_runs or not device_per_row, "merge_results: device_per_row (--device-per-row) merges parts of "
                                             "different runs: pass across_runs (--across-runs) too")
    for field in ("schema", "kind") + (() if device_per_row else ("device",)) + (() if across_runs else ("commit",)):
        values = {p.get(field) for p in parts}
        check(len(values) == 1, f"merge_results: the parts differ in {field} ({sorted(map(str, values))}): merge "
                                "only parts of one run" + ("" if across_runs else " (or pass across_runs)")
                                + (" (or pass device_per_row, --device-per-row: each row then names its device)"
                                   if field == "device" and across_runs else ""))
    merged = {k: v for k, v in parts[0].items() if k != "rows"}
    merged["command"] = command
    if across_runs:
        merged["commit"] = ",".join(dict.fromkeys(c.strip() for p in parts for c in str(p.get("commit")).split(",")))
        merged["runs"] = [run for p in parts  # a part merged before keeps the runs it lists
                          for run in (p.get("runs") or [{k: p.get(k) for k in ("commit", "date", "command")}])]
    seen, rows = {}, []  # key -> index in rows
    for p in parts:
        for r in p["rows"]:
            if across_runs:
                r = {**r, **{k: p[k] for k in ("commit", "date", "n_per_task") if k in p and k not in r}}
            if device_per_row and p.get("device") != parts[0].get("device") and "device" not in r:
                r = {**r, "device": p.get("device")}
            if r.get("method") in replace and "model" not in r and "model" in p:
                r = {**r, "model": p["model"]}  # a `kvlearn eval` part names its student once, at the top
            key = merge_key({**r, "model": None} if r.get("method") in replace else r)
            if key not in seen:
                seen[key] = len(rows)
                rows.append(r)
            elif "error" in rows[seen[key]] and "error" not in r:  # a measured row beats a failed one
                rows[seen[key]] = r
            elif rows[seen[key]].get("incomplete") and not r.get("incomplete") and "error" not in r:
                rows[seen[key]] = r  # and a whole family beats one a time guard stopped inside
    if any("not_run" in p for p in parts):
        merged["not_run"] = [x for p in parts for x in p.get("not_run", [])]
        if across_runs:  # a later run may have measured what an earlier one did not reach
            measured = {row_run_key(r) for r in rows if "error" not in r}
            families = {(row_run_key(r), r.get("task")) for r in rows if "error" not in r and not r.get("incomplete")}

            def reached(entry: str) -> bool:  # a run cut between families: every family it lacked is now there
                run, tasks = split_not_run(entry)
                return all((run, t) in families for t in tasks) if tasks else run in measured

            merged["not_run"] = list(dict.fromkeys(x for x in merged["not_run"] if not reached(x)))
    if any("students" in p for p in parts):  # each part of a table chain evaluates its own student(s)
        merged["students"] = {k: v for p in parts for k, v in (p.get("students") or {}).items()}
    if any("skipped" in p for p in parts):
        merged["skipped"] = {k: v for p in parts for k, v in p.get("skipped", {}).items()}
        if across_runs:  # a run that could not take a budget (e.g. a student's window) and another run that did
            measured = {row_run_key(r) for r in rows if "error" not in r}
            merged["skipped"] = {k: v for k, v in merged["skipped"].items() if k not in measured}
    if any("complete" in p for p in parts):
        merged["complete"] = all(p.get("complete", False) for p in parts)
        if across_runs:
            merged["complete"] = not merged.get("not_run") and not any("error" in r or r.get("incomplete")
                                                                        for r in rows)
    if any("wall_seconds" in p for p in parts):
        merged["wall_seconds"] = max(p.get("wall_seconds", 0) for p in parts)
    merged.update(settings or {})
    merged["rows"] = rows
    return merged


SET_RESERVED = ("schema", "kind", "device", "commit", "runs", "rows")  # fields only the merge writes


def relabel_results(results: dict, selectors: dict[str, str] | None = None,
                    paths: dict[str, str] | None = None) -> dict:
    """A copy of ``results`` with selector labels and path prefixes renamed, e.g. a device run's
    ``kaizen8_s2`` (the label ``benchmarks/device/kaizen_table.sh`` gives seed 2) made the table's
    ``kaizen8_share02_ema_fw_alone4000_s2``, and the device's ``/root/out/kz`` written ``$OUT``.

    ``selectors`` (OLD -> NEW): each row's ``selector``, the keys of ``selectors`` and ``LABEL=`` in ``command``
    (``--selector OLD=PATH``). ``paths`` (OLD -> NEW): every occurrence in every string of the file. The file records
    what was renamed under ``relabelled`` (added to an earlier record). A label or path the file does not hold, an
    empty new name, or a new label the file already uses are one-line errors."""
    import re

    from .errors import check

    selectors, paths = dict(selectors or {}), dict(paths or {})
    check(bool(selectors or paths), "relabel: nothing to rename: give --selector OLD=NEW or --path OLD=NEW")
    present = {r.get("selector") for r in results.get("rows", [])} | set(results.get("selectors") or {})
    present.discard(None)
    for old, new in selectors.items():
        check(old in present, f"relabel: selector {old!r} is not in the file (its selectors: "
                              f"{', '.join(sorted(present)) or 'none'})")
        check(new.split() == [new] and "=" not in new,
              f"relabel: new selector label {new!r} is invalid: expected a non-empty name without spaces or '='")
        check(new == old or new not in present, f"relabel: new selector label {new!r} is already in the file")
    text = json.dumps(results)
    for old, new in paths.items():
        check(bool(old), "relabel: --path with an empty OLD is invalid: expected OLD=NEW with OLD a path prefix")
        check(old in text, f"relabel: path {old!r} occurs nowhere in the file")

    def rename(value):
        if isinstance(value, str):
            for old, new in paths.items():
                value = value.replace(old, new)
            return value
        if isinstance(value, list):
            return [rename(v) for v in value]
        if isinstance(value, dict):
            return {rename(k) if isinstance(k, str) else k: rename(v) for k, v in value.items()}
        return value

    out = rename(results)
    for row in out.get("rows", []):
        if row.get("selector") in selectors:
            row["selector"] = selectors[row["selector"]]
    if "selectors" in out:
        out["selectors"] = {selectors.get(k, k): v for k, v in out["selectors"].items()}
    for old, new in selectors.items():  # --selector OLD=PATH in the recorded command
        out["command"] = re.sub(rf"(?<=[\s=]){re.escape(old)}(?==)", new, out.get("command", ""))
    record = out.setdefault("relabelled", {})
    for field, renames in (("selectors", selectors), ("paths", paths)):
        if renames:
            record[field] = {**record.get(field, {}), **renames}
    return out


def parse_pairs(items: list[str], option: str, form: str) -> dict[str, str]:
    """``["a=b", "c=d"]`` (the values of a repeatable ``option``) -> ``{"a": "b", "c": "d"}``, keys stripped; an item
    without ``=`` or with an empty key is a one-line error naming it and the expected ``form``."""
    from .errors import check

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        check(bool(sep) and bool(key.strip()), f"{option} {item!r} is invalid: expected {form}")
        out[key.strip()] = value
    return out


def parse_settings(items: list[str]) -> dict:
    """``["dms_scope=head", "n=3"]`` -> ``{"dms_scope": "head", "n": 3}`` (a value that reads as JSON is that
    JSON, else the string); an item without ``=`` or with an empty key is a one-line error naming it."""
    from .errors import check

    out = {}
    for key, value in parse_pairs(items, "--set", "KEY=VALUE, e.g. dms_scope=head").items():
        check(key not in SET_RESERVED, f"--set {key}={value} is invalid: {key!r} is the merge's own "
                                       f"(reserved: {', '.join(SET_RESERVED)})")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


TEXT_OPTIONS = {"--origin": "<in parentheses after this merge>", "--add-note": "<the end of the note>"}


def _elide_texts(args: list[str]) -> list[str]:
    """``args`` with the values of :data:`TEXT_OPTIONS` replaced by where the file keeps them, so that the recorded
    command does not repeat a paragraph the file already holds (``--origin 'session 54 ...'`` ->
    ``--origin '<in parentheses after this merge>'``)."""
    out, elide_next = [], None
    for a in args:
        if elide_next:
            out.append(elide_next)
            elide_next = None
            continue
        name, sep, _ = a.partition("=")
        if name in TEXT_OPTIONS:
            if sep:
                out.append(f"{name}={TEXT_OPTIONS[name]}")
            else:
                out.append(a)
                elide_next = TEXT_OPTIONS[name]
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kvlearn.results merge OUT IN [IN ...]``: :func:`merge_results` of the IN files into OUT;
    ``python -m kvlearn.results relabel FILE --selector OLD=NEW --path OLD=NEW``: :func:`relabel_results`."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m kvlearn.results")
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge results files of one run split over processes or GPUs")
    m.add_argument("out")
    m.add_argument("inputs", nargs="+")
    m.add_argument("--across-runs", action="store_true",
                   help="the inputs come from different runs (commits): each row keeps its run's commit and date")
    m.add_argument("--replace", action="append", default=[], metavar="METHOD",
                   help="an earlier input's rows of METHOD replace a later input's whatever model they name (a "
                        "retrained student's rows in place of the old one's); repeatable")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                   help="a top-level field of the merged file (e.g. dms_scope=head); repeatable")
    m.add_argument("--device-per-row", action="store_true",
                   help="with --across-runs: an input measured on another device than the first input's may join; "
                        "each of its rows names its device (the file's device stays the first input's)")
    m.add_argument("--origin", default=None, metavar="TEXT",
                   help="with --across-runs: where the new inputs came from (the device command, a relabelling), "
                        "written in parentheses after this merge in the file's command")
    m.add_argument("--add-note", default=None, metavar="TEXT",
                   help="appended to the merged file's note (the first input's), after a space")
    r = sub.add_parser("relabel", help="rename selector labels and path prefixes in a results file (a device run's "
                                       "labels and output folder made the table's)")
    r.add_argument("file")
    r.add_argument("--selector", action="append", default=[], metavar="OLD=NEW",
                   help="rename a selector label (rows, selectors, the command's --selector OLD=); repeatable")
    r.add_argument("--path", action="append", default=[], metavar="OLD=NEW",
                   help="replace OLD by NEW in every string of the file, e.g. /root/out/kz='$OUT'; repeatable")
    r.add_argument("--out", default=None, help="write the relabelled file here (default: FILE, in place)")
    args = ap.parse_args(argv)
    from .errors import KVLearnError, check

    try:
        if args.command == "relabel":
            renames = [parse_pairs(items, option, "OLD=NEW") for option, items in (("--selector", args.selector),
                                                                                   ("--path", args.path))]
            print(write_results(args.out or args.file, relabel_results(read_results(args.file), *renames)))
            return 0
        for option in ("origin", "add_note"):
            value = getattr(args, option)
            check(value is None or bool(value.strip()), f"--{option.replace('_', '-')} is empty: give the text "
                                                        "to record, or leave the option out")
        check(args.origin is None or args.across_runs, "--origin records where the inputs of a merge across runs "
                                                       "came from: pass --across-runs too")
        settings = parse_settings(args.settings)
        parts = [read_results(p) for p in args.inputs]
        # one run's parts: its command is theirs; across runs each part's command is in ``runs``, and the file's is
        # this merge as typed (argv given: as the caller passed it), with --origin after it; a table of record
        # updated in place (OUT is the first input) keeps its history: its command, then this merge
        typed = _elide_texts(sys.argv[1:] if argv is None else argv)
        command = (" && ".join(p["command"] for p in parts) if not args.across_runs
                   else command_line(typed) if argv is None
                   else " ".join(["python -m kvlearn.results"] + [shell_word(portable_path(a)) for a in typed]))
        if args.across_runs:
            command += f" ({args.origin})" if args.origin else ""
            if Path(args.out).resolve() == Path(args.inputs[0]).resolve() and parts[0].get("command"):
                command = f"{parts[0]['command']} && {command}"
        merged = merge_results(parts, command, across_runs=args.across_runs, replace=tuple(args.replace),
                               settings=settings, device_per_row=args.device_per_row)
        if args.add_note:
            merged["note"] = f"{merged['note']} {args.add_note}" if merged.get("note") else args.add_note
        print(write_results(args.out, merged))
    except (KVLearnError, ValueError, OSError) as e:
        print(f"python -m kvlearn.results: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
