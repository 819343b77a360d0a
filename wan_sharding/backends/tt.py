"""Tenstorrent's own torch stack: tt-xla's torch plugin (``pjrt-plugin-tt``, ``tt_torch``).

Weights are marked like stock torch-xla (``xs.mark_sharding`` on the TT device); activations go
through ``tt_torch.sharding.sharding_constraint_tensor``, which emits a ``tt.sharding_constraint``
custom call that tt-mlir turns into ``sdy.sharding_constraint``. The model is then compiled with
``torch.compile(dit, backend="tt")``.

That stack comes from Tenstorrent's package index with their torch-xla fork and cannot be installed
here; ``tests/test_tt_contract.py`` checks what this backend sends to it with a stand-in module.
"""

from __future__ import annotations

from typing import Any

import torch

from ..mesh import MeshSpec
from ..specs import Spec
from .base import BackendError
from .xla import XlaBackend


def _tt_sharding():
    try:
        from tt_torch import sharding
    except ImportError as e:
        raise BackendError(
            "the tt backend needs Tenstorrent's torch plugin (pjrt-plugin-tt, which provides tt_torch) and "
            "Tenstorrent's torch-xla build, from Tenstorrent's package index; without them use "
            "backend='xla' (CPU SPMD) or the tt-mlir compile-only path (wan-sharding compile)"
        ) from e
    return sharding


class TTBackend(XlaBackend):
    name = "tt"

    def __init__(self, mesh: MeshSpec, native_mesh: Any = None):
        self._sharding = _tt_sharding()  # fail before anything is touched
        super().__init__(mesh, native_mesh)

    def _make_mesh(self, mesh: MeshSpec) -> Any:
        import os

        import torch_xla.runtime as xr

        # tt-mlir consumes Shardy; the TT plugin converts the SHLO it gets when this is set.
        os.environ.setdefault("CONVERT_SHLO_TO_SHARDY", "1")
        xr.set_device_type("TT")
        return super()._make_mesh(mesh)

    def _device_count_hint(self) -> str:
        return "pick the mesh preset for the chips in this machine (1x4 QuietBox, 2x4 LoudBox, 8x4 Galaxy)"

    def constrain(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        # Returns a new value, so replicated-then-sharded stays two constraints in the graph.
        return self._sharding.sharding_constraint_tensor(tensor, self.native_mesh, spec)

    def run_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        compiled = torch.compile(dit, backend="tt")
        args, kwargs = self._to_device(args, kwargs)
        return compiled(*args, **kwargs, return_dict=False)[0]

    @staticmethod
    def cpu_env(num_devices: int) -> dict[str, str]:
        raise BackendError("the tt backend runs on Tenstorrent devices, not CPU virtual devices")
