"""``check`` (the main job), ``specs`` and ``meshes``."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..jobs.check import CASE_LATENTS, Case, run_in_subprocess
from ..jobs.pcc import PCC_THRESHOLDS, grade
from ..mesh import PRESET_TABLE, PRESET_MACHINES, mesh_from_preset
from ..models import VARIANTS
from ..options import CPU_BACKENDS, EXECUTING_BACKENDS, vae_placement
from . import text_encoder
from .lora import add_lora, validate_lora
from .args import (add_cfg, add_component, add_dtype, add_mesh, add_multihost, add_padding, add_patches, add_plan,
                   add_text_encoder, preset, presets, print_settings, stack_missing)
from .dryrun import dry_run
from .launch import binding_mesh, check_launch
from .vae import add_vae_placement, check_vae, check_vae_request
from .validate import UsageError, apply_plan, cfg_plan, check_length, check_rope_length

DEFAULT_MESHES = ("1x4", "2x4", "8x4")
CFG_MESHES = ("2x4", "8x4")  # --cfg 2: the presets with an even SP axis to cut in two


def _validate_check(args: argparse.Namespace) -> None:
    from ..models import config_for

    if args.component == "vae":
        check_vae_request(args)
        return
    text_encoder.validate_check(args)  # before the DiT's defaults fill in what was not given
    args.variant = args.variant or "t2v-a14b"
    args.lengths = args.lengths or ["aligned", "padded"]

    if args.cfg == 2:
        if args.plan is not None:
            raise UsageError("--cfg 2 with --plan: the plan says whether it has a cfg axis; leave --cfg out")
        # one plan per mesh, each cut into guidance groups (a mesh that cannot be: one line, now)
        args.cfg_plans = {m: cfg_plan(m, 2, args.padding) for m in (args.meshes or binding_mesh(args, CFG_MESHES))}
        args.meshes = list(args.cfg_plans)
    apply_plan(args, binding_mesh(args, list(DEFAULT_MESHES)), "--meshes")
    for length in args.lengths:
        if length not in CASE_LATENTS:
            check_rope_length(length, config_for(args.variant)["rope_max_seq_len"], "--lengths")
    check_launch(args, args.backends)
    validate_lora(args)
    if args.distributed and args.vae == "mesh":
        raise UsageError("--vae mesh with --rank-binding: the VAE's check runs on one host; check the VAE with "
                         "--component vae on one host, or leave --vae out")


def _check(args: argparse.Namespace) -> int:
    _validate_check(args)
    if dry_run(args, "check"):
        return 0
    if stack_missing(args.backends):
        return 1
    if not args.json:
        if args.plan is not None:
            print(f"plan: {args.plan.name}")
        print_settings(args)
    if args.component == "vae":
        return check_vae(args)
    cases = [] if text_encoder.encoder_only(args) else [
        Case(args.variant, length, args.dtype, args.padding, "+".join(args.patches)) for length in args.lengths]
    cases += text_encoder.check_cases(args)  # the UMT5 encoder's rows (--component text-encoder, --text-encoder mesh)
    rows: list[dict[str, Any]] = []
    failed = False
    start = time.perf_counter()
    for backend in args.backends:
        for mesh in args.meshes:
            plan = getattr(args, "cfg_plans", {}).get(mesh, args.plan)
            label = f"{mesh}-cfg2" if plan is not None and plan.cfg_axes else mesh
            for r in run_in_subprocess(backend, label, cases, plan=plan, distributed=args.distributed,
                                       lora=args.lora, lora_mode=args.lora_mode):
                failed |= not r["ok"]
                header = not rows or rows[-1]["component"] != r["component"]
                rows.append(r)
                if not args.json:
                    (text_encoder.print_row if r["component"] == text_encoder.COMPONENT else _print_row)(r, header)
    # --vae mesh (tt's default on one host): the VAE's rows after the DiT's
    on_mesh = [] if args.distributed or text_encoder.encoder_only(args) else [b for b in args.backends if vae_placement(args.vae, b) == "mesh"]
    if on_mesh:
        vae_args = argparse.Namespace(**{**vars(args), "backends": on_mesh, "json": True})
        if not args.json:
            print()
        failed |= check_vae(vae_args, echo=not args.json) != 0
    if args.json:
        print(json.dumps({"results": rows, "ok": not failed}, indent=1))
    else:
        limits = "; ".join(f"{d} {grade(CPU_BACKENDS[0], d)}" for d in PCC_THRESHOLDS)  # every CPU backend's
        if "tt" in args.backends:  # the chips against the CPU reference: the hardware table
            limits += "; tt: " + ", ".join(f"{d} {grade('tt', d)}" for d in PCC_THRESHOLDS)
        print(f"\n{len(rows)} checks in {time.perf_counter() - start:.0f} s: "
              + (f"all within bounds ({limits})" if not failed else "SOME FAILED"))
    return 1 if failed else 0


def _print_row(r: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'backend':7} {'mesh':9} {'variant':9} {'dtype':5} {'tokens':>11} {'padding':7} "
              f"{'PCC':>12} {'max|diff|':>9}  params col/row/norm/rep  SP points  collectives")
    p = r["params"]
    tokens = f"{r['tokens']}->{r['padded_tokens']}" if r["padded_tokens"] != r["tokens"] else str(r["tokens"])
    coll = ", ".join(f"{k} {v}" for k, v in (r.get("collectives") or {}).items()) or "-"
    print(f"{r['backend']:7} {r['mesh']:9} {r['variant']:9} {r['dtype']:5} {tokens:>11} {r['padding']:7} "
          f"{r['pcc']:12.9f} {r['max_abs']:9.2e}  {p['colwise']}/{p['rowwise']}/{p['norm_colwise']}/{p['replicate']:<14} "
          f"{r['sp_points']:^9}  {coll}{'' if r['ok'] else '  <-- FAIL'}", flush=True)


def _specs(args: argparse.Namespace) -> int:
    from ..models import build_dit
    from ..dit.specs import shard_dit_specs

    mesh = cfg_plan(args.mesh, 2, None).mesh() if args.cfg == 2 else args.mesh  # named e.g. 8x4-cfg2
    if text_encoder.encoder_only(args):  # UMT5's specs on the same mesh rules
        specs = text_encoder.specs(args.size, mesh)
    else:
        specs = shard_dit_specs(build_dit(args.variant, args.size, device="meta"), mesh)  # cfg: TP split in each group
    if args.json:
        print(json.dumps({"mesh": mesh if isinstance(mesh, str) else mesh.name, "component": args.component,
                          "variant": args.variant,
                          "counts": specs.counts(), "cfg": args.cfg,
                          "specs": {n: list(s) for n, s in specs.by_name().items()}}, indent=1))
    else:
        print(specs)
        print("counts:", specs.counts())
    return 0


def _meshes(args: argparse.Namespace) -> int:
    from ..mesh import MeshError, with_cfg

    w_name, w_machine = max(map(len, PRESET_TABLE)), max(map(len, PRESET_MACHINES.values()))
    for name in PRESET_TABLE:
        m = mesh_from_preset(name)
        try:  # what --cfg 2 makes of it: two groups, one per guidance branch
            g = with_cfg(m)
            cfg = f"2 groups of sp={g.sp} tp={g.tp}"
        except MeshError:
            cfg = "-"
        print(f"{name:{w_name}}  {PRESET_MACHINES[name]:{w_machine}}  devices {m.num_devices:3}  "
              f"shape {'x'.join(map(str, m.shape)):5} sp={m.sp:<2} tp={m.tp}  "
              f"tokens padded to a multiple of {m.seq_multiple:<4} --cfg 2: {cfg}")
    from ..systems import RANK_BINDINGS, served_presets

    print("\nrank bindings of tt-xla's distributed runtime (--rank-binding; docs/tt-backend.md):")
    w = max(map(len, RANK_BINDINGS))
    for b in RANK_BINDINGS.values():
        print(f"{b.name:{w}}  {b.summary}; presets: {', '.join(served_presets(b)) or 'none (a plan)'}")
    return 0


def add_subcommands(sub: Any) -> None:
    """Add ``check``, ``specs`` and ``meshes``."""
    check = sub.add_parser("check", help="PCC of the sharded tiny DiT vs unsharded (the default job)")
    check.add_argument("--meshes", nargs="+", default=None, type=presets, choices=list(PRESET_TABLE),
                       metavar="MESH", help=f"mesh presets (default {' '.join(DEFAULT_MESHES)}, or the plan's)")
    add_component(check, ("dit", text_encoder.COMPONENT, "vae"))
    add_text_encoder(check, help="mesh: also check the UMT5 text encoder sharded on each mesh (its rows after the "
                                 "DiT's); host: the DiT only (default)")
    add_vae_placement(check)
    check.add_argument("--vae-kind", default=None, choices=["wan2.1", "wan2.2"],
                       help="with --component vae: one VAE (default both)")
    add_cfg(check)
    add_plan(check)
    check.add_argument("--backends", nargs="+", default=list(CPU_BACKENDS), choices=list(EXECUTING_BACKENDS),
                       help=f"default {' '.join(CPU_BACKENDS)} (CPU virtual devices); tt runs on Tenstorrent "
                            "devices and needs Tenstorrent's stack")
    check.add_argument("--variant", default=None, choices=VARIANTS, help="the DiT's variant (default t2v-a14b)")
    check.add_argument("--lengths", nargs="+", default=None, type=check_length(tuple(CASE_LATENTS)),
                       help="'aligned' (256 tokens), 'padded' (105 tokens) or a latent shape F,H,W (default both)")
    add_dtype(check, "fp32")
    add_padding(check, None)
    add_patches(check)
    add_lora(check)
    check.add_argument("--json", action="store_true")
    add_multihost(check)
    check.set_defaults(func=_check, validate=_validate_check)

    specs = sub.add_parser("specs", help="print the partition spec of every parameter")
    add_component(specs, ("dit", text_encoder.COMPONENT))
    add_mesh(specs, "8x4")
    add_cfg(specs)
    specs.add_argument("--variant", default="t2v-a14b", choices=VARIANTS)
    specs.add_argument("--size", default="full", choices=["full", "tiny"])
    specs.add_argument("--json", action="store_true")
    specs.set_defaults(func=_specs)

    meshes = sub.add_parser("meshes", help="list the mesh presets")
    meshes.set_defaults(func=_meshes)
