"""The pipeline's UMT5 text encoder on the mesh: ``shard_pipeline(pipe, mesh, text_encoder=True)``.

The Wan pipelines encode the prompt (and, under guidance, the negative prompt) with
``self.text_encoder(text_input_ids, mask).last_hidden_state`` (diffusers ``pipeline_wan.py``,
``_get_t5_prompt_embeds``), after reading ``self.text_encoder.dtype`` and the encoder's execution
device. :class:`ShardedTextEncoder` stands in for the encoder with exactly that: ``dtype``, the host
as its ``device`` (the pipeline keeps the token ids and the embeddings there), and a ``forward``
that runs the real encoder on the mesh through its
:class:`~wan_sharding.text_encoder.TextEncoderHandle`. As for the experts' stand-ins, the real
encoder is a plain attribute, not a submodule, so ``pipe.device`` / ``pipe.to(...)`` never reach
the sharded weights; the swap goes through the pipeline's own attribute assignment, and
:meth:`~.handle.ShardedComponent.remove` puts the very same encoder back.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compose import Resolved
from ..specs import ShardingError
from ..text_encoder import TextEncoderHandle, check_text_encoder, shard_text_encoder
from .handle import ShardedComponent
from .standin import ComponentStandIn

__all__ = ["ShardedTextEncoder", "check_pipeline_text_encoder", "shard_pipeline_text_encoder"]


class ShardedTextEncoder(ComponentStandIn):
    """Stands in for a sharded pipeline's ``text_encoder``; ``forward(input_ids, attention_mask)``
    runs the real UMT5 encoder on the mesh and returns its output (``last_hidden_state`` on the host)."""

    def __init__(self, encoder: torch.nn.Module, handle: TextEncoderHandle):
        super().__init__(encoder, "text_encoder")
        self.__dict__["_handle"] = handle

    @property
    def encoder(self) -> torch.nn.Module:
        """The real (sharded) ``UMT5EncoderModel``."""
        return self.model

    @property
    def handle(self) -> TextEncoderHandle:
        return self._handle

    @property
    def calls(self) -> int:
        return self._handle.calls if self._handle is not None else 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                return_dict: bool = True, **kwargs: Any) -> Any:
        if kwargs:
            raise ShardingError(f"the sharded text encoder takes input_ids and attention_mask only, got "
                                f"{sorted(kwargs)}; call the encoder unsharded for the rest")
        self.encoder  # noqa: B018 - refuses a removed stand-in
        return self._handle(input_ids, attention_mask, return_dict=return_dict)

    def _release(self) -> None:
        super()._release()
        self.__dict__["_handle"] = None

    def extra_repr(self) -> str:
        inner = "removed" if self._handle is None else f"{self._handle.backend.name} {self._handle.mesh.name}"
        return f"text_encoder: UMT5EncoderModel on {inner}"


def check_pipeline_text_encoder(pipe: Any, resolved: Resolved) -> None:
    """Before anything is changed: the pipeline has a UMT5 text encoder (not sharded already) that
    splits on the mesh."""
    encoder = getattr(pipe, "text_encoder", None)
    if isinstance(encoder, ShardedTextEncoder):
        raise ShardingError("pipe.text_encoder is already sharded (through another handle); remove that handle first")
    if encoder is None:
        raise ShardingError(f"text_encoder=True, but this {type(pipe).__name__} has no text encoder (prompt embeddings "
                            "are given to it instead); load the pipeline with its text encoder, or leave text_encoder "
                            "out")
    check_text_encoder(encoder, resolved)


def shard_pipeline_text_encoder(pipe: Any, resolved: Resolved, keep_host_weights: bool) -> ShardedComponent:
    """Shard ``pipe.text_encoder`` with ``resolved`` (the experts' request) and put its stand-in in
    the pipeline; the returned :class:`~.handle.ShardedComponent` undoes it. Checked already
    (:func:`check_pipeline_text_encoder`)."""
    part = ShardedComponent("text_encoder", pipe.text_encoder, None, None, pipe.config.get("text_encoder"))
    part.sharding = shard_text_encoder(part.model, resolved=resolved, keep_host_weights=keep_host_weights)
    try:
        part.wrapper = ShardedTextEncoder(part.model, part.sharding)
        pipe.text_encoder = part.wrapper
    except BaseException:
        part.remove(pipe)
        raise
    return part
