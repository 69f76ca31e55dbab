"""``kvlearn kaizen-train --recipe`` (``kvlearn.train.kaizen_recipes``): a recipe of record fills every option the
command line leaves out, options given win, no recipe leaves ``KaizenTrainConfig``'s defaults, and each recipe equals
the flags of the device runs it names (read from the committed device log, an independent record of what ran).
Tiny random GQA Qwen3 teacher (2 KV heads, 2 query heads each); the trainer is replaced by a recorder of its config,
except for one 1-step run that makes a selector to refine."""

import re
import shlex
from dataclasses import asdict
from pathlib import Path

import pytest

from kvlearn import KVLearnError, cli
from kvlearn.train import kaizen_train as kaizen_module
from kvlearn.train.kaizen_recipes import FIRST_STAGE, KAIZEN_RECIPES, kaizen_recipe, recipe_options
from kvlearn.train.kaizen_train import KaizenTrainConfig

REPO = Path(__file__).resolve().parents[2]
DEVICE_LOG = REPO / "results" / "raw" / "device_stdout_session54_h100_99bb045.log"


@pytest.fixture(scope="module")
def refinable(make_teacher, tmp_path_factory):
    """``(teacher, final)``: a tiny teacher and the final/ of a 1-step 8x kaizen-train run from it (all layers may
    share), the folder an 8x-refine starts from."""
    teacher = make_teacher(2, 4)
    out = tmp_path_factory.mktemp("first8x")
    result = kaizen_module.kaizen_train(KaizenTrainConfig(model=teacher, out=str(out), targets=(8.0,), steps=1,
                                                          batch_size=2, seq_len=128, device="cpu"), progress=False)
    return teacher, result["final"]


@pytest.fixture
def configs(monkeypatch):
    got = []
    monkeypatch.setattr(kaizen_module, "kaizen_train", lambda c: got.append(c) or {"final": "f", "step": 0})
    return got


def train_cli(configs, teacher, out, *args) -> KaizenTrainConfig:
    assert cli.main(["kaizen-train", "--model", teacher, "--out", str(out), "--device", "cpu", "--seq-len", "128",
                     *args]) == 0
    return configs[-1]


def fields(config: KaizenTrainConfig) -> dict:
    return {k: v for k, v in asdict(config).items() if k != "out"}


def test_a_recipe_fills_every_option_left_out_and_equals_its_options(refinable, configs, tmp_path):
    teacher, final = refinable
    for name in KAIZEN_RECIPES:
        extra = ["--init-student", final] if name in FIRST_STAGE else []
        config = train_cli(configs, teacher, tmp_path / name, "--recipe", name, *extra)
        for field, value in kaizen_recipe(name).items():
            assert getattr(config, field) == value, (name, field)
        assert config.minutes is None
        # the same run spelled out as options (the help's and the docs' text of the recipe)
        spelled = train_cli(configs, teacher, tmp_path / f"{name}-spelled", *recipe_options(name).split(), *extra)
        assert fields(spelled) == fields(config)
    assert kaizen_recipe("8x") == {"targets": (8.0,), "dense_fraction": 0.25, "underuse_weight": 1.0,
                                   "share_layers": "auto", "share_threshold": 0.2, "lr": 1e-4, "ema_decay": 0.998,
                                   "family_weights": (2.0, 1.0, 1.0, 1.0), "steps": 4000}


def test_the_first_stage_prints_the_command_of_the_second(refinable, configs, tmp_path, capsys):
    """``--recipe 8x`` ends by printing the ``8x-refine`` command from its final/ with the next seed; that command,
    run as printed, gives the refinement's config. Other runs print no second stage."""
    teacher, final = refinable
    capsys.readouterr()
    train_cli(configs, teacher, tmp_path / "first", "--recipe", "8x", "--seed", "4")
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("the recipe's second stage: ")]
    words = shlex.split(line.removeprefix("the recipe's second stage: "))
    assert words[:4] == ["kvlearn", "kaizen-train", "--recipe", "8x-refine"] and "--seed" in words
    assert words[words.index("--seed") + 1] == "5" and words[words.index("--init-student") + 1] == "f"
    words[words.index("--init-student") + 1] = final  # the recorder's stand-in final/ replaced by a real one
    assert cli.main(words[1:] + ["--seq-len", "128"]) == 0
    config = configs[-1]
    assert (config.init_student, config.seed, config.steps, config.tau_start, config.out) == (
        final, 5, 3000, 0.1, str(tmp_path / "first") + "-refined")
    train_cli(configs, teacher, tmp_path / "plain", "--steps", "3")
    train_cli(configs, teacher, tmp_path / "refine", "--recipe", "8x-refine", "--init-student", final, "--seed", "5")
    assert "second stage" not in capsys.readouterr().out


def test_options_given_win_over_the_recipe(make_teacher, configs, tmp_path):
    teacher = make_teacher(2, 4)
    config = train_cli(configs, teacher, tmp_path / "a", "--recipe", "8x", "--lr", "1e-5", "--share-layers", "all",
                       "--ema-decay", "0", "--target", "4", "--dense-fraction", "0.75", "--steps", "10")
    assert (config.lr, config.share_layers, config.ema_decay, config.targets, config.dense_fraction, config.steps) \
        == (1e-5, None, 0.0, (4.0,), 0.75, 10)
    assert config.underuse_weight == 1.0 and config.family_weights == (2.0, 1.0, 1.0, 1.0)  # still the recipe's
    assert config.share_threshold == KaizenTrainConfig.share_threshold  # the recipe's 0.2 went with its "auto"
    config = train_cli(configs, teacher, tmp_path / "c", "--recipe", "8x", "--share-threshold", "0.1")
    assert (config.share_layers, config.share_threshold) == ("auto", 0.1)
    config = train_cli(configs, teacher, tmp_path / "b", "--recipe", "8x", "--minutes", "2")
    assert (config.minutes, config.steps) == (2.0, None)  # minutes replace the recipe's steps


def test_without_a_recipe_the_config_keeps_its_defaults(make_teacher, configs, tmp_path):
    """The options a recipe may set default to None on the command line: left out, they must leave exactly
    ``KaizenTrainConfig``'s defaults (as before the recipes)."""
    teacher = make_teacher(2, 4)
    config = train_cli(configs, teacher, tmp_path / "a")
    assert fields(config) == fields(KaizenTrainConfig(model=teacher, out=str(tmp_path / "a"), device="cpu",
                                                      seq_len=128))
    assert (config.targets, config.dense_fraction, config.underuse_weight, config.share_layers, config.ema_decay,
            config.steps) == ((4.0,), 0.75, 0.0, None, 0.0, 1000)


def test_the_recipes_are_the_flags_of_the_device_runs_they_name(refinable, configs, tmp_path):
    """Session 54's device log records the two calls of the 8x recipe of record: ``kaizen_table.sh`` with TARGETS,
    TRAIN_STEPS and TRAIN_ARGS (which the script passes to kaizen-train as ``--target T --steps N TRAIN_ARGS``).
    Those flags give the config ``--recipe 8x`` gives, and the second call's (the carried export replaced by a
    local final/) the config of ``--recipe 8x-refine``."""
    teacher, final = refinable
    calls = re.findall(r"^## g=.*?\*\) (.*? bash benchmarks/device/kaizen_table\.sh)", DEVICE_LOG.read_text(), re.M)
    assert len(calls) == 2, calls
    for command, name in zip(calls, ("8x", "8x-refine")):
        env = dict(word.split("=", 1) for word in shlex.split(command) if "=" in word.split("--")[0][:40])
        args = ["--target", env["TARGETS"], "--steps", env["TRAIN_STEPS"], *shlex.split(env["TRAIN_ARGS"])]
        args = [final if a.startswith("carry_eval/") else a for a in args]
        recorded = train_cli(configs, teacher, tmp_path / f"{name}-recorded", *args)
        extra = ["--init-student", final] if name in FIRST_STAGE else []
        assert fields(train_cli(configs, teacher, tmp_path / name, "--recipe", name, *extra)) == fields(recorded)


def test_bad_recipes_are_one_line_errors(make_teacher, configs, tmp_path, capsys):
    teacher = make_teacher(2, 4)
    base = ["kaizen-train", "--model", teacher, "--out", str(tmp_path / "x"), "--device", "cpu", "--seq-len", "128"]
    capsys.readouterr()
    assert cli.main([*base, "--recipe", "8x-refine"]) == 2
    err = capsys.readouterr().err
    assert "--recipe 8x-refine continues a trained selector: give --init-student FOLDER (the final/ of a --recipe 8x " \
           "run" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):
        cli.main([*base, "--recipe", "16x"])
    assert "invalid choice: '16x' (choose from 8x, 8x-refine)" in capsys.readouterr().err.replace("'8x'", "8x") \
        .replace("'8x-refine'", "8x-refine")
    with pytest.raises(KVLearnError, match="recipe '16x' is unknown: expected one of 8x, 8x-refine"):
        kaizen_recipe("16x")
    assert configs == []


def test_the_device_script_trains_the_recipes_as_the_next_device_calls_name_them(refinable, configs, tmp_path):
    """``benchmarks/device/kaizen_table.sh`` with ``TRAIN_ARGS='--recipe 8x'`` (then ``'--recipe 8x-refine
    --init-student ...'``) and its own ``--target`` / ``--steps`` from TARGETS / TRAIN_STEPS: the kaizen-train command
    it writes (DRY_RUN=1), run on the CPU with the tiny teacher, gets every setting of the recipe and the seed."""
    import os
    import subprocess

    teacher, final = refinable
    for name, seeds, steps, extra in (("8x", "3", "4000", ""), ("8x-refine", "32", "3000", f" --init-student {final}")):
        out = tmp_path / name
        env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "PYTHONPATH": str(REPO / "src"), "TARGETS": "8",
               "SEEDS": seeds, "TRAIN_STEPS": steps, "BASELINE_PARTS": "none", "TRAIN_ARGS": f"--recipe {name}{extra}"}
        run = subprocess.run(["bash", "benchmarks/device/kaizen_table.sh"], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        line = (out / f"kaizen_train_t8_s{seeds}.log").read_text().strip()
        words = shlex.split(line.removeprefix("dry run: python3 -m kvlearn.cli "))
        for option, value in (("--model", teacher), ("--seq-len", "128"), ("--device", "cpu")):
            words[words.index(option) + 1] = value
        assert cli.main(words) == 0
        config = configs[-1]
        for field, value in kaizen_recipe(name).items():
            assert getattr(config, field) == value, (name, field)
        assert config.seed == int(seeds) and config.init_student == (final if extra else None)
