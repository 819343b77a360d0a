"""tt-xla's distributed runtime under the tt backend: several hosts (or processes) as one mesh.

tt-xla runs a multi-host mesh with a single controller: the user's process is the controller, and
when its environment says so, the TT PJRT plugin starts one worker per MPI rank on every host
(through tt-metal's ``tt-run`` and ``mpirun``) and drives them over sockets (tenstorrent/tt-xla
``pjrt_implementation/src/api/client_instance.cc``, ``launchDistributedRuntime``). This package
does not launch anything of its own: its tt worker process is that controller, started with the
environment tt-xla's topology helper sets (tenstorrent/tt-xla ``scripts/multihost_topology.py``,
``get_env_vars``; re-exported as ``tests/torch/multi_host/topology.py``):

- ``TT_RUNTIME_ENABLE_DISTRIBUTED=1``, ``TT_DISTRIBUTED_WORKER_PATH`` (the plugin's worker binary,
  found as the helper finds it: :func:`find_worker_binary`), ``TT_DISTRIBUTED_RANK_BINDING``;
- ``TT_DISTRIBUTED_CONTROLLER_HOST_NAME`` and ``TT_DISTRIBUTED_TCP_IFACE`` when given;
- ``TT_DISTRIBUTED_HOSTS_FILE``, else ``TT_DISTRIBUTED_HOSTS_LIST``;
- ``TT_DISTRIBUTED_PLM_RSH_AGENT`` when given (MPI's remote shell: containers only);
- what the helper adds for one topology (``TT_RUNTIME_USING_DUALT3K=1`` for ``dual_t3k``).

Nothing else in the tt worker's environment changes (:func:`with_distributed`). What the rank
bindings are (global mesh, hosts, chips per host) is :mod:`wan_sharding.systems`'s table.
"""

from __future__ import annotations

import os
import shlex
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from ..systems import RankBinding, rank_binding

ENABLE = "TT_RUNTIME_ENABLE_DISTRIBUTED"
WORKER_PATH = "TT_DISTRIBUTED_WORKER_PATH"
RANK_BINDING = "TT_DISTRIBUTED_RANK_BINDING"
CONTROLLER = "TT_DISTRIBUTED_CONTROLLER_HOST_NAME"
TCP_IFACE = "TT_DISTRIBUTED_TCP_IFACE"
HOSTS_LIST = "TT_DISTRIBUTED_HOSTS_LIST"
HOSTS_FILE = "TT_DISTRIBUTED_HOSTS_FILE"
RSH_AGENT = "TT_DISTRIBUTED_PLM_RSH_AGENT"
DUAL_T3K = "TT_RUNTIME_USING_DUALT3K"
# Every variable the helper manages: a launch replaces all of them (a stale hosts file beside a new
# hosts list would make the plugin refuse both). The plugin also reads TT_DISTRIBUTED_RANK_FILE_PATH
# and TT_DISTRIBUTED_TRACY_CMD, which the helper never sets: they pass through from the user's.
MANAGED = (ENABLE, WORKER_PATH, RANK_BINDING, CONTROLLER, TCP_IFACE, HOSTS_LIST, HOSTS_FILE, RSH_AGENT, DUAL_T3K)

# Where the helper looks for the worker binary: the pjrt-plugin-tt wheel ships it under the plugin
# directory; a tt-mlir source build under TT_MLIR_HOME.
PLUGIN_DIR_ENV, MLIR_HOME_ENV = "TT_PJRT_PLUGIN_DIR", "TT_MLIR_HOME"
WORKER_IN_PLUGIN = "bin/ttmlir/runtime/distributed/worker"
WORKER_IN_MLIR_HOME = "build/runtime/bin/distributed/worker"
LAUNCH_FLAGS = ("--hosts", "--hostfile", "--controller", "--tcp-iface", "--rsh-agent")


class LaunchError(ValueError):
    """A launch that cannot work: one line naming the problem and the fix."""


def _plugin_package_dir() -> Path | None:
    """The installed ``pjrt_plugin_tt`` package's directory, found without importing it."""
    import sys
    from importlib.util import find_spec

    if sys.modules.get("pjrt_plugin_tt", "") is None:  # blocked (a test standing in for a machine without it)
        return None
    try:
        spec = find_spec("pjrt_plugin_tt")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def find_worker_binary(environ: Mapping[str, str] | None = None) -> tuple[str | None, list[str]]:
    """``(path, looked_at)``: the distributed worker binary, looked for where tt-xla's helper looks
    (``get_distributed_worker_path``): ``TT_DISTRIBUTED_WORKER_PATH`` when set (it must exist),
    else ``<plugin dir>/bin/ttmlir/runtime/distributed/worker`` (``TT_PJRT_PLUGIN_DIR``, or the
    installed ``pjrt_plugin_tt`` package), else ``$TT_MLIR_HOME/build/runtime/bin/distributed/worker``.
    ``path`` is None when none exists; ``looked_at`` names every place tried."""
    env = os.environ if environ is None else environ
    given = env.get(WORKER_PATH)
    if given:
        return (str(Path(given).absolute()) if Path(given).is_file() else None), [f"{WORKER_PATH}={given}"]
    plugin = Path(env[PLUGIN_DIR_ENV]) if env.get(PLUGIN_DIR_ENV) else _plugin_package_dir()
    candidates = []
    candidates.append(str(plugin / WORKER_IN_PLUGIN) if plugin is not None
                      else f"<pjrt_plugin_tt>/{WORKER_IN_PLUGIN} (pjrt-plugin-tt is not installed)")
    if env.get(MLIR_HOME_ENV):
        candidates.append(str(Path(env[MLIR_HOME_ENV]) / WORKER_IN_MLIR_HOME))
    else:
        candidates.append(f"$TT_MLIR_HOME/{WORKER_IN_MLIR_HOME} (TT_MLIR_HOME is not set)")
    for c in candidates:
        if not c.startswith(("<", "$")) and Path(c).is_file():
            return str(Path(c).absolute()), candidates
    return None, candidates


def parse_hosts(text: str, flag: str = "--hosts") -> list[str]:
    """``H1,H2,...`` as host names: no empty entry, no whitespace, none twice, none like a flag."""
    hosts = [h.strip() for h in str(text).split(",")]
    for h in hosts:
        if not h:
            raise LaunchError(f"{flag} {text!r} has an empty host name; write H1,H2,... with no blank entry")
        if h.startswith("-") or any(c.isspace() for c in h):
            raise LaunchError(f"{flag}: {h!r} is not a host name; write H1,H2,... (names, commas between)")
    twice = sorted({h for h in hosts if hosts.count(h) > 1})
    if twice:
        raise LaunchError(f"{flag} names {', '.join(twice)} twice; each host runs one rank, so name each once")
    return hosts


def read_hostfile(path: str) -> list[str]:
    """The hosts of an MPI hostfile (one per line, then options such as ``slots=1``; ``#``
    comments), each once, in order."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise LaunchError(f"--hostfile {path}: cannot be read ({e.strerror}); pass an MPI hostfile, one host per "
                          "line") from None
    except UnicodeDecodeError:
        raise LaunchError(f"--hostfile {path}: not a text file; pass an MPI hostfile, one host per line") from None
    hosts: list[str] = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] not in hosts:
            hosts.append(words[0])
    if not hosts:
        raise LaunchError(f"--hostfile {path} lists no host; write one host name per line")
    return hosts


@dataclass(frozen=True)
class DistributedLaunch:
    """A resolved multi-host (or multi-process) launch: what :meth:`env` sets in the tt worker.

    ``hosts`` are the hosts in order (from ``--hosts`` or read from ``hostfile``); ``hostfile`` is
    absolute (the plugin runs ``mpirun`` from tt-metal's directory). ``worker_path`` is empty only
    in a dry run on a machine without the plugin (``looked_at`` then says where it was looked for).
    """

    binding: str
    hosts: tuple[str, ...] = ()
    hostfile: str = ""
    controller: str = ""
    tcp_iface: str = ""
    rsh_agent: str = ""
    worker_path: str = ""
    looked_at: tuple[str, ...] = ()

    @property
    def system(self) -> RankBinding:
        return rank_binding(self.binding)

    def env(self) -> dict[str, str]:
        """The variables tt-xla's helper sets for this topology, in its order (module docstring)."""
        out = {ENABLE: "1", WORKER_PATH: self.worker_path or f"<pjrt_plugin_tt>/{WORKER_IN_PLUGIN}",
               RANK_BINDING: self.binding}
        if self.controller:
            out[CONTROLLER] = self.controller
        if self.tcp_iface:
            out[TCP_IFACE] = self.tcp_iface
        if self.hostfile:
            out[HOSTS_FILE] = self.hostfile
        elif self.hosts:
            out[HOSTS_LIST] = ",".join(self.hosts)
        if self.rsh_agent:
            out[RSH_AGENT] = self.rsh_agent
        out.update(self.system.extra_env)
        return out

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "DistributedLaunch":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def resolve_launch(binding: str, hosts: str | None = None, hostfile: str | None = None, controller: str | None = None,
                   tcp_iface: str | None = None, rsh_agent: str | None = None, *, dry_run: bool = False,
                   environ: Mapping[str, str] | None = None) -> DistributedLaunch:
    """Check a launch of ``binding`` and resolve it; :class:`LaunchError` (one line) when it
    cannot work: hosts that do not match the binding, a missing worker binary (where it was looked
    for; a dry run only notes it), a controller that is not this machine or a network interface it
    does not have (checked on a real launch: the controller is where this process runs)."""
    system = rank_binding(binding)
    given = {"--hosts": hosts, "--hostfile": hostfile, "--controller": controller, "--tcp-iface": tcp_iface,
             "--rsh-agent": rsh_agent}
    if hosts is not None and hostfile is not None:
        raise LaunchError("--hosts and --hostfile both name the hosts, and the plugin takes one of them; pass one")
    if not system.multi_host:
        extra = [flag for flag, value in given.items() if value is not None]
        if extra:
            one = len(extra) == 1
            raise LaunchError(f"{binding} runs its {system.num_ranks} processes on this machine (no hosts, no MPI "
                              f"remote shell), so {', '.join(extra)} {'has' if one else 'have'} nothing to name; "
                              f"leave {'it' if one else 'them'} out")
        path, looked = _worker(dry_run, environ)
        return DistributedLaunch(binding, worker_path=path or "", looked_at=tuple(looked))
    if hosts is None and hostfile is None:
        raise LaunchError(f"{binding} runs on {system.hosts} hosts ({system.machine}); pass --hosts H1,...,H"
                          f"{system.hosts} or --hostfile PATH")
    names = parse_hosts(hosts) if hosts is not None else read_hostfile(str(hostfile))
    if len(names) != system.hosts:
        where = "--hosts" if hosts is not None else f"--hostfile {hostfile}"
        raise LaunchError(f"{binding} runs on {system.hosts} hosts ({system.machine}, one MPI rank each), but {where} "
                          f"names {len(names)}: {','.join(names)}; name {system.hosts}")
    if controller is not None:
        parse_hosts(controller, "--controller")
    if tcp_iface is not None and (not tcp_iface or any(c.isspace() or c == "," for c in tcp_iface)):
        raise LaunchError(f"--tcp-iface {tcp_iface!r} is not a network interface name (e.g. eth0, cnx1)")
    agent = ""
    if rsh_agent is not None:
        p = Path(rsh_agent)
        if not p.is_file() or not os.access(p, os.X_OK):
            raise LaunchError(f"--rsh-agent {rsh_agent}: not an executable file; pass the script MPI runs to reach "
                              "a worker host (tt-xla's tests/torch/multi_host/experimental/remote_docker.sh is one)")
        agent = str(p.resolve())  # MPI's plm_rsh_agent needs an absolute path (the helper resolves it too)
    path, looked = _worker(dry_run, environ)
    launch = DistributedLaunch(binding, tuple(names), str(Path(hostfile).absolute()) if hostfile is not None else "",
                               controller or names[0], tcp_iface or "", agent, path or "", tuple(looked))
    if not dry_run:
        for problem in (controller_problem(launch.controller, controller is not None), iface_problem(launch.tcp_iface)):
            if problem:
                raise LaunchError(problem)
    return launch


def _worker(dry_run: bool, environ: Mapping[str, str] | None) -> tuple[str | None, list[str]]:
    path, looked = find_worker_binary(environ)
    if path is None and not dry_run:
        raise LaunchError("no distributed worker binary (the plugin starts it on every host): looked at "
                          f"{'; '.join(looked)}; install pjrt-plugin-tt, whose wheel ships {WORKER_IN_PLUGIN}, or set "
                          f"{WORKER_PATH}")
    return path, looked


def controller_problem(controller: str, given: bool = True) -> str:
    """Why ``controller`` cannot be this process's host (empty when it is): the plugin tells every
    worker to connect back to it, so the command must run there. ``given``: named by
    ``--controller`` (else it is the first host)."""
    here = socket.gethostname()
    what = f"--controller {controller}" if given else f"the controller {controller} (the first host)"
    if controller in (here, "localhost") or controller.split(".")[0] == here.split(".")[0]:
        return ""
    try:
        infos = socket.getaddrinfo(controller, None)
    except (socket.gaierror, UnicodeError) as e:
        return (f"{what}: cannot resolve it ({getattr(e, 'strerror', None) or e}); pass --controller with this "
                f"machine's name ({here}): the command runs there and the workers connect back to it")
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr[0], 0))  # binds only to an address of this machine
            return ""
        except OSError:
            continue
    return (f"{what} is not this machine ({here}): the workers connect back to the controller, which is this "
            f"process; run the command on {controller}, or pass --controller {here}")


def iface_problem(iface: str) -> str:
    """Why ``iface`` cannot carry MPI's traffic from this machine (empty when it can, or not given)."""
    if not iface:
        return ""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:  # no way to list them here: MPI will say
        return ""
    if iface in names:
        return ""
    return (f"--tcp-iface {iface}: this machine has no such network interface ({', '.join(names)}); name the one "
            "the hosts reach each other on")


def inherited_problem(environ: Mapping[str, str] | None = None) -> str:
    """Why a single-host tt run cannot go ahead in this environment (empty when it can): it turns
    tt-xla's distributed runtime on without a binding this package checked."""
    env = os.environ if environ is None else environ
    if env.get(ENABLE, "0") not in ("", "0"):
        return (f"the environment sets {ENABLE}={env[ENABLE]} (tt-xla's distributed runtime) but no --rank-binding "
                f"was given; pass --rank-binding NAME with its hosts (the package then sets the environment) or "
                f"unset {ENABLE}")
    return ""


def with_distributed(env: Mapping[str, str], launch: DistributedLaunch) -> dict[str, str]:
    """``env`` with the helper's variables for ``launch`` in place of any it had of them."""
    out = {k: v for k, v in env.items() if k not in MANAGED}
    out.update(launch.env())
    return out


def launch_lines(launch: DistributedLaunch | None, env: Mapping[str, str], environ: Mapping[str, str]) -> list[str]:
    """What a dry run prints about the launch: the binding, its hosts, the worker binary, and the
    tt worker's environment ``env`` as it differs from the user's ``environ``."""
    lines = []
    if launch is None:
        lines.append("rank binding: none (one host: this machine's chips)")
    else:
        system = launch.system
        lines.append(f"rank binding: {system.describe()}; tt-metal {system.rank_bindings_file}")
        if system.multi_host:
            source = f" (from {launch.hostfile})" if launch.hostfile else ""
            lines.append(f"hosts: {', '.join(launch.hosts)}{source}; controller {launch.controller} (this process "
                         "runs there; the plugin starts one worker per host over MPI)")
        if launch.worker_path:
            lines.append(f"worker binary: {launch.worker_path} (the same path on every host)")
        else:
            lines.append(f"worker binary: not found on this machine (looked at {'; '.join(launch.looked_at)}); "
                         "a launch without --dry-run refuses")
    helper = launch.env() if launch is not None else {}
    changed = {k: v for k, v in env.items() if environ.get(k) != v and k not in helper}
    removed = [k for k in environ if k not in env]
    lines.append("the tt worker's environment: yours, with")
    if helper:
        lines.append("  what tt-xla's topology helper sets for this topology:")
        lines += [f"    {k}={shlex.quote(v)}" for k, v in helper.items()]
        lines.append("  and what every tt worker gets:" if changed else "  and nothing else")
    lines += [f"    {k}={shlex.quote(v)}" for k, v in changed.items()]
    if removed:
        lines.append(f"  and without {', '.join(removed)}")
    return lines
