"""Worker processes that cannot hang the caller.

Each backend runs in its own process (torch-xla and JAX both read ``XLA_FLAGS``). jaxlib 0.7.1
on this host occasionally deadlocks in its MLIR verifier's thread pool (worker threads wait on
the dynamic loader's lock, which the main thread holds): seen a few times in about fifty JAX
worker runs on a 2-core host, and a fresh process runs normally. So a worker whose CPU time stops
moving is killed and started again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

STALL_SECONDS = 90  # a worker whose CPU time does not move for this long is hung, not slow


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` in clock ticks (Linux /proc), or None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def _watch(proc: subprocess.Popen, timeout: float | None, stall_s: float, state: dict) -> None:
    """Kill ``proc`` past ``timeout``, or when its CPU time has not moved for ``stall_s`` (a
    deadlocked process uses no CPU; a slow or starved one still does)."""
    start = last_change = time.monotonic()
    last = _cpu_ticks(proc.pid)
    while proc.poll() is None:
        time.sleep(2.0)
        now = time.monotonic()
        ticks = _cpu_ticks(proc.pid)
        if ticks is None or ticks != last:
            last, last_change = ticks, now
        if ticks is not None and now - last_change > stall_s:
            state["stalled"] = True
        elif timeout is not None and now - start > timeout:
            state["timed_out"] = True
        else:
            continue
        proc.kill()
        return


def run_watched(cmd: list[str], env: dict[str, str], *, label: str, echo: bool = False,
                timeout: float | None = None, stall_s: float = STALL_SECONDS,
                retries_on_stall: int = 1) -> tuple[int, list[dict[str, Any]], str]:
    """Run ``cmd``; returns (exit code, the ``RESULT {json}`` lines it printed, its stdout).

    With ``echo`` its other stdout lines are printed as they come and its stderr goes straight to
    ours; otherwise the tail of its stderr is appended to the returned text on failure. A process
    that uses no CPU for ``stall_s`` seconds is killed and run again, at most ``retries_on_stall``
    times; one past ``timeout`` is killed.
    """
    for attempt in range(retries_on_stall + 1):
        # stderr to a file, not a pipe: a chatty worker (XLA warnings) would block on a full pipe
        # while we read stdout, and look hung.
        errfile = None if echo else tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errfile, text=True)
        state: dict[str, bool] = {}
        threading.Thread(target=_watch, args=(proc, timeout, stall_s, state), daemon=True).start()
        results, lines = [], []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
            elif echo:
                print(line, end="", flush=True)
        proc.wait()
        err = ""
        if errfile is not None:
            errfile.seek(0)
            err = errfile.read()
            errfile.close()
        out = "".join(lines)
        if proc.returncode and not echo and err:
            out += "\n[stderr]\n" + err[-4000:]
        if state.get("stalled"):
            note = (f"{label} made no progress for {stall_s:.0f} s and was stopped "
                    "(hung: see wan_sharding.workers on the jaxlib deadlock)")
            print(note + ("; starting it again" if attempt < retries_on_stall else ""), file=sys.stderr, flush=True)
            out += "\n" + note
            if attempt < retries_on_stall:
                continue
        if state.get("timed_out"):
            out += f"\n{label} ran past its {timeout:.0f} s limit and was stopped"
        return proc.returncode, results, out
