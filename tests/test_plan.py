"""Whole sharding plans (ShardingPlan): roles on any axes, FSDP, activation layout, save/load."""

import pytest
import torch

from wan_sharding import apply_dit_sp_activation_sharding, get_backend, shard_dit_specs
from wan_sharding.jobs.pcc import pcc
from wan_sharding.models import LatentShape, build_dit, dit_inputs
from wan_sharding.plan import ShardingPlan


def test_plan_roles_can_swap_axes_or_span_several():
    swapped = ShardingPlan((2, 4), ("a", "b"), sp_axes=("b",), tp_axes=("a",)).mesh()
    assert (swapped.sp, swapped.tp) == (4, 2)
    both = ShardingPlan((2, 4), ("a", "b"), sp_axes=(), tp_axes=("a", "b")).mesh()
    assert (both.sp, both.tp, both.tp_axis) == (1, 8, ("a", "b"))


def test_plan_specs_follow_the_plans_axes():
    dit = build_dit("t2v-a14b", "full", device="meta")
    specs = shard_dit_specs(dit, ShardingPlan((2, 4), ("a", "b"), sp_axes=(), tp_axes=("a", "b")))
    assert specs.by_name()["blocks.0.attn1.to_q.weight"] == (("a", "b"), None)  # TP 8: 5 heads each


def test_fsdp_divides_weight_memory_by_sp():
    dit = build_dit("t2v-a14b", "full", device="meta", dtype=torch.bfloat16)
    plain = shard_dit_specs(dit, ShardingPlan((2, 4)))
    fsdp = shard_dit_specs(dit, ShardingPlan((2, 4), fsdp=True))
    assert fsdp.by_name()["blocks.0.attn1.to_q.weight"] == ("tp", "sp")
    assert fsdp.by_name()["blocks.0.ffn.net.2.weight"] == ("sp", "tp")
    assert fsdp.by_name()["blocks.0.attn1.norm_q.weight"] == ("tp",)  # small: left alone
    gb = 1e9
    # One 14.3B-parameter expert in bf16 is 28.6 GB: TP 4 leaves ~7.2 GB per chip, FSDP over SP 2 ~3.6 GB.
    assert 7.0 < plain.bytes_per_device(2) / gb < 7.4
    assert 3.5 < fsdp.bytes_per_device(2) / gb < 3.8


def test_plan_must_match_the_mesh():
    from wan_sharding import ShardingError

    dit = build_dit("t2v-a14b")
    with pytest.raises(ShardingError, match="plan is for mesh"):
        shard_dit_specs(dit, "8x4", plan=ShardingPlan((2, 4)))
    with pytest.raises(ShardingError, match="plan is for mesh"):
        apply_dit_sp_activation_sharding(dit, "8x4", backend="jax", plan=ShardingPlan((2, 4)))


def test_plan_saves_and_loads(tmp_path):
    plan = ShardingPlan((8, 4), sp_axes=("tp",), tp_axes=("sp",), fsdp=True, layout="sharded", padding="mask")
    plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json") == plan


@pytest.mark.parametrize("plan", [
    ShardingPlan((2, 4), sp_axes=("tp",), tp_axes=("sp",), padding="mask"),  # SP 4 / TP 2
    ShardingPlan((2, 4), fsdp=True, layout="sharded"),
    ShardingPlan((2, 4), sp_axes=(), tp_axes=("sp", "tp")),  # TP 8 only
], ids=lambda p: p.name)
def test_plans_apply_through_the_ordinary_path_exactly(plan):
    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    with torch.no_grad():
        ref = dit(**inputs, return_dict=False)[0]
    backend = get_backend("jax", plan.mesh())
    specs = shard_dit_specs(dit, plan.mesh(), plan=plan)
    handle = apply_dit_sp_activation_sharding(dit, plan.mesh(), backend=backend, plan=plan)
    out = backend.run(dit, backend.place(dit, specs), **inputs)
    handle.remove()
    assert pcc(ref, out) > 0.99999 and (ref - out).abs().max() < 1e-4
