"""Plan the sharding of the Wan 2.2 DiT and its placement on a Tenstorrent mesh.

Two stages, a compiler-mediated planner (``docs/design.md``): an analytic stage scores every legal
plan from shapes and specs (:mod:`.analytic`), and the best few are compiled with tt-mlir in
compile-only mode and costed op by op from their TTNN programs on a model of the chip fabric
(:mod:`.compiled`, :mod:`.ir_cost`, :mod:`.hardware`). ``wan-sharding plan`` is the command;
:func:`plan_sharding` the function, :func:`format_report` its text.

Imports run one way: ``workload`` / ``hardware`` -> ``weights`` (bytes per chip) / ``ir_cost`` -> ``analytic`` / ``compiled`` ->
``candidates`` -> ``hosts`` (what crosses hosts) -> ``search`` -> ``report``. TTNN text is read by :mod:`wan_sharding.compile.ttnn_ir`,
meshes by :func:`wan_sharding.mesh.parse_mesh_shape`.
"""

from .analytic import Estimate
from .candidates import Candidate
from .compiled import CompiledEstimate
from .hardware import Chip, Fabric, chip, fabric_for
from .report import format_report
from .search import PlannerError, PlanReport, plan_sharding
from .workload import Workload

# What a user of the planner needs; the stages' helpers stay in their modules.
__all__ = [
    "Candidate", "Chip", "CompiledEstimate", "Estimate", "Fabric", "PlanReport", "PlannerError", "Workload", "chip",
    "fabric_for", "format_report", "plan_sharding",
]
