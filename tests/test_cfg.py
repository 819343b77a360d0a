"""CFG parallel: a denoising step's cond and uncond branches at once, one per half of the mesh.

The mesh side (``with_cfg``, ``ShardingPlan.cfg_axes``, the one-line refusals) runs here; the DiT
runs in this process on JAX's 8 CPU devices (2x4 cut into two 1x4 groups) and in workers for
torch-xla and for 32 devices (8x4 cut into two SP 4 x TP 4 groups). The reference is always what
the pipeline would do unsharded: two forwards, one per branch, one after the other.
"""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch

from wan_sharding import ShardingError
from wan_sharding.cli import main
from wan_sharding.compose import shard_dit
from wan_sharding.jobs.check import Case, run_case, run_in_subprocess
from wan_sharding.jobs.generate import plans_compare_in_subprocess
from wan_sharding.mesh import MeshError, MeshSpec, mesh_from_preset, with_cfg
from wan_sharding.models import build_dit, dit_inputs, guidance_pair
from wan_sharding.patches import EXACT_PATCHES
from wan_sharding.plan import PlanError, ShardingPlan

BOUNDS = {"fp32": (0.99999, 1e-4), "bf16": (0.99, 0.1)}  # (min PCC, max |difference|), as tests/test_pcc.py
CFG_2X4 = ShardingPlan.from_mesh(with_cfg("2x4"))
CFG_8X4 = ShardingPlan.from_mesh(with_cfg("8x4"), padding="slice")
EXACT = "+".join(EXACT_PATCHES)


# ---- the mesh and the plan -------------------------------------------------------------------


def test_cfg_cuts_the_sp_axis_into_two_contiguous_groups():
    m = with_cfg("2x4")  # SP 2 becomes the cfg axis: two 1x4 groups, TP 4 each
    assert (m.shape, m.axis_names, m.sp, m.tp, m.cfg, m.group_devices) == ((2, 4), ("cfg", "tp"), 1, 4, 2, 4)
    m = with_cfg("8x4")  # SP 8 -> cfg 2 x SP 4: rows 0-3 one branch, rows 4-7 the other
    assert (m.shape, m.axis_names, m.sp, m.tp) == ((2, 4, 4), ("cfg", "sp", "tp"), 4, 4)
    assert np.arange(32).reshape(m.shape)[0].ravel().tolist() == list(range(16))
    m = with_cfg("4x16-tt-metal")  # SP 16 on the long axis -> each Galaxy (8 columns) one branch
    assert (m.shape, m.axis_names, m.sp, m.tp) == ((4, 2, 8), ("tp", "cfg", "sp"), 8, 4)
    grid = np.arange(64).reshape(4, 16)
    group0 = np.arange(64).reshape(m.shape)[:, 0, :]
    assert sorted(group0.ravel().tolist()) == sorted(grid[:, :8].ravel().tolist())
    # the batch of (cond, uncond) halves goes on cfg; a batch of one (no guidance) stays whole
    assert m.batch_spec((2, 5, 7)) == ("cfg", None, None) and m.batch_spec((1, 5, 7)) == (None, None, None)


@pytest.mark.parametrize("mesh, match", [
    ("1x4", "no SP axis to cut"),
    (MeshSpec((3, 4)), "odd count"),
    (with_cfg("2x4"), "already splits"),
])
def test_a_mesh_that_cannot_be_cut_is_refused_in_one_line(mesh, match):
    with pytest.raises(MeshError, match=match) as e:
        with_cfg(mesh)
    assert "\n" not in str(e.value)
    with pytest.raises(MeshError, match="2 branches"):
        with_cfg("8x4", 3)


def test_a_plan_carries_its_cfg_axes_and_old_plan_files_still_load(tmp_path):
    plan = CFG_8X4
    assert plan.mesh().cfg_axis == "cfg" and "cfg2[cfg]" in plan.name
    assert ShardingPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    old = {k: v for k, v in ShardingPlan().to_dict().items() if k != "cfg_axes"}  # written before cfg existed
    assert ShardingPlan.from_dict(old).cfg_axes == ()
    with pytest.raises(PlanError, match="must span 2"):
        dataclasses.replace(CFG_8X4, cfg_axes=("cfg", "sp"), sp_axes=())
    with pytest.raises(PlanError, match="both CFG and SP"):
        dataclasses.replace(CFG_8X4, sp_axes=("cfg",))


@pytest.mark.parametrize("argv, match", [
    (["generate", "--cfg", "2", "--mesh", "1x4"], "no SP axis to cut"),
    (["generate", "--cfg", "2", "--guidance-scale", "1"], "guidance is off"),
    (["generate", "--cfg", "2", "--cache", "fbc"], "a step cache cannot run with CFG parallel"),
    (["profile", "--cfg", "2", "--mesh", "unsharded"], "one-device baseline"),
    (["check", "--cfg", "2", "--meshes", "1x4"], "no SP axis to cut"),
])
def test_bad_cfg_requests_are_one_line_usage_errors(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(match, err) and len(err.splitlines()) == 1, err


def test_cfg_that_contradicts_a_plan_is_refused(tmp_path, capsys):
    path = tmp_path / "plan.json"
    ShardingPlan().save(path)
    assert main(["generate", "--cfg", "2", "--plan", str(path)]) == 2
    assert "no cfg axis" in capsys.readouterr().err


# ---- the DiT: both branches as one program (JAX, in this process) ------------------------------


@pytest.mark.parametrize("case", [
    Case("t2v-a14b", "padded", "fp32", "mask"),
    Case("t2v-a14b", "aligned", "fp32", "none"),
    Case("t2v-a14b", "padded", "bf16", "slice"),
    Case("ti2v-5b", "padded", "fp32", "mask"),
    Case("t2v-a14b", "padded", "fp32", "mask", EXACT),
], ids=str)
def test_the_pair_equals_two_unsharded_forwards_jax(case):
    r = run_case("jax", CFG_2X4.mesh().name, case, plan=dataclasses.replace(CFG_2X4, padding=case.padding))
    pcc_min, max_abs = BOUNDS[case.dtype]
    assert r["shape"][0] == 2 and r["pcc"] >= pcc_min and r["max_abs"] <= max_abs, r
    # TP-only groups: the three Megatron all-reduces per block and the embedders', nothing of SP
    assert set(r["collectives"]) == {"all-reduce"}, r["collectives"]


def test_each_group_runs_one_branch_and_the_comparison_can_fail():
    """Per device the program holds one branch (batch 1); the branches' order matters (swapping
    the halves fails the bound, so the check above can fail)."""
    dit = build_dit("t2v-a14b", "tiny")
    cond, uncond, both = guidance_pair(dit_inputs("t2v-a14b", Case().latent()))
    with torch.no_grad():
        ref = [dit(**x, return_dict=False)[0] for x in (cond, uncond)]
        sharded = build_dit("t2v-a14b", "tiny")
        sharded.load_state_dict(dit.state_dict())
        handle = shard_dit(sharded, CFG_2X4)
        try:
            program = handle.backend.compile(sharded, handle.placed, **both)
            out = handle.backend.to_host(program())
        finally:
            handle.remove()
    x_shape = ",".join(map(str, both["hidden_states"].shape[1:]))  # the latents, per device
    assert f"f32[1,{x_shape}]" in program.text and f"f32[2,{x_shape}]" not in program.text
    assert torch.allclose(out, torch.cat(ref), atol=1e-4)
    assert not torch.allclose(out, torch.cat(ref[::-1]), atol=1e-2)


# ---- workers: torch-xla, 32 devices, and the pipelines' own __call__ -----------------------------


@pytest.fixture(scope="module")
def workers() -> dict[str, Future]:
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {
        # T2V-A14B (both experts) on 2x4 and 8x4, with guidance and without
        "t2v": pool.submit(plans_compare_in_subprocess, "jax", [CFG_2X4, CFG_8X4], guidance_scales=(4.0, 1.0)),
        "xla-dit": pool.submit(run_in_subprocess, "xla", "2x4-cfg2",
                               [Case("t2v-a14b", "padded", "fp32", "mask", EXACT),
                                Case("t2v-a14b", "aligned", "bf16", "mask")], plan=CFG_2X4),
        "jax-8x4-dit": pool.submit(run_in_subprocess, "jax", "8x4-cfg2",
                                   [Case("t2v-a14b", "padded", "fp32", "slice"),
                                    Case("t2v-a14b", "aligned", "fp32", "slice"),
                                    Case("t2v-a14b", "padded", "fp32", "slice", EXACT)], plan=CFG_8X4),
        "xla-t2v": pool.submit(plans_compare_in_subprocess, "xla", [CFG_2X4], patches=tuple(EXACT_PATCHES)),
        "i2v": pool.submit(plans_compare_in_subprocess, "jax", [CFG_2X4], "i2v-a14b"),
        "ti2v": pool.submit(plans_compare_in_subprocess, "jax", [CFG_8X4], "ti2v-5b"),
    }
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("key", ["xla-dit", "jax-8x4-dit"])
def test_the_pair_equals_two_unsharded_forwards_in_workers(workers, key):
    for r in workers[key].result():
        pcc_min, max_abs = BOUNDS[r["dtype"]]
        assert r["ok"] and r["shape"][0] == 2 and r["pcc"] >= pcc_min and r["max_abs"] <= max_abs, r
        if key == "jax-8x4-dit":  # SP 4 inside each group: its K/V gathers, never across the groups
            assert r["padded_tokens"] % (4 * 32) == 0 and r["collectives"]["all-gather"] > 0


@pytest.mark.parametrize("key", ["t2v", "xla-t2v", "i2v", "ti2v"])
def test_the_pipelines_call_runs_each_step_as_one_program(workers, key):
    rows = workers[key].result()
    assert rows
    for r in rows:
        assert r["max_abs"] <= 1e-4 and r["pcc"] >= 0.99999 and r["restored"], r
        assert r["cfg"] == 2
        per_expert = set(r["forwards"].values())
        if r["guidance_scale"] > 1:  # each step: one forward of the pair, the uncond call answered from it
            assert r["cfg_steps"] == {"paired": r["steps"], "single": 0}, r
        else:  # guidance off: the cond branch alone, one forward per step
            assert r["cfg_steps"] == {"paired": 0, "single": r["steps"]}, r
        assert sum(r["forwards"].values()) == r["steps"] and per_expert <= {0, 1, 2}, r


def test_a_step_cache_is_refused_with_cfg_before_anything_changes():
    from wan_sharding.caching import wan_cache_config
    from wan_sharding.pipeline.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("ti2v-5b")
    pipe.transformer.enable_cache(wan_cache_config("fbc", 2))
    from wan_sharding import shard_pipeline

    with pytest.raises(ShardingError, match="a step cache cannot run with CFG parallel") as e:
        shard_pipeline(pipe, plan=CFG_2X4)
    assert "\n" not in str(e.value) and "encode_prompt" not in vars(pipe)
    assert type(pipe.transformer).__name__ == "WanTransformer3DModel"


@pytest.mark.filterwarnings("ignore:WanPipeline will call torch_xla")  # sharded and removed here, never called
def test_the_wrapper_is_on_one_pipeline_instance_only():
    """The wrapper is on the one pipeline instance: the class and another pipeline keep the
    pipeline's own encode_prompt."""
    from wan_sharding import shard_pipeline
    from wan_sharding.pipeline.tiny import build_tiny_pipeline

    a, b = build_tiny_pipeline("ti2v-5b"), build_tiny_pipeline("ti2v-5b")
    original = type(a).encode_prompt
    handle = shard_pipeline(a, plan=CFG_2X4)
    try:
        assert "encode_prompt" in vars(a) and "encode_prompt" not in vars(b)
        assert type(a).encode_prompt is original and b.encode_prompt.__func__ is original
    finally:
        handle.remove()
    assert "encode_prompt" not in vars(a) and a.encode_prompt.__func__ is original
    assert mesh_from_preset("2x4").cfg_axis is None
