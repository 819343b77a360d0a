"""What the hooks the package installs on a model share, below every backend.

- :class:`ForwardState`: the token counts (and key mask) one sharded model's hooks share within a
  forward;
- :class:`RefusesCopy` and :class:`Hook`: an installed object that stops a deep copy or pickle of
  the model with a clear error, instead of copying a hook still bound to the original;
- the registry of models that carry sequence-parallel hooks (:func:`sp_state`), which the SP hooks
  (:mod:`wan_sharding.dit.activation`) fill and the tt backend's RMSNorm pins and the patches read.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .specs import ShardingError

__all__ = ["ForwardState", "Hook", "RefusesCopy", "forget_sp", "has_sp", "record_sp", "sp_state"]


@dataclass
class ForwardState:
    """What the hooks of one sharded model share within a forward: the valid and padded token
    counts (Python ints, static under tracing) and the key mask when the mode builds one."""

    valid_len: int | None = None
    padded_len: int | None = None
    key_mask: torch.Tensor | None = None

    @property
    def padded(self) -> bool:
        return self.valid_len is not None and self.padded_len != self.valid_len


class RefusesCopy:
    """For the objects the package installs on a model (hooks, attention processors): deep copy and
    pickling of the model reach them and stop with a clear error (``copy_refusal``). A copy would
    otherwise keep them bound to the original's forward state and backend and compute wrong results
    silently."""

    copy_refusal = ("a model with sequence parallelism applied cannot be copied or pickled (its hooks belong to the "
                    "original); call handle.remove() first, copy, then apply_dit_sp_activation_sharding to each copy")

    def __deepcopy__(self, memo: dict) -> Any:
        raise ShardingError(self.copy_refusal)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ShardingError(self.copy_refusal)


class Hook(RefusesCopy):
    """One hook the package installs on a model: a plain callable wrapper, so that copying or
    pickling the model (which would copy the hook by reference, still bound to the original's
    forward state and backend) stops with a clear error instead of giving a wrong model."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


# Models that currently carry SP hooks, with their hooks' forward state. Weak, so a dropped model
# is forgotten (the state holds no reference to the model).
_SP_MODELS: "weakref.WeakKeyDictionary[torch.nn.Module, ForwardState]" = weakref.WeakKeyDictionary()


def sp_state(dit: torch.nn.Module) -> ForwardState | None:
    """The forward state of the SP hooks on ``dit`` (valid and padded token counts of the forward
    being traced), ``None`` when it has none."""
    return _SP_MODELS.get(dit)


def has_sp(dit: torch.nn.Module) -> bool:
    """Whether ``dit`` carries sequence-parallel hooks now."""
    return dit in _SP_MODELS


def record_sp(dit: torch.nn.Module, state: ForwardState) -> None:
    """Record that ``dit`` now carries SP hooks sharing ``state`` (the SP hooks' own call)."""
    _SP_MODELS[dit] = state


def forget_sp(dit: torch.nn.Module) -> None:
    """Record that ``dit``'s SP hooks were removed."""
    _SP_MODELS.pop(dit, None)
