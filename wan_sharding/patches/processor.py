"""The per-instance attention processor that the ``rope``, ``qkv`` and ``prompt_kv`` patches share.

It computes what diffusers' ``WanAttnProcessor`` computes (projections, RMSNorm across heads,
rotary, SDPA, output projection), with three switches the patches set on one module's processor:

- ``half_rotary``: rotary as ``x * cos + rotate_half(x) * sin`` on heads-first q / k whose
  channels are laid out in halves (the ``rope`` patch permutes the weights to match), the form
  tt-mlir fuses into ``ttnn.rotary_embedding``; otherwise diffusers' interleaved-pair form.
- ``qkv_groups``: the projections come from one fused Linear (``to_qkv`` for self-attention,
  ``to_kv`` for cross-attention) whose rows are interleaved per TP shard (the ``qkv`` patch).
- ``prompt_key``: a cross-attention that may be handed its K / V ready-made, computed once per
  prompt (the ``prompt_kv`` patch): given the prompt state (a dict) in place of the text
  embedding, it reads its own entry instead of projecting.

It also provides ``attend(attn, hidden_states, rotary_emb, keep)``: self-attention with K / V cut to
the first ``keep`` tokens before SDPA, which ``wan_sharding.dit.attention.SliceKV`` (the ``slice``
padding mode) calls instead of its own restatement of the stock processor when the processor it
wraps has one. The ``mask`` mode needs nothing: it passes its key mask as ``attention_mask``.

The Wan 2.1 I2V image cross-attention (``add_k_proj``) is not handled; the patches that install
this processor refuse such models.
"""

from __future__ import annotations

from typing import Any

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (its two halves): the NeoX rotation, written as
    tt-mlir's RoPE fusion matches it (two plain slices, a negation of the second, a concat)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def widen(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``x`` in the wider of its and ``table``'s dtypes (what ``x * table`` promotes to: bf16 q / k
    against f32 rope tables). Read from the item sizes, not ``torch.promote_types``, which torchax
    has no lowering for; where neither is wider, the products still promote as they would."""
    return x.to(table.dtype) if table.dtype.itemsize > x.dtype.itemsize else x


def half_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on a head dim laid out in halves (first elements of all pairs, then the second
    elements), with ``cos`` / ``sin`` tables laid out the same way
    (:func:`~wan_sharding.patches.rope.half_rope_forward`): ``x * cos + rotate_half(x) * sin``, with
    ``x`` cast once (:func:`widen`). Heads-first ``x`` ``(B, H, S, D)`` with ``(1, 1, S, D)`` tables is
    the form tt-mlir fuses. The values are the interleaved form's, permuted, bit for bit: casting
    bf16 up is exact, before or after the slices, ``a + (-b) * s`` is ``a - b * s`` and ``b * c + a *
    s`` is ``a * s + b * c`` in IEEE arithmetic."""
    wide = widen(x, cos)
    return (wide * cos + rotate_half(wide) * sin).type_as(x)


def heads_first_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`half_rotary` of token-major ``(B, L, H, D)`` q / k with ``(1, L, 1, D)`` tables, run heads
    first (q / k ``(B, H, L, D)``, tables ``(1, 1, L, D)``) and handed back token-major. The transposes
    back meet the attention dispatch's own heads-first permute, which the compiler cancels."""
    cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
    return tuple(half_rotary(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (query, key))


def interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from ..dit.attention import apply_rotary

    return apply_rotary(x, cos, sin)


class PatchedAttnProcessor:
    """One attention module's processor while a patch needs one (``original``: what it replaced)."""

    # diffusers' dispatch reads these, as on WanAttnProcessor
    _attention_backend = None
    _parallel_config = None

    def __init__(self, original: Any):
        self.original = original
        self.half_rotary = False
        self.qkv_groups: int | None = None
        self.prompt_key: str | None = None
        self._attention_backend = getattr(original, "_attention_backend", None)
        self._parallel_config = getattr(original, "_parallel_config", None)

    # ---- installing / releasing on one module -------------------------------------------------
    @classmethod
    def on(cls, attn: torch.nn.Module) -> "PatchedAttnProcessor":
        """``attn``'s PatchedAttnProcessor, installed over its current processor if needed."""
        proc = attn.processor
        if isinstance(proc, cls):
            return proc
        proc = cls(proc)
        attn.set_processor(proc)
        return proc

    @staticmethod
    def release(attn: torch.nn.Module) -> None:
        """Give ``attn`` its original processor back once no patch uses this one."""
        proc = attn.processor
        if (isinstance(proc, PatchedAttnProcessor) and not proc.half_rotary and proc.qkv_groups is None
                and proc.prompt_key is None):
            attn.set_processor(proc.original)

    @staticmethod
    def fits(attn: torch.nn.Module) -> str | None:
        """Why this processor cannot take over ``attn`` (None: it can)."""
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        proc = attn.processor
        if getattr(attn, "add_k_proj", None) is not None:
            return "image cross-attention (add_k_proj, Wan 2.1 I2V) is not supported"
        if getattr(attn, "fused_projections", False):
            return "diffusers' own fuse_projections() is applied; call unfuse_projections() first"
        if type(proc) is WanAttnProcessor or isinstance(proc, PatchedAttnProcessor):
            return None
        from ..dit.attention import PaddedAttention

        if isinstance(proc, PaddedAttention):
            return ("it carries the sequence-parallel padding processor; remove the SP handle, apply the "
                    "patches, then apply_dit_sp_activation_sharding again")
        return f"its processor is a {type(proc).__name__}, not diffusers' stock WanAttnProcessor"

    # ---- the computation ------------------------------------------------------------------------
    def projections(self, attn, hidden_states, encoder_hidden_states):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        g = self.qkv_groups
        if g is None:
            return attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        if encoder_hidden_states is None:  # rows [q_0, k_0, v_0, q_1, k_1, v_1, ...] per TP shard
            q, k, v = attn.to_qkv(hidden_states).unflatten(-1, (g, 3, -1)).unbind(-2)
            return q.flatten(-2), k.flatten(-2), v.flatten(-2)
        return (attn.to_q(hidden_states), *self.kv_projections(attn, context))

    def kv_projections(self, attn, context):
        """Cross-attention's K and V projections of the (embedded) prompt, before ``norm_k``."""
        g = self.qkv_groups
        if g is None:
            return attn.to_k(context), attn.to_v(context)
        k, v = attn.to_kv(context).unflatten(-1, (g, 2, -1)).unbind(-2)  # rows [k_0, v_0, k_1, v_1, ...]
        return k.flatten(-2), v.flatten(-2)

    def prompt_kv(self, attn, context):
        """What a cross-attention computes from the prompt alone: K after ``norm_k``, and V, each
        split into heads and laid out heads first, (B, heads, S, head dim), as SDPA takes them: the
        split runs once per prompt too, and the step's transpose back (for diffusers' dispatch)
        meets the dispatch's own permute, which the compiler folds away."""
        key, value = self.kv_projections(attn, context)
        return (attn.norm_k(key).unflatten(2, (attn.heads, -1)).transpose(1, 2),
                value.unflatten(2, (attn.heads, -1)).transpose(1, 2))

    def attend(self, attn, hidden_states, rotary_emb, keep: int | None, encoder_hidden_states=None,
               attention_mask=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if isinstance(encoder_hidden_states, dict):  # the prompt state: K / V made once per prompt
            if self.prompt_key is None:
                raise ValueError("this cross-attention got a prompt state (a dict) in place of the text embedding, but "
                                 "the 'prompt_kv' patch is not applied to it; pass the prompt embedding itself")
            query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
            key, value = (t.transpose(1, 2) for t in encoder_hidden_states[self.prompt_key])
        else:
            query, key, value = self.projections(attn, hidden_states, encoder_hidden_states)
            query, key = attn.norm_q(query), attn.norm_k(key)
            query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None and self.half_rotary:
            query, key = heads_first_rotary(query, key, *rotary_emb)
        elif rotary_emb is not None:
            query, key = interleaved_rotary(query, *rotary_emb), interleaved_rotary(key, *rotary_emb)
        if keep is not None:  # the slice padding mode: padded keys never reach SDPA
            key, value = key[:, :keep], value[:, :keep]
        out = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config if encoder_hidden_states is None else None,
        )
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, **kwargs):
        if getattr(attn, "add_k_proj", None) is not None:
            raise ValueError("PatchedAttnProcessor does not handle image cross-attention (add_k_proj)")
        return self.attend(attn, hidden_states, rotary_emb, None, encoder_hidden_states, attention_mask)

    def __repr__(self) -> str:
        return (f"PatchedAttnProcessor(half_rotary={self.half_rotary}, qkv_groups={self.qkv_groups}, "
                f"prompt_key={self.prompt_key!r}, original={type(self.original).__name__})")
