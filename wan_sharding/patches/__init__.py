"""Opt-in rewrites of one Wan DiT instance: exact (or measured) and reversible.

The package shards the unmodified diffusers model; these rewrites are what Tenstorrent measured as
faster on hardware, done per instance (no diffusers class is touched, two models in one process
do not affect each other) and undone by ``remove()`` (the same module objects back, and the same
parameter objects unless the model was moved to an XLA device meanwhile; bit-identical output). ``README.md`` beside this file has the table; each module's docstring the
details.

::

    from wan_sharding import shard_dit

    handle = shard_dit(dit, "2x4", backend="jax", patches="exact")  # every exact patch (EXACT_PATCHES)
    ...
    handle.remove()                                         # SP off, then the vanilla model again

Order: patches first, then ``shard_dit_specs`` and ``apply_dit_sp_activation_sharding``.
``patchify``, ``rope_tables``, ``prompt_kv``, ``ffn_rows`` and ``adaln_bf16`` also work on a model that
already has SP hooks; ``rope`` and ``qkv`` replace the self-attention processor that SP's padding
modes wrap, so on such a model (and for their removal while SP is on) they raise PatchError saying
to remove SP first.
``shard_dit_specs`` must always run after the patches (``patchify`` and ``qkv`` make new parameters).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..hooks import has_sp
from . import adaln_bf16, adaln_norm, ffn_rows, patchify, prompt_kv, qkv, rope, rope_tables
from .base import Patch, PatchContext, PatchError

# name -> patch, in the order ``apply_patches`` applies them (``rope`` before ``qkv`` fuses its
# permuted weights, and before ``rope_tables`` caches its layout; ``prompt_kv`` reads whichever
# projections the processor has)
PATCHES: dict[str, Patch] = {
    p.name: p for p in (patchify.PATCH, rope.PATCH, qkv.PATCH, rope_tables.PATCH, prompt_kv.PATCH, ffn_rows.PATCH,
                        adaln_norm.PATCH, adaln_bf16.PATCH)
}
EXACT_PATCHES: tuple[str, ...] = tuple(n for n, p in PATCHES.items() if p.exact)
EXACT = "exact"  # the name that selects every exact patch (apply_patches, --patches)


def patch_names(names: str | Sequence[str]) -> list[str]:
    """``names`` with :data:`EXACT` (``"exact"``) replaced by every name of :data:`EXACT_PATCHES`
    not given otherwise, in place; a single name may be given as a string. Other names are kept as
    they are (``apply_patches`` checks them)."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for n in names:
        if n == EXACT:
            out.extend(m for m in EXACT_PATCHES if m not in names and m not in out)
        else:
            out.append(n)
    return out

# model -> {patch name: the handle that applied it}. Weak: a dropped model is forgotten.
_PATCHED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, PatchesHandle]]" = weakref.WeakKeyDictionary()


def applied_patches(dit: torch.nn.Module) -> tuple[str, ...]:
    """The names of the patches currently applied to ``dit``, in application order."""
    on = _PATCHED.get(dit, {})
    return tuple(n for n in PATCHES if n in on)


@dataclass
class PatchesHandle:
    """What :func:`apply_patches` did to one model; ``remove()`` undoes it (also as a context manager)."""

    dit: torch.nn.Module
    names: tuple[str, ...]
    mesh: Any = None
    _undo: list = field(default_factory=list, repr=False)
    removed: bool = False

    @property
    def exact(self) -> bool:
        return all(PATCHES[n].exact for n in self.names)

    def describe(self) -> dict[str, Any]:
        """Summary for reports: each patch, whether it is exact (and its drift if not), the TP degree."""
        return {
            "patches": {n: {"exact": PATCHES[n].exact, "drift": PATCHES[n].drift, "what": PATCHES[n].summary}
                        for n in self.names},
            "tp": None if self.mesh is None else self.mesh.tp,
            "removed": self.removed,
        }

    def remove(self) -> None:
        """Undo every patch of this handle, in reverse order. PatchError (nothing undone) when the
        model has SP hooks that wrap a patch's processor, or another handle's patch depends on one
        of these."""
        if self.removed:
            return
        on = _PATCHED.get(self.dit, {})
        others = {n for n, h in on.items() if h is not self}
        if has_sp(self.dit):
            stuck = [n for n in self.names if not PATCHES[n].after_sp]
            if stuck:
                raise PatchError(f"patch {stuck[0]!r} cannot be removed while sequence parallelism is applied (its "
                                 "processor is wrapped by SP's): call the SP handle's remove() first")
        for n in self.names:
            later = [m for m in PATCHES[n].precedes if m in others]
            if later:
                raise PatchError(f"patch {n!r} cannot be removed while {later[0]!r} (applied after it by another "
                                 f"handle) is on: remove that handle first")
        for name, undo in reversed(self._undo):
            undo()
            on.pop(name, None)
        self._undo.clear()
        self.removed = True

    def __enter__(self) -> "PatchesHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _mesh_spec(mesh: Any):
    if mesh is None:
        return None
    from ..mesh import MeshError, as_mesh_spec
    from ..plan import ShardingPlan

    if isinstance(mesh, ShardingPlan):
        return mesh.mesh()
    try:
        return as_mesh_spec(mesh)
    except MeshError as e:
        raise PatchError(str(e)) from None


def check_patches(dit: torch.nn.Module, names: Sequence[str] | str, *, mesh: Any = None) -> None:
    """Every check :func:`apply_patches` makes before it changes anything, alone: PatchError (one
    line) when the named patches do not fit ``dit`` on ``mesh``; the model is not changed."""
    _checked(dit, names, mesh)


def _checked(dit: torch.nn.Module, names: Sequence[str] | str, mesh: Any) -> tuple[list[str], PatchContext]:
    """The patch names in application order and their context, once every check passed. Every exact
    patch asked for (``exact``, or all of them named) means those that suit the model: one that does
    not apply to this kind of model (``Patch.suits``: ``adaln_norm`` on TI2V-5B) is left out."""
    names = patch_names(names)
    if set(EXACT_PATCHES) <= set(names):
        names = [n for n in names if not (n in EXACT_PATCHES and PATCHES[n].suits(dit) is not None)]
    unknown = [n for n in names if n not in PATCHES]
    if unknown:
        raise PatchError(f"unknown patch {unknown[0]!r}; choose from {', '.join(PATCHES)} (or {EXACT!r} for every "
                         "exact one)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PatchError(f"patch {repeated[0]!r} is named twice; name each patch once")
    from diffusers import WanTransformer3DModel

    if not isinstance(dit, WanTransformer3DModel):
        raise PatchError(f"patches rewrite a diffusers WanTransformer3DModel, got {type(dit).__name__}; pass the "
                         "pipeline's transformer (pipe.transformer / pipe.transformer_2)")
    ordered = [n for n in PATCHES if n in names]
    on = _PATCHED.get(dit, {})
    for n in ordered:
        if n in on:
            raise PatchError(f"patch {n!r} is already applied to this model; call its PatchesHandle's remove() "
                             "first, or leave it on")
    if has_sp(dit):
        late = [n for n in ordered if not PATCHES[n].after_sp]
        if late:
            raise PatchError(f"patch {late[0]!r} must be applied before sequence parallelism: call the SP handle's "
                             f"remove(), apply_patches, then apply_dit_sp_activation_sharding again")
    for n in ordered:
        after = [m for m in PATCHES[n].precedes if m in on]
        if after:
            raise PatchError(f"patch {n!r} must be applied before {after[0]!r}, which this model already has: remove "
                             f"that handle and apply both in one call, apply_patches(dit, [{n!r}, {after[0]!r}])")
    ctx = PatchContext(_mesh_spec(mesh))
    for n in ordered:
        PATCHES[n].check(dit, ctx)

    return ordered, ctx


def apply_patches(dit: torch.nn.Module, names: Sequence[str] | str, *, mesh: Any = None) -> PatchesHandle:
    """Apply the named rewrites to this model instance.

    Args:
        dit: a diffusers ``WanTransformer3DModel`` (real weights or on the ``meta`` device).
        names: patch names from :data:`PATCHES` (``"patchify"``, ``"rope"``, ``"qkv"``,
            ``"rope_tables"``, ``"prompt_kv"``, ``"adaln_bf16"``), in any order: they are applied
            in the order of :data:`PATCHES`; ``"exact"`` stands for every exact one
            (:data:`EXACT_PATCHES`).
        mesh: the mesh the model will be sharded on (a preset name, :class:`MeshSpec`,
            :class:`ShardingPlan`, or a torch-xla / JAX mesh). ``qkv`` lays its weights out for
            this mesh's TP degree and raises PatchError without it; other patches ignore it.

    Returns:
        A :class:`PatchesHandle`; ``handle.remove()`` restores the vanilla model.

    Raises:
        PatchError: an unknown or repeated name, a patch already applied to this model, not a Wan
            model, a model or config a patch does not fit, a patch that must precede one already
            applied, or ``rope`` / ``qkv`` on a model that already has SP hooks. Every check runs
            before anything is changed.
    """
    ordered, ctx = _checked(dit, names, mesh)
    handle = PatchesHandle(dit, tuple(ordered), ctx.mesh)
    record = _PATCHED.setdefault(dit, {})
    try:
        for n in ordered:
            handle._undo.append((n, PATCHES[n].apply(dit, ctx)))
            record[n] = handle
    except BaseException:
        for n, undo in reversed(handle._undo):
            undo()
            record.pop(n, None)
        raise
    return handle


__all__ = ["EXACT", "EXACT_PATCHES", "PATCHES", "Patch", "PatchError", "PatchesHandle", "applied_patches",
           "apply_patches", "check_patches", "patch_names"]
