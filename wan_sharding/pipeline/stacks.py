"""Keeping torch-xla out of a JAX process that runs a diffusers Wan pipeline.

diffusers' Wan pipelines call torch-xla's ``mark_step()`` after every step when torch-xla is
installed; in a process that runs the ``jax`` backend that would start a second XLA runtime.
"""

from __future__ import annotations

from typing import Any

from ..backends import Backend

__all__ = ["diffusers_without_torch_xla", "warn_if_torch_xla_in_jax_process"]

_WAN_PIPELINE_MODULES = ("diffusers.pipelines.wan.pipeline_wan", "diffusers.pipelines.wan.pipeline_wan_i2v")


def diffusers_without_torch_xla() -> None:
    """For a process that runs the ``jax`` backend: make diffusers treat torch-xla as absent.

    When torch-xla is installed, diffusers' Wan pipelines call ``torch_xla``'s ``mark_step()``
    after every denoising step, which starts torch-xla's own XLA runtime next to JAX's in the same
    process (this project keeps the two stacks in separate processes). Call this before the
    pipeline modules are imported; it sets diffusers' cached "is torch_xla available" answer for
    this process and touches no class.
    """
    import sys

    loaded = [m for m in _WAN_PIPELINE_MODULES if getattr(sys.modules.get(m), "XLA_AVAILABLE", False)]
    if loaded:
        raise RuntimeError(
            f"{', '.join(loaded)} already imported with torch-xla enabled; call diffusers_without_torch_xla() "
            "before importing diffusers' Wan pipelines (first thing in the script)"
        )
    import diffusers.utils.import_utils as import_utils

    import_utils._torch_xla_available = False


def warn_if_torch_xla_in_jax_process(pipe: Any, be: Backend) -> None:
    import sys
    import warnings

    if not be.uses_torch_xla and getattr(sys.modules.get(type(pipe).__module__), "XLA_AVAILABLE", False):
        warnings.warn(
            f"{type(pipe).__name__} will call torch_xla's mark_step() after every step (torch-xla is installed), "
            "starting torch-xla's runtime in this JAX process; call wan_sharding.pipeline.diffusers_without_torch_xla() "
            "before importing diffusers pipelines to keep the two stacks apart", RuntimeWarning, stacklevel=3)
