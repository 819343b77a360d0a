"""The largest request one serve worker can take on its mesh, by the planner's memory model.

``wan-sharding serve`` bounds every request before it is queued (docs/serving.md, "Limits"). The
bound on its size is the largest flat token count L (latent frames x latent height x latent width
after the DiT's patch) whose per-device memory fits one device of the worker's mesh:

- the DiT's weights per device, every expert resident (:func:`.weights.predicted_weight_bytes` on
  the model built on the ``meta`` device, in the worker's dtype), and the text encoder's when it
  is sharded on the mesh too (:func:`.weights.text_encoder_weight_bytes`);
- one block's working set at L tokens (:func:`.workload.memory_per_chip`: the activations, the
  gathered K and V, and the attention's score tensor where it is materialised);

against one device's memory: a Tenstorrent chip's DRAM (``chips.json``) less the planner's
:data:`~.hardware.DRAM_RESERVE`; a CPU virtual device's share of this host's memory (its physical
RAM divided by every device of the serve mesh, all replicas together: they share the one RAM),
less the same reserve. On CPU backends the score tensor is materialised (XLA's CPU backend has no
fused attention); on ``tt`` attention is fused, as the planner assumes for the chips.
"""

from __future__ import annotations

import os
from functools import lru_cache

from ..plan import ShardingPlan
from .hardware import DRAM_RESERVE, chip
from .workload import BF16, Workload, memory_per_chip

TT_ARCH = "wormhole_b0"  # the chip a tt server's limits assume: the smaller DRAM (12 GB) of the two
MAX_TOKENS_SEARCHED = 1 << 24  # far past any video the models make (720p, 81 frames: 75,600 tokens)


def host_memory_bytes() -> float:
    """This host's physical memory (``sysconf``: pages x page size)."""
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_memory_bytes(backend: str, mesh_devices: int, arch: str = TT_ARCH) -> float:
    """What one device of a serve mesh of ``mesh_devices`` devices (all replicas) may fill: a chip's
    DRAM on ``tt``, else an equal share of this host's memory; less :data:`DRAM_RESERVE`."""
    whole = chip(arch).dram_bytes if backend == "tt" else host_memory_bytes() / max(1, mesh_devices)
    return whole * (1.0 - DRAM_RESERVE)


Overrides = tuple[tuple[str, object], ...]  # config entries a checkpoint sets (hashable: the results are cached)


def workload(variant: str, size: str, tokens: int, dit: Overrides = ()) -> Workload:
    """The DiT of ``variant`` (``"tiny"`` or ``"full"``, with a checkpoint's config entries ``dit``)
    at ``tokens`` flat tokens (one latent frame of 1 x ``tokens``: the memory model reads only the
    token count)."""
    from ..models import PROMPT_TOKENS, config_for
    from .workload import EXPERTS

    cfg = config_for(variant, size, **dict(dit))
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    patch = tuple(cfg["patch_size"])
    return Workload(variant, (patch[0], patch[1], patch[2] * tokens), None, heads * head_dim, heads, head_dim,
                    cfg["ffn_dim"], cfg["num_layers"], PROMPT_TOKENS[size], patch, EXPERTS[variant],  # type: ignore[arg-type]
                    cfg["out_channels"])


@lru_cache(maxsize=64)
def resident_bytes(variant: str, size: str, plan: ShardingPlan, dtype_bytes: int, text_encoder: bool,
                   dit: Overrides = (), encoder: Overrides = ()) -> tuple[float, float]:
    """One expert's weights per device under ``plan`` (``dtype_bytes`` each), and the text
    encoder's per device when it is on the mesh (else 0): both built on the ``meta`` device
    (``dit`` / ``encoder``: a checkpoint's config entries)."""
    import torch

    from ..models import build_dit, build_text_encoder
    from .weights import predicted_text_encoder_bytes, predicted_weight_bytes

    dit_bytes = predicted_weight_bytes(build_dit(variant, size, device="meta", dtype=torch.bfloat16, **dict(dit)),
                                       plan, dtype_bytes)
    if not text_encoder:
        return float(dit_bytes), 0.0
    umt5 = build_text_encoder(size, device="meta", dtype=torch.bfloat16, **dict(encoder))
    return float(dit_bytes), float(predicted_text_encoder_bytes(umt5, plan, dtype_bytes))


def max_request_tokens(variant: str, size: str, plan: ShardingPlan, device_bytes: float, *, attention: str,
                       dtype_bytes: int = BF16, text_encoder: bool = False, dit: Overrides = (),
                       encoder: Overrides = ()) -> int:
    """The most flat tokens one request may have so that the memory model's per-device total under
    ``plan`` stays within ``device_bytes``; 0 when the weights alone do not fit. The total grows
    with the tokens, so the largest is found by bisection."""
    weights, umt5 = resident_bytes(variant, size, plan, dtype_bytes, text_encoder, dit, encoder)

    def fits(tokens: int) -> bool:
        mem = memory_per_chip(workload(variant, size, tokens, dit), plan, weights, attention, umt5)
        return mem.total <= device_bytes

    if not fits(1):
        return 0
    low, high = 1, MAX_TOKENS_SEARCHED
    if fits(high):
        return high
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


__all__ = ["MAX_TOKENS_SEARCHED", "Overrides", "TT_ARCH", "device_memory_bytes", "host_memory_bytes", "max_request_tokens",
           "resident_bytes", "workload"]
