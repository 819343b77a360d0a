"""Plan the sharding of the Wan 2.2 DiT and its placement on a Tenstorrent mesh.

Two stages, after the seed's compiler-mediated planner: an analytic stage scores every legal
plan from shapes and specs (:mod:`.analytic`), and the best few are compiled with tt-mlir in
compile-only mode and costed op by op from their TTNN programs on a model of the chip fabric
(:mod:`.compiled`, :mod:`.ir_cost`, :mod:`.hardware`). ``wan-sharding plan`` is the command;
:func:`plan_sharding` the function.
"""

from .candidates import Candidate, build_candidates, enumerate_plans
from .hardware import Chip, Fabric, chip, collective_seconds, fabric_for
from .search import PlannerError, PlanReport, plan_sharding
from .workload import Memory, Workload, memory_per_chip

__all__ = [
    "Candidate", "Chip", "Fabric", "Memory", "PlanReport", "PlannerError", "Workload", "build_candidates", "chip",
    "collective_seconds", "enumerate_plans", "fabric_for", "memory_per_chip", "plan_sharding",
]
