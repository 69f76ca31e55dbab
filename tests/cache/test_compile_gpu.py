"""GPU: one decode step of the streaming cache and of the scored base (knorm) under ``torch.compile(fullgraph=True)``
(and KVpop's, MLP and mLSTM scorer, under it too) and under CUDA-graph capture equals the eager step; and a tiny random GQA Qwen3 decodes through both caches on
CUDA as on the CPU. Self-contained (float32, random weights); run with ``pytest -m gpu tests/cache``."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from decode_step import D, clone_cache, decode_case, make_cache
from kvlearn.hf import attach, kvlearn_attention

pytestmark = pytest.mark.gpu
NAMES = ["streaming", "knorm"]


@pytest.mark.parametrize("name", NAMES + ["kvpop_mlp", "kvpop_mlstm"])
def test_compiled_decode_step_equals_eager(name):
    cache, step_fn, inputs = decode_case(name, "cuda")
    eager = step_fn(clone_cache(cache), *inputs)
    torch._dynamo.reset()
    compiled = torch.compile(step_fn, fullgraph=True)
    out, slots = compiled(cache, *inputs)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(slots, eager[1])


def _layer_step(cache, step, k, query):
    """update + attention of layer 0 for an already announced step (what a CUDA graph captures)."""
    layer = cache.layers[0]
    keys, values = layer.update(k, k * 0.5, step=step)
    out, _ = kvlearn_attention(SimpleNamespace(layer_idx=0), query, keys, values, None, scaling=D ** -0.5,
                               kvlearn_cache=cache)
    return out, layer.slot_positions.clone()


def _buffers(cache):
    layer = cache.layers[0]
    return [layer.slot_positions, *layer.store.read(), *layer.slot_state.values()]


@pytest.mark.parametrize("name", NAMES)
def test_cuda_graph_decode_step_equals_eager(name):
    cache, _, (mask, k, query) = decode_case(name, "cuda")
    ref_cache = clone_cache(cache)
    ref_step = ref_cache.begin_forward(mask, mask.shape[0], 1, mask.device)
    ref = _layer_step(ref_cache, ref_step, k, query)

    step = cache.begin_forward(mask, mask.shape[0], 1, mask.device)  # static inputs: step, k, query
    snapshot = [t.clone() for t in _buffers(cache)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (allocations, lazy init) outside the graph
        _layer_step(cache, step, k, query)
    torch.cuda.current_stream().wait_stream(side)
    for t, s in zip(_buffers(cache), snapshot):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, slots = _layer_step(cache, step, k, query)
    for t, s in zip(_buffers(cache), snapshot):
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(slots, ref[1])


@pytest.mark.parametrize("name", NAMES)
def test_tiny_qwen3_decodes_on_cuda_as_on_cpu(name):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa")
    model = attach(Qwen3ForCausalLM(cfg).eval())
    ids = torch.randint(1, 64, (2, 30))
    logits = {}
    for device in ("cpu", "cuda"):
        m = copy.deepcopy(model).to(device)
        cache = make_cache(name, num_layers=2)
        got = []
        with torch.no_grad():
            got.append(m(input_ids=ids[:, :12].to(device), past_key_values=cache, use_cache=True).logits)
            for t in range(12, 30):
                got.append(m(input_ids=ids[:, t:t + 1].to(device), past_key_values=cache, use_cache=True).logits)
        logits[device] = torch.cat(got, 1).cpu()
    torch.testing.assert_close(logits["cuda"], logits["cpu"], atol=1e-4, rtol=1e-4)
