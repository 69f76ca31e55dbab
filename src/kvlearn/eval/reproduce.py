"""``kvlearn reproduce kvpop``: the KVpop paper's Table 1 on the testbed, rebuilt from the committed teacher.

For each budget (default 1024, 512, 256: CR 75%, 88%, 94% at context 4096), one run of
``benchmarks/device/kvpop_table.sh`` (the repository's Table 1 chain): four students retrofitted side by side from
the teacher, each for ``steps`` optimizer steps (default :data:`STEPS_OF_RECORD`, the table of record's: the same
for every method) or, with ``minutes``, for that much wall clock each, with the measured recipes (KVpop with the MLP and with the mLSTM scorer, both on the
peak target from ``--decay-init 0.99999``, the mLSTM under ``--readout-penalty 30 --scorer-kd 1``, the chain's defaults;
StreamingLLM+; DMS), the window :func:`kvlearn.config.retrofit_window` gives (256 from budget 512 up, half the budget below),
then the table at that budget: the teacher, the students under the pattern each was trained for, and every
training-free baseline under the ``bounded`` protocol, both splits, ``n_per_task`` per family (the table of record's
``context`` rows, eval split only, came from a separate run of ``benchmarks/device/eviction_baselines.sh``; with
``context_rows`` the chain measures them too, SnapKV and PyramidKV among them, which define only ``context``). The budgets run one after another (four
retrofits share the GPU at a time); their tables are merged into ``out/kvpop_table.json`` with its plot, and the
students' checkpoints stay in ``out/students/`` (``table_reproduce<budget>_<student>/final``).

Device time: with ``minutes``, about ``minutes + 4`` per budget. With steps, as long as the slowest student beside
the others plus 4 minutes of table: on one H100 DMS made 481-488 steps in 5 minutes beside the three others, and
1,300 alone in 152 s (session 42, which ran budget 512 with ``students`` in three runs of 375, 363 and 177 s:
DMS alone with the teacher and baselines, the two KVpop students side by side, StreamingLLM+ alone). In minutes
the device decides each student's steps, and DMS then trains far fewer than the students of record
(:func:`short_students` names them; session 41 measured what that costs at budget 512). While a chain runs, a
progress bar counts its students' steps (:class:`RetrofitProgress`, from their ``train_log.jsonl``). The chain is a shell script
of the repository checkout (the editable install the README sets up); ``retrofit_args`` / ``table_args`` pass more
options to every retrofit / table process (a CPU smoke run uses them for tiny shapes).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import retrofit_window
from ..errors import KVLearnError, check, check_int
from ..output_paths import check_output_folder
from ..results import (FULL_CACHE_LABELS, device_name, merge_results, portable_path, read_results, repo_root,
                       row_run_key, split_not_run, write_results)

TABLE1_STUDENTS = "kvpop_mlp=kvpop kvpop=kvpop streaming_plus=streaming_plus dms=dms"
STUDENT_METHODS = dict(s.split("=") for s in TABLE1_STUDENTS.split())  # label -> registered method
CHAIN = Path("benchmarks") / "device" / "kvpop_table.sh"
TABLE_SCRIPT = Path("benchmarks") / "kvpop_table.py"  # what finish_budget runs for the runs a table lacks
COMMITTED_TABLE = Path("results") / "kvpop_table.json"  # the table of record a reproduction is compared with
SETTINGS = "reproduce_settings.json"  # in out: the settings a --resume must match
EVAL_MINUTES = 4.0  # the table's share of a budget's run after the retrofits (n = 100, both splits, 6 parts)
LEGACY_DMS_SCOPE = "model"  # the DMS scope of a table without `dms_scope`: every run before session 48 (DESIGN section 9)
RETROFIT_SINKS, RETROFIT_SEQ_LEN = 4, 4096  # kvlearn retrofit's defaults of --sinks and --seq-len (tested equal)
STEPS_OF_RECORD = 1300  # every student of results/kvpop_table.json trained this many steps (docs/DESIGN.md section 5)


def retrofit_option(retrofit_args: str, option: str, default: int | None) -> int | None:
    """The integer value of ``option`` (``--window``, ``--sinks``, ``--seq-len``) in ``retrofit_args`` as the students'
    ``kvlearn retrofit`` will read it (the last one given wins, ``--opt N`` or ``--opt=N``), else ``default``; a value
    that is not an integer is left to the retrofit's own one-line error (``default`` is returned)."""
    try:
        words = shlex.split(retrofit_args)
    except ValueError as error:
        raise KVLearnError(f"retrofit_args {retrofit_args!r} is invalid: {error} (expected kvlearn retrofit options)") \
            from None
    value = default
    for i, word in enumerate(words):
        text = word.split("=", 1)[1] if word.startswith(option + "=") else (
            words[i + 1] if word == option and i + 1 < len(words) else None)
        if text is not None:
            value = int(text) if re.fullmatch(r"[+-]?\d+", text.strip()) else default
    return value


def check_student_budget(budget: int, retrofit_args: str = "") -> None:
    """One-line errors, before any student starts, for a budget that one of Table 1's students cannot train at:
    KVpop and DMS keep ``sinks + window`` protected tokens and at least one long-range slot (``window``: the one
    :func:`kvlearn.config.retrofit_window` gives at this budget, or ``--window`` in ``retrofit_args``), and every
    student needs a budget below the training sequence (``--seq-len``, default 4096), else nothing is evicted. Before
    session 58 only ``budget >= 6`` was checked, so ``--budgets 7`` started four retrofits whose three windowed ones
    failed at once while StreamingLLM+ trained on."""
    sinks = retrofit_option(retrofit_args, "--sinks", RETROFIT_SINKS)
    given = retrofit_option(retrofit_args, "--window", None)
    seq_len = retrofit_option(retrofit_args, "--seq-len", RETROFIT_SEQ_LEN)
    # budget - window never decreases as the budget grows, so the smallest budget that fits is the bound
    smallest = (sinks + given + 1 if given is not None
                else next(b for b in range(1, 4 * sinks + 8) if b >= sinks + retrofit_window(b) + 1))
    window = (f"--window {given}" if given is not None else "a window of 256 from budget 512 up, half the budget below")
    check_int("budget", budget, smallest, seq_len - 1,
              hint=f" (the KVpop and DMS students keep sinks={sinks} + {window} + at least one long-range slot; a "
                   f"budget of the retrofit's seq_len={seq_len} or more evicts nothing)")


@dataclass
class ReproduceConfig:
    """``out``: folder for the per-budget runs and the merged table; ``budgets``: tokens per KV head; ``steps``:
    each retrofit's optimizer steps (the same for every method, however the shared GPU slows each; the table then
    gets ``EVAL_MINUTES``, and the run's time is not bounded), :data:`STEPS_OF_RECORD` when neither it nor
    ``minutes`` is given; ``minutes``: instead, each retrofit's training time (a bounded run; the GPU then decides
    the steps, and the slower methods train fewer than the table of record's students); ``n_per_task``: examples per family and split; ``device``: ``cuda`` (``cpu`` for
    a smoke run); ``model``: the teacher's folder (default the committed one). ``resume``: keep every budget whose
    complete table an earlier run with the same settings left in ``out`` and run only the others, so that the
    budgets may run in separate sessions (e.g. device calls shorter than the whole run); the merge covers them all,
    and the budgets of ``out`` that this run's ``budgets`` does not name too (:func:`earlier_budgets`).
    A budget whose table a time guard cut (runs under ``not_run``, rows marked ``incomplete``) gets only those runs
    measured (:func:`finish_budget`), not its retrofits again, when every student they need is still in ``out``;
    a chain killed inside its table stage leaves parts that are merged first (:func:`salvage_parts`). ``students``:
    which of the four Table 1 students (labels of :data:`STUDENT_METHODS`) this run trains; with ``resume``, a
    budget whose table lacks some of them gets those added (:func:`add_students`), so a machine whose runs are too
    short for four retrofits at once can train them over several runs; until then the merged file lists the
    missing students under ``not_run``. ``context_rows``: also the table of record's ``context`` rows, every
    training-free baseline under the ``context`` protocol on the eval split (SnapKV and PyramidKV define only that
    protocol): one more part of a budget's chain, and with ``resume`` measured for a budget an earlier run left
    without them (:func:`context_runs_missing`)."""

    out: str = "runs/reproduce-kvpop"
    budgets: tuple[int, ...] = (1024, 512, 256)
    minutes: float | None = None
    steps: int | None = None
    n_per_task: int = 100
    device: str = "cuda"
    model: str | None = None
    retrofit_args: str = ""
    table_args: str = ""
    overwrite: bool = False
    resume: bool = False
    students: tuple[str, ...] = tuple(STUDENT_METHODS)
    context_rows: bool = False
    dms_scope: str = "head"  # the DMS student's --compression-scope (a run before session 48: "model")

    def __post_init__(self) -> None:
        check(len(self.budgets) > 0, "budgets is empty: expected one or more budgets, e.g. 1024,512,256")
        for b in self.budgets:
            check_student_budget(b, self.retrofit_args)
        check(self.minutes is None or self.steps is None, f"minutes={self.minutes!r} and steps={self.steps!r}: "
              "give one of them (steps: the same for every student; minutes: the same wall clock)")
        if self.minutes is None and self.steps is None:
            self.steps = STEPS_OF_RECORD
        if self.minutes is not None:
            check(self.minutes > 0, f"minutes={self.minutes!r} is invalid: expected > 0")
        if self.steps is not None:
            check_int("steps", self.steps, 1)
        check_int("n_per_task", self.n_per_task, 1)
        self.students = tuple(self.students)
        check(len(self.students) > 0 and all(label in STUDENT_METHODS for label in self.students)
              and len(set(self.students)) == len(self.students),
              f"students={','.join(self.students)!r} is invalid: expected one or more of {','.join(STUDENT_METHODS)}, "
              "each once")
        check(self.device in ("cuda", "cpu"), f"device={self.device!r} is invalid: expected cuda or cpu")
        check(self.dms_scope in ("head", "model"),
              f"dms_scope={self.dms_scope!r} is invalid: expected head (each KV head trained for its slots) or model "
              "(the reference's hinge, Table 1's DMS rows of record)")
        if self.model is not None:  # one-line errors for a missing folder, a file, an unsupported family
            from ..hf import read_model_config

            read_model_config(self.model)
        out = Path(self.out)
        check_output_folder(out, "out")
        check(not (self.overwrite and self.resume),
              "--overwrite and --resume exclude each other: --resume keeps the finished budgets, --overwrite reruns "
              "them")
        check(self.overwrite or self.resume or not out.exists() or not any(out.iterdir()),
              f"out={self.out!r} already holds files: pass --overwrite to replace them, --resume to keep its finished "
              "budgets, or choose a new folder")

    def settings(self) -> dict:
        """What decides a budget's rows (all but ``out``, ``budgets``, ``students`` and the two flags): a resumed run
        must match. ``students`` may differ between runs: each trains some of a budget's students."""
        return {"minutes": self.minutes, "steps": self.steps, "n_per_task": self.n_per_task, "device": self.device,
                "model": self.model, "retrofit_args": self.retrofit_args, "table_args": self.table_args,
                "dms_scope": self.dms_scope}


def teacher_of(config: ReproduceConfig) -> str:
    """The teacher every budget retrofits from and evaluates: ``config.model``, else the committed one."""
    return config.model or str(repo_root() / "checkpoints" / "testbed-teacher")


def budget_table(config: ReproduceConfig, budget: int) -> Path:
    """Where a budget's chain writes its table: ``out/budget<B>/kvpop_table.json`` (``OUT`` of :func:`budget_env`)."""
    return Path(config.out) / f"budget{budget}" / "kvpop_table.json"


def folder_tables(out: str | os.PathLike) -> dict[int, Path]:
    """``{budget: table}`` of every budget table in the folder ``out`` (``out/budget<B>/kvpop_table.json``), largest
    budget first."""
    found = {}
    for table in Path(out).glob("budget*/kvpop_table.json"):
        name = table.parent.name[len("budget"):]
        if name.isdigit():
            found[int(name)] = table
    return dict(sorted(found.items(), reverse=True))


def earlier_budgets(config: ReproduceConfig) -> dict[int, Path]:
    """:func:`folder_tables` less the budgets ``config.budgets`` names (an earlier run's). A ``--resume`` run merges
    them too, so the folder's table holds every budget its runs measured whichever ``--budgets`` the last run named
    (the settings check already holds them to the same settings)."""
    return {b: t for b, t in folder_tables(config.out).items() if b not in config.budgets}


def check_one_device(config: ReproduceConfig) -> None:
    """``--resume`` into a folder whose budget tables another device measured is a one-line error before any chain
    runs: the merge refuses parts of two devices (a table holds one device's rows), and it comes after the chains."""
    def model_of(name):  # a CPU's name carries the process's thread count, which is no other device
        return None if name is None else re.sub(r", \d+ threads\)$", ")", name)

    here = device_name(config.device)
    for budget, table in folder_tables(config.out).items():
        there = read_results(table).get("device")
        check(model_of(there) in (None, model_of(here)),
              f"--resume: {table} (budget {budget}) was measured on {there!r} and this run is on {here!r}: a table "
              f"holds one device's rows, so start a new --out for this device (--merge-only merges a folder "
              f"without running anything)")


def budget_env(config: ReproduceConfig, budget: int, students: tuple[str, ...] | None = None,
               out: Path | None = None) -> dict[str, str]:
    """The environment of ``kvpop_table.sh`` for one budget's run (its options are environment variables):
    ``students`` (default ``config.students``) are retrofitted and tabled; with ``out`` (a folder other than the
    budget's) the chain adds those students to a budget whose table exists: no teacher, no baselines
    (``BASELINES=0``), its own table in ``out`` to merge."""
    students = config.students if students is None else students
    return {
        "OUT": str((budget_table(config, budget).parent if out is None else out).resolve()),
        "BASELINES": "1" if out is None else "0",
        "CONTEXT_BASELINES": "1" if config.context_rows and out is None else "0",
        "TAG": f"_reproduce{budget}",
        "WORK_DIR": str(Path(config.out).resolve() / "students"),  # the retrofits' checkpoints, kept with the table
        "MODEL": teacher_of(config),
        "BUDGET": str(budget),
        "STUDENTS": " ".join(f"{label}={STUDENT_METHODS[label]}" for label in students),
        **({"RETROFIT_STEPS": str(config.steps), "TABLE_MINUTES": str(EVAL_MINUTES)} if config.steps is not None else
           {"RETROFIT_MINUTES": str(config.minutes), "TOTAL_MINUTES": str(round(config.minutes + EVAL_MINUTES, 2))}),
        "N_PER_TASK": str(config.n_per_task),
        "DEVICE": config.device,
        "EXPORT_STUDENTS": "0",  # the students' final/ stay in out/students: no bf16 tar of each in the budget folder
        "RETROFIT_ARGS": f"--window {retrofit_window(budget)} {config.retrofit_args}".strip(),
        "DMS_SCOPE": config.dms_scope,
        "TABLE_ARGS": f"--budgets {budget} {config.table_args}".strip(),
    }


def finished(table: dict) -> bool:
    """Whether a budget's table is whole: no run cut by a time guard (``not_run``) and not marked incomplete."""
    return table.get("complete", True) is True and not table.get("not_run")


def students_missing(table: dict) -> list[str]:
    """The Table 1 students (:data:`STUDENT_METHODS`' labels, in order) with no row in a budget's table: a run with
    ``--students`` trained the others, and a later ``--resume`` run adds these."""
    have = {r.get("method") for r in table["rows"]}
    return [label for label in STUDENT_METHODS if label not in have]


def add_students(config: ReproduceConfig, budget: int, labels: list[str],
                 run: Callable[..., subprocess.CompletedProcess]) -> bool:
    """Retrofit and table ``labels`` (students the budget's table lacks) with the chain in ``budget<B>/add_<labels>``
    (no teacher, no baselines: the table has them) and merge their rows into the budget's table. Returns whether
    the chain wrote its table."""
    table_path = budget_table(config, budget)
    folder = table_path.parent / f"add_{'_'.join(labels)}"
    part = folder / "kvpop_table.json"
    part.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    with open(table_path.parent / f"{folder.name}.log", "w") as log, retrofit_progress(config, budget, labels):
        run(["bash", str(repo_root() / CHAIN)], cwd=repo_root(),
            env={**os.environ, **budget_env(config, budget, tuple(labels), out=folder)},
            stdout=log, stderr=subprocess.STDOUT, check=False)
    if not part.is_file():
        return False
    table = read_results(table_path)
    write_results(table_path, merge_results([table, read_results(part)], table["command"], across_runs=True))
    return True


def length_of(config: ReproduceConfig) -> str:
    """How long each retrofit trains, for the progress lines: ``1300 steps`` or ``5.0 min``."""
    return f"{config.steps} steps" if config.steps is not None else f"{config.minutes} min"


def resume_budget(config: ReproduceConfig, budget: int, run: Callable[..., subprocess.CompletedProcess],
                  say: str) -> bool:
    """For ``--resume``, a budget whose table an earlier run left: measure the runs a time guard cut
    (:func:`finish_budget`) and train the students it lacks that ``config.students`` names (:func:`add_students`).
    Returns False, doing nothing, when only the whole chain can finish the table (not :func:`finished` and not
    :func:`finishable`); ``say`` prefixes the progress lines."""
    table = budget_table(config, budget)
    if not finished(read_results(table)):
        if not finishable(config, budget):
            return False
        print(f"{say} the earlier run's table lacks {len(missing_runs(read_results(table)))} run(s): measuring only "
              "those", flush=True)
        finish_budget(config, budget, run)  # what it could not finish stays under the table's not_run
    lacking = context_runs_missing(read_results(table)) if config.context_rows else []
    if lacking:
        print(f"{say} measuring the table of record's context rows it lacks ({len(lacking)} run(s))", flush=True)
        finish_budget(config, budget, run, runs=lacking)
    add = [label for label in students_missing(read_results(table)) if label in config.students]
    if add:
        print(f"{say} adding student(s) {', '.join(add)} ({len(add)} retrofit(s) of {length_of(config)}, then their "
              "rows)", flush=True)
        add_students(config, budget, add, run)
    elif finished(read_results(table)) and not lacking:
        print(f"{say} kept from the earlier run ({table})", flush=True)
    return True


def student_dir(config: ReproduceConfig, budget: int, label: str) -> Path:
    """Where a budget's chain leaves student ``label``'s checkpoint (``WORK_DIR/table<TAG>_<label>/final``)."""
    return Path(config.out) / "students" / f"table_reproduce{budget}_{label}" / "final"


def missing_runs(table: dict) -> list[tuple[str, str, str]] | None:
    """``(label, protocol, split)`` of every run a budget's table lacks: its ``not_run`` entries (a time guard
    stopped the table before them) and the runs of its ``incomplete`` rows (stopped inside a family). None when an
    entry is not a run's name (``every run at B=...``: the chain itself failed), so only the whole chain can
    finish the budget."""
    keys = ([split_not_run(x)[0] for x in table.get("not_run", [])]  # a run cut between families: all of it again
            + [row_run_key(r) for r in table["rows"] if r.get("incomplete")])
    runs = []
    for key in dict.fromkeys(keys):
        parts = key.split("/")
        if len(parts) not in (3, 4) or " " in key or (len(parts) == 4 and not parts[3].startswith("B=")):
            return None
        runs.append(tuple(parts[:3]))
    return runs


CONTEXT_SPLITS = ("eval",)  # the splits of the table of record's context rows


def context_runs_missing(table: dict) -> list[tuple[str, str, str]]:
    """``(baseline, "context", split)`` of the table of record's ``context`` runs (every training-free baseline on
    :data:`CONTEXT_SPLITS`) of which a budget's table has no row, e.g. a table an earlier run made without
    ``context_rows`` (a run a guard cut is already :func:`missing_runs`')."""
    from ..methods import EVICTION_METHODS

    have = {(r["method"], r.get("protocol", "bounded"), r.get("split", "eval")) for r in table["rows"]}
    return [(m, "context", s) for m in EVICTION_METHODS for s in CONTEXT_SPLITS if (m, "context", s) not in have]


def finish_parts(config: ReproduceConfig, budget: int, runs: list[tuple[str, str, str]]) -> list[list[str]] | None:
    """The ``kvpop_table.py`` options (after the common ones) that measure ``runs`` at ``budget``: one part per
    protocol and split for the teacher, per student, and for the training-free baselines together. None when a run
    needs a student whose checkpoint is gone (the device script keeps only the students' training logs): then only
    the whole chain can finish the budget."""
    from ..methods import EVICTION_METHODS

    groups: dict[tuple[str, str, str], list[str]] = {}
    for label, protocol, split in runs:
        if label == "teacher":
            who = "teacher"
        elif label in STUDENT_METHODS:
            if not (student_dir(config, budget, label) / "config.json").is_file():
                return None
            who = f"student:{label}"
        elif label in EVICTION_METHODS:
            who = "baselines"
        else:
            return None
        groups.setdefault((who, protocol, split), []).append(label)
    parts = []
    for (who, protocol, split), labels in groups.items():
        if who == "teacher":
            options = ["--baselines", "none"]
        elif who == "baselines":
            options = ["--baselines", ",".join(labels), "--no-teacher"]
        else:
            label = who.split(":", 1)[1]
            options = ["--student", f"{label}={STUDENT_METHODS[label]}:{student_dir(config, budget, label)}",
                       "--baselines", "none", "--no-teacher"]
        parts.append(options + ["--protocols", protocol, "--splits", split])
    return parts


CHAIN_PARTS = (*STUDENT_METHODS, "baselines_a", "baselines_b")  # the table parts kvpop_table.sh writes for reproduce
CONTEXT_PART = "baselines_context"  # and with CONTEXT_BASELINES=1 (``context_rows``)


def salvage_parts(folder: Path, names: tuple[str, ...] = CHAIN_PARTS) -> bool:
    """Merge the table parts a chain killed in its table stage left in ``folder`` (``part_<name>.json``, one per
    of ``names``: :data:`CHAIN_PARTS`, and :data:`CONTEXT_PART` with ``context_rows``) into ``folder/kvpop_table.json``, as the chain would have, and remove them; returns
    whether it did. Each part is written before its first run and after every run, so a killed part lists what it
    did not reach under ``not_run``; but a part that never started left no file and its runs would be listed
    nowhere, so nothing is merged unless every part is there (the chain then runs again)."""
    parts = [folder / f"part_{name}.json" for name in names]
    if not all(p.is_file() for p in parts):
        return False
    merged = merge_results([read_results(p) for p in parts], "benchmarks/device/kvpop_table.sh (killed in its table "
                           "stage; its parts merged by kvlearn reproduce --resume)")
    write_results(folder / "kvpop_table.json", merged)
    for p in parts:
        p.unlink()
        p.with_suffix(".png").unlink(missing_ok=True)
    return True


def finishable(config: ReproduceConfig, budget: int) -> bool:
    """Whether the budget's table lacks some runs and :func:`finish_budget` can measure every one of them."""
    runs = missing_runs(read_results(budget_table(config, budget)))
    return bool(runs) and finish_parts(config, budget, runs) is not None


def finish_budget(config: ReproduceConfig, budget: int, run: Callable[..., subprocess.CompletedProcess],
                  runs: list[tuple[str, str, str]] | None = None) -> bool:
    """Measure only the runs the budget's table lacks (``runs``, default :func:`missing_runs`), with the students the chain trained,
    and merge each part into the table as soon as it is written (a part's rows replace the table's incomplete ones;
    a run it measured leaves ``not_run``), so that a call cut short keeps what it finished. Returns whether the table
    is now :func:`finished`; False at once (nothing run) when only the whole chain can finish it (not
    :func:`finishable`)."""
    table_path = budget_table(config, budget)
    runs = missing_runs(read_results(table_path)) if runs is None else runs
    parts = None if runs is None else finish_parts(config, budget, runs)
    if not parts:
        return False
    model = teacher_of(config)
    for i, options in enumerate(parts):
        part = table_path.with_name(f"finish_{i}.json")
        part.unlink(missing_ok=True)
        command = [sys.executable, str(repo_root() / TABLE_SCRIPT), "--model", model,
                   "--n-per-task", str(config.n_per_task), "--device", config.device, "--budgets", str(budget),
                   *shlex.split(config.table_args), *options, "--out", str(part), "--plot", str(part.with_suffix(".png"))]
        print(f"    finishing budget {budget}: {TABLE_SCRIPT} {' '.join(options)}", flush=True)
        with open(table_path.with_name(f"finish_{i}.log"), "w") as log:
            run(command, cwd=repo_root(), env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT, check=False)
        if part.is_file():
            table = read_results(table_path)
            merged = merge_results([table, read_results(part)], table["command"], across_runs=True)
            write_results(table_path, merged)
            part.unlink()
            part.with_suffix(".png").unlink(missing_ok=True)
    return finished(read_results(table_path))


def compare_tables(rows: list[dict], reference: list[dict]) -> list[dict]:
    """Per ``(method, protocol, split, budget)`` the mean accuracy of ``rows`` (a reproduction) and of ``reference``
    (the table of record) over the task families both measured, with each side's student checkpoint (``model``),
    in the order of ``rows``. The full cache is one method whatever its label (``teacher``, ``dense``) and
    whatever its budget field. Runs only one side measured are left out. ``shared_budgets`` /
    ``reference_shared_budgets``: every budget that side's student checkpoint serves (its rows' ``model``), when it
    serves more than one (one student trained at one budget and served at others: not the same experiment as a
    student trained for each budget), else ``None``."""
    def groups(table: list[dict]) -> dict:
        out: dict = {}
        for r in table:
            if "error" in r or r.get("incomplete"):
                continue
            full = r["method"] in FULL_CACHE_LABELS
            key = ("teacher" if full else r["method"], r.get("protocol", "bounded"), r.get("split", "eval"),
                   None if full else r.get("budget"))
            student = None if full or r.get("model") in (None, "teacher") else r.get("model")
            out.setdefault(key, {"tasks": {}, "model": student})["tasks"][r["task"]] = r["accuracy"]
        return out

    def served(grouped: dict) -> dict:  # student checkpoint -> the budgets its runs serve
        out: dict = {}
        for key, g in grouped.items():
            if g["model"] is not None:
                out.setdefault(g["model"], set()).add(key[3])
        return out

    def shared(budgets_of: dict, model) -> list | None:
        budgets = budgets_of.get(model, set())
        return sorted(budgets, reverse=True) if len(budgets) > 1 else None

    mine, theirs = groups(rows), groups(reference)
    mine_served, theirs_served = served(mine), served(theirs)
    compared = []
    for key, g in mine.items():
        if key not in theirs:
            continue
        tasks = [t for t in g["tasks"] if t in theirs[key]["tasks"]]
        if not tasks:
            continue
        a = sum(g["tasks"][t] for t in tasks) / len(tasks)
        b = sum(theirs[key]["tasks"][t] for t in tasks) / len(tasks)
        compared.append({"method": key[0], "protocol": key[1], "split": key[2], "budget": key[3], "tasks": tasks,
                         "accuracy": round(a, 4), "reference_accuracy": round(b, 4), "difference": round(a - b, 4),
                         "model": g["model"], "reference_model": theirs[key]["model"],
                         "shared_budgets": shared(mine_served, g["model"]),
                         "reference_shared_budgets": shared(theirs_served, theirs[key]["model"])})
    return compared


def shared_note(c: dict) -> str:
    """A compared row's note when the two sides differ in serving one student at several budgets (empty when they
    do not: then the row compares like with like)."""
    if c.get("shared_budgets") == c.get("reference_shared_budgets"):
        return ""
    return "; ".join(f"{side}: one student serves budgets {', '.join(map(str, c[key]))}"
                     for side, key in (("this run", "shared_budgets"), ("of record", "reference_shared_budgets"))
                     if c.get(key))


def comparison_text(compared: list[dict], reference: str) -> str:
    """:func:`compare_tables`'s rows as a fixed-width table for the terminal."""
    lines = [f"against {reference} (mean accuracy over the families both measured):",
             f"{'method':<16}{'protocol':<9}{'split':<9}{'budget':>7}{'this run':>10}{'of record':>11}{'diff':>8}"]
    for c in compared:
        note = shared_note(c)
        lines.append(f"{c['method']:<16}{c['protocol']:<9}{c['split']:<9}{str(c['budget'] or 'full'):>7}"
                     f"{c['accuracy']:>10.3f}{c['reference_accuracy']:>11.3f}{c['difference']:>+8.3f}"
                     + (f"  ({note})" if note else ""))
    return "\n".join(lines)


def command_of(config: ReproduceConfig) -> str:
    """The ``kvlearn reproduce kvpop`` command line of ``config`` (recorded in the merged table)."""
    parts = ["kvlearn reproduce kvpop", f"--out {portable_path(config.out)}",
             f"--budgets {','.join(map(str, config.budgets))}",
             f"--steps {config.steps}" if config.steps is not None else f"--minutes {config.minutes}",
             f"--n-per-task {config.n_per_task}", f"--device {config.device}"]
    if config.model:
        parts.append(f"--model {portable_path(config.model)}")
    for name, value in (("--retrofit-args", config.retrofit_args), ("--table-args", config.table_args)):
        if value:
            parts.append(f"{name} '{value}'")
    if config.students != tuple(STUDENT_METHODS):
        parts.append(f"--students {','.join(config.students)}")
    if config.context_rows:
        parts.append("--context-rows")
    if config.dms_scope != "head":
        parts.append(f"--dms-scope {config.dms_scope}")
    if config.resume:
        parts.append("--resume")
    return " ".join(parts)


def reproduce_kvpop(config: ReproduceConfig, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Path:
    """Run every budget's chain (``run`` is :func:`subprocess.run`'s signature, replaceable in tests), then merge
    the tables that were written into ``out/kvpop_table.json`` (and its plot); returns that path. A budget whose
    chain wrote no table is named in the merged file's ``not_run``; none at all is a one-line error."""
    chain = repo_root() / CHAIN
    check(chain.is_file(), f"{chain} is missing: `kvlearn reproduce` runs the repository's Table 1 chain, so it needs "
                           "the repository checkout (the README's editable install)")
    out = Path(config.out)
    (out / "students").mkdir(parents=True, exist_ok=True)
    settings_file = out / SETTINGS
    settings = config.settings()
    if config.resume and settings_file.is_file():
        earlier = {"dms_scope": "model", **json.loads(settings_file.read_text())}  # a folder from before the setting
        changed = sorted(k for k in set(earlier) | set(settings) if earlier.get(k) != settings.get(k))
        check(not changed, f"--resume: {', '.join(f'{k}={settings.get(k)!r}' for k in changed)} differ from "
                           f"the earlier run's {', '.join(f'{k}={earlier.get(k)!r}' for k in changed)} "
                           f"({settings_file}): resume with the same settings, or start a new --out")
    if config.resume:
        check_one_device(config)
    settings_file.write_text(json.dumps(settings, indent=1) + "\n")
    written, missing = {}, []  # budget -> its table; budgets whose chain wrote none
    for i, budget in enumerate(config.budgets):
        table = budget_table(config, budget)
        say = f"[{i + 1}/{len(config.budgets)}] budget {budget}:"
        names = (*CHAIN_PARTS, CONTEXT_PART) if config.context_rows else CHAIN_PARTS
        if config.resume and not table.is_file() and salvage_parts(table.parent, names):
            print(f"{say} merged the table parts a killed chain left", flush=True)
        if config.resume and table.is_file() and resume_budget(config, budget, run, say):
            written[budget] = table
            continue
        print(f"{say} {len(config.students)} retrofit(s) of {length_of(config)}, then the table "
              f"(log: {out / f'budget{budget}.log'})", flush=True)
        table.unlink(missing_ok=True)  # a chain that fails now must not leave an earlier run's table standing
        for stale in table.parent.glob("part_*"):  # nor an earlier chain's parts for salvage_parts to mix with its own
            stale.unlink()
        with open(out / f"budget{budget}.log", "w") as log, retrofit_progress(config, budget, config.students):
            run(["bash", str(chain)], cwd=repo_root(), env={**os.environ, **budget_env(config, budget)},
                stdout=log, stderr=subprocess.STDOUT, check=False)
        if table.is_file():
            written[budget] = table
        else:
            missing.append(budget)
    check(written, f"no budget's chain wrote a table: see the logs in {out}")
    if config.resume:  # the folder's other budgets, from earlier runs with the same settings, stay in its table
        for budget, table in earlier_budgets(config).items():
            print(f"budget {budget}: merged from an earlier run in {out} (not in --budgets)", flush=True)
            written[budget] = table
    return write_merged(config, written, missing, command_of(config))


def merge_folder(out: str) -> Path:
    """``kvlearn reproduce kvpop --merge-only``: merge every budget table the folder ``out`` holds into
    ``out/kvpop_table.json`` (and its plot, the comparison, the students' steps), running nothing, so it needs no GPU
    (e.g. a folder copied back from the device). Returns that path; a folder without a budget table is a one-line
    error."""
    folder = Path(out)
    check(folder.is_dir(), f"out={out!r} is not a folder: expected the --out of an earlier kvlearn reproduce kvpop run")
    tables = folder_tables(folder)
    check(tables, f"out={out!r} holds no budget table (budget<B>/kvpop_table.json): nothing to merge")
    config = ReproduceConfig(out=out, budgets=tuple(tables), resume=True)
    return write_merged(config, tables, [], f"kvlearn reproduce kvpop --out {out} --merge-only")


def write_merged(config: ReproduceConfig, written: dict[int, Path], missing: list[int], command: str) -> Path:
    """Merge the budget tables ``written`` (budget -> table) into ``out/kvpop_table.json`` with its plot, name the
    budgets in ``missing`` (their chain wrote no table) and the students not trained yet under ``not_run``, print
    the comparison with the table of record and the students' steps; returns the path."""
    from ..eval.plots import plot_pareto

    out = Path(config.out)
    parts = {budget: read_results(table) for budget, table in written.items()}
    merged = merge_results(list(parts.values()), command,
                           across_runs=config.resume)  # resumed budgets may come from other commits
    # each budget has its own four students under the same labels: name them per budget (a union by label kept one)
    merged["students"] = {str(b): part["students"] for b, part in parts.items() if part.get("students")}
    not_run = ([f"every run at B={b} (its chain failed: see its log)" for b in missing]
               + [f"every run of student {label} at B={b} (not trained yet: a later --resume run with it in "
                  "--students adds it)" for b, part in parts.items() for label in students_missing(part)])
    if not_run:
        merged["not_run"] = merged.get("not_run", []) + not_run
        merged["complete"] = False
    committed = repo_root() / COMMITTED_TABLE
    if committed.is_file():
        merged["reproduces"] = str(COMMITTED_TABLE)
    merged["student_steps"] = student_steps(config, tuple(written))
    merged["dms_scope"] = config.dms_scope
    path = write_results(out / "kvpop_table.json", merged)
    plot_pareto(merged["rows"], out / "kvpop_table.png", title="KVpop Table 1 on the testbed (kvlearn reproduce kvpop)")
    if committed.is_file():
        print(comparison_text(compare_tables(merged["rows"], read_results(committed)["rows"]), str(COMMITTED_TABLE)))
    for budget, steps in merged["student_steps"].items():  # in minutes the device decides the steps: say how many
        print(f"students' optimizer steps at budget {budget}: "
              + ", ".join(f"{label} {n}" for label, n in steps.items()))
    short = short_students(merged["student_steps"])
    if short:
        print(f"not like for like with {COMMITTED_TABLE}, whose students trained {STEPS_OF_RECORD:,} steps each: "
              + "; ".join(f"{label} at {budget} ({n} steps)" for budget, label, n in short)
              + f" (--steps {STEPS_OF_RECORD}, the default, gives every student the steps of record)")
    scope = dms_scope_note(merged)
    if scope:
        print(scope)
    return path


def record_dms_scope() -> str:
    """The compression scope of the table of record's DMS students: its ``dms_scope`` (written by ``python -m
    kvlearn.results merge --set dms_scope=...`` when its DMS rows are replaced), :data:`LEGACY_DMS_SCOPE` for a file
    without one, or when there is no committed table (an installed copy)."""
    from ..results import read_results, repo_root

    try:
        return read_results(repo_root() / COMMITTED_TABLE).get("dms_scope", LEGACY_DMS_SCOPE)
    except (OSError, ValueError):
        return LEGACY_DMS_SCOPE


def dms_scope_note(table: dict, record_scope: str | None = None) -> str:
    """A line when ``table`` (a reproduction) has DMS rows trained in another compression scope than the table of
    record's (``record_scope``, default :func:`record_dms_scope`); a table without ``dms_scope`` predates the setting
    and used :data:`LEGACY_DMS_SCOPE`. ``""`` otherwise."""
    record = record_dms_scope() if record_scope is None else record_scope
    scope = table.get("dms_scope", LEGACY_DMS_SCOPE)
    if scope == record or not any(r.get("method") == "dms" for r in table.get("rows", [])):
        return ""
    return (f"DMS not like for like with {COMMITTED_TABLE}: this run's DMS students trained in the {scope} scope, the "
            f"record's in the {record} scope (--dms-scope {record} rebuilds the record's recipe)")


def short_students(steps: dict[str, dict[str, int]]) -> list[tuple[str, str, int]]:
    """``(budget, label, steps)`` of every student that trained fewer optimizer steps than the students of record
    (:data:`STEPS_OF_RECORD`), from :func:`student_steps`' ``{budget: {label: steps}}``: their rows are not a like
    for like reproduction (a ``--minutes`` run on a GPU too slow for the slower methods' steps)."""
    return [(budget, label, n) for budget, by_label in steps.items() for label, n in by_label.items()
            if n < STEPS_OF_RECORD]


def student_steps(config: ReproduceConfig, budgets: tuple[int, ...] | None = None) -> dict[str, dict[str, int]]:
    """``{budget: {student: steps}}``: the optimizer steps each budget's students trained (``budgets``, default
    ``config.budgets``), from the last line of their ``train_log.jsonl`` in ``out/students/`` (a student with no log
    is left out). In ``--minutes`` the device decides them (four students share one GPU), so a reproduction states
    them next to its accuracies."""
    found: dict[str, dict[str, int]] = {}
    for budget in config.budgets if budgets is None else budgets:
        for label in STUDENT_METHODS:
            step = last_step(student_dir(config, budget, label).parent / "train_log.jsonl")
            if step is not None:
                found.setdefault(str(budget), {})[label] = step
    return found


def last_step(log: Path, since: float | None = None) -> int | None:
    """The ``step`` of the last whole line of a trainer's ``train_log.jsonl`` (the trainer may be writing the next
    one), read from the file's end; None when there is no log, no whole line yet, or (with ``since``, a
    :func:`time.time`) the log was last written before then, i.e. by an earlier run."""
    try:
        if since is not None and log.stat().st_mtime < since:
            return None
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            tail = f.read()
    except FileNotFoundError:
        return None
    for line in reversed(tail.split(b"\n")):  # a line the 8 KiB cut through is no JSON object either
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # an empty, cut or partly written line
    return None


def retrofit_progress(config: ReproduceConfig, budget: int, labels: tuple[str, ...] | list[str]) -> "RetrofitProgress":
    """The bar over the retrofits of students ``labels`` at ``budget`` (their logs where the chain puts them,
    :func:`student_dir`), of ``steps x students`` steps when the run is in steps."""
    return RetrofitProgress([student_dir(config, budget, label).parent / "train_log.jsonl" for label in labels],
                            total=config.steps * len(labels) if config.steps is not None else None,
                            desc=f"budget {budget}: {len(labels)} retrofit(s)")


class RetrofitProgress:
    """A progress bar over a chain's retrofits while it runs (the chain writes to its log, not the terminal): a
    thread reads the last step of each student's ``train_log.jsonl`` every ``interval`` seconds (logs an earlier run
    left are not counted) and shows their sum, of ``total`` (steps x students, or None in minutes). Use as a context
    manager around the chain; on leaving, it shows the final count and closes. ``disable=None``: tqdm's rule (no bar
    when the output is not a terminal)."""

    def __init__(self, logs: list[Path], total: int | None, desc: str, interval: float = 5.0,
                 disable: bool | None = None, file=None):
        self.logs, self.total, self.desc, self.interval = list(logs), total, desc, interval
        self.disable, self.file = disable, file
        self._stop = threading.Event()

    def steps(self) -> int:
        """The students' steps so far, summed (0 for a student whose retrofit has not logged a step yet)."""
        return sum(last_step(log, since=self.started) or 0 for log in self.logs)

    def _show(self) -> None:
        self.bar.n = self.steps()
        self.bar.refresh()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self._show()

    def __enter__(self) -> "RetrofitProgress":
        from tqdm.auto import tqdm

        self.started = time.time() - 1.0  # a file system's coarse mtime must not hide a log written at once
        self.bar = tqdm(total=self.total, desc=self.desc, unit="step", disable=self.disable, file=self.file,
                        dynamic_ncols=True)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._show()
        self.bar.close()
