"""``generate`` and ``profile``: the sharded pipeline, end to end (the work: ``wan_sharding.jobs``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..jobs.generate import __doc__ as GENERATE_DOC
from ..jobs.generate import run_generate
from ..jobs.launch import UNSHARDED
from ..jobs.requests import check_video_format
from ..jobs.profile import PROFILE_LATENTS, WHAT, note_for, run_profile
from ..jobs.profile import __doc__ as PROFILE_DOC
from ..models import VARIANTS
from ..options import EXECUTING_BACKENDS, vae_placement
from . import text_encoder
from .args import (add_cache, add_cfg, add_dtype, add_mesh, add_multihost, add_overwrite, add_padding, add_patches,
                   add_plan, add_text_encoder, print_settings, stack_missing)
from .dryrun import dry_run
from .lora import add_lora, validate_lora
from .vae import add_vae_placement, check_vae_frame
from .launch import binding_mesh, check_launch
from .validate import apply_plan, check_generate, check_profile

BACKEND_HELP = "xla or jax: CPU virtual devices; tt: Tenstorrent devices (needs Tenstorrent's stack)"


def worker_params(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options as the worker's JSON parameters (a plan as its dict)."""
    out = {k: v for k, v in vars(args).items() if k not in ("func", "validate")}  # the command's functions
    if args.plan is not None:
        out.update(plan=args.plan.to_dict(), plan_name=args.plan.name)
    return out


def _validate_generate(args: argparse.Namespace) -> None:
    args.vae = vae_placement(args.vae, args.backend)
    apply_plan(args, binding_mesh(args, "2x4"))
    check_generate(args)
    check_vae_frame(args)
    validate_lora(args)
    check_video_format(args.video_format)
    text_encoder.validate_pipeline(args)
    check_launch(args, [args.backend])


def _validate_profile(args: argparse.Namespace) -> None:
    check_profile(args)  # before apply_plan: it refuses --plan with --mesh unsharded
    validate_lora(args)
    apply_plan(args, binding_mesh(args, "2x4"))
    check_launch(args, [args.backend])


def _generate(args: argparse.Namespace) -> int:
    _validate_generate(args)
    if dry_run(args, "generate"):
        return 0
    if stack_missing([args.backend]):
        return 1
    print_settings(args)
    run = run_generate(worker_params(args))
    if not run.ok:
        return run.returncode
    return 0 if run.results[-1].get("pcc_ok", True) else 1


def _profile(args: argparse.Namespace) -> int:
    _validate_profile(args)
    if dry_run(args, "profile"):
        return 0
    if stack_missing([args.backend]):
        return 1
    if not args.json:
        print_settings(args)
    run = run_profile(worker_params(args), echo=not args.json)
    if not run.ok:
        if args.json:
            print(run.output[-4000:], file=sys.stderr)
        return run.returncode
    if args.json:
        print(json.dumps({"results": run.results, "note": note_for(args.backend)}, indent=1))
    return 0


def add_pipeline_source(ap: argparse.ArgumentParser) -> None:
    """Which pipeline runs where: ``--mesh`` / ``--plan``, ``--backend``, ``--variant``, ``--model``
    (``generate`` and ``serve`` take the same)."""
    add_mesh(ap, None, help="mesh preset (default 2x4, or the plan's)")
    add_cfg(ap)
    add_plan(ap)
    ap.add_argument("--backend", default="jax", choices=list(EXECUTING_BACKENDS), help=f"{BACKEND_HELP} (default jax)")
    ap.add_argument("--variant", default="t2v-a14b", choices=VARIANTS,
                    help="the tiny pipeline's variant (ignored with --model: the checkpoint decides)")
    ap.add_argument("--model", help="a local diffusers Wan 2.2 checkpoint directory (needs transformers)")
    add_multihost(ap)
    add_text_encoder(ap)


def add_subcommands(sub: Any) -> None:
    """Add ``generate`` and ``profile``."""
    g = sub.add_parser("generate", help="run a Wan 2.2 pipeline with both experts sharded; write the video",
                       description=GENERATE_DOC.split("\n\n")[0])
    add_pipeline_source(g)
    g.add_argument("--steps", type=int, default=4)
    g.add_argument("--frames", type=int, help="video frames (default: 5 tiny, 81 with --model)")
    g.add_argument("--height", type=int, help="pixels (default: 64 tiny A14B, 128 tiny TI2V, 480 with --model)")
    g.add_argument("--width", type=int, help="pixels (default: 96 tiny A14B, 192 tiny TI2V, 832 with --model)")
    add_padding(g, None)
    add_patches(g)
    add_cache(g)
    add_lora(g)
    add_vae_placement(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt", default="a red fox running through fresh snow, golden hour")
    g.add_argument("--negative-prompt", default="")
    g.add_argument("--guidance-scale", type=float, default=4.0)
    add_dtype(g, None, help="default: fp32 tiny, bf16 with --model")
    g.add_argument("--video-format", default="mp4", choices=["mp4", "gif"], help="the video's format: H.264 MP4 "
                                                                                 "(default) or an animated GIF")
    g.add_argument("--out", default="results/generate", help="directory for the video and the JSON summary "
                                                             "(default results/generate)")
    add_overwrite(g)
    g.add_argument("--compare", action="store_true",
                   help="also run it unsharded with the same seed and print the PCC of the final latents (and of "
                        "the decoded video with --vae mesh)")
    g.set_defaults(func=_generate, validate=_validate_generate)

    p = sub.add_parser("profile", help="warm-iteration timing of the sharded DiT, denoising step or VAE decode",
                       description=PROFILE_DOC.split("\n\n")[0])
    add_mesh(p, None, UNSHARDED, help=f"a preset, or '{UNSHARDED}' (one device, no TP/SP: the baseline); default 2x4, "
                                       "or the plan's")
    add_cfg(p)
    add_plan(p)
    p.add_argument("--backend", default="jax", choices=list(EXECUTING_BACKENDS), help=f"{BACKEND_HELP} (default jax)")
    p.add_argument("--what", nargs="+", default=["dit"], choices=list(WHAT),
                   help="dit: one DiT forward; step: cond + uncond forward, CFG, scheduler step; vae: the VAE's "
                        "decode of the latent, sharded beside the host's (docs/vae.md's CPU table: --latent 3,16,24)")
    p.add_argument("--variant", default="t2v-a14b", choices=VARIANTS)
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations (the first compiles)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations")
    add_padding(p, None)
    add_patches(p)
    add_cache(p)
    add_lora(p)
    p.add_argument("--resolution", default="small", choices=sorted(PROFILE_LATENTS),
                   help="latent preset: tiny 3x10x14 (105 tokens), small 5x30x52 (1950 tokens)")
    p.add_argument("--latent", help="latent shape F,H,W (overrides --resolution)")
    add_dtype(p, "fp32")
    p.add_argument("--json", action="store_true")
    add_multihost(p)
    p.set_defaults(func=_profile, validate=_validate_profile)
