"""What :func:`.shard.shard_pipeline` did to one pipeline, and how ``remove()`` undoes it.

:class:`PipelineHandle` holds one :class:`ShardedExpert` per expert (the original model, its
specs, SP hooks, patches and stand-in, and the host weights it came with) and restores every one
of them: the same objects back in the pipeline, on the device they came from.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..activation import SPHandle
from ..backends import Backend
from ..mesh import MeshSpec
from ..specs import ShardSpecs
from .standin import ShardedTransformer

__all__ = ["PipelineHandle", "ShardedExpert", "register_handle", "sharded_handle"]

# Pipelines that are currently sharded -> their handle. Weak both ways (the handle holds the
# pipeline), so a pipeline and handle that are both dropped are freed.
_SHARDED: "weakref.WeakKeyDictionary[Any, weakref.ref[PipelineHandle]]" = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class ShardedExpert:
    """One expert of a sharded pipeline: the original model, what was done to it, its stand-in."""

    name: str
    dit: torch.nn.Module
    wrapper: ShardedTransformer
    specs: ShardSpecs
    sp: SPHandle | None
    original_device: torch.device
    config_entry: Any
    moved: bool = False
    host_tensors: list | None = None  # (module, "param"|"buffer", name, tensor) before placement
    patches: Any = None  # the PatchesHandle of its model rewrites (wan_sharding.patches), if any


@dataclass(eq=False)
class PipelineHandle:
    """What :func:`shard_pipeline` did to one pipeline; ``remove()`` undoes it."""

    pipe: Any
    backend: Backend
    padding: str
    experts: list[ShardedExpert] = field(default_factory=list)
    removed: bool = False
    plan: Any = None  # the ShardingPlan applied, if any

    @property
    def mesh(self) -> MeshSpec:
        return self.backend.mesh

    @property
    def components(self) -> list[str]:
        return [e.name for e in self.experts]

    def remove(self) -> None:
        """Put the original experts back in the pipeline (the same objects), remove their SP hooks
        and attention processors, and move them back to the device they were on."""
        if self.removed:
            return
        errors = []
        for e in reversed(self.experts):
            try:
                if e.wrapper is not None and e.wrapper._dit is not None:
                    from ..caching import release_model_cache

                    release_model_cache(e.dit)  # the cache stays enabled, without this backend's pieces
                if e.sp is not None:
                    e.sp.remove()
                if e.moved:
                    _return_to_host(e)
                self.backend.release(e.dit)  # jax: drop the compiled forward
                if e.patches is not None:  # after SP: a patch's processor is wrapped by SP's
                    e.patches.remove()
                if e.wrapper is not None:
                    e.wrapper._release()
                if getattr(self.pipe, e.name, None) is not e.dit:
                    _restore_component(self.pipe, e.name, e.dit, e.config_entry)
            except Exception as exc:  # keep restoring the others, then report
                errors.append(f"{e.name}: {exc!r}")
        _SHARDED.pop(self.pipe, None)
        self.removed = True
        if errors:
            raise RuntimeError("restoring the pipeline failed for " + "; ".join(errors))

    def __enter__(self) -> "PipelineHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def describe(self) -> dict[str, Any]:
        """Summary: backend, mesh, padding, and per expert its parameter split and SP points."""
        return {
            "backend": self.backend.name, "mesh": self.mesh.name, "sp": self.mesh.sp, "tp": self.mesh.tp,
            "padding": self.padding, "pipeline": type(self.pipe).__name__,
            "plan": None if self.plan is None else self.plan.name,
            "experts": {
                e.name: {"params": e.specs.counts(), "forwards": e.wrapper.calls if e.wrapper is not None else 0,
                         **({k: v for k, v in e.sp.describe().items() if k in ("sp_points", "last_tokens",
                                                                              "last_padded_tokens")}
                            if e.sp is not None else {})}
                for e in self.experts
            },
        }


    def placed_weight_bytes(self) -> dict[str, list[int]]:
        """Per expert, the bytes of its parameters each device holds, read from the backend's
        placed arrays (what is really on the devices, FSDP and TP splits included)."""
        return {e.name: self.backend.placed_weight_bytes(e.dit, e.wrapper._placed) for e in self.experts
                if e.wrapper is not None and e.wrapper._dit is not None}


def _restore_component(pipe: Any, name: str, dit: torch.nn.Module, config_entry: Any) -> None:
    setattr(pipe, name, dit)  # the pipeline's own __setattr__ records the class in pipe.config again
    if config_entry is not None and pipe.config.get(name) != config_entry:
        pipe.register_to_config(**{name: config_entry})


def _host_tensors(dit: torch.nn.Module) -> list:
    """Every parameter and buffer object of ``dit``, with where it sits."""
    out = []
    for module in dit.modules():
        out += [(module, "param", n, t) for n, t in module._parameters.items() if t is not None]
        out += [(module, "buffer", n, t) for n, t in module._buffers.items() if t is not None]
    return out


def _return_to_host(e: "ShardedExpert") -> None:
    """Back to the host: the original parameter and buffer objects when they were kept (exact, and
    no device-to-host copy), else a copy of the device weights via ``.to(original_device)``."""
    if e.host_tensors is None:
        e.dit.to(e.original_device)
        return
    for module, kind, name, tensor in e.host_tensors:
        if kind == "param":
            if module._parameters.get(name) is not tensor:
                module.register_parameter(name, tensor)
        elif module._buffers.get(name) is not tensor:
            module.register_buffer(name, tensor, persistent=name not in module._non_persistent_buffers_set)
    if any(t.device != e.original_device for *_, t in e.host_tensors):  # moved in place (same objects)
        e.dit.to(e.original_device)


def _model_device(dit: torch.nn.Module) -> torch.device:
    for p in dit.parameters():
        return p.device
    return torch.device("cpu")


def register_handle(pipe: Any, handle: PipelineHandle) -> None:
    """Record ``handle`` as the live one of ``pipe`` (what :func:`sharded_handle` answers)."""
    _SHARDED[pipe] = weakref.ref(handle)


def sharded_handle(pipe: Any) -> PipelineHandle | None:
    """The live handle of a sharded pipeline, or ``None``."""
    ref = _SHARDED.get(pipe)
    handle = ref() if ref is not None else None
    return handle if handle is not None and not handle.removed else None
