"""Step caching on sharded experts: every diffusers cache kind, sharded vs unsharded with the same cache.

The pipeline runs live in worker processes (one per backend and device count, two at a time); the
structural tests of the probes (which modules a cache hooks, which pieces a compiling backend runs
whole, that removing a probe restores the model) run here on a bare tiny DiT, without a backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from wan_sharding.caching import CACHE_KINDS, wan_cache_config
from wan_sharding.caching.probes import compiled_units, install_probe
from wan_sharding.jobs.generate import cache_compare_in_subprocess
from wan_sharding.jobs.launch import worker_env
from wan_sharding.models import LatentShape, build_dit, dit_inputs
from wan_sharding.runtime.workers import run_worker

KINDS = [k for k in CACHE_KINDS if k != "none"]
STEPS = 6  # each A14B expert runs 3: enough for every kind's Wan defaults to skip
MAX_ABS = 1e-4  # fp32; observed ~2e-6

# Runs in a jax worker on 8 CPU devices: the stand-in's diffusers cache API, as JSON.
API_SCRIPT = textwrap.dedent('''
    import json, torch
    from wan_sharding.pipeline import diffusers_without_torch_xla, shard_pipeline
    diffusers_without_torch_xla()
    from wan_sharding.caching import model_cache_stats, wan_cache_config
    from wan_sharding.caching.model import model_cache_probe
    from wan_sharding.caching.probes import INNER_HOOK
    from wan_sharding.pipeline.tiny import build_tiny_pipeline, call_kwargs

    r = {}
    pipe = build_tiny_pipeline("t2v-a14b")
    run = lambda: pipe(**call_kwargs(pipe, steps=6), output_type="latent").frames
    real = pipe.transformer
    fbc = lambda: wan_cache_config("fbc", 3)
    # a cache enabled on the real expert before sharding is honoured by the sharded run
    real.enable_cache(fbc())
    handle = shard_pipeline(pipe, "2x4", backend="jax")
    stand_in = pipe.transformer
    r["enabled_before_sharding"] = stand_in.is_cache_enabled
    run()
    r["adopted_skipped"] = stand_in.cache_stats.skipped()
    # FirstBlockCache runs as whole programs, each compiled once (jax.jit), two per forward
    plan = model_cache_probe(real).programs
    programs = stand_in.backend._program_cache[id(real)]
    r["programs"] = sorted(key[1] for key in programs)
    r["compiled_once"] = [f._cache_size() for f in programs.values()]
    r["programs_per_forward"] = plan.timing.program_calls / plan.timing.forwards
    # each program is given only the weights it reads (every array passed costs dispatch time)
    weights = stand_in.backend._program_weights[id(real)]
    r["blocks_read"] = sorted({(key[1], w.split(".")[1]) for key, ws in weights.items() for w in ws
                               if w.startswith("blocks.")})
    stand_in.disable_cache()
    r["disabled"] = [stand_in.is_cache_enabled, real.is_cache_enabled]
    r["no_probe_after_disable"] = not any(INNER_HOOK in getattr(m, "_diffusers_hook").hooks
                                          for m in real.modules() if hasattr(m, "_diffusers_hook"))
    try:
        stand_in.enable_cache(fbc()); stand_in.enable_cache(fbc())
    except ValueError as e:
        r["twice"] = str(e)
    run()
    r["via_stand_in_skipped"] = stand_in.cache_stats.skipped()
    handle.remove()
    r["after_remove_enabled"] = real.is_cache_enabled
    r["after_remove_probe"] = model_cache_probe(real) is not None
    r["after_remove_inner_hooks"] = sum(INNER_HOOK in m._diffusers_hook.hooks
                                        for m in real.modules() if hasattr(m, "_diffusers_hook"))
    real.disable_cache()
    print("RESULT " + json.dumps(r))
''')


def _api_run(tmp: Path):
    """API_SCRIPT as a worker of the package's own runner: its watchdog restarts a worker hung in the
    jaxlib deadlock (docs/tt-mlir-notes.md) instead of the test waiting out a timeout."""
    (tmp / "cache_api_probe.py").write_text(API_SCRIPT)
    env = worker_env("jax", 8)
    env["PYTHONPATH"] = os.pathsep.join((str(tmp), env["PYTHONPATH"]))
    return run_worker("cache_api_probe", None, env, label="cache API worker", timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Future]:
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {
        "jax": pool.submit(cache_compare_in_subprocess, "jax", ["1x4", "2x4"], KINDS, steps=STEPS),
        "xla-1x4": pool.submit(cache_compare_in_subprocess, "xla", ["1x4"], KINDS, steps=STEPS),
        "xla-2x4": pool.submit(cache_compare_in_subprocess, "xla", ["2x4"], KINDS, steps=STEPS),
        "api": pool.submit(_api_run, tmp_path_factory.mktemp("cache-api")),
        "profile": pool.submit(subprocess.run, [sys.executable, "-m", "wan_sharding.cli", "profile", "--what", "step",
                                                "--cache", "fbc", "--resolution", "tiny", "--warmup", "1", "--iters",
                                                "2", "--json"], capture_output=True, text=True, timeout=600),
    }
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("backend", ["jax", "xla"])
@pytest.mark.parametrize("mesh", ["1x4", "2x4"])
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_cache_matches_unsharded_cache(runs, backend, mesh, kind):
    results = runs["jax" if backend == "jax" else f"xla-{mesh}"].result()
    r = next(x for x in results if x["mesh"] == mesh and x["cache"] == kind)
    assert r["skipped"] > 0, f"{kind} skipped nothing on {backend} {mesh}: {r}"
    assert r["decisions_match"], f"{kind} decided differently sharded than unsharded on {backend} {mesh}"
    assert r["max_abs_vs_unsharded_cached"] <= MAX_ABS, r
    # the cache changed the result (it really skipped work), by a cache's drift, not a sharding error
    assert r["drift_max_abs"] > 10 * r["max_abs_vs_unsharded_cached"], r
    assert r["forwards"] == 2 * STEPS  # cond + uncond per step: a cache skips inside the forward
    # every kind runs as whole programs: FirstBlockCache its head and one of rest / reuse, the others one
    assert r["programs_per_forward"] == (2 if kind == "fbc" else 1), r


def test_stand_in_cache_api(runs):
    run = runs["api"].result()
    assert run.ok and len(run.results) == 1, run.output[-3000:]
    r = run.results[0]
    assert r["enabled_before_sharding"] and r["adopted_skipped"] > 0
    # the head twice (the first forward of a context has no statistic), the rest, the reuse path
    assert r["programs"] == ["head", "head", "rest", "reuse"] and r["compiled_once"] == [1, 1, 1, 1]
    assert r["programs_per_forward"] == 2
    # the head reads blocks.0's weights only, rest blocks.1 only (2 blocks), reuse none
    assert r["blocks_read"] == [["head", "0"], ["rest", "1"]]
    assert r["disabled"] == [False, False] and r["no_probe_after_disable"]
    assert "already enabled" in r["twice"]
    assert r["via_stand_in_skipped"] > 0
    # remove() takes the backend's pieces off and leaves the user's cache on the original expert
    assert r["after_remove_enabled"] and not r["after_remove_probe"] and r["after_remove_inner_hooks"] == 0


# ---------------------------------------------------------------------------- probes, no backend


def _dit() -> torch.nn.Module:
    return build_dit("t2v-a14b", "tiny", seed=0)


def test_compiled_pieces_sit_under_the_cache_decisions():
    dit = _dit()
    top = ["rope", "patch_embedding", "condition_embedder", "norm_out", "proj_out"]
    assert compiled_units(dit, {"blocks.0", "blocks.1"}) == top[:3] + ["blocks.0", "blocks.1"] + top[3:]
    pieces = compiled_units(dit, {"blocks.0.attn1", "blocks.1.attn1"})
    assert "blocks.0" not in pieces and "blocks.0.attn1" in pieces and "blocks.0.ffn" in pieces
    assert compiled_units(dit, {""}) == [name for name, _ in dit.named_children()]


@pytest.mark.parametrize("kind", KINDS)
def test_wan_configs_act_on_wan_modules(kind):
    dit = _dit()
    config = wan_cache_config(kind, 4, timestep=lambda: 500, mag_ratios=[1.0] * 4)
    probe = install_probe(dit, config)
    expected = {"fbc": r"blocks\.\d", "mag": r"blocks\.\d", "taylorseer": r"blocks\.\d\.(attn1|attn2|ffn)",
                "pab": r"blocks\.\d\.attn[12]"}[kind]
    import re

    assert probe.hooked and all(re.fullmatch(expected, name) for name in probe.hooked), probe.hooked
    probe.remove(keep_cache=False)
    assert not dit.is_cache_enabled


def test_a_cache_that_hooks_nothing_is_an_error():
    from diffusers.hooks import TaylorSeerCacheConfig

    dit = _dit()
    with pytest.raises(ValueError, match="hooks no module"):  # diffusers' default identifiers miss Wan's names
        install_probe(dit, TaylorSeerCacheConfig())
    assert not dit.is_cache_enabled


def test_probe_counts_and_removal_restores_the_model():
    dit = _dit()
    inputs = dit_inputs("t2v-a14b", LatentShape(2, 4, 6))
    reference = dit(**inputs, return_dict=False)[0]
    probe = install_probe(dit, wan_cache_config("fbc", 4, threshold=1e9))  # skips whenever it can
    for i in range(3):
        with dit.cache_context("cond", step_index=i):
            dit(**inputs, return_dict=False)
    # blocks.0 always runs; blocks.1 runs on the first call only (the same input afterwards)
    assert probe.stats.calls == {"blocks.0": 3, "blocks.1": 3}
    assert probe.stats.computed == {"blocks.0": 3, "blocks.1": 1}
    probe.remove(keep_cache=False)
    assert not any(hasattr(m, "_diffusers_hook") and m._diffusers_hook.hooks for m in dit.modules())
    assert not any(m._forward_pre_hooks for m in dit.modules())
    assert torch.equal(dit(**inputs, return_dict=False)[0], reference)


def test_profile_cache_reports_ratio_to_uncached_and_skip_fraction(runs):
    proc = runs["profile"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)["results"][0]
    stats = r["cache_stats"]
    assert r["cache"] == "fbc" and stats["skipped"] > 0
    assert r["skip_fraction"] == stats["skipped"] / stats["calls"]
    # both warm medians come from this run: the cached loop's and the same loop's uncached
    assert r["uncached_median_s"] > 0 and r["ratio_to_uncached"] == r["median_s"] / r["uncached_median_s"]
    # no compile in the timed steps: the cached loop ran once, untimed, first (with one warm-up
    # step only, fbc's reuse programs compiled inside the timed ones: ~96x the uncached step)
    assert r["cache_warmup_s"] > 0 and r["ratio_to_uncached"] < 5, r


def test_profile_cache_needs_steps():
    proc = subprocess.run([sys.executable, "-m", "wan_sharding.cli", "profile", "--what", "dit", "--cache", "fbc"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--what step" in proc.stderr


def test_a_cache_the_backend_cannot_run_is_refused_before_anything_changes():
    from diffusers.hooks import SeaCacheConfig

    from wan_sharding import get_backend, shard_dit_specs
    from wan_sharding.pipeline import ShardedTransformer
    from wan_sharding.specs import ShardingError

    dit = _dit()
    backend = get_backend("jax", "2x4")  # this pytest process runs JAX on 8 CPU devices
    model = ShardedTransformer(dit, backend, backend.place(dit, shard_dit_specs(dit, backend.mesh)), "transformer",
                               "mask")
    with pytest.raises(ShardingError, match="torchax cannot lower"):
        model.enable_cache(SeaCacheConfig())
    assert not dit.is_cache_enabled and not hasattr(dit.blocks[0], "_diffusers_hook")


@pytest.mark.parametrize("kind", ["taylorseer", "pab"])
def test_module_plan_runs_a_mixed_decision_pattern_as_the_hooks_do(kind):
    """A per-module cache's plan, run eagerly (each program the model's forward, as the lazy backends
    trace it), against the same cache hook by hook: one module's counter is put out of step with the
    others on both models, so some forwards decide differently per block. Each such pattern is a
    program of its own; the decisions and outputs are the hooks'."""
    dit, reference = _dit(), _dit()
    config = lambda: wan_cache_config(kind, 6, timestep=lambda: 500)  # noqa: E731
    probe, ref_probe = install_probe(dit, config(), as_programs=True), install_probe(reference, config())
    plan = probe.programs
    assert type(plan).__name__ == "ModulePrograms"
    inputs = dit_inputs("t2v-a14b", LatentShape(2, 4, 6))
    names = []

    def run(name: str, extra: dict) -> dict:
        names.append(name)
        return plan.body(name, lambda: dit(**inputs, return_dict=False)[0], extra)

    for step in range(8):
        inputs["timestep"] = torch.tensor([900.0 - 100 * step])
        with dit.cache_context("cond", step_index=step), reference.cache_context("cond", step_index=step):
            if step == 1:  # blocks.1.attn1 one call ahead of the rest, on both models
                for model in (dit, reference):
                    hook = model.blocks[1].attn1._diffusers_hook.hooks["taylorseer_cache" if kind == "taylorseer"
                                                                         else "pyramid_attention_broadcast"]
                    if kind == "taylorseer":
                        hook.state_manager.get_state().current_step += 1
                    else:
                        hook.state.iteration += 1
            out = plan.forward(run, probe.stats)
            ref = reference(**inputs, return_dict=False)[0]
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert probe.stats.decisions == ref_probe.stats.decisions and probe.stats.skipped() > 0
    assert any("blocks.1.attn1:" in name for name in names), names  # a per-module pattern ran
    probe.remove(keep_cache=False)
    ref_probe.remove(keep_cache=False)
