"""Sequence parallelism on the flat token dim L, through sharding constraints on activations.

Per instance and reversible: forward hooks on this model's ``rope``, ``condition_embedder``,
``blocks[0]`` and ``proj_out``, and per-module attention processors on its self-attentions. No
method of any diffusers class is replaced, so other instances are untouched.

Data flow (``WAN_SP_POINTS``)::

    patch_embedding -> flatten -> (B, L, D) replicated
      -> constrain(replicated) -> pad L to SP*32 -> constrain(L on SP)    # blocks[0] pre-hook
    rope tables (1, L, 1, d): the same replicated -> pad -> L-on-SP        # rope hook
    blocks ... (B, L_pad/SP, D) per device
    proj_out -> constrain(replicated) -> slice back to L                   # proj_out hook

On a cfg mesh every one of these constraints also puts a batch of (cond, uncond) halves on the cfg
axis (``Backend.activation_spec``): each group runs one branch, and the SP gathers stay inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .attention import PADDING_MODES, build_key_mask
from ..backends import Backend, get_backend
from ..hooks import ForwardState, Hook, forget_sp, has_sp, record_sp
from ..mesh import MeshSpec, as_mesh_spec, padded_length
from ..options import DEFAULT_PADDING
from ..plan import SELF_ATTENTION, WAN_SP_POINTS, ShardingPlan, SPGather, SPSplit
from ..specs import ShardingError, pattern_regex
from .specs import check_wan_model

def _pad_dim(x: torch.Tensor, dim: int, to: int) -> torch.Tensor:
    extra = to - x.shape[dim]
    if extra == 0:
        return x
    pads = [0, 0] * (x.ndim - 1 - dim) + [0, extra]  # F.pad lists dims from the last one
    return F.pad(x, pads)


def _sp_spec(ndim: int, dim: int, axis: str | None) -> tuple:
    spec = [None] * ndim
    spec[dim] = axis
    return tuple(spec)


def _device_check(be: Backend):
    """A forward pre-hook for the model itself: a backend that runs on its device (torch-xla, tt)
    needs the forward's input and weights there, and a plain eager call of the hooked model on host
    tensors gets a clear error instead of torch-xla's. ``None`` for other backends.

    It runs once per forward, at its entry, and never inside a compiled one: dynamo does not trace
    it (``torch.compiler.disable``; under tt's ``inline_inbuilt_nn_modules=False`` a top-level hook
    runs before dynamo picks up the forward's frame), so no untraceable call splits the graph and
    no frame of its own counts against dynamo's recompile limit. The device type is read here,
    once, outside any forward."""
    if not getattr(be, "uses_torch_xla", False):
        return None
    device_type = be.device.type

    @torch.compiler.disable
    def check(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        weight = next(mod.parameters(), None)
        for t in (x, weight):
            if t is not None and t.device.type != device_type:
                raise ShardingError(
                    f"this model has SP hooks for the {be.name} backend but ran eagerly on {t.device.type} tensors; "
                    f"run it with backend.run(dit, backend.place(dit, specs), **inputs) (or through shard_pipeline's "
                    "ShardedTransformer), which puts the model and inputs on the device"
                )
        return None

    return check


@dataclass
class SPHandle:
    """What :func:`apply_dit_sp_activation_sharding` did to one model; ``remove()`` undoes it."""

    dit: torch.nn.Module
    mesh: MeshSpec
    backend: Backend
    padding: str
    points: list[str]
    state: ForwardState
    _hooks: list = field(default_factory=list, repr=False)
    _processors: dict = field(default_factory=dict, repr=False)
    removed: bool = False

    def remove(self) -> None:
        """Remove every hook and put the original attention processors back."""
        if self.removed:
            return
        for h in self._hooks:
            h.remove()
        for module, proc in self._processors.items():
            module.set_processor(proc)
        self._hooks.clear()
        self._processors.clear()
        forget_sp(self.dit)
        self.removed = True

    def __enter__(self) -> "SPHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def describe(self) -> dict[str, Any]:
        """Summary for reports: mesh, SP size, padding mode, constraint points and last padding."""
        return {
            "mesh": self.mesh.name,
            "sp": self.mesh.sp,
            "padding": self.padding,
            "pad_multiple": self.mesh.seq_multiple if self.padding != "none" else 1,
            "sp_points": list(self.points),
            "last_tokens": self.state.valid_len,
            "last_padded_tokens": self.state.padded_len,
        }


def check_sp(dit: torch.nn.Module, mesh: Any, padding: str, plan: ShardingPlan | None = None) -> MeshSpec:
    """Check that SP with ``padding`` fits ``dit`` on ``mesh`` (and ``plan``), changing nothing:
    a Wan model, a known padding mode, the plan's mesh, every module the SP points name. Returns
    the mesh with its roles (the plan's when there is one)."""
    check_wan_model(dit)
    if padding not in PADDING_MODES:
        raise ShardingError(f"unknown padding mode {padding!r}; choose one of {sorted(PADDING_MODES)}")
    # Roles (which axis is SP, which TP) come from the plan when there is one; the backend only
    # needs the mesh's shape and axis names.
    mesh_spec = as_mesh_spec(mesh)
    if plan is not None:
        if (mesh_spec.shape, mesh_spec.axis_names) != (plan.mesh_shape, plan.axis_names):
            raise ShardingError(f"plan is for mesh {plan.mesh()}, not {mesh_spec}")
        mesh_spec = plan.mesh()
    modules = dict(dit.named_modules())
    for point in WAN_SP_POINTS:
        if point.module not in modules:
            raise ShardingError(f"model has no module {point.module!r} named by the SP points")
    return mesh_spec


def apply_dit_sp_activation_sharding(
    dit: torch.nn.Module,
    mesh: Any,
    backend: str | Backend = "xla",
    padding: str | None = None,
    plan: ShardingPlan | None = None,
    *,
    anchor: bool = True,
) -> SPHandle:
    """Shard the flat token dim L of a Wan DiT's activations over the mesh's SP axis.

    Args:
        dit: a diffusers ``WanTransformer3DModel``.
        mesh: a preset name, :class:`MeshSpec`, or the backend's own mesh.
        backend: ``"xla"`` (torch-xla SPMD), ``"jax"`` (torchax), ``"tt"`` (Tenstorrent's torch
            plugin) or a :class:`~wan_sharding.backends.Backend` instance.
        padding: how L is padded to a multiple of SP x 32 and attention kept exact: ``"slice"``
            (K/V sliced back in every block), ``"mask"`` (additive key mask built once per
            forward) or ``"none"`` (no padding). Padding is skipped when L is already aligned.
            Default: the plan's mode, else ``"mask"`` (the cheaper exact mode, see docs/compile-only.md).
        plan: a :class:`~wan_sharding.plan.ShardingPlan`; its mesh roles, padding and activation
            layout apply (``layout="sharded"`` keeps D TP-sharded on every block's output).
        anchor: keep the replicated constraint in front of each L-on-SP split (the tt-mlir
            workaround). ``False`` exists only to show, on the real compiler, that it is needed.

    Returns:
        An :class:`SPHandle`; ``handle.remove()`` restores the model exactly.

    Raises:
        ShardingError: not a Wan model, unknown padding mode, or SP already applied to this model.
        BackendError: the backend is missing or sees a different number of devices.
    """
    check_wan_model(dit)
    if has_sp(dit):
        raise ShardingError("sequence parallelism is already applied to this model; call handle.remove() first")
    if padding is None:  # only None means "the default": "" is a bad value, not a request for mask
        padding = plan.padding if plan is not None else DEFAULT_PADDING
    mesh_spec = check_sp(dit, mesh, padding, plan)
    be = get_backend(backend, mesh)  # checks the stack and the device count before any change
    modules = dict(dit.named_modules())

    state = ForwardState()
    handle = SPHandle(dit, mesh_spec, be, padding, [], state)
    sp_axis, cfg_axis = mesh_spec.sp_axis, mesh_spec.cfg_axis
    multiple = mesh_spec.seq_multiple if padding != "none" else 1

    def shard_tokens(x: torch.Tensor, dim: int) -> torch.Tensor:
        # The replicated anchor first is a tt-mlir workaround: with only the L-on-SP constraint,
        # Shardy pushes the split back into the 5-D -> 3-D reshape before it (patchify, rope) and
        # tt-mlir fails to retype that reshape ("number of output elements doesn't match").
        # Anchored, the split lands after the reshape as one clean scatter. Padding sits between
        # the two, on the replicated tensor.
        if sp_axis is None:  # TP-only plan: tile padding, no SP constraint
            x = _pad_dim(x, dim, padded_length(x.shape[dim], multiple))
            # TP-only groups of a cfg mesh: the pair's batch pinned on cfg where the blocks start
            return be.constrain(x, (None,) * x.ndim) if cfg_axis is not None else x
        if anchor:
            x = be.constrain(x, (None,) * x.ndim)
        x = _pad_dim(x, dim, padded_length(x.shape[dim], multiple))
        return be.constrain(x, _sp_spec(x.ndim, dim, sp_axis))

    check = _device_check(be)
    if check is not None:  # first, so it runs before any other hook of the forward
        # not a Hook: the other hooks already refuse copies, and dynamo must see the disabled function itself
        handle._hooks.append(dit.register_forward_pre_hook(check, with_kwargs=True, prepend=True))

    split = f"{'replicated -> ' if anchor else ''}pad -> L-on-{sp_axis}"
    for point in WAN_SP_POINTS:
        module = modules[point.module]
        if isinstance(point, SPSplit) and point.arg is None:  # rope: split both output tables
            def rope_hook(mod, args, out, dim=point.dim):
                return tuple(shard_tokens(t, dim) for t in out)

            handle._hooks.append(module.register_forward_hook(Hook(rope_hook)))
            handle.points.append(f"{point.module} outputs: {split}")
        elif isinstance(point, SPSplit):  # block-stack entry
            def entry_hook(mod, args, kwargs, dim=point.dim, arg=point.arg):
                x = kwargs[arg] if arg in kwargs else args[0]
                state.valid_len = x.shape[dim]
                state.padded_len = padded_length(state.valid_len, multiple)
                state.key_mask = None
                if padding == "mask" and state.padded:
                    mask = build_key_mask(state.valid_len, state.padded_len, x)
                    # Whole on every device, like the gathered K it masks: left free, the
                    # partitioner may split it over SP along with the queries, and tt-mlir's fused
                    # SDPA then sees a mask shorter than K. One constraint per forward.
                    state.key_mask = be.constrain(mask, (None,) * mask.ndim) if sp_axis is not None else mask
                x = shard_tokens(x, dim)
                if arg in kwargs:
                    return args, {**kwargs, arg: x}
                return (x, *args[1:]), kwargs

            handle._hooks.append(module.register_forward_pre_hook(Hook(entry_hook), with_kwargs=True))
            handle.points.append(f"{point.module}.{point.arg}: {split}")
        elif isinstance(point, SPGather):  # exit: back to replicated, then drop the padding
            def exit_hook(mod, args, out, dim=point.dim):
                if sp_axis is not None or cfg_axis is not None:  # whole on each group (cfg: its branch)
                    out = be.constrain(out, (None,) * out.ndim)
                return out.narrow(dim, 0, state.valid_len) if state.padded else out

            handle._hooks.append(module.register_forward_hook(Hook(exit_hook)))
            handle.points.append(f"{point.module} output: replicated, slice to L")

    # Wan 2.2 TI2V: per-token timesteps make temb (B, L, D) and timestep_proj (B, L, 6D); they
    # must follow the padded token dim (padded tokens get zeros and are discarded at the exit).
    def cond_hook(mod, args, kwargs, out):
        if kwargs.get("timestep_seq_len") is None or multiple == 1:
            return out
        temb, proj, *rest = out
        to = padded_length(temb.shape[1], multiple)
        return (_pad_dim(temb, 1, to), _pad_dim(proj, 1, to), *rest)

    handle._hooks.append(modules["condition_embedder"].register_forward_hook(Hook(cond_hook), with_kwargs=True))

    if plan is not None and plan.layout == "sharded" and mesh_spec.tp_axis is not None:
        # tt-metal's layout: the residual stream stays TP-sharded on D between blocks.
        residual = (None, sp_axis, mesh_spec.tp_axis)
        for block in dit.blocks:
            handle._hooks.append(block.register_forward_hook(Hook(lambda mod, args, out: be.constrain(out, residual))))
        handle.points.append(f"blocks.* outputs: D-on-{mesh_spec.tp_axis}")

    mode_cls = PADDING_MODES[padding]
    if mode_cls is not None:
        rx = pattern_regex(SELF_ATTENTION)
        for name, module in modules.items():
            if rx.match(name):
                handle._processors[module] = module.processor
                module.set_processor(mode_cls(module.processor, state))

    record_sp(dit, state)
    return handle
