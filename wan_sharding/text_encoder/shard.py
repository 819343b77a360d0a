"""Shard one UMT5 text encoder: :func:`shard_text_encoder`, its handle and its one hook.

The encoder goes through the package's one composition (:func:`wan_sharding.compose.shard_module`):
``resolve`` (the same mesh, plan and backend rules as the DiT) -> this module's checks (nothing
changed yet) -> specs (:func:`~.specs.shard_text_encoder_specs`) -> placement -> the mask hook.
``TextEncoderHandle.remove()`` undoes it in reverse.

The one hook: the Wan pipelines call the encoder with a 2-D padding mask ``(B, L)`` of ones and
zeros. transformers turns it into the 4-D attention mask inside the forward by indexing it with
``arange`` index tensors; for a batch of one, torchax (the ``jax`` backend) reads the batch index as a
scalar and cannot trace it ("ConcretizationTypeError"). The hook hands the encoder the additive 4-D
mask ``(B, 1, 1, L)`` (0 where a key is kept, the dtype's minimum where it is padding) that the
attention then adds to its scores, on every backend: one code path, and the same scores as the 2-D
mask's (a padded key's score is the minimum either way, its probability exactly 0).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..backends import Backend
from ..compose import Resolved, ShardHandle, resolve, shard_module
from ..hooks import Hook
from ..specs import ShardingError
from .specs import check_umt5_model, shard_text_encoder_specs

__all__ = ["TextEncoderHandle", "check_text_encoder", "shard_text_encoder", "sharded_text_encoder"]

# Encoders that are sharded now -> their handle (weak both ways: a dropped encoder is forgotten).
_SHARDED: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[TextEncoderHandle]]" = weakref.WeakKeyDictionary()


class MaskHook(Hook):
    """The encoder's forward pre-hook: a 2-D padding mask in, the additive 4-D mask out (module doc)."""

    copy_refusal = ("a sharded text encoder cannot be copied or pickled (its mask hook and weights belong to the "
                    "original on the mesh); call handle.remove() first, copy, then shard_text_encoder each copy")

    def __init__(self, encoder: torch.nn.Module):
        super().__init__(self._additive)
        self.handle = encoder.register_forward_pre_hook(self, with_kwargs=True)

    @staticmethod
    def _additive(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if "attention_mask" in kwargs:
            mask, at = kwargs["attention_mask"], None
        elif len(args) > 1:
            mask, at = args[1], 1
        else:
            return None
        if mask is None or mask.ndim != 2:
            return None  # no mask, or already a 4-D one: as the caller gave it
        dtype = module.get_input_embeddings().weight.dtype  # the scores' dtype (the embeddings')
        keep = mask[:, None, None, :] != 0
        # no arithmetic with a Python float: torchax would compute it in float32, which the scores
        # (and Tenstorrent's fused attention, bf16 operands only) would then follow
        additive = torch.zeros_like(keep, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
        if at is None:
            return args, {**kwargs, "attention_mask": additive}
        return (*args[:at], additive, *args[at + 1:]), kwargs

    def remove(self) -> None:
        self.handle.remove()


@dataclass(eq=False, repr=False)  # ShardHandle's short repr
class TextEncoderHandle(ShardHandle):
    """What :func:`shard_text_encoder` did to one encoder; callable as the pipeline calls the
    encoder: ``handle(input_ids, attention_mask)`` returns what the encoder returns (its output
    with ``last_hidden_state``, on the host), run on the mesh. ``remove()`` undoes all of it."""

    calls: int = 0

    @property
    def encoder(self) -> torch.nn.Module:
        return self.model

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden state ``(B, L, d_model)`` on the host, one program on the mesh."""
        if self.removed:
            raise ShardingError("this text encoder's sharding was removed by handle.remove(); call the encoder "
                                "itself, or shard it again")
        args = (input_ids,) if attention_mask is None else (input_ids, attention_mask)
        with torch.no_grad():
            out = self.backend.run(self.model, self.placed, *args)
        self.calls += 1
        return out

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 return_dict: bool = True) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        out = self.encode(input_ids, attention_mask)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=out) if return_dict else (out,)

    def remove(self) -> None:
        ShardHandle.remove(self)
        if _SHARDED.get(self.model) is not None and _SHARDED[self.model]() is self:
            del _SHARDED[self.model]

    def describe(self) -> dict[str, Any]:
        """Summary for reports: backend, mesh, plan, how the parameters were split, calls so far."""
        return {**super().describe(), "calls": self.calls}


def sharded_text_encoder(encoder: torch.nn.Module) -> TextEncoderHandle | None:
    """The live handle of a sharded encoder, or ``None``."""
    ref = _SHARDED.get(encoder)
    handle = ref() if ref is not None else None
    return handle if handle is not None and not handle.removed else None


def check_text_encoder(encoder: torch.nn.Module, resolved: Resolved) -> None:
    """Everything :func:`shard_text_encoder` can check on the encoder as it is, changing nothing: a
    UMT5 encoder, not sharded already, its TP split on the mesh."""
    check_umt5_model(encoder)
    live = sharded_text_encoder(encoder)
    if live is not None:
        raise ShardingError(f"this text encoder is already sharded (on {live.mesh.name}); call its handle's "
                            "remove() before sharding it again")
    shard_text_encoder_specs(encoder, resolved.mesh_or_plan)


def shard_text_encoder(encoder: torch.nn.Module, mesh_or_plan: Any = None, backend: str | Backend | None = None, *,
                       keep_host_weights: bool = True, resolved: Resolved | None = None) -> TextEncoderHandle:
    """Shard a UMT5 text encoder over a mesh: Megatron TP on its weights (:data:`~.specs.UMT5_TP_TABLE`).

    Args:
        encoder: a transformers ``UMT5EncoderModel`` (the Wan 2.2 pipelines' ``text_encoder``).
        mesh_or_plan: a preset name (``"2x4"``), a :class:`~wan_sharding.mesh.MeshSpec`, a backend's
            own mesh, or a :class:`~wan_sharding.plan.ShardingPlan`, as for ``shard_dit``.
        backend: ``"jax"`` (default), ``"xla"``, ``"tt"`` or a Backend bound to the mesh.
        keep_host_weights: for backends that move the model to their device (``xla``, ``tt``): keep
            the original host parameters, so ``remove()`` puts exactly those back.
        resolved: a request resolved once for several components (``shard_pipeline``); then leave
            ``mesh_or_plan`` and ``backend`` out.

    Returns:
        A :class:`TextEncoderHandle`: ``handle(input_ids, attention_mask)`` runs the encoder on the
        mesh; ``handle.remove()`` restores the encoder.

    Raises:
        ShardingError: not a UMT5 encoder, already sharded, heads or FFN width not divisible by TP,
            no mesh. Raised before anything is changed.
        BackendError: the backend's stack is missing or sees another number of devices.
    """
    if resolved is None:
        resolved = resolve(mesh_or_plan, backend)
    elif mesh_or_plan is not None or backend is not None:
        raise ShardingError("shard_text_encoder got a resolved request and request arguments too; pass one of them")
    check_text_encoder(encoder, resolved)
    handle = shard_module(encoder, resolved, lambda m: shard_text_encoder_specs(m, resolved.mesh_or_plan),
                          hooks=lambda h: MaskHook(encoder), keep_host_weights=keep_host_weights,
                          handle_type=TextEncoderHandle)
    _SHARDED[encoder] = weakref.ref(handle)  # type: ignore[arg-type]
    return handle  # type: ignore[return-value]
