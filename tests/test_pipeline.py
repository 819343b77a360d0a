"""The sharded diffusers pipeline: both experts, exact restore, the generate and profile commands.

Every pipeline runs in a worker process with its backend's environment (torch-xla and JAX must not
share a process, and this pytest process keeps neither the pipeline modules nor torch-xla). The
four workers start together when the module's first test asks for them, two at a time (the host
has 2 cores), so the module takes about as long as its longest worker pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from wan_sharding.jobs.generate import compare_in_subprocess
from wan_sharding.jobs.launch import worker_env

PCC_MIN = 0.99999  # fp32 pipeline latents after 2 denoising steps (observed ~1 - 1e-11)
MAX_ABS = 1e-4  # observed ~3e-6; a padded key leaking into attention is ~1e-3 (docs/check.md)

# Runs in an xla worker on 8 CPU devices: refusals, isolation and exact restore, as JSON.
API_SCRIPT = textwrap.dedent('''
    import json, torch
    from wan_sharding.backends.xla import enable_spmd
    enable_spmd()
    from diffusers import DiffusionPipeline
    from wan_sharding.pipeline import ShardedTransformer, shard_pipeline
    from wan_sharding.specs import ShardingError
    from wan_sharding.pipeline.tiny import build_tiny_pipeline, call_kwargs

    r = {}
    def refused(fn):
        try:
            fn()
        except ShardingError as e:
            return str(e)
        return None

    pipe = build_tiny_pipeline("t2v-a14b")
    run = lambda p: p(**call_kwargs(p, steps=2), output_type="latent").frames
    reference = run(pipe)
    experts = (pipe.transformer, pipe.transformer_2)
    params = [[id(t) for t in e.parameters()] for e in experts]
    config = dict(pipe.config)

    class NotWan(DiffusionPipeline):
        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

    r["not_wan"] = refused(lambda: shard_pipeline(NotWan(experts[0]), "2x4", backend="xla"))
    r["bad_padding"] = refused(lambda: shard_pipeline(pipe, "2x4", backend="xla", padding="zero"))
    no_encoder = build_tiny_pipeline("t2v-a14b", text_encoder=False)  # prompt embeddings given instead
    r["no_text_encoder"] = refused(lambda: shard_pipeline(no_encoder, "2x4", backend="xla", text_encoder=True))
    r["untouched_after_refusals"] = all(getattr(pipe, n) is e for n, e in zip(("transformer", "transformer_2"), experts)) \
        and no_encoder.transformer is not None and not isinstance(no_encoder.transformer, ShardedTransformer)

    encoder = pipe.text_encoder
    encoder_params = [id(t) for t in encoder.parameters()]
    handle = shard_pipeline(pipe, "2x4", backend="xla", text_encoder=True)  # the UMT5 encoder on the mesh too
    wrappers = (pipe.transformer, pipe.transformer_2)
    r["wrapped"] = [type(w).__name__ for w in wrappers]
    r["text_encoder_wrapped"] = [type(pipe.text_encoder).__name__, str(next(encoder.parameters()).device),
                                 list(pipe.config["text_encoder"])]
    r["pipe_device_sharded"] = str(pipe.device)
    r["expert_device_sharded"] = str(next(experts[0].parameters()).device)
    r["config_sharded"] = list(pipe.config["transformer"])
    r["twice"] = refused(lambda: shard_pipeline(pipe, "2x4", backend="xla"))
    shared = type(pipe)(**{**pipe.components, "transformer": experts[0], "transformer_2": experts[1]})
    r["shared_expert"] = refused(lambda: shard_pipeline(shared, "2x4", backend="xla"))
    r["wrappers_kept_after_refusals"] = (pipe.transformer, pipe.transformer_2) == wrappers
    # copies of a sharded pipeline would share its device weights and hooks: refused, pipeline intact
    import copy, pickle
    r["deepcopy"] = refused(lambda: copy.deepcopy(pipe))
    r["pickle"] = refused(lambda: pickle.dumps(pipe))
    r["wrappers_kept_after_copy"] = (pipe.transformer, pipe.transformer_2) == wrappers
    # an eager call of an expert with SP hooks, on host tensors: says to use backend.run
    from wan_sharding.models import LatentShape, dit_inputs
    r["eager_host_call"] = refused(lambda: experts[0](**dit_inputs("t2v-a14b", LatentShape(2, 8, 12))))
    other = build_tiny_pipeline("t2v-a14b")  # a second instance, same weights, not sharded
    r["other_instance_unaffected"] = bool(torch.equal(run(other), reference))
    sharded = run(pipe)
    r["sharded_close"] = float((sharded - reference).abs().max())

    handle.remove()
    handle.remove()  # idempotent
    r["restored_objects"] = all(getattr(pipe, n) is e for n, e in zip(("transformer", "transformer_2"), experts)) \
        and pipe.text_encoder is encoder
    r["restored_params"] = [[id(t) for t in e.parameters()] for e in experts] == params \
        and [id(t) for t in encoder.parameters()] == encoder_params \
        and encoder.encoder.embed_tokens.weight is encoder.shared.weight
    r["restored_config"] = dict(pipe.config) == config
    r["expert_device_after"] = str(next(experts[0].parameters()).device)
    r["bit_identical_after"] = bool(torch.equal(run(pipe), reference))
    r["no_hooks_after"] = all(not m._forward_hooks and not m._forward_pre_hooks
                              for e in (*experts, encoder) for m in e.modules())
    try:
        wrappers[0](hidden_states=None)
    except ShardingError as e:
        r["stale_wrapper"] = str(e)
    again = shard_pipeline(pipe, "2x4", backend="xla")  # sharding again after remove() is fine
    again.remove()
    r["reshard_ok"] = pipe.transformer is experts[0]

    # load_pipeline: a saved pipeline directory, offline (the tiny one with its UMT5 encoder and tokenizer)
    import tempfile
    from wan_sharding.pipeline.tiny import PipelineUnavailable, load_pipeline
    with tempfile.TemporaryDirectory() as folder:
        try:
            load_pipeline(folder)
        except PipelineUnavailable as e:
            r["not_a_pipeline_dir"] = str(e)
        pipe.save_pretrained(folder)
        loaded = load_pipeline(folder, dtype=torch.float32)
    r["loaded"] = [type(loaded).__name__, type(loaded.transformer_2).__name__, loaded.config.boundary_ratio]
    r["loaded_close"] = float((run(loaded) - reference).abs().max())
    print("RESULT " + json.dumps(r))
''')


# Runs in a jax worker on 8 CPU devices: the prompt_kv patch in a two-expert pipeline with guidance.
PROMPT_KV_SCRIPT = textwrap.dedent('''
    import json, torch
    from wan_sharding.pipeline import diffusers_without_torch_xla, shard_pipeline
    diffusers_without_torch_xla()
    from wan_sharding.caching import enable_pipeline_cache, pipeline_cache_stats
    from wan_sharding.patches.prompt_kv import prompt_cache
    from wan_sharding.pipeline.tiny import build_tiny_pipeline, call_kwargs

    r = {}
    pipe, reference = build_tiny_pipeline("t2v-a14b"), build_tiny_pipeline("t2v-a14b")  # the same weights
    experts = {n: getattr(pipe, n) for n in ("transformer", "transformer_2")}
    def gap(prompt="a red fox running through snow", **extra):
        """Sharded (patched) against unsharded (vanilla) final latents, each with fresh call kwargs."""
        runs = [p(**call_kwargs(p, prompt=prompt, steps=4), **extra, output_type="latent").frames
                for p in (pipe, reference)]
        return float((runs[0] - runs[1]).abs().max())
    counts = lambda: {n: [prompt_cache(e).computed, prompt_cache(e).reused] for n, e in experts.items()}

    handle = shard_pipeline(pipe, "2x4", backend="jax", patches=["exact"])
    r["patches"] = list(handle.experts[0].patches.names)
    r["fox"], r["fox_counts"] = gap(), counts()
    r["bird"], r["bird_counts"] = gap("a blue bird over a lake"), counts()
    def halve(p, i, t, kw):  # the pipeline's prompt tensor changed in place after the first step
        if i == 0:
            kw["prompt_embeds"].mul_(0.5)
        return {}
    r["in_place"] = gap(callback_on_step_end=halve, callback_on_step_end_tensor_inputs=["prompt_embeds"])
    r["in_place_counts"] = counts()
    for p in (pipe, reference):  # a step cache decides as it does on the vanilla unsharded pipeline
        enable_pipeline_cache(p, "fbc", 4, threshold=1e9)  # skip whenever it may
    r["fbc"] = gap()
    r["fbc_decisions"] = [pipeline_cache_stats(p) for p in (pipe, reference)]
    handle.remove()
    r["removed"] = [prompt_cache(e) is None for e in experts.values()]
    print("RESULT " + json.dumps(r))
''')


def _run(cmd: list[str], backend: str, devices: int, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=worker_env(backend, devices), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Future]:
    out = tmp_path_factory.mktemp("generate")
    pool = ThreadPoolExecutor(max_workers=2)
    cli = [sys.executable, "-m", "wan_sharding.cli"]
    futures = {
        # longest first: jax on three meshes in one 32-device process, the default padding mode
        "compare_jax": pool.submit(compare_in_subprocess, "jax", ["1x4", "2x4", "8x4"], "t2v-a14b", 2),
        "generate": pool.submit(_run, [*cli, "generate", "--backend", "xla", "--mesh", "2x4", "--steps", "2",
                                       "--variant", "i2v-a14b", "--padding", "slice", "--text-encoder", "mesh",
                                       "--vae", "mesh", "--compare", "--out", str(out)],
                                "xla", 8),
        "api": pool.submit(_run, [sys.executable, "-c", API_SCRIPT], "xla", 8),
        "prompt_kv": pool.submit(_run, [sys.executable, "-c", PROMPT_KV_SCRIPT], "jax", 8),
        "profile": pool.submit(_run, [*cli, "profile", "--backend", "jax", "--mesh", "1x4", "--what", "dit", "step",
                                      "--padding", "mask", "--resolution", "tiny", "--warmup", "2", "--iters", "2",
                                      "--json"], "jax", 4),
    }
    futures["out"] = out
    yield futures
    pool.shutdown(wait=True)


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))


def test_pipeline_latents_match_unsharded_on_every_mesh_jax(jobs):
    results = jobs["compare_jax"].result()
    assert [r["mesh"] for r in results] == ["1x4", "2x4", "8x4"]
    for r in results:
        assert r["pcc"] >= PCC_MIN and r["max_abs"] <= MAX_ABS, r
        assert r["swapped"] == {"transformer": "ShardedTransformer", "transformer_2": "ShardedTransformer"}
        # step 1 (t=999) is the high-noise expert's, step 2 (t=750) the low-noise one's; cond + uncond each
        assert r["forwards"] == {"transformer": 2, "transformer_2": 2}, r
        assert r["tokens"] == 48 and r["padded_tokens"] == (256 if r["mesh"] == "8x4" else 64)
        # remove() put the very same objects back, and the unsharded pipeline is bit-identical
        assert r["restored_objects"] and r["restored_params"] and r["restored_config"], r
        assert r["bit_identical_after_remove"] and r["device_after_remove"] == "cpu", r


def test_generate_writes_video_and_summary_and_matches_unsharded_xla(jobs):
    """``generate --variant i2v-a14b --mesh 2x4 --text-encoder mesh --vae mesh --compare`` on
    torch-xla: both experts, the tiny UMT5 encoder and the VAE sharded (the image condition encoded
    and the video decoded through it), the final latents and the video against the unsharded
    pipeline's."""
    proc = jobs["generate"].result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == "backend: xla; patches: none; cache: none; cfg: 1; text encoder: mesh; vae: mesh"
    assert "compare: final latents sharded vs unsharded PCC" in proc.stdout
    assert "compare: decoded video (VAE on the mesh) vs unsharded PCC" in proc.stdout
    assert "it/s]" not in proc.stderr  # its stderr is a pipe here: no progress bars
    summary = json.loads(Path(jobs["out"], "i2v-a14b-xla-2x4-slice.json").read_text())
    assert summary["backend"] == "xla" and summary["mesh"] == "2x4" and summary["steps"] == 2
    assert summary["experts"] == ["transformer", "transformer_2"]
    assert summary["forwards"] == {"transformer": 2, "transformer_2": 2}
    assert summary["latent_shape"] == [1, 16, 2, 8, 12] and summary["video_shape"] == [5, 64, 96, 3]
    assert summary["pcc"] >= PCC_MIN and summary["max_abs"] <= MAX_ABS, summary
    # the tiny UMT5 encoder ran on the mesh, not prompt embeddings given: the prompt and the negative prompt
    assert summary["text_encoder"] == "mesh" and summary["text_encoder_calls"] == 2, summary
    assert summary["text_encoder_params"]["embedding_colwise"] == 2
    # the image condition encoded and the video decoded on the mesh, by the pipeline's own __call__
    assert summary["vae"] == "mesh" and summary["vae_calls"] == {"decode": 1, "encode": 1}, summary
    assert summary["vae_split"] == "H/2 on sp, W/4 on tp"
    assert summary["video_ok"] and summary["video_pcc"] >= PCC_MIN and summary["video_max_abs"] <= MAX_ABS, summary
    assert len(summary["step_seconds"]) == 2 and summary["seconds"] > 0
    from PIL import Image

    video = Path(summary["output"])
    assert video.suffix in (".gif", ".mp4") and video.stat().st_size > 0
    if video.suffix == ".gif":
        with Image.open(video) as im:
            assert im.n_frames == 5 and im.size == (96, 64)


def test_shard_pipeline_refuses_restores_and_isolates(jobs):
    r = _result(jobs["api"].result())
    assert "Wan 2.2 pipeline" in r["not_wan"] and "NotWan" in r["not_wan"]
    assert "unknown padding mode" in r["bad_padding"]
    assert "text_encoder=True, but this WanPipeline has no text encoder" in r["no_text_encoder"]
    assert r["text_encoder_wrapped"] == ["ShardedTextEncoder", "xla:0", ["wan_sharding.pipeline", "ShardedTextEncoder"]]
    assert r["untouched_after_refusals"]
    assert r["wrapped"] == ["ShardedTransformer", "ShardedTransformer"]
    assert r["pipe_device_sharded"] == "cpu" and r["expert_device_sharded"].startswith("xla")
    assert r["config_sharded"] == ["wan_sharding.pipeline", "ShardedTransformer"]
    assert "already sharded" in r["twice"] and "remove()" in r["twice"]
    assert "sequence-parallel hooks" in r["shared_expert"]
    assert r["wrappers_kept_after_refusals"]
    for how in ("deepcopy", "pickle"):  # refused with the way to do it; sharded_close below: still exact
        assert "cannot be copied or pickled" in r[how] and "handle.remove() first, copy, then shard_pipeline" in r[how]
    assert r["wrappers_kept_after_copy"]
    assert "backend.run" in r["eager_host_call"] and "ran eagerly on cpu tensors" in r["eager_host_call"]
    assert r["other_instance_unaffected"]
    assert r["sharded_close"] <= MAX_ABS
    assert r["restored_objects"] and r["restored_params"] and r["restored_config"]
    assert r["expert_device_after"] == "cpu" and r["bit_identical_after"] and r["no_hooks_after"]
    assert "removed" in r["stale_wrapper"]
    assert r["reshard_ok"]
    assert r["loaded"] == ["WanPipeline", "WanTransformer3DModel", 0.875] and r["loaded_close"] <= MAX_ABS
    assert "model_index.json" in r["not_a_pipeline_dir"]


def test_prompt_kv_in_a_pipeline_once_per_prompt_value_per_expert(jobs):
    """``shard_pipeline(patches=["exact"])``, prompt_kv among them, in the two-expert pipeline with
    guidance (4 steps: 2 on each expert, cond + uncond each): final
    latents as the vanilla unsharded pipeline's; each expert makes each prompt's state once (a new
    prompt only its own, the unchanged negative prompt is reused by value), again when the prompt
    tensor is changed in place mid-run; FirstBlockCache decides as on the vanilla pipeline."""
    r = _result(jobs["prompt_kv"].result())
    assert "prompt_kv" in r["patches"]
    for key in ("fox", "bird", "in_place", "fbc"):
        assert r[key] <= MAX_ABS, (key, r[key])
    # [states made, states reused] per expert, summed over the runs
    assert r["fox_counts"] == {"transformer": [2, 2], "transformer_2": [2, 2]}
    assert r["bird_counts"] == {"transformer": [3, 5], "transformer_2": [3, 5]}
    # the fox prompt again (its state was dropped for the bird's), halved in place after step 1: the
    # high-noise expert makes the fox's and then the halved one's, the low-noise expert the halved one's
    assert r["in_place_counts"] == {"transformer": [5, 7], "transformer_2": [4, 8]}
    sharded, vanilla = r["fbc_decisions"]
    assert sharded == vanilla and any(0 in e["decisions"] for e in vanilla.values()), (sharded, vanilla)
    assert r["removed"] == [True, True]


def test_profile_json_reports_warm_iterations(jobs):
    proc = jobs["profile"].result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert "not hardware predictions" in data["note"]
    by_what = {r["what"]: r for r in data["results"]}
    assert set(by_what) == {"dit", "step"}
    for what, r in by_what.items():
        assert r["backend"] == "jax" and r["mesh"] == "1x4" and r["padding"] == "mask"
        assert r["tokens"] == 105 and r["padded_tokens"] == 128
        assert len(r["warmup_s"]) == 2 and len(r["times_s"]) == 2
        assert r["min_s"] <= r["median_s"] <= r["max_s"] and r["first_iter_s"] > r["median_s"]
        assert r["compile_s"] >= 0 and r["forwards_per_iter"] == (1 if what == "dit" else 2)


def test_cli_registers_generate_and_profile():
    from wan_sharding.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--mesh", "8x4", "--variant", "ti2v-5b", "--compare"])
    assert args.mesh == "8x4" and args.compare and args.backend == "jax" and callable(args.func)
    args = parser.parse_args(["profile", "--mesh", "unsharded", "--what", "dit", "step"])
    assert args.what == ["dit", "step"] and args.warmup == 2 and args.iters == 3


MP4_BESIDE_JAX = textwrap.dedent("""
    import json, os, sys, warnings
    from pathlib import Path
    from wan_sharding.jobs.launch import prepare_worker
    prepare_worker("jax")  # as a jax worker starts: CPU JAX without the Tenstorrent plugin
    import imageio, jax.numpy as jnp, numpy as np
    from wan_sharding.pipeline.video import write_video

    jnp.ones(3).block_until_ready()  # JAX's runtime threads are up: a fork that runs Python now warns
    frames, out = np.random.default_rng(0).random((5, 64, 96, 3)), Path(sys.argv[1])
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        path = write_video(frames, out / "ours")
    with warnings.catch_warnings(record=True) as plain:  # imageio's defaults, for comparison
        warnings.simplefilter("always")
        with imageio.get_writer(str(out / "plain.mp4"), format="FFMPEG", mode="I", fps=8) as w:
            w.append_data((frames[0] * 255).astype(np.uint8))
    with imageio.get_reader(path, format="FFMPEG") as reader:
        decoded = len([f for f in reader])
    fork = lambda ws: [str(w.message)[:40] for w in ws if "fork" in str(w.message)]
    print(json.dumps({"ours": fork(ours), "plain": fork(plain), "decoded": decoded,
                      "switch_left": "IMAGEIO_FFMPEG_NO_PREVENT_SIGINT" in os.environ}))
""")


def test_an_mp4_is_written_beside_jax_threads_without_a_fork_running_python(tmp_path):
    """``write_video`` starts ffmpeg without imageio-ffmpeg's ``preexec_fn`` (a fork that runs Python
    in the child, which JAX warns "will likely lead to a deadlock"), leaves the environment as it
    was, and the MP4 decodes whole; imageio's defaults in the same process do warn."""
    proc = subprocess.run([sys.executable, "-c", MP4_BESIDE_JAX, str(tmp_path)], env=worker_env("jax", 1),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["ours"] == [] and r["plain"] != [] and r["decoded"] == 5 and not r["switch_left"], r
