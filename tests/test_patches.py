"""The opt-in model rewrites (``wan_sharding.patches``): exact, reversible, per instance, and composable
with the TP specs and the SP hooks.

In-process sharded runs use JAX on this process's 8 CPU devices (conftest.py); the torch-xla run
and the 32-device 8x4 mesh run in worker processes (``wan_sharding.jobs.patch_check``).
"""

import types

import pytest
import torch

from wan_sharding import (WAN_TP_TABLE, ShardingError, ShardingPlan, apply_dit_sp_activation_sharding,
                          shard_dit_specs)
from wan_sharding.jobs.pcc import pcc
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import PER_TOKEN_TIMESTEPS, LatentShape, build_dit, dit_inputs, guidance_pair
from wan_sharding.patches import EXACT_PATCHES, PATCHES, PatchError, applied_patches, apply_patches
from wan_sharding.jobs.patch_check import sharpen
from wan_sharding.patches.processor import PatchedAttnProcessor
from wan_sharding.patches.rope import half_rope_forward

from jaxprs import equations

ALIGNED, PADDED = LatentShape(1, 32, 32), LatentShape(3, 10, 14)  # 256 tokens; 105 -> 128 on SP 2
EXACT = 1e-5  # fp32 max-abs against the vanilla unsharded model
ALL = list(PATCHES)
# Self-attention q/k RMSNorm weights scaled by this: with the tiny models' default weights attention
# is nearly uniform and its adaLN gates small, so RoPE moves the output by only ~5e-5; sharper, a
# wrong rotary layout moves it by ~1e-3, far outside the 1e-5 bound (test_layout_mismatches...).
SHARPEN = 4.0


def _sharp_dit(variant, **kwargs):
    return sharpen(build_dit(variant, **kwargs), SHARPEN)


def _eager(dit, inputs):
    with torch.no_grad():
        return dit(**inputs, return_dict=False)[0]


def _eager_attn(dit, inputs, attn="attn1"):
    """The output and every block's self-attention (or ``attn``) output: the tiny models' small adaLN
    gates let attention move the output by only ~1e-4, so exactness is also checked where it is
    computed."""
    outs = []
    hooks = [getattr(b, attn).register_forward_hook(lambda mod, args, out: outs.append(out)) for b in dit.blocks]
    try:
        return _eager(dit, inputs), torch.stack(outs)
    finally:
        for h in hooks:
            h.remove()


def _state(dit):
    """Everything a patch may change, by identity: modules and where they sit, instance forwards,
    parameters, processors, hooks."""
    modules = [(n, id(m), type(m).__name__, id(m.__dict__.get("forward"))) for n, m in dit.named_modules()]
    params = [(n, id(p), tuple(p.shape), p.dtype) for n, p in dit.named_parameters()]
    buffers = [(n, id(b), tuple(b.shape)) for n, b in dit.named_buffers()]
    procs = [(n, id(m.processor)) for n, m in dit.named_modules() if hasattr(m, "set_processor")]
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in dit.modules())
    return modules, params, buffers, procs, hooks


def _jax_backend(mesh):
    import jax

    from wan_sharding.backends.jax import JaxBackend

    spec = mesh_from_preset(mesh)
    return JaxBackend(spec, devices=jax.devices()[: spec.num_devices])  # 1x4: the first 4 of 8


def _sharded(dit, inputs, mesh, padding, names, sp_first=False):
    """Patches, then specs + SP (or SP first, for the patches that allow it); the sharded output."""
    backend = _jax_backend(mesh)
    if sp_first:
        sp = apply_dit_sp_activation_sharding(dit, mesh, backend=backend, padding=padding)
        patches = apply_patches(dit, names, mesh=mesh)
    else:
        patches = apply_patches(dit, names, mesh=mesh)
        sp = apply_dit_sp_activation_sharding(dit, mesh, backend=backend, padding=padding)
    placed = backend.place(dit, shard_dit_specs(dit, mesh))
    out = backend.run(dit, placed, **inputs)
    return out, backend, placed, sp, patches


# ---- exact, unsharded ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["t2v-a14b", "ti2v-5b"])
@pytest.mark.parametrize("names", [[n] for n in EXACT_PATCHES] + [list(EXACT_PATCHES)], ids="+".join)
def test_exact_patches_match_vanilla_and_remove_restores_it(variant, names):
    dit = _sharp_dit(variant)
    if variant in PER_TOKEN_TIMESTEPS and "adaln_norm" in names:  # per-token modulation: not for this model
        if len(names) == 1:
            with pytest.raises(PatchError, match="TI2V-5B modulates per token"):
                apply_patches(dit, names, mesh="2x4")
            return
        names = [n for n in names if n != "adaln_norm"]  # every exact patch: those that suit the model
    for latent in (ALIGNED, PADDED):
        inputs = dit_inputs(variant, latent)
        (ref, ref_attn), before = _eager_attn(dit, inputs), _state(dit)
        with apply_patches(dit, list(EXACT_PATCHES) if len(names) > 1 else names, mesh="2x4") as handle:
            assert handle.exact and applied_patches(dit) == tuple(names)
            out, attn = _eager_attn(dit, inputs)
            assert (out - ref).abs().max() <= EXACT, (latent, float((out - ref).abs().max()))
            assert (attn - ref_attn).abs().max() <= EXACT, (latent, float((attn - ref_attn).abs().max()))
        assert _state(dit) == before and applied_patches(dit) == ()
        assert torch.equal(_eager(dit, inputs), ref)


def test_remove_gives_the_same_objects_and_bit_identical_output():
    dit = _sharp_dit("ti2v-5b")
    inputs = dit_inputs("ti2v-5b", PADDED)
    ref, before = _eager(dit, inputs), _state(dit)
    conv, attn1 = dit.patch_embedding, dit.blocks[0].attn1
    to_q, proc = attn1.to_q, attn1.processor
    handle = apply_patches(dit, ALL, mesh="2x4")
    assert not isinstance(dit.patch_embedding, torch.nn.Conv3d) and not hasattr(attn1, "to_q")
    assert isinstance(attn1.processor, PatchedAttnProcessor) and "forward" in dit.rope.__dict__
    assert (_eager(dit, inputs) - ref).abs().max() <= EXACT  # adaln_bf16 is bit-identical in fp32
    handle.remove()
    assert dit.patch_embedding is conv and attn1.to_q is to_q and attn1.processor is proc
    assert _state(dit) == before
    assert torch.equal(_eager(dit, inputs), ref)
    handle.remove()  # idempotent
    apply_patches(dit, ALL, mesh="2x4").remove()  # and applicable again


def test_layout_mismatches_would_be_caught():
    """Negative controls: the permuted weights with diffusers' interleaved tables, or the fused rows
    unpacked for another TP degree, are far outside the 1e-5 bound (measured: 1.0e-3 / 7.7e-3 at the
    model output, 0.053 / 0.24 at the self-attention outputs; the exact patch 3e-7)."""
    dit = _sharp_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    ref, ref_attn = _eager_attn(dit, inputs)
    with apply_patches(dit, ["rope"]):
        del dit.rope.forward  # interleaved tables again, weights still in halves
        out, attn = _eager_attn(dit, inputs)
        assert (out - ref).abs().max() > 5e-4 and (attn - ref_attn).abs().max() > 2e-2
        dit.rope.forward = types.MethodType(half_rope_forward, dit.rope)  # as the patch left it
    with apply_patches(dit, ["qkv"], mesh="2x4"):
        for block in dit.blocks:
            block.attn1.processor.qkv_groups = 2  # laid out for TP 4
        out, attn = _eager_attn(dit, inputs)
        assert (out - ref).abs().max() > 5e-4 and (attn - ref_attn).abs().max() > 2e-2
        for block in dit.blocks:
            block.attn1.processor.qkv_groups = 4
    assert torch.equal(_eager(dit, inputs), ref)


def test_rope_tables_are_cached_per_shape_on_the_instance():
    dit = _sharp_dit("t2v-a14b")
    with apply_patches(dit, ["rope", "rope_tables"]):
        cache = dit.rope.forward
        for latent in (PADDED, PADDED, ALIGNED):
            _eager(dit, dit_inputs("t2v-a14b", latent))
        assert sorted(k[0] for k in cache.host) == [(1, 32, 32), (3, 10, 14)]


# ---- sharded: patches, then shard_dit_specs + SP --------------------------------------------------


@pytest.mark.parametrize("mesh", ["1x4", "2x4"])
@pytest.mark.parametrize("padding", ["mask", "slice"])
def test_all_exact_patches_sharded_on_jax(mesh, padding):
    dit = _sharp_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    ref = _eager(dit, inputs)
    out, *_, sp, patches = _sharded(dit, inputs, mesh, padding, EXACT_PATCHES)
    sp.remove()
    patches.remove()
    assert (out - ref).abs().max() <= EXACT
    assert torch.equal(_eager(dit, inputs), ref)


@pytest.mark.parametrize("name", ["rope", "qkv"])
def test_each_processor_patch_sharded_on_jax(name):
    """Each patch that brings its own attention processor, alone on 2x4 with the slice mode, whose
    K/V cut then goes through that processor's ``attend`` (the others: all together above, and
    after SP below)."""
    dit = _sharp_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    ref = _eager(dit, inputs)
    out, *_, sp, patches = _sharded(dit, inputs, "2x4", "slice", [name])
    sp.remove()
    patches.remove()
    assert (out - ref).abs().max() <= EXACT


def test_ti2v_aligned_with_every_patch_sharded_on_jax():
    """TI2V (per-token timesteps) with every patch; adaln_bf16 is bit-identical in fp32."""
    dit = _sharp_dit("ti2v-5b")
    inputs = dit_inputs("ti2v-5b", ALIGNED)
    ref = _eager(dit, inputs)
    out, *_, sp, patches = _sharded(dit, inputs, "2x4", "mask", ALL)
    sp.remove()
    patches.remove()
    assert (out - ref).abs().max() <= EXACT


def test_patches_that_allow_it_also_compose_after_sp():
    dit = _sharp_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    ref = _eager(dit, inputs)
    late = [n for n, p in PATCHES.items() if p.after_sp]
    assert late == ["patchify", "rope_tables", "prompt_kv", "ffn_rows", "adaln_norm", "adaln_bf16"]
    out, *_, sp, patches = _sharded(dit, inputs, "2x4", "mask", late, sp_first=True)
    patches.remove()  # allowed with SP still on
    sp.remove()
    assert (out - ref).abs().max() <= EXACT
    assert torch.equal(_eager(dit, inputs), ref)


def test_the_traced_graph_loses_what_the_patches_remove():
    """No strided rotary write (scatter) or strided reads (gather), no convolution, and the rope
    buffers unread (the tables come in computed), against the vanilla trace."""
    import jax

    def trace(names):
        dit = build_dit("t2v-a14b")
        inputs = dit_inputs("t2v-a14b", PADDED)
        _, backend, placed, sp, patches = _sharded(dit, inputs, "2x4", "mask", names)
        jargs, jkwargs = backend._device_inputs((), inputs)
        closed = jax.make_jaxpr(backend.jax_forward(dit))(placed, jargs, jkwargs)
        sp.remove()
        patches.remove()
        prims = [e.primitive.name for e in equations(closed.jaxpr)]
        flat = jax.tree_util.tree_leaves((placed, jargs, jkwargs))
        rope_ids = {id(placed["rope.freqs_cos"]), id(placed["rope.freqs_sin"])}
        invars = [v for v, x in zip(closed.jaxpr.invars, flat) if id(x) in rope_ids]
        used = {id(v) for e in closed.jaxpr.eqns for v in e.invars}
        return prims, [id(v) in used for v in invars]

    prims, rope_read = trace([])
    assert {"scatter", "gather", "conv_general_dilated"} <= set(prims) and all(rope_read)
    prims, rope_read = trace(EXACT_PATCHES)
    assert not {"scatter", "gather", "conv_general_dilated"} & set(prims)
    assert len(rope_read) == 2 and not any(rope_read)


# ---- other backends and the 32-device mesh, in worker processes ---------------------------------


@pytest.mark.parametrize("backend,mesh", [("xla", "1x4"), ("xla", "2x4"), ("xla", "8x4"), ("jax", "8x4")])
def test_all_exact_patches_sharded_in_a_worker(backend, mesh):
    from wan_sharding.jobs.patch_check import run_in_subprocess

    cases = [{"variant": "t2v-a14b", "latent": [3, 10, 14], "padding": padding, "sharpen": SHARPEN}
             for padding in ("mask", "slice")]
    results = run_in_subprocess(backend, mesh, EXACT_PATCHES, cases)
    assert len(results) == len(cases)
    for r in results:
        assert r["max_abs"] <= EXACT, r
        assert r["prompt_programs"] == 2, r  # prompt_kv: the first prompt's state reused, the second's made


# ---- TP specs ------------------------------------------------------------------------------------


def test_specs_cover_every_parameter_of_a_patched_model():
    dit = build_dit("t2v-a14b", "full", device="meta", dtype=torch.bfloat16)
    vanilla = shard_dit_specs(dit, "8x4")
    vanilla_bytes = vanilla.bytes_per_device(2)
    with apply_patches(dit, ALL, mesh="8x4"):
        specs = shard_dit_specs(dit, "8x4")
        names = [n for n, _ in dit.named_parameters()]
        assert list(specs.by_name()) == names
        styles = specs.styles()
        assert styles["blocks.0.attn1.to_qkv.weight"] == styles["blocks.39.attn2.to_kv.bias"] == "colwise"
        assert specs.by_name()["blocks.0.attn1.to_qkv.weight"] == ("tp", None)
        assert not any(".attn1.to_q." in n or ".attn2.to_k." in n for n in names)
        assert specs.bytes_per_device(2) == vanilla_bytes  # fusing moves no weight between devices
        without = {k: v for k, v in WAN_TP_TABLE.items() if not k.endswith(("to_qkv", "to_kv"))}
        with pytest.raises(ShardingError, match="not covered by the TP plan .*attn1.to_qkv.weight"):
            shard_dit_specs(dit, "8x4", tp_table=without)  # the fused layers are named, never replicated silently
    assert list(shard_dit_specs(dit, "8x4").by_name()) == list(vanilla.by_name())


def test_fused_weights_split_colwise_give_every_device_whole_heads():
    """The actual rows each device holds: its own heads of q, k and v, and nothing else."""
    import numpy as np

    dit = build_dit("t2v-a14b")
    plan = ShardingPlan((2, 4))
    inner, head_dim, tp = 128, 16, plan.mesh().tp  # tiny t2v: 8 heads of 16 channels, TP 4
    rows = inner // tp
    assert rows == 2 * head_dim  # two whole heads of each of q, k, v per device
    a1, a2 = dit.blocks[1].attn1, dit.blocks[1].attn2
    expect = {"attn1.to_qkv": [m.weight.detach().clone() for m in (a1.to_q, a1.to_k, a1.to_v)],
              "attn2.to_kv": [m.weight.detach().clone() for m in (a2.to_k, a2.to_v)]}
    backend = _jax_backend("2x4")
    with apply_patches(dit, ["qkv"], mesh=plan):
        placed = backend.place(dit, shard_dit_specs(dit, plan))
        for name, parts in expect.items():
            arr = placed[f"blocks.1.{name}.weight"]
            assert arr.shape == (len(parts) * inner, 128)
            for shard in arr.addressable_shards:
                start = shard.index[0].start or 0
                assert shard.data.shape[0] == len(parts) * rows and start % (len(parts) * rows) == 0
                s = start // (len(parts) * rows)  # this device's TP rank
                want = torch.cat([p[s * rows:(s + 1) * rows] for p in parts])
                np.testing.assert_array_equal(np.asarray(shard.data), want.numpy())


# ---- adaln_bf16: not exact, bounded ----------------------------------------------------------------


@pytest.mark.parametrize("variant", ["t2v-a14b", "ti2v-5b"])
def test_adaln_bf16_drift(variant):
    """Bit-identical in fp32; in bf16 within two bf16 ulps of vanilla bf16 at the outputs' magnitude
    (measured 0.0078, one ulp; PCC 0.999999) and as close to fp32 as vanilla bf16 is."""
    fp32 = build_dit(variant)
    inputs = dit_inputs(variant, PADDED)
    ref = _eager(fp32, inputs)
    with apply_patches(fp32, ["adaln_bf16"]):
        assert torch.equal(_eager(fp32, inputs), ref)
    bf16 = build_dit(variant, dtype=torch.bfloat16)
    inputs = dit_inputs(variant, PADDED, dtype=torch.bfloat16)
    vanilla = _eager(bf16, inputs).float()
    with apply_patches(bf16, ["adaln_bf16"]):
        patched = _eager(bf16, inputs).float()
    assert not torch.equal(patched, vanilla)
    assert pcc(vanilla, patched) >= 0.99999
    assert (vanilla - patched).abs().max() <= 0.016
    assert pcc(ref, patched) >= pcc(ref, vanilla) - 2e-6
    assert PATCHES["adaln_bf16"].exact is False and "PCC" in PATCHES["adaln_bf16"].drift


@pytest.mark.parametrize("latent", [ALIGNED, PADDED])
def test_adaln_norm_drift(latent):
    """adaLN folded into the LayerNorm: float32 within float rounding of vanilla (measured 4.8e-7 /
    3.6e-7), bf16 bit-identical on the tiny model; a batch of two samples (a CFG pair) runs the
    vanilla expression, bit for bit."""
    fp32 = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", latent)
    ref = _eager(fp32, inputs)
    with apply_patches(fp32, ["adaln_norm"]):
        out = _eager(fp32, inputs)
        _, _, pair = guidance_pair(inputs)
        pair_ref = _eager(fp32, pair)  # patched, two samples: the vanilla expression
    assert not torch.equal(out, ref) and (out - ref).abs().max() <= 1e-6
    assert torch.equal(pair_ref, _eager(fp32, pair))
    bf16 = build_dit("t2v-a14b", dtype=torch.bfloat16)
    inputs = dit_inputs("t2v-a14b", latent, dtype=torch.bfloat16)
    vanilla = _eager(bf16, inputs)
    with apply_patches(bf16, ["adaln_norm"]):
        patched = _eager(bf16, inputs)
    assert pcc(vanilla.float(), patched.float()) >= 0.99999 and (vanilla - patched).abs().max() <= 0.0078


# ---- errors: one line, before any change ---------------------------------------------------------


def _fused_by_diffusers(dit):
    dit.blocks[1].attn1.fuse_projections()


@pytest.mark.parametrize("names,kwargs,prepare,match", [
    (["rope", "fuse"], {}, None, "unknown patch 'fuse'; choose from patchify, rope, qkv"),
    (["rope", "rope"], {}, None, "patch 'rope' is named twice"),
    (["patchify", "rope", "qkv"], {}, None, "patch 'qkv' .* needs the TP degree: pass the mesh"),
    (["qkv"], {"mesh": "1x8"}, None, "12 heads do not divide over TP 8"),
    (["rope"], {}, _fused_by_diffusers, "does not fit blocks.1.attn1: diffusers' own fuse_projections"),
    (["patchify", "rope"], {"mesh": "2x4"}, "sp", "patch 'rope' must be applied before sequence parallelism: "
                                                  "call the SP handle's remove()"),
    (["rope"], {}, ["rope"], "patch 'rope' is already applied to this model"),
    (["rope"], {}, ["qkv"], "patch 'rope' must be applied before 'qkv'"),
    (["adaln_norm"], {}, None, "patch 'adaln_norm' folds one modulation vector per sample .* TI2V-5B modulates per "
                               "token; leave it out"),
])
def test_bad_requests_are_refused_before_the_model_is_touched(names, kwargs, prepare, match):
    dit = build_dit("ti2v-5b")
    inputs = dit_inputs("ti2v-5b", PADDED)
    earlier = None
    if prepare == "sp":
        earlier = apply_dit_sp_activation_sharding(dit, "2x4", backend=_jax_backend("2x4"))
    elif isinstance(prepare, list):
        earlier = apply_patches(dit, prepare, mesh="1x4")
    elif prepare is not None:
        prepare(dit)
    before = _state(dit)
    ref = _eager(dit, inputs) if prepare != "sp" else None
    with pytest.raises(PatchError, match=match) as err:
        apply_patches(dit, names, **kwargs)
    assert "\n" not in str(err.value)
    assert _state(dit) == before
    if ref is not None:
        assert torch.equal(_eager(dit, inputs), ref)
    if earlier is not None:
        earlier.remove()


def test_not_a_wan_model_is_refused():
    with pytest.raises(PatchError, match="rewrite a diffusers WanTransformer3DModel, got Linear"):
        apply_patches(torch.nn.Linear(2, 2), ["rope"])


def test_removing_a_processor_patch_under_sp_is_refused_until_sp_is_removed():
    dit = build_dit("t2v-a14b")
    patches = apply_patches(dit, ["rope", "qkv"], mesh="2x4")
    sp = apply_dit_sp_activation_sharding(dit, "2x4", backend=_jax_backend("2x4"), padding="slice")
    state = _state(dit)
    with pytest.raises(PatchError, match="cannot be removed while sequence parallelism is applied.*SP handle"):
        patches.remove()
    assert _state(dit) == state and not patches.removed
    sp.remove()
    patches.remove()
    assert applied_patches(dit) == ()


# ---- per instance --------------------------------------------------------------------------------


def test_two_instances_are_independent():
    from diffusers.models.transformers import transformer_wan as tw

    classes = (tw.WanTransformer3DModel, tw.WanTransformerBlock, tw.WanAttention, tw.WanAttnProcessor,
               tw.WanRotaryPosEmbed, torch.nn.Conv3d, torch.nn.Linear)
    vars_before = {c: dict(vars(c)) for c in classes}
    a, b = build_dit("t2v-a14b"), build_dit("t2v-a14b", seed=3)
    inputs = dit_inputs("t2v-a14b", PADDED)
    b_ref, b_state = _eager(b, inputs), _state(b)
    on_a = apply_patches(a, ALL, mesh="2x4")
    assert _state(b) == b_state and torch.equal(_eager(b, inputs), b_ref) and applied_patches(b) == ()
    on_b = apply_patches(b, ["rope"])  # b gets its own, a keeps its five
    assert applied_patches(a) == tuple(ALL) and applied_patches(b) == ("rope",)
    assert a.blocks[0].attn1.processor is not b.blocks[0].attn1.processor
    on_a.remove()
    assert applied_patches(b) == ("rope",) and b.blocks[0].attn1.processor.half_rotary
    on_b.remove()
    assert _state(b) == b_state and torch.equal(_eager(b, inputs), b_ref)
    assert {c: dict(vars(c)) for c in classes} == vars_before


def test_generate_shards_a_patched_pipeline_and_matches_the_vanilla_one(tmp_path):
    """`wan-sharding generate --patches ...`: both experts patched then sharded (shard_pipeline's
    ``patches``), final latents against the unpatched unsharded pipeline, and the summary says so."""
    import json
    import subprocess
    import sys

    from wan_sharding.jobs.launch import worker_env

    out = tmp_path / "gen"
    cmd = [sys.executable, "-m", "wan_sharding.cli", "generate", "--backend", "jax", "--mesh", "1x4", "--steps", "2",
           "--patches", "rope", "qkv", "patchify", "--compare", "--out", str(out)]
    proc = subprocess.run(cmd, env=worker_env("jax", 4), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(next(out.glob("*.json")).read_text())
    assert summary["patches"] == ["rope", "qkv", "patchify"]
    assert summary["pcc_ok"] and summary["max_abs"] < 1e-4, summary
    # graded as one forward is: fp32 PCC and the max-abs bound, both printed
    assert (summary["pcc_threshold"], summary["max_abs_bound"]) == (0.99999, 1e-4), summary
    assert "(within PCC >= 0.99999, max|diff| <= 1e-04)" in proc.stdout, proc.stdout[-2000:]


# ---- prompt_kv: K / V once per prompt ------------------------------------------------------------


@pytest.mark.parametrize("variant", ["t2v-a14b", "ti2v-5b"])
def test_a_prompt_state_gives_the_vanilla_step_bit_for_bit(variant):
    """The step given the prompt state (K / V made by the prompt program) is the vanilla forward given
    the prompt embedding: bit-identical on the CPU alone, and with qkv's fused to_kv."""
    from wan_sharding.patches.prompt_kv import prompt_state

    dit = _sharp_dit(variant)
    inputs = dit_inputs(variant, PADDED)
    ref, ref_cross = _eager_attn(dit, inputs, "attn2")
    for names in (["prompt_kv"], ["qkv", "prompt_kv"]):
        with apply_patches(dit, names, mesh="2x4"):
            state = prompt_state(dit, inputs["encoder_hidden_states"])
            assert sorted(state) == [f"blocks.{i}" for i in range(len(dit.blocks))]
            out, cross = _eager_attn(dit, {**inputs, "encoder_hidden_states": state}, "attn2")
            assert torch.equal(out, ref) and torch.equal(cross, ref_cross), names
            assert torch.equal(_eager(dit, inputs), ref)  # the prompt embedding itself: the vanilla path


def test_prompt_kv_through_a_stand_in_caches_per_prompt_values_on_jax():
    """Through a pipeline's stand-in on 2x4: each prompt's state made once and reused while its values
    are the same (the guidance branches alternate, another tensor with the same values), made again
    for changed values (in place, with or without a version bump) and for another placement; each
    output as the vanilla model's for its prompt; the state split over TP on the devices; and the
    step's program has no matmul of the prompt (the text MLP, to_k / to_v) left."""
    import jax

    from wan_sharding.patches.prompt_kv import prompt_cache, prompt_state_bytes
    from wan_sharding.pipeline import ShardedTransformer

    dit, twin = _sharp_dit("t2v-a14b"), _sharp_dit("t2v-a14b")  # twin: the same weights, never patched
    inputs = dit_inputs("t2v-a14b", PADDED)
    cond, uncond = inputs["encoder_hidden_states"], torch.randn_like(inputs["encoder_hidden_states"])
    patches = apply_patches(dit, ["rope", "qkv", "prompt_kv"], mesh="2x4")
    backend = _jax_backend("2x4")
    specs = shard_dit_specs(dit, "2x4")
    sp = apply_dit_sp_activation_sharding(dit, "2x4", backend=backend, padding="mask")
    model = ShardedTransformer(dit, backend, backend.place(dit, specs), "transformer", "mask", sp=sp)
    cache = prompt_cache(dit)

    def step(prompt, stand_in=model):
        with torch.no_grad():
            out = stand_in(**{**inputs, "encoder_hidden_states": prompt}, return_dict=False)[0]
        assert (out - _eager(twin, {**inputs, "encoder_hidden_states": prompt})).abs().max() <= EXACT
        return cache.computed, cache.reused

    assert [step(p) for p in (cond, uncond, cond, uncond)] == [(1, 0), (2, 0), (2, 1), (2, 2)]
    assert step(cond.clone()) == (2, 3)
    state = cache.entries[0].state
    # (B, heads, S, head dim), the heads split over TP: what each device's cross-attention reads
    spec = tuple(state["blocks.0"][0].sharding.spec)  # JAX drops trailing Nones
    assert spec[:2] == (None, "tp") and not any(spec[2:])
    per_device = sum(t.addressable_shards[0].data.nbytes for kv in state.values() for t in kv)
    assert per_device == prompt_state_bytes(dit, 1, cond.shape[1], tp=4, itemsize=4)
    cond.mul_(1.5)  # in place: a version bump and new values
    assert step(cond) == (3, 3)
    cond.data[0, 0, 0] += 1.0  # in place behind autograd's back: no version bump, new values
    assert step(cond) == (4, 3) and len(cache.entries) == cache.capacity
    again = ShardedTransformer(dit, backend, backend.place(dit, specs), "transformer", "mask", sp=sp)
    assert step(cond, again) == (5, 3)  # another placement: its own states

    def prompt_matmuls(prompt) -> int:
        """Matmuls of (B, S, channels) operands in the step's program: the text MLP and K / V projections."""
        jargs, jkwargs = backend._device_inputs((), {**inputs, "encoder_hidden_states": prompt})
        eqns = equations(jax.make_jaxpr(backend.jax_forward(dit))(again._placed, jargs, jkwargs).jaxpr)
        return sum(e.primitive.name == "dot_general" and e.invars[0].aval.ndim == 3
                   and tuple(e.invars[0].aval.shape[:2]) == (1, cond.shape[1]) for e in eqns)

    assert prompt_matmuls(cond) == 2 + len(dit.blocks)  # the prompt embedding itself: linear_1, linear_2, to_kv
    assert prompt_matmuls(state) == 0
    sp.remove()
    patches.remove()
    backend.release(dit)


@pytest.mark.parametrize("overrides,match", [
    ({"image_dim": 32}, "patch 'prompt_kv' does not support image embeddings"),
    ({"added_kv_proj_dim": 32}, "does not fit blocks.0.attn2: image cross-attention"),
])
def test_prompt_kv_refuses_image_conditioning_before_the_model_is_touched(overrides, match):
    dit = build_dit("t2v-a14b", **overrides)
    before = _state(dit)
    with pytest.raises(PatchError, match=match) as err:
        apply_patches(dit, ["prompt_kv"])
    assert "\n" not in str(err.value) and _state(dit) == before


def test_a_prompt_state_reaches_only_a_cross_attention_that_takes_one():
    """A prompt state handed to a cross-attention whose processor was not set up by prompt_kv (here:
    qkv's only) is a one-line error, not a wrong K / V."""
    dit = build_dit("t2v-a14b")
    with apply_patches(dit, ["qkv"], mesh="2x4"):
        attn = dit.blocks[0].attn2
        h = torch.randn(1, 8, attn.inner_dim)
        kv = (1, attn.heads, 16, attn.inner_dim // attn.heads)  # a state's K / V: (B, heads, S, head dim)
        state = {"blocks.0": (torch.randn(kv), torch.randn(kv))}
        with pytest.raises(ValueError, match="the 'prompt_kv' patch is not applied to it") as err:
            attn(h, state)
    assert "\n" not in str(err.value)


def test_exact_selects_every_exact_patch():
    from wan_sharding.cli import build_parser
    from wan_sharding.patches import patch_names

    assert patch_names("exact") == list(EXACT_PATCHES) and "prompt_kv" in EXACT_PATCHES
    assert patch_names(["adaln_bf16", "exact"]) == ["adaln_bf16", *EXACT_PATCHES]
    assert patch_names(["rope", "exact"]) == ["rope", *(n for n in EXACT_PATCHES if n != "rope")]
    dit = build_dit("t2v-a14b")
    with apply_patches(dit, "exact", mesh="2x4") as handle:
        assert applied_patches(dit) == EXACT_PATCHES and handle.exact
    args = build_parser().parse_args(["compile", "--patches", "exact", "adaln_bf16"])
    assert args.patches == [*EXACT_PATCHES, "adaln_bf16"]
