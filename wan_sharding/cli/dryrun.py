"""``--dry-run`` on the commands that run ``--backend tt``: what they would launch, with nothing started.

Checks a launch before the hardware is held: the mesh and its roles, which of its axes cross hosts,
the rank binding and its hosts, the worker binary, and the environment the tt worker (tt-xla's
controller) would get. Runs on any machine: the tt stack is neither needed nor imported.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..mesh import MeshSpec, axes_of


def _roles_by_axis(m: MeshSpec) -> dict[str, str]:
    return {a: role.upper() for role in ("sp", "tp", "cfg") for a in axes_of(m.roles.get(role))}


def mesh_lines(what: str, m: MeshSpec, binding: Any) -> list[str]:
    """The mesh's roles, and which of its axes cross hosts (``binding``: a RankBinding or None)."""
    from ..systems import host_cuts

    roles = _roles_by_axis(m)
    axes = ", ".join(f"{n}={s} ({roles.get(n, 'idle')})" for n, s in zip(m.axis_names, m.shape))
    lines = [f"mesh: {what}: {m.name}, {m.num_devices} chips, axes {axes}; SP {m.sp}, TP {m.tp}"]
    cuts = host_cuts(m.grid, binding) if len(m.shape) == 2 else None
    if cuts is not None:
        crossing = [(m.axis_names[i], cuts.segment(i)) for i in cuts.crossing_axes()]
        tp_out = [a for a, _ in crossing if roles.get(a) == "TP"]
        lines.append("crosses hosts: " + ", ".join(f"{a} ({roles.get(a, 'idle')}) every {seg} chips"
                                                  for a, seg in crossing)
                     + ("; TP crosses hosts too: its all-reduces go over the inter-host links every block"
                        if tp_out else "; no TP" if m.tp == 1 else "; TP stays inside each host"))
    return lines


def launch_report(meshes: list[tuple[str, MeshSpec | None]], distributed: dict[str, Any] | None) -> list[str]:
    """The dry run's lines: each mesh (``(what, spec)``; None: the one-device baseline) and the
    launch (``distributed``: a DistributedLaunch as JSON, or None on one host)."""
    from ..backends.tt_distributed import DistributedLaunch, launch_lines
    from ..jobs.launch import planned_tt_env

    launch = DistributedLaunch.from_json(distributed) if distributed else None
    binding = launch.system if launch is not None else None
    lines = [line for what, m in meshes
             for line in ([f"mesh: {what}: one device, no SP or TP"] if m is None else mesh_lines(what, m, binding))]
    return lines + launch_lines(launch, planned_tt_env(distributed), os.environ)


def dry_run(args: argparse.Namespace, command: str) -> bool:
    """With ``--dry-run``: print what the command would launch and return True (the command then
    exits 0); else False. Call after the command's checks."""
    if not getattr(args, "dry_run", False):
        return False
    from ..jobs.launch import UNSHARDED
    from ..mesh import mesh_from_preset

    plans = dict(getattr(args, "cfg_plans", None) or {})
    if getattr(args, "plan", None) is not None and not plans:
        meshes: list[tuple[str, MeshSpec | None]] = [(f"plan {args.plan.name}", args.plan.mesh())]
    else:
        names = args.meshes if hasattr(args, "meshes") else [args.mesh]
        meshes = [(f"--mesh {n}", None if n == UNSHARDED else plans[n].mesh() if n in plans else mesh_from_preset(n))
                  for n in names]
    print(f"wan-sharding {command}: dry run, nothing was started")
    print("\n".join(launch_report(meshes, args.distributed)))
    return True
