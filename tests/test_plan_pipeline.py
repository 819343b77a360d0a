"""From plan to pipeline: the planner's recommended plans applied through ``shard_pipeline(plan=...)``.

The plans are the recommendations the planner recorded in ``results/plan_<mesh>_<arch>_480p.json``
(the full two-stage planner with tt-mlir, ``scripts/bench_plan.py --with-plans``): inputs here,
not outputs of the code under test. Each runs the tiny pipeline sharded vs unsharded on jax and xla
(a worker per backend and device count, two at a time), and its weights per device as the backend
placed them are compared with what the planner counts for the same plan and model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from wan_sharding.jobs.generate import plans_compare_in_subprocess
from wan_sharding.plan import ShardingPlan

RESULTS = Path(__file__).resolve().parents[1] / "results"
SYSTEMS = [("2x4", "wormhole_b0"), ("2x4", "blackhole"), ("8x4", "wormhole_b0"), ("8x4", "blackhole")]
MAX_ABS = 1e-4  # fp32 final latents; observed ~3e-6
VARIANTS = ("i2v-a14b", "ti2v-5b")
BYTES_TOLERANCE = 0.01  # placed vs planner-counted weights per device; observed equal


def recommended(mesh: str, arch: str) -> ShardingPlan:
    data = json.loads((RESULTS / f"plan_{mesh}_{arch}_480p.json").read_text())
    return ShardingPlan.from_dict(data["recommended"]["plan"])


PLANS = {f"{mesh}-{arch}": recommended(mesh, arch) for mesh, arch in SYSTEMS}


@pytest.fixture(scope="module")
def runs() -> dict[str, Future]:
    by_devices: dict[int, list[ShardingPlan]] = {}
    for plan in PLANS.values():
        by_devices.setdefault(plan.mesh().num_devices, []).append(plan)
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {"jax": pool.submit(plans_compare_in_subprocess, "jax", list(PLANS.values()))}
    for variant in VARIANTS:  # every pipeline: I2V-A14B (WanImageToVideoPipeline), TI2V-5B (one expert)
        futures[variant] = pool.submit(plans_compare_in_subprocess, "jax", [PLANS["2x4-wormhole_b0"]], variant)
    for n, plans in by_devices.items():
        futures[f"xla-{n}"] = pool.submit(plans_compare_in_subprocess, "xla", plans)
    yield futures
    pool.shutdown(wait=True)


def test_recommended_plans_are_varied():
    """The four systems' recommendations exercise what a plan carries beyond a preset."""
    plans = list(PLANS.values())
    assert any(p.fsdp for p in plans)
    assert any(p.sp_axes and p.sp_axes != (p.axis_names[0],) for p in plans) or any(len(p.tp_axes) > 1 for p in plans)


@pytest.mark.parametrize("backend", ["jax", "xla"])
@pytest.mark.parametrize("system", list(PLANS))
def test_recommended_plan_runs_the_pipeline_exactly(runs, backend, system):
    plan = PLANS[system]
    key = "jax" if backend == "jax" else f"xla-{plan.mesh().num_devices}"
    r = next(x for x in runs[key].result() if x["plan"] == plan.name)
    assert r["max_abs"] <= MAX_ABS and r["pcc"] >= 0.99999, r
    assert r["padding"] == plan.padding and r["fsdp"] == plan.fsdp and r["restored"]
    for expert, m in r["memory"].items():
        assert abs(m["placed_max"] / m["predicted"] - 1) <= BYTES_TOLERANCE, (expert, m)
        assert m["placed_min"] <= m["placed_max"] < m["unsharded"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_plan_shards_every_pipeline(runs, variant):
    plan = PLANS["2x4-wormhole_b0"]
    (r,) = runs[variant].result()
    assert r["max_abs"] <= MAX_ABS and r["restored"], r
    assert len(r["memory"]) == (1 if variant == "ti2v-5b" else 2)
    assert all(m["placed_max"] == m["predicted"] for m in r["memory"].values()), r["memory"]
    assert plan.fsdp and all(m["placed_max"] < m["unsharded"] / 4 for m in r["memory"].values())


def test_plan_contradictions_are_usage_errors(tmp_path):
    path = tmp_path / "plan.json"
    PLANS["2x4-wormhole_b0"].save(path)
    cli = [sys.executable, "-m", "wan_sharding.cli"]
    plan = PLANS["2x4-wormhole_b0"]
    other = "slice" if plan.padding != "slice" else "mask"
    for args in (["generate", "--plan", str(path), "--padding", other],
                 ["check", "--plan", str(path), "--meshes", "8x4"],
                 ["profile", "--plan", str(path), "--mesh", "unsharded"]):
        proc = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert "plan" in proc.stderr


def test_shard_pipeline_plan_argument_checks():
    """Before anything is changed: a plan path that does not exist, and a padding that contradicts it."""
    from wan_sharding.compose import resolve
    from wan_sharding.specs import ShardingError

    plan = PLANS["2x4-wormhole_b0"]
    with pytest.raises(ShardingError, match="cannot read plan file"):
        resolve(None, "jax", plan="/nonexistent/plan.json")
    with pytest.raises(ShardingError, match="contradicts the plan's padding"):
        resolve(None, "jax", "slice" if plan.padding != "slice" else "mask", plan=plan)
    with pytest.raises(ShardingError, match="contradicts the plan's mesh"):
        resolve("8x4", "jax", plan=plan)
    resolved = resolve(None, "jax", plan=plan)  # this process's JAX has the plan's 8 devices
    assert resolved.plan is plan and resolved.padding == plan.padding and resolved.mesh == plan.mesh()
