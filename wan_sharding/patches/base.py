"""What every patch is: a name, whether it is exact, and check / apply / undo on one model instance."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

Undo = Callable[[], None]


class PatchError(ValueError):
    """A patch cannot be applied to (or removed from) this model here. One line: the problem and
    the fix. Raised before anything is changed."""


@dataclass(frozen=True)
class PatchContext:
    """What a patch may need besides the model: the mesh it will be sharded on (a
    :class:`~wan_sharding.mesh.MeshSpec`, or ``None`` when the caller gave none)."""

    mesh: Any = None

    def tp(self, patch: str) -> int:
        """The TP degree the weights are laid out for; PatchError when no mesh was given."""
        if self.mesh is None:
            raise PatchError(
                f"patch {patch!r} lays its weights out per TP shard and needs the TP degree: pass the mesh "
                f"the model will be sharded on, e.g. apply_patches(dit, [{patch!r}], mesh='2x4')"
            )
        return self.mesh.tp


class Patch:
    """One opt-in rewrite of a ``WanTransformer3DModel`` instance.

    - ``exact``: output equal to the vanilla model's up to floating-point reordering (fp32 max-abs
      within 1e-5 on the tiny models, ``tests/test_patches.py``); ``drift`` says what an inexact
      patch changes, measured.
    - ``after_sp``: may also be applied to (and removed from) a model that already carries the SP
      hooks of ``apply_dit_sp_activation_sharding``. The documented order is patches first either way.
    - ``precedes``: patches this one must be applied before (``apply_patches`` orders the names of
      one call itself; across calls the order is checked).
    """

    name: str = "?"
    exact: bool = True
    drift: str | None = None
    after_sp: bool = False
    precedes: tuple[str, ...] = ()
    summary: str = ""

    def suits(self, dit: torch.nn.Module) -> str | None:
        """Why this patch does not apply to this kind of model at all (None: it does). ``exact``
        leaves such a patch out; named on its own it is refused with this reason."""
        return None

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        """Raise PatchError if the patch does not fit this model; must change nothing."""

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        """Rewrite the model instance; return the function that undoes exactly this."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<patch {self.name!r} exact={self.exact}>"


# ---- small helpers the patches share ------------------------------------------------------------


def wan_classes():
    from diffusers.models.transformers import transformer_wan

    return transformer_wan


def blocks_of(dit: torch.nn.Module) -> Iterable[torch.nn.Module]:
    return list(dit.blocks)


def set_children(module: torch.nn.Module, items: list[tuple[str, torch.nn.Module]]) -> None:
    """Replace ``module``'s submodules by ``items``, in that order (``named_parameters`` order is
    part of what ``remove()`` restores)."""
    for name in list(module._modules):
        del module._modules[name]
    for name, child in items:
        module._modules[name] = child


def take_data(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's tensor, leaving the Parameter object holding an empty one: a rewrite that
    copies weights into a new layout keeps the original objects (for ``remove()``) without
    keeping two copies of the weights in memory."""
    data = param.data
    param.data = torch.empty(0, dtype=data.dtype, device=data.device)
    return data


def put_data(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Give ``module``'s parameter ``name`` the tensor ``tensor``: the same Parameter object where the
    tensor types allow it; a new one where they do not (a model moved to an XLA device since:
    ``Module.to`` replaces Parameter objects there too)."""
    param = getattr(module, name)
    if torch._has_compatible_shallow_copy_type(param, tensor):
        param.data = tensor
    else:
        setattr(module, name, torch.nn.Parameter(tensor, requires_grad=param.requires_grad))


def new_linear(weight: torch.Tensor, bias: torch.Tensor | None, like: torch.nn.Linear,
               cls: type[torch.nn.Linear] = torch.nn.Linear, **extra: Any) -> torch.nn.Linear:
    """An ``nn.Linear`` (or subclass) holding ``weight`` / ``bias`` as they are (no init, no copy)."""
    out_f, in_f = weight.shape
    with torch.device("meta"):
        lin = cls(in_f, out_f, bias=bias is not None, **extra)
    grad = like.weight.requires_grad
    lin.weight = torch.nn.Parameter(weight, requires_grad=grad)
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias, requires_grad=grad)
    return lin


def instance_override(module: torch.nn.Module, name: str = "forward") -> Any:
    """What the instance itself sets for ``name`` (not its class), or None."""
    return module.__dict__.get(name)
