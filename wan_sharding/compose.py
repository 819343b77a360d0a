"""The one composition: every component is sharded in one fixed order, and undone in reverse.

:func:`shard_module` writes the order once for any model (the DiT, the VAE, the text encoder);
:func:`shard_dit` is the DiT's use of it. Every caller that shards a model (``shard_pipeline``, the
``check`` / ``profile`` / patches jobs, both compile frontends, the server's worker through
``shard_pipeline``) comes through here::

    resolve (mesh or plan, backend, padding, patches: once, checked against each other)
      -> validate (the component's own checks; for the DiT: Wan model, no SP hooks yet, TP specs,
         SP points, patch names): nothing changed yet
      -> rewrites (patches) -> specs (of the rewritten model) -> placement -> activation hooks
    ShardHandle.remove(): hooks -> back to the host -> the backend's caches -> rewrites

Like torchtitan's ``parallelize_llama`` (meshes resolved once, then ``apply_tp -> apply_cp -> ...``
in one order) and diffusers' ``enable_parallelism`` (the parallel config set up once, read by every
hook), but each step here is undone by ``remove()``, specs stay data computed on a possibly-``meta``
model, and no forward is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .backends import Backend, get_backend
from .backends.base import move_module
from .dit.activation import SPHandle, apply_dit_sp_activation_sharding, check_sp
from .dit.specs import check_wan_model, shard_dit_specs
from .hooks import has_sp
from .lora_layers import LoraError, check_layers
from .mesh import MeshSpec, as_mesh_spec
from .options import DEFAULT_PADDING, PADDING_NAMES
from .patches import apply_patches, check_patches
from .plan import PlanError, ShardingPlan
from .specs import LoraShardingError, ShardingError, ShardSpecs

__all__ = ["DitHandle", "OnResolved", "Resolved", "ShardHandle", "check_dit", "host_tensors", "model_device", "resolve",
           "shard_dit", "shard_module"]


@dataclass(frozen=True)
class Resolved:
    """What a sharding was asked for, resolved once; every later step reads this.

    ``backend`` is bound to the mesh with its roles (the plan's when there is one); ``plan`` is the
    :class:`~wan_sharding.plan.ShardingPlan` or ``None`` (a preset's roles); ``padding`` a padding
    mode; ``patches`` the model rewrites, in the order given."""

    backend: Backend
    plan: ShardingPlan | None
    padding: str
    patches: tuple[str, ...] = ()

    @property
    def mesh(self) -> MeshSpec:
        """The mesh with its roles (SP and TP axes)."""
        return self.backend.mesh

    @property
    def mesh_or_plan(self) -> MeshSpec | ShardingPlan:
        """What :func:`shard_dit_specs` takes: the plan (its FSDP and roles) or the mesh."""
        return self.plan if self.plan is not None else self.mesh


def _load_plan(plan: Any) -> ShardingPlan | None:
    """``None``, a ShardingPlan, or the path of one, as a ShardingPlan."""
    if plan is None or isinstance(plan, ShardingPlan):
        return plan
    if isinstance(plan, (str, Path)):
        try:
            return ShardingPlan.load(plan)
        except PlanError as e:  # unreadable, not JSON, or a bad field: one line, nothing changed
            raise ShardingError(f"{e}; pass a file `wan-sharding plan --write` wrote") from None
    raise ShardingError(f"plan must be a ShardingPlan or the path of one, got {type(plan).__name__}")


def _mesh_against_plan(plan: ShardingPlan, mesh: Any) -> None:
    """An explicit mesh given with a plan must be the plan's: a preset or MeshSpec equal to it, or a
    backend's own mesh with its shape and axis names (to choose the devices)."""
    given, wanted = as_mesh_spec(mesh), plan.mesh()
    named = isinstance(mesh, (str, MeshSpec))
    if given.shape != wanted.shape or (named and given != wanted) or (not named and given.axis_names != wanted.axis_names):
        raise ShardingError(f"mesh {given.name} (axes {given.axis_names}) contradicts the plan's mesh "
                            f"{wanted.name} {plan.name!r}; leave mesh out to use the plan's")


def _backend(backend: str | Backend, mesh: Any, plan: ShardingPlan | None) -> Backend:
    """The backend on ``mesh``; with a plan, on the plan's mesh and roles (over the devices of
    ``mesh`` when that is the backend's own mesh)."""
    if plan is None:
        return get_backend(backend, mesh)
    if isinstance(backend, Backend) and backend.mesh != plan.mesh():
        raise ShardingError(f"backend {backend!r} has mesh roles {backend.mesh.roles} but the plan {plan.name!r} "
                            f"needs {plan.mesh().roles}; pass the backend's name instead")
    native = mesh if mesh is not None and not isinstance(mesh, (str, MeshSpec)) else plan.mesh()
    return get_backend(backend, native, spec=plan.mesh())


def resolve(mesh_or_plan: Any = None, backend: str | Backend | None = None, padding: str | None = None,
            patches: Sequence[str] | str = (), *, plan: ShardingPlan | str | Path | None = None) -> Resolved:
    """Resolve a sharding request once: mesh or plan, backend, padding and patches, checked
    against each other before anything is changed.

    Args:
        mesh_or_plan: a preset name (``"2x4"``), a :class:`MeshSpec`, a backend's own mesh, or a
            :class:`ShardingPlan`.
        backend: ``"jax"`` (``None``: the default), ``"xla"``, ``"tt"`` or a :class:`Backend`
            instance bound to the mesh.
        padding: a padding mode; ``None``: the plan's, else the default (``"mask"``).
        patches: model rewrites by name (``wan_sharding.patches``), applied before the specs.
        plan: a plan (or its file) given beside a mesh (``shard_pipeline``'s ``plan=``): the mesh
            may then only choose the devices, and must have the plan's shape and axis names.

    Raises:
        ShardingError: no mesh, a padding or mesh that contradicts the plan, an unknown padding
            mode, an unreadable plan file.
        BackendError: the backend's stack is missing or sees a different number of devices.
    """
    if isinstance(mesh_or_plan, ShardingPlan):
        if plan is not None:
            raise ShardingError("a plan was given twice (as the mesh and as plan=); pass it once")
        mesh_or_plan, plan = None, mesh_or_plan
    plan = _load_plan(plan)
    mesh = mesh_or_plan
    if plan is None:
        if mesh is None:
            raise ShardingError("sharding needs a mesh (a preset such as '2x4') or a plan")
        padding = DEFAULT_PADDING if padding is None else padding
    else:
        if padding is not None and padding != plan.padding:
            raise ShardingError(f"padding={padding!r} contradicts the plan's padding {plan.padding!r}; "
                                "leave padding out to use the plan's")
        if mesh is not None:
            _mesh_against_plan(plan, mesh)
        padding = plan.padding
    if padding not in PADDING_NAMES:
        raise ShardingError(f"unknown padding mode {padding!r}; choose one of {sorted(PADDING_NAMES)}")
    names = (patches,) if isinstance(patches, str) else tuple(patches)
    return Resolved(_backend("jax" if backend is None else backend, mesh, plan), plan, padding, names)


class OnResolved:
    """The request a handle was made for, read through its ``resolved`` attribute."""

    resolved: Resolved

    @property
    def backend(self) -> Backend:
        return self.resolved.backend

    @property
    def mesh(self) -> MeshSpec:
        return self.resolved.mesh

    @property
    def padding(self) -> str:
        return self.resolved.padding

    @property
    def plan(self) -> ShardingPlan | None:
        """The ShardingPlan applied, if any."""
        return self.resolved.plan


@dataclass(eq=False, repr=False)  # the generated repr would print the whole model and its placed weights
class ShardHandle(OnResolved):
    """What sharding one model did (any component: the DiT, the VAE, the text encoder);
    ``remove()`` undoes all of it, in reverse of :func:`shard_module`'s order.

    ``placed`` is what the backend's ``run`` / ``run_function`` take, ``specs`` every parameter's
    spec, ``hooks`` the component's activation hooks (anything with ``remove()``, or ``None``),
    ``rewrites`` the model rewrites' handle (or ``None``)."""

    model: torch.nn.Module
    resolved: Resolved
    specs: ShardSpecs
    placed: Any = None
    hooks: Any = None
    rewrites: Any = None
    original_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    moved: bool = False
    host_tensors: list | None = field(default=None, repr=False)  # (module, kind, name, tensor) before placement
    removed: bool = False

    def remove(self) -> None:
        """Hooks off, weights back on the host they came from (the very objects when they were
        kept), the backend's compiled programs for this model dropped, the rewrites undone."""
        if self.removed:
            return
        if self.hooks is not None:
            self.hooks.remove()  # first: a rewrite's processor is wrapped by the hooks' own
        if self.moved:
            _return_to_host(self)
        self.backend.release(self.model)
        if self.rewrites is not None:
            self.rewrites.remove()
        self.removed = True

    def __repr__(self) -> str:
        """One short line: the handle, the model's class, the mesh and backend, and whether it was
        removed (``describe()`` has the rest)."""
        state = ", removed" if self.removed else ""
        return f"{type(self).__name__}({type(self.model).__name__} on {self.mesh.name}, {self.backend.name}{state})"

    def __enter__(self) -> "ShardHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def describe(self) -> dict[str, Any]:
        """Summary for reports: backend, mesh, plan and how the parameters were split."""
        return {"backend": self.backend.name, "mesh": self.mesh.name,
                "plan": None if self.plan is None else self.plan.name, "params": self.specs.counts()}


def shard_module(model: torch.nn.Module, resolved: Resolved, specs_of: Callable[[torch.nn.Module], ShardSpecs], *,
                 hooks: Callable[[ShardHandle], Any] | None = None, rewrites: Callable[[], Any] | None = None,
                 keep_host_weights: bool = True, handle_type: type[ShardHandle] = ShardHandle) -> ShardHandle:
    """The one order every component is sharded in: rewrites -> specs (of the rewritten model) ->
    placement -> hooks. A failure at any step undoes the steps before it, so the model is left as
    it was.

    Args:
        model: the module, checked by the caller (nothing has been changed yet).
        resolved: the request, from :func:`resolve`.
        specs_of: the component's specs function (pure), called on the model after the rewrites.
        hooks: installs the component's activation hooks on the placed model and returns their
            handle (``remove()``); ``None``: none.
        rewrites: applies the model rewrites and returns their handle; ``None``: none.
        keep_host_weights: see :func:`shard_dit`.
        handle_type: the handle class to return (:class:`ShardHandle` or a subclass).
    """
    undo_rewrites = rewrites() if rewrites is not None else None
    try:
        specs = specs_of(model)
    except BaseException:
        if undo_rewrites is not None:
            undo_rewrites.remove()
        raise
    handle = handle_type(model, resolved, specs, rewrites=undo_rewrites, original_device=model_device(model),
                         host_tensors=host_tensors(model) if keep_host_weights else None)
    try:
        handle.moved = True  # until known otherwise: remove() moves it back
        handle.placed = resolved.backend.place(model, specs)
        handle.moved = model_device(model) != handle.original_device
        if not handle.moved:
            handle.host_tensors = None  # nothing to put back (jax: the model stays where it is)
        if hooks is not None:
            handle.hooks = hooks(handle)
    except BaseException:
        handle.remove()
        raise
    return handle


@dataclass(eq=False, repr=False)
class DitHandle(ShardHandle):
    """What :func:`shard_dit` did to one DiT; ``remove()`` undoes all of it, in reverse.

    ``placed`` is what the backend's ``run`` takes (``backend.run(dit, handle.placed, **inputs)``),
    ``specs`` every parameter's TP spec, ``sp`` the SP hooks' handle, ``patches`` the rewrites'
    handle (or ``None``)."""

    @property
    def dit(self) -> torch.nn.Module:
        return self.model

    @property
    def sp(self) -> SPHandle | None:
        return self.hooks

    @property
    def patches(self) -> Any:
        return self.rewrites

    def describe(self) -> dict[str, Any]:
        """Summary for reports: backend, mesh, padding, parameter split, SP points and last token counts."""
        out = {"backend": self.backend.name, "mesh": self.mesh.name, "padding": self.padding,
               "plan": None if self.plan is None else self.plan.name,
               "patches": list(self.resolved.patches), "params": self.specs.counts()}
        if self.sp is not None:
            out.update(self.sp.describe())
        return out


def shard_dit(dit: torch.nn.Module, mesh_or_plan: Any = None, backend: str | Backend | None = None,
              padding: str | None = None, patches: Sequence[str] | str = (), *,
              keep_host_weights: bool = True, anchor: bool = True, resolved: Resolved | None = None) -> DitHandle:
    """Shard one diffusers ``WanTransformer3DModel``: patches -> TP specs -> placement -> SP hooks.

    Args:
        dit: the model (real weights, or on the ``meta`` device for the ``jax`` backend: placement
            is then abstract, shapes and shardings only, for compile-only lowering).
        mesh_or_plan: a preset name (``"1x4"``, ``"2x4"``, ``"8x4"``, ...), a :class:`MeshSpec`, a
            backend's own mesh, or a :class:`~wan_sharding.plan.ShardingPlan` (its roles, FSDP,
            activation layout and padding apply).
        backend: ``"jax"`` (torchax, the default), ``"xla"`` (torch-xla SPMD), ``"tt"`` (Tenstorrent
            hardware) or a :class:`~wan_sharding.backends.Backend` bound to the mesh.
        padding: ``"mask"`` (default), ``"slice"`` or ``"none"``
            (:func:`~wan_sharding.dit.activation.apply_dit_sp_activation_sharding`); a plan's otherwise.
        patches: opt-in exact model rewrites by name (``wan_sharding.patches``).
        keep_host_weights: for backends that move the model to their device (``xla``, ``tt``): keep
            the original host parameter objects so ``remove()`` puts exactly those back; ``False``
            frees them while sharded and ``remove()`` copies the weights back from the device.
        anchor: keep the replicated constraint before each L-on-SP split (the tt-mlir workaround);
            ``False`` only to show on the real compiler that it is needed.
        resolved: an already :func:`resolve`-d request (``shard_pipeline`` resolves once for both
            experts); the other request arguments must then be left out.

    Returns:
        A :class:`DitHandle`: ``backend.run(dit, handle.placed, **inputs)`` runs a forward on the
        mesh; ``handle.remove()`` restores the model exactly.

    Raises:
        ShardingError: not a Wan model, already sharded, a model that does not shard on this mesh
            (heads or dims not divisible by TP), a contradiction between mesh, plan and padding.
        PatchError: a patch that does not fit. BackendError: the backend's stack is missing or sees
        a different number of devices. All raised before the model is changed.
    """
    if resolved is None:
        resolved = resolve(mesh_or_plan, backend, padding, patches)
    elif mesh_or_plan is not None or backend is not None or padding is not None or patches:
        raise ShardingError("shard_dit got a resolved request and request arguments too; pass one of them")
    check_dit(dit, resolved)
    return shard_module(  # type: ignore[return-value]
        dit, resolved, lambda m: shard_dit_specs(m, resolved.mesh_or_plan),
        rewrites=(lambda: apply_patches(dit, resolved.patches, mesh=resolved.mesh_or_plan)) if resolved.patches else None,
        hooks=lambda h: apply_dit_sp_activation_sharding(dit, resolved.mesh, backend=resolved.backend,
                                                         padding=resolved.padding, plan=resolved.plan, anchor=anchor),
        keep_host_weights=keep_host_weights, handle_type=DitHandle)


def check_dit(dit: torch.nn.Module, resolved: Resolved) -> None:
    """Everything :func:`shard_dit` can check on the model as it is, changing nothing: a Wan model
    without SP hooks, its TP split on the mesh, the SP points, and the patches' own checks."""
    check_wan_model(dit)
    if has_sp(dit):
        raise ShardingError("this model is already sharded (it carries sequence-parallel hooks); call its "
                            "handle's remove() first")
    try:  # LoRA layers: a variant, merged weights, a patch that would drop their terms
        check_layers(dit, resolved.patches)
    except LoraError as e:
        raise LoraShardingError(str(e)) from None
    shard_dit_specs(dit, resolved.mesh_or_plan)
    check_sp(dit, resolved.mesh, resolved.padding, resolved.plan)
    if resolved.patches:
        check_patches(dit, resolved.patches, mesh=resolved.mesh_or_plan)


# ---- where the weights are, and putting them back --------------------------------------------------


def host_tensors(dit: torch.nn.Module) -> list:
    """Every parameter and buffer object of ``dit``, with where it sits."""
    out = []
    for module in dit.modules():
        out += [(module, "param", n, t) for n, t in module._parameters.items() if t is not None]
        out += [(module, "buffer", n, t) for n, t in module._buffers.items() if t is not None]
    return out


def model_device(dit: torch.nn.Module) -> torch.device:
    """The device of ``dit``'s first parameter (the host CPU for a model without any)."""
    for p in dit.parameters():
        return p.device
    return torch.device("cpu")


def _return_to_host(h: ShardHandle) -> None:
    """Back to the host: the original parameter and buffer objects when they were kept (exact, and
    no device-to-host copy), else a copy of the device weights via ``.to(original_device)``."""
    if h.host_tensors is None:
        move_module(h.model, h.original_device)  # tied weights stay tied
        return
    for module, kind, name, tensor in h.host_tensors:
        if kind == "param":
            if module._parameters.get(name) is not tensor:
                module.register_parameter(name, tensor)
        elif module._buffers.get(name) is not tensor:
            module.register_buffer(name, tensor, persistent=name not in module._non_persistent_buffers_set)
    if any(t.device != h.original_device for *_, t in h.host_tensors) or \
            any(p.device != h.original_device for p in h.model.parameters()):  # moved in place, or added while sharded
        move_module(h.model, h.original_device)
