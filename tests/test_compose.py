"""``shard_dit``: the one composition (patches -> TP specs -> placement -> SP hooks), its checks
before any change, and ``DitHandle.remove()`` undoing all of it.

Runs in this pytest process on JAX's 8 CPU devices (see conftest.py); the other backends go through
the same function in their workers (tests/test_pcc.py, test_pipeline.py, test_frontends.py).
"""

import ast
from pathlib import Path

import pytest
import torch

from wan_sharding import (BackendError, PatchError, ShardingError, ShardingPlan, get_backend, shard_dit,
                          shard_dit_specs)
from wan_sharding.compose import resolve
from wan_sharding.hooks import has_sp
from wan_sharding.jobs.pcc import compare
from wan_sharding.models import LatentShape, build_dit, dit_inputs
from wan_sharding.patches import applied_patches

PADDED = LatentShape(3, 10, 14)  # 105 tokens -> 128 on 2x4
ROOT = Path(__file__).resolve().parents[1]


def _eager(dit, inputs):
    with torch.no_grad():
        return dit(**inputs, return_dict=False)[0]


def _state(dit):
    """Everything shard_dit may touch: hooks, processors, the parameter objects and their values."""
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in dit.modules())
    procs = [type(b.attn1.processor).__name__ for b in dit.blocks]
    params = [(n, id(p), p.detach().clone()) for n, p in dit.named_parameters()]
    return hooks, procs, params


def _same(a, b):
    return a[0] == b[0] and a[1] == b[1] and len(a[2]) == len(b[2]) and all(
        n1 == n2 and i1 == i2 and torch.equal(t1, t2) for (n1, i1, t1), (n2, i2, t2) in zip(a[2], b[2]))


def test_shard_dit_composes_every_step_and_remove_undoes_them():
    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", PADDED)
    reference, before = _eager(dit, inputs), _state(dit)

    handle = shard_dit(dit, "2x4", backend="jax", padding="mask", patches=["rope", "qkv"])
    # patches first: the specs are the patched model's (qkv's fused projection, split colwise on TP)
    assert applied_patches(dit) == ("rope", "qkv")
    assert handle.specs.by_name()["blocks.0.attn1.to_qkv.weight"] == ("tp", None)
    # then placement and the SP hooks, on the resolved mesh, backend and padding
    assert handle.mesh.name == "2x4" and handle.backend.name == "jax" and handle.padding == "mask"
    assert has_sp(dit) and len(handle.sp.points) == 3
    value, max_abs = compare(reference, handle.backend.run(dit, handle.placed, **inputs))
    assert value >= 0.99999 and max_abs < 1e-5
    assert handle.describe()["patches"] == ["rope", "qkv"] and handle.describe()["last_padded_tokens"] == 128

    handle.remove()  # in reverse: SP hooks off first (qkv's processor is wrapped by SP's), then the patches
    assert not has_sp(dit) and applied_patches(dit) == ()
    assert _same(_state(dit), before)
    assert torch.equal(_eager(dit, inputs), reference)
    handle.remove()  # idempotent


def _jax_mesh(shape):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("sp", "tp"))


def _refused(call, error, match, dit):
    before = _state(dit)
    with pytest.raises(error, match=match):
        call()
    assert _same(_state(dit), before) and not has_sp(dit) and applied_patches(dit) == ()


def test_bad_requests_are_refused_before_the_model_is_changed():
    dit = build_dit("t2v-a14b")
    _refused(lambda: shard_dit(dit, "2x4", backend="jax", padding="pad"), ShardingError, "unknown padding mode", dit)
    _refused(lambda: shard_dit(dit, "2x4", backend="jax", patches=["qkv", "nope"]), PatchError, "unknown patch", dit)
    # heads not divisible by TP (a JAX mesh over 3 of the 8 devices): found before the (valid) patches
    # are applied
    _refused(lambda: shard_dit(dit, _jax_mesh((1, 3)), backend="jax", patches=["rope"]), ShardingError,
             "not divisible by TP=3", dit)
    plan = ShardingPlan((2, 4), padding="slice")
    _refused(lambda: shard_dit(dit, plan, backend="jax", padding="mask"), ShardingError, "contradicts the plan's padding",
             dit)
    _refused(lambda: shard_dit(dit, "2x4", backend="jax", resolved=resolve("2x4", "jax")), ShardingError,
             "resolved request and request arguments", dit)
    _refused(lambda: shard_dit(dit, "8x4", backend="jax"), BackendError, "needs 32 devices", dit)
    _refused(lambda: shard_dit(torch.nn.Linear(2, 2), "2x4", backend="jax"), ShardingError,
             "expected a diffusers WanTransformer3DModel", dit)

    handle = shard_dit(dit, "2x4", backend="jax")
    with pytest.raises(ShardingError, match="already sharded"):
        shard_dit(dit, "2x4", backend="jax")
    handle.remove()


def test_a_plan_is_resolved_once_with_its_roles_and_padding():
    plan = ShardingPlan((2, 4), axis_names=("rows", "cols"), sp_axes=("cols",), tp_axes=("rows",), padding="slice")
    resolved = resolve(plan, "jax")
    assert (resolved.padding, resolved.mesh.sp_axis, resolved.mesh.tp_axis) == ("slice", "cols", "rows")
    assert resolved.mesh_or_plan is plan
    assert resolve("2x4").backend.name == "jax" and resolve("2x4").padding == "mask"  # the defaults
    with pytest.raises(ShardingError, match="contradicts the plan's mesh"):
        resolve("2x4", "jax", plan=plan)  # a preset with other roles than the plan's
    with pytest.raises(ShardingError, match="needs a mesh"):
        resolve(None, "jax")

    dit = build_dit("t2v-a14b")
    handle = shard_dit(dit, resolved=resolved)
    assert handle.specs.by_name()["blocks.0.attn1.to_q.weight"] == ("rows", None)  # TP on the plan's axis
    assert handle.sp.describe()["padding"] == "slice"
    handle.remove()


def test_two_models_sharded_apart_do_not_touch_each_other():
    a, b = build_dit("t2v-a14b"), build_dit("t2v-a14b", seed=3)
    inputs = dit_inputs("t2v-a14b", PADDED)
    b_before, b_state = _eager(b, inputs), _state(b)
    handle = shard_dit(a, "2x4", backend="jax", patches=["rope"])
    assert _same(_state(b), b_state) and applied_patches(b) == ()
    assert torch.equal(_eager(b, inputs), b_before)
    handle.remove()


def test_a_meta_model_is_placed_abstractly_for_compile_only():
    import jax

    dit = build_dit("t2v-a14b", device="meta", dtype=torch.bfloat16)
    handle = shard_dit(dit, "2x4", backend=get_backend("jax", "2x4"))
    weight = handle.placed["blocks.0.ffn.net.0.proj.weight"]
    assert isinstance(weight, jax.ShapeDtypeStruct) and weight.sharding.spec == ("tp", None)
    handle.remove()


def test_the_steps_are_composed_in_one_place():
    """On the syntax tree of the package: the SP hooks and the patches are applied from one place (the
    composition) and a backend's placement is called from at most two (the composition and profile's
    unsharded baseline). Inside ``backends/`` a backend's ``place`` calling its parent's is the
    implementation, not a caller."""
    calls: dict[str, list[str]] = {"apply_dit_sp_activation_sharding": [], "place": [], "apply_patches": []}
    for path in (ROOT / "wan_sharding").rglob("*.py"):
        if path.parent.name == "backends":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in calls:
                    calls[name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [c.split(":")[0] for c in calls["apply_dit_sp_activation_sharding"]] == ["wan_sharding/compose.py"]
    assert [c.split(":")[0] for c in calls["apply_patches"]] == ["wan_sharding/compose.py"]
    assert sorted(c.split(":")[0] for c in calls["place"]) == ["wan_sharding/compose.py", "wan_sharding/jobs/profile.py"]
    assert shard_dit_specs is not None
