"""The two compile frontends (torchax, torch-xla), the fused SDPA composite and the bytes check.

tt-mlir compiles run in worker processes (the compile runner starts them); the tiny configs keep
each compile to seconds. Full-width comparisons are in scripts/bench_frontends.py.
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch
from conftest import stock_rotary_in_bf16

from wan_sharding import apply_dit_sp_activation_sharding, get_backend, shard_dit_specs
from wan_sharding.compile import BlockBill, CompileRequest, compile_reports, sysdesc
from wan_sharding.compile.bill import BillEntry, attention_report, bill_problems, design_bytes
from wan_sharding.compile.ttnn_ir import TTNNModule, ttir_attention
from wan_sharding.fused_sdpa import FusedSDPA, sdpa_math
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import LatentShape, build_dit, config_for, dit_inputs
from wan_sharding.plan import ShardingPlan

needs_plugin = pytest.mark.skipif(sysdesc.installed_plugin_version() is None,
                                  reason="jax-tt-plugin is not installed")


# DRAM space saving off for tiny torch-xla compiles: there tt-mlir 0.1.3's ttnn-memory-management
# pass (the option's aggressive patterns) does not converge on the tiny widths' RoPE (sub-tile
# reshape/slice/eltwise chains) and fails without a diagnostic (docs/compile-hardware.md); the
# compile path would retry without it, so each compile would run twice. Full width compiles with it.
TINY_XLA_OPTIONS = {"dram_space_saving": False}


def _tiny(frontend: str, **changes) -> CompileRequest:
    # 105 tokens -> 128 on SP 2 with the default key mask: what the torchax/torch-xla difference is about.
    fields = dict(variant="t2v-a14b", size="tiny", mesh="2x4", blocks=2, latent=(3, 10, 14), frontend=frontend)
    if frontend == "torch-xla":
        fields["compile_options"] = TINY_XLA_OPTIONS
    return CompileRequest(**{**fields, **changes})


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    if sysdesc.installed_plugin_version() is None:
        pytest.skip("jax-tt-plugin is not installed")
    reqs = {
        "torchax": _tiny("torchax"),
        "torch-xla": _tiny("torch-xla"),
        "torch-xla/plain": _tiny("torch-xla", composites="none"),
        "torchax/1x4": _tiny("torchax", mesh="1x4", padding="none"),  # SP 1: nothing to pad
        "torchax/1x4/prompt_kv": _tiny("torchax", mesh="1x4", padding="none", patches=("prompt_kv",)),
        "torchax/8x4": _tiny("torchax", mesh="8x4"),
        # tt-metal's layout: the residual split on D over TP between the projections (SP 1: tt-mlir
        # rejects sharded D with SP > 1, docs/tt-mlir-notes.md), fused QKV as tt-metal has it
        "torchax/sharded-1x4": CompileRequest.for_plan(
            ShardingPlan(mesh_shape=(1, 4), sp_axes=(), tp_axes=("tp",), layout="sharded", padding="none"),
            variant="t2v-a14b", size="tiny", blocks=2, latent=(3, 10, 14), frontend="torchax", patches=("qkv",)),
        "torchax/rope": _tiny("torchax", patches=("rope",)),
        "torchax/unmarked": _tiny("torchax", mark_arguments=False),
        "torch-xla/prompt_kv": _tiny("torch-xla", patches=("prompt_kv",)),
        # hardware's options: DRAM space saving compiles once the RoPE is half-rotation
        "torch-xla/rope": _tiny("torch-xla", patches=("rope",), compile_options=None),
        # the UMT5 text encoder (2 layers): tiny through both frontends (the torch-xla one in the same
        # trace worker as the tiny DiTs on 2x4), and at UMT5-XXL's widths on the Galaxy, 512 tokens
        **{f"text-encoder/{frontend}": CompileRequest(component="text-encoder", size="tiny", mesh="2x4", blocks=2,
                                                       frontend=frontend) for frontend in ("torchax", "torch-xla")},
        "text-encoder/full": CompileRequest(component="text-encoder", size="full", mesh="8x4", blocks=2),
    }
    work = tmp_path_factory.mktemp("frontends")
    out = compile_reports([r for r in reqs.values()], "wormhole_b0", timeout=900, work_dir=work)
    return dict(zip(reqs, out))


@needs_plugin
@pytest.mark.parametrize("key,reduce_bytes", [("text-encoder/torchax", 1 * 16 * 32 * 2),
                                              ("text-encoder/torch-xla", 1 * 16 * 32 * 2),
                                              ("text-encoder/full", 1 * 512 * 4096 * 2)])
def test_text_encoder_compiles_with_one_all_reduce_per_attention_and_per_ffn(reports, key, reduce_bytes):
    """The UMT5 encoder through tt-mlir, as hardware's frontend hands it over (arguments marked,
    hardware's composites): per layer exactly one all-reduce over TP after the attention and one after
    the FFN, each the bf16 residual stream (B x L x d_model), nothing once per forward; the attention
    fused (the per-head relative bias as its mask)."""
    r = reports[key]
    assert r["ok"] and r["component"] == "text-encoder", r.get("error")
    assert r["bill_ok"], r["bill_problems"]
    assert r["per_block"] == {"all_reduce": 2} and r["per_forward_collectives"] == {}
    assert [(e["kind"], e["axis"], e["size"], e["count"], e["bytes"]) for e in r["per_block_entries"]] == \
        [("all_reduce", "tp", "large", 2, reduce_bytes)] == [("all_reduce", "tp", "large", 2, r["design_reduce_bytes"])]
    assert r["sdpa"]["count"] == 2 and r["sdpa"]["traced_fused"] == 2 and r["sdpa"]["traced_plain"] == 0
    assert all(c["mask"] for c in r["sdpa"]["calls"])  # the relative position bias (and padding mask)
    # 22 weights (the tied embedding once, 10 per layer, the final norm) and the two inputs
    assert r["arguments_marked"] == r["argument_types"] == {"parameter": 22, "input": 2}
    assert r["runtime_ops_per_block"] > 0 and r["const_eval_ops"] > 0


@needs_plugin
@pytest.mark.parametrize("frontend", ["torchax", "torch-xla"])
def test_both_frontends_meet_the_bill_in_bytes_with_fused_attention(reports, frontend):
    r = reports[frontend]
    assert r["ok"] and r["frontend"] == frontend, r.get("error")
    assert r["bill_ok"], r["bill_problems"]
    assert r["per_block_totals"] == {"large": 5, "small": 4}
    # K and V gathered in bf16, exactly the design's bytes: (B, heads/TP, padded L, head_dim) x 2.
    gathers = [e for e in r["per_block_entries"] if e["kind"] == "all_gather" and e["size"] == "large"]
    assert [(e["count"], e["payload"], e["bytes"]) for e in gathers] == [(2, "1x2x64x16xbf16", 1 * 2 * 128 * 16 * 2)]
    assert r["design_bytes"]["sp_gather"] == 1 * 2 * 128 * 16 * 2
    # Fused SDPA: self- and cross-attention in both blocks, Q split over SP (64 of 128), K/V whole.
    sdpa = r["sdpa"]
    assert sdpa["count"] == 4 and sdpa["traced_fused"] == 4 and sdpa["q_split"]
    assert sdpa["q_tokens_per_device"] == [64]
    self_attn = [c for c in sdpa["calls"] if c["mask"]]
    assert self_attn == [{"q": "1x2x64x16xbf16", "k": "1x2x128x16xbf16", "v": "1x2x128x16xbf16",
                          "mask": "1x1x1x128xbf16", "count": 2}]
    _assert_hardware_set(r)


# Hardware's composites on the tiny 2-block DiT (docs/compile-hardware.md): 2 SDPA, 4 RMSNorm
# (norm_q/norm_k of both attentions), 3 LayerNorm (diffusers' FP32LayerNorm) and 1 tanh GELU per
# block, plus norm_out; on a TP mesh every RMSNorm becomes tt-mlir's distributed_rms_norm.
MARKED = {"tenstorrent.scaled_dot_product_attention": 4, "tenstorrent.rms_norm": 8, "tenstorrent.layer_norm": 7,
          "tenstorrent.gelu_tanh": 2}
IN_TTIR = {"scaled_dot_product_attention": 4, "distributed_rms_norm": 8, "layer_norm": 7, "gelu": 2}


def _assert_hardware_set(r: dict) -> None:
    assert r["composites"] == "hardware" and r["composites_marked"] == MARKED
    assert r["composites_ttir"] == IN_TTIR
    # tt-xla's Wan options, as far as they run here: level 0 on Wormhole, said in a note; DRAM space
    # saving as requested (off for tiny torch-xla, above), compiled once, without a retry.
    assert r["options_used"]["optimization_level"] == "0" and r["options_used"]["enable_trace"] == "true"
    dram = "false" if r["frontend"] == "torch-xla" else "true"
    assert r["options_used"]["experimental-enable-dram-space-saving-optimization"] == dram
    assert not [n for n in r["notes"] if "dram-space-saving" in n], r["notes"]
    assert any("brisc build failed" in n for n in r["notes"])
    # No large gather for a norm: the only large gathers are K and V over SP.
    assert not [e for e in r["per_block_entries"] if e["kind"] == "all_gather" and e["size"] == "large"
                and e["axis"] != "sp"]


@needs_plugin
@pytest.mark.parametrize("mesh,totals", [("1x4", {"large": 3, "small": 4}), ("8x4", {"large": 5, "small": 4})])
def test_hardware_set_compiles_on_every_mesh_with_the_bill_intact(reports, mesh, totals):
    r = reports[f"torchax/{mesh}"]
    assert r["ok"], r.get("error")
    assert r["bill_ok"], r["bill_problems"]
    assert r["per_block_totals"] == totals
    _assert_hardware_set(r)


@needs_plugin
@pytest.mark.parametrize("frontend", ["torchax", "torch-xla"])
def test_every_sdpa_composite_says_it_is_not_causal(reports, frontend):
    from pathlib import Path

    from wan_sharding.compile.composites import sdpa_causal_flags

    r = reports[frontend]
    if frontend == "torch-xla":
        text = Path(r["stablehlo_path"]).read_text()
    else:  # the module JAX handed the plugin, as the plugin exported it
        text = sorted((Path(r["ttnn_path"]).parent).glob("shlo_frontend_*.mlir"))[-1].read_text()
    assert sdpa_causal_flags(text) == ["false"] * 4
    assert sdpa_causal_flags(text.replace("is_causal = false, ", "")) == [None] * 4


def _weight_layouts(report: dict) -> tuple[int, list[str | None]]:
    """(``to_layout`` ops in const-eval, the roles of the function arguments that the step's program
    itself converts with ``to_layout``) in a compile's TTNN module. The step is ``@main`` and the
    functions tt-mlir made of it (its trace), whose arguments carry roles too."""
    import re
    from pathlib import Path

    from wan_sharding.compile.marking import argument_roles_by_function
    from wan_sharding.compile.ttnn_ir import TTNNModule

    text = Path(report["ttnn_path"]).read_text()
    roles, lines = argument_roles_by_function(text), text.splitlines()
    once, step = 0, []
    for op in TTNNModule.parse(text).op_list:
        if op.name != "to_layout":
            continue
        if op.const_eval:
            once += 1
        elif (arg := re.search(r'"ttnn\.to_layout"\(%arg(\d+)\)', lines[op.line - 1])) is not None:
            step.append(roles[op.function][int(arg.group(1))])
    return once, step


@needs_plugin
@pytest.mark.parametrize("frontend", ["torchax", "torch-xla"])
def test_arguments_reach_tt_mlir_marked_and_weights_are_tiled_in_const_eval(reports, frontend):
    # As tt-xla marks them on hardware: every weight a parameter, the rope tables (buffers)
    # constants, the three activations inputs. tt-mlir then converts the weights once, in const-eval.
    from pathlib import Path

    from wan_sharding.compile.marking import markers

    r = reports[frontend]
    dit = build_dit("t2v-a14b", "tiny", device="meta", num_layers=2)
    want = {"parameter": len(list(dit.parameters())), "constant": len(list(dit.buffers())), "input": 3}
    # the module the plugin received (its first export), one marker per argument ...
    received = sorted(Path(r["ttnn_path"]).parent.glob("shlo_[0-9]*.mlir"))[-1].read_text()
    assert markers(received) == want == r["arguments_marked"]
    # ... and the roles tt-mlir compiled with, once tt-xla's frontend pass moved them to @main
    assert r["argument_types"] == want
    once, step = _weight_layouts(r)
    assert once >= want["parameter"] and step == ["input"] * 3  # only activations converted per step
    assert 0 < r["runtime_ops_per_block"] and 0 < r["const_eval_ops_per_block"]
    # Unmarked (--no-argument-marks: this package before), every argument is an input and the
    # step's program converts each weight itself, every call.
    u = reports["torchax/unmarked"]
    assert u["argument_types"] == {"input": sum(want.values())} and u["arguments_marked"] == {}
    once, step = _weight_layouts(u)
    assert once < want["parameter"] <= step.count("input")
    assert u["runtime_ops_per_block"] > reports["torchax"]["runtime_ops_per_block"]
    assert u["bill_ok"] and u["per_block_totals"] == {"large": 5, "small": 4}  # the bill keeps its meaning


@needs_plugin
@pytest.mark.parametrize("frontend", ["torchax", "torch-xla"])
def test_every_runtime_op_of_a_block_gets_a_cause(reports, frontend):
    # The causes split the step's ops per block exactly, and none is left unexplained. Marked, no
    # weight preparation is left in the step; the collectives are the bill's 5 large ones (2 K/V
    # gathers over SP, 3 all-reduces over TP; the 4 statistics gathers count with their norms).
    r = reports[frontend]
    c = r["runtime_ops_per_block_by_cause"]
    assert sum(c.values()) == pytest.approx(r["runtime_ops_per_block"])
    assert c["other"] == 0 and c["weight preparation"] == 0, c
    assert c["collectives"] == r["per_block_totals"]["large"] == 5
    assert all(c[k] > 0 for k in ("norms", "RoPE", "heads", "SDPA", "projections", "adaLN", "residuals")), c
    # Unmarked, what marking takes out of the step is exactly the weight preparation.
    u = reports["torchax/unmarked"]["runtime_ops_per_block_by_cause"]
    marked = reports["torchax"]["runtime_ops_per_block_by_cause"]
    assert u["weight preparation"] > 0
    assert {k: v for k, v in u.items() if k != "weight preparation"} == {
        k: v for k, v in marked.items() if k != "weight preparation"}
    # prompt_kv takes cross-attention's K and V projections (and K's norm) out of the step
    kv, plain = reports["torchax/1x4/prompt_kv"]["runtime_ops_per_block_by_cause"], \
        reports["torchax/1x4"]["runtime_ops_per_block_by_cause"]
    assert kv["projections"] < plain["projections"] and kv["norms"] < plain["norms"]
    assert kv["RoPE"] == plain["RoPE"] and kv["adaLN"] == plain["adaLN"]


# One block's fused forms, as tt-mlir writes them at level 1 with the rope and adaln_norm patches
# (shapes of the 2x4 480p step): the fused RoPE and a heads-first table multiply, the adaLN vectors
# made into the LayerNorm's (D,) weight and bias, the fused head merge.
_FUSED_TTNN = textwrap.dedent("""\
    %1 = "ttnn.rotary_embedding"(%arg0, %arg1, %arg2) : (tensor<1x10x16384x128xf32>, tensor<1x1x16384x128xf32>, tensor<1x1x16384x128xf32>) -> tensor<1x10x16384x128xf32> loc(#l)
    %2 = "ttnn.multiply"(%arg3, %arg1) : (tensor<1x10x16384x128xf32>, tensor<1x1x16384x128xf32>) -> tensor<1x10x16384x128xf32> loc(#l)
    %3 = "ttnn.silu"(%arg4) : (tensor<1x5120xf32>) -> tensor<1x5120xf32> loc(#l)
    %4 = "ttnn.reshape"(%3) <{shape = [1 : i32, 1 : i32, 5120 : i32]}> : (tensor<1x5120xf32>) -> tensor<1x1x5120xf32> loc(#l)
    %5 = "ttnn.add"(%4, %arg5) : (tensor<1x1x5120xf32>, tensor<1x1x5120xf32>) -> tensor<1x1x5120xf32> loc(#l)
    %6 = "ttnn.reshape"(%5) <{shape = [5120 : i32]}> : (tensor<1x1x5120xf32>) -> tensor<5120xf32> loc(#l)
    %7 = "ttnn.add"(%6, %arg6) : (tensor<5120xf32>, tensor<1xf32>) -> tensor<5120xf32> loc(#l)
    %8 = "ttnn.layer_norm"(%arg7, %7, %6) <{epsilon = 9.99999997E-7 : f32}> : (tensor<1x16384x5120xf32>, tensor<5120xf32>, tensor<5120xf32>) -> tensor<1x16384x5120xf32> loc(#l)
    %9 = "ttnn.concatenate_heads"(%1) : (tensor<1x10x16384x128xf32>) -> tensor<1x16384x1280xf32> loc(#l)
""")


def test_the_fused_rope_adaln_norm_and_head_merge_get_their_causes():
    from wan_sharding.compile import causes

    (nodes,) = causes.step_functions(TTNNModule.parse(_FUSED_TTNN))
    causes.classify(nodes)
    assert [(n.name, n.cause) for n in nodes] == [
        ("rotary_embedding", "RoPE"), ("multiply", "RoPE"), ("silu", "projections"), ("reshape", "adaLN"),
        ("add", "adaLN"), ("reshape", "adaLN"), ("add", "adaLN"), ("layer_norm", "norms"),
        ("concatenate_heads", "heads")]


# The same RoPE where a shard's rows are not a tile multiple (8x4 480p without padding: 32760 / 8 =
# 4095): tt-mlir runs rotary_embedding on 4096 rows and slices the output back (its
# RotaryEmbeddingOpRewritePattern), then the cast back to bf16.
_PADDED_ROPE_TTNN = textwrap.dedent("""\
    %0 = "ttnn.matmul"(%arg0, %arg4) : (tensor<1x10x4095x128xbf16>, tensor<1x10x128x128xbf16>) -> tensor<1x10x4095x128xbf16> loc(#l)
    %1 = "ttnn.typecast"(%0) : (tensor<1x10x4095x128xbf16>) -> tensor<1x10x4095x128xf32> loc(#l)
    %2 = "ttnn.rotary_embedding"(%1, %arg1, %arg2) : (tensor<1x10x4095x128xf32>, tensor<1x1x4095x128xf32>, tensor<1x1x4095x128xf32>) -> tensor<1x10x4096x128xf32> loc(#l)
    %3 = "ttnn.slice_static"(%2) <{begins = [0 : i32, 0 : i32, 0 : i32, 0 : i32], ends = [1 : i32, 10 : i32, 4095 : i32, 128 : i32], step = [1 : i32, 1 : i32, 1 : i32, 1 : i32]}> : (tensor<1x10x4096x128xf32>) -> tensor<1x10x4095x128xf32> loc(#l)
    %4 = "ttnn.typecast"(%3) : (tensor<1x10x4095x128xf32>) -> tensor<1x10x4095x128xbf16> loc(#l)
    %5 = "ttnn.slice_static"(%0) <{begins = [0 : i32, 0 : i32, 0 : i32, 0 : i32], ends = [1 : i32, 10 : i32, 4064 : i32, 128 : i32], step = [1 : i32, 1 : i32, 1 : i32, 1 : i32]}> : (tensor<1x10x4095x128xbf16>) -> tensor<1x10x4064x128xbf16> loc(#l)
    %6 = "ttnn.scaled_dot_product_attention"(%4, %5, %5) : (tensor<1x10x4095x128xbf16>, tensor<1x10x4064x128xbf16>, tensor<1x10x4064x128xbf16>) -> tensor<1x10x4095x128xbf16> loc(#l)
""")


def test_the_rope_tile_padding_slice_back_counts_as_rope():
    from wan_sharding.compile import causes

    (nodes,) = causes.step_functions(TTNNModule.parse(_PADDED_ROPE_TTNN))
    causes.classify(nodes)
    assert [(n.name, n.cause) for n in nodes] == [
        ("matmul", "SDPA"), ("typecast", "RoPE"), ("rotary_embedding", "RoPE"), ("slice_static", "RoPE"),
        ("typecast", "RoPE"), ("slice_static", "other"),  # a row slice of anything but the fused RoPE is not
        ("scaled_dot_product_attention", "SDPA")]


@needs_plugin
def test_the_sharded_residual_plan_has_the_forms_fused_collectives_match(reports):
    """tt-mlir #9028 / #9066 fuse ``linear(all_gather(x, last dim))`` (the gather's only use) and
    ``reduce_scatter(linear(x), last dim)`` (the matmul's only use). With the residual split on D,
    every block has three of each, nothing between: QKV, attn2's query and the FFN's first layer
    read a gather of D; attn1's and attn2's outputs and the FFN's second layer are scattered on D."""
    from pathlib import Path

    from wan_sharding.compile.ccl_fusion import GATHER_MATMUL, MATMUL_SCATTER, fused_ccl_sites

    r = reports["torchax/sharded-1x4"]
    assert r["ok"], r.get("error")
    sites = fused_ccl_sites(Path(r["ttir_path"]).read_text())
    assert [s for s in sites if not s.fusable] == []
    cfg = config_for("t2v-a14b")
    blocks, tokens, dim = 2, 3 * 5 * 7, cfg["num_attention_heads"] * cfg["attention_head_dim"]
    on_tokens = [s for s in sites if s.gathered_or_scattered[:-1] == (1, tokens)]
    assert [s.gathered_or_scattered for s in on_tokens if s.kind == GATHER_MATMUL] == [(1, tokens, dim)] * 3 * blocks
    assert [s.gathered_or_scattered for s in on_tokens if s.kind == MATMUL_SCATTER] == [(1, tokens, dim)] * 3 * blocks
    # the replicated layout has none of them (its row-parallel outputs are all-reduced)
    assert fused_ccl_sites(Path(reports["torchax/1x4"]["ttir_path"]).read_text()) == []


@needs_plugin
def test_prompt_kv_on_torch_xla_marks_each_k_and_v_an_input(reports):
    # The prompt state ({block: (K, V)}) replaces the prompt embedding: each of its tensors is an
    # input, as in tt-xla's export signature (converted in the step, as activations are: not weight
    # preparation); the step then runs no norm_k of the prompt, and fewer ops in all.
    r, plain = reports["torch-xla/prompt_kv"], reports["torch-xla"]
    assert r["ok"], r.get("error")
    assert r["arguments_marked"]["input"] == 2 + 2 * 2  # hidden_states, timestep, K and V of 2 blocks
    assert r["argument_types"]["input"] == 6
    assert r["bill_ok"], r["bill_problems"]
    kv, base = r["runtime_ops_per_block_by_cause"], plain["runtime_ops_per_block_by_cause"]
    assert kv["weight preparation"] == 0 and kv["norms"] < base["norms"]
    assert r["runtime_ops_per_block"] < plain["runtime_ops_per_block"]


@needs_plugin
def test_plain_attention_on_torch_xla_gathers_in_f32_and_the_bytes_check_catches_it(reports):
    # Without the composite, torch-xla's lowering upcasts before the SP gather: twice the bytes.
    r = reports["torch-xla/plain"]
    assert r["ok"] and r["sdpa"]["count"] == 0
    assert r["per_block_totals"] == {"large": 5, "small": 4}  # the counts alone look right
    assert not r["bill_ok"]
    assert any("f32" in p and "bf16 minimum" in p for p in r["bill_problems"]), r["bill_problems"]


@needs_plugin
def test_torch_xla_frontend_writes_the_shardy_module_it_compiled(reports):
    r = reports["torch-xla"]
    text = open(r["stablehlo_path"]).read() if r.get("stablehlo_path") else ""
    assert "sdy.mesh @mesh" in text and "mhlo.sharding" not in text
    assert 'stablehlo.composite "tenstorrent.scaled_dot_product_attention"' in text


def test_a_gathered_query_fails_the_attention_check():
    # TTIR lines as tt-mlir writes them; per-device shapes on SP 2 with 128 padded tokens.
    split = ('%1 = "ttir.scaled_dot_product_attention"(%a, %b, %c) <{is_causal = false}> : (tensor<1x2x64x16xbf16>, '
             "tensor<1x2x128x16xbf16>, tensor<1x2x128x16xbf16>) -> tensor<1x2x64x16xbf16> loc(#l)")
    gathered = split.replace("tensor<1x2x64x16xbf16>", "tensor<1x2x128x16xbf16>")
    assert attention_report(ttir_attention(split), "2x4", 128)["q_split"]
    report = attention_report(ttir_attention(gathered), "2x4", 128)
    assert not report["q_split"] and report["q_tokens_per_device"] == [128]


def test_bytes_budget_is_the_design_minimum():
    cfg = config_for("t2v-a14b", "full")
    b = design_bytes(cfg, "8x4", 32768)  # 480p on a Galaxy: 4096 tokens per device
    assert b.sp_gather == 10 * 32768 * 128 * 2 and b.tp_reduce == 4096 * 5120 * 2
    ok = BlockBill([BillEntry("all_gather", "sp", "large", 2, "1x10x4096x128xbf16", b.sp_gather)], (1, 2))
    f32 = BlockBill([BillEntry("all_gather", "sp", "large", 2, "1x10x4096x128xf32", 2 * b.sp_gather)], (1, 2))
    assert not [p for p in bill_problems(ok, "8x4", b) if "minimum" in p]
    assert [p for p in bill_problems(f32, "8x4", b) if "minimum" in p]


# ---- the composite executes its body: exact on the CPU backends --------------------------------


def test_fused_sdpa_is_the_same_math_and_leaves_f32_alone():
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)
    mask[..., 6:] = torch.finfo(torch.bfloat16).min
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float())
    assert (sdpa_math(q, k, v, mask, 16 ** -0.5).float() - ref).abs().max() < 2e-2

    calls = []
    # The mode's collaborator: a one-device mesh (nothing to pin) and a composite builder that counts.
    backend = SimpleNamespace(mesh=mesh_from_preset("1x1"), sdpa_composite=lambda *a: calls.append(a) or sdpa_math(*a))
    mode = FusedSDPA(backend)
    with mode:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert (mode.fused, mode.plain, len(calls)) == (1, 1, 1)


def test_fused_sdpa_in_a_sharded_jax_trace_matches_the_unsharded_model():
    dit = build_dit("t2v-a14b", "tiny", dtype=torch.bfloat16)
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14), dtype=torch.bfloat16)
    with torch.no_grad():
        ref = dit(**inputs, return_dict=False)[0]
    backend = get_backend("jax", mesh_from_preset("2x4"))
    placed = backend.place(dit, shard_dit_specs(dit, backend.mesh))
    handle = apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend)
    try:
        import jax

        mode = FusedSDPA(backend)
        jargs, jkwargs = backend._device_inputs((), inputs)
        with stock_rotary_in_bf16():
            out = backend.to_host(jax.jit(backend.jax_forward(dit, fused_sdpa=mode))(placed, jargs, jkwargs))
    finally:
        handle.remove()
    assert mode.fused == 4  # self- and cross-attention in each of the 2 blocks
    from wan_sharding.jobs.pcc import compare

    pcc, max_abs = compare(ref, out)
    assert pcc > 0.99 and max_abs < 0.1  # bf16 bounds of the suite


@needs_plugin
@pytest.mark.parametrize("frontend", ["torchax", "torch-xla"])
def test_half_rotation_rope_patch_removes_the_rotary_scatter(reports, frontend):
    vanilla, patched = reports[frontend], reports[f"{frontend}/rope"]
    assert vanilla["ops"].get("rows_scatter", 0) > 0  # diffusers' interleaved rotary write
    assert patched["ok"] and patched["patches"] == ["rope"]
    assert patched["ops"].get("rows_scatter", 0) == 0
    # torch-xla bakes the scatter's per-element indices into the program as constants; torchax does not.
    if frontend == "torch-xla":
        assert patched["constant_bytes"] < vanilla["constant_bytes"] / 4
    assert patched["constant_bytes"] <= vanilla["constant_bytes"]
    assert patched["bill_ok"] and patched["sdpa"]["q_split"], patched.get("bill_problems")
    # With the half-rotation RoPE, DRAM space saving (hardware's default, left on here) compiles
    # on the first try on both frontends: the tiny widths' interleaved RoPE is what it fails on.
    assert patched["options_used"]["experimental-enable-dram-space-saving-optimization"] == "true"
    assert not [n for n in patched["notes"] if "dram-space-saving" in n], patched["notes"]


@needs_plugin
def test_prompt_kv_leaves_the_prompts_work_out_of_the_step(reports):
    """The step compiled with ``prompt_kv`` (the prompt state's K / V as inputs) against the same step
    without: per block, cross-attention's ``to_k`` / ``to_v`` and ``norm_k`` (its statistics gather
    over TP) are gone, the rest of the bill is the same and meets the patch's design (3 small)."""
    vanilla, patched = reports["torchax/1x4"], reports["torchax/1x4/prompt_kv"]
    assert patched["ok"] and patched["bill_ok"], patched.get("bill_problems")
    assert patched["design"]["all_reduce/small/tp"] == 3 and vanilla["design"]["all_reduce/small/tp"] == 4
    before, after = vanilla["per_block_ops"], patched["per_block_ops"]
    assert after["linear"] == before["linear"] - 2
    assert after["rms_norm_pre_all_gather"] == before["rms_norm_pre_all_gather"] - 1
    assert after["all_gather"] == before["all_gather"] - 1
    assert vanilla["per_block_totals"] == {"large": 3, "small": 4} and patched["per_block_totals"] == {"large": 3, "small": 3}
    assert sum(after.values()) < sum(before.values()) - 10


def test_a_dram_saving_failure_is_compiled_once_more_without_it_and_said():
    """The compile path's retry (wan_sharding/compile/lowering.py), with a stand-in for the
    plugin's compile call raising what tt-mlir 0.1.3 raises when its DRAM space-saving patterns
    fail: once more without the option, with the note; any other failure is reported as it is."""
    from wan_sharding.compile.lowering import DRAM_NOTE, _compile_with_options

    key = "experimental-enable-dram-space-saving-optimization"
    seen = []

    def compile(options, error="INTERNAL: Failed to run TTIRToTTNNCommon pipeline"):
        seen.append(options[key])
        if options[key] == "true":
            raise RuntimeError(error)

    result: dict = {}
    _compile_with_options(compile, CompileRequest(size="tiny", mesh="1x4"), result)
    assert seen == ["true", "false"] and result["ok"] and result["error"] is None
    assert result["options_note"] == DRAM_NOTE and result["options_used"][key] == "false"
    seen.clear()
    result = {}
    _compile_with_options(lambda o: compile(o, "INTERNAL: something else"), CompileRequest(size="tiny", mesh="1x4"), result)
    assert seen == ["true"] and not result["ok"] and "something else" in result["error"]
