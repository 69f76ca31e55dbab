"""The 8x KV-Kaizen recipe of record over its seeds: each seed's first stage and its refinement against the issue's
8x bar, from the committed table (issue #11; docs/FINDINGS.md, "KV-Kaizen").

The 8x recipe trains in two stages (``kvlearn kaizen-train --recipe 8x``, then ``--recipe 8x-refine
--init-student <its export>``), one device call each. Its runs of record sit in ``results/kaizen_table.json`` as
selector series (one label per run); this script gathers them per seed and stage and, per split, gives each run's
per-family accuracies, its mean, that mean relative to the same-recipe control's (the table's ``control`` rows),
the difference from the control with its binomial standard error, and whether it is within the issue's bar (0.05
under the control's mean). With ``--plot``, the relative means per seed, one panel per split, an arrow from each
refined run's first stage (the last first-stage run given for that seed) to it, and the bar as a dashed line.

A run is ``SEED:STAGE=LABEL`` with STAGE ``first`` or ``refined``; a seed may have several first-stage runs (a second
draw of the same seed, as seed 3 has: its refinement starts from the last one given). The default is the record's
runs. Every run must have rows on every split the control has, at the 8x factor, and every run must be complete.

The control was measured on the table's device (an H200), the selectors on their own (H100s; each row names it):
the table evaluates in bfloat16, the same weights on either GPU, so the comparison is the table's own.

Usage:
  python benchmarks/kaizen_8x_seeds.py --out results/kaizen_8x_seeds.json --plot results/kaizen_8x_seeds.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.eval.acceptance import difference_se, mean  # noqa: E402
from kvlearn.results import make_results, portable_path, read_results, write_results  # noqa: E402

STAGES = ("first", "refined")
BAR = 0.05  # the 8x bar: within 0.05 of the control's mean accuracy
FACTOR = 8.0
RECORD_RUNS = (
    "0:first=kaizen8_share02_ema_fw_alone6_s0", "0:refined=kaizen8_share02_ema_fw_alone6_s0_refined",
    "1:first=kaizen8_share02_ema_fw_alone6_s1", "1:refined=kaizen8_share02_ema_fw_alone6_s1_refined",
    "2:first=kaizen8_share02_ema_fw_alone4000_s2", "2:refined=kaizen8_share02_ema_fw_alone4000_s2_refined",
    "3:first=kaizen8_share02_ema_fw_alone4000_s3", "3:first=kaizen8_share02_ema_fw_alone4000_s3_retrained",
    "3:refined=kaizen8_share02_ema_fw_alone4000_s3_refined",
)


def parse_run(text: str) -> tuple[int, str, str]:
    """``SEED:STAGE=LABEL`` -> ``(seed, stage, label)``; anything else is a one-line error naming the form."""
    head, sep, label = text.partition("=")
    seed, colon, stage = head.partition(":")
    check(bool(sep and colon and label) and seed.isdigit() and stage in STAGES,
          f"run {text!r} is invalid: expected SEED:STAGE=LABEL with SEED a whole number and STAGE one of "
          f"{', '.join(STAGES)} (e.g. 3:refined=kaizen8_share02_ema_fw_alone4000_s3_refined)")
    return int(seed), stage, label


def family_accuracies(rows: list[dict], split: str, *, method: str, label: str | None = None) -> dict[str, tuple]:
    """``{task: (accuracy, n)}`` of the ``bounded`` rows of ``method`` (and selector ``label``) on ``split``; a
    selector's rows at the 8x factor only."""
    return {r["task"]: (r["accuracy"], r.get("n")) for r in rows
            if r["method"] == method and r.get("protocol", "bounded") == "bounded" and r["split"] == split
            and (label is None or (r.get("selector") == label and r.get("factor") == FACTOR))}


def seed_rows(table: dict, runs: list[tuple[int, str, str]]) -> list[dict]:
    """One row per (run, split): the run's per-family accuracies, mean, mean relative to the control's, the control's
    mean minus its mean with the standard error of that difference, and whether it is within :data:`BAR`."""
    rows = table["rows"]
    splits = sorted({r["split"] for r in rows if r["method"] == "control"})
    check(bool(splits), "the table has no control rows: the bar is relative to the same-recipe control")
    labels = [label for _, _, label in runs]
    check(len(set(labels)) == len(labels), f"a label is given twice in {labels}")
    out = []
    for seed, stage, label in runs:
        check(any(r.get("selector") == label for r in rows),
              f"selector {label!r} has no rows in the table: expected one of its selector labels")
        for split in splits:
            control = family_accuracies(rows, split, method="control")
            run = family_accuracies(rows, split, method="kaizen", label=label)
            check(set(run) == set(control),
                  f"{label} on {split} has families {sorted(run)} at {FACTOR:g}x, the control {sorted(control)}: "
                  "expected the same (a run cut short is not compared)")
            tasks = sorted(control)
            run_mean = mean(run[t][0] for t in tasks)
            control_mean = mean(control[t][0] for t in tasks)
            gap = control_mean - run_mean
            devices = sorted({r.get("device") or table.get("device") for r in rows
                              if r.get("selector") == label and r["split"] == split})
            out.append({"seed": seed, "stage": stage, "label": label, "split": split,
                        "accuracy": {t: run[t][0] for t in tasks}, "mean": run_mean, "control_mean": control_mean,
                        "of_control": run_mean / control_mean, "under_control": gap,
                        "under_control_se": difference_se([control[t] for t in tasks], [run[t] for t in tasks]),
                        "bar": BAR, "within_bar": gap <= BAR + 1e-12, "device": devices[0] if len(devices) == 1 else devices})
    return out


def summary(rows: list[dict]) -> dict:
    """Per stage and split: how many seeds' runs are within the bar, and the range of the relative means."""
    out = {}
    for stage in STAGES:
        for split in sorted({r["split"] for r in rows}):
            part = [r for r in rows if r["stage"] == stage and r["split"] == split]
            if part:
                out[f"{stage}/{split}"] = {
                    "runs": len(part), "seeds": len({r["seed"] for r in part}),
                    "within_bar": sum(r["within_bar"] for r in part),
                    "of_control_min": min(r["of_control"] for r in part),
                    "of_control_max": max(r["of_control"] for r in part)}
    return out


def plot(rows: list[dict], path: str) -> None:
    """Relative mean per seed, one panel per split: first-stage runs as circles (a later draw of the same seed
    hollow, beside it), refined runs as triangles with an arrow from the first stage they started from; the bar
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({r["split"] for r in rows})
    fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits), 4.2), sharey=True, squeeze=False)
    for ax, split in zip(axes[0], splits):
        part = [r for r in rows if r["split"] == split]
        bar = 1 - BAR / part[0]["control_mean"]
        ax.axhline(1.0, color="0.3", lw=0.8, ls=":")
        ax.axhline(bar, color="tab:red", lw=1.0, ls="--", label=f"the bar: {BAR:g} under the control's mean")
        ax.annotate(f"{bar:.3f}", xy=(1.0, bar), xycoords=("axes fraction", "data"), xytext=(-2, 3),
                    textcoords="offset points", ha="right", fontsize=8, color="tab:red")
        for seed in sorted({r["seed"] for r in part}):
            firsts = [r for r in part if r["seed"] == seed and r["stage"] == "first"]
            for i, r in enumerate(firsts):
                x = seed - 0.12 + 0.1 * i
                ax.scatter([x], [r["of_control"]], s=60, marker="o", zorder=3,
                           facecolors="tab:blue" if i == 0 else "white", edgecolors="tab:blue",
                           label="first stage (--recipe 8x)" if seed == 0 and i == 0 else
                           ("first stage, a second draw" if i == 1 else None))
            for r in part:
                if r["seed"] == seed and r["stage"] == "refined":
                    ax.scatter([seed + 0.15], [r["of_control"]], s=70, marker="^", color="tab:orange", zorder=3,
                               label="refined (--recipe 8x-refine)" if seed == 0 else None)
                    if firsts:
                        start = firsts[-1]
                        ax.annotate("", xy=(seed + 0.13, r["of_control"]),
                                    xytext=(seed - 0.12 + 0.1 * (len(firsts) - 1), start["of_control"]),
                                    arrowprops={"arrowstyle": "->", "color": "0.5", "lw": 0.8})
        ax.set_xticks(sorted({r["seed"] for r in part}))
        ax.set_xlabel("seed")
        ax.set_title(f"split: {split}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean accuracy / the control's")
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle("KV-Kaizen 8x recipe over seeds (8.00x realised, n = 100 per family)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", default="results/kaizen_table.json", help="the KV-Kaizen table (default: of record)")
    parser.add_argument("--run", action="append", default=None, metavar="SEED:STAGE=LABEL",
                        help="a run of the recipe, repeatable (default: the record's runs)")
    parser.add_argument("--out", required=True, help="JSON to write (kind comparison)")
    parser.add_argument("--plot", default=None, help="PNG of the relative means per seed")
    args = parser.parse_args(argv)
    try:
        runs = [parse_run(text) for text in (args.run or RECORD_RUNS)]
        table = read_results(args.table)
        rows = seed_rows(table, runs)
    except KVLearnError as err:
        parser.exit(2, f"kaizen_8x_seeds: {err}\n")
    command = "python benchmarks/kaizen_8x_seeds.py " + " ".join(
        [f"--table {portable_path(args.table)}"] + [f"--run {t}" for t in (args.run or [])] + [f"--out {args.out}"]
        + ([f"--plot {args.plot}"] if args.plot else []))
    result = make_results(
        "comparison", rows, device="cpu", command=command, table=portable_path(args.table),
        table_commit=table.get("commit"), summary=summary(rows),
        note="Each run of the 8x recipe of record against the same-recipe control (the table's control rows); "
             f"under_control = control mean - run mean, within_bar = at most {BAR:g}; a refined run starts from "
             "the last first-stage run of its seed.")
    result["device"] = "none (read off the table; each row names the device its run was measured on)"
    write_results(args.out, result)
    print(f"wrote {args.out}")
    for key, part in result["summary"].items():
        print(f"{key}: {part['within_bar']} of {part['runs']} runs within the bar, relative "
              f"{part['of_control_min']:.3f}-{part['of_control_max']:.3f}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
