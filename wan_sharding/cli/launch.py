"""Checks of a launch over several hosts (``--rank-binding``, ``--hosts``, ``--hostfile``,
``--controller``, ``--tcp-iface``; flags from ``cli.args.add_multihost``), run before any worker
starts. Each raises :class:`~wan_sharding.jobs.requests.UsageError` with one line that names the fix.
"""

from __future__ import annotations

import argparse
from typing import Any

from .validate import UsageError


def binding_mesh(args: argparse.Namespace, default: Any) -> Any:
    """The default mesh of a command: with ``--rank-binding`` (and neither ``--mesh`` nor
    ``--plan``) the binding's preset (:func:`wan_sharding.systems.served_presets`), else
    ``default`` (a name, or a list of names for ``check``)."""
    from ..systems import rank_binding, served_presets

    name = getattr(args, "rank_binding", None)
    if not name or getattr(args, "plan", None) is not None:
        return default
    system = rank_binding(name)
    presets = served_presets(system)
    if not presets and getattr(args, "mesh", getattr(args, "meshes", None)) is None:
        grid = "x".join(map(str, system.grid))
        raise UsageError(f"--rank-binding {name}: its global mesh {grid} has no preset; pass --plan PLAN.json (wan-sharding "
                         f"plan --mesh {grid} --arch {system.arch} --rank-binding {name} --write PLAN.json)")
    if not presets:
        return default
    return presets[0] if isinstance(default, str) else presets[:1]


def _grids(args: argparse.Namespace) -> list[tuple[str, tuple[int, ...]]]:
    """``(what, chip grid)`` of every mesh the command runs on (after :func:`apply_plan`)."""
    from ..jobs.launch import UNSHARDED
    from ..mesh import parse_mesh_shape

    plans = dict(getattr(args, "cfg_plans", None) or {})
    if not plans and getattr(args, "plan", None) is not None:
        return [(f"the plan's mesh ({args.plan.name})", args.plan.mesh().grid)]
    names = args.meshes if hasattr(args, "meshes") else [args.mesh]
    return [(f"--mesh {n}", (1, 1) if n == UNSHARDED else plans[n].mesh().grid if n in plans
             else parse_mesh_shape(n)) for n in names]


def _binding_name(args: argparse.Namespace) -> str | None:
    """The rank binding asked for: ``--rank-binding``, or the plan's; refused when they differ."""
    name, plan = getattr(args, "rank_binding", None), getattr(args, "plan", None)
    if plan is None or not plan.rank_binding:
        return name
    if name and name != plan.rank_binding:
        raise UsageError(f"--rank-binding {name} contradicts the plan's rank binding {plan.rank_binding}; leave "
                         "--rank-binding out with --plan")
    return plan.rank_binding


def _check_grids(system: Any, args: argparse.Namespace) -> None:
    """Every mesh the command runs on must be ``system``'s global mesh."""
    from ..systems import BindingError, check_binding_grid

    try:
        for what, grid in _grids(args):
            check_binding_grid(system, grid, what)
    except BindingError as e:
        raise UsageError(str(e)) from None


def check_binding(args: argparse.Namespace) -> None:
    """``--rank-binding`` on a command that plans or compiles (no launch): the mesh (or plan) must
    be its global mesh, the chips its architecture."""
    from ..systems import rank_binding

    system = rank_binding(_binding_name(args))
    _check_grids(system, args)
    if getattr(args, "arch", system.arch) != system.arch:
        raise UsageError(f"--arch {args.arch} contradicts --rank-binding {system.name} ({system.machine}: "
                         f"{system.arch} chips); pass --arch {system.arch}")


def check_launch(args: argparse.Namespace, backends: list[str]) -> None:
    """The multi-host flags, after the mesh is known: sets ``args.distributed`` (the resolved
    launch as JSON, or None on one host). Refused in one line: the flags without ``--backend tt``,
    a mesh or plan that is not the binding's global mesh, a binding other than the plan's, hosts
    that do not match it, a missing worker binary, a controller that is not this machine
    (:func:`wan_sharding.backends.tt_distributed.resolve_launch`), several serve replicas, and an
    environment that turns tt-xla's distributed runtime on without a binding."""
    from ..backends.tt_distributed import LAUNCH_FLAGS, LaunchError, inherited_problem, resolve_launch
    from ..systems import BindingError, rank_binding

    args.distributed = None
    flag = "--backends" if hasattr(args, "backends") else "--backend"
    given = [f for f in ("--rank-binding", *LAUNCH_FLAGS, "--dry-run") if getattr(args, f[2:].replace("-", "_"), None)]
    if "tt" not in backends:
        if given:
            raise UsageError(f"{given[0]} is for a launch on Tenstorrent hardware; add {flag} tt")
        return
    name = _binding_name(args)
    if name is None:
        hosts = [f for f in given if f in LAUNCH_FLAGS]
        if hosts:
            raise UsageError(f"{hosts[0]} belongs to a launch over several hosts; pass --rank-binding NAME with it")
        problem = "" if args.dry_run else inherited_problem()
        if problem:
            raise UsageError(problem)
        return
    if backends != ["tt"]:
        raise UsageError(f"--rank-binding {name} runs the tt backend over several hosts; use {flag} tt alone")
    if getattr(args, "replicas", 1) > 1:
        raise UsageError(f"--replicas {args.replicas} with --rank-binding {name}: tt-xla's distributed runtime has one "
                         "controller for all its hosts, so the server runs one worker; use --replicas 1")
    try:
        _check_grids(rank_binding(name), args)
        launch = resolve_launch(name, args.hosts, args.hostfile, args.controller, args.tcp_iface, args.rsh_agent,
                                dry_run=args.dry_run)
    except (BindingError, LaunchError) as e:
        raise UsageError(str(e)) from None
    args.distributed = launch.to_json()
