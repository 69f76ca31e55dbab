"""End to end on the rank axis: a tiny GQA Qwen3 (testbed vocabulary, 2 layers) converted to MLA and saved is the
teacher of ``kaizen_train`` with the axes precision + rank (the dense MLA model is the control, as in the paper); a
few steps move the selector to cheaper actions, the final folder loads back with its MLA attention and selector, and
the ``kaizen`` method's per-prompt cache (LatentStores) decodes like the configuration's forward."""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvlearn
from kvlearn.kaizen.actions import Backbone
from kvlearn.kaizen.apply import KaizenMethodConfig, make_prompt_cache
from kvlearn.kaizen.mla import convert_to_mla, is_mla
from kvlearn.kaizen.sharing import attach
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from kvlearn.train.kaizen_train import LOG_FILE, KaizenTrainConfig, kaizen_train


def test_train_load_and_serve_a_converted_model(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      pad_token_id=0, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    cal = torch.randint(1, VOCAB_SIZE, (4, 64), generator=torch.Generator().manual_seed(1))
    convert_to_mla(model, 16, cal, rank=32, variant="care")
    model.save_pretrained(tmp_path / "mla")
    out = tmp_path / "run"
    config = KaizenTrainConfig(model=str(tmp_path / "mla"), out=str(out), targets=(4.0,), axes=("precision", "rank"),
                               steps=4, batch_size=2, seq_len=128, save_interval=4, warmup_steps=0, lr=1e-3,
                               lr_new=0.2, beta=50.0, eta=0.0)
    result = kaizen_train(config, progress=False)
    log = [json.loads(ln) for ln in (out / LOG_FILE).read_text().splitlines()]
    assert log[0]["factor"] == pytest.approx(2048 / (2 * 48 * 16))  # the full latent (32 + 16 RoPE) at 16 bits: conversion only
    assert log[-1]["factor"] > log[0]["factor"]  # the selector moved to cheaper actions

    trained = attach(kvlearn.load(result["final"]))
    assert is_mla(trained) and Backbone.from_model(trained).mla_rank == 32
    ids = torch.randint(1, VOCAB_SIZE, (1, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    cache = make_prompt_cache(KaizenMethodConfig(target=4.0, axes=("precision", "rank")), trained, ids, mask, 4)
    # the served choice is the trained selector's: cheaper than the conversion alone (4 steps need not reach 4x)
    assert cache.config.compression(metadata=False) > log[0]["factor"]
    with torch.no_grad():
        ref = trained(input_ids=ids, kaizen_config=cache.config, use_cache=False).logits
        got = [trained(input_ids=ids[:, :8], past_key_values=cache, use_cache=True).logits]
        got += [trained(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(got, dim=1), ref, atol=1e-4, rtol=1e-4)
    assert Path(result["final"]).is_dir()
