"""The Wan 2.2 pipelines' UMT5 text encoder on the mesh: Megatron tensor parallelism, exact.

- :mod:`.specs`: the TP plan as data (:data:`UMT5_TP_TABLE`, Tenstorrent's recipe) and
  :func:`shard_text_encoder_specs`;
- :mod:`.shard`: :func:`shard_text_encoder` through the package's one composition, and its
  :class:`TextEncoderHandle` (callable as the pipeline calls the encoder; ``remove()`` restores it).
"""

from .shard import TextEncoderHandle, check_text_encoder, shard_text_encoder, sharded_text_encoder
from .specs import UMT5_TP_TABLE, check_umt5_model, shard_text_encoder_specs

__all__ = ["TextEncoderHandle", "UMT5_TP_TABLE", "check_text_encoder", "check_umt5_model", "shard_text_encoder",
           "shard_text_encoder_specs", "sharded_text_encoder"]
