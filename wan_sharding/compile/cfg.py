"""CFG parallel through tt-mlir: which program a cfg plan compiles to, and a denoising step's bill.

A plan with ``cfg_axes`` (``--cfg 2``, :func:`wan_sharding.mesh.with_cfg`) runs a step's two
expert calls (cond, uncond) as one forward with a batch of two, the batch split over the cfg axis:
each half of the mesh (a group) runs one branch. What reaches tt-mlir:

- a **2-D cfg mesh** (``2x4 --cfg 2``: cfg 2 x TP 4, groups of 1x4) compiles as it is: **one
  program** with a batch of ``2 x`` the per-branch batch (cond rows, then uncond rows), the batch
  split over cfg by the inputs' shardings (``MeshSpec.batch_spec``);
- a **3-D cfg mesh** (``8x4 --cfg 2``: cfg 2 x SP 4 x TP 4; ``4x16-tt-metal --cfg 2``: TP 4 x
  cfg 2 x SP 8) cannot: tt-mlir takes 0-, 1- and 2-D meshes only (tenstorrent/tt-mlir
  ``lib/Dialect/StableHLO/Utils/ShardyUtils.cpp``: "Pass expects a 0D, 1D, or 2D mesh";
  ``lib/Dialect/StableHLO/Utils/GSPMDUtils.cpp``: "only 1D and 2D meshes are supported"). It
  compiles the **per-group program**: :func:`group_plan` (the cfg axes removed: 4x4 SP 4 / TP 4,
  4x8 TP 4 / SP 8) with the per-branch batch. That is what SPMD partitioning of the batch-2
  program gives every device: the batch split over cfg leaves each device one branch's rows, and
  no weight and no collective spans the cfg axis (weights are whole across it, every constraint
  keeps the batch on it), so every collective stays inside a group. On 2x4, where both can be
  compiled, the two give the same per-block ops and collectives (``tests/test_cfg_compile.py``).

A step's figures (:func:`step_figures`): with guidance on, a plan without cfg runs **2 forwards
per step** (cond, then uncond, on the whole mesh); a cfg plan **1** (both branches at once, one per
group). Per step = forwards per step x per forward, so SP and cfg layouts compare on one unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..mesh import CFG_BRANCHES
from ..plan import ShardingPlan
from ..systems import HostCuts, host_cuts, rank_binding
from .request import CompileError, CompileRequest
from .ttnn_ir import TTNNModule

# tt-mlir's limit on mesh rank (the source lines named in the module docstring).
TT_MLIR_MAX_MESH_RANK = 2
# A step with guidance on, without CFG parallel: the cond forward, then the uncond one.
SEQUENTIAL_FORWARDS_PER_STEP = CFG_BRANCHES
ONE_PROGRAM, PER_GROUP = "one program", "per group"


def group_plan(plan: ShardingPlan) -> ShardingPlan:
    """``plan`` without its cfg axes: the plan one guidance group (one branch) runs on its
    sub-mesh. A cfg axis that leaves fewer than two axes stays as a size-1 axis without a role (a
    preset's cfg axis named ``"cfg"`` is renamed ``"sp"``, as the 1x4 preset names it), so 2x4-cfg2
    gives 1x4 TP 4; 8x4-cfg2 gives 4x4 SP 4 / TP 4; 4x16-tt-metal-cfg2 4x8 TP 4 / SP 8."""
    if not plan.cfg_axes:
        return plan
    shape, names = list(plan.mesh_shape), list(plan.axis_names)
    for a in plan.cfg_axes:
        i = names.index(a)
        if len(names) > TT_MLIR_MAX_MESH_RANK:
            del shape[i], names[i]
        else:  # keep the mesh 2-D: the axis stays, one device long, carrying nothing
            shape[i] = 1
            if names[i] == "cfg" and "sp" not in names:
                names[i] = "sp"
    return ShardingPlan(tuple(shape), tuple(names), plan.sp_axes, plan.tp_axes, plan.fsdp, plan.layout, plan.padding)


@dataclass(frozen=True)
class CfgCompile:
    """How a plan compiles: ``how`` (:data:`ONE_PROGRAM` or :data:`PER_GROUP`; ``None`` without
    cfg), the plan tt-mlir compiles, the request's batch and a step's forwards."""

    plan: ShardingPlan
    compiled_plan: ShardingPlan
    batch: int
    branch_batch: int
    how: str | None
    note: str | None

    @property
    def forwards_per_step(self) -> int:
        return 1 if self.how else SEQUENTIAL_FORWARDS_PER_STEP

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.plan.name, "cfg_axes": list(self.plan.cfg_axes), "how": self.how,
                "compiled_plan": self.compiled_plan.name, "compiled_mesh": list(self.compiled_plan.mesh_shape),
                "batch": self.batch, "branch_batch": self.branch_batch, "forwards_per_step": self.forwards_per_step,
                "note": self.note}


def cfg_compile(plan: ShardingPlan, branch_batch: int = 1) -> CfgCompile:
    """What compiling ``plan`` means (module docstring): the plan itself with batch ``2 x
    branch_batch`` on a 2-D cfg mesh, the group plan with ``branch_batch`` on a 3-D one."""
    if branch_batch < 1:
        raise CompileError(f"batch must be >= 1, got {branch_batch}")
    if not plan.cfg_axes:
        return CfgCompile(plan, plan, branch_batch, branch_batch, None, None)
    mesh = plan.mesh()
    if len(plan.mesh_shape) <= TT_MLIR_MAX_MESH_RANK:
        note = (f"CFG parallel on a {len(plan.mesh_shape)}-D mesh: one program, batch {CFG_BRANCHES * branch_batch} "
                f"(cond + uncond rows) split over {'+'.join(plan.cfg_axes)}, each group of {mesh.group_devices} "
                "devices one branch")
        return CfgCompile(plan, plan, CFG_BRANCHES * branch_batch, branch_batch, ONE_PROGRAM, note)
    group = group_plan(plan)
    note = (f"CFG parallel on a {len(plan.mesh_shape)}-D mesh ({mesh.name}), which tt-mlir does not take (1-D and 2-D "
            "meshes only: tenstorrent/tt-mlir lib/Dialect/StableHLO/Utils/ShardyUtils.cpp): compiled the per-group "
            f"program, {group.name} with batch {branch_batch}, which is what SPMD partitioning of the batch-"
            f"{CFG_BRANCHES * branch_batch} program gives each device (batch split over cfg, every collective inside "
            "a group)")
    return CfgCompile(plan, group, branch_batch, branch_batch, PER_GROUP, note)


def compile_request(plan: ShardingPlan, branch_batch: int = 1, **fields: Any) -> CompileRequest:
    """The :class:`CompileRequest` that compiles ``plan`` (:func:`cfg_compile`), its note first in
    ``notes`` and the cfg plan in ``cfg_plan`` (for the report's per-step figures)."""
    how = cfg_compile(plan, branch_batch)
    notes = (how.note,) if how.note else ()
    notes += tuple(fields.pop("notes", ()))
    return CompileRequest.for_plan(how.compiled_plan, batch=how.batch, notes=notes,
                                   cfg_plan=plan if plan.cfg_axes else None, **fields)


def request_cfg(req: CompileRequest) -> CfgCompile:
    """How ``req`` stands for its cfg plan (``how`` None: no CFG parallel)."""
    one_program = req.plan is not None and bool(req.plan.cfg_axes)
    if req.cfg_plan is not None:
        return cfg_compile(req.cfg_plan, req.batch // (CFG_BRANCHES if one_program else 1))
    if one_program:
        return cfg_compile(req.plan, req.batch // CFG_BRANCHES)
    plan = req.plan if req.plan is not None else ShardingPlan.from_mesh(req.mesh_spec(), padding=req.padding)
    return CfgCompile(plan, plan, req.batch, req.batch, None, None)


# --------------------------------------------------------------------------------- per step


def _forward_counts(module: TTNNModule, cuts: HostCuts | None = None) -> dict[str, float]:
    """A program's collectives (count, large ones, bytes per device: results, the SP scatter's
    local slices left out) and its runtime ops (bookkeeping left out); with ``cuts``, also the
    bytes its collectives move between hosts (the whole mesh)."""
    from .bill import host_link_bytes

    moving = [c for c in module.collectives if c.kind != "mesh_partition"]
    out = {"collectives": len(moving), "large_collectives": sum(1 for c in moving if c.size == "large"),
           "collective_bytes": sum(c.bytes for c in moving),
           "runtime_ops": sum(module.program_ops(const_eval=False).values())}
    if cuts is not None:
        out["cross_host_bytes"] = host_link_bytes(moving, cuts)
    return out


def host_cuts_for(how: CfgCompile, binding: str | None = None) -> tuple[HostCuts | None, int]:
    """``(cuts, programs)``: where the hosts fall on the mesh of the program ``how`` compiles, and
    how many such programs a step runs at once (a cfg plan compiled per group: one per group; else
    one). The whole mesh's hosts are ``binding``'s, or one per Galaxy (None: one host)."""
    whole = how.plan.mesh().grid
    if len(whole) != 2:
        return None, 1
    cuts = host_cuts(whole, rank_binding(binding) if binding else None)
    if cuts is None or how.how != PER_GROUP:
        return cuts, 1
    group = how.compiled_plan.mesh().grid
    axis = next(i for i in range(2) if group[i] != whole[i])
    return cuts.part(axis, whole[axis] // group[axis]), whole[axis] // group[axis]


def step_figures(shallow: TTNNModule, deep: TTNNModule, shallow_blocks: int, deep_blocks: int, layers: int,
                 forwards_per_step: int, cuts: HostCuts | None = None) -> dict[str, Any]:
    """Per device, for a model of ``layers`` blocks: per block, per forward (once-per-forward part
    + ``layers`` x per block, from the two depths' difference) and per denoising step
    (``forwards_per_step`` x per forward). With ``cuts`` each also has ``cross_host_bytes``: what the
    whole mesh moves between hosts."""
    a, b = _forward_counts(shallow, cuts), _forward_counts(deep, cuts)
    n = deep_blocks - shallow_blocks
    per_block = {k: (b[k] - a[k]) / n for k in a}
    per_forward = {k: a[k] - shallow_blocks * per_block[k] + layers * per_block[k] for k in a}

    def whole(d: dict[str, float], k: float = 1) -> dict[str, float]:
        return {key: (int(v * k) if float(v * k).is_integer() else round(v * k, 3)) for key, v in d.items()}

    return {"forwards_per_step": forwards_per_step, "blocks": layers, "per_block": whole(per_block),
            "per_block_per_step": whole(per_block, forwards_per_step), "per_forward": whole(per_forward),
            "per_step": whole(per_forward, forwards_per_step)}
