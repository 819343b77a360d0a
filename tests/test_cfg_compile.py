"""CFG parallel through tt-mlir (wan_sharding.compile.cfg, the cfg path of ``wan-sharding compile``).

One module-scoped batch of tiny compiles (one worker, ~20 s of start-up, ~1-2 s a compile): the
2x4 cfg plan as one program (batch 2: cond + uncond rows split over cfg), its 1x4 group plan
(batch 1), at 1 and 2 blocks each; the per-block bill is the difference of the two depths. What is
asserted is structure (collectives, their per-device payloads, op counts), never seconds.
"""

from __future__ import annotations

import argparse

import pytest

from wan_sharding.cli.compile import add_subcommands
from wan_sharding.compile import CompileError, CompileRequest, CompileResult, compile_many, per_block_bill, sysdesc, ttnn_ir
from wan_sharding.compile.bill import bill_problems, program_split
from wan_sharding.compile.cfg import ONE_PROGRAM, PER_GROUP, cfg_compile, compile_request, group_plan
from wan_sharding.compile.report import build_report
from wan_sharding.compile.report_text import format_report
from wan_sharding.mesh import with_cfg
from wan_sharding.plan import ShardingPlan

needs_plugin = pytest.mark.skipif(sysdesc.installed_plugin_version() is None,
                                  reason="jax-tt-plugin is not installed")

TINY = dict(variant="t2v-a14b", size="tiny", latent=(3, 8, 8))


def _plan(mesh: str) -> ShardingPlan:
    return ShardingPlan.from_mesh(with_cfg(mesh, 2), padding="mask")


# ------------------------------------------------------------------ which program a plan compiles


def test_group_plans_of_the_cfg_presets() -> None:
    """2x4 keeps its 2-D mesh (one program); 8x4 and 4x16-tt-metal are 3-D, so their group's plan
    is compiled: the cfg axis removed, SP and TP as they were."""
    two = cfg_compile(_plan("2x4"))
    assert (two.how, two.batch, two.branch_batch, two.forwards_per_step) == (ONE_PROGRAM, 2, 1, 1)
    assert two.compiled_plan == _plan("2x4")
    g = group_plan(_plan("2x4"))
    assert (g.mesh_shape, g.sp_axes, g.tp_axes, g.cfg_axes, g.mesh().name) == ((1, 4), (), ("tp",), (), "1x4")

    for mesh, shape, names, sp, tp in (("8x4", (4, 4), ("sp", "tp"), 4, 4),
                                       ("4x16-tt-metal", (4, 8), ("tp", "sp"), 8, 4)):
        how = cfg_compile(_plan(mesh), branch_batch=1)
        assert (how.how, how.batch, how.forwards_per_step) == (PER_GROUP, 1, 1)
        m = how.compiled_plan.mesh()
        assert (m.shape, m.axis_names, m.sp, m.tp, m.cfg) == (shape, names, sp, tp, 1)
        assert "ShardyUtils.cpp" in how.note
        req = compile_request(_plan(mesh), 1, blocks=1, **TINY).validate()
        assert req.plan == how.compiled_plan and req.cfg_plan == _plan(mesh) and req.batch == 1

    assert cfg_compile(ShardingPlan.from_mesh(with_cfg("2x4", 1))).forwards_per_step == 2  # no cfg: cond, uncond
    with pytest.raises(CompileError, match="1-D and 2-D meshes only"):  # a 3-D plan straight to tt-mlir
        CompileRequest.for_plan(_plan("8x4"), **TINY).validate()
    with pytest.raises(CompileError, match="must be even"):
        CompileRequest.for_plan(_plan("2x4"), batch=1, **TINY).validate()


# -------------------------------------------------------------------------- compiled, structure

BATCH = {
    **{f"one/{n}": compile_request(_plan("2x4"), 1, blocks=n, **TINY) for n in (1, 2)},
    **{f"group/{n}": compile_request(group_plan(_plan("2x4")), 1, blocks=n, **TINY) for n in (1, 2)},
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CompileResult]:
    if sysdesc.installed_plugin_version() is None:
        pytest.skip("jax-tt-plugin is not installed")
    results = compile_many(list(BATCH.values()), "wormhole_b0", timeout=600,
                           work_dir=tmp_path_factory.mktemp("cfg_compile"))
    return dict(zip(BATCH, results))


def _module(res: CompileResult) -> ttnn_ir.TTNNModule:
    assert res.ok, f"{res.request.label()} did not compile: {res.error}\n" + "\n".join(res.diagnostics)
    return ttnn_ir.TTNNModule.from_file(res.ttnn_path)


@needs_plugin
def test_one_program_on_2x4_is_the_1x4_group_program(compiled: dict[str, CompileResult]) -> None:
    """The batch-2 program on 2x4 (cfg 2 x TP 4) gives each device one branch: per block the same
    ops and the same collectives (kind, axis, per-device payload) as the 1x4 group's batch-1
    program, the design's TP-only bill, and nothing over the cfg axis."""
    one = [_module(compiled[f"one/{n}"]) for n in (1, 2)]
    group = [_module(compiled[f"group/{n}"]) for n in (1, 2)]
    assert one[1].mesh_shape == (2, 4) and group[1].mesh_shape == (1, 4)
    bills = [per_block_bill(*mods, 1, 2, plan.mesh())
             for mods, plan in ((one, _plan("2x4")), (group, group_plan(_plan("2x4"))))]
    entries = [sorted((e.kind, e.axis, e.size, e.count, e.payload) for e in b.entries) for b in bills]
    assert entries[0] == entries[1]
    assert bills[0].ops == bills[1].ops
    assert program_split(*one, 1, 2)["runtime_ops_per_block_by_op"] == program_split(*group, 1, 2)["runtime_ops_per_block_by_op"]
    assert bill_problems(bills[0], _plan("2x4").mesh()) == []
    assert bills[0].totals()["large"] == 3
    assert {(e.kind, e.axis) for e in bills[0].entries if e.size == "large"} == {("all_reduce", "tp")}
    # per device one branch: batch 1 in every large payload; the cfg axis (cluster_axis 0) carries nothing
    assert all(e.payload.startswith("1x") for e in bills[0].entries)
    assert not [c for c in one[1].collectives if c.cluster_axis == 0]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="wan-sharding")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_compile_command_cfg_makes_the_cfg_plan() -> None:
    """``compile --mesh 2x4 --cfg 2`` (checked before any worker starts): the plan of 2x4 cut into
    guidance groups, whose request is one program of batch 2 per branch batch 1; a --cfg the mesh
    cannot take is a usage error."""
    from wan_sharding.cli.compile import _validate_compile
    from wan_sharding.cli.validate import UsageError

    args = _parse(["compile", "--mesh", "2x4", "--cfg", "2", "--size", "tiny", "--latent", "3,8,8"])
    _validate_compile(args)
    assert args.plan == _plan("2x4") and args.mesh == "2x4-cfg2"
    args = _parse(["compile", "--mesh", "1x4", "--cfg", "2"])
    with pytest.raises(UsageError, match="no SP axis to cut"):
        _validate_compile(args)


@needs_plugin
def test_report_counts_a_cfg_step_as_one_forward(compiled: dict[str, CompileResult]) -> None:
    """The report of the one-program compile: the TP-only bill against the design (bytes of one
    branch: each device holds batch 1), and a step of one forward whose per-step figures are the
    per-forward ones; the 1x4 group program, counted as a plan without cfg, runs 2 per step."""
    report = build_report(compiled["one/2"], compiled["one/1"])
    assert report["bill_ok"], report["bill_problems"]
    assert report["mesh"] == "2x4-cfg2" and (report["sp"], report["tp"]) == (1, 4)
    assert report["cfg"]["how"] == ONE_PROGRAM and report["cfg"]["batch"] == 2
    assert report["per_block_totals"] == {"large": 3, "small": 4}
    assert report["design_bytes"]["tp_reduce"] == 1 * 64 * 128 * 2  # (B=1, padded L, D) bf16
    step = report["step"]
    assert step["forwards_per_step"] == 1 and step["per_step"] == step["per_forward"]
    assert step["per_block_per_step"]["large_collectives"] == 3
    assert "per denoising step (1 forward" in format_report(report)

    alone = build_report(compiled["group/2"], compiled["group/1"])
    assert alone["cfg"]["how"] is None and alone["step"]["forwards_per_step"] == 2
    assert alone["step"]["per_step"]["collective_bytes"] == 2 * step["per_step"]["collective_bytes"]
    assert alone["step"]["per_block"] == step["per_block"]
