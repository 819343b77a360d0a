"""The resident worker's prompt embeddings: each prompt encoded once, reused for a repeated prompt.

A video request's prompt (and negative prompt, under guidance) goes through the UMT5 encoder before
the first denoising step: 5.7B parameters, about 6 TFLOP for a prompt pair at full size. A server
sees the same prompts again (the default negative prompt in nearly every request, a prompt tried
with other seeds or sizes), so the worker keeps each prompt's embedding in a least-recently-used
cache bounded in bytes, keys and values (``serve --prompt-cache-mb``; a full-size embedding is 512 x 4096 bf16,
4 MiB; a key is the prompt's 32-byte digest, whatever the prompt's length)
and hands the pipeline ``prompt_embeds`` / ``negative_prompt_embeds`` from it. The embeddings are
the pipeline's own (``pipe.encode_prompt``, on the host or on the mesh as the encoder is), so a
cached request gives the same video as an uncached one. The counts reach ``GET /metrics`` with every
job the worker reports.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable

import torch

__all__ = ["PromptEmbeddings"]

KEY_BYTES = 32  # each entry's key: the prompt's digest, counted in the bound with its embedding


class PromptEmbeddings:
    """An LRU of prompt embeddings bounded by ``max_bytes``; ``encode(prompt, max_sequence_length)``
    makes one on a miss. ``max_bytes`` 0 keeps nothing (every prompt encoded again)."""

    def __init__(self, encode: Callable[[str, int], torch.Tensor], max_bytes: int):
        self._encode = encode
        self.max_bytes = max_bytes
        # keyed by the prompt's SHA-256 (32 bytes, whatever its length), so the keys are bounded as the values are
        self._kept: OrderedDict[tuple[bytes, int], torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, prompt: str, max_sequence_length: int) -> torch.Tensor:
        """``prompt``'s embedding ``(1, max_sequence_length, d_model)``: the kept one, or encoded now
        (and kept, the least recently used ones dropped to stay within ``max_bytes``)."""
        key = (hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest(), max_sequence_length)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            self.hits += 1
            return kept
        self.misses += 1
        with torch.no_grad():
            emb = self._encode(prompt, max_sequence_length).detach()
        size = emb.numel() * emb.element_size() + KEY_BYTES
        if size <= self.max_bytes:
            while self.bytes + size > self.max_bytes:
                _, old = self._kept.popitem(last=False)
                self.bytes -= old.numel() * old.element_size() + KEY_BYTES
                self.evictions += 1
            self._kept[key] = emb
            self.bytes += size
        return emb

    def stats(self) -> dict[str, Any]:
        """What ``/metrics`` shows: hits, misses, evictions, entries, bytes kept and the bound."""
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "entries": len(self._kept),
                "bytes": self.bytes, "max_bytes": self.max_bytes}
