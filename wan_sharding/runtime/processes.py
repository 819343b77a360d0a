"""The process table (Linux ``/proc``): the CPU time of a process and of its whole tree, and
killing a tree so that no descendant escapes. What the worker runner's watchdog counts and how it
stops a worker (:mod:`wan_sharding.runtime.workers`, and the server's resident workers)."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

__all__ = ["cpu_ticks", "kill_tree", "process_state", "tree_cpu_ticks"]


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` in clock ticks (Linux /proc), or None where unavailable."""
    stat = _stat(pid)
    return None if stat is None else stat.own


def process_state(pid: int) -> str | None:
    """The state letter /proc gives ``pid`` (``R`` running, ``S`` sleeping, ``T`` stopped by a
    signal, ``t`` stopped by a debugger, ``Z`` dead, not yet reaped ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class _Stat:
    """What /proc/<pid>/stat says about one process."""

    pid: int
    ppid: int
    pgid: int
    own: int  # utime + stime, clock ticks
    children: int  # cutime + cstime: the children it has waited for

    @property
    def ticks(self) -> int:
        return self.own + self.children


def _stat(pid: int) -> _Stat | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
        return _Stat(pid, int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12]),
                     int(fields[13]) + int(fields[14]))
    except (OSError, IndexError, ValueError):
        return None


def _processes() -> list[_Stat]:
    """Every process /proc lists now (empty where there is no /proc)."""
    try:
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    return [s for s in map(_stat, pids) if s is not None]


def _tree(root: int, group: int | None, table: list[_Stat]) -> dict[int, _Stat]:
    """``root``, its descendants (by parent pid) and, with ``group``, every member of that process
    group (a descendant whose parent already died has parent 1, but keeps its group)."""
    children: dict[int, list[_Stat]] = {}
    for s in table:
        children.setdefault(s.ppid, []).append(s)
    found = {s.pid: s for s in table if s.pid == root or (group is not None and s.pgid == group)}
    todo = list(found)
    while todo:
        for s in children.get(todo.pop(), ()):
            if s.pid not in found:
                found[s.pid] = s
                todo.append(s.pid)
    return found


def tree_cpu_ticks(pid: int) -> int | None:
    """CPU clock ticks used by ``pid``'s whole process tree: its own, those of the children it
    has waited for, and those of every live descendant (with the children they waited for). What
    the watchdog counts: a worker waiting on a compiler it started is working. ``None`` when
    ``pid`` is gone or /proc is unavailable."""
    tree = _tree(pid, None, _processes())
    return sum(s.ticks for s in tree.values()) if pid in tree else None


def kill_tree(pid: int, group: int | None = None) -> None:
    """SIGKILL ``pid``, all its descendants and (with ``group``) every process of that group.

    Stopped first (SIGSTOP), until a fresh look finds no new process: a stopped process cannot
    start another one, and killing a parent first would hand its children to pid 1, out of reach
    of the parent-pid walk. Processes that are gone already are skipped."""
    me = os.getpid()
    stopped: set[int] = set()
    for _ in range(50):  # each round stops what the last one found; a fork bomb ends the loop
        new = set(_tree(pid, group, _processes())) - stopped - {me}
        if not new:
            break
        for p in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
        stopped |= new
    for p in stopped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
