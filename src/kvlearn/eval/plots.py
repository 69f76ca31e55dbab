"""Plots built from results rows (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .accuracy import wilson_interval  # noqa: E402


def _label(row: dict) -> str:
    if row["method"] == "dense":
        return "dense (full cache)"
    return f"{row['method']} B={row['budget']} (CR {row['compression']:.0%})"


def plot_accuracy(rows: list[dict], path: str | Path, title: str = "Testbed accuracy") -> Path:
    """Grouped bars: one group per task, one bar per method/budget, with 95% Wilson intervals."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    series = list(dict.fromkeys(_label(r) for r in rows))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(tasks), 3.6))
    for si, name in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for ti, task in enumerate(tasks):
            match = [r for r in rows if r["task"] == task and _label(r) == name]
            if not match:
                continue
            r = match[0]
            a, b = wilson_interval(round(r["accuracy"] * r["n"]), r["n"])
            xs.append(ti + (si - (len(series) - 1) / 2) * width)
            ys.append(r["accuracy"])
            lo.append(r["accuracy"] - a)
            hi.append(b - r["accuracy"])
        bars = ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=3, label=name)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], padding=2, fontsize=7)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("exact-match accuracy")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
