"""Backends: one constraint primitive each (``tt``, ``xla``, ``jax``), quirks documented in each."""

from __future__ import annotations

from typing import Any

from ..mesh import MeshSpec, as_mesh_spec
from .base import Backend, BackendError

BACKENDS = ("xla", "jax", "tt")


def get_backend(backend: str | Backend, mesh: Any) -> Backend:
    """A backend instance for ``mesh``. ``mesh`` may be a native mesh of that backend (used as is)."""
    if isinstance(backend, Backend):
        if as_mesh_spec(mesh).shape != backend.mesh.shape:
            raise BackendError(f"backend {backend!r} is bound to mesh {backend.mesh.name}, not {as_mesh_spec(mesh).name}")
        return backend
    spec = as_mesh_spec(mesh)
    native = None if isinstance(mesh, (MeshSpec, str, tuple)) else mesh
    if backend == "xla":
        from .xla import XlaBackend

        return XlaBackend(spec, native)
    if backend == "jax":
        from .jax import JaxBackend

        return JaxBackend(spec, native)
    if backend == "tt":
        from .tt import TTBackend

        return TTBackend(spec, native)
    raise BackendError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "Backend", "BackendError", "get_backend"]
