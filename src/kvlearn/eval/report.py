"""Build ``docs/RESULTS.md`` from the committed results files, so every number in it comes from one of them.

    python -m kvlearn.eval.report            # rewrites docs/RESULTS.md from results/*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..results import SCHEMA

ROOT = Path(__file__).resolve().parents[3]

INTRO = """# Results

Built by `python -m kvlearn.eval.report` from the files in `results/` (schema `kvlearn.results.v1`); do not edit
by hand. Each section names its file, the command that produced it, the commit, the date and the device.
"""


def _provenance(name: str, data: dict) -> str:
    lines = [
        f"File `results/{name}` | device: {data['device']} | date: {data['date']} | commit: "
        f"`{', '.join(c[:12] for c in str(data['commit']).split(','))}`",
        "",
        f"Command: `{data['command']}`",
    ]
    if data.get("note"):
        lines += ["", f"Note: {data['note']}"]
    if data.get("not_run"):
        lines += ["", f"Not run (planned, no row): {', '.join(data['not_run'])}."]
    return "\n".join(lines)


REFERENCE_LABELS = ("control", "teacher", "dense")  # the file's own full-cache model, in order of preference


def reference_rows(rows: list[dict]) -> dict:
    """The full-cache row each row is compared with, per ``(task, split)``: the row labelled ``control``, else
    ``teacher``, else ``dense``, else the first row whose cache method is ``dense``. A full-cache *baseline* of
    another model (``smaller_model``: cache method ``dense`` too) is never the reference while the file has its
    own."""
    def rank(r: dict) -> int:
        return REFERENCE_LABELS.index(r["method"]) if r["method"] in REFERENCE_LABELS else len(REFERENCE_LABELS)

    best: dict = {}
    for r in rows:
        if r.get("registry_method", r["method"]) != "dense":
            continue
        k = (r["task"], r.get("split", "eval"))
        if k not in best or rank(r) < rank(best[k]):
            best[k] = r
    return best


def accuracy_section(name: str, data: dict) -> str:
    """The rows of an accuracy file, each next to the full-cache row of its task and split (``reference_rows``: the
    file's own full-cache model, e.g. ``control`` or ``teacher``): accuracy relative to it and bytes relative to it. A
    ``series`` column names each row's trained ``selector`` or its ``series`` label where any row has one."""
    rows = data["rows"]
    out = [f"## Accuracy: {name.removesuffix('.json')} (context {data.get('context')})", "", _provenance(name, data), ""]
    has_store = any("store_bytes" in r for r in rows)  # keys/values alone, without slot positions and scores
    has_series = any(r.get("selector") or r.get("series") for r in rows)  # which selector or student a row is
    extra = " K/V only / dense |" if has_store else ""
    out.append("| method |" + (" series |" if has_series else "") + " protocol | split | budget | CR | task | accuracy | "
               f"accuracy / dense | n | kv_bytes (mean per example) | kv_bytes / dense |{extra}")
    out.append("| --- |" + (" --- |" if has_series else "") + " --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
               + (" ---: |" if has_store else ""))
    key = lambda r: (r["task"], r.get("split", "eval"))  # noqa: E731
    dense = reference_rows(rows)
    for r in rows:
        d = dense.get(key(r))
        ratio = f"{r['kv_bytes'] / d['kv_bytes']:.3f}" if d else ""
        relative = f"{r['accuracy'] / d['accuracy']:.2f}" if d and d["accuracy"] > 0 else ""
        store = ""
        if has_store:
            store = f" {r['store_bytes'] / d['store_bytes']:.3f} |" if d and "store_bytes" in r and "store_bytes" in d else " |"
        mark = " (incomplete)" if r.get("incomplete") else ""
        out.append(
            f"| {r['method']} |" + (f" {r.get('selector') or r.get('series') or ''} |" if has_series else "")
            + f" {r.get('protocol', 'bounded')} | {r.get('split', 'eval')} | {r['budget']} | "
            f"{r['compression']:.0%} | {r['task']} | {r['accuracy']:.3f} | {relative} | {r['n']}{mark} | "
            f"{r['kv_bytes']:,} | {ratio} |"
            + store
        )
    variants = [(r["method"], r.get("split", "eval"), r["task"], k, v) for r in rows
                for k, v in r.get("variants", {}).items() if len(r.get("variants", {})) > 1]
    if variants:
        out += ["", "Per variant:", "", "| method | split | task | variant | accuracy | n |",
                "| --- | --- | --- | --- | ---: | ---: |"]
        out += [f"| {m} | {sp} | {t} | {k} | {v['accuracy']:.3f} | {v['n']} |" for m, sp, t, k, v in variants]
    return "\n".join(out)


def ops_section(name: str, data: dict) -> str:
    out = [f"## GPU ops: {name.removesuffix('.json')}", "", _provenance(name, data), ""]
    out.append("| name | median ms | / dense SDPA (same pass, same run) | block sparsity | notes |")
    out.append("| --- | ---: | ---: | ---: | --- |")
    for r in data["rows"]:
        sp = f"{r['block_sparsity']:.3f}" if "block_sparsity" in r else ""
        ratio = f"{r['over_dense']:.2f}" if isinstance(r.get("over_dense"), (int, float)) else ""
        parts = [str(r[k]) for k in ("layout", "priorities", "includes") if r.get(k)]
        if r.get("backend"):
            parts.append(f"backend: {r['backend']}")
        if isinstance(r.get("launch"), dict):
            parts.append("launch: " + ", ".join(f"{k}={v}" for k, v in r["launch"].items()))
        note = "; ".join(parts)
        out.append(f"| {r['name']} | {r['ms']:.3f} | {ratio} | {sp} | {note} |")
    for key in ("checks", "summary"):
        if data.get(key):
            out += ["", f"{key.capitalize()}:", "", "```", json.dumps(data[key], indent=1), "```"]
    return "\n".join(out)


def testbed_section(name: str, data: dict) -> str:
    out = [f"## Testbed: oracle token counts at {data.get('context')}", "", _provenance(name, data), ""]
    out.append("| family | variant | needed mean / max | informative mean / max | answer mean / max | "
               "window cache loses (share of needed items) | window cache keeps all |")
    out.append("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in data["rows"]:
        out.append(f"| {r['family']} | {r['variant']} | {r['needed_mean']:.0f} / {r['needed_max']} | "
                   f"{r['informative_mean']:.0f} / {r['informative_max']} | {r['answer_mean']:.0f} / {r['answer_max']} | "
                   f"{r['window_lost']:.2f} | {r['window_keeps_all']:.2f} |")
    t = data.get("throughput")
    if t:
        out += ["", f"Generation throughput (one process): {t['tokens_per_s']:,} tokens/s at length {t['length']}."]
    return "\n".join(out)


def kaizen_memory_section(name: str, data: dict) -> str:
    """``benchmarks/kaizen_memory.py``: a row per context and configuration, MiB and ratios to the bf16 row of the
    same context and run, then the summary."""
    model = data.get("model") or {}
    shape = ", ".join(f"{k} {model[k]}" for k in ("layers", "heads", "kv_heads", "head_dim", "hidden",
                                                    "intermediate", "vocab") if k in model)
    out = [f"## KV-Kaizen memory and decode speed: {name.removesuffix('.json')}", "", _provenance(name, data), ""]
    if shape:
        out += [f"Model: {model.get('family', '?')}, {shape}" + (f" ({model['cut']})" if model.get("cut") else "")
                + ".", ""]
    out.append("| config | context | cache MiB | cache / cost model | peak MiB | decode ms/token | cache / bf16 | "
               "peak / bf16 | decode / bf16 |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    mib = lambda v: "" if v is None else f"{v / 2**20:,.1f}"  # noqa: E731
    num = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in data["rows"]:
        if "error" in r:
            out.append(f"| {r['config']} | {r['context']} | error: {r['error']} | | | | | | |")
            continue
        ratio = r.get("ratio_to_bf16") or {}
        out.append(f"| {r['config']} | {r['context']} | {mib(r['cache_bytes'])} | {r['cache_over_cost_model']:.4f} | "
                   f"{mib(r.get('peak_bytes'))} | {r['decode_ms_per_token']:.2f} | "
                   f"{num(ratio.get('cache_bytes'), '.4g')} | {num(ratio.get('peak_bytes'), '.3f')} | "
                   f"{num(ratio.get('decode_ms_per_token'), '.2f')} |")
    if data.get("summary"):
        out += ["", "Summary:", "", "```", json.dumps(data["summary"], indent=1), "```"]
    return "\n".join(out)


def acceptance_section(name: str, data: dict) -> str:
    """An acceptance file (``python -m kvlearn.eval.acceptance``): one line per verdict with the number its bar
    applies to, then the summary of who meets each criterion."""
    out = [f"## Acceptance: {name.removesuffix('.json')}", "", _provenance(name, data), "",
           "| criterion | method | label | target / budget | split | value | of what | bar | met |",
           "| --- | --- | --- | ---: | --- | ---: | --- | ---: | --- |"]
    for r in data["rows"]:
        v = f"{r['value']:.3f}" if isinstance(r.get("value"), (int, float)) else ""
        if isinstance(r.get("of_control"), (int, float)):
            v += f" ({r['of_control']:.3f} of the control)"
        rivals = r.get("baseline_means") or r.get("rival_means")
        if rivals:
            best = max(rivals, key=rivals.get)
            v += f" (best other: {best} {rivals[best]:.3f})"
        bar = f"{r['bar']:g}" if isinstance(r.get("bar"), (int, float)) else ""
        met = {True: "yes", False: "no", None: ""}[r.get("met")] + (" (incomplete)" if r.get("incomplete") else "")
        where = f"{r['target']:g}x" if isinstance(r.get("target"), (int, float)) else str(r.get("budget", ""))
        where += f" ({r['protocol']})" if r.get("protocol") not in (None, "bounded") else ""
        out.append(f"| {r['criterion']} | {r['method']} | {r.get('label', '')} | {where} | {r['split']} | {v} | "
                   f"{r.get('value_name', '')} | {bar} | {met} |")
    if data.get("summary"):
        out += ["", "Summary:", "", "```", json.dumps(data["summary"], indent=1), "```"]
    return "\n".join(out)


def graphed_compare_section(name: str, data: dict) -> str:
    """``benchmarks/graphed_retrofit_compare.py``: one row per run (eager, graphed) with its median step time, its
    loss terms over the last tenth of the steps and its accuracy per family, then the comparison's summary."""
    rows = data["rows"]
    tasks = list(dict.fromkeys(t for r in rows for t in r.get("accuracy", {}) if t != "mean"))
    terms = list(dict.fromkeys(t for r in rows for t in r.get("metrics", {})))
    out = [f"## A graphed retrofit against an eager one: {name.removesuffix('.json')}", "", _provenance(name, data), "",
           "| run | steps | median step ms | " + " | ".join(f"{t} (last tenth)" for t in terms) + " | "
           + " | ".join(tasks) + " | mean |",
           "| --- | ---: | ---: |" + " ---: |" * (len(terms) + len(tasks) + 1)]
    for r in rows:
        acc = r.get("accuracy", {})
        out.append(f"| {r['run']} | {r['steps']} | {r['step_ms_median']:.1f} | "
                   + " | ".join(f"{r['metrics'][t]['last_tenth']:.4f}" for t in terms) + " | "
                   + " | ".join(f"{acc[t]:.2f}" for t in tasks) + f" | {acc.get('mean', float('nan')):.4f} |")
    if data.get("comparison"):
        out += ["", "Comparison:", "", "```", json.dumps(data["comparison"], indent=1), "```"]
    return "\n".join(out)


def reproduction_section(data: dict, root: Path) -> str:
    """For a reproduction (a file whose ``reproduces`` names the table of record, as ``kvlearn reproduce`` writes
    it): each run's mean accuracy next to the table of record's, over the families both measured, with each side's
    student checkpoint. Empty when the file reproduces nothing or the table of record is not there."""
    from .reproduce import STEPS_OF_RECORD, compare_tables, dms_scope_note, shared_note, short_students

    reference = root / str(data.get("reproduces", ""))
    if not data.get("reproduces") or not reference.is_file():
        return ""
    compared = compare_tables(data["rows"], json.loads(reference.read_text())["rows"])
    out = ["", "", f"Against `{data['reproduces']}` (mean accuracy over the families both measured; a difference in a "
           "training-free row would mean the evaluation changed, one in a student row is the retrofit's):", "",
           "| method | protocol | split | budget | this run | of record | difference | student (this run) | "
           "student (of record) |", "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    out += [f"| {c['method']} | {c['protocol']} | {c['split']} | {c['budget'] or 'full'} | {c['accuracy']:.3f} | "
            f"{c['reference_accuracy']:.3f} | {c['difference']:+.3f} | {c['model'] or ''} | {c['reference_model'] or ''} |"
            for c in compared]
    notes = [(c, shared_note(c)) for c in compared]
    notes = [f"{c['method']} at {c['budget']} ({c['split']}): {n}" for c, n in notes if n]
    if notes:
        out += ["", "Rows where one side serves one student checkpoint at several budgets (trained at one of them) "
                "and the other does not, so at the other budgets they are not the same experiment: "
                + "; ".join(notes) + "."]
    for budget, steps in (data.get("student_steps") or {}).items():
        out += ["", f"Students' optimizer steps at budget {budget} (this run): "
                + ", ".join(f"{label} {n}" for label, n in steps.items()) + "."]
    short = short_students(data.get("student_steps") or {})
    if short:
        out += ["", f"Not like for like: the students of record trained {STEPS_OF_RECORD:,} steps each, and here "
                + ", ".join(f"{label} at {budget} trained {n:,}" for budget, label, n in short) + "."]
    scope = dms_scope_note(data)
    if scope:
        out += ["", scope + "."]
    return "\n".join(out)


def table_section(name: str, data: dict) -> str:
    """Any other kind of results file: its rows as one table (columns in first-seen order)."""
    rows = data["rows"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out = [f"## {data['kind']}: {name.removesuffix('.json')}", "", _provenance(name, data), "",
           "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def plot_line(results_dir: Path, name: str) -> str:
    """A Markdown image of the file's plot (the PNG named after it, as the table scripts write it) when it exists,
    else nothing."""
    png = name.removesuffix(".json") + ".png"
    return f"\n\n![{png}](../results/{png})" if (results_dir / png).is_file() else ""


def build(results_dir: Path) -> str:
    sections = [INTRO]
    first = ("testbed_teacher.json", "kvpop_ops_h200.json")  # the acceptance files first, then the rest by name
    for path in sorted(results_dir.glob("*.json"), key=lambda p: (first.index(p.name) if p.name in first else len(first), p.name)):
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            continue
        if data.get("kind") == "accuracy":
            sections.append(accuracy_section(path.name, data) + reproduction_section(data, results_dir.parent)
                            + plot_line(results_dir, path.name))
        elif data.get("kind") == "ops":
            sections.append(ops_section(path.name, data))
        elif data.get("kind") == "testbed":
            sections.append(testbed_section(path.name, data))
        elif data.get("kind") == "kaizen_memory":
            sections.append(kaizen_memory_section(path.name, data))
        elif data.get("kind") == "acceptance":
            sections.append(acceptance_section(path.name, data))
        elif data.get("kind") == "graphed_retrofit_compare":
            sections.append(graphed_compare_section(path.name, data))
        else:
            sections.append(table_section(path.name, data))
    return "\n\n".join(sections) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "RESULTS.md"))
    args = ap.parse_args(argv)
    Path(args.out).write_text(build(Path(args.results)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
