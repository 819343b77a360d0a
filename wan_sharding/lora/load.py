"""Adapters into a Wan pipeline as diffusers loads them, every file checked against its expert
first: :func:`load_loras` reads and checks all the requests, then calls the pipeline's own
``load_lora_weights`` (``load_into_transformer_2=True`` for the low-noise expert) and
``set_adapters`` with the requested weights. A sharded pipeline takes the same calls (its
stand-ins forward them to the real experts and place the LoRA weights on the mesh)."""

from __future__ import annotations

from typing import Any, Sequence

from ..lora_layers import LoraError
from .files import LoraRequest, check_adapter_state, converted_state, parse_lora_arg


def _expert(pipe: Any, name: str) -> Any:
    model = getattr(pipe, name, None)
    return getattr(model, "dit", model)  # a sharded pipeline's stand-in holds the real model


def expert_names(request: LoraRequest) -> tuple[str, ...]:
    return ("transformer", "transformer_2") if request.expert == "both" else (request.expert,)


def check_loras(pipe: Any, requests: Sequence[LoraRequest | str]) -> list[tuple[LoraRequest, dict]]:
    """Every request read (safetensors only), converted as diffusers converts it
    (``pipe.lora_state_dict``: Wan's original keys, ``diff_b`` biases) and checked against its
    expert(s); ``[(request, converted state dict)]``. :class:`LoraError` (one line) for the first
    that does not fit: nothing has been loaded."""
    out, names = [], set()
    for r in requests:
        r = parse_lora_arg(r) if isinstance(r, str) else r
        for name in expert_names(r):
            if _expert(pipe, name) is None:
                raise LoraError(f"--lora {r.path}: this pipeline has no {name} (TI2V-5B has one expert); load it into "
                                "transformer")
        if r.name in names:
            raise LoraError(f"two adapters are named {r.name!r} (from their files' names); rename one file")
        names.add(r.name)
        converted = converted_state(r.path)
        for name in expert_names(r):
            try:
                check_adapter_state(_expert(pipe, name), converted)
            except LoraError as e:
                raise LoraError(f"--lora {r.path} ({name}): {e}") from None
        out.append((r, converted))
    return out


def load_loras(pipe: Any, requests: Sequence[LoraRequest | str]) -> list[str]:
    """Load every request into its expert(s) (checked first: :func:`check_loras`) and make them
    the active adapters with their scales; returns the adapter names."""
    checked = check_loras(pipe, requests)
    for r, state in checked:
        for name in expert_names(r):
            pipe.load_lora_weights(dict(state), adapter_name=r.name, load_into_transformer_2=name == "transformer_2")
    names = [r.name for r, _ in checked]
    if names:
        pipe.set_adapters(names, [r.scale for r, _ in checked])
    return names


def load_into_dit(dit: Any, requests: Sequence[LoraRequest | str], fuse: bool = False) -> list[str]:
    """The requests for the high-noise expert (``transformer`` or ``both``) loaded into a bare DiT
    (what ``profile`` times), each converted as diffusers converts it and checked first, then made
    active with their scales; with ``fuse`` merged into its base weights
    (:func:`~wan_sharding.lora.fuse.fuse_lora_layers`, kept until the process ends)."""
    from .fuse import fuse_lora_layers

    names, scales = [], []
    for r in requests:
        r = parse_lora_arg(r) if isinstance(r, str) else r
        if r.expert == "transformer_2":
            continue
        converted = converted_state(r.path)
        check_adapter_state(dit, converted)
        dit.load_lora_adapter(converted, adapter_name=r.name)
        names.append(r.name)
        scales.append(r.scale)
    if names:
        dit.set_adapters(names, scales)
        if fuse:
            fuse_lora_layers(dit)
    return names
