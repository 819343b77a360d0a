"""Step caching on sharded Wan 2.2 experts: diffusers' cache hooks, honoured on every backend.

diffusers ships step caches as hooks (``transformer.enable_cache(config)``): FirstBlockCache,
MagCache, TaylorSeer, Pyramid Attention Broadcast, FasterCache. They decide *on the host, at every
forward* whether to run a block or an attention module. A backend that compiles whole forwards
(``jax``) runs a model's Python only while tracing, so there a cache would decide once and then
skip nothing. This package therefore runs a block cache's forward (FirstBlockCache, MagCache) as
two or three whole programs cut at the cache's one decision (:mod:`.programs`), a per-module
cache's (TaylorSeer, PAB) as one whole program per decision pattern, decided on the host before
the forward (:mod:`.module_plans`), and any other cache as host Python between compiled pieces
(:mod:`.probes`); it counts what each cache computed and skipped on every backend.

- :func:`enable_model_cache` / :func:`disable_model_cache`: what a sharded pipeline's stand-in
  (``pipe.transformer.enable_cache(...)``) calls; usable on an unsharded model too, to get the same
  statistics (:func:`model_cache_stats`);
- :mod:`.wan`: Wan-ready configs per cache kind (:func:`wan_cache_config`), per-expert step counts,
  MagCache calibration, and pipeline-wide helpers.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .module_plans import ModulePlan, module_cache_kind
from .programs import BlockPlan, ForwardTiming, block_cache_kind
from .probes import (
    CacheProbe,
    CacheStats,
    OutputFix,
    UnitRunner,
    cache_hooked_modules,
    compiled_units,
    install_probe,
    zero_padding_rows,
)

# Models with a cache enabled through this package -> their probe. Weak: a dropped model is forgotten.
_PROBES: "weakref.WeakKeyDictionary[torch.nn.Module, CacheProbe]" = weakref.WeakKeyDictionary()


def enable_model_cache(dit: torch.nn.Module, config: Any, runner: UnitRunner | None = None,
                       post: OutputFix | None = None, programs: bool = False) -> CacheProbe:
    """``dit.enable_cache(config)`` with a probe under the cache's hooks (statistics; with
    ``runner``, compiled pieces between the cache's decisions; with ``programs``, a block cache as a
    few whole programs, :mod:`.programs`; ``post``: see :func:`install_probe`).
    Errors as diffusers' ``enable_cache``."""
    probe = install_probe(dit, config, runner=runner, post=post, programs=programs)
    _PROBES[dit] = probe
    return probe


def model_cache_probe(dit: torch.nn.Module) -> CacheProbe | None:
    """The live probe of ``dit``'s cache, or ``None`` (no cache, or one enabled around this package)."""
    probe = _PROBES.get(dit)
    if probe is None or probe.removed or dit._cache_config is not probe.config:
        return None
    return probe


def model_cache_stats(dit: torch.nn.Module) -> CacheStats | None:
    """What the cache enabled on ``dit`` computed and skipped so far, or ``None``."""
    probe = model_cache_probe(dit)
    return probe.stats if probe is not None else None


def disable_model_cache(dit: torch.nn.Module) -> None:
    """Disable the cache on ``dit`` (diffusers' ``disable_cache``) and take the probe off."""
    probe = _PROBES.pop(dit, None)
    if probe is not None and not probe.removed:
        probe.remove(keep_cache=False)
    elif dit.is_cache_enabled:
        dit.disable_cache()


def release_model_cache(dit: torch.nn.Module) -> None:
    """Take the probe (and any backend's compiled pieces) off ``dit``, leaving its cache enabled."""
    probe = _PROBES.pop(dit, None)
    if probe is not None and not probe.removed:
        probe.remove(keep_cache=True)


from .wan import (  # noqa: E402  (uses the functions above)
    CACHE_KINDS,
    calibrate_mag_ratios,
    calibrate_pipeline_mag_ratios,
    disable_pipeline_cache,
    enable_pipeline_cache,
    expert_steps,
    pipeline_cache_stats,
    reset_pipeline_cache,
    wan_cache_config,
)

__all__ = [
    "BlockPlan", "CACHE_KINDS", "CacheProbe", "ForwardTiming", "block_cache_kind", "CacheStats", "cache_hooked_modules", "calibrate_mag_ratios", "calibrate_pipeline_mag_ratios",
    "compiled_units", "ModulePlan", "module_cache_kind",
    "disable_model_cache", "disable_pipeline_cache", "enable_model_cache", "enable_pipeline_cache", "expert_steps",
    "install_probe", "model_cache_probe", "model_cache_stats", "pipeline_cache_stats", "release_model_cache",
    "reset_pipeline_cache", "wan_cache_config", "zero_padding_rows",
]
