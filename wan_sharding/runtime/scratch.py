"""Temporary files: one folder per process under the temp dir, removed when the process ends.

No command leaves anything in ``$TMPDIR`` (``tempfile.gettempdir()``), finished, failed or
interrupted, and that includes what third-party code in its workers writes there:

- :func:`scratch_dir`: a fresh folder for the package's own intermediate files (a compile's work
  folder without ``--out``, a planner run's IRs), inside this process's root
  ``$TMPDIR/wan_sharding-<pid>-<random>/``;
- :func:`worker_tmpdir`: a private ``TMPDIR`` for one worker process, inside the same root. The
  worker and everything it starts write their temporary files there: jax-tt-plugin unpacks its
  ~400 MB tt-metal runtime into ``$TMPDIR`` at every load and copies the system descriptor to a
  fixed name under it, so a private one also keeps two plugin processes from breaking each other
  (``docs/tt-mlir-notes.md``). :func:`remove` deletes it once the worker has stopped
  (:mod:`wan_sharding.runtime.workers` does, for every worker, also after a kill);
- the root goes when the process exits (``atexit``; Ctrl-C and SIGTERM unwind to it through
  :func:`wan_sharding.runtime.workers.install_signal_handlers`). A process killed outright (SIGKILL) cannot
  clean up: the next process that makes a root removes the roots of processes that are gone
  (:func:`sweep`), with the temp folders its libraries made that it had adopted
  (:func:`adopt_library_temp_dirs`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

__all__ = ["ADOPTED", "ROOT_PREFIX", "adopt_library_temp_dirs", "folder", "remove", "remove_root", "scratch_dir",
           "scratch_root", "sweep", "worker_tmpdir"]

ROOT_PREFIX = "wan_sharding-"
ADOPTED = "adopted"  # in a root: temp folders of its process's libraries, removed when a sweep removes the root
_ROOT_NAME = re.compile(re.escape(ROOT_PREFIX) + r"(\d+)-")
_lock = threading.Lock()
_root: Path | None = None
_pid_of_root: int | None = None
_count = itertools.count(1)


def scratch_root() -> Path:
    """This process's root folder under the temp dir, made on first use (and then the roots of
    processes that died without removing theirs are swept)."""
    global _root, _pid_of_root
    with _lock:
        if _root is None or _pid_of_root != os.getpid() or not _root.is_dir():  # a fork gets its own
            sweep()
            _root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-"))
            _pid_of_root = os.getpid()
        return _root


def scratch_dir(prefix: str) -> Path:
    """A fresh, empty folder inside :func:`scratch_root`; gone when this process exits, or earlier
    with :func:`remove`."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=scratch_root()))


@contextlib.contextmanager
def folder(given: str | os.PathLike[str] | None, prefix: str) -> Iterator[Path]:
    """``given`` (created if missing, kept), or a :func:`scratch_dir` removed when the block ends,
    however it ends: for work whose files matter only while it runs unless the caller names a
    place to keep them."""
    if given is not None:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = scratch_dir(prefix)
    try:
        yield path
    finally:
        remove(path)


def worker_tmpdir() -> Path:
    """A private ``TMPDIR`` for one worker process (see the module's docstring)."""
    path = scratch_root() / f"worker-{next(_count)}"
    path.mkdir()
    return path


def adopt_library_temp_dirs() -> list[str]:
    """Have the temp folders that libraries imported into this process made for it removed with its
    root when the process is killed before they clean up (:func:`sweep`); they remove them
    themselves at a normal exit. torch makes one whenever ``torch._dynamo`` is imported
    (``torch.distributed.nn.jit.instantiator``: a ``tmp*`` folder with one generated module). For
    command-line entry points, once the libraries are imported; returns what was adopted."""
    found = []
    instantiator = sys.modules.get("torch.distributed.nn.jit.instantiator")
    made = getattr(getattr(instantiator, "_TEMP_DIR", None), "name", None)
    if made:
        found.append(str(made))
    if found:
        with open(scratch_root() / ADOPTED, "a") as f:
            f.writelines(p + "\n" for p in found)
    return found


def remove(path: str | os.PathLike[str] | None) -> None:
    """Delete ``path`` and all below it; nothing when it is gone already."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the roots in ``directory`` (default: the temp dir) that belong to processes that no
    longer run (killed before they could clean up) and to this user; returns what was removed."""
    base = Path(directory or tempfile.gettempdir())
    removed = []
    with contextlib.suppress(OSError):
        for entry in base.iterdir():
            m = _ROOT_NAME.match(entry.name)
            if not m or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir() and not entry.is_symlink() and entry.stat().st_uid == os.getuid():
                    for adopted in _adopted(entry, base):
                        shutil.rmtree(adopted, ignore_errors=True)
                        removed.append(adopted)
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
    return removed


def _adopted(root: Path, base: Path) -> list[Path]:
    """The folders ``root``'s process adopted that are still there: only folders directly in the temp
    dir ``base`` and this user's (a stale list never reaches anything else)."""
    try:
        names = (root / ADOPTED).read_text().splitlines()
    except OSError:
        return []
    out = []
    for name in names:
        path = Path(name)
        with contextlib.suppress(OSError):
            if (path.parent == base and path.is_dir() and not path.is_symlink()
                    and path.stat().st_uid == os.getuid()):
                out.append(path)
    return out


@atexit.register
def remove_root() -> None:
    """Delete this process's root (at exit; the worker runner calls it after stopping its workers)."""
    global _root
    with _lock:
        if _root is not None and _pid_of_root == os.getpid():
            shutil.rmtree(_root, ignore_errors=True)
            _root = None
