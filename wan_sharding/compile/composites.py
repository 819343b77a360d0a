"""The StableHLO composites Tenstorrent's torch plugin marks, marked the same way in our traces.

tt-xla's ``torch.compile(backend="tt")`` (``python_package/tt_torch/backend/passes.py::
handle_composite_ops``, on by default) rewrites the dynamo graph with ``tt_torch/composite_ops.py``:

- function calls ``F.gelu`` (``tenstorrent.gelu``, or ``tenstorrent.gelu_tanh`` with attribute
  ``approximate = "tanh"``), ``F.rms_norm`` / ``torch.rms_norm`` (``tenstorrent.rms_norm``:
  ``normalized_shape``, ``epsilon`` when given; operands input, weight when given),
  ``F.layer_norm`` (``tenstorrent.layer_norm``: ``normalized_shape``, ``epsilon``; weight and bias
  cast to the input's dtype) and SDPA (``wan_sharding.fused_sdpa``);
- modules of exactly the types ``nn.LayerNorm``, ``nn.RMSNorm`` (and ``nn.GroupNorm``, absent from
  Wan). Under ``inline_inbuilt_nn_modules = False`` (set by ``torch_plugin_tt``) dynamo keeps
  other built-in modules as opaque ``call_module`` nodes: ``nn.GELU`` (Wan's text embedder) gets
  no composite, while diffusers' own modules (``FP32LayerNorm``, diffusers' ``GELU``) are inlined
  and their ``F.layer_norm`` / ``F.gelu`` calls are replaced.

:class:`HardwareComposites` does the same around one traced forward of ours, without touching
diffusers: a ``TorchFunctionMode`` (subclass of :class:`~wan_sharding.fused_sdpa.FusedSDPA`) plus
per-instance hooks that mark the forward of every ``nn.GELU`` so its call stays plain, as dynamo
leaves it. Each composite's body is the stock function itself, so a compiler that inlines it
computes what the model would.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..fused_sdpa import SDPA_COMPOSITE, FusedSDPA

RMS_NORM = "tenstorrent.rms_norm"
LAYER_NORM = "tenstorrent.layer_norm"
GELU = "tenstorrent.gelu"
GELU_TANH = "tenstorrent.gelu_tanh"
# "hardware": what tt-xla's default pass marks; "sdpa": only the fused attention (this package's
# lowering before issue 21); "none": plain math everywhere.
COMPOSITE_SETS = ("hardware", "sdpa", "none")
DEFAULT_COMPOSITES = "hardware"
# What each composite becomes in TTIR (tt-mlir's StableHLOLegalizeCompositePass), for counting.
TTIR_OPS = {SDPA_COMPOSITE: "scaled_dot_product_attention", RMS_NORM: "rms_norm", LAYER_NORM: "layer_norm",
            GELU: "gelu", GELU_TANH: "gelu"}


def check_composites(name: str) -> str:
    """``name`` if it is a composite set, else ``ValueError`` naming the choices."""
    if name not in COMPOSITE_SETS:
        raise ValueError(f"unknown composite set {name!r}; choose one of {', '.join(COMPOSITE_SETS)}")
    return name


class HardwareComposites(FusedSDPA):
    """Within ``with HardwareComposites(backend, model):``, the calls tt-xla's default pass turns
    into composites become the backend's composites (``composite_set="hardware"``), or only SDPA
    (``"sdpa"``). ``marked`` counts each composite name; ``fused`` / ``plain`` count attention as
    :class:`FusedSDPA` does.

    On a TP mesh the RMSNorm composite's operands are pinned so that tt-mlir fuses it into its
    distributed RMSNorm (:meth:`_gather_normalized`).
    """

    def __init__(self, backend: Any, model: torch.nn.Module | None = None, composite_set: str = DEFAULT_COMPOSITES,
                 split_tokens: Callable[[], int | None] | None = None, mark: bool = True):
        super().__init__(backend)
        self.composite_set = check_composites(composite_set)
        self.model = model
        self.marked: Counter[str] = Counter()
        # mark=False: the same bodies and pinning without the composite markers, for running the
        # graph on a CPU backend (torch-xla's CPU client cannot execute its composite markers).
        self._emit = mark
        # The token count the SP hooks split (global, padded): a norm input of that length has its
        # tokens split over SP; any other (the prompt's) is whole.
        self._split_tokens = split_tokens or (lambda: None)
        self._opaque = 0  # > 0 while an nn.GELU module's forward runs (a call_module node to dynamo)
        self._hooks: list[Any] = []

    # -- nn.GELU stays opaque, as a call_module node does under tt-xla's dynamo settings
    def __enter__(self) -> "HardwareComposites":
        if self.model is not None and self.composite_set == "hardware":
            for m in self.model.modules():
                if type(m) is torch.nn.GELU:
                    self._hooks.append(m.register_forward_pre_hook(self._enter_opaque))
                    self._hooks.append(m.register_forward_hook(self._leave_opaque))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def _enter_opaque(self, module: torch.nn.Module, args: Any) -> None:
        self._opaque += 1

    def _leave_opaque(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self._opaque -= 1

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = super().__torch_function__(func, types, args, kwargs)
            self.marked[SDPA_COMPOSITE] = self.fused
            return out
        if self.composite_set != "hardware":
            return func(*args, **kwargs)
        if func is F.gelu and not self._opaque:
            return self._gelu(*args, **kwargs)
        if func in (F.rms_norm, torch.rms_norm):
            return self._rms_norm(*args, **kwargs)
        if func is F.layer_norm:
            return self._layer_norm(*args, **kwargs)
        return func(*args, **kwargs)

    # -- the composites, named and attributed as tt_torch/composite_ops.py has them
    def _gelu(self, input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        tanh = approximate == "tanh"
        name = GELU_TANH if tanh else GELU
        return self._mark(name, {"approximate": "tanh"} if tanh else {},
                          lambda x: F.gelu(x, approximate=approximate), input)

    def _rms_norm(self, input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
        shape = [int(d) for d in normalized_shape]
        attr: dict[str, Any] = {"normalized_shape": shape}
        if eps is not None:
            attr["epsilon"] = float(eps)
        input, weight, unpin = self._gather_normalized(input, weight)
        if weight is None:
            out = self._mark(RMS_NORM, attr, lambda x: F.rms_norm(x, shape, None, eps), input)
        else:
            out = self._mark(RMS_NORM, attr, lambda x, w: F.rms_norm(x, shape, w, eps), input, weight)
        return unpin(out)

    def _gather_normalized(self, input: torch.Tensor, weight: torch.Tensor | None):
        """On a TP mesh, Wan's RMSNorms (``norm_q`` / ``norm_k``) normalise over the TP-split
        channels. Pin the composite's operands whole along them and its result split again: Shardy
        then writes all_gather -> ``tenstorrent.rms_norm`` -> all_slice, the pattern tt-mlir's
        ``FuseDistributedCustomCalls`` turns into one ``distributed_rms_norm`` on the local shards
        (statistics exchanged inside it, no gathered activation left)."""
        from ..backends.tt_norms import norm_pin_specs, pin_axes

        mesh = self.backend.mesh
        if mesh.tp == 1:
            return input, weight, lambda out: out
        pin, whole, split = norm_pin_specs(tuple(input.shape), self._split_tokens(), *pin_axes(mesh))
        constrain = self.backend.constrain
        input = constrain(input, pin)
        if weight is not None:
            # whole here, gathered from its TP split: tt-mlir's fusion takes the local shard again
            weight = constrain(weight, (None,) * weight.ndim)
        return input, weight, lambda out: constrain(constrain(out, whole), split)

    def _layer_norm(self, input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
        shape = [int(normalized_shape)] if isinstance(normalized_shape, int) else [int(d) for d in normalized_shape]
        attr = {"normalized_shape": shape, "epsilon": float(eps)}
        # As tt-xla: affine parameters in the input's dtype.
        weight = weight.to(input.dtype) if weight is not None and weight.dtype != input.dtype else weight
        bias = bias.to(input.dtype) if bias is not None and bias.dtype != input.dtype else bias
        extra = [t for t in (weight, bias) if t is not None]

        def body(x: torch.Tensor, *wb: torch.Tensor) -> torch.Tensor:
            it = iter(wb)
            w = next(it) if weight is not None else None
            b = next(it) if bias is not None else None
            return F.layer_norm(x, shape, w, b, eps)

        return self._mark(LAYER_NORM, attr, body, input, *extra)

    def _mark(self, name: str, attr: dict[str, Any], fn: Callable[..., torch.Tensor],
              *tensors: torch.Tensor) -> torch.Tensor:
        self.marked[name] += 1
        return mark_composite(self.backend, name, attr, fn, *tensors) if self._emit else fn(*tensors)

    def counts(self) -> dict[str, int]:
        """Composites marked, by name (SDPA included), in a stable order."""
        return {k: self.marked[k] for k in (SDPA_COMPOSITE, RMS_NORM, LAYER_NORM, GELU_TANH, GELU) if self.marked[k]}


def mark_composite(backend: Any, name: str, attr: dict[str, Any], fn: Callable[..., torch.Tensor],
                   *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` wrapped as the StableHLO composite ``name`` with ``attr``, in the backend's
    lowering: torch-xla's ``StableHLOCompositeBuilder`` (as tt-xla marks them), or
    ``jax.lax.composite`` inside a torchax trace (lists become i64 dense arrays, floats f32: the
    forms tt-mlir reads).
    Any other backend computes ``fn`` plainly."""
    if getattr(backend, "name", None) == "xla":
        from torch_xla.experimental.mark_pattern_utils import StableHLOCompositeBuilder

        builder = StableHLOCompositeBuilder(name=name, attr=attr or None)
        marked = builder.mark_inputs(*tensors)
        marked = marked if isinstance(marked, (tuple, list)) else (marked,)
        return builder.mark_outputs(fn(*marked))
    if getattr(backend, "name", None) == "jax":
        import jax
        import numpy as np
        from torchax.interop import jax_view, torch_view

        # tt-mlir reads float attributes as f32 (torch-xla writes them so); JAX would write f64.
        jattr = {k: np.asarray(v, dtype=np.int64) if isinstance(v, list) else np.float32(v) if isinstance(v, float) else v
                 for k, v in attr.items()}

        def body(*arrays: Any, **_: Any) -> Any:
            return jax_view(fn(*(torch_view(a) for a in arrays)))

        return torch_view(jax.lax.composite(body, name=name)(*(jax_view(t) for t in tensors), **jattr))
    return fn(*tensors)


def ttir_composite_counts(ttir_text: str) -> dict[str, int]:
    """How many of each composite's TTIR op the TTIR module holds (``ttir.rms_norm``,
    ``ttir.distributed_rms_norm``, ``ttir.layer_norm``, ``ttir.gelu``,
    ``ttir.scaled_dot_product_attention``): what reached tt-mlir fused."""
    import re

    names = ("scaled_dot_product_attention", "rms_norm", "distributed_rms_norm", "layer_norm", "gelu")
    counts = {n: len(re.findall(rf'"?ttir\.{n}"?[( ]', ttir_text)) for n in names}
    return {n: c for n, c in counts.items() if c}


def sdpa_causal_flags(stablehlo_text: str) -> list[str | None]:
    """The ``is_causal`` attribute of every SDPA composite in a StableHLO text module (``None``
    where it is missing: tt-mlir's ``StableHLOLegalizeCompositePass`` then reads it as causal)."""
    import re

    flags = []
    for m in re.finditer(rf'composite "{re.escape(SDPA_COMPOSITE)}"[^{{]*\{{composite_attributes = \{{([^}}]*)\}}',
                         stablehlo_text):
        hit = re.search(r"is_causal = (\w+)", m.group(1))
        flags.append(hit.group(1) if hit else None)
    return flags
