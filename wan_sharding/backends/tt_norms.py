"""The RMSNorm pins a TP mesh needs on the tt backend, so tt-mlir fuses the norm instead of failing.

tt-xla's ``torch.compile(backend="tt")`` marks every ``nn.RMSNorm`` (and every ``F.rms_norm`` /
``torch.rms_norm`` call) as the composite ``tenstorrent.rms_norm`` (tt-xla
``python_package/tt_torch/composite_ops.py``, ``replacements``; on by default in
``backend/passes.py::handle_composite_ops``). Wan's ``norm_q`` / ``norm_k`` normalise over all
heads' channels, which TP splits. With the input left split, tt-mlir refuses the composite
(1x4: "'ttir.rms_norm' op input and output must have the same shape"; 2x4: "normalized_shape
dimensions must match trailing dimensions of input tensor"). Pinned whole along the channels at
its input, and its result whole then split again, Shardy writes all_gather -> rms_norm ->
all_slice, which tt-mlir's ``FuseDistributedCustomCalls`` turns into one ``distributed_rms_norm``
on the local shards (no gathered activation left). The weight stays split over TP as placed: the
fused op takes each operand's local shard, and a whole weight beside a local input fails
("'ttir.distributed_rms_norm' op weight tensor's last dimension must match input's last
dimension"), so :func:`norm_pin_refusal` refuses that placement before anything compiles.

:class:`NormPins` places those pins on one model: a forward pre-hook and a forward hook per norm
module, per instance, acting only while dynamo traces (``torch.compiler.is_compiling()``: the
composite exists only in tt's compiled graphs; a lazy forward keeps its plain math, where the pins
would only gather Q and K). The compile-only path pins its own composite the same way
(:func:`norm_pin_specs`, used by :mod:`wan_sharding.compile.composites`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..hooks import Hook, sp_state
from ..mesh import MeshSpec
from ..plan import NORM_COLWISE
from ..specs import Spec, resolve_styles


def norm_pin_specs(shape: tuple[int, ...], split_tokens: int | None, sp_axis: Any, tp_axis: Any) -> tuple[Spec, Spec, Spec]:
    """For an RMSNorm over TP-split channels: the input's pin (whole channels), the result's
    (whole), then the result split again over ``tp_axis``. The token dim (second to last) keeps
    its split over ``sp_axis`` (``None``: no SP) when it has the length the SP hooks split
    (``split_tokens``); any other (the prompt's) is whole. Two result constraints, as the SP
    anchor: a single split constraint is folded into the custom call's result type and its shapes
    no longer agree. Plain values only: dynamo traces this inside the hooks."""
    if len(shape) < 2:
        return (None,), (None,), (tp_axis,)
    split = sp_axis is not None and shape[-2] == split_tokens
    lead = (None,) * (len(shape) - 2) + ((sp_axis if split else None),)
    return lead + (None,), lead + (None,), lead + (tp_axis,)


def pin_axes(mesh: MeshSpec) -> tuple[Any, Any]:
    """The SP axis (``None`` when SP is 1) and the TP axis, as :func:`norm_pin_specs` takes them."""
    return (mesh.sp_axis if mesh.sp > 1 else None), mesh.tp_axis


def tp_split_norms(dit: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's ``nn.RMSNorm`` modules whose channels the TP table splits (``norm_colwise``:
    Wan's ``norm_q``, ``norm_k``, ``norm_added_k``), by name. A model without ``nn.RMSNorm``
    (the UMT5 text encoder: its norms are its own module, whole on every device) has none."""
    if not any(isinstance(m, torch.nn.RMSNorm) for m in dit.modules()):
        return {}
    owners = {name.rpartition(".")[0] for name, style in resolve_styles(dit).items() if style == NORM_COLWISE}
    return {name: m for name, m in dit.named_modules() if name in owners and isinstance(m, torch.nn.RMSNorm)}


def norm_pin_refusal(dit: torch.nn.Module, mesh: MeshSpec, placed: Mapping[str, Spec] | None) -> str | None:
    """One line naming why the tt compile of ``dit`` on ``mesh`` would still fail in tt-mlir with
    the pins, and the fix; ``None`` when it will not. ``placed``: the weight specs the backend
    placed (by parameter name), ``None`` when it did not place the model (then only the norms'
    shapes are checked)."""
    if mesh.tp == 1:
        return None
    pinned = tp_split_norms(dit)
    for name, norm in pinned.items():
        if len(norm.normalized_shape) != 1:
            return (f"{name} normalises over {tuple(norm.normalized_shape)}: the tt backend's TP pins split only the last "
                    "dim; use the diffusers Wan config (RMSNorm over the channels) or a mesh with TP 1")
    for name, norm in dit.named_modules():
        if not isinstance(norm, torch.nn.RMSNorm) or norm.weight is None or placed is None:
            continue
        spec = tuple(placed.get(f"{name}.weight", (None,)))
        if name in pinned and spec[:1] != (mesh.tp_axis,):
            return (f"{name}.weight is placed {spec} on TP mesh {mesh.name} while its input channels are split over "
                    f"{mesh.tp_axis!r}: tt-mlir's distributed_rms_norm would get a whole weight beside a local input "
                    "(\"weight tensor's last dimension must match input's last dimension\"); place it split over "
                    f"{mesh.tp_axis!r} as shard_dit_specs does (the plan's norm_colwise)")
        if name not in pinned and mesh.tp_axis in spec:
            return (f"{name}.weight is placed {spec}, split over {mesh.tp_axis!r}, but {name} is not one of the TP plan's "
                    "norm_colwise norms the tt backend pins: tt-xla's tenstorrent.rms_norm on it would fail in tt-mlir; "
                    "place it replicated (shard_dit_specs) or name it norm_colwise in the plan")
    return None


class NormPins:
    """The pins of :func:`norm_pin_specs` on every TP-split RMSNorm of one model, through the
    backend's constraint (``tt::sharding_constraint`` on the tt backend). ``remove()`` takes them
    off. Holds no reference to the model, so a backend can keep it in a weak map keyed by it."""

    def __init__(self, backend: Any, dit: torch.nn.Module):
        self.backend = backend
        self.axes = pin_axes(backend.mesh)  # read here: dynamo cannot trace the mesh's axis sizes
        # The SP hooks' forward state: its padded length says which token dims they split.
        self.state = sp_state(dit)
        self.names = sorted(tp_split_norms(dit))
        self._handles: list[Any] = []
        modules = dict(dit.named_modules())
        for name in self.names:
            self._handles.append(modules[name].register_forward_pre_hook(Hook(self._pin_input)))
            self._handles.append(modules[name].register_forward_hook(Hook(self._pin_result)))

    def stale(self, dit: torch.nn.Module) -> bool:
        """Whether the model's SP hooks changed since the pins were placed."""
        return sp_state(dit) is not self.state

    def _specs(self, x: torch.Tensor) -> tuple[Spec, Spec, Spec]:
        split = self.state.padded_len if self.state is not None else None
        return norm_pin_specs(tuple(x.shape), split, *self.axes)

    def _pin_input(self, mod: torch.nn.Module, args: tuple) -> tuple | None:
        if not torch.compiler.is_compiling():
            return None
        return (self.backend.constrain(args[0], self._specs(args[0])[0]), *args[1:])

    def _pin_result(self, mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if not torch.compiler.is_compiling():
            return None
        _, whole, split = self._specs(out)
        return self.backend.constrain(self.backend.constrain(out, whole), split)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
