"""Several hosts as one mesh through tt-xla's distributed runtime: the rank bindings, the launch
checks, ``--dry-run``, the planner's hosts, and a contract test of the tt worker's environment.

This is a **contract test**: Tenstorrent's stack (``pjrt-plugin-tt``, its distributed worker,
tt-metal's ``tt-run`` and MPI) cannot be installed here, and there are no hosts of Galaxies. What
stands in for it, and nothing else:

- a stand-in plugin directory on ``PYTHONPATH``: packages ``pjrt_plugin_tt`` (with an executable
  ``bin/ttmlir/runtime/distributed/worker``, where the wheel ships the worker binary) and
  ``tt_torch`` (empty: the stack counts as installed), and a ``sitecustomize`` that, in a process
  started as a tt worker (``PJRT_DEVICE=TT``), writes the environment it was started with to a file
  and exits, where tt-xla's plugin would read it (when it creates its PJRT client);
- for ``serve``, a resident worker that records its environment at every start
  (``tests/tt_controller_standin.py``).

The real CLI runs as ``python -m wan_sharding.cli`` and starts its real worker through the package's
worker runner; the expected variables are written out here from tt-xla's topology helper
(tenstorrent/tt-xla ``scripts/multihost_topology.py``, ``get_env_vars`` and ``TOPOLOGIES``, main
2026-08-21), not computed by the code under test. The binding table is checked against the names
tt-xla's plugin maps (``pjrt_implementation/src/api/client_instance.cc``, ``getRankBindingPath``)
and the shapes of tt-metal's descriptors (docs/tt-backend.md, "Beyond one host").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wan_sharding.backends import tt_distributed as td
from wan_sharding.cli import main, parse_and_validate
from wan_sharding.systems import RANK_BINDINGS, galaxies, host_cuts, served_presets

ROOT = Path(__file__).resolve().parents[1]
WORKER = "bin/ttmlir/runtime/distributed/worker"
# What stays apart when two runs of the CLI are compared: the worker runner's parent pid and the
# stand-in's own output path.
BOOKKEEPING = ("WAN_SHARDING_PARENT", "WAN_STANDIN_ENV")


# ------------------------------------------------------------------------------ the bindings


def test_the_bindings_are_the_plugins_with_tt_metals_shapes():
    # client_instance.cc, getRankBindingPath: every name the plugin maps to a tt-metal file
    assert set(RANK_BINDINGS) == {"2x4_multiprocess", "dual_bh_quietbox", "dual_t3k", "dual_galaxy", "quad_galaxy",
                                  "dual_exabox_galaxy", "quad_exabox_galaxy", "dual_bh_loudbox_1x16"}
    # the helper's TOPOLOGIES (n300_llmbox runs the binding 2x4_multiprocess)
    assert {n for n, b in RANK_BINDINGS.items() if b.in_helper} == {
        "quad_galaxy", "dual_galaxy", "dual_bh_quietbox", "dual_t3k", "dual_bh_loudbox_1x16", "2x4_multiprocess"}
    # (device_topology, host_topology, hosts, arch) of each mesh graph descriptor the binding names
    shapes = {"quad_galaxy": ((8, 16), (1, 4), 4, "wormhole_b0"), "dual_galaxy": ((8, 8), (1, 2), 2, "wormhole_b0"),
              "quad_exabox_galaxy": ((32, 4), (4, 1), 4, "blackhole"),
              "dual_exabox_galaxy": ((16, 4), (2, 1), 2, "blackhole"),
              "dual_bh_quietbox": ((2, 4), (1, 2), 2, "blackhole"), "dual_t3k": ((1, 16), (1, 2), 2, "wormhole_b0"),
              "dual_bh_loudbox_1x16": ((1, 16), (1, 2), 2, "blackhole"),
              "2x4_multiprocess": ((2, 4), (1, 2), 1, "wormhole_b0")}
    for name, (grid, ranks, hosts, arch) in shapes.items():
        b = RANK_BINDINGS[name]
        assert (b.grid, b.ranks, b.hosts, b.arch) == (grid, ranks, hosts, arch), name
    for b in RANK_BINDINGS.values():  # a Galaxy system is one host per Galaxy, as systems.py cuts it
        if "galaxy" in b.name:
            assert galaxies(b.grid) == b.ranks and b.chips_per_rank == 32
    assert dict(RANK_BINDINGS["dual_t3k"].extra_env) == {"TT_RUNTIME_USING_DUALT3K": "1"}
    served = {n: served_presets(b) for n, b in RANK_BINDINGS.items()}
    assert served["quad_galaxy"] == ["8x16-quad-galaxy"] and served["dual_galaxy"] == ["8x8-dual-galaxy"]
    assert served["quad_exabox_galaxy"] == ["4x32-tt-metal", "32x4"]  # the view tt-mlir compiles first
    assert served["dual_exabox_galaxy"] == ["4x16-tt-metal", "16x4"] and served["dual_t3k"] == []


def test_what_crosses_hosts_on_four_galaxies_worked_by_hand():
    cuts = host_cuts((4, 32))  # one host per Galaxy: 4 along the 32-long axis
    assert (cuts.hosts, cuts.crossing_axes(), cuts.segment(1)) == (4, (1,), 8)
    # A ring all-gather over 32 chips: each chip sends half its chunk each way every step, so each
    # of the 4 cuts carries half a chunk in each direction: 4 chunks per step, 31 steps, 4 rows.
    assert cuts.link_bytes("all_gather", 1.0, 1) == 4 * 31 * 4
    assert cuts.link_bytes("all_reduce", 1.0, 1) == 2 * 4 * 31 * 4  # reduce-scatter + all-gather
    assert cuts.link_bytes("all_reduce", 1.0, 0) == 0  # the 4-long axis stays inside each Galaxy
    # A CFG split's halves: every chip swaps with the one 16 away; each route crosses 2 cuts.
    assert cuts.pair_exchange_bytes(1.0, 1) == 4 * 32 * 2
    half = cuts.part(1, 2)
    assert (half.grid, half.ranks, half.wraps) == ((4, 16), (1, 2), (True, False))
    assert host_cuts((8, 4)) is None and host_cuts((2, 4), RANK_BINDINGS["2x4_multiprocess"]) is None
    assert host_cuts((2, 4), RANK_BINDINGS["dual_bh_quietbox"]).crossing_axes() == (1,)


def test_the_planner_names_the_axis_that_crosses_hosts_and_its_bytes():
    from wan_sharding.planner import plan_sharding

    report = plan_sharding("4x32-tt-metal", "blackhole", resolution="720p", compile=False)
    data = report.to_json()
    assert data["hosts"] == {"hosts": 4, "source": "one host per Galaxy", "rank_binding": None,
                             "crossing_axes": [{"axis": "cols", "chips_per_host": 8}]}
    tt_metal = next(c for c in data["candidates"] if c["name"] == "4x32 sp32[cols] tp4[rows] replicated-D mask")
    assert not tt_metal["tp_crosses_hosts"]
    # By hand: per block the K and V all-gathers over cols, 75776 / 32 = 2368 tokens x 5120 / 4
    # channels each, K in bf16 and V in f32 (the mask mode): 496 chunks cross hosts per gather (the
    # test above); TP's all-reduces stay on rows. 40 blocks, 2 forwards per step.
    chunk = 2368 * 1280 * (2 + 4)
    assert tt_metal["cross_host_gb_per_step"] == pytest.approx(496 * chunk * 40 * 2 / 1e9, rel=1e-4)
    from wan_sharding.planner.report import format_report

    text = format_report(report, data)
    assert "hosts: 4 (one host per Galaxy); crossing hosts: cols every 8 chips" in text
    assert "crosses hosts: cols (SP); TP stays inside each host;" in text


def test_the_planner_keeps_tp_inside_a_host_unless_it_is_clearly_faster():
    from wan_sharding.planner import plan_sharding
    from wan_sharding.planner.search import TP_ACROSS_HOSTS

    report = plan_sharding("8x8-dual-galaxy", "wormhole_b0", resolution="720p", compile=False,
                           rank_binding_name="dual_galaxy")
    rec = report.recommended
    assert rec is not None and not rec.tp_crosses_hosts
    crossing = [c for c in report.ranked if c.analytic is not None and c.tp_crosses_hosts]
    assert crossing  # TP 8 over cols, which crosses the two hosts, is a legal plan here
    best = rec.analytic.seconds_per_forward
    assert all(c.analytic.seconds_per_forward >= best / (1 + TP_ACROSS_HOSTS) for c in crossing)
    data = report.to_json()
    assert data["hosts"]["rank_binding"] == "dual_galaxy"
    assert data["recommended"]["cross_host_gb_per_step"] > 0


# ------------------------------------------------------------------------------ the launch


def test_hosts_and_hostfiles(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# lab\ng05glx01 slots=1\ng05glx02 slots=1  # second\n\ng05glx01 slots=1\n"
                        "g05glx03\ng05glx04 max_slots=1\n")
    assert td.read_hostfile(str(hostfile)) == ["g05glx01", "g05glx02", "g05glx03", "g05glx04"]
    launch = td.resolve_launch("quad_galaxy", hostfile=str(hostfile), dry_run=True, environ={})
    assert launch.controller == "g05glx01" and launch.hostfile == str(hostfile)
    env = launch.env()
    assert env[td.HOSTS_FILE] == str(hostfile) and td.HOSTS_LIST not in env
    with pytest.raises(td.LaunchError, match="names b twice"):
        td.parse_hosts("a,b,b")
    with pytest.raises(td.LaunchError, match="empty host name"):
        td.parse_hosts("a,,b")
    with pytest.raises(td.LaunchError, match="'-x' is not a host name"):
        td.parse_hosts("a,-x")


def test_the_controller_is_where_the_command_runs():
    assert td.controller_problem("localhost") == ""
    assert td.controller_problem(socket.gethostname()) == ""
    assert "cannot resolve it" in td.controller_problem("no-such-host.invalid")
    assert "is not this machine" in td.controller_problem("192.0.2.1")  # TEST-NET-1: never local
    assert "(the first host)" in td.controller_problem("192.0.2.1", given=False)
    assert td.iface_problem("") == "" and "no such network interface" in td.iface_problem("no-such-iface0")


def test_a_stale_environment_is_replaced_or_refused():
    launch = td.DistributedLaunch("dual_galaxy", ("a", "b"), controller="a", worker_path="/w")
    stale = {"PATH": "/bin", td.HOSTS_FILE: "/old/hostfile", td.DUAL_T3K: "1", "TT_DISTRIBUTED_RANK_FILE_PATH": "/rf"}
    env = td.with_distributed(stale, launch)
    # a stale hosts file beside the new hosts list would make the plugin refuse both; the rank file,
    # which the helper never sets, is the user's and stays
    assert env == {"PATH": "/bin", "TT_DISTRIBUTED_RANK_FILE_PATH": "/rf", **launch.env()}
    assert "no --rank-binding was given" in td.inherited_problem({td.ENABLE: "1"})
    assert td.inherited_problem({td.ENABLE: "0"}) == ""


@pytest.fixture
def no_plugin(monkeypatch):
    """This process as on a machine without Tenstorrent's plugin (and none named in the environment)."""
    monkeypatch.setitem(sys.modules, "pjrt_plugin_tt", None)
    for name in ("TT_DISTRIBUTED_WORKER_PATH", "TT_PJRT_PLUGIN_DIR", "TT_MLIR_HOME", td.ENABLE):
        monkeypatch.delenv(name, raising=False)


def test_dry_runs_print_the_launch_without_the_stack(capsys, tmp_path, no_plugin):
    """``--dry-run`` on a machine without the Tenstorrent stack or its worker binary."""
    argv = ["generate", "--backend", "tt", "--rank-binding", "quad_galaxy", "--hosts", "a,b,c,d", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for line in ("mesh: --mesh 8x16-quad-galaxy: 8x16-quad-galaxy, 128 chips", "crosses hosts: sp (SP) every 4 chips",
                 "hosts: a, b, c, d; controller a", "    TT_RUNTIME_ENABLE_DISTRIBUTED=1",
                 "    TT_DISTRIBUTED_RANK_BINDING=quad_galaxy", "    TT_DISTRIBUTED_CONTROLLER_HOST_NAME=a",
                 "    TT_DISTRIBUTED_HOSTS_LIST=a,b,c,d", "    PJRT_DEVICE=TT", "worker binary: not found on this machine"):
        assert line in out, line
    assert td.HOSTS_FILE not in out and td.TCP_IFACE not in out
    # tt-metal's quad Blackhole Galaxy in its Wan 2.2 view, on the binding the plugin names it by
    args = parse_and_validate(["profile", "--backend", "tt", "--mesh", "4x32-tt-metal", "--rank-binding",
                               "quad_exabox_galaxy", "--hosts", "h1,h2,h3,h4", "--tcp-iface", "cnx1", "--dry-run"])
    assert args.distributed["hosts"] == ["h1", "h2", "h3", "h4"] and args.distributed["tcp_iface"] == "cnx1"
    for argv in (["serve", "--backend", "tt", "--rank-binding", "dual_galaxy", "--hosts", "a,b", "--dry-run",
                  "--store", str(tmp_path / "s")],
                 ["check", "--backends", "tt", "--rank-binding", "2x4_multiprocess", "--dry-run"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"wan-sharding {argv[0]}: dry run, nothing was started")
    assert f"TT_DISTRIBUTED_RANK_BINDING=2x4_multiprocess" in out and td.CONTROLLER not in out
    assert list(tmp_path.iterdir()) == []  # serve's dry run opened no store


def test_a_plan_carries_its_binding(tmp_path, capsys, no_plugin):
    from wan_sharding.plan import ShardingPlan

    plan = ShardingPlan((8, 16), ("rows", "cols"), ("cols",), ("rows",), rank_binding="quad_galaxy")
    path = tmp_path / "quad.json"
    plan.save(path)
    assert json.loads(path.read_text())["rank_binding"] == "quad_galaxy"
    assert "rank_binding" not in ShardingPlan().to_dict()  # one host: the plan file is as before
    args = parse_and_validate(["generate", "--backend", "tt", "--plan", str(path), "--hosts", "a,b,c,d", "--dry-run"])
    assert args.distributed["binding"] == "quad_galaxy"
    with pytest.raises(Exception, match="contradicts the plan's rank binding quad_galaxy"):
        parse_and_validate(["generate", "--backend", "tt", "--plan", str(path), "--rank-binding", "dual_galaxy",
                            "--hosts", "a,b", "--dry-run"])
    # the planner writes it
    out = tmp_path / "written.json"
    assert main(["plan", "--rank-binding", "dual_galaxy", "--no-compile", "--json", "--write", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == "8x8" and data["arch"] == "wormhole_b0" and data["hosts"]["hosts"] == 2
    assert ShardingPlan.load(out).rank_binding == "dual_galaxy"


# ----------------------------------------------------------------------- the contract: the CLI

SITECUSTOMIZE = '''
import json, os
if os.environ.get("PJRT_DEVICE") == "TT" and os.environ.get("WAN_STANDIN_ENV"):
    # a tt worker: record the environment tt-xla's plugin would read, and stop (no Tenstorrent stack here)
    with open(os.environ["WAN_STANDIN_ENV"], "w") as f:
        json.dump(dict(os.environ), f)
    os._exit(3)
'''


def _standin_plugin(root: Path) -> Path:
    """The stand-in plugin directory (module docstring)."""
    for package in ("pjrt_plugin_tt", "tt_torch"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    worker = root / "pjrt_plugin_tt" / WORKER
    worker.parent.mkdir(parents=True)
    worker.write_text("#!/bin/sh\nexit 1\n")
    worker.chmod(0o755)
    agent = root / "remote_docker.sh"
    agent.write_text("#!/bin/sh\nexec ssh \"$@\"\n")
    agent.chmod(0o755)
    (root / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return root


@pytest.fixture(scope="module")
def cli_worker_envs(tmp_path_factory):
    """The real CLI, three runs at once with the stand-in plugin: one host (the baseline), quad_galaxy
    (with every option tt-xla's helper sets for it) and 2x4_multiprocess. Each run's tt worker
    environment, as the stand-in recorded it."""
    root = tmp_path_factory.mktemp("multihost")
    plugin = _standin_plugin(root / "plugin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TT_DISTRIBUTED", "TT_RUNTIME", "TT_PJRT",
                                                                     "TT_MLIR"))}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("JAX_PLATFORMS", None)
    runs = {
        "one host": ["generate", "--backend", "tt", "--mesh", "2x4"],
        "quad_galaxy": ["generate", "--backend", "tt", "--rank-binding", "quad_galaxy", "--hosts", "localhost,b,c,d",
                        "--tcp-iface", "lo", "--rsh-agent", str(plugin / "remote_docker.sh")],
        "2x4_multiprocess": ["check", "--backends", "tt", "--rank-binding", "2x4_multiprocess", "--lengths", "aligned"],
    }
    procs = {}
    for name, argv in runs.items():
        record = root / f"{name.replace(' ', '-')}.json"
        procs[name] = (record, subprocess.Popen([sys.executable, "-m", "wan_sharding.cli", *argv],
                                                env={**env, "WAN_STANDIN_ENV": str(record)}, cwd=root,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = {}
    for name, (record, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode != 0, stdout  # the stand-in stops the worker: the command reports it failed
        assert record.exists(), f"{name}: no tt worker started\n{stdout[-2000:]}{stderr[-2000:]}"
        out[name] = {k: v for k, v in json.loads(record.read_text()).items() if k not in BOOKKEEPING}
    return plugin, out


@pytest.mark.parametrize("run", ["quad_galaxy", "2x4_multiprocess"])
def test_contract_the_tt_worker_gets_exactly_the_helpers_environment(cli_worker_envs, run):
    """Contract test (module docstring): the worker's environment is the one-host tt worker's plus
    exactly what tt-xla's topology helper sets for the topology; nothing else differs."""
    plugin, envs = cli_worker_envs
    worker = str(plugin / "pjrt_plugin_tt" / WORKER)
    # scripts/multihost_topology.py, get_env_vars: TT_RUNTIME_ENABLE_DISTRIBUTED, the worker path, the
    # binding; the controller, TCP interface and hosts when the topology has them; the remote shell
    # agent, resolved absolute; nothing for n300_llmbox (2x4_multiprocess) beyond the first three.
    expected = {
        "quad_galaxy": {"TT_RUNTIME_ENABLE_DISTRIBUTED": "1", "TT_DISTRIBUTED_WORKER_PATH": worker,
                        "TT_DISTRIBUTED_RANK_BINDING": "quad_galaxy", "TT_DISTRIBUTED_CONTROLLER_HOST_NAME": "localhost",
                        "TT_DISTRIBUTED_TCP_IFACE": "lo", "TT_DISTRIBUTED_HOSTS_LIST": "localhost,b,c,d",
                        "TT_DISTRIBUTED_PLM_RSH_AGENT": str(plugin / "remote_docker.sh")},
        "2x4_multiprocess": {"TT_RUNTIME_ENABLE_DISTRIBUTED": "1", "TT_DISTRIBUTED_WORKER_PATH": worker,
                             "TT_DISTRIBUTED_RANK_BINDING": "2x4_multiprocess"},
    }[run]
    one, multi = envs["one host"], envs[run]
    assert one["PJRT_DEVICE"] == multi["PJRT_DEVICE"] == "TT"
    assert not any(k.startswith(("TT_DISTRIBUTED", "TT_RUNTIME")) for k in one)
    # TMPDIR: every worker's own temp folder, made by the worker runner for each worker it starts
    # (wan_sharding.runtime.scratch.worker_tmpdir), so it differs between any two workers, one host or several
    assert "TMPDIR" in one and "TMPDIR" in multi
    changed = {k: v for k, v in multi.items() if one.get(k) != v and k != "TMPDIR"}
    assert changed == expected
    assert set(one) <= set(multi)  # nothing taken away


# ----------------------------------------------------------------------- serve: the controller


def test_serve_restarts_the_controller_with_the_same_environment(tmp_path, monkeypatch):
    """The server's one resident worker on a multi-host launch is tt-xla's controller; killed, it
    is replaced with the very same environment (the resident worker is a stand-in: module docstring)."""
    import types

    from wan_sharding.serve import resident
    from wan_sharding.serve.server import request_defaults, worker_specs
    from wan_sharding.serve.store import Store
    from wan_sharding.serve.supervisor import Supervisor

    worker = tmp_path / "worker"
    worker.write_text("#!/bin/sh\n")
    worker.chmod(0o755)
    log = tmp_path / "env.log"
    monkeypatch.setitem(sys.modules, "tt_torch", types.ModuleType("tt_torch"))  # the stack counts as installed
    monkeypatch.setenv("TT_DISTRIBUTED_WORKER_PATH", str(worker))
    monkeypatch.setenv("WAN_STANDIN_ENV_LOG", str(log))
    args = parse_and_validate(["serve", "--backend", "tt", "--rank-binding", "2x4_multiprocess",
                               "--store", str(tmp_path / "store"), "--port", "0"])
    from wan_sharding.cli.pipeline import worker_params

    p = worker_params(args)
    [spec] = worker_specs(p, request_defaults(p))
    assert spec.env["TT_DISTRIBUTED_RANK_BINDING"] == "2x4_multiprocess"
    monkeypatch.setattr(resident, "WORKER", "tests.tt_controller_standin")
    sup = Supervisor(Store.open(str(tmp_path / "store")), [spec], model="tiny", queue_size=1, job_timeout=60,
                     stall_s=None, say=lambda s: None)
    sup.start()
    try:
        recorded = lambda: len(log.read_text().splitlines()) if log.exists() else 0  # noqa: E731
        first = _wait(lambda: sup.state == "ready" and recorded() == 1 and sup.worker_pid)
        os.kill(first, signal.SIGKILL)
        _wait(lambda: sup.state == "ready" and sup.restarts == 1 and recorded() == 2)
    finally:
        sup.stop("test over")
    # the same environment both times, the spec's, but for what the worker runner sets for every worker
    # it starts: its parent, its own temp folder (a new one per worker: wan_sharding.runtime.scratch.worker_tmpdir)
    # and progress bars off without a terminal (wan_sharding.runtime.noise.progress_env)
    runner = ("WAN_SHARDING_PARENT", "TMPDIR", "TQDM_DISABLE")
    starts = [{k: v for k, v in json.loads(line).items() if k not in runner} for line in log.read_text().splitlines()]
    assert len(starts) == 2 and starts[0] == starts[1]
    assert starts[0] == {k: v for k, v in spec.env.items() if k not in runner}


def _wait(get, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = get()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")
