"""Adapters merged into the base weights before sharding (opt-in, ``shard_pipeline(...,
lora="fuse")``): each LoRA layer's forward is then its base layer alone, no extra op per block, and
:meth:`FusedLora.remove` puts the very base weight objects back, bit for bit (PEFT's own
``unmerge`` subtracts the product again, which rounds).

PEFT's ``merge`` writes ``W + scale * B @ A`` (its ``get_delta_weight``) into the base weight in
place; here it writes into a copy that replaces the base weight for as long as the merge lasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..lora_layers import FUSED_MARK, lora_modules


@dataclass(eq=False)
class FusedLora:
    """The merge of every active adapter into its base weights; ``remove()`` undoes it."""

    saved: list[tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.nn.Parameter]]] = field(default_factory=list)

    @property
    def layers(self) -> int:
        return len(self.saved)

    def remove(self) -> None:
        """The original base parameters back (the same objects) and the layers unmerged."""
        for layer, base, params in reversed(self.saved):
            for name, p in params.items():
                base.register_parameter(name, p)
            layer.merged_adapters.clear()
            layer.__dict__.pop(FUSED_MARK, None)
        self.saved.clear()


def fuse_lora_layers(model: torch.nn.Module) -> FusedLora:
    """Merge every active adapter of every LoRA layer of ``model`` (with its current scale) into a
    copy of its base weights (and bias, for an adapter with a ``lora_B`` bias)."""
    fused = FusedLora()
    for layer in lora_modules(model).values():
        if layer.disable_adapters or layer.merged:
            continue
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if not active:
            continue
        base = layer.get_base_layer()
        params = {n: p for n, p in base.named_parameters(recurse=False)}
        for name, p in params.items():
            base.register_parameter(name, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        fused.saved.append((layer, base, params))
        layer.merge(adapter_names=active)
        layer.__dict__[FUSED_MARK] = True
    return fused


def fused_here(layer: Any) -> bool:
    """Whether ``layer``'s merge is one :func:`fuse_lora_layers` made."""
    return bool(layer.__dict__.get(FUSED_MARK))
