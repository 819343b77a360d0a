"""What hardware's composites and compile options change, per block, at full width.

T2V-A14B, 480p, 2 blocks (the per-block figures are the difference of the 1- and 2-block compiles),
compiled with tt-mlir in compile-only mode for each composite set (``hardware``, ``sdpa``; see
docs/compile-hardware.md), with and without the exact patches, on the torch-xla frontend (2x4, the
lowering hardware compiles) and the torchax one (8x4). Every argument is marked parameter /
constant / input as tt-xla marks them (``wan_sharding.compile.marking``), so tt-mlir prepares weights
once, in const-eval. Printed per configuration: the TTNN ops per block of the step's program grouped
by class (matmul/linear, norm, attention, elementwise, data movement, collectives, other; their
total is the report's ``runtime_ops_per_block``), the ops per block tt-mlir hoisted into const-eval
(run once, at load), the composites that reached TTIR, the bill check, the options used and compile
seconds. ``--unmarked`` adds each configuration with nothing marked (every argument an input: the
package's compiles before), side by side.
``--level1`` adds Blackhole compiles at optimization level 1 (where tt-mlir keeps the fused SDPA),
with every exact patch; they take minutes each. ``--galaxies`` compiles only the multi-Galaxy views (torchax, 64 and 128
chips, ``4x16-tt-metal`` / ``4x32-tt-metal``, both archs) with the hardware set and default options
(level 0 there, with the reason: Wormhole's firmware build, and on Blackhole tt-metal's mock
device has no 64- or 128-chip configuration), the token
dim padded by the default key mask (480p's 32760 tokens do not split over SP 16 or 32).
Each run replaces the rows of the same label in the JSON and keeps the others. Every run (and
``--render``) then prints the runtime ops per block by cause (``wan_sharding.compile.causes``) of
the marked rows with every exact patch, beside tt-metal's hand-written block, and draws the same as
a chart (``--chart``, default ``docs/images/block-ops-by-cause.png``).

    python scripts/bench_hardware.py                 # writes results/hardware.json
    python scripts/bench_hardware.py --only torchax --composites hardware --level1
    python scripts/bench_hardware.py --galaxies
    python scripts/bench_hardware.py --composites hardware --unmarked   # marking's effect
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.compile import CompileRequest, compile_reports, latent_for  # noqa: E402
from wan_sharding.compile.causes import CAUSES  # noqa: E402
from wan_sharding.compile.ttnn_ir import BOOKKEEPING_OPS, COLLECTIVES  # noqa: E402
from wan_sharding.patches import EXACT_PATCHES  # noqa: E402
from wan_sharding.runtime.workers import atomic_write, install_signal_handlers  # noqa: E402

# TTNN op name -> class, for the per-block table.
CLASSES = {
    "matmul/linear": ("matmul", "linear"),
    # the fused norms, their distributed pieces, and the plain math (torch-xla's LayerNorm is a
    # batch_norm_training; a plain RMSNorm is pow + sum/mean + rsqrt)
    "norm": ("layer_norm", "rms_norm", "distributed_rms_norm", "rms_norm_pre_all_gather", "rms_norm_post_all_gather",
             "batch_norm_training", "batch_norm_inference", "mean", "sum", "pow_scalar", "rsqrt", "var"),
    "attention": ("scaled_dot_product_attention", "softmax"),
    "data movement": ("reshape", "permute", "typecast", "to_layout", "to_memory_config", "slice_static", "concat",
                      "pad", "repeat", "rows_scatter", "transpose", "embedding"),
    "collectives": tuple(c for c in COLLECTIVES if c != "distributed_rms_norm"),
}
ELEMENTWISE = ("add", "multiply", "subtract", "divide", "gelu", "silu", "exp", "sin", "cos", "where", "neg",
               "sqrt", "pow", "reciprocal", "maximum", "minimum", "abs", "tanh", "sigmoid")
SKIP = BOOKKEEPING_OPS  # what the reports' runtime_ops_per_block leaves out too


def op_classes(per_block_ops: dict[str, float]) -> dict[str, float]:
    """Per-block TTNN op counts grouped by class (buffer/trace bookkeeping left out). Given the step's
    program (``runtime_ops_per_block_by_op``), ``total`` is the report's ``runtime_ops_per_block``."""
    out = {k: 0.0 for k in [*CLASSES, "elementwise", "other"]}
    for name, n in per_block_ops.items():
        if name in SKIP:
            continue
        cls = next((c for c, names in CLASSES.items() if name in names), None)
        cls = cls or ("elementwise" if name in ELEMENTWISE else "other")
        out[cls] += n
    out["total"] = sum(out.values())
    return {k: round(v, 2) for k, v in out.items()}


GALAXIES = ("4x16-tt-metal", "4x32-tt-metal")

# tt-metal's hand-written Wan 2.2 block, TTNN calls per block by the same causes, counted from its
# source (tenstorrent/tt-metal models/tt_dit/models/transformers/wan2_2/transformer_wan.py at
# b076cef1, attention_wan.py at df142af6, layers/normalization.py) on a mesh with TP > 1 and SP > 1.
TT_METAL_BLOCK = {
    "weight preparation": 0,  # weights tiled once, at load
    "norms": 21,  # norm1/2/3 as DistributedLayerNorm (pre, stats all_gather, post: 3 each) + norm_q/norm_k
                  # per attention as wan_fused_rmsnorm pre / all_gather / post (3 each)
    "RoPE": 0,  # inside the fused RMSNorm's post step
    "heads": 6,  # nlp_create_qkv_heads (V), concatenate_heads, unsqueeze, per attention (Q/K split in the norm)
    "SDPA": 2,  # ring_joint_scaled_dot_product_attention (attn1, K/V exchange inside), SDPA (attn2)
    "projections": 10,  # to_q, to_k, to_v, to_out per attention; ff1 (GELU fused), ff2
    "adaLN": 4,  # scale_shift_table + temb, chunk, 2 typecasts
    "residuals": 3,  # 2 addcmul (gated), 1 add
    "collectives": 5,  # all_gather over TP before each attention, before each to_out, before the FFN
    "layout": 0,
    "other": 0,
}


def configs(only: str | None, level1: bool, galaxies: bool = False, composites: tuple[str, ...] = ("hardware", "sdpa"),
            unmarked: bool = False) -> list[tuple[str, str, CompileRequest]]:
    lat = latent_for("480p")
    base = dict(variant="t2v-a14b", size="full", blocks=2, latent=lat, resolution="480p", padding="none")
    if galaxies:
        return [(arch, f"torchax {mesh} hardware (mask padding{', blackhole' if arch == 'blackhole' else ''})",
                 CompileRequest(mesh=mesh, frontend="torchax", composites="hardware", **{**base, "padding": "mask"}))
                for arch in ("wormhole_b0", "blackhole") for mesh in GALAXIES]
    rows = []
    for frontend, mesh in (("torch-xla", "2x4"), ("torchax", "8x4")):
        if only and frontend != only:
            continue
        for comp in composites:
            for patches in ((), EXACT_PATCHES):
                if frontend == "torch-xla" and comp == "sdpa" and patches:
                    continue  # each torch-xla trace is ~45 s and ~8 GB: the four that tell the story
                label = f"{frontend} {mesh} {comp}{' +patches' if patches else ''}"
                for marked in (True, False) if unmarked else (True,):
                    rows.append(("wormhole_b0", label + ("" if marked else " unmarked"),
                                 CompileRequest(mesh=mesh, frontend=frontend, composites=comp, patches=patches,
                                                mark_arguments=marked, **base)))
        if level1:
            # with every exact patch: what a step still runs where tt-mlir keeps the fused SDPA
            rows.append(("blackhole", f"{frontend} {mesh} hardware +patches level 1 (blackhole)",
                         CompileRequest(mesh=mesh, frontend=frontend, composites="hardware", patches=EXACT_PATCHES,
                                        **base)))
    return rows


def row(label: str, arch: str, r: dict) -> dict:
    out = {"label": label, "arch": arch, "ok": r["ok"], "error": r.get("error"), "frontend": r["frontend"],
           "mesh": r["mesh"], "composites": r["composites"], "patches": r["patches"],
           "composites_ttir": r.get("composites_ttir"), "options_used": r.get("options_used"), "notes": r.get("notes"),
           "bill_ok": r.get("bill_ok"), "bill_problems": r.get("bill_problems"),
           "mark_arguments": r.get("mark_arguments"), "argument_types": r.get("argument_types"),
           "runtime_ops_per_block": r.get("runtime_ops_per_block"),
           "const_eval_ops_per_block": r.get("const_eval_ops_per_block"), "const_eval_ops": r.get("const_eval_ops"),
           "runtime_ops_per_block_by_op": r.get("runtime_ops_per_block_by_op"),
           "runtime_ops_per_block_by_cause": r.get("runtime_ops_per_block_by_cause"),
           "per_block_totals": r.get("per_block_totals"), "compile_seconds": r.get("compile_seconds"),
           "base_compile_seconds": r.get("base_compile_seconds"), "trace_seconds": r.get("trace_seconds")}
    ops = r.get("per_block_ops") or {}
    out["per_block_classes"] = classes_of(out | {"per_block_ops": ops})
    out["per_block_ops"] = ops
    out["per_block_sdpa_fused"] = ops.get("scaled_dot_product_attention", 0)
    # large all-gathers per block and their axis: only K and V over SP belong there (none for a norm)
    out["per_block_large_gathers"] = [{k: e[k] for k in ("count", "axis", "payload")}
                                      for e in r.get("per_block_entries") or []
                                      if e["kind"] == "all_gather" and e["size"] == "large"]
    return out


def classes_of(row: dict) -> dict | None:
    """The row's per-block classes: of the step's program where the row has it (const-eval ops run
    once, at load), else of every op (rows measured before the split; nothing was hoisted then)."""
    ops = row.get("runtime_ops_per_block_by_op") or row.get("per_block_ops")
    return op_classes(ops) if ops else None


def markdown(rows: list[dict]) -> str:
    head = ["configuration", "ops/block", *CLASSES, "elementwise", "other", "const-eval/block", "fused in TTIR", "bill",
            "level", "compile s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = r["per_block_classes"] or {}
        ttir = ", ".join(f"{k} {v}" for k, v in (r["composites_ttir"] or {}).items())
        lines.append("| " + " | ".join([
            r["label"], f"{c.get('total', '-')}", *[f"{c.get(k, '-')}" for k in [*CLASSES, "elementwise", "other"]],
            f"{r.get('const_eval_ops_per_block', '-')}", ttir or "-", "ok" if r["bill_ok"] else ("FAILED" if not r["ok"] else "differs"),
            (r["options_used"] or {}).get("optimization_level", "-"), f"{r['compile_seconds']}"]) + " |")
    return "\n".join(lines)


# The rows the cause table and the chart show (the marked rows with every exact patch), in order.
CAUSE_ROWS = ("torchax 8x4 hardware +patches", "torch-xla 2x4 hardware +patches",
              "torchax 8x4 hardware +patches level 1 (blackhole)", "torch-xla 2x4 hardware +patches level 1 (blackhole)")


def short_label(r: dict) -> str:
    """``torchax 8x4, Wormhole, level 0``: what tells the cause table's columns apart."""
    arch = "Blackhole" if r["arch"] == "blackhole" else "Wormhole"
    return f"{r['frontend']} {r['mesh']}, {arch}, level {(r['options_used'] or {}).get('optimization_level', '?')}"


def cause_rows(rows: list[dict]) -> list[dict]:
    by_label = {r["label"]: r for r in rows if r.get("runtime_ops_per_block_by_cause")}
    return [by_label[label] for label in CAUSE_ROWS if label in by_label]


def causes_markdown(rows: list[dict]) -> str:
    """Runtime ops per block by cause for the :data:`CAUSE_ROWS` measured, beside tt-metal's block."""
    shown = cause_rows(rows)
    head = ["cause", *[short_label(r) for r in shown], "tt-metal's block"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cause in CAUSES:
        values = [r["runtime_ops_per_block_by_cause"].get(cause, 0) for r in shown]
        if not any(values) and not TT_METAL_BLOCK[cause]:
            continue
        lines.append("| " + " | ".join([cause, *[f"{v:g}" for v in values], str(TT_METAL_BLOCK[cause])]) + " |")
    totals = [sum(r["runtime_ops_per_block_by_cause"].values()) for r in shown]
    lines.append("| " + " | ".join(["**total**", *[f"**{t:g}**" for t in totals],
                                    f"**{sum(TT_METAL_BLOCK.values())}**"]) + " |")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> Path | None:
    """A horizontal stacked bar per configuration (and tt-metal's block): runtime ops per block by
    cause, written as a PNG with Pillow (a diffusers dependency, so nothing more to install)."""
    from PIL import Image, ImageDraw, ImageFont

    shown = cause_rows(rows)
    if not shown:
        return None
    bars = [(short_label(r), r["runtime_ops_per_block_by_cause"]) for r in shown]
    bars.append(("tt-metal's block (hand-written)", TT_METAL_BLOCK))
    colors = ["#9e9e9e", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
              "#bcbd22", "#7f7f7f"]
    font, small = ImageFont.load_default(size=15), ImageFont.load_default(size=12)
    left, top, bar_h, gap, scale = 330, 50, 30, 16, 4.0
    width = left + int(scale * max(sum(v for v in c.values()) for _, c in bars)) + 80
    height = top + len(bars) * (bar_h + gap) + 90
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 12), "TTNN ops one Wan 2.2 block runs per step, by cause (T2V-A14B, 480p, tt-mlir compile-only)",
           fill="black", font=font)
    for i, (label, counts) in enumerate(bars):
        y = top + i * (bar_h + gap)
        d.text((10, y + 7), label, fill="black", font=small)
        x = left
        for cause, color in zip(CAUSES, colors):
            w = scale * counts.get(cause, 0)
            if w:
                d.rectangle([x, y, x + w, y + bar_h], fill=color, outline="white")
                if w >= 22:
                    d.text((x + 3, y + 9), f"{counts[cause]:g}", fill="white", font=small)
            x += w
        d.text((x + 6, y + 7), f"{sum(counts.values()):g}", fill="black", font=font)
    y = top + len(bars) * (bar_h + gap) + 10
    x = 10
    for cause, color in zip(CAUSES, colors):
        d.rectangle([x, y, x + 14, y + 14], fill=color)
        d.text((x + 18, y), cause, fill="black", font=small)
        x += 24 + int(d.textlength(cause, font=small))
        if x > width - 140:
            x, y = 10, y + 22
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["torch-xla", "torchax"], default=None)
    p.add_argument("--level1", action="store_true", help="also compile at optimization level 1 on Blackhole")
    p.add_argument("--galaxies", action="store_true", help="only the multi-Galaxy views (torchax, 64 and 128 chips)")
    p.add_argument("--composites", default="hardware,sdpa", help="composite sets to compile (default hardware,sdpa)")
    p.add_argument("--unmarked", action="store_true",
                   help="also each configuration with no argument marked (every argument an input), side by side")
    p.add_argument("--out", default=str(ROOT / "results" / "hardware.json"))
    p.add_argument("--render", action="store_true", help="print the table of --out again (classes recomputed), no compile")
    p.add_argument("--chart", default=str(ROOT / "docs" / "images" / "block-ops-by-cause.png"),
                   help="where the chart of ops per block by cause goes (PNG)")
    args = p.parse_args(argv)
    if args.render:
        rows = json.loads(Path(args.out).read_text())["rows"]
        for r in rows:
            r["per_block_classes"] = classes_of(r)
        print(markdown(rows))
        print()
        print(causes_markdown(rows))
        chart(rows, Path(args.chart))
        return 0
    install_signal_handlers()
    rows = []
    t0 = time.time()
    for arch, label, req in configs(args.only, args.level1, args.galaxies, tuple(args.composites.split(",")),
                                    args.unmarked):
        print(f"compiling {label} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="bench_hw_") as work:
            report = compile_reports([req], arch, timeout=7200, work_dir=work)[0]
        rows.append(row(label, arch, report))
        print(markdown(rows[-1:]), flush=True)
    command = "python scripts/bench_hardware.py " + " ".join(argv if argv is not None else sys.argv[1:])
    date = time.strftime("%Y-%m-%d", time.gmtime())
    for r in rows:  # each row says where it came from (a run keeps other runs' rows)
        r.update(command=command.strip(), date=date)
    out = {"date": date, "host": platform.node(), "seconds": round(time.time() - t0), "command": command.strip(),
           "rows": rows}
    path = Path(args.out)
    if path.exists():  # rows of the same label replaced in place, the others kept
        new = {r["label"]: r for r in rows}
        old = json.loads(path.read_text()).get("rows", [])
        out["rows"] = [new.pop(r["label"], r) for r in old] + list(new.values())
    atomic_write(path, json.dumps(out, indent=1) + "\n")
    print()
    print(markdown(out["rows"]))
    print()
    print(causes_markdown(out["rows"]))
    written = chart(out["rows"], Path(args.chart))
    if written:
        print(f"chart: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
