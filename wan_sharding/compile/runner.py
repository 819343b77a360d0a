"""The caller's side of a compile: descriptor, worker environment, worker processes, results.

Every compile runs in a worker subprocess (``python -m wan_sharding.compile.worker``, see
:mod:`wan_sharding.compile.worker`), started through the package's one process runner
(:func:`wan_sharding.runtime.workers.run_worker`: parameters as JSON on stdin, one ``RESULT`` line per
result, the worker's process group killed whenever the caller leaves, Ctrl-C included). Why a
subprocess: ``TT_COMPILE_ONLY_SYSTEM_DESC`` has to be set before JAX initialises its backends, and
with the plugin installed a process that initialises JAX without it fails ("No chips detected").
The calling process (CLI, pytest) never imports JAX with the plugin.

One worker compiles a batch of requests to pay the ~15-20 s of start-up (plugin, torch,
diffusers) once. A worker that dies mid-compile (a compiler crash) or hangs (no CPU progress for
:data:`wan_sharding.runtime.workers.STALL_SECONDS`) costs only the request it was compiling: that one is
recorded as failed and a fresh worker compiles the requests after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from ..runtime import scratch, workers
from . import sysdesc
from .request import CompileError, CompileRequest, CompileResult

# What compile_many writes into its work folder besides the requests' IR folders (prepare_descriptor,
# the worker and trace logs, IR folders of requests without their own).
WORK_FILES = (*(f"{arch}_*.ttsys" for arch in sysdesc.ARCHS), "worker_*.log", "trace_*.log", "ir_[0-9][0-9][0-9]")
WORKER_MODULE = "wan_sharding.compile.worker"
TRACE_MODULE = "wan_sharding.compile.xla_lowering"  # the torch-xla frontend's worker
# Lines the worker writes into its log (stdout and stderr merged) around each request, so the log
# can be cut into what the compiler printed for each (:func:`split_log`).
BEGIN_MARK = "@@wan_sharding.compile begin "
END_MARK = "@@wan_sharding.compile end "

def check_plugin() -> str:
    """The installed ``jax-tt-plugin`` version, or :class:`CompileError` saying how to get it."""
    version = sysdesc.installed_plugin_version()
    if version is None:
        known = sysdesc.known_schema_hashes()
        raise CompileError(
            f"{sysdesc.PLUGIN_DIST} is not installed, so tt-mlir cannot be run. "
            f"Fix: pip install '{sysdesc.PLUGIN_DIST}=={max(known)}' (with jax/jaxlib 0.7.1 and torchax)."
        )
    return version


def prepare_descriptor(arch: str, num_chips: int, directory: str | os.PathLike[str]) -> Path:
    """Write a ``num_chips`` descriptor for ``arch`` and check it against the installed plugin.

    A descriptor with more chips than a mesh needs works (JAX sees them all; the mesh takes the
    first ones), so one descriptor serves every mesh of a batch.
    """
    if arch not in sysdesc.ARCHS:
        raise CompileError(f"unknown arch {arch!r}; known: {', '.join(sysdesc.ARCHS)}")
    path = Path(directory) / f"{arch}_{num_chips}.ttsys"
    sysdesc.write_system_descriptor(path, arch, num_chips)
    try:
        data = path.read_bytes()
        sysdesc.check_plugin_schema(data)
        sysdesc.check_chip_count(data, num_chips)
    except sysdesc.SystemDescriptorError as e:
        raise CompileError(f"bad system descriptor {path}: {e}") from e
    return path


def worker_env(descriptor: str | os.PathLike[str], tmpdir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Environment for a plugin process: the descriptor set, no CPU-only JAX override, and
    ``tmpdir`` as its ``TMPDIR`` when given. The worker runner gives each worker a private one
    anyway (:func:`wan_sharding.runtime.scratch.worker_tmpdir`): the plugin copies the descriptor to the
    fixed path ``$TMPDIR/tt_pjrt_system_descriptor`` and deletes it when its process exits, and it
    unpacks its ~400 MB tt-metal runtime into ``$TMPDIR`` at every start, over what is there, so two
    plugin processes sharing one ``TMPDIR`` break each other (``docs/tt-mlir-notes.md``)."""
    env = dict(os.environ)
    env["TT_COMPILE_ONLY_SYSTEM_DESC"] = str(descriptor)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    env.pop("JAX_PLATFORMS", None)  # the tt platform must be picked up
    env.pop("XLA_FLAGS", None)  # host device counts are for the CPU stack
    return _importable(env)


def trace_env(num_devices: int) -> dict[str, str]:
    """Environment for a torch-xla frontend worker: torch-xla SPMD on ``num_devices`` CPU devices,
    and nothing of the tt plugin."""
    from ..backends.xla import XlaBackend

    env = XlaBackend.cpu_env(num_devices)
    env.pop("TT_COMPILE_ONLY_SYSTEM_DESC", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return _importable(env)


def _importable(env: dict[str, str]) -> dict[str, str]:
    workers.with_package_path(env)  # the worker imports this package: the same copy as the caller
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ------------------------------------------------------------------------------------ the log

_DIAG = re.compile(r"(error|failed|doesn't match|does not match|mismatch|exception|abort)", re.I)


def diagnostics(log: str, limit: int = 40) -> list[str]:
    """The compiler's error lines in a log slice (MLIR diagnostics, plugin errors)."""
    out = []
    for line in log.splitlines():
        if _DIAG.search(line) and "FutureWarning" not in line and "warnings.warn" not in line:
            out.append(line.strip()[:2000])
    return out[:limit]


def split_log(log: str) -> dict[int, str]:
    """Log text per request index, cut at the worker's begin/end marks."""
    pieces: dict[int, list[str]] = {}
    current: int | None = None
    for line in log.splitlines():
        if line.startswith(BEGIN_MARK):
            current = int(line[len(BEGIN_MARK):].split()[0])
            pieces[current] = []
            continue
        if line.startswith(END_MARK):
            current = None
            continue
        if current is not None:
            pieces[current].append(line)
    return {i: "\n".join(lines) for i, lines in pieces.items()}


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _result_from_worker(req: CompileRequest, raw: dict[str, Any], log: str) -> CompileResult:
    fields = {f.name for f in dataclasses.fields(CompileResult)} - {"request", "log", "diagnostics"}
    res = CompileResult(req, **{k: v for k, v in raw.items() if k in fields})
    res.log = log
    if not res.ok:
        res.diagnostics = diagnostics(log)
    return res


# ---------------------------------------------------------------------------------- compiling


def _run(params: dict[str, Any], env: dict[str, str], log_file: Path, timeout: float, python: str | None,
         verbose: bool) -> workers.WorkerRun:
    """One compile worker, start to exit. With ``verbose`` its log is echoed on stderr (stdout
    stays free for a command's own output, e.g. ``--json``)."""
    echo = contextlib.redirect_stdout(sys.stderr) if verbose else contextlib.nullcontext()
    try:
        with echo:
            return workers.run_worker(WORKER_MODULE, params, env, label="compile worker", log_file=log_file,
                                      timeout=timeout, echo=verbose, merge_stderr=True,
                                      stall_s=workers.STALL_SECONDS, retries_on_stall=0, python=python)
    except workers.WorkerError as e:
        raise CompileError(str(e)) from e


def compile_many(
    requests: Iterable[CompileRequest],
    arch: str = "wormhole_b0",
    *,
    timeout: float = 1800.0,
    work_dir: str | os.PathLike[str] | None = None,
    python: str | None = None,
    verbose: bool = False,
) -> list[CompileResult]:
    """Compile every request with tt-mlir in compile-only mode, in worker subprocesses.

    Args:
        requests: what to compile; results come back in the same order.
        arch: chip architecture of the system descriptor (``"wormhole_b0"`` or ``"blackhole"``).
        timeout: wall-clock seconds for all requests together.
        work_dir: where descriptors, logs and (for requests without ``out_dir``) IRs go;
            when ``None``, a fresh folder under this process's scratch root
            (:func:`wan_sharding.runtime.scratch.scratch_dir`), deleted when the process exits.
        python: interpreter for the worker (default: this one).
        verbose: echo the worker log to stderr as it runs.

    Returns:
        One :class:`CompileResult` per request. A graph tt-mlir rejects is a result with
        ``ok=False``, not an exception; so is a request whose worker crashed or hung.

    Raises:
        CompileError: plugin missing, unknown arch, bad descriptor, an invalid request, the
            worker failing to start or to get to its first request, or the timeout.
    """
    reqs = [r.validate() for r in requests]
    if not reqs:
        return []
    if arch not in sysdesc.ARCHS:
        raise CompileError(f"unknown arch {arch!r}; known: {', '.join(sysdesc.ARCHS)}")
    check_plugin()
    reqs = [for_arch(r, arch) for r in reqs]
    work = Path(work_dir) if work_dir is not None else scratch.scratch_dir("compile-")
    work.mkdir(parents=True, exist_ok=True)
    desc = prepare_descriptor(arch, max(r.num_devices for r in reqs), work)
    # Give every request its own IR folder so the exported files cannot be confused.
    reqs = [r if r.out_dir else dataclasses.replace(r, out_dir=str(work / f"ir_{i:03d}")) for i, r in enumerate(reqs)]

    results: dict[int, CompileResult] = {}
    deadline = time.monotonic() + timeout
    traced = _trace_torch_xla(reqs, work, deadline, python, verbose)
    for i, t in traced.items():
        if not t.get("ok"):
            results[i] = CompileResult(reqs[i], ok=False, error=t.get("error"), out_dir=reqs[i].out_dir,
                                       log=t.get("log", ""))
    pending = [i for i in range(len(reqs)) if i not in results]
    attempt = 0
    hung_at_start = 0
    while pending:
        attempt += 1
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CompileError("compile timeout reached before all requests were compiled")
        params = {"requests": [{"index": i, **reqs[i].to_json(), **({"traced": traced[i]} if i in traced else {})}
                               for i in pending]}
        log_file = work / f"worker_{attempt}.log"
        run = _run(params, worker_env(desc), log_file, remaining, python, verbose)
        if run.timed_out:
            raise CompileError(f"compile worker timed out after {remaining:.0f} s; log: {log_file}")
        log = run.output
        pieces = split_log(log)
        done = set()
        for raw in run.results:
            raw = dict(raw)
            i = raw.pop("index")
            results[i] = _result_from_worker(reqs[i], raw, pieces.get(i, ""))
            done.add(i)
        left = [i for i in pending if i not in done]
        if not left:
            break
        if run.ok and not run.stalled:
            raise CompileError(f"worker exited cleanly without results for {len(left)} request(s); log: {log_file}")
        # The worker died (a compiler crash takes the process down) or hung while compiling the
        # first request without a result: record that one, run the rest in a fresh worker.
        dead = left[0]
        started = dead in pieces
        if not started and not done:
            if run.stalled and not hung_at_start:
                hung_at_start += 1  # hung in its start-up (a jaxlib deadlock): one fresh worker more
                continue
            what = "hung" if run.stalled else "failed"
            raise CompileError(
                f"the compile worker {what} before compiling anything (exit code {run.returncode}); "
                f"last log lines:\n{_tail(log)}\nfull log: {log_file}"
            )
        why = (f"compiler process hung (no CPU progress for {workers.STALL_SECONDS} s) and was stopped"
               if run.stalled else f"compiler process died (exit code {run.returncode})")
        results[dead] = CompileResult(
            reqs[dead], ok=False, error=f"{why} while compiling {reqs[dead].label()}",
            diagnostics=diagnostics(pieces.get(dead, log)), out_dir=reqs[dead].out_dir,
            log=pieces.get(dead, _tail(log)),
        )
        pending = left[1:]
    return [results[i] for i in range(len(reqs))]


# Why level >= 1 compiles add the patchify patch (one line, recorded in the request's notes).
CONV3D_NOTE = ("optimization level >= 1 validates every op on tt-metal's mock device and ttnn::conv3d (the patch "
               "embedding) has no op model there ('ttnn::conv3d is not linked'); added the exact 'patchify' patch")


def for_arch(req: CompileRequest, arch: str) -> CompileRequest:
    """``req`` as it can compile here for ``arch``: its options resolved (the optimization level
    lowered where level >= 1 cannot run, :func:`.options.effective_options`), the ``patchify``
    patch added to a DiT at level >= 1; each change recorded in ``notes`` with its reason."""
    from .options import effective_options

    options, why = effective_options(req.options(), arch, req.num_devices)
    notes = list(req.notes)
    patches = tuple(req.patches)
    if why and why not in notes:
        notes.append(why)
    if options.optimization_level >= 1 and "patchify" not in patches and req.component == "dit":
        patches += ("patchify",)
        notes.append(CONV3D_NOTE)
    return dataclasses.replace(req, compile_options=options.to_json(), notes=tuple(notes), patches=patches)


def _trace_batches(reqs: list[CompileRequest]) -> list[list[int]]:
    """The torch-xla requests in trace-worker batches: a full-width trace alone in its worker (the
    weights a trace placed stay in that process: it needs all of the host memory it can get), tiny
    ones together per device count (torch-xla SPMD sees a fixed number of devices per process), so
    a tiny compile does not pay a worker start-up per graph."""
    batches: list[list[int]] = []
    tiny: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        if r.frontend != "torch-xla":
            continue
        if r.size == "tiny":
            if r.num_devices not in tiny:
                tiny[r.num_devices] = []
                batches.append(tiny[r.num_devices])
            tiny[r.num_devices].append(i)
        else:
            batches.append([i])
    return batches


def _trace_torch_xla(reqs: list[CompileRequest], work: Path, deadline: float, python: str | None,
                     verbose: bool) -> dict[int, dict[str, Any]]:
    """Run the torch-xla frontend for the requests that ask for it, in fresh trace workers
    (:func:`_trace_batches`). Returns ``{request index: trace result}``; a trace that failed is a
    result with ``ok`` False."""
    traced: dict[int, dict[str, Any]] = {}
    for batch in _trace_batches(reqs):
        r = reqs[batch[0]]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CompileError("compile timeout reached before the torch-xla traces were done")
        log_file = work / f"trace_{batch[0]:03d}.log"
        params = {"requests": [{"index": i, **reqs[i].to_json()} for i in batch]}
        label = r.label() if len(batch) == 1 else f"{len(batch)} tiny graphs from {r.label()}"
        echo = contextlib.redirect_stdout(sys.stderr) if verbose else contextlib.nullcontext()
        try:
            with echo:
                run = workers.run_worker(TRACE_MODULE, params, trace_env(r.num_devices), label=f"torch-xla trace of {label}",
                                         log_file=log_file, timeout=remaining, echo=verbose, merge_stderr=True,
                                         retries_on_stall=1, python=python)
        except workers.WorkerError as e:
            raise CompileError(str(e)) from e
        for raw in run.results:
            raw = dict(raw)
            traced[raw.pop("index")] = raw
        for i in batch:
            if i in traced:
                continue
            # SIGKILL with no watchdog involved is the kernel's OOM killer: torch-xla holds every
            # weight shard once per virtual device, so SP multiplies the host memory a trace needs.
            oom = run.returncode == -9 and not (run.stalled or run.timed_out)
            why = ("killed, most likely out of host memory (torch-xla keeps each weight shard once per virtual "
                   "device: fewer blocks or a smaller mesh fit)" if oom else f"ended (exit code {run.returncode})")
            traced[i] = {"ok": False, "log": _tail(run.output),
                         "error": f"torch-xla trace worker {why} before {reqs[i].label()} was traced; log: {log_file}"}
    return traced


def compile_dit(request: CompileRequest | None = None, arch: str = "wormhole_b0", **kwargs: Any) -> CompileResult:
    """Compile one request (or ``CompileRequest(**kwargs)``); see :func:`compile_many`."""
    req = request if request is not None else CompileRequest(**kwargs)
    return compile_many([req], arch)[0]
