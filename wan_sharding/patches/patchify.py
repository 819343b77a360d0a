"""``patchify``: the Conv3d patch embedding as a reshape / permute and one Linear. Exact.

``patch_embedding`` is an ``nn.Conv3d`` whose kernel equals its stride (the patch size, ``(1, 2, 2)``
in Wan 2.2), without padding or dilation: every output position sees one patch, and no two patches
overlap. That is a matmul of each patch's ``C x pt x ph x pw`` values with the kernel flattened the
same way. The rewrite replaces the module (on this instance) by :class:`LinearPatchEmbedding`, an
``nn.Linear`` holding the conv's weight reshaped to ``(D, C * pt * ph * pw)`` (a view of the same
storage: no copy) and its bias, so the graph has no convolution.

Why it matters on Tenstorrent: the conv lowers to ``ttnn.conv3d``, whose channels-last output the
compiler permutes back to channels-first before the model's ``flatten(2).transpose(1, 2)``
(~33 ms at 480p, tt-xla's ``monkey_patch.py`` notes), and its 5-D -> 3-D reshape is where the
partitioner pushes the token split unless the SP hooks anchor it replicated first
(``wan_sharding.dit.activation``). Here the Linear produces ``(B, F', H', W', D)`` channels-last; the
module returns it as the ``(B, D, F', H', W')`` view the model expects, and the model's
``flatten(2).transpose(1, 2)`` undoes that permute: one reshape from channels-last to ``(B, L, D)``.

Exact up to floating-point reordering; measured bit-identical (max-abs 0) in fp32 on the CPU for
the tiny t2v-a14b and ti2v-5b models, latents (1, 32, 32) and (3, 10, 14). Composition:
works before or after sequence parallelism (no SP hook touches ``patch_embedding``), but
``shard_dit_specs`` must run after it (its parameters are new tensors: ``patch_embedding.weight``
is 2-D now, still named by the plan's replicated ``patch_embedding`` entry).
"""

from __future__ import annotations

import math

import torch

from .base import Patch, PatchContext, PatchError, Undo, new_linear, put_data


class LinearPatchEmbedding(torch.nn.Linear):
    """Non-overlapping 3-D patch embedding as reshape / permute + Linear; ``(B, C, F, H, W)`` ->
    ``(B, D, F/pt, H/ph, W/pw)`` (a channels-last tensor seen channels-first)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 patch_size: tuple[int, int, int], in_channels: int, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.patch_size = tuple(patch_size)
        self.in_channels = in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, frames, height, width = x.shape
        pt, ph, pw = self.patch_size
        f, h, w = frames // pt, height // ph, width // pw
        if (f * pt, h * ph, w * pw) != (frames, height, width):  # a strided conv drops the remainder
            x = x[:, :, : f * pt, : h * ph, : w * pw]
        patches = x.reshape(b, c, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4)
        return super().forward(patches).permute(0, 4, 1, 2, 3)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, patch_size={self.patch_size}, in_channels={self.in_channels}"


class PatchifyPatch(Patch):
    name = "patchify"
    exact = True
    after_sp = True
    summary = "Conv3d patch embedding as reshape/permute + Linear (no conv in the graph)"

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        conv = getattr(dit, "patch_embedding", None)
        if not isinstance(conv, torch.nn.Conv3d):
            raise PatchError(f"patch 'patchify' needs dit.patch_embedding to be the model's Conv3d, found "
                             f"{type(conv).__name__}; remove what replaced it first")
        plain = (tuple(conv.kernel_size) == tuple(conv.stride) and tuple(conv.padding) == (0, 0, 0)
                 and tuple(conv.dilation) == (1, 1, 1) and conv.groups == 1)
        if not plain:
            raise PatchError(f"patch 'patchify' needs a non-overlapping patch conv (kernel == stride, no padding, "
                             f"dilation or groups); this one is {conv}; this config cannot use it")

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        conv = dit.patch_embedding
        shape = conv.weight.shape
        weight = conv.weight.detach().reshape(shape[0], math.prod(shape[1:]))  # a view: no copy
        bias = None if conv.bias is None else conv.bias.detach()
        linear = new_linear(weight, bias, conv, LinearPatchEmbedding, patch_size=tuple(conv.kernel_size),
                            in_channels=conv.in_channels)
        linear.train(conv.training)
        dit.patch_embedding = linear

        def undo() -> None:
            # the conv takes the Linear's current tensors back (same values, the device / dtype the
            # model has now), then returns to its place
            with torch.no_grad():
                put_data(conv, "weight", linear.weight.data.reshape(shape))
                if conv.bias is not None:
                    put_data(conv, "bias", linear.bias.data)
            dit.patch_embedding = conv

        return undo


PATCH = PatchifyPatch()
