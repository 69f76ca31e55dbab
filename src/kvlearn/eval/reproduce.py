"""``kvlearn reproduce kvpop``: the KVpop paper's Table 1 on the testbed, rebuilt from the committed teacher.

For each budget (default 1024, 512, 256: CR 75%, 88%, 94% at context 4096), one run of
``benchmarks/device/kvpop_table.sh`` (the repository's Table 1 chain): four students retrofitted side by side from
the teacher for ``minutes`` each with the measured recipes (KVpop with the MLP and with the mLSTM scorer, both on the
peak target from ``--decay-init 0.99999``, the mLSTM under ``--readout-penalty 30 --scorer-kd 1``, the chain's defaults;
StreamingLLM+; DMS), the window :func:`kvlearn.config.retrofit_window` gives (256 from budget 512 up, half the budget below),
then the table at that budget: the teacher, the students under the pattern each was trained for, and every
training-free baseline, both splits, ``n_per_task`` per family. The budgets run one after another (four
retrofits share the GPU at a time); their tables are merged into ``out/kvpop_table.json`` with its plot, and the
students' checkpoints stay in ``out/students/`` (``table_reproduce<budget>_<student>/final``).

Device time on one H200: about ``minutes + 4`` per budget, 27 minutes for the defaults. The chain is a shell script
of the repository checkout (the editable install the README sets up); ``retrofit_args`` / ``table_args`` pass more
options to every retrofit / table process (a CPU smoke run uses them for tiny shapes).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import retrofit_window
from ..errors import check, check_int
from ..results import merge_results, portable_path, read_results, repo_root, write_results

TABLE1_STUDENTS = "kvpop_mlp=kvpop kvpop=kvpop streaming_plus=streaming_plus dms=dms"
CHAIN = Path("benchmarks") / "device" / "kvpop_table.sh"
SETTINGS = "reproduce_settings.json"  # in out: the settings a --resume must match
EVAL_MINUTES = 4.0  # the table's share of a budget's run after the retrofits (n = 100, both splits, 6 parts)


@dataclass
class ReproduceConfig:
    """``out``: folder for the per-budget runs and the merged table; ``budgets``: tokens per KV head; ``minutes``:
    each retrofit's training time; ``steps``: instead, each retrofit's steps (the same for every method, however
    the shared GPU slows each; the table then gets ``EVAL_MINUTES``, and the run's time is not bounded); ``n_per_task``: examples per family and split; ``device``: ``cuda`` (``cpu`` for
    a smoke run); ``model``: the teacher's folder (default the committed one). ``resume``: keep every budget whose
    complete table an earlier run with the same settings left in ``out`` and run only the others, so that the
    budgets may run in separate sessions (e.g. device calls shorter than the whole run); the merge covers them all."""

    out: str = "runs/reproduce-kvpop"
    budgets: tuple[int, ...] = (1024, 512, 256)
    minutes: float = 5.0
    steps: int | None = None
    n_per_task: int = 100
    device: str = "cuda"
    model: str | None = None
    retrofit_args: str = ""
    table_args: str = ""
    overwrite: bool = False
    resume: bool = False

    def __post_init__(self) -> None:
        check(len(self.budgets) > 0, "budgets is empty: expected one or more budgets, e.g. 1024,512,256")
        for b in self.budgets:
            check_int("budget", b, 6)
        check(self.minutes > 0, f"minutes={self.minutes!r} is invalid: expected > 0")
        if self.steps is not None:
            check_int("steps", self.steps, 1)
        check_int("n_per_task", self.n_per_task, 1)
        check(self.device in ("cuda", "cpu"), f"device={self.device!r} is invalid: expected cuda or cpu")
        if self.model is not None:  # one-line errors for a missing folder, a file, an unsupported family
            from ..hf import read_model_config

            read_model_config(self.model)
        out = Path(self.out)
        check(not out.exists() or out.is_dir(), f"out={self.out!r} is a file: expected a folder")
        check(not (self.overwrite and self.resume),
              "--overwrite and --resume exclude each other: --resume keeps the finished budgets, --overwrite reruns "
              "them")
        check(self.overwrite or self.resume or not out.exists() or not any(out.iterdir()),
              f"out={self.out!r} already holds files: pass --overwrite to replace them, --resume to keep its finished "
              "budgets, or choose a new folder")

    def settings(self) -> dict:
        """What decides a budget's rows (all but ``out``, ``budgets`` and the two flags): a resumed run must match."""
        return {"minutes": self.minutes, "steps": self.steps, "n_per_task": self.n_per_task, "device": self.device,
                "model": self.model, "retrofit_args": self.retrofit_args, "table_args": self.table_args}


def budget_env(config: ReproduceConfig, budget: int) -> dict[str, str]:
    """The environment of ``kvpop_table.sh`` for one budget's run (its options are environment variables)."""
    return {
        "OUT": str(Path(config.out).resolve() / f"budget{budget}"),
        "TAG": f"_reproduce{budget}",
        "WORK_DIR": str(Path(config.out).resolve() / "students"),  # the retrofits' checkpoints, kept with the table
        "MODEL": config.model or str(repo_root() / "checkpoints" / "testbed-teacher"),
        "BUDGET": str(budget),
        "STUDENTS": TABLE1_STUDENTS,
        "RETROFIT_MINUTES": str(config.minutes),
        **({"RETROFIT_STEPS": str(config.steps), "TABLE_MINUTES": str(EVAL_MINUTES)} if config.steps is not None else {}),
        "TOTAL_MINUTES": str(round(config.minutes + EVAL_MINUTES, 2)),
        "N_PER_TASK": str(config.n_per_task),
        "DEVICE": config.device,
        "RETROFIT_ARGS": f"--window {retrofit_window(budget)} {config.retrofit_args}".strip(),
        "TABLE_ARGS": f"--budgets {budget} {config.table_args}".strip(),
    }


def finished(table: dict) -> bool:
    """Whether a budget's table is whole: no run cut by a time guard (``not_run``) and not marked incomplete."""
    return table.get("complete", True) is True and not table.get("not_run")


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
    if config.resume:
        parts.append("--resume")
    return " ".join(parts)


def reproduce_kvpop(config: ReproduceConfig, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Path:
    """Run every budget's chain (``run`` is :func:`subprocess.run`'s signature, replaceable in tests), then merge
    the tables that were written into ``out/kvpop_table.json`` (and its plot); returns that path. A budget whose
    chain wrote no table is named in the merged file's ``not_run``; none at all is a one-line error."""
    from ..eval.plots import plot_pareto

    chain = repo_root() / CHAIN
    check(chain.is_file(), f"{chain} is missing: `kvlearn reproduce` runs the repository's Table 1 chain, so it needs "
                           "the repository checkout (the README's editable install)")
    out = Path(config.out)
    (out / "students").mkdir(parents=True, exist_ok=True)
    settings_file = out / SETTINGS
    settings = config.settings()
    if config.resume and settings_file.is_file():
        earlier = json.loads(settings_file.read_text())
        changed = sorted(k for k in set(earlier) | set(settings) if earlier.get(k) != settings.get(k))
        check(not changed, f"--resume: {', '.join(f'{k}={settings.get(k)!r}' for k in changed)} differ from "
                           f"the earlier run's {', '.join(f'{k}={earlier.get(k)!r}' for k in changed)} "
                           f"({settings_file}): resume with the same settings, or start a new --out")
    settings_file.write_text(json.dumps(settings, indent=1) + "\n")
    tables, missing = [], []
    for i, budget in enumerate(config.budgets):
        table = out / f"budget{budget}" / "kvpop_table.json"
        if config.resume and table.is_file() and finished(read_results(table)):
            print(f"[{i + 1}/{len(config.budgets)}] budget {budget}: kept from the earlier run ({table})", flush=True)
            tables.append(table)
            continue
        length = f"{config.steps} steps" if config.steps is not None else f"{config.minutes} min"
        print(f"[{i + 1}/{len(config.budgets)}] budget {budget}: 4 retrofits of {length}, then the table "
              f"(log: {out / f'budget{budget}.log'})", flush=True)
        table.unlink(missing_ok=True)  # a chain that fails now must not leave an earlier run's table standing
        with open(out / f"budget{budget}.log", "w") as log:
            run(["bash", str(chain)], cwd=repo_root(), env={**os.environ, **budget_env(config, budget)},
                stdout=log, stderr=subprocess.STDOUT, check=False)
        (tables if table.is_file() else missing).append(table if table.is_file() else f"B={budget}")
    check(tables, f"no budget's chain wrote a table: see the logs in {out}")
    merged = merge_results([read_results(t) for t in tables], command_of(config),
                           across_runs=config.resume)  # resumed budgets may come from other commits
    if missing:
        merged["not_run"] = merged.get("not_run", []) + [f"every run at {m} (its chain failed: see its log)" for m in missing]
        merged["complete"] = False
    path = write_results(out / "kvpop_table.json", merged)
    plot_pareto(merged["rows"], out / "kvpop_table.png", title="KVpop Table 1 on the testbed (kvlearn reproduce kvpop)")
    return path
