"""The queue and the resident workers: one job at a time per worker, and recovery when one fails.
Each worker and its thread are a :class:`~wan_sharding.serve.resident.Replica`; this module hands
out the jobs and reports the whole.

The queue is the store itself (``queued`` rows, oldest first), so what was accepted survives a
worker replacement and a server restart. Each :class:`Replica` (one per sub-mesh, ``serve
--replicas N``; one by default) has a thread that starts its worker
(:mod:`wan_sharding.serve.worker`), waits for its warm-up, then takes queued jobs one at a time and
follows their progress; a queued job goes to the first free worker in order. A job is ``failed``
with a one-line error (and a code), and its worker replaced (a new process, built, sharded and
warmed up again) while the other workers keep serving, when:

- the worker dies (killed, crashed): its stdout closes;
- the worker stops reporting progress: no step finished and no CPU time used by its process tree
  for ``stall_s`` seconds (the same rule as the one-shot runner's watchdog, ``wan_sharding.runtime.workers``).

A job past ``job_timeout`` seconds is ``failed`` at the limit and its worker is asked to stop it;
cancelling a running job (``cancelling`` until then) asks the same: a SIGUSR1, on which the worker
stops at the end of the current step and stays warm. A worker that has not stopped within
``CANCEL_GRACE_S`` is replaced.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from .resident import Replica, WorkerSpec
from .store import Store, StoreError, public_message

HISTOGRAM_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
STORAGE_FAILURES = 3  # jobs in a row failed for a storage reason: /health is degraded until one completes
PRUNE_EVERY_S = 60.0  # how often finished jobs past the retention rule are removed


class Supervisor:
    """Runs queued jobs on resident workers (one per :class:`WorkerSpec`) and replaces a worker
    when it fails. ``state``: ``ready`` while any worker serves, else that of the workers
    (``warming``, ``replacing``, ``broken`` once every worker was given up, ``stopped``)."""

    def __init__(self, store: Store, specs: list[WorkerSpec], *, model: str, queue_size: int, job_timeout: float,
                 stall_s: float | None, say: Callable[[str], None] = print, keep_seconds: float | None = None,
                 keep_jobs: int | None = None) -> None:
        self.store, self.specs, self.model = store, specs, model
        self.queue_size, self.job_timeout, self.stall_s = queue_size, job_timeout, stall_s
        self.say = say
        self.broken: str | None = None  # why no worker could be started, once every one was given up
        self.job_seconds: list[float] = []
        self.on_broken: Callable[[str], None] = lambda reason: None
        self.stopping = threading.Event()
        self.log = open(Path(store.root) / "worker.log", "a")
        self._wake = threading.Condition()
        self._dispatch = threading.Lock()
        self._stopped_why: str | None = None
        self.keep_seconds, self.keep_jobs = keep_seconds, keep_jobs  # the retention rule (None: keep)
        self._pruned = 0.0
        self._pending: dict[str, tuple[str, tuple[str, str] | None]] = {}  # job ends not yet recorded
        self._pending_lock = threading.Lock()
        self._tokenizer: Any = None
        self.storage_failures: list[str] = []  # jobs failed for a storage reason since the last completed one
        self.replicas = [Replica(self, i, spec) for i, spec in enumerate(specs)]
        # jobs accepted per adapter (serve --lora NAME=PATH), for /metrics
        self.adapter_jobs = {a["adapter"]: 0 for a in specs[0].config.get("lora") or []} if specs else {}

    # ---- what the API reads --------------------------------------------------------------------

    @property
    def state(self) -> str:
        states = [r.status[0] for r in self.replicas]
        if "ready" in states:
            return "ready"
        if self._stopped_why is not None and self.broken is None:
            return "stopped"
        for s in ("replacing", "warming"):
            if s in states:
                return s
        return "broken" if self.broken else "stopped"

    @property
    def reason(self) -> str:
        if self.state == "ready":
            return ""
        if self.state == "stopped":
            return self._stopped_why or "the server stopped"
        state = self.state
        r = next(r for r in self.replicas if r.status[0] == state or state == "broken")
        return r.status[1] if len(self.replicas) == 1 else f"{r.name}: {r.status[1]}"

    @property
    def ever_ready(self) -> bool:
        return any(r.ever_ready for r in self.replicas)

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)

    def _first_ready(self) -> Replica:
        return next((r for r in self.replicas if r.status[0] == "ready"), self.replicas[0])

    @property
    def worker_pid(self) -> int | None:
        return self._first_ready().pid

    @property
    def ready_info(self) -> dict[str, Any]:
        return self._first_ready().ready_info

    @property
    def running(self) -> str | None:
        return next((r.running for r in self.replicas if r.running), None)

    def queue_depth(self) -> int:
        return self.store.counts()["queued"]

    def count_tokens(self) -> Callable[[str], int] | None:
        """A prompt's token count by the served pipeline's tokenizer (as a worker sent it at its
        warm-up), or None before any worker is warm (no job is accepted then)."""
        if self._tokenizer is None:
            text = next((r.tokenizer for r in self.replicas if r.tokenizer), None)
            if text is None:
                return None
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(text)
            self._tokenizer.no_truncation()  # as the pipeline last called it: cut and padded to its length
            self._tokenizer.no_padding()
        return lambda prompt: len(self._tokenizer.encode(prompt).ids)

    def degraded(self) -> str | None:
        """Why the server serves badly although a worker is warm, or None: a worker's thread ended,
        a warm worker's process is stopped, the store (database or videos folder) cannot be written,
        job ends wait to be recorded, or the last :data:`STORAGE_FAILURES` jobs failed for a storage
        reason (until a job completes: only a real job shows that their cause went)."""
        gone = [r for r in self.replicas if not r.thread.is_alive() and r.thread.ident is not None and not r.broken]
        if gone and not self.stopping.is_set():
            return f"{gone[0].name}'s thread ended; restart the server"
        stopped = next((why for r in self.replicas if (why := r.stopped())), None)
        if stopped:
            return stopped
        why = self.store.probe()
        if why:
            return why
        with self._pending_lock:
            pending = len(self._pending)
        if pending:
            return f"the end of {pending} job(s) could not be recorded in the job store yet"
        if len(self.storage_failures) >= STORAGE_FAILURES:
            return f"the last {len(self.storage_failures)} jobs failed for a storage reason: {self.storage_failures[-1]}"
        return None

    # ---- called from the API -------------------------------------------------------------------

    def start(self) -> None:
        for r in self.replicas:
            r.thread.start()

    def submit(self, request: dict[str, Any], images: dict[int, bytes] | None = None) -> dict[str, Any] | None:
        """Queue a job (and its images); ``None`` when the queue is full."""
        self.prune()
        job = self.store.create(request, self.model, images, queued_limit=self.queue_size)
        if job is not None:
            with self._wake:
                for choice in request.get("loras") or ():
                    self.adapter_jobs[choice["name"]] = self.adapter_jobs.get(choice["name"], 0) + 1
            self.notify()
        return job

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Cancel a queued job at once, an ``in_progress`` one at the end of its current step (it
        is ``cancelling`` until then); ``None`` for an unknown job. A finished job is returned as
        it is."""
        job = self.store.get(job_id)
        if job is None:
            return None
        if job["status"] == "queued":
            self.store.finish(job_id, "cancelled")
        elif job["status"] == "in_progress":
            for r in self.replicas:
                if r.running == job_id:
                    r.cancel(job_id)
            self.store.cancelling(job_id)
            self.notify()
        return self.store.get(job_id)

    def stop(self, why: str) -> None:
        """Stop: every worker is killed, the running jobs ``failed`` with ``why``, queued jobs stay
        queued (a server started on the same store runs them)."""
        self._stopped_why = why
        self.stopping.set()
        self.notify()
        running = [r.running for r in self.replicas if r.running is not None]
        for r in self.replicas:
            r.kill()
        for r in self.replicas:
            if r.thread.is_alive():
                r.thread.join(timeout=30)
        for job_id in running:
            self.end_job(job_id, "failed", ("server_stopped", f"{why} while this job ran; submit it again"))
        self.retry_pending()
        with contextlib.suppress(OSError):
            self.store.remove_partial_files()
        for r in self.replicas:
            if r.broken is None:
                r.state, r.reason = "stopped", why
        self.log.close()

    def prune(self, force: bool = False) -> int:
        """Remove the finished jobs past the retention rule (``--keep-days``, ``--keep-jobs``) and
        their files, at most every :data:`PRUNE_EVERY_S`; how many."""
        if (self.keep_seconds is None and self.keep_jobs is None) or (
                not force and time.monotonic() - self._pruned < PRUNE_EVERY_S):
            return 0
        self._pruned = time.monotonic()
        try:
            return self.store.prune(self.keep_seconds, self.keep_jobs)
        except StoreError:
            return 0  # tried again at the next turn

    # ---- called from the workers' threads ------------------------------------------------------

    def log_error(self, line: str, exc: BaseException | None = None) -> None:
        """An error the server survived: its one line on the server's output, its traceback in worker.log."""
        self.say(f"wan-sharding serve: error: {line}")
        if exc is not None and not self.log.closed:
            self.log.write("".join(traceback.format_exception(exc)))
            self.log.flush()

    def end_job(self, job_id: str, status: str, error: tuple[str, str] | None = None) -> None:
        """A job ``failed`` (``error``: ``(code, message)``) or ``cancelled``; when the store cannot
        record it now, kept and retried (:meth:`retry_pending`) until it can."""
        if error is not None:
            error = (error[0], public_message(error[1]))
        try:
            ended = self.store.finish(job_id, status, error)
        except StoreError:
            with self._pending_lock:
                self._pending[job_id] = (status, error)
            return
        if ended and error is not None:
            self.say(f"wan-sharding serve: job {job_id} failed: {error[1]}")

    def retry_pending(self) -> None:
        """Record the job ends the store could not take before (each replica's loop calls it)."""
        with self._pending_lock:
            pending = list(self._pending.items())
        for job_id, (status, error) in pending:
            try:  # once, without waiting: it was logged when it first failed
                self.store.finish(job_id, status, error, tries=1)
            except StoreError:
                return
            with self._pending_lock:
                self._pending.pop(job_id, None)
            if error is not None:
                self.say(f"wan-sharding serve: job {job_id} failed: {error[1]}")
        self.prune()

    def storage_failed(self, error: str) -> None:
        self.storage_failures = [*self.storage_failures[-STORAGE_FAILURES + 1:], public_message(error)]

    def storage_ok(self) -> None:
        self.storage_failures = []

    def notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def wait(self, timeout: float) -> None:
        with self._wake:
            self._wake.wait(timeout=timeout)

    def take(self, replica: Replica) -> str | None:
        """The oldest queued job, now ``in_progress`` on ``replica``; ``None`` when there is none
        or a worker before it in order is free (that one takes it)."""
        with self._dispatch:
            if any(r.idle for r in self.replicas[:replica.index]):
                return None
            if self._pending:  # the store failed a write a moment ago: no new job until it records again
                return None
            for job_id in self.store.queued_ids():
                if self.store.start(job_id, replica.index):
                    replica.idle, replica.running = False, job_id
                    return job_id
            return None

    def replica_broken(self, replica: Replica) -> None:
        """A worker was given up; the server is broken once every one was."""
        if all(r.broken for r in self.replicas):
            self.broken = replica.broken if len(self.replicas) == 1 else (
                "no worker could be started: " + "; ".join(f"{r.name}: {r.broken}" for r in self.replicas))
            self.on_broken(self.broken)
