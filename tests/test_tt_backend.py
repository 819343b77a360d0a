"""The ``tt`` backend from the command line, without Tenstorrent's stack: every command that runs a
forward accepts it, and without the stack says in one line what is missing and how to get it, then
exits 1 before any worker starts. Also the environment a tt worker gets. No worker runs here; the
commands run as ``python -m wan_sharding.cli`` subprocesses (this pytest process keeps JAX on CPU).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from wan_sharding.backends import BackendError
from wan_sharding.backends.tt import TT_INSTALL, tt_stack_missing
from wan_sharding.cli import build_parser
from wan_sharding.jobs import launch

@pytest.mark.parametrize("argv", [
    ["profile", "--backend", "tt"],
    ["generate", "--backend", "tt"],
    ["check", "--backends", "jax", "tt", "--meshes", "2x4"],  # refused before the jax worker starts too
])
def test_command_without_the_stack_says_what_is_missing_in_one_line(argv):
    assert build_parser().parse_args(argv)  # accepted by argparse: not a usage error
    if tt_stack_missing() is None:
        pytest.skip("Tenstorrent's stack is installed here: the command would run")
    proc = subprocess.run([sys.executable, "-m", "wan_sharding.cli", *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("wan-sharding: the tt backend needs Tenstorrent's torch stack")
    assert "tt_torch" in lines[0] and TT_INSTALL in lines[0] and "xla or jax backend" in lines[0]
    assert proc.stdout == ""  # no worker ran, no check row printed


def test_an_unknown_backend_is_still_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["profile", "--backend", "cuda"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_library_callers_get_the_same_line_before_a_worker_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "tt_torch", None)  # the plugin missing, even where it is installed
    with pytest.raises(BackendError, match="pjrt-plugin-tt.*Tenstorrent's package index") as err:
        launch.worker_env("tt", 8)
    assert "\n" not in str(err.value)
    from wan_sharding.jobs.check import Case, run_in_subprocess

    with pytest.raises(BackendError):
        run_in_subprocess("tt", "2x4", [Case()])
    launch.check_stacks(["xla", "jax"])  # the CPU backends need nothing more


def test_a_tt_worker_runs_on_the_chips_with_the_users_environment(monkeypatch):
    import types

    # A stand-in for Tenstorrent's plugin package, so the stack counts as present (it is not here).
    monkeypatch.setitem(sys.modules, "tt_torch", types.ModuleType("tt_torch"))
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # what the CLI defaults its own process to
    monkeypatch.setenv("CPU_NUM_DEVICES", "8")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/hlo")
    monkeypatch.setenv("TT_USER_SETTING", "kept")
    monkeypatch.delenv("PYTHONPATH", raising=False)  # as on a fresh clone: the root comes from the package
    env = launch.worker_env("tt", 8)
    assert env["PJRT_DEVICE"] == "TT" and env["CONVERT_SHLO_TO_SHARDY"] == "1"
    assert "CPU_NUM_DEVICES" not in env
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/hlo"
    assert env["TT_USER_SETTING"] == "kept"
    import wan_sharding

    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(wan_sharding.__file__).resolve().parents[1])
