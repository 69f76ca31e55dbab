"""The retrofit trainer under ``torchrun`` with FSDP2 (2 processes, gloo, CPU) takes the same steps as one process on
the whole batch, for KVpop and for StreamingLLM+: equal loss terms at every step and equal final weights (float32,
tiny random GQA Qwen3). The
single-process run is the reference; the 2-process run shards the student and the teacher per decoder layer and
splits every batch's rows. On a machine with two GPUs the same comparison runs under NCCL (``-m gpu``), where bf16
autocast makes the two runs round differently, so it is held to bf16 tolerances and to the size of the update."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun import run_two_processes

from kvlearn import KVLearnError
from kvlearn.testbed.data import shard_rows
from kvlearn.train.distill import LOG_FILE, RetrofitConfig, retrofit

SETTINGS = dict(kvpop=dict(sinks=4, window=16, topk=32, scorer="mlp"), steps=3, batch_size=4, seq_len=128,
                save_interval=2, queries_per_step=16, warmup_steps=1, lr=1e-3, lr_new=1e-2)

# the mLSTM scorer under the readout penalty (Table 1's mLSTM recipe): the penalty reads the readout weights, which
# FSDP2 holds sharded outside the forward
MLSTM_PENALTY = {**SETTINGS, "kvpop": dict(sinks=4, window=16, topk=32, scorer="mlstm"), "readout_penalty": 30.0}

# the scorers also trained through the distillation loss (the straight-through soft retention on sampled rows)
SCORER_KD = {**SETTINGS, "scorer_kd": 1.0, "scorer_kd_queries": 16}

# streaming_plus: no added modules, no noise (DMS's Gumbel noise is drawn per process's rows, so it is not compared)
STREAMING_PLUS = {**{k: v for k, v in SETTINGS.items() if k != "kvpop"}, "method": "streaming_plus",
                  "streaming": dict(budget=36, sinks=4)}

# the driver also checks that no sharded module is alive when the trainer leaves the process group: one collected
# only at interpreter exit destroys the gloo group there, and a rank aborted ("terminate called without an active
# exception") in CI
DRIVER = """
import gc, json, sys
from torch.distributed.fsdp import FSDPModule
from kvlearn.train import parallel
from kvlearn.train.distill import RetrofitConfig, retrofit
close = parallel.close_distributed
def checked_close(d):
    close(d)
    alive = sum(isinstance(o, FSDPModule) for o in gc.get_objects())
    assert alive == 0, f"{alive} sharded modules outlive the process group"
parallel.close_distributed = checked_close
settings = json.loads(sys.argv[3])
retrofit(RetrofitConfig(model=sys.argv[1], out=sys.argv[2], **settings), progress=False)
"""


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]


def _single_and_two_processes(teacher_path: str, tmp_path: Path, settings: dict) -> tuple[Path, Path]:
    """One process on the whole batch (``single/``), then 2 processes under ``torchrun`` (``fsdp/``)."""
    single = tmp_path / "single"
    retrofit(RetrofitConfig(model=teacher_path, out=str(single), **json.loads(json.dumps(settings))), progress=False)
    sharded = tmp_path / "fsdp"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run = run_two_processes(str(driver), teacher_path, str(sharded), json.dumps(settings))
    assert run.returncode == 0, run.stderr[-3000:]
    return single, sharded


@pytest.mark.parametrize("settings", [SETTINGS, MLSTM_PENALTY, SCORER_KD, STREAMING_PLUS],
                         ids=["kvpop", "kvpop_mlstm_readout_penalty", "kvpop_scorer_kd", "streaming_plus"])
def test_two_gloo_processes_equal_one(teacher_path, tmp_path, settings):
    single, sharded = _single_and_two_processes(teacher_path, tmp_path, settings)
    one, two = _log(single), _log(sharded)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    keys = ("loss", "kd", "boundary") if "kvpop" in settings else ("loss", "kd")
    if "readout_penalty" in settings:
        keys += ("readout_penalty",)
        assert one[0]["readout_penalty"] == 0 and all(r["readout_penalty"] > 0 for r in one[1:])  # a starts at 0
    for a, b in zip(one, two):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    # the same final weights, written once in the single-process format, and the same optimizer state layout
    w1, w2 = load_file(single / "final" / "model.safetensors"), load_file(sharded / "final" / "model.safetensors")
    assert w1.keys() == w2.keys() and any(".kvpop." in k for k in w1) == ("kvpop" in settings)
    # the scorer's output bias (the MLP's b2, the mLSTM's b) shifts every priority of a head alike, so the pairwise
    # boundary loss does not see it: its gradient is round-off, which Adam scales up to steps of size lr_new in either
    # run; it is left out
    compared = [k for k in w1 if not k.endswith(("scorer.b2", "scorer.b"))]
    assert len(compared) == len(w1) - (2 if "kvpop" in settings else 0)
    for k in compared:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)
    s1 = torch.load(single / "final" / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    s2 = torch.load(sharded / "final" / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    assert s1.keys() == s2.keys()
    assert sorted(p.name for p in sharded.iterdir()) == sorted(p.name for p in single.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)")
def test_two_nccl_processes_on_two_gpus_equal_one_gpu(teacher_path, tmp_path):
    """KVpop (MLP scorer) on ``cuda:0`` alone against FSDP2 over ``cuda:0`` and ``cuda:1`` (NCCL). Under bf16 autocast
    the two runs round differently (different matmul shapes per process), so the loss terms agree to bf16 precision,
    not bit for bit; the gradient norm catches a wrong gradient average (Adam itself is blind to a scale), and the
    final weights' difference is measured against the update the runs made (a parameter the sharded run failed to
    update, or updated from the wrong rows, differs by the size of its update)."""
    settings = {**SETTINGS, "device": "cuda"}
    single, sharded = _single_and_two_processes(teacher_path, tmp_path, settings)
    one, two = _log(single), _log(sharded)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in ("loss", "kd", "boundary"):
            assert b[key] == pytest.approx(a[key], rel=2e-2, abs=1e-4), (a["step"], key, a[key], b[key])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2), (a["step"], a["grad_norm"], b["grad_norm"])
    w0 = load_file(str(Path(teacher_path) / "model.safetensors"))
    w1, w2 = load_file(single / "final" / "model.safetensors"), load_file(sharded / "final" / "model.safetensors")
    assert w1.keys() == w2.keys()
    shared = [k for k in w1 if k in w0]
    assert len(shared) >= len(w0) - 1  # the teacher's weights (a tied lm_head may be dropped)
    update = torch.cat([(w1[k].float() - w0[k].float()).flatten() for k in shared])
    disagreement = torch.cat([(w2[k].float() - w1[k].float()).flatten() for k in shared])
    assert update.norm() > 0
    ratio = (disagreement.norm() / update.norm()).item()
    print(f"loss terms per step (one / two): {[(a['loss'], b['loss']) for a, b in zip(one, two)]}; "
          f"|w2 - w1| / |w1 - w0| = {ratio:.4f}")
    assert ratio < 0.25, ratio


def test_row_shards_cover_the_batch_once():
    assert [list(shard_rows(6, i, 3)) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(KVLearnError, match="batch_size=5 is invalid for 2 processes"):
        shard_rows(5, 0, 2)
