"""``plan --verify``: a plan placed for real on the full-size experts, against the planner's count.

The worker builds the full-size DiT on the meta device, shards it with the plan on the ``jax``
backend over as many CPU devices as the plan's mesh, and places every weight as an abstract
``ShapeDtypeStruct`` with its ``NamedSharding`` (no weight memory). The bytes each device would
hold are read from those shardings (the slices JAX assigns each device), not from the specs'
arithmetic the planner uses, and put next to the planner's count for the same plan. Runs in a
worker (``python -m wan_sharding.jobs.placement``).
"""

from __future__ import annotations

import sys
from typing import Any

from ..runtime.workers import WorkerError, run_worker, worker_main
from .launch import plan_devices, stall_seconds, worker_env


def verify_in_subprocess(plan: Any, variant: str, timeout: float = 600) -> dict[str, Any]:
    """Per-device weight bytes of ``plan`` placed on the full-size ``variant`` (both experts of an
    A14B variant), next to the planner's count. One JAX worker with the plan's device count."""
    params = {"plan": plan.to_dict(), "variant": variant}
    run = run_worker("wan_sharding.jobs.placement", params, worker_env("jax", plan_devices(plan)),
                     label="jax worker (plan --verify)", timeout=timeout, stall_s=stall_seconds("jax"))
    if not run.ok:
        raise WorkerError(f"plan --verify worker failed (exit {run.returncode}):\n{run.output[-4000:]}")
    return run.results[-1]


def _verify(p: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from ..backends import get_backend
    from ..models import build_dit
    from ..plan import ShardingPlan
    from ..planner.weights import predicted_weight_bytes
    from ..planner.workload import BF16, EXPERTS
    from ..dit.specs import shard_dit_specs
    from .launch import prepare_worker

    prepare_worker("jax")
    plan = ShardingPlan.from_dict(p["plan"])
    dit = build_dit(p["variant"], "full", device="meta", dtype=torch.bfloat16)
    backend = get_backend("jax", plan.mesh())
    specs = shard_dit_specs(dit, plan)
    state = backend.abstract_state(dit, specs, dtype=torch.bfloat16)
    per_device = backend.placed_weight_bytes(dit, state)
    experts = EXPERTS[p["variant"]]
    predicted = predicted_weight_bytes(dit, plan, BF16)  # what the planner counts per expert
    return [{
        "plan": plan.name, "variant": p["variant"], "experts": experts, "devices": len(per_device),
        "placed_bytes_max": max(per_device) * experts, "placed_bytes_min": min(per_device) * experts,
        "predicted_bytes": predicted * experts,
        "placed_over_predicted": round(max(per_device) / predicted, 6),
    }]


if __name__ == "__main__":
    from ..backends import BackendError
    from ..specs import ShardingError

    sys.exit(worker_main(_verify, expected=(ShardingError, BackendError)))
