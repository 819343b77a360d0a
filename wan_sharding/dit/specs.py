"""The DiT's TP specs: the specs engine (``specs.py``) with the DiT's TP table (``WAN_TP_TABLE``).

Pure: never changes the model, works on a ``meta``-device model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..mesh import MeshSpec
from ..plan import WAN_TP_TABLE
from ..specs import FSDP_MIN_NUMEL, ShardingError, ShardSpecs, check_tp_divides, fsdp_min_numel, spec_mesh, table_specs


def check_wan_model(dit: Any) -> None:
    """Refuse anything that is not a diffusers ``WanTransformer3DModel``."""
    from diffusers import WanTransformer3DModel

    if not isinstance(dit, WanTransformer3DModel):
        raise ShardingError(
            f"expected a diffusers WanTransformer3DModel, got {type(dit).__name__}; "
            "pass the pipeline's transformer (pipe.transformer / pipe.transformer_2), "
            "or use shard_pipeline for a whole pipeline"
        )


def _check_heads(dit: torch.nn.Module, mesh: MeshSpec) -> None:
    check_tp_divides(dit.config.num_attention_heads, "attention heads", mesh)


def shard_dit_specs(dit: torch.nn.Module, mesh_or_plan: Any, tp_table: Mapping[str, str] = WAN_TP_TABLE, *,
                    fsdp: bool = False, plan: Any = None) -> ShardSpecs:
    """Megatron tensor-parallel partition specs for every parameter of a Wan DiT.

    Args:
        dit: a diffusers ``WanTransformer3DModel`` (real weights or on the ``meta`` device).
        mesh_or_plan: a preset name (``"1x4"``, ``"2x4"``, ``"8x4"``), a :class:`MeshSpec`, a
            torch-xla / JAX mesh, or a :class:`~wan_sharding.plan.ShardingPlan` (its mesh roles and
            ``fsdp`` then apply). The TP role's axis carries the split.
        tp_table: module-path pattern -> style (defaults to :data:`WAN_TP_TABLE`).
        fsdp: also shard each large weight over the SP axes (FSDP-style), see ``ShardingPlan``.
        plan: a :class:`~wan_sharding.plan.ShardingPlan` given beside a mesh; it must be for that
            mesh's shape.

    Returns:
        :class:`ShardSpecs`, a mapping from each parameter tensor to its spec.

    Raises:
        ShardingError: not a Wan model, heads or a sharded dim not divisible by TP, a parameter
            the TP table does not cover, or a plan for another mesh. Nothing is changed on the model.
    """
    check_wan_model(dit)
    mesh, fsdp = spec_mesh(mesh_or_plan, plan, fsdp)
    _check_heads(dit, mesh)
    return table_specs(dit, mesh, tp_table, fsdp=fsdp, fsdp_floor=fsdp_min_numel(dit) if fsdp else FSDP_MIN_NUMEL)
