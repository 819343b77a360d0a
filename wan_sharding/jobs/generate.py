"""``generate``: a Wan 2.2 pipeline with both experts sharded, end to end; and the pipeline PCC.

- :func:`run_generate`: the tiny offline pipeline (or a local checkpoint) with every expert
  sharded by :func:`wan_sharding.pipeline.shard_pipeline`, a few denoising steps through the
  pipeline's own ``__call__``, the video (H.264 MP4, or a GIF with ``--video-format gif``) and a JSON
  summary.
  With ``compare`` the same pipeline first runs unsharded with the same seed and the final latents
  are compared.
- :func:`compare_in_subprocess`: for tests and scripts: sharded vs unsharded latents per mesh,
  and whether ``remove()`` restored the pipeline exactly.

The pipeline runs in a worker (``python -m wan_sharding.jobs.generate``) with the backend's
environment; its progress bar goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..mesh import mesh_from_preset
from ..options import DEFAULT_PADDING, torch_dtype
from ..plan import ShardingPlan
from ..runtime.workers import WorkerError, WorkerRun, atomic_write, emit, run_worker, worker_main
from .launch import (mesh_arg, num_devices, plan_devices, plan_mesh_arg, prepare_worker, quiet_progress, stall_seconds,
                     worker_env)
from .pcc import compare, grade

WORKER = "wan_sharding.jobs.generate"


# ------------------------------------------------------------------------------------ parent side


def run_generate(params: dict[str, Any], echo: bool = True) -> WorkerRun:
    """Run one ``generate`` (``params``: the command's options) in a worker; its lines are printed
    as they come when ``echo``."""
    devices = plan_devices(params["plan"]) if params.get("plan") else num_devices([params["mesh"]])
    return run_worker(WORKER, {"kind": "generate", **params},
                      worker_env(params["backend"], devices, params.get("distributed")),
                      label=f"{params['backend']} worker (generate)", echo=echo,
                      stall_s=stall_seconds(params["backend"]))


def output_files(out: str | Path, variant: str, backend: str, mesh: str | None, padding: str | None,
                 plan_name: str | None = None, cache: str | None = None, video_format: str | None = None) -> list[Path]:
    """What one ``generate`` writes: ``<out>/<variant>-<backend>-<mesh>-<padding>[-<cache>]`` (a plan's
    name in place of mesh and padding) as the video (``.mp4`` or ``.gif``) and its ``.json``
    summary. The command checks them before it starts (``--overwrite``); the worker writes them."""
    tag = f"{mesh}-{padding}" if not plan_name else "plan-" + plan_name.replace(" ", "_").replace("[", "").replace("]", "")
    cache = cache or "none"
    stem = Path(out) / f"{variant}-{backend}-{tag}{'' if cache == 'none' else '-' + cache}"
    return [stem.with_suffix("." + (video_format or "mp4")), stem.with_suffix(".json")]


def compare_in_subprocess(backend: str, meshes: list[str], variant: str = "t2v-a14b", steps: int = 2,
                          padding: str = DEFAULT_PADDING, dtype: str = "fp32", seed: int = 0,
                          timeout: float = 900, distributed: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Sharded vs unsharded pipeline latents for each mesh, in one worker process (JAX runs every
    mesh on a subset of one process's devices; torch-xla needs one process per mesh size).
    Each result also says whether ``remove()`` restored the pipeline exactly. ``distributed``: a tt
    launch over several hosts (:func:`~wan_sharding.jobs.launch.worker_env`)."""
    params = dict(kind="compare", meshes=meshes, variant=variant, steps=steps, padding=padding, dtype=dtype,
                  seed=seed, backend=backend, distributed=distributed)
    return _comparison_worker(params, [mesh_from_preset(m).num_devices for m in meshes], timeout)


def _comparison_worker(params: dict[str, Any], device_counts: list[int], timeout: float) -> list[dict[str, Any]]:
    """One worker for a comparison job (``params["kind"]``) over runs needing ``device_counts``
    devices: JAX runs the smaller ones on a subset of one process's devices; torch-xla and tt
    need one device count per process."""
    backend, kind = params["backend"], params["kind"]
    if backend in ("xla", "tt") and len(set(device_counts)) > 1:
        raise ValueError(f"the {backend} backend runs one device count per process; call once per device count")
    run = run_worker(WORKER, params, worker_env(backend, max(device_counts), params.get("distributed")),
                     label=f"{backend} worker ({kind})",
                     stall_s=stall_seconds(backend), timeout=timeout)
    if not run.ok:
        raise WorkerError(f"{backend} {kind} worker failed (exit {run.returncode}):\n{run.output[-4000:]}")
    return run.results


# ------------------------------------------------------------------------------------ worker side


def _generate(p: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from ..pipeline import shard_pipeline, write_video
    from ..pipeline.tiny import build_tiny_pipeline, call_kwargs, load_pipeline, pipeline_variant

    t0 = time.perf_counter()
    tiny = not p.get("model")
    dtype_name = p.get("dtype") or ("fp32" if tiny else "bf16")
    dtype = torch_dtype(dtype_name)
    pipe = quiet_progress(build_tiny_pipeline(p["variant"], seed=p["seed"], dtype=dtype) if tiny
                          else load_pipeline(p["model"], dtype))
    variant = p["variant"] if tiny else pipeline_variant(pipe)
    if p.get("lora"):  # checked by the command; loaded as diffusers loads them, then sharded with them
        from ..lora.files import LoraRequest
        from ..lora.load import load_loras

        load_loras(pipe, [LoraRequest(**r) for r in p["lora"]])
    build_s = time.perf_counter() - t0

    def kwargs() -> dict[str, Any]:  # fresh generator each call: same seed, same noise
        return call_kwargs(pipe, prompt=p["prompt"], negative_prompt=p["negative_prompt"], frames=p["frames"],
                           height=p["height"], width=p["width"], steps=p["steps"],
                           guidance_scale=p["guidance_scale"], seed=p["seed"], tiny=tiny, variant=variant)

    req = kwargs()
    print(f"generate {variant} ({'tiny random weights' if tiny else p['model']}, {dtype_name}) on "
          f"{p['backend']} {p['mesh']}{' (plan ' + p['plan_name'] + ')' if p.get('plan_name') else ''}, padding "
          f"{p['padding']}: {p['steps']} steps, {req['num_frames']} frames "
          f"{req['height']}x{req['width']}", flush=True)
    result: dict[str, Any] = {"variant": variant, "model": p.get("model") or "tiny", "dtype": dtype_name,
                              "backend": p["backend"], "mesh": p["mesh"], "padding": p["padding"],
                              "steps": p["steps"], "seed": p["seed"], "frames": req["num_frames"],
                              "height": req["height"], "width": req["width"], "build_seconds": round(build_s, 3),
                              "lora": list(p.get("lora") or []), "lora_mode": p.get("lora_mode", "layers")}
    cache = p.get("cache") or "none"
    latents_of = lambda: pipe(**kwargs(), output_type="latent").frames  # noqa: E731
    result["cache"] = cache
    ratios = None
    if cache == "mag":  # MagCache needs each expert's magnitude ratios: one calibration run, unsharded
        from ..caching import calibrate_pipeline_mag_ratios

        ratios = calibrate_pipeline_mag_ratios(pipe, latents_of, p["steps"])
        result["mag_ratios"] = ratios
    reference = cached_reference = reference_video = None
    vae_on_mesh = p.get("vae") == "mesh"
    result["vae"] = "mesh" if vae_on_mesh else "host"
    if p["compare"]:
        t = time.perf_counter()
        if vae_on_mesh:  # the decoded video is compared too: one reference run gives latents and video
            reference, reference_video = _latents_and_video(pipe, kwargs())
        else:
            reference = latents_of()
        result["unsharded_seconds"] = round(time.perf_counter() - t, 3)
        print(f"  unsharded reference run: {result['unsharded_seconds']:.2f} s", flush=True)
        if cache != "none":
            cached_reference, result["unsharded_cache"] = _cached_run(pipe, cache, p["steps"], ratios, latents_of)
            print(f"  unsharded reference run with {cache}: {_skips(result['unsharded_cache'])}", flush=True)

    t = time.perf_counter()
    plan = ShardingPlan.from_dict(p["plan"]) if p.get("plan") else None
    encoder_on_mesh = (p.get("text_encoder") or "host") == "mesh"  # the UMT5 encoder sharded with the experts
    if plan is not None:  # the plan's mesh, roles, FSDP, layout and padding
        handle = shard_pipeline(pipe, plan_mesh_arg(p["backend"], plan), backend=p["backend"], plan=plan,
                                patches=p.get("patches") or (), text_encoder=encoder_on_mesh, vae=vae_on_mesh,
                                lora=p.get("lora_mode", "layers"))
        result["memory"] = placed_vs_predicted(handle, plan)
        _print_memory(result["memory"])
    else:
        handle = shard_pipeline(pipe, mesh_arg(p["backend"], p["mesh"]), backend=p["backend"], padding=p["padding"],
                                patches=p.get("patches") or (), text_encoder=encoder_on_mesh, vae=vae_on_mesh,
                                lora=p.get("lora_mode", "layers"))
    result["plan"] = None if plan is None else plan.name
    result["patches"] = list(p.get("patches") or ())
    result["shard_seconds"] = round(time.perf_counter() - t, 3)
    uncached = None
    if cache != "none":
        from ..caching import enable_pipeline_cache, pipeline_cache_stats

        try:
            uncached = latents_of()  # the drift is measured against this (it also compiles the whole forward)
            enable_pipeline_cache(pipe, cache, p["steps"], mag_ratios=ratios)
        except BaseException:
            handle.remove()
            raise
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
        if cache != "none":
            result["cache_stats"] = pipeline_cache_stats(pipe)
    finally:
        handle.remove()
        if cache != "none":
            from ..caching import disable_pipeline_cache

            disable_pipeline_cache(pipe)  # remove() leaves a cache on the experts
    frames = out.frames[0]
    if "vae" in info:  # where the VAE ran, and which of its calls (I2V: the image encode too)
        result.update(vae_split=info["vae"].get("frame_split"), vae_calls=info["vae"]["calls"])
    steps_s = [b - a for a, b in zip([start] + marks[:-1], marks)]
    latents = final["latents"]
    video_path, summary = output_files(p["out"], variant, p["backend"], p["mesh"], p["padding"],
                                       None if plan is None else plan.name, cache, p.get("video_format"))
    video = write_video(frames, video_path.with_suffix(""), video_format=p.get("video_format") or "mp4")
    expert = next(iter(info["experts"].values()))
    result.update(
        experts=list(info["experts"]), params=expert["params"], sp_points=len(expert.get("sp_points", [])),
        forwards={n: e["forwards"] for n, e in info["experts"].items()},
        latent_shape=list(latents.shape), video_shape=list(frames.shape),
        tokens=expert.get("last_tokens"), padded_tokens=expert.get("last_padded_tokens"),
        seconds=round(end - start, 3), step_seconds=[round(s, 3) for s in steps_s],
        decode_seconds=round(end - marks[-1], 3), output=str(video), summary=str(summary),
    )
    tok = result["tokens"]
    pad = f" -> {result['padded_tokens']} padded" if result["padded_tokens"] != tok else ""
    c = result["params"]
    print(f"  sharded {', '.join(result['experts'])}: params col/row/norm/rep "
          f"{c['colwise']}/{c['rowwise']}/{c['norm_colwise']}/{c['replicate']}, {tok} tokens{pad}", flush=True)
    result["text_encoder"] = "mesh" if encoder_on_mesh else ("host" if getattr(pipe, "text_encoder", None) is not None
                                                     else "none (prompt embeddings given)")
    if "text_encoder" in info:  # on the mesh: how it was split, and the prompts it encoded there
        result["text_encoder_params"], result["text_encoder_calls"] = info["text_encoder"]["params"], \
            info["text_encoder"]["calls"]
        e = result["text_encoder_params"]
        print(f"  text encoder on the mesh: params col/row/emb/rep {e['colwise']}/{e['rowwise']}/"
              f"{e.get('embedding_colwise', 0)}/{e['replicate']}, {result['text_encoder_calls']} prompts encoded there",
              flush=True)
    else:
        print(f"  text encoder: {result['text_encoder']}", flush=True)
    print(f"  denoising: {len(steps_s)} steps, seconds per step {', '.join(f'{s:.2f}' for s in steps_s)} "
          "(an expert's first step compiles); VAE decode "
          f"{result['decode_seconds']:.2f} s; total {result['seconds']:.2f} s", flush=True)
    if "cfg_steps" in info:  # CFG parallel: how many steps ran cond and uncond as one program
        result.update(cfg_steps=info["cfg_steps"])
        print(f"  CFG parallel: {info['cfg_steps']['paired']} steps ran their cond and uncond calls as one program "
              f"(one branch per group of {handle.mesh.group_devices} devices), "
              f"{info['cfg_steps']['single']} calls on their own (no guidance)", flush=True)
    if cache != "none":
        stats = result["cache_stats"]
        drift_pcc, drift = compare(uncached, latents)
        result.update(blocks_computed=sum(e["computed"] for e in stats.values()),
                      blocks_skipped=sum(e["skipped"] for e in stats.values()),
                      drift_max_abs=drift, drift_pcc=drift_pcc)
        print(f"  cache {cache}: {_skips(stats)}; drift vs the uncached sharded run: max|diff| {drift:.2e}, "
              f"PCC {drift_pcc:.6f}", flush=True)
    if reference is not None:
        against = cached_reference if cached_reference is not None else reference
        value, max_abs = compare(against, latents)
        bound = grade(p["backend"], dtype_name, pipeline=True)  # tt: the hardware table
        result.update(pcc=value, max_abs=max_abs, pcc_threshold=bound.pcc, max_abs_bound=bound.max_abs,
                      pcc_ok=bound.passes(value, max_abs))
        what = f"unsharded with {cache}" if cached_reference is not None else "unsharded"
        if cached_reference is not None:
            same = {n: e["decisions"] for n, e in result["cache_stats"].items()} == \
                {n: e["decisions"] for n, e in result["unsharded_cache"].items()}
            result.update(cache_decisions_match=same, pcc_ok=result["pcc_ok"] and same)
            print(f"  compare: cache decisions {'identical to' if same else 'DIFFER from'} the unsharded run's",
                  flush=True)
        print(f"  compare: final latents sharded vs {what} PCC {value:.9f}, max|diff| {max_abs:.2e} "
              f"({'within' if result['pcc_ok'] else 'OUTSIDE'} {bound})", flush=True)
        if reference_video is not None:  # the VAE on the mesh: its decode against the host's
            v_pcc, v_max = compare(torch.from_numpy(reference_video), torch.from_numpy(frames))
            v_ok = bound.passes(v_pcc, v_max)
            result.update(video_pcc=v_pcc, video_max_abs=v_max, video_ok=v_ok, pcc_ok=result["pcc_ok"] and v_ok)
            print(f"  compare: decoded video (VAE on the mesh) vs unsharded PCC {v_pcc:.9f}, max|diff| {v_max:.2e} "
                  f"({'within' if v_ok else 'OUTSIDE'} {bound})", flush=True)
    atomic_write(result["summary"], json.dumps(result, indent=1) + "\n")
    print(f"  video: {video}  summary: {result['summary']}", flush=True)
    return [result]


def _latents_and_video(pipe: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """One run of ``pipe``: its final latents (the last step's callback) and its decoded video."""
    final: dict[str, Any] = {}

    def keep(_pipe, i, _t, cb):
        final["latents"] = cb["latents"]
        return {}

    out = pipe(**kwargs, output_type="np", callback_on_step_end=keep)
    return final["latents"], out.frames[0]


def placed_vs_predicted(handle: Any, plan: Any) -> dict[str, dict[str, Any]]:
    """Per expert (and the text encoder, when it is on the mesh): its weights' bytes per device as
    placed on the backend's devices, next to what the planner counts for the same plan and model
    (``predicted_weight_bytes``, ``predicted_text_encoder_bytes``)."""
    from ..planner.weights import predicted_text_encoder_bytes, predicted_weight_bytes

    out = {}
    for name, per_device in handle.placed_weight_bytes().items():
        if name == "text_encoder":  # the UMT5 encoder on the mesh: the planner counts it too
            model = handle.text_encoder.model
            predicted = predicted_text_encoder_bytes(model, plan)
        else:
            model = next(e.dit for e in handle.experts if e.name == name)
            predicted = predicted_weight_bytes(model, plan)
        out[name] = {"placed_max": max(per_device), "placed_min": min(per_device), "predicted": predicted,
                     "placed_over_predicted": round(max(per_device) / predicted, 6),
                     "unsharded": sum(t.numel() * t.element_size() for t in model.parameters())}
    return out


def _print_memory(memory: dict[str, dict[str, Any]]) -> None:
    for name, m in memory.items():
        print(f"  weights per device, {name}: placed {m['placed_max']:,} B (min {m['placed_min']:,}), planner "
              f"{m['predicted']:,} B ({m['placed_over_predicted']:.4f}x); unsharded {m['unsharded']:,} B", flush=True)


def _cached_run(pipe: Any, cache: str, steps: int, ratios: Any, run: Any) -> tuple[Any, dict[str, Any]]:
    """``run()`` with a ``cache`` enabled on every expert; its output and the cache statistics."""
    from ..caching import disable_pipeline_cache, enable_pipeline_cache, pipeline_cache_stats

    enable_pipeline_cache(pipe, cache, steps, mag_ratios=ratios)
    try:
        return run(), pipeline_cache_stats(pipe)
    finally:
        disable_pipeline_cache(pipe)


def _skips(stats: dict[str, dict[str, Any]]) -> str:
    """``transformer 8/12 computed (4 skipped), ...`` over the cache-hooked modules."""
    return ", ".join(f"{n} {e['computed']}/{e['calls']} computed ({e['skipped']} skipped)" for n, e in stats.items())


def _compare(p: dict[str, Any]) -> list[dict[str, Any]]:
    """One pipeline, its unsharded latents, then per mesh: shard, run, compare, remove, and check
    the pipeline is exactly as before. Results are emitted as each mesh finishes."""
    import torch

    from ..pipeline import shard_pipeline
    from ..pipeline.tiny import build_tiny_pipeline, call_kwargs

    pipe = build_tiny_pipeline(p["variant"], seed=p["seed"], dtype=torch_dtype(p["dtype"]))
    kwargs = lambda: call_kwargs(pipe, steps=p["steps"], seed=p["seed"])  # noqa: E731
    originals = {n: getattr(pipe, n) for n in ("transformer", "transformer_2")}
    params = {n: [id(t) for t in m.parameters()] for n, m in originals.items() if m is not None}
    config = dict(pipe.config)
    reference = pipe(**kwargs(), output_type="latent").frames
    for mesh in p["meshes"]:
        t = time.perf_counter()
        handle = shard_pipeline(pipe, mesh_arg(p["backend"], mesh), backend=p["backend"], padding=p["padding"])
        swapped = {n: type(getattr(pipe, n)).__name__ for n in originals if originals[n] is not None}
        try:
            out = pipe(**kwargs(), output_type="latent").frames
            info = handle.describe()
        finally:
            handle.remove()
        seconds = time.perf_counter() - t
        after = pipe(**kwargs(), output_type="latent").frames
        value, max_abs = compare(reference, out)
        expert = next(iter(info["experts"].values()))
        emit({
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
    return []


def cache_compare_in_subprocess(backend: str, meshes: list[str], caches: list[str], variant: str = "t2v-a14b",
                                steps: int = 6, padding: str = DEFAULT_PADDING, seed: int = 0, timing: bool = False,
                                timeout: float = 1200, blocks: int | None = None,
                                repeats: int = 3) -> list[dict[str, Any]]:
    """Per cache kind and mesh: the tiny pipeline (``blocks`` per expert) sharded with that cache vs
    unsharded with the same cache (decisions, final latents), and vs the sharded run without a cache
    (drift). With ``timing``, warm runs cached and uncached, interleaved ``repeats`` times, and PSNR
    of the decoded frames (the benchmark; :mod:`wan_sharding.jobs.cache_compare`). One worker for all."""
    params = dict(kind="cache", meshes=meshes, caches=caches, variant=variant, steps=steps, padding=padding,
                  dtype="fp32", seed=seed, backend=backend, timing=timing, blocks=blocks, repeats=repeats)
    return _comparison_worker(params, [mesh_from_preset(m).num_devices for m in meshes], timeout)


def _cache(p: dict[str, Any]) -> list[dict[str, Any]]:
    """The work of :func:`cache_compare_in_subprocess`; results are emitted as each run finishes."""
    from .cache_compare import cache_comparison

    cache_comparison(p, emit)
    return []


def plans_compare_in_subprocess(backend: str, plans: list[Any], variant: str = "t2v-a14b", steps: int = 2,
                                seed: int = 0, timeout: float = 1200, guidance_scales: tuple[float, ...] = (4.0,),
                                patches: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Per plan and guidance scale: the tiny pipeline sharded with ``shard_pipeline(pipe,
    plan=plan, patches=patches)`` vs unsharded (final latents), its expert forwards and, on a cfg
    plan, how many steps ran their two calls as one program; and its weights per device as placed
    vs the planner's count. One worker with the most devices any plan needs (JAX runs smaller plans
    on the first devices; torch-xla needs one device count per process)."""
    params = dict(kind="plans", plans=[p.to_dict() for p in plans], variant=variant, steps=steps, seed=seed,
                  dtype="fp32", backend=backend, guidance_scales=list(guidance_scales), patches=list(patches))
    return _comparison_worker(params, [plan_devices(p) for p in plans], timeout)


def _plans(p: dict[str, Any]) -> list[dict[str, Any]]:
    """The work of :func:`plans_compare_in_subprocess`; a result per plan as it finishes."""
    from ..pipeline import shard_pipeline
    from ..pipeline.tiny import build_tiny_pipeline, call_kwargs

    pipe = build_tiny_pipeline(p["variant"], seed=p["seed"], dtype=torch_dtype(p["dtype"]))
    scales = p.get("guidance_scales", [4.0])

    def run(scale: float) -> Any:
        kwargs = call_kwargs(pipe, steps=p["steps"], seed=p["seed"], guidance_scale=scale)
        return pipe(**kwargs, output_type="latent").frames

    references = {scale: run(scale) for scale in scales}
    for data in p["plans"]:
        plan = ShardingPlan.from_dict(data)
        handle = shard_pipeline(pipe, plan_mesh_arg(p["backend"], plan), backend=p["backend"], plan=plan,
                                patches=p.get("patches", ()))
        rows = []
        try:
            memory = placed_vs_predicted(handle, plan)
            for scale in scales:
                before = handle.describe()
                out = run(scale)
                info = handle.describe()
                value, max_abs = compare(references[scale], out)
                forwards = {n: e["forwards"] - before["experts"][n]["forwards"] for n, e in info["experts"].items()}
                steps = {k: v - before["cfg_steps"][k] for k, v in info["cfg_steps"].items()} if "cfg_steps" in info else None
                rows.append({"backend": p["backend"], "plan": plan.name, "mesh": info["mesh"], "sp": info["sp"],
                             "tp": info["tp"], "cfg": info["cfg"], "fsdp": plan.fsdp, "layout": plan.layout,
                             "padding": info["padding"], "steps": p["steps"], "guidance_scale": scale, "pcc": value,
                             "max_abs": max_abs, "memory": memory, "forwards": forwards, "cfg_steps": steps})
        finally:
            handle.remove()
        # the same experts back, and no wrapper left on the pipeline instance (CFG parallel's encode_prompt)
        restored = all(getattr(pipe, e.name) is e.dit for e in handle.experts) and "encode_prompt" not in vars(pipe)
        for row in rows:
            emit({**row, "restored": restored})
    return []


def _job(params: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    prepare_worker(params["backend"])
    with torch.no_grad():  # inference only (the pipelines' __call__ is no_grad too; the references are not)
        return {"generate": _generate, "compare": _compare, "cache": _cache, "plans": _plans}[params["kind"]](params)


if __name__ == "__main__":
    from ..backends import BackendError
    from ..pipeline.tiny import PipelineUnavailable
    from ..specs import ShardingError

    from ..patches import PatchError

    sys.exit(worker_main(_job, expected=(ShardingError, PipelineUnavailable, BackendError, PatchError)))
