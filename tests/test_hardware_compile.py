"""Hardware's composite set and compile options (docs/compile-hardware.md).

The compiles share tests/test_frontends.py's module fixture where they can; here: the options'
spelling and checks, the norm-statistics bill class, and the RMSNorm solution's numerics against
the unsharded model on the jax CPU mesh (in this process) and the torch-xla CPU mesh (a worker).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from wan_sharding import apply_dit_sp_activation_sharding, get_backend, shard_dit_specs
from wan_sharding.compile import BlockBill, TTNNModule, sysdesc
from wan_sharding.compile.bill import BillEntry, bill_problems
from wan_sharding.compile.composites import LAYER_NORM, RMS_NORM, HardwareComposites, ttir_composite_counts
from wan_sharding.compile.options import PLUGIN_KEYS, CompileOptions, effective_options
from wan_sharding.compile.request import CompileError, CompileRequest
from wan_sharding.compile.runner import for_arch
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import LatentShape, build_dit, dit_inputs

EXACT = 1e-4  # fp32 max-abs bound of the suite


# ---- compile options: the plugin's spelling, checked before any worker starts ----------------


def test_options_default_to_tt_xlas_wan_settings_with_the_plugins_keys():
    from wan_sharding.backends.tt import TTCompileOptions

    hw = CompileOptions.hardware()
    tt = TTCompileOptions()
    assert (hw.optimization_level, hw.dram_space_saving, hw.enable_trace) == (
        tt.optimization_level, tt.experimental_enable_dram_space_saving_optimization, tt.enable_trace)
    # Keys as tt-xla's pjrt_implementation/src/api/compile_options.cc reads them.
    assert hw.plugin_options() == {"optimization_level": "1", "experimental-enable-dram-space-saving-optimization": "true",
                                   "enable_trace": "true"}
    assert set(PLUGIN_KEYS.values()) == set(hw.plugin_options())


def test_bfp8_collectives_are_an_opt_in_option_sent_only_when_on():
    # tt-xla's plugin reads enable_activation_dtype_lowering (off by default; hardware's Wan tests
    # leave it off): sent only when asked for, and kept when level 1 is lowered on Wormhole.
    on = CompileOptions.parse("enable_activation_dtype_lowering=true")
    assert on.activation_dtype_lowering and on.plugin_options()["enable_activation_dtype_lowering"] == "true"
    assert "enable_activation_dtype_lowering" not in CompileOptions.hardware().plugin_options()
    assert on.differs_from(CompileOptions.hardware()) == ["enable_activation_dtype_lowering=true (hardware: false)"]
    assert effective_options(on, "wormhole_b0")[0].activation_dtype_lowering
    with pytest.raises(ValueError, match="enable_activation_dtype_lowering must be true or false"):
        CompileOptions.parse("enable_activation_dtype_lowering=bfp8")
    # jax-tt-plugin 0.1.3 fails such a compile ("No such compile option"): refused before any worker
    if sysdesc.installed_plugin_version() == "0.1.3":
        with pytest.raises(CompileError, match="not one jax-tt-plugin 0.1.3 parses"):
            CompileRequest(size="tiny", mesh="1x4", compile_options="enable_activation_dtype_lowering=true").validate()


@pytest.mark.parametrize("text,expect", [
    ("optimization_level=0", {"optimization_level": 0, "dram_space_saving": True, "enable_trace": True}),
    ("experimental-enable-dram-space-saving-optimization=off,enable_trace=0",
     {"optimization_level": 1, "dram_space_saving": False, "enable_trace": False}),
    ('{"optimization_level": 2, "dram_space_saving": false}',
     {"optimization_level": 2, "dram_space_saving": False, "enable_trace": True}),
])
def test_options_parse(text, expect):
    assert CompileOptions.parse(text).to_json() == expect


@pytest.mark.parametrize("text,match", [
    ("optimisation_level=1", "unknown compile option 'optimisation_level'"),
    ("optimization_level=3", "must be one of"),
    ("enable_trace=maybe", "must be true or false"),
    ("enable_trace", "has no value"),
])
def test_bad_options_are_one_line_errors(text, match):
    with pytest.raises(ValueError, match=match):
        CompileOptions.parse(text)
    with pytest.raises(CompileError, match=match):
        CompileRequest(size="tiny", mesh="1x4", compile_options=text).validate()


def test_level_one_is_lowered_on_wormhole_with_the_reason_and_patchify_added_on_blackhole():
    opts, why = effective_options(CompileOptions.hardware(), "wormhole_b0")
    assert opts.optimization_level == 0 and "brisc build failed" in why
    assert effective_options(CompileOptions.hardware(), "blackhole") == (CompileOptions.hardware(), None)
    # tt-metal's mock device has no 64- or 128-chip configuration: level 0 there too, with the reason.
    opts, why = effective_options(CompileOptions.hardware(), "blackhole", 128)
    assert opts.optimization_level == 0 and "128-chip" in why
    assert effective_options(CompileOptions.hardware(), "blackhole", 32)[1] is None
    wh = for_arch(CompileRequest(size="tiny", mesh="1x4"), "wormhole_b0")
    assert wh.compile_options["optimization_level"] == 0 and wh.patches == () and len(wh.notes) == 1
    bh = for_arch(CompileRequest(size="tiny", mesh="1x4"), "blackhole")
    assert bh.compile_options["optimization_level"] == 1 and bh.patches == ("patchify",)
    assert "conv3d" in bh.notes[0]
    with pytest.raises(CompileError, match="unknown composite set"):
        CompileRequest(size="tiny", mesh="1x4", composites="all").validate()


def test_the_planner_compute_follows_the_mock_devices_worker_grid():
    from wan_sharding.planner.hardware import chip, worker_cores

    assert worker_cores("blackhole") == 120 and worker_cores("wormhole_b0") == 64  # p150 10x12, n150 8x8
    assert chip("blackhole").peak_tflops == pytest.approx(332.0)


# ---- the bill: RMSNorm statistics in tt-mlir's distributed forms ------------------------------

_STATS_TTNN = textwrap.dedent("""\
    %1 = "ttnn.rms_norm_pre_all_gather"(%0) : (tensor<1x1x4096x32xbf16>) -> tensor<1x1x4096x32xbf16> loc(#l)
    "ttnn.deallocate"(%0) : (tensor<1x1x4096x32xbf16>) -> () loc(#l)
    %2 = "ttnn.all_gather"(%1) <{all_gather_dim = 3 : si32, cluster_axis = 1 : ui32}> : (tensor<1x1x4096x32xbf16>) -> tensor<1x1x4096x128xbf16> loc(#l)
    %3 = "ttnn.all_gather"(%9) <{all_gather_dim = 3 : si32, cluster_axis = 1 : ui32}> : (tensor<1x1x4096x32xbf16>) -> tensor<1x1x4096x128xbf16> loc(#l)
    %4 = "ttnn.distributed_rms_norm"(%3, %8) <{cluster_axis = 1 : ui32, epsilon = 1.0e-06 : f32}> : (tensor<1x1x32x1280xbf16>, tensor<40x32xbf16>) -> tensor<1x1x32x1280xbf16> loc(#l)
""")


def test_norm_statistics_are_small_and_count_as_the_designs_four_small_tp_collectives():
    colls = TTNNModule.parse(_STATS_TTNN).collectives
    # Only the gather right after rms_norm_pre_all_gather carries statistics; the same shape elsewhere is large.
    assert [(c.kind, c.size) for c in colls] == [("all_gather", "small"), ("all_gather", "large"),
                                                ("distributed_rms_norm", "small")]
    big = [BillEntry("all_reduce", "tp", "large", 3, "1x4096x5120xbf16", 1), BillEntry("all_gather", "sp", "large", 2, "x", 1)]
    mixed = BlockBill(big + [BillEntry("all_gather", "tp", "small", 1, "1x1x4096x32xbf16", 1),
                             BillEntry("distributed_rms_norm", "tp", "small", 3, "1x1x32x1280xbf16", 1)], (1, 2))
    assert bill_problems(mixed, "2x4") == []
    short = BlockBill(big + [BillEntry("distributed_rms_norm", "tp", "small", 3, "1x1x32x1280xbf16", 1)], (1, 2))
    assert bill_problems(short, "2x4") == ["small all_reduce over tp: 3 per block, design says 4"]
    # the prompt_kv patch's step: cross-attention's norm_k runs once per prompt, outside it
    assert bill_problems(short, "2x4", prompt_kv=True) == []
    assert bill_problems(mixed, "2x4", prompt_kv=True) == ["small all_reduce over tp: 4 per block, design says 3"]


def test_ttir_composite_counts():
    text = ('%1 = "ttir.distributed_rms_norm"(%0) <{cluster_axis = 1 : ui32}> : (tensor<1x8xbf16>) -> tensor<1x8xbf16>\n'
            '%2 = "ttir.layer_norm"(%1) : (tensor<1x8xf32>) -> tensor<1x8xf32>\n'
            '%3 = "ttir.rms_norm"(%2) : (tensor<1x8xbf16>) -> tensor<1x8xbf16>\n')
    assert ttir_composite_counts(text) == {"rms_norm": 1, "distributed_rms_norm": 1, "layer_norm": 1}


# ---- the RMSNorm solution is exact against the unsharded model -------------------------------


def test_hardware_composites_sharded_on_jax_match_the_unsharded_model():
    import jax

    from wan_sharding.jobs.pcc import compare

    dit = build_dit("t2v-a14b", "tiny", dtype=torch.float32)
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14), dtype=torch.float32)
    with torch.no_grad():
        ref = dit(**inputs, return_dict=False)[0]
    backend = get_backend("jax", mesh_from_preset("2x4"))
    placed = backend.place(dit, shard_dit_specs(dit, backend.mesh))
    handle = apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend)
    try:
        mode = HardwareComposites(backend, dit, split_tokens=lambda: handle.state.padded_len)
        jargs, jkwargs = backend._device_inputs((), inputs)
        fn = jax.jit(backend.jax_forward(dit, fused_sdpa=mode))
        text = fn.lower(placed, jargs, jkwargs).as_text()
        out = backend.to_host(fn(placed, jargs, jkwargs))
    finally:
        handle.remove()
    assert mode.counts() == {RMS_NORM: 8, LAYER_NORM: 7, "tenstorrent.gelu_tanh": 2}  # fp32: no SDPA composite
    assert text.count(f'stablehlo.composite "{RMS_NORM}"') == 8
    pcc, max_abs = compare(ref, out)
    assert pcc >= 0.99999 and max_abs <= EXACT, (pcc, max_abs)


_XLA_CHECK = """
import json, torch, torch_xla.core.xla_model as xm
from wan_sharding import apply_dit_sp_activation_sharding, shard_dit_specs
from wan_sharding.backends.xla import XlaBackend, enable_spmd
from wan_sharding.compile.composites import HardwareComposites
from wan_sharding.jobs.pcc import compare
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import LatentShape, build_dit, dit_inputs
enable_spmd()
torch_xla = __import__("torch_xla")
dit = build_dit("t2v-a14b", "tiny", dtype=torch.float32)
inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14), dtype=torch.float32)
with torch.no_grad():
    ref = dit(**inputs, return_dict=False)[0]
backend = XlaBackend(mesh_from_preset("2x4"))
backend.place(dit, shard_dit_specs(dit, backend.mesh))
handle = apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend)
split = lambda: handle.state.padded_len
dev = {k: v.to(backend.device) for k, v in inputs.items()}
torch_xla._XLAC._set_xla_all_numbers_special_scalars(True)
with torch.no_grad(), HardwareComposites(backend, dit, split_tokens=split) as marked:
    text = xm.get_stablehlo([dit(**dev, return_dict=False)[0]])  # lowered, not run: the CPU client has no markers
torch_xla._XLAC._set_xla_all_numbers_special_scalars(False)
with torch.no_grad(), HardwareComposites(backend, dit, split_tokens=split, mark=False) as mode:
    out = dit(**dev, return_dict=False)[0].cpu()  # the same bodies and pinning, executed
pcc, max_abs = compare(ref, out)
print("RESULT " + json.dumps({"pcc": pcc, "max_abs": max_abs, "counts": marked.counts(), "run_counts": mode.counts(),
                              "rms_composites": text.count('stablehlo.composite "tenstorrent.rms_norm"')}))
"""


def test_hardware_composites_sharded_on_torch_xla_match_the_unsharded_model():
    from wan_sharding.compile.runner import trace_env

    run = subprocess.run([sys.executable, "-c", _XLA_CHECK], env=trace_env(8), capture_output=True, text=True,
                         timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, run.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["counts"] == r["run_counts"] == {RMS_NORM: 8, LAYER_NORM: 7, "tenstorrent.gelu_tanh": 2}
    assert r["rms_composites"] == 8
    assert r["pcc"] >= 0.99999 and r["max_abs"] <= EXACT, r


# ---- what the compiler got: shared with test_frontends' compiles -----------------------------


needs_plugin = pytest.mark.skipif(sysdesc.installed_plugin_version() is None, reason="jax-tt-plugin is not installed")
