"""diffusers' LoRA API on a sharded expert: what a pipeline's ``load_lora_weights``,
``set_adapters``, ``disable_lora`` / ``enable_lora`` and ``delete_adapters`` call on its
transformer, run on the real model, then only the LoRA weights put on the mesh again.

The Wan pipelines' LoRA methods (``WanLoraLoaderMixin``, ``LoraBaseMixin``) act on each component
they find that is a diffusers ``ModelMixin`` (``set_adapters``, ``disable_lora``, ...) or that has
``load_lora_adapter``; the stand-in is a ``ModelMixin`` with those methods, so the pipeline's own
calls reach the sharded experts. A new scale or set of active adapters needs no placement at all
(the next forward reads them: ``wan_sharding.lora_layers``); loading, hotswapping or deleting an
adapter places the LoRA weights again, never the base weights.
"""

from __future__ import annotations

from typing import Any

import torch

from ..lora.files import check_adapter_state
from ..lora_layers import LoraError, check_layers, lora_parameters
from ..dit.specs import shard_dit_specs
from ..specs import LoraShardingError, ShardingError


class LoraStandIn:
    """The LoRA part of :class:`~wan_sharding.pipeline.standin.ShardedTransformer` (a mixin: it
    reads ``dit``, ``_backend``, ``_placed`` and ``_sharding``, the expert's ``DitHandle``)."""

    dit: torch.nn.Module
    _backend: Any
    _placed: Any
    _sharding: Any

    # --- what the pipeline reads -----------------------------------------------------------------
    @property
    def peft_config(self) -> dict:
        """The real model's PEFT configs by adapter name (``get_list_adapters`` reads it)."""
        return getattr(self.dit, "peft_config", {})

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return bool(getattr(self.dit, "_hf_peft_config_loaded", False))

    def active_adapters(self) -> list[str]:
        return self.dit.active_adapters() if self.peft_config else []

    # --- switching: nothing placed ----------------------------------------------------------------
    def set_adapters(self, adapter_names: Any, weights: Any = None) -> None:
        """diffusers' ``set_adapters`` on the real model: the next forward adds those adapters with
        those weights (a new weight reuses the compiled forward where the backend takes scales as
        inputs, ``jax``)."""
        self.dit.set_adapters(adapter_names, weights)

    def disable_lora(self) -> None:
        self.dit.disable_lora()

    def enable_lora(self) -> None:
        self.dit.enable_lora()

    # --- loading and deleting: the LoRA weights placed again --------------------------------------
    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict: Any, prefix: str = "transformer",
                          hotswap: bool = False, **kwargs: Any) -> None:
        """diffusers' ``load_lora_adapter`` on the real model, checked first (module, shapes, a
        hotswap's rank and targets: :class:`LoraError`, nothing changed), then the LoRA weights
        placed on the mesh; the base weights stay where they are."""
        state = pretrained_model_name_or_path_or_dict
        if not isinstance(state, dict):
            raise LoraError("a sharded expert loads adapters through the pipeline (pipe.load_lora_weights(path, ...)), "
                            f"which reads the file first; got {type(state).__name__}")
        name = kwargs.get("adapter_name")
        check_adapter_state(self.dit, state, prefix=prefix, hotswap_of=name if hotswap else None)
        self._lora_to_host()
        self.dit.load_lora_adapter(state, prefix=prefix, hotswap=hotswap, **kwargs)
        try:
            self._place_lora()
        except LoraError:
            if not hotswap and name is not None and name in self.peft_config:
                self.dit.delete_adapters([name])  # leave the model as it was
            raise

    def delete_adapters(self, adapter_names: Any) -> None:
        self._lora_to_host()
        self.dit.delete_adapters(adapter_names)
        self._place_lora()

    def unload_lora(self) -> None:
        raise ShardingError("unloading every LoRA layer of a sharded expert would rename its base weights on the mesh; "
                            "delete_adapters (or disable_lora) keeps them, or call handle.remove() first")

    def fuse_lora(self, *args: Any, **kwargs: Any) -> None:
        raise ShardingError("fusing adapters into a sharded expert's base weights would place them again; fuse before "
                            "sharding (shard_pipeline(..., lora='fuse')), or keep the adapters unfused")

    unfuse_lora = fuse_lora

    def _lora_to_host(self) -> None:
        """Before PEFT writes LoRA weights (a hotswap copies into them in place): the host copies
        the handle keeps in the model again, so the writes are host copies and the device copies
        are placed afresh after, instead of a device graph per weight written and read back."""
        handle = self._sharding
        if handle.host_tensors is None:
            return
        owners = {id(self.dit.get_submodule(n.rpartition(".")[0])) for n in lora_parameters(self.dit)}
        for module, kind, name, tensor in handle.host_tensors:
            if kind == "param" and id(module) in owners and module._parameters.get(name) is not tensor:
                module.register_parameter(name, tensor)

    def _place_lora(self) -> None:
        """Every LoRA parameter of the real model placed with its spec (base weights untouched);
        where the handle puts host weights back on ``remove()``, it then puts these adapters' host
        values back (a hotswap on the devices wrote only the device copy)."""
        dit, handle = self.dit, self._sharding
        try:
            check_layers(dit)
            specs = shard_dit_specs(dit, handle.resolved.mesh_or_plan).by_name()
        except LoraError as e:
            raise LoraShardingError(str(e)) from None
        lora = lora_parameters(dit)
        host = {n: torch.nn.Parameter(p.detach().to("cpu"), requires_grad=p.requires_grad) for n, p in lora.items()}
        self._backend.place_lora(dit, self._placed, {n: specs[n] for n in lora})
        if handle.host_tensors is not None:
            owners = {id(dit.get_submodule(n.rpartition(".")[0])) for n in lora}
            kept = [e for e in handle.host_tensors if not (e[1] == "param" and id(e[0]) in owners)]
            # deleted adapters' layers: their entries go too (their modules are gone from the model)
            alive = {id(m) for m in dit.modules()}
            handle.host_tensors[:] = [e for e in kept if id(e[0]) in alive] + [
                (dit.get_submodule(n.rpartition(".")[0]), "param", n.rpartition(".")[2], t) for n, t in host.items()]
