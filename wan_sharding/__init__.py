"""Shard the unmodified diffusers Wan 2.2 DiT on Tenstorrent meshes (tt-xla / tt-mlir).

The public API:

- :func:`shard_dit_specs`: Megatron TP partition specs for every parameter.
- :func:`apply_dit_sp_activation_sharding`: sequence parallelism on the token dim, reversible.
- :class:`MeshSpec`, :func:`mesh_from_preset`, :func:`mesh_for_device_count`: meshes.
- :func:`get_backend`: the ``xla`` / ``jax`` / ``tt`` constraint primitives.
- :class:`ShardingPlan`: a whole plan (axes, FSDP, layout, padding), e.g. from ``wan-sharding plan``.
"""

from .activation import SPHandle, apply_dit_sp_activation_sharding
from .backends import BACKENDS, Backend, BackendError, get_backend
from .mesh import PRESETS, MeshError, MeshSpec, as_mesh_spec, mesh_for_device_count, mesh_from_preset
from .plan import WAN_SP_PLAN, WAN_TP_PLAN, ShardingPlan
from .specs import ShardingError, ShardSpecs, shard_dit_specs

__all__ = [
    "BACKENDS", "Backend", "BackendError", "MeshError", "MeshSpec", "PRESETS", "SPHandle", "ShardSpecs",
    "ShardingError", "ShardingPlan", "WAN_SP_PLAN", "WAN_TP_PLAN", "apply_dit_sp_activation_sharding", "as_mesh_spec",
    "get_backend", "mesh_for_device_count", "mesh_from_preset", "shard_dit_specs",
]
