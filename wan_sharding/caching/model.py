"""A cache on one model through this package: diffusers' ``enable_cache`` with a probe under its
hooks (:mod:`.probes`), and the registry of those probes."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .probes import CacheProbe, CacheStats, OutputFix, UnitRunner, install_probe

__all__ = ["disable_model_cache", "enable_model_cache", "model_cache_probe", "model_cache_stats",
           "release_model_cache"]

# Models with a cache enabled through this package -> their probe. Weak: a dropped model is forgotten.
_PROBES: "weakref.WeakKeyDictionary[torch.nn.Module, CacheProbe]" = weakref.WeakKeyDictionary()


def enable_model_cache(dit: torch.nn.Module, config: Any, runner: UnitRunner | None = None,
                       post: OutputFix | None = None, programs: bool = False) -> CacheProbe:
    """``dit.enable_cache(config)`` with a probe under the cache's hooks (statistics; with
    ``runner``, compiled pieces between the cache's decisions; with ``programs``, a block cache as a
    few whole programs, :mod:`.programs`; ``post``: see :func:`install_probe`).
    Errors as diffusers' ``enable_cache``."""
    probe = install_probe(dit, config, runner=runner, post=post, as_programs=programs)
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
