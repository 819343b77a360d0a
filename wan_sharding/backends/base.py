"""The one small interface every backend implements: place weights, constrain an activation."""

from __future__ import annotations

import abc
from typing import Any, Mapping

import torch

from ..mesh import MeshSpec

Spec = tuple


class BackendError(RuntimeError):
    """A backend cannot be used here: its stack is missing or the device count is wrong."""


class Backend(abc.ABC):
    """A sharding backend bound to one mesh.

    ``mesh`` is the backend-neutral :class:`MeshSpec`; ``native_mesh`` the backend's own mesh
    object (``torch_xla`` ``Mesh`` or ``jax.sharding.Mesh``).
    """

    name: str = "?"

    def __init__(self, mesh: MeshSpec, native_mesh: Any = None):
        self.mesh = mesh
        self.native_mesh = native_mesh if native_mesh is not None else self._make_mesh(mesh)

    @abc.abstractmethod
    def _make_mesh(self, mesh: MeshSpec) -> Any:
        """Build the backend's mesh over the visible devices (error if the count differs)."""

    @abc.abstractmethod
    def place(self, dit: torch.nn.Module, specs: Mapping[torch.Tensor, Spec]) -> Any:
        """Put the weights on the mesh with their specs; returns whatever ``run`` needs."""

    @abc.abstractmethod
    def constrain(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        """A sharding constraint on an activation inside the traced forward; returns the tensor
        to use downstream (a new value, so two constraints in a row stay two)."""

    def run(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run one forward of ``dit`` on the mesh and return the output on the host (CPU)."""
        raise BackendError(f"the {self.name} backend cannot execute here")

    def release(self, dit: torch.nn.Module) -> None:
        """Forget anything compiled or cached for ``dit`` (nothing by default)."""

    def check_device_count(self, available: int, what: str) -> None:
        if available != self.mesh.num_devices:
            raise BackendError(
                f"mesh {self.mesh.name} needs {self.mesh.num_devices} devices but {what} sees {available}; "
                f"{self._device_count_hint()}"
            )

    def _device_count_hint(self) -> str:
        return "use a mesh that matches the device count (wan_sharding.mesh_for_device_count)"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mesh.name})"
