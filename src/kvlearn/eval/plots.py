"""Plots built from results rows (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from ..errors import check  # noqa: E402
from .accuracy import model_name, wilson_interval  # noqa: E402


MARKERS = {"bounded": "o", "context": "s"}
LINESTYLES = {"bounded": "-", "context": "--"}
MARKERSIZES = {"bounded": 10, "context": 6}  # a smaller marker on top keeps coinciding points of both visible


def _label(row: dict) -> str:
    """A series' name: method, budget and CR, and the model's folder name when the row records one."""
    model = f" [{model_name(row)}]" if model_name(row) else ""
    if row["method"] == "dense":
        return f"dense (full cache){model}"
    proto = f", {row['protocol']}" if row.get("protocol", "bounded") != "bounded" else ""
    return f"{row['method']} B={row['budget']} (CR {row['compression']:.0%}{proto}){model}"


def _tick(row: dict) -> str:
    """A series' short name under the memory panel: method (and budget), the model's folder name below it."""
    name = "dense" if row["method"] == "dense" else f"{row['method']} B={row['budget']}"
    return name + (f"\n{model_name(row)}" if model_name(row) else "")


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def plot_accuracy(rows: list[dict], path: str | Path, title: str = "Testbed accuracy") -> Path:
    """Two panels: accuracy per task family (grouped bars, 95% Wilson intervals, a marker and label at 0 so no bar
    is invisible) and the allocated KV bytes per example of each series (mean over families, with the memory saved
    against the full cache). The legend sits below the panels; n and ``CR = 1 - budget/context`` are stated. A series
    is one method, budget and protocol, and one model when the rows record theirs (``row["model"]``)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    series = list(dict.fromkeys(_label(r) for r in rows))
    colors = [f"C{i}" for i in range(len(series))]
    width = 0.8 / max(1, len(series))
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(2.4 + 1.5 * len(tasks) + 1.2 * len(series), 4.2),
                                 gridspec_kw={"width_ratios": [max(2, len(tasks)), max(1.2, 0.6 * len(series))]})
    handles = []
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
            lo.append(max(0.0, r["accuracy"] - a))  # the Wilson bounds can miss 0 or 1 by a rounding error
            hi.append(max(0.0, b - r["accuracy"]))
        bars = ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=3, color=colors[si], ecolor="0.35", label=name)
        handles.append(bars)
        zeros = [x for x, y in zip(xs, ys) if y == 0]
        if zeros:  # a bar of height 0 is invisible: mark it on the axis
            ax.plot(zeros, [0.0] * len(zeros), linestyle="none", marker="_", markersize=200 * width / max(1, len(tasks)) + 8,
                    markeredgewidth=4, color=colors[si], clip_on=False, zorder=3)
        for x, y, h in zip(xs, ys, hi):
            ax.text(x, y + h + 0.02, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylim(0, 1.18)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_ylabel("exact-match accuracy")
    ns = sorted({r["n"] for r in rows})
    contexts = sorted({r["context"] for r in rows if "context" in r})
    ctx = f", context {contexts[0]}" if len(contexts) == 1 else ""
    ax.set_title(f"accuracy (n = {'/'.join(map(str, ns))} per family; 95% Wilson intervals)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)

    # allocated KV bytes per example, mean over families
    dense = [r["kv_bytes"] for r in rows if r["method"] == "dense"]
    dense_mean = sum(dense) / len(dense) if dense else None
    means, is_dense = [], []
    for name in series:
        b = [r["kv_bytes"] for r in rows if _label(r) == name]
        means.append(sum(b) / len(b))
        is_dense.append(any(r["method"] == "dense" for r in rows if _label(r) == name))
    bars = mx.bar(range(len(series)), [m / 2**20 for m in means], color=colors, width=0.6)
    top = max(means) / 2**20 if means else 1
    for i, m in enumerate(means):
        text = _mib(m)
        if dense_mean and not is_dense[i]:
            text += f"\n{1 - m / dense_mean:.0%} saved"
        mx.text(i, m / 2**20 + 0.02 * top, text, ha="center", va="bottom", fontsize=7)
    ticks = {_label(r): _tick(r) for r in rows}
    mx.set_xticks(range(len(series)), [ticks[s] for s in series], fontsize=8)
    mx.set_ylim(0, top * 1.3)
    mx.set_ylabel("allocated KV cache per example (MiB)")
    mx.set_title("KV memory (end of generation)", fontsize=9)
    mx.grid(axis="y", alpha=0.3)

    fig.suptitle(f"{title}\nCR = 1 - budget/context{ctx}", fontsize=10)
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(series)), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, path)


def mean_accuracy(rows: list[dict], extra_keys: tuple[str, ...] = ()) -> dict[tuple, dict]:
    """Mean accuracy over task families per ``(split, method, protocol, budget, *extra_keys)``: ``{key: {"accuracy",
    "compression", "factor", "tasks", "incomplete"}}`` (``factor``: the rows' mean realised ``factor``, 1 without
    one)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r.get("split", "eval"), r["method"], r.get("protocol", "bounded"), r["budget"])
        groups.setdefault(key + tuple(r.get(k) for k in extra_keys), []).append(r)
    return {
        k: {"accuracy": sum(r["accuracy"] for r in g) / len(g), "compression": g[0]["compression"],
            "factor": sum(r.get("factor", 1.0) for r in g) / len(g),
            "tasks": len(g), "incomplete": any(r.get("incomplete") for r in g)}
        for k, g in groups.items()
    }


def method_colors(methods: list[str]) -> dict:
    """One colour per method: matplotlib's ten default colours for up to ten methods, else tab20's twenty, so no
    two of up to twenty methods share a colour (then they repeat)."""
    palette = [f"C{i}" for i in range(10)] if len(methods) <= 10 else list(plt.get_cmap("tab20").colors)
    return {m: palette[i % len(palette)] for i, m in enumerate(methods)}


def by_selector(agg: dict[tuple, dict]) -> dict[tuple, dict]:
    """``mean_accuracy(rows, ("target", "selector"))`` with each trained selector's rows as a series of its own: the
    method of a key whose ``selector`` is set becomes ``"<method> [<selector>]"`` (e.g. ``kaizen [kaizen4]`` and
    ``untrained_backbone [kaizen4]``), so two selectors at one factor are two points on two lines, not one line
    zig-zagging between them."""
    return {(k[0], k[1] if k[-1] is None else f"{k[1]} [{k[-1]}]", *k[2:]): v for k, v in agg.items()}


def series_legend(series: list[str]) -> dict[str, tuple[str, str | None]]:
    """Colour and legend label of each plotted series (a method, or ``"<method> [<selector>]"`` from
    :func:`by_selector`): one colour per *method*, so that every trained selector of ``kaizen`` shares one colour and
    every ``untrained_backbone`` series another; only a method's first series carries a legend label, which counts its
    lines where it has more than one (``"kaizen (5 lines)"``: selectors, or students with a ``series`` label).
    ``{series: (colour, label or None)}``."""
    method_of = {s: s.split(" [", 1)[0] for s in series}
    methods = list(dict.fromkeys(method_of.values()))
    colour = method_colors(methods)
    count = {m: sum(1 for s in series if method_of[s] == m) for m in methods}
    out, labelled = {}, set()
    for s in series:
        m = method_of[s]
        label = None
        if m not in labelled:
            labelled.add(m)
            n = count[m]
            label = m + (f" ({n} lines)" if n > 1 else "")
        out[s] = (colour[m], label)
    return out


FADED_LABEL = "every other run (faded)"
HIGHLIGHT_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "h")


def plot_pareto(rows: list[dict], path: str | Path, title: str = "Accuracy against compression",
                x: str = "compression", reference: str = "dense", highlight: dict[str, str] | None = None) -> Path:
    """Mean accuracy over families against the compression ratio ``1 - budget/context`` (``x="factor"``: against the
    rows' realised cache reduction ``factor``, log scale, points also split by ``target``, one line per trained
    ``selector`` or per ``series`` label of the rows (a row with both: its selector): :func:`by_selector`, all of a
    method's lines in its colour, :func:`series_legend`): one colour per
    method, one marker and line style per protocol; the full cache (method ``reference``) is a star at CR 0 (factor 1)
    and a dotted reference line. One panel per split, one legend for the figure. Points from runs cut short by a time
    guard are drawn hollow.

    ``highlight`` (``{series: legend label}``, series named as :func:`by_selector` names them, e.g. ``"kaizen
    [kaizen4]"``): those series are drawn bold under their label (several series may share one label: one legend
    entry), every other labelled series (a ``[...]`` one) faded under one legend entry, :data:`FADED_LABEL`; plain
    method series keep their style. For a table of many runs, where the recipes of record should stand out. A name
    the rows lack is a one-line error."""
    check(x in ("compression", "factor"), f"x={x!r} is invalid: expected 'compression' or 'factor'")
    by_factor = x == "factor"
    if by_factor:  # a row's ``series`` (e.g. a student retrofitted under its configuration) is a line of its own too
        rows = [dict(r, selector=r.get("selector") or r.get("series")) for r in rows]
    agg = by_selector(mean_accuracy(rows, ("target", "selector"))) if by_factor else mean_accuracy(rows)
    origin = 1.0 if by_factor else 0.0
    splits = list(dict.fromkeys(k[0] for k in agg))
    methods = [m for m in dict.fromkeys(k[1] for k in agg) if m != reference]
    highlight = dict(highlight or {})
    missing = sorted(set(highlight) - set(methods))
    check(not missing, f"highlight names series the rows lack: {missing}; the rows' series: {methods}")
    faded = {m for m in methods if highlight and " [" in m and m not in highlight}
    colour_of = method_colors(list(dict.fromkeys(m.split(" [", 1)[0] for m in methods)))
    style = {m: (colour_of[m.split(" [", 1)[0]], label)  # one colour per method, whatever is faded
             for m, (_, label) in series_legend([m for m in methods if m not in faded and m not in highlight]).items()}
    style.update({m: (colour_of[m.split(" [", 1)[0]], f"{m.split(' [', 1)[0]}: {highlight[m]}") for m in highlight})
    style.update({m: ("0.55", FADED_LABEL) for m in faded})
    labels = list(dict.fromkeys(highlight.values()))  # each highlighted label its own marker, so one colour reads
    marker_of = {m: HIGHLIGHT_MARKERS[labels.index(label) % len(HIGHLIGHT_MARKERS)] for m, label in highlight.items()}
    legend: dict[str, object] = {}  # label -> handle, over every panel
    rank: dict[str, int] = {}  # legend order: the full cache, the highlighted series, the rest, the faded runs

    def keep(handle, label, order=2):
        if label is not None and label not in legend:
            legend[label] = handle
            rank[label] = order

    fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits), 4.2), squeeze=False)
    for ax, split in zip(axes[0], splits):
        for (sp, m, proto, *_), v in agg.items():
            if sp == split and m == reference:
                ax.axhline(v["accuracy"], color="0.4", linestyle=":", linewidth=1)
                keep(ax.plot([origin], [v["accuracy"]], marker="*", markersize=14, color="0.2", linestyle="none")[0],
                     f"{reference} (full cache)", 0)
        for m in methods:
            colour, label = style[m]
            for proto in dict.fromkeys(k[2] for k in agg if k[0] == split and k[1] == m):
                pts = sorted((v[x], v["accuracy"], v["incomplete"]) for k, v in agg.items()
                             if k[0] == split and k[1] == m and k[2] == proto)
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                emphasis = ({"markersize": 5, "markeredgewidth": 0, "alpha": 0.3, "linewidth": 0.8, "zorder": 1}
                            if m in faded else
                            {"markersize": MARKERSIZES.get(proto, 7) + 3, "markeredgewidth": 1.0, "alpha": 0.95,
                             "linewidth": 2.2, "zorder": 5} if m in highlight else
                            {"markersize": MARKERSIZES.get(proto, 7), "markeredgewidth": 0.6, "alpha": 0.85,
                             "zorder": 3 if proto == "context" else 2})
                marker = marker_of.get(m, MARKERS.get(proto, "^"))
                line = ax.plot(xs, ys, color=colour, linestyle=LINESTYLES.get(proto, "-"), marker=marker,
                               markeredgecolor="black", **emphasis)[0]
                keep(line, None if label is None else label if m in faded else f"{label} [{proto}]",
                     3 if m in faded else 1 if m in highlight else 2)
                hollow = [(x, y) for x, y, inc in pts if inc]
                if hollow:
                    ax.plot(*zip(*hollow), linestyle="none", marker=marker,
                            markersize=MARKERSIZES.get(proto, 7), markerfacecolor="white", color=colour, zorder=4)
        if any(v["incomplete"] for k, v in agg.items() if k[0] == split):
            keep(ax.plot([], [], linestyle="none", marker="o", markerfacecolor="white", color="0.3")[0],
                 "hollow: run cut short (incomplete)", 4)
        ax.set_ylabel("accuracy, mean over task families")
        ax.set_ylim(-0.03, 1.05)
        if by_factor:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("realised cache reduction factor (log scale)")
        else:
            ax.set_xlabel("compression ratio CR = 1 - budget/context")
            ax.set_xlim(-0.03, 1.0)
            ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        ax.set_title(f"split: {split}", fontsize=9)
    order = sorted(legend, key=lambda label: rank[label])  # stable: first drawn first within a rank
    fig.legend([legend[k] for k in order], order, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5),
               frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
