"""What crosses hosts on a mesh of several (several Galaxies, one host each, or a rank binding of
tt-xla's distributed runtime: :func:`wan_sharding.systems.host_cuts`): the hosts on the mesh a
candidate runs or is compiled on, whether its TP crosses a host boundary, how that ranks, and the
bytes per denoising step. :mod:`.search` applies them.
"""

from __future__ import annotations

from typing import Any

from ..compile.cfg import ONE_PROGRAM, SEQUENTIAL_FORWARDS_PER_STEP, cfg_compile
from ..mesh import PHYSICAL_AXIS_NAMES
from ..systems import HostCuts
from .candidates import Candidate

# How much faster a plan whose TP crosses hosts must be to win: TP's all-reduces run in every block,
# and on the inter-host links they depend on cables whose figures are assumptions
# (docs/hardware-facts.md); the model's own resolution (search.NEAR_TIE) is as large.
TP_ACROSS_HOSTS = 0.03


def hosts_json(cuts: HostCuts | None, binding: str = "") -> dict[str, Any] | None:
    """Where the hosts fall on the planned mesh (None: one host)."""
    if cuts is None:
        return None
    return {"hosts": cuts.hosts, "source": cuts.source, "rank_binding": binding or None,
            "crossing_axes": [{"axis": PHYSICAL_AXIS_NAMES[i], "chips_per_host": cuts.segment(i)}
                              for i in cuts.crossing_axes()]}


def candidate_cuts(cuts: HostCuts | None, c: Candidate) -> HostCuts | None:
    """The hosts on the mesh ``c``'s plan runs on: the whole mesh's, or one half's for a CFG split."""
    if cuts is None or not c.cfg_axis:
        return cuts
    return cuts.part(PHYSICAL_AXIS_NAMES.index(c.cfg_axis), c.cfg_parts)


def compile_cuts(cuts: HostCuts | None, c: Candidate) -> HostCuts | None:
    """The hosts on the mesh ``c``'s program is compiled for (see :func:`compile_fabric`)."""
    if c.cfg_axis and cfg_compile(c.cfg_plan).how == ONE_PROGRAM:
        return cuts
    return candidate_cuts(cuts, c)


def tp_crosses_hosts(cuts: HostCuts | None, c: Candidate) -> bool:
    """Whether one of ``c``'s TP axes runs across a host boundary."""
    part = candidate_cuts(cuts, c)
    return part is not None and any(part.segment(PHYSICAL_AXIS_NAMES.index(a)) for a in c.plan.tp_axes)


def ranking_seconds(c: Candidate, seconds: float) -> float:
    """What ``c`` is ranked by: its estimate, with the handicap :data:`TP_ACROSS_HOSTS` when its TP
    crosses hosts."""
    return seconds * (1.0 + TP_ACROSS_HOSTS) if c.tp_crosses_hosts else seconds


def cross_host_gb_per_step(cuts: HostCuts | None, layers: int, c: Candidate) -> float | None:
    """GB the whole mesh moves between hosts in one denoising step under ``c`` (None: one host, or
    no estimate): the compiled program's when there is one, else the analytic block's x ``layers``."""
    if cuts is None:
        return None
    if c.compiled is not None and c.compiled.ok:
        return (c.compiled.per_step(layers) or {}).get("cross_host_gb")
    if c.analytic is None:
        return None
    return round(SEQUENTIAL_FORWARDS_PER_STEP * layers * c.analytic.per_block.cross_host_bytes / 1e9, 4)
