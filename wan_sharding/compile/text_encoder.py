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
per-block bill (:func:`~.bill.per_block_bill`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from ..mesh import MeshSpec, as_mesh_spec
from ..options import torch_dtype
from . import bill as ir_bill
from .report import (EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_OK, base_depth, compile_lines, composite_lines,
                     failure_lines, no_bill)
from .request import CompileRequest, CompileResult
from .runner import compile_many
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
        "design_reduce_bytes": design_reduce_bytes(req),
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
        report.update(no_bill(req, base, "layer"))
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


def encoder_reports(requests: Sequence[CompileRequest], arch: str = "wormhole_b0", *, timeout: float = 3600.0,
                    work_dir: str | Path | None = None, verbose: bool = False) -> list[dict[str, Any]]:
    """Compile each encoder request next to a shallower twin (1 layer, or 2 when 1 is asked for)
    in one worker batch: one :func:`build_report` per request."""
    def twin(r: CompileRequest) -> CompileRequest:
        out = None if r.out_dir is None else str(Path(r.out_dir).with_name(Path(r.out_dir).name + "_base"))
        return dataclasses.replace(r, out_dir=out, blocks=base_depth(r.num_blocks))

    flat = [x for r in requests for x in (r, twin(r))]
    results = compile_many(flat, arch, timeout=timeout, work_dir=work_dir, verbose=verbose)
    return [build_report(results[2 * i], results[2 * i + 1]) for i in range(len(requests))]


def exit_code(report: dict[str, Any]) -> int:
    """:data:`~.report.EXIT_ERROR` when the compile failed, :data:`~.report.EXIT_CHECK_FAILED` when
    the per-layer bill differs from the design, else :data:`~.report.EXIT_OK`."""
    if not report["ok"]:
        return EXIT_ERROR
    return EXIT_OK if report["bill_ok"] else EXIT_CHECK_FAILED


def format_report(report: dict[str, Any], top: int = 15) -> str:
    """Human-readable text for one encoder report."""
    vocab = "" if report.get("vocab") is None else f", vocab cut to {report['vocab']} (the lookup's table only)"
    lines = [f"text encoder UMT5 ({report['size']}{vocab}), {report['blocks']} layers, mesh {report['mesh']} "
             f"(TP {report['tp']}; the encoder has no SP), {report['batch']} x {report['tokens']} prompt tokens, "
             f"{report['dtype']}, frontend {report['frontend']}"]
    lines += composite_lines(report)
    if not report["ok"]:
        return "\n".join(lines + failure_lines(report))
    lines += compile_lines(report)
    lines.append(f"TTNN op histogram (top {top}, deallocations left out): "
                 + ", ".join(f"{k} {v}" for k, v in list(report["ops"].items())[:top]))
    lines.append("collectives in the whole graph (per device):")
    lines += [f"  {r['count']:>4} x {r['kind']:<15} over {str(r['axis']):<4} {r['size']:<6} {r['payload']:<24} "
              f"{format_bytes(r['bytes']):>10}" for r in report["collectives"]]
    if report.get("per_block_entries") is not None:
        lines.append(f"per-layer collective bill (difference of the {report['base_blocks']}- and "
                     f"{report['blocks']}-layer graphs):")
        lines += [f"  {e['count']:>4} x {e['kind']:<12} over {str(e['axis']):<4} {e['size']:<6} {e['payload']:<24} "
                  f"{format_bytes(e['bytes']):>10} per device" for e in report["per_block_entries"]]
        lines.append(f"TTNN ops per layer (bookkeeping left out): {report['runtime_ops_per_block']:g} in the step's "
                     f"program, {report['const_eval_ops_per_block']:g} in const-eval; const-eval in all: "
                     f"{report['const_eval_ops']} ops, run once when the program is loaded")
    design = ", ".join(f"{n} {k.replace('/', ' ')}" for k, n in report["design"].items()) or "no collective (TP 1)"
    lines.append(f"design per layer: {design} (after the attention's o and the FFN's wo), each "
                 f"{format_bytes(report['design_reduce_bytes'])} per device; none once per forward")
    attention = report.get("sdpa")
    if attention is not None:
        lines.append(f"fused attention: {attention['count']} ttir.scaled_dot_product_attention "
                     f"({attention.get('traced_fused')} traced fused, {attention.get('traced_plain')} plain)")
    lines.append("bill: OK (matches the design)" if report["bill_ok"] else "bill: DIFFERS from the design")
    lines += [f"  {p}" for p in report.get("bill_problems", [])]
    return "\n".join(lines)
