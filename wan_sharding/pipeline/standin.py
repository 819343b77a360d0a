"""The stand-in a sharded pipeline holds in place of each expert.

:class:`ShardedTransformer` exposes what the Wan pipelines' denoising loop reads (``config``,
``dtype``, ``device``, ``cache_context``, the cache API, ``forward``) and runs the forward of the
real model on the mesh through the backend, with inputs and outputs on the host. The real model is
a plain attribute, not a submodule, so ``pipe.device`` / ``pipe.to(...)`` never reach the sharded
weights.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ModelMixin

from ..dit.activation import SPHandle
from ..backends import Backend
from ..mesh import MeshSpec
from ..patches.prompt_kv import prompt_inputs
from ..specs import ShardingError
from .guidance import GuidancePairs
from .lora import LoraStandIn

# Why a step cache and CFG parallel do not go together (one line, with the fix).
CFG_CACHE_REFUSAL = (
    "a step cache cannot run with CFG parallel: diffusers' caches decide to skip or compute per branch (the "
    "pipeline's cond and uncond cache contexts, each from its own residuals), and one program for both branches "
    "makes one decision for both, so the cached steps would differ from the unsharded pipeline's; use --cfg 1 "
    "(a plan without cfg_axes) with a cache, or no cache with CFG parallel")

__all__ = ["ComponentStandIn", "ShardedTransformer"]


class ComponentStandIn(torch.nn.Module):
    """What a sharded pipeline holds in place of one of its models (an expert, the text encoder, the
    VAE): the real model is a plain attribute, not a submodule, so module traversal (``pipe.device``,
    ``pipe.to``, ``.modules()``) never reaches the sharded weights; it shows the attributes the Wan
    pipelines read of every component (``config``, ``dtype``, the host as its ``device``: inputs
    and outputs stay on the host); copying or pickling it is refused (a copy would share the
    original's device weights and hooks); the pipeline handle's ``remove()`` releases it."""

    def __init__(self, model: torch.nn.Module, component: str):
        super().__init__()
        self.__dict__.update(_model=model, component=component)

    @property
    def model(self) -> torch.nn.Module:
        """The real (sharded) model."""
        if self._model is None:
            raise ShardingError(f"this sharded {self.component} was removed by handle.remove(); use "
                                f"pipe.{self.component}, which is the original model again")
        return self._model

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Where the pipeline should keep inputs and outputs: the host."""
        return torch.device("cpu")

    def _release(self) -> None:
        self.__dict__["_model"] = None

    def __deepcopy__(self, memo: dict) -> Any:
        raise ShardingError(
            f"a pipeline sharded with shard_pipeline cannot be copied or pickled (its {self.component} runs the "
            "original's weights on the mesh); call handle.remove() first, copy, then shard_pipeline each copy"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__deepcopy__({})


class ShardedTransformer(LoraStandIn, ComponentStandIn, ModelMixin):
    """Stands in for one expert of a sharded pipeline; ``forward`` runs the real model on the mesh.

    Inputs are host tensors (as the pipeline makes them); the output comes back to the host, as a
    tuple with ``return_dict=False`` (what the Wan pipelines ask for) or a
    ``Transformer2DModelOutput``. A diffusers ``ModelMixin`` with diffusers' LoRA methods
    (:class:`~.lora.LoraStandIn`), so the pipeline's ``set_adapters`` / ``load_lora_weights`` /
    ``disable_lora`` reach the sharded expert; every other attribute is the stand-in's own.
    """

    def __init__(self, dit: torch.nn.Module, backend: Backend, placed: Any, name: str, padding: str,
                 sp: SPHandle | None = None, pairs: GuidancePairs | None = None,
                 sharding: Any = None):
        super().__init__(dit, name)
        # ``pairs``: on a cfg mesh, what runs a step's cond and uncond calls as one forward (shared by
        # the pipeline's experts); ``sharding``: the expert's DitHandle (LoRA weights placed again).
        self.__dict__.update(_backend=backend, _placed=placed, padding=padding, calls=0, _sp=sp, _pairs=pairs,
                             _sharding=sharding)

    # --- what the Wan pipelines read ------------------------------------------------------
    @property
    def dit(self) -> torch.nn.Module:
        """The real (sharded) ``WanTransformer3DModel``."""
        return self.model

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def mesh(self) -> MeshSpec:
        return self._backend.mesh

    # --- diffusers' cache API (CacheMixin), on the real model --------------------------------
    def cache_context(self, name: str, **kwargs: Any):
        """The real model's ``cache_context`` (diffusers' cache hooks live on it)."""
        if self.dit.is_cache_enabled:
            self._adopt_cache()  # before the context is set: adopting re-creates the hooks
        return self.dit.cache_context(name, **kwargs)

    @property
    def is_cache_enabled(self) -> bool:
        return self.dit.is_cache_enabled

    @property
    def _cache_config(self) -> Any:
        """The enabled cache's config (diffusers' ``CacheMixin`` attribute), or ``None``."""
        return self.dit._cache_config

    def enable_cache(self, config: Any) -> None:
        """diffusers' ``enable_cache`` on the real model, so that its decisions run on the host at
        every forward on this backend too (``wan_sharding.caching``). Raises what diffusers raises
        (a cache already enabled, an unsupported config), ``ValueError`` for a config that hooks
        no module of a Wan DiT, and ``ShardingError`` for a cache this backend cannot run."""
        from ..caching import enable_model_cache
        from ..caching.probes import zero_padding_rows

        refusal = CFG_CACHE_REFUSAL if self.mesh.cfg_axis is not None else self._backend.cache_refusal(config)
        if refusal is not None:
            raise ShardingError(refusal)
        sp = self.__dict__.get("_sp")
        enable_model_cache(self.dit, config, runner=self._backend.cache_unit_runner(self.dit, self._placed),
                           post=zero_padding_rows(sp.state) if sp is not None else None,
                           programs=self._backend.cache_programs)

    def disable_cache(self) -> None:
        """diffusers' ``disable_cache`` on the real model."""
        from ..caching import disable_model_cache

        disable_model_cache(self.dit)

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        self.dit._reset_stateful_cache(recurse=recurse)

    @property
    def cache_stats(self) -> Any:
        """The enabled cache's :class:`~wan_sharding.caching.CacheStats` (calls, computed, skipped), or ``None``."""
        from ..caching import model_cache_stats

        return model_cache_stats(self.dit)

    @torch.no_grad()  # inference only: with grad on, the tt backend's torch.compile would trace a backward too
    def forward(self, *args: Any, return_dict: bool = True, **kwargs: Any):
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if "attention_kwargs" in kwargs and self._backend.traces_whole_forward:
            raise ShardingError(
                f"attention_kwargs (a LoRA scale) cannot be passed into the {self._backend.name} backend's compiled "
                "forward; set the adapters' weights with pipe.set_adapters(names, weights) instead (they reach it)"
            )
        pairs = self._pairs
        if pairs is not None and not args:  # CFG parallel: the step's cond and uncond calls as one forward
            out = pairs.run(kwargs, self._forward)
        else:
            out = self._forward(kwargs, args)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)

    def _forward(self, kwargs: dict, args: tuple = ()) -> torch.Tensor:
        """One forward of the real model on the mesh, inputs and output on the host."""
        dit = self.dit
        # the prompt_kv patch: the prompt's K / V from its cache (or its prompt program), on the devices
        args, kwargs = prompt_inputs(dit, self._backend, self._placed, args, kwargs)
        if dit.is_cache_enabled:
            self._adopt_cache()
            out = self._backend.to_host(self._backend.run_cached_device(dit, self._placed, *args, **kwargs))
        else:
            out = self._backend.run(dit, self._placed, *args, **kwargs)
        self.__dict__["calls"] += 1
        return out

    def _adopt_cache(self) -> None:
        """A cache enabled on the real model directly (or before sharding) gets this backend's probe,
        so it acts at every forward instead of only while a forward is traced."""
        from ..caching.model import model_cache_probe

        probe = model_cache_probe(self.dit)
        # A backend that traces whole forwards needs the compiled pieces (cache_unit_runner) or
        # programs; one with cache programs needs a probe installed for them (its programs, if any).
        if probe is None or (self._backend.traces_whole_forward and not (probe.units or probe.programs)) \
                or (self._backend.cache_programs and not probe.as_programs):
            config = self.dit._cache_config
            if probe is not None:
                probe.remove(keep_cache=False)
            else:
                self.dit.disable_cache()
            self.enable_cache(config)

    def _release(self) -> None:
        super()._release()
        self.__dict__.update(_placed=None, _sp=None, _pairs=None, _sharding=None)

    def extra_repr(self) -> str:
        inner = type(self._model).__name__ if self._model is not None else "removed"
        return f"{self.component}: {inner} on {self._backend.name} {self._backend.mesh.name}, padding={self.padding}"
