"""Shard a whole diffusers Wan 2.2 pipeline: every expert, with the pipeline's own ``__call__``.

:func:`shard_pipeline` takes a ``WanPipeline`` or ``WanImageToVideoPipeline`` (T2V-A14B and
I2V-A14B: ``transformer`` + ``transformer_2``; TI2V-5B: ``transformer`` only) and, for each expert,
computes the TP specs, places the weights on the mesh, installs the SP hooks, and puts a small
:class:`ShardedTransformer` in the pipeline in its place. The wrapper exposes what the pipeline's
denoising loop uses (``config``, ``dtype``, ``device``, ``cache_context``, ``forward``) and runs
the forward through the backend; inputs and outputs stay on the host, so the pipeline's latents,
CFG, scheduler and VAE run as usual. The real model is held by the wrapper but not registered as
its submodule, so ``pipe.device`` / ``pipe._execution_device`` stay the host device and
``pipe.to(...)`` cannot move the sharded weights.

Nothing on any diffusers class is replaced: components are swapped through the pipeline's own
attribute assignment (which also records them in ``pipe.config``), and the returned
:class:`PipelineHandle`'s ``remove()`` puts the original objects back, removes the SP hooks and
returns the experts to the device they came from.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..activation import _APPLIED, SPHandle, apply_dit_sp_activation_sharding
from ..backends import Backend, get_backend
from ..mesh import MeshSpec
from ..options import DEFAULT_PADDING, PADDING_NAMES
from ..specs import ShardingError, ShardSpecs, check_wan_model, shard_dit_specs

EXPERT_COMPONENTS = ("transformer", "transformer_2")
SUPPORTED_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")

# Pipelines that are currently sharded -> their handle. Weak both ways (the handle holds the
# pipeline), so a pipeline and handle that are both dropped are freed.
_SHARDED: "weakref.WeakKeyDictionary[Any, weakref.ref[PipelineHandle]]" = weakref.WeakKeyDictionary()


class ShardedTransformer(torch.nn.Module):
    """Stands in for one expert of a sharded pipeline; ``forward`` runs the real model on the mesh.

    Inputs are host tensors (as the pipeline makes them); the output comes back to the host, as a
    tuple with ``return_dict=False`` (what the Wan pipelines ask for) or a
    ``Transformer2DModelOutput``.
    """

    def __init__(self, dit: torch.nn.Module, backend: Backend, placed: Any, name: str, padding: str,
                 sp: SPHandle | None = None):
        super().__init__()
        # Plain attributes, not submodules: module traversal (pipe.device, pipe.to, .modules())
        # must not reach the sharded weights.
        self.__dict__.update(_dit=dit, _backend=backend, _placed=placed, component=name, padding=padding, calls=0,
                             _sp=sp)

    # --- what the Wan pipelines read ------------------------------------------------------
    @property
    def dit(self) -> torch.nn.Module:
        """The real (sharded) ``WanTransformer3DModel``."""
        if self._dit is None:
            raise ShardingError(
                f"this sharded {self.component} was removed by handle.remove(); use pipe.{self.component}, "
                "which is the original model again"
            )
        return self._dit

    @property
    def config(self) -> Any:
        return self.dit.config

    @property
    def dtype(self) -> torch.dtype:
        return self.dit.dtype

    @property
    def device(self) -> torch.device:
        """Where the pipeline should keep inputs and outputs: the host."""
        return torch.device("cpu")

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
        from ..caching import enable_model_cache, zero_padding_rows

        refusal = self._backend.cache_refusal(config)
        if refusal is not None:
            raise ShardingError(refusal)
        sp = self.__dict__.get("_sp")
        enable_model_cache(self.dit, config, runner=self._backend.cache_unit_runner(self.dit, self._placed),
                           post=zero_padding_rows(sp.state) if sp is not None else None)

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

    def forward(self, *args: Any, return_dict: bool = True, **kwargs: Any):
        dit = self.dit
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if "attention_kwargs" in kwargs and self._backend.traces_whole_forward:
            raise ShardingError(
                f"attention_kwargs (a LoRA scale) cannot be passed into the {self._backend.name} backend's compiled "
                "forward; fuse the LoRA into the weights (pipe.fuse_lora()) before shard_pipeline, or use the xla backend"
            )
        if dit.is_cache_enabled:
            self._adopt_cache()
            out = self._backend.to_host(self._backend.run_cached_device(dit, self._placed, *args, **kwargs))
        else:
            out = self._backend.run(dit, self._placed, *args, **kwargs)
        self.__dict__["calls"] += 1
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)

    def _adopt_cache(self) -> None:
        """A cache enabled on the real model directly (or before sharding) gets this backend's probe,
        so it acts at every forward instead of only while a forward is traced."""
        from ..caching import model_cache_probe

        probe = model_cache_probe(self.dit)
        # A backend that traces whole forwards needs the compiled pieces (cache_unit_runner).
        if probe is None or (self._backend.traces_whole_forward and not probe.units):
            config = self.dit._cache_config
            if probe is not None:
                probe.remove(keep_cache=False)
            else:
                self.dit.disable_cache()
            self.enable_cache(config)

    def _release(self) -> None:
        self.__dict__.update(_dit=None, _placed=None, _sp=None)

    # --- copying: refused (a copy would share the original's device weights and SP hooks) ---
    def __deepcopy__(self, memo: dict) -> Any:
        raise ShardingError(
            f"a pipeline sharded with shard_pipeline cannot be copied or pickled (its {self.component} runs the "
            "original's weights on the mesh); call handle.remove() first, copy, then shard_pipeline each copy"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__deepcopy__({})

    def extra_repr(self) -> str:
        inner = type(self._dit).__name__ if self._dit is not None else "removed"
        return f"{self.component}: {inner} on {self._backend.name} {self._backend.mesh.name}, padding={self.padding}"


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


def _load_plan(plan: Any) -> Any:
    """``None``, a ShardingPlan, or the path of one, as a ShardingPlan."""
    from ..plan import PlanError, ShardingPlan

    if plan is None or isinstance(plan, ShardingPlan):
        return plan
    if isinstance(plan, (str, Path)):
        try:
            return ShardingPlan.load(plan)
        except PlanError as e:  # unreadable, not JSON, or a bad field: one line, nothing changed
            raise ShardingError(f"{e}; pass a file `wan-sharding plan --write` wrote") from None
    raise ShardingError(f"plan must be a ShardingPlan or the path of one, got {type(plan).__name__}")


def _plan_mesh_and_padding(plan: Any, mesh: Any, padding: str | None) -> tuple[Any, str]:
    """The mesh and padding to use: the arguments, or the plan's, which they must not contradict."""
    if plan is None:
        if mesh is None:
            raise ShardingError("shard_pipeline needs a mesh (a preset such as '2x4') or a plan")
        return mesh, DEFAULT_PADDING if padding is None else padding
    if padding is not None and padding != plan.padding:
        raise ShardingError(f"padding={padding!r} contradicts the plan's padding {plan.padding!r}; "
                            "leave padding out to use the plan's")
    if mesh is not None:
        from ..mesh import as_mesh_spec

        given, wanted = as_mesh_spec(mesh), plan.mesh()
        if given.shape != wanted.shape or (not isinstance(mesh, (str, MeshSpec)) and given.axis_names != wanted.axis_names) \
                or (isinstance(mesh, (str, MeshSpec)) and given != wanted):
            raise ShardingError(f"mesh {given.name} (axes {given.axis_names}) contradicts the plan's mesh "
                                f"{wanted.name} {plan.name!r}; leave mesh out to use the plan's")
    return mesh, plan.padding


def _backend_for(backend: str | Backend, mesh: Any, plan: Any) -> Backend:
    """The backend on ``mesh``; with a plan, on the plan's mesh and roles (over the devices of
    ``mesh`` when that is the backend's own mesh)."""
    if isinstance(backend, Backend) and plan is not None and backend.mesh != plan.mesh():
        raise ShardingError(f"backend {backend!r} has mesh roles {backend.mesh.roles} but the plan {plan.name!r} "
                            f"needs {plan.mesh().roles}; pass the backend's name instead")
    if plan is None:
        return get_backend(backend, mesh)
    return get_backend(backend, mesh if mesh is not None and not isinstance(mesh, (str, MeshSpec)) else plan.mesh(),
                       spec=plan.mesh())


def _is_wan_pipeline(pipe: Any) -> bool:
    return any(c.__name__ in SUPPORTED_PIPELINES and c.__module__.startswith("diffusers.")
               for c in type(pipe).__mro__)


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


def shard_pipeline(pipe: Any, mesh: Any = None, backend: str | Backend = "jax",
                   padding: str | None = None, keep_host_weights: bool = True,
                   patches: Sequence[str] = (), plan: "ShardingPlan | str | Path | None" = None) -> PipelineHandle:
    """Shard every expert of a diffusers Wan 2.2 pipeline over ``mesh``; the pipeline is then
    called as usual (``pipe(...)``) and runs each DiT forward on the mesh.

    Args:
        pipe: a ``WanPipeline`` (T2V-A14B, TI2V-5B) or ``WanImageToVideoPipeline`` (I2V-A14B).
            ``transformer`` and ``transformer_2`` are sharded when present (``None`` is skipped).
        mesh: a preset name (``"1x4"``, ``"2x4"``, ``"8x4"``), a :class:`MeshSpec`, or the
            backend's own mesh. With ``plan``: omit it (the plan's mesh), or pass the backend's own
            mesh with the plan's shape and axis names (to choose the devices).
        backend: ``"jax"`` (torchax, the default), ``"xla"`` (torch-xla SPMD), ``"tt"``, or a
            :class:`~wan_sharding.backends.Backend` instance bound to ``mesh``.
        padding: ``"slice"``, ``"mask"`` or ``"none"`` (see :func:`apply_dit_sp_activation_sharding`);
            default: the plan's, else ``"mask"``.
        keep_host_weights: for backends that move the model to their device (``xla``, ``tt``):
            keep the original host parameter objects, so ``remove()`` puts exactly those back (no
            device-to-host copy). ``False`` frees them while sharded (host memory: one copy of each
            expert less) and ``remove()`` copies the weights back from the device instead. The
            ``jax`` backend never moves the torch model.
        patches: model rewrites (``wan_sharding.patches``, e.g. ``("rope", "qkv")``) applied to
            every expert before it is sharded; ``remove()`` undoes them too.
        plan: a :class:`~wan_sharding.plan.ShardingPlan` or the path of one (``wan-sharding plan
            --write``): its mesh and axis roles, FSDP, activation layout and padding are applied to
            every expert. An explicit ``mesh`` or ``padding`` that contradicts it is an error.

    Returns:
        A :class:`PipelineHandle`; ``handle.remove()`` (or leaving a ``with`` block) restores the
        pipeline's original components exactly.

    Raises:
        ShardingError: not a Wan pipeline, no experts, already sharded, an expert that cannot be
            sharded on this mesh, or an unknown padding mode. Raised before anything is changed.
        BackendError: the backend is missing or sees a different number of devices.
    """
    if not _is_wan_pipeline(pipe):
        raise ShardingError(
            f"shard_pipeline expects a diffusers Wan 2.2 pipeline ({' or '.join(SUPPORTED_PIPELINES)}), got "
            f"{type(pipe).__name__}; for a bare WanTransformer3DModel use shard_dit_specs + "
            "apply_dit_sp_activation_sharding"
        )
    live = sharded_handle(pipe)
    if live is not None:
        raise ShardingError(
            f"this {type(pipe).__name__} is already sharded (on {live.mesh.name}); call handle.remove() "
            "on the first handle before sharding it again"
        )
    plan = _load_plan(plan)
    mesh, padding = _plan_mesh_and_padding(plan, mesh, padding)
    if padding not in PADDING_NAMES:
        raise ShardingError(f"unknown padding mode {padding!r}; choose one of {sorted(PADDING_NAMES)}")

    found = [(name, getattr(pipe, name, None)) for name in EXPERT_COMPONENTS]
    found = [(name, dit) for name, dit in found if dit is not None]
    if not found:
        raise ShardingError(f"{type(pipe).__name__} has no transformer to shard (transformer and transformer_2 are None)")
    for name, dit in found:
        if isinstance(dit, ShardedTransformer):
            raise ShardingError(
                f"pipe.{name} is already a ShardedTransformer (sharded through another handle); remove that handle first"
            )
        check_wan_model(dit)
        if dit in _APPLIED:
            raise ShardingError(
                f"pipe.{name} already carries sequence-parallel hooks (is it shared with another sharded pipeline, or "
                "was apply_dit_sp_activation_sharding called on it?); remove those first"
            )
    be = _backend_for(backend, mesh, plan)  # the stack and the device count, checked before any change
    rewrites: dict[int, Any] = {}
    unique: dict[int, ShardSpecs] = {}
    try:
        for _, dit in found:  # validates heads / ffn / dims against TP for every expert first
            if id(dit) not in unique:
                if patches:  # rewrites first: the specs are the patched model's (PatchError before any change)
                    from ..patches import apply_patches

                    rewrites[id(dit)] = apply_patches(dit, patches, mesh=be.mesh)
                unique[id(dit)] = shard_dit_specs(dit, plan if plan is not None else be.mesh)
    except BaseException:
        for h in rewrites.values():
            h.remove()
        raise

    _warn_if_torch_xla_in_jax_process(pipe, be)
    handle = PipelineHandle(pipe, be, padding, plan=plan)
    done: dict[int, ShardedExpert] = {}
    try:
        for name, dit in found:
            entry = pipe.config.get(name)
            if id(dit) in done:  # the same model in both slots: one placement, one stand-in
                first = done[id(dit)]
                expert = ShardedExpert(name, dit, first.wrapper, first.specs, None, first.original_device, entry)
                handle.experts.append(expert)
            else:
                expert = ShardedExpert(name, dit, None, unique[id(dit)], None, _model_device(dit), entry,
                                       host_tensors=_host_tensors(dit) if keep_host_weights else None,
                                       patches=rewrites.get(id(dit)))
                handle.experts.append(expert)  # from here on, remove() can undo what follows
                expert.moved = True  # until known otherwise: remove() moves it back
                placed = be.place(dit, expert.specs)
                expert.moved = _model_device(dit) != expert.original_device
                if not expert.moved:
                    expert.host_tensors = None  # nothing to put back (jax: the model stays where it is)
                expert.sp = apply_dit_sp_activation_sharding(dit, be.mesh, backend=be, padding=padding, plan=plan)
                expert.wrapper = ShardedTransformer(dit, be, placed, name, padding, sp=expert.sp)
                if dit.is_cache_enabled:  # a cache enabled before sharding acts on the mesh too
                    expert.wrapper._adopt_cache()
                done[id(dit)] = expert
            setattr(pipe, name, expert.wrapper)
    except BaseException:
        handle.remove()
        raise
    _SHARDED[pipe] = weakref.ref(handle)
    return handle


_WAN_PIPELINE_MODULES = ("diffusers.pipelines.wan.pipeline_wan", "diffusers.pipelines.wan.pipeline_wan_i2v")


def diffusers_without_torch_xla() -> None:
    """For a process that runs the ``jax`` backend: make diffusers treat torch-xla as absent.

    When torch-xla is installed, diffusers' Wan pipelines call ``torch_xla``'s ``mark_step()``
    after every denoising step, which starts torch-xla's own XLA runtime next to JAX's in the same
    process (this project keeps the two stacks in separate processes). Call this before the
    pipeline modules are imported; it sets diffusers' cached "is torch_xla available" answer for
    this process and touches no class.
    """
    import sys

    loaded = [m for m in _WAN_PIPELINE_MODULES if getattr(sys.modules.get(m), "XLA_AVAILABLE", False)]
    if loaded:
        raise RuntimeError(
            f"{', '.join(loaded)} already imported with torch-xla enabled; call diffusers_without_torch_xla() "
            "before importing diffusers' Wan pipelines (first thing in the script)"
        )
    import diffusers.utils.import_utils as import_utils

    import_utils._torch_xla_available = False


def _warn_if_torch_xla_in_jax_process(pipe: Any, be: Backend) -> None:
    import sys
    import warnings

    if not be.uses_torch_xla and getattr(sys.modules.get(type(pipe).__module__), "XLA_AVAILABLE", False):
        warnings.warn(
            f"{type(pipe).__name__} will call torch_xla's mark_step() after every step (torch-xla is installed), "
            "starting torch-xla's runtime in this JAX process; call wan_sharding.pipeline.diffusers_without_torch_xla() "
            "before importing diffusers pipelines to keep the two stacks apart", RuntimeWarning, stacklevel=3)


def sharded_handle(pipe: Any) -> PipelineHandle | None:
    """The live handle of a sharded pipeline, or ``None``."""
    ref = _SHARDED.get(pipe)
    handle = ref() if ref is not None else None
    return handle if handle is not None and not handle.removed else None


@contextlib.contextmanager
def sharded(pipe: Any, mesh: Any = None, backend: str | Backend = "jax", padding: str | None = None,
            plan: Any = None) -> Iterator[PipelineHandle]:
    """``with sharded(pipe, "2x4"): pipe(...)``: shard for the block, restore after."""
    handle = shard_pipeline(pipe, mesh, backend=backend, padding=padding, plan=plan)
    try:
        yield handle
    finally:
        handle.remove()
