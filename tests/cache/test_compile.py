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
