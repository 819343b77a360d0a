"""Exact self-attention over a padded token dim: the padding modes.

Padding L to a multiple of SP x 32 adds keys that must not be attended to. Each mode is a
per-instance attention processor that wraps the model's own processor (``WanAttnProcessor``):

- ``slice``: K and V are cut back to the valid tokens before SDPA in every block (the original
  design's mode). Costs two ``slice`` ops per block: +81 ``ttnn.slice_static`` for 40 blocks and
  ~5.6 s -> ~8.9 s per iteration at 480p on a Galaxy (``docs/hardware-facts.md``).
- ``mask``: an additive key mask (0 for valid keys, a large negative value for padded ones) built
  once per forward and passed to every self-attention through the stock processor's
  ``attention_mask``. No per-block op beyond what SDPA already does with a mask.

A padded key gets weight exp(min - max) == 0 exactly, so both modes match the unpadded model up to
floating-point reordering.
"""

from __future__ import annotations

from typing import Any

import torch

from ..options import DEFAULT_PADDING, PADDING_NAMES  # noqa: F401  (DEFAULT_PADDING re-exported beside the modes)
from ..hooks import ForwardState, RefusesCopy  # noqa: F401  (ForwardState: the processors' shared state)


def build_key_mask(valid_len: int, padded_len: int, like: torch.Tensor) -> torch.Tensor:
    """(1, 1, 1, padded_len) additive mask in ``like``'s dtype: 0 for valid keys, dtype-min after."""
    pos = torch.arange(padded_len, device=like.device)
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    neg = torch.full((), torch.finfo(like.dtype).min, dtype=like.dtype, device=like.device)
    return torch.where(pos < valid_len, zero, neg).view(1, 1, 1, padded_len)


class PaddedAttention(RefusesCopy):
    """Base for the per-instance processors: falls through to the wrapped processor when the
    forward is not padded or the call is not self-attention."""

    mode = "?"

    def __init__(self, inner: Any, state: ForwardState):
        self.inner = inner
        self.state = state

    def __getattr__(self, name: str) -> Any:  # _attention_backend, _parallel_config, ...
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, **kwargs):
        if encoder_hidden_states is not None or not self.state.padded:
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if attention_mask is not None:
            raise ValueError("padded self-attention got its own attention_mask; Wan self-attention takes none")
        return self.padded_call(attn, hidden_states, rotary_emb, **kwargs)

    def padded_call(self, attn, hidden_states, rotary_emb, **kwargs):
        raise NotImplementedError


class MaskPaddedKeys(PaddedAttention):
    """Padded keys masked out by the mask built once per forward; the stock processor does the rest."""

    mode = "mask"

    def padded_call(self, attn, hidden_states, rotary_emb, **kwargs):
        return self.inner(attn, hidden_states, None, self.state.key_mask, rotary_emb, **kwargs)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same interleaved-pair rotation as WanAttnProcessor (checked bit-exact in the tests), with the
    # cast of the (float32-table) products to x's dtype written out: torch's setitem casts them
    # silently, JAX's scatter under torchax warns that it will refuse to (a FutureWarning per block).
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = (x1 * cos - x2 * sin).to(out.dtype)
    out[..., 1::2] = (x1 * sin + x2 * cos).to(out.dtype)
    return out


class SliceKV(PaddedAttention):
    """K and V sliced back to the valid tokens before SDPA, in every block (the original design's mode).

    The slice has to sit between RoPE and SDPA, inside the processor, so this path restates
    ``WanAttnProcessor``'s self-attention steps; ``tests/test_attention.py`` checks it stays
    bit-identical to the stock processor when nothing is sliced.
    """

    mode = "slice"

    def padded_call(self, attn, hidden_states, rotary_emb, **kwargs):
        # Hook point: a wrapped processor that restates attention itself (``wan_sharding.patches``)
        # provides the same ``attend`` and slices its own K/V; the stock processor gets ours.
        # (`is None`, not `or`: dynamo cannot take the truth value of a bound method, a graph break)
        attend = getattr(self.inner, "attend", None)
        if attend is None:
            attend = self.attend
        return attend(attn, hidden_states, rotary_emb, self.state.valid_len)

    def attend(self, attn, hidden_states, rotary_emb, keep: int):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        key, value = key[:, :keep], value[:, :keep]  # the per-block slice this mode pays for
        out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                    backend=self.inner._attention_backend, parallel_config=None)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


PADDING_MODES: dict[str, type[PaddedAttention] | None] = {
    "slice": SliceKV,
    "mask": MaskPaddedKeys,
    "none": None,  # no padding at all: per-device token counts may not be tile-aligned
}
assert set(PADDING_MODES) == set(PADDING_NAMES), "wan_sharding.options.PADDING_NAMES and the modes here disagree"
