"""Step caching on sharded Wan 2.2 experts: diffusers' cache hooks, honoured on every backend.

diffusers ships step caches as hooks (``transformer.enable_cache(config)``): FirstBlockCache,
MagCache, TaylorSeer, Pyramid Attention Broadcast, FasterCache. They decide *on the host, at every
forward* whether to run a block or an attention module. A backend that compiles whole forwards
(``jax``) runs a model's Python only while tracing, so there a cache would decide once and then
skip nothing. This package therefore runs a block cache's forward (FirstBlockCache, MagCache) as
two or three whole programs cut at the cache's one decision (:mod:`.programs`), a per-module
cache's (TaylorSeer, PAB) as one whole program per decision pattern, decided on the host before
the forward (:mod:`.module_programs`), and any other cache as host Python between compiled pieces
(:mod:`.probes`); it counts what each cache computed and skipped on every backend.

- :func:`enable_model_cache` / :func:`disable_model_cache` (:mod:`.model`): what a sharded pipeline's stand-in
  (``pipe.transformer.enable_cache(...)``) calls; usable on an unsharded model too, to get the same
  statistics (:func:`model_cache_stats`);
- :mod:`.wan`: Wan-ready configs per cache kind (:func:`wan_cache_config`), per-expert step counts,
  MagCache calibration, and pipeline-wide helpers.
"""

from __future__ import annotations

from .model import disable_model_cache, enable_model_cache, model_cache_stats
from .probes import CacheStats
from .wan import (
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

# What a user of step caching needs; the machinery (probes, programs, the backends' side) stays in
# its modules.
__all__ = [
    "CACHE_KINDS", "CacheStats", "calibrate_mag_ratios", "calibrate_pipeline_mag_ratios", "disable_model_cache",
    "disable_pipeline_cache", "enable_model_cache", "enable_pipeline_cache", "expert_steps", "model_cache_stats",
    "pipeline_cache_stats", "reset_pipeline_cache", "wan_cache_config",
]
