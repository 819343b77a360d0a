"""Compile reports: what ``wan-sharding compile`` prints, as data (library; no argument parsing).

:func:`compile_reports` compiles each request next to a shallower twin (1 block, or 2 when 1 is
asked for): the difference of the two is what one block costs. That compile is cheap next to the
full one. A padded request also gets both depths compiled unpadded, so the report can name the ops
that are there only because of padding. :func:`build_report` then checks the two things
compile-only mode can check: the per-block collective bill against the design
(``docs/design.md``), and that every per-device token dim split over SP is tile-aligned
(``docs/tt-mlir-notes.md``). It also counts the TTNN ops one block adds to the step's program
(``runtime_ops_per_block``) apart from those tt-mlir hoisted into const-eval functions, run once at
load (``const_eval_ops_per_block``, ``const_eval_ops``), and the roles the arguments had
(:mod:`.marking`). On a mesh of several hosts (several Galaxies, one host each, or a rank binding)
it says which axes cross hosts and what the whole mesh moves between them per denoising step
(``hosts``).

Exit codes (:func:`report_exit_code`): :data:`EXIT_OK` all checks pass; :data:`EXIT_CHECK_FAILED`
the bill differs from the design or a token dim is not tile-aligned; :data:`EXIT_ERROR` bad
arguments, missing plugin or descriptor trouble, or a compile tt-mlir rejected.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..models import config_for
from . import bill as ir_bill
from .causes import per_block_causes
from . import text_encoder
from .cfg import host_cuts_for, request_cfg, step_figures
from .request import CompileRequest, CompileResult
from .runner import compile_many
from .ttnn_ir import TTNNModule, format_bytes, ttir_attention

EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR = 0, 1, 2


def build_report(main: CompileResult, base: CompileResult | None, rank_binding: str | None = None) -> dict[str, Any]:
    """One compile's summary: op histogram, collectives, per-block bill against the design, tile
    alignment, times. ``base`` is the shallower compile of the same configuration (or None).
    ``rank_binding``: the multi-host system the mesh is (default: one host per Galaxy)."""
    req = main.request
    mesh = req.mesh_spec()
    how = request_cfg(req)
    report: dict[str, Any] = {
        "ok": main.ok,
        "mesh": req.mesh, "sp": mesh.sp, "tp": mesh.tp,
        "resolution": req.resolution or "x".join(map(str, req.latent)),
        "latent": list(req.latent), "variant": req.variant, "size": req.size, "blocks": req.num_blocks,
        "padding": req.padding, "anchor": req.anchor, "dtype": req.dtype, "frontend": req.frontend,
        "composites": req.composites, "patches": list(req.patches),
        "composites_marked": main.composites_marked,
        "mark_arguments": req.mark_arguments, "arguments_marked": main.arguments_marked,
        "options_requested": req.options().to_json() if req.compile_options is None else dict(req.compile_options),
        "options_used": main.options_used,
        "notes": list(req.notes) + ([main.options_note] if main.options_note else []),
        "tokens": main.tokens, "padded_tokens": main.padded_tokens,
        "compile_seconds": main.compile_seconds, "lower_seconds": main.lower_seconds,
        "build_lower_compile_seconds": main.total_seconds, "rss_mb": main.rss_mb,
        "ttnn_path": main.ttnn_path, "ttir_path": main.ttir_path, "stablehlo_path": main.stablehlo_path,
        "trace_seconds": main.trace_seconds, "trace_rss_mb": main.trace_rss_mb,
        "design": {f"{k}/{s}/{a}": n for (k, s, a), n in ir_bill.design_bill(mesh, "prompt_kv" in req.patches, req.lora_rank).items()},
        # CFG parallel: how the plan compiled (one program / per group) and a step's forwards (1; 2 without)
        "cfg": how.to_json(),
    }
    if not main.ok:
        report.update(error=main.error, diagnostics=main.diagnostics[:10], bill_ok=False, tile_aligned=None,
                      ops={}, per_block={})
        return report
    module = TTNNModule.from_file(main.ttnn_path)
    tiles = ir_bill.tile_alignment(module, mesh)
    attention = (ir_bill.attention_report(ttir_attention(Path(main.ttir_path).read_text()), mesh, main.padded_tokens)
                 if main.ttir_path else None)
    if attention is not None:
        attention.update(traced_fused=main.sdpa_fused, traced_plain=main.sdpa_plain)
    flatbuffers = sorted(Path(main.out_dir).glob("*.ttnn")) if main.out_dir else []
    constants = [op for op in module.op_list if op.name == "constant"]
    if main.ttir_path:
        from .composites import ttir_composite_counts

        report["composites_ttir"] = ttir_composite_counts(Path(main.ttir_path).read_text())
    if main.frontend_ir_path:
        from .marking import argument_types

        report["argument_types"] = argument_types(Path(main.frontend_ir_path).read_text())
    const_eval = module.program_ops(const_eval=True)
    report.update(const_eval_ops=sum(const_eval.values()), const_eval_ops_by_op=dict(const_eval.most_common()))
    report.update(
        sdpa=attention,
        # What the program carries: the flatbuffer tt-mlir wrote (runtime program + constants), the
        # TTNN text, and the constants baked into it (e.g. index tables of a scatter).
        flatbuffer_bytes=flatbuffers[-1].stat().st_size if flatbuffers else None,
        ttnn_ir_bytes=Path(main.ttnn_path).stat().st_size,
        constant_bytes=sum(op.results[0].bytes for op in constants if op.results), constants=len(constants),
        ops=module.histogram(),
        collectives=ir_bill.collective_table(module, mesh),
        tile_aligned=tiles["aligned"], token_dims=tiles["token_dims"], misaligned=tiles["misaligned"],
    )
    if base is None or not base.ok:
        report.update(ir_bill.no_bill(req.num_blocks, base))
        return report
    shallow = TTNNModule.from_file(base.ttnn_path)
    bill = ir_bill.per_block_bill(shallow, module, base.request.num_blocks, req.num_blocks, mesh)
    split = ir_bill.program_split(shallow, module, base.request.num_blocks, req.num_blocks)
    # per device: one branch's rows (a cfg program's batch is split over its cfg axis)
    budget = ir_bill.design_bytes(config_for(req.variant, req.size), mesh, main.padded_tokens or main.tokens,
                                  how.branch_batch, req.dtype)
    problems = ir_bill.bill_problems(bill, mesh, budget, lora_rank=req.lora_rank, prompt_kv="prompt_kv" in req.patches)
    causes = per_block_causes(shallow, module, base.request.num_blocks, req.num_blocks)
    cuts, programs = host_cuts_for(how, rank_binding)
    step = step_figures(shallow, module, base.request.num_blocks, req.num_blocks,
                        config_for(req.variant, req.size)["num_layers"], how.forwards_per_step, cuts)
    report.update(
        design_bytes=budget.to_json(),
        per_block=bill.counts(), per_block_totals=bill.totals(),
        per_block_entries=[e.to_json() for e in bill.entries], per_block_ops=bill.ops,
        # what a step runs per block, apart from what tt-mlir hoisted into const-eval (run once)
        **split,
        runtime_ops_per_block_by_cause=causes,
        bill_ok=not problems, bill_problems=problems,
        base_blocks=base.request.num_blocks, base_compile_seconds=base.compile_seconds,
        # per device at the model's depth: per block, per forward and per denoising step (guidance
        # on: 2 forwards without CFG parallel, 1 with it), so SP and cfg layouts compare per step
        step=step,
        hosts=hosts_report(how, rank_binding, cuts, programs, step),
    )
    return report


def hosts_report(how: Any, rank_binding: str | None, cuts: Any, programs: int,
                 step: dict[str, Any]) -> dict[str, Any] | None:
    """Where the hosts fall on the mesh, which axes (and roles) cross them, and the bytes the whole
    mesh moves between hosts per denoising step (None on one host)."""
    from ..mesh import axes_of
    from ..systems import host_cuts
    from ..systems import rank_binding as binding_named

    mesh = how.plan.mesh()
    whole = host_cuts(mesh.grid, binding_named(rank_binding) if rank_binding else None) if len(mesh.grid) == 2 else None
    if whole is None:
        return None
    names = [n for n in mesh.axis_names if n not in axes_of(mesh.cfg_axis) or len(mesh.shape) == 2]
    roles = {a: role.upper() for role in ("sp", "tp", "cfg") for a in axes_of(mesh.roles.get(role))}
    per_step = step["per_step"].get("cross_host_bytes", 0.0) * programs if cuts is not None else 0.0
    return {"hosts": whole.hosts, "source": whole.source, "rank_binding": rank_binding,
            "crossing_axes": [{"axis": names[i], "role": roles.get(names[i]), "chips_per_host": whole.segment(i)}
                              for i in whole.crossing_axes()],
            "cross_host_bytes_per_step": per_step}


def compile_reports(requests: Sequence[CompileRequest], arch: str = "wormhole_b0", *, timeout: float = 3600.0,
                    work_dir: str | Path | None = None, verbose: bool = False,
                    padding_cost: bool = True, rank_binding: str | None = None) -> list[dict[str, Any]]:
    """Compile each request and its shallow twin in one worker batch; one report per request.

    A padded request also gets the same two depths compiled unpadded (unless ``padding_cost`` is
    False), so the report can name the ops that are there only because of padding
    (``padding_ops_per_block`` / ``_per_forward``). ``rank_binding``: the multi-host system every
    request's mesh is (:func:`build_report`). A text encoder's request (``component``
    ``"text-encoder"``) gets its own report (:func:`.text_encoder.build_report`: the bill per layer).
    """
    def twin(r: CompileRequest, suffix: str, **changes: Any) -> CompileRequest:
        out = None if r.out_dir is None else str(Path(r.out_dir).with_name(Path(r.out_dir).name + suffix))
        if r.plan is not None and "padding" in changes:  # a plan carries its padding: the twin's plan too
            changes["plan"] = dataclasses.replace(r.plan, padding=changes["padding"])
        return dataclasses.replace(r, out_dir=out, **changes)

    groups = []
    for r in requests:
        group = [r, twin(r, "_base", blocks=ir_bill.base_depth(r.num_blocks))]
        if r.component == "dit" and r.padding != "none" and padding_cost:
            group += [twin(g, "_unpadded", padding="none") for g in group]
        groups.append(group)
    flat = [g for group in groups for g in group]
    results = iter(compile_many(flat, arch, timeout=timeout, work_dir=work_dir, verbose=verbose))
    reports = []
    for r, group in zip(requests, groups):
        res = [next(results) for _ in group]
        if r.component == text_encoder.COMPONENT:  # the UMT5 encoder: its own bill, per layer
            reports.append(text_encoder.build_report(res[0], res[1]))
            continue
        report = build_report(res[0], res[1], rank_binding)
        if len(res) == 4:
            report.update(padding_report(res[:2], res[2:]))
        elif r.padding == "none":  # unpadded: nothing is there because of padding
            report.update(padding_ops_per_block={}, padding_ops_per_forward={})
        reports.append(report)
    return reports


def keep_cited(report: dict[str, Any], written: Iterable[str | Path]) -> int:
    """Delete the files and folders in ``written`` (what one run wrote) except the files ``report``
    names (its ``*_path`` values): the intermediate IRs tt-mlir exports, the flatbuffers, the
    shallow and unpadded twins, logs and the system descriptor, which the report has been made from.
    A full-width compile leaves gigabytes of them; the IRs it cites stay readable. Nothing outside
    ``written`` is touched. Returns the bytes freed."""
    cited = {Path(v).resolve() for k, v in report.items() if k.endswith("_path") and isinstance(v, str)}
    freed = 0
    for top in map(Path, written):
        below = sorted(top.rglob("*"), reverse=True) if top.is_dir() and not top.is_symlink() else []
        for path in [*below, top]:  # children before their folders
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            elif path.exists() and path.resolve() not in cited:
                freed += path.lstat().st_size
                path.unlink()
    return freed


def padding_report(padded: Sequence[CompileResult], unpadded: Sequence[CompileResult]) -> dict[str, Any]:
    """What padding adds against the same graph unpadded (both at the same two depths)."""
    if not all(r.ok for r in [*padded, *unpadded]):
        failed = [r for r in [*padded, *unpadded] if not r.ok]
        return {"padding_ops_per_block": None, "padding_ops_per_forward": None,
                "padding_note": f"no comparison: {failed[0].request.label()} did not compile ({failed[0].error})"}
    mods = [TTNNModule.from_file(r.ttnn_path) for r in [*padded, *unpadded]]
    depths = (padded[1].request.num_blocks, padded[0].request.num_blocks)
    masks = 0.0
    if padded[0].ttir_path and padded[1].ttir_path:
        masks = ir_bill.masked_attention_per_block(Path(padded[1].ttir_path).read_text(),
                                                   Path(padded[0].ttir_path).read_text(), depths)
    cost = ir_bill.padding_cost((mods[1], mods[0]), (mods[3], mods[2]), depths, masks)
    return {"padding_ops_per_block": cost["per_block"], "padding_ops_per_forward": cost["per_forward"],
            "padding_ops_in_fused_attention": cost["in_fused_attention"]}


def report_exit_code(report: dict[str, Any]) -> int:
    """:data:`EXIT_ERROR` when the compile failed, :data:`EXIT_CHECK_FAILED` when the bill, the
    tile check or the fused attention's Q split failed, else :data:`EXIT_OK` (a text encoder's
    report: its per-layer bill)."""
    if not report["ok"]:
        return EXIT_ERROR
    if report.get("component") == text_encoder.COMPONENT:
        return EXIT_OK if report["bill_ok"] else EXIT_CHECK_FAILED
    q_split = (report.get("sdpa") or {}).get("q_split", True)
    return EXIT_OK if report["bill_ok"] and report["tile_aligned"] and q_split else EXIT_CHECK_FAILED


# Per-block op kinds worth comparing between lowerings and rewrites.
COMPARED_OPS = ("matmul", "linear", "softmax", "rows_scatter", "scatter", "typecast", "reshape", "permute",
                "all_gather", "all_reduce")


def comparison_row(report: dict[str, Any]) -> dict[str, Any]:
    """The figures a side-by-side benchmark compares, from one report: ops per block, the bill and
    its bytes, fused attention, program sizes (flatbuffer, TTNN text, baked constants), times."""
    base = {"frontend": report.get("frontend"), "patches": report.get("patches", []), "mesh": report["mesh"],
            "resolution": report["resolution"]}
    if not report["ok"]:
        return {**base, "ok": False, "error": str(report.get("error"))[:200]}
    entries = report.get("per_block_entries", [])
    sdpa = report.get("sdpa") or {}
    return {
        **base, "ok": True,
        "ops_per_block": {k: report.get("per_block_ops", {}).get(k, 0) for k in COMPARED_OPS},
        "ops_per_block_total": sum(report.get("per_block_ops", {}).values()),
        "runtime_ops_per_block": report.get("runtime_ops_per_block"),
        "const_eval_ops": report.get("const_eval_ops"),
        "ops_total": sum(report["ops"].values()),
        "per_block": report.get("per_block_totals"), "bill_ok": report["bill_ok"],
        "bill_problems": report.get("bill_problems", []),
        "sp_gather": [f"{e['count']:g} x {e['payload']} {format_bytes(e['bytes'])}" for e in entries
                      if e["kind"] == "all_gather"],
        "collective_bytes_per_block": sum(e["count"] * e["bytes"] for e in entries),
        "sdpa_fused": sdpa.get("count"), "q_split": sdpa.get("q_split"),
        "flatbuffer_bytes": report.get("flatbuffer_bytes"), "ttnn_ir_bytes": report.get("ttnn_ir_bytes"),
        "constant_bytes": report.get("constant_bytes"),
        "compile_seconds": report["compile_seconds"],
        "trace_seconds": report.get("trace_seconds") or report.get("lower_seconds"),
        "trace_rss_mb": report.get("trace_rss_mb") or report.get("rss_mb"),
    }
