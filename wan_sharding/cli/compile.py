"""``sysdesc`` and ``compile``: the compile-only checks as commands (arguments and printing only).

``compile`` compiles the sharded DiT through tt-mlir and checks its per-block collective bill and
tile alignment (:func:`wan_sharding.compile.compile_reports`); ``sysdesc`` writes a system
descriptor for ``TT_COMPILE_ONLY_SYSTEM_DESC``.

Exit codes: 0 all checks pass; 1 the bill differs from the design or a token dim is not
tile-aligned; 2 bad arguments, missing plugin or descriptor trouble, or a compile tt-mlir rejected.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..runtime import scratch
from ..compile import (EXIT_ERROR, EXIT_OK, CompileError, CompileRequest, compile_reports, format_report, keep_cited,
                       latent_for, report_exit_code, sysdesc)
from ..mesh import PRESETS, MeshError, mesh_from_preset
from ..compile.composites import COMPOSITE_SETS, DEFAULT_COMPOSITES
from ..compile.request import FRONTENDS
from ..compile.runner import WORK_FILES
from ..models import RESOLUTIONS, VARIANTS
from ..runtime.workers import atomic_write
from . import text_encoder
from .args import add_cfg, add_component, add_dtype, add_multihost, add_overwrite, add_padding, add_patches, add_plan
from .launch import binding_mesh, check_binding
from .vae import add_vae_compile_args, check_vae_compile, compile_vae
from .validate import (UsageError, apply_plan, compile_options, latent, output_dir, output_file, positive_float,
                       positive_int)

DEFAULT_ARCH = "wormhole_b0"

REPORT = "report.json"


def _validate_sysdesc(args: argparse.Namespace) -> None:
    output_file(args.output, "-o", args.overwrite)


def _cmd_sysdesc(args: argparse.Namespace) -> int:
    _validate_sysdesc(args)
    try:
        mesh = mesh_from_preset(args.mesh)
        path = sysdesc.write_system_descriptor(args.output, args.arch, mesh.num_devices,
                                               grid=tuple(mesh.shape), topology=args.topology)
    except (MeshError, ValueError, sysdesc.SystemDescriptorError) as e:
        print(f"wan-sharding {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    data = path.read_bytes()
    desc = sysdesc.read_system_descriptor(data)
    crossing = sysdesc.inter_galaxy_channels(desc, tuple(mesh.shape))
    between = f", {crossing} of them between Galaxies" if crossing else ""
    print(f"wrote {path}: {desc['num_chips']} x {args.arch} chips on a {mesh.name} grid, "
          f"{len(desc['channels'])} ethernet links ({args.topology}{between}), "
          f"schema hash {desc['schema_hash'][:12]}...")
    version = sysdesc.installed_plugin_version()
    if version is None:
        print(f"note: {sysdesc.PLUGIN_DIST} is not installed here; the schema hash was not checked")
        return EXIT_OK
    try:
        sysdesc.check_plugin_schema(data)
    except sysdesc.SystemDescriptorError as e:
        print(f"wan-sharding {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(f"matches {sysdesc.PLUGIN_DIST}=={version}; use it with TT_COMPILE_ONLY_SYSTEM_DESC={path}")
    return EXIT_OK


# Where ``compile`` writes without ``--out``: a folder per configuration under this one.
DEFAULT_OUT = Path("results/compile")


def default_out(args: argparse.Namespace) -> Path:
    """One folder per configuration under ``results/compile/``, so runs of different ones sit side by
    side: ``<variant>-<size>-<mesh or plan>-<resolution or latent>-<blocks>blk-<padding>-<frontend>
    [-<patches>]`` for the DiT, ``text-encoder-<size>-<mesh>-<tokens>tok-<layers>lay-<frontend>`` and
    ``vae-<kind>-<mesh>-<resolution>-<strategy>-<frontend>`` for the other components."""
    from ..patches import EXACT, EXACT_PATCHES

    if args.component == "vae":
        parts = ["vae", args.vae_kind or "wan2.1", args.mesh, args.resolution, args.strategy or "halo", args.frontend]
    elif text_encoder.encoder_only(args):
        parts = [text_encoder.COMPONENT, args.size, args.mesh, f"{args.tokens or 'default'}tok",
                 f"{args.blocks or 'all'}lay", *([f"vocab{args.vocab}"] if args.vocab else []), args.frontend]
    else:
        where = args.mesh if args.plan is None else f"plan-{args.plan.name}"
        patches = [EXACT] if set(args.patches) == set(EXACT_PATCHES) else args.patches
        parts = [args.variant, args.size, where, args.latent or args.resolution, f"{args.blocks or 'all'}blk",
                 args.padding, args.frontend, *patches, *([f"lora{args.lora_rank}"] if args.lora_rank else [])]
    return DEFAULT_OUT / re.sub(r"[^\w.+]+", "-", "-".join(map(str, parts))).strip("-")


def _writes(args: argparse.Namespace) -> tuple[str, ...]:
    """What a compile writes into its ``--out``: the report, its IR folders (the request's and its
    twins': ``blocks_*`` for the DiT, ``layers_*`` for the text encoder, ``irs`` for the VAE), the
    worker logs and the system descriptor."""
    if args.component == "vae":
        return (REPORT, "irs")
    unit = "layers" if text_encoder.encoder_only(args) else "blocks"
    return (REPORT, f"{unit}_{args.blocks or 'all'}*", *WORK_FILES)


def _written(out: Path, args: argparse.Namespace) -> list[Path]:
    """What of :func:`_writes` is in ``out`` now, the report aside."""
    return [p for pattern in _writes(args)[1:] for p in sorted(out.glob(pattern))]


def _validate_compile(args: argparse.Namespace) -> None:
    from ..systems import rank_binding

    if args.component == "vae":
        args.resolution = args.resolution or "480p"
        check_vae_compile(args)
    else:
        if args.vae_kind is not None or args.strategy is not None or args.step is not None:
            raise UsageError("--vae-kind, --strategy and --step are the VAE's; use them with --component vae")
        text_encoder.validate_compile(args)
    apply_plan(args, binding_mesh(args, "8x4"))
    args.rank_binding = args.rank_binding or (args.plan.rank_binding if args.plan is not None else None) or None
    if args.rank_binding:
        args.arch = args.arch or rank_binding(args.rank_binding).arch
        check_binding(args)
    args.arch = args.arch or DEFAULT_ARCH
    if args.out is None:
        args.out = str(default_out(args))
    output_dir(args.out, "--out", _writes(args), args.overwrite)


def _cmd_compile(args: argparse.Namespace) -> int:
    _validate_compile(args)
    out = Path(args.out)
    if args.overwrite:  # what an earlier run left: no stale IR can then be mistaken for this run's
        for old in [out / REPORT, *_written(out, args)]:
            if old.is_dir():
                scratch.remove(old)
            else:
                old.unlink(missing_ok=True)
    if args.component == "vae":
        return compile_vae(args, out, lambda cited: keep_cited(cited, _written(out, args)))
    # the UMT5 text encoder: its own request (its report and per-layer bill come with it)
    return _report(args, text_encoder.compile_report if text_encoder.encoder_only(args) else _dit_report)


def _dit_report(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The DiT's request from the options, compiled with its twins: its report."""
    latent = latent_for(args.resolution, args.latent)
    blocks = args.blocks
    fields = dict(
        variant=args.variant, latent=latent, blocks=blocks, size=args.size,
        anchor=not args.no_anchor, dtype=args.dtype, batch=args.batch,
        frontend=args.frontend, patches=tuple(args.patches), lora_rank=args.lora_rank or 0,
        composites="none" if args.no_fused_sdpa else args.composites, compile_options=args.compile_options,
        mark_arguments=not args.no_argument_marks,
        resolution=args.resolution if args.latent is None else None,
        out_dir=str(out / f"blocks_{blocks or 'all'}"),
    )
    if args.plan is not None and args.plan.cfg_axes:
        # CFG parallel: one program with cond + uncond rows (2-D mesh), or the group's program (3-D)
        from ..compile.cfg import compile_request

        fields.pop("batch")
        req = compile_request(args.plan, args.batch, **fields).validate()
    else:
        req = (CompileRequest.for_plan(args.plan, **fields) if args.plan is not None
               else CompileRequest(mesh=args.mesh, padding=args.padding, **fields)).validate()
    return compile_reports([req], args.arch, timeout=args.timeout, work_dir=out, verbose=args.verbose,
                           rank_binding=args.rank_binding)[0]


def _report(args: argparse.Namespace, make: Callable[[argparse.Namespace, Path], dict[str, Any]]) -> int:
    """``make(args, out)`` (a component's report), written to ``--out`` with the IRs it names (every
    IR with ``--keep-irs``) and printed (``--json``: one JSON object); a request or compile that
    cannot be set up is one line and exit 2."""
    t0 = time.perf_counter()
    out = Path(args.out)
    try:
        report = make(args, out)
    except (CompileError, ValueError) as e:
        if args.json:
            print(json.dumps({"ok": False, "error": str(e)}))
        else:
            print(f"wan-sharding {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    report["wall_seconds"] = round(time.perf_counter() - t0, 2)
    if not args.keep_irs:  # what the report names stays; intermediate dumps, twins and flatbuffers go
        report["removed_bytes"] = keep_cited(report, _written(out, args))
    report["report_path"] = str(out / REPORT)
    atomic_write(out / REPORT, json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
        kept = "every IR and flatbuffer (--keep-irs)" if args.keep_irs else "the IRs it names (--keep-irs: every one)"
        print(f"report: {out / REPORT}, with {kept}")
        print(f"(wall time with both compiles and process start-up: {report['wall_seconds']:.0f} s)")
    return report_exit_code(report)


def add_subcommands(sub: Any) -> None:
    """Add ``sysdesc`` and ``compile`` to an argparse subparsers object; each sets ``func``."""
    archs = list(sysdesc.ARCHS)
    p = sub.add_parser("sysdesc", help="write a tt-mlir system descriptor (.ttsys) for compile-only mode",
                       description="Write a Tenstorrent system descriptor for the chips of a mesh preset, "
                                   "for TT_COMPILE_ONLY_SYSTEM_DESC.")
    p.add_argument("--arch", choices=archs, default="wormhole_b0")
    p.add_argument("--mesh", default="8x4", help=f"mesh preset: {', '.join(PRESETS)} (default 8x4)")
    p.add_argument("--topology", choices=sysdesc.TOPOLOGIES, default="none",
                   help="ethernet links to list (default none: what compile-only needs; machine: a Galaxy-based "
                        "grid as cabled, fewer links between Galaxies)")
    p.add_argument("-o", "--output", required=True, help="file to write (.ttsys)")
    add_overwrite(p)
    p.set_defaults(func=_cmd_sysdesc, validate=_validate_sysdesc)

    c = sub.add_parser(
        "compile", help="compile the sharded DiT with tt-mlir (compile-only) and check its collectives",
        description="Compile the sharded Wan DiT through tt-mlir without hardware, print the TTNN op "
                    "histogram and the per-block collective bill, and check the bill against the design "
                    "and the per-device token dims for tile alignment. Exit 1 when a check fails.")
    add_component(c, ("dit", text_encoder.COMPONENT, "vae"))
    c.add_argument("--mesh", default=None, help=f"mesh preset: {', '.join(PRESETS)} (default 8x4, or the plan's)")
    add_plan(c)
    add_cfg(c)
    add_vae_compile_args(c)
    c.add_argument("--resolution", choices=list(RESOLUTIONS), default=None,
                   help="the DiT's latent, or the VAE's frame (default 480p)")
    c.add_argument("--latent", default=None, type=latent, help="latent F,H,W instead of a resolution, e.g. 21,60,104")
    c.add_argument("--variant", choices=list(VARIANTS), default=None, help="the DiT's variant (default t2v-a14b)")
    c.add_argument("--blocks", type=positive_int, default=None,
                   help="transformer blocks (the text encoder: layers; default: all of the model's)")
    c.add_argument("--tokens", type=positive_int, default=None,
                   help="the text encoder's prompt tokens (default 512, what the Wan pipelines pass; 16 with --size tiny)")
    c.add_argument("--vocab", type=positive_int, default=None,
                   help="the text encoder's vocabulary (default its own, 256384): smaller for a torch-xla trace, which "
                        "holds the replicated embedding once per virtual device in host memory")
    c.add_argument("--size", choices=["full", "tiny"], default="full", help="real widths or the tiny test config")
    c.add_argument("--arch", choices=archs, default=None,
                   help=f"chip architecture (default {DEFAULT_ARCH}, or the rank binding's)")
    add_padding(c, None)
    add_dtype(c, "bf16")
    c.add_argument("--batch", type=positive_int, default=1,
                   help="batch per guidance branch (default 1); with --cfg 2 (or a plan with cfg axes) a 2-D mesh "
                        "compiles one program of twice this batch, cond and uncond rows split over cfg")
    c.add_argument("--frontend", choices=list(FRONTENDS), default="torchax",
                   help="torchax: the DiT as a JAX function, abstract weights (any depth); torch-xla: the lowering "
                        "Tenstorrent hardware compiles (real weights in host memory: keep full width to a few blocks)")
    add_patches(c)
    c.add_argument("--lora-rank", type=positive_int, default=None, metavar="R",
                   help="the DiT carries a rank-R LoRA adapter on every Linear a Wan LoRA targets, split beside its "
                        "bases: the bill with adapters (docs/lora.md; default none)")
    c.add_argument("--composites", choices=list(COMPOSITE_SETS), default=DEFAULT_COMPOSITES,
                   help="StableHLO composites the trace marks: hardware (default: what tt-xla's torch plugin marks: "
                        "SDPA, RMSNorm, LayerNorm, GELU; docs/compile-hardware.md), sdpa (fused attention only), none")
    c.add_argument("--compile-options", type=compile_options, default=None, metavar="KEY=VALUE,...",
                   help="tt-mlir options as tt-xla's plugin spells them, over hardware's defaults (optimization_level=1,"
                        "experimental-enable-dram-space-saving-optimization=true,enable_trace=true); e.g. "
                        "optimization_level=0")
    c.add_argument("--no-fused-sdpa", action="store_true", help="the same as --composites none")
    c.add_argument("--no-argument-marks", action="store_true",
                   help="do not mark arguments as parameter / constant / input the way tt-xla does on hardware "
                        "(every argument then counts as an input and weights are prepared in every step)")
    c.add_argument("--no-anchor", action="store_true",
                   help="drop the replicated constraint before each L-on-SP split (shows why it is there)")
    c.add_argument("--out", default=None, help="folder for report.json and the IRs it names (default: a folder per "
                                                f"configuration under {DEFAULT_OUT}/)")
    c.add_argument("--keep-irs", action="store_true",
                   help="also keep every intermediate IR, the flatbuffers, the shallow and unpadded twins and the logs")
    add_overwrite(c)
    c.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds for both compiles (default 3600)")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    c.add_argument("-v", "--verbose", action="store_true", help="echo the compiler log")
    add_multihost(c, launch=False)
    c.set_defaults(func=_cmd_compile, validate=_validate_compile)
