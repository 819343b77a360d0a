"""``serve`` and ``submit``: a resident sharded pipeline behind an HTTP API, and its client
(the work: ``wan_sharding.serve``; docs/serving.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..jobs.requests import RequestLimits, check_limits, check_video_format
from ..options import vae_placement
from ..planner.hardware import ARCHS
from ..planner.serving import TT_ARCH
from . import text_encoder
from .args import add_cache, add_dtype, add_padding, add_patches, stack_missing
from .dryrun import dry_run
from .pipeline import add_pipeline_source, worker_params
from .launch import binding_mesh, check_launch
from .lora import add_serve_lora, validate_lora
from .vae import add_vae_placement, check_vae_frame
from .validate import (
    REQUEST_FLAGS,
    UsageError,
    apply_plan,
    check_counts,
    check_video,
    model_dir,
    output_dir,
    positive_float,
    positive_int,
    server_url,
)

DEFAULT_PORT = 8765


def check_serve(args: argparse.Namespace) -> None:
    """``serve``: the checks of ``generate`` on the request defaults, a mesh that splits into
    ``--replicas`` meshes the model shards on, a writable store, a port, and an API key whenever
    the server listens beyond this machine."""
    from ..pipeline.video import mp4_encoder_missing
    from ..serve.server import API_KEY_ENV, api_key_from, is_loopback, replicas_of

    check_counts({f"--{flag}": getattr(args, flag) for flag in ("steps", "frames", "height", "width")})
    if args.model is not None:
        model_dir(args.model)
    check_video(args.frames, args.height, args.width, args.variant, args.model)
    check_vae_frame(args)
    text_encoder.validate_pipeline(args)
    missing = mp4_encoder_missing()
    if missing:  # a request gets MP4 unless it asks for a GIF
        raise UsageError(f"{missing}: the server writes MP4 videos")
    replicas_of({"replicas": args.replicas, "variant": args.variant, "model": args.model, "mesh": args.mesh,
                 "plan": args.plan.to_dict() if args.plan is not None else None})
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: not a TCP port; use 1-65535 (0: any free port)")
    args.api_key = api_key_from(args.api_key)
    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable() and
                                         " " not in args.api_key):
        raise UsageError("--api-key: a key must be printable ASCII without spaces (an HTTP header carries it); pick "
                         "another key")
    from ..serve.server import request_limits

    from ..jobs.requests import video_factors
    from ..serve.server import request_defaults

    defaults = request_defaults(vars(args))
    check_limits({"num_inference_steps": args.steps, "num_frames": defaults["num_frames"],
                  "height": defaults["height"], "width": defaults["width"]},
                 request_limits({**vars(args), "plan": args.plan.to_dict() if args.plan is not None else None}),
                 REQUEST_FLAGS, factors=video_factors(args.variant, args.model))
    if args.keep_days < 0 or args.keep_jobs < 0:
        raise UsageError(f"--keep-days {args.keep_days:g} --keep-jobs {args.keep_jobs}: must be >= 0 (0: no bound)")
    output_dir(args.store, "--store")
    if not is_loopback(args.host) and not args.api_key:
        raise UsageError(f"--host {args.host} reaches beyond this machine, so the API needs a key; pass --api-key KEY "
                         f"(or set {API_KEY_ENV}), or keep the default --host 127.0.0.1")


def _validate_serve(args: argparse.Namespace) -> None:
    args.vae = vae_placement(args.vae, args.backend)
    if args.arch is not None and args.backend != "tt":
        raise UsageError(f"--arch {args.arch}: only a tt server's limits are sized by a chip's DRAM (on "
                         f"{args.backend} by this host's memory); drop --arch or pass --backend tt")
    if args.rank_binding is not None:  # the binding's chips size the limits
        from ..systems import rank_binding

        chips = rank_binding(args.rank_binding).arch
        if args.arch not in (None, chips):
            raise UsageError(f"--arch {args.arch} contradicts --rank-binding {args.rank_binding} ({chips} chips); "
                             f"pass --arch {chips} or leave it out")
        args.arch = chips
    apply_plan(args, binding_mesh(args, "2x4"))
    validate_lora(args, serve=True)  # before the store is made: a refused adapter leaves nothing behind
    check_serve(args)
    check_launch(args, [args.backend])


def _validate_submit(args: argparse.Namespace) -> None:
    server_url(args.server)
    # the rules any server applies, with the widest defaults (a checkpoint's); the server checks its own
    check_limits({"prompt": args.prompt, "negative_prompt": args.negative_prompt, "num_inference_steps": args.steps,
                  "num_frames": args.frames, "height": args.height, "width": args.width, "seed": args.seed,
                  "guidance_scale": args.guidance_scale}, RequestLimits(frames=121), REQUEST_FLAGS)
    output_dir(args.out, "--out")
    if args.image is not None:
        from ..serve.client import read_image

        read_image(args.image, "--image")
        if args.frame_pos < 0:
            raise UsageError(f"--frame-pos {args.frame_pos}: must be >= 0 (0: the first frame)")
    elif args.frame_pos:
        raise UsageError("--frame-pos places the --image; pass --image PATH with it")
    if args.video_format == "mp4":
        check_video_format("mp4")


def _serve(args: argparse.Namespace) -> int:
    _validate_serve(args)
    if dry_run(args, "serve"):
        return 0
    if stack_missing([args.backend]):
        return 1
    from ..serve.server import serve

    return serve(worker_params(args))


def _submit(args: argparse.Namespace) -> int:
    from ..serve.client import Client, ServeError

    _validate_submit(args)
    client = Client(args.server, api_key=args.api_key)
    fields = dict(prompt=args.prompt, negative_prompt=args.negative_prompt, num_inference_steps=args.steps,
                  seed=args.seed, guidance_scale=args.guidance_scale, num_frames=args.frames, height=args.height,
                  width=args.width, video_format=args.video_format, image=args.image, frame_pos=args.frame_pos)
    try:
        job = client.submit(**fields)
    except ServeError as e:
        if e.status in (413, 415, 422):  # the request (an image, a field) refused: a usage error, exit 2
            raise UsageError(str(e).split(": ", 1)[1]) from None
        print(f"wan-sharding submit: error: {e}", file=sys.stderr)
        return 1
    print(f"job {job['id']} queued on {args.server}", flush=True)
    if args.detach:
        return 0
    try:
        job = client.wait(job["id"], on_progress=_progress_bar())
    except KeyboardInterrupt:
        client.cancel(job["id"])
        print(f"wan-sharding submit: interrupted; job {job['id']} was cancelled on the server", file=sys.stderr)
        raise
    except ServeError as e:
        print(f"wan-sharding submit: error: {e}", file=sys.stderr)
        return 1
    if job["status"] != "completed":
        error = (job.get("error") or {}).get("message", "")
        print(f"wan-sharding submit: error: job {job['id']} {job['status']}: {error}".rstrip(": "),
              file=sys.stderr)
        return 1
    path = client.download(job["id"], args.out)
    t = job["timings"]
    print(f"job {job['id']} completed: {path} ({job['progress']['total']} steps, ran {t.get('run_seconds', 0):.2f} s "
          f"after {t.get('queued_seconds', 0):.2f} s queued)", flush=True)
    return 0


def _progress_bar() -> Any:
    """``on_progress`` for :meth:`Client.wait`: a tqdm bar on stderr from the job's ``progress``."""
    from tqdm import tqdm

    from ..serve.store import FINISHED

    bar: dict[str, Any] = {}

    def update(job: dict[str, Any]) -> None:
        done, total = job["progress"]["done"], job["progress"]["total"]
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, unit="step", desc="queued", file=sys.stderr)
        b = bar["bar"]
        b.set_description(job["status"])
        b.update(done - b.n)
        if job["status"] in FINISHED:
            b.close()

    return update


def add_limits(s: argparse.ArgumentParser) -> None:
    """serve's bounds on one request (docs/serving.md, "Limits"), on connections and on the store."""
    g = s.add_argument_group("limits", "what one request may cost (default: sized from the model), connections and "
                                       "how long finished jobs are kept (docs/serving.md)")
    for flag, what in (("steps", "denoising steps"), ("frames", "frames"), ("height", "pixels of height"),
                       ("width", "pixels of width"),
                       ("frame-pixels", "height x width"), ("prompt-bytes", "UTF-8 bytes of each prompt"),
                       ("prompt-tokens", "tokens of each prompt"), ("images", "conditioning images"),
                       ("image-pixels", "pixels of each image"),
                       ("tokens", "DiT tokens (frames x height x width after the VAE and the patch)")):
        g.add_argument(f"--max-{flag}", type=positive_int, metavar="N", help=f"the most {what} a request may ask for")
    g.add_argument("--max-image-mb", type=positive_float, metavar="MB", help="the largest image file (default 10)")
    g.add_argument("--arch", choices=list(ARCHS), default=None,
                   help="with --backend tt: the chip whose DRAM sizes the request limits (default: the rank "
                        f"binding's, else {TT_ARCH}, the smaller DRAM)")
    g.add_argument("--header-timeout", type=positive_float, metavar="S",
                   help="seconds a request head may take to arrive (default 10): then 408 and the connection closed")
    g.add_argument("--body-timeout", type=positive_float, metavar="S",
                   help="the longest pause while a request body arrives (default 30): then 408")
    g.add_argument("--max-connections", type=positive_int, metavar="N",
                   help="open connections (default 256); one more closes the oldest not running a request")
    g.add_argument("--keep-days", type=float, default=7.0, metavar="D",
                   help="finished jobs (and their videos) are removed D days after they ended (default 7; 0: kept)")
    g.add_argument("--keep-jobs", type=int, default=1000, metavar="N",
                   help="at most the N newest finished jobs are kept (default 1000; 0: no bound)")


def add_subcommands(sub: Any) -> None:
    """Add ``serve`` and ``submit``."""
    s = sub.add_parser("serve", help="serve the sharded pipeline over HTTP: one resident worker, a queue, recovery",
                       description="An HTTP server (docs/serving.md) in front of one resident worker that loads and "
                                   "shards the pipeline once and warms it up before accepting jobs.")
    add_pipeline_source(s)
    add_padding(s, None)
    add_patches(s)
    add_cache(s)
    add_vae_placement(s)
    add_dtype(s, None, help="default: fp32 tiny, bf16 with --model")
    add_serve_lora(s)
    s.add_argument("--steps", type=int, default=4, help="steps of a request that leaves them out, and of the warm-up")
    s.add_argument("--frames", type=int, help="frames of a request that leaves them out (default: generate's)")
    s.add_argument("--height", type=int, help="height of a request that leaves it out (default: generate's)")
    s.add_argument("--width", type=int, help="width of a request that leaves it out (default: generate's)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other needs "
                                                       "--api-key)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: a free one)")
    s.add_argument("--queue", type=positive_int, default=8, metavar="N",
                   help="jobs that may wait; more get 429 with Retry-After (default 8)")
    s.add_argument("--job-timeout", type=positive_float, default=600.0, metavar="S",
                   help="seconds a job may run: then it fails and the worker stops it at its step's end (default 600)")
    s.add_argument("--stall-timeout", type=positive_float, metavar="S",
                   help="seconds without a finished step and without CPU use before a worker counts as hung and is "
                        "replaced (default 90 on CPU backends; never on tt, whose worker waits on its chips)")
    s.add_argument("--store", default="results/serve", metavar="DIR",
                   help="jobs database and videos; a server restarted on it serves them again (default results/serve)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                                     "(default: $WAN_SHARDING_API_KEY)")
    s.add_argument("--prompt-cache-mb", type=positive_float, default=None, metavar="MB",
                   help="memory for the worker's prompt embeddings, each prompt encoded once and reused for a repeated "
                        "prompt (default 256: 64 full-size prompts; docs/serving.md)")
    add_limits(s)
    s.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                   help="split the mesh into N equal sub-meshes, one resident worker each, serving jobs side by side "
                        "(default 1)")
    s.set_defaults(func=_serve, validate=_validate_serve)

    c = sub.add_parser("submit", help="send a job to `wan-sharding serve`, show its progress, download the video",
                       description="The client of `wan-sharding serve` (also wan_sharding.serve.Client).")
    c.add_argument("--server", default=f"http://127.0.0.1:{DEFAULT_PORT}",
                   help=f"the server's URL (default http://127.0.0.1:{DEFAULT_PORT})")
    c.add_argument("--api-key", help="the server's key (default: $WAN_SHARDING_API_KEY)")
    c.add_argument("--prompt", default="a red fox running through fresh snow, golden hour")
    c.add_argument("--negative-prompt", default="")
    c.add_argument("--steps", type=positive_int, help="denoising steps (default: the server's)")
    c.add_argument("--frames", type=positive_int, help="video frames, 4k+1 (default: the server's)")
    c.add_argument("--height", type=positive_int, help="pixels (default: the server's)")
    c.add_argument("--width", type=positive_int, help="pixels (default: the server's)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--guidance-scale", type=float, default=4.0)
    c.add_argument("--image", metavar="PATH", help="image to video: the conditioning image (PNG, JPEG, WebP); the "
                                                  "server must run i2v-a14b or ti2v-5b")
    c.add_argument("--frame-pos", type=int, default=0, metavar="N",
                   help="the frame --image anchors: 0 (default), or the last frame (frames - 1) on i2v-a14b")
    c.add_argument("--video-format", default="mp4", choices=["mp4", "gif"], help="the video's format (default mp4)")
    c.add_argument("--out", default="results/submit", help="directory for the downloaded video")
    c.add_argument("--detach", action="store_true", help="print the job id once queued and exit (no download)")
    c.set_defaults(func=_submit, validate=_validate_submit)
