"""The decode step of the streaming cache and of the scored base (knorm) is compile-ready: no host sync, no
data-dependent shape (nor is that of the attention-driven TOVA and H2O: attend, hand the attention back, evict one;
nor KVpop's, with the MLP and the delayed-readout mLSTM scorer: score, evict the worst eligible, write).
Proved on the CPU by forbidding every sync primitive during one step, and by tracing the step
with ``torch.compile(fullgraph=True, backend="eager")`` (a graph break = a failure). The same holds over the packed
integer store (``PackedStore``: quantize and pack in the write)."""

import pytest
import torch

from decode_step import clone_cache, decode_case

from kvlearn.cache import PackedStore

STORES = {"plain": None, "packed4": lambda: PackedStore(4), "packed2": lambda: PackedStore(2)}
CASES = [(n, "plain") for n in ("streaming", "knorm", "tova", "h2o", "kvpop_mlp", "kvpop_mlstm")] + [
    ("streaming", "packed4"), ("knorm", "packed4"), ("tova", "packed4"), ("streaming", "packed2")]


def _forbidden(*args, **kwargs):
    raise AssertionError("host sync or data-dependent shape on the decode path")


@pytest.mark.parametrize("name,store", CASES)
def test_decode_step_never_syncs(name, store, monkeypatch):
    cache, step_fn, inputs = decode_case(name, "cpu", store_factory=STORES[store])
    expected = step_fn(clone_cache(cache), *inputs)
    for attr in ("__bool__", "item", "__int__", "__float__", "tolist", "nonzero", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, _forbidden)
    monkeypatch.setattr(torch, "nonzero", _forbidden)
    out, slots = step_fn(cache, *inputs)
    monkeypatch.undo()
    torch.testing.assert_close(out, expected[0])
    assert torch.equal(slots, expected[1])


@pytest.mark.parametrize("name,store", CASES)
def test_decode_step_traces_as_one_graph(name, store):
    cache, step_fn, inputs = decode_case(name, "cpu", store_factory=STORES[store])
    eager = step_fn(clone_cache(cache), *inputs)
    torch._dynamo.reset()
    compiled = torch.compile(step_fn, backend="eager", fullgraph=True)
    out, slots = compiled(cache, *inputs)
    torch.testing.assert_close(out, eager[0])
    assert torch.equal(slots, eager[1])


@pytest.mark.parametrize("name", ["streaming", "knorm", "kvpop_mlp", "kvpop_mlstm"])
def test_model_decode_step_traces_as_one_graph(name):
    """The whole model's decode forward (a tiny GQA Qwen3 through ``attach``'s hook, the rotary embedding, every
    layer's cache update and attention, the head) traces as one graph through a kvlearn cache, with a padded row:
    what a compiled (CUDA-graph) decode needs from transformers' side too. Two caches filled alike (a prompt, then
    decoding past the budget); the compiled step on one equals the eager step on the other, logits and slots."""
    from decode_step import make_cache
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.config import KVpopConfig
    from kvlearn.hf import attach
    from kvlearn.kvpop.apply import apply_kvpop, make_kvpop_cache

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = attach(Qwen3ForCausalLM(config).eval())
    if name.startswith("kvpop_"):  # the cache's scorers are this model's
        apply_kvpop(model, KVpopConfig(sinks=2, window=3, topk=3, scorer=name.removeprefix("kvpop_")))

    def filled():
        cache = make_kvpop_cache(model) if name.startswith("kvpop_") else make_cache(name, num_layers=2)
        gen = torch.Generator().manual_seed(1)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :3] = 0  # row 1 is left-padded
        model(input_ids=torch.randint(1, 64, (2, 12), generator=gen), attention_mask=mask, past_key_values=cache,
              use_cache=True)
        for _ in range(3):  # decode past the budget (8 tokens per head): every step evicts
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            model(input_ids=torch.randint(1, 64, (2, 1), generator=gen), attention_mask=mask, past_key_values=cache,
                  use_cache=True)
        token = torch.randint(1, 64, (2, 1), generator=gen)
        return cache, token, torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)

    def step(cache, token, mask):
        return model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True).logits

    with torch.no_grad():
        eager_cache, token, mask = filled()
        eager = step(eager_cache, token, mask)
        cache, token, mask = filled()
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="eager", fullgraph=True)(cache, token, mask)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(cache.layers, eager_cache.layers):
        assert torch.equal(got.slot_positions, want.slot_positions)
