"""The server's jobs and results, kept in one SQLite file under ``--store`` (``jobs.sqlite3``).

A server restarted on the same store lists every job and serves every finished video: jobs are
rows, videos are files under ``videos/`` named by the job id, written under a temporary name and
renamed when complete. Opening a store (:meth:`Store.open`) takes an exclusive lock on it, so two
servers never share one, and recovers what the last server left: a job still ``running`` is
``failed`` with that reason, leftover temporary files are removed, ``queued`` jobs stay queued (the
new server runs them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

STATUSES = ("queued", "running", "completed", "failed", "cancelled")
FINISHED = ("completed", "failed", "cancelled")
DIED_WHILE_RUNNING = "the server stopped while this job ran (it was not finished); submit it again"

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


class StoreBusy(RuntimeError):
    """Another server holds this store."""


class Store:
    """Jobs in SQLite and their videos on disk; safe to use from several threads."""

    def __init__(self, root: Path, db: sqlite3.Connection, lock_fd: int) -> None:
        self.root = root
        self.videos = root / "videos"
        self._db = db
        self._lock = threading.Lock()
        self._lock_fd = lock_fd

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> "Store":
        """Open (creating it if needed) the store under ``root``, lock it and recover it.

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
        db = sqlite3.connect(root / "jobs.sqlite3", check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(_SCHEMA)
        store = cls(root, db, fd)
        store._recover()
        return store

    def close(self) -> None:
        with self._lock:
            self._db.close()
            os.close(self._lock_fd)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _recover(self) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET status='failed', error=?, finished=? WHERE status='running'",
                       (DIED_WHILE_RUNNING, time.time()))
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

    def create(self, request: dict[str, Any], queued_limit: int | None = None) -> dict[str, Any] | None:
        """A new ``queued`` job with a server-made id; ``None`` when ``queued_limit`` jobs are
        already queued (the check and the insert are one transaction)."""
        job_id = uuid.uuid4().hex
        with self._tx() as db:
            if queued_limit is not None:
                (n,) = db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued'").fetchone()
                if n >= queued_limit:
                    return None
            db.execute("INSERT INTO jobs (id, status, request, created, total) VALUES (?, 'queued', ?, ?, ?)",
                       (job_id, json.dumps(request), time.time(), int(request["num_inference_steps"])))
        return self.get(job_id)

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def list(self, status: str | None = None) -> list[dict[str, Any]]:
        """Every job, oldest first (optionally only those with ``status``)."""
        query, args = "SELECT * FROM jobs", ()
        if status is not None:
            query, args = query + " WHERE status=?", (status,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created, rowid", args).fetchall()
        return [_job(r) for r in rows]

    def queued_ids(self) -> list[str]:
        return [j["id"] for j in self.list("queued")]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        found = dict(rows)
        return {s: int(found.get(s, 0)) for s in STATUSES}

    def start(self, job_id: str) -> bool:
        """``queued`` -> ``running``; False when it is no longer queued (cancelled meanwhile)."""
        with self._tx() as db:
            cur = db.execute("UPDATE jobs SET status='running', started=? WHERE id=? AND status='queued'",
                             (time.time(), job_id))
        return cur.rowcount == 1

    def progress(self, job_id: str, done: int, total: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET done=?, total=? WHERE id=? AND status='running'", (done, total, job_id))

    def finish(self, job_id: str, status: str, error: str | None = None, video: str | None = None,
               result: dict[str, Any] | None = None) -> bool:
        """A queued or running job becomes ``status`` (completed, failed or cancelled); False when
        it had already finished."""
        assert status in FINISHED
        with self._tx() as db:
            cur = db.execute(
                "UPDATE jobs SET status=?, error=?, video=?, result=?, finished=? WHERE id=? AND status IN "
                "('queued', 'running')",
                (status, error, video, None if result is None else json.dumps(result), time.time(), job_id))
        return cur.rowcount == 1

    def video_path(self, job: dict[str, Any]) -> Path | None:
        """The finished video of a completed job, when its file is there."""
        name = job.get("video")
        path = self.videos / name if name else None
        return path if path is not None and job["status"] == "completed" and path.is_file() else None


def _job(row: sqlite3.Row) -> dict[str, Any]:
    """A job as the API shows it."""
    created, started, finished = row["created"], row["started"], row["finished"]
    result = json.loads(row["result"]) if row["result"] else {}
    timings: dict[str, Any] = {"created": created, "started": started, "finished": finished}
    if started is not None:
        timings["queued_seconds"] = round(started - created, 3)
    if started is not None and finished is not None:
        timings["run_seconds"] = round(finished - started, 3)
    if "step_seconds" in result:
        timings["step_seconds"] = result["step_seconds"]
    return {"id": row["id"], "object": "video.generation", "status": row["status"],
            "request": json.loads(row["request"]),
            "progress": {"done": row["done"], "total": row["total"]},
            "timings": timings, "error": row["error"], "video": row["video"],
            "video_shape": result.get("video_shape")}
