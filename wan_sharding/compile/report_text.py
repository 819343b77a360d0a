"""A compile report as the text ``wan-sharding compile`` prints (:func:`format_report`): the
configuration, what was marked and fused, the options, the op histogram, the collectives and the
per-block (per-layer, for the text encoder) bill against the design. The report itself, as data,
is :mod:`.report`'s."""

from __future__ import annotations

from typing import Any

from ..mesh import TILE
from ..options import settings_line
from . import text_encoder
from .ttnn_ir import REPORTED_OPS, format_bytes

__all__ = ["format_report"]


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
