"""Multi-Galaxy systems (64 and 128 chips): presets and roles, system descriptors with their
inter-Galaxy links, the fabric model, a tiny-config compile on a 128-chip mesh, and the planner's
legality on 128 chips (analytic stage; the compiled stage is the benchmark's job).

Expected values are worked out by hand from the cabling in ``wan_sharding/systems.py``:
a Blackhole Galaxy has 2 links per on-board neighbour pair, a Wormhole Galaxy 4; between two
Galaxies the model has half as many (1 / 2).
"""

from __future__ import annotations

from collections import Counter

import pytest

from wan_sharding import mesh_from_preset
from wan_sharding.compile import CompileError, CompileRequest, compile_many, latent_for, per_block_bill, sysdesc, ttnn_ir
from wan_sharding.compile.bill import bill_problems, tile_alignment
from wan_sharding.compile.sysdesc import build_system_descriptor, inter_galaxy_channels, read_system_descriptor
from wan_sharding.planner import PlannerError, hardware, plan_sharding
from wan_sharding.planner.candidates import build_candidates
from wan_sharding.planner.weights import weight_bytes_per_expert
from wan_sharding.planner.workload import Workload

needs_plugin = pytest.mark.skipif(sysdesc.installed_plugin_version() is None, reason="jax-tt-plugin is not installed")


# ------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name, shape, sp_pos, sp, tp", [
    ("16x4", (16, 4), 0, 16, 4),
    ("32x4", (32, 4), 0, 32, 4),
    ("4x16-tt-metal", (4, 16), 1, 16, 4),
    ("4x32-tt-metal", (4, 32), 1, 32, 4),
    ("4x8-tt-metal", (4, 8), 1, 8, 4),  # one Galaxy as tt-metal lays it out: SP on the 8-long axis
    ("4x8", (4, 8), 0, 4, 8),
])
def test_multi_galaxy_presets_and_roles(name: str, shape: tuple[int, int], sp_pos: int, sp: int, tp: int) -> None:
    m = mesh_from_preset(name)
    assert m.shape == shape and (m.sp, m.tp) == (sp, tp)
    assert m.axis_names[sp_pos] == m.sp_axis == "sp"
    assert m.num_devices == shape[0] * shape[1]
    assert m.seq_multiple == sp * 32
    # 720p on 128 chips: 75600 tokens padded to a multiple of 32 x 32 = 1024 -> 75776, 2368 per chip
    if sp == 32:
        assert m.padded_tokens(75600) == 75776 and 75776 // 32 == 2368


# -------------------------------------------------------------------------------- descriptors


@pytest.mark.parametrize("arch, inside, between", [("blackhole", 2, 1), ("wormhole_b0", 4, 2)])
@pytest.mark.parametrize("grid", [(16, 4), (32, 4), (4, 32)])
def test_descriptor_round_trip_with_inter_galaxy_links(arch: str, inside: int, between: int,
                                                       grid: tuple[int, int]) -> None:
    rows, cols = grid
    n = rows * cols
    d = read_system_descriptor(build_system_descriptor(arch, n, grid=grid, topology="machine"))
    assert d["num_chips"] == n and d["archs"] == [arch] * n and len(d["chips"]) == n
    assert d["coords"] == [(i // cols, i % cols) for i in range(n)]
    # A torus: every chip has an east and a south neighbour (wrap-around included).
    pairs = Counter((min(a, b), max(a, b)) for a, _, b, _ in d["channels"])
    assert len(pairs) == 2 * n
    long_axis = 0 if rows > cols else 1
    galaxies = grid[long_axis] // 8
    crossing = galaxies * grid[1 - long_axis]  # one cut every 8 chips of the long axis, wrap included
    assert sorted(Counter(pairs.values()).items()) == [(between, crossing), (inside, 2 * n - crossing)]
    assert len(d["channels"]) == inside * (2 * n - crossing) + between * crossing
    assert inter_galaxy_channels(d, grid) == between * crossing
    for (a, b), links in pairs.items():
        ga, gb = (d["coords"][a][long_axis] // 8, d["coords"][b][long_axis] // 8)
        assert links == (between if ga != gb else inside)
    used = [(dev, core) for d0, c0, d1, c1 in d["channels"] for dev, core in ((d0, c0), (d1, c1))]
    assert len(used) == len(set(used))  # no Ethernet core carries two links


def test_default_grids_of_64_and_128_chips_and_bad_topology() -> None:
    assert sysdesc.default_grid(64) == (16, 4) and sysdesc.default_grid(128) == (32, 4)
    with pytest.raises(ValueError, match="topology 'machine' is known for Galaxy grids"):
        build_system_descriptor("blackhole", 8, grid=(2, 4), topology="machine")


# ---------------------------------------------------------------------------------- fabric


def test_all_gather_across_four_galaxies_is_bound_by_the_inter_galaxy_cables() -> None:
    fab = hardware.fabric_for("blackhole", (4, 32))
    long = fab.axes[1]
    assert (long.links, long.wrap, long.segment, long.cross_links) == (2, True, 8, 1)
    chunk = 1e6
    c = hardware.collective_seconds("all_gather", chunk, 32, long, fab)
    # A ring of 32: every directed link carries half a chunk per step; the slowest are the 1 x 12.5
    # GB/s inter-Galaxy cables (on board: 2 x 25 GB/s). 31 steps.
    assert c.bandwidth_seconds == pytest.approx(31 * 0.5 * chunk / 12.5e9)
    # Latency: the longest one-hop route is an inter-Galaxy hop (1.3 us), 31 steps, + 10 us start-up.
    assert c.latency_seconds == pytest.approx((31 * 1.3 + 10.0) * 1e-6)
    # The 4-long axis stays on board: 2 x 25 GB/s per neighbour pair.
    short = hardware.collective_seconds("all_gather", chunk, 4, fab.axes[0], fab)
    assert short.bandwidth_seconds == pytest.approx(3 * 0.5 * chunk / 50e9)


def test_half_of_a_quad_galaxy_is_a_line_keeping_its_inner_cut() -> None:
    fab = hardware.fabric_for("wormhole_b0", (4, 32))
    half = hardware.sub_fabric(fab, 1, 2)
    assert half.grid == (4, 16)
    assert (half.axes[1].wrap, half.axes[1].segment, half.axes[1].cross_links) == (False, 8, 2)
    assert half.axes[0] == fab.axes[0]
    # An 8-chip quarter has no cut left.
    assert hardware.sub_fabric(fab, 1, 4).axes[1].segment == 0


# --------------------------------------------------------------------- compile on 128 chips


def test_compile_refuses_a_mesh_shape_tt_mlir_rejects_and_names_the_view() -> None:
    req = CompileRequest(variant="t2v-a14b", size="tiny", mesh="32x4", blocks=2, latent=latent_for("480p"))
    with pytest.raises(CompileError, match="rejects a 32x4 mesh.*--mesh 4x32-tt-metal"):
        req.validate()
    with pytest.raises(PlannerError, match="--mesh 4x32-tt-metal"):
        plan_sharding("32x4", "blackhole", resolution="720p", compile=True)


@needs_plugin
def test_tiny_compile_on_128_chips_has_the_design_bill(tmp_path) -> None:
    reqs = [CompileRequest(variant="t2v-a14b", size="tiny", mesh="4x32-tt-metal", blocks=b, padding="mask",
                           latent=latent_for("480p"), resolution="480p") for b in (1, 2)]
    one, two = compile_many(reqs, "blackhole", timeout=600, work_dir=tmp_path)
    assert one.ok and two.ok, (one.error, two.error)
    m1, m2 = ttnn_ir.TTNNModule.from_file(one.ttnn_path), ttnn_ir.TTNNModule.from_file(two.ttnn_path)
    assert m2.mesh_shape == (4, 32)
    bill = per_block_bill(m1, m2, 1, 2, "4x32-tt-metal")
    assert bill_problems(bill, "4x32-tt-metal") == []
    assert bill.totals() == {"large": 5, "small": 4}
    # Tiny DiT: 8 heads x 16 = 128 wide, TP 4 -> 2 local heads; 32760 tokens padded to 32768 -> 1024 per
    # chip; K/V gathered heads-first (the fused SDPA layout, as on one Galaxy)
    large = {(e.kind, e.axis, e.payload) for e in bill.entries if e.size == "large"}
    assert large == {("all_reduce", "tp", "1x1x1024x128xbf16"), ("all_gather", "sp", "1x2x1024x16xbf16")}
    assert tile_alignment(m2, "4x32-tt-metal")["aligned"]
    # What crosses the hosts (one per Galaxy, every 8 chips of the sp axis) per block: the K and V
    # gathers, each 1x2x1024x16 bf16 per chip, 496 chunks over the cuts (a ring of 32 with 4 cuts,
    # 31 steps, 4 rows: tests/test_multihost.py); TP's all-reduces stay inside each Galaxy.
    from wan_sharding.compile.cfg import step_figures
    from wan_sharding.systems import host_cuts

    step = step_figures(m1, m2, 1, 2, 40, 2, host_cuts((4, 32)))
    assert step["per_block"]["cross_host_bytes"] == 2 * 496 * (2 * 1024 * 16 * 2)


# ------------------------------------------------------------------------ planner, 128 chips


def test_planner_legality_on_128_chips() -> None:
    work = Workload.build("t2v-a14b", "720p")
    chip = hardware.chip("blackhole")
    cands = build_candidates(work, (4, 32), chip.usable_dram_bytes,
                             lambda p: weight_bytes_per_expert(work.variant, p))
    legal = [c for c in cands if c.legal]
    assert legal
    for c in legal:
        assert c.tp <= 8 and 40 % c.tp == 0  # TP never exceeds 8 on 40 heads
        assert c.memory.total <= chip.usable_dram_bytes
        if c.plan.padding == "none" and c.sp > 1:  # an unpadded SP split must be whole tiles per chip
            assert work.tokens % (c.sp * 32) == 0
    names = {c.name for c in legal}
    # tt-metal's quad-Galaxy configuration (SP 32 on the long axis, TP 4, no FSDP) is legal
    assert "4x32 sp32[cols] tp4[rows] replicated-D mask" in names
    # CFG splits: halves of either axis, each running a plan of the half mesh
    cfg = [c for c in legal if c.cfg_axis]
    assert {c.cfg_axis for c in cfg} == {"rows", "cols"}
    assert {c.plan.mesh_shape for c in cfg} == {(2, 32), (4, 16)}
    # Each half holds both experts: with FSDP over SP 16 a chip keeps twice what SP 32 leaves it.
    w_half = next(c for c in cfg if c.name == "4x16 sp16[cols] tp4[rows] fsdp replicated-D mask + cfg2[cols]")
    w_full = next(c for c in legal if c.name == "4x32 sp32[cols] tp4[rows] fsdp replicated-D mask")
    assert 1.8 < w_half.memory.weights / w_full.memory.weights <= 2.0
    # Illegal for the right reasons: TP 16 / 32 on 40 heads
    assert any("TP 32 does not divide 40 heads" in c.reason for c in cands)


def test_planner_on_128_chips_recommends_a_plan_that_fits_and_ranks_cfg_split() -> None:
    report = plan_sharding("4x32-tt-metal", "blackhole", resolution="720p", compile=False, cfg_split=True)
    rec = report.recommended
    assert rec is not None and rec.memory.total <= report.chip.usable_dram_bytes and rec.tp <= 8
    data = report.to_json()
    cfg = [c for c in data["candidates"] if c["cfg_split"] and c["stage"] == "analytic"]
    assert cfg and all(c["estimated_seconds_per_forward"] > 0 for c in cfg)
    # A CFG split's estimate is its own: half of the half mesh's forward plus the exchange.
    c = next(c for c in report.ranked if c.cfg_axis == "cols" and c.plan.layout == "replicated" and not c.plan.fsdp
             and c.reason == "")
    assert any(k.startswith("cfg_exchange@cols") for k in c.analytic.per_block.comm)
