"""One sub-mesh's resident worker (:mod:`wan_sharding.serve.worker`) and the thread that feeds it.

A :class:`Replica` starts its worker process, waits for its warm-up, takes queued jobs from the
:class:`~wan_sharding.serve.supervisor.Supervisor` one at a time, follows their progress, and replaces
the worker when it dies, hangs (no step finished and no CPU time used by its process tree for
``stall_s`` seconds: the rule of the one-shot runner's watchdog, ``wan_sharding.runtime.workers``) or does not
stop within ``CANCEL_GRACE_S`` of a cancel or of the job timeout.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from ..runtime.processes import process_state, tree_cpu_ticks
from ..runtime.workers import RESULT_PREFIX, start_resident_worker, stop_worker
from .store import StoreError

__all__ = ["CANCEL_GRACE_S", "HUNG", "MAX_FAILED_STARTS", "Replica", "WorkerSpec"]

WORKER = "wan_sharding.serve.worker"
CANCEL_GRACE_S = 30.0  # a worker that does not stop within this after SIGUSR1 is replaced
MAX_FAILED_STARTS = 3  # consecutive failed replacements before a worker is given up
HUNG = "(hung)"


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker is started with: its sub-mesh's name and devices (for /health), its
    environment and its configuration (the first stdin line)."""

    mesh: str
    devices: str
    env: dict[str, str]
    config: dict[str, Any]


class _Worker:
    """One resident worker process: its events (``RESULT`` lines) on a queue, ``None`` at its end."""

    def __init__(self, env: dict[str, str], config: dict[str, Any], log: IO[str], prefix: str,
                 on_end: Any = lambda: None) -> None:
        self.proc: subprocess.Popen = start_resident_worker(WORKER, env, label="serve worker", stderr=log)
        self.on_end = on_end  # called once its stdout closed (it died): its replica's thread is woken
        self.events: queue.Queue = queue.Queue()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        threading.Thread(target=self._read, args=(log, prefix), daemon=True).start()

    def _read(self, log: IO[str], prefix: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                self.events.put(json.loads(line[len(RESULT_PREFIX):]))
            else:
                with contextlib.suppress(ValueError):  # the log is closed once the server stopped
                    log.write(prefix + line)
                    log.flush()
        self.events.put(None)
        self.on_end()

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died: its stdout closes, and that is handled
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()

    def stop(self) -> str:
        """Kill it (and its group); how it ended."""
        stop_worker(self.proc)
        return _signal_name(self.proc.returncode)


class Replica:
    """One sub-mesh's resident worker, on its own thread: started and warmed up, fed queued jobs
    one at a time, replaced when it fails. ``state``: ``warming`` (first start), ``ready``,
    ``replacing``, ``broken`` (given up), ``stopped``; ``reason`` says why when not ready."""

    def __init__(self, sup: Any, index: int, spec: WorkerSpec) -> None:
        # sup: the Supervisor, which hands out the jobs (take, wait), holds the store, the log and
        # the limits, and is told when this worker is given up (replica_broken).
        self.sup, self.index, self.spec = sup, index, spec
        self.name = "worker" if len(sup.specs) == 1 else f"worker {index}"
        self.state, self.reason = "warming", "the worker is loading, sharding and warming up the pipeline"
        self.ever_ready = False
        self.broken: str | None = None
        self.restarts = 0
        self.completed = 0
        self.ready_info: dict[str, Any] = {}
        self.prompt_cache: dict[str, Any] | None = None  # the worker's prompt embeddings, as it last reported them
        self.vae: dict[str, Any] | None = None  # where its VAE runs and its calls on the mesh, as last reported
        self.tokenizer: str | None = None  # the pipeline's tokenizer (tokenizers JSON), for the prompt token limit
        self.running: str | None = None
        self.idle = False  # ready and waiting for a job (the dispatch reads it under its lock)
        self._worker: _Worker | None = None
        self._cancel: set[str] = set()
        self._timed_out: set[str] = set()
        self.thread = threading.Thread(target=self._loop, name=f"serve-worker-{index}", daemon=True)

    @property
    def pid(self) -> int | None:
        w = self._worker
        return None if w is None or w.proc.poll() is not None else w.proc.pid

    @property
    def status(self) -> tuple[str, str]:
        """``(state, reason)`` as ``/health`` reports them: a ``ready`` worker whose process has died
        is ``replacing`` from that moment, not from its thread's next turn (which replaces it)."""
        w = self._worker
        if self.state == "ready" and w is not None and w.proc.poll() is not None:
            return "replacing", f"the worker process died ({_signal_name(w.proc.returncode)}); it is being replaced"
        return self.state, self.reason

    def stopped(self) -> str | None:
        """Why this warm worker cannot run a job now although its process lives: stopped by a signal
        (SIGSTOP, Ctrl-Z) or a debugger; None otherwise."""
        w = self._worker
        if self.state != "ready" or w is None or process_state(w.proc.pid) not in ("T", "t"):
            return None
        return (f"{self.name}'s process (pid {w.proc.pid}) is stopped (SIGSTOP or a debugger); its jobs wait until it "
                f"continues (SIGCONT), one it runs longer than --stall-timeout replaces it")

    def describe(self) -> dict[str, Any]:
        """This worker as ``/health`` lists it."""
        state, reason = self.status
        return {"index": self.index, "mesh": self.spec.mesh, "devices": self.spec.devices, "state": state,
                "reason": reason or None, "pid": self.pid, "running": self.running, "restarts": self.restarts,
                "completed": self.completed, **{k: self.ready_info[k] for k in ("ready_seconds", "warmup_seconds")
                                                if k in self.ready_info}}

    def cancel(self, job_id: str) -> None:
        self._cancel.add(job_id)

    def kill(self) -> None:
        if self._worker is not None:
            self._worker.stop()

    def _say(self, line: str) -> None:
        self.sup.say(f"wan-sharding serve: {line}")

    # ---- the worker's thread -------------------------------------------------------------------

    def _loop(self) -> None:
        """Serve until the server stops. Nothing ends this thread but that (or the worker given up):
        an error of the store, or any other, is logged and the loop goes on (what it could not
        record is retried: :meth:`Supervisor.end_job`)."""
        failed_starts = [0]  # in a row; a first start is retried only when the worker hung
        while not self.sup.stopping.is_set():
            try:
                self.sup.retry_pending()
                if not self._serve_one(failed_starts):
                    return
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one failure
                self.sup.log_error(f"{self.name}: {type(e).__name__}: {e}", e)
                self.sup.wait(1.0)

    def _serve_one(self, failed_starts: list[int]) -> bool:
        """One turn of the loop: start (or replace) the worker, or run one job, or wait; False once
        this replica is given up or the server stops while it starts."""
        if self._worker is None:
            self.idle = False
            error = self._start_worker()
            if error is None:
                failed_starts[0] = 0
                return True
            failed_starts[0] += 1
            if self.sup.stopping.is_set():
                return False
            hung = error.endswith(HUNG)  # a start-up deadlock (docs/serving.md): a fresh process runs normally
            if failed_starts[0] >= MAX_FAILED_STARTS or not (self.ever_ready or hung):
                self.broken = f"the worker could not be started: {error}; its log: worker.log in the store"
                self.state, self.reason = "broken", self.broken
                self.sup.replica_broken(self)
                return False
            self._say(f"{self.name} did not start: {error}; starting a fresh one")
            return True
        if self._worker.proc.poll() is not None:  # died while idle: replaced before it gets a job
            self.idle = False
            how = self._worker.stop()
            self._worker = None
            self.restarts += 1
            self.state, self.reason = "replacing", f"the worker process died while idle ({how}); it is being replaced"
            self._say(f"{self.name} died while idle ({how}); replacing it")
            return True
        self.idle = True
        try:
            job_id = self.sup.take(self)
        except StoreError:  # the job stays queued; taken once the store can be written again
            job_id = None
        if job_id is None:
            self.sup.wait(1.0)
            return True
        self._run(job_id)
        return True

    def _start_worker(self) -> str | None:
        """Start a worker and wait for its warm-up; ``None`` when ready, else the error."""
        if self.ever_ready:
            self.state = "replacing"
        t = time.monotonic()
        prefix = "" if len(self.sup.specs) == 1 else f"[worker {self.index}] "
        worker = self._worker = _Worker(self.spec.env, self.spec.config, self.sup.log, prefix, self.sup.notify)
        error = self._wait_ready(worker)
        if error is not None:
            worker.stop()
            self._worker = None
            return error
        self.ready_info = {**self.ready_info, "ready_seconds": round(time.monotonic() - t, 3)}
        self.state, self.reason = "ready", ""
        self.ever_ready = True
        self._say(f"{self.name} ready (pid {worker.proc.pid}) in {time.monotonic() - t:.1f} s: "
                  f"warm-up {self.ready_info.get('warmup_seconds', 0):.1f} s, frames finite")
        return None

    def _wait_ready(self, worker: _Worker) -> str | None:
        ticks, moved = tree_cpu_ticks(worker.proc.pid), time.monotonic()
        stall_s = self.sup.stall_s
        while not self.sup.stopping.is_set():
            try:
                ev = worker.events.get(timeout=0.5)
            except queue.Empty:
                now_ticks = tree_cpu_ticks(worker.proc.pid)
                if now_ticks != ticks:
                    ticks, moved = now_ticks, time.monotonic()
                elif stall_s is not None and time.monotonic() - moved > stall_s:
                    return f"the worker made no progress for {stall_s:.0f} s while warming up {HUNG}"
                continue
            if ev is None:
                worker.proc.wait()
                return f"the worker ended while warming up ({_signal_name(worker.proc.returncode)})"
            if ev.get("event") == "failed_start":
                return ev["error"]
            if ev.get("event") == "ready":
                self.ready_info = {k: v for k, v in ev.items() if k not in ("event", "tokenizer")}
                self.tokenizer = ev.get("tokenizer") or self.tokenizer
                self.prompt_cache = ev.get("prompt_cache")
                self.vae = ev.get("vae")
                return None
        return "the server is stopping"

    def _run(self, job_id: str) -> None:
        worker = self._worker
        store = self.sup.store
        assert worker is not None
        self.running = job_id
        try:
            job = store.get(job_id)
            images = {str(pos): base64.b64encode(data).decode() for pos, data in store.images(job_id).items()}
        except Exception as e:  # noqa: BLE001 - the store could not be read: this job fails, the rest go on
            self.running = None
            self.sup.log_error(f"job {job_id}: reading it from the store: {type(e).__name__}: {e}", e)
            self.sup.end_job(job_id, "failed", ("storage_error", "the job could not be read from the job store; "
                                                                 "submit it again"))
            return
        assert job is not None
        started = last_sign = time.monotonic()
        ticks = tree_cpu_ticks(worker.proc.pid)
        cancel_sent: float | None = None
        worker.send({"id": job_id, "request": job["request_parameters"], "images": images,
                     "stem": str(store.videos / job_id)})
        stall_s, job_timeout = self.sup.stall_s, self.sup.job_timeout
        try:
            while not self.sup.stopping.is_set():
                try:
                    ev = worker.events.get(timeout=0.5)
                except queue.Empty:
                    ev = "tick"
                now = time.monotonic()
                if ev is None:
                    if self.sup.stopping.is_set():
                        return
                    worker.proc.wait()
                    how = _signal_name(worker.proc.returncode)
                    return self._replace(job_id, ("worker_died", f"the worker process died ({how}) while running "
                                                                 "this job; it was replaced, submit the job again"))
                if isinstance(ev, dict):
                    last_sign = now
                    if self._finished(job_id, ev):
                        return
                now_ticks = tree_cpu_ticks(worker.proc.pid)
                if now_ticks != ticks:
                    ticks, last_sign = now_ticks, now
                if stall_s is not None and now - last_sign > stall_s:
                    return self._replace(job_id, ("worker_hung", f"the worker stopped reporting progress for "
                                                                 f"{stall_s:g} s (hung); it was replaced"))
                if now - started > job_timeout and job_id not in self._timed_out | self._cancel:
                    # Failed at the limit; the worker is asked to stop at its step's end and stays warm
                    # (replaced only if it does not stop within CANCEL_GRACE_S).
                    self._timed_out.add(job_id)
                    error = f"ran past --job-timeout {job_timeout:g} s and was stopped"
                    self.sup.end_job(job_id, "failed", ("timeout", error))
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
        """Record one worker event for the running job; True when the job ended. A store that cannot
        be written fails the job (``storage_error``), never this thread."""
        store = self.sup.store
        kind = ev.get("event")
        if kind == "progress":
            with contextlib.suppress(StoreError):  # the next step's progress supersedes it
                store.progress(job_id, ev["done"], ev["total"])
            return False
        if kind == "completed":
            self.prompt_cache = ev.get("prompt_cache", self.prompt_cache)
            self.vae = ev.get("vae", self.vae)
            with contextlib.suppress(StoreError):
                store.progress(job_id, len(ev["step_seconds"]), len(ev["step_seconds"]))
            try:
                recorded = store.complete(job_id, ev["video"], ev)
            except StoreError as e:
                (store.videos / ev["video"]).unlink(missing_ok=True)
                self.sup.storage_failed(str(e))
                self.sup.end_job(job_id, "failed", ("storage_error", f"the video was made but the job store could "
                                                                     f"not record it ({e}); submit the job again"))
                return True
            if recorded:
                self.completed += 1
                self.sup.job_seconds.append(ev["seconds"])
                self.sup.storage_ok()
                on = "" if len(self.sup.specs) == 1 else f" on worker {self.index}"
                self._say(f"job {job_id} completed in {ev['seconds']:.2f} s{on}")
            else:  # cancelled as it finished (or failed at its timeout already): its video is not served
                self.sup.end_job(job_id, "cancelled")  # no-op unless it was cancelling
                (store.videos / ev["video"]).unlink(missing_ok=True)
        elif kind == "cancelled":  # by a user, or at the job timeout (then already failed)
            self.sup.end_job(job_id, "cancelled")
        else:
            error = ev.get("error", "the worker reported a failure")
            if ev.get("storage"):  # the worker could not write the video
                self.sup.storage_failed(error)
            self.sup.end_job(job_id, "failed", ("storage_error" if ev.get("storage") else "processing_error", error))
        return True

    def _replace(self, job_id: str, error: tuple[str, str] | None) -> None:
        """Kill the worker; the job ends ``failed`` with ``error`` (``(code, message)``), or
        ``cancelled`` when it was being cancelled (or ``error`` is None); the loop starts a new
        worker before this replica's next job."""
        if self._worker is not None:
            self._worker.stop()
        self._worker = None
        self.restarts += 1
        self.state, self.reason = "replacing", "the worker is being replaced and warmed up again"
        with contextlib.suppress(OSError):
            self.sup.store.remove_partial_files()
        if error is None or job_id in self._cancel:
            self.sup.end_job(job_id, "cancelled")
        else:
            self.sup.end_job(job_id, "failed", error)
