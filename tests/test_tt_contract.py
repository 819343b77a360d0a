"""Contract test for the ``tt`` backend with stand-ins for Tenstorrent's stack.

Tenstorrent's torch plugin (``pjrt-plugin-tt``, providing ``tt_torch``) and their torch-xla fork
come from Tenstorrent's own package index and cannot be installed here, and there is no Tenstorrent
device. So these tests replace, and say so plainly:

- ``tt_torch.sharding`` with a recorder, and check exactly what the backend would send it: which
  tensors (shapes), with which partition specs, in which order, and the Shardy strings
  ``sharding_constraint_tensor`` would emit for them (its documented format). The recorder returns
  each tensor unchanged, so the model runs eagerly on CPU.
- ``torch.compile`` (only where the backend calls it) with a counter that records each call and
  returns the eager model, and ``torch_xla`` with a fake module whose ``device()`` is the CPU and
  whose ``set_custom_compile_options`` records what it gets (that function exists only in
  Tenstorrent's torch-xla build). These show the backend compiles once per model and input
  signature, forgets on ``release``, and sends the compile options once, defaults or overrides.
- for the graph counts, real ``torch.compile`` in a stock torch-xla CPU process
  (``tests/tt_graphs.py``): there the custom op ``tt::sharding_constraint`` (registered as tt-xla's
  ``python_package/tt_torch/custom_ops.py`` registers it, applying the constraint on torch-xla
  SPMD) and a graph-counting ``"tt"`` dynamo backend stand in for tt_torch, with
  ``inline_inbuilt_nn_modules=False`` as tt-xla's ``torch_plugin_tt`` sets it; the backend,
  hooks, torch-xla SPMD and dynamo are the real ones. The same process counts the RMSNorm pins
  the backend places on TP meshes (1x4, 2x4) in that one graph and compares the output with the
  unsharded model.
- for LoRA switching, real ``torch.compile`` in this process (the CPU standing in for the TT
  device): a graph-counting ``"tt"`` dynamo backend in place of tt_torch's, which runs each graph
  as it is (fixture ``real_dynamo_tt``).

The option keys are checked against the list of keys tt-xla's plugin reads, copied by hand from
its source below (``PLUGIN_KEYS``).
"""

import sys
import types
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from diffusers import WanTransformer3DModel  # noqa: F401  (imported before a stand-in replaces torch_xla)
from diffusers.hooks import FirstBlockCacheConfig  # noqa: F401  (likewise: the cache hooks' modules)

from wan_sharding import apply_dit_sp_activation_sharding
from wan_sharding.backends import tt as tt_module
from wan_sharding.backends.tt import COMPILE_OPTIONS_ENV, TTBackend, TTCompileOptions
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import LatentShape, build_dit, dit_inputs

REAL_COMPILE = torch.compile  # before a stand-in replaces it; the graph-counting LoRA test uses dynamo itself


def sdy_string(axis_names, spec):
    """What tt_torch emits: one {...} per tensor dim, mesh axis i named "mesh_idx_<i>"."""
    dims = ", ".join("{}" if a is None else '{"mesh_idx_%d"}' % axis_names.index(a) for a in spec)
    return f"#sdy.sharding_per_value<[<@mesh, [{dims}]>]>"


@pytest.fixture
def tt_recorder(monkeypatch):
    calls = []

    def sharding_constraint_tensor(tensor, mesh, partition_spec, unreduced=None):
        calls.append((tuple(tensor.shape), tuple(partition_spec), sdy_string(mesh.axis_names, partition_spec)))
        return tensor

    sharding = types.ModuleType("tt_torch.sharding")
    sharding.sharding_constraint_tensor = sharding_constraint_tensor
    pkg = types.ModuleType("tt_torch")
    pkg.sharding = sharding
    monkeypatch.setitem(sys.modules, "tt_torch", pkg)
    monkeypatch.setitem(sys.modules, "tt_torch.sharding", sharding)
    return calls


@pytest.mark.parametrize("padding", ["slice", "mask"])
def test_tt_backend_sends_the_double_constraint_and_the_exit_gather(tt_recorder, tt_stand_ins, padding):
    mesh = mesh_from_preset("2x4")
    # A torch-xla Mesh needs Tenstorrent devices; the constraint call only reads its axis names.
    backend = TTBackend(mesh, native_mesh=SimpleNamespace(mesh_shape=(2, 4), axis_names=("sp", "tp")))
    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))  # 105 tokens -> 128
    with torch.no_grad():
        ref = dit(**inputs, return_dict=False)[0]
    handle = apply_dit_sp_activation_sharding(dit, mesh, backend=backend, padding=padding)
    with torch.no_grad():
        out = dit(**inputs, return_dict=False)[0]
    handle.remove()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    rep4, sp4 = "[{}, {}, {}, {}]", '[{}, {"mesh_idx_0"}, {}, {}]'
    rep3, sp3 = "[{}, {}, {}]", '[{}, {"mesh_idx_0"}, {}]'
    wrap = lambda s: f"#sdy.sharding_per_value<[<@mesh, {s}>]>"  # noqa: E731
    # mask mode: the key mask, built once at the block-stack entry, is pinned whole on every device
    mask = [((1, 1, 1, 128), (None, None, None, None), wrap(rep4))] if padding == "mask" else []
    assert tt_recorder == [
        # rope tables: replicated anchor, then padded and L-on-SP (cos, then sin)
        ((1, 105, 1, 16), (None, None, None, None), wrap(rep4)),
        ((1, 128, 1, 16), (None, "sp", None, None), wrap(sp4)),
        ((1, 105, 1, 16), (None, None, None, None), wrap(rep4)),
        ((1, 128, 1, 16), (None, "sp", None, None), wrap(sp4)),
        *mask,
        # block-stack entry: the same double constraint on (B, L, D)
        ((1, 105, 128), (None, None, None), wrap(rep3)),
        ((1, 128, 128), (None, "sp", None), wrap(sp3)),
        # proj_out: one constraint back to replicated, on the padded length (sliced after)
        ((1, 128, 64), (None, None, None), wrap(rep3)),
    ]


def test_tt_backend_on_a_cfg_mesh_sends_the_pair_split_over_cfg(tt_recorder, tt_stand_ins):
    """CFG parallel on 2x4 (two 1x4 groups, TP only): every constraint of the pair's batch names the
    cfg axis on its batch dim (the rope tables, batch 1, stay whole); the pair equals the two
    forwards. A 3-D cfg mesh is refused in one line before the runtime starts (tt-mlir: 2-D at most)."""
    from wan_sharding import BackendError
    from wan_sharding.mesh import with_cfg
    from wan_sharding.models import guidance_pair

    mesh = with_cfg("2x4")
    backend = TTBackend(mesh, native_mesh=SimpleNamespace(mesh_shape=(2, 4), axis_names=("cfg", "tp")))
    dit = build_dit("t2v-a14b")
    cond, uncond, both = guidance_pair(dit_inputs("t2v-a14b", LatentShape(3, 10, 14)))
    with torch.no_grad():
        ref = torch.cat([dit(**cond, return_dict=False)[0], dit(**uncond, return_dict=False)[0]])
    handle = apply_dit_sp_activation_sharding(dit, mesh, backend=backend)
    with torch.no_grad():
        out = dit(**both, return_dict=False)[0]
    handle.remove()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    batch = [(shape, spec) for shape, spec, _ in tt_recorder if shape[0] == 2]
    assert batch and all(spec[0] == "cfg" and "sp" not in spec for _, spec in batch), tt_recorder
    assert all(spec[0] is None for shape, spec, _ in tt_recorder if shape[0] == 1)
    with pytest.raises(BackendError, match="1-D and 2-D meshes only") as e:
        TTBackend(with_cfg("8x4"))
    assert "\n" not in str(e.value)


def test_tt_backend_without_the_plugin_says_where_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tt_torch", None)
    from wan_sharding import BackendError

    with pytest.raises(BackendError, match="pjrt-plugin-tt.*Tenstorrent's package index"):
        TTBackend(mesh_from_preset("2x4"))


# ---------------------------------------------------------------------------- compile once, options

# What Tenstorrent's Wan DiT tests compile with (tt-xla tests/torch/models/wan14b/test_wan_dit.py),
# under the keys the plugin reads (tt-xla pjrt_implementation/src/api/compile_options.cc: the DRAM
# pass's key is hyphenated, as tests/infra/testers/compiler_config.py sends it), string values.
WAN_TEST_OPTIONS = {"optimization_level": "1", "experimental-enable-dram-space-saving-optimization": "true",
                    "enable_trace": "true"}


@pytest.fixture
def tt_stand_ins(tt_recorder, monkeypatch):
    """Stand-ins (see the module docstring): ``torch.compile`` counts and returns the eager model;
    a fake ``torch_xla`` records ``set_custom_compile_options`` and puts "the TT device" on the CPU."""
    record = SimpleNamespace(compiles=[], options=[])

    def compile_stand_in(model, *, backend=None, **kwargs):
        record.compiles.append((model, backend, kwargs))
        return lambda *args, **kw: model(*args, **kw)

    fake_xla = types.ModuleType("torch_xla")
    fake_xla.device = lambda: torch.device("cpu")
    fake_xla.set_custom_compile_options = lambda options: record.options.append(dict(options))
    monkeypatch.setattr(torch, "compile", compile_stand_in)
    monkeypatch.setitem(sys.modules, "torch_xla", fake_xla)
    monkeypatch.setattr(tt_module, "_applied_options", None)  # a fresh process: nothing sent yet
    monkeypatch.delenv(COMPILE_OPTIONS_ENV, raising=False)
    return record


def _tt_backend(**kwargs):
    # A torch-xla Mesh needs Tenstorrent devices; nothing here reads more than its axis names.
    native = SimpleNamespace(mesh_shape=(2, 4), axis_names=("sp", "tp"))
    return TTBackend(mesh_from_preset("2x4"), native_mesh=native, **kwargs)


def test_tt_backend_compiles_once_per_model_and_input_signature(tt_stand_ins):
    backend = _tt_backend()
    dit, other = build_dit("t2v-a14b"), build_dit("t2v-a14b")
    small = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    large = dit_inputs("t2v-a14b", LatentShape(1, 32, 32))
    with torch.no_grad():
        ref = dit(**small, return_dict=False)[0]
        first = backend.run(dit, None, **small)
        second = backend.run(dit, None, **small)
        assert len(tt_stand_ins.compiles) == 1  # repeated calls reuse the compiled forward
        model, name, kwargs = tt_stand_ins.compiles[0]
        assert model is dit and name == "tt" and kwargs == {"dynamic": False}
        torch.testing.assert_close(first, ref)
        torch.testing.assert_close(second, ref)

        backend.compile(dit, None, **small)()  # a Program for the same inputs: the same compile
        backend.run(dit, None, **large)  # a new input shape: compiled again, for that shape
        assert len(tt_stand_ins.compiles) == 2
        backend.run(dit, None, **small)
        backend.run(dit, None, **large)
        assert len(tt_stand_ins.compiles) == 2

        backend.run(dit, None, **{**small, "encoder_hidden_states_image": None})  # None-ness is part of it
        backend.run(dit, None, **{k: v.to(torch.float64) if k == "timestep" else v for k, v in small.items()})
        assert len(tt_stand_ins.compiles) == 4  # ... and so are dtypes
        backend.run(other, None, **small)  # another model: its own compile
        assert len(tt_stand_ins.compiles) == 5 and tt_stand_ins.compiles[-1][0] is other
        assert backend.compiles == 5

        backend.release(dit)  # forgotten: the next call compiles again; the other model is kept
        backend.run(dit, None, **small)
        backend.run(other, None, **small)
    assert len(tt_stand_ins.compiles) == 6 and tt_stand_ins.compiles[-1][0] is dit
    # The options reached torch-xla once, before the first compile, with the Wan tests' defaults.
    assert tt_stand_ins.options == [WAN_TEST_OPTIONS]


def test_tt_backend_compiles_the_text_encoder_once_with_its_mask_hook_and_no_norm_pins(tt_stand_ins):
    """The UMT5 encoder on the tt backend (``shard_text_encoder`` runs it through ``backend.run``):
    one ``torch.compile(..., backend="tt")`` per input signature with its padding-mask hook inside,
    no RMSNorm pins (its norms are whole on every device), and the unsharded output."""
    from wan_sharding.models import build_text_encoder, text_encoder_inputs
    from wan_sharding.text_encoder.shard import MaskHook

    backend = _tt_backend()
    encoder = build_text_encoder()
    ids, mask = text_encoder_inputs(valid=(11,))
    with torch.no_grad():
        ref = encoder(ids, mask).last_hidden_state
        hook = MaskHook(encoder)  # what shard_text_encoder installs
        first, second = backend.run(encoder, None, ids, mask), backend.run(encoder, None, ids, mask)
        hook.remove()
    assert [(m, b, kw) for m, b, kw in tt_stand_ins.compiles] == [(encoder, "tt", {"dynamic": False})]
    assert backend.pin_norms(encoder).names == []
    torch.testing.assert_close(first, ref)
    torch.testing.assert_close(second, ref)
    backend.release(encoder)


def test_tt_compile_options_defaults_and_overrides(tt_stand_ins, monkeypatch):
    assert TTCompileOptions().to_torch_xla() == WAN_TEST_OPTIONS
    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    backend = _tt_backend(compile_options={"optimization_level": 2, "enable_trace": False, "export_path": "irs"})
    with torch.no_grad():
        backend.run(dit, None, **inputs)
        backend.run(dit, None, **inputs)
    overridden = {"optimization_level": "2", "experimental-enable-dram-space-saving-optimization": "true",
                  "enable_trace": "false", "export_path": "irs"}
    assert tt_stand_ins.options == [overridden]

    # Options from the environment (how the CLI's workers get them), as a dataclass field each.
    monkeypatch.setenv(COMPILE_OPTIONS_ENV, '{"optimization_level": 0, "experimental_enable_dram_space_saving_optimization": false}')
    env_backend = _tt_backend()
    assert env_backend.compile_options == TTCompileOptions(0, False, True)
    with torch.no_grad():
        env_backend.run(dit, None, **inputs)
    assert tt_stand_ins.options[-1] == {"optimization_level": "0", "enable_trace": "true",
                                        "experimental-enable-dram-space-saving-optimization": "false"}
    # A backend with the options torch-xla already has sends nothing again (they are process-wide).
    with torch.no_grad():
        _tt_backend(compile_options=TTCompileOptions(0, False, True)).run(dit, None, **inputs)
    assert len(tt_stand_ins.options) == 2

    with pytest.raises(ValueError, match="optimization_level"):
        TTCompileOptions(optimization_level=3)


def test_tt_backend_on_stock_torch_xla_says_it_is_not_tenstorrents_build(tt_stand_ins, monkeypatch):
    monkeypatch.delattr(sys.modules["torch_xla"], "set_custom_compile_options")
    from wan_sharding import BackendError

    with pytest.raises(BackendError, match="stock torch-xla.*Tenstorrent's package index"), torch.no_grad():
        _tt_backend().run(build_dit("t2v-a14b"), None, **dit_inputs("t2v-a14b", LatentShape(3, 10, 14)))


# per kind: the programs six forwards make (two runs of 3 steps, one context), and programs per forward
CACHED_PROGRAMS = {
    "fbc": ({"head", "rest", "reuse"}, 2),
    "mag": ({"full", "reuse"}, 1),
    # computed on steps 0, 1, 3 (step distances 1, 2 since the last update), predicted 1 or 2 after
    "taylorseer": ({"update", "update/1", "predict/1", "update/2", "predict/2"}, 1),
    # attn1 every 2nd call, attn2 every 3rd: calls 0..5 give these four patterns
    "pab": ({"compute", "reuse", "attn1:compute attn2:reuse", "attn1:reuse attn2:compute"}, 1),
}
CACHE_OVERRIDES = {"fbc": {"threshold": 1e9}, "mag": {"threshold": 1e9, "mag_ratios": [1.0] * 3},
                   "taylorseer": {}, "pab": {"timestep": lambda: 500}}  # skip whenever they can


@pytest.mark.parametrize("kind", list(CACHED_PROGRAMS))
def test_tt_backend_runs_a_cached_forward_as_a_few_compiled_programs(tt_stand_ins, monkeypatch, kind):
    """With a cache on, a forward is a fixed number of programs, each through
    ``torch.compile(backend="tt")`` once per signature (stand-in: run eagerly on the CPU), with the
    compile options sent before the first of them; never the whole-forward compile. The cache
    decides and computes exactly as on the unsharded model."""
    from wan_sharding.caching import wan_cache_config
    from wan_sharding.caching.probes import install_probe
    from wan_sharding.pipeline import ShardedTransformer

    seen = []  # the options torch-xla had when each torch.compile was called
    compile_stand_in = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (seen.append(tt_module._applied_options),
                                                            compile_stand_in(fn, **kw))[1])
    backend = _tt_backend()
    dit, reference_dit = build_dit("t2v-a14b", num_layers=3), build_dit("t2v-a14b", num_layers=3)
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    sp = apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend, padding="mask")
    model = ShardedTransformer(dit, backend, None, "transformer", "mask", sp=sp)
    programs, per_forward = CACHED_PROGRAMS[kind]
    config = lambda: wan_cache_config(kind, 3, **CACHE_OVERRIDES[kind])  # noqa: E731
    model.enable_cache(config())
    reference = install_probe(reference_dit, config())
    with torch.no_grad():
        for step in range(6):  # two runs of 3 steps (MagCache starts again after its 3)
            with model.cache_context("cond", step_index=step % 3), reference_dit.cache_context("cond", step_index=step % 3):
                out = model(**inputs, return_dict=False)[0]
                ref = reference_dit(**inputs, return_dict=False)[0]
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            if step == 2:
                after_one_run = len(tt_stand_ins.compiles)
    assert model.cache_stats.decisions == reference.stats.decisions
    assert model.cache_stats.skipped() > 0
    compiled = [key[2] for key in backend._compiled[id(dit)][1]]
    # FirstBlockCache: its head twice (the first forward of a context has no statistic to compute)
    assert set(compiled) == programs and len(compiled) == len(programs) + (kind == "fbc")
    assert len(tt_stand_ins.compiles) == backend.compiles == len(compiled)  # once each
    if kind in ("fbc", "mag"):  # every pattern of a block cache shows in one run: the second compiles nothing
        assert after_one_run == len(compiled)
    assert all(model_ is not dit and name == "tt" and kw == {"dynamic": False}
               for model_, name, kw in tt_stand_ins.compiles)
    assert seen == [WAN_TEST_OPTIONS] * len(compiled) and tt_stand_ins.options == [WAN_TEST_OPTIONS]
    from wan_sharding.caching.model import model_cache_probe

    timing = model_cache_probe(dit).programs.timing
    assert timing.forwards == 6 and timing.program_calls == 6 * per_forward
    backend.release(dit)  # forgotten with the model's compiled forwards
    with torch.no_grad(), model.cache_context("cond", step_index=0):
        model(**inputs, return_dict=False)
    assert len(tt_stand_ins.compiles) > len(compiled)
    model.disable_cache()
    sp.remove()


def test_a_placement_the_pins_cannot_fix_is_refused_before_compiling(tt_stand_ins, monkeypatch):
    """A TP-split norm's weight placed whole: with the pins, tt-mlir's distributed_rms_norm would
    get a whole weight beside a local input and fail (tt-mlir 0.1.3, checked by hand: "weight
    tensor's last dimension must match input's last dimension"). The backend refuses it in one line
    before anything is compiled or sent, and places no pins; placed as shard_dit_specs places it,
    the same model compiles and carries the pins, per instance (another model has none)."""
    from wan_sharding import BackendError, shard_dit_specs
    from wan_sharding.backends.tt_norms import tp_split_norms
    from wan_sharding.backends.xla import XlaBackend

    monkeypatch.setattr(XlaBackend, "place", lambda self, dit, specs: None)  # no device to put weights on
    backend = _tt_backend()
    dit, other = build_dit("t2v-a14b"), build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    specs = dict(shard_dit_specs(dit, backend.mesh))
    norm_q = dit.blocks[0].attn1.norm_q.weight
    assert specs[norm_q] == ("tp",)
    backend.place(dit, {**specs, norm_q: (None,)})
    with pytest.raises(BackendError, match=r"blocks\.0\.attn1\.norm_q\.weight is placed \(None,\) on TP mesh 2x4.*"
                                           "place it split over 'tp'") as err, torch.no_grad():
        backend.run(dit, None, **inputs)
    assert "\n" not in str(err.value)
    assert tt_stand_ins.compiles == [] and tt_stand_ins.options == []
    hooks = lambda model: sum(len(m._forward_pre_hooks) + len(m._forward_hooks)  # noqa: E731
                              for m in tp_split_norms(model).values())
    assert hooks(dit) == 0
    backend.place(dit, shard_dit_specs(dit, backend.mesh))
    with torch.no_grad():
        backend.run(dit, None, **inputs)
    assert len(tt_stand_ins.compiles) == 1 and hooks(dit) == 16 and hooks(other) == 0
    backend.release(dit)
    assert hooks(dit) == 0
    with torch.no_grad():
        backend.run(dit, None, **inputs)  # compiled again, pinned again
    backend.place(dit, {**specs, norm_q: (None,)})  # a new placement is checked again before its compile
    with pytest.raises(BackendError, match="norm_q"), torch.no_grad():
        backend.run(dit, None, **inputs)
    assert hooks(dit) == 0


# ---------------------------------------------------------------------------- the plugin's option keys

# Every key tt-xla's PJRT plugin reads (tt-xla main 2026-08-21, pjrt_implementation/src/api/
# compile_options.cc, CompileOptions::parse), copied from that source by hand: the plugin ignores
# any other key without a word.
PLUGIN_KEYS = {
    "optimization_level", "experimental_weight_dtype", "experimental-kv-cache-dtype",
    "enable_activation_dtype_lowering", "math_fidelity", "fp32_dest_acc_en",
    "experimental_enable_fusing_conv2d_with_multiply_pattern", "backend", "export_path", "enable_trace",
    "export_tensors", "enable_const_eval", "enable_const_eval_on_cpu", "enable_const_eval_inputs_to_system_memory",
    "experimental_enable_permute_matmul_fusion", "codegen_try_recover_structure", "codegen_split_files",
    "experimental-enable-dram-space-saving-optimization", "enable_create_d2m_subgraphs", "ttnn_perf_metrics_enabled",
    "ttnn_perf_metrics_output_file", "dry_run", "target_module", "export_model_name",
}


def test_every_option_sent_is_a_key_the_plugin_reads():
    assert set(tt_module.PLUGIN_OPTIONS) == PLUGIN_KEYS  # the backend's table is the plugin's list
    every = TTCompileOptions(0, False, False, extra={"math_fidelity": "HiFi4", "fp32_dest_acc_en": "on",
                                                     "experimental-kv-cache-dtype": "bfp_bf8", "export_path": "irs"})
    assert set(TTCompileOptions().to_torch_xla()) <= PLUGIN_KEYS
    assert every.to_torch_xla() == {"optimization_level": "0", "experimental-enable-dram-space-saving-optimization": "false",
                                    "enable_trace": "false", "math_fidelity": "hifi4", "fp32_dest_acc_en": "true",
                                    "experimental-kv-cache-dtype": "bfp_bf8", "export_path": "irs"}
    # the plugin's own key for a field sets that field
    assert TTCompileOptions.of({"experimental-enable-dram-space-saving-optimization": False}) == TTCompileOptions(1, False)


@pytest.mark.parametrize("options, match", [
    ({"optimization_level": 3}, "optimization_level must be 0, 1 or 2, got 3"),
    ({"optimization_level": "2"}, "optimization_level must be 0, 1 or 2"),
    ({"enable_trace": "maybe"}, "'enable_trace' must be True or False, got 'maybe'"),
    ({"fp32_dest_acc_en": "maybe"}, "'fp32_dest_acc_en' must be true or false, got 'maybe'"),
    ({"math_fidelity": "hifi5"}, "'math_fidelity' must be one of 'lofi', 'hifi2', 'hifi3', 'hifi4', 'ttnn_default'"),
    ({"backend": "codegen_py"}, "needs export_path"),
    ({"export_path": 7}, "'export_path' must be a string"),
    ({"experimental_kv_cache_dtype": "bf16"}, "unknown tt compile option .*plugin spells it 'experimental-kv-cache-dtype'"),
    ({"enable_tracing": True}, "unknown tt compile option 'enable_tracing'.*would ignore it"),
])
def test_a_bad_option_is_one_line_before_anything_is_sent(tt_stand_ins, options, match):
    from wan_sharding.backends.tt import TTOptionsError

    with pytest.raises(TTOptionsError, match=match) as err:
        _tt_backend(compile_options=options)
    assert "\n" not in str(err.value)
    assert tt_stand_ins.options == [] and tt_stand_ins.compiles == []


def test_a_bad_options_variable_stops_the_worker_before_it_starts(tt_stand_ins, monkeypatch):
    from wan_sharding.backends.tt import TTOptionsError

    monkeypatch.setenv(COMPILE_OPTIONS_ENV, '{"optimization_level": 1, "enable_trace": "sometimes"}')
    with pytest.raises(TTOptionsError, match="'enable_trace' must be True or False"):
        TTBackend.worker_env(8)
    monkeypatch.setenv(COMPILE_OPTIONS_ENV, "optimization_level=1")
    with pytest.raises(TTOptionsError, match="not a JSON object"):
        TTBackend.worker_env(8)


# ---------------------------------------------------------------------------- real dynamo, counted graphs

# variant:dtype:padding[:patches]; 105 tokens padded to 128 on the 2x4 mesh
GRAPH_CASES = ["t2v-a14b:fp32:mask", "t2v-a14b:fp32:slice", "t2v-a14b:bf16:mask", "t2v-a14b:bf16:slice",
               "t2v-a14b:fp32:mask:patchify+rope+qkv+rope_tables", "t2v-a14b:bf16:slice:patchify+rope+qkv+rope_tables",
               "i2v-a14b:fp32:mask", "ti2v-5b:bf16:mask"]
MODELS = 10  # more than dynamo's recompile limit (8)


def run_standin(script: str, args: list[str], devices: int) -> dict:
    """``python tests/<script> ARGS...`` in a torch-xla CPU process of ``devices`` devices (the
    stand-ins' process); the JSON object it prints after ``RESULT``."""
    import json
    import subprocess
    from pathlib import Path

    from wan_sharding.runtime import scratch
    from wan_sharding.jobs.launch import worker_env

    tmp = scratch.worker_tmpdir()  # as the worker runner gives a worker: dynamo's caches go with it
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *args],
                              env={**worker_env("xla", devices), "TMPDIR": str(tmp)}, capture_output=True, text=True,
                              timeout=1200)
    finally:
        scratch.remove(tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def _tt_graphs(preset: str, devices: int, parts: str, models: int = 0, cases: tuple[str, ...] = ()) -> dict:
    return run_standin("tt_graphs.py", [preset, parts, str(models), *cases], devices)


@pytest.fixture(scope="module")
def dynamo_runs():
    """torch-xla CPU processes (``tt_graphs.py``), two at a time (each is mostly one core's work):
    on the 2x4 mesh every GRAPH_CASE compiled by real dynamo with a graph-counting backend and a
    tt-style constraint op standing in for tt_torch (which cannot be installed here; see that file),
    the prompt states, then MODELS models one after another (it ends at a recompile limit of 1); the caches' forwards apart; the 1x4 mesh
    (TP only), one case, in a 4-device process."""
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {"2x4": pool.submit(_tt_graphs, "2x4", 8, "cases,prompt,models", MODELS, tuple(GRAPH_CASES)),
               "2x4-cached": pool.submit(_tt_graphs, "2x4", 8, "cached"),
               "1x4": pool.submit(_tt_graphs, "1x4", 4, "cases", 0, (GRAPH_CASES[0],))}
    yield futures
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def dynamo_run(dynamo_runs):
    """What the 2x4 processes found: ``cases``, ``models``, ``prompt`` and ``cached``."""
    return {**dynamo_runs["2x4"].result(), **dynamo_runs["2x4-cached"].result()}


@pytest.fixture(scope="module")
def dynamo_run_1x4(dynamo_runs):
    """The same on the 1x4 mesh: ``cases`` for the first GRAPH_CASE."""
    return dynamo_runs["1x4"].result()


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_one_graph_per_compiled_forward_holding_every_sp_constraint(dynamo_run, case):
    """Real ``torch.compile`` of the sharded tiny DiT on the tt path: one graph, and in it every
    constraint the hooks make in an eager forward, in order. A split graph (an untraceable call in
    a hook) shows as more graphs and constraints missing from them."""
    r = dynamo_run["cases"][case]
    assert r["breaks"] == {}, r["breaks"]
    assert len(r["graphs"]) == 1, [len(g) for g in r["graphs"]]  # and none more for the warm call
    [graph] = r["graphs"]
    assert graph == r["eager"]
    # the plan, counted apart: rope cos + sin, block entry (replicated anchor, then L on SP each),
    # the key mask (mask mode: L is padded), the exit gather
    rep4, sp4 = sdy_string(("sp", "tp"), (None,) * 4), sdy_string(("sp", "tp"), (None, "sp", None, None))
    rep3, sp3 = sdy_string(("sp", "tp"), (None,) * 3), sdy_string(("sp", "tp"), (None, "sp", None))
    mask = [rep4] if case.split(":")[2] == "mask" else []
    assert graph == [rep4, sp4, rep4, sp4, *mask, rep3, sp3, rep3]


def _pins(tokens_split: bool) -> list[list[str]]:
    """The pins of one tiny block (2 blocks in the tiny config) in graph order: attn1 norm_q and
    norm_k and attn2 norm_q on the video tokens (split over SP when SP > 1), attn2 norm_k on the
    prompt (whole): the input whole on the channels, the result whole, then split over TP again."""
    axes = ("sp", "tp")
    lead = ("sp" if tokens_split else None)
    video = [sdy_string(axes, (None, lead, None))] * 2 + [sdy_string(axes, (None, lead, "tp"))]
    prompt = [sdy_string(axes, (None, None, None))] * 2 + [sdy_string(axes, (None, None, "tp"))]
    return [video, video, video, prompt]


@pytest.mark.parametrize("mesh", ["1x4", "2x4"])
def test_rms_norm_pins_in_the_one_graph_and_gone_after_release(request, mesh):
    """On a TP mesh the backend pins every ``nn.RMSNorm`` (tt-xla marks it ``tenstorrent.rms_norm``;
    unpinned, tt-mlir rejects it, docs/tt-backend.md) inside the one dynamo graph of a forward:
    8 norms, each fed by its input pin and followed by its two result pins; the output (fetched
    for this case only: each fetch compiles and runs the SPMD program) as the unsharded model's. After ``release`` no hook is left on the norms and a graph compiled
    afresh holds the 8 norms and no pin."""
    run = request.getfixturevalue("dynamo_run_1x4" if mesh == "1x4" else "dynamo_run")
    r = run["cases"][GRAPH_CASES[0]]
    assert r["breaks"] == {} and len(r["graphs"]) == 1
    assert r["norms"] == [8]
    assert r["pins"] == [_pins(tokens_split=mesh == "2x4") * 2]
    assert r["max_abs"] <= 1e-4, r["max_abs"]
    assert r["hooks_after_release"] == 0
    assert r["after_release"] == {"pins": [[]], "norms": [8]}
    if mesh == "2x4":  # every case of the 2x4 run: all 8 norms pinned in its one graph
        for case, c in run["cases"].items():
            assert c["norms"] == [8] and len(c["pins"][0]) == 8, case


def test_many_models_in_one_process_stay_compiled(dynamo_run):
    """More models than dynamo's recompile limit, one backend, one process (after the GRAPH_CASES'
    8 models, each released: a released model's entry must not count against the next ones): each
    compiles once (one graph) and warm calls compile nothing; ``release`` drops dynamo's entry for
    that model (it compiles afresh); one model past the limit is an error, not a silent uncompiled
    forward."""
    r = dynamo_run["models"]
    assert r["per_model"] == [1] * MODELS
    assert r["warm"] == 0
    assert r["dropped"] == 1 and r["after_release"] == 1
    assert r["compiles"] == MODELS + 2  # the released model again, and the one past the limit
    assert r["over_limit"].startswith("BackendError: dynamo's recompile_limit (1) is reached for this model")
    assert r["options"] == [WAN_TEST_OPTIONS]  # sent once, for every model


@pytest.mark.parametrize("backend, kind", [("tt", k) for k in CACHED_PROGRAMS] + [("xla", "fbc"), ("xla", "mag")])
def test_a_cached_forward_is_one_graph_per_program(dynamo_run, backend, kind):
    """Each cache kind's forwards under real dynamo, in the same process: on ``tt`` with the stand-in
    backend, on ``xla`` (the block caches: the programs it compiles through dynamo) with
    torch-xla's own ``openxla`` backend. Each program is one graph (no
    graph break: a break would split a program into several graphs and, on tt, lose trace replay),
    compiled once (as many graphs as programs, with dynamo's recompile limit at 1: each program is
    a code object of its own; for the block caches, all after three forwards). The decisions and outputs
    are the unsharded model's with the same cache. Enabled again, the cache gets new hooks and its
    programs are compiled afresh for them, deciding as before."""
    r = dynamo_run["cached"][f"{backend}-{kind}"]
    assert r["breaks"] == {}, r["breaks"]
    # FirstBlockCache's head twice: the first forward of a context has no statistic to compute
    programs = sorted(CACHED_PROGRAMS[kind][0]) + (["head"] if kind == "fbc" else [])
    assert r["programs"] == sorted(programs)
    assert r["graphs"][0] == len(programs)
    if kind in ("fbc", "mag"):  # the first three forwards reach all of them; the fourth adds nothing
        assert r["graphs_after_first_run"] == len(programs)
    assert r["decisions_match"] and r["skipped"] > 0
    assert r["max_abs"] <= 1e-5, r["max_abs"]
    if kind == "fbc":
        assert r["programs_again"] == sorted(programs) and r["graphs"][1] == len(programs)  # 2 forwards: all four again
        assert r["decisions_match_again"]


def test_prompt_kv_keeps_one_graph_for_every_prompt(dynamo_run):
    """The ``prompt_kv`` patch on the tt path (rope and qkv too, mask padding), through a pipeline's
    stand-in: four forwards over three prompts (the first again after the second, as the guidance
    branches alternate) compile one graph (the prompt state is the step's input, the prompt
    programs run lazily outside dynamo: 3 made, 1 reused), with every SP constraint and only the
    pins the step still needs (no cross-attention norm_k: it runs once per prompt), and each output
    is the unsharded model's for its prompt."""
    r = dynamo_run["prompt"]["forwards"]
    assert r["breaks"] == {} and len(r["graphs"]) == 1 and r["compiles"] == 1, r
    rep4, sp4 = sdy_string(("sp", "tp"), (None,) * 4), sdy_string(("sp", "tp"), (None, "sp", None, None))
    rep3, sp3 = sdy_string(("sp", "tp"), (None,) * 3), sdy_string(("sp", "tp"), (None, "sp", None))
    assert r["graphs"] == [[rep4, sp4, rep4, sp4, rep4, rep3, sp3, rep3]]  # rope, block entry, mask, exit
    assert (r["computed"], r["reused"]) == (3, 1)
    assert r["norms"] == [6] and r["pins"] == [_pins(tokens_split=True)[:3] * 2]
    assert r["max_abs"] <= 1e-5, r["max_abs"]


@pytest.mark.parametrize("backend", ["tt", "xla"])
def test_prompt_kv_under_a_step_cache_decides_and_computes_as_before(dynamo_run, backend):
    """FirstBlockCache with ``prompt_kv``, two steps of the two guidance branches: the same decisions
    and outputs as the unsharded model with the same cache, each prompt's state made once. On
    ``tt`` each of FirstBlockCache's programs is one graph; on ``xla`` the programs of a forward
    given a prompt state run lazily (traced at each call): replayed through torch-xla's dynamo
    bridge, its ``head`` program read the first prompt's K / V for the second prompt."""
    r = dynamo_run["prompt"][f"{backend}-fbc"]
    assert r["breaks"] == {} and r["decisions_match"] and r["skipped"] > 0, r
    assert (r["computed"], r["reused"]) == (2, 2)
    assert r["max_abs"] <= 1e-5, r["max_abs"]
    if backend == "tt":
        assert len(r["graphs"]) == len(CACHED_PROGRAMS["fbc"][0]) + 1  # the head twice: with and without the statistic


# ---------------------------------------------------------------------------- inference only

def test_profile_runs_the_tt_forward_without_autograd(tt_stand_ins, monkeypatch):
    """``profile``'s worker job on the tt path (stand-ins as above, plus a fake torch-xla runtime
    and SPMD module with 8 "devices"): every compiled forward runs with grad off, and its output
    carries no autograd graph (with grad on, tt's torch.compile would trace a backward too)."""
    from wan_sharding.jobs import profile

    runtime = types.ModuleType("torch_xla.runtime")
    runtime.set_device_type, runtime.is_spmd, runtime.use_spmd = (lambda kind: None), (lambda: True), (lambda: None)
    runtime.global_runtime_device_count = lambda: 8
    spmd = types.ModuleType("torch_xla.distributed.spmd")
    spmd.Mesh = lambda ids, shape, names: SimpleNamespace(mesh_shape=shape, axis_names=names)
    spmd.mark_sharding = lambda tensor, mesh, spec: None
    distributed = types.ModuleType("torch_xla.distributed")
    distributed.spmd = spmd
    for name, module in (("runtime", runtime), ("distributed", distributed), ("distributed.spmd", spmd)):
        monkeypatch.setitem(sys.modules, f"torch_xla.{name}", module)
    monkeypatch.setattr(sys.modules["torch_xla"], "runtime", runtime, raising=False)
    monkeypatch.setattr(sys.modules["torch_xla"], "distributed", distributed, raising=False)
    monkeypatch.setenv("CONVERT_SHLO_TO_SHARDY", "1")  # what start_tt_runtime sets, restored after

    seen = []

    def compile_stand_in(model, *, backend=None, **kwargs):
        def run(*args, **kw):
            out = model(*args, **kw)
            seen.append((torch.is_grad_enabled(), out[0].requires_grad, out[0].grad_fn is None))
            return out
        return run

    monkeypatch.setattr(torch, "compile", compile_stand_in)
    params = {"backend": "tt", "mesh": "2x4", "what": ["dit", "step"], "variant": "t2v-a14b", "warmup": 1,
              "iters": 1, "padding": "mask", "resolution": "tiny", "latent": None, "dtype": "fp32"}
    results = profile._job(params)
    assert [r["what"] for r in results] == ["dit", "step"]
    assert len(seen) == 2 + 4  # dit: 2 forwards; step: 2 steps of cond + uncond
    assert set(seen) == {(False, False, True)}
    assert torch.is_grad_enabled()  # the job leaves the caller's grad mode as it was


# ---------------------------------------------------------------------------- the first-run report

def test_first_run_report_is_one_whole_json_file(tmp_path, monkeypatch):
    """What ``pytest -m tt`` writes (tests/test_tt_hardware.py fills it on the chips): the stack's
    versions from the package metadata, the chips, the sections, the outcomes; written in one step,
    so a write that fails leaves no file behind."""
    import json
    from importlib.metadata import version

    from wan_sharding.jobs import first_run

    report = first_run.FirstRunReport("2x4", {"devices": 8})
    report.add("pcc_fp32", [{"case": "t2v-a14b:padded:fp32:mask", "pcc": 0.998, "threshold": 0.99, "ok": True}])
    report.outcome("pcc_matrix[fp32]", True)
    report.outcome("warm_profile[bf16]", False, "dynamo_graphs 3 != 1")
    monkeypatch.setenv(first_run.REPORT_ENV, str(tmp_path / "out" / "first-run.json"))
    path = report.write(first_run.default_path("2x4"))
    data = json.loads(path.read_text())
    assert data["stack"]["torch"] == version("torch") and data["stack"]["pjrt-plugin-tt"] is None
    assert data["mesh"] == "2x4" and data["chips"] == {"devices": 8} and data["pcc_fp32"][0]["ok"]
    assert data["outcomes"] == {"pcc_matrix[fp32]": "passed", "warm_profile[bf16]": "failed: dynamo_graphs 3 != 1"}
    monkeypatch.setattr(first_run.json, "dumps", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        report.write(tmp_path / "interrupted.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing half-written, no temporary left
    monkeypatch.delenv(first_run.REPORT_ENV)
    assert first_run.default_path("8x4").name == "tt-first-run-8x4.json"


@pytest.fixture
def spmd_marks(tt_stand_ins, monkeypatch):
    """``torch_xla.distributed.spmd.mark_sharding`` recorded (shape, spec) on the fake torch_xla."""
    marks = []
    spmd = types.ModuleType("torch_xla.distributed.spmd")
    spmd.mark_sharding = lambda tensor, mesh, spec: marks.append((tuple(tensor.shape), tuple(spec)))
    distributed = types.ModuleType("torch_xla.distributed")
    distributed.spmd = spmd
    monkeypatch.setattr(sys.modules["torch_xla"], "distributed", distributed, raising=False)
    monkeypatch.setattr(sys.modules["torch_xla"], "sync", lambda: None, raising=False)
    monkeypatch.setitem(sys.modules, "torch_xla.distributed", distributed)
    monkeypatch.setitem(sys.modules, "torch_xla.distributed.spmd", spmd)
    return marks


def test_tt_backend_marks_lora_weights_beside_their_base_and_runs_the_adapters(tt_stand_ins, spmd_marks):
    """LoRA on tt (stand-ins, above; ``torch_xla.distributed.spmd.mark_sharding`` recorded too):
    every parameter is marked with its spec, the LoRA weights beside their base's; the forward adds
    the adapters with their live weights; ``place_lora`` marks the LoRA weights only, base untouched."""
    from wan_sharding.lora.tiny import adapter_state
    from wan_sharding.lora_layers import lora_parameters
    from wan_sharding.dit.specs import shard_dit_specs

    marks = spmd_marks
    dit = build_dit("t2v-a14b")
    dit.load_lora_adapter(adapter_state(dit, rank=4, bias=True), adapter_name="a")
    specs = shard_dit_specs(dit, "2x4")
    backend = _tt_backend()
    backend.place(dit, specs)
    by_name = specs.by_name()
    assert marks == [(tuple(p.shape), by_name[n]) for n, p in dit.named_parameters()]
    assert by_name["blocks.0.attn1.to_q.lora_B.a.weight"] == ("tp", None)
    assert by_name["blocks.0.ffn.net.2.lora_A.a.weight"] == (None, "tp")
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    with torch.no_grad():
        base = backend.run(dit, None, **inputs)
        for weight in (0.3, 1.7):
            dit.set_adapters(["a"], [weight])
            torch.testing.assert_close(backend.run(dit, None, **inputs), dit(**inputs, return_dict=False)[0])
        assert (backend.run(dit, None, **inputs) - base).abs().max() > 1e-3  # the adapter's weight reached it
    assert len(tt_stand_ins.compiles) == 1
    marks.clear()
    lora = lora_parameters(dit)
    backend.place_lora(dit, None, {n: by_name[n] for n in lora})
    assert marks == [(tuple(p.shape), by_name[n]) for n, p in lora.items()]
    assert backend._placed_specs[dit] == by_name


def _fp32_grade(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    pcc = torch.corrcoef(torch.stack([out.flatten().double(), ref.flatten().double()]))[0, 1].item()
    return pcc, (out - ref).abs().max().item()


@pytest.fixture
def real_dynamo_tt(tt_stand_ins, monkeypatch):
    """REAL dynamo for ``torch.compile(backend="tt")``: torch's own ``torch.compile``, a
    graph-counting ``"tt"`` dynamo backend standing in for tt_torch's (which cannot be installed
    here; it runs each graph as it is), ``inline_inbuilt_nn_modules=False`` as tt-xla's plugin sets
    it, and the pins' constraints passed through without the recorder's list (dynamo would guard on
    its length). Yields the graphs, each as ``scales`` (its 0-dim tensor inputs) and ``weights``
    (the shapes of the graph's own parameters, what tt-xla marks ``parameter``)."""
    from torch._dynamo.backends import registry

    graphs = []

    def counting_tt(gm, example_inputs):
        graphs.append(SimpleNamespace(scales=sum(isinstance(t, torch.Tensor) and t.ndim == 0 for t in example_inputs),
                                      weights=[tuple(p.shape) for p in gm.parameters()]))
        return gm.forward

    monkeypatch.setattr(torch, "compile", REAL_COMPILE)
    monkeypatch.setitem(registry._COMPILER_FNS, "tt", counting_tt)  # this test only: both registry tables
    monkeypatch.setitem(registry._BACKENDS, "tt", None)
    monkeypatch.setattr(sys.modules["tt_torch.sharding"], "sharding_constraint_tensor", lambda t, *a, **k: t)
    with torch._dynamo.config.patch(inline_inbuilt_nn_modules=False):
        yield graphs
    torch._dynamo.reset()


def test_tt_lora_switches_reuse_the_compiled_graph(real_dynamo_tt, spmd_marks):
    """Switching adapters on tt under REAL dynamo (``real_dynamo_tt``). The adapters' scales reach
    the graph as its inputs (0-dim float32 placeholders, one per LoRA layer and active adapter), not as guarded Python floats nor as weights of the graph, so a
    new ``set_adapters`` weight, ``disable_lora`` (scale 0), ``enable_lora`` and a hotswap of an
    adapter with the same rank and targets make no new graph; another set of adapters makes one.
    After every switch the output is the unsharded model's with the same adapters (a copy switched
    alike), at the fp32 grade."""
    import copy

    from wan_sharding.dit.specs import shard_dit_specs
    from wan_sharding.lora.tiny import adapter_state
    from wan_sharding.lora_layers import lora_modules, lora_parameters

    dit = build_dit("t2v-a14b")
    dit.load_lora_adapter(adapter_state(dit, rank=4, bias=True), adapter_name="a")
    ref = copy.deepcopy(dit)  # the unsharded model, switched alike
    specs = shard_dit_specs(dit, "2x4")
    backend = _tt_backend()
    backend.place(dit, specs)
    by_name = specs.by_name()
    weights_before = {n: id(p) for n, p in dit.named_parameters()}
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    graphs, new_graphs = real_dynamo_tt, {}

    def switch(name, change):
        before = len(graphs)
        for model in (dit, ref):
            change(model)
        with torch.no_grad():
            out, want = backend.run(dit, None, **inputs), ref(**inputs, return_dict=False)[0]
        pcc, max_abs = _fp32_grade(out, want)
        assert pcc >= 0.99999 and max_abs <= 1e-4, (name, pcc, max_abs)
        new_graphs[name] = len(graphs) - before
        return out

    first = switch("first forward", lambda m: None)
    switch("set_adapters weight 0.3", lambda m: m.set_adapters(["a"], [0.3]))
    switch("set_adapters weight 1.7", lambda m: m.set_adapters(["a"], [1.7]))
    off = switch("disable_lora", lambda m: m.disable_lora())
    with torch.no_grad():
        assert (off - first).abs().max() > 1e-3  # the adapter's terms are really off
    switch("enable_lora", lambda m: m.enable_lora())
    swapped = adapter_state(dit, rank=4, bias=True, seed=1)

    def hotswap(model):
        model.load_lora_adapter(swapped, adapter_name="a", hotswap=True)
        if model is dit:  # as the sharded pipeline does after a load (pipeline/lora.py)
            marks = len(spmd_marks)
            backend.place_lora(dit, None, {n: by_name[n] for n in lora_parameters(dit)})
            assert len(spmd_marks) - marks == len(lora_parameters(dit))  # the LoRA weights re-marked only

    switch("hotswap, same rank and targets", hotswap)
    kept = {n: id(p) for n, p in dit.named_parameters()} == weights_before  # the very parameters, new values
    second = adapter_state(dit, rank=2, seed=2, blocks_only=True)

    def add_second(model):
        model.load_lora_adapter(second, adapter_name="b")
        model.set_adapters(["a", "b"], [0.5, 1.2])
        if model is dit:
            lora = lora_parameters(dit)
            backend.place_lora(dit, None, {n: shard_dit_specs(dit, "2x4").by_name()[n] for n in lora})

    switch("a second adapter, both active", add_second)
    switch("set_adapters weights of both", lambda m: m.set_adapters(["a", "b"], [1.0, 0.25]))
    layers = lora_modules(dit)
    assert new_graphs == {"first forward": 1, "set_adapters weight 0.3": 0, "set_adapters weight 1.7": 0,
                          "disable_lora": 0, "enable_lora": 0, "hotswap, same rank and targets": 0,
                          "a second adapter, both active": 1, "set_adapters weights of both": 0}, new_graphs
    assert kept
    # the scales are inputs of each graph; none of the graph's own weights (tt's parameters) is a scale
    assert [g.scales for g in graphs] == [len(layers), len(layers) + sum("b" in m.lora_A for m in layers.values())]
    assert all(len(shape) > 0 for g in graphs for shape in g.weights)
    assert all(isinstance(m.scaling[a], float) for m in layers.values() for a in m.scaling)  # PEFT's own, as it was

