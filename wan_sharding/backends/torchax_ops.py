"""torchax lowerings of ``aten.add`` / ``aten.sub`` / ``aten.neg`` without a multiply by one.

torchax 0.0.13 lowers ``aten.add`` / ``aten.sub`` as ``x +/- y * alpha`` and ``aten.neg`` as
``-1 * x`` (``torchax/ops/jaten.py``): with alpha 1 that is a multiply by one in the StableHLO,
which tt-mlir 0.1.3 keeps (its TTNN module runs a ``multiply`` per such add: 7 per Wan block,
docs/compile-hardware.md). The replacements below give the same values, bit for bit, without it
(``y * 1`` is ``y`` and ``-1 * x`` is ``-x`` exactly for every non-NaN value), and fall back to
torchax's own lowering for anything else (another alpha, bool operands, a Python-scalar operand).
Every JAX backend installs them (:func:`install_lean_lowerings`).
"""

from __future__ import annotations

from typing import Any

def _number(x: Any) -> bool:
    import jax.numpy as jnp

    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.number)


def _alpha_one(y: Any, alpha: Any) -> bool:
    """Whether ``y * alpha`` is ``y`` itself, dtype included: alpha the int 1 (a weak type that
    keeps ``y``'s dtype), or the float 1.0 on a floating ``y`` (an integer ``y`` would turn float)."""
    import jax.numpy as jnp

    if not _number(y) or isinstance(alpha, bool):
        return False
    if isinstance(alpha, int):
        return alpha == 1
    return isinstance(alpha, float) and alpha == 1.0 and jnp.issubdtype(y.dtype, jnp.floating)


def _add(x: Any, y: Any, *, alpha: Any = 1) -> Any:
    import torch as _torch
    from torchax.ops import jaten, mappings

    if not _alpha_one(y, alpha):
        return jaten._aten_add(x, y, alpha=alpha)
    res = x + y
    if isinstance(x, float):  # as torchax's own lowering: a Python float operand gives the default dtype
        res = res.astype(mappings.t2j_dtype(_torch.get_default_dtype()))
    return res


def _sub(x: Any, y: Any, alpha: Any = 1) -> Any:
    from torchax.ops import jaten

    if isinstance(x, float) or not _alpha_one(y, alpha):
        return jaten._aten_sub(x, y, alpha)
    return x - y


def _neg(x: Any) -> Any:
    import jax.numpy as jnp
    from torchax.ops import jaten

    if _number(x) and (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.signedinteger)):
        return jnp.negative(x)
    return jaten._aten_neg(x)


_LEAN_LOWERINGS: list[bool] = []  # installed in this process


def install_lean_lowerings() -> None:
    """Give torchax's default environment the lowerings above for ``aten.add`` / ``aten.sub``
    (Tensor and Scalar overloads) and ``aten.neg``: the environment's operator table entry that
    torchax's ``Environment.override_op_definition`` writes, here for a JAX function (that method
    itself fails in torchax 0.0.13: it leaves ``Operator.is_view_op`` out). Once per process;
    every JAX backend calls it. Process-wide, like the environment itself: any torchax code in the
    process gets the same values without the multiply."""
    if _LEAN_LOWERINGS:
        return
    import torch as _torch
    import torchax
    from torchax.ops.ops_registry import Operator

    env = torchax.default_env()
    aten = _torch.ops.aten
    for op, impl in ((aten.add.Tensor, _add), (aten.add.Scalar, _add), (aten.sub.Tensor, _sub),
                     (aten.sub.Scalar, _sub), (aten.neg.default, _neg)):
        env._ops[op] = Operator(op, impl, is_jax_function=True, is_user_defined=True, needs_env=False,
                                is_view_op=False)
    _LEAN_LOWERINGS.append(True)
