"""``profile``: warm-iteration timing of the sharded DiT, of a whole denoising step, or of the
VAE's decode beside the host's.

The protocol: ``warmup`` iterations (the first compiles), then ``iters`` timed iterations, each a
forward plus the copy to the host; median / min / max reported, compile time apart. ``dit`` is one
DiT forward; ``step`` a denoising step as the Wan pipelines do it (cond + uncond forward, CFG,
scheduler step); ``vae`` the VAE's decode, sharded beside the host's (:mod:`.vae_profile`). The
mesh ``unsharded`` is the baseline: the same backend on one device,
replicated weights, no SP hooks (on ``tt`` only where the machine has one chip: torch-xla SPMD spans
every chip it sees, and a larger machine refuses a one-device mesh with one line). Runs in a worker
(``python -m wan_sharding.jobs.profile``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from ..runtime.workers import WorkerRun, run_worker, worker_main
from .launch import (UNSHARDED, mesh_arg, num_devices, plan_devices, plan_mesh_arg, prepare_worker, stall_seconds,
                     worker_env)

CPU_NOTE = "CPU virtual devices: timings compare configurations on this host; they are not hardware predictions"
TT_NOTE = ("Tenstorrent devices: warm iterations reuse the forward compiled on the first one; "
           "each includes copying the output to the host")


def note_for(backend: str) -> str:
    """What a profile's timings mean for ``backend``."""
    return TT_NOTE if backend == "tt" else CPU_NOTE
# Profile latents (F, H, W): "tiny" is the check's padded case (105 tokens); "small" 1950 tokens.
PROFILE_LATENTS = {"tiny": (3, 10, 14), "small": (5, 30, 52)}
WHAT = ("dit", "step", "vae")


# ------------------------------------------------------------------------------------ parent side


def run_profile(params: dict[str, Any], echo: bool = True, timeout: float | None = None) -> WorkerRun:
    """Run one profile (``params``: the command's options) in a worker; one result per ``what``."""
    devices = plan_devices(params["plan"]) if params.get("plan") else num_devices([params["mesh"]])
    return run_worker("wan_sharding.jobs.profile", params, worker_env(params["backend"], devices, params.get("distributed")),
                      label=f"{params['backend']} worker (profile)", echo=echo, timeout=timeout,
                      stall_s=stall_seconds(params["backend"]))


# ------------------------------------------------------------------------------------ worker side


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
    """Share of the host's CPU capacity used by *other* processes between two snapshots: they
    skew CPU timings, so the result says how busy the host was."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return round(max(others, 0.0) / ((after[2] - before[2]) * (os.cpu_count() or 1)), 3)


def _dynamo_graphs() -> dict[str, int]:
    """Graphs dynamo compiled in this worker so far, and its graph breaks (tt: the forward's
    torch.compile should make one graph per input signature and no break)."""
    from torch._dynamo.utils import counters

    return {"dynamo_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def _profile(p: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from ..backends import get_backend
    from ..compose import resolve, shard_dit
    from ..mesh import MeshSpec
    from ..models import PER_TOKEN_TIMESTEPS, LatentShape, build_dit, dit_inputs
    from ..options import torch_dtype
    from ..pipeline import ShardedTransformer
    from ..pipeline.guidance import as_pair
    from ..pipeline.tiny import flow_scheduler, prompt_embeddings
    from ..plan import ShardingPlan
    from ..specs import replicated_specs

    dtype = torch_dtype(p["dtype"])
    latent = LatentShape(*(int(v) for v in p["latent"].split(","))) if p.get("latent") \
        else LatentShape(*PROFILE_LATENTS[p["resolution"]])
    dit = build_dit(p["variant"], "tiny", dtype=dtype).requires_grad_(False)  # timed as inference
    if p.get("lora"):  # checked by the command: the high-noise expert's adapters, as generate loads them
        from ..lora.files import LoraRequest
        from ..lora.load import load_into_dit

        load_into_dit(dit, [LoraRequest(**r) for r in p["lora"]], fuse=p.get("lora_mode") == "fuse")
        dit.requires_grad_(False)
    sharding = None
    if p["mesh"] == UNSHARDED:  # the baseline: one device, every weight replicated, no SP hooks, no padding
        backend = get_backend(p["backend"], MeshSpec((1, 1)))
        placed = backend.place(dit, replicated_specs(dit))
        sp, padding = None, "none"
    else:  # the plan's mesh and roles, FSDP, layout, padding; or the preset's
        plan = ShardingPlan.from_dict(p["plan"]) if p.get("plan") else None
        mesh = plan_mesh_arg(p["backend"], plan) if plan is not None else mesh_arg(p["backend"], p["mesh"])
        sharding = shard_dit(dit, resolved=resolve(mesh, p["backend"], p["padding"], p.get("patches") or (), plan=plan))
        backend, placed, sp, padding = sharding.backend, sharding.placed, sharding.sp, p["padding"]
    model = ShardedTransformer(dit, backend, placed, "transformer", padding, sp=sp)
    inputs = dit_inputs(p["variant"], latent, dtype=dtype)
    text_dim = dit.config.text_dim
    cond = prompt_embeddings("a red fox running through fresh snow", text_dim, dtype=dtype)
    uncond = prompt_embeddings("", text_dim, dtype=dtype)
    per_token = p["variant"] in PER_TOKEN_TIMESTEPS
    n = p["warmup"] + p["iters"]

    def forward(x, t, emb):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=emb, return_dict=False)[0]

    # CFG parallel: a step's cond and uncond forwards as one, the pair's batch split over the cfg
    # axis, as a sharded pipeline runs them (wan_sharding.pipeline.guidance)
    cfg = sharding is not None and sharding.mesh.cfg_axis is not None
    prompts = torch.cat([cond, uncond]) if cfg else None

    def both(x, t):
        """The step's two noise predictions (cond, uncond)."""
        if cfg:
            pair = as_pair({"hidden_states": x, "timestep": t}, prompts)
            return model(**pair, return_dict=False)[0].chunk(2)
        with model.cache_context("cond", step_index=current["i"], num_inference_steps=n):
            noise_c = forward(x, t, cond)
        with model.cache_context("uncond", step_index=current["i"], num_inference_steps=n):
            noise_u = forward(x, t, uncond)
        return noise_c, noise_u

    current: dict[str, Any] = {}

    def denoise(times: list[float] | None = None, marks: list | None = None) -> torch.Tensor:
        """One denoising loop of ``n`` steps as the Wan pipelines run it (cond + uncond in their
        cache contexts, CFG, scheduler step); with ``times``, each step's seconds. Returns the
        final latents."""
        scheduler = flow_scheduler()
        scheduler.set_timesteps(n)
        latents = inputs["hidden_states"].float()
        tokens = latent.tokens()
        for i, step_t in enumerate(scheduler.timesteps):
            if marks is not None and i == p["warmup"]:
                marks.append(_cpu_snapshot())
            t = time.perf_counter()
            current.update(t=step_t, i=i)
            x = latents.to(dtype)
            ts = step_t.expand(1, tokens) if per_token else step_t.expand(1)
            noise_c, noise_u = both(x, ts)
            noise = noise_u + 4.0 * (noise_c - noise_u)
            latents = scheduler.step(noise, step_t, latents, return_dict=False)[0]
            if times is not None:
                times.append(time.perf_counter() - t)
        return latents

    cache = p.get("cache") or "none"
    uncached, uncached_times = None, []
    if cache != "none":  # a step cache on the expert, as `generate --cache` sets it (wan_sharding.caching)
        from ..caching import calibrate_mag_ratios, wan_cache_config

        # The same loop uncached, timed in this run: the drift and ratio_to_uncached are against it.
        uncached = denoise(uncached_times) if "step" in p["what"] else None

        ratios = calibrate_mag_ratios({"transformer": (dit, n)}, denoise)["transformer"] if cache == "mag" else None
        model.enable_cache(wan_cache_config(cache, n, dtype=dtype, timestep=lambda: current["t"], mag_ratios=ratios))
        if "step" in p["what"]:
            # The whole cached loop once, untimed, then its state cleared: a cache's programs are
            # reached only by the decisions that need them (fbc's reuse path after its first
            # skip), so warm-up steps alone would leave compiles in the timed ones.
            t = time.perf_counter()
            denoise()
            cache_warmup_s = time.perf_counter() - t
            model._reset_stateful_cache()
            model.cache_stats.reset()

    results = []
    for what in [w for w in p["what"] if w != "vae"]:
        times: list[float] = []
        marks: list = []
        if what == "dit":
            for i in range(n):
                if i == p["warmup"]:
                    marks.append(_cpu_snapshot())
                t = time.perf_counter()
                if cfg:  # the DiT forward of a cfg mesh: the pair's batch, one branch per group
                    both(inputs["hidden_states"], inputs["timestep"])
                else:
                    forward(inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"])
                times.append(time.perf_counter() - t)
        else:  # one denoising step as the Wan pipelines do it
            final = denoise(times, marks)
        marks.append(_cpu_snapshot())
        timed = times[p["warmup"]:]
        described = sp.describe() if sp is not None else {}
        r = {
            "what": what, "backend": p["backend"], "mesh": p["mesh"], "plan": p.get("plan_name"), "padding": padding,
            "variant": p["variant"],
            "patches": list(p.get("patches") or ()),
            "dtype": p["dtype"], "latent": [latent.frames, latent.height, latent.width],
            "tokens": latent.tokens(), "padded_tokens": described.get("last_padded_tokens") or latent.tokens(),
            "warmup": p["warmup"], "iters": p["iters"],
            "first_iter_s": times[0], "warmup_s": times[: p["warmup"]],
            "compile_s": max(times[0] - (statistics.median(timed) if timed else 0.0), 0.0),
            "median_s": statistics.median(timed) if timed else None,
            "min_s": min(timed) if timed else None, "max_s": max(timed) if timed else None, "times_s": timed,
            "forwards_per_iter": 1 if what == "dit" or cfg else 2, "cfg": 2 if cfg else 1, "note": note_for(p["backend"]),
            "compiles": backend.compiles,  # tt: torch.compile calls so far
            **(_dynamo_graphs() if p["backend"] == "tt" else {}),
            "others_cpu_share": _others_share(marks[0], marks[-1]) if len(marks) == 2 else None,
            "host_cpus": os.cpu_count(), "cache": cache,
        }
        if what == "step" and model.cache_stats is not None:
            from .pcc import compare

            r["cache_warmup_s"] = cache_warmup_s  # the untimed cached loop before the timed one
            r["cache_stats"] = model.cache_stats.summary()
            r["skip_fraction"] = r["cache_stats"]["skipped"] / max(r["cache_stats"]["calls"], 1)
            r["drift_pcc"], r["drift_max_abs"] = compare(uncached, final)  # vs the same loop uncached
            warm_uncached = uncached_times[p["warmup"]:]
            r["uncached_median_s"] = statistics.median(warm_uncached) if warm_uncached else None
            r["ratio_to_uncached"] = (r["median_s"] / r["uncached_median_s"]
                                      if timed and r["uncached_median_s"] else None)
            model.cache_stats.reset()
        results.append(r)
        if timed:
            print(f"profile {what:4} {p['backend']} {p['mesh']:9} padding {padding:5} {r['tokens']} tokens"
                  f"{' -> ' + str(r['padded_tokens']) if r['padded_tokens'] != r['tokens'] else ''}: "
                  f"first (compile + run) {r['first_iter_s']:.3f} s, warm median {r['median_s']:.4f} s "
                  f"(min {r['min_s']:.4f}, max {r['max_s']:.4f}) over {p['iters']}"
                  + (f"; cache {cache}: {r['cache_stats']['computed']}/{r['cache_stats']['calls']} computed "
                     f"({r['skip_fraction']:.0%} skipped), warm median {r['ratio_to_uncached']:.2f}x the uncached "
                     f"{r['uncached_median_s']:.4f} s, drift vs uncached max|diff| {r['drift_max_abs']:.2e}"
                     if "cache_stats" in r and r["ratio_to_uncached"] is not None else ""), flush=True)
    if model.is_cache_enabled:
        model.disable_cache()
    if sharding is not None:
        sharding.remove()
    print(f"note: {note_for(p['backend'])}", flush=True)
    return results


def _job(params: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    prepare_worker(params["backend"])
    # Inference only, as Tenstorrent runs it: with grad on, the tt backend's torch.compile would
    # trace forward and backward and keep activations.
    with torch.no_grad():
        rows = _profile(params) if set(params["what"]) - {"vae"} else []
        if "vae" in params["what"]:  # the VAE's decode, sharded and on the host (jobs/vae_profile.py)
            from .vae_profile import profile_vae

            latent = (tuple(int(v) for v in params["latent"].split(",")) if params.get("latent")
                      else PROFILE_LATENTS[params["resolution"]])
            rows.append(profile_vae(params, latent, note_for(params["backend"])))
        return rows


if __name__ == "__main__":
    from ..backends import BackendError
    from ..pipeline.tiny import PipelineUnavailable
    from ..specs import ShardingError

    from ..patches import PatchError

    sys.exit(worker_main(_job, expected=(ShardingError, PipelineUnavailable, BackendError, PatchError)))
