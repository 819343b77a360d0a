"""The queue and the resident worker: one job at a time on the mesh, and recovery when the worker fails.

The queue is the store itself (``queued`` rows, oldest first), so what was accepted survives a
worker replacement and a server restart. One thread (:class:`Supervisor`) starts the worker
(:mod:`wan_sharding.serve.worker`), waits for its warm-up, then feeds it one queued job at a time
and follows its progress. A job is ``failed`` with a one-line error, and the worker replaced (a
new process, built, sharded and warmed up again) while the queue waits, when:

- the worker dies (killed, crashed): its stdout closes;
- the worker stops reporting progress: no step finished and no CPU time used for ``stall_s``
  seconds (the same rule as the one-shot runner's watchdog, ``wan_sharding.workers``).

A job past ``job_timeout`` seconds is ``failed`` at the limit and the worker is asked to stop it;
cancelling a running job asks the same: a SIGUSR1, on which the worker stops at the end of the
current step and stays warm. A worker that has not stopped within ``CANCEL_GRACE_S`` is replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable

from ..workers import RESULT_PREFIX, cpu_ticks, start_resident_worker, stop_worker
from .store import Store

WORKER = "wan_sharding.serve.worker"
CANCEL_GRACE_S = 30.0  # a worker that does not stop within this after SIGUSR1 is replaced
MAX_FAILED_STARTS = 3  # consecutive failed replacements before the server reports itself broken
HUNG = "(hung)"
HISTOGRAM_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class _Worker:
    """One resident worker process: its events (``RESULT`` lines) on a queue, ``None`` at its end."""

    def __init__(self, env: dict[str, str], config: dict[str, Any], log: IO[str]) -> None:
        self.proc: subprocess.Popen = start_resident_worker(WORKER, env, label="serve worker", stderr=log)
        self.events: queue.Queue = queue.Queue()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        threading.Thread(target=self._read, args=(log,), daemon=True).start()

    def _read(self, log: IO[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                self.events.put(json.loads(line[len(RESULT_PREFIX):]))
            else:
                with contextlib.suppress(ValueError):  # the log is closed once the server stopped
                    log.write(line)
                    log.flush()
        self.events.put(None)

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> str:
        """Kill it (and its group); how it ended."""
        stop_worker(self.proc)
        return _signal_name(self.proc.returncode)


class Supervisor:
    """Runs queued jobs on one resident worker and replaces the worker when it fails.

    ``state``: ``warming`` (first start), ``ready``, ``replacing``, ``broken`` (it could not be
    started), ``stopped``; ``reason`` says why when not ready.
    """

    def __init__(self, store: Store, config: dict[str, Any], env: dict[str, str], *, queue_size: int,
                 job_timeout: float, stall_s: float | None, say: Callable[[str], None] = print) -> None:
        self.store, self.config, self.env = store, config, env
        self.queue_size, self.job_timeout, self.stall_s = queue_size, job_timeout, stall_s
        self.say = say
        self.state, self.reason = "warming", "the worker is loading, sharding and warming up the pipeline"
        self.ever_ready = False
        self.broken: str | None = None  # why the worker could not be started, once given up
        self.restarts = 0
        self.ready_info: dict[str, Any] = {}
        self.running: str | None = None
        self.job_seconds: list[float] = []
        self.on_broken: Callable[[str], None] = lambda reason: None
        self._worker: _Worker | None = None
        self._cancel: set[str] = set()
        self._timed_out: set[str] = set()
        self._wake = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="serve-supervisor", daemon=True)
        self._log = open(Path(store.root) / "worker.log", "a")

    # ---- called from the API -------------------------------------------------------------------

    @property
    def worker_pid(self) -> int | None:
        w = self._worker
        return None if w is None or w.proc.poll() is not None else w.proc.pid

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Queue a job; ``None`` when the queue is full."""
        job = self.store.create(request, queued_limit=self.queue_size)
        if job is not None:
            self._notify()
        return job

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Cancel a queued job at once, a running one at the end of its current step."""
        job = self.store.get(job_id)
        if job is None:
            return None
        if job["status"] == "queued":
            self.store.finish(job_id, "cancelled")
        elif job["status"] == "running":
            self._cancel.add(job_id)
            self._notify()
        return self.store.get(job_id)

    def queue_depth(self) -> int:
        return self.store.counts()["queued"]

    def stop(self, why: str) -> None:
        """Stop: the worker is killed, the running job ``failed`` with ``why``, queued jobs stay
        queued (a server started on the same store runs them)."""
        self._stopping.set()
        self._notify()
        running = self.running
        if self._worker is not None:
            self._worker.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if running is not None:
            self.store.finish(running, "failed", error=f"{why} while this job ran; submit it again")
        self.store.remove_partial_files()
        if self.broken is None:
            self.state, self.reason = "stopped", why
        self._log.close()

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # ---- the supervisor thread -----------------------------------------------------------------

    def _loop(self) -> None:
        failed_starts = 0  # in a row; a first start is retried only when the worker hung
        while not self._stopping.is_set():
            if self._worker is None:
                error = self._start_worker()
                if error is None:
                    failed_starts = 0
                    continue
                failed_starts += 1
                if self._stopping.is_set():
                    return
                hung = error.endswith(HUNG)  # the jaxlib start-up deadlock: a fresh process runs normally
                if failed_starts >= MAX_FAILED_STARTS or not (self.ever_ready or hung):
                    self.broken = f"the worker could not be started: {error}; its log: {self._log.name}"
                    self.state, self.reason = "broken", self.broken
                    self.on_broken(self.reason)
                    return
                continue
            queued = self.store.queued_ids()
            if not queued:
                with self._wake:
                    self._wake.wait(timeout=1.0)
                continue
            if self.store.start(queued[0]):
                self._run(queued[0])

    def _start_worker(self) -> str | None:
        """Start a worker and wait for its warm-up; ``None`` when ready, else the error."""
        if self.ever_ready:
            self.state = "replacing"
        t = time.monotonic()
        worker = self._worker = _Worker(self.env, self.config, self._log)
        error = self._wait_ready(worker)
        if error is not None:
            worker.stop()
            self._worker = None
            return error
        self.ready_info = {**self.ready_info, "ready_seconds": round(time.monotonic() - t, 3)}
        self.state, self.reason = "ready", ""
        self.ever_ready = True
        self.say(f"wan-sharding serve: worker ready (pid {worker.proc.pid}) in {time.monotonic() - t:.1f} s: "
                 f"warm-up {self.ready_info.get('warmup_seconds', 0):.1f} s, frames finite")
        return None

    def _wait_ready(self, worker: _Worker) -> str | None:
        ticks, moved = cpu_ticks(worker.proc.pid), time.monotonic()
        while not self._stopping.is_set():
            try:
                ev = worker.events.get(timeout=0.5)
            except queue.Empty:
                now_ticks = cpu_ticks(worker.proc.pid)
                if now_ticks != ticks:
                    ticks, moved = now_ticks, time.monotonic()
                elif self.stall_s is not None and time.monotonic() - moved > self.stall_s:
                    return f"the worker made no progress for {self.stall_s:.0f} s while warming up {HUNG}"
                continue
            if ev is None:
                worker.proc.wait()
                return f"the worker ended while warming up ({_signal_name(worker.proc.returncode)})"
            if ev.get("event") == "failed_start":
                return ev["error"]
            if ev.get("event") == "ready":
                self.ready_info = {k: v for k, v in ev.items() if k != "event"}
                return None
        return "the server is stopping"

    def _run(self, job_id: str) -> None:
        worker = self._worker
        assert worker is not None
        self.running = job_id
        job = self.store.get(job_id)
        assert job is not None
        started = last_sign = time.monotonic()
        ticks = cpu_ticks(worker.proc.pid)
        cancel_sent: float | None = None
        worker.send({"id": job_id, "request": job["request"], "stem": str(self.store.videos / job_id)})
        try:
            while not self._stopping.is_set():
                try:
                    ev = worker.events.get(timeout=0.5)
                except queue.Empty:
                    ev = "tick"
                now = time.monotonic()
                if ev is None:
                    if self._stopping.is_set():
                        return
                    worker.proc.wait()
                    how = _signal_name(worker.proc.returncode)
                    return self._replace(job_id, f"the worker process died ({how}) while running this job; "
                                                 "it was replaced, submit the job again")
                if isinstance(ev, dict):
                    last_sign = now
                    if self._finished(job_id, ev):
                        return
                now_ticks = cpu_ticks(worker.proc.pid)
                if now_ticks != ticks:
                    ticks, last_sign = now_ticks, now
                if self.stall_s is not None and now - last_sign > self.stall_s:
                    return self._replace(job_id, f"the worker stopped reporting progress for {self.stall_s:g} s "
                                                 "(hung); it was replaced")
                if now - started > self.job_timeout and job_id not in self._timed_out:
                    # Failed at the limit; the worker is asked to stop at its step's end and stays warm
                    # (replaced only if it does not stop within CANCEL_GRACE_S).
                    self._timed_out.add(job_id)
                    error = f"ran past --job-timeout {self.job_timeout:g} s and was stopped"
                    self.store.finish(job_id, "failed", error=error)
                    self.say(f"wan-sharding serve: job {job_id} failed: {error}")
                if (job_id in self._cancel or job_id in self._timed_out) and cancel_sent is None:
                    cancel_sent = now
                    os.kill(worker.proc.pid, signal.SIGUSR1)
                elif cancel_sent is not None and now - cancel_sent > CANCEL_GRACE_S:
                    return self._replace(job_id, None)
        finally:
            self._cancel.discard(job_id)
            self._timed_out.discard(job_id)
            self.running = None

    def _finished(self, job_id: str, ev: dict[str, Any]) -> bool:
        """Record one worker event for the running job; True when the job ended."""
        kind = ev.get("event")
        if kind == "progress":
            self.store.progress(job_id, ev["done"], ev["total"])
            return False
        if kind == "completed":
            self.store.progress(job_id, len(ev["step_seconds"]), len(ev["step_seconds"]))
            if self.store.finish(job_id, "completed", video=ev["video"], result=ev):
                self.job_seconds.append(ev["seconds"])
                self.say(f"wan-sharding serve: job {job_id} completed in {ev['seconds']:.2f} s")
            else:  # it finished as its timeout hit: failed already; its video is not served
                (self.store.videos / ev["video"]).unlink(missing_ok=True)
        elif kind == "cancelled":  # by a user, or at the job timeout (then already failed)
            self.store.finish(job_id, "cancelled")
        else:
            self.store.finish(job_id, "failed", error=ev.get("error", "the worker reported a failure"))
            self.say(f"wan-sharding serve: job {job_id} failed: {ev.get('error')}")
        return True

    def _replace(self, job_id: str, error: str | None) -> None:
        """Kill the worker; the job ends ``failed`` with ``error`` (``cancelled`` when None); the
        loop starts a new worker before the next job."""
        worker = self._worker
        if worker is not None:
            worker.stop()
        self._worker = None
        self.restarts += 1
        self.state, self.reason = "replacing", "the worker is being replaced and warmed up again"
        self.store.remove_partial_files()
        if error is None:
            self.store.finish(job_id, "cancelled")
        else:
            self.store.finish(job_id, "failed", error=error)
            self.say(f"wan-sharding serve: job {job_id} failed: {error}")
