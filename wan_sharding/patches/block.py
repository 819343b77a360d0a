"""The per-instance block forward that the ``adaln_norm`` and ``adaln_bf16`` patches share.

It computes what diffusers' ``WanTransformerBlock.forward`` computes (adaLN modulation, self-attention,
cross-attention, feed-forward, gated residuals), with two switches the patches set on one block:

- ``fold_norm`` (``adaln_norm``): where the modulation is one vector for the whole batch (one sample,
  one timestep: the A14B experts), ``norm(x) * (1 + scale) + shift`` runs as one ``F.layer_norm``
  with ``1 + scale`` as its weight and ``shift`` as its bias, in float32 as vanilla. Otherwise (a
  batch of several samples) the vanilla expression runs for that forward.
- ``model_dtype`` (``adaln_bf16``): the modulation vectors cast to the model dtype once, the
  modulation and the gated residual adds in that dtype (the LayerNorms stay float32).

Both switches off is the vanilla forward; the block gets its class's forward back when no patch
uses this one (:meth:`PatchedBlockForward.release`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import PatchError, Undo, blocks_of, instance_override, wan_classes


def folded_norm(norm: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` as one ``F.layer_norm(x, weight=1 + scale, bias=shift)``, for
    an affine-free float32 LayerNorm ``norm`` and ``(1, 1, D)`` modulation vectors (one sample)."""
    width = scale.shape[-1]
    return F.layer_norm(x.float(), norm.normalized_shape, (1 + scale).reshape(width), shift.reshape(width), norm.eps)


class PatchedBlockForward:
    """One block's forward while a patch needs it (an instance attribute; the class is untouched)."""

    def __init__(self, block: torch.nn.Module):
        self.block = block
        self.fold_norm = False
        self.model_dtype = False

    @classmethod
    def on(cls, block: torch.nn.Module) -> "PatchedBlockForward":
        """``block``'s PatchedBlockForward, installed as its forward if needed."""
        own = block.__dict__.get("forward")
        if isinstance(own, cls):
            return own
        if own is not None:
            raise PatchError(f"this block's forward is already replaced by {own!r}; remove that first")
        block.forward = fwd = cls(block)
        return fwd

    @staticmethod
    def release(block: torch.nn.Module) -> None:
        """Give ``block`` its class's forward back once no patch uses this one."""
        own = block.__dict__.get("forward")
        if isinstance(own, PatchedBlockForward) and not own.fold_norm and not own.model_dtype:
            del block.forward

    def _modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        table = self.block.scale_shift_table
        if temb.ndim == 4:  # (B, L, 6, D): Wan 2.2 TI2V's per-token timesteps
            return tuple(m.squeeze(2) for m in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2))
        return (table + temb.float()).chunk(6, dim=1)  # (B, 6, D): one vector per sample

    def _modulated(self, norm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """The modulated norm of ``x`` in ``x``'s dtype, from the float32 ``scale`` / ``shift``."""
        if self.fold_norm and scale.shape[0] == 1 and scale.shape[1] == 1:
            return folded_norm(norm, x, scale, shift).type_as(x)
        if self.model_dtype:
            return norm(x.float()).to(x.dtype) * (1 + scale.to(x.dtype)) + shift.to(x.dtype)
        return (norm(x.float()) * (1 + scale) + shift).type_as(x)

    def __call__(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                 rotary_emb) -> torch.Tensor:
        b = self.block
        dtype = hidden_states.dtype
        mod = self._modulation(temb)
        if self.fold_norm and temb.ndim == 4:
            raise PatchError("patch 'adaln_norm' folds one modulation vector per sample into the LayerNorm, but this "
                             "block got per-token timesteps (TI2V-5B); remove the patch for this model")
        shift, scale, gate, c_shift, c_scale, c_gate = mod
        if self.model_dtype:
            gate, c_gate = gate.to(dtype), c_gate.to(dtype)

        attn_out = b.attn1(self._modulated(b.norm1, hidden_states, scale, shift), None, None, rotary_emb)
        if self.model_dtype:
            hidden_states = hidden_states + attn_out * gate
        else:
            hidden_states = (hidden_states.float() + attn_out * gate).type_as(hidden_states)

        normed = b.norm2(hidden_states.float()).type_as(hidden_states)
        hidden_states = hidden_states + b.attn2(normed, encoder_hidden_states, None, None)

        ff_out = b.ffn(self._modulated(b.norm3, hidden_states, c_scale, c_shift))
        if self.model_dtype:
            return hidden_states + ff_out * c_gate
        return (hidden_states.float() + ff_out.float() * c_gate).type_as(hidden_states)

    def __repr__(self) -> str:
        return f"PatchedBlockForward(fold_norm={self.fold_norm}, model_dtype={self.model_dtype})"


def check_blocks(dit: torch.nn.Module, patch: str) -> None:
    """PatchError unless every block is a stock ``WanTransformerBlock`` whose forward is the class's or
    the shared :class:`~wan_sharding.patches.block.PatchedBlockForward`."""
    block_cls = wan_classes().WanTransformerBlock
    for i, block in enumerate(blocks_of(dit)):
        own = instance_override(block)
        if type(block) is not block_cls or (own is not None and not isinstance(own, PatchedBlockForward)):
            raise PatchError(f"patch {patch!r} needs stock WanTransformerBlocks; blocks.{i} is a "
                             f"{type(block).__name__} or has its forward replaced; remove that first")


def switch_blocks(dit: torch.nn.Module, flag: str) -> Undo:
    """Set ``flag`` on every block's :class:`PatchedBlockForward` (installed where needed); the undo
    clears it and gives a block its class's forward back once no flag is left."""
    blocks = blocks_of(dit)
    for block in blocks:
        setattr(PatchedBlockForward.on(block), flag, True)

    def undo() -> None:
        for block in blocks:
            setattr(block.forward, flag, False)
            PatchedBlockForward.release(block)

    return undo
