"""``wan-sharding serve`` for real: a server process on 127.0.0.1, driven over HTTP, its store a real
SQLite file, its faults real (the worker SIGKILLed mid-job, a full queue, a job past its timeout,
the server itself interrupted or killed).

One warm server is shared by the API tests (the tiny pipeline, 2x4, 1 frame of 32x32, 2 steps:
its jobs take well under a second warm); the restart scenario at the end stops it and starts
two more servers on the same store. "Long" jobs are the same small video with a few hundred
steps, so that a job is still running when a test acts on it.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import CPU_COMPILE_FLAGS
from test_workers import _workers_of

from wan_sharding.cli import UsageError, build_parser
from wan_sharding.serve import Client

KEY = "test-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMALL = ["--steps", "2", "--frames", "1", "--height", "32", "--width", "32"]
REQUEST = {"prompt": "a red fox in the snow", "seed": 5}
LONG = {"prompt": "a long job", "num_inference_steps": 300}
CLI = [sys.executable, "-m", "wan_sharding.cli"]
G = "/v1/videos/generations"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)  # the server sets up its worker's environment itself
    env["XLA_FLAGS"] = CPU_COMPILE_FLAGS  # without the suite's device count
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH"))
                                        if p)
    return env


class Server:
    """A ``wan-sharding serve`` process on a free port of 127.0.0.1."""

    def __init__(self, store: Path, *extra: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([*CLI, "serve", "--port", "0", "--store", str(store), "--api-key", KEY,
                                      *SMALL, *extra], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.stderr = ""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        deadline = time.monotonic() + 120
        while not any("listening on" in line for line in self.lines):
            assert self.proc.poll() is None, f"the server exited: {self.stderr[-3000:]}"
            assert time.monotonic() < deadline, "the server did not listen within 120 s"
            time.sleep(0.1)
        self.url = re.search(r"http://[\d.]+:\d+", next(x for x in self.lines if "listening on" in x)).group(0)
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=30)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr += line

    def wait_healthy(self, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = self.http.get("/health")
            except httpx.ConnectError:
                self.proc.wait(timeout=30)
                raise AssertionError(f"the server exited: {self.stderr[-3000:]}") from None
            if r.status_code == 200:
                return r.json()
            assert r.status_code == 503 and r.json()["reason"], r.text
            assert time.monotonic() < deadline, f"not healthy within {timeout} s: {r.text}"
            time.sleep(0.25)

    def post(self, body: dict) -> httpx.Response:
        return self.http.post(G, json=body)

    def job(self, job_id: str) -> dict:
        return self.http.get(f"{G}/{job_id}").json()

    def wait(self, job_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled"), timeout: float = 120,
             progress: int = 0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["status"] in until and job["progress"]["done"] >= progress:
                return job
            assert time.monotonic() < deadline, f"job still {job['status']} after {timeout} s: {job}"
            time.sleep(0.1)

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in _workers_of(self.proc.pid):
            os.kill(pid, signal.SIGKILL)


def _none_left(pid: int) -> bool:
    for _ in range(40):  # a killed process may take a moment to disappear
        if not _workers_of(pid):
            return True
        time.sleep(0.25)
    return False


def _no_partial_files(store: Path) -> None:
    videos = list((store / "videos").iterdir())
    assert not [p.name for p in videos if p.name.startswith(".") or "partial" in p.name]
    for p in videos:  # every video there is whole: a GIF ends with its trailer byte
        data = p.read_bytes()
        assert data[:6] in (b"GIF87a", b"GIF89a") and data[-1:] == b"\x3b", p


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-store")


@pytest.fixture(scope="module")
def server(store):
    s = Server(store, "--queue", "1")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.kill_all()


@pytest.fixture(scope="module")
def reference(server) -> dict:
    """One completed job of REQUEST: its id and its video's bytes."""
    job = server.post(REQUEST).json()
    done = server.wait(job["id"])
    assert done["status"] == "completed", done
    return {"id": job["id"], "video": server.http.get(f"{G}/{job['id']}/download").content}


def test_a_job_completes_and_its_video_downloads(server, store, reference):
    health = server.http.get("/health").json()
    assert health["status"] == "ok" and health["worker"]["warmup_shape"] == [1, 32, 32, 3]
    job = server.job(reference["id"])
    assert job["status"] == "completed" and job["error"] is None
    assert job["progress"] == {"done": 2, "total": 2}
    assert job["request"] == {**REQUEST, "negative_prompt": "", "num_inference_steps": 2, "guidance_scale": 4.0,
                              "num_frames": 1, "height": 32, "width": 32}
    assert len(job["timings"]["step_seconds"]) == 2 and job["timings"]["run_seconds"] > 0
    assert job["video_shape"] == [1, 32, 32, 3]
    assert reference["video"] == (store / "videos" / f"{reference['id']}.gif").read_bytes()
    assert reference["video"][:6] == b"GIF89a"
    listed = server.http.get("/v1/videos/jobs").json()["data"]
    assert reference["id"] in [j["id"] for j in listed]


def test_the_python_client_and_submit_command(server, reference, tmp_path):
    with Client(server.url, api_key=KEY) as client:
        job, path = client.generate(tmp_path / "py", **REQUEST)
    assert job["status"] == "completed" and path.read_bytes() == reference["video"]
    proc = subprocess.run([*CLI, "submit", "--server", server.url, "--api-key", KEY, "--prompt", REQUEST["prompt"],
                           "--seed", "5", "--out", str(tmp_path / "cli")], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = list((tmp_path / "cli").iterdir())
    assert len(written) == 1 and written[0].read_bytes() == reference["video"]
    assert f"completed: {written[0]}" in proc.stdout and "2/2" in proc.stderr  # the progress bar


def test_every_endpoint_but_health_needs_the_key(server, reference):
    bare = httpx.Client(base_url=server.url, timeout=30)
    rid = reference["id"]
    for method, path in [("POST", G), ("GET", f"{G}/{rid}"), ("GET", f"{G}/{rid}/download"),
                         ("POST", f"{G}/{rid}/cancel"), ("GET", "/v1/videos/jobs"), ("GET", "/metrics")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = bare.request(method, path, headers=headers, json=REQUEST if method == "POST" else None)
            assert r.status_code == 401, (method, path, r.text)
            assert "Authorization: Bearer" in r.json()["error"]
    assert bare.get("/health").status_code == 200


@pytest.mark.parametrize("body,line", [
    ({**REQUEST, "num_frames": 6}, "num_frames 6: this pipeline needs 4k+1 frames; use 5 or 9"),
    ({**REQUEST, "height": 40}, "height 40 is not a multiple of 16"),
    ({**REQUEST, "width": 0}, "width 0: must be >= 1"),
    ({**REQUEST, "num_inference_steps": -2}, "num_inference_steps -2: must be >= 1"),
    ({**REQUEST, "seed": "five"}, "seed: Input should be a valid integer; send a whole number"),
    ({"seed": 1}, "prompt: Field required; send it"),
    ({**REQUEST, "output": "/etc/passwd"}, "output: Extra inputs are not permitted; remove it"),
])
def test_bad_fields_get_one_line_422_and_nothing_is_queued(server, reference, body, line):
    before = server.http.get("/v1/videos/jobs").json()["data"]
    r = server.post(body)
    assert r.status_code == 422
    error = r.json()["error"]
    assert line in error and "\n" not in error
    assert server.http.get("/v1/videos/jobs").json()["data"] == before


def test_a_full_queue_gets_429_and_jobs_cancel(server, reference):
    pid = server.http.get("/health").json()["worker_pid"]
    running = server.post(LONG).json()
    server.wait(running["id"], until=("running",), progress=1)
    waiting = server.post(REQUEST)
    assert waiting.status_code == 202 and waiting.json()["status"] == "queued"
    full = server.post(REQUEST)  # --queue 1: one waiting job fills it
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    assert "queue is full" in full.json()["error"]
    assert server.http.post(f"{G}/{waiting.json()['id']}/cancel").json()["status"] == "cancelled"
    server.http.post(f"{G}/{running['id']}/cancel")
    done = server.wait(running["id"], timeout=30)
    assert done["status"] == "cancelled" and done["progress"]["done"] < LONG["num_inference_steps"]
    health = server.wait_healthy()
    assert health["worker_pid"] == pid and health["worker_restarts"] == 0  # stopped at a step; still warm
    assert server.http.get(f"{G}/{running['id']}/download").status_code == 409


def test_worker_killed_mid_job_is_replaced_and_nothing_queued_is_lost(server, store, reference):
    old = server.http.get("/health").json()["worker_pid"]
    doomed = server.post(LONG).json()
    server.wait(doomed["id"], until=("running",), progress=1)
    behind = server.post(REQUEST).json()  # queued behind the job that dies
    os.kill(old, signal.SIGKILL)
    t = time.monotonic()
    failed = server.wait(doomed["id"], until=("failed",), timeout=15)
    assert time.monotonic() - t < 5
    assert "worker process died (killed by SIGKILL)" in failed["error"] and "\n" not in failed["error"]
    health = server.http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "replacing"
    done = server.wait(behind["id"], timeout=240)
    assert done["status"] == "completed"
    after = server.http.get(f"{G}/{behind['id']}/download").content
    assert after == reference["video"]  # the same request, byte-identical, on the new worker
    health = server.wait_healthy()
    assert health["worker_pid"] != old and health["worker_restarts"] == 1
    assert not Path(f"/proc/{old}").exists() or "Z" in Path(f"/proc/{old}/stat").read_text().split()[2]
    _no_partial_files(store)


def test_metrics(server, reference):
    server.wait_healthy()
    jobs = server.http.get("/v1/videos/jobs").json()["data"]
    restarts = server.http.get("/health").json()["worker_restarts"]
    text = server.http.get("/metrics").text
    for status in ("queued", "running", "completed", "failed", "cancelled"):
        n = sum(j["status"] == status for j in jobs)
        assert re.search(rf'^wan_sharding_jobs\{{status="{status}"\}} {n}$', text, re.M), (status, n)
    assert re.search(r"^wan_sharding_queue_depth 0$", text, re.M)
    assert re.search(rf"^wan_sharding_worker_restarts_total {restarts}$", text, re.M)
    assert re.search(r"^wan_sharding_ready 1$", text, re.M)
    count = int(re.search(r"^wan_sharding_job_seconds_count (\d+)$", text, re.M).group(1))
    assert count == sum(j["status"] == "completed" for j in jobs)  # all completed by this server
    assert f'wan_sharding_job_seconds_bucket{{le="+Inf"}} {count}' in text


def test_a_second_server_on_the_same_port_or_store_is_refused(server, store, tmp_path):
    """Refused with a usage error before any worker starts (run in this process: the command's own code)."""
    port = server.url.rsplit(":", 1)[1]
    for argv, line in [(["--port", port, "--store", str(tmp_path)], "cannot listen there"),
                       (["--port", "0", "--store", str(store)], "is in use by another server")]:
        args = build_parser().parse_args(["serve", *argv])
        with pytest.raises(UsageError, match=line):
            args.func(args)
    assert list(tmp_path.iterdir()) == []


def _db_jobs(store: Path) -> dict[str, tuple[str, str | None]]:
    with sqlite3.connect(store / "jobs.sqlite3") as db:
        return {i: (s, e) for i, s, e in db.execute("SELECT id, status, error FROM jobs")}


def test_ctrl_c_restart_on_the_same_store_and_a_killed_server(server, store, reference):
    # Ctrl-C on a server with a job running and one queued.
    running = server.post(LONG).json()
    server.wait(running["id"], until=("running",), progress=1)
    queued = server.post(REQUEST).json()
    listed = {j["id"]: j["status"] for j in server.http.get("/v1/videos/jobs").json()["data"]}
    assert server.stop(signal.SIGINT) == 130, server.stderr[-2000:]
    assert "interrupted" in server.stderr
    assert _none_left(server.proc.pid)
    jobs = _db_jobs(store)
    assert jobs[running["id"]] == ("failed", "the server was stopped (SIGINT) while this job ran; submit it again")
    assert jobs[queued["id"]][0] == "queued"
    _no_partial_files(store)

    # A second server on the store lists every job and serves every finished video, even while warming.
    second = Server(store, "--job-timeout", "6", "--stall-timeout", "5")
    try:
        now = {j["id"]: j["status"] for j in second.http.get("/v1/videos/jobs").json()["data"]}
        assert set(now) == set(listed) and now[running["id"]] == "failed"
        assert second.http.get(f"{G}/{reference['id']}/download").content == reference["video"]
        assert second.wait(queued["id"], timeout=240)["status"] == "completed"  # queued before the restart
        assert second.http.get(f"{G}/{queued['id']}/download").content == reference["video"]

        # A job past --job-timeout fails at the limit; the worker stops it and serves on, warm.
        pid = second.wait_healthy()["worker_pid"]
        slow = second.post({**LONG, "num_inference_steps": 5000}).json()
        failed = second.wait(slow["id"], until=("failed",), timeout=60)
        assert failed["error"] == "ran past --job-timeout 6 s and was stopped"
        assert 6 <= failed["timings"]["run_seconds"] < 15
        again = second.post(REQUEST).json()
        assert second.wait(again["id"], timeout=30)["status"] == "completed"
        health = second.wait_healthy()
        assert health["worker_pid"] == pid and health["worker_restarts"] == 0

        # A worker that stops reporting progress (SIGSTOP: no step ends, no CPU used) is hung: replaced.
        hung = second.post(LONG).json()
        second.wait(hung["id"], until=("running",), progress=1)
        os.kill(pid, signal.SIGSTOP)
        failed = second.wait(hung["id"], until=("failed",), timeout=30)
        assert failed["error"] == "the worker stopped reporting progress for 5 s (hung); it was replaced"
        health = second.wait_healthy()
        assert health["worker_pid"] != pid and health["worker_restarts"] == 1

        # SIGKILL of the server itself with a job running: its worker dies with it, the job stays "running".
        dying = second.post({**LONG, "num_inference_steps": 5000}).json()
        second.wait(dying["id"], until=("running",), progress=1)
        os.kill(second.proc.pid, signal.SIGKILL)
        second.proc.wait(timeout=30)
        assert _none_left(second.proc.pid)
        assert _db_jobs(store)[dying["id"]][0] == "running"
    finally:
        second.kill_all()

    # The next server on that store marks that job failed, and a SIGTERM while it warms leaves nothing.
    third = Server(store)
    try:
        job = third.job(dying["id"])
        assert job["status"] == "failed" and "server stopped while this job ran" in job["error"]
        assert third.http.get("/health").status_code == 503  # still warming
        assert third.post(REQUEST).status_code == 503  # no work accepted before the warm-up
        assert third.stop(signal.SIGTERM) == 130
        assert _none_left(third.proc.pid)
    finally:
        third.kill_all()
    _no_partial_files(store)
    assert set(_db_jobs(store)) >= set(listed) | {slow["id"], dying["id"]}
