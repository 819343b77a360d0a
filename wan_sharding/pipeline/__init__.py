"""Pipeline integration: shard a whole diffusers Wan 2.2 pipeline and run it as usual.

- :mod:`.shard`: :func:`shard_pipeline` (every expert, the pipeline's own ``__call__``), with
  :mod:`.standin` (the stand-in per expert), :mod:`.handle` (the handle and its undo) and
  :mod:`.stacks` (the JAX / torch-xla guard), and the reversible :class:`PipelineHandle`; each expert is
  sharded by :func:`wan_sharding.compose.shard_dit`;
- :mod:`.text_encoder`: the pipeline's UMT5 text encoder on the mesh too (``text_encoder=True``),
  through its own stand-in;
- :mod:`.tiny`: an offline tiny pipeline per variant (random weights, no download) and loading a
  local checkpoint;
- :mod:`.video`: writing the frames a pipeline returns.
"""

from .shard import (
    EXPERT_COMPONENTS,
    SUPPORTED_PIPELINES,
    PipelineHandle,
    ShardedExpert,
    ShardedTransformer,
    diffusers_without_torch_xla,
    shard_pipeline,
    sharded,
    sharded_handle,
)
from .text_encoder import ShardedTextEncoder
from .video import write_video

# The public home of the stand-ins: what a sharded pipeline's config records for its experts and its
# text encoder.
ShardedTransformer.__module__ = __name__
ShardedTextEncoder.__module__ = __name__

__all__ = [
    "EXPERT_COMPONENTS", "SUPPORTED_PIPELINES", "PipelineHandle", "ShardedExpert", "ShardedTextEncoder",
    "ShardedTransformer", "diffusers_without_torch_xla", "shard_pipeline", "sharded", "sharded_handle", "write_video",
]
