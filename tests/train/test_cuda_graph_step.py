"""The retrofit step replayed as one CUDA graph (``kvlearn.train.cuda_graph``, ``distill.GraphedRetrofitStep``,
``retrofit --cuda-graph-step``).

On the CPU, where CUDA graphs do not exist, the buffer protocol is checked with a capture that replays by running the
step function again: every step's batch, query positions and learning rates must reach the step through the static
buffers (a step that closed over the first batch, its draws or its learning rates would replay stale values), and the
run must equal the eager trainer's steps. On CUDA (``-m gpu``) the real graph is compared with the eager steps, and a
graphed retrofit, killed and resumed, with an eager one."""

from __future__ import annotations

import copy

import pytest
import torch
from benchmark_loader import load_benchmark

from kvlearn.config import KVpopConfig, StreamingConfig
from kvlearn.errors import KVLearnError
from kvlearn.ops import distill_loss
from kvlearn.train import cuda_graph, distill
from kvlearn.train.cuda_graph import EAGER_STEPS, plain_optimizer_groups, prepare_capturable
from kvlearn.train.distill import (GraphedRetrofitStep, RetrofitConfig, build_models, make_optimizer, train_step,
                                   training_kvpop)


def tiny_folder(tmp_path, device):
    script = load_benchmark("retrofit_step_speed")
    return script.random_model_folder("tiny", tmp_path / "tiny", str(script.REPO / "checkpoints" / "testbed-teacher"),
                                      device)


def tiny_config(folder, tmp_path, method="kvpop", scorer="mlp", device="cpu", **kw):
    method_kw = {"streaming": StreamingConfig(budget=64, sinks=4)} if method == "streaming_plus" else {}
    return RetrofitConfig(model=str(folder), out=str(tmp_path / "o"), batch_size=2, seq_len=256, device=device,
                          method=method, kvpop=KVpopConfig(sinks=4, window=16, topk=44, scorer=scorer), steps=8,
                          warmup_steps=3, **method_kw, **kw)


def batches(n, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 200, (2, 256), generator=gen)
        labels = ids.clone()
        labels[:, :100] = -100
        out.append((ids.to(device), labels.to(device)))
    return out


class RecordingCapture:
    """A capture for the CPU: returns the step function itself (a replay runs it again) and records when it was
    called."""

    def __init__(self):
        self.captured_at = []

    def __call__(self, device_part):
        self.captured_at.append(len(self.captured_at))
        return device_part


@pytest.mark.parametrize("method,scorer", [("kvpop", "mlp"), ("kvpop", "mlstm"), ("streaming_plus", "mlp")])
def test_buffers_carry_each_steps_inputs(tmp_path, method, scorer):
    """Six steps through ``GraphedRetrofitStep`` (3 eager, the capture, 3 replays-by-rerun) equal six eager
    ``train_step`` calls on a copy of the student, with a new batch every step and the learning rates in warm-up (so
    that a stale batch, stale query positions or a stale learning rate would show): the same logged values and
    weights. The capture happens once, at the fourth call."""
    device = torch.device("cpu")
    config = tiny_config(tiny_folder(tmp_path, device), tmp_path, method, scorer)
    torch.manual_seed(0)
    teacher, student = build_models(config, device)
    twin = copy.deepcopy(student)
    kv = training_kvpop(config, student)
    capture = RecordingCapture()
    graphed = GraphedRetrofitStep(config, teacher, student, make_optimizer(config, student, device), kv, device,
                                  capture=capture)
    eager_opt = make_optimizer(config, twin, device)
    for step, (ids, labels) in enumerate(batches(6, device)):
        got = graphed(ids, labels, step, step / config.steps)
        want = train_step(config, teacher, twin, eager_opt, ids, labels, step, step / config.steps, kv)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (step, k)
        assert graphed.graph.captured == (step >= EAGER_STEPS)
    assert capture.captured_at == [0]
    for (name, p), q in zip(student.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    changed = sum(not torch.equal(p, q) for p, q in zip(student.parameters(),
                                                        build_models(config, device)[1].parameters()))
    assert changed > 0  # the steps trained something (the comparison above is not of two untouched students)


def test_a_stale_batch_would_be_caught(tmp_path):
    """The check above fails for a step that reads its first batch forever (the mutation a real graph makes of a
    step that does not read the static buffers)."""
    device = torch.device("cpu")
    config = tiny_config(tiny_folder(tmp_path, device), tmp_path)
    torch.manual_seed(0)
    teacher, student = build_models(config, device)
    twin = copy.deepcopy(student)
    kv = training_kvpop(config, student)
    graphed = GraphedRetrofitStep(config, teacher, student, make_optimizer(config, student, device), kv, device,
                                  capture=RecordingCapture())
    eager_opt = make_optimizer(config, twin, device)
    data = batches(5, device)
    first = data[0]
    diffs = []
    for step, (ids, labels) in enumerate(data):
        got = graphed(*(first if step >= EAGER_STEPS else (ids, labels)), step, step / config.steps)
        want = train_step(config, teacher, twin, eager_opt, ids, labels, step, step / config.steps, kv)
        diffs.append(abs(got["kd"] - want["kd"]))
    assert max(diffs[:EAGER_STEPS]) < 1e-6 and max(diffs[EAGER_STEPS:]) > 1e-4


def test_config_refuses_what_a_graph_cannot_replay(tmp_path):
    folder = tiny_folder(tmp_path, torch.device("cpu"))
    with pytest.raises(KVLearnError, match="cuda_graph_step=True on device='cpu'"):
        tiny_config(folder, tmp_path, cuda_graph_step=True)
    cases = [({"method": "dms"}, "is for methods kvpop, streaming_plus, not 'dms'"),
             ({"scorer_kd": 1.0}, "scorer_kd=1.0 is not supported"),
             ({"scorer": "mlstm", "kvpop_mode": "reduce-overhead"}, "mlstm_compile_mode='reduce-overhead'")]
    for kw, message in cases:
        kw = dict(kw)
        mode = kw.pop("kvpop_mode", None)
        method, scorer = kw.pop("method", "kvpop"), kw.pop("scorer", "mlp")
        kvpop = KVpopConfig(sinks=4, window=16, topk=44, scorer=scorer,
                            **({"mlstm_compile_mode": mode} if mode else {}))
        extra = {"dms": distill.DMSConfig(sinks=4, window=16, budget=64)} if method == "dms" else {}
        with pytest.raises(KVLearnError, match=message.replace("(", r"\(").replace(")", r"\)")):
            RetrofitConfig(model=str(folder), out=str(tmp_path / "o"), batch_size=2, seq_len=256, device="cpu",
                           method=method, kvpop=kvpop, steps=8, cuda_graph_step=True, **extra, **kw)
    with pytest.raises(KVLearnError, match="cuda_graph_step='yes' is invalid: expected True or False"):
        tiny_config(folder, tmp_path, cuda_graph_step="yes")
    with pytest.raises(KVLearnError, match="a CUDA graph needs a CUDA device"):
        cuda_graph.check_graph_step(torch.device("cpu"))


def test_step_refuses_a_batch_it_cannot_replay(tmp_path, monkeypatch):
    """A batch whose KD loss would select positions (data-dependent shape) and a batch of a new shape: one-line
    errors before anything runs."""
    device = torch.device("cpu")
    config = tiny_config(tiny_folder(tmp_path, device), tmp_path)
    torch.manual_seed(0)
    teacher, student = build_models(config, device)
    kv = training_kvpop(config, student)
    opt = make_optimizer(config, student, device)
    monkeypatch.setattr(distill_loss, "KD_DENSE_ELEMENTS", 1000)
    with pytest.raises(KVLearnError, match=r"batch_size x \(seq_len - 1\) x vocab = 2 x 255 x \d+ = \d+ logits: "
                                           r"expected <= 1000"):
        GraphedRetrofitStep(config, teacher, student, opt, kv, device)
    monkeypatch.undo()
    step = GraphedRetrofitStep(config, teacher, student, opt, kv, device, capture=RecordingCapture())
    ids, labels = batches(1, device)[0]
    step(ids, labels, 0, 0.0)
    with pytest.raises(KVLearnError, match=r"a batch of shape \(1, 256\) after batches of \(2, 256\)"):
        step(ids[:1], labels[:1], 1, 0.1)


def test_checkpoint_of_a_graphed_optimizer_is_plain(tmp_path):
    """Device learning rates and ``capturable`` are the graphed run's own: the checkpoint holds float learning rates
    and ``capturable=False``, so it loads into an eager optimizer with those learning rates, which then steps."""
    device = torch.device("cpu")
    config = tiny_config(tiny_folder(tmp_path, device), tmp_path)
    torch.manual_seed(0)
    _, student = build_models(config, device)
    opt = make_optimizer(config, student, device)
    lrs = prepare_capturable(opt, device)
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)
    lrs[1].fill_(5e-4)
    path = distill.save_checkpoint(config, student, opt, 3, "step-3")
    saved = torch.load(path / distill.STATE_FILE, weights_only=False)["optimizer"]
    groups = saved["param_groups"]
    assert [type(g["lr"]) for g in groups] == [float] * 3 and groups[1]["lr"] == pytest.approx(5e-4)
    assert not any(g.get("capturable") for g in groups)
    eager = make_optimizer(config, student, device)
    distill.parallel.load_optimizer_state_dict(student, eager, saved)
    assert [g["lr"] for g in eager.param_groups] == [g["lr"] for g in groups]
    assert all(isinstance(g["lr"], float) and not g.get("capturable") for g in eager.param_groups)
    for p in student.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in student.parameters()]
    eager.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, student.parameters()) if p.requires_grad)
    state = {"param_groups": [{"lr": torch.tensor(1.0), "capturable": True}]}
    assert plain_optimizer_groups(state) == {"param_groups": [{"lr": 1.0, "capturable": False}]}


def test_cli_flag_reaches_the_config(tmp_path, capsys):
    from kvlearn.cli import main

    folder = tiny_folder(tmp_path, torch.device("cpu"))
    code = main(["retrofit", "--model", str(folder), "--out", str(tmp_path / "o"), "--seq-len", "256",
                 "--budget", "64", "--window", "16", "--steps", "2", "--cuda-graph-step", "--device", "cpu"])
    assert code != 0
    err = capsys.readouterr().err
    assert "cuda_graph_step=True on device='cpu'" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------------------------
# CUDA


# A constant added to every score of a head (the MLP scorer's output bias b2, the mLSTM readout's bias b) changes no
# ranking, hence neither the forward nor the boundary loss: its gradient is rounding noise (~1e-10 here), which Adam
# scales up to steps of about the learning rate, of either sign. Two CUDA runs that round differently (fused AdamW
# with a float32 tensor learning rate against a Python float, atomics in a backward) move it differently; the CPU test
# above, which rounds alike, compares it too.
SCORE_SHIFTS = (".scorer.b2", ".scorer.b")


def cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run with -m gpu on the device machine)")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("method,scorer", [("kvpop", "mlp"), ("kvpop", "mlstm"), ("streaming_plus", "mlp")])
def test_cuda_graph_replays_the_eager_steps(tmp_path, method, scorer):
    """The real graph: 3 eager steps, the capture, 3 replays, a new batch every step, against six eager steps of
    ``train_step`` (fused AdamW, float learning rates) on a copy: the same logged values and weights to the fused
    kernels' rounding."""
    device = cuda_or_skip()
    config = tiny_config(tiny_folder(tmp_path, device), tmp_path, method, scorer, device="cuda")
    torch.manual_seed(0)
    teacher, student = build_models(config, device)
    twin = copy.deepcopy(student)
    kv = training_kvpop(config, student)
    graphed = GraphedRetrofitStep(config, teacher, student, make_optimizer(config, student, device, capturable=True),
                                  kv, device)
    eager_opt = make_optimizer(config, twin, device)
    for step, (ids, labels) in enumerate(batches(6, device)):
        got = graphed(ids, labels, step, step / config.steps)
        want = train_step(config, teacher, twin, eager_opt, ids, labels, step, step / config.steps, kv)
        for k in ("loss", "kd", "grad_norm") + (("boundary",) if method == "kvpop" else ()):
            assert got[k] == pytest.approx(want[k], rel=2e-3, abs=1e-4), (step, k)
    assert graphed.graph.captured
    for (name, p), q in zip(student.named_parameters(), twin.parameters()):
        if not name.endswith(SCORE_SHIFTS):
            torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.gpu
def test_graphed_retrofit_killed_and_resumed_equals_an_eager_run(tmp_path):
    """``retrofit(cuda_graph_step=True)`` killed after step 4 (checkpoint at step 3) and resumed, graphed again, ends
    on the weights of an eager run of the same 8 steps (the resumed optimizer's step counters move to the device)."""
    device = cuda_or_skip()
    folder = tiny_folder(tmp_path, device)

    def run(out, graphed, stop_after=None, resume=False):
        config = RetrofitConfig(model=str(folder), out=str(out), batch_size=2, seq_len=256, device="cuda",
                                kvpop=KVpopConfig(sinks=4, window=16, topk=44, scorer="mlp"), steps=8, warmup_steps=3,
                                save_interval=3, cuda_graph_step=graphed, resume=resume, overwrite=not resume)
        return distill.retrofit(config, stop_after=stop_after, progress=False)

    eager = run(tmp_path / "eager", False)
    assert run(tmp_path / "graphed", True, stop_after=4)["final"] is None
    resumed = run(tmp_path / "graphed", True, resume=True)
    a, b = distill.folder_weights(eager["final"]), distill.folder_weights(resumed["final"])
    assert a.keys() == b.keys()
    for k in a:
        if not k.endswith(SCORE_SHIFTS):
            torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3, msg=k)
    assert resumed["log"]["kd"] == pytest.approx(eager["log"]["kd"], rel=2e-3, abs=1e-4)
