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


def get_backend(backend: str | Backend, mesh: Any, spec: MeshSpec | None = None) -> Backend:
    """A backend instance for ``mesh``. ``mesh`` may be a native mesh of that backend (used as is,
    e.g. over a subset of the devices). ``spec``: the roles to use instead of what ``mesh`` implies
    (a ``ShardingPlan``'s ``mesh()``); it must have ``mesh``'s shape and axis names."""
    given = as_mesh_spec(mesh)
    if spec is not None and (given.shape != spec.shape or
                             (not isinstance(mesh, (MeshSpec, str, tuple)) and given.axis_names != spec.axis_names)):
        raise BackendError(f"mesh {given.name} with axes {given.axis_names} is not the mesh {spec} of the plan")
    if isinstance(backend, Backend):
        if given.shape != backend.mesh.shape:
            raise BackendError(f"backend {backend!r} is bound to mesh {backend.mesh.name}, not {given.name}")
        return backend
    cls = backend_class(backend)  # an unknown name fails before the mesh is looked at
    native = None if isinstance(mesh, (MeshSpec, str, tuple)) else mesh
    return cls(spec if spec is not None else given, native)


__all__ = ["BACKENDS", "Backend", "BackendError", "Program", "backend_class", "get_backend"]
