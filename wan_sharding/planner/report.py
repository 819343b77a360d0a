"""The planner's report as text: the ranked table, the recommendation, the short bill (library;
no argument parsing). ``wan-sharding plan`` prints these (:mod:`wan_sharding.cli.plan`).

Exit codes (:func:`plan_exit_code`): :data:`EXIT_OK` a plan was recommended; :data:`EXIT_NO_PLAN`
nothing to recommend (no legal plan, or tt-mlir rejected every survivor); :data:`EXIT_ERROR` bad
arguments or the compiler could not be run.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .search import PlanReport

EXIT_OK, EXIT_NO_PLAN, EXIT_ERROR = 0, 1, 2
_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
          "collective_permute": "CP", "mesh_partition": "MP"}


def _mb(b: float) -> str:
    return f"{b / 1e9:.1f}G" if b >= 1e9 else f"{b / 1e6:.0f}M" if b >= 1e6 else f"{b / 1e3:.0f}K"


def bill_text(entry: dict[str, Any]) -> str:
    """Short per-block bill, per collective kind and mesh axis: ``AR@cols 3:504M+4s`` = 3 large
    all-reduces over cols moving 504 MB per device in all, plus 4 small ones."""
    comp = entry.get("compiled") or {}
    large: Counter = Counter()
    small: Counter = Counter()
    volume: Counter = Counter()
    if comp.get("ok"):
        for e in comp["bill"]:
            key = f"{_SHORT.get(e['kind'], e['kind'])}@{e['axis']}"
            (large if e["size"] == "large" else small)[key] += e["count"]
            volume[key] += e["count"] * e["bytes"] if e["size"] == "large" else 0
    elif entry.get("analytic"):
        for b in entry["analytic"]["bill"]:
            key = f"{_SHORT.get(b['kind'], b['kind'])}@{b['axis']}"
            is_small = b["result_mb"] < 1.0
            (small if is_small else large)[key] += b["count"]
            volume[key] += 0 if is_small else b["count"] * b["result_mb"] * 1e6
    else:
        return "-"
    parts = []
    for key in dict.fromkeys([*large, *small]):
        big = f"{large[key]:g}:{_mb(volume[key])}" if large[key] else ""
        few = f"{small[key]:g}s" if small[key] else ""
        parts.append(f"{key} " + "+".join(p for p in (big, few) if p))
    return ", ".join(parts) or "none"


def format_report(report: PlanReport, data: dict[str, Any] | None = None, rows: int = 12) -> str:
    """The ranked table and the recommendation, as text."""
    data = data or report.to_json()
    w = data["workload"]
    cnt = data["counts"]
    lines = [
        f"Wan 2.2 {w['variant']} at {w['resolution'] or w['latent']} ({w['tokens']} tokens, {w['layers']} blocks, "
        f"{w['experts']} expert{'s' if w['experts'] > 1 else ''} resident) on {data['mesh']} {data['arch']}",
        f"fabric: {data['fabric']}",
        f"chip: {data['chip']['peak_tflops']:g} TFLOPS x {data['chip']['matmul_efficiency']:g}, "
        f"{data['chip']['dram_gbps']:g} GB/s, {data['chip']['dram_gb']:g} GB DRAM; attention {data['attention']}",
        f"{cnt['enumerated']} plans, {cnt['distinct']} distinct, {cnt['legal']} legal; "
        f"{cnt['compiled']} compiled with tt-mlir, {cnt['compiled_ok']} accepted",
    ]
    hosts = data.get("hosts")
    if hosts:
        lines.append(f"hosts: {hosts_text(hosts)}; xhost: GB between hosts per denoising step, the whole mesh")
    lines.append("")
    xhost = f"{'xhost':>6} " if hosts else ""
    head = (f"{'#':>3}  {'plan':<50} {'GB/chip':>7}  {'s/step':>7} {xhost}{'src':<3}  "
            f"{'per-block bill (per device)':<38}  why it lost")
    lines.append(head)
    lines.append("-" * len(head))
    ranked = [c for c in data["candidates"] if c["rank"] is not None]
    shown = [c for c in ranked if c["stage"] in ("compiled", "no-compile")]
    pruned = [c for c in ranked if c["stage"] == "analytic"]
    illegal = [c for c in ranked if c["stage"] == "illegal"]
    shown += pruned[: max(rows - len(shown), 3)]
    for c in shown:
        est = c["estimated_seconds_per_step"]
        src = {"compiled": "tt", "no-compile": "--", "analytic": "an"}[c["stage"]]
        mem = f"{c['memory_per_chip_gb']:.1f}" if c["memory_per_chip_gb"] is not None else "-"
        secs = f"{est:.2f}" if est is not None and c["stage"] != "no-compile" else "-"
        gb = c.get("cross_host_gb_per_step")
        cross = (f"{gb:>6.1f} " if gb is not None else f"{'-':>6} ") if hosts else ""
        lines.append(f"{c['rank']:>3}  {c['name']:<50} {mem:>7}  {secs:>7} {cross}{src:<3}  {bill_text(c):<38}  "
                     f"{c['why_lost']}")
    more = len(pruned) - (len(shown) - sum(1 for c in shown if c["stage"] != "analytic"))
    if more > 0:
        lines.append(f"     ... {more} more pruned in stage 1 (see --json)")
    if illegal:
        reasons = Counter(_reason_class(c["why_lost"]) for c in illegal)
        lines.append(f"     {len(illegal)} illegal: " + "; ".join(f"{n} x {r}" for r, n in reasons.most_common()))
        cfg_out = [c for c in illegal if c.get("cfg_split")]
        if cfg_out and not any(c.get("cfg_split") for c in shown):  # no split ranked: say why each is out
            lines.append(f"     CFG splits: all {len(cfg_out)} illegal, e.g.:")
            lines += [f"       {c['name']}: {c['why_lost']}" for c in cfg_out[:3]]
    lines.append("")
    lines.append("src: tt = costed from the compiled TTNN program (1- and 2-block proxies scaled to "
                 f"{w['layers']} blocks), an = analytic stage 1, -- = tt-mlir rejected it")
    lines.append("s/step: one denoising step with guidance on: 2 forwards (cond, then uncond) without cfg; with "
                 "+ cfg2[axis] one program, both branches at once, one per half of the mesh")
    cfg = [c for c in shown if c.get("cfg_split")]
    for c in cfg:
        step = c.get("per_step")
        lines.append(f"  #{c['rank']} as a plan on {c['cfg_split'].get('mesh', '?')}, cfg axis "
                     f"{'+'.join(c['cfg_split']['plan']['cfg_axes'])}: [{c['cfg_split']['plan_name']}], compiled "
                     f"{c['cfg_split']['compiled_as']}" + (f"; per step per device {step['collectives']:g} collectives, "
                                                            f"{step['collective_gb']:g} GB moved" if step else ""))
    rec = data["recommended"]
    if not data["compiled_stage"]:
        lines.append("analytic only (--no-compile): nothing here was checked by tt-mlir, which rejects some plans "
                     "(see the sharded-D layouts in a compiled run)")
    if rec is None:
        lines.append("no plan recommended: " + ("no legal plan" if not cnt["legal"] else
                                                 "tt-mlir rejected every compiled survivor"))
    else:
        mem = rec["memory"]
        comp = rec.get("compiled") or {}
        lines += [
            f"recommended: {rec['name']}",
            f"  SP {rec['sp']} on {'+'.join(rec['mesh_axes']['sp']) or '-'}, TP {rec['tp']} on "
            f"{'+'.join(rec['mesh_axes']['tp']) or '-'}, FSDP {'on' if rec['fsdp'] else 'off'}, "
            f"{rec['layout']} D between Megatron pairs, padding {rec['padding']}"
            + (f"; CFG split on {rec['cfg_split']['axis']}: cond and uncond at once, one per "
               f"{'x'.join(map(str, rec['cfg_split']['half_mesh']))} half (plan "
               f"[{rec['cfg_split']['plan_name']}])" if rec.get("cfg_split") else ""),
            f"  memory per chip {rec['memory_per_chip_gb']:.2f} GB of {data['chip']['dram_gb']:g} (weights "
            f"{mem['weights_gb']:.2f}"
            + (f", text encoder {mem['text_encoder_gb']:.2f}" if mem.get("text_encoder_gb") else "")
            + f", FSDP working set {mem['fsdp_gathered_gb']:.2f}, activations "
            f"{mem['activations_gb']:.2f}, gathered K/V {mem['kv_gathered_gb']:.2f})"
            + (f"; the VAE beside them {data['vae_memory_per_chip']['total_gb']:.2f} GB (weights "
               f"{data['vae_memory_per_chip']['weights_gb']:.2f}, time cache {data['vae_memory_per_chip']['cache_gb']:.2f}, "
               f"decode activations {data['vae_memory_per_chip']['activations_gb']:.2f})"
               if data.get("vae_memory_per_chip") else ""),
            f"  estimated {rec['estimated_seconds_per_step']:.2f} s per denoising step "
            f"({rec['estimated_seconds_per_forward']:.2f} s per DiT forward or half-step)"
            + (f" (compiled: per block {comp['per_block']['seconds'] * 1e3:.0f} ms = compute "
               f"{comp['per_block']['compute_seconds'] * 1e3:.0f} + comm "
               f"{(comp['per_block']['seconds'] - comp['per_block']['compute_seconds']) * 1e3:.0f}; "
               f"once per forward {comp['per_forward']['seconds'] * 1e3:.0f} ms)" if comp.get("ok") else ""),
        ]
        if comp.get("ok"):
            lines.append("  compiled per-block bill: " + ", ".join(
                f"{e['count']:g} x {e['kind']} over {e['axis']} {e['payload']}" for e in comp["bill"]))
        if hosts:
            lines.append("  " + recommended_hosts_text(rec, hosts))
    t = data["timings_seconds"]
    lines.append(f"planning time: {t.get('total', 0):.0f} s (model {t.get('model', 0):.0f} s, stage 1 "
                 f"{t.get('stage1', 0):.1f} s, stage 2 {t.get('stage2', 0):.0f} s)")
    return "\n".join(lines)


def hosts_text(hosts: dict[str, Any]) -> str:
    """Where the hosts fall on the planned mesh (the report's ``hosts``), in words."""
    axes = ", ".join(f"{a['axis']} every {a['chips_per_host']} chips" for a in hosts["crossing_axes"])
    binding = f"rank binding {hosts['rank_binding']}" if hosts.get("rank_binding") else hosts["source"]
    return f"{hosts['hosts']} ({binding}); crossing hosts: {axes}"


def recommended_hosts_text(rec: dict[str, Any], hosts: dict[str, Any]) -> str:
    """Which of the recommended plan's axes cross hosts, in which role, and the bytes per step."""
    roles = {a: role for role in ("sp", "tp") for a in rec["mesh_axes"][role]}
    crossing = [f"{a['axis']} ({roles.get(a['axis'], 'idle').upper()})" for a in hosts["crossing_axes"]]
    gb = rec.get("cross_host_gb_per_step")
    tp = ("no TP" if rec["tp"] == 1 else "TP crosses hosts too" if rec.get("tp_crosses_hosts")
          else "TP stays inside each host")
    return (f"crosses hosts: {', '.join(crossing)}; {tp}; "
            + (f"{gb:g} GB between hosts per denoising step (the whole mesh)" if gb is not None else "bytes unknown"))


def _reason_class(text: str) -> str:
    if text.startswith("needs "):
        return "over the chip's DRAM"
    if text.startswith("TP ") and "heads" in text:
        return text
    if text.startswith("unpadded"):
        return "unpadded L/SP not whole tiles"
    return text[:60]


def plan_exit_code(report: PlanReport) -> int:
    """:data:`EXIT_OK` when a plan is recommended, else :data:`EXIT_NO_PLAN`."""
    return EXIT_OK if report.recommended is not None else EXIT_NO_PLAN
