"""The Wan VAE (diffusers ``AutoencoderKLWan``) on the mesh: frames split over H and W, a halo
exchange per conv, exact.

- :mod:`.halo`: the exchange in the global view (boundary rows gathered, shards folded into the batch);
- :mod:`.layout`: what the plan covers, how a frame is split and padded, every parameter's spec;
- :mod:`.hooks`: the per-instance hooks that put the exchange around each conv;
- :mod:`.shard`: :func:`shard_vae` and :class:`VaeHandle`, through ``compose.shard_module``.
"""

from .layout import DEFAULT_STRATEGY, STRATEGIES, VAE_PADDINGS, vae_specs
from .shard import VaeHandle, check_vae, shard_vae

__all__ = ["DEFAULT_STRATEGY", "STRATEGIES", "VAE_PADDINGS", "VaeHandle", "check_vae", "shard_vae", "vae_specs"]
