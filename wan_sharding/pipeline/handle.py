"""What :func:`.shard.shard_pipeline` did to one pipeline, and how ``remove()`` undoes it.

:class:`PipelineHandle` holds one :class:`ShardedExpert` per expert (the original model, its
:class:`~wan_sharding.compose.DitHandle` and its stand-in) and restores every one of them: the same
objects back in the pipeline, on the device they came from.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from ..compose import DitHandle, OnResolved, Resolved
from .standin import ShardedTransformer

__all__ = ["PipelineHandle", "ShardedComponent", "ShardedExpert", "register_handle", "sharded_handle"]

# Pipelines that are currently sharded -> their handle. Weak both ways (the handle holds the
# pipeline), so a pipeline and handle that are both dropped are freed.
_SHARDED: "weakref.WeakKeyDictionary[Any, weakref.ref[PipelineHandle]]" = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class ShardedExpert:
    """One expert of a sharded pipeline: the original model, how it was sharded (its
    :class:`~wan_sharding.compose.DitHandle`; ``None`` for the second slot of a model that fills
    both), its stand-in, and the pipeline's config entry for it."""

    name: str
    dit: Any
    wrapper: ShardedTransformer | None
    sharding: DitHandle | None
    config_entry: Any

    @property
    def specs(self) -> Any:
        return self.sharding.specs if self.sharding is not None else None

    @property
    def patches(self) -> Any:
        """The PatchesHandle of its model rewrites, if any."""
        return self.sharding.patches if self.sharding is not None else None


@dataclass(eq=False)
class ShardedComponent:
    """A part of a sharded pipeline other than its experts (the text encoder, the VAE): the
    original model, its handle (``sharding``: a :class:`~wan_sharding.compose.ShardHandle`), its
    stand-in in the pipeline (``wrapper``) and the pipeline's config entry for it."""

    name: str
    model: Any
    wrapper: Any
    sharding: Any
    config_entry: Any

    def remove(self, pipe: Any) -> None:
        """Sharding undone, the stand-in released, the very same model back in the pipeline."""
        if self.sharding is not None:
            self.sharding.remove()
        if self.wrapper is not None:
            self.wrapper._release()
        if getattr(pipe, self.name, None) is not self.model:
            _restore_component(pipe, self.name, self.model, self.config_entry)

    def describe(self) -> dict[str, Any]:
        """The handle's summary (backend, mesh, how the parameters were split, ...) and the calls
        the pipeline made through the stand-in."""
        return {**(self.sharding.describe() if self.sharding is not None else {}),
                "calls": self.wrapper.calls if self.wrapper is not None else 0}


@dataclass(eq=False)
class PipelineHandle(OnResolved):
    """What :func:`shard_pipeline` did to one pipeline; ``remove()`` undoes it."""

    pipe: Any
    resolved: Resolved
    experts: list[ShardedExpert] = field(default_factory=list)
    pairs: Any = None  # CFG parallel: the pipeline's GuidancePairs (its encode_prompt wrapper), else None
    text_encoder: ShardedComponent | None = None  # shard_pipeline(..., text_encoder=True)
    vae: ShardedComponent | None = None  # shard_pipeline(..., vae=True)
    fused: list = field(default_factory=list)  # shard_pipeline(..., lora="fuse"): each expert's FusedLora
    removed: bool = False

    @property
    def components(self) -> list[str]:
        return [e.name for e in self.experts]

    def remove(self) -> None:
        """Put the original experts back in the pipeline (the same objects), after undoing each
        one's sharding (SP hooks, placement, patches: :meth:`DitHandle.remove`)."""
        if self.removed:
            return
        errors = []
        if self.vae is not None:  # sharded last: undone first
            try:
                self.vae.remove(self.pipe)
            except Exception as exc:
                errors.append(f"vae: {exc!r}")
        if self.text_encoder is not None:
            try:
                self.text_encoder.remove(self.pipe)
            except Exception as exc:
                errors.append(f"text_encoder: {exc!r}")
        for e in reversed(self.experts):
            try:
                if e.wrapper is not None and e.wrapper._model is not None:
                    from ..caching.model import release_model_cache

                    release_model_cache(e.dit)  # the cache stays enabled, without this backend's pieces
                if e.sharding is not None:
                    e.sharding.remove()
                if e.wrapper is not None:
                    e.wrapper._release()
                if getattr(self.pipe, e.name, None) is not e.dit:
                    _restore_component(self.pipe, e.name, e.dit, e.config_entry)
            except Exception as exc:  # keep restoring the others, then report
                errors.append(f"{e.name}: {exc!r}")
        for f in reversed(self.fused):  # the base weights back, bit for bit, once the experts are on the host
            f.remove()
        if self.pairs is not None:
            self.pairs.remove()
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
            "plan": None if self.plan is None else self.plan.name, "cfg": self.mesh.cfg,
            **({"cfg_steps": {"paired": self.pairs.paired, "single": self.pairs.single}} if self.pairs is not None else {}),
            **({"text_encoder": self.text_encoder.describe()} if self.text_encoder is not None else {}),
            **({"vae": self.vae.describe()} if self.vae is not None else {}),
            "experts": {
                e.name: {"params": e.specs.counts() if e.specs is not None else {},
                         "forwards": e.wrapper.calls if e.wrapper is not None else 0,
                         **({k: v for k, v in e.sharding.sp.describe().items() if k in ("sp_points", "last_tokens",
                                                                                      "last_padded_tokens")}
                            if e.sharding is not None and e.sharding.sp is not None else {})}
                for e in self.experts
            },
        }

    def placed_weight_bytes(self) -> dict[str, list[int]]:
        """Per expert, the bytes of its parameters each device holds, read from the backend's
        placed arrays (what is really on the devices, FSDP and TP splits included)."""
        out = {e.name: self.backend.placed_weight_bytes(e.dit, e.wrapper._placed) for e in self.experts
               if e.wrapper is not None and e.wrapper._model is not None}
        if self.text_encoder is not None and self.text_encoder.sharding is not None:
            out["text_encoder"] = self.backend.placed_weight_bytes(self.text_encoder.model, self.text_encoder.sharding.placed)
        return out


def _restore_component(pipe: Any, name: str, dit: Any, config_entry: Any) -> None:
    setattr(pipe, name, dit)  # the pipeline's own __setattr__ records the class in pipe.config again
    if config_entry is not None and pipe.config.get(name) != config_entry:
        pipe.register_to_config(**{name: config_entry})


def register_handle(pipe: Any, handle: PipelineHandle) -> None:
    """Record ``handle`` as the live one of ``pipe`` (what :func:`sharded_handle` answers)."""
    _SHARDED[pipe] = weakref.ref(handle)


def sharded_handle(pipe: Any) -> PipelineHandle | None:
    """The live handle of a sharded pipeline, or ``None``."""
    ref = _SHARDED.get(pipe)
    handle = ref() if ref is not None else None
    return handle if handle is not None and not handle.removed else None
