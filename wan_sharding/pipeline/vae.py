"""The pipeline's VAE on the mesh: :class:`ShardedVae` takes ``pipe.vae``'s place and sends the
pipeline's ``decode`` (after denoising) and ``encode`` (I2V's image condition) through
:func:`wan_sharding.vae.shard_vae`'s handle.

It exposes what the Wan pipelines read of their VAE (``config``, ``dtype``, ``device``, ``decode``,
``encode``); the real VAE is held but not registered as a submodule, so ``pipe.to(...)`` cannot
move the sharded weights. ``shard_pipeline(..., vae=True)`` installs it, the pipeline handle's
``remove()`` puts the very same VAE back.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hooks import RefusesCopy

__all__ = ["ShardedVae"]


class ShardedVae(RefusesCopy, torch.nn.Module):
    """``pipe.vae`` while the VAE is sharded: its calls run on the mesh, its attributes are the VAE's."""

    def __init__(self, vae: torch.nn.Module, handle: Any):
        super().__init__()
        object.__setattr__(self, "_vae", vae)  # not a submodule: pipe.to() must not move it
        object.__setattr__(self, "_handle", handle)
        self.calls = {"decode": 0, "encode": 0}

    @property
    def vae(self) -> torch.nn.Module:
        return self._vae

    @property
    def handle(self) -> Any:
        return self._handle

    @property
    def config(self) -> Any:
        return self._vae.config

    @property
    def dtype(self) -> torch.dtype:
        return self._vae.dtype

    @property
    def device(self) -> torch.device:
        """The host: the pipeline hands host tensors in and gets host tensors back."""
        return torch.device("cpu")

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> Any:
        self.calls["decode"] += 1
        return self._handle.decode(z.to(self._vae.dtype), return_dict=return_dict)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        self.calls["encode"] += 1
        return self._handle.encode(x.to(self._vae.dtype), return_dict=return_dict)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a sharded VAE runs decode() and encode(); call those")

    def extra_repr(self) -> str:
        return f"{type(self._vae).__name__} on {self._handle.mesh.name} ({self._handle.backend.name})"
