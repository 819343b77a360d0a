"""The resident model process behind ``wan-sharding serve``: one pipeline, built and sharded once.

Runs as ``python -m wan_sharding.serve.worker`` under :func:`wan_sharding.runtime.workers.start_resident_worker`.
The first stdin line is the configuration (the options of ``serve``); the worker builds (or loads)
the pipeline, shards every expert once, runs a warm-up generation with the server's default
request settings (the first call compiles every program those shapes need) and checks its frames
are finite; then it emits ``{"event": "ready"}``. Each further stdin line is one job; the worker
answers with ``RESULT`` lines: ``progress`` after every denoising step, then ``completed``,
``cancelled`` or ``failed``. SIGUSR1 cancels the running job at the end of its current step (the
pipeline stays usable; the next job runs warm).

A job with images (``{frame_pos: base64}``, checked by the server) runs on the image-to-video
pipeline (:func:`wan_sharding.pipeline.tiny.image_pipeline`: the pipeline itself for I2V-A14B, one
over the same sharded experts for TI2V-5B), frame 0 as ``image`` and the last frame as
``last_image``. The worker of one replica (``serve --replicas N``) shards on its sub-mesh
(``replica_mesh`` in the configuration) and sees only that sub-mesh's devices.

The video goes through :func:`wan_sharding.pipeline.write_video` (a temporary name, renamed when
complete), the same file ``generate`` writes: MP4 unless the request asks for a GIF.

With ``text_encoder: "mesh"`` the pipeline's UMT5 encoder is sharded with the experts. Either way
each prompt's embedding is kept and reused for a repeated prompt (:mod:`.embeddings`; its counts
go out with every ``ready`` and ``completed`` event, for ``/metrics``). With ``vae: "mesh"`` the
VAE is sharded too (``shard_pipeline(..., vae=True)``); the decodes and encodes it ran on the mesh
go out with the same events.
"""

from __future__ import annotations

import base64
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..options import torch_dtype
from ..plan import ShardingPlan
from ..runtime.workers import emit, resident_worker_main

# The tiny pipeline's random weights: those of ``generate --seed 0``, whatever a request's seed.
WEIGHTS_SEED = 0
# ``serve --prompt-cache-mb``'s default: 64 full-size prompt embeddings (512 x 4096 bf16, 4 MiB each).
PROMPT_CACHE_MB = 256


class Cancelled(Exception):
    """The running job was cancelled (SIGUSR1)."""


class Resident:
    """The worker's state: the sharded pipeline and what it needs per request."""

    def __init__(self, config: dict[str, Any]) -> None:
        from ..jobs.launch import mesh_arg, plan_mesh_arg, prepare_worker
        from ..pipeline import shard_pipeline
        from ..pipeline.tiny import build_tiny_pipeline, image_pipeline, load_pipeline, pipeline_variant
        from .replicas import mesh_from_dict

        prepare_worker(config["backend"])
        self.config = config
        self.cancel_requested = False
        t0 = time.perf_counter()
        self.tiny = not config.get("model")
        self.dtype = config.get("dtype") or ("fp32" if self.tiny else "bf16")
        dtype = torch_dtype(self.dtype)
        self.pipe = (build_tiny_pipeline(config["variant"], seed=WEIGHTS_SEED, dtype=dtype) if self.tiny
                     else load_pipeline(config["model"], dtype))
        self.pipe.set_progress_bar_config(disable=True)
        self.variant = config["variant"] if self.tiny else pipeline_variant(self.pipe)
        self.adapters: list[str] = []  # serve --lora: loaded once, before sharding; off until a job names them
        if config.get("lora"):
            from ..lora.files import LoraRequest
            from ..lora.load import load_loras

            self.adapters = load_loras(self.pipe, [LoraRequest(**r) for r in config["lora"]])
            self.pipe.disable_lora()
        self.cache = config.get("cache") or "none"
        self.cache_steps: int | None = None  # the step count the enabled cache is set up for
        self.mag_ratios = None
        if self.cache == "mag":  # calibrated unsharded for the default step count (as generate does)
            from ..caching import calibrate_pipeline_mag_ratios

            steps = config["defaults"]["num_inference_steps"]
            self.mag_ratios = calibrate_pipeline_mag_ratios(
                self.pipe, lambda: self.pipe(**self.kwargs(config["defaults"]), output_type="latent"), steps)
        build_s = time.perf_counter() - t0
        t = time.perf_counter()
        plan = ShardingPlan.from_dict(config["plan"]) if config.get("plan") else None
        self.text_encoder = config.get("text_encoder") or "host"
        on_mesh = self.text_encoder == "mesh"
        self.vae_placement = config.get("vae") or "host"
        if plan is not None:
            self.handle = shard_pipeline(self.pipe, plan_mesh_arg(config["backend"], plan), backend=config["backend"],
                                         plan=plan, patches=config.get("patches") or (), text_encoder=on_mesh,
                                         vae=self.vae_placement == "mesh")
        else:
            mesh = (mesh_from_dict(config["replica_mesh"]) if config.get("replica_mesh")
                    else mesh_arg(config["backend"], config["mesh"]))
            self.handle = shard_pipeline(self.pipe, mesh, backend=config["backend"], padding=config["padding"],
                                         patches=config.get("patches") or (), text_encoder=on_mesh,
                                         vae=self.vae_placement == "mesh")
        self.i2v = image_pipeline(self.pipe)  # after sharding: it shares the sharded experts
        self.prompts = None  # each prompt's embedding once: from here on, by the encoder where it now runs
        if self.pipe.text_encoder is not None:
            from .embeddings import PromptEmbeddings

            mb = config.get("prompt_cache_mb")
            self.prompts = PromptEmbeddings(self._encode, int((PROMPT_CACHE_MB if mb is None else mb) * 2**20))
        shard_s = time.perf_counter() - t
        signal.signal(signal.SIGUSR1, self._on_cancel)
        t = time.perf_counter()
        frames, _ = self.generate(config["defaults"], lambda done, total: None)
        warm_s = time.perf_counter() - t
        import numpy as np

        if not np.isfinite(frames).all():
            raise RuntimeError("the warm-up generation gave non-finite frames; the pipeline or its sharding is "
                               "broken (try --dtype fp32 or another mesh)")
        emit({"event": "ready", "variant": self.variant, "dtype": self.dtype, "build_seconds": round(build_s, 3),
              "shard_seconds": round(shard_s, 3), "warmup_seconds": round(warm_s, 3),
              "warmup_shape": list(frames.shape), "text_encoder": self.text_encoder, "adapters": self.adapters,
              "prompt_cache": self.prompt_cache(), "tokenizer": self.tokenizer_json(),
              "vae": self.vae_calls()})

    def tokenizer_json(self) -> str | None:
        """The pipeline's tokenizer as ``tokenizers`` JSON: the server counts a prompt's tokens with it
        before a job is queued (without importing torch or transformers itself)."""
        backend = getattr(getattr(self.pipe, "tokenizer", None), "backend_tokenizer", None)
        return backend.to_str() if backend is not None else None

    def _on_cancel(self, _signum: int, _frame: Any) -> None:
        self.cancel_requested = True

    def kwargs(self, req: dict[str, Any], images: dict[str, Any] | None = None, pipe: Any = None) -> dict[str, Any]:
        """``pipe(**kwargs)`` for a request; ``images``: ``{"image": PIL, "last_image": PIL}``. The
        prompts as their embeddings from the worker's cache (:mod:`.embeddings`), once it has one."""
        from ..pipeline.tiny import call_kwargs

        kw = call_kwargs(pipe or self.pipe, prompt=req["prompt"], negative_prompt=req["negative_prompt"],
                         frames=req["num_frames"], height=req["height"], width=req["width"],
                         steps=req["num_inference_steps"], guidance_scale=req["guidance_scale"], seed=req["seed"],
                         tiny=self.tiny, variant=self.variant, **(images or {}))
        prompts = getattr(self, "prompts", None)
        if prompts is not None and "prompt" in kw:
            length = kw.pop("max_sequence_length", 512)  # the pipelines' default
            kw["prompt_embeds"] = prompts.get(kw.pop("prompt"), length)
            negative = kw.pop("negative_prompt") or ""
            if kw["guidance_scale"] > 1.0:  # the pipelines encode the negative prompt only under guidance
                kw["negative_prompt_embeds"] = prompts.get(negative, length)
        return kw

    def _encode(self, prompt: str, max_sequence_length: int) -> Any:
        """One prompt's embedding, as the pipeline's ``__call__`` makes it (``encode_prompt``)."""
        return self.pipe.encode_prompt(prompt, do_classifier_free_guidance=False,
                                       max_sequence_length=max_sequence_length)[0]

    def prompt_cache(self) -> dict[str, Any] | None:
        return self.prompts.stats() if self.prompts is not None else None

    def vae_calls(self) -> dict[str, Any]:
        """Where the VAE runs and how many decodes and encodes it ran on the mesh in this process
        (the warm-up's included): the counts of the pipelines' sharded VAE (``ShardedVae.calls``)."""
        from ..pipeline.vae import ShardedVae

        sharded = {id(v): v for v in (getattr(self.pipe, "vae", None), getattr(self.i2v, "vae", None))
                   if isinstance(v, ShardedVae)}
        return {"placement": self.vae_placement,
                **{f"mesh_{part}s": sum(v.calls[part] for v in sharded.values()) for part in ("decode", "encode")}}

    def images(self, req: dict[str, Any], encoded: dict[str, str]) -> dict[str, Any]:
        """The pipeline's image arguments from a job's images (``{frame_pos: base64}``, checked by
        the server with the same rules)."""
        from ..jobs.conditioning import conditioning, open_image

        rules = conditioning(self.config["variant"], self.config.get("model"))
        if not encoded:  # a job queued for another server (the API refuses it): no made-up image
            rules.check_text_only()
            return {}
        positions = sorted(int(p) for p in encoded)
        names = rules.image_arguments(positions, req["num_frames"])
        return {name: open_image(base64.b64decode(encoded[str(pos)])) for name, pos in zip(names, positions)}

    def generate(self, req: dict[str, Any], progress: Any, images: dict[str, Any] | None = None
                 ) -> tuple[Any, list[float]]:
        """The frames of one request (F, H, W, 3) and its seconds per step; ``progress(done, total)``
        after each step; with ``images`` on the image-to-video pipeline. Raises :class:`Cancelled`
        at a step's end once SIGUSR1 came."""
        steps = req["num_inference_steps"]
        marks: list[float] = []

        def on_step(_pipe: Any, i: int, _t: Any, _cb: dict) -> dict:
            marks.append(time.perf_counter())
            progress(i + 1, steps)
            if self.cancel_requested:
                raise Cancelled()
            return {}

        if self.cache != "none":
            self._cache_for(steps)
        self._use_adapters(req.get("loras") or [])
        pipe = self.i2v if images else self.pipe
        start = time.perf_counter()
        out = pipe(**self.kwargs(req, images, pipe), output_type="np", callback_on_step_end=on_step)
        return out.frames[0], [b - a for a, b in zip([start] + marks[:-1], marks)]

    def _use_adapters(self, choices: list[dict[str, Any]]) -> None:
        """The job's adapters (``[{"name", "scale"}]``, checked by the server) made the active ones
        with their scales, or every adapter off for a job that names none: diffusers'
        ``set_adapters`` / ``disable_lora`` on the sharded experts, which keep their placed base
        weights (a new scale reuses the compiled forward: docs/lora.md)."""
        if not self.adapters:
            return
        if not choices:
            self.pipe.disable_lora()
            return
        self.pipe.enable_lora()
        self.pipe.set_adapters([c["name"] for c in choices], [float(c["scale"]) for c in choices])

    def _cache_for(self, steps: int) -> None:
        """The step cache set up for a run of ``steps`` steps, its state cleared: kept enabled
        between requests of the same step count (re-enabling would compile its pieces again)."""
        from ..caching import disable_pipeline_cache, enable_pipeline_cache, reset_pipeline_cache

        if self.cache_steps == steps:
            reset_pipeline_cache(self.pipe)
            return
        if self.cache_steps is not None:
            disable_pipeline_cache(self.pipe)
            self.cache_steps = None
        enable_pipeline_cache(self.pipe, self.cache, steps, mag_ratios=self.mag_ratios)
        self.cache_steps = steps


def _setup(config: dict[str, Any]) -> Resident:
    return Resident(config)


def _handle(state: Resident, job: dict[str, Any]) -> None:
    from ..pipeline import write_video

    state.cancel_requested = False
    job_id = job["id"]
    try:
        t = time.perf_counter()
        req = job["request"]
        frames, step_s = state.generate(req, lambda done, total: emit(
            {"event": "progress", "id": job_id, "done": done, "total": total}), state.images(req, job.get("images")))
        try:
            video = write_video(frames, Path(job["stem"]), video_format=req.get("video_format") or "mp4")
        except OSError as e:  # the videos folder (unwritable, full): a storage failure, not the pipeline's
            emit({"event": "failed", "id": job_id, "storage": True,
                  "error": f"the video could not be written to the store ({e.strerror or type(e).__name__})"})
            return
        emit({"event": "completed", "id": job_id, "video": video.name, "video_shape": list(frames.shape),
              "seconds": round(time.perf_counter() - t, 3), "step_seconds": [round(s, 3) for s in step_s],
              "prompt_cache": state.prompt_cache(), "vae": state.vae_calls()})
    except Cancelled:
        emit({"event": "cancelled", "id": job_id})
    except Exception as e:  # the job failed; the pipeline is still loaded and sharded
        emit({"event": "failed", "id": job_id, "error": f"{type(e).__name__}: {e}".splitlines()[0]})


if __name__ == "__main__":
    try:
        sys.exit(resident_worker_main(_setup, _handle))
    except Exception as e:  # a failed build, shard or warm-up: one line for the server
        emit({"event": "failed_start", "error": f"{type(e).__name__}: {e}".splitlines()[0]})
        sys.exit(1)
