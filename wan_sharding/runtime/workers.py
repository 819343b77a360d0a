"""The one way this package runs work in another process, and cleans up after it.

Every job that needs a particular runtime (a PCC check, a pipeline, a profile, a tt-mlir compile)
runs in a worker process: torch-xla and JAX both read ``XLA_FLAGS``, and the Tenstorrent plugin
breaks JAX's CPU backend, so each stack gets a process of its own.

The protocol, the same for every worker:

- the parent starts ``python -m <module>`` with the job's parameters as one JSON document on stdin;
- the worker (:func:`worker_main`) prints one ``RESULT {json}`` line per result on stdout; every
  other line is log;
- the parent (:func:`run_worker`) collects the results and the log.

What the parent guarantees:

- **a watchdog**: a worker whose CPU time stops moving for ``stall_s`` is hung, not slow (jaxlib
  0.7.1 on a 2-core host occasionally deadlocks in its MLIR verifier's thread pool: worker threads
  wait on the dynamic loader's lock, which the main thread holds; seen a few times in about fifty
  JAX worker runs, and a fresh process runs normally). It is killed and started again
  ``retries_on_stall`` times. One past ``timeout`` is killed. The CPU counted is the worker's
  whole process tree (:func:`tree_cpu_ticks`): at optimization level 1 tt-metal's mock device
  JIT-builds kernels in child processes (``cc1plus``, ``lto1``, ``ld`` under the compile worker)
  while the worker itself waits, and that is work, not a hang.
- **no orphans**: the worker runs in its own process group. Stopping it (:func:`stop_worker`, and
  whenever the parent leaves :func:`run_worker` for any reason: an exception, Ctrl-C, SIGTERM once
  :func:`install_signal_handlers` ran, a watchdog kill, the worker's own exit) kills the worker,
  every descendant and every process left in its group (:func:`kill_tree`), so no compiler it
  started is left running with parent 1; the worker also asks the kernel to kill it if the parent
  dies without cleaning up (``PR_SET_PDEATHSIG``, Linux).

A long-lived worker (the model process behind ``wan-sharding serve``) is started with
:func:`start_resident_worker` and stopped with :func:`stop_worker`, with the same process group
and parent-death guarantees; its side is :func:`resident_worker_main` (a configuration line, then
one request per stdin line, ``RESULT`` lines back).

Files a job writes go through :func:`atomic_write` (a temporary name, renamed when complete), so an
interrupted job leaves no half-written file that looks complete. Every worker gets a private
``TMPDIR`` (:func:`wan_sharding.runtime.scratch.worker_tmpdir`), deleted when the worker is stopped, so
nothing it or the libraries it runs write there outlives it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Mapping

from . import noise, scratch
from .processes import kill_tree, tree_cpu_ticks

STALL_SECONDS = 90  # a worker that uses (almost) no CPU for this long is hung, not slow
STALL_CPU_FRACTION = 0.05  # "almost no": under 5 % of one core over the whole window (hung: 2-3 % seen)
RESULT_PREFIX = "RESULT "
# Set in every worker's environment: the parent's pid. Lets a test (or a user) find the workers
# a command started.
PARENT_ENV = "WAN_SHARDING_PARENT"


class WorkerError(RuntimeError):
    """A worker could not be started, or failed in a way the caller asked to be raised."""


@dataclass
class WorkerRun:
    """What one worker run gave: its exit code, its ``RESULT`` dicts and its log."""

    returncode: int
    results: list[dict[str, Any]] = field(default_factory=list)
    output: str = ""  # every non-RESULT line (with stderr when it was merged), plus watchdog notes
    stalled: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# ------------------------------------------------------------------------------------ parent side

_LIVE: dict[subprocess.Popen, Path] = {}  # each live worker and its private TMPDIR
_LIVE_LOCK = threading.Lock()


def with_package_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this package's source root first on ``PYTHONPATH`` (once), so a worker imports
    the same copy as its parent, also from a source checkout."""
    root = str(Path(__file__).resolve().parents[2])  # wan_sharding/runtime/workers.py -> the source root
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the worker and anything it started (:func:`kill_tree`), then reap it. Also after the
    worker exited by itself: children it left running (a compiler it had started when it crashed)
    are still in its process group. Until reaped, an exited worker's pid (its group's id) cannot
    be taken by another process; :func:`_exited` and :func:`_wait_exit` leave it unreaped."""
    if proc.returncode is None:  # not reaped yet: the pid and the group are still ours
        kill_tree(proc.pid, group=proc.pid)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the worker has ended, without reaping it (``Popen.poll`` would)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere
        return True
    except (AttributeError, OSError):  # no waitid / WNOWAIT on this OS
        return proc.poll() is not None


def _wait_exit(proc: subprocess.Popen) -> None:
    """Block until the worker ends, without reaping it."""
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        pass
    except (AttributeError, OSError):
        proc.wait()


@atexit.register
def _kill_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        stop_worker(proc)
    scratch.remove_root()  # after the workers: none of them writes there any more


def install_signal_handlers() -> None:
    """Make SIGTERM and SIGHUP end this process the way Ctrl-C does (an exception that unwinds
    through :func:`run_worker`, which kills its worker). For command-line entry points; call from
    the main thread."""

    def _raise(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread / not on this OS
            signal.signal(sig, _raise)


def _watch(proc: subprocess.Popen, timeout: float | None, stall_s: float | None, state: dict) -> None:
    """Kill ``proc`` past ``timeout``, or when its process tree (:func:`tree_cpu_ticks`) used less
    than :data:`STALL_CPU_FRACTION` of a core over the last ``stall_s`` seconds (``None``: never).
    A slow or starved worker still uses a good share of a core; the jaxlib deadlock uses almost
    none, but not none: a thread waiting for the GIL that the blocked thread holds wakes every few
    milliseconds, so "CPU time has not moved" never fires on it.

    When the worker ends by itself, whatever it left running in its group is killed at once: a
    leftover child holding the worker's stdout would otherwise keep the caller reading."""
    start = time.monotonic()
    per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    samples: list[tuple[float, int]] = []  # (monotonic time, CPU ticks so far), the last stall_s seconds
    progress, last = 0, None
    while not _exited(proc):
        time.sleep(1.0)
        now = time.monotonic()
        ticks = tree_cpu_ticks(proc.pid)
        if ticks is not None:
            # Only increases count: the tree's total drops when a descendant whose parent died
            # ends (its time leaves the tree), which is no reason to call the worker hung.
            progress += max(0, ticks - last) if last is not None else 0
            last = ticks
            samples.append((now, progress))
        stalled = False
        if stall_s is not None and samples and now - samples[0][0] >= stall_s:
            while len(samples) > 1 and now - samples[1][0] >= stall_s:
                samples.pop(0)  # keep the oldest sample at least stall_s old
            used = (samples[-1][1] - samples[0][1]) / per_s
            stalled = used < STALL_CPU_FRACTION * (samples[-1][0] - samples[0][0])
        if stalled:
            state["stalled"] = True
        elif timeout is not None and now - start > timeout:
            state["timed_out"] = True
        else:
            continue
        _kill_group(proc)
        return
    if proc.returncode is None:  # ended, not reaped: its group id is still its own
        kill_tree(proc.pid, group=proc.pid)


def run_worker(module: str, params: Any, env: Mapping[str, str] | None = None, *, label: str,
               echo: bool = False, merge_stderr: bool | None = None, log_file: str | os.PathLike[str] | None = None,
               timeout: float | None = None, stall_s: float | None = STALL_SECONDS, retries_on_stall: int = 1,
               python: str | None = None) -> WorkerRun:
    """Run ``python -m module`` with ``params`` (JSON) on stdin until it exits.

    Args:
        module: the worker module (its ``__main__`` calls :func:`worker_main`).
        params: the job's parameters, any JSON-serialisable value.
        env: the worker's environment (default: this process's).
        label: how messages name this worker.
        echo: print the worker's non-RESULT stdout lines as they come.
        merge_stderr: send the worker's stderr into the same stream (kept in ``output`` and
            ``log_file``); default: merged unless ``echo``, where stderr (progress bars) goes
            straight to ours.
        log_file: also write every line of the log there.
        timeout: wall-clock seconds before the worker is killed.
        stall_s: seconds without CPU progress before the worker counts as hung (``None``: a
            worker that may legitimately wait, e.g. on a device, is never taken for hung).
        retries_on_stall: how many times a hung worker is started again.
        python: the interpreter (default: this one).

    Returns:
        A :class:`WorkerRun`. A non-zero exit is a result, not an exception.

    Raises:
        WorkerError: the worker could not be started.
    """
    merge = (not echo) if merge_stderr is None else merge_stderr
    cmd = [python or sys.executable, "-m", module]
    child_env = dict(os.environ if env is None else env)
    child_env[PARENT_ENV] = str(os.getpid())
    payload = json.dumps(params)
    run = WorkerRun(returncode=-1)
    for attempt in range(retries_on_stall + 1):
        run = _run_once(cmd, payload, child_env, label, echo, merge, log_file, timeout, stall_s)
        if run.stalled:
            note = f"{label} made no progress for {stall_s:.0f} s and was stopped (hung)"
            print(note + ("; starting it again" if attempt < retries_on_stall else ""), file=sys.stderr, flush=True)
            run.output += "\n" + note
            if attempt < retries_on_stall:
                continue
        if run.timed_out:
            run.output += f"\n{label} ran past its {timeout:.0f} s limit and was stopped"
        return run
    return run


def _start(cmd: list[str], env: Mapping[str, str], stderr: IO[str] | int | None, label: str) -> subprocess.Popen:
    """Start a worker in its own process group (so its whole group can be killed) with a private
    ``TMPDIR``, registered for the at-exit cleanup."""
    tmp = scratch.worker_tmpdir()
    # progress bars only where the worker's stderr is a terminal: ours, when it inherits it
    env = noise.progress_env({**env, "TMPDIR": str(tmp)}, stderr is None and noise.is_terminal(sys.stderr))
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                errors="replace", start_new_session=True)
    except OSError as e:
        scratch.remove(tmp)
        raise WorkerError(f"cannot start {label} ({' '.join(cmd)}): {e}") from e
    with _LIVE_LOCK:
        _LIVE[proc] = tmp
    return proc


def start_resident_worker(module: str, env: Mapping[str, str] | None = None, *, label: str,
                          stderr: IO[str] | int | None = None, python: str | None = None) -> subprocess.Popen:
    """Start ``python -m module`` as a long-lived worker that the caller talks to over its stdin and
    stdout (one JSON line per request, ``RESULT`` lines back), with the guarantees of
    :func:`run_worker`: its own process group, killed at exit or by :func:`stop_worker`, and dying
    with its parent. Call it from a thread that outlives the worker: the kernel's parent-death
    signal fires when the *thread* that started the worker ends. ``stderr``: where the worker's
    stderr goes (default: ours)."""
    child_env = dict(os.environ if env is None else env)
    child_env[PARENT_ENV] = str(os.getpid())
    return _start([python or sys.executable, "-m", module], child_env, stderr, label)


def stop_worker(proc: subprocess.Popen) -> None:
    """Kill a worker, its descendants and what is left in its process group (:func:`kill_tree`;
    after the worker ended, what it left behind), delete its private ``TMPDIR`` and forget it."""
    _kill_group(proc)
    with _LIVE_LOCK:
        tmp = _LIVE.pop(proc, None)
    scratch.remove(tmp)


def _run_once(cmd: list[str], payload: str, env: dict[str, str], label: str, echo: bool, merge: bool,
              log_file: str | os.PathLike[str] | None, timeout: float | None, stall_s: float | None) -> WorkerRun:
    # Unmerged stderr goes to ours (echo) or to a file, never a pipe we do not read: a chatty
    # worker (XLA warnings) would block on a full pipe and look hung.
    err: IO[str] | int | None
    err = subprocess.STDOUT if merge else (None if echo else tempfile.TemporaryFile(mode="w+"))
    log = open(log_file, "w") if log_file is not None else None
    proc = _start(cmd, env, err, label)
    state: dict[str, bool] = {}
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    try:
        threading.Thread(target=_watch, args=(proc, timeout, stall_s, state), daemon=True).start()
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(BrokenPipeError):  # a worker that fails at start-up
            proc.stdin.write(payload)
            proc.stdin.close()
        for line in proc.stdout:
            if line.startswith(RESULT_PREFIX):
                results.append(json.loads(line[len(RESULT_PREFIX):]))
                continue
            lines.append(line)
            if log is not None:
                log.write(line)
            if echo:
                print(line, end="", flush=True)
        _wait_exit(proc)  # not reaped: stop_worker below still finds what it left in its group
    finally:
        stop_worker(proc)  # no-op after a normal exit; Ctrl-C or an exception lands here too
        if log is not None:
            log.close()
    output = "".join(lines)
    if hasattr(err, "seek"):
        err.seek(0)  # type: ignore[union-attr]
        text = err.read()  # type: ignore[union-attr]
        err.close()  # type: ignore[union-attr]
        if proc.returncode and text:
            output += "\n[stderr]\n" + text[-4000:]
    return WorkerRun(proc.returncode, results, output, bool(state.get("stalled")), bool(state.get("timed_out")))


# ------------------------------------------------------------------------------------ worker side


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        parent = os.environ.get(PARENT_ENV)
        if parent and os.getppid() != int(parent):  # the parent died before the request took
            os._exit(1)


def resident_worker_main(setup: Callable[[Any], Any], handle: Callable[[Any, Any], None]) -> int:
    """The worker side of :func:`start_resident_worker`: the first stdin line is the configuration,
    ``setup(config)`` builds the state (it may :func:`emit` as it goes); then every further line is
    a request, ``handle(state, request)``, until stdin closes. The worker dies with its parent."""
    _die_with_parent()
    noise.quiet_worker()
    state = setup(json.loads(sys.stdin.readline() or "null"))
    for line in sys.stdin:
        if line.strip():
            handle(state, json.loads(line))
    return 0


def emit(result: Mapping[str, Any]) -> None:
    """Send one result to the parent (one ``RESULT`` line on stdout)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def worker_main(job: Callable[[Any], Iterable[Mapping[str, Any]] | None],
                expected: tuple[type[BaseException], ...] = ()) -> int:
    """The worker side of :func:`run_worker`: read the parameters from stdin, run ``job`` on them
    and emit what it returns (a job may also :func:`emit` as it goes). An exception of a type in
    ``expected`` is a usage error: one line on stderr, exit 2."""
    _die_with_parent()
    noise.quiet_worker()
    params = json.loads(sys.stdin.read() or "null")
    try:
        for result in job(params) or ():
            emit(result)
    except expected as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


# ------------------------------------------------------------------------------------ files


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = ".partial") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block completes it is renamed to ``path``,
    otherwise removed. Readers never see a half-written ``path``. ``suffix`` ends the temporary
    name (a writer that picks its format from the file name needs e.g. ``".partial.gif"``)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename; returns ``path``."""
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
    return Path(path)
