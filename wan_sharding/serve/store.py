"""The server's jobs and results, kept in one SQLite file under ``--store`` (``jobs.sqlite3``).

A job is shown as tt-media-server's job record (``tt-media-server/utils/job_manager.py``,
``Job.to_public_dict``): ``id``, ``job_type`` (``"video"``), ``status``, ``created_at`` (whole
seconds), ``model``, ``request_parameters``, ``completed_at`` once it ended and ``error``
(``{"code", "message"}``) once it failed, both left out before; with this server's extras
(``progress``, ``timings``, ``video``, ``video_shape``, ``worker``). Its states are tt-media-server's
``JobStatus``: ``queued``, ``in_progress``, ``cancelling`` (cancelled while it ran: until the end of
its step), ``completed``, ``failed``, ``cancelled``.

A server restarted on the same store lists every job and serves every finished video: jobs are
rows, the images of I2V jobs are rows too (inserted with their job, in one transaction), videos are
files under ``videos/`` named by the job id, written under a temporary name and renamed when
complete. Opening a store (:meth:`Store.open`) takes an exclusive lock on it, so two servers never
share one, migrates a store an older server wrote (its ``running`` jobs are ``in_progress``, its
one-line errors get a code) and recovers what the last server left, as tt-media-server does on a
restart: a job still ``in_progress`` is ``failed`` (code ``server_restart``), one ``cancelling`` is
``cancelled``, leftover temporary files are removed, ``queued`` jobs stay queued (the new server
runs them).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import hashlib
import json
import os
import re
import sqlite3
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")
log = logging.getLogger("wan_sharding.serve")

STATUSES = ("queued", "in_progress", "cancelling", "completed", "failed", "cancelled")
FINISHED = ("completed", "failed", "cancelled")
ACTIVE = ("in_progress", "cancelling")  # on a worker
DIED_WHILE_RUNNING = "the server stopped while this job ran (it was not finished); submit it again"
SCHEMA_VERSION = 1  # 0: the first store (states queued/running/..., errors as one line, no images)

# The error codes of a failed job: tt-media-server's ``processing_error`` (the pipeline raised) and
# ``server_restart``, and this server's faults. ``LEGACY_ERRORS``: how the first store's one-line
# errors start, to give them their code when it is migrated.
ERROR_CODES = ("processing_error", "server_restart", "server_stopped", "worker_died", "worker_hung", "timeout",
               "storage_error")
# A write that finds the store busy (another SQLite client holds its write lock: a backup, the sqlite3
# shell) waits BUSY_S for it, and is tried WRITE_TRIES times in all before it fails with StoreError:
# at most about WRITE_TRIES * BUSY_S + the pauses, so no caller waits unbounded.
BUSY_S = 1.0
WRITE_TRIES = 3
PROBE_S = 5.0  # /health writes to the store and its videos folder at most this often (more often after a failure)
LEGACY_ERRORS = (("the server stopped while this job ran", "server_restart"), ("the server was stopped", "server_stopped"),
                 ("the worker process died", "worker_died"), ("the worker stopped reporting progress", "worker_hung"),
                 ("ran past --job-timeout", "timeout"))

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    request TEXT NOT NULL,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    done INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL,
    error TEXT,
    video TEXT,
    result TEXT
)
"""
# Added by SCHEMA_VERSION 1 (ALTER TABLE on a first-version store).
_COLUMNS_V1 = {"error_code": "TEXT", "job_type": "TEXT NOT NULL DEFAULT 'video'", "model": "TEXT", "worker": "INTEGER"}
_IMAGES = """
CREATE TABLE IF NOT EXISTS job_images (
    job_id TEXT NOT NULL,
    frame_pos INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (job_id, frame_pos)
)
"""


class StoreBusy(RuntimeError):
    """Another server holds this store."""


class StoreError(RuntimeError):
    """A write to the store failed after :data:`WRITE_TRIES` tries; the message is one line for
    clients (no path), the SQLite error it ends with."""


# What a message to a client never shows: a host path (the store's, a temporary file's) and an
# allocator's own words (sizes, its source file): the server's output and worker.log keep them.
_PATH = re.compile(r"(?<![\w.])(?!/v1/)(?:/[\w.+@%-]+){2,}/?")  # not the API's own routes
_ALLOCATOR = re.compile(r"alloc|out of memory|OutOfMemory|MemoryError|std::bad_alloc", re.I)


def public_message(message: str) -> str:
    """``message`` as a client may read it: one line, host paths as ``<path>``, an allocation failure
    as "out of memory" and nothing of the allocator's own text, at most 500 characters."""
    line = (message.splitlines() or [""])[0]
    if _ALLOCATOR.search(line):
        head = line.split(":", 1)[0] if ":" in line else "error"
        line = f"{head}: out of memory while running this job; send a smaller request (fewer frames, a smaller size)"
    line = _PATH.sub("<path>", line)
    return line if len(line) <= 500 else line[:497] + "..."


def legacy_error_code(message: str) -> str:
    """The code of a one-line error the first store kept without one."""
    return next((code for start, code in LEGACY_ERRORS if message.startswith(start)), "processing_error")


class Store:
    """Jobs in SQLite and their videos on disk; safe to use from several threads."""

    def __init__(self, root: Path, db: sqlite3.Connection, lock_fd: int) -> None:
        self.root = root
        self.videos = root / "videos"
        self._db = db
        self._lock = threading.Lock()
        self._lock_fd = lock_fd
        self.write_error: str | None = None  # the last failed write's error, until a write succeeds
        self._probed: tuple[float, str | None] = (0.0, None)

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> "Store":
        """Open (creating it if needed) the store under ``root``, lock it, migrate and recover it.

        Raises:
            StoreBusy: another live server has it open.
        """
        root = Path(root)
        (root / "videos").mkdir(parents=True, exist_ok=True)
        fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreBusy(f"store {root} is in use by another server (pid {owner}); stop it or pass another "
                            "--store") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        db = sqlite3.connect(root / "jobs.sqlite3", check_same_thread=False, isolation_level=None, timeout=BUSY_S)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        store = cls(root, db, fd)
        db.execute("CREATE TABLE IF NOT EXISTS health_probe (id INTEGER PRIMARY KEY, at REAL)")
        store._migrate()
        store._recover()
        return store

    def close(self) -> None:
        with self._lock:
            self._db.close()
            os.close(self._lock_fd)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction, tried once (opening the store: a failure there is the command's error)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        """Roll back what is open. SQLite rolls back by itself after some failures (then ROLLBACK would
        raise "no transaction is active" and hide the real error), so only an open transaction is."""
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def _write(self, what: str, fn: Callable[[sqlite3.Connection], T], tries: int = WRITE_TRIES,
               wait: bool = True) -> T:
        """``fn(db)`` in one transaction, tried up to ``tries`` times while SQLite fails (busy,
        locked, I/O), each waiting up to :data:`BUSY_S` for a lock (``wait=False``: not at all); then
        :class:`StoreError`, the real error logged (never the rollback's)."""
        error: sqlite3.Error | None = None
        for attempt in range(tries):
            if attempt:
                time.sleep(0.2 * attempt)
            with self._lock:
                try:
                    if not wait:
                        self._db.execute("PRAGMA busy_timeout=0")
                    self._db.execute("BEGIN IMMEDIATE")
                    out = fn(self._db)
                    self._db.execute("COMMIT")
                except sqlite3.Error as e:
                    error = e
                    self._rollback()
                    continue
                except BaseException:
                    self._rollback()
                    raise
                finally:
                    if not wait:
                        self._db.execute(f"PRAGMA busy_timeout={int(BUSY_S * 1000)}")
            self.write_error = None
            return out
        self.write_error = f"{type(error).__name__}: {error}"
        if tries > 1:  # a probe or a progress write (tried once) is not worth a line: /health says it
            log.error("the job store could not be written (%s) after %d tries: %s", what, tries, self.write_error)
        raise StoreError(f"the job store could not be written ({what}: {error}); retry later")

    def probe(self, force: bool = False) -> str | None:
        """Why the store cannot be written now (its database, its videos folder), or None: a real
        write of each, at most every :data:`PROBE_S` seconds (each second while one fails)."""
        last, why = self._probed
        if not force and time.monotonic() - last < (1.0 if why or self.write_error else PROBE_S):
            return why
        why = None
        try:
            self._write("health probe", lambda db: db.execute(
                "INSERT OR REPLACE INTO health_probe (id, at) VALUES (1, ?)", (time.time(),)), tries=1, wait=False)
        except StoreError:
            why = f"the job store cannot be written ({self.write_error})"
        else:
            try:
                fd, name = tempfile.mkstemp(prefix=".probe.", suffix=".partial", dir=self.videos)
                os.write(fd, b"0")
                os.close(fd)
                os.unlink(name)
            except OSError as e:
                why = f"the videos folder cannot be written ({e.strerror or type(e).__name__})"
        self._probed = (time.monotonic(), why)
        return why

    def _migrate(self) -> None:
        """Bring a store of any earlier version to :data:`SCHEMA_VERSION`, in one transaction."""
        with self._tx() as db:
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if version >= SCHEMA_VERSION:
                return
            db.execute(_SCHEMA)
            have = {r["name"] for r in db.execute("PRAGMA table_info(jobs)")}
            for name, kind in _COLUMNS_V1.items():
                if name not in have:
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
            db.execute(_IMAGES)
            db.execute("UPDATE jobs SET status='in_progress' WHERE status='running'")
            for row in db.execute("SELECT id, error FROM jobs WHERE error IS NOT NULL AND error_code IS NULL").fetchall():
                db.execute("UPDATE jobs SET error_code=? WHERE id=?", (legacy_error_code(row["error"]), row["id"]))
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _recover(self) -> None:
        with self._tx() as db:
            now = time.time()
            db.execute("UPDATE jobs SET status='failed', error=?, error_code='server_restart', finished=? "
                       "WHERE status='in_progress'", (DIED_WHILE_RUNNING, now))
            db.execute("UPDATE jobs SET status='cancelled', finished=? WHERE status='cancelling'", (now,))
        self.remove_partial_files()

    def remove_partial_files(self) -> list[str]:
        """Remove the temporary files a killed worker left (``.<name>.*.partial*``); their names."""
        gone = []
        for p in self.videos.iterdir():
            if p.name.startswith(".") and ".partial" in p.name:
                with contextlib.suppress(OSError):
                    p.unlink()
                    gone.append(p.name)
        return gone

    # ---- jobs -----------------------------------------------------------------------------------

    def create(self, request: dict[str, Any], model: str, images: dict[int, bytes] | None = None,
               queued_limit: int | None = None) -> dict[str, Any] | None:
        """A new ``queued`` job with a server-made id, and its images (``{frame_pos: bytes}``);
        ``None`` when ``queued_limit`` jobs are already queued (the check and the inserts are one
        transaction)."""
        job_id = uuid.uuid4().hex
        if images:  # the job record names each image by its digest; the bytes are in job_images
            request = {**request, "image_prompts": [
                {"frame_pos": pos, "image_bytes": len(data), "image_sha256": hashlib.sha256(data).hexdigest()}
                for pos, data in sorted(images.items())]}
        def insert(db: sqlite3.Connection) -> bool:
            if queued_limit is not None:
                (n,) = db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued'").fetchone()
                if n >= queued_limit:
                    return False
            db.execute("INSERT INTO jobs (id, status, request, created, total, model) VALUES (?, 'queued', ?, ?, ?, ?)",
                       (job_id, json.dumps(request), time.time(), int(request["num_inference_steps"]), model))
            for pos, data in (images or {}).items():
                db.execute("INSERT INTO job_images (job_id, frame_pos, data) VALUES (?, ?, ?)", (job_id, pos, data))
            return True

        if not self._write("queueing a job", insert):
            return None
        return self.get(job_id)

    def images(self, job_id: str) -> dict[int, bytes]:
        """The images of a job, ``{frame_pos: bytes}`` (empty for text to video)."""
        with self._lock:
            rows = self._db.execute("SELECT frame_pos, data FROM job_images WHERE job_id=?", (job_id,)).fetchall()
        return {int(r["frame_pos"]): bytes(r["data"]) for r in rows}

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def list(self, status: str | None = None, limit: int | None = None, after: str | None = None
             ) -> list[dict[str, Any]]:
        """Jobs oldest first (only those with ``status``, when given): at most ``limit``, those
        queued after job ``after`` (a page's last id: the next page). An unknown ``after``: none."""
        where, args = [], []
        if status is not None:
            where.append("status=?")
            args.append(status)
        if after is not None:
            where.append("rowid > COALESCE((SELECT rowid FROM jobs WHERE id=?), (SELECT MAX(rowid) FROM jobs))")
            args.append(after)
        query = "SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY rowid"
        if limit is not None:
            query += f" LIMIT {int(limit)}"
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [_job(r) for r in rows]

    def prune(self, keep_seconds: float | None, keep_jobs: int | None) -> int:
        """Remove finished jobs (completed, failed, cancelled) that ended more than ``keep_seconds``
        ago or are past the newest ``keep_jobs`` finished ones, with their images and videos; how many."""
        def delete(db: sqlite3.Connection) -> list[tuple[str, str | None]]:
            finished = "status IN ('completed', 'failed', 'cancelled')"
            clauses, args = [], []
            if keep_seconds is not None:
                clauses.append("COALESCE(finished, created) < ?")
                args.append(time.time() - keep_seconds)
            if keep_jobs is not None:
                clauses.append(f"rowid NOT IN (SELECT rowid FROM jobs WHERE {finished} ORDER BY rowid DESC LIMIT ?)")
                args.append(int(keep_jobs))
            if not clauses:
                return []
            rows = db.execute(f"SELECT id, video FROM jobs WHERE {finished} AND ({' OR '.join(clauses)})",
                              args).fetchall()
            for r in rows:
                db.execute("DELETE FROM job_images WHERE job_id=?", (r["id"],))
                db.execute("DELETE FROM jobs WHERE id=?", (r["id"],))
            return [(r["id"], r["video"]) for r in rows]

        gone = self._write("removing old jobs", delete)
        for _, video in gone:
            if video:
                with contextlib.suppress(OSError):
                    (self.videos / Path(video).name).unlink()
        return len(gone)

    def queued_ids(self) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT id FROM jobs WHERE status='queued' ORDER BY created, rowid").fetchall()
        return [r["id"] for r in rows]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        found = dict(rows)
        return {s: int(found.get(s, 0)) for s in STATUSES}

    def start(self, job_id: str, worker: int = 0) -> bool:
        """``queued`` -> ``in_progress`` on ``worker``; False when it is no longer queued (cancelled,
        or taken by another worker)."""
        return self._update("starting a job", "UPDATE jobs SET status='in_progress', started=?, worker=? WHERE id=? AND "
                            "status='queued'", (time.time(), worker, job_id))

    def cancelling(self, job_id: str) -> bool:
        """``in_progress`` -> ``cancelling`` (its worker stops it at the end of the step)."""
        return self._update("cancelling a job", "UPDATE jobs SET status='cancelling' WHERE id=? AND status='in_progress'",
                            (job_id,))

    def progress(self, job_id: str, done: int, total: int) -> None:
        """A running job's steps done: tried once (the next step's progress supersedes it)."""
        self._update("recording progress", "UPDATE jobs SET done=?, total=? WHERE id=? AND status IN ('in_progress', "
                     "'cancelling')", (done, total, job_id), tries=1, wait=False)

    def complete(self, job_id: str, video: str, result: dict[str, Any]) -> bool:
        """An ``in_progress`` job is ``completed`` with its video; False when it is not in progress
        (cancelled meanwhile: ``cancelling``; or already failed at its timeout)."""
        return self._update("recording a finished video", "UPDATE jobs SET status='completed', video=?, result=?, "
                            "finished=? WHERE id=? AND status='in_progress'",
                            (video, json.dumps(result), time.time(), job_id))

    def finish(self, job_id: str, status: str, error: tuple[str, str] | None = None, tries: int = WRITE_TRIES
               ) -> bool:
        """A job not yet finished becomes ``failed`` (with ``error``: ``(code, message)``) or
        ``cancelled``; False when it had already finished."""
        assert status in ("failed", "cancelled") and (error is None) == (status == "cancelled")
        assert error is None or error[0] in ERROR_CODES
        code, message = error or (None, None)
        return self._update(f"marking a job {status}", "UPDATE jobs SET status=?, error_code=?, error=?, finished=? "
                            "WHERE id=? AND status IN ('queued', 'in_progress', 'cancelling')",
                            (status, code, message, time.time(), job_id), tries, wait=tries > 1)

    def _update(self, what: str, sql: str, args: tuple, tries: int = WRITE_TRIES, wait: bool = True) -> bool:
        """One UPDATE in its transaction (:meth:`_write`); True when it changed a row."""
        return self._write(what, lambda db: db.execute(sql, args).rowcount == 1, tries, wait)

    def video_path(self, job: dict[str, Any]) -> Path | None:
        """The finished video of a completed job, when its file is there."""
        name = job.get("video")
        path = self.videos / name if name else None
        return path if path is not None and job["status"] == "completed" and path.is_file() else None


def _job(row: sqlite3.Row) -> dict[str, Any]:
    """A job as the API shows it: tt-media-server's record, then this server's extras; a row this
    server cannot read (written by hand, or by another program) is shown as ``failed`` with why,
    so that one odd row never breaks a listing."""
    try:
        return _record(row)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        return {"id": str(row["id"]), "object": "video.generation", "job_type": "video", "status": "failed",
                "created_at": 0, "model": None, "request_parameters": None,
                "error": {"code": "storage_error", "message": f"this job's record cannot be read ({type(e).__name__})"}}


def _record(row: sqlite3.Row) -> dict[str, Any]:
    created, started, finished = row["created"], row["started"], row["finished"]
    result = json.loads(row["result"]) if row["result"] else {}
    timings: dict[str, Any] = {"created": created, "started": started, "finished": finished}
    if started is not None:
        timings["queued_seconds"] = round(started - created, 3)
    if started is not None and finished is not None:
        timings["run_seconds"] = round(finished - started, 3)
    if "step_seconds" in result:
        timings["step_seconds"] = result["step_seconds"]
    job: dict[str, Any] = {"id": row["id"], "object": "video.generation", "job_type": row["job_type"],
                           "status": row["status"], "created_at": int(created), "model": row["model"],
                           "request_parameters": json.loads(row["request"])}
    if finished is not None and row["status"] in FINISHED:
        job["completed_at"] = int(finished)
    if row["error"] is not None:
        job["error"] = {"code": row["error_code"] or "processing_error", "message": row["error"]}
    job.update(progress={"done": row["done"], "total": row["total"]}, timings=timings, video=row["video"],
               video_shape=result.get("video_shape"), worker=row["worker"])
    return job
