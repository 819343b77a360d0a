"""Compile-only of the UMT5 text encoder through tt-mlir: its model for both frontends, its bill.

The compile machinery is the DiT's (:mod:`.runner`, :mod:`.worker`, :mod:`.lowering` for torchax,
:mod:`.xla_lowering` for torch-xla, the argument marking of :mod:`.marking`, the composites of
:mod:`.composites`); this module gives it the encoder instead of the DiT, sharded by
:func:`wan_sharding.text_encoder.shard_text_encoder` (Tenstorrent's Megatron table), and reads the
TTNN module against the encoder's design:

- **per layer**: one all-reduce over TP after the attention's ``o`` and one after the FFN's ``wo``,
  each of the whole residual stream, ``B x L x d_model`` in the compute dtype (4 MiB per device at
  512 tokens in bf16); nothing else: the norms, the embedding and the residual stream are whole on
  every device, q / k / v, the per-head relative attention bias and ``wi_0`` / ``wi_1`` split with
  no collective;
- **once per forward**: nothing (the embedding lookup is local, the final norm whole).

The encoder has no SP: on a mesh with an SP axis (2x4, 8x4) its weights are the same on every SP
row, and it is compiled on the mesh's TP role alone (:func:`encoder_mesh`), so no constraint or
composite pin splits its tokens. The per-layer bill is the difference of two depths, as the DiT's
per-block bill (:func:`~.bill.per_block_bill`); :func:`wan_sharding.compile.compile_reports` compiles
an encoder's request next to its 1-layer twin and builds its report here (:func:`build_report`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable

from ..mesh import MeshSpec, as_mesh_spec
from ..options import torch_dtype
from . import bill as ir_bill
from .request import CompileRequest, CompileResult
from .ttnn_ir import TTNNModule, format_bytes, ttir_attention

COMPONENT = "text-encoder"


def encoder_mesh(mesh: MeshSpec | str) -> MeshSpec:
    """``mesh`` as the encoder uses it: its TP role only (the SP axis, when there is one, holds
    copies of the same weights and runs the same program)."""
    m = as_mesh_spec(mesh)
    return MeshSpec(m.shape, m.axis_names, {"sp": None, "tp": m.tp_axis}, preset=m.preset)


def _encoder(req: CompileRequest, backend: Any, device: str) -> tuple[Any, Any, Callable[[], dict]]:
    """The encoder of ``req`` (``device="meta"``: no memory; ``"cpu"``: uninitialised host weights,
    the tied embedding tied again) sharded on ``backend``; and what it reports after the trace."""
    from ..models import build_text_encoder
    from ..text_encoder import shard_text_encoder

    overrides = {} if req.blocks is None else {"num_layers": req.blocks}
    if req.vocab is not None:
        overrides["vocab_size"] = req.vocab
    encoder = build_text_encoder(req.size, device="meta", dtype=torch_dtype(req.dtype), **overrides)
    if device != "meta":
        encoder = encoder.to_empty(device=device)  # a compile reads shapes and dtypes, never values
        encoder.tie_weights()  # to_empty makes one table per holder: the embedding is one tensor again
    handle = shard_text_encoder(encoder, backend.mesh, backend, keep_host_weights=device == "meta")
    info = lambda: {"sp_points": [], "tokens": req.tokens, "padded_tokens": req.tokens}  # noqa: E731
    return encoder, handle, info


def _composites(req: CompileRequest, backend: Any, encoder: Any) -> Any:
    from .composites import HardwareComposites

    return HardwareComposites(backend, encoder, req.composites) if req.composites != "none" else None


def jax_encoder(req: CompileRequest, backend: Any) -> tuple:
    """For the torchax frontend (:func:`.lowering.compile_in_process`): the encoder on the meta
    device with abstract weights, its abstract inputs (``input_ids`` and the 2-D ``attention_mask``,
    replicated, int32 as JAX holds them), the composites mode, what it reports."""
    import jax
    import jax.numpy as jnp

    encoder, handle, info = _encoder(req, backend, "meta")
    shape, rep = (req.batch, req.tokens), backend.sharding(())
    inputs = {"input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep),
              "attention_mask": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)}
    return encoder, handle, inputs, _composites(req, backend, encoder), info


def xla_encoder(req: CompileRequest, backend: Any) -> tuple:
    """For the torch-xla frontend (:func:`.xla_lowering.trace_in_process`): the encoder with
    uninitialised host weights placed by the xla backend, its inputs on the device (int64, as the
    tokenizer gives them), the composites mode, what it reports."""
    import torch

    encoder, handle, info = _encoder(req, backend, "cpu")
    try:
        dev = backend.device
        inputs = {"input_ids": torch.zeros(req.batch, req.tokens, dtype=torch.long).to(dev),
                  "attention_mask": torch.ones(req.batch, req.tokens, dtype=torch.long).to(dev)}
    except BaseException:
        handle.remove()
        raise
    return encoder, handle, inputs, _composites(req, backend, encoder), info


# ---------------------------------------------------------------------------------- the bill


def design_bill(mesh: MeshSpec | str) -> dict[tuple[str, str, str | None], int]:
    """The encoder's per-layer bill as ``{(kind, size, axis): count}``: one large all-reduce over
    TP after the attention and one after the FFN (none at TP 1)."""
    m = encoder_mesh(mesh)
    return {("all_reduce", "large", m.tp_axis): 2} if m.tp > 1 else {}


def design_reduce_bytes(req: CompileRequest) -> int:
    """What one of the layer's all-reduces moves per device: the residual stream, B x L x d_model."""
    from ..models import text_encoder_config

    return req.batch * req.tokens * text_encoder_config(req.size)["d_model"] * {"bf16": 2, "fp32": 4}[req.dtype]


def bill_problems(layer_bill: ir_bill.BlockBill, req: CompileRequest) -> list[str]:
    """How a measured per-layer bill departs from :func:`design_bill` (counts by kind, size and
    axis; a large all-reduce moving more than :func:`design_reduce_bytes`); empty when it agrees."""
    want = design_bill(req.mesh)
    got = Counter(layer_bill.by_class())
    problems = list(layer_bill.irregular)
    for key in sorted(set(want) | set(got), key=str):
        if want.get(key, 0) != got.get(key, 0):
            kind, size, axis = key
            problems.append(f"{size} {kind} over {axis}: {got.get(key, 0):g} per layer, design says {want.get(key, 0)}")
    limit = design_reduce_bytes(req)
    for e in layer_bill.entries:
        if e.kind == "all_reduce" and e.size == "large" and e.bytes > limit:
            problems.append(f"large all_reduce moves {format_bytes(e.bytes)} per device ({e.payload}); the design's "
                            f"{req.dtype} residual stream is {format_bytes(limit)}")
    return problems


def build_report(main: CompileResult, base: CompileResult | None) -> dict[str, Any]:
    """One encoder compile's summary: ops, collectives with bytes, the per-layer bill against the
    design, runtime ops per layer apart from const-eval, argument roles, fused attention."""
    req = main.request
    mesh = encoder_mesh(req.mesh)
    report: dict[str, Any] = {
        "ok": main.ok, "component": COMPONENT, "mesh": req.mesh, "sp": mesh.sp, "tp": mesh.tp, "size": req.size,
        "blocks": req.num_blocks, "tokens": req.tokens, "batch": req.batch, "dtype": req.dtype,
        "frontend": req.frontend, "vocab": req.vocab, "composites": req.composites, "composites_marked": main.composites_marked,
        "mark_arguments": req.mark_arguments, "arguments_marked": main.arguments_marked,
        "options_requested": req.options().to_json() if req.compile_options is None else dict(req.compile_options),
        "options_used": main.options_used, "notes": list(req.notes) + ([main.options_note] if main.options_note else []),
        "compile_seconds": main.compile_seconds, "lower_seconds": main.lower_seconds,
        "build_lower_compile_seconds": main.total_seconds, "rss_mb": main.rss_mb, "trace_seconds": main.trace_seconds,
        "trace_rss_mb": main.trace_rss_mb, "ttnn_path": main.ttnn_path, "ttir_path": main.ttir_path,
        "stablehlo_path": main.stablehlo_path,
        "design": {f"{k}/{s}/{a}": n for (k, s, a), n in design_bill(req.mesh).items()},
        "design_reduce_bytes": design_reduce_bytes(req), "tile_aligned": True,  # no SP: no token split to align
    }
    if not main.ok:
        report.update(error=main.error, diagnostics=main.diagnostics[:10], bill_ok=False, ops={}, per_block={})
        return report
    module = TTNNModule.from_file(main.ttnn_path)
    if main.ttir_path:
        from .composites import ttir_composite_counts

        ttir = Path(main.ttir_path).read_text()
        report["composites_ttir"] = ttir_composite_counts(ttir)
        report["sdpa"] = ir_bill.attention_report(ttir_attention(ttir), mesh, req.tokens)
        report["sdpa"].update(traced_fused=main.sdpa_fused, traced_plain=main.sdpa_plain)
    if main.frontend_ir_path:
        from .marking import argument_types

        report["argument_types"] = argument_types(Path(main.frontend_ir_path).read_text())
    const_eval = module.program_ops(const_eval=True)
    report.update(ops=module.histogram(), collectives=ir_bill.collective_table(module, mesh),
                  const_eval_ops=sum(const_eval.values()), const_eval_ops_by_op=dict(const_eval.most_common()))
    if base is None or not base.ok:
        report.update(ir_bill.no_bill(req.num_blocks, base, "layer"))
        return report
    shallow = TTNNModule.from_file(base.ttnn_path)
    layers = (base.request.num_blocks, req.num_blocks)
    layer_bill = ir_bill.per_block_bill(shallow, module, *layers, mesh)
    per_forward = Counter(c.kind for c in shallow.collectives)
    for e in layer_bill.entries:
        per_forward[e.kind] -= e.count * layers[0]
    problems = bill_problems(layer_bill, req)
    problems += [f"{n:g} {kind} once per forward, outside the layers; the design has none"
                 for kind, n in per_forward.items() if n]
    report.update(
        per_block=layer_bill.counts(), per_block_totals=layer_bill.totals(),
        per_block_entries=[e.to_json() for e in layer_bill.entries], per_block_ops=layer_bill.ops,
        per_forward_collectives={k: v for k, v in per_forward.items() if v},
        **ir_bill.program_split(shallow, module, *layers),
        bill_ok=not problems, bill_problems=problems, base_blocks=layers[0], base_compile_seconds=base.compile_seconds,
    )
    return report
