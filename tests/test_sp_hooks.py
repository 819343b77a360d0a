"""The SP hooks on one model: reversible, per instance, refusing bad input before touching it.

Runs in this pytest process on JAX's 8 CPU devices (see conftest.py).
"""

import copy
import io
import pickle

import pytest
import torch

from wan_sharding import (BackendError, ShardingError, apply_dit_sp_activation_sharding, get_backend,
                          shard_dit_specs)
from wan_sharding.dit.attention import MaskPaddedKeys, SliceKV
from wan_sharding.jobs.pcc import pcc
from wan_sharding.models import LatentShape, build_dit, dit_inputs

PADDED = LatentShape(3, 10, 14)  # 105 tokens -> 128 on 2x4


def _eager(dit, inputs):
    with torch.no_grad():
        return dit(**inputs, return_dict=False)[0]


def _hook_state(dit):
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in dit.modules())
    procs = [type(b.attn1.processor).__name__ for b in dit.blocks]
    return hooks, procs


def _sharded(dit, inputs, mesh="2x4", padding="slice"):
    backend = get_backend("jax", mesh)
    specs = shard_dit_specs(dit, mesh)
    handle = apply_dit_sp_activation_sharding(dit, mesh, backend=backend, padding=padding)
    out = backend.run(dit, backend.place(dit, specs), **inputs)
    return handle, out


@pytest.mark.parametrize("padding", ["slice", "mask"])
def test_remove_restores_bit_identical_eager_output(padding):
    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    before_out, before_state = _eager(dit, inputs), _hook_state(dit)
    handle, sharded = _sharded(dit, inputs, padding=padding)
    assert pcc(before_out, sharded) > 0.99999
    assert _hook_state(dit) != before_state
    handle.remove()
    assert _hook_state(dit) == before_state
    assert torch.equal(_eager(dit, inputs), before_out)
    handle.remove()  # idempotent


def test_two_instances_are_independent():
    a, b = build_dit("t2v-a14b"), build_dit("t2v-a14b", seed=3)
    inputs = dit_inputs("t2v-a14b", PADDED)
    b_before = _eager(b, inputs)
    handle, _ = _sharded(a, inputs)
    # b carries nothing and still runs as plain eager torch (a's hooks would need a JAX trace)
    assert _hook_state(b) == (0, ["WanAttnProcessor", "WanAttnProcessor"])
    assert torch.equal(_eager(b, inputs), b_before)
    # b can be sharded on its own while a still is
    handle_b, _ = _sharded(b, inputs, padding="mask")
    assert isinstance(a.blocks[0].attn1.processor, SliceKV)
    assert isinstance(b.blocks[0].attn1.processor, MaskPaddedKeys)
    handle.remove()
    handle_b.remove()


def test_applying_twice_raises_and_leaves_the_first_application():
    dit = build_dit("t2v-a14b")
    handle = apply_dit_sp_activation_sharding(dit, "2x4", backend="jax")
    state = _hook_state(dit)
    with pytest.raises(ShardingError, match="already applied.*handle.remove"):
        apply_dit_sp_activation_sharding(dit, "2x4", backend="jax")
    assert _hook_state(dit) == state
    handle.remove()
    apply_dit_sp_activation_sharding(dit, "2x4", backend="jax").remove()  # fine again after remove


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mesh="8x4", backend="jax"), BackendError, "mesh 8x4 needs 32 devices but JAX .* sees 8"),
    (dict(mesh="3x3", backend="jax"), Exception, "unknown mesh '3x3'"),
    (dict(mesh="2x4", backend="jax", padding="zeros"), ShardingError, "unknown padding mode 'zeros'"),
    (dict(mesh="2x4", backend="neuron"), BackendError, "unknown backend 'neuron'"),
    (dict(mesh="2x4", backend="tt"), BackendError, "pjrt-plugin-tt.*Tenstorrent's package index"),
])
def test_bad_input_is_refused_before_the_model_is_touched(kwargs, error, match):
    dit = build_dit("t2v-a14b")
    state = _hook_state(dit)
    mesh = kwargs.pop("mesh")
    with pytest.raises(error, match=match):
        apply_dit_sp_activation_sharding(dit, mesh, **kwargs)
    assert _hook_state(dit) == state


def test_non_wan_model_is_refused():
    with pytest.raises(ShardingError, match="expected a diffusers WanTransformer3DModel"):
        apply_dit_sp_activation_sharding(torch.nn.Linear(2, 2), "2x4", backend="jax")


def test_padding_without_exact_attention_would_be_caught():
    """Negative control: with padded keys visible to attention the result is off by ~1e-3, which the
    max-abs bound of the PCC tests catches. PCC alone does not here (0.9999986 > 0.99999): 23 zero keys
    among 128 only dilute the softmax, so the suite bounds both."""
    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    ref = _eager(dit, inputs)
    handle, _ = _sharded(copy.deepcopy(dit), inputs)
    backend = handle.backend
    handle.remove()
    handle = apply_dit_sp_activation_sharding(dit, "2x4", backend=backend, padding="slice")
    for module, proc in handle._processors.items():  # drop the exact-attention processors only
        module.set_processor(proc)
    out = backend.run(dit, backend.place(dit, shard_dit_specs(dit, "2x4")), **inputs)
    handle.remove()
    assert (ref - out).abs().max() > 1e-3  # the suite's fp32 max-abs bound is 1e-4


def test_eager_call_with_jax_hooks_explains_itself():
    dit = build_dit("t2v-a14b")
    handle = apply_dit_sp_activation_sharding(dit, "2x4", backend="jax")
    with pytest.raises(BackendError, match="only inside a torchax trace"):
        _eager(dit, dit_inputs("t2v-a14b", PADDED))
    handle.remove()


def test_no_diffusers_class_is_modified():
    from diffusers.models.transformers import transformer_wan as tw

    classes = (tw.WanTransformer3DModel, tw.WanTransformerBlock, tw.WanAttention, tw.WanAttnProcessor,
               tw.WanRotaryPosEmbed, tw.WanTimeTextImageEmbedding)
    before = {c: dict(vars(c)) for c in classes}
    dit = build_dit("t2v-a14b")
    handle, _ = _sharded(dit, dit_inputs("t2v-a14b", PADDED), padding="mask")
    assert {c: dict(vars(c)) for c in classes} == before
    handle.remove()
    assert {c: dict(vars(c)) for c in classes} == before


@pytest.mark.parametrize("copy_model", [copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())],
                         ids=["deepcopy", "pickle", "torch.save"])
def test_copying_a_model_with_sp_is_refused_and_leaves_it_intact(copy_model):
    """A copy would share the original's hooks and forward state (silently wrong): refused, with
    the way to do it; the original still runs exactly as before, and after remove() it copies."""
    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    backend = get_backend("jax", "2x4")
    placed = backend.place(dit, shard_dit_specs(dit, "2x4"))
    handle = apply_dit_sp_activation_sharding(dit, "2x4", backend=backend, padding="mask")
    before, state = backend.run(dit, placed, **inputs), _hook_state(dit)
    with pytest.raises(ShardingError, match=r"cannot be copied or pickled.*handle.remove\(\) first, copy, then"):
        copy_model(dit)
    assert _hook_state(dit) == state
    assert torch.equal(backend.run(dit, placed, **inputs), before)
    handle.remove()
    copy_model(dit)  # a plain model copies again


def test_copy_is_refused_without_padding_processors_too():
    """padding='none' installs hooks only (no attention processors): they refuse the copy as well."""
    dit = build_dit("t2v-a14b")
    handle = apply_dit_sp_activation_sharding(dit, "2x4", backend="jax", padding="none")
    assert _hook_state(dit)[1] == ["WanAttnProcessor", "WanAttnProcessor"]
    with pytest.raises(ShardingError, match="cannot be copied"):
        copy.deepcopy(dit)
    handle.remove()


def test_empty_padding_is_an_error_not_the_default():
    dit = build_dit("t2v-a14b")
    with pytest.raises(ShardingError, match="unknown padding mode ''"):
        apply_dit_sp_activation_sharding(dit, "2x4", backend="jax", padding="")
    assert _hook_state(dit) == (0, ["WanAttnProcessor", "WanAttnProcessor"])


def test_hooks_trace_whole_under_torch_compile():
    """The tt backend runs the hooked model through torch.compile: the package's hook objects must
    trace without a graph break. A backend whose constraint is a plain op stands in for the device."""
    from wan_sharding.backends.base import Backend
    from wan_sharding.mesh import as_mesh_spec

    class PlainOps(Backend):
        name = "plain"

        def _make_mesh(self, mesh):
            return None

        def place(self, dit, specs):
            return None

        def constrain(self, tensor, spec):
            return tensor * 1

    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    reference = _eager(dit, inputs)
    handle = apply_dit_sp_activation_sharding(dit, "2x4", backend=PlainOps(as_mesh_spec("2x4")), padding="mask")
    compiled = torch.compile(dit, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        out = compiled(**inputs, return_dict=False)[0]
    handle.remove()
    assert (out - reference).abs().max() <= 1e-5
