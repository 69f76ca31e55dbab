"""The shipped KVpop student (checkpoints/testbed-kvpop): its recorded KVpop config, and one forward through its
KVpop cache on a short testbed prompt against dense attention (float32, CPU)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvlearn
from kvlearn.kvpop.apply import has_kvpop
from kvlearn.methods import get_method, make_config, trained_options
from kvlearn.testbed import example_seed, generate

STUDENT = Path(__file__).resolve().parents[2] / "checkpoints" / "testbed-kvpop"

pytestmark = pytest.mark.skipif(not (STUDENT / "model.safetensors").exists(),
                                reason="no shipped KVpop student in this checkout")


def test_shipped_student_records_its_kvpop_config():
    saved = json.loads((STUDENT / "config.json").read_text())["kvpop"]
    assert (saved["sinks"], saved["window"], saved["topk"]) == (4, 256, 252)  # trained at budget 512
    assert saved["scorer"] == "mlp" and saved["target_reduction"] == "peak"
    assert trained_options("kvpop", STUDENT) == {"scorer": "mlp", "delayed_readout": True, "mlstm_skip": True, "decay_min": 0.999,
                                                 "decay_max": 0.999999, "window": 256,
                                                 "state_in_budget": False}  # mlstm_skip: unused by the MLP scorer


def kvpop_logits(model, ids, budget):
    """Logits of one forward of ``ids`` through a fresh KVpop cache of ``budget`` tokens (the registry's path)."""
    method = get_method("kvpop")
    config = make_config("kvpop", budget=budget, sinks=4, **trained_options("kvpop", STUDENT))
    method.prepare(model, config)
    cache = method.new_cache(model, config)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
    return logits, cache


def test_shipped_student_forward_through_its_cache_equals_dense_attention_when_nothing_is_evicted():
    student = kvlearn.load(STUDENT)  # float32, CPU, KVpop re-applied with its scorers and decays
    assert has_kvpop(student) and student.dtype == torch.float32
    ex = generate("niah", example_seed("niah", "eval", 0), 300)
    ids = torch.tensor([ex.prompt_ids])
    assert 261 < ids.shape[1] <= 300
    # the reference: the same backbone weights under transformers' own dense (eager) attention, no kvlearn code
    dense = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expect = dense(ids).logits
    kept, cache = kvpop_logits(student, ids, budget=320)  # >= the prompt: nothing evicted
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(kept, expect, atol=1e-4, rtol=1e-4)
    evicting, cache = kvpop_logits(student, ids, budget=261)  # the smallest budget: 4 + 256 + one ranked slot
    assert torch.isfinite(evicting).all()
    held = (cache.layers[0].slot_positions >= 0).sum(dim=2)  # [batch, kv_heads]: tokens each head keeps
    assert held.tolist() == [[261, 261]]
    torch.testing.assert_close(evicting[:, :261], expect[:, :261], atol=1e-4, rtol=1e-4)  # before any eviction
