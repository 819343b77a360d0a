"""``ffn_rows``: each block's feed-forward on token rows ``(L, D)`` instead of ``(1, L, D)``. Exact.

diffusers' ``FeedForward`` runs ``Linear -> GELU(tanh) -> Linear`` on ``(B, L, D)``. Lowered for
tt-mlir, each ``Linear`` on a 3-D input becomes a 2-D matmul between a flatten and an unflatten,
so the GELU sits between two reshapes and tt-mlir's TTNN fusion of a linear with its activation
(``TTNNMatmulAndLinearWithActivation``, which needs the GELU to be the linear's only, direct user)
does not fire: per block a reshape, the GELU and a reshape remain in the step's program. Given the
rows of a one-sample batch, the first linear's output goes straight to the GELU, which tt-mlir
then folds into the linear.

The rewrite gives each block's ``ffn`` (an instance attribute; the class is untouched) a forward
that, for a batch of one, runs diffusers' own forward on ``hidden_states[0]`` and puts the batch
dim back; a batch of more than one goes to diffusers' forward unchanged (flattening ``(B, L)``
would merge a token dim split over SP with the batch dim, which a sharding cannot express).

Exactness: the same modules on the same rows; a ``Linear`` on ``(1, L, D)`` is the same matrix
product as on ``(L, D)``: bit-identical on the CPU (``tests/test_patches.py``). Composition: any
order with the other patches, before or after sequence parallelism (no parameter changes, the TP
specs of ``ffn.net.0.proj`` / ``ffn.net.2`` unchanged).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from .base import Patch, PatchContext, PatchError, Undo, blocks_of, instance_override


def rows_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """diffusers' ``FeedForward.forward`` on the rows of a one-sample batch."""
    forward = type(self).forward
    if hidden_states.dim() == 3 and hidden_states.shape[0] == 1:
        return forward(self, hidden_states[0], *args, **kwargs).unsqueeze(0)
    return forward(self, hidden_states, *args, **kwargs)


class FfnRowsPatch(Patch):
    name = "ffn_rows"
    exact = True
    after_sp = True
    summary = "each block's feed-forward on (L, D) rows for a batch of one, so tt-mlir fuses the GELU into its linear"

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        from diffusers.models.attention import FeedForward

        for i, block in enumerate(blocks_of(dit)):
            ffn = getattr(block, "ffn", None)
            if type(ffn) is not FeedForward or instance_override(ffn) is not None:
                raise PatchError(f"patch 'ffn_rows' needs diffusers' stock FeedForward as blocks.{i}.ffn (its forward "
                                 "not replaced); remove whatever replaced it first")

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        ffns = [block.ffn for block in blocks_of(dit)]
        for ffn in ffns:
            ffn.forward = types.MethodType(rows_forward, ffn)

        def undo() -> None:
            for ffn in ffns:
                del ffn.forward

        return undo


PATCH = FfnRowsPatch()
