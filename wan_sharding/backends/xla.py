"""Stock torch-xla SPMD: ``xs.mark_sharding`` on weights, a custom-sharding node on activations.

Runs on CPU virtual devices with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=<n>`` set before torch_xla
starts; ``enable_spmd()`` must run before the first XLA op.
"""

from __future__ import annotations

import ast
import os
from typing import Any, Mapping

import numpy as np
import torch

from ..lora_layers import live_scales, scales_as
from ..mesh import MeshSpec
from ..specs import Spec
from .base import (Backend, BackendError, compiled_cache_program, input_signature, move_module, slice_bytes,
                   with_xla_flags)


def enable_spmd() -> None:
    """Turn on torch-xla SPMD (idempotent). Call before any tensor is put on the XLA device."""
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()


# The torch-xla meshes the dynamo-traced constraint op applies on, by a name the op carries.
_MESHES: dict[str, Any] = {}


def _register_constraint_op() -> None:
    """``wan_sharding::xla_sharding_constraint``: :meth:`XlaBackend.constrain` as one op dynamo
    traces (torch-xla's own custom-sharding call returns an ``XLAShardedTensor`` wrapper, which
    dynamo cannot trace). The graph torch-xla's dynamo bridge builds from it runs the op's body on
    lazy tensors, which puts the same custom-sharding node in the HLO as the lazy path does."""
    if hasattr(torch.ops.wan_sharding, "xla_sharding_constraint"):
        return

    @torch.library.custom_op("wan_sharding::xla_sharding_constraint", mutates_args=(), device_types=("xla",))
    def xla_sharding_constraint(tensor: torch.Tensor, mesh: str, spec: str) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs

        out = tensor.clone()
        xs.annotate_custom_sharding(out, _MESHES[mesh], ast.literal_eval(spec))
        return out

    @xla_sharding_constraint.register_fake
    def _(tensor: torch.Tensor, mesh: str, spec: str) -> torch.Tensor:
        return tensor.clone()


class XlaBackend(Backend):
    name = "xla"
    uses_torch_xla = True
    cache_programs = True

    def _make_mesh(self, mesh: MeshSpec) -> Any:
        try:
            import torch_xla.distributed.spmd as xs
            import torch_xla.runtime as xr
        except ImportError as e:  # pragma: no cover - torch-xla is a hard dependency
            raise BackendError(f"torch-xla is not importable ({e}); install wan_sharding's pinned stack") from e
        enable_spmd()
        self.check_device_count(xr.global_runtime_device_count(), "torch-xla")
        return xs.Mesh(np.arange(mesh.num_devices), mesh.shape, mesh.axis_names)

    def _mesh_for_dynamo(self) -> None:
        """Name the backend's mesh for the constraint op dynamo traces (see
        :func:`_register_constraint_op`); on the host, before the first compile."""
        if getattr(self, "_mesh_name", None) is None:
            _register_constraint_op()
            self._mesh_name = f"mesh{len(_MESHES)}"
            _MESHES[self._mesh_name] = self.native_mesh

    def _device_count_hint(self) -> str:
        return (
            "on CPU set PJRT_DEVICE=CPU and CPU_NUM_DEVICES=<mesh devices> before importing torch_xla, "
            "or pick the mesh for this device count"
        )

    @property
    def device(self) -> torch.device:
        import torch_xla

        return torch_xla.device()

    def place(self, dit: torch.nn.Module, specs: Mapping[torch.Tensor, Spec]) -> Any:
        """Move the model to the XLA device (tied weights stay tied: :func:`~.base.move_module`) and
        mark every weight's sharding (replicated included)."""
        import torch_xla.distributed.spmd as xs

        # Look specs up by name, taken before the move: CPU -> XLA replaces the parameter objects.
        names = specs.by_name() if hasattr(specs, "by_name") else {n: specs[p] for n, p in dit.named_parameters()}
        move_module(dit, self.device)
        for name, param in dit.named_parameters():
            spec = names[name]
            xs.mark_sharding(param, self.native_mesh, spec)
        return None

    def place_lora(self, dit: torch.nn.Module, placed: Any, specs: Mapping[str, Spec]) -> None:
        """Put ``dit``'s LoRA parameters (``specs``: their name -> spec) on the mesh again, each
        from a host copy (a hotswap or a new adapter may have left it on the host, or written it in
        place); the base weights stay as they are."""
        self._put_lora(dit, specs)
        self.__dict__.get("_cache_programs", {}).pop(id(dit), None)  # dynamo's guards hold the old parameters

    def _put_lora(self, dit: torch.nn.Module, specs: Mapping[str, Spec],
                  keep: Mapping[str, torch.nn.Parameter] | None = None) -> dict[str, torch.nn.Parameter]:
        """Each LoRA parameter of ``specs`` (name -> spec) copied to the host and back onto the mesh,
        marked with its spec; the parameters now in ``dit``, by name. One in ``keep`` of the same
        shape and dtype gets the new values in that very object (``.data``), any other a new
        ``Parameter``."""
        import torch_xla
        import torch_xla.distributed.spmd as xs

        torch_xla.sync()  # a hotswap's in-place copies on the devices run as one graph, not one per weight read
        now = {}
        for name, spec in specs.items():
            owner, _, attr = name.rpartition(".")
            module = dit.get_submodule(owner)
            current = module._parameters[attr]
            value = current.detach().to("cpu").to(self.device)
            param = (keep or {}).get(name)
            if param is not None and param.shape == value.shape and param.dtype == value.dtype:
                xs.mark_sharding(value, self.native_mesh, spec)
                param.data = value  # the same object, new values, split as marked
            else:
                param = torch.nn.Parameter(value, requires_grad=current.requires_grad)
                xs.mark_sharding(param, self.native_mesh, spec)
            module._parameters[attr] = now[name] = param
        return now

    def constrain(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs

        # A custom "Sharding" node (not an in-place annotation of the producer), so a replicated
        # constraint followed by a sharded one stays two separate constraints in the HLO.
        spec = self.activation_spec(tensor, spec)
        if torch.compiler.is_compiling():  # a program compiled through dynamo (cached_programs)
            if getattr(self, "_mesh_name", None) is None:
                raise BackendError("the xla backend's SP hooks ran under a torch.compile it did not start; "
                                   "run the model through backend.run / shard_pipeline (its lazy path)")
            return torch.ops.wan_sharding.xla_sharding_constraint(tensor, self._mesh_name, repr(tuple(spec)))
        return xs.annotate_custom_sharding(tensor, self.native_mesh, spec).global_tensor

    def sdpa_composite(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None, scale: float, is_causal: bool) -> torch.Tensor:
        """A ``stablehlo.composite`` around the plain math, as Tenstorrent's torch plugin marks it.

        Its body must not use a value defined outside it: trace with every scalar inlined as a
        constant (``torch_xla._XLAC._set_xla_all_numbers_special_scalars(True)``, what torch-xla's
        own StableHLO exporter does), or the scale becomes an extra operand.
        """
        from torch_xla.experimental.mark_pattern_utils import StableHLOCompositeBuilder

        from ..fused_sdpa import SDPA_COMPOSITE, sdpa_math

        builder = StableHLOCompositeBuilder(name=SDPA_COMPOSITE, attr={"is_causal": is_causal, "scale": scale})
        marked = builder.mark_inputs(query, key, value, *(() if attn_mask is None else (attn_mask,)))
        q, k, v, *mask = marked
        return builder.mark_outputs(sdpa_math(q, k, v, mask[0] if mask else None, scale, is_causal))

    def _to_device(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dev = self.device
        move = lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x  # noqa: E731
        args, kwargs = tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
        if self.mesh.cfg_axis is not None:  # a batch of (cond, uncond) halves: one half per group
            import torch_xla.distributed.spmd as xs

            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor) and t.ndim and self.mesh.batch_spec(t.shape)[0] is not None:
                    xs.mark_sharding(t, self.native_mesh, self.mesh.batch_spec(t.shape))
        return args, kwargs

    def run_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One forward traced lazily; torch-xla compiles (or reuses, by graph hash) when the output
        is materialised."""
        args, kwargs = self._to_device(args, kwargs)
        with scales_as(dit, self.device_scales(dit)):
            return dit(*args, **kwargs, return_dict=False)[0]

    def device_scales(self, dit: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The LoRA adapters' live scales as device scalars: data of the traced graph, so a new
        scale finds the same graph again (as Python numbers, 0 and 1 would be constants baked into
        the graph, torch-xla's special scalars)."""
        scales = live_scales(dit)
        if not scales:
            return {}
        values = torch.tensor(list(scales.values()), dtype=torch.float32).to(self.device)
        return dict(zip(scales, values.unbind()))

    def run_function(self, dit: torch.nn.Module, placed: Any, fn: Any, *args: Any) -> Any:
        """``fn(dit, *args)`` traced lazily on the device and materialised at once
        (``torch_xla.sync()``): one graph, compiled once and found again by graph hash; its outputs
        are then device data, so a later forward reads them instead of recomputing them."""
        import torch_xla

        args, _ = self._to_device(args, {})
        out = fn(dit, *args)
        torch_xla.sync()
        return out

    def run_step(self, model: torch.nn.Module, placed: Any, fn: Any, *args: Any) -> Any:
        """A VAE step: :meth:`step_program` traced and materialised at once (``torch_xla.sync()``),
        one graph per step structure, found again by graph hash."""
        import torch_xla

        out = self.step_program(model, fn)(*args)
        torch_xla.sync()
        return out

    def step_program(self, model: torch.nn.Module, fn: Any) -> Any:
        """The program :meth:`run_step` runs for the step ``fn``: ``fn(model, *args)`` traced lazily
        on the device (host inputs moved there first), its outputs lazy: ``run_step``
        materialises them, the compile frontend (``compile --component vae --frontend torch-xla``)
        exports their graph, so the compile bill is of this very trace. (The ``tt`` backend runs a
        step through ``torch.compile`` instead: its own ``run_step``.)"""

        def program(*args: Any) -> Any:
            args, _ = self._to_device(args, {})
            return fn(model, *args)

        return program

    def run_cached_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One forward with the cache hooks live. A block cache (FirstBlockCache, MagCache) or a
        per-module one (TaylorSeer, PAB) runs as its few programs (:meth:`cached_programs`); any
        other cache runs lazily like any forward, its decisions cutting the lazy graph."""
        from ..caching.model import model_cache_probe

        probe = model_cache_probe(dit)
        if probe is None or probe.programs is None:
            return self.run_device(dit, placed, *args, **kwargs)
        args, kwargs = self._to_device(args, kwargs)
        return probe.programs.forward(self.cached_programs(dit, placed, probe.programs, args, kwargs), probe.stats)

    def cached_programs(self, dit: torch.nn.Module, placed: Any, programs: Any, args: tuple, kwargs: dict) -> Any:
        """How a cache's ``programs`` run here: each through ``torch.compile(backend="openxla")``
        (torch-xla's dynamo bridge), made once per model, program and signature of its inputs and
        kept on the backend until ``release``. Dynamo traces the program once; every later call
        runs the compiled XLA graph on the device values given, with no Python tracing of the
        model (the lazy path traces the whole model's Python at every call, which here costs about
        as much as running the blocks; see docs/caching.md).

        The per-module caches' programs (:class:`~wan_sharding.caching.module_programs.ModulePrograms`)
        run lazily instead: each traced at every call and cut off with ``torch_xla.sync()``, one
        graph found again by hash. Through the dynamo bridge, PAB's ``attn1:compute attn2:reuse``
        program gave a wrong result when replayed (max-abs 1.2e-2 against unsharded; its traced
        first call was right); the cause is not found, so no per-module cache's program is replayed here."""
        from ..caching.module_programs import ModulePrograms

        if isinstance(programs, ModulePrograms) or any(isinstance(v, dict) for v in kwargs.values()):
            # and a prompt_kv state among the inputs: replayed through the dynamo bridge, a block
            # cache's program read the K / V (and weights) it was traced with instead of the ones
            # given (FirstBlockCache's head for the second prompt: max-abs 6e-3); lazily it is exact
            return self._lazy_programs(dit, programs, args, kwargs)
        kept = self.__dict__.setdefault("_cache_programs", {})
        entry = kept.get(id(dit))
        if entry is None or entry[0] is not dit or entry[1] is not programs:
            # A cache enabled again has new programs over new hooks: dynamo would trace each one
            # again (its guards hold the hooks), so the last cache's compiled programs are dropped
            entry = kept[id(dit)] = (dit, programs, {})
        signature = (input_signature(args), input_signature(kwargs))
        self._mesh_for_dynamo()
        self._replicate_inputs(args, kwargs)

        def run(name: str, extra: dict) -> dict:
            key = (programs.key, name, signature, input_signature(extra))
            compiled = entry[2].get(key)
            if compiled is None:
                compiled = entry[2][key] = compiled_cache_program(programs, name, dit, "openxla")
            return compiled(args, kwargs, extra)

        return run

    @staticmethod
    def _lazy_programs(dit: torch.nn.Module, programs: Any, args: tuple, kwargs: dict) -> Any:
        """Each program traced lazily at every call and ended with ``torch_xla.sync()``: one graph,
        compiled once and found again by graph hash; what it hands on is materialised."""
        import torch_xla

        def run(name: str, extra: dict) -> dict:
            out = programs.body(name, lambda: dit(*args, **kwargs, return_dict=False)[0], extra)
            torch_xla.sync()
            return out

        return run

    def _replicate_inputs(self, args: tuple, kwargs: dict) -> None:
        """Mark the forward's inputs replicated where they carry no sharding yet. torch-xla's
        dynamo bridge compares its inputs' shardings with those it traced with and traces the
        program again when they differ; a fresh input (the scheduler's latents) has none, while
        the same tensor after a compiled call reads replicated, so unmarked inputs made every
        call a new trace (measured: MagCache's ``full`` program, ~100-220 ms of host time per
        call instead of a few ms)."""
        import torch_xla
        import torch_xla.distributed.spmd as xs

        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        for t, spec in zip(tensors, torch_xla._XLAC._get_xla_sharding_specs(tensors)):
            if not spec:
                xs.mark_sharding(t, self.native_mesh, self.mesh.batch_spec(t.shape))

    def release(self, dit: torch.nn.Module) -> None:
        """Forget ``dit``'s compiled cache programs (their graphs hold its device weights)."""
        entry = self.__dict__.get("_cache_programs", {}).get(id(dit))
        if entry is not None and entry[0] is dit:
            del self._cache_programs[id(dit)]

    def step_quirks(self) -> Any:
        from .frontend_quirks import clamped_negative_slices

        return clamped_negative_slices()

    def frontend_hooks(self, model: torch.nn.Module) -> list[Any]:
        from .frontend_quirks import lowered_upsample

        return lowered_upsample(model)

    def upload(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        """Split on upload: the host tensor handed to the device and marked before any program
        reads it, so torch-xla transfers each device only its piece (measured: an 8-device split
        moves the tensor's bytes once, where a replicated upload moves them 8 times)."""
        import torch_xla.distributed.spmd as xs

        out = tensor.to(self.device)
        xs.mark_sharding(out, self.native_mesh, spec)
        return out

    def to_host(self, out: Any) -> torch.Tensor:
        """A replicated (or not yet sharded) output through ``.cpu()``, which copies one device's
        copy. A split one shard by shard: ``.cpu()`` of it would run a program that replicates it
        on every device first (torch-xla's ``ReplicateShardedData``), so each device's piece is
        copied instead (``_get_local_shards``: no program when the tensor is device data) and
        the whole assembled on the host, one replica of each piece."""
        if out.device.type != "xla":  # already a host tensor
            return out.cpu()
        import torch_xla
        import torch_xla.core.xla_model as xm

        if torch_xla._XLAC._get_xla_sharding_type(out) is None:  # not computed yet: its sharding is the program's
            torch_xla._XLAC._xla_sync_multi([out], [], True, True)
        if torch_xla._XLAC._get_xla_sharding_type(out) in (None, 0):  # no sharding, or replicated
            return out.cpu()
        xm.wait_device_ops()  # the program that made it may still be running (torch-xla executes asynchronously)
        shards = torch_xla._XLAC._get_local_shards([out])[0]
        where = torch_xla._XLAC._get_local_shard_replica_and_indices([out])[0]
        host = torch.empty(out.shape, dtype=out.dtype)
        for (piece, _), (replica, index) in zip(shards, where):
            if replica == 0:  # a piece of an uneven split comes padded: cut to its slice
                index = tuple(index)
                host[index] = piece[tuple(slice(0, len(range(*i.indices(n)))) for i, n in zip(index, out.shape))]
        return host

    def placed_weight_bytes(self, dit: torch.nn.Module, placed: Any) -> list[int]:
        """Per device, from torch-xla's own record of which piece of each parameter that device
        holds (``_get_local_shard_replica_and_indices``, no data copied)."""
        import torch_xla

        params = list(dit.parameters())
        totals = [0] * self.mesh.num_devices
        for p, pieces in zip(params, torch_xla._XLAC._get_local_shard_replica_and_indices(params)):
            for device, (_, index) in enumerate(pieces):
                totals[device] += slice_bytes(tuple(p.shape), index, p.element_size())
        return totals

    @staticmethod
    def cpu_env(num_devices: int) -> dict[str, str]:
        """Environment for a process that runs torch-xla SPMD on ``num_devices`` CPU devices."""
        # JAX's device-count flag would confuse torch-xla's CPU client (CPU_NUM_DEVICES counts here)
        env = with_xla_flags(dict(os.environ))
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(num_devices))
        return env


cpu_env = XlaBackend.cpu_env  # the environment for a CPU worker of this backend
