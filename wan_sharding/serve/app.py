"""The HTTP API of ``wan-sharding serve`` (FastAPI): tt-media-server's video API and job model.

Its routes, job record, states and status codes are those of tt-media-server's
``open_ai_api/video.py`` and ``utils/job_manager.py`` (see docs/serving.md for the commit read), so
the clients tt-inference-server ships for it work unchanged:

- ``POST /v1/videos/generations`` (text to video), ``POST /v1/videos/generations/i2v`` (JSON,
  ``image_prompts``: ``[{"image": <base64>, "frame_pos": N}]``) and ``POST
  /v1/videos/generations/i2v/upload`` (multipart: ``prompt``, ``image``, ``frame_pos``,
  ``num_inference_steps``, ``seed``, ``negative_prompt``): 202 and the job. Bad fields get 422 with
  one line naming the field and the fix (``generate``'s rules, and the image rules of
  :mod:`wan_sharding.jobs.conditioning`); an upload that is not PNG, JPEG or WebP 415, one over the
  size limit 413; an adapter name in ``loras`` the server did not register (``serve --lora``) 400;
  a full queue 429 with ``Retry-After``; nothing is queued in any of these cases.
- ``GET /v1/videos/generations/{id}``: the job; ``.../download``: the video (``video/mp4``), 404
  until the job is completed; ``POST .../cancel``: the job (``cancelled``, or ``cancelling`` until
  its step ends), 404 for a job that already ended.
- ``GET /v1/videos/jobs``: a page of jobs, oldest first (a JSON list; ``?limit=``, ``?after=``, a
  ``Link`` to the next page).
- ``GET /health``: 200 while a worker is warm and the store can be written, 503 with the reason
  otherwise (``degraded`` for the store), and each worker's state; ``GET /metrics``: Prometheus text.

Every request is within :class:`~wan_sharding.jobs.requests.RequestLimits` before anything is
stored (422 naming the limit). An error body is ``{"error": <line>, "detail": <line>}`` (``detail``:
where FastAPI clients look), without host paths. The API key and the body's size are checked before
this app sees a request (:mod:`.guard`).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Literal

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..jobs.conditioning import IMAGE_CONTENT_TYPES, Conditioning, ImageTooLarge, check_image, image_format, image_from_base64
from ..jobs.requests import (TEXT_BODY_BYTES, RequestLimits, UsageError, check_adapters, check_counts, check_limits,
                             check_video, video_factors)
from .store import FINISHED, STATUSES, StoreError, public_message
from .supervisor import HISTOGRAM_BUCKETS, Supervisor

PREFIX = "/v1/videos"
_UPLOAD_CHUNK = 64 * 1024
LIST_LIMIT = 100  # jobs a page of GET /v1/videos/jobs holds unless ?limit= says (at most LIST_MAX)
LIST_MAX = 1000


class SafeJSON(JSONResponse):
    """JSON as ASCII: any text a job holds (even a lone surrogate, escaped) can be sent."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class AdapterChoice(BaseModel):
    """One adapter a job runs with: a name the server registered (``serve --lora NAME=PATH``)
    and its weight in ``set_adapters``. tt-media-server's video request has no such field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(max_length=64)
    scale: float | int = 1.0


class GenerationRequest(BaseModel):
    """The fields of a job; the ones left out (or ``null``) take the server's defaults (``serve
    --steps`` ...; seed 0, no negative prompt). Unknown fields are refused: no field names a file
    or a path, and a field this server does not read is not silently dropped."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    seed: int | None = None
    guidance_scale: float | int = 4.0
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    video_format: Literal["mp4", "gif"] = "mp4"
    loras: list[AdapterChoice] | None = None


class ImagePrompt(BaseModel):
    """One conditioning image: base64 of a PNG, JPEG or WebP file, and the frame it anchors."""

    model_config = ConfigDict(extra="forbid", strict=True)

    image: str
    frame_pos: int = 0


class I2VRequest(GenerationRequest):
    """A job conditioned on images (tt-media-server's ``VideoI2VGenerateRequest``)."""

    image_prompts: list[ImagePrompt] = Field(min_length=1)


_FIXES = {"extra_forbidden": "remove it (the fields: " + ", ".join(I2VRequest.model_fields) + ")",
          "missing": "send it", "int_type": "send a whole number", "string_type": "send a JSON string",
          "float_type": "send a number", "model_type": "send a JSON object", "json_invalid": "send valid JSON",
          "literal_error": "send one of the values named", "too_short": "send at least one",
          "list_type": "send a JSON list", "int_parsing": "send a whole number"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    message = public_message(message)
    return SafeJSON({"error": message, "detail": message}, status_code=status, headers=headers)


def validation_line(errors: list[dict[str, Any]]) -> str:
    """The first pydantic error as one line: the field, the problem, the fix."""
    e = errors[0]
    parts = [p for p in e.get("loc", ()) if p != "body"]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or "body"
    field = field if len(field) <= 60 else field[:57] + "..."
    if e.get("type") == "string_unicode":  # a lone surrogate, in a value or in a field's name (then loc is the body)
        text = e.get("input") if isinstance(e.get("input"), str) else ""
        at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), 0)
        where = field if parts else "a field name"
        return f"{where}: a lone UTF-16 surrogate at character {at} is not text; send UTF-8 text"
    return f"{field}: {e.get('msg', 'invalid')}; {_FIXES.get(e.get('type', ''), 'see docs/serving.md for the fields')}"


def resolve_request(body: GenerationRequest, defaults: dict[str, Any], variant: str, model: str | None,
                    cache: str, limits: RequestLimits, count_tokens: Callable[[str], int] | None = None,
                    adapters: tuple[str, ...] = ()) -> dict[str, Any]:
    """The job's full settings (defaults filled in), checked with ``generate``'s rules and within
    ``limits`` (``count_tokens``: the served pipeline's tokenizer, for the prompt's token limit);
    its ``loras`` among the server's ``adapters`` (none given: the key is left out, adapters off).

    Raises:
        UsageError: one line naming the field and the fix.
    """
    req = body.model_dump(exclude={"image_prompts"})
    loras = req.pop("loras")
    if loras:
        req["loras"] = check_adapters(loras, adapters)
    for key, value in defaults.items():
        if req.get(key) is None:
            req[key] = value
    req["negative_prompt"] = req["negative_prompt"] or ""
    req["seed"] = req["seed"] or 0
    check_counts({k: req[k] for k in ("num_inference_steps", "num_frames", "height", "width")})
    check_limits(req, limits, count_tokens=count_tokens, factors=video_factors(variant, model))
    check_video(req["num_frames"], req["height"], req["width"], variant, model, names=("num_frames", "height", "width"))
    if cache == "mag" and req["num_inference_steps"] != defaults["num_inference_steps"]:
        raise UsageError(f"num_inference_steps {req['num_inference_steps']}: this server's MagCache is calibrated for "
                         f"{defaults['num_inference_steps']} steps; send that (or leave it out)")
    req["guidance_scale"] = float(req["guidance_scale"])
    return req


def metrics_text(sup: Supervisor) -> str:
    """Prometheus text: jobs by status, queue depth, job seconds (this process), worker restarts,
    each worker's state, and each worker's prompt embeddings (hits, misses, what is kept)."""
    counts = sup.store.counts()
    lines = ["# HELP wan_sharding_jobs Jobs in the store by status.", "# TYPE wan_sharding_jobs gauge"]
    lines += [f'wan_sharding_jobs{{status="{s}"}} {counts[s]}' for s in STATUSES]
    lines += ["# HELP wan_sharding_queue_depth Jobs waiting.", "# TYPE wan_sharding_queue_depth gauge",
              f"wan_sharding_queue_depth {counts['queued']}",
              "# HELP wan_sharding_queue_capacity The --queue bound.", "# TYPE wan_sharding_queue_capacity gauge",
              f"wan_sharding_queue_capacity {sup.queue_size}",
              "# HELP wan_sharding_job_seconds Seconds a completed job ran on a worker (this server process).",
              "# TYPE wan_sharding_job_seconds histogram"]
    seconds = list(sup.job_seconds)
    for bound in HISTOGRAM_BUCKETS:
        lines.append(f'wan_sharding_job_seconds_bucket{{le="{bound}"}} {sum(s <= bound for s in seconds)}')
    lines += [f'wan_sharding_job_seconds_bucket{{le="+Inf"}} {len(seconds)}',
              f"wan_sharding_job_seconds_sum {sum(seconds):.6f}", f"wan_sharding_job_seconds_count {len(seconds)}",
              "# HELP wan_sharding_worker_restarts_total Worker processes replaced after a failure (all workers).",
              "# TYPE wan_sharding_worker_restarts_total counter",
              f"wan_sharding_worker_restarts_total {sup.restarts}",
              "# HELP wan_sharding_ready 1 when a worker is warm and serving.", "# TYPE wan_sharding_ready gauge",
              f"wan_sharding_ready {int(sup.state == 'ready')}",
              "# HELP wan_sharding_adapter_jobs_total Jobs accepted that run with this adapter (this server process).",
              "# TYPE wan_sharding_adapter_jobs_total counter"]
    lines += [f'wan_sharding_adapter_jobs_total{{adapter="{name}"}} {n}' for name, n in sup.adapter_jobs.items()]
    per_worker = [("wan_sharding_worker_ready", "gauge", "1 when this worker is warm and serving.",
                   lambda r: int(r.status[0] == "ready")),
                  ("wan_sharding_worker_busy", "gauge", "1 while this worker runs a job.", lambda r: int(bool(r.running))),
                  ("wan_sharding_worker_replaced_total", "counter", "Times this worker was replaced after a failure.",
                   lambda r: r.restarts),
                  ("wan_sharding_worker_completed_total", "counter", "Jobs this worker completed (this server process).",
                   lambda r: r.completed)]
    # each worker's prompt embeddings (serve/embeddings.py), as its worker process last reported them
    cached = [r for r in sup.replicas if r.prompt_cache is not None]
    per_worker += [(f"wan_sharding_prompt_cache_{key}{'_total' if kind == 'counter' else ''}", kind, what,
                    lambda r, key=key: r.prompt_cache[key]) for key, kind, what in PROMPT_CACHE_METRICS]
    # the decodes and encodes each worker's VAE ran on the mesh (serve --vae mesh; 0 on the host)
    per_worker += [(f"wan_sharding_vae_mesh_{part}s_total", "counter",
                    f"VAE {part}s this worker process ran on the mesh (its warm-up's included).",
                    lambda r, part=part: r.vae[f"mesh_{part}s"]) for part in ("decode", "encode")]
    reported = {"wan_sharding_prompt_cache_": cached, "wan_sharding_vae_": [r for r in sup.replicas if r.vae]}
    for name, kind, what, value in per_worker:
        lines += [f"# HELP {name} {what}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{worker="{r.index}",mesh="{r.spec.mesh}",devices="{r.spec.devices}"}} {value(r)}'
                  for r in next((rs for prefix, rs in reported.items() if name.startswith(prefix)), sup.replicas)]
    return "\n".join(lines) + "\n"


# The prompt-embedding counts of a worker in /metrics: (key of PromptEmbeddings.stats(), kind, what)
PROMPT_CACHE_METRICS = (
    ("hits", "counter", "Prompts this worker process encoded before and took from its cache."),
    ("misses", "counter", "Prompts this worker process encoded (a new or evicted prompt)."),
    ("evictions", "counter", "Embeddings dropped to stay within --prompt-cache-mb."),
    ("entries", "gauge", "Prompt embeddings kept."),
    ("bytes", "gauge", "Bytes of the prompt embeddings kept."),
    ("max_bytes", "gauge", "The bound on them (--prompt-cache-mb)."),
)


def body_limits(limits: RequestLimits) -> Callable[[str], int]:
    """The most bytes a request body to each path may have (:class:`~.guard.Guard` enforces it):
    the JSON I2V route its images in base64, the upload route one image, the rest their text."""
    by_path = {f"{PREFIX}/generations/i2v": limits.body_bytes(limits.images),
               f"{PREFIX}/generations/i2v/upload": TEXT_BODY_BYTES + limits.image_bytes}
    return lambda path: by_path.get(path, TEXT_BODY_BYTES)


def create_app(sup: Supervisor, *, defaults: dict[str, Any], variant: str, model: str | None, cache: str,
               rules: Conditioning, limits: RequestLimits, adapters: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI application over a started (or starting) :class:`Supervisor`; ``rules``: what
    the served pipeline does with images; ``limits``: what one request may cost. The key and the
    body's size are checked before it (:class:`~.guard.Guard`); its interactive docs are off and
    its OpenAPI schema needs the key as every route but ``/health`` does."""
    app = FastAPI(title="wan-sharding serve", version="1", docs_url=None, redoc_url=None,
                  default_response_class=SafeJSON)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, validation_line(list(exc.errors())))

    @app.exception_handler(StoreError)
    async def _store_failed(_request: Request, exc: StoreError) -> JSONResponse:
        return _error(503, str(exc), {"Retry-After": "5"})

    def resolve(body: GenerationRequest) -> dict[str, Any]:
        return resolve_request(body, defaults, variant, model, cache, limits, sup.count_tokens(), adapters)

    def job_or_404(job_id: str) -> dict[str, Any] | JSONResponse:
        job = sup.store.get(job_id)
        return job if job is not None else _error(404, f"no job {job_id!r}; list them with GET {PREFIX}/jobs")

    def queue(req: dict[str, Any], images: dict[int, bytes] | None) -> Any:
        if not sup.ever_ready:
            return _error(503, f"not accepting jobs yet: {sup.reason}; retry when GET /health is 200",
                          {"Retry-After": "10"})
        unwritable = sup.store.probe()
        if unwritable:  # the job could not be kept, or its video not written: refused, not accepted to fail
            return _error(503, f"not accepting jobs: {unwritable}; retry when GET /health is 200", {"Retry-After": "5"})
        job = sup.submit(req, images)
        if job is None:
            mean = sum(sup.job_seconds) / len(sup.job_seconds) if sup.job_seconds else 10.0
            return _error(429, f"the queue is full ({sup.queue_size} jobs waiting); retry later",
                          {"Retry-After": str(max(1, math.ceil(mean)))})
        return SafeJSON(job, status_code=202)

    def conditioned(body: GenerationRequest, images: list[tuple[bytes, int]]) -> Any:
        """Queue an image-conditioned job: its frames checked against the pipeline's."""
        req = resolve(body)
        rules.image_arguments([pos for _, pos in images], req["num_frames"])
        return queue(req, {pos: data for data, pos in images})

    @app.post(f"{PREFIX}/generations", status_code=202)
    def submit(body: GenerationRequest) -> Any:
        try:
            rules.check_text_only()
            req = resolve(body)
        except UsageError as e:
            return _error(e.status, str(e))
        return queue(req, None)

    @app.post(f"{PREFIX}/generations/i2v", status_code=202)
    def submit_i2v(body: I2VRequest) -> Any:
        try:
            if not rules.takes_image:
                rules.image_arguments([], 1)  # the one-line refusal of this pipeline
            if len(body.image_prompts) > limits.images:  # counted before any is decoded
                raise UsageError(f"image_prompts: {len(body.image_prompts)} images is over the {limits.images} this "
                                 "server takes (--max-images); send one per frame the pipeline conditions on")
            images = [(image_from_base64(p.image, f"image_prompts[{i}].image", limits.image_bytes, limits.image_pixels),
                       p.frame_pos) for i, p in enumerate(body.image_prompts)]
            return conditioned(body, images)
        except UsageError as e:  # an image over the limit too: 422, as tt-media-server's JSON route
            return _error(e.status, str(e))

    @app.post(f"{PREFIX}/generations/i2v/upload", status_code=202)
    def submit_i2v_upload(prompt: str = Form(...), image: UploadFile = File(...), frame_pos: int = Form(0),
                          num_inference_steps: int | None = Form(None), seed: int | None = Form(None),
                          negative_prompt: str | None = Form(None)) -> Any:
        if image.content_type not in IMAGE_CONTENT_TYPES:
            return _error(415, f"image: content type {image.content_type!r} is not an image this server takes; send "
                               f"{', '.join(IMAGE_CONTENT_TYPES)}")
        chunks, size = [], 0
        while chunk := image.file.read(_UPLOAD_CHUNK):
            size += len(chunk)
            if size > limits.image_bytes:
                return _error(413, f"image: over the {limits.image_bytes:,}-byte image limit (--max-image-mb); send a "
                                   "smaller image (the video's size is enough)")
            chunks.append(chunk)
        data = b"".join(chunks)
        if image_format(data) is None:  # by its content, whatever its label said
            return _error(415, "image: not a PNG, JPEG or WebP file (by its first bytes); send one of those")
        try:
            if not rules.takes_image:
                rules.image_arguments([], 1)
            body = GenerationRequest(prompt=prompt, negative_prompt=negative_prompt,
                                     num_inference_steps=num_inference_steps, seed=seed)
            check_image(data, "image", limits.image_bytes, limits.image_pixels)
            return conditioned(body, [(data, frame_pos)])
        except ValidationError as e:
            return _error(422, validation_line(list(e.errors())))
        except ImageTooLarge as e:
            return _error(413, str(e))
        except UsageError as e:
            return _error(e.status, str(e))

    @app.get(f"{PREFIX}/generations/{{job_id}}")
    def status(job_id: str) -> Any:
        return job_or_404(job_id)

    @app.get(f"{PREFIX}/generations/{{job_id}}/download")
    def download(job_id: str) -> Any:
        job = job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        path = sup.store.video_path(job)
        if path is None:  # 404 as tt-media-server answers for a video not (or no longer) there
            return _error(404, f"job {job_id} is {job['status']}: no video to download; download once its status is "
                               "completed")
        media = "video/mp4" if path.suffix == ".mp4" else "image/gif"
        return FileResponse(path, media_type=media, filename=path.name)

    @app.post(f"{PREFIX}/generations/{{job_id}}/cancel")
    def cancel(job_id: str) -> Any:
        job = job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        if job["status"] in FINISHED:  # 404 as tt-media-server answers: nothing left to cancel
            return _error(404, f"job {job_id} is already {job['status']}; there is nothing to cancel")
        return sup.cancel(job_id)

    @app.get(f"{PREFIX}/jobs")
    def jobs(limit: int = Query(LIST_LIMIT, ge=1, le=LIST_MAX), after: str | None = Query(None, max_length=64)) -> Any:
        """A page of jobs, oldest first (a JSON list, as tt-media-server's); a full page names the
        next one in ``Link`` (``?after=<last id>``)."""
        page = sup.store.list(limit=limit, after=after)
        headers = {}
        if len(page) == limit:
            headers["Link"] = f'<{PREFIX}/jobs?limit={limit}&after={page[-1]["id"]}>; rel="next"'
        return SafeJSON(page, headers=headers)

    @app.get("/health")
    def health() -> Any:
        state, reason = sup.state, sup.reason
        degraded = sup.degraded() if state == "ready" else None
        ready = state == "ready" and degraded is None
        body = {"status": "ok" if ready else "degraded" if degraded else state,
                "reason": public_message(degraded or reason) or None, "model": sup.model,
                "worker_pid": sup.worker_pid, "running": sup.running, "queue_depth": sup.queue_depth(),
                "queue_capacity": sup.queue_size, "worker_restarts": sup.restarts, "worker": sup.ready_info,
                "workers": [r.describe() for r in sup.replicas]}
        return SafeJSON(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    def metrics() -> Any:
        return PlainTextResponse(metrics_text(sup), media_type="text/plain; version=0.0.4")

    return app
