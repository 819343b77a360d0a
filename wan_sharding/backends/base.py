"""The one interface every backend implements.

What sharding needs: place weights, constrain an activation. What callers need to run and
measure a sharded model without knowing which backend it is: compile a forward once, run it on
the devices, copy its output to the host, count the collectives of what was compiled, forget
what was cached, and the environment a worker process needs to run this backend (on CPU virtual
devices, or on the backend's own devices).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Mapping

import torch

from ..mesh import MeshSpec
from ..specs import Spec


class BackendError(RuntimeError):
    """A backend cannot be used here: its stack is missing or the device count is wrong."""


class Backend(abc.ABC):
    """A sharding backend bound to one mesh.

    ``mesh`` is the backend-neutral :class:`MeshSpec`; ``native_mesh`` the backend's own mesh
    object (``torch_xla`` ``Mesh`` or ``jax.sharding.Mesh``).
    """

    name: str = "?"
    # The stack the backend runs in. A process runs one stack (both read XLA_FLAGS).
    uses_torch_xla: bool = False
    # The whole forward is traced once into one program: Python-level per-call arguments
    # (e.g. a LoRA scale in attention_kwargs) cannot reach it, and hooks run only while tracing.
    traces_whole_forward: bool = False
    # A block cache's forward (FirstBlockCache, MagCache) runs as a few whole programs cut at the
    # cache's decision (``wan_sharding.caching.programs``), through :meth:`run_cached_device`.
    cache_programs: bool = False
    # Forwards and cache programs compiled so far, where the backend counts them (``tt``: its
    # ``torch.compile`` calls); ``None`` where it does not.
    compiles: int | None = None

    def __init__(self, mesh: MeshSpec, native_mesh: Any = None):
        self.mesh = mesh
        self.native_mesh = native_mesh if native_mesh is not None else self._make_mesh(mesh)

    @abc.abstractmethod
    def _make_mesh(self, mesh: MeshSpec) -> Any:
        """Build the backend's mesh over the visible devices (error if the count differs)."""

    @property
    def device(self) -> torch.device:
        """Where a forward's inputs and the model must be for :meth:`run_device`: the host for
        backends that keep the torch model where it is (``jax``), the XLA device for torch-xla ones."""
        return torch.device("cpu")

    @abc.abstractmethod
    def place(self, dit: torch.nn.Module, specs: Mapping[torch.Tensor, Spec]) -> Any:
        """Put the weights on the mesh with their specs; returns whatever ``run`` needs."""

    @abc.abstractmethod
    def constrain(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        """A sharding constraint on an activation inside the traced forward; returns the tensor
        to use downstream (a new value, so two constraints in a row stay two)."""

    def activation_spec(self, tensor: torch.Tensor, spec: Spec) -> Spec:
        """``spec`` as a constraint on this mesh: on a cfg mesh a leading batch of (cond, uncond)
        halves also goes on the cfg axis (``MeshSpec.batch_spec``), so every constraint of the SP
        hooks, the padding modes and the patches keeps the two branches apart without naming cfg;
        elsewhere ``spec`` as it is. Only tensors of 3 dims or more lead with a batch: a weight
        pinned by a constraint (an RMSNorm composite's 1-D weight) or a mask row has none."""
        if self.mesh.cfg_axis is None or len(spec) < 3 or spec[0] is not None:
            return spec
        return (self.mesh.batch_spec(tensor.shape)[0], *spec[1:])

    def run_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> Any:
        """One forward of ``dit`` on the mesh; the output stays on the devices."""
        raise BackendError(f"the {self.name} backend cannot execute here")

    def to_host(self, out: Any) -> torch.Tensor:
        """A device output as a host (CPU) tensor; a split output leaves shard by shard, each
        device's piece copied to the host and the whole assembled there (no program gathers it
        on the devices)."""
        raise BackendError(f"the {self.name} backend cannot execute here")

    def run_function(self, dit: torch.nn.Module, placed: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(dit, *args)``, torch code over ``dit``'s modules outside any forward (such as the
        ``prompt_kv`` patch's prompt program), run once on the mesh as a program of its own, with
        the weights :meth:`place` put there and host tensors in ``args``; its outputs stay on the
        devices, ready to be passed into a forward. Compiled once per model and ``fn`` object."""
        raise BackendError(f"the {self.name} backend cannot execute here")

    def run_step(self, model: torch.nn.Module, placed: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(model, *args)`` as one compiled program of its own (a VAE decode or encode step),
        made once per model, ``fn`` object and input signature; ``args`` host tensors or what
        :meth:`upload` and earlier steps left on the devices, the outputs left there. By default
        :meth:`run_function`; the ``tt`` backend compiles it as it compiles a forward."""
        return self.run_function(model, placed, fn, *args)

    def step_quirks(self) -> Any:
        """The context a VAE step is traced in, for what this backend's frontend lowers unlike
        torch (:mod:`.frontend_quirks`); none by default."""
        import contextlib

        return contextlib.nullcontext()

    def frontend_hooks(self, model: torch.nn.Module) -> list[Any]:
        """Per-instance hooks on the VAE ``model`` for what this backend's frontend lowers unlike
        torch (:mod:`.frontend_quirks`), installed after the VAE's own; their handles, to remove."""
        return []

    def upload(self, tensor: torch.Tensor, spec: Spec) -> Any:
        """A host tensor onto the mesh split as ``spec``: each device gets its own piece, not the
        whole tensor. By default the host tensor itself (the program then takes it replicated)."""
        return tensor

    def run(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run one forward of ``dit`` on the mesh and return the output on the host (CPU)."""
        return self.to_host(self.run_device(dit, placed, *args, **kwargs))

    def run_cached_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> Any:
        """One forward with diffusers' cache hooks live (``wan_sharding.caching``): their decisions
        must run on the host at every call. Backends that run the model's Python at every call
        (``xla``: lazy tensors) need nothing more than :meth:`run_device`."""
        return self.run_device(dit, placed, *args, **kwargs)

    def cached_programs(self, dit: torch.nn.Module, placed: Any, programs: Any, args: tuple,
                        kwargs: dict) -> Callable[[str, dict], dict]:
        """How a cache's ``programs`` (:class:`~wan_sharding.caching.programs.BlockPrograms` or
        :class:`~wan_sharding.caching.module_programs.ModulePrograms`, the forward cut at the cache's decisions) run
        on this backend for these device inputs: ``run(name, handed_over) -> outputs`` runs program
        ``name``, compiled once per model, program and input signature. Backends with
        ``cache_programs`` implement it."""
        raise BackendError(f"the {self.name} backend does not run a cache's programs")

    def cache_refusal(self, config: Any) -> str | None:
        """Why this backend cannot honour the diffusers cache ``config`` (one line with the fix), or
        ``None`` when it can."""
        return None

    def cache_unit_runner(self, dit: torch.nn.Module, placed: Any) -> Any:
        """For a backend that compiles whole forwards: how to run one piece between a cache's
        decisions compiled (``wan_sharding.caching.probes.UnitRunner``); ``None``: no pieces."""
        return None

    def compile(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> "Program":
        """The forward for these inputs, compiled once: ``program()`` runs it (device output).
        Backends that compile lazily run it once here, so the first call is not the compile."""
        run = lambda: self.run_device(dit, placed, *args, **kwargs)  # noqa: E731
        return Program(run)

    def collective_counts(self, program: "Program") -> dict[str, int] | None:
        """Collectives in the partitioned program, by kind; ``None`` where the backend cannot
        show its partitioned program."""
        return None

    def placed_weight_bytes(self, dit: torch.nn.Module, placed: Any) -> list[int]:
        """Bytes of ``dit``'s parameters on each device of the mesh (device order), read from what
        :meth:`place` put there, not from the specs."""
        raise BackendError(f"the {self.name} backend cannot report its placed weights")

    def place_lora(self, dit: torch.nn.Module, placed: Any, specs: Mapping[str, Spec]) -> None:
        """Put ``dit``'s LoRA parameters (``specs``: name -> spec, every LoRA parameter it has now)
        on the mesh again after an adapter was loaded, swapped or deleted, leaving the base weights
        where they are; ``placed`` (what :meth:`place` returned) is updated in place."""
        raise BackendError(f"the {self.name} backend cannot place LoRA weights again; shard the pipeline again")

    def release(self, dit: torch.nn.Module) -> None:
        """Forget anything compiled or cached for ``dit`` (nothing by default)."""

    def sdpa_composite(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None, scale: float, is_causal: bool) -> torch.Tensor:
        """Attention as Tenstorrent's fused SDPA composite in this backend's lowering
        (``wan_sharding.fused_sdpa``); a backend that cannot mark composites computes the plain math."""
        from ..fused_sdpa import sdpa_math

        return sdpa_math(query, key, value, attn_mask, scale, is_causal)

    @staticmethod
    def cpu_env(num_devices: int) -> dict[str, str]:
        """The environment a fresh process needs to run this backend on ``num_devices`` CPU
        devices (set before the stack starts)."""
        raise BackendError("this backend does not run on CPU virtual devices")

    @classmethod
    def worker_env(cls, num_devices: int) -> dict[str, str]:
        """The environment a fresh worker process needs to run this backend on ``num_devices``
        devices: CPU virtual devices by default (:meth:`cpu_env`); a backend on real devices
        (``tt``) overrides it, and raises BackendError when its stack is missing."""
        return cls.cpu_env(num_devices)

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


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_xla_flags(env: dict[str, str], *flags: str) -> dict[str, str]:
    """``env`` with its ``XLA_FLAGS`` set to the user's own flags less any host device count (the
    worker's device count is the package's to set) plus ``flags``; unset when nothing is left.
    Keeping the user's other flags is how a dump directory or a compile setting reaches a worker."""
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    kept += flags
    if kept:
        env["XLA_FLAGS"] = " ".join(kept)
    else:
        env.pop("XLA_FLAGS", None)
    return env


class Program:
    """A compiled forward: calling it runs it and returns the device output. ``text`` is the
    partitioned program where the backend can show it."""

    def __init__(self, call: Callable[[], Any], text: str | None = None):
        self._call = call
        self.text = text

    def __call__(self) -> Any:
        return self._call()


def move_module(model: torch.nn.Module, device: Any) -> None:
    """``model.to(device)`` with every parameter that several modules share (tied weights: UMT5's
    ``shared`` and ``encoder.embed_tokens``) still one parameter afterwards. ``Module.to`` makes a
    new parameter per holding module when the move changes the tensor type (CPU <-> XLA), which would
    put a tied table on the devices twice and leave a name (``encoder.embed_tokens.weight``) that the
    specs, keyed by ``named_parameters()`` (one name per shared parameter), do not have."""
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
    model.to(device)
    for (first, first_name), *rest in holders.values():
        for module, name in rest:
            if module._parameters[name] is not first._parameters[first_name]:
                module.register_parameter(name, first._parameters[first_name])


def input_signature(value: Any) -> Any:
    """What a compiled forward is specialised on: tensor shapes and dtypes, which inputs are
    ``None``, plain values as they are."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(input_signature(v) for v in value))
    if isinstance(value, Mapping):
        return ("mapping", tuple(sorted((str(k), input_signature(v)) for k, v in value.items())))
    return ("object", type(value).__qualname__)


def slice_bytes(shape: tuple[int, ...], index: Any, itemsize: int) -> int:
    """Bytes of the block ``index`` (a tuple of slices, as shardings report a device's piece) of
    an array of ``shape``."""
    if index is Ellipsis:  # the whole array
        index = None
    n = 1
    for dim, size in enumerate(shape):
        s = index[dim] if index is not None and dim < len(index) else slice(None)
        n *= len(range(*s.indices(size)))
    return n * itemsize


def compiled_cache_program(programs: Any, name: str, dit: torch.nn.Module, backend: str) -> Callable[[tuple, dict, dict], dict]:
    """A cache's program ``name`` among its ``programs`` (:class:`~wan_sharding.caching.programs.BlockPrograms` or
    :class:`~wan_sharding.caching.module_programs.ModulePrograms`) through
    ``torch.compile(backend=backend, dynamic=False)``: called with the forward's inputs and what the
    previous program handed over, it returns the program's outputs; one dynamo graph per program
    (the programs' body breaks none).

    The program runs the root's ``forward`` itself, not ``dit(...)``: the root's only torch hook is
    the SP device check, a dynamo-disabled function that would split the graph, and the backend
    has put the inputs on the device already. Each program gets a code object of its own, because
    dynamo keeps its compiled entries per code object and stops compiling one after
    ``recompile_limit`` (8) entries: two experts with FirstBlockCache's four programs each reach it."""
    import types

    def program(a: tuple, k: dict, given: dict) -> dict:
        return programs.body(name, lambda: dit.forward(*a, **k, return_dict=False)[0], given)

    code = program.__code__.replace(co_name=f"{name}_program")
    fn = types.FunctionType(code, program.__globals__, code.co_name, program.__defaults__, program.__closure__)
    return torch.compile(fn, backend=backend, dynamic=False)


def compiled_step_program(fn: Callable[..., Any], model: torch.nn.Module, backend: str, name: str) -> Callable[..., Any]:
    """``fn(model, *args)`` through ``torch.compile(backend=backend, dynamic=False)``, with a code
    object of its own named ``name`` (dynamo keeps its compiled entries, and counts its recompile
    limit, per code object). ``model`` is a free variable of the compiled function, not an
    argument: dynamo then makes its weights attributes of the graph (its parameters), and only
    ``args`` its inputs."""
    import types

    def program(*args: Any) -> Any:
        return fn(model, *args)

    code = program.__code__.replace(co_name=name)
    compiled = types.FunctionType(code, program.__globals__, name, program.__defaults__, program.__closure__)
    return torch.compile(compiled, backend=backend, dynamic=False)


def compiled_lora_forward(dit: torch.nn.Module, targets: tuple[tuple[torch.nn.Module, str], ...], backend: str,
                          name: str) -> Callable[[tuple, tuple, dict], torch.Tensor]:
    """``dit``'s forward with its LoRA adapters' scales as inputs, through ``torch.compile(backend=
    backend, dynamic=False)``: called with one 0-dim tensor per ``(layer, adapter)`` of
    ``targets`` (``lora_layers.scale_targets``), the forward's args and kwargs. Each scale is
    written into its layer's ``scaling`` inside the program, so PEFT's forward multiplies by a
    graph input: dynamo guards on a Python float it reads (a new weight would be a new graph) and
    makes a tensor it finds on a module a constant of the graph, a weight; an argument is neither.
    The caller puts PEFT's floats back after (``lora_layers.adapters_enabled``). ``dit`` is a free
    variable, so its weights are the graph's parameters as in :func:`compiled_step_program`; the
    program gets a code object of its own named ``name``."""
    import types

    def program(scales: tuple, a: tuple, k: dict) -> torch.Tensor:
        for (layer, adapter), value in zip(targets, scales):
            layer.scaling[adapter] = value
        return dit(*a, **k, return_dict=False)[0]

    code = program.__code__.replace(co_name=name)
    compiled = types.FunctionType(code, program.__globals__, name, program.__defaults__, program.__closure__)
    return torch.compile(compiled, backend=backend, dynamic=False)
