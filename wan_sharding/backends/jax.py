"""JAX through torchax: the unmodified torch module runs as a JAX function.

Weights become arrays with a ``NamedSharding`` (real ones on CPU devices, or abstract
``jax.ShapeDtypeStruct`` for compile-only lowering); activations are constrained with
``jax.lax.with_sharding_constraint``. Executes on JAX CPU virtual devices when
``XLA_FLAGS=--xla_force_host_platform_device_count=<n>`` and ``JAX_PLATFORMS=cpu`` are set
before JAX starts. With the Tenstorrent plugin in compile-only mode the same lowering goes
through tt-mlir (``wan_sharding.compile``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import torch

from ..lora_layers import SCALES_KEY, live_scales, scales_as, split_scales
from ..mesh import MeshSpec
from ..specs import Spec
from .base import DEVICE_COUNT_FLAG, Backend, BackendError, Program, input_signature, slice_bytes, with_xla_flags
from .jax_plugins import keep_plugins_out_of_cpu_jax, start_cpu_jax
from .torchax_ops import install_lean_lowerings


class JaxBackend(Backend):
    name = "jax"
    traces_whole_forward = True  # one jax.jit per model: the SP hooks run while tracing
    cache_programs = True

    def __init__(self, mesh: MeshSpec, native_mesh: Any = None, devices: list | None = None):
        self._devices = devices
        super().__init__(mesh, native_mesh)
        self.compiles = 0  # traces of a whole forward (a retrace is a recompile)
        install_lean_lowerings()

    def _make_mesh(self, mesh: MeshSpec) -> Any:
        try:
            import jax
            from jax.sharding import Mesh
        except ImportError as e:  # pragma: no cover - jax is a hard dependency
            raise BackendError(f"jax is not importable ({e}); install wan_sharding's pinned stack") from e
        if self._devices is None:
            start_cpu_jax(mesh.num_devices)  # a script that did not set JAX up: CPU devices, no plugin
        keep_plugins_out_of_cpu_jax()
        try:
            devices = self._devices if self._devices is not None else jax.devices()
        except RuntimeError as e:  # a platform JAX_PLATFORMS names could not start
            raise BackendError(f"JAX could not start its devices ({str(e).splitlines()[0][:200]}); for CPU virtual "
                               "devices leave JAX_PLATFORMS unset or set it to cpu") from None
        if len(devices) < mesh.num_devices or (self._devices is None and len(devices) != mesh.num_devices):
            self.check_device_count(len(devices), f"JAX ({devices[0].platform})")
        grid = np.array(devices[: mesh.num_devices]).reshape(mesh.shape)
        return Mesh(grid, mesh.axis_names)

    def _device_count_hint(self) -> str:
        return (
            "JAX's devices are fixed once it has started: shard before the first JAX call (the package then "
            "sets up the CPU devices itself), or set JAX_PLATFORMS=cpu and "
            f"XLA_FLAGS={DEVICE_COUNT_FLAG}={self.mesh.num_devices} before importing jax; for tt-mlir "
            "compile-only, generate a descriptor with that many chips"
        )

    def sharding(self, spec: Spec) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.native_mesh, PartitionSpec(*spec))

    def state_specs(self, dit: torch.nn.Module, specs: Mapping[torch.Tensor, Spec]) -> dict[str, Spec]:
        """Specs for everything ``functional_call`` needs: parameters from ``specs``, buffers
        (the non-persistent rope tables too) replicated."""
        by_name = specs.by_name() if hasattr(specs, "by_name") else {n: specs[p] for n, p in dit.named_parameters()}
        out = dict(by_name)
        for name, buf in dit.named_buffers():
            out[name] = (None,) * buf.ndim
        return out

    def place(self, dit: torch.nn.Module, specs: Mapping[torch.Tensor, Spec]) -> dict[str, Any]:
        """Real weights as sharded JAX arrays (the torch module itself is left as it is); a model on
        the ``meta`` device gets :meth:`abstract_state` (shapes and shardings: compile-only)."""
        import jax
        import torchax

        tensors = dict(dit.named_parameters())
        tensors.update(dit.named_buffers())
        if any(t.is_meta for t in tensors.values()):
            return self.abstract_state(dit, specs)
        env = torchax.default_env()
        placed = {}
        for name, spec in self.state_specs(dit, specs).items():
            arr = env.t2j_copy(tensors[name].detach())
            placed[name] = jax.device_put(arr, self.sharding(spec))
        return placed

    def abstract_state(self, dit: torch.nn.Module, specs: Mapping[torch.Tensor, Spec],
                       dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Shape/dtype/sharding stand-ins for every weight: lowering needs no weights in memory."""
        import jax
        from torchax.ops import mappings

        tensors = dict(dit.named_parameters())
        tensors.update(dit.named_buffers())
        out = {}
        for name, spec in self.state_specs(dit, specs).items():
            t = tensors[name]
            dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            if dt == torch.float64:  # no f64 without jax_enable_x64 (and none on Tenstorrent chips)
                dt = torch.float32
            out[name] = jax.ShapeDtypeStruct(tuple(t.shape), mappings.t2j_dtype(dt), sharding=self.sharding(spec))
        return out

    def constrain(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        import jax
        from torchax.interop import jax_view, torch_view

        if not hasattr(tensor, "jax"):
            raise BackendError(
                "the jax backend constrains activations only inside a torchax trace; run the model "
                "through JaxBackend.run / jax_forward, not as a plain torch call"
            )
        return torch_view(jax.lax.with_sharding_constraint(jax_view(tensor), self.sharding(self.activation_spec(tensor, spec))))

    def jax_forward(self, dit: torch.nn.Module, fused_sdpa: Any = None):
        """``f(state, args, kwargs) -> output`` as a JAX-traceable function of JAX values.

        ``fused_sdpa``: a :class:`~wan_sharding.fused_sdpa.FusedSDPA` to trace under (bf16 attention
        becomes Tenstorrent's composite), or ``None`` for the model as it is.
        """
        import contextlib

        import torchax

        env = torchax.default_env()

        def forward(state: dict, args: tuple, kwargs: dict):
            self.compiles += 1  # runs only while jax traces
            state, scales = split_scales(state)  # LoRA scales: inputs, not constants (lora_layers)
            state, args, kwargs, scales = env.j2t_iso((state, args, kwargs, scales))
            with env, (fused_sdpa if fused_sdpa is not None else contextlib.nullcontext()), scales_as(dit, scales):
                out = torch.func.functional_call(dit, state, args, {**kwargs, "return_dict": False})[0]
            return env.t2j_iso(out)

        return forward

    def sdpa_composite(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None, scale: float, is_causal: bool) -> torch.Tensor:
        """``jax.lax.composite`` around the plain math (inside a torchax trace)."""
        import jax
        import jax.numpy as jnp
        from torchax.interop import jax_view, torch_view

        from ..fused_sdpa import SDPA_COMPOSITE

        def body(q, k, v, *mask, scale, is_causal):
            scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * jnp.asarray(scale, q.dtype)
            if mask:
                scores = scores + mask[0]
            if is_causal:
                lq, lk = scores.shape[-2:]
                keep = jnp.tril(jnp.ones((lq, lk), bool), lk - lq)
                scores = jnp.where(keep, scores, jnp.finfo(scores.dtype).min)
            probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
            return jnp.matmul(probs, v)

        operands = [jax_view(t) for t in (query, key, value)] + ([] if attn_mask is None else [jax_view(attn_mask)])
        out = jax.lax.composite(body, name=SDPA_COMPOSITE)(*operands, scale=float(scale), is_causal=bool(is_causal))
        return torch_view(out)

    def _jitted(self, dit: torch.nn.Module):
        """One ``jax.jit`` per model, so repeated calls with the same shapes reuse the executable
        (the SP hooks run only while tracing; their Python state is not needed afterwards)."""
        import jax

        cache = self.__dict__.setdefault("_jit_cache", {})
        if id(dit) not in cache:
            cache[id(dit)] = (dit, jax.jit(self.jax_forward(dit)))  # keep dit alive with its id
        return cache[id(dit)][1]

    def placed_weight_bytes(self, dit: torch.nn.Module, placed: dict[str, Any]) -> list[int]:
        """Per device, from each parameter array's sharding (concrete arrays, or the abstract
        ``ShapeDtypeStruct`` weights of compile-only): the piece that device holds."""
        return placed_bytes_per_device([placed[n] for n, _ in dit.named_parameters()], self.native_mesh)

    def run_function(self, dit: torch.nn.Module, placed: dict[str, Any], fn: Any, *args: Any) -> Any:
        """``fn(dit, *args)`` as one ``jax.jit`` over the placed weights (``dit`` reparametrised
        with them, as ``functional_call`` does) and the inputs, made once per model and ``fn``
        object; its outputs are JAX arrays on the devices, a forward's inputs as they are."""
        jargs, _ = self._device_inputs(args, {})
        return self.function_program(dit, fn)(placed, jargs)

    def function_program(self, dit: torch.nn.Module, fn: Any) -> Any:
        """The ``jax.jit`` that :meth:`run_function` runs for ``fn``: ``program(placed, tensors)``, made
        once per model and ``fn``. The compile frontends lower this very program (``.lower``)."""
        import jax
        import torchax
        from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses

        env = torchax.default_env()
        programs = self.__dict__.setdefault("_function_cache", {}).setdefault(id(dit), {})
        if fn not in programs:
            def program(state: dict, tensors: tuple) -> Any:
                state, tensors = env.j2t_iso((state, tensors))
                with env, _reparametrize_module(dit, state):
                    return env.t2j_iso(fn(dit, *tensors))

            programs[fn] = jax.jit(program)
        return programs[fn]

    def place_lora(self, dit: torch.nn.Module, placed: dict[str, Any], specs: Mapping[str, Spec]) -> None:
        """Put ``dit``'s LoRA parameters (``specs``: their name -> spec) on the mesh again, in
        ``placed`` itself, and drop the ones no longer in the model; the base weights stay as they
        are. Same names and shapes (a hotswap) reuse the compiled forward."""
        import jax
        import torchax

        from ..lora_layers import BASE, parameter_role

        env = torchax.default_env()
        params = dict(dit.named_parameters())
        for name in [n for n in placed if n not in params and parameter_role(n)[1] != BASE]:
            del placed[name]
        for name in [n for n in params if n not in placed and ".base_layer." in n]:  # a Linear PEFT wrapped just now
            placed[name] = placed.pop(name.replace(".base_layer.", "."))
        for name, spec in specs.items():
            placed[name] = jax.device_put(env.t2j_copy(params[name].detach()), self.sharding(spec))
        self.__dict__.get("_program_weights", {}).pop(id(dit), None)  # the cache programs' weight lists

    def release(self, dit: torch.nn.Module) -> None:
        self.__dict__.get("_jit_cache", {}).pop(id(dit), None)
        for cache in ("_program_cache", "_program_weights", "_live_programs", "_unit_cache",
                      "_function_cache", "_step_cache"):  # a cached forward's programs and pieces, run_function's programs
            self.__dict__.get(cache, {}).pop(id(dit), None)

    def _device_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        import jax
        import torchax

        env = torchax.default_env()
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, torch.Tensor))
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        # One device_put for all inputs: a call per array costs host time at every forward. Replicated,
        # except a batch of (cond, uncond) halves on a cfg mesh: one half per group.
        arrays = [env.t2j_copy(leaves[i]) for i in tensors]
        shardings = [self.sharding(self.mesh.batch_spec(a.shape)) for a in arrays] if self.mesh.cfg_axis else self.sharding(())
        placed = jax.device_put(arrays, shardings)
        for i, x in zip(tensors, placed):
            leaves[i] = x
        return jax.tree_util.tree_unflatten(tree, leaves)

    def compile(self, dit: torch.nn.Module, placed: dict[str, Any], *args: Any, **kwargs: Any) -> Program:
        """The compiled program for these inputs; its partitioned HLO is ``program.text``."""
        jargs, jkwargs = self._device_inputs(args, kwargs)
        state = with_scales(dit, placed)
        exe = self._jitted(dit).lower(state, jargs, jkwargs).compile()
        return Program(lambda: exe(state, jargs, jkwargs), text=exe.as_text())

    def collective_counts(self, program: Program) -> dict[str, int] | None:
        return collective_counts(program.text) if program.text is not None else None

    def run_device(self, dit: torch.nn.Module, placed: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """One forward; the output stays a (sharded) JAX array on the devices."""
        jargs, jkwargs = self._device_inputs(args, kwargs)
        return self._jitted(dit)(with_scales(dit, placed), jargs, jkwargs)

    # --- forwards with diffusers' cache hooks: decisions on the host between compiled pieces -----

    def run_cached_device(self, dit: torch.nn.Module, placed: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """One forward with the cache hooks live. A block cache (FirstBlockCache, MagCache) runs as
        a few ``jax.jit`` programs cut at its decision, a per-module one (TaylorSeer, PAB) as one
        program per decision pattern (:meth:`cached_programs`); FirstBlockCache reads one scalar
        back, the others nothing. Any other cache runs the model's own Python on the host over the
        sharded arrays (torchax eager), with the pieces between the cache's decisions compiled
        (:meth:`cache_unit_runner`)."""
        import torchax

        from ..caching.model import model_cache_probe

        probe = model_cache_probe(dit)
        if probe is not None and probe.programs is not None:
            return probe.programs.forward(self.cached_programs(dit, placed, probe.programs, args, kwargs), probe.stats)
        env = torchax.default_env()
        jargs, jkwargs = self._device_inputs(args, kwargs)
        # The pieces are compiled per input signature of the whole forward: SP's Python state (the
        # padded length, the key mask) follows from it and is baked into the pieces' programs.
        self.__dict__["_cached_forward_key"] = input_signature((args, kwargs))
        with env:
            state, targs, tkwargs = env.j2t_iso((placed, jargs, jkwargs))
            out = torch.func.functional_call(dit, state, targs, {**tkwargs, "return_dict": False})[0]
        return env.t2j_iso(out)

    def cached_programs(self, dit: torch.nn.Module, placed: dict[str, Any], programs: Any, args: tuple,
                        kwargs: dict) -> Any:
        """How a cache's ``programs`` (:class:`~wan_sharding.caching.programs.BlockPrograms` or ``ModulePrograms``) run for these
        inputs: each program a ``jax.jit`` of the whole forward (weights and inputs as arguments,
        so nothing is baked in), made once per model, cache, program, input signature and the
        structure of what the previous program handed over; kept across enable/disable."""
        import jax
        import torchax

        env = torchax.default_env()
        jargs, jkwargs = self._device_inputs(args, kwargs)
        compiled = self.__dict__.setdefault("_program_cache", {}).setdefault(id(dit), {})
        weights_of = self.__dict__.setdefault("_program_weights", {}).setdefault(id(dit), {})
        signature = input_signature((args, kwargs))
        # Compiled programs are kept across enable/disable (same key); a cache enabled again has new
        # programs over new hooks, so a program that jax traces again must trace the live ones.
        live = self.__dict__.setdefault("_live_programs", {})
        live[id(dit)] = programs

        def run(name: str, extra: dict) -> dict:
            key = (programs.key, name, signature, jax.tree_util.tree_structure(extra))
            if key not in weights_of:  # dropped when LoRA weights are placed again (place_lora)
                # Only the weights the program reads: each array passed costs dispatch time on the
                # host (per device), and a reuse path reads none of the skipped blocks'.
                skipped = tuple(m + "." for m in programs.skipped_modules(name, extra))
                weights_of[key] = {k: v for k, v in placed.items() if not k.startswith(skipped)}
            if key not in compiled:
                def program(state: dict, a: tuple, k: dict, given: dict) -> Any:
                    state, scales = split_scales(state)
                    state, a, k, given, scales = env.j2t_iso((state, a, k, given, scales))
                    with env, scales_as(dit, scales):
                        forward = lambda: torch.func.functional_call(dit, state, a, {**k, "return_dict": False})[0]  # noqa: E731
                        return env.t2j_iso(live[id(dit)].body(name, forward, given))

                compiled[key] = jax.jit(program)
            return compiled[key](with_scales(dit, weights_of[key]), jargs, jkwargs, extra)

        return run

    def cache_refusal(self, config: Any) -> str | None:
        """SeaCache's indicators use ``torch.fft`` ops (``aten::fft_fftfreq``) that torchax cannot
        lower; the cache would fail on its first forward."""
        if type(config).__name__ == "SeaCacheConfig":
            return ("SeaCache computes torch.fft ops (aten::fft_fftfreq) that torchax cannot lower, so the jax backend "
                    "cannot run it; use the xla backend for SeaCache, or fbc / mag / taylorseer / pab on jax")
        return None

    def cache_unit_runner(self, dit: torch.nn.Module, placed: dict[str, Any]):
        """Runs one piece (a module's own forward) as a ``jax.jit`` of its weights and tensor
        inputs, compiled once per piece and signature; non-tensor inputs are part of the key."""
        import jax
        import torchax
        from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses
        from torch.utils._pytree import tree_flatten, tree_unflatten
        from torchax.interop import jax_view

        env = torchax.default_env()
        # Kept on the backend per model, so enabling the cache again compiles nothing again.
        compiled: dict[Any, Any] = self.__dict__.setdefault("_unit_cache", {}).setdefault(id(dit), {})
        states: dict[str, dict[str, Any]] = {}

        def state_of(name: str) -> dict[str, Any]:
            if name not in states:
                prefix = name + "."
                states[name] = {k[len(prefix):]: v for k, v in placed.items() if k.startswith(prefix)}
            return states[name]

        def run(name: str, module: torch.nn.Module, forward, args: tuple, kwargs: dict) -> Any:
            leaves, spec = tree_flatten((args, kwargs))
            dynamic = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            fixed = tuple(None if i in dynamic else x for i, x in enumerate(leaves))
            # a piece bakes in the LoRA scales it was traced with: they are part of its key
            key = (name, str(spec), fixed, self.__dict__.get("_cached_forward_key"), tuple(sorted(live_scales(dit).items())))
            try:
                hash(key)
            except TypeError:  # an unhashable non-tensor input: run this piece op by op
                return forward(*args, **kwargs)
            if key not in compiled:
                def piece(state: dict, tensors: list) -> Any:
                    state, tensors = env.j2t_iso((state, tensors))
                    filled = list(fixed)
                    for i, t in zip(dynamic, tensors):
                        filled[i] = t
                    a, k = tree_unflatten(filled, spec)
                    with env, _reparametrize_module(module, state):
                        return env.t2j_iso(forward(*a, **k))

                compiled[key] = jax.jit(piece)
            out = compiled[key](state_of(name), [jax_view(leaves[i]) for i in dynamic])
            return env.j2t_iso(out)

        return run

    def run_step(self, model: torch.nn.Module, placed: dict[str, Any], fn: Any, *args: Any) -> Any:
        """A VAE step as one ``jax.jit`` (:meth:`step_program`)."""
        jargs, _ = self._device_inputs(args, {})
        return self.step_program(model, fn)(placed, jargs)

    def step_program(self, model: torch.nn.Module, fn: Any) -> Any:
        """The ``jax.jit`` :meth:`run_step` runs for the step ``fn``: :meth:`function_program` of ``fn``
        traced with torchax's integer index written as a static slice
        (:func:`~.frontend_quirks.sliced_integer_indexing`), entered inside torchax's own mode (from
        outside, torchax would lower the index first). Made once per model and step; the compile
        frontend lowers this very program."""
        from .frontend_quirks import sliced_integer_indexing

        steps = self.__dict__.setdefault("_step_cache", {}).setdefault(id(model), {})
        if fn not in steps:
            def step(m: torch.nn.Module, *tensors: Any) -> Any:
                with sliced_integer_indexing():
                    return fn(m, *tensors)

            steps[fn] = step
        return self.function_program(model, steps[fn])

    def frontend_hooks(self, model: torch.nn.Module) -> list[Any]:
        from .frontend_quirks import torch_dtypes

        return torch_dtypes(model)

    def upload(self, tensor: torch.Tensor, spec: Spec) -> Any:
        """Split on upload: ``jax.device_put`` with the spec's sharding sends each device its piece."""
        import jax
        import torchax

        return jax.device_put(torchax.default_env().t2j_copy(tensor), self.sharding(spec))

    def to_host(self, out: Any) -> torch.Tensor:
        """``jax.device_get``: a split array is copied shard by shard (each addressable shard to the
        host, assembled there), never gathered by a program on the devices."""
        import jax

        out = jax.device_get(out)
        dtype = torch.bfloat16 if str(out.dtype) == "bfloat16" else None  # numpy has no bf16 for torch
        host = torch.from_numpy(np.asarray(out, dtype=np.float32 if dtype else out.dtype).copy())
        return host.to(dtype) if dtype else host

    @staticmethod
    def cpu_env(num_devices: int) -> dict[str, str]:
        """Environment for a process that runs JAX on ``num_devices`` CPU devices."""
        env = with_xla_flags(dict(os.environ), f"{DEVICE_COUNT_FLAG}={num_devices}")
        env["JAX_PLATFORMS"] = "cpu"
        env.pop("TT_COMPILE_ONLY_SYSTEM_DESC", None)
        return env


def with_scales(dit: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the LoRA adapters' live scales beside it (``lora_layers.SCALES_KEY``), as
    float32 inputs: a new scale reuses the compiled program, another set of adapters retraces (the
    keys are part of the program's input structure). ``state`` itself when no adapter is active."""
    scales = live_scales(dit)
    if not scales:
        return state
    return {**state, SCALES_KEY: {k: np.float32(v) for k, v in scales.items()}}


def placed_bytes_per_device(arrays: list, mesh: Any) -> list[int]:
    """Bytes each device of ``mesh`` holds of ``arrays`` (jax arrays or ``ShapeDtypeStruct`` with a
    sharding), in the mesh's device order."""
    import numpy as np

    devices = list(np.asarray(mesh.devices).flat)
    totals = {d: 0 for d in devices}
    for a in arrays:
        itemsize = np.dtype(a.dtype).itemsize
        for device, index in a.sharding.devices_indices_map(tuple(a.shape)).items():
            totals[device] += slice_bytes(tuple(a.shape), index, itemsize)
    return [totals[d] for d in devices]


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collectives in a partitioned HLO module, by kind (``all-reduce``, ``all-gather``, ...)."""
    import re

    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    counts = {k: len(re.findall(rf"= [^=\n]*\b{k}(?:-start)?\(", hlo_text)) for k in kinds}
    return {k: v for k, v in counts.items() if v}


cpu_env = JaxBackend.cpu_env  # the environment for a CPU worker of this backend
