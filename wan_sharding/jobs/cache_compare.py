"""Each cache kind on the sharded tiny pipeline against the unsharded one and against no cache.

What :func:`wan_sharding.jobs.generate.cache_compare_in_subprocess` runs in its worker (the tests
and ``scripts/bench_cache.py``): per cache kind and mesh, the decisions and final latents of the
sharded run against the unsharded run with the same cache; the drift against the sharded run
without a cache (latents, and PSNR of the decoded frames); with ``timing``, warm time per video
cached and uncached, measured interleaved in the same process (uncached, cached, uncached, ...)
``repeats`` times, medians and spread, and the host time a cached forward spends outside its
compiled programs. The cache stays enabled across its warm runs (the uncached ones run on a twin
pipeline), as a user keeps it: enabling it again makes new hooks, and the xla and tt backends'
dynamo-compiled programs are traced again for them.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch


def decode_frames(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """The frames the Wan pipeline would return for ``latents`` (``output_type="pt"``): the same
    de-normalisation, VAE decode and post-processing as its ``__call__``, values in [0, 1]."""
    vae = pipe.vae
    latents = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.dtype)
    with torch.no_grad():
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
    return pipe.video_processor.postprocess_video(video, output_type="pt")


def psnr(reference: torch.Tensor, other: torch.Tensor, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of ``other`` against ``reference`` (``inf`` when equal)."""
    mse = float(((reference.double() - other.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def _spread(samples: list[float]) -> float:
    """(max - min) / median: how noisy a set of repeated timings is."""
    return (max(samples) - min(samples)) / statistics.median(samples)


def _plan_timing(pipe: Any) -> tuple[int, float, int] | None:
    """Summed over the experts whose cache runs as programs: (cached forwards, host seconds outside
    the programs, program calls) so far; ``None`` when no expert's cache does."""
    from ..caching.model import model_cache_probe
    from ..caching.wan import pipeline_experts

    plans = [p.programs for _, _, dit in pipeline_experts(pipe) if (p := model_cache_probe(dit)) is not None and p.programs]
    if not plans:
        return None
    return (sum(p.timing.forwards for p in plans), sum(p.timing.total_s - p.timing.programs_s for p in plans),
            sum(p.timing.program_calls for p in plans))


def host_overhead(pipe: Any, since: tuple[int, float, int] | None = None) -> dict[str, Any] | None:
    """Over the experts whose cache runs as programs, since ``since`` (a :func:`_plan_timing`):
    cached forwards, programs per forward and the host seconds per forward outside the programs
    (``None`` when no expert's cache does)."""
    now = _plan_timing(pipe)
    if now is None:
        return None
    forwards, host, calls = (a - b for a, b in zip(now, since or (0, 0.0, 0)))
    return {"forwards": forwards, "programs_per_forward": round(calls / max(forwards, 1), 3),
            "host_overhead_s": round(host / max(forwards, 1), 6)}


def _sharded_tiny(p: dict[str, Any], mesh: str, blocks: int | None) -> tuple[Any, Any, Any]:
    """The comparison's tiny pipeline (``blocks`` per expert; ``None``: ``p``'s), built afresh and
    sharded on ``mesh``: (pipeline, its shard handle, a call running one video to latents)."""
    from .launch import mesh_arg
    from ..options import torch_dtype
    from ..pipeline import shard_pipeline
    from ..pipeline.tiny import build_tiny_pipeline, call_kwargs

    pipe = build_tiny_pipeline(p["variant"], seed=p["seed"], dtype=torch_dtype(p["dtype"]), blocks=blocks)
    pipe.set_progress_bar_config(disable=True)
    handle = shard_pipeline(pipe, mesh_arg(p["backend"], mesh), backend=p["backend"], padding=p["padding"])
    return pipe, handle, lambda: pipe(**call_kwargs(pipe, steps=p["steps"], seed=p["seed"]), output_type="latent").frames


def blocks_share(p: dict[str, Any], mesh: str, run_n: Any, blocks: int) -> dict[str, Any]:
    """The share of an uncached video's warm time spent in the blocks: the same pipeline with one
    block per expert, sharded alike, timed interleaved with the ``blocks`` one; with
    ``T(n) = fixed + n * per_block``, the share is ``blocks * per_block / T(blocks)``. What the
    rest is: the embedders and output layers, the inputs' copy to the devices and the output's
    back, the dispatch, the pipeline's own loop (scheduler, CFG)."""
    _, handle, run_one = _sharded_tiny(p, mesh, blocks=1)
    try:
        run_one()
        t_one, t_n = [], []
        for _ in range(max(p.get("repeats", 3), 3)):
            for f, out in ((run_one, t_one), (run_n, t_n)):
                t = time.perf_counter()
                f()
                out.append(time.perf_counter() - t)
    finally:
        handle.remove()
    one_s, n_s = statistics.median(t_one), statistics.median(t_n)
    per_block = (n_s - one_s) / max(blocks - 1, 1)
    return {"blocks_share": round(blocks * per_block / n_s, 3), "one_block_warm_seconds": round(one_s, 4),
            "blocks_warm_seconds": round(n_s, 4)}


def _ones(pipe: Any, steps: int) -> dict[str, list[float]]:
    """Magnitude ratios of 1 for every expert's steps (for a MagCache that never skips)."""
    from ..caching.wan import expert_steps

    return {name: [1.0] * n for name, n in expert_steps(pipe, steps).items()}


def cache_comparison(p: dict[str, Any], emit: Any) -> None:
    """The worker's job (see the module docstring); ``emit`` gets one result per mesh and kind."""
    from .launch import mesh_arg
    from .pcc import compare
    from ..options import torch_dtype
    from ..pipeline import shard_pipeline
    from ..pipeline.tiny import build_tiny_pipeline, call_kwargs
    from ..caching import calibrate_pipeline_mag_ratios, disable_pipeline_cache, enable_pipeline_cache, pipeline_cache_stats

    pipe = build_tiny_pipeline(p["variant"], seed=p["seed"], dtype=torch_dtype(p["dtype"]), blocks=p.get("blocks"))
    run = lambda: pipe(**call_kwargs(pipe, steps=p["steps"], seed=p["seed"]), output_type="latent").frames  # noqa: E731

    def timed(f: Any = run) -> tuple[Any, float]:
        t = time.perf_counter()
        out = f()
        return out, time.perf_counter() - t

    references = {}
    for cache in p["caches"]:  # unsharded, with the same cache: what the sharded run must match
        ratios = calibrate_pipeline_mag_ratios(pipe, run, p["steps"]) if cache == "mag" else None
        enable_pipeline_cache(pipe, cache, p["steps"], mag_ratios=ratios)
        try:
            references[cache] = (ratios, run(), pipeline_cache_stats(pipe))
        finally:
            disable_pipeline_cache(pipe)
    repeats = p.get("repeats", 3) if p["timing"] else 0
    for mesh in p["meshes"]:
        handle = shard_pipeline(pipe, mesh_arg(p["backend"], mesh), backend=p["backend"], padding=p["padding"])
        others: list[tuple[Any, Any]] = []  # the timing's other pipelines and their handles
        try:
            uncached, first = timed()
            frames = decode_frames(pipe, uncached) if p["timing"] else None
            share = blocks_share(p, mesh, run, len(pipe.transformer.dit.blocks)) if p["timing"] else {}
            if repeats:
                # The uncached warm runs go to a twin (the same pipeline, built and sharded alike),
                # so the cache stays enabled across the cached ones, as a user runs it: enabling a
                # cache again makes new hooks, whose programs dynamo (xla, tt) traces again.
                twin, twin_handle, run_twin = _sharded_tiny(p, mesh, p.get("blocks"))
                others.append((twin, twin_handle))
                run_twin()
                # A third, whose every forward is one compiled program of the cache path: MagCache
                # that never skips (at most 0 skips in a row) runs its `full` program each time.
                # On xla the uncached forward is traced lazily at every call while the cache's
                # programs are compiled through dynamo; against this one a cache gains only what it skips.
                whole, whole_handle, run_whole = _sharded_tiny(p, mesh, p.get("blocks"))
                others.append((whole, whole_handle))
                enable_pipeline_cache(whole, "mag", p["steps"], mag_ratios=_ones(whole, p["steps"]), max_skip_steps=0)
                run_whole()
                whole_stats = pipeline_cache_stats(whole)
                if any(e["skipped"] for e in whole_stats.values()):
                    raise RuntimeError(f"the never-skipping MagCache skipped: {whole_stats}")
            for cache in p["caches"]:
                ratios, reference, reference_stats = references[cache]
                calls_before = {e.name: e.wrapper.calls for e in handle.experts}
                enable_pipeline_cache(pipe, cache, p["steps"], mag_ratios=ratios)
                try:
                    out, cached_first = timed()
                    stats, programs = pipeline_cache_stats(pipe), host_overhead(pipe)
                    forwards = sum(e.wrapper.calls - calls_before[e.name] for e in handle.experts)
                    warm_u, warm_w, warm_c, host = [], [], [], []
                    for _ in range(repeats):  # interleaved, so all see the same load on the host
                        warm_u.append(timed(run_twin)[1])
                        warm_w.append(timed(run_whole)[1])
                        since = _plan_timing(pipe)
                        warm_c.append(timed()[1])
                        host.append(host_overhead(pipe, since))
                finally:
                    disable_pipeline_cache(pipe)
                _, max_abs = compare(reference, out)
                drift_pcc, drift = compare(uncached, out)
                calls = sum(e["calls"] for e in stats.values())
                computed = sum(e["computed"] for e in stats.values())
                result = {
                    "backend": p["backend"], "mesh": mesh, "cache": cache, "variant": p["variant"],
                    "blocks": len(pipe.transformer.dit.blocks), "steps": p["steps"], "padding": p["padding"],
                    "forwards": forwards, "calls": calls, "computed": computed, "skipped": calls - computed,
                    "computed_fraction": round(computed / calls, 4),
                    "per_expert": {n: {k: v for k, v in e.items() if k != "decisions"} for n, e in stats.items()},
                    "decisions_match": {n: e["decisions"] for n, e in stats.items()}
                    == {n: e["decisions"] for n, e in reference_stats.items()},
                    "max_abs_vs_unsharded_cached": max_abs, "drift_max_abs": drift, "drift_pcc": drift_pcc,
                    "first_seconds": round(cached_first, 3), "uncached_first_seconds": round(first, 3),
                    "programs_per_forward": None if programs is None else programs["programs_per_forward"],
                }
                if p["timing"]:
                    mc, mu = statistics.median(warm_c), statistics.median(warm_u)
                    overhead = host[-1]
                    result.update({
                        "psnr_db_vs_uncached": round(psnr(frames, decode_frames(pipe, out)), 2),
                        "warm_seconds": round(mc, 4), "uncached_warm_seconds": round(mu, 4),
                        "warm_ratio": round(mc / mu, 3), "goal_ratio": round(computed / calls + 0.15, 4),
                        # against the whole forward as one program of the cache path (see above)
                        "whole_program_warm_seconds": round(statistics.median(warm_w), 4),
                        "whole_program_ratio": round(mc / statistics.median(warm_w), 3),
                        # the median of the ratios of adjacent runs: less moved by a load that changes
                        "paired_ratio": round(statistics.median(c / u for c, u in zip(warm_c, warm_u)), 3),
                        **share,
                        # the share of the video's work computed: the blocks computed, and all the rest
                        "work_fraction": round(share["blocks_share"] * computed / calls + 1 - share["blocks_share"], 4),
                        "warm_samples": [round(x, 4) for x in warm_c],
                        "uncached_warm_samples": [round(x, 4) for x in warm_u],
                        "spread": round(max(_spread(warm_c), _spread(warm_u)), 3),
                        "programs_per_forward": None if overhead is None else overhead["programs_per_forward"],
                        "host_overhead_s": None if overhead is None else statistics.median(
                            h["host_overhead_s"] for h in host),
                    })
                emit(result)
        finally:
            handle.remove()
            for other, other_handle in others:
                disable_pipeline_cache(other)  # a no-op for the twin, which has none
                other_handle.remove()
