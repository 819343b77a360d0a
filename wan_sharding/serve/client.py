"""A Python client for ``wan-sharding serve`` (also what ``wan-sharding submit`` uses).

>>> from wan_sharding.serve import Client
>>> c = Client("http://127.0.0.1:8765")
>>> job = c.submit(prompt="a red fox", seed=1, num_inference_steps=4)
>>> job = c.wait(job["id"])                  # polls progress until completed / failed / cancelled
>>> path = c.download(job["id"], "out/")     # the MP4, written under a temporary name, then renamed
>>> job = c.submit(prompt="it turns", image="fox.png")   # image to video (frame_pos 0)
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from ..jobs.conditioning import check_image
from ..jobs.requests import UsageError
from ..runtime.workers import atomic_path
from .store import FINISHED

ImageSource = str | os.PathLike[str] | bytes


def read_image(source: ImageSource, what: str) -> bytes:
    """The bytes of an image file (a path, or the bytes themselves), checked as the server checks
    them (:func:`wan_sharding.jobs.conditioning.check_image`): UsageError naming ``what`` otherwise."""
    if isinstance(source, bytes):
        data = source
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise UsageError(f"{what} {source}: cannot be read ({e.strerror}); pass an image file") from None
    check_image(data, f"{what} {source}" if not isinstance(source, bytes) else what)
    return data

PREFIX = "/v1/videos"


class ServeError(RuntimeError):
    """The server answered with an error (``status``: the HTTP code; the message is its one line)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Client:
    """Jobs on one ``wan-sharding serve`` server, over HTTP.

    Args:
        url: the server, e.g. ``http://127.0.0.1:8765``.
        api_key: sent as ``Authorization: Bearer <key>`` (default: ``WAN_SHARDING_API_KEY``).
        timeout: seconds per HTTP request.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        key = api_key or os.environ.get("WAN_SHARDING_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ServeError(0, f"cannot reach {self.url} ({type(e).__name__}: {e}); is `wan-sharding serve` "
                                "running there?") from None
        if r.status_code >= 400:
            try:
                message = r.json().get("error") or r.text
            except ValueError:
                message = r.text
            retry = r.headers.get("retry-after")
            raise ServeError(r.status_code, f"{r.status_code}: {message}", float(retry) if retry else None)
        return r

    def health(self) -> dict[str, Any]:
        """``/health``'s body (raises :class:`ServeError` with 503 while not ready)."""
        return self._call("GET", "/health").json()

    def wait_ready(self, timeout: float = 600.0, poll: float = 0.5) -> dict[str, Any]:
        """Wait until ``/health`` is 200."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except ServeError as e:
                if time.monotonic() > deadline:
                    raise
                if e.status not in (0, 503):
                    raise
            time.sleep(poll)

    def submit(self, image: ImageSource | None = None, frame_pos: int = 0,
               image_prompts: Sequence[tuple[ImageSource, int]] = (), **fields: Any) -> dict[str, Any]:
        """Queue a job; the job. Fields: ``prompt``, ``negative_prompt``, ``num_inference_steps``,
        ``seed``, ``guidance_scale``, ``num_frames``, ``height``, ``width``, ``video_format``, ``loras``
        (``None`` ones are left out: the server's defaults).

        Text to video: ``POST /v1/videos/generations``. With ``image`` (a file's path or bytes, at
        ``frame_pos``) or ``image_prompts`` (``[(image, frame_pos), ...]``), image to video: ``POST
        /v1/videos/generations/i2v``. Each image is read and checked here first (UsageError)."""
        body = {k: v for k, v in fields.items() if v is not None}
        prompts = ([(image, frame_pos)] if image is not None else []) + list(image_prompts)
        if not prompts:
            return self._call("POST", f"{PREFIX}/generations", json=body).json()
        body["image_prompts"] = [{"image": base64.b64encode(read_image(src, "image")).decode("ascii"), "frame_pos": pos}
                                 for src, pos in prompts]
        return self._call("POST", f"{PREFIX}/generations/i2v", json=body).json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"{PREFIX}/generations/{job_id}").json()

    def jobs(self, limit: int | None = None, after: str | None = None) -> list[dict[str, Any]]:
        """A page of jobs, oldest first (the server's default page size unless ``limit``); ``after``:
        the last id of the page before."""
        params = {k: v for k, v in (("limit", limit), ("after", after)) if v is not None}
        return self._call("GET", f"{PREFIX}/jobs", params=params).json()

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"{PREFIX}/generations/{job_id}/cancel").json()

    def metrics(self) -> str:
        return self._call("GET", "/metrics").text

    def wait(self, job_id: str, on_progress: Callable[[dict[str, Any]], None] | None = None, poll: float = 0.25,
             timeout: float | None = None) -> dict[str, Any]:
        """Poll a job until it is completed, failed or cancelled; ``on_progress(job)`` on each poll."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if on_progress is not None:
                on_progress(job)
            if job["status"] in FINISHED:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout} s")
            time.sleep(poll)

    def video_bytes(self, job_id: str) -> bytes:
        return self._call("GET", f"{PREFIX}/generations/{job_id}/download").content

    def download(self, job_id: str, out_dir: str | os.PathLike[str]) -> Path:
        """Write a completed job's video into ``out_dir`` (the server's file name); its path."""
        r = self._call("GET", f"{PREFIX}/generations/{job_id}/download")
        disposition = r.headers.get("content-disposition", "")
        name = Path(disposition.split("filename=")[-1].strip('"') if "filename=" in disposition else "").name
        if name in ("", ".", "..") or name.startswith("."):  # nothing usable (or hidden): the job's own name
            name = f"{job_id}.gif" if name.endswith(".gif") else f"{job_id}.mp4"
        target = Path(out_dir) / name
        with atomic_path(target, suffix=".partial" + target.suffix) as tmp:
            tmp.write_bytes(r.content)
        return target

    def generate(self, out_dir: str | os.PathLike[str], **fields: Any) -> tuple[dict[str, Any], Path | None]:
        """Submit, wait and download: the finished job and its video (None unless completed)."""
        job = self.wait(self.submit(**fields)["id"])
        return job, self.download(job["id"], out_dir) if job["status"] == "completed" else None
