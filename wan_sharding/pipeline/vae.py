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

from ..specs import ShardingError
from .handle import ShardedComponent
from .standin import ComponentStandIn

__all__ = ["ShardedVae", "check_pipeline_vae", "shard_pipeline_vae"]


class ShardedVae(ComponentStandIn):
    """``pipe.vae`` while the VAE is sharded: its calls run on the mesh, its attributes are the VAE's."""

    def __init__(self, vae: torch.nn.Module, handle: Any):
        super().__init__(vae, "vae")
        self.__dict__.update(_handle=handle, calls={"decode": 0, "encode": 0})

    @property
    def vae(self) -> torch.nn.Module:
        return self.model

    @property
    def handle(self) -> Any:
        return self._handle

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> Any:
        self.calls["decode"] += 1
        return self._handle.decode(z.to(self.model.dtype), return_dict=return_dict)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        self.calls["encode"] += 1
        return self._handle.encode(x.to(self.model.dtype), return_dict=return_dict)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a sharded VAE runs decode() and encode(); call those")

    def extra_repr(self) -> str:
        if self._model is None:
            return "vae: removed"
        return f"{type(self._model).__name__} on {self._handle.mesh.name} ({self._handle.backend.name})"


def check_pipeline_vae(pipe: Any, resolved: Any) -> None:
    """The pipeline's VAE checked for ``vae=True`` before anything is changed."""
    from ..vae import check_vae

    if isinstance(getattr(pipe, "vae", None), ShardedVae):
        raise ShardingError("pipe.vae is already sharded (a ShardedVae); remove that handle first")
    if getattr(pipe, "vae", None) is None:
        raise ShardingError(f"{type(pipe).__name__} has no VAE to shard (pipe.vae is None); leave vae=False")
    check_vae(pipe.vae, resolved)


def shard_pipeline_vae(pipe: Any, resolved: Any, keep_host_weights: bool) -> Any:
    """Shard ``pipe.vae`` on the request's mesh and put a :class:`ShardedVae` in its place; returns
    what the pipeline handle needs to undo it."""
    from ..vae import shard_vae

    original, entry = pipe.vae, pipe.config.get("vae")
    part = ShardedComponent("vae", original, None, None, entry)
    # padding="none" refuses a frame the mesh does not divide, for the VAE as for the DiT; the DiT's
    # other modes (mask, slice) pad, which for the VAE is its mask
    padding = "none" if resolved.padding == "none" else "mask"
    part.sharding = shard_vae(original, padding=padding, resolved=resolved, keep_host_weights=keep_host_weights)
    part.wrapper = ShardedVae(original, part.sharding)
    pipe.vae = part.wrapper
    return part
