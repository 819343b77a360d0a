"""Test-session setup.

This pytest process runs JAX on 8 CPU devices for the in-process hook tests; torch-xla and the
tt-mlir compiler only ever run in subprocesses the tests start (each stack in its own process:
both read XLA_FLAGS, and the Tenstorrent plugin breaks JAX's CPU backend unless JAX_PLATFORMS=cpu).
"""

import contextlib
import os
import shutil
import signal
import tempfile
import warnings
from pathlib import Path

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
# XLA's CPU code generation without LLVM's expensive passes: every tiny-model compile in the suite
# (here and in the workers, which keep the user's other XLA flags) takes about 2.5x less time.
# SPMD partitioning, and so every collective the tests count, is untouched; results differ from the
# default build by float reordering only (the same max-abs on the PCC cases; docs/check.md).
CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {CPU_COMPILE_FLAGS}"
os.environ.pop("TT_COMPILE_ONLY_SYSTEM_DESC", None)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# This process's JAX runs on the CPU: it need not load the Tenstorrent plugin, which unpacks its
# runtime at every load (wan_sharding.backends.jax_plugins.keep_plugins_out_of_cpu_jax).
from wan_sharding.backends.jax_plugins import keep_plugins_out_of_cpu_jax  # noqa: E402

keep_plugins_out_of_cpu_jax()

# A suite started in the background by a shell without job control inherits SIGINT ignored, and so
# would every command the tests interrupt as Ctrl-C does (they would carry on and exit 0): restore
# Ctrl-C, which the children then get as Python's default (a handler is not inherited across exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ``pytest -m tt`` on a mesh of several hosts (tests/test_tt_hardware.py; docs/tt-backend.md): the
# commands' launch options, checked here before any test runs (a bad one is one line, exit 4).
LAUNCH_OPTIONS = ("rank-binding", "hosts", "hostfile", "controller", "tcp-iface", "rsh-agent")


def pytest_addoption(parser):
    group = parser.getgroup("tt", "pytest -m tt on several hosts (tt-xla's distributed runtime)")
    for name in LAUNCH_OPTIONS:
        group.addoption(f"--{name}", default=None, help=f"as the commands' --{name} (docs/tt-backend.md)")
    group.addoption("--dry-run", action="store_true",
                    help="print the mesh, rank binding, hosts and the tt worker's environment; run no test")


def launch_options(config) -> dict:
    return {name.replace("-", "_"): config.getoption(name.replace("-", "_")) for name in (*LAUNCH_OPTIONS, "dry-run")}


def pytest_configure(config):
    import pytest

    options = launch_options(config)
    if not any(options.values()):
        return
    from wan_sharding.jobs.first_run import marker_launch

    try:
        mesh, distributed = marker_launch(options)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    if options["dry_run"]:
        from wan_sharding.cli.dryrun import launch_report
        from wan_sharding.mesh import mesh_from_preset

        meshes = [(f"the tt run's mesh {mesh}", mesh_from_preset(mesh))] if mesh else []
        print("pytest -m tt: dry run, nothing was started")
        print("\n".join(launch_report(meshes, distributed)))
        pytest.exit("dry run", returncode=0)
# Every process the tests start (commands, their workers, scripts) gets an empty TMPDIR of its own,
# which must be empty again after each test module: no command leaves anything in the temp dir,
# finished, failed or interrupted (wan_sharding.runtime.scratch). This process keeps the usual temp dir,
# where pytest's tmp_path folders live.
tempfile.tempdir = tempfile.gettempdir()
COMMANDS_TMPDIR = Path(tempfile.mkdtemp(prefix="wan-sharding-tests-tmpdir-"))
os.environ["TMPDIR"] = str(COMMANDS_TMPDIR)


@pytest.fixture(scope="module", autouse=True)
def commands_leave_an_empty_tmpdir():
    """After each module: nothing the module's commands and workers started is left in their
    TMPDIR (what is there is named, then removed so the next module starts clean)."""
    yield
    left = sorted(COMMANDS_TMPDIR.iterdir())
    for path in left:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    assert not left, f"left in the commands' TMPDIR: {[p.name for p in left]}"


# The files whose module fixtures take the longest (a minute or more of one core each): collected
# first, so that with `-n 2 --dist loadfile` (pyproject.toml) they start at once on the two processes
# and the short files fill in beside them, instead of one of them running alone at the end.
LONG_FILES = ("test_tt_contract.py", "test_tt_vae_contract.py", "test_vae.py", "test_serve.py", "test_workers.py",
              "test_cache.py", "test_pcc.py", "test_plan_pipeline.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: each file's order kept


def pytest_unconfigure(config):
    shutil.rmtree(COMMANDS_TMPDIR, ignore_errors=True)


@contextlib.contextmanager
def stock_rotary_in_bf16():
    """For an in-process torchax trace of diffusers' own attention processor in bf16: its
    interleaved rotary writes float32 products into a bf16 tensor, which JAX 0.7.1's scatter casts
    with a FutureWarning (the same values torch gives). Workers drop that one warning by message and
    module (wan_sharding.runtime.noise); here it is dropped inside the block only, by its message."""
    from wan_sharding.runtime.noise import HARMLESS

    (entry,) = [e for e in HARMLESS if e.category is FutureWarning]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", entry.message, FutureWarning)
        yield
