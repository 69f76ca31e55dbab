"""``scatter_slots``: the write every store and the layer's slot bookkeeping use, against a Python loop, and free of
host syncs for every number of new tokens (a chunked prefill must not wait for the GPU in every layer)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvlearn.cache.store import scatter_slots

SYNCING = {"nonzero", "_local_scalar_dense", "is_nonzero", "equal", "item"}


def loop_reference(buf, slots, src):
    out = buf.clone()
    b, p, q = slots.shape
    for i in range(b):
        for j in range(p):
            for t in range(q):
                if slots[i, j, t] >= 0:
                    out[i, j, slots[i, j, t]] = src[i, j, t].to(buf.dtype)
    return out


def random_case(seed, q, rest, capacity=9, skip=0.4, empty_rows=True):
    g = torch.Generator().manual_seed(seed)
    b, p = 3, 2
    buf = torch.randn((b, p, capacity) + rest, generator=g)
    src = torch.randn((b, p, q) + rest, generator=g, dtype=torch.float64)  # cast to the buffer's dtype on write
    slots = torch.stack([torch.randperm(capacity, generator=g)[:q] for _ in range(b * p)]).view(b, p, q)
    slots = torch.where(torch.rand(b, p, q, generator=g) < skip, torch.full_like(slots, -1), slots)
    if empty_rows:
        slots[1, 0] = -1  # a row that keeps none of its new tokens
    return buf, slots, src


@pytest.mark.parametrize("q", [1, 2, 5, 9])
@pytest.mark.parametrize("rest", [(), (4,), (2, 3)])
def test_scatter_equals_the_loop(q, rest):
    for seed in range(5):
        buf, slots, src = random_case(seed * 10 + q, q, rest)
        want = loop_reference(buf, slots, src)
        scatter_slots(buf, slots, src)
        torch.testing.assert_close(buf, want, atol=0, rtol=0)


def test_int_buffers_and_all_kept():
    buf = torch.full((1, 2, 5), -1, dtype=torch.int32)
    slots = torch.tensor([[[3, 0, 4], [1, 2, 0]]])
    src = torch.tensor([[[7, 8, 9], [10, 11, 12]]])
    scatter_slots(buf, slots, src)
    assert buf.tolist() == [[[8, -1, -1, 7, 9], [12, 10, 11, -1, -1]]]


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in SYNCING:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("q", [1, 6])
def test_no_host_sync(q):
    buf, slots, src = random_case(3, q, (4,))
    with SyncCounter() as counter:
        scatter_slots(buf, slots, src)
    assert counter.calls == []
