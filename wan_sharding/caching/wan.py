"""Wan-ready cache configs, per expert, and pipeline-wide helpers.

diffusers' defaults do not all act on Wan: TaylorSeer's default identifiers (``^blocks.*attn``,
matched in full) match no Wan module name (``blocks.3.attn1``), so it silently does nothing; MagCache
needs magnitude ratios of the model it runs. :func:`wan_cache_config` gives, per kind, settings that
act on a Wan DiT, and this is what each then skips:

- ``fbc`` (FirstBlockCache): ``blocks.0`` runs every forward; when its residual changed by less
  than ``threshold`` (relative mean abs) since the last full forward, every other block is skipped
  and the cached residual of the stack is added instead. Decided from one scalar read back per forward.
- ``mag`` (MagCache): the whole block stack is skipped (input + the last residual) while the
  accumulated magnitude-ratio error stays under ``threshold``, at most ``max_skip_steps`` in a row,
  never in the first ``retention_ratio`` of the steps. Decided from the step index and the ratios
  (calibrated per expert with :func:`calibrate_mag_ratios`): nothing is read back.
- ``taylorseer``: every block's ``attn1``, ``attn2`` and ``ffn`` are computed on the first
  ``disable_cache_before_step`` steps and then once every ``cache_interval`` steps; in between their
  outputs are predicted by a first-order Taylor expansion. Decided from the call count.
- ``pab`` (Pyramid Attention Broadcast): self-attention (``attn1``) runs every
  ``spatial_attention_block_skip_range``-th call and cross-attention (``attn2``) every
  ``cross_attention_block_skip_range``-th call while the timestep is inside the skip range; the last
  output is reused in between. Decided from the call count and the pipeline's current timestep.
  In diffusers 0.42 its state is not kept per ``cache_context``, so with classifier-free guidance the
  cond and uncond calls share it (the uncond call can reuse the cond call's attention).

Counts are per expert: the A14B pipelines switch from ``transformer`` to ``transformer_2`` at the
boundary timestep, so each expert sees only its share of the steps (:func:`expert_steps`), and the
step-count settings above are taken per expert.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from .model import disable_model_cache, enable_model_cache, model_cache_stats

CACHE_KINDS = ("none", "fbc", "mag", "taylorseer", "pab")

# Wan module names the per-module caches act on.
TAYLORSEER_MODULES = r"blocks\.\d+\.(attn1|attn2|ffn)"


def wan_cache_config(kind: str, steps: int, dtype: torch.dtype = torch.float32,
                     timestep: Callable[[], Any] | None = None, mag_ratios: list[float] | None = None,
                     **overrides: Any) -> Any:
    """A diffusers cache config of ``kind`` (``fbc``, ``mag``, ``taylorseer``, ``pab``) that acts on
    a Wan DiT which runs ``steps`` denoising steps (per expert: :func:`expert_steps`).

    ``dtype``: TaylorSeer keeps its factors in it (the model's dtype, so fp32 runs stay fp32).
    ``timestep``: PAB's ``current_timestep_callback`` (``lambda: pipe.current_timestep``).
    ``mag_ratios``: MagCache's per-step ratios for this expert (:func:`calibrate_mag_ratios`).
    ``overrides``: any field of the config (e.g. ``threshold=0.1``).
    """
    from diffusers.hooks import (
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )

    if kind not in CACHE_KINDS or kind == "none":
        raise ValueError(f"unknown cache kind {kind!r}; choose one of {', '.join(CACHE_KINDS[1:])}")
    if steps < 1:
        raise ValueError(f"a cache needs at least one denoising step on its expert, got steps={steps}")
    if kind == "fbc":
        return FirstBlockCacheConfig(**{"threshold": 0.05, **overrides})
    if kind == "mag":
        if mag_ratios is None and not overrides.get("calibrate"):
            raise ValueError("MagCache needs this expert's magnitude ratios: mag_ratios=calibrate_mag_ratios(pipe, run)[name]")
        return MagCacheConfig(**{"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2,
                                 "num_inference_steps": steps, "mag_ratios": mag_ratios, **overrides})
    if kind == "taylorseer":
        # Two computed steps give the first-order factors; then compute every third step.
        return TaylorSeerCacheConfig(**{"cache_interval": 3, "disable_cache_before_step": 2, "max_order": 1,
                                        "taylor_factors_dtype": dtype, "cache_identifiers": [TAYLORSEER_MODULES],
                                        **overrides})
    if timestep is None:
        raise ValueError("PAB needs the pipeline's current timestep: timestep=lambda: pipe.current_timestep")
    return PyramidAttentionBroadcastConfig(**{
        "spatial_attention_block_skip_range": 2, "cross_attention_block_skip_range": 3,
        "spatial_attention_timestep_skip_range": (100, 950), "cross_attention_timestep_skip_range": (100, 950),
        "current_timestep_callback": timestep, **overrides})


# ----------------------------------------------------------------------------------- pipelines


def pipeline_experts(pipe: Any) -> list[tuple[str, Any, torch.nn.Module]]:
    """``(component name, the pipeline's object, the real DiT)`` per expert present (a sharded
    pipeline's stand-in or the model itself)."""
    out = []
    for name in ("transformer", "transformer_2"):
        component = getattr(pipe, name, None)
        if component is not None:
            out.append((name, component, getattr(component, "dit", component)))
    return out


def expert_steps(pipe: Any, steps: int) -> dict[str, int]:
    """How many of ``steps`` denoising steps each expert runs (A14B: ``transformer`` while the
    timestep is at or above ``boundary_ratio x num_train_timesteps``, then ``transformer_2``)."""
    scheduler = copy.deepcopy(pipe.scheduler)
    scheduler.set_timesteps(steps, device="cpu")
    timesteps = scheduler.timesteps
    names = [name for name, *_ in pipeline_experts(pipe)]
    ratio = pipe.config.get("boundary_ratio")
    if ratio is None or "transformer_2" not in names:
        return {names[0]: len(timesteps)}
    boundary = ratio * scheduler.config.num_train_timesteps
    high = int((timesteps >= boundary).sum())
    return {"transformer": high, "transformer_2": len(timesteps) - high}


def calibrate_mag_ratios(models: dict[str, tuple[torch.nn.Module, int]], run: Callable[[], Any]) -> dict[str, list[float]]:
    """MagCache's magnitude ratios per model, from one call of ``run()`` in diffusers' calibration
    mode (nothing skipped). ``models``: name -> (the DiT, how many steps it runs in ``run``). Ratios
    of the ``cond`` calls, one per step (the denoising loop must set ``cache_context("cond")``)."""
    from diffusers.hooks import MagCacheConfig
    from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK


    ratios: dict[str, list[float]] = {}
    enabled, taps = [], []

    def tap(name: str, hook: Any) -> Callable:
        def after_forward(module: torch.nn.Module, args: tuple, out: Any) -> None:
            # Read after every forward: a pipeline clears cache state when its call ends.
            state = hook.state_manager._state_cache.get("cond")
            if state is not None:
                ratios[name] = [float(r) for r in state.calibration_ratios]

        return after_forward

    try:
        for name, (dit, steps) in models.items():
            # One more step than it runs: diffusers clears the ratios when the count is reached.
            enable_model_cache(dit, MagCacheConfig(calibrate=True, num_inference_steps=steps + 1))
            enabled.append(dit)
            hook = dit.blocks[0]._diffusers_hook.get_hook(_MAG_CACHE_LEADER_BLOCK_HOOK)
            taps.append(dit.register_forward_hook(tap(name, hook)))
        run()
        return ratios
    finally:
        for h in taps:
            h.remove()
        for dit in enabled:
            disable_model_cache(dit)


def calibrate_pipeline_mag_ratios(pipe: Any, run: Callable[[], Any], steps: int) -> dict[str, list[float]]:
    """:func:`calibrate_mag_ratios` for every expert of ``pipe`` that runs one of ``steps`` steps in
    ``run()`` (a call of the pipeline with ``steps`` steps)."""
    per_expert = expert_steps(pipe, steps)
    models = {name: (dit, per_expert[name]) for name, _, dit in pipeline_experts(pipe) if per_expert.get(name, 0) > 0}
    return calibrate_mag_ratios(models, run)


def enable_pipeline_cache(pipe: Any, kind: str, steps: int, mag_ratios: dict[str, list[float]] | None = None,
                          **overrides: Any) -> dict[str, Any]:
    """Enable a ``kind`` cache (:func:`wan_cache_config`) on every expert of ``pipe`` that runs at
    least one of ``steps`` steps, sharded (through its stand-in) or not; returns the configs."""

    per_expert = expert_steps(pipe, steps)
    configs = {}
    for name, component, dit in pipeline_experts(pipe):
        if per_expert.get(name, 0) < 1:
            continue
        config = wan_cache_config(kind, per_expert[name], dtype=dit.dtype, timestep=lambda: pipe.current_timestep,
                                  mag_ratios=(mag_ratios or {}).get(name), **overrides)
        if component is dit:
            enable_model_cache(dit, config)
        else:
            component.enable_cache(config)
        configs[name] = config
    return configs


def disable_pipeline_cache(pipe: Any) -> None:
    """Disable the cache on every expert of ``pipe`` that has one."""

    for _, component, dit in pipeline_experts(pipe):
        if dit.is_cache_enabled:
            disable_model_cache(dit)


def reset_pipeline_cache(pipe: Any) -> None:
    """Clear every expert's cache state and statistics, so the next call starts like the first
    (the Wan pipelines do not reset cache state between calls)."""

    for _, _, dit in pipeline_experts(pipe):
        if dit.is_cache_enabled:
            dit._reset_stateful_cache()
            stats = model_cache_stats(dit)
            if stats is not None:
                stats.reset()


def pipeline_cache_stats(pipe: Any) -> dict[str, dict[str, Any]]:
    """Per expert with a cache: calls, computed, skipped (of the cache-hooked modules) and each
    call's decision in order."""

    out = {}
    for name, _, dit in pipeline_experts(pipe):
        stats = model_cache_stats(dit)
        if stats is not None:
            out[name] = {**stats.summary(), "decisions": [int(c) for _, c in stats.decisions]}
    return out
