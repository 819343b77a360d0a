"""The HTTP API of ``wan-sharding serve`` (FastAPI), in the shape of tt-media-server's video API.

- ``POST /v1/videos/generations``: a job (202, ``{"id", "status": "queued", ...}``); bad fields
  get 422 with one line naming the field and the fix (the rules of ``generate``), a full queue 429
  with ``Retry-After``; nothing is queued in either case.
- ``GET /v1/videos/generations/{id}``: its ``status``, ``progress`` (steps done / total),
  ``timings`` and ``error``; ``.../download``: the video; ``POST .../cancel``.
- ``GET /v1/videos/jobs``: every job in the store, oldest first.
- ``GET /health``: 200 once the worker is warm, 503 with the reason while it warms up or is
  replaced; ``GET /metrics``: Prometheus text.

With an API key every endpoint but ``/health`` needs ``Authorization: Bearer <key>`` (401).
"""

from __future__ import annotations

import hmac
import math
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ..cli.validate import UsageError, check_counts, check_video
from .store import STATUSES
from .supervisor import HISTOGRAM_BUCKETS, Supervisor

PREFIX = "/v1/videos"


class GenerationRequest(BaseModel):
    """The fields of a job; the ones left out take the server's defaults (``serve --steps`` ...).
    Unknown fields are refused: no field names a file or a path."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    negative_prompt: str = ""
    num_inference_steps: int | None = None
    seed: int = 0
    guidance_scale: float | int = 4.0
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None


_FIXES = {"extra_forbidden": "remove it (the fields: " + ", ".join(GenerationRequest.model_fields) + ")",
          "missing": "send it", "int_type": "send a whole number", "string_type": "send a JSON string",
          "float_type": "send a number", "model_type": "send a JSON object", "json_invalid": "send valid JSON"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def validation_line(errors: list[dict[str, Any]]) -> str:
    """The first pydantic error as one line: the field, the problem, the fix."""
    e = errors[0]
    field = ".".join(p for p in e.get("loc", ()) if isinstance(p, str) and p != "body") or "body"
    return f"{field}: {e.get('msg', 'invalid')}; {_FIXES.get(e.get('type', ''), 'see GET /docs for the fields')}"


def resolve_request(body: GenerationRequest, defaults: dict[str, Any], variant: str, model: str | None,
                    cache: str) -> dict[str, Any]:
    """The job's full settings (defaults filled in), checked with ``generate``'s rules.

    Raises:
        UsageError: one line naming the field and the fix.
    """
    req = body.model_dump()
    for key, value in defaults.items():
        if req.get(key) is None:
            req[key] = value
    check_counts({k: req[k] for k in ("num_inference_steps", "num_frames", "height", "width")})
    check_video(req["num_frames"], req["height"], req["width"], variant, model, names=("num_frames", "height", "width"))
    if not math.isfinite(req["guidance_scale"]):
        raise UsageError(f"guidance_scale {req['guidance_scale']}: must be a finite number; e.g. 4.0")
    if cache == "mag" and req["num_inference_steps"] != defaults["num_inference_steps"]:
        raise UsageError(f"num_inference_steps {req['num_inference_steps']}: this server's MagCache is calibrated for "
                         f"{defaults['num_inference_steps']} steps; send that (or leave it out)")
    req["guidance_scale"] = float(req["guidance_scale"])
    return req


def metrics_text(sup: Supervisor) -> str:
    """Prometheus text: jobs by status, queue depth, job seconds (this process), worker restarts."""
    counts = sup.store.counts()
    lines = ["# HELP wan_sharding_jobs Jobs in the store by status.", "# TYPE wan_sharding_jobs gauge"]
    lines += [f'wan_sharding_jobs{{status="{s}"}} {counts[s]}' for s in STATUSES]
    lines += ["# HELP wan_sharding_queue_depth Jobs waiting.", "# TYPE wan_sharding_queue_depth gauge",
              f"wan_sharding_queue_depth {counts['queued']}",
              "# HELP wan_sharding_queue_capacity The --queue bound.", "# TYPE wan_sharding_queue_capacity gauge",
              f"wan_sharding_queue_capacity {sup.queue_size}",
              "# HELP wan_sharding_job_seconds Seconds a completed job ran on the worker (this server process).",
              "# TYPE wan_sharding_job_seconds histogram"]
    seconds = list(sup.job_seconds)
    for bound in HISTOGRAM_BUCKETS:
        lines.append(f'wan_sharding_job_seconds_bucket{{le="{bound}"}} {sum(s <= bound for s in seconds)}')
    lines += [f'wan_sharding_job_seconds_bucket{{le="+Inf"}} {len(seconds)}',
              f"wan_sharding_job_seconds_sum {sum(seconds):.6f}", f"wan_sharding_job_seconds_count {len(seconds)}",
              "# HELP wan_sharding_worker_restarts_total Worker processes replaced after a failure.",
              "# TYPE wan_sharding_worker_restarts_total counter",
              f"wan_sharding_worker_restarts_total {sup.restarts}",
              "# HELP wan_sharding_ready 1 when the worker is warm and serving.", "# TYPE wan_sharding_ready gauge",
              f"wan_sharding_ready {int(sup.state == 'ready')}"]
    return "\n".join(lines) + "\n"


def create_app(sup: Supervisor, *, defaults: dict[str, Any], variant: str, model: str | None, cache: str,
               api_key: str | None) -> FastAPI:
    """The FastAPI application over a started (or starting) :class:`Supervisor`."""
    app = FastAPI(title="wan-sharding serve", version="1")

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise _Unauthorized()

    class _Unauthorized(Exception):
        pass

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(_request: Request, _exc: Exception) -> JSONResponse:
        return _error(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                      {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, validation_line(list(exc.errors())))

    auth = [Depends(authorized)]

    def job_or_404(job_id: str) -> dict[str, Any] | JSONResponse:
        job = sup.store.get(job_id)
        return job if job is not None else _error(404, f"no job {job_id!r}; list them with GET {PREFIX}/jobs")

    @app.post(f"{PREFIX}/generations", status_code=202, dependencies=auth)
    def submit(body: GenerationRequest) -> Any:
        try:
            req = resolve_request(body, defaults, variant, model, cache)
        except UsageError as e:
            return _error(422, str(e))
        if not sup.ever_ready:
            return _error(503, f"not accepting jobs yet: {sup.reason}; retry when GET /health is 200",
                          {"Retry-After": "10"})
        job = sup.submit(req)
        if job is None:
            mean = sum(sup.job_seconds) / len(sup.job_seconds) if sup.job_seconds else 10.0
            return _error(429, f"the queue is full ({sup.queue_size} jobs waiting); retry later",
                          {"Retry-After": str(max(1, math.ceil(mean)))})
        return job

    @app.get(f"{PREFIX}/generations/{{job_id}}", dependencies=auth)
    def status(job_id: str) -> Any:
        return job_or_404(job_id)

    @app.get(f"{PREFIX}/generations/{{job_id}}/download", dependencies=auth)
    def download(job_id: str) -> Any:
        job = job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        path = sup.store.video_path(job)
        if path is None:
            return _error(409, f"job {job_id} is {job['status']}, no video to download; download once its status "
                               "is completed")
        media = "video/mp4" if path.suffix == ".mp4" else "image/gif"
        return FileResponse(path, media_type=media, filename=path.name)

    @app.post(f"{PREFIX}/generations/{{job_id}}/cancel", dependencies=auth)
    def cancel(job_id: str) -> Any:
        job = sup.cancel(job_id)
        return job if job is not None else job_or_404(job_id)

    @app.get(f"{PREFIX}/jobs", dependencies=auth)
    def jobs() -> Any:
        return {"object": "list", "data": sup.store.list()}

    @app.get("/health")
    def health() -> Any:
        body = {"status": "ok" if sup.state == "ready" else sup.state, "reason": sup.reason or None,
                "worker_pid": sup.worker_pid, "running": sup.running, "queue_depth": sup.queue_depth(),
                "queue_capacity": sup.queue_size, "worker_restarts": sup.restarts, "worker": sup.ready_info}
        return JSONResponse(body, status_code=200 if sup.state == "ready" else 503)

    @app.get("/metrics", dependencies=auth)
    def metrics() -> Any:
        return PlainTextResponse(metrics_text(sup), media_type="text/plain; version=0.0.4")

    return app
