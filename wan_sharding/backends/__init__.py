"""Backends: one constraint primitive each (``tt``, ``xla``, ``jax``), quirks documented in each."""

from __future__ import annotations

from typing import Any

from ..mesh import MeshSpec, as_mesh_spec
from .base import Backend, BackendError, Program

BACKENDS = ("xla", "jax", "tt")


def backend_class(name: str) -> type[Backend]:
    """The backend class for a name (imports only that backend's module)."""
    if name == "xla":
        from .xla import XlaBackend

        return XlaBackend
    if name == "jax":
        from .jax import JaxBackend

        return JaxBackend
    if name == "tt":
        from .tt import TTBackend

        return TTBackend
    raise BackendError(f"unknown backend {name!r}; choose one of {BACKENDS}")


def get_backend(backend: str | Backend, mesh: Any) -> Backend:
    """A backend instance for ``mesh``. ``mesh`` may be a native mesh of that backend (used as is)."""
    if isinstance(backend, Backend):
        if as_mesh_spec(mesh).shape != backend.mesh.shape:
            raise BackendError(f"backend {backend!r} is bound to mesh {backend.mesh.name}, not {as_mesh_spec(mesh).name}")
        return backend
    cls = backend_class(backend)  # an unknown name fails before the mesh is looked at
    spec = as_mesh_spec(mesh)
    native = None if isinstance(mesh, (MeshSpec, str, tuple)) else mesh
    return cls(spec, native)


__all__ = ["BACKENDS", "Backend", "BackendError", "Program", "backend_class", "get_backend"]
