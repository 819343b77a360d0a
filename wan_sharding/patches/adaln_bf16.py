"""``adaln_bf16``: the blocks' adaLN modulation in the model dtype instead of float32. NOT exact in bf16.

diffusers' ``WanTransformerBlock`` adds ``scale_shift_table`` (kept in float32) to the timestep
projection in float32 and then runs the whole modulation in float32 on ``(B, L, D)`` activations:
``norm(x) * (1 + scale) + shift`` before self-attention and the FFN, and the gated residual adds
``x + out * gate``, casting back to the model dtype after each. In a bf16 model that is twice the
bytes per element on the largest tensors of the block for values that are rounded to bf16 right
after. tt-xla measured the bf16 form at 1445 -> 1345 ms for one A14B block at 480p on 4 Blackhole
chips (``docs/hardware-facts.md``).

The rewrite gives each block (an instance attribute, :class:`~wan_sharding.patches.block.PatchedBlockForward`,
shared with ``adaln_norm``; the class is untouched) a forward that:
sums ``scale_shift_table + temb`` in float32 as before and casts the six modulation vectors to the
model dtype once; keeps the LayerNorms in float32 (``FP32LayerNorm``) and casts their output to the
model dtype; then does the modulation and the gated residual adds in the model dtype. The
cross-attention branch is unchanged. The model-level output modulation (``norm_out``, once per
forward) is in the model's own forward and is left as it is.

Exactness: in a float32 model every op is the same float32 op as vanilla: bit-identical
(``tests/test_patches.py``). In bf16 the residual stream takes one more rounding per gated add and
the modulation rounds its operands. Measured on the tiny models (bf16 weights and inputs, latents
(3, 10, 14) and (1, 32, 32), outputs of magnitude up to ~2.3), against the vanilla bf16 model:

    t2v-a14b and ti2v-5b: PCC 0.999999, max-abs 0.0078 (one bf16 ulp at the outputs' magnitude)

and against the float32 model, the patched bf16 model is as close as the vanilla bf16 one:

    t2v-a14b (3, 10, 14): vanilla bf16 PCC 0.999986 / max-abs 0.0112, patched 0.999986 / 0.0114
    ti2v-5b  (3, 10, 14): vanilla bf16 PCC 0.999987 / max-abs 0.0113, patched 0.999987 / 0.0113

``tests/test_patches.py::test_adaln_bf16_drift`` asserts PCC >= 0.99999 and max-abs <= 0.016 (two
ulps) against vanilla bf16, and PCC against float32 within 2e-6 of vanilla bf16's. Tenstorrent
measured PCC 0.99947 against 0.99943 for vanilla on one full-size block on hardware.

Composition: only the block's forward changes: works before or after sequence parallelism (the SP
hooks on ``blocks.0`` and, for the sharded layout, on every block run around it) and needs nothing
from ``shard_dit_specs`` (no parameter changes).
"""

from __future__ import annotations

import torch

from .base import Patch, PatchContext, Undo
from .block import check_blocks, switch_blocks


class AdalnBf16Patch(Patch):
    name = "adaln_bf16"
    exact = False
    drift = ("bf16 vs vanilla bf16 (tiny models): PCC 0.999999, max-abs 0.0078 (one bf16 ulp); vs float32 as close "
             "as vanilla bf16 (PCC 0.999986); fp32 models: bit-identical")
    after_sp = True
    summary = "adaLN modulation and gated residual adds in the model dtype (LayerNorms stay float32)"

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        check_blocks(dit, self.name)

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        return switch_blocks(dit, "model_dtype")


PATCH = AdalnBf16Patch()
