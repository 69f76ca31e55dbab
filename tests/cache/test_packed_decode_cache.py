"""Decoding through packed stores with the fused kernel (``PackedStore.attends_decode``: the layer hands back no keys
and the attention reads the codes) equals decoding with the read-back path, on a tiny random GQA Qwen3 (float32,
2 KV heads x 2 query heads, head_dim 32; the KV-Kaizen model head_dim 64, so that its 2-bit layer's packed
bytes fill one ``tl.dot`` operand). The kernel runs in Triton's CPU interpreter (a subprocess with
``TRITON_INTERPRET=1``), the read-back path in this process; both against the same saved model:

- a streaming cache on ``PackedStore(4)`` through :func:`kvlearn.attach` (``kvlearn_attention``);
- ``KVLEARN_PACKED_DECODE=0`` turns the kernel off there (the read-back path, same logits);
- KV-Kaizen caches with mixed bits and cross-layer sharing through :func:`kvlearn.kaizen.sharing.attach` (a sharer
  attends its anchor's packed store), against the no-cache forward of the configuration (fake-quantized anchors).
"""

import textwrap
from pathlib import Path

import pytest
import torch

from kvlearn.cache import PackedStore
from kvlearn.config import StreamingConfig
from kvlearn.eviction.streaming import make_cache as streaming_cache

TESTS = Path(__file__).resolve().parents[1]


def streaming_logits(model_dir, fused_expected: bool):
    """Prefill 20 tokens, decode 14 through a budget-16 streaming cache on 4-bit packed stores; also whether every
    decode step's store attended itself."""
    import kvlearn

    model = kvlearn.attach(kvlearn.load(model_dir, dtype=torch.float32))
    cache = streaming_cache(StreamingConfig(budget=16, sinks=2), model.config, store_factory=lambda: PackedStore(4))
    ids = torch.randint(1, 60, (2, 34), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = [model(input_ids=ids[:, :20], past_key_values=cache, use_cache=True).logits[:, -1:]]
        attends = []
        for t in range(20, 34):
            out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
            attends.append(all(layer.store_attends for layer in cache.layers))
    assert all(attends) == fused_expected, attends
    return torch.cat(out, 1)


def test_streaming_and_kaizen_decode_through_the_kernel_equal_the_read_back(tmp_path, run_in_triton_interpreter):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    want = streaming_logits(str(tmp_path / "m"), fused_expected=False)  # this process: no interpreter, read-back
    torch.save(want, tmp_path / "want.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(TESTS / "cache")!r}); sys.path.insert(0, {str(TESTS / "kaizen")!r})
        from test_packed_decode_cache import streaming_logits
        got = streaming_logits({str(tmp_path / "m")!r}, fused_expected=True)
        want = torch.load({str(tmp_path / "want.pt")!r})
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        print("streaming OK", float((got - want).abs().max()))
        import os
        os.environ["KVLEARN_PACKED_DECODE"] = "0"  # the switch: the read-back path even where the kernel runs
        torch.testing.assert_close(streaming_logits({str(tmp_path / "m")!r}, fused_expected=False), want,
                                   atol=1e-4, rtol=1e-4)
        del os.environ["KVLEARN_PACKED_DECODE"]

        # KV-Kaizen: mixed bits and sharing, against the configuration's no-cache forward
        from test_cache_sharing import CONFIGS, config, decode_through, tiny
        from kvlearn.kaizen.cache import make_cache
        for name in ("sharing, mixed bits", "mixed bits, no sharing", "one anchor"):
            model = tiny(1, head_dim=64)
            cfg = config(model, *CONFIGS[name])
            ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
            cache = make_cache(cfg, model.config, capacity=32)
            got = decode_through(model, cache, ids, 11)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            fused = [layer.store_attends for layer, a in zip(cache.layers, cfg.actions)
                     if not a.share and a.bits < 16]
            assert fused and all(fused), (name, fused)
            print("kaizen OK", name, float((got - ref).abs().max()))
    """)
    out = run_in_triton_interpreter(script)
    assert "streaming OK" in out and out.count("kaizen OK") == 3, out


@pytest.mark.gpu
def test_cuda_decode_through_the_kernel_equals_the_read_back(tmp_path, monkeypatch):
    """On CUDA the packed store attends decode steps itself by default; ``KVLEARN_PACKED_DECODE=0`` gives the
    read-back path; the logits agree (float32 model, 4-bit stores)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvlearn

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "m")

    def run():
        model = kvlearn.attach(kvlearn.load(str(tmp_path / "m"), dtype=torch.float32, device="cuda"))
        cache = streaming_cache(StreamingConfig(budget=16, sinks=2), model.config,
                                store_factory=lambda: PackedStore(4))
        ids = torch.randint(1, 60, (2, 34), generator=torch.Generator().manual_seed(5)).cuda()
        with torch.no_grad():
            out = [model(input_ids=ids[:, :20], past_key_values=cache, use_cache=True).logits[:, -1:]]
            out += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                    for t in range(20, 34)]
        return torch.cat(out, 1), all(layer.store_attends for layer in cache.layers)

    fused, attended = run()
    monkeypatch.setenv("KVLEARN_PACKED_DECODE", "0")
    read_back, attended_off = run()
    assert attended and not attended_off
    torch.testing.assert_close(fused, read_back, atol=1e-4, rtol=1e-4)
