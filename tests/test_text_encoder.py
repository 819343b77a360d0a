"""``shard_text_encoder``: the UMT5 encoder's specs against Tenstorrent's recipe, parameter by
parameter, its checks before any change, and its handle (called as the pipeline calls the encoder;
``remove()`` undoing everything).

Runs in this pytest process on JAX's 8 CPU devices (see conftest.py). The PCC matrix on every CPU
mesh and both backends runs in the check workers (tests/test_pcc.py::test_text_encoder_matches_unsharded).
"""

import copy
import pickle
import re

import pytest
import torch

from wan_sharding import ShardingError, ShardingPlan, shard_text_encoder, shard_text_encoder_specs
from wan_sharding.jobs.pcc import compare
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import build_dit, build_text_encoder, text_encoder_inputs

# Tenstorrent's recipe for this encoder, transcribed as data (tenstorrent/tt-xla
# tests/torch/models/wan14b/shared.py, shard_umt5_specs, at commit 14d7b5abf0fec6cc5ccd2e718583e4a07290ae6b):
# per block, SelfAttention q / k / v `col = (TP_AXIS, None)`, o `row = (None, TP_AXIS)`, its
# relative_attention_bias `row` ("shard the head dim"), DenseReluDense wi_0 / wi_1 `col`, wo `row`;
# every other parameter gets no spec there, i.e. replicated. TP_AXIS is "model" in the recipe's
# ("batch", "model") mesh: the TP axis, "tp" in this package's presets.
TT_XLA_RULES = (
    (r"encoder\.block\.\d+\.layer\.0\.SelfAttention\.[qkv]\.weight", ("model", None)),
    (r"encoder\.block\.\d+\.layer\.0\.SelfAttention\.o\.weight", (None, "model")),
    (r"encoder\.block\.\d+\.layer\.0\.SelfAttention\.relative_attention_bias\.weight", (None, "model")),
    (r"encoder\.block\.\d+\.layer\.1\.DenseReluDense\.wi_[01]\.weight", ("model", None)),
    (r"encoder\.block\.\d+\.layer\.1\.DenseReluDense\.wo\.weight", (None, "model")),
)


def tt_xla_spec(name, ndim, tp_axis):
    for pattern, spec in TT_XLA_RULES:
        if re.fullmatch(pattern, name):
            return tuple(tp_axis if a == "model" else a for a in spec)
    return (None,) * ndim


@pytest.mark.parametrize("mesh", ["1x4", "2x4", "8x4"])
def test_specs_equal_tt_xla_recipe_parameter_by_parameter(mesh):
    encoder = build_text_encoder("full", device="meta", dtype=torch.bfloat16)  # UMT5-XXL, no memory
    specs = shard_text_encoder_specs(encoder, mesh).by_name()
    names = [n for n, _ in encoder.named_parameters()]
    assert list(specs) == names and len(names) == 1 + 24 * 10 + 1  # the tied embedding once, as shared.weight
    tp = mesh_from_preset(mesh).tp_axis
    params = dict(encoder.named_parameters())
    for name in names:
        assert specs[name] == tt_xla_spec(name, params[name].ndim, tp), name
    assert sum(s != (None,) * len(s) for s in specs.values()) == 24 * 8  # 8 split weights per layer, the rest whole


def test_a_plan_applies_its_tp_axes_and_fsdp():
    encoder = build_text_encoder()
    plan = ShardingPlan((2, 4), ("rows", "cols"), ("rows",), ("cols",), fsdp=True)
    specs = shard_text_encoder_specs(encoder, plan).by_name()
    assert specs["encoder.block.0.layer.0.SelfAttention.q.weight"] == ("cols", "rows")  # TP, then FSDP over SP
    assert specs["shared.weight"] == ("rows", None)  # a large replicated weight: split over SP alone
    assert specs["encoder.final_layer_norm.weight"] == (None,)  # small: whole


@pytest.mark.parametrize("overrides,line", [
    ({"num_heads": 6}, "6 attention heads of the text encoder are not divisible by TP=4 (mesh 2x4); TP must be "
                       "head-aligned: use a mesh whose TP axis is one of [1, 2, 3, 6]"),
    ({"d_ff": 102}, "102 FFN channels (d_ff) of the text encoder are not divisible by TP=4"),
])
def test_what_tp_does_not_divide_is_refused_in_one_line_before_any_change(overrides, line):
    encoder = build_text_encoder(**overrides)
    before = [(n, id(p)) for n, p in encoder.named_parameters()]
    with pytest.raises(ShardingError) as info:
        shard_text_encoder(encoder, "2x4", backend="jax")
    assert line in str(info.value) and "\n" not in str(info.value)
    assert [(n, id(p)) for n, p in encoder.named_parameters()] == before
    assert not encoder._forward_pre_hooks and all(p.device.type == "cpu" for p in encoder.parameters())


def test_only_a_umt5_encoder_is_taken():
    with pytest.raises(ShardingError, match="expected a transformers UMT5EncoderModel .* got WanTransformer3DModel"):
        shard_text_encoder(build_dit(), "2x4", backend="jax")


def test_the_handle_is_called_as_the_pipeline_calls_the_encoder_and_remove_restores_it():
    encoder, other = build_text_encoder(), build_text_encoder(seed=1)
    ids, mask = text_encoder_inputs(valid=(11,))
    with torch.no_grad():
        expected, other_expected = encoder(ids, mask), other(ids, mask).last_hidden_state
    params = [(n, id(p)) for n, p in encoder.named_parameters()]

    handle = shard_text_encoder(encoder, "2x4", backend="jax")
    out = handle(ids, mask)  # the pipeline: text_encoder(text_input_ids, mask).last_hidden_state
    assert type(out) is type(expected) and out.last_hidden_state.shape == (1, 16, 32)
    value, max_abs = compare(expected.last_hidden_state, out.last_hidden_state)
    assert value >= 0.99999 and max_abs <= 1e-4
    assert torch.equal(handle(ids, mask, return_dict=False)[0], out.last_hidden_state)
    assert handle.describe() == {"backend": "jax", "mesh": "2x4", "plan": None, "calls": 2, "params": {
        "colwise": 10, "rowwise": 4, "norm_colwise": 0, "replicate": 6, "embedding_colwise": 2}}
    with torch.no_grad():  # a second encoder in the process is not affected
        assert torch.equal(other(ids, mask).last_hidden_state, other_expected)
    with pytest.raises(ShardingError, match="already sharded"):
        shard_text_encoder(encoder, "2x4", backend="jax")
    with pytest.raises(ShardingError, match="call handle.remove\\(\\) first, copy, then shard_text_encoder"):
        copy.deepcopy(encoder)
    with pytest.raises(ShardingError, match="cannot be copied or pickled"):
        pickle.dumps(encoder)

    handle.remove()
    assert [(n, id(p)) for n, p in encoder.named_parameters()] == params and not encoder._forward_pre_hooks
    assert encoder.encoder.embed_tokens.weight is encoder.shared.weight
    with torch.no_grad():
        assert torch.equal(encoder(ids, mask).last_hidden_state, expected.last_hidden_state)
    with pytest.raises(ShardingError, match="was removed by handle.remove"):
        handle(ids, mask)
    handle.remove()  # twice: nothing more to undo
    again = shard_text_encoder(encoder, ShardingPlan.from_mesh(mesh_from_preset("2x4")), backend="jax")  # and again
    assert again.plan is not None and again.mesh.name == "2x4"
    again.remove()
