"""PEFT's LoRA layers on a model, as data: which base a LoRA parameter belongs to, how it is split
beside its base, what cannot be split exactly, and the adapter state a compiled forward reads.

diffusers' ``load_lora_weights`` wraps each targeted ``nn.Linear`` in PEFT's ``lora.Linear``: the
original layer becomes ``<path>.base_layer`` and each adapter adds ``<path>.lora_A.<adapter>``
(rank x in) and ``<path>.lora_B.<adapter>`` (out x rank, with a bias when the file has Wan's
``diff_b``). The forward is ``base(x) + lora_B(lora_A(x)) * scaling[adapter]`` for every active
adapter (PEFT ``tuners/lora/layer.py``, ``Linear.forward``). So a LoRA is split by its base's TP
style, with no new large collective:

- column-parallel base (output rows split): ``lora_A`` whole, ``lora_B`` (and its bias) split on
  its output rows, like the base; the rank-sized ``x @ A^T`` is computed on every device;
- row-parallel base (input columns split): ``lora_A`` split on its input columns, ``lora_B`` whole;
  ``x @ A^T`` is then a rank-sized partial sum, reduced (``rank`` values per token, against the
  base's ``out`` values per token);
- replicated base: both whole.

Imports no backend and no ``peft``: layers are recognised by their attributes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .plan import COLWISE, REPLICATE, ROWWISE

BASE, LORA_A, LORA_B = "base", "lora_A", "lora_B"
# Parameter containers PEFT adds that this package does not split, and why (one line each).
REFUSED_PARTS = {
    "lora_magnitude_vector": "DoRA's magnitude vector (it rescales each output row by the norm of the whole merged "
                             "row, a norm over the row-parallel split)",
    "lora_embedding_A": "an Embedding LoRA (Wan's DiT has no embedding layer a LoRA targets)",
    "lora_embedding_B": "an Embedding LoRA (Wan's DiT has no embedding layer a LoRA targets)",
}
# patches that leave every Linear a LoRA wraps as it is (the others fuse or reorder Linear weights
# and would read the base weight without the adapter)
PATCHES_WITH_LORA = ("rope", "rope_tables")
# set on a LoRA layer that wan_sharding.lora.fuse merged (shard_pipeline(..., lora="fuse")): its
# merged state is then the sharding's own, not a merge sharding would miss
FUSED_MARK = "_wan_sharding_fused"
# The key a compiled forward's adapter scales travel under, beside the weights (never a parameter name)
SCALES_KEY = "<lora scales>"


class LoraError(ValueError):
    """A LoRA adapter that cannot be used here (one line naming the problem and the fix); raised
    before anything is changed."""


def parameter_role(name: str) -> tuple[str, str]:
    """``(owner, role)`` of a parameter name: the module path the TP table names (the wrapped
    Linear's own path for PEFT's ``base_layer`` and LoRA parameters) and ``"base"``, ``"lora_A"``
    or ``"lora_B"``. Raises :class:`LoraError` for a PEFT part this package does not split."""
    parts = name.split(".")
    for refused, why in REFUSED_PARTS.items():
        if refused in parts:
            owner = ".".join(parts[: parts.index(refused)])
            raise LoraError(f"{owner}: {why} cannot be split exactly on a mesh; load a plain LoRA (no use_dora), or "
                            "merge it into the weights before sharding (pipe.fuse_lora(); pipe.unload_lora_weights())")
    for role in (LORA_A, LORA_B):
        if role in parts[:-1]:
            return ".".join(parts[: parts.index(role)]), role
    if "base_layer" in parts:
        return ".".join(parts[: parts.index("base_layer")]), BASE
    return name.rpartition(".")[0], BASE


def lora_spec(style: str, role: str, ndim: int, tp: Any) -> tuple | None:
    """The spec of a LoRA parameter of ``role`` beside a base of TP ``style`` (module docstring),
    ``None`` for a base parameter (the base's own rule applies). Raises :class:`LoraError` for a
    base style no LoRA can sit beside (a norm, an embedding)."""
    if role == BASE:
        return None
    whole = (None,) * ndim
    if style == REPLICATE or tp is None:
        return whole
    if style == COLWISE:  # lora_A (rank, in) whole; lora_B (out, rank) and its bias (out,) split on out
        return whole if role == LORA_A else (tp,) + (None,) * (ndim - 1)
    if style == ROWWISE:  # lora_A (rank, in) split on in; lora_B whole (its bias added once)
        return (None, tp) if role == LORA_A and ndim == 2 else whole
    raise LoraError(f"a LoRA layer sits on a {style} module, which is not a Linear the TP plan splits by rows or "
                    "columns; target Linear layers only")


# ---- the live adapter state ------------------------------------------------------------------------


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every PEFT LoRA layer of ``model`` by its path (the wrapped layer's path)."""
    return {n: m for n, m in model.named_modules()
            if hasattr(m, "base_layer") and isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)}


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries PEFT LoRA layers (loaded adapters)."""
    return bool(lora_modules(model))


def check_layers(model: torch.nn.Module, patches: tuple[str, ...] = ()) -> None:
    """:class:`LoraError` (one line) when a LoRA layer cannot be sharded exactly as it is: a variant
    (DoRA, ...), an adapter merged into the host weights, or ``patches`` that rewrite the Linear
    layers an adapter wraps."""
    layers = lora_modules(model)
    if not layers:
        return
    for path, m in layers.items():
        variants = sorted(getattr(m, "lora_variant", {}) or {})
        if variants or any(getattr(m, "use_dora", {}).values()):
            raise LoraError(f"{path}: adapter {(variants or sorted(m.use_dora))[0]!r} is a LoRA variant (DoRA or "
                            "another PEFT variant) whose forward is not a plain low-rank sum; load it without the "
                            "variant, or merge it before sharding (pipe.fuse_lora(); pipe.unload_lora_weights())")
        if getattr(m, "merged", False) and not m.__dict__.get(FUSED_MARK):
            raise LoraError(f"{path}: adapter(s) {list(m.merged_adapters)} are merged into the base weight by "
                            "fuse_lora; unfuse them (pipe.unfuse_lora()), or shard with lora='fuse'")
    rewriting = [p for p in patches if p not in PATCHES_WITH_LORA]
    if rewriting:
        raise LoraError(f"patch {rewriting[0]!r} rewrites Linear layers that LoRA adapters wrap, and would drop the "
                        f"adapters' terms; with LoRA adapters use only the patches {list(PATCHES_WITH_LORA)}")


def adapter_ranks(model: torch.nn.Module) -> dict[str, int]:
    """``{adapter: rank}`` of every adapter loaded on ``model``."""
    out: dict[str, int] = {}
    for m in lora_modules(model).values():
        out.update({a: int(r) for a, r in m.r.items()})
    return out


def live_scales(model: torch.nn.Module) -> dict[str, float]:
    """What PEFT's forward adds right now: ``{"<layer path>|<adapter>": scaling}`` for every
    active, loaded, unmerged adapter of every LoRA layer not disabled. The keys are the forward's
    structure (which low-rank terms it has), the values its only numbers that are not tensors."""
    out = {}
    for path, m in lora_modules(model).items():
        if m.disable_adapters or m.merged:
            continue
        for adapter in m.active_adapters:
            if adapter in m.lora_A:
                out[f"{path}|{adapter}"] = float(m.scaling[adapter])
    return out


@contextlib.contextmanager
def scales_as(model: torch.nn.Module, values: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, PEFT reads each adapter's scaling from ``values`` (``live_scales``' keys,
    values such as traced scalars), so a compiled forward takes the scales as inputs instead of
    constants baked into its program; PEFT's own floats are put back after."""
    if not values:
        yield
        return
    layers = lora_modules(model)
    saved = []
    try:
        for key, value in values.items():
            path, _, adapter = key.rpartition("|")
            scaling = layers[path].scaling
            saved.append((scaling, adapter, scaling[adapter]))
            scaling[adapter] = value
        yield
    finally:
        for scaling, adapter, value in reversed(saved):
            scaling[adapter] = value


def program_scales(model: torch.nn.Module) -> dict[str, float]:
    """The low-rank terms a compiled program keeps and their scales now: ``live_scales``' keys and
    values, and a disabled layer's active adapters too, with scale 0.0. Adding ``0 * x`` for a
    finite ``x`` adds exactly nothing, so a program over these keys computes the base forward when
    every scale is 0, and ``disable_lora`` / ``enable_lora`` only change the program's inputs."""
    out = {}
    for path, m in lora_modules(model).items():
        if m.merged:
            continue
        for adapter in m.active_adapters:
            if adapter in m.lora_A:
                out[f"{path}|{adapter}"] = 0.0 if m.disable_adapters else float(m.scaling[adapter])
    return out


@contextlib.contextmanager
def adapters_enabled(model: torch.nn.Module) -> Iterator[None]:
    """Within the block every LoRA layer reads as enabled (its disabled state is then a scale of 0,
    :func:`program_scales`) and each layer's ``scaling`` may be written; both are put back after,
    so PEFT's own state is as it was."""
    layers = [m for m in lora_modules(model).values() if not m.merged]
    saved = [(m, m._disable_adapters, dict(m.scaling)) for m in layers]
    try:
        for m in layers:
            m._disable_adapters = False  # PEFT's flag behind ``disable_adapters`` (tuners_utils.BaseTunerLayer)
        yield
    finally:
        for m, disabled, scaling in saved:
            m._disable_adapters = disabled
            m.scaling.clear()
            m.scaling.update(scaling)


def scale_targets(model: torch.nn.Module, keys: Sequence[str]) -> tuple[tuple[torch.nn.Module, str], ...]:
    """``(layer, adapter)`` for each key of :func:`program_scales`, in order: where a compiled
    program writes the scale it is given."""
    layers = lora_modules(model)
    return tuple((layers[path], adapter) for path, _, adapter in (key.rpartition("|") for key in keys))


def lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every LoRA parameter of ``model`` by name (``...lora_A.<adapter>.weight`` and the like)."""
    return {n: p for n, p in model.named_parameters() if parameter_role(n)[1] != BASE}


def split_scales(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A compiled forward's weights and its adapter scales (under :data:`SCALES_KEY`), apart."""
    if SCALES_KEY not in state:
        return dict(state), {}
    rest = dict(state)
    return rest, rest.pop(SCALES_KEY)
