"""tt-mlir compile-only checks of the sharded DiT (wan_sharding.compile).

Everything here compiles with the real tt-mlir compiler (jax-tt-plugin, no hardware). The
compiles run in worker subprocesses: this process never initialises JAX with the plugin. One
module-scoped batch (one worker, ~20 s of imports, then ~1-2 s per compile) serves the bill,
anchor and tile tests.

The proxies are full-width T2V-A14B DiTs (dim 5120, 40 heads, ffn 13824) with 1 or 2 blocks at
480p (32760 tokens): the width and token count are what the partitioner and the tile check react
to; the depth only repeats blocks (the per-block bill is the 2-block minus the 1-block graph).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from wan_sharding.cli.compile import add_subcommands
from wan_sharding.compile import (EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_OK, CompileError, CompileRequest, CompileResult,
                                  compile_many, format_report, latent_for, per_block_bill, sysdesc, ttnn_ir)
from wan_sharding.compile.bill import bill_problems, masked_attention_per_block, padding_cost, tile_alignment
from wan_sharding.mesh import mesh_from_preset

needs_plugin = pytest.mark.skipif(sysdesc.installed_plugin_version() is None,
                                  reason="jax-tt-plugin is not installed")

MESHES = ("1x4", "2x4", "8x4")
L_480P = 32760  # 21 x 30 x 52
L_480P_PADDED = 32768  # to a multiple of SP x 32 for SP 1, 2 and 8


# The design's bill in its plain form: fused SDPA only, tt-mlir's default options (hardware's
# composite set and options are tests/test_frontends.py and tests/test_hardware_compile.py).
PLAIN = dict(composites="sdpa", compile_options={"optimization_level": 0, "dram_space_saving": False,
                                                 "enable_trace": False})


PLAIN_ARGS = ("--composites", "sdpa", "--compile-options",
              "optimization_level=0,enable_trace=false,experimental-enable-dram-space-saving-optimization=false")


def _proxy(mesh: str, blocks: int, padding: str = "slice", anchor: bool = True) -> CompileRequest:
    return CompileRequest(variant="t2v-a14b", size="full", mesh=mesh, blocks=blocks, padding=padding,
                          anchor=anchor, latent=latent_for("480p"), resolution="480p", **PLAIN)


BATCH = {
    **{f"{m}/slice/{n}": _proxy(m, n) for m in MESHES for n in (1, 2)},
    **{f"{m}/none/2": _proxy(m, 2, "none") for m in ("2x4", "8x4")},
    **{f"{m}/none/2/no-anchor": _proxy(m, 2, "none", anchor=False) for m in ("2x4", "8x4")},
    # padding cost on Galaxy: the mask mode and the unpadded graph at both depths
    "8x4/mask/1": _proxy("8x4", 1, "mask"), "8x4/mask/2": _proxy("8x4", 2, "mask"),
    "8x4/none/1": _proxy("8x4", 1, "none"),
}


# `wan-sharding compile` as a user runs it: the tiny model, 3x8x8 latent (48 tokens) on 8x4, unpadded
# (6 tokens per device: not tile-aligned, so exit 1 while the bill itself matches) and with the mask.
CLI_RUNS = {padding: ("compile", "--size", "tiny", "--latent", "3,8,8", "--mesh", "8x4", "--blocks", "2",
                      "--padding", padding, "--json", *PLAIN_ARGS) for padding in ("none", "mask")}


def _cli(out: Path, argv: tuple[str, ...]) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "wan_sharding.cli", *argv, "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode in (EXIT_OK, EXIT_CHECK_FAILED), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Future]]:
    """The command runs, started at once (each compile is mostly one core's work) and beside the
    module's batch (``compiled``), which requests this fixture first."""
    if sysdesc.installed_plugin_version() is None:
        pytest.skip("jax-tt-plugin is not installed")
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {}
    for padding, argv in CLI_RUNS.items():
        out = tmp_path_factory.mktemp(f"compile-cli-{padding}")
        runs[padding] = (out, pool.submit(_cli, out, argv))
    yield runs
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory, cli_runs) -> dict[str, CompileResult]:
    # cli_runs (started first, to run beside this batch) skips when jax-tt-plugin is not installed
    work = tmp_path_factory.mktemp("compile")
    results = compile_many(list(BATCH.values()), "wormhole_b0", timeout=900, work_dir=work)
    return dict(zip(BATCH, results))


def _module(res: CompileResult) -> ttnn_ir.TTNNModule:
    assert res.ok, f"{res.request.label()} did not compile: {res.error}\n" + "\n".join(res.diagnostics)
    return ttnn_ir.TTNNModule.from_file(res.ttnn_path)


# ------------------------------------------------------------------------------ collective bill


@needs_plugin
@pytest.mark.parametrize("mesh", MESHES)
def test_two_block_proxy_bill_matches_design(compiled: dict[str, CompileResult], mesh: str) -> None:
    m = mesh_from_preset(mesh)
    one, two = _module(compiled[f"{mesh}/slice/1"]), _module(compiled[f"{mesh}/slice/2"])
    assert two.mesh_shape == m.shape

    bill = per_block_bill(one, two, 1, 2, mesh)
    assert bill_problems(bill, mesh) == []
    assert bill.totals() == ({"large": 5, "small": 4} if m.sp > 1 else {"large": 3, "small": 4})
    assert bill.counts() == ({"all_gather": 2, "all_reduce": 7} if m.sp > 1 else {"all_reduce": 7})

    # The design's layout (docs/design.md): the residual stream is (B, L/sp, D) per device with D
    # whole, so the row-parallel all-reduces carry L/sp x 5120 and the K/V gathers L/sp tokens x 10 local heads.
    local = L_480P_PADDED // m.sp
    large = {(e.kind, e.axis, e.payload) for e in bill.entries if e.size == "large"}
    want = {("all_reduce", "tp", f"1x1x{local}x5120xbf16")}
    if m.sp > 1:
        want.add(("all_gather", "sp", f"1x{local}x10x128xbf16"))
    assert large == want
    assert all(e.payload.endswith("f32") for e in bill.entries if e.size == "small")  # RMSNorm stats

    # Once per forward on top of 2 x the bill: the condition embedder's two Megatron all-reduces;
    # with SP the exit gather and the scatters of hidden states, both rope tables and the exit.
    counts = two.collective_counts()
    assert counts.get("all_reduce") == 2 * 7 + 2
    assert counts.get("all_gather", 0) == (2 * 2 + 1 if m.sp > 1 else 0)
    assert counts.get("mesh_partition", 0) == (4 if m.sp > 1 else 0)
    assert tile_alignment(two, mesh)["aligned"]


# ---------------------------------------------------------------------- the replicated anchor


@needs_plugin
@pytest.mark.parametrize("mesh", ["2x4", "8x4"])
def test_replicated_anchor_is_still_needed(compiled: dict[str, CompileResult], mesh: str) -> None:
    """Without the replicated constraint in front of the L-on-SP split, Shardy pushes the split
    into the patchify / rope reshapes and tt-mlir rejects the graph; with it, the graph compiles.

    Unpadded (padding="none") on purpose: a pad between the reshape and the split also stops the
    propagation at 480p, which would hide the reshape problem the anchor works around.
    """
    bare = compiled[f"{mesh}/none/2/no-anchor"]
    assert all(p.endswith("pad -> L-on-sp") for p in bare.sp_points[:2])  # no replicated anchor
    assert not bare.ok, "the graph without the replicated anchor compiled: is the workaround still needed?"
    assert "number of output elements" in bare.failure_text
    assert "doesn't match expected number of elements" in bare.failure_text

    anchored = compiled[f"{mesh}/none/2"]
    assert all("replicated -> pad -> L-on-sp" in p for p in anchored.sp_points[:2])
    assert anchored.ok, anchored.error


# ------------------------------------------------------------------------------ tile alignment


@needs_plugin
def test_unpadded_sp8_is_not_tile_aligned(compiled: dict[str, CompileResult]) -> None:
    # 32760 / 8 = 4095 tokens per device: tt-mlir compiles it, but it is not whole tiles (docs/tt-mlir-notes.md).
    bare = tile_alignment(_module(compiled["8x4/none/2"]), "8x4")
    assert not bare["aligned"]
    assert bare["token_dims"] == [L_480P // 8]
    assert bare["misaligned"]

    padded = tile_alignment(_module(compiled["8x4/slice/2"]), "8x4")
    assert padded["aligned"] and padded["token_dims"] == [L_480P_PADDED // 8]
    assert compiled["8x4/slice/2"].padded_tokens == L_480P_PADDED

    # SP 2: 16380 is not a whole number of tiles either.
    assert tile_alignment(_module(compiled["2x4/none/2"]), "2x4")["token_dims"] == [L_480P // 2]
    assert not tile_alignment(_module(compiled["2x4/none/2"]), "2x4")["aligned"]


@needs_plugin
def test_slice_padding_costs_two_slices_per_block(compiled: dict[str, CompileResult]) -> None:
    # The +81 slice_static measured for 40 blocks (docs/hardware-facts.md) is 2 per block (K, V) + 1 (the exit).
    padded, bare = _module(compiled["8x4/slice/2"]), _module(compiled["8x4/none/2"])
    assert padded.ops["slice_static"] - bare.ops["slice_static"] == 2 * 2 + 1


# ----------------------------------------------------------------------------------- commands


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="wan-sharding")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@needs_plugin
def test_compile_command_json_and_exit_code(cli_runs) -> None:
    # Tiny model, 3x8x8 latent: 48 tokens, 6 per device on SP 8 unpadded -> exit 1 (not aligned)
    # while the bill itself matches the design.
    out, run = cli_runs["none"]
    rc, report = run.result()
    assert rc == EXIT_CHECK_FAILED, report
    for key in ("mesh", "resolution", "variant", "blocks", "padding", "compile_seconds", "ops", "per_block",
                "bill_ok", "tile_aligned"):
        assert key in report, key
    assert report["per_block"] == {"all_gather": 2, "all_reduce": 7}
    assert report["bill_ok"] is True and report["composites"] == "sdpa" and report["notes"] == []
    assert report["options_used"] == {"optimization_level": "0", "enable_trace": "false",
                                      "experimental-enable-dram-space-saving-optimization": "false"}
    assert report["tile_aligned"] is False and report["token_dims"] == [6]
    assert report["ops"]["mesh_partition"] == 4
    assert (out / "report.json").exists() and report["report_path"] == str(out / "report.json")
    assert report["padding_ops_per_block"] == {} and report["padding_ops_per_forward"] == {}
    text = format_report(report).splitlines()
    assert text[1] == "backend: tt-mlir compile-only (torchax frontend); patches: none; cache: none; cfg: 1"
    # what stays: report.json and the IRs it names; the twin, the other IRs, logs and descriptor are gone
    kept = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert kept == sorted(["report.json", *(str(Path(report[k]).relative_to(out)) for k in ("ttnn_path", "ttir_path"))])
    assert report["removed_bytes"] > 0


@needs_plugin
def test_compile_command_padding_mode_reports_what_padding_adds(cli_runs) -> None:
    # 48 tokens -> 256 on SP 8 with the key mask: aligned, bill as designed, nothing added per block.
    rc, report = cli_runs["mask"][1].result()
    assert rc == EXIT_OK, report
    assert report["padding"] == "mask" and report["tile_aligned"] is True and report["token_dims"] == [32]
    assert report["padding_ops_per_block"] == {}
    assert report["padding_ops_per_forward"].get("pad") == 3


def test_compile_command_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    # Checked before any worker starts.
    args = _parse(["compile", "--mesh", "3x3"])
    assert args.func(args) == EXIT_ERROR
    assert "unknown mesh '3x3'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a bad latent is an argparse usage error (exit 2)
        _parse(["compile", "--latent", "21,61,104"])
    assert exit_info.value.code == 2 and "patch size" in capsys.readouterr().err
    with pytest.raises(CompileError, match="unknown arch"):
        compile_many([_proxy("1x4", 1)], arch="grayskull")


def test_sysdesc_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "galaxy.ttsys"
    args = _parse(["sysdesc", "--arch", "blackhole", "--mesh", "8x4", "--topology", "ring", "-o", str(out)])
    assert args.func(args) == EXIT_OK
    d = sysdesc.read_system_descriptor(out.read_bytes())
    assert d["num_chips"] == 32 and d["archs"][0] == "blackhole"
    assert d["coords"][-1] == (7, 3) and len(d["channels"]) == 8 * 4 + 7 * 4
    assert str(out) in capsys.readouterr().out
    args = _parse(["sysdesc", "--mesh", "5x5", "-o", str(tmp_path / "other.ttsys")])
    assert args.func(args) == EXIT_ERROR


# ---------------------------------------------------------------------------------- IR parsing


_SNIPPET = """
    %5 = "ttnn.all_gather"(%4) <{all_gather_dim = -3 : si32, cluster_axis = 0 : ui32}> : (tensor<1x4095x10x128xbf16, #l1>) -> tensor<1x32760x10x128xbf16, #l2> loc(#loc9)
    %6 = "ttnn.all_reduce"(%5) <{cluster_axis = 1 : ui32, reduce_type = #ttcore.reduce_type<sum>}> : (tensor<1x1x1x4095xf32, #l3>) -> tensor<1x1x1x4095xf32, #l3> loc(#loc9)
    "ttnn.deallocate"(%5) <{force = false}> : (tensor<1x32760x10x128xbf16, #l2>) -> () loc(#loc9)
"""


def test_parse_collectives_from_text() -> None:
    mod = ttnn_ir.TTNNModule.parse(_SNIPPET)
    assert mod.ops == {"all_gather": 1, "all_reduce": 1, "deallocate": 1}
    ag, ar = mod.collectives
    assert (ag.kind, ag.cluster_axis, ag.dim, ag.size) == ("all_gather", 0, 1, "large")  # dim -3 of rank 4
    assert ag.operand.shape == (1, 4095, 10, 128)
    assert ag.bytes == 32760 * 10 * 128 * 2
    assert (ar.reduce, ar.size, ar.bytes) == ("sum", "small", 4095 * 4)
    tiles = tile_alignment(mod, "8x4")
    assert tiles["token_dims"] == [4095] and not tiles["aligned"]
    assert tile_alignment(mod, "1x4") == {"aligned": True, "token_dims": [], "misaligned": [], "checked": 0}
    with pytest.raises(ttnn_ir.IRError):
        ttnn_ir.TTNNModule.parse("module {}")


# ------------------------------------------------------------------------------ padding cost


@needs_plugin
def test_mask_padding_adds_no_op_per_block_and_slice_adds_two_slices(compiled: dict[str, CompileResult]) -> None:
    """The slice mode's K/V slice-back adds +2 ttnn.slice_static per block (measured on hardware too,
    docs/hardware-facts.md); the key mask adds nothing per block outside the fused attention (whose
    compile-only decomposition adds the mask: one add, an operand of the fused op on hardware),
    and once per forward only the boundary pads and the small mask."""
    mods = {k: _module(compiled[f"8x4/{k}"]) for k in ("slice/1", "slice/2", "mask/1", "mask/2", "none/1", "none/2")}
    unpadded = (mods["none/1"], mods["none/2"])
    masks = masked_attention_per_block(*(Path(compiled[f"8x4/mask/{d}"].ttir_path).read_text() for d in (1, 2)), (1, 2))
    assert masks == 1  # self-attention carries the key mask, cross-attention none
    slice_cost = padding_cost((mods["slice/1"], mods["slice/2"]), unpadded, (1, 2))
    mask_cost = padding_cost((mods["mask/1"], mods["mask/2"]), unpadded, (1, 2), masks)
    assert slice_cost["per_block"].get("slice_static") == 2
    assert mask_cost["per_block"] == {}
    assert mask_cost["in_fused_attention"] == {"add": 1}
    assert mask_cost["per_forward"].get("pad") == 3  # hidden states and both rope tables
    assert mask_cost["per_forward"].get("slice_static") == 1  # the output back to L
    assert sum(mask_cost["per_forward"].values()) < 25
