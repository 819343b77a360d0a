"""``qkv``: fused Q/K/V projections, laid out so that a plain colwise TP split keeps whole heads. Exact.

Self-attention (``attn1``) gets one Linear ``to_qkv`` (D -> 3 x inner) in place of ``to_q``,
``to_k``, ``to_v``; cross-attention (``attn2``) one ``to_kv`` (D -> 2 x inner) in place of ``to_k``
and ``to_v`` (its queries come from the video tokens and its keys / values from the prompt, so only
K and V share an input). One matmul instead of three (two) per attention.

Layout. A colwise TP split hands device ``s`` of ``tp`` the ``s``-th contiguous block of output rows.
diffusers' own ``fuse_projections()`` concatenates ``[q; k; v]``, so that block would be a third of
the heads' queries and nothing else (device 0 would hold only q rows; tt-xla measured the naive
fused form slower than separate projections on hardware). Here the rows are interleaved per TP
shard::

    to_qkv rows = [q heads of shard 0, k heads of shard 0, v heads of shard 0, q heads of shard 1, ...]
    to_kv  rows = [k heads of shard 0, v heads of shard 0, k heads of shard 1, ...]

so the colwise split gives every device whole heads of q, k and v (``heads / tp`` each), and
splitting the fused output (``unflatten(-1, (tp, 3, -1))``) is local to each device. The layout
depends on the TP degree: ``apply_patches(dit, ["qkv"], mesh=...)`` reads it from the mesh (and
raises PatchError without one). The math is right on any mesh (the processor unpacks with the
layout's own degree); only a mesh with another TP degree would split heads across devices.

``WAN_TP_TABLE`` names ``blocks.*.attn1.to_qkv`` and ``blocks.*.attn2.to_kv`` colwise, so
``shard_dit_specs`` covers the patched model (run it after the patch). The original Linear modules
keep their objects but give their storage up while fused (no second copy of the weights); ``remove()``
writes the fused rows back into them and puts them back in their places.

Composition: apply after ``rope`` (``apply_patches`` orders one call's names), before sequence
parallelism (the SP padding processors wrap this processor; on a model that already has SP hooks it
raises PatchError). Models with image cross-attention (``add_k_proj``, Wan 2.1 I2V) are refused.
Exact up to floating-point reordering of the wider matmul; measured bit-identical (max-abs 0) in
fp32 on the CPU for the tiny models, latents (1, 32, 32) and (3, 10, 14).
"""

from __future__ import annotations

import torch

from .base import Patch, PatchContext, PatchError, Undo, blocks_of, new_linear, put_data, set_children, take_data
from .processor import PatchedAttnProcessor

SELF, CROSS = ("to_q", "to_k", "to_v"), ("to_k", "to_v")


def interleave(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Rows of ``parts`` (each (N, ...), N divisible by ``groups``) as
    ``[part0 block 0, part1 block 0, ..., part0 block 1, ...]``."""
    n = parts[0].shape[0]
    stacked = torch.stack([p.reshape(groups, n // groups, *p.shape[1:]) for p in parts], dim=1)
    return stacked.reshape(len(parts) * n, *parts[0].shape[1:])


def deinterleave(fused: torch.Tensor, count: int, groups: int) -> list[torch.Tensor]:
    """Inverse of :func:`interleave`: the ``count`` parts, each contiguous."""
    n = fused.shape[0] // count
    blocks = fused.reshape(groups, count, n // groups, *fused.shape[1:])
    return [blocks[:, i].reshape(n, *fused.shape[1:]).contiguous() for i in range(count)]


class QkvPatch(Patch):
    name = "qkv"
    exact = True
    after_sp = False
    summary = "fused to_qkv (attn1) / to_kv (attn2), rows interleaved per TP shard for a whole-head colwise split"

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        tp = ctx.tp(self.name)
        heads = dit.config.num_attention_heads
        if heads % tp:
            raise PatchError(f"patch 'qkv' lays out whole heads per TP shard, but {heads} heads do not divide "
                             f"over TP {tp}; use a mesh whose TP degree divides {heads}")
        for i, block in enumerate(blocks_of(dit)):
            for attn_name, names in (("attn1", SELF), ("attn2", CROSS)):
                attn = getattr(block, attn_name)
                why = PatchedAttnProcessor.fits(attn)
                if why is None and not all(isinstance(getattr(attn, n, None), torch.nn.Linear)
                                           and getattr(attn, n).bias is not None for n in names):
                    why = f"it has no separate {'/'.join(names)} Linear layers with biases"
                if why is None and (attn.is_cross_attention != (attn_name == "attn2")):
                    why = "its is_cross_attention flag is not what the Wan block layout says"
                if why is not None:
                    raise PatchError(f"patch 'qkv' does not fit blocks.{i}.{attn_name}: {why}")

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        tp = ctx.tp(self.name)
        undos = []
        for block in blocks_of(dit):
            for attn_name, names, fused_name in (("attn1", SELF, "to_qkv"), ("attn2", CROSS, "to_kv")):
                undos.append(_fuse(getattr(block, attn_name), names, fused_name, tp))

        def undo() -> None:
            for u in reversed(undos):
                u()

        return undo


def _fuse(attn: torch.nn.Module, names: tuple[str, ...], fused_name: str, tp: int) -> Undo:
    before = list(attn._modules.items())
    originals = [getattr(attn, n) for n in names]
    with torch.no_grad():
        weight = interleave([take_data(m.weight) for m in originals], tp)
        bias = interleave([take_data(m.bias) for m in originals], tp)
    fused = new_linear(weight, bias, originals[0])
    fused.train(originals[0].training)
    # the fused layer where the first of the originals was, the originals gone
    items = []
    for name, child in before:
        if name == names[0]:
            items.append((fused_name, fused))
        elif name not in names:
            items.append((name, child))
    set_children(attn, items)
    proc = PatchedAttnProcessor.on(attn)
    proc.qkv_groups = tp

    def undo() -> None:
        proc.qkv_groups = None
        PatchedAttnProcessor.release(attn)
        with torch.no_grad():
            for m, w, b in zip(originals, deinterleave(fused.weight.data, len(names), tp),
                               deinterleave(fused.bias.data, len(names), tp)):
                put_data(m, "weight", w)
                put_data(m, "bias", b)
        set_children(attn, before)

    return undo


PATCH = QkvPatch()
