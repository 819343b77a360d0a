"""Resolving what :func:`.shard.shard_pipeline` was given: a plan (object or file), a mesh, a
padding mode and a backend, checked against each other before anything is changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..backends import Backend, get_backend
from ..mesh import MeshSpec
from ..options import DEFAULT_PADDING
from ..specs import ShardingError

__all__ = ["backend_for", "load_plan", "plan_mesh_and_padding"]


def load_plan(plan: Any) -> Any:
    """``None``, a ShardingPlan, or the path of one, as a ShardingPlan."""
    from ..plan import PlanError, ShardingPlan

    if plan is None or isinstance(plan, ShardingPlan):
        return plan
    if isinstance(plan, (str, Path)):
        try:
            return ShardingPlan.load(plan)
        except PlanError as e:  # unreadable, not JSON, or a bad field: one line, nothing changed
            raise ShardingError(f"{e}; pass a file `wan-sharding plan --write` wrote") from None
    raise ShardingError(f"plan must be a ShardingPlan or the path of one, got {type(plan).__name__}")


def plan_mesh_and_padding(plan: Any, mesh: Any, padding: str | None) -> tuple[Any, str]:
    """The mesh and padding to use: the arguments, or the plan's, which they must not contradict."""
    if plan is None:
        if mesh is None:
            raise ShardingError("shard_pipeline needs a mesh (a preset such as '2x4') or a plan")
        return mesh, DEFAULT_PADDING if padding is None else padding
    if padding is not None and padding != plan.padding:
        raise ShardingError(f"padding={padding!r} contradicts the plan's padding {plan.padding!r}; "
                            "leave padding out to use the plan's")
    if mesh is not None:
        from ..mesh import as_mesh_spec

        given, wanted = as_mesh_spec(mesh), plan.mesh()
        if given.shape != wanted.shape or (not isinstance(mesh, (str, MeshSpec)) and given.axis_names != wanted.axis_names) \
                or (isinstance(mesh, (str, MeshSpec)) and given != wanted):
            raise ShardingError(f"mesh {given.name} (axes {given.axis_names}) contradicts the plan's mesh "
                                f"{wanted.name} {plan.name!r}; leave mesh out to use the plan's")
    return mesh, plan.padding


def backend_for(backend: str | Backend, mesh: Any, plan: Any) -> Backend:
    """The backend on ``mesh``; with a plan, on the plan's mesh and roles (over the devices of
    ``mesh`` when that is the backend's own mesh)."""
    if isinstance(backend, Backend) and plan is not None and backend.mesh != plan.mesh():
        raise ShardingError(f"backend {backend!r} has mesh roles {backend.mesh.roles} but the plan {plan.name!r} "
                            f"needs {plan.mesh().roles}; pass the backend's name instead")
    if plan is None:
        return get_backend(backend, mesh)
    return get_backend(backend, mesh if mesh is not None and not isinstance(mesh, (str, MeshSpec)) else plan.mesh(),
                       spec=plan.mesh())
