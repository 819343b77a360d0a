"""``adaln_norm``: each block's adaLN modulation as the weight and bias of its LayerNorm. Exact (fp32
max-abs at float rounding).

diffusers' ``WanTransformerBlock`` runs ``norm1(x) * (1 + scale) + shift`` before self-attention and
``norm3(x) * (1 + c_scale) + c_shift`` before the FFN, with affine-free float32 LayerNorms: a
LayerNorm, then a multiply and an add on the ``(B, L, D)`` activation (13 TTNN ops per block for
the adaLN in a compiled block at optimization level 1; docs/compile-hardware.md). Where the
modulation is one ``D``-vector for the whole batch (the A14B experts: one timestep per sample, one
sample per forward), that is ``F.layer_norm(x, (D,), weight=1 + scale, bias=shift)``: one
``layer_norm`` with weight and bias, as tt-metal's Wan block runs it
(tenstorrent/tt-metal ``models/tt_dit/models/transformers/wan2_2/transformer_wan.py``), and the
form tt-xla's composite ``tenstorrent.layer_norm`` carries to tt-mlir.

The rewrite sets the ``fold_norm`` switch of each block's per-instance forward
(:class:`~wan_sharding.patches.block.PatchedBlockForward`, shared with ``adaln_bf16``; the class is
untouched). A forward whose batch holds several samples (a CFG pair in one batch) cannot share one
weight vector and runs the vanilla expression. TI2V-5B modulates per token (its timesteps are one
per token, ``(B, L, 6, D)`` modulation): refused when the patch is named for it, left out of
``exact`` there.

Drift (``tests/test_patches.py::test_adaln_norm_drift``), tiny T2V model, latents (1, 32, 32) and
(3, 10, 14), outputs of magnitude ~2, against vanilla: float32 max-abs 4.8e-7 and 3.6e-7 (the
normalised value times the weight plus the bias inside one kernel, where vanilla rounds the
LayerNorm's output first; PCC 1.0); bf16 bit-identical (max-abs 0: the modulation is float32 in
both and its last-bit differences vanish in the bf16 cast), so as close to the float32 model as
vanilla bf16 (PCC 0.999986, max-abs 0.0118 and 0.0112).

Composition: only the block's forward changes: works before or after sequence parallelism, and
needs nothing from ``shard_dit_specs`` (no parameter changes); with ``adaln_bf16`` the folded norm
stays float32 and the gated residual adds run in the model dtype.
"""

from __future__ import annotations

import torch

from .base import Patch, PatchContext, PatchError, Undo, blocks_of
from .block import check_blocks, switch_blocks

# The Wan 2.2 VAE's 48 latent channels: the TI2V-5B model, whose pipeline passes one timestep per
# token (diffusers' WanPipeline ``expand_timesteps``; docs/hardware-facts.md).
PER_TOKEN_CHANNELS = 48


def per_token_modulation(dit: torch.nn.Module) -> bool:
    """Whether this Wan model is the TI2V-5B one, whose adaLN modulation is per token."""
    return int(getattr(getattr(dit, "config", None), "out_channels", 0)) == PER_TOKEN_CHANNELS


class AdalnNormPatch(Patch):
    name = "adaln_norm"
    exact = True
    after_sp = True
    summary = "adaLN modulation as the LayerNorm's weight and bias (one layer_norm) where it is one vector per sample"

    def suits(self, dit: torch.nn.Module) -> str | None:
        if per_token_modulation(dit):
            return ("patch 'adaln_norm' folds one modulation vector per sample into the LayerNorm, but TI2V-5B "
                    "modulates per token; leave it out for this model")
        return None

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        why = self.suits(dit)
        if why is not None:
            raise PatchError(why)
        check_blocks(dit, self.name)
        for i, block in enumerate(blocks_of(dit)):
            for name in ("norm1", "norm3"):
                norm = getattr(block, name)
                if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None or norm.bias is not None:
                    raise PatchError(f"patch 'adaln_norm' needs affine-free LayerNorms as diffusers builds them; "
                                     f"blocks.{i}.{name} is a {type(norm).__name__} with weights; remove what changed it")

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        return switch_blocks(dit, "fold_norm")


PATCH = AdalnNormPatch()
