"""The Wan 2.2 DiT (diffusers ``WanTransformer3DModel``) on the mesh: its own parts of the sharding.

- :mod:`.specs`: the DiT's TP specs (:func:`shard_dit_specs`: the specs engine with its TP table);
- :mod:`.attention`: the padding modes' per-instance attention processors;
- :mod:`.activation`: the SP hooks (:func:`apply_dit_sp_activation_sharding`, :class:`SPHandle`).

Its TP table and SP points are data in ``plan.py``; ``compose.shard_dit`` shards it through the
package's one composition.
"""

from .activation import SPHandle, apply_dit_sp_activation_sharding
from .specs import check_wan_model, shard_dit_specs

__all__ = ["SPHandle", "apply_dit_sp_activation_sharding", "check_wan_model", "shard_dit_specs"]
