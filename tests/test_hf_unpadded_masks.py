"""kvlearn.hf.unpadded_causal_masks: a training forward gets transformers' prepared mask mapping (every mask None)
only where that is exact, and then gives the same logits without reading the device."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from kvlearn.hf import unpadded_causal_masks


def qwen3(**kw):
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw)).eval()


def test_sdpa_gets_the_mapping_and_the_same_logits_without_a_device_read(monkeypatch):
    model = qwen3()  # GQA: 2 KV heads, 2 query heads each
    masks = unpadded_causal_masks(model)
    assert masks == {"full_attention": None}
    ids = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits  # transformers builds the mask (and reads a bool)
        calls = []
        real = torch.Tensor.__bool__
        monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: calls.append(1) or real(t))
        got = model(input_ids=ids, attention_mask=masks, use_cache=False).logits
        monkeypatch.undo()
    assert calls == []
    assert torch.equal(got, expected)
    # and it is causal: a later token does not change an earlier position's logits
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    with torch.no_grad():
        other = model(input_ids=changed, attention_mask=masks, use_cache=False).logits
    assert torch.equal(other[:, :-1], got[:, :-1]) and not torch.equal(other[:, -1], got[:, -1])


@pytest.mark.parametrize("case", ["eager", "sliding", "llama"])
def test_none_where_the_mapping_would_not_be_exact(case):
    """Eager attention needs its mask (None would attend to the future), a sliding-window layer needs its window,
    and Llama's forward (transformers 5.17) takes no prepared mapping: transformers keeps building the masks."""
    if case == "eager":
        model = qwen3()
        model.config._attn_implementation = "eager"
    elif case == "sliding":
        model = qwen3(use_sliding_window=True, sliding_window=8, max_window_layers=0)
        assert "sliding_attention" in model.config.layer_types
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2))
    assert unpadded_causal_masks(model) is None


def test_a_forward_captured_in_a_cuda_graph_gets_the_mapping(monkeypatch):
    """While a CUDA graph is captured transformers' SDPA mask function never skips the mask (it counts capture as
    tracing), so a probe made then would say "build it" and the captured forward would run SDPA with a full
    ``[B, 1, T, T]`` mask. The answer of an earlier call outside the capture is used instead; with none, ``None``.
    (Capture is simulated: ``torch.cuda.is_current_stream_capturing`` is what transformers asks.)"""
    from transformers.masking_utils import create_causal_mask

    import kvlearn.hf as hf

    model = qwen3()
    monkeypatch.setattr(hf, "_UNPADDED_PROBES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    probe = create_causal_mask(config=model.config, inputs_embeds=torch.zeros(1, 2, 1), attention_mask=None,
                               past_key_values=None, position_ids=None)
    assert probe is not None  # what a probe inside the capture would see: the reason for the memo
    assert unpadded_causal_masks(model) is None  # no answer from outside a capture yet: transformers builds the mask
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert unpadded_causal_masks(model) == {"full_attention": None}  # the eager step before the capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert unpadded_causal_masks(model) == {"full_attention": None}  # the captured step: the eager answer
    eager = qwen3()
    eager.config._attn_implementation = "eager"
    assert unpadded_causal_masks(eager) is None  # a different mask function is probed on its own (and not inside)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert unpadded_causal_masks(eager) is None  # eager attention needs its mask, remembered as such
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert unpadded_causal_masks(eager) is None


@pytest.mark.gpu
def test_real_cuda_graph_capture_gets_the_mapping():
    """The same inside a real capture on the GPU: after one eager call, the call made while capturing returns the
    mapping, and the captured forward replays to the eager logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = qwen3().cuda()
    ids = torch.randint(0, 64, (2, 24), device="cuda")
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=unpadded_causal_masks(model), use_cache=False).logits
        seen = []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            masks = unpadded_causal_masks(model)
            seen.append(masks)
            out = model(input_ids=ids, attention_mask=masks, use_cache=False).logits
        graph.replay()
        torch.cuda.synchronize()
    assert seen == [{"full_attention": None}]
    torch.testing.assert_close(out, expected)
