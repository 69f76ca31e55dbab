"""The package's public API: training, evaluation and the method registry are reachable from ``kvlearn`` itself
(imported on first use, so ``import kvlearn`` stays light), and a retrofit runs from three lines of Python."""

import subprocess
import sys
from pathlib import Path

import torch
from benchmark_loader import load_benchmark

import kvlearn


def test_lazy_names_are_the_real_objects_and_are_listed():
    from kvlearn.eval.accuracy import EvalConfig, evaluate
    from kvlearn.methods import get_method, make_config
    from kvlearn.train.distill import RetrofitConfig, retrofit
    from kvlearn.train.kaizen_recipes import kaizen_recipe
    from kvlearn.train.kaizen_train import KaizenTrainConfig, kaizen_train

    real = {"RetrofitConfig": RetrofitConfig, "retrofit": retrofit, "KaizenTrainConfig": KaizenTrainConfig,
            "kaizen_train": kaizen_train, "kaizen_recipe": kaizen_recipe, "EvalConfig": EvalConfig, "evaluate": evaluate, "get_method": get_method,
            "make_config": make_config}
    for name, obj in real.items():
        assert getattr(kvlearn, name) is obj and name in kvlearn.__all__ and name in dir(kvlearn)
    try:
        kvlearn.retrofitt
    except AttributeError as e:
        assert "no attribute 'retrofitt'" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_import_kvlearn_imports_neither_torch_nor_the_trainers():
    """``import kvlearn`` and the JSON-only tools (the acceptance verdicts, the report) import neither torch nor
    transformers nor a trainer; the first public name used imports its module."""
    heavy = ('torch', 'transformers', 'kvlearn.train.distill', 'kvlearn.train.kaizen_train', 'kvlearn.eval.accuracy')
    code = ("import sys, kvlearn, kvlearn.eval.acceptance, kvlearn.eval.report; "
            f"print([m for m in {heavy!r} if m in sys.modules]); "
            "kvlearn.apply_kvpop; print('kvlearn.kvpop.apply' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split("\n")[:2] == ["[]", "True True"], out.stdout + out.stderr[-1000:]


def test_a_retrofit_from_three_lines_of_python(tmp_path):
    """``kvlearn.retrofit(kvlearn.RetrofitConfig(...))`` trains a KVpop student of a tiny random GQA teacher (2 KV
    heads, 2 query heads each) and ``kvlearn.load`` serves it back with its scorers."""
    step_timing = load_benchmark("step_timing")
    repo = Path(__file__).resolve().parents[1]
    teacher = step_timing.random_model_folder("tiny", tmp_path / "teacher", str(repo / "checkpoints" / "testbed-teacher"),
                                              torch.device("cpu"))
    config = kvlearn.RetrofitConfig(model=teacher, out=str(tmp_path / "student"), seq_len=256, batch_size=2,
                                    kvpop=kvlearn.KVpopConfig(sinks=4, window=16, topk=44), steps=2, device="cpu")
    summary = kvlearn.retrofit(config, progress=False)
    student = kvlearn.load(summary["final"])
    from kvlearn.kvpop.apply import has_kvpop

    assert has_kvpop(student) and summary["step"] == 2
