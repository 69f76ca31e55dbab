"""GQA -> MLA conversion (:mod:`kvlearn.kaizen.mla`) on tiny random models, float32: a GQA Qwen3 with k_norm (2 KV
heads, 2 query heads per KV head, head_dim 16), a Llama without q/k norm and a Qwen2 with q/k/v biases.

- full rank ``r = 2 n_kv d_h`` with every rotary component in the RoPE key (``d_R = n_kv d_h``) reproduces the GQA
  logits to 1e-4, both variants;
- a smaller ``d_R``: every attention score is within the documented bound ``|Δs| <= 2 ‖q_h‖ ‖(P k)_g‖`` (``P``
  commutes with RoPE), the dropped key energy is the sum of the dropped eigenvalues, and the logits error decreases
  as ``d_R`` grows and as the latent prefix ``d`` grows;
- bad input is a one-line error naming the value and the valid range.
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVLearnError
from kvlearn.kaizen import sharing
from kvlearn.kaizen.actions import Backbone, KaizenConfig
from kvlearn.kaizen.mla import convert_to_mla, is_mla, key_covariance, rope_components
from kvlearn.kaizen.mla_attention import MLAAttention

VOCAB = 64
KV, HEAD_DIM = 2, 16
FULL_ROPE, FULL_RANK = KV * HEAD_DIM, 2 * KV * HEAD_DIM  # 32, 64


def tiny(kind="qwen3", seed=0, layers=2):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=256, attn_implementation="sdpa")
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_norm.weight.uniform_(0.25, 2.0)
                layer.self_attn.q_norm.weight.uniform_(0.25, 2.0)
    elif kind == "qwen2":
        kw.pop("head_dim")
        model = Qwen2ForCausalLM(Qwen2Config(**kw)).eval()  # head_dim = 64 / 4 = 16
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.q_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    return model


def calibration(seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (4, 64), generator=g), torch.randint(0, VOCAB, (2, 40), generator=g)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("variant", ["svd", "care"])
@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2"])
def test_full_rank_full_rope_reproduces_the_gqa_logits(kind, variant):
    model = tiny(kind, 1)
    cal, ids = calibration()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    convert_to_mla(model, FULL_ROPE, cal, rank=FULL_RANK, variant=variant)
    assert is_mla(model) and all(isinstance(l.self_attn, MLAAttention) for l in model.model.layers)
    assert not hasattr(model.model.layers[0].self_attn, "v_proj")
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert (out - ref).abs().max() < 1e-4
    backbone = Backbone.from_model(model)
    assert (backbone.mla_rank, backbone.rope_dim, backbone.kv_heads) == (FULL_RANK, FULL_ROPE, KV)
    assert backbone.widths == (8, 16, 32, 64)


def test_default_rank_is_the_papers():
    model = tiny("llama")
    convert_to_mla(model, 16, calibration()[0])
    assert Backbone.from_model(model).mla_rank == KV * HEAD_DIM


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_rope_key_error_is_within_the_documented_bound(kind):
    """``s_GQA = rope(q_h)·rope(k_g)``, ``s_MLA = q_h·(P k)_g + q_R,h·k_R``; ``P = I - EᵀE`` commutes with RoPE,
    so ``|s_GQA - s_MLA| = |rope(q_h)·rope(Pk)_g - q_h·(Pk)_g| <= 2 ‖q_h‖ ‖(P k)_g‖`` (before the softmax scale)."""
    base = tiny(kind, 2)
    cal, ids = calibration()
    rope_dim = 8
    mla = convert_to_mla(copy.deepcopy(base), rope_dim, cal, rank=FULL_RANK)
    x = torch.randn(1, 24, 64)
    pos = torch.arange(24)[None]
    emb = base.model.rotary_emb(x, pos)
    orig, new = base.model.layers[0].self_attn, mla.model.layers[0].self_attn
    with torch.no_grad():
        q = orig.q_proj(x).view(1, 24, -1, HEAD_DIM).transpose(1, 2)
        k = orig.k_proj(x).view(1, 24, -1, HEAD_DIM).transpose(1, 2)
        if kind == "qwen3":
            q, k = orig.q_norm(q), orig.k_norm(k)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        q_rot, k_rot = apply_rotary_pos_emb(q, k, *emb)
        k_rep = k_rot.repeat_interleave(2, dim=1)
        s_gqa = q_rot @ k_rep.transpose(-1, -2)
        q2, _, q_r, k_r, c = new.project(x, emb)
        k_nope, _ = new.expand(c)
        s_mla = q2 @ k_nope.repeat_interleave(2, dim=1).transpose(-1, -2) + q_r @ k_r.transpose(-1, -2)
        pk = (k.transpose(1, 2).reshape(1, 24, -1) @ new.nope_proj.T).view(1, 24, KV, HEAD_DIM).transpose(1, 2)
        bound = 2 * q.norm(dim=-1)[..., None] * pk.norm(dim=-1).repeat_interleave(2, dim=1)[:, :, None, :]
        assert torch.allclose(k_nope, pk, atol=1e-5)  # full rank: the latent reconstructs the no-RoPE key exactly
    err = (s_gqa - s_mla).abs()
    assert err.max() > 1e-3  # the approximation is real at d_R = 8 ...
    assert (err <= bound + 1e-5).all()  # ... and within the bound


def test_dropped_key_energy_is_the_sum_of_the_dropped_eigenvalues():
    torch.manual_seed(0)
    keys = torch.randn(200, KV, HEAD_DIM, dtype=torch.float64) * torch.linspace(0.1, 2, HEAD_DIM, dtype=torch.float64)
    flat = keys.reshape(200, -1)
    total = (flat ** 2).sum()
    for rope_dim in (2, 8, 16, 32):
        e, energy = rope_components(key_covariance(keys), rope_dim)
        assert torch.allclose(e @ e.T, torch.eye(rope_dim, dtype=torch.float64), atol=1e-10)  # orthonormal rows
        kept = ((flat @ e.T) ** 2).sum()
        assert torch.allclose(kept, energy[: rope_dim // 2].sum(), rtol=1e-9)
        assert torch.allclose(total - kept, energy[rope_dim // 2:].sum(), rtol=1e-9)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_error_decreases_as_rope_dim_grows(kind):
    base = tiny(kind, 3)
    cal, ids = calibration()
    with torch.no_grad():
        ref = base(input_ids=ids).logits
    errors = []
    for rope_dim in (8, 16, 24, 32):
        model = convert_to_mla(copy.deepcopy(base), rope_dim, cal, rank=FULL_RANK)
        with torch.no_grad():
            errors.append(rel(model(input_ids=ids).logits, ref))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5


@pytest.mark.parametrize("variant", ["svd", "care"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_error_decreases_as_the_latent_prefix_grows(kind, variant):
    """One converted model (r = 64, d_R = 16) serves every width d in {8, 16, 32, 64} by prefix truncation; the
    error against the GQA model decreases with d down to the RoPE-key error of the full latent."""
    base = tiny(kind, 3)
    cal, ids = calibration()
    with torch.no_grad():
        ref = base(input_ids=ids).logits
    model = sharing.attach(convert_to_mla(copy.deepcopy(base), 16, cal, rank=FULL_RANK, variant=variant))
    backbone = Backbone.from_model(model)
    errors = []
    for d in backbone.widths:
        with torch.no_grad():
            out = model(input_ids=ids, kaizen_config=KaizenConfig.static(backbone, rank=d), use_cache=False).logits
        errors.append(rel(out, ref))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits  # no configuration: the full latent
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] == pytest.approx(rel(full, ref), abs=1e-6)


def test_care_beats_weight_only_svd_on_the_calibration_objective():
    base = tiny("qwen3", 3)
    cal, ids = calibration()
    with torch.no_grad():
        ref = base(input_ids=cal).logits
    errors = {}
    for variant in ("svd", "care"):
        model = sharing.attach(convert_to_mla(copy.deepcopy(base), 16, cal, rank=FULL_RANK, variant=variant))
        cfg = KaizenConfig.static(Backbone.from_model(model), rank=16)
        with torch.no_grad():
            errors[variant] = rel(model(input_ids=cal, kaizen_config=cfg, use_cache=False).logits, ref)
    assert errors["care"] < errors["svd"], errors


BAD = [
    (dict(rope_dim=15), "rope_dim=15 is invalid: expected an even integer in [2, 32]"),
    (dict(rope_dim=34), "rope_dim=34 is invalid: expected an even integer in [2, 32]"),
    (dict(rope_dim=0), "rope_dim=0 is invalid"),
    (dict(rank=12), "rank=12 is invalid: expected a multiple of 8 in [8, 64]"),
    (dict(rank=72), "rank=72 is invalid: expected a multiple of 8 in [8, 64]"),
    (dict(variant="pca"), "variant='pca' is invalid: expected one of svd, care"),
    (dict(input_ids=torch.rand(2, 4)), "input_ids is invalid"),
]


@pytest.mark.parametrize("kwargs, message", BAD)
def test_bad_conversion_input_is_one_line(kwargs, message):
    model = tiny("llama")
    args = dict(rope_dim=16, input_ids=calibration()[0], rank=32)
    args.update(kwargs)
    with pytest.raises(KVLearnError) as err:
        convert_to_mla(model, **args)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not is_mla(model)


def test_converting_twice_is_refused():
    model = convert_to_mla(tiny("llama"), 16, calibration()[0])
    with pytest.raises(KVLearnError, match="already converted"):
        convert_to_mla(model, 16, calibration()[0])


def test_calibration_statistics_are_batched_and_skip_padding():
    """Streaming statistics: any ``batch_size`` gives the same moments; right padding (masked) adds nothing."""
    from kvlearn.kaizen.mla import calibrate

    model = tiny("qwen3", 4)
    cal = calibration()[0]
    one = calibrate(model, cal, batch_size=4)
    rows = calibrate(model, cal, batch_size=1)
    padded = torch.cat([cal, torch.randint(0, VOCAB, (4, 5))], dim=1)
    mask = torch.cat([torch.ones(4, 64, dtype=torch.long), torch.zeros(4, 5, dtype=torch.long)], dim=1)
    masked = calibrate(model, padded, attention_mask=mask, batch_size=3)
    for a, b, c in zip(one, rows, masked):
        assert a.tokens == b.tokens == c.tokens == 4 * 64
        for other in (b, c):
            torch.testing.assert_close(other.xtx, a.xtx, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(other.cov, a.cov, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_a_saved_conversion_loads_back(kind, tmp_path):
    """``save_pretrained`` + :func:`kvlearn.load`: the MLA attention is rebuilt with its tensors (same logits at a
    truncated width); a checkpoint that lost them is a one-line error."""
    import kvlearn
    from safetensors.torch import load_file, save_file

    model = sharing.attach(convert_to_mla(tiny(kind, 6), 16, calibration()[0], rank=32, variant="care"))
    ids = calibration()[1]
    cfg = KaizenConfig.static(Backbone.from_model(model), bits=8, rank=8)
    with torch.no_grad():
        ref = model(input_ids=ids, kaizen_config=cfg, use_cache=False).logits
    model.save_pretrained(tmp_path / "mla")
    loaded = sharing.attach(kvlearn.load(tmp_path / "mla"))
    assert is_mla(loaded) and Backbone.from_model(loaded) == Backbone.from_model(model)
    with torch.no_grad():
        got = loaded(input_ids=ids, kaizen_config=cfg, use_cache=False).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    weights = tmp_path / "mla" / "model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if "up_v" not in k}, weights, metadata={"format": "pt"})
    with pytest.raises(KVLearnError, match=r"MLA checkpoint .*weights do not match \(missing \['model\.layers\.0\.self_attn\.up_v") as err:
        kvlearn.load(tmp_path / "mla")
    assert "\n" not in str(err.value)
