"""KIVIStore: keys per channel over groups of G tokens, values per token over groups of channels, a full-precision
window of R recent tokens.

- after every write of a prefill-then-decode sequence (two rows, one with padding), ``read()`` equals a brute-force
  KIVI written here (explicit loops over blocks, groups and channels), at 2, 4 and 8 bits;
- ``allocated_bytes`` is exact (hand-computed);
- as the store of the no-eviction policy on a tiny random GQA Qwen3: decoding runs, is close to the plain cache at 8
  bits, and holds the expected bytes; joined to an evicting policy it is refused; the decode write neither syncs
  nor breaks a ``torch.compile(fullgraph=True)`` trace.
"""

import pytest
import torch
from test_policies import tiny_model

from kvlearn import KVLearnError
from kvlearn.cache import CompactCache, CompactLayer, KeepAllPolicy, PlainStore
from kvlearn.cache.kivi import KIVIStore
from kvlearn.eviction import streaming
from kvlearn.hf import attach


def brute_force(x, n, bits, g, r, gv, is_key):
    """KIVI of one row's tokens ``x [H, n_max, D]`` after ``n`` tokens, as read back ``[H, n_max, D]`` (zeros past n)."""
    levels = 2 ** bits - 1
    out = torch.zeros_like(x)
    h, _, d = x.shape

    def qdq(block):  # asymmetric min/max over all of ``block``
        lo, hi = block.min(), block.max()
        scale = (hi - lo) / levels
        if scale == 0:
            return torch.full_like(block, float(lo))
        return ((block - lo) / scale).round().clamp(0, levels) * scale + lo

    full_until = (n // r) * r if is_key else max(0, n - r)
    for head in range(h):
        for t in range(n):
            if t >= full_until:
                out[head, t] = x[head, t]
            elif not is_key:
                for c in range(0, d, gv):
                    out[head, t, c:c + gv] = qdq(x[head, t, c:c + gv])
        if is_key:
            for t0 in range(0, full_until, g):
                for c in range(d):
                    out[head, t0:t0 + g, c] = qdq(x[head, t0:t0 + g, c])
    return out


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_read_equals_brute_force_after_every_write(bits):
    g, r, gv, cap, h, d = 4, 8, 8, 37, 2, 16
    store = KIVIStore(bits, group_size=g, residual=r, value_group_size=gv)
    store.allocate(2, h, cap, d, d, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(bits)
    k, v = torch.randn(2, h, cap, d, generator=gen), torch.randn(2, h, cap, d, generator=gen)
    # row 0: 13 tokens prefilled; row 1: 3 padding columns then 10 tokens; then one token per step, row 1 skipping two
    pad = 3
    slots = torch.tensor([list(range(13)), [-1] * pad + list(range(10))])
    ks = torch.stack([k[0, :, :13], torch.cat([k[1, :, :pad], k[1, :, :10]], dim=1)])
    vs = torch.stack([v[0, :, :13], torch.cat([v[1, :, :pad], v[1, :, :10]], dim=1)])
    store.write(slots[:, None].expand(2, h, 13), ks, vs)
    n = [13, 10]
    writes = 0
    for step in range(30):
        keys, values = store.read()
        for row in range(2):
            torch.testing.assert_close(keys[row], brute_force(k[row], n[row], bits, g, r, gv, True), atol=1e-5, rtol=0)
            torch.testing.assert_close(values[row], brute_force(v[row], n[row], bits, g, r, gv, False), atol=1e-5,
                                       rtol=0)
        if max(n) == cap:
            break
        take = [n[0] < cap, n[1] < cap and step not in (4, 5)]
        s = torch.tensor([[n[i] if take[i] else -1] for i in range(2)])
        idx = torch.tensor([min(n[0], cap - 1), min(n[1], cap - 1)])
        store.write(s[:, None].expand(2, h, 1), k[torch.arange(2), :, idx][:, :, None], v[torch.arange(2), :, idx][:, :, None])
        n = [n[i] + int(take[i]) for i in range(2)]
        writes += 1
    assert writes >= 24 and store.filled.tolist() == n
    assert bool((store.key_scale[0, :, : 32 // g] > 0).all())  # 4 blocks of row 0 quantized through the decode path


def test_allocated_bytes_exact():
    store = KIVIStore(2, group_size=4, residual=8, value_group_size=8)
    assert store.allocated_bytes() == 0
    store.allocate(2, 3, 37, 16, 16, torch.bfloat16, "cpu")
    b, h = 2, 3
    q = 32  # 4 whole blocks of 8; the last 5 slots only ever live in the window
    key = b * h * (q * 16 * 2 // 8 + 2 * (q // 4) * 16 * 2)  # packed 2-bit codes + bf16 scale and minimum per group
    value = b * h * (37 * 16 * 2 // 8 + 2 * 37 * (16 // 8) * 2)
    window = 2 * b * h * 8 * 16 * 2
    assert store.allocated_bytes() == key + value + window + 2 * 8  # + the int64 fill counters
    assert store.shape == (2, 3, 37, 16, 16)


def test_bad_configuration_is_refused_in_one_line():
    for make, message in [
        (lambda: KIVIStore(3), "bits=3 is invalid"),
        (lambda: KIVIStore(2, group_size=4, residual=6), "residual=6 is invalid: expected a multiple of group_size=4"),
        (lambda: KIVIStore(2, group_size=8, residual=4), "residual=4 is invalid: expected an integer >= 8"),
        (lambda: KIVIStore(2, group_size=4, residual=8, value_group_size=5).allocate(1, 1, 8, 16, 16, torch.float32,
                                                                                     "cpu"),
         "value_group_size=5 is invalid: it must divide v_dim=16"),
        (lambda: CompactLayer(streaming.StreamingPolicy(streaming.StreamingConfig(budget=8, sinks=2)), KIVIStore()),
         "KIVIStore needs a policy that never evicts .*StreamingPolicy evicts"),
    ]:
        with pytest.raises(KVLearnError, match=message) as err:
            make()
        assert "\n" not in str(err.value)
    store = KIVIStore(2, group_size=4, residual=8)
    store.allocate(1, 1, 16, 8, 8, torch.float32, "cpu")
    store.write(torch.arange(5)[None, None], torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    with pytest.raises(KVLearnError, match="KIVIStore is append-only"):
        store.write(torch.tensor([[[2, 3]]]), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))


def kivi_cache(model, capacity, **kw):
    return CompactCache([CompactLayer(KeepAllPolicy(capacity), KIVIStore(**kw))
                         for _ in range(model.config.num_hidden_layers)])


def test_kivi_as_the_store_of_a_full_cache():
    model = attach(tiny_model(3))
    ids = torch.randint(1, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))

    def decode(cache):
        with torch.no_grad():
            out = [model(input_ids=ids[:, :13], past_key_values=cache, use_cache=True).logits]
            out += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                    for t in range(13, 40)]
        return torch.cat(out, dim=1)

    full = CompactCache([CompactLayer(KeepAllPolicy(48), PlainStore()) for _ in range(2)])
    ref = decode(full)
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    torch.testing.assert_close(ref, dense, atol=1e-4, rtol=1e-4)  # the full cache is the dense model
    errors = {}
    for bits in (8, 4, 2):
        cache = kivi_cache(model, 48, bits=bits, group_size=4, residual=8)
        got = decode(cache)
        errors[bits] = float((got - ref).abs().max())
        store = cache.layers[0].store
        assert cache.store_bytes() == 2 * store.allocated_bytes()
    assert errors[8] < 1e-2 and errors[8] < errors[2], errors
    # the first R tokens' logits do not depend on quantization at all (everything still in the window)
    cache = kivi_cache(model, 48, bits=2, group_size=4, residual=16)
    with torch.no_grad():
        early = model(input_ids=ids[:, :16], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(early, ref[:, :16], atol=1e-5, rtol=0)


def test_decode_write_is_sync_free_and_traces():
    store = KIVIStore(4, group_size=4, residual=8)
    store.allocate(2, 2, 24, 16, 16, torch.float32, "cpu")
    store.write(torch.arange(7).expand(2, 2, 7), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16))

    def step(slot, k, v):
        store.write(slot, k, v)
        return store.read()

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    slot = torch.full((2, 2, 1), 7, dtype=torch.long)
    keys, _ = compiled(slot, torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))  # completes block 0
    assert store.filled.tolist() == [8, 8] and bool((store.key_scale[:, :, :2] > 0).all())


def test_decode_through_the_kivi_kernel_equals_the_read_back(run_in_triton_interpreter):
    """Where the KIVI kernel applies (Triton's CPU interpreter here, CUDA on the GPU) a decode step attends the codes
    (``store_attends``: the layer hands back no keys) and the logits equal the read-back path's
    (``KVLEARN_PACKED_DECODE=0``), float32, at 2 and 4 bits, through prefill, block completions and the window."""
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from test_kivi_store import kivi_cache
        from test_policies import tiny_model
        from kvlearn.hf import attach

        model = attach(tiny_model(3, head_dim=64))
        ids = torch.randint(1, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))

        def decode(bits):
            cache = kivi_cache(model, 32, bits=bits, group_size=4, residual=8)
            attends = []
            with torch.no_grad():
                out = [model(input_ids=ids[:, :13], past_key_values=cache, use_cache=True).logits[:, -1:]]
                for t in range(13, 30):
                    out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
                    attends.append(all(layer.store_attends for layer in cache.layers))
            return torch.cat(out, dim=1), attends

        for bits in (2, 4):
            got, attends = decode(bits)
            os.environ["KVLEARN_PACKED_DECODE"] = "0"
            want, attends_off = decode(bits)
            del os.environ["KVLEARN_PACKED_DECODE"]
            assert all(attends) and not any(attends_off), (attends, attends_off)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            print("kivi OK", bits, float((got - want).abs().max()))
    """)
    out = run_in_triton_interpreter(script)
    assert out.count("kivi OK") == 2, out


@pytest.mark.parametrize("bits", [2, 4])
def test_chunked_writes_quantize_only_their_blocks_and_prefix_reads_are_the_sliced_read(bits, monkeypatch):
    """Prefill in several multi-token chunks (row 1 behind row 0 by a padding gap): after every chunk ``read()``
    equals the brute-force KIVI and ``read_prefix(L)`` equals ``read()[:, :, :L]`` for every L; and each chunk's key
    quantization is handed only the blocks from the earliest row's current block to the last completed one (never
    the whole capacity)."""
    import kvlearn.cache.kivi as kivi_module
    g, r, gv, cap, h, d = 4, 8, 8, 61, 2, 16
    store = KIVIStore(bits, group_size=g, residual=r, value_group_size=gv)
    store.allocate(2, h, cap, d, d, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(10 + bits)
    k, v = torch.randn(2, h, cap, d, generator=gen), torch.randn(2, h, cap, d, generator=gen)
    spans = []
    quantize = kivi_module.kivi_quantize_keys
    monkeypatch.setattr(kivi_module, "kivi_quantize_keys", lambda x, *a: spans.append(x.shape[2]) or quantize(x, *a))
    n = [0, 0]
    for chunk in (5, 11, 3, 17, 9, 6):
        take = [chunk, chunk - 2 if n[1] == 0 else chunk]  # row 1: two padding columns in its first chunk
        slots = torch.tensor([list(range(n[0], n[0] + take[0])),
                              [-1] * (chunk - take[1]) + list(range(n[1], n[1] + take[1]))])
        idx = slots.clamp(min=0)
        ks = torch.stack([k[i][:, idx[i]] for i in range(2)])
        vs = torch.stack([v[i][:, idx[i]] for i in range(2)])
        before = list(n)
        spans.clear()
        store.write(slots[:, None].expand(2, h, chunk), ks, vs)
        n = [n[0] + take[0], n[1] + take[1]]
        lo, hi = min(before) // r * r, min(cap // r * r, max(n) // r * r)  # the last block any row completes
        assert spans == ([hi - lo] if hi > lo else []), (spans, before, n)
        keys, values = store.read()
        for row in range(2):
            torch.testing.assert_close(keys[row], brute_force(k[row], n[row], bits, g, r, gv, True), atol=1e-5, rtol=0)
            torch.testing.assert_close(values[row], brute_force(v[row], n[row], bits, g, r, gv, False), atol=1e-5,
                                       rtol=0)
        for length in sorted({0, 1, min(n), max(n), r, r + 3, 2 * r - 1, cap - 1, cap}):
            pk, pv = store.read_prefix(length)
            assert pk.shape == (2, h, length, d) and pv.shape == (2, h, length, d)
            assert torch.equal(pk, keys[:, :, :length]) and torch.equal(pv, values[:, :, :length])
    assert n == [51, 49]


def test_a_keep_all_kivi_prefill_reads_only_the_filled_prefix(monkeypatch):
    """In a chunked prefill each KIVI layer attends the ``seen`` slots it filled plus the chunk (``read_prefix``),
    never the whole store, with the logits of the path that attends every slot (the policy's ``append_only`` turned
    off on the instance) and of decoding afterwards."""
    model = attach(tiny_model(5))
    ids = torch.randint(1, model.config.vocab_size, (2, 44), generator=torch.Generator().manual_seed(6))

    def run(cache):
        with torch.no_grad():
            out = [model(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True).logits
                   for a, b in ((0, 9), (9, 22), (22, 35))]
            out += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                    for t in range(35, 44)]
        return torch.cat(out, dim=1)

    lengths, whole = [], []
    read_prefix, read = KIVIStore.read_prefix, KIVIStore.read
    monkeypatch.setattr(KIVIStore, "read_prefix", lambda self, n: lengths.append(n) or read_prefix(self, n))
    monkeypatch.setattr(KIVIStore, "read", lambda self: whole.append(1) or read(self))
    fast = run(kivi_cache(model, 64, bits=2, group_size=4, residual=8))
    assert sorted(set(lengths)) == [0, 9, 22] and len(lengths) == 3 * 2 and len(whole) == 9 * 2  # decode: read()
    slow_cache = kivi_cache(model, 64, bits=2, group_size=4, residual=8)
    for layer in slow_cache.layers:
        layer.policy.append_only = False  # attend every slot (the empty ones masked), as before
    lengths.clear()
    slow = run(slow_cache)
    assert lengths == []
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
