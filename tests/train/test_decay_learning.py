"""The retrofit trainer's optimiser lets the learned decay cross its range (docs/DESIGN.md, "The learned decay"):
the decays' ``alpha`` get their own group at ``lr_decay``, and a short run on a synthetic future-attention target
that rewards old tokens (the scorers, fed random keys, cannot see age: only the decay can) moves every head's decay
measurably towards ``decay_max``. With the decay in the scorer's group at ``lr_new`` (the trainer before the fix,
``lr_decay = lr_new`` here), Adam moves ``alpha`` by at most ~``lr_new`` per step: the same run moves it a tenth as
far, and 1000 steps could not cross the range."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVpopConfig
from kvlearn.kvpop.apply import kvpop_modules
from kvlearn.kvpop.loss import boundary_loss
from kvlearn.kvpop.policy import boundary_decisions, sample_query_positions, static_priorities, teacher_policy
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from kvlearn.train.distill import RetrofitConfig, build_models, decay_lr_at, make_optimizer, new_lr_at

SEQ, STEPS = 128, 120
KV = dict(sinks=2, window=4, topk=16, scorer="mlp")


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      pad_token_id=0, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("teacher") / "qwen3"
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def run_synthetic(teacher_path, tmp_path, slope: float, **kw):
    """``STEPS`` trainer-optimiser steps of the boundary loss on random keys/values against the synthetic target
    ``slope * t + noise``; returns (alpha before, alpha after) stacked over layers, ``[layers, kv_heads]``."""
    config = RetrofitConfig(model=teacher_path, out=str(tmp_path / "run"), kvpop=KVpopConfig(**KV), steps=STEPS,
                            seq_len=SEQ, batch_size=2, warmup_steps=10, **kw)
    _, student = build_models(config, torch.device("cpu"))
    optimizer = make_optimizer(config, student, torch.device("cpu"))
    scorers, decays = kvpop_modules(student)
    before = torch.stack([d.alpha.detach().clone() for d in decays])
    g = torch.Generator().manual_seed(1)
    t = torch.arange(SEQ, dtype=torch.float32)
    kv = config.kvpop
    for step in range(STEPS):
        optimizer.param_groups[1]["lr"] = new_lr_at(config, step, step / STEPS)
        optimizer.param_groups[2]["lr"] = decay_lr_at(config, step, step / STEPS)
        queries = sample_query_positions(SEQ, kv.sinks, kv.window, kv.topk, 16, generator=g)
        losses = []
        for scorer, decay in zip(scorers, decays):
            key, value = torch.randn(2, 2, SEQ, 16, generator=g), torch.randn(2, 2, SEQ, 16, generator=g)
            log_gamma = decay()
            pred = static_priorities(scorer(key, value), log_gamma)
            target = slope * t + 0.5 * torch.randn(2, 2, SEQ, generator=g)
            teacher = teacher_policy(target, log_gamma, kv.sinks, kv.window, kv.topk)
            dec = boundary_decisions(teacher, queries, kv.sinks, kv.window, kv.topk)
            losses.append(boundary_loss(pred, teacher.priorities, dec).loss)
        torch.stack(losses).mean().backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return before, torch.stack([d.alpha.detach().clone() for d in decays])


def test_decays_have_their_own_group(teacher_path, tmp_path):
    config = RetrofitConfig(model=teacher_path, out=str(tmp_path / "run"), kvpop=KVpopConfig(**KV), steps=3,
                            seq_len=SEQ, batch_size=2)
    _, student = build_models(config, torch.device("cpu"))
    groups = make_optimizer(config, student, torch.device("cpu")).param_groups
    names = {id(p): n for n, p in student.named_parameters()}
    assert [names[id(p)] for p in groups[2]["params"]] == ["model.layers.0.self_attn.kvpop.decay.alpha"]
    assert groups[1]["params"] and all(".kvpop.scorer." in names[id(p)] for p in groups[1]["params"])
    assert groups[2]["lr"] == config.lr_decay == 1e-2
    assert decay_lr_at(config, 50, 0.5) == pytest.approx(new_lr_at(config, 50, 0.5) * 10)


def test_decay_learns_to_keep_old_tokens(teacher_path, tmp_path):
    # The target falls by 4e-3 per position: steeper than any decay (|log γ| <= 1e-3), so the teacher keeps old
    # tokens and drops the newly eligible ones; the student can only agree by slowing its decay.
    before, after = run_synthetic(teacher_path, tmp_path, slope=-4e-3)
    assert (before == 0).all()
    # sum of the lr_decay schedule over the run ~0.65: alpha > 0.4 is gamma > 0.99960 (from 0.9995)
    assert (after > 0.4).all(), after
    # the same run with the decay at lr_new's rate (the trainer before the fix): at most ~0.065
    _, slow = run_synthetic(teacher_path, tmp_path, slope=-4e-3, lr_decay=1e-3)
    assert (slow > 0).all() and (slow < 0.08).all(), slow
