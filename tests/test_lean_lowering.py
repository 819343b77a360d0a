"""The exact small cuts: torchax's ``add`` / ``sub`` (alpha 1) and ``neg`` without a multiply, and the
``rope`` patch's rotary cast once, in the rotate-half form tt-mlir fuses. Both bit-identical.

In-process, JAX on this process's CPU devices (conftest.py). The op counts these cuts remove from a
compiled block are measured through tt-mlir in docs/patches.md.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from wan_sharding.backends.torchax_ops import _add, _neg, _sub, install_lean_lowerings
from wan_sharding.models import LatentShape, build_dit, dit_inputs
from wan_sharding.patches import apply_patches
from wan_sharding.dit.attention import apply_rotary
from wan_sharding.patches.processor import heads_first_rotary
from wan_sharding.patches.rope import half_layout

from conftest import stock_rotary_in_bf16
from jaxprs import equations


def _same(a, b) -> bool:
    """Same dtype and the same bits, except a NaN's sign and payload (``-1 * nan`` and ``-nan`` may
    differ there, as may ``y * 1`` and ``y``): NaN where the other is NaN."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype:
        return False
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    if not np.issubdtype(a.dtype, np.integer) and a.dtype != np.bool_:
        nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
        return bool(np.array_equal(nan_a, nan_b) and np.array_equal(a.view(view)[~nan_a], b.view(view)[~nan_b]))
    return bool(np.array_equal(a.view(view) if a.dtype != np.bool_ else a, b.view(view) if b.dtype != np.bool_ else b))


def _operands():
    """Arrays with signed zeros, infinities and NaN, in the dtypes a Wan forward uses."""
    values = np.array([1.5, -0.0, 0.0, np.inf, -np.inf, np.nan, -3.25, 7e-3], np.float32)
    floats = [jnp.asarray(values, d) for d in (jnp.float32, jnp.bfloat16)]
    ints = [jnp.asarray([3, -2, 0, 2**30, -(2**31), 5, 1, -1], jnp.int32)]
    return floats + ints


# float with float (mixed precisions too) and int with int
PAIRS = [(x, y) for x in _operands() for y in _operands()
         if jnp.issubdtype(x.dtype, jnp.integer) == jnp.issubdtype(y.dtype, jnp.integer)]


@pytest.mark.parametrize("x,y", PAIRS, ids=[f"{x.dtype}-{y.dtype}" for x, y in PAIRS])
def test_torchax_add_sub_neg_are_bit_identical_to_torchax_own(x, y):
    from torchax.ops import jaten

    for alpha in (1, 1.0, 2):
        pairs = [(_add(x, y, alpha=alpha), jaten._aten_add(x, y, alpha=alpha)),
                 (_sub(x, y, alpha), jaten._aten_sub(x, y, alpha)),
                 (_add(x, 2.0), jaten._aten_add(x, 2.0)), (_sub(2.0, x), jaten._aten_sub(2.0, x))]
        for ours, theirs in pairs:
            assert _same(ours, theirs)
    assert _same(_neg(x), jaten._aten_neg(x))
    bools = jnp.asarray([True, False])
    assert _same(_add(bools, bools), jaten._aten_add(bools, bools))  # torchax's own lowering kept


def _unit_factor(eqn) -> float | None:
    """1.0 or -1.0 when ``eqn`` multiplies by that literal, else None."""
    if eqn.primitive.name != "mul":
        return None
    for v in eqn.invars:
        if type(v).__name__ == "Literal" and float(np.asarray(v.val)) in (1.0, -1.0):
            return float(np.asarray(v.val))
    return None


def _torchax_units(eqns) -> list:
    """What torchax's own lowerings emit: ``-1 * x`` (neg), and ``y * 1`` feeding an add / sub (alpha)."""
    negs = [e for e in eqns if _unit_factor(e) == -1.0]
    ones = {id(e.outvars[0]) for e in eqns if _unit_factor(e) == 1.0}
    alphas = [e for e in eqns if e.primitive.name in ("add", "sub") and any(id(v) in ones for v in e.invars)]
    return negs + alphas


@contextlib.contextmanager
def _torchax_own_lowerings():
    """torchax's own add / sub / neg in its default environment for a while (its registry keeps them)."""
    import torchax
    from torchax.ops import ops_registry

    env = torchax.default_env()
    ours = {op: env._ops[op] for op in ops_registry.all_aten_ops if op in env._ops and env._ops[op].is_user_defined}
    env._ops.update({op: ops_registry.all_aten_ops[op] for op in ours})
    try:
        yield
    finally:
        env._ops.update(ours)


def test_a_patched_bf16_forward_traces_no_multiply_by_one_and_one_negation_per_rotary():
    """The whole tiny bf16 forward with the rope patch, as the jax backend traces it: none of
    torchax's multiplies by +-1 (alpha, neg; diffusers' own timestep ``scale * emb`` with scale 1 is
    the model's), one ``neg`` for q and one for k per block (rotate-half's, the form tt-mlir's RoPE
    fusion matches), and at least two casts fewer per block than vanilla's interleaved rotary (q
    and k cast once each)."""
    from wan_sharding import shard_dit_specs
    from wan_sharding.backends.jax import JaxBackend
    from wan_sharding.mesh import mesh_from_preset

    install_lean_lowerings()
    dit = build_dit("t2v-a14b", dtype=torch.bfloat16, num_layers=1)  # the counts scale with the blocks
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14), dtype=torch.bfloat16)

    def trace(names):
        with apply_patches(dit, names, mesh="1x4"):
            backend = JaxBackend(mesh_from_preset("1x4"), devices=jax.devices()[:4])
            placed = backend.place(dit, shard_dit_specs(dit, "1x4"))
            jargs, jkwargs = backend._device_inputs((), inputs)
            return equations(jax.make_jaxpr(backend.jax_forward(dit))(placed, jargs, jkwargs).jaxpr)

    with stock_rotary_in_bf16():
        vanilla = trace([])
    patched = trace(["rope", "rope_tables"])
    assert not _torchax_units(vanilla) and not _torchax_units(patched)
    with _torchax_own_lowerings():  # the control: torchax's own add / neg emit them, every block
        assert len(_torchax_units(trace(["rope", "rope_tables"]))) >= 3 * dit.config.num_layers
    blocks = dit.config.num_layers
    assert sum(e.primitive.name == "neg" for e in patched) == 2 * blocks
    casts = lambda eqns: sum(e.primitive.name == "convert_element_type" for e in eqns)  # noqa: E731
    # vanilla (interleaved): x1, x2 each cast for both products of q and of k; the patch: q and k once
    assert casts(vanilla) - casts(patched) >= 2 * blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tables", [torch.float32, torch.float64])
def test_heads_first_rotate_half_is_the_interleaved_rotary_permuted_bit_for_bit(dtype, tables):
    """The ``rope`` patch's rotary (heads first, rotate-half, tables ``[c | c]`` / ``[s | s]``) on q laid
    out in halves gives diffusers' interleaved rotary's values, permuted the same way, bit for bit."""
    x = torch.randn(1, 50, 4, 16).to(dtype)
    x[0, 0, 0, :4] = torch.tensor([-0.0, float("inf"), 0.0, -float("inf")])
    c, s = torch.randn(1, 50, 1, 8).to(tables), torch.randn(1, 50, 1, 8).to(tables)
    perm = half_layout(16)
    before = apply_rotary(x, c.repeat_interleave(2, -1), s.repeat_interleave(2, -1))[..., perm]
    q, k = heads_first_rotary(x[..., perm], x[..., perm].clone(), torch.cat([c, c], -1), torch.cat([s, s], -1))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for after in (q, k):
        assert after.dtype == dtype and after.shape == x.shape
        assert torch.equal(before.view(bits), after.contiguous().view(bits))
