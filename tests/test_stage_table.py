"""The stage table's denoising runs the planner's best plan for each system, named in its row.

Inputs, not outputs of the code under test: the full planner's runs kept in
``results/plan_<RxC>_<arch>_<res>.json`` (its compiled ranking) and the planner's analytic model
(``planner/analytic.py``), against ``results/stages.json`` as ``scripts/bench_vae.py`` wrote it
and against :func:`wan_sharding.planner.stages.denoising_stage` itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wan_sharding.mesh import mesh_from_preset
from wan_sharding.plan import ShardingPlan
from wan_sharding.planner import analytic
from wan_sharding.planner.hardware import chip, fabric_for
from wan_sharding.planner.workload import Workload
from wan_sharding.systems import host_cuts

RESULTS = Path(__file__).resolve().parents[1] / "results"
STEPS, FORWARDS = 40, 2  # tt-metal's performance test: 40 steps; guidance on: 2 forwards a step


def _analytic_seconds(plan: ShardingPlan, arch: str, resolution: str) -> float:
    work = Workload.build("t2v-a14b", resolution)
    fabric = fabric_for(arch, plan.mesh_shape)
    cuts = host_cuts(tuple(plan.mesh_shape), None, (fabric.axes[0].wrap, fabric.axes[1].wrap))
    return analytic.estimate(work, plan, chip(arch), fabric, cuts).seconds_per_forward * FORWARDS * STEPS


def test_stage_rows_name_their_plan_and_its_figure():
    rows = json.loads((RESULTS / "stages.json").read_text())["rows"]
    rankings = set()
    for r in rows:
        d = r["stages"]["denoising"]
        p = d["plan"]
        plan = ShardingPlan.from_dict(p["plan"])
        assert p["name"].startswith("x".join(map(str, plan.mesh_shape)) + " ") and plan.mesh_shape == tuple(
            mesh_from_preset(r["mesh"]).shape)
        rankings.add(p["ranking"])
        if p["ranking"] == "compiled":  # the kept run's recommendation and its compiled figure
            run = json.loads((RESULTS.parent / p["source"]).read_text())
            assert run["recommended"]["name"] == p["name"] and run["recommended"]["plan"] == p["plan"]
            assert d["seconds"] == pytest.approx(run["recommended"]["estimated_seconds_per_step"] * STEPS, rel=1e-4)
        else:  # the analytic model's figure for that plan, no worse than the preset's roles
            assert p["ranking"] == "analytic"
            seconds = _analytic_seconds(plan, r["arch"], r["resolution"])
            assert d["seconds"] == pytest.approx(seconds, rel=1e-4)
            preset = ShardingPlan.from_mesh(mesh_from_preset(r["mesh"]))
            assert seconds <= _analytic_seconds(preset, r["arch"], r["resolution"])
    assert rankings == {"compiled", "analytic"}  # BH 2x4 480p has a compiled ranking kept, 720p none


def test_denoising_takes_a_compiled_run_only_of_its_own_system():
    from wan_sharding.planner.stages import compiled_recommendation, denoising_stage

    run = json.loads((RESULTS / "plan_2x4_blackhole_480p.json").read_text())
    est = denoising_stage("2x4", "blackhole", "480p", plan_run=run, plan_source="results/plan_2x4_blackhole_480p.json")
    rec = run["recommended"]
    assert est.plan["name"] == rec["name"] and est.plan["ranking"] == "compiled"
    assert est.seconds == pytest.approx(rec["estimated_seconds_per_step"] * STEPS, rel=1e-9)
    assert est.comm_s == pytest.approx(rec["per_step"]["comm_seconds"] * STEPS, rel=1e-9)
    # a run of another resolution, chip or mesh is not this system's ranking
    assert compiled_recommendation(run, "2x4", "blackhole", "720p", "t2v-a14b") is None
    assert compiled_recommendation(run, "2x4", "wormhole_b0", "480p", "t2v-a14b") is None
    assert compiled_recommendation(run, "8x4", "blackhole", "480p", "t2v-a14b") is None
    assert compiled_recommendation(run, "2x4", "blackhole", "480p", "t2v-a14b") == rec
