"""Candidate sharding plans for one mesh, and the legality filters applied before any costing.

A candidate is a :class:`~wan_sharding.plan.ShardingPlan`: which mesh axes (and in which order)
carry SP and which TP (each role: none, one axis, or both), FSDP over the SP axes or not, the
activation layout between Megatron pairs, and the padding mode. Filters, each leaving a reason:

- TP must divide the head count (whole heads per chip; 40 for A14B, 24 for TI2V-5B), and D / TP
  and FFN / TP must be whole 32-wide tiles;
- without padding, the per-chip token count L / SP must be whole tiles (the hardware rejects the
  scatter otherwise); with padding (``slice`` / ``mask``) any SP is legal. Padding is only a
  candidate where it changes something (SP > 1 and L not already a multiple of SP x 32);
- ``shard_dit_specs`` must accept the plan on the real (meta-device) model;
- the per-chip memory estimate, both A14B experts included, must fit the chip's DRAM.

CFG split: classifier-free guidance runs two forwards per denoising step (cond and uncond). Besides
plans that run both on the whole mesh one after the other, every mesh axis of even size can be cut
in two halves that run one forward each at the same time (the batch of two sharded over that cut).
Such a candidate is a plan on the half mesh (``Candidate.plan``, what each group runs and what the
memory model and stage 1 cost) plus the cut axis (``Candidate.cfg_axis``); ``Candidate.cfg_plan``
is the real plan, a :class:`~wan_sharding.plan.ShardingPlan` with ``cfg_axes`` on the whole mesh
(a cut axis of 2 becomes the cfg axis; a longer one is split into a ``cfg`` axis of 2 outside the
rest, as :func:`wan_sharding.mesh.with_cfg` cuts a preset), which ``--write`` saves and the
compiled stage compiles (:func:`wan_sharding.compile.cfg.compile_request`). Each half holds both
experts' weights whole at its own TP width, so it needs twice the weight memory per chip of the
same plan on the whole mesh; a split that does not fit is out, with that reason.

Plans that differ only in the order of the axes inside a role are kept once: tt-mlir lowers a
role spanning two axes to one collective per axis in mesh order whatever the plan's order (seen
for TP 8 over both axes of 2x4: the same TTNN collectives for either order), so they cost the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import permutations
from typing import Callable, Sequence

from ..mesh import PHYSICAL_AXIS_NAMES, TILE
from ..plan import LAYOUTS, ShardingPlan
from .analytic import Estimate
from .compiled import CompiledEstimate
from .workload import Memory, Workload, memory_per_chip

AXIS_NAMES = PHYSICAL_AXIS_NAMES  # the physical mesh axes, in order: the plan's axis names ("rows", "cols")


@dataclass
class Candidate:
    """One plan and what the planner learnt about it. ``reason`` is why it is out (empty: legal)."""

    plan: ShardingPlan
    cfg_axis: str | None = None  # CFG split: cond / uncond on the two halves of this physical axis
    reason: str = ""
    duplicate_of: str | None = None
    idle_axes: tuple[str, ...] = ()
    memory: Memory | None = None
    analytic: Estimate | None = None  # stage 1
    compiled: CompiledEstimate | None = None  # stage 2 (None: not compiled)
    notes: list[str] = field(default_factory=list)
    tp_crosses_hosts: bool = False  # a TP axis runs across a host boundary (set by the search)

    @property
    def name(self) -> str:
        return self.plan.name + (f" + cfg2[{self.cfg_axis}]" if self.cfg_axis else "")

    @property
    def cfg_plan(self) -> ShardingPlan | None:
        """The CFG split as a real plan on the whole mesh (``cfg_axes`` set); None without a split."""
        return cfg_plan(self.plan, self.cfg_axis) if self.cfg_axis else None

    @property
    def full_plan(self) -> ShardingPlan:
        """What runs: the cfg plan for a CFG split, else the plan."""
        return self.cfg_plan or self.plan

    @property
    def cfg_parts(self) -> int:
        """Forwards of one denoising step that run at once: 2 for a CFG split, else 1."""
        return 2 if self.cfg_axis else 1

    @property
    def legal(self) -> bool:
        return not self.reason and self.duplicate_of is None

    @property
    def sp(self) -> int:
        return self.plan.mesh().sp

    @property
    def tp(self) -> int:
        return self.plan.mesh().tp


def role_options(shape: Sequence[int], names: Sequence[str] = PHYSICAL_AXIS_NAMES) -> list[tuple[str, ...]]:
    """Axis tuples one role can take: none, each axis of size > 1, and every order of several."""
    usable = [n for n, s in zip(names, shape) if s > 1]
    out: list[tuple[str, ...]] = [()]
    for k in range(1, len(usable) + 1):
        for combo in permutations(usable, k):
            out.append(tuple(combo))
    return out


def padding_options(work: Workload, sp: int) -> list[str]:
    """``["none"]`` when padding would change nothing, else the two exact padding modes (plus
    ``none`` so that the planner can say why it is out)."""
    if sp == 1 or work.tokens % (sp * TILE) == 0:
        return ["none"]
    return ["mask", "slice", "none"]


def enumerate_plans(work: Workload, mesh_shape: Sequence[int],
                    names: Sequence[str] = PHYSICAL_AXIS_NAMES) -> list[ShardingPlan]:
    """Every assignment of mesh axes to SP and TP with the FSDP, layout and padding choices that
    apply to it (FSDP only with SP > 1, a layout choice only with TP > 1)."""
    shape = tuple(int(s) for s in mesh_shape)
    names = tuple(names[: len(shape)])
    sizes = dict(zip(names, shape))
    plans = []
    for sp_axes in role_options(shape, names):
        for tp_axes in role_options(shape, names):
            if set(sp_axes) & set(tp_axes):
                continue
            sp = math.prod(sizes[a] for a in sp_axes)
            tp = math.prod(sizes[a] for a in tp_axes)
            for fsdp in ((False, True) if sp > 1 else (False,)):
                for layout in (LAYOUTS if tp > 1 else ("replicated",)):
                    for padding in padding_options(work, sp):
                        plans.append(ShardingPlan(shape, names, sp_axes, tp_axes, fsdp, layout, padding))
    return plans


def cfg_halves(work: Workload, mesh_shape: Sequence[int],
               names: Sequence[str] = PHYSICAL_AXIS_NAMES) -> list[tuple[str, ShardingPlan]]:
    """CFG-split candidates: for every axis of even size, the plans of the half mesh cut along it,
    each with the name of the cut axis."""
    shape = tuple(int(s) for s in mesh_shape)
    out = []
    for i, size in enumerate(shape):
        if size < 2 or size % 2:
            continue
        half = list(shape)
        half[i] //= 2
        out += [(names[i], p) for p in enumerate_plans(work, half, names)]
    return out


CFG_AXIS = "cfg"  # the axis a cut longer than 2 adds (as wan_sharding.mesh.with_cfg names it)


def cfg_plan(half: ShardingPlan, cut_axis: str) -> ShardingPlan:
    """The whole-mesh plan of the CFG split of ``half`` (a half-mesh plan) along ``cut_axis``: the
    cut axis of the whole mesh was 2 (``half`` has it at 1): it becomes the cfg axis; longer, it is
    split into a ``cfg`` axis of 2 in front of it (row-major device order: each half a contiguous
    block). ``wan_sharding.compile.cfg.group_plan`` of the result is ``half`` again."""
    i = half.axis_names.index(cut_axis)
    shape, names = list(half.mesh_shape), list(half.axis_names)
    if shape[i] == 1:
        shape[i] = 2
        cfg_axes = (cut_axis,)
    else:
        shape[i:i] = [2]
        names[i:i] = [CFG_AXIS]
        cfg_axes = (CFG_AXIS,)
    return ShardingPlan(tuple(shape), tuple(names), half.sp_axes, half.tp_axes, half.fsdp, half.layout, half.padding,
                        cfg_axes)


def signature(plan: ShardingPlan, cfg_axis: str | None = None) -> tuple:
    """What the compiled program depends on: axis sets per role (their order inside a role does
    not change tt-mlir's collectives), FSDP, layout, padding; and the CFG cut, if any."""
    return (plan.mesh_shape, frozenset(plan.sp_axes), frozenset(plan.tp_axes), plan.fsdp, plan.layout, plan.padding,
            cfg_axis)


def structural_reason(work: Workload, plan: ShardingPlan) -> str:
    """Why ``plan`` cannot run at all, from shapes alone (empty when it can)."""
    m = plan.mesh()
    sp, tp = m.sp, m.tp
    if work.heads % tp:
        return f"TP {tp} does not divide {work.heads} heads"
    if (work.dim // tp) % TILE or work.dim % tp:
        return f"D/TP = {work.dim}/{tp} is not whole {TILE}-wide tiles"
    if work.ffn % tp or (work.ffn // tp) % TILE:
        return f"FFN/TP = {work.ffn}/{tp} is not whole {TILE}-wide tiles"
    if plan.padding == "none" and sp > 1 and work.tokens % (sp * TILE):
        per = work.tokens / sp
        return (f"unpadded: L/SP = {work.tokens}/{sp} = {per:g} tokens per chip is not whole tiles "
                f"(the hardware rejects the scatter; use padding)")
    return ""


def build_candidates(work: Workload, mesh_shape: Sequence[int], dram_bytes: float,
                     weight_bytes: Callable[[ShardingPlan], float], attention: str = "fused",
                     names: Sequence[str] = PHYSICAL_AXIS_NAMES,
                     keep: Callable[[ShardingPlan], bool] | None = None, cfg_split: bool = True,
                     mesh_rejected: Callable[[tuple[int, ...]], str] | None = None,
                     text_encoder_bytes: Callable[[ShardingPlan], float] | None = None) -> list[Candidate]:
    """All candidates for ``mesh_shape`` with legality decided.

    ``dram_bytes`` is the per-chip budget. ``weight_bytes(plan)`` returns one expert's weight bytes
    per chip under ``plan`` (the caller runs ``shard_dit_specs`` on a meta model); a ``ValueError``
    from it makes the plan illegal; so does one from ``text_encoder_bytes(plan)``, the UMT5 encoder's
    bytes per chip when it is on the mesh too (``None``: on the host). ``keep``: restrict the search
    to the plans it accepts.
    ``cfg_split``: add the CFG-split candidates (see the module docstring). ``mesh_rejected(shape)``:
    why the compiler will not take a (half) mesh of that shape, empty if it will.
    """
    out: list[Candidate] = []
    seen: dict[tuple, str] = {}
    whole = [(None, p) for p in enumerate_plans(work, mesh_shape, names)]
    for cfg_axis, plan in whole + (cfg_halves(work, mesh_shape, names) if cfg_split else []):
        if keep is not None and not keep(plan):
            continue
        cand = Candidate(plan, cfg_axis)
        used = set(plan.sp_axes) | set(plan.tp_axes)
        cand.idle_axes = tuple(a for a, s in zip(plan.axis_names, plan.mesh_shape) if s > 1 and a not in used)
        sig = signature(plan, cfg_axis)
        if sig in seen:
            cand.duplicate_of = seen[sig]
            out.append(cand)
            continue
        seen[sig] = cand.name
        cand.reason = structural_reason(work, plan)
        if not cand.reason and mesh_rejected is not None:
            cand.reason = mesh_rejected(plan.mesh_shape)
        if not cand.reason:
            try:
                wb = weight_bytes(plan)
            except ValueError as e:  # ShardingError: the specs refuse the plan
                cand.reason = f"shard_dit_specs refuses it: {e}"
            else:
                try:
                    te = text_encoder_bytes(plan) if text_encoder_bytes is not None else 0.0
                except ValueError as e:  # the text encoder on the mesh: its TP must divide 64 heads and d_ff
                    cand.reason = f"the text encoder cannot be sharded on it: {e}"
                    out.append(cand)
                    continue
                cand.memory = memory_per_chip(work, plan, wb, attention, te)
                if cand.memory.total > dram_bytes:
                    cand.reason = (f"needs {cand.memory.total / 1e9:.1f} GB per chip > "
                                   f"{dram_bytes / 1e9:.1f} GB usable "
                                   f"(weights {cand.memory.weights / 1e9:.1f} GB"
                                   + (f", text encoder {te / 1e9:.1f} GB" if te else "")
                                   + ("" if plan.fsdp or plan.mesh().sp == 1 else "; FSDP would divide them by SP")
                                   + (f"; CFG split: each half holds every expert whole at TP {plan.mesh().tp}"
                                      if cfg_axis else "")
                                   + ")")
        out.append(cand)
    return out


def restriction(layout: str | None = None, padding: str | None = None,
                fsdp: bool | None = None) -> Callable[[ShardingPlan], bool] | None:
    """A plan filter for :func:`build_candidates` (``keep``): only plans with this ``layout``,
    ``padding`` mode and FSDP choice; None when nothing is restricted. Plans with SP 1 stay under a
    padding restriction (they need none) and under ``fsdp=True`` (FSDP needs SP > 1)."""
    tests: list[Callable[[ShardingPlan], bool]] = []
    if layout:
        tests.append(lambda p: p.layout == layout)
    if padding:
        tests.append(lambda p: p.padding == padding or (p.padding == "none" and p.mesh().sp == 1))
    if fsdp is not None:
        tests.append(lambda p: p.fsdp == fsdp or (fsdp and p.mesh().sp == 1))
    return (lambda p: all(t(p) for t in tests)) if tests else None
