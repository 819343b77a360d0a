"""``rope``: half-rotation RoPE in the form tt-mlir fuses, with no strided write in the graph. Exact.

diffusers rotates interleaved channel pairs ``(0, 1), (2, 3), ...`` of each head and writes the two
results back with ``out[..., 0::2] = ...; out[..., 1::2] = ...``. torch-xla lowers that strided write
to a scatter with large per-element index constants (``rows_scatter`` on Tenstorrent); tt-xla
measured the half-rotation form at 1255 -> 1031 ms for one A14B block at 480p on 4 Blackhole chips
(with a channels-last patchify; ``docs/hardware-facts.md``). tt-mlir's RoPE fusion
(``RoPEFusingPattern``) turns the rotate-half form ``x * cos + concat(-x[..., D/2:], x[..., :D/2]) *
sin`` on heads-first ``(B, H, S, D)`` q / k with ``(1, 1, S, D)`` tables into one
``ttnn.rotary_embedding`` at optimization level >= 1 (``docs/tt-mlir-notes.md``); this patch emits
exactly that form.

The rewrite, on one model instance:

- the output channels of every self-attention's ``to_q`` and ``to_k`` (weight rows and bias), and
  the weights of ``norm_q`` / ``norm_k``, are permuted within each head from interleaved pairs to
  halves: first the first element of every pair (channels 0, 2, 4, ...), then the second (1, 3, 5,
  ...). Wan's q / k RMSNorm normalises across all heads (``qk_norm="rms_norm_across_heads"``): its
  statistic does not depend on the channel order, and its weight permuted the same way keeps it
  exact. Heads stay contiguous, so the head-aligned colwise TP split is unchanged;
- the ``rope`` module's forward (an instance attribute, the class is untouched) builds its cos / sin
  tables in the same half layout, ``(1, L, 1, head_dim)`` as diffusers' (the SP hook splits their
  token dim), from the same buffer values (the first of each pair of cos and the second of sin,
  as diffusers reads them), with reshapes, plain slices, expands and concatenations only (no
  strided slice: torchax lowers those to gathers);
- every ``attn1`` gets a per-instance :class:`~wan_sharding.patches.processor.PatchedAttnProcessor`
  that lays q / k and the tables out heads first (``(B, H, L, D)``, tables ``(1, 1, L, D)``), casts
  q / k once to the tables' dtype, applies ``x * cos + rotate_half(x) * sin`` and hands q / k back
  token-major to diffusers' attention dispatch (whose own heads-first permute then cancels the
  one back: the compiler folds the pair).

Why exact: the rotated q and k are the vanilla ones with the same permutation of each head's
channels (bit for bit: the first half is ``x1 * c + (-x2) * s == x1 * c - x2 * s``, the second
``x2 * c + x1 * s``, the vanilla sum in the other order, and a bf16 value cast up before or after
the slices is the same value), and ``q . k`` over a head does not depend on the channel order (a
permutation applied to both q and k leaves every score unchanged); ``v`` is untouched. Only
summation order changes (RMSNorm's mean, the q.k dot products): fp32 max-abs 1.3e-7 to 4.8e-7
against vanilla on the tiny t2v-a14b and ti2v-5b models, latents (1, 32, 32) and (3, 10, 14)
(``tests/test_patches.py`` bounds it at 1e-5).

Composition: apply before ``qkv`` (the fused weights then carry the half layout) and before
``rope_tables`` (its tables are the layout of the forward it caches); ``apply_patches`` orders one
call's names itself. Apply before sequence parallelism: the SP padding processors wrap this
processor (``mask`` passes its key mask through, ``slice`` calls the processor's own ``attend``,
which cuts K / V after the rotary); the SP hook on ``rope`` splits the tables' token dim before the
processor moves it; on a model that already has SP hooks it raises PatchError.
``shard_dit_specs``: no new parameter.
"""

from __future__ import annotations

import types

import torch

from .base import Patch, PatchContext, PatchError, Undo, blocks_of, instance_override, wan_classes
from .processor import PatchedAttnProcessor


def half_layout(head_dim: int) -> torch.Tensor:
    """Channel order of one head in the half layout: new channel ``j`` holds old channel ``perm[j]``."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _head_permutation(heads: int, head_dim: int, inverse: bool = False) -> torch.Tensor:
    perm = half_layout(head_dim)
    if inverse:
        perm = torch.argsort(perm)
    return (torch.arange(heads).unsqueeze(1) * head_dim + perm).flatten()


def half_rope_forward(rope: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``WanRotaryPosEmbed``'s cos / sin tables, (1, L, 1, head_dim) each, in the half layout:
    ``[angles of all pairs | the same again]``, pairs in the vanilla order (frames, height, width
    segments), so that the rotary is the rotate-half form tt-mlir fuses (the rotation's sign in the
    rotated half, not in the table). Reads only the module's attributes and buffers, so it also
    runs on a CPU twin (``rope_tables``)."""
    _, _, frames, height, width = hidden_states.shape
    pt, ph, pw = rope.patch_size
    grid = (frames // pt, height // ph, width // pw)
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
    out = []
    for buf, offset in ((rope.freqs_cos, 0), (rope.freqs_sin, 1)):
        parts = []
        for axis, seg in enumerate(buf.split(sizes, dim=1)):
            # one value per pair (the table repeats each); a reshape and a plain slice, where a
            # strided slice ``[..., offset::2]`` lowers to a gather on some frontends (torchax)
            angles = seg[: grid[axis]].unflatten(-1, (-1, 2)).select(-1, offset)
            shape = [1, 1, 1, angles.shape[-1]]
            shape[axis] = grid[axis]
            parts.append(angles.reshape(shape).expand(*grid, -1))
        half = torch.cat(parts, dim=-1)  # (F', H', W', head_dim / 2)
        out.append(torch.cat([half, half], dim=-1).reshape(1, -1, 1, 2 * half.shape[-1]))
    return out[0], out[1]


class RopePatch(Patch):
    name = "rope"
    exact = True
    after_sp = False
    precedes = ("qkv", "rope_tables")
    summary = ("half-rotation RoPE in tt-mlir's fusable form: q/k channels per head in halves, heads first, "
               "x*cos + rotate_half(x)*sin with (1, 1, L, D) tables")

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        tw = wan_classes()
        rope = dit.rope
        if not isinstance(rope, tw.WanRotaryPosEmbed) or instance_override(rope) is not None:
            raise PatchError("patch 'rope' needs the model's stock WanRotaryPosEmbed as dit.rope (its forward not "
                             "replaced); remove whatever replaced it first")
        head_dim = rope.attention_head_dim
        if head_dim % 2 or any(d % 2 for d in (rope.t_dim, rope.h_dim, rope.w_dim)):
            raise PatchError(f"patch 'rope' needs even rotary segments, got head_dim {head_dim} split "
                             f"{(rope.t_dim, rope.h_dim, rope.w_dim)}; this config cannot use it")
        for i, block in enumerate(blocks_of(dit)):
            attn = block.attn1
            why = PatchedAttnProcessor.fits(attn)
            if why is None and not all(isinstance(getattr(attn, n, None), torch.nn.Linear) for n in ("to_q", "to_k")):
                why = "its to_q / to_k are not Linear layers (fused by the 'qkv' patch?)"
            if why is None and attn.inner_dim // attn.heads != head_dim:
                why = f"its head dim {attn.inner_dim // attn.heads} differs from the rope's {head_dim}"
            for norm_name in ("norm_q", "norm_k"):
                norm = getattr(attn, norm_name, None)
                if why is None and not (isinstance(norm, torch.nn.RMSNorm)
                                        and tuple(norm.normalized_shape) == (attn.inner_dim,)):
                    why = (f"its {norm_name} is not an RMSNorm across all heads "
                           "(qk_norm='rms_norm_across_heads'), so permuting channels would change it")
            if why is not None:
                raise PatchError(f"patch 'rope' does not fit blocks.{i}.attn1: {why}")

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        rope = dit.rope
        head_dim = rope.attention_head_dim
        attns = [block.attn1 for block in blocks_of(dit)]

        def permute(inverse: bool) -> None:
            with torch.no_grad():
                for attn in attns:
                    index = _head_permutation(attn.heads, head_dim, inverse)
                    for tensor in (attn.to_q.weight, attn.to_q.bias, attn.to_k.weight, attn.to_k.bias,
                                   attn.norm_q.weight, attn.norm_k.weight):
                        if tensor is not None:
                            tensor.data = tensor.data.index_select(0, index.to(tensor.device))

        permute(inverse=False)
        for attn in attns:
            PatchedAttnProcessor.on(attn).half_rotary = True
        rope.forward = types.MethodType(half_rope_forward, rope)

        def undo() -> None:
            del rope.forward
            for attn in attns:
                attn.processor.half_rotary = False
                PatchedAttnProcessor.release(attn)
            permute(inverse=True)

        return undo


PATCH = RopePatch()
