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

from ..mesh import TILE
from ..models import config_for
from ..options import settings_line
from . import bill as ir_bill
from .causes import per_block_causes
from . import text_encoder
from .cfg import host_cuts_for, request_cfg, step_figures
from .request import CompileRequest, CompileResult
from .runner import compile_many
from .ttnn_ir import REPORTED_OPS, TTNNModule, format_bytes, ttir_attention

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
        "design": {f"{k}/{s}/{a}": n for (k, s, a), n in ir_bill.design_bill(mesh, "prompt_kv" in req.patches).items()},
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
    problems = ir_bill.bill_problems(bill, mesh, budget, prompt_kv="prompt_kv" in req.patches)
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


def composite_lines(report: dict[str, Any]) -> list[str]:
    """The composite set, what was marked and what reached TTIR fused, how the arguments were marked,
    the options used and every note on what differs from the request (hardware's defaults)."""
    marked = ", ".join(f"{k.split('.', 1)[-1]} {v}" for k, v in (report.get("composites_marked") or {}).items())
    lines = [f"composites: {report.get('composites')} (marked: {marked or 'none'})"]
    if report.get("composites_ttir") is not None:
        ttir = ", ".join(f"{k} {v}" for k, v in report["composites_ttir"].items())
        lines.append(f"  fused in TTIR: {ttir or 'none'}")
    lines.append(argument_line(report))
    if report.get("options_used"):
        lines.append("tt-mlir options: " + ", ".join(f"{k}={v}" for k, v in report["options_used"].items()))
    lines += [f"  note: {n}" for n in report.get("notes") or []]
    return lines


def argument_line(report: dict[str, Any]) -> str:
    """How the program's arguments were marked, and the roles tt-mlir compiled with."""
    fmt = lambda d: ", ".join(f"{k} {v}" for k, v in (d or {}).items()) or "none"  # noqa: E731
    if not report.get("mark_arguments", True):
        head = "arguments: not marked (--no-argument-marks): every one an input"
    else:
        head = f"arguments: marked as tt-xla marks them ({fmt(report.get('arguments_marked'))})"
    if report.get("argument_types") is not None:
        head += f"; tt-mlir compiled them as {fmt(report['argument_types'])}"
    return head


def failure_lines(report: dict[str, Any]) -> list[str]:
    """What tt-mlir said when a compile failed: the error and the first diagnostics."""
    # MLIR call-site locations run to kilobytes; the head names the op and the tail the error.
    return [f"COMPILE FAILED: {report.get('error')}",
            *[f"  {d if len(d) < 400 else d[:200] + ' ... ' + d[-190:]}" for d in report.get("diagnostics", [])[:5]]]


def compile_lines(report: dict[str, Any]) -> list[str]:
    """How long the compile took, its memory, and where its TTNN IR is."""
    return [f"compile: {report['compile_seconds']:.1f} s tt-mlir, {report['lower_seconds']:.1f} s trace+lower, "
            f"peak RSS {report['rss_mb']:.0f} MB", f"TTNN IR: {report['ttnn_path']}"]


def ops_line(report: dict[str, Any]) -> str | None:
    """Runtime ops per block apart from const-eval ops (run once), or None without a per-block bill."""
    if report.get("runtime_ops_per_block") is None:
        return None
    return (f"TTNN ops per block (bookkeeping left out): {report['runtime_ops_per_block']:g} in the step's program, "
            f"{report['const_eval_ops_per_block']:g} in const-eval; const-eval in all: {report['const_eval_ops']} ops, "
            "run once when the program is loaded"
            + (f"\n  by cause: {', '.join(f'{k} {v:g}' for k, v in causes.items() if v)}"
               if (causes := report.get("runtime_ops_per_block_by_cause")) else ""))


def step_lines(report: dict[str, Any]) -> list[str]:
    """Per device, per block and per denoising step (guidance on) at the model's depth."""
    step = report.get("step")
    if not step:
        return []
    f = step["forwards_per_step"]
    why = ("both branches at once, one per group" if f == 1 else "cond then uncond, one after the other")

    def row(d: dict[str, float]) -> str:
        return (f"{d['collectives']:g} collectives ({d['large_collectives']:g} large), "
                f"{format_bytes(d['collective_bytes'])} moved, {d['runtime_ops']:g} runtime ops")

    lines = [f"per denoising step ({f} forward{'s' if f > 1 else ''}: {why}), per device, {step['blocks']} blocks:",
             f"  per block x {f}: {row(step['per_block_per_step'])}",
             f"  per step:       {row(step['per_step'])}"]
    hosts = report.get("hosts")
    if hosts:
        axes = ", ".join(f"{a['axis']} ({a['role'] or 'idle'}) every {a['chips_per_host']} chips"
                         for a in hosts["crossing_axes"])
        binding = f"rank binding {hosts['rank_binding']}" if hosts.get("rank_binding") else hosts["source"]
        lines.append(f"hosts: {hosts['hosts']} ({binding}); crossing hosts: {axes}; "
                     f"{format_bytes(hosts['cross_host_bytes_per_step'])} between hosts per denoising step "
                     "(the whole mesh)")
    return lines


def format_report(report: dict[str, Any], top: int = 25) -> str:
    """Human-readable text for one report."""
    if report.get("component") == text_encoder.COMPONENT:
        return format_encoder_report(report)
    lines = [
        f"{report['variant']} ({report['size']}), {report['blocks']} blocks, mesh {report['mesh']} "
        f"(SP {report['sp']} x TP {report['tp']}), {report['resolution']} latent {tuple(report['latent'])}, "
        f"padding {report['padding']}{'' if report['anchor'] else ', NO replicated anchor'}, "
        f"frontend {report.get('frontend', 'torchax')}",
        settings_line(f"tt-mlir compile-only ({report.get('frontend', 'torchax')} frontend)", report.get("patches", ()),
                      "none", 2 if (report.get("cfg") or {}).get("how") else 1),
    ]
    if report.get("tokens"):
        lines.append(f"tokens: {report['tokens']} -> padded {report['padded_tokens']}")
    cfg = report.get("cfg") or {}
    if cfg.get("how"):
        lines.append(f"CFG parallel: plan [{cfg['plan']}] compiled {cfg['how']}: [{cfg['compiled_plan']}], batch "
                     f"{cfg['batch']} ({cfg['branch_batch']} per branch); a step is 1 forward (both branches at once)")
    lines += composite_lines(report)
    if not report["ok"]:
        return "\n".join(lines + failure_lines(report))
    lines += compile_lines(report)
    lines.append("")
    lines.append(f"TTNN op histogram (top {top}, deallocations left out):")
    ops = list(report["ops"].items())
    for name, n in ops[:top]:
        lines.append(f"  {name:<32} {n:>7}")
    rest = [(k, v) for k, v in ops[top:] if k in REPORTED_OPS]
    for name, n in rest:
        lines.append(f"  {name:<32} {n:>7}")
    lines.append("")
    lines.append("collectives in the whole graph (per device):")
    for r in report["collectives"]:
        lines.append(f"  {r['count']:>4} x {r['kind']:<15} over {str(r['axis']):<4} {r['size']:<6} "
                     f"{r['payload']:<24} -> {r['result']:<24} {format_bytes(r['bytes']):>10}")
    lines.append("")
    if report.get("per_block_entries") is not None:
        lines.append(f"per-block collective bill (difference of the {report['base_blocks']}- and "
                     f"{report['blocks']}-block graphs):")
        for e in report["per_block_entries"]:
            lines.append(f"  {e['count']:>4} x {e['kind']:<12} over {str(e['axis']):<4} {e['size']:<6} "
                         f"{e['payload']:<24} {format_bytes(e['bytes']):>10} per device")
        tot = report["per_block_totals"]
        lines.append(f"  = {tot['large']:g} large + {tot['small']:g} small per block")
        ops = ops_line(report)
        if ops:
            lines.append(ops)
    design = ", ".join(f"{n} {k.replace('/', ' ')}" for k, n in report["design"].items())
    lines.append(f"design: {design}" + (" (per block, per branch: each group's program)"
                                        if (report.get("cfg") or {}).get("how") else ""))
    lines += step_lines(report)
    if "padding_ops_per_block" in report:
        fmt = lambda d: ", ".join(f"{k} {v:+g}" for k, v in d.items()) or "none"  # noqa: E731
        if report["padding_ops_per_block"] is None:
            lines.append(f"padding cost: {report['padding_note']}")
        else:
            lines.append(f"ops only there because of padding ({report['padding']} vs unpadded), deallocations "
                         f"left out: per block: {fmt(report['padding_ops_per_block'])}; once per forward: "
                         f"{fmt(report['padding_ops_per_forward'])}")
            if report.get("padding_ops_in_fused_attention"):
                lines.append(f"  and per block inside the fused SDPA's compile-only decomposition: "
                             f"{fmt(report['padding_ops_in_fused_attention'])} (the mask: an operand of the fused "
                             "op on hardware)")
    if report.get("design_bytes"):
        b = report["design_bytes"]
        lines.append(f"design bytes per device ({b['dtype']}): K or V gather over SP {format_bytes(b['sp_gather'])}, "
                     f"large all-reduce over TP {format_bytes(b['tp_reduce'])}")
    attention = report.get("sdpa")
    if attention is not None:
        lines.append(f"fused attention: {attention['count']} ttir.scaled_dot_product_attention "
                     f"({attention.get('traced_fused')} traced fused, {attention.get('traced_plain')} plain); "
                     f"Q split over SP: {'OK' if attention['q_split'] else 'NO (Q gathered)'}")
        lines += [f"  {c['count']:>3} x Q {c['q']}  K {c['k']}  V {c['v']}" + (f"  mask {c['mask']}" if c["mask"] else "")
                  for c in attention["calls"]]
    if report["bill_ok"]:
        lines.append("bill: OK (matches the design)")
    else:
        lines.append("bill: DIFFERS from the design")
        lines += [f"  {p}" for p in report.get("bill_problems", [])]
    if report["sp"] > 1:
        dims = ", ".join(map(str, report["token_dims"])) or "none found"
        lines.append(f"tile alignment: {'OK' if report['tile_aligned'] else 'NOT ALIGNED'} "
                     f"(per-device token dims split over SP: {dims}; tile {TILE})")
        lines += [f"  {m}" for m in report["misaligned"][:5]]
    else:
        lines.append("tile alignment: OK (SP = 1: nothing is split over the token dim)")
    return "\n".join(lines)


def format_encoder_report(report: dict[str, Any], top: int = 15) -> str:
    """Human-readable text for one text encoder report (:func:`.text_encoder.build_report`)."""
    vocab = "" if report.get("vocab") is None else f", vocab cut to {report['vocab']} (the lookup's table only)"
    lines = [f"text encoder UMT5 ({report['size']}{vocab}), {report['blocks']} layers, mesh {report['mesh']} "
             f"(TP {report['tp']}; the encoder has no SP), {report['batch']} x {report['tokens']} prompt tokens, "
             f"{report['dtype']}, frontend {report['frontend']}",
             settings_line(f"tt-mlir compile-only ({report['frontend']} frontend)", (), None)]
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
