"""The UMT5 text encoder's tensor-parallel plan as data, and its specs: Megatron TP on the TP axis.

``UMT5_TP_TABLE`` is the plan in the ``plan.py`` vocabulary, resolved by the same generic machinery
as the DiT's (:func:`wan_sharding.specs.table_specs`). It follows Tenstorrent's own recipe for this
encoder in the Wan 2.2 pipeline (tenstorrent/tt-xla ``tests/torch/models/wan14b/shared.py``,
``shard_umt5_specs``): per layer, q / k / v and the gated FFN's ``wi_0`` / ``wi_1`` colwise, ``o``
and ``wo`` rowwise (one all-reduce each), the layer's own ``relative_attention_bias`` (UMT5, unlike
T5, has one in every layer) split on its heads so it meets the head-split scores; the token
embedding, the norms and the residual stream whole on every device. No activation is split over
SP: 512 prompt tokens are little work next to the weights, and the recipe leaves that axis replicated.
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan import COLWISE, EMBEDDING_COLWISE, REPLICATE, ROWWISE
from ..specs import FSDP_MIN_NUMEL, ShardingError, ShardSpecs, check_tp_divides, spec_mesh, table_specs

__all__ = ["UMT5_TP_TABLE", "check_umt5_model", "shard_text_encoder_specs"]

_LAYER = "encoder.block.*.layer"
UMT5_TP_TABLE: dict[str, str] = {
    # -- the token embedding (tied: shared = encoder.embed_tokens), 256384 x 4096: whole, as the recipe
    "shared": REPLICATE,
    "encoder.embed_tokens": REPLICATE,
    # -- self-attention: one Megatron pair per layer
    f"{_LAYER}.0.SelfAttention.q": COLWISE,
    f"{_LAYER}.0.SelfAttention.k": COLWISE,
    f"{_LAYER}.0.SelfAttention.v": COLWISE,
    f"{_LAYER}.0.SelfAttention.o": ROWWISE,  # all-reduce
    # (num_buckets, heads): each device looks up the bias of its own heads
    f"{_LAYER}.0.SelfAttention.relative_attention_bias": EMBEDDING_COLWISE,
    f"{_LAYER}.0.layer_norm": REPLICATE,  # RMS norm over the whole residual stream
    # -- the gated-GELU FFN: one Megatron pair per layer
    f"{_LAYER}.1.DenseReluDense.wi_0": COLWISE,
    f"{_LAYER}.1.DenseReluDense.wi_1": COLWISE,
    f"{_LAYER}.1.DenseReluDense.wi": COLWISE,  # the ungated form (feed_forward_proj="gelu"); Wan's is gated
    f"{_LAYER}.1.DenseReluDense.wo": ROWWISE,  # all-reduce
    f"{_LAYER}.1.layer_norm": REPLICATE,
    "encoder.final_layer_norm": REPLICATE,
}
WRITTEN_FOR = "the transformers UMT5 encoder (UMT5EncoderModel)"


def check_umt5_model(encoder: Any) -> None:
    """Refuse anything that is not a transformers ``UMT5EncoderModel`` (one line, with the fix)."""
    from transformers import UMT5EncoderModel

    if not isinstance(encoder, UMT5EncoderModel):
        raise ShardingError(
            f"expected a transformers UMT5EncoderModel (the Wan 2.2 pipelines' text encoder), got "
            f"{type(encoder).__name__}; pass the pipeline's text_encoder (pipe.text_encoder), or use "
            "shard_pipeline(pipe, mesh, text_encoder=True) for a whole pipeline"
        )


def shard_text_encoder_specs(encoder: torch.nn.Module, mesh_or_plan: Any) -> ShardSpecs:
    """Megatron tensor-parallel partition specs for every parameter of a UMT5 encoder.

    Args:
        encoder: a transformers ``UMT5EncoderModel`` (real weights or on the ``meta`` device).
        mesh_or_plan: a preset name (``"2x4"``), a :class:`~wan_sharding.mesh.MeshSpec`, a
            backend's own mesh, or a :class:`~wan_sharding.plan.ShardingPlan`: the same rules as
            :func:`~wan_sharding.dit.specs.shard_dit_specs` (the TP role's axis carries the split; a
            plan's FSDP also splits each large weight over its SP axes).

    Returns:
        :class:`~wan_sharding.specs.ShardSpecs` with one spec per parameter (the tied embedding once,
        as ``shared.weight``).

    Raises:
        ShardingError: not a UMT5 encoder, heads or FFN width not divisible by TP, a parameter the
            table does not cover. Nothing is changed on the model.
    """
    check_umt5_model(encoder)
    mesh, fsdp = spec_mesh(mesh_or_plan)
    cfg = encoder.config
    check_tp_divides(cfg.num_heads, "attention heads of the text encoder", mesh)
    check_tp_divides(cfg.d_ff, "FFN channels (d_ff) of the text encoder", mesh, "a divisor of the FFN width")
    # FSDP's floor: the DiT's, or a quarter of a d_model x d_model projection in a tiny config
    floor = min(FSDP_MIN_NUMEL, cfg.d_model * cfg.d_model // 4)
    return table_specs(encoder, mesh, UMT5_TP_TABLE, fsdp=fsdp, fsdp_floor=floor, written_for=WRITTEN_FOR)
