"""The first-run report: what a first ``tt`` run on Tenstorrent hardware should send back.

``pytest -m tt`` (``tests/test_tt_hardware.py``) fills one :class:`FirstRunReport` as its tests run
and writes it once, at the end, as one JSON file: the stack's versions, the chips found, PCC per
mesh and dtype with the threshold it was held to, compile and warm seconds, and dynamo graphs per
forward. See ``docs/tt-backend.md``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPORT_ENV = "WAN_SHARDING_TT_REPORT"  # where the report goes (default: results/tt-first-run-<mesh>.json)
MESH_ENV = "WAN_SHARDING_TT_MESH"  # the mesh preset by hand (default: from the chips, or the rank binding's)
# The distributions whose versions a hardware run depends on (looked up, not imported).
STACK = ("wan_sharding", "torch", "torch-xla", "pjrt-plugin-tt", "jax", "jaxlib", "diffusers", "transformers",
         "accelerate", "numpy", "tt_lang")


def stack_versions() -> dict[str, str | None]:
    """Python and each distribution of :data:`STACK` with its installed version (``None``: not
    installed), from the package metadata; imports none of them."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in STACK:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def default_path(mesh: str) -> Path:
    """:data:`REPORT_ENV` if set, else ``results/tt-first-run-<mesh>.json`` in the repository."""
    given = os.environ.get(REPORT_ENV)
    if given:
        return Path(given)
    return Path(__file__).resolve().parents[2] / "results" / f"tt-first-run-{mesh}.json"


class FirstRunReport:
    """Sections added as the run goes (``add``), written once (``write``). A section records
    what came back even when its test then fails; ``outcomes`` says which tests passed."""

    def __init__(self, mesh: str, chips: dict[str, Any]):
        self.data: dict[str, Any] = {
            "what": "wan_sharding tt backend, first hardware run (pytest -m tt)",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "platform": platform.platform(), "argv": sys.argv,
            "stack": stack_versions(), "mesh": mesh, "chips": chips, "outcomes": {},
        }

    def add(self, section: str, value: Any) -> None:
        self.data[section] = value

    def outcome(self, test: str, passed: bool, error: str | None = None) -> None:
        self.data["outcomes"][test] = "passed" if passed else f"failed: {error}"

    def write(self, path: Path) -> Path:
        """Write the report to ``path`` in one step (a temporary file renamed over it), so an
        interrupted run leaves either the previous report or none, never a half-written one."""
        self.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


def marker_launch(options: dict[str, Any], environ: dict[str, str] | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """What ``pytest -m tt`` runs on: ``(mesh preset, launch)``. ``options``: the run's
    ``--rank-binding``, ``--hosts``, ``--hostfile``, ``--controller``, ``--tcp-iface``,
    ``--rsh-agent`` and ``--dry-run`` (by those names, ``-`` as ``_``). Without a binding the preset
    is :data:`MESH_ENV`'s or None (from the chip count) and the launch None; with one, the preset is
    :data:`MESH_ENV`'s (which must be the binding's global mesh) or the binding's, and the launch
    its :class:`~wan_sharding.backends.tt_distributed.DistributedLaunch` as JSON. ValueError (one
    line) for what the commands refuse."""
    from ..backends.tt_distributed import LAUNCH_FLAGS, inherited_problem, resolve_launch
    from ..mesh import preset_key
    from ..systems import check_binding_grid, rank_binding, served_presets

    env = dict(os.environ if environ is None else environ)
    mesh = preset_key(env[MESH_ENV]) if env.get(MESH_ENV) else None
    name = options.get("rank_binding")
    if not name:
        given = [f for f in LAUNCH_FLAGS if options.get(f[2:].replace("-", "_"))]
        if given:
            raise ValueError(f"{given[0]} belongs to a launch over several hosts; pass --rank-binding NAME with it")
        problem = "" if options.get("dry_run") else inherited_problem(env)
        if problem:
            raise ValueError(problem)
        return mesh, None
    from ..mesh import mesh_from_preset

    system = rank_binding(name)
    presets = served_presets(system)
    if mesh is None and not presets:
        raise ValueError(f"--rank-binding {name}: its global mesh {system.grid[0]}x{system.grid[1]} has no mesh preset, "
                         "and pytest -m tt runs presets")
    mesh = mesh or presets[0]
    check_binding_grid(system, mesh_from_preset(mesh).grid, f"{MESH_ENV}={mesh}")
    launch = resolve_launch(name, options.get("hosts"), options.get("hostfile"), options.get("controller"),
                            options.get("tcp_iface"), options.get("rsh_agent"), dry_run=bool(options.get("dry_run")),
                            environ=env)
    return mesh, launch.to_json()
