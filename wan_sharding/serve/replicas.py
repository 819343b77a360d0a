"""``serve --replicas N``: the server's mesh split into N equal sub-meshes, one resident worker each.

Data parallelism over independent requests: each sub-mesh holds a whole copy of the pipeline,
sharded on that sub-mesh as ``shard_pipeline`` shards it on any mesh, and runs its own jobs. The
mesh is split along one axis, the first of: an axis without a role (splitting it changes nothing
in the sharding), the SP axis (each replica keeps the full TP: the same weight shards per device),
then the TP axis when the smaller TP still divides the attention heads. A count that no axis
takes is refused in one line, with the counts that work, before any worker starts.

Each replica's devices are the block of the mesh it keeps, numbered row-major over the whole mesh
(a 2x4 mesh split in two: devices 0-3 and 4-7). A CPU worker gets that many virtual devices of its
own; a ``tt`` worker gets those chips through ``TT_VISIBLE_DEVICES``, as tt-media-server's
scheduler gives each of its device workers its group of chips (``tt-media-server/utils/runner_utils.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobs.requests import UsageError, read_json_file
from ..mesh import PRESET_TABLE, MeshSpec, mesh_from_preset


@dataclass(frozen=True)
class Replica:
    """One sub-mesh: its index, the mesh it shards on and the devices of the whole mesh it uses."""

    index: int
    mesh: MeshSpec
    devices: tuple[int, ...]

    @property
    def devices_label(self) -> str:
        d = self.devices
        return f"{d[0]}-{d[-1]}" if list(d) == list(range(d[0], d[-1] + 1)) and len(d) > 1 else ",".join(map(str, d))

    def mesh_dict(self) -> dict[str, Any]:
        """The mesh for the worker's JSON configuration (:func:`mesh_from_dict` reads it)."""
        roles = {k: list(v) if isinstance(v, tuple) else v for k, v in self.mesh.roles.items()}
        return {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names), "roles": roles,
                "preset": self.mesh.preset}


def mesh_from_dict(d: dict[str, Any]) -> MeshSpec:
    return MeshSpec(tuple(d["shape"]), tuple(d["axis_names"]), d["roles"], preset=d.get("preset"))


def model_heads(variant: str, model: str | None) -> int:
    """Attention heads of the DiT that will be sharded: the tiny config's, or the checkpoint's."""
    if model is None:
        from ..models import config_for

        return int(config_for(variant, "tiny")["num_attention_heads"])
    root = Path(model)
    cfg = (read_json_file(root / "transformer" / "config.json", required=False)
           or read_json_file(root / "transformer_2" / "config.json", required=False) or {})
    return int(cfg.get("num_attention_heads") or 1)


def _axes(role: Any) -> tuple[str, ...]:
    return () if role is None else ((role,) if isinstance(role, str) else tuple(role))


def _split_axis(mesh: MeshSpec, n: int, heads: int) -> str | None:
    """The axis ``n`` replicas split, or None when none can."""
    sp, tp, cfg = _axes(mesh.sp_axis), _axes(mesh.tp_axis), _axes(mesh.cfg_axis)
    # never the cfg axis: each replica keeps its two guidance groups
    free = tuple(a for a in mesh.axis_names if a not in sp + tp + cfg)
    for axis in free + sp + tp:
        size = mesh.axis_size(axis)
        if size % n:
            continue
        if axis in tp and heads % (mesh.tp // n):
            continue
        return axis
    return None


def _preset_of(shape: tuple[int, ...], like: MeshSpec) -> str | None:
    """The preset with this shape and the same role positions as ``like`` (for its name)."""
    pos = lambda m, role: tuple(m.axis_names.index(a) for a in _axes(m.roles.get(role)))  # noqa: E731
    for name, (pshape, _, _, _) in PRESET_TABLE.items():
        if tuple(pshape) == tuple(shape):
            p = mesh_from_preset(name)
            if pos(p, "sp") == pos(like, "sp") and pos(p, "tp") == pos(like, "tp"):
                return name
    return None


def split_mesh(mesh: MeshSpec, n: int, heads: int, variant: str = "the model") -> list[Replica]:
    """``mesh`` split into ``n`` equal sub-meshes the model shards on (see the module doc).

    Raises:
        UsageError: no axis splits into ``n`` such meshes (naming the counts that work).
    """
    import numpy as np

    ids = np.arange(mesh.num_devices).reshape(mesh.shape)
    if n == 1:
        return [Replica(0, mesh, tuple(int(i) for i in ids.ravel()))]
    axis = _split_axis(mesh, n, heads)
    if axis is None:
        work = [k for k in range(1, mesh.num_devices + 1) if k == 1 or _split_axis(mesh, k, heads) is not None]
        raise UsageError(f"--replicas {n}: mesh {mesh.name} (SP {mesh.sp}, TP {mesh.tp}) does not split into {n} equal "
                         f"sub-meshes that {variant} shards on (its {heads} attention heads need a TP that divides "
                         f"them); use --replicas {' or '.join(map(str, work))}, or another --mesh")
    pos = mesh.axis_names.index(axis)
    shape = tuple(s // n if i == pos else s for i, s in enumerate(mesh.shape))
    sub = MeshSpec(shape, mesh.axis_names, mesh.roles, preset=_preset_of(shape, mesh))
    return [Replica(i, sub, tuple(int(d) for d in block.ravel())) for i, block in enumerate(np.split(ids, n, axis=pos))]


def split_plan(plan: Any, n: int, heads: int, variant: str = "the model") -> tuple[Any, list[Replica]]:
    """A plan for one of ``n`` sub-meshes of the plan's mesh (its other choices kept), and the replicas."""
    replicas = split_mesh(plan.mesh(), n, heads, variant)
    return dataclasses.replace(plan, mesh_shape=replicas[0].mesh.shape), replicas
