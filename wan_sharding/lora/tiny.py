"""LoRA adapter files made in code, offline, for any Wan DiT (tiny or full size): random
``lora_A`` / ``lora_B`` for every Linear the adapter targets, written as safetensors, in
diffusers' PEFT key format or in Wan's original one (``diffusion_model.blocks.N.self_attn.q.
lora_down.weight``, ``.alpha``, ``.diff_b`` biases), which diffusers' ``load_lora_weights``
converts (``lora_conversion_utils._convert_non_diffusers_wan_lora_to_diffusers``)."""

from __future__ import annotations

from pathlib import Path

import torch

# The DiT's Linear layers a Wan LoRA targets, by their diffusers path in one block, and their
# names in Wan's original format.
BLOCK_TARGETS = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
                 "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
                 "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
                 "ffn.net.2": "ffn.2"}
# Outside the blocks: the condition embedder's Linears and the output projection.
MODEL_TARGETS = {"condition_embedder.time_embedder.linear_1": "time_embedding.0",
                 "condition_embedder.time_embedder.linear_2": "time_embedding.2",
                 "condition_embedder.text_embedder.linear_1": "text_embedding.0",
                 "condition_embedder.text_embedder.linear_2": "text_embedding.2",
                 "condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head"}


def adapter_state(dit: torch.nn.Module, rank: int = 4, seed: int = 0, fmt: str = "peft", bias: bool = False,
                  blocks_only: bool = False, std: float = 0.05, prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """A random LoRA for every targeted Linear of ``dit``: ``fmt="peft"`` (diffusers' keys, under
    ``prefix.``) or ``"wan"`` (Wan's original keys with an ``alpha`` per layer, ``diff_b`` biases
    when ``bias``); ``blocks_only`` leaves the condition embedder and ``proj_out`` out."""
    if fmt not in ("peft", "wan"):
        raise ValueError(f"unknown LoRA format {fmt!r}; choose peft or wan")
    gen = torch.Generator().manual_seed(seed)
    targets = {f"blocks.{i}.{p}": f"blocks.{i}.{w}" for i in range(dit.config.num_layers) for p, w in BLOCK_TARGETS.items()}
    if not blocks_only:
        targets.update(MODEL_TARGETS)
    out: dict[str, torch.Tensor] = {}
    for path, wan in targets.items():
        lin = dit.get_submodule(path)
        lin = getattr(lin, "base_layer", lin)
        a = torch.randn(rank, lin.in_features, generator=gen) * std
        b = torch.randn(lin.out_features, rank, generator=gen) * std
        db = torch.randn(lin.out_features, generator=gen) * std if bias else None
        if fmt == "peft":
            out[f"{prefix}.{path}.lora_A.weight"], out[f"{prefix}.{path}.lora_B.weight"] = a, b
            if db is not None:
                out[f"{prefix}.{path}.lora_B.bias"] = db
        else:
            out[f"diffusion_model.{wan}.lora_down.weight"], out[f"diffusion_model.{wan}.lora_up.weight"] = a, b
            if wan.startswith("blocks."):  # diffusers' converter reads an alpha for block layers only
                out[f"diffusion_model.{wan}.alpha"] = torch.tensor(float(rank))
            if db is not None:
                out[f"diffusion_model.{wan}.diff_b"] = db
    return out


def write_adapter(path: str | Path, dit: torch.nn.Module, **kwargs) -> Path:
    """:func:`adapter_state` written to ``path`` as safetensors; returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    save_file({k: v.contiguous() for k, v in adapter_state(dit, **kwargs).items()}, str(path))
    return path


def add_wan_lora(dit: torch.nn.Module, rank: int, name: str = "lora") -> torch.nn.Module:
    """PEFT's LoRA layers of rank ``rank`` (zero-initialised ``lora_B``, as PEFT makes them) on every
    Linear a Wan LoRA targets (:data:`BLOCK_TARGETS` in each block, :data:`MODEL_TARGETS`), made on
    the model's own device (a ``meta`` model stays weightless): what ``compile --lora-rank`` and
    ``plan --lora-rank`` count."""
    from peft import LoraConfig

    device = next(dit.parameters()).device
    targets = sorted({*(f"blocks.{i}.{p}" for i in range(dit.config.num_layers) for p in BLOCK_TARGETS), *MODEL_TARGETS})
    with torch.device(device):
        dit.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), adapter_name=name)
    return dit
