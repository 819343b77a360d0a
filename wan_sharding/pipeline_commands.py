"""``wan-sharding generate`` and ``wan-sharding profile``: the sharded pipeline, end to end.

- ``generate``: a Wan 2.2 pipeline (the tiny offline one, or ``--model PATH``) with both experts
  sharded by :func:`wan_sharding.pipeline.shard_pipeline`, a few denoising steps through the
  pipeline's own ``__call__``, the video written as a GIF (MP4 when ``imageio`` + ``imageio-ffmpeg``
  are installed) plus a JSON summary. ``--compare`` first runs the same pipeline unsharded with the
  same seed and reports the PCC of the final latents.
- ``profile``: the warm-iteration protocol (N warm-up iterations, the first compiles; M timed
  iterations, each a forward plus the copy to host) for the DiT alone or a whole denoising step
  (cond + uncond forward, CFG, scheduler step), on ``jax`` or ``xla``. ``--mesh unsharded`` is the
  baseline: the same backend on one device, replicated weights, no SP hooks.

Each run happens in a worker process with the backend's environment (torch-xla and JAX must not
share a process): ``python -m wan_sharding.pipeline_commands KIND JSON`` prints its human-readable
lines and one ``RESULT {json}`` line per result on stdout; the pipeline's progress bar goes to
stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .mesh import PRESETS, mesh_from_preset
from .plan import DEFAULT_PADDING
from .workers import STALL_SECONDS, run_watched

UNSHARDED = "unsharded"
CPU_NOTE = "CPU virtual devices: timings compare configurations on this host; they are not hardware predictions"
# Profile latents (F, H, W): "tiny" is check.py's padded case (105 tokens); "small" 1950 tokens.
PROFILE_LATENTS = {"tiny": (3, 10, 14), "small": (5, 30, 52)}
PCC_THRESHOLDS = {"fp32": 0.9999, "bf16": 0.99}


# ------------------------------------------------------------------------------ parent side


def _num_devices(meshes: list[str]) -> int:
    return max(1 if m == UNSHARDED else mesh_from_preset(m).num_devices for m in meshes)


def worker_env(backend: str, num_devices: int) -> dict[str, str]:
    """``check.backend_env`` plus quiet imports: the diffusers Wan pipeline modules import
    ``transformers`` and (when installed) ``torch_xla``, also in a JAX worker."""
    from .check import backend_env

    env = backend_env(backend, num_devices)
    env.setdefault("PJRT_DEVICE", "CPU")  # torch_xla, imported by diffusers, would warn about the default
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
    return env


def run_worker(kind: str, params: dict[str, Any], backend: str, num_devices: int, echo: bool = True,
               timeout: float | None = None, stall_s: float = STALL_SECONDS,
               retries_on_stall: int = 1) -> tuple[int, list[dict[str, Any]], str]:
    """Run one ``pipeline_commands`` worker; returns (exit code, RESULT dicts, stdout). With
    ``echo`` its other stdout lines are printed as they come and its stderr (progress bars) goes
    straight to ours. A hung worker is restarted (see :func:`wan_sharding.workers.run_watched`).
    """
    cmd = [sys.executable, "-m", "wan_sharding.pipeline_commands", kind, json.dumps(params)]
    return run_watched(cmd, worker_env(backend, num_devices), label=f"{backend} worker ({kind})", echo=echo,
                       timeout=timeout, stall_s=stall_s, retries_on_stall=retries_on_stall)
    raise AssertionError("unreachable")


def compare_in_subprocess(backend: str, meshes: list[str], variant: str = "t2v-a14b", steps: int = 2,
                          padding: str = DEFAULT_PADDING, dtype: str = "fp32", seed: int = 0,
                          timeout: float = 900) -> list[dict[str, Any]]:
    """Sharded vs unsharded pipeline latents for each mesh, in one worker process (JAX runs every
    mesh on a subset of one process's devices; torch-xla needs one process per mesh size).
    Each result also says whether ``remove()`` restored the pipeline exactly."""
    if backend == "xla" and len({mesh_from_preset(m).num_devices for m in meshes}) > 1:
        raise ValueError("the xla backend runs one device count per process; call once per mesh")
    params = dict(meshes=meshes, variant=variant, steps=steps, padding=padding, dtype=dtype, seed=seed,
                  backend=backend)
    rc, results, out = run_worker("compare", params, backend, _num_devices(meshes), echo=False, timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"{backend} compare worker failed (exit {rc}):\n{out[-4000:]}")
    return results


def _generate(args: argparse.Namespace) -> int:
    params = {k: v for k, v in vars(args).items() if k != "func"}
    rc, results, _ = run_worker("generate", params, args.backend, _num_devices([args.mesh]))
    if rc != 0:
        return rc
    r = results[-1]
    return 0 if r.get("pcc_ok", True) else 1


def _profile(args: argparse.Namespace) -> int:
    params = {k: v for k, v in vars(args).items() if k != "func"}
    rc, results, out = run_worker("profile", params, args.backend, _num_devices([args.mesh]), echo=not args.json)
    if rc != 0:
        if args.json:
            print(out[-4000:], file=sys.stderr)
        return rc
    if args.json:
        print(json.dumps({"results": results, "note": CPU_NOTE}, indent=1))
    return 0


def add_subcommands(sub: Any) -> None:
    """Add ``generate`` and ``profile`` to the ``wan-sharding`` subparsers."""
    from .attention import PADDING_MODES
    from .models import VARIANTS

    meshes = list(PRESETS)
    g = sub.add_parser("generate", help="run a Wan 2.2 pipeline with both experts sharded; write the video",
                       description=__doc__.split("\n\n")[1])
    g.add_argument("--mesh", default="2x4", choices=meshes)
    g.add_argument("--backend", default="jax", choices=["jax", "xla"])
    g.add_argument("--variant", default="t2v-a14b", choices=VARIANTS,
                   help="the tiny pipeline's variant (ignored with --model: the checkpoint decides)")
    g.add_argument("--model", help="a local diffusers Wan 2.2 checkpoint directory (needs transformers)")
    g.add_argument("--steps", type=int, default=4)
    g.add_argument("--frames", type=int, help="video frames (default: 5 tiny, 81 with --model)")
    g.add_argument("--height", type=int, help="pixels (default: 64 tiny A14B, 128 tiny TI2V, 480 with --model)")
    g.add_argument("--width", type=int, help="pixels (default: 96 tiny A14B, 192 tiny TI2V, 832 with --model)")
    g.add_argument("--padding", default=DEFAULT_PADDING, choices=sorted(PADDING_MODES))
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt", default="a red fox running through fresh snow, golden hour")
    g.add_argument("--negative-prompt", default="")
    g.add_argument("--guidance-scale", type=float, default=4.0)
    g.add_argument("--dtype", choices=["fp32", "bf16"], help="default: fp32 tiny, bf16 with --model")
    g.add_argument("--out", default="results/generate", help="directory for the video and the JSON summary")
    g.add_argument("--compare", action="store_true",
                   help="also run it unsharded with the same seed and print the PCC of the final latents")
    g.set_defaults(func=_generate)

    p = sub.add_parser("profile", help="warm-iteration timing of the sharded DiT or denoising step",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--mesh", default="2x4", choices=meshes + [UNSHARDED],
                   help=f"a preset, or '{UNSHARDED}' (one device, no TP/SP: the baseline)")
    p.add_argument("--backend", default="jax", choices=["jax", "xla"])
    p.add_argument("--what", nargs="+", default=["dit"], choices=["dit", "step"],
                   help="dit: one DiT forward; step: cond + uncond forward, CFG, scheduler step")
    p.add_argument("--variant", default="t2v-a14b", choices=VARIANTS)
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations (the first compiles)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations")
    p.add_argument("--padding", default=DEFAULT_PADDING, choices=sorted(PADDING_MODES))
    p.add_argument("--resolution", default="small", choices=sorted(PROFILE_LATENTS),
                   help="latent preset: tiny 3x10x14 (105 tokens), small 5x30x52 (1950 tokens)")
    p.add_argument("--latent", help="latent shape F,H,W (overrides --resolution)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_profile)


# ------------------------------------------------------------------------------ worker side


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _mesh_arg(backend: str, name: str) -> Any:
    """The mesh to shard on: the preset name, or (JAX, when the process has more devices) a JAX
    mesh over the first devices, so one process can try several meshes."""
    spec = mesh_from_preset(name)
    if backend == "jax":
        import jax
        import numpy as np
        from jax.sharding import Mesh

        devices = jax.devices()
        if len(devices) > spec.num_devices:
            return Mesh(np.array(devices[: spec.num_devices]).reshape(spec.shape), spec.axis_names)
    return name


def _pcc(a, b) -> tuple[float, float]:
    from .check import pcc

    a64, b64 = a.double(), b.double()
    return pcc(a64, b64), float((a64 - b64).abs().max())


def write_video(frames, stem: Path, fps: int = 8) -> Path:
    """``frames``: (F, H, W, 3) floats in [0, 1]. MP4 when imageio + imageio-ffmpeg are installed,
    else an animated GIF (Pillow only)."""
    import importlib.util

    import numpy as np

    stem.parent.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("imageio") and importlib.util.find_spec("imageio_ffmpeg"):
        from diffusers.utils import export_to_video

        return Path(export_to_video(list(frames), str(stem.with_suffix(".mp4")), fps=fps))
    from diffusers.utils import export_to_gif
    from PIL import Image

    images = [Image.fromarray((np.clip(f, 0, 1) * 255).round().astype(np.uint8)) for f in frames]
    return Path(export_to_gif(images, str(stem.with_suffix(".gif")), fps=fps))


def _generate_worker(p: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from .pipeline import shard_pipeline
    from .tiny_pipeline import build_tiny_pipeline, call_kwargs, load_pipeline, pipeline_variant

    t0 = time.perf_counter()
    tiny = not p.get("model")
    dtype_name = p.get("dtype") or ("fp32" if tiny else "bf16")
    dtype = _torch_dtype(dtype_name)
    pipe = build_tiny_pipeline(p["variant"], seed=p["seed"], dtype=dtype) if tiny else load_pipeline(p["model"], dtype)
    variant = p["variant"] if tiny else pipeline_variant(pipe)
    build_s = time.perf_counter() - t0

    def kwargs() -> dict[str, Any]:  # fresh generator each call: same seed, same noise
        return call_kwargs(pipe, prompt=p["prompt"], negative_prompt=p["negative_prompt"], frames=p["frames"],
                           height=p["height"], width=p["width"], steps=p["steps"],
                           guidance_scale=p["guidance_scale"], seed=p["seed"], tiny=tiny, variant=variant)

    req = kwargs()
    print(f"generate {variant} ({'tiny random weights' if tiny else p['model']}, {dtype_name}) on "
          f"{p['backend']} {p['mesh']}, padding {p['padding']}: {p['steps']} steps, {req['num_frames']} frames "
          f"{req['height']}x{req['width']}", flush=True)
    result: dict[str, Any] = {"variant": variant, "model": p.get("model") or "tiny", "dtype": dtype_name,
                              "backend": p["backend"], "mesh": p["mesh"], "padding": p["padding"],
                              "steps": p["steps"], "seed": p["seed"], "frames": req["num_frames"],
                              "height": req["height"], "width": req["width"], "build_seconds": round(build_s, 3)}
    reference = None
    if p["compare"]:
        t = time.perf_counter()
        reference = pipe(**kwargs(), output_type="latent").frames
        result["unsharded_seconds"] = round(time.perf_counter() - t, 3)
        print(f"  unsharded reference run: {result['unsharded_seconds']:.2f} s", flush=True)

    t = time.perf_counter()
    handle = shard_pipeline(pipe, _mesh_arg(p["backend"], p["mesh"]), backend=p["backend"], padding=p["padding"])
    result["shard_seconds"] = round(time.perf_counter() - t, 3)
    marks: list[float] = []
    final: dict[str, torch.Tensor] = {}

    def on_step(_pipe, i, _t, cb):
        marks.append(time.perf_counter())
        final["latents"] = cb["latents"]
        return {}

    try:
        start = time.perf_counter()
        out = pipe(**kwargs(), output_type="np", callback_on_step_end=on_step)
        end = time.perf_counter()
        info = handle.describe()
    finally:
        handle.remove()
    frames = out.frames[0]
    steps_s = [b - a for a, b in zip([start] + marks[:-1], marks)]
    latents = final["latents"]
    stem = Path(p["out"]) / f"{variant}-{p['backend']}-{p['mesh']}-{p['padding']}"
    video = write_video(frames, stem)
    expert = next(iter(info["experts"].values()))
    result.update(
        experts=list(info["experts"]), params=expert["params"], sp_points=len(expert.get("sp_points", [])),
        forwards={n: e["forwards"] for n, e in info["experts"].items()},
        latent_shape=list(latents.shape), video_shape=list(frames.shape),
        tokens=expert.get("last_tokens"), padded_tokens=expert.get("last_padded_tokens"),
        seconds=round(end - start, 3), step_seconds=[round(s, 3) for s in steps_s],
        decode_seconds=round(end - marks[-1], 3), output=str(video), summary=str(stem.with_suffix(".json")),
    )
    tok = result["tokens"]
    pad = f" -> {result['padded_tokens']} padded" if result["padded_tokens"] != tok else ""
    c = result["params"]
    print(f"  sharded {', '.join(result['experts'])}: params col/row/norm/rep "
          f"{c['colwise']}/{c['rowwise']}/{c['norm_colwise']}/{c['replicate']}, {tok} tokens{pad}", flush=True)
    print(f"  denoising: {len(steps_s)} steps, seconds per step {', '.join(f'{s:.2f}' for s in steps_s)} "
          "(an expert's first step compiles); VAE decode "
          f"{result['decode_seconds']:.2f} s; total {result['seconds']:.2f} s", flush=True)
    if reference is not None:
        value, max_abs = _pcc(reference, latents)
        result.update(pcc=value, max_abs=max_abs, pcc_threshold=PCC_THRESHOLDS[dtype_name],
                      pcc_ok=value >= PCC_THRESHOLDS[dtype_name])
        print(f"  compare: final latents sharded vs unsharded PCC {value:.9f}, max|diff| {max_abs:.2e} "
              f"({'ok' if result['pcc_ok'] else 'BELOW'} threshold {PCC_THRESHOLDS[dtype_name]})", flush=True)
    Path(result["summary"]).write_text(json.dumps(result, indent=1) + "\n")
    print(f"  video: {video}  summary: {result['summary']}", flush=True)
    return [result]


def _compare_worker(p: dict[str, Any]) -> list[dict[str, Any]]:
    """For tests and scripts: one pipeline, its unsharded latents, then per mesh: shard, run,
    compare, remove, and check the pipeline is exactly as before."""
    import torch

    from .pipeline import shard_pipeline
    from .tiny_pipeline import build_tiny_pipeline, call_kwargs

    dtype = _torch_dtype(p["dtype"])
    pipe = build_tiny_pipeline(p["variant"], seed=p["seed"], dtype=dtype)
    kwargs = lambda: call_kwargs(pipe, steps=p["steps"], seed=p["seed"])  # noqa: E731
    originals = {n: getattr(pipe, n) for n in ("transformer", "transformer_2")}
    params = {n: [id(t) for t in m.parameters()] for n, m in originals.items() if m is not None}
    config = dict(pipe.config)
    reference = pipe(**kwargs(), output_type="latent").frames
    results = []
    for mesh in p["meshes"]:
        t = time.perf_counter()
        handle = shard_pipeline(pipe, _mesh_arg(p["backend"], mesh), backend=p["backend"], padding=p["padding"])
        swapped = {n: type(getattr(pipe, n)).__name__ for n in originals if originals[n] is not None}
        try:
            out = pipe(**kwargs(), output_type="latent").frames
            info = handle.describe()
        finally:
            handle.remove()
        seconds = time.perf_counter() - t
        after = pipe(**kwargs(), output_type="latent").frames
        value, max_abs = _pcc(reference, out)
        expert = next(iter(info["experts"].values()))
        results.append({
            "backend": p["backend"], "mesh": mesh, "variant": p["variant"], "padding": p["padding"],
            "steps": p["steps"], "dtype": p["dtype"], "pcc": value, "max_abs": max_abs,
            "shape": list(out.shape), "tokens": expert.get("last_tokens"),
            "padded_tokens": expert.get("last_padded_tokens"), "experts": list(info["experts"]), "swapped": swapped,
            "forwards": {n: e["forwards"] for n, e in info["experts"].items()},
            "seconds": round(seconds, 2),
            "restored_objects": all(getattr(pipe, n) is m for n, m in originals.items()),
            "restored_params": all([id(t) for t in getattr(pipe, n).parameters()] == ids for n, ids in params.items()),
            "restored_config": dict(pipe.config) == config,
            "bit_identical_after_remove": bool(torch.equal(after, reference)),
            "device_after_remove": str(pipe.device),
        })
        print("RESULT " + json.dumps(results[-1]), flush=True)
    return []


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(host busy CPU seconds, this process's CPU seconds, wall seconds); None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(v[:3]) + sum(v[5:8])  # user nice system (idle iowait) irq softirq steal
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.perf_counter()


def _others_share(before, after) -> float | None:
    """Share of the host's CPU capacity used by *other* processes between two snapshots."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return round(max(others, 0.0) / ((after[2] - before[2]) * (os.cpu_count() or 1)), 3)


class _ReplicatedSpecs(dict):
    """Every parameter replicated (the unsharded baseline), keyed by tensor and by name (the xla
    backend looks specs up by name: moving a model to the XLA device replaces its parameters)."""

    def __init__(self, dit):
        super().__init__({t: (None,) * t.ndim for t in dit.parameters()})
        self._names = {n: (None,) * t.ndim for n, t in dit.named_parameters()}

    def by_name(self) -> dict:
        return dict(self._names)


def _profile_worker(p: dict[str, Any]) -> list[dict[str, Any]]:
    from . import apply_dit_sp_activation_sharding, get_backend, shard_dit_specs
    from .mesh import MeshSpec
    from .models import PER_TOKEN_TIMESTEPS, LatentShape, build_dit, dit_inputs
    from .pipeline import ShardedTransformer
    from .tiny_pipeline import flow_scheduler, prompt_embeddings

    dtype = _torch_dtype(p["dtype"])
    latent = LatentShape(*(int(v) for v in p["latent"].split(","))) if p.get("latent") \
        else LatentShape(*PROFILE_LATENTS[p["resolution"]])
    dit = build_dit(p["variant"], "tiny", dtype=dtype)
    unsharded = p["mesh"] == UNSHARDED
    if unsharded:  # the baseline: one device, every weight replicated, no SP hooks, no padding
        backend = get_backend(p["backend"], MeshSpec((1, 1)))
        placed = backend.place(dit, _ReplicatedSpecs(dit))
        sp, padding = None, "none"
    else:
        backend = get_backend(p["backend"], _mesh_arg(p["backend"], p["mesh"]))
        placed = backend.place(dit, shard_dit_specs(dit, backend.mesh))
        sp = apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend, padding=p["padding"])
        padding = p["padding"]
    model = ShardedTransformer(dit, backend, placed, "transformer", padding)
    inputs = dit_inputs(p["variant"], latent, dtype=dtype)
    text_dim = dit.config.text_dim
    cond = prompt_embeddings("a red fox running through fresh snow", text_dim, dtype=dtype)
    uncond = prompt_embeddings("", text_dim, dtype=dtype)
    per_token = p["variant"] in PER_TOKEN_TIMESTEPS
    n = p["warmup"] + p["iters"]

    def forward(x, t, emb):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=emb, return_dict=False)[0]

    results = []
    for what in p["what"]:
        times: list[float] = []
        marks: list = []
        if what == "dit":
            for i in range(n):
                if i == p["warmup"]:
                    marks.append(_cpu_snapshot())
                t = time.perf_counter()
                forward(inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"])
                times.append(time.perf_counter() - t)
        else:  # one denoising step as the Wan pipelines do it
            scheduler = flow_scheduler()
            scheduler.set_timesteps(n)
            latents = inputs["hidden_states"].float()
            tokens = latent.tokens()
            for i, step_t in enumerate(scheduler.timesteps):
                if i == p["warmup"]:
                    marks.append(_cpu_snapshot())
                t = time.perf_counter()
                x = latents.to(dtype)
                ts = step_t.expand(1, tokens) if per_token else step_t.expand(1)
                noise_c = forward(x, ts, cond)
                noise_u = forward(x, ts, uncond)
                noise = noise_u + 4.0 * (noise_c - noise_u)
                latents = scheduler.step(noise, step_t, latents, return_dict=False)[0]
                times.append(time.perf_counter() - t)
        marks.append(_cpu_snapshot())
        timed = times[p["warmup"]:]
        described = sp.describe() if sp is not None else {}
        r = {
            "what": what, "backend": p["backend"], "mesh": p["mesh"], "padding": padding, "variant": p["variant"],
            "dtype": p["dtype"], "latent": [latent.frames, latent.height, latent.width],
            "tokens": latent.tokens(), "padded_tokens": described.get("last_padded_tokens") or latent.tokens(),
            "warmup": p["warmup"], "iters": p["iters"],
            "first_iter_s": times[0], "warmup_s": times[: p["warmup"]],
            "compile_s": max(times[0] - (statistics.median(timed) if timed else 0.0), 0.0),
            "median_s": statistics.median(timed) if timed else None,
            "min_s": min(timed) if timed else None, "max_s": max(timed) if timed else None, "times_s": timed,
            "forwards_per_iter": 1 if what == "dit" else 2, "note": CPU_NOTE,
            # other processes on the host skew CPU timings: their share of its CPU during the timed iterations
            "others_cpu_share": _others_share(marks[0], marks[-1]) if len(marks) == 2 else None,
            "host_cpus": os.cpu_count(),
        }
        results.append(r)
        if timed:
            print(f"profile {what:4} {p['backend']} {p['mesh']:9} padding {padding:5} {r['tokens']} tokens"
                  f"{' -> ' + str(r['padded_tokens']) if r['padded_tokens'] != r['tokens'] else ''}: "
                  f"first (compile + run) {r['first_iter_s']:.3f} s, warm median {r['median_s']:.4f} s "
                  f"(min {r['min_s']:.4f}, max {r['max_s']:.4f}) over {p['iters']}", flush=True)
    if sp is not None:
        sp.remove()
    print(f"note: {CPU_NOTE}", flush=True)
    return results


WORKERS: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "generate": _generate_worker, "compare": _compare_worker, "profile": _profile_worker,
}


def worker(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in WORKERS:
        print(f"usage: python -m wan_sharding.pipeline_commands {{{','.join(WORKERS)}}} JSON", file=sys.stderr)
        return 2
    params = json.loads(argv[1])
    if params.get("backend") == "xla":
        from .backends.xla import enable_spmd

        enable_spmd()
    else:  # keep torch-xla's runtime out of a JAX process (diffusers' Wan loop would start it)
        from .pipeline import diffusers_without_torch_xla

        diffusers_without_torch_xla()
    from .specs import ShardingError
    from .tiny_pipeline import PipelineUnavailable

    try:
        results = WORKERS[argv[0]](params)
    except (ShardingError, PipelineUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        print("RESULT " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(worker())
