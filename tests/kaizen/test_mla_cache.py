"""Serving an MLA-converted model through the latent cache (:class:`kvlearn.cache.LatentStore` in a
:class:`KaizenCache`), float32 tiny models of :mod:`test_mla_conversion` (Qwen3 with k_norm: decompressed decode;
Llama: absorbed decode).

- prefill + token-by-token decoding through the cache equals the ``use_cache=False`` forward with the same actions
  (rank truncation and precision) to 1e-4, and so does ``generate()``, and the ``context`` protocol (a dense
  context forward, then a question chunk and decoding); a left-padded batch equals its rows alone;
- the absorbed decode equals the decompressed one; a plain ``DynamicCache`` holds ``(k_R, c)`` and decodes the same;
- the cache holds exactly the bytes of the cost model (hand-computed);
- sharing layers (depth on MLA) attend their anchor's latent, in the forward, the cache and the training mixture
  (expanded K/V, or absorbed through a cache without k_norm: :mod:`test_mla_share_absorbed`);
- bad input (a rank on a GQA model, a width not in the action set, eviction on MLA, a mismatched backbone) is a
  one-line error.
"""

import copy

import pytest
import torch
from transformers import DynamicCache

from kvlearn import KVLearnError
from kvlearn.cache import LatentStore
from kvlearn.kaizen import sharing
from kvlearn.kaizen.actions import Backbone, KaizenConfig, LayerAction, action_bits, action_space
from kvlearn.kaizen.cache import KaizenCache, make_cache
from kvlearn.kaizen.mla import convert_to_mla

from test_mla_conversion import FULL_RANK, VOCAB, calibration, tiny

ROPE = 16


def converted(kind, seed=1, rope_dim=ROPE, rank=FULL_RANK, variant="care"):
    return sharing.attach(convert_to_mla(tiny(kind, seed), rope_dim, calibration()[0], rank=rank, variant=variant))


def config(model, *actions):
    return KaizenConfig(Backbone.from_model(model, scale_bits=32), actions)


A = LayerAction
CONFIGS = {
    "full latent, 16 bits": (A(16), A(16)),
    "truncated": (A(16, 8), A(16, 32)),
    "truncated and quantized": (A(4, 16), A(8)),
    "2 bits": (A(2, 32), A(16, 8)),
}
S = A.shared()
SHARED = {  # 4-layer models
    "share a truncated anchor": (A(16, 16), S, A(4, 32), S),
    "one anchor": (A(8), S, S, S),
}


def decode_through(model, cache, ids, prompt):
    with torch.no_grad():
        out = [model(input_ids=ids[:, :prompt], past_key_values=cache, use_cache=True).logits]
        out += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                for t in range(prompt, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_decoding_through_the_latent_store_equals_the_mla_forward(kind, name):
    model = converted(kind)
    cfg = config(model, *CONFIGS[name])
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
        full = model(input_ids=ids, use_cache=False).logits
    cache = make_cache(cfg, model.config, capacity=24)
    got = decode_through(model, cache, ids, 7)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    if name != "full latent, 16 bits":
        assert float((ref - full).abs().max()) > 1e-3  # the action changes the model
    for layer, action in zip(cache.layers, cfg.actions):
        assert isinstance(layer.store, LatentStore)
        assert layer.store.shape == (2, 1, 24, ROPE, action.rank or FULL_RANK)
        assert layer.store.bits == action.bits
    assert model.model.layers[0].self_attn.absorb == (kind == "llama")


@pytest.mark.parametrize("name", list(SHARED))
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_sharing_layers_decode_like_the_mla_forward(kind, name):
    """Depth on MLA: a sharing layer attends its anchor's latent; prefill + decoding (sharing layers
    are BorrowedLayers, 0 bytes) equals the no-cache forward, and the sharer's own latent projections are unused."""
    model = sharing.attach(convert_to_mla(tiny(kind, 13, layers=4), ROPE, calibration()[0], rank=FULL_RANK))
    cfg = config(model, *SHARED[name])
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
    cache = make_cache(cfg, model.config, capacity=20)
    got = decode_through(model, cache, ids, 6)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert cache.store_bytes() == cfg.cache_bytes(batch=2, tokens=20, dtype_bits=32)
    assert all(cache.layers[l].allocated_bytes() == 0 for l, a in enumerate(cfg.actions) if a.share)
    with torch.no_grad():
        for l, a in enumerate(cfg.actions):
            if a.share:
                model.model.layers[l].self_attn.kv_down.weight.normal_()
                model.model.layers[l].self_attn.up_v.normal_()
        after = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
    torch.testing.assert_close(after, ref, atol=1e-6, rtol=0)


def test_absorbed_decode_equals_decompressed_decode():
    model = converted("llama")
    cfg = config(model, A(16, 16), A(8, 32))
    ids = torch.randint(1, VOCAB, (1, 14))
    absorbed = decode_through(model, make_cache(cfg, model.config, 16), ids, 4)
    for layer in model.model.layers:
        layer.self_attn.absorb = False
    decompressed = decode_through(model, make_cache(cfg, model.config, 16), ids, 4)
    torch.testing.assert_close(absorbed, decompressed, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_generate_through_the_cache_equals_the_no_cache_forward(kind):
    model = converted(kind, 3)
    cfg = config(model, *CONFIGS["truncated and quantized"])
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model.generate(input_ids=ids, past_key_values=make_cache(cfg, model.config, capacity=16),
                             max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        ref = model(input_ids=out.sequences[:, :-1], use_cache=False, kaizen_config=cfg).logits
    torch.testing.assert_close(torch.stack(out.logits, dim=1), ref[:, 8:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_dynamic_cache_holds_the_latent_and_decodes_the_same(kind):
    model = converted(kind, 4)
    ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    cache = DynamicCache()
    got = decode_through(model, cache, ids, 5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    k_r, c = cache.layers[0].keys, cache.layers[0].values
    assert k_r.shape == (2, 1, 12, ROPE) and c.shape == (2, 1, 12, FULL_RANK)


def test_padded_batch_equals_rows_alone():
    from test_cache_sharing import assert_padded_batch_equals_rows_alone

    model = converted("qwen3", 10)
    assert_padded_batch_equals_rows_alone(model, config(model, *CONFIGS["truncated and quantized"]), max_new_tokens=4)


def test_allocated_bytes_equal_the_cost_model_exactly():
    model = converted("qwen3", 7)
    cfg = config(model, A(16, 8), A(4, 16))
    cache = make_cache(cfg, model.config, capacity=16)
    with torch.no_grad():
        model(input_ids=torch.randint(1, VOCAB, (2, 5)), past_key_values=cache, use_cache=True)
    # per (batch row, slot), float32: b16/d8 = (8 + 16) x 4 = 96; b4/d16 = (16 + 16) / 2 codes + 2 scales of 4 = 24
    assert cache.store_bytes() == 2 * 16 * (96 + 24) == cfg.cache_bytes(batch=2, tokens=16, dtype_bits=32)
    assert cache.layers[1].store.bytes_per_token() * 8 == action_bits(A(4, 16), cfg.backbone)
    assert cache.allocated_bytes() == cache.store_bytes() + 2 * 2 * 16 * 4  # + int32 slot positions
    # against the bf16 GQA reference, in bits: L 2 n_kv d_h 16 / ((8 + 16) 16 + (16 + 16) 4 + 2 scales of 32)
    assert cfg.compression() == pytest.approx((2 * 2 * 2 * 16 * 16) / (24 * 16 + 32 * 4 + 2 * 32))


def test_rank_actions_are_in_the_action_space_of_a_converted_model():
    model = converted("llama")
    backbone = Backbone.from_model(model)
    ranks = {a.rank for a in action_space(backbone) if not a.share}
    assert ranks == {None, 8, 16, 32}
    assert Backbone.from_model(tiny("llama")).is_mla is False


def test_bad_input_is_refused_in_one_line():
    model = converted("qwen3", 9)
    gqa = sharing.attach(tiny("qwen3", 9))
    backbone = Backbone.from_model(model)
    mla_like = Backbone(2, 2, 16, mla_rank=FULL_RANK, rope_dim=ROPE)
    other_rope = Backbone(2, 2, 16, mla_rank=FULL_RANK, rope_dim=8)
    ids = torch.ones(1, 3, dtype=torch.long)
    broken = copy.deepcopy(gqa)
    broken.config.kv_lora_rank, broken.config.qk_rope_head_dim = FULL_RANK, ROPE
    cases = [
        (lambda: KaizenConfig.static(Backbone.from_model(gqa), rank=8), "rank=8 needs an MLA backbone; this one is GQA"),
        (lambda: KaizenConfig.static(backbone, rank=12), "rank=12 is invalid: expected one of 8, 16, 32, 64"),
        (lambda: gqa(input_ids=ids, kaizen_config=KaizenConfig.static(mla_like, rank=8)), "mla_rank.*the model has"),
        (lambda: make_cache(KaizenConfig.static(mla_like, rank=8), gqa.config, 8), "mla_rank.*the model has"),
        (lambda: make_cache(KaizenConfig.static(other_rope), model.config, 8), "rope_dim=8 differs from the model's 16"),
        (lambda: KaizenCache(KaizenConfig.static(backbone), 8, policy_factory=lambda l: None), "policy_factory"),
        (lambda: Backbone.from_model(broken), "config says MLA .* attention modules are GQA"),
    ]
    for make, message in cases:
        with pytest.raises(KVLearnError, match=message) as err:
            make()
        assert "\n" not in str(err.value)


def one_hot_mixture_matches_configurations(model, backbone, space, picks):
    """A ``kaizen_train`` forward whose per-row one-hot weights pick ``picks[row][layer]`` (indices into ``space``)
    equals, row by row, the ``kaizen_config`` forward of that configuration; backpropagates the logits' sum and
    returns the weights (their ``.grad`` set)."""
    from kvlearn.kaizen.sharing import KaizenTrainForward

    weights = torch.zeros(len(picks), len(picks[0]), len(space))
    for row, layers in enumerate(picks):
        for layer, a in enumerate(layers):
            weights[row, layer, a] = 1.0
    weights.requires_grad_(True)
    ids = torch.randint(1, VOCAB, (len(picks), 10), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=ids, use_cache=False, kaizen_train=KaizenTrainForward(space, weights)).logits
    with torch.no_grad():
        for row, layers in enumerate(picks):
            cfg = KaizenConfig(backbone, tuple(space[a] for a in layers))
            ref = model(input_ids=ids[row:row + 1], use_cache=False, kaizen_config=cfg).logits
            torch.testing.assert_close(out[row:row + 1], ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    return weights


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_training_mixture_with_one_hot_weights_is_the_chosen_configuration(kind):
    """``kaizen_train`` on an MLA model: per-row one-hot weights over precision x rank give each row's configuration
    (the ``kaizen_config`` forward); the gradient reaches the weights and the latent projections."""
    model = converted(kind, 12)
    backbone = Backbone.from_model(model)
    space = action_space(backbone, ("precision", "rank"))
    assert len(space) == 16
    picks = [[3, 9], [14, 0]]  # per row, per layer: indices into the space
    weights = one_hot_mixture_matches_configurations(model, backbone, space, picks)
    assert weights.grad.abs().sum() > 0
    attn = model.model.layers[0].self_attn
    assert attn.kv_down.weight.grad.abs().sum() > 0 and attn.up_k.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_training_mixture_with_share_is_the_chosen_configuration(kind):
    """All three axes (17 actions): per-row one-hot weights with sharing rows give each row's configuration."""
    model = sharing.attach(convert_to_mla(tiny(kind, 14, layers=4), ROPE, calibration()[0], rank=FULL_RANK))
    backbone = Backbone.from_model(model)
    space = action_space(backbone)
    assert len(space) == 17 and space[-1].share
    picks = [[5, 16, 16, 2], [0, 9, 16, 16]]
    weights = one_hot_mixture_matches_configurations(model, backbone, space, picks)
    assert weights.grad[:, :, -1].abs().sum() > 0  # the share logit gets a gradient


def test_kaizen_static_uses_the_rank_axis_on_a_converted_model():
    """The least compressed uniform configuration at a target, over bits x width x sharing group."""
    from kvlearn.kaizen.fixed import static_config

    backbone = Backbone.from_model(converted("llama"))  # r = 64, d_R = 16; reference 2 x 2 x 2 x 16 x 16 bits
    cfg = static_config(backbone, 4.0)
    rho = cfg.compression(metadata=False)
    assert rho >= 4.0
    uniform = [KaizenConfig.static(backbone, b, d) for b in (16, 8, 4, 2) for d in (None, 32, 16, 8)]
    assert rho == min(c.compression(metadata=False) for c in uniform if c.compression(metadata=False) >= 4.0)
    # precision alone on the full latent: (64 + 16) x 4 bits is only 3.2x, so 2 bits
    assert static_config(backbone, 4.0, axes=("precision",)) == KaizenConfig.static(backbone, 2)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_context_protocol_through_the_latent_store_equals_the_mla_forward(kind):
    """The ``context`` protocol on MLA: the context in one full-attention forward (stored as truncated, quantized
    latents), then a multi-token question chunk, then decoding, equals the no-cache forward to 1e-4."""
    from kvlearn.cache import prefill

    model = converted(kind)
    cfg = config(model, *CONFIGS["truncated and quantized"])
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    cache = make_cache(cfg, model.config, capacity=32)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
        last = prefill(model, cache, ids[:, :20], dense=True)  # [batch, vocab]: the context's last column
        got = decode_through(model, cache, ids[:, 20:], 4)
    torch.testing.assert_close(last, ref[:, 19], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, ref[:, 20:], atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 30
