"""The one worker runner (wan_sharding.runtime.workers): protocol, watchdog, cleanup, atomic files, and
that interrupting a command leaves none of its workers running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import CPU_COMPILE_FLAGS

from wan_sharding.runtime.workers import PARENT_ENV, atomic_path, atomic_write, run_worker

ROOT = Path(__file__).resolve().parents[1]


def _worker_module(tmp_path: Path, body: str) -> tuple[str, dict[str, str]]:
    """A throwaway worker module ``fake_worker`` on PYTHONPATH, running ``body`` as its job."""
    (tmp_path / "fake_worker.py").write_text(textwrap.dedent('''
        import sys, time
        from wan_sharding.runtime.workers import emit, worker_main

        def job(params):
        ''') + textwrap.indent(textwrap.dedent(body), "    ") + "\nsys.exit(worker_main(job))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    return "fake_worker", env


def test_protocol_params_in_results_out(tmp_path):
    module, env = _worker_module(tmp_path, '''
        emit({"early": params["x"]})
        print("a log line")
        print("to stderr", file=sys.stderr)
        return [{"late": params["x"] * 2}]
    ''')
    run = run_worker(module, {"x": 21}, env, label="fake")
    assert run.ok and run.results == [{"early": 21}, {"late": 42}]
    assert "a log line" in run.output and "to stderr" in run.output  # merged when not echoing
    assert "RESULT" not in run.output


def test_a_worker_gets_a_private_tmpdir_and_no_harmless_noise(tmp_path):
    """Each worker writes its temporary files in a TMPDIR of its own, deleted when it stops (what
    it left there included); the known-harmless third-party messages are dropped by message and
    module (wan_sharding.runtime.noise): the real ones, from flax's import and from a JAX scatter called
    from diffusers' Wan module, while the same messages from anywhere else still show."""
    wan = tmp_path / "diffusers" / "models" / "transformers" / "transformer_wan.py"
    wan.parent.mkdir(parents=True)
    wan.write_text("import jax.numpy as jnp\n\ndef rotary():\n"
                   "    return jnp.zeros(4, jnp.bfloat16).at[:1].set(jnp.ones(1, jnp.float32))\n")
    module, env = _worker_module(tmp_path, f'''
        import importlib.util, logging, os, tempfile
        from wan_sharding.runtime import noise
        from wan_sharding.backends.jax_plugins import keep_plugins_out_of_cpu_jax
        keep_plugins_out_of_cpu_jax()  # CPU JAX, as a jax worker runs it
        import jax.numpy as jnp
        logging.getLogger("absl").warning("Tensorflow library not found, said elsewhere")
        import flax.io  # logs the harmless one (absl) at import
        spec = importlib.util.spec_from_file_location("wan_like", {str(wan)!r})
        wan_like = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(wan_like)
        wan_like.rotary()  # the scatter's FutureWarning, from diffusers' Wan module: dropped
        jnp.zeros(4, jnp.bfloat16).at[:1].set(jnp.ones(1, jnp.float32))  # the same from here: shown
        open(os.path.join(tempfile.gettempdir(), "left-behind"), "w").close()
        return [{{"tmpdir": tempfile.gettempdir(), "dropped": noise.dropped(), "tqdm": os.environ.get("TQDM_DISABLE")}}]
    ''')
    run = run_worker(module, {}, env, label="fake")
    assert run.ok, run.output
    (r,) = run.results
    assert Path(r["tmpdir"]).name.startswith("worker-") and not Path(r["tmpdir"]).exists()
    assert set(r["dropped"].values()) == {1} and len(r["dropped"]) == 2, r["dropped"]
    assert "said elsewhere" in run.output and "Tensorflow library not found, tensorflow.io" not in run.output
    assert run.output.count("scatter inputs have incompatible types") == 1, run.output
    assert r["tqdm"] == "1"  # its stderr is a pipe: no progress bars


def test_roots_of_processes_that_died_are_swept(tmp_path):
    """A command killed outright (SIGKILL) cannot remove its scratch root; the next one that makes
    a root removes the roots of processes that are gone, and only those."""
    from wan_sharding.runtime import scratch

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (gone, live.pid):
            (tmp_path / f"{scratch.ROOT_PREFIX}{pid}-x" / "worker-1").mkdir(parents=True)
        (tmp_path / "someone-elses").mkdir()
        assert [p.name for p in scratch.sweep(tmp_path)] == [f"{scratch.ROOT_PREFIX}{gone}-x"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{scratch.ROOT_PREFIX}{live.pid}-x",
                                                                    "someone-elses"])
    finally:
        live.kill()
        live.wait()


def test_a_scratch_folder_goes_when_its_work_ends_and_a_given_one_stays(tmp_path):
    """What the planner compiles in without ``--out`` (``scratch.folder``): removed however the
    block ends; a folder the caller names is kept."""
    from wan_sharding.runtime import scratch

    with pytest.raises(KeyboardInterrupt):
        with scratch.folder(None, "plan-") as work:
            (work / "round_1").mkdir()
            raise KeyboardInterrupt
    assert not work.exists() and work.parent == scratch.scratch_root()
    with scratch.folder(tmp_path / "kept", "plan-") as kept:
        (kept / "ir.mlir").write_text("module {}")
    assert (tmp_path / "kept" / "ir.mlir").exists()


def test_a_hung_worker_is_restarted_then_reported(tmp_path):
    module, env = _worker_module(tmp_path, '''
        time.sleep(60)  # uses no CPU: looks exactly like the jaxlib deadlock
    ''')
    start = time.monotonic()
    run = run_worker(module, {}, env, label="sleeper", stall_s=3, retries_on_stall=1)
    assert run.stalled and not run.ok
    assert run.output.count("made no progress") == 1  # the note of the last attempt
    assert time.monotonic() - start < 30  # two attempts of ~3-5 s, not 60 s


def test_a_hung_worker_whose_waiting_thread_still_ticks_is_caught(tmp_path):
    # The jaxlib deadlock as it really looks: not zero CPU, since a thread waiting for the GIL wakes
    # every few milliseconds. The watchdog goes by the share of a core used, not by "no CPU at all".
    module, env = _worker_module(tmp_path, '''
        end = time.time() + 60
        while time.time() < end:
            time.sleep(0.005)
    ''')
    start = time.monotonic()
    run = run_worker(module, {}, env, label="ticker", stall_s=3, retries_on_stall=0)
    assert run.stalled and not run.ok
    assert time.monotonic() - start < 30


def test_a_worker_past_its_timeout_is_stopped(tmp_path):
    module, env = _worker_module(tmp_path, '''
        end = time.time() + 60
        while time.time() < end:  # busy: not a stall
            pass
    ''')
    run = run_worker(module, {}, env, label="spinner", timeout=3)
    assert run.timed_out and not run.ok and "limit" in run.output


def test_a_worker_whose_child_does_the_work_is_not_taken_for_hung(tmp_path):
    # What a level-1 compile looks like: the worker waits while compilers it started (cc1plus under
    # the g++ driver) use the CPU. The watchdog counts the worker's whole process tree.
    module, env = _worker_module(tmp_path, f'''
        import subprocess
        busy = "import time\\nend = time.time() + 6\\nwhile time.time() < end: pass"
        subprocess.run(["sh", "-c", f"{sys.executable} -c '{{busy}}'; echo done"], check=True)
        return [{{"child": "finished"}}]
    ''')
    run = run_worker(module, {}, env, label="waiter", stall_s=3, retries_on_stall=0)
    assert run.ok and not run.stalled, run.output
    assert run.results == [{"child": "finished"}]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("how", ["hung", "exits"])
def test_no_child_outlives_its_worker(tmp_path, how):
    # A worker starts a grandchild through a shell (in its process group) and, when it hangs, a
    # child in a session of its own (out of its group, found through its parent). Whether the
    # watchdog stops the worker or the worker exits by itself, none of them is left running.
    # (They write nowhere: one holding the worker's output would also keep the caller reading.)
    module, env = _worker_module(tmp_path, f'''
        import subprocess
        quiet = dict(stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sh = subprocess.Popen(["sh", "-c", "sleep 600 >/dev/null & echo $!; wait"], stdout=subprocess.PIPE,
                              text=True, **quiet)
        pids = [sh.pid, int(sh.stdout.readline())]
        if {how!r} == "hung":
            pids.append(subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL,
                                         **quiet).pid)
        emit({{"pids": pids}})
        if {how!r} == "hung":
            time.sleep(60)
    ''')
    run = run_worker(module, {}, env, label=how, stall_s=2, retries_on_stall=0)
    assert run.stalled == (how == "hung") and run.ok == (how == "exits"), run.output
    pids = run.results[0]["pids"]
    assert len(pids) == (3 if how == "hung" else 2)
    deadline = time.monotonic() + 5  # init reaps the killed orphans
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


def test_atomic_write_leaves_nothing_when_interrupted(tmp_path):
    target = tmp_path / "out" / "result.json"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert not target.exists() and list(target.parent.iterdir()) == []
    atomic_write(target, "whole\n")
    assert target.read_text() == "whole\n" and [p.name for p in target.parent.iterdir()] == ["result.json"]
    assert target.stat().st_mode & 0o044  # readable by others, as a plain write would be


# ---- interrupting a command ------------------------------------------------------------------


def _workers_of(pid: int) -> list[int]:
    """Live processes started by the runner on behalf of process ``pid``."""
    marker = f"{PARENT_ENV}={pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in env.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def _interrupt_when_working(cmd: list[str], sig: int, settle_s: float = 4.0, env: dict[str, str] | None = None,
                            ready=None) -> tuple[int, int, str]:
    """Start ``cmd``, wait until its worker runs (and ``ready()`` holds), let it work ``settle_s``,
    send ``sig`` to the command (as Ctrl-C does to the foreground process); returns (rc, workers
    left, stderr)."""
    env = {**os.environ, **(env or {})}
    env.pop("JAX_PLATFORMS", None)  # the command sets up its workers' environments itself
    env["XLA_FLAGS"] = CPU_COMPILE_FLAGS  # without the suite's device count
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _workers_of(proc.pid) or (ready is not None and not ready()):
            assert proc.poll() is None, f"the command ended before it started a worker: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "no worker appeared within 120 s"
            time.sleep(0.2)
        time.sleep(settle_s)
        assert _workers_of(proc.pid), "the worker ended by itself before the interrupt"
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        stderr = proc.stderr.read()
        left = _workers_of(proc.pid)
        for _ in range(20):  # a killed process may take a moment to disappear
            if not left:
                break
            time.sleep(0.25)
            left = _workers_of(proc.pid)
        return rc, len(left), stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _workers_of(proc.pid):
            os.kill(pid, signal.SIGKILL)


CLI = [sys.executable, "-m", "wan_sharding.cli"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_generate_stops_its_worker_and_writes_nothing(tmp_path, sig):
    out = tmp_path / "generate"
    rc, left, stderr = _interrupt_when_working(
        [*CLI, "generate", "--mesh", "1x4", "--backend", "jax", "--steps", "500", "--out", str(out)], sig)
    assert left == 0
    assert rc == 130, stderr[-2000:]
    assert "interrupted" in stderr
    assert not out.exists() or not [p for p in out.iterdir() if not p.name.startswith(".")]


def test_a_command_killed_outright_is_cleaned_up_by_the_next(tmp_path):
    """SIGKILL gives a command no chance to clean up: its worker dies with it (parent-death signal)
    and its scratch root stays, with torch's import-time temp folder beside it; the next command
    that makes a root (the same ``sweep``) removes both, and the temp dir is empty again."""
    from wan_sharding.runtime import scratch

    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    rc, left, _ = _interrupt_when_working([*CLI, "generate", "--mesh", "1x4", "--steps", "500", "--out",
                                           str(tmp_path / "out")], signal.SIGKILL, settle_s=0.5,
                                          env={"TMPDIR": str(tmp)})
    assert rc == -signal.SIGKILL and left == 0
    names = sorted(p.name for p in tmp.iterdir())
    assert len(names) == 2 and names[0].startswith("tmp") and names[1].startswith(scratch.ROOT_PREFIX), names
    assert len(scratch.sweep(tmp)) == 2 and list(tmp.iterdir()) == []


def test_ctrl_c_mid_compile_stops_its_worker_and_leaves_an_empty_tmpdir(tmp_path):
    """Ctrl-C once the compile worker has loaded the Tenstorrent plugin, which unpacked its runtime
    (~400 MB) into the worker's TMPDIR: no worker is left, no report, and the command's TMPDIR is
    empty again."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    loaded = lambda: any(tmp.glob("wan_sharding-*/worker-*/libtt-tt-metal-runtime-assets-*"))  # noqa: E731
    rc, left, stderr = _interrupt_when_working(
        [*CLI, "compile", "--size", "tiny", "--mesh", "1x4", "--blocks", "1",
         "--out", str(tmp_path / "ir")], signal.SIGINT, settle_s=1.0, env={"TMPDIR": str(tmp)}, ready=loaded)
    assert left == 0
    assert rc == 130, stderr[-2000:]
    assert not (tmp_path / "ir" / "report.json").exists()
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("backend,count", [("jax", "--xla_force_host_platform_device_count=4"), ("xla", None)])
def test_cpu_workers_keep_the_users_xla_flags_and_set_their_own_device_count(monkeypatch, backend, count):
    from wan_sharding.jobs import launch

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/hlo")
    env = launch.worker_env(backend, 4)
    # torch-xla counts its CPU devices with CPU_NUM_DEVICES; JAX's count flag would confuse its client
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/hlo"] + ([count] if count else [])
    assert backend == "jax" or env["CPU_NUM_DEVICES"] == "4"
    monkeypatch.delenv("XLA_FLAGS")
    assert ("XLA_FLAGS" in launch.worker_env(backend, 4)) == (backend == "jax")


def test_a_jax_cpu_worker_starts_without_the_tenstorrent_plugin():
    """A CPU JAX worker (its environment from the package, ``prepare_worker("jax")`` first) loads no
    PJRT plugin: the Tenstorrent plugin would unpack its runtime at every start and can fail when
    two workers load it at once (``keep_plugins_out_of_cpu_jax``). JAX still sees its 8 CPU devices."""
    from wan_sharding.jobs.launch import worker_env

    probe = textwrap.dedent('''
        import sys
        from wan_sharding.jobs.launch import prepare_worker
        prepare_worker("jax")
        import jax
        print(len(jax.devices()), jax.devices()[0].platform, "jax_plugins.libtt" in sys.modules)
    ''')
    run = subprocess.run([sys.executable, "-c", probe], env=worker_env("jax", 8), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["8", "cpu", "False"]
    assert "failed to extract" not in run.stderr
