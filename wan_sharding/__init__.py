"""Shard the unmodified diffusers Wan 2.2 DiT on Tenstorrent meshes (tt-xla / tt-mlir).

The public API, all of it acting on one model instance and undone by ``remove()``:

- :func:`shard_pipeline`: every expert of a diffusers Wan 2.2 pipeline; the pipeline's own
  ``__call__`` then runs on the mesh.
- :func:`shard_dit`: one ``WanTransformer3DModel`` (patches -> TP specs -> placement -> SP hooks),
  returning a :class:`DitHandle`.
- :func:`shard_dit_specs` and :func:`apply_dit_sp_activation_sharding`: the two steps of the
  design by themselves (TP specs as data; the SP hooks and padding).
- :func:`get_backend`: the ``xla`` / ``jax`` / ``tt`` stacks; :class:`MeshSpec`,
  :func:`mesh_from_preset`: meshes, :func:`with_cfg`: a mesh cut into two guidance groups (CFG
  parallel); :class:`ShardingPlan`: a planner's plan, accepted wherever a
  mesh is.
- :func:`shard_vae`: the pipeline's ``AutoencoderKLWan`` (frames split over H and W, a halo per
  conv), returning a :class:`VaeHandle` whose ``decode`` / ``encode`` run on the mesh.
- :func:`apply_patches`: opt-in exact model rewrites (``shard_dit``'s ``patches=`` applies them).
- :func:`shard_text_encoder` and :func:`shard_text_encoder_specs`: the pipelines' UMT5 text encoder,
  Megatron TP on the mesh (``shard_pipeline(..., text_encoder=True)`` does it for a pipeline).
"""

from .backends import BACKENDS, Backend, BackendError, get_backend
from .compose import DitHandle, shard_dit
from .dit.activation import SPHandle, apply_dit_sp_activation_sharding
from .dit.specs import shard_dit_specs
from .mesh import PRESETS, MeshError, MeshSpec, mesh_for_device_count, mesh_from_preset, with_cfg
from .patches import PatchError, apply_patches
from .pipeline import PipelineHandle, diffusers_without_torch_xla, shard_pipeline
from .plan import WAN_SP_POINTS, WAN_TP_TABLE, PlanError, ShardingPlan
from .specs import ShardingError, ShardSpecs
from .text_encoder import TextEncoderHandle, shard_text_encoder, shard_text_encoder_specs
from .vae import VaeHandle, shard_vae

__all__ = [
    "BACKENDS", "Backend", "BackendError", "DitHandle", "MeshError", "MeshSpec", "PRESETS", "PatchError",
    "PipelineHandle", "PlanError", "SPHandle", "ShardSpecs", "ShardingError", "ShardingPlan", "TextEncoderHandle",
    "WAN_SP_POINTS",
    "WAN_TP_TABLE", "apply_dit_sp_activation_sharding", "apply_patches", "diffusers_without_torch_xla",
    "get_backend", "mesh_for_device_count", "mesh_from_preset", "shard_dit", "shard_dit_specs", "shard_pipeline",
    "shard_text_encoder", "shard_text_encoder_specs", "shard_vae", "VaeHandle", "with_cfg",
]
