"""The weight bytes each chip holds under a plan, as the planner counts them: the specs'
``bytes_per_device`` of the full-size models built on the meta device (no weights are read).

The same figures the jobs check their sharded models against (``jobs/placement.py``,
``jobs/generate.py``), so the planner's memory and what a run places cannot drift apart.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..plan import ShardingPlan
from .workload import BF16


@lru_cache(maxsize=4)
def meta_dit(variant: str) -> Any:
    """The full-size ``variant`` on the meta device, built once per process (~10 s)."""
    import torch

    from ..models import build_dit

    return build_dit(variant, "full", device="meta", dtype=torch.bfloat16)


def predicted_weight_bytes(dit: Any, plan: ShardingPlan, dtype_bytes: int | None = None) -> int:
    """What the planner counts for one expert's weights per chip under ``plan``: the specs'
    ``bytes_per_device`` (``dtype_bytes`` overrides the parameters' element size). Raises
    ``ShardingError`` (a ``ValueError``) when the specs refuse the plan."""
    from ..dit.specs import shard_dit_specs

    return shard_dit_specs(dit, plan).bytes_per_device(dtype_bytes)


@lru_cache(maxsize=4096)
def weight_bytes_per_expert(variant: str, plan: ShardingPlan) -> float:
    """One expert's weight bytes per chip in bf16 under ``plan``, on the meta model (~30 ms)."""
    return float(predicted_weight_bytes(meta_dit(variant), plan, BF16))


@lru_cache(maxsize=8)
def meta_dit_with_lora(variant: str, rank: int) -> Any:
    """The full-size ``variant`` on the meta device with a rank-``rank`` PEFT LoRA on every Linear a
    Wan LoRA targets (the blocks' attention and FFN, the condition embedder, ``proj_out``)."""
    import torch

    from ..lora.tiny import add_wan_lora
    from ..models import build_dit

    return add_wan_lora(build_dit(variant, "full", device="meta", dtype=torch.bfloat16), rank)


@lru_cache(maxsize=4096)
def adapter_bytes_per_expert(variant: str, plan: ShardingPlan, rank: int) -> float:
    """A rank-``rank`` adapter's bytes per chip in bf16 under ``plan`` (its weights split beside
    their bases': ``wan_sharding.lora_layers``), on the meta model; 0 for rank 0."""
    if rank <= 0:
        return 0.0
    return float(predicted_weight_bytes(meta_dit_with_lora(variant, rank), plan, BF16)
                 - predicted_weight_bytes(meta_dit(variant), plan, BF16))


@lru_cache(maxsize=1)
def meta_text_encoder() -> Any:
    """The full-size UMT5 encoder on the meta device, built once per process."""
    import torch

    from ..models import build_text_encoder

    return build_text_encoder("full", device="meta", dtype=torch.bfloat16)


def predicted_text_encoder_bytes(encoder: Any, plan: ShardingPlan, dtype_bytes: int | None = None) -> int:
    """What the planner counts for the UMT5 text encoder's weights per chip under ``plan`` when it
    is on the mesh: its specs' ``bytes_per_device`` (the replicated 256384 x 4096 embedding, 2.1 GB
    in bf16, is most of it at TP 4). Raises ``ShardingError`` when the specs refuse the plan."""
    from ..text_encoder import shard_text_encoder_specs

    return shard_text_encoder_specs(encoder, plan).bytes_per_device(dtype_bytes)


@lru_cache(maxsize=4096)
def text_encoder_weight_bytes(plan: ShardingPlan) -> float:
    """The full-size UMT5 encoder's weight bytes per chip in bf16 under ``plan``."""
    return float(predicted_text_encoder_bytes(meta_text_encoder(), plan, BF16))
