"""The padding modes' attention processors against diffusers' own WanAttnProcessor."""

import torch

from wan_sharding.mesh import padded_length
from wan_sharding.dit.attention import ForwardState, MaskPaddedKeys, SliceKV, build_key_mask
from wan_sharding.models import build_dit


def _attn_inputs(tokens=40, seed=0):
    dit = build_dit("t2v-a14b")
    attn = dit.blocks[0].attn1
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, attn.to_q.in_features, generator=g)
    cos, sin = (torch.randn(1, tokens, 1, attn.to_q.out_features // attn.heads, generator=g) for _ in range(2))
    return attn, x, (cos, sin)


def test_slice_processor_restates_wan_processor_bit_exactly():
    attn, x, rope = _attn_inputs()
    stock = attn.processor
    with torch.no_grad():
        expected = stock(attn, x, None, None, rope)
        ours = SliceKV(stock, ForwardState()).attend(attn, x, rope, keep=x.shape[1])
    assert torch.equal(ours, expected)


def test_both_modes_equal_unpadded_attention_on_the_valid_rows():
    attn, x, rope = _attn_inputs(tokens=37)
    stock = attn.processor
    n, n_pad = 37, padded_length(37, 64)
    pad = lambda t: torch.nn.functional.pad(t, [0, 0] * (t.ndim - 2) + [0, n_pad - n])  # noqa: E731
    xp, ropep = pad(x), tuple(pad(t) for t in rope)
    state = ForwardState(n, n_pad, build_key_mask(n, n_pad, x))
    with torch.no_grad():
        expected = stock(attn, x, None, None, rope)
        for mode in (SliceKV, MaskPaddedKeys):
            out = mode(stock, state)(attn, xp, None, None, ropep)[:, :n]
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_key_mask_is_zero_on_valid_keys_and_dtype_min_on_padding():
    m = build_key_mask(3, 5, torch.zeros(1, dtype=torch.bfloat16))
    assert m.shape == (1, 1, 1, 5) and m.dtype == torch.bfloat16
    assert m.flatten()[:3].eq(0).all() and m.flatten()[3:].eq(torch.finfo(torch.bfloat16).min).all()


def test_cross_attention_and_unpadded_calls_fall_through_to_the_stock_processor():
    attn, x, rope = _attn_inputs()
    stock = attn.processor
    with torch.no_grad():
        expected = stock(attn, x, None, None, rope)
        assert torch.equal(SliceKV(stock, ForwardState(40, 40))(attn, x, None, None, rope), expected)
        assert torch.equal(MaskPaddedKeys(stock, ForwardState())(attn, x, None, None, rope), expected)
