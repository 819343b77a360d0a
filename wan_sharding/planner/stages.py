"""The stage table: a Wan 2.2 video's stages per system (text encoder, denoising, VAE decode)
beside the bounds tt-metal's performance test asserts for them.

The text encoder's and the VAE's estimates are :mod:`.vae`'s. **Denoising** runs the planner's best
plan for the system, its figure per step (two DiT forwards, CFG) times the steps: the compiled
ranking's recommendation where a run of the full planner for that mesh, chip and workload is given
(``wan-sharding plan --json``, kept by scripts/bench_plan.py as ``results/plan_<RxC>_<arch>_<res>.json``),
else stage 1's best (:func:`.search.plan_sharding` without compiling). Each row names its plan and
the ranking that chose it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from ..mesh import mesh_from_preset
from .vae import STEPS, StageEstimate, text_encoder_stage, vae_memory_per_chip, vae_stage


def compiled_recommendation(run: Mapping[str, Any] | None, mesh: str, arch: str, resolution: str,
                            variant: str) -> dict[str, Any] | None:
    """The recommended plan of a full planner run (``wan-sharding plan --json``) when the run is of
    this mesh, chip and workload and its recommendation was ranked on compiled programs; else None."""
    if not run or not run.get("compiled_stage") or not run.get("recommended"):
        return None
    work = run.get("workload", {})
    same = (run.get("mesh") == "x".join(map(str, mesh_from_preset(mesh).shape)) and run.get("arch") == arch
            and work.get("variant") == variant and work.get("resolution") == resolution)
    rec = run["recommended"]
    return rec if same and rec.get("stage") == "compiled" else None


def denoising_stage(mesh: str, arch: str, resolution: str, variant: str = "t2v-a14b", steps: int = STEPS,
                    plan_run: Mapping[str, Any] | None = None, plan_source: str = "") -> StageEstimate:
    """One video's denoising with the planner's best plan for the system: its figure per step (two
    DiT forwards, CFG) x ``steps``.

    ``plan_run`` is a run of the full planner (``wan-sharding plan --json``; ``plan_source`` names
    where it was kept): when it is of this mesh, chip and workload, its recommendation and compiled
    figure; otherwise the planner's best analytic plan (stage 1, as ``plan --no-compile`` ranks it).
    The estimate's ``plan`` names the plan and the ranking that chose it."""
    from ..compile.cfg import SEQUENTIAL_FORWARDS_PER_STEP as FORWARDS  # guidance on: cond and uncond
    from ..plan import ShardingPlan
    from .analytic import block_flops
    from .workload import Workload

    spec = mesh_from_preset(mesh)
    work = Workload.build(variant, resolution)
    rec = compiled_recommendation(plan_run, mesh, arch, resolution, variant)
    if rec is not None:
        plan = ShardingPlan.from_dict(rec["plan"])
        seconds = rec["estimated_seconds_per_step"] * steps
        comm = rec["per_step"]["comm_seconds"] * steps
        named = {"name": rec["name"], "ranking": "compiled", "source": plan_source, "date": plan_run.get("date"),
                 "plan": rec["plan"]}
    else:
        from .search import plan_sharding

        report = plan_sharding(mesh, arch, variant, resolution, compile=False)
        best = report.recommended
        plan = best.full_plan
        seconds = report.estimated_seconds_per_step(best) * steps
        comm = sum(best.analytic.per_block.comm.values()) * work.layers * FORWARDS * steps
        named = {"name": best.name, "ranking": "analytic", "source": "plan --no-compile", "date": None,
                 "plan": plan.to_dict()}
    flops = block_flops(work, plan) * spec.num_devices * work.layers * FORWARDS * steps
    return StageEstimate("denoising", seconds - comm, comm, flops, named)


# tt-metal's Wan 2.2 performance test (models/tt_dit/tests/models/wan2_2/test_performance_wan.py,
# t2v_metrics): the upper bounds its CI asserts per stage, seconds, 81 frames, 40 steps.
TT_METAL_BOUNDS = {
    ("bh-2x4", "480p"): {"text_encoder": 0.08, "denoising": 240.0, "vae": 5.0},
    ("bh-galaxy", "720p"): {"text_encoder": 0.1, "denoising": 140.0, "vae": 2.0},
    ("bh-4x32", "720p"): {"text_encoder": 0.5, "denoising": 75.0, "vae": 5.0},
}
# The same stages as measured in tt-metal pull requests (VAE only): #41873 (BH 2x4 480p 2.5 -> 1.5 s),
# #45975 (BH Galaxy 720p, traced decode 559 -> 479 ms).
TT_METAL_MEASURED = {("bh-2x4", "480p"): {"vae": 1.5}, ("bh-galaxy", "720p"): {"vae": 0.479}}
# The systems of the stage table: (label, mesh preset, arch).
SYSTEMS = {"bh-2x4": ("2x4", "blackhole"), "bh-galaxy": ("8x4", "blackhole"), "bh-4x32": ("4x32-tt-metal", "blackhole")}


def stage_table(kind: str = "wan2.1", variant: str = "t2v-a14b", plan_runs: Path | None = None) -> list[dict[str, Any]]:
    """Per system and resolution of :data:`TT_METAL_BOUNDS`: each stage's estimate beside tt-metal's
    bound (and measured figure where published), and the VAE's memory per chip.

    ``plan_runs``: a folder of full planner runs named ``plan_<RxC>_<arch>_<resolution>.json`` (as
    scripts/bench_plan.py keeps them); a system with one takes its denoising from the compiled
    ranking's recommendation, the others from the planner's best analytic plan."""
    rows = []
    for (system, resolution), bounds in TT_METAL_BOUNDS.items():
        mesh, arch = SYSTEMS[system]
        grid = "x".join(map(str, mesh_from_preset(mesh).shape))
        path = None if plan_runs is None else Path(plan_runs) / f"plan_{grid}_{arch}_{resolution}.json"
        run = json.loads(path.read_text()) if path is not None and path.exists() else None
        source = f"{path.parent.name}/{path.name}" if run is not None else ""
        stages = [text_encoder_stage(mesh, arch), denoising_stage(mesh, arch, resolution, variant, plan_run=run,
                                                                  plan_source=source),
                  vae_stage(kind, mesh, arch, resolution)]
        rows.append({"system": system, "mesh": mesh, "arch": arch, "resolution": resolution,
                     "stages": {s.stage: s.to_json() for s in stages},
                     "tt_metal_bound_s": bounds, "tt_metal_measured_s": TT_METAL_MEASURED.get((system, resolution), {}),
                     "vae_memory_per_chip": vae_memory_per_chip(kind, mesh_from_preset(mesh).num_devices,
                                                                resolution).to_json()})
    return rows
