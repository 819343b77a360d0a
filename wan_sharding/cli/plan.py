"""``plan``: rank sharding plans for a Tenstorrent mesh and recommend one (arguments and printing only).

    wan-sharding plan --mesh 8x4 --arch wormhole_b0 --resolution 480p [--variant t2v-a14b]
                      [--top K] [--json] [--write PLAN.json] [--rank-binding NAME]

Prints a ranked table (plan, memory per chip, per-block collective bill, estimated seconds per
forward and why each plan lost) and the recommended plan (:func:`wan_sharding.planner.plan_sharding`,
:func:`wan_sharding.planner.report.format_report`); ``--write`` saves it as a ``ShardingPlan`` JSON
file for ``shard_dit_specs(dit, ShardingPlan.load(path))``. On a mesh of several hosts (several
Galaxies, or ``--rank-binding``) it says which axis crosses hosts and what crosses them per step;
``--rank-binding`` plans for that system (its global mesh and chips) and the written plan carries it.

Exit codes: 0 a plan was recommended; 1 nothing to recommend (no legal plan, or tt-mlir rejected
every survivor); 2 bad arguments or the compiler could not be run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..compile import latent_for
from ..models import RESOLUTIONS, VARIANTS
from ..options import PADDING_NAMES
from ..planner import PlannerError, plan_sharding
from ..planner.candidates import restriction
from ..planner.hardware import ARCHS, TOPOLOGIES
from ..planner.ir_cost import ATTENTION_MODES
from ..planner.report import EXIT_ERROR, format_report, plan_exit_code
from ..plan import LAYOUTS
from ..mesh import MeshError, parse_mesh_shape
from ..runtime import scratch
from ..runtime.workers import atomic_path
from .args import add_multihost, add_overwrite, add_text_encoder
from .launch import check_binding
from .validate import UsageError, latent, output_dir, output_file, positive_float, positive_int

DEFAULT_MESH, DEFAULT_ARCH = "8x4", "wormhole_b0"


def _validate_plan(args: argparse.Namespace) -> None:
    from ..systems import rank_binding, served_presets

    if args.rank_binding:  # its mesh and chips unless given (check_binding: given ones must agree)
        binding = rank_binding(args.rank_binding)
        args.mesh = args.mesh or (served_presets(binding) or ["x".join(map(str, binding.grid))])[0]
        args.arch = args.arch or binding.arch
    args.mesh, args.arch = args.mesh or DEFAULT_MESH, args.arch or DEFAULT_ARCH
    try:
        parse_mesh_shape(args.mesh)
    except MeshError as e:
        raise UsageError(f"--mesh: {e}") from None
    if args.rank_binding:
        check_binding(args)
    if args.write:
        output_file(args.write, "--write", args.overwrite)
    if args.out:
        output_dir(args.out, "--out", ["round_*"], args.overwrite)


def _cmd_plan(args: argparse.Namespace) -> int:
    _validate_plan(args)
    if args.out and args.overwrite:  # an earlier run's IRs: none can then be mistaken for this run's
        for old in Path(args.out).glob("round_*"):
            scratch.remove(old)
    t0 = time.perf_counter()
    progress = None if args.json or args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    keep = restriction(args.layout, args.padding, None if args.fsdp is None else args.fsdp == "on")
    try:
        report = plan_sharding(args.mesh, args.arch, args.variant, args.resolution,
                               latent_for(None, args.latent) if args.latent else None, top=args.top,
                               compile=not args.no_compile, attention=args.attention, topology=args.topology,
                               work_dir=args.out, timeout=args.timeout, keep=keep, cfg_split=args.cfg_split,
                               progress=progress, rank_binding_name=args.rank_binding,
                               text_encoder=args.text_encoder == "mesh", vae=args.vae == "mesh",
                               lora_rank=args.lora_rank or 0)
    except (PlannerError, ValueError, RuntimeError) as e:  # CompileError is a RuntimeError
        if args.json:
            print(json.dumps({"ok": False, "error": str(e)}))
        else:
            print(f"wan-sharding {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    data = report.to_json()
    data["wall_seconds"] = round(time.perf_counter() - t0, 2)
    if args.write and report.recommended is not None:
        written = report.recommended.full_plan  # a CFG split: the plan with its cfg axes
        if args.rank_binding:
            written = dataclasses.replace(written, rank_binding=args.rank_binding)
        with atomic_path(args.write) as tmp:  # the plan's own format, renamed into place when complete
            written.save(tmp)
        data["written"] = str(args.write)
    if args.verify and report.recommended is not None and not report.recommended.cfg_axis:
        from ..jobs.placement import verify_in_subprocess

        v = verify_in_subprocess(report.recommended.plan, args.variant)
        v["planner_memory_per_chip_gb"] = round(report.recommended.memory.total / 1e9, 3)
        v["planner_weights_gb"] = round(report.recommended.memory.weights / 1e9, 3)
        data["verify"] = v
    if args.json:
        print(json.dumps(data))
    else:
        print(format_report(report, data))
        if data.get("verify"):
            v = data["verify"]
            print(f"verify: {v['plan']} placed on {v['devices']} devices (abstract full-size weights, "
                  f"{v['experts']} expert(s), bf16): {v['placed_bytes_max'] / 1e9:.3f} GB of weights per device "
                  f"(min {v['placed_bytes_min'] / 1e9:.3f}); the planner counts {v['planner_weights_gb']:.3f} GB "
                  f"({v['placed_over_predicted']:.4f}x) of its {v['planner_memory_per_chip_gb']:.2f} GB per chip")
        if data.get("written"):
            print(f"wrote {data['written']}: shard_pipeline(pipe, plan={str(args.write)!r}) or "
                  f"wan-sharding generate --plan {args.write}")
    return plan_exit_code(report)


def add_subcommands(sub: Any) -> None:
    """Add ``plan`` to an argparse subparsers object (sets ``func``)."""
    p = sub.add_parser(
        "plan", help="rank sharding plans for a Tenstorrent mesh from compiled TTNN IR and recommend one",
        description="Two-stage planner: enumerate SP/TP axis assignments, FSDP, layout and padding; filter by "
                    "divisibility, tiles and per-chip memory; rank analytically; compile the best with tt-mlir "
                    "(compile-only) and rank them on a model of the chip fabric.")
    p.add_argument("--mesh", default=None, help=f"physical chip grid ROWSxCOLS or a preset (default {DEFAULT_MESH}, or "
                                                "the rank binding's)")
    p.add_argument("--arch", choices=list(ARCHS), default=None,
                   help=f"chip architecture (default {DEFAULT_ARCH}, or the rank binding's)")
    p.add_argument("--resolution", choices=list(RESOLUTIONS), default="480p")
    p.add_argument("--latent", default=None, type=latent, help="latent F,H,W instead of a resolution")
    p.add_argument("--variant", choices=list(VARIANTS), default="t2v-a14b")
    p.add_argument("--top", type=positive_int, default=6, help="stage-1 survivors to compile (default 6)")
    p.add_argument("--attention", choices=list(ATTENTION_MODES), default="fused",
                   help="whether attention scores stay on chip (fused, default) or go to DRAM")
    p.add_argument("--topology", choices=list(TOPOLOGIES), default="machine",
                   help="the machine's wiring (default), or force every axis to a line / ring")
    p.add_argument("--layout", choices=list(LAYOUTS), default=None, help="only plans with this layout")
    p.add_argument("--padding", choices=list(PADDING_NAMES), default=None,
                   help="only plans with this padding mode (SP 1 plans, which need none, stay)")
    p.add_argument("--fsdp", choices=["on", "off"], default=None, help="only plans with (on) or without (off) FSDP")
    add_text_encoder(p, help="mesh: the pipeline's UMT5 text encoder is sharded on the mesh too (its weights count in "
                             "each chip's memory; a plan it cannot be sharded on is illegal); host (default): it is not")
    p.add_argument("--vae", choices=["mesh", "host"], default="host",
                   help="mesh: the pipeline's VAE runs on the mesh too, its memory per chip counted beside the "
                        "experts' (default host: the experts alone, as plans were made before)")
    p.add_argument("--lora-rank", type=positive_int, default=None, metavar="R",
                   help="each expert also holds a rank-R LoRA adapter on every Linear a Wan LoRA targets: its bytes "
                        "per chip count in the memory (docs/lora.md; default none)")
    p.add_argument("--no-compile", action="store_true", help="stage 1 only (no tt-mlir)")
    p.add_argument("--cfg-split", action="store_true",
                   help="also rank CFG splits (cond and uncond at once on the two halves of an axis, a plan with "
                        "cfg axes as --cfg 2 makes): every plan then compared per denoising step; --write saves a "
                        "recommended split with its cfg axes")
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds per compile batch")
    p.add_argument("--out", default=None, help="folder to keep the compiled IRs in (default: none kept; they are "
                                                "compiled in a scratch folder, removed when planning ends)")
    add_overwrite(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--write", default=None, metavar="PLAN.json", help="save the recommended ShardingPlan")
    p.add_argument("--verify", action="store_true",
                   help="place the recommended plan on the full-size experts (abstract weights, JAX CPU devices) and "
                        "report the bytes per device next to the planner's count")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    add_multihost(p, launch=False)
    p.set_defaults(func=_cmd_plan, validate=_validate_plan)
