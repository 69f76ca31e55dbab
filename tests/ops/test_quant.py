"""kvlearn.ops.quant: the symmetric per-vector quantizer, its straight-through gradient, bit packing, KIVI's grouped
asymmetric quantizer and the cost model."""

import pytest
import torch

from kvlearn import KVLearnError
from kvlearn.ops.quant import (
    code_max, cost_bits_per_token, dequantize, fake_quantize, kivi_dequantize_keys, kivi_dequantize_values,
    kivi_quantize_keys, kivi_quantize_values, pack, quantize, unpack,
)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step(bits, dtype):
    x = (torch.randn(4, 3, 7, 32) * torch.rand(4, 3, 7, 1) * 5).to(dtype)
    codes, scale = quantize(x, bits)
    q = code_max(bits)
    assert codes.dtype == torch.int8 and scale.dtype == dtype and scale.shape == x.shape[:-1]
    assert int(codes.abs().max()) <= q
    # the scale is absmax / q, as stored in the model dtype
    torch.testing.assert_close(scale, (x.float().abs().amax(-1) / q).to(dtype), atol=0, rtol=0)
    err = (dequantize(codes, scale, torch.float32) - x.float()).abs()
    assert bool((err <= scale.float()[..., None] / 2 * (1 + 1e-6) + 1e-12).all())
    assert dequantize(codes, scale, dtype).dtype == dtype


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_values_on_the_grid_are_exact(bits):
    q = code_max(bits)
    codes = torch.randint(-q, q + 1, (5, 16), dtype=torch.int8)
    codes[:, 3] = q  # the absmax sits on the top code, so absmax / q is the grid step
    step = 2.0 ** torch.randint(-4, 4, (5, 1)).float()
    x = codes.float() * step
    got_codes, scale = quantize(x, bits)
    assert torch.equal(got_codes, codes)
    assert torch.equal(scale, step[:, 0])
    assert torch.equal(dequantize(got_codes, scale, torch.float32), x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_zero_vectors_have_zero_scale_and_no_nan(bits):
    x = torch.randn(3, 8)
    x[1] = 0
    codes, scale = quantize(x, bits)
    assert scale[1] == 0 and bool((codes[1] == 0).all())
    out = dequantize(codes, scale, torch.float32)
    assert bool(torch.isfinite(out).all()) and bool((out[1] == 0).all())
    xg = x.clone().requires_grad_()
    fake_quantize(xg, bits).sum().backward()
    assert bool(torch.isfinite(xg.grad).all())


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_fake_quantize_forward_and_straight_through_gradient(bits):
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = fake_quantize(x, bits)
    expected = x.detach() if bits == 16 else dequantize(*quantize(x.detach(), bits), x.dtype)
    assert torch.equal(y.detach(), expected)
    g = torch.randn_like(x)
    (y * g).sum().backward()
    assert torch.equal(x.grad, g)  # d fake_quantize(x) / dx = identity


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_requantizing_keeps_the_codes(bits):
    x = torch.randn(6, 32)
    codes, scale = quantize(x, bits)
    again, _ = quantize(dequantize(codes, scale, torch.float32), bits)
    assert torch.equal(again, codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_exact_inverse(bits):
    q = code_max(bits)
    codes = torch.randint(-q, q + 1, (3, 4, 5, 64), dtype=torch.int8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits, 64), codes)
    # every byte value unpacks and packs back (the representation is a bijection)
    every = torch.arange(256, dtype=torch.int16).to(torch.uint8)[:, None]
    assert torch.equal(pack(unpack(every, bits, 8 // bits), bits), every)


def test_packing_layout_is_the_documented_one():
    # 2-bit: u = c + 2, first value in the low bits; 4-bit: u = c + 8
    assert pack(torch.tensor([-1, 0, 1, -2], dtype=torch.int8), 2).tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6]
    assert pack(torch.tensor([-7, 7], dtype=torch.int8), 4).tolist() == [1 | 15 << 4]
    assert pack(torch.tensor([-127, 0], dtype=torch.int8), 8).tolist() == [1, 128]


def test_pack_checks_divisibility():
    with pytest.raises(KVLearnError, match="divisible by 4"):
        pack(torch.zeros(3, 6, dtype=torch.int8), 2)


@pytest.mark.parametrize("bad", [1, 3, 0, 32, 4.0, True, "4"])
def test_bad_bit_widths_are_one_line_errors(bad):
    with pytest.raises(KVLearnError) as err:
        fake_quantize(torch.zeros(2, 8), bad)
    assert "expected one of 2, 4, 8, 16" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(KVLearnError, match="expected one of 2, 4, 8"):
        quantize(torch.zeros(2, 8), bad)


def test_sixteen_bits_is_not_an_integer_code():
    with pytest.raises(KVLearnError, match="16 = no quantization"):
        quantize(torch.zeros(2, 8), 16)


def test_kivi_keys_per_channel_over_token_groups_hand_computed():
    # [T=4, D=2], group_size 2, 2 bits (levels 0..3): groups are tokens {0,1} and {2,3} of each channel
    k = torch.tensor([[0.0, 5.0], [3.0, 5.0], [1.0, -1.0], [-2.0, 2.0]])
    codes, scale, minimum = kivi_quantize_keys(k, 2, 2)
    # channel 0: group 0 min 0 max 3 -> scale 1; group 1 min -2 max 1 -> scale 1
    # channel 1: group 0 constant 5 -> scale 0, codes 0; group 1 min -1 max 2 -> scale 1
    assert scale.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert minimum.tolist() == [[0.0, 5.0], [-2.0, -1.0]]
    assert codes.tolist() == [[0, 0], [3, 0], [3, 0], [0, 3]]
    assert torch.equal(kivi_dequantize_keys(codes, scale, minimum, torch.float32), k)


def test_kivi_values_per_token_over_channel_groups_hand_computed():
    # [T=2, D=4], group_size 2, 2 bits: groups are channels {0,1} and {2,3} of each token
    v = torch.tensor([[0.0, 0.9, 2.0, 8.0], [4.0, 4.0, -3.0, 0.0]])
    codes, scale, minimum = kivi_quantize_values(v, 2, 2)
    # token 0: (0, 0.9) scale 0.3 -> codes 0, 3; (2, 8) scale 2 -> 0, 3
    # token 1: (4, 4) constant -> scale 0; (-3, 0) scale 1 -> 0, 3
    torch.testing.assert_close(scale, torch.tensor([[0.3, 2.0], [0.0, 1.0]]))
    assert minimum.tolist() == [[0.0, 2.0], [4.0, -3.0]]
    assert codes.tolist() == [[0, 3, 0, 3], [0, 0, 0, 3]]
    torch.testing.assert_close(kivi_dequantize_values(codes, scale, minimum, torch.float32), v)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_round_trip_error_bounded(bits):
    k = torch.randn(2, 3, 32, 16)
    codes, scale, minimum = kivi_quantize_keys(k, bits, 8)
    assert scale.shape == (2, 3, 4, 16) and int(codes.max()) <= 2 ** bits - 1
    err = (kivi_dequantize_keys(codes, scale, minimum, torch.float32) - k).abs()
    assert bool((err <= scale.repeat_interleave(8, dim=-2) / 2 + 1e-6).all())
    codes, scale, minimum = kivi_quantize_values(k, bits, 4)
    assert scale.shape == (2, 3, 32, 4)
    err = (kivi_dequantize_values(codes, scale, minimum, torch.float32) - k).abs()
    assert bool((err <= scale.repeat_interleave(4, dim=-1) / 2 + 1e-6).all())


def test_kivi_group_size_must_divide():
    with pytest.raises(KVLearnError, match="group_size=5"):
        kivi_quantize_keys(torch.zeros(12, 4), 2, 5)


def test_cost_model_matches_the_paper():
    # KV-Kaizen Table 10: 4-bit, one bf16 scale per 128-element row -> 4.00x before metadata, 3.88x after
    cost = cost_bits_per_token(128, 4, 16)
    assert cost == (2 * (128 * 4 + 16), 2 * 128 * 4)
    assert 2 * 128 * 16 / cost.codes == 4.0 and round(2 * 128 * 16 / cost.total, 2) == 3.88
    assert cost_bits_per_token(128, 16, 16) == (4096, 4096)


def test_kivi_cost_matches_the_paper():
    # KV-Kaizen Table 6: 2-bit KIVI, G = 128, bf16 metadata: 7.11x without the window, 5.15x with a 128-token bf16
    # window in a 2048-token context; 4-bit G = 128: 4.25 bits per element before the window
    from kvlearn.ops.quant import kivi_bits_per_element
    assert round(16 / kivi_bits_per_element(2, 128), 2) == 7.11
    assert round(16 / kivi_bits_per_element(2, 128, residual=128, tokens=2048), 2) == 5.15
    assert kivi_bits_per_element(4, 128) == 4.25
    assert round(kivi_bits_per_element(4, 128, residual=128, tokens=16384), 2) == 4.34  # the 3.7x of Table 2
