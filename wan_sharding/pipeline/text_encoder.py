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
:meth:`EncoderSharding.remove` puts the very same encoder back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..compose import Resolved
from ..specs import ShardingError
from ..text_encoder import TextEncoderHandle, check_text_encoder, shard_text_encoder

__all__ = ["EncoderSharding", "ShardedTextEncoder", "check_pipeline_text_encoder", "shard_pipeline_text_encoder"]


class ShardedTextEncoder(torch.nn.Module):
    """Stands in for a sharded pipeline's ``text_encoder``; ``forward(input_ids, attention_mask)``
    runs the real UMT5 encoder on the mesh and returns its output (``last_hidden_state`` on the host)."""

    def __init__(self, encoder: torch.nn.Module, handle: TextEncoderHandle):
        super().__init__()
        self.__dict__.update(_encoder=encoder, _handle=handle)  # plain attributes, not submodules

    @property
    def encoder(self) -> torch.nn.Module:
        """The real (sharded) ``UMT5EncoderModel``."""
        if self._encoder is None:
            raise ShardingError("this sharded text_encoder was removed by handle.remove(); use pipe.text_encoder, "
                                "which is the original encoder again")
        return self._encoder

    @property
    def config(self) -> Any:
        return self.encoder.config

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.dtype

    @property
    def device(self) -> torch.device:
        """Where the pipeline keeps the token ids and the embeddings: the host."""
        return torch.device("cpu")

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
        self.__dict__.update(_encoder=None, _handle=None)

    def __deepcopy__(self, memo: dict) -> Any:
        raise ShardingError("a pipeline sharded with shard_pipeline cannot be copied or pickled (its text_encoder runs "
                            "the original's weights on the mesh); call handle.remove() first, copy, then shard_pipeline "
                            "each copy")

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__deepcopy__({})

    def extra_repr(self) -> str:
        inner = "removed" if self._handle is None else f"{self._handle.backend.name} {self._handle.mesh.name}"
        return f"text_encoder: UMT5EncoderModel on {inner}"


@dataclass(eq=False)
class EncoderSharding:
    """The pipeline's encoder on the mesh: the original, its handle, its stand-in, its config entry."""

    encoder: Any
    handle: TextEncoderHandle | None = None
    standin: ShardedTextEncoder | None = None
    config_entry: Any = None

    def remove(self, pipe: Any) -> None:
        """Sharding undone (:meth:`TextEncoderHandle.remove`), the same encoder back in the pipeline."""
        if self.handle is not None:
            self.handle.remove()
        if self.standin is not None:
            self.standin._release()
        if getattr(pipe, "text_encoder", None) is not self.encoder:
            pipe.text_encoder = self.encoder  # the pipeline's own __setattr__ records it in pipe.config
            if self.config_entry is not None and pipe.config.get("text_encoder") != self.config_entry:
                pipe.register_to_config(text_encoder=self.config_entry)

    def describe(self) -> dict[str, Any]:
        return {"params": self.handle.specs.counts() if self.handle else {}, "calls": self.handle.calls if self.handle else 0}


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


def shard_pipeline_text_encoder(pipe: Any, resolved: Resolved, keep_host_weights: bool) -> EncoderSharding:
    """Shard ``pipe.text_encoder`` with ``resolved`` (the experts' request) and put its stand-in in
    the pipeline; the returned :class:`EncoderSharding` undoes it. Checked already
    (:func:`check_pipeline_text_encoder`)."""
    entry = EncoderSharding(pipe.text_encoder, config_entry=pipe.config.get("text_encoder"))
    entry.handle = shard_text_encoder(entry.encoder, resolved=resolved, keep_host_weights=keep_host_weights)
    try:
        entry.standin = ShardedTextEncoder(entry.encoder, entry.handle)
        pipe.text_encoder = entry.standin
    except BaseException:
        entry.remove(pipe)
        raise
    return entry
