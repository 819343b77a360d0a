"""Attention as Tenstorrent's fused SDPA composite, where hardware has it.

Tenstorrent's torch plugin (tt-xla, ``python_package/tt_torch/composite_ops.py`` and its
``torch.compile`` backend) does not change a model: it replaces, in the traced graph, each
``F.scaled_dot_product_attention`` whose Q, K, V (and mask) are bf16 by a StableHLO composite named
``tenstorrent.scaled_dot_product_attention`` with ``is_causal`` and ``scale`` attributes, whose body
is the plain math. tt-mlir turns the composite into ``ttir.scaled_dot_product_attention``; a
compiler that does not know it inlines the body. Other dtypes stay plain math.

:class:`FusedSDPA` does the same for this package's own traces (the compile frontends), without
touching diffusers: a ``TorchFunctionMode`` active only around one traced forward, which hands every
qualifying call to the backend's composite builder (``Backend.sdpa_composite``), pins its operands'
shardings and counts what it did. The composite's body is :func:`sdpa_math` (the same math as SDPA, softmax in f32), so a
composite that is inlined computes what the stock call would.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SDPA_COMPOSITE = "tenstorrent.scaled_dot_product_attention"

_SDPA_SIGNATURE = inspect.Signature([
    inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
    for n, d in (("query", inspect.Parameter.empty), ("key", inspect.Parameter.empty),
                 ("value", inspect.Parameter.empty), ("attn_mask", None), ("dropout_p", 0.0),
                 ("is_causal", False), ("scale", None), ("enable_gqa", False))
])


def sdpa_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              scale: float, is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention as plain ops: ``softmax(q k^T * scale + mask) v``, the softmax
    in f32 (as SDPA's math path does for bf16), the result in ``value``'s dtype."""
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if attn_mask is not None:
        scores = scores + attn_mask
    if is_causal:
        lq, lk = scores.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril(lk - lq)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(value.dtype), value)


def qualifies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              dropout_p: float, enable_gqa: bool) -> bool:
    """Whether Tenstorrent's plugin would make this call the composite: bf16 Q/K/V, a bf16 mask or
    none, no dropout, no grouped-query broadcasting."""
    bf16 = all(t.dtype == torch.bfloat16 for t in (query, key, value))
    mask_ok = attn_mask is None or attn_mask.dtype == torch.bfloat16
    return bf16 and mask_ok and not dropout_p and not enable_gqa


class FusedSDPA(TorchFunctionMode):
    """Within ``with FusedSDPA(backend):``, qualifying SDPA calls become the backend's composite.

    Under sequence parallelism the composite's operands are pinned to what the design wants:
    Q split over SP (each device attends for its own queries), K, V and the mask whole along the
    sequence (gathered once), heads split over TP. tt-mlir (jax-tt-plugin 0.1.3) has no sharding
    rule for the composite and propagates the queries' split onto K and V, which would make every
    device attend only to its own keys (observed: TTIR with Q, K and V all at L/SP).

    ``fused`` and ``plain`` count the calls that did and did not qualify, so a caller can report
    how many attention calls reached the compiler fused.
    """

    def __init__(self, backend: Any):
        super().__init__()
        self.backend = backend
        self.fused = 0
        self.plain = 0

    def _pin(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        mesh = self.backend.mesh
        if mesh.sp == 1:  # nothing is split over the sequence: nothing to pin
            return query, key, value, mask
        tp, sp = mesh.tp_axis, mesh.sp_axis
        constrain = self.backend.constrain
        query = constrain(query, (None, tp, sp, None))  # (B, heads, L, head_dim)
        key, value = constrain(key, (None, tp, None, None)), constrain(value, (None, tp, None, None))
        if mask is not None:
            mask = constrain(mask, (None,) * mask.ndim)
        return query, key, value, mask

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _SDPA_SIGNATURE.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        if not qualifies(a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"], a["enable_gqa"]):
            self.plain += 1
            return func(*args, **kwargs)
        self.fused += 1
        scale = a["scale"] if a["scale"] is not None else a["query"].shape[-1] ** -0.5
        query, key, value, mask = self._pin(a["query"], a["key"], a["value"], a["attn_mask"])
        return self.backend.sdpa_composite(query, key, value, mask, float(scale), bool(a["is_causal"]))
