"""Argument roles, marked the way Tenstorrent's own frontends mark them before tt-mlir sees a graph.

On hardware, tt-xla tells tt-mlir what each argument of the step's program is: a **parameter** (a
weight), a **constant** (an unmutated buffer, a tensor baked into the graph) or an **input** (what
changes every call). tt-mlir hoists everything computed from parameters and constants alone (tile
layout of weights, bias reshapes, slices of tables) into const-eval functions that run once when the
program is loaded, not in every step. An unmarked argument counts as an input.

Two mechanisms, both read from tenstorrent/tt-xla at commit ``95c1c1ce7`` (2026-08-21), and both
accepted by the ``jax-tt-plugin`` 0.1.3 this package pins (its ``libtt.so`` holds the same frontend
pass; ``docs/compile-hardware.md``):

- **torch** (``python_package/tt_torch/backend/passes.py::insert_argument_type_markers``,
  ``custom_ops.py::mark_argument_attributes``): every lifted argument of the exported graph goes
  through ``torch.ops.tt.mark_argument_attributes(x, argument_type, name)`` before its first use, a
  StableHLO ``custom_call @tt.mark_argument`` with ``mhlo.frontend_attributes =
  {ttcore.argument_type, ttir.name}`` (tensors of rank < 3 reshaped to rank 3 around it). The roles
  follow the export signature: parameters ``parameter``, buffers ``constant`` (``input`` when the
  forward mutates them), constant tensors ``constant``, user inputs ``input``.
  :class:`XlaArgumentMarks` does the same in a torch-xla trace.
- **JAX** (``python_package/jax_plugin_tt/monkeypatch.py``, ``mark_weight``): a primitive lowered to
  ``func.call @tt.mark_<...>(x) {ttcore.argument_type = "parameter"}`` of a private identity
  function; tt-xla applies it to every weight of a flax model. :func:`mark_jax` is that primitive with
  the role as a parameter; :func:`mark_jax_arguments` marks every argument of the torchax forward.

tt-xla's PJRT frontend pass (``pjrt_implementation/.../frontend_passes/shlo_input_role_propagation.cc``)
moves either form onto the entry function's arguments (``ttcore.argument_type`` and ``ttir.name``
argument attributes), removes the markers and gives every unmarked argument ``input``. The plugin
writes the module before that pass (``irs/shlo_*.mlir``: the markers) and after it
(``irs/shlo_frontend_*.mlir``: the argument attributes); :func:`argument_types` reads the latter.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Callable, Mapping

import torch
from torch.utils._pytree import tree_flatten

from .ttnn_ir import argument_roles_by_function

PARAMETER, CONSTANT, INPUT = "parameter", "constant", "input"
ROLES = (PARAMETER, CONSTANT, INPUT)
ARGUMENT_TYPE_ATTR = "ttcore.argument_type"  # the role, on the marker and then on the argument
NAME_ATTR = "ttir.name"  # the argument's name (torch path)
MARK_TARGET = "tt.mark_argument"  # the torch path's custom call
MARK_FUNCTION_PREFIX = "tt.mark_"  # the JAX path's private identity functions


def argument_roles(model: torch.nn.Module) -> dict[str, str]:
    """``{name: role}`` for every parameter (``parameter``) and buffer (``constant``) of ``model``,
    non-persistent buffers included: what tt-xla's export signature gives a forward that mutates
    no buffer (the Wan DiT's does not)."""
    roles = {name: PARAMETER for name, _ in model.named_parameters()}
    roles.update({name: CONSTANT for name, _ in model.named_buffers()})
    return roles


# ------------------------------------------------------------------------------------------ JAX


_JAX_PRIMITIVE: Any = None


def _jax_primitive() -> Any:
    """The ``tt_mark_argument`` primitive: identity on values, lowered as tt-xla's ``mark_weight``
    (a ``func.call`` of a private identity function carrying ``ttcore.argument_type``)."""
    global _JAX_PRIMITIVE
    if _JAX_PRIMITIVE is not None:
        return _JAX_PRIMITIVE
    from jax.extend import core
    from jax.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func as func_dialect

    prim = core.Primitive("tt_mark_argument")
    prim.def_impl(lambda x, *, argument_type: x)
    prim.def_abstract_eval(lambda x, *, argument_type: x)

    def lowering(ctx: Any, x: Any, *, argument_type: str) -> list:
        ttype = mlir.aval_to_ir_type(ctx.avals_in[0])
        module = ctx.module_context
        name = f"{MARK_FUNCTION_PREFIX}{'x'.join(map(str, ctx.avals_in[0].shape))}_{ctx.avals_in[0].dtype}"
        with ir.InsertionPoint.at_block_begin(module.module.body):
            fn = func_dialect.FuncOp(name, ir.FunctionType.get([ttype], [ttype]))
        fn.attributes["sym_visibility"] = ir.StringAttr.get("private")
        name = ir.StringAttr(module.symbol_table.insert(fn)).value  # made unique if taken
        with ir.InsertionPoint(fn.add_entry_block()):
            func_dialect.ReturnOp([fn.arguments[0]])
        call = func_dialect.CallOp([ttype], ir.FlatSymbolRefAttr.get(name), [x])
        call.attributes[ARGUMENT_TYPE_ATTR] = ir.StringAttr.get(argument_type)
        return list(call.results)

    mlir.register_lowering(prim, lowering, cacheable=False)
    _JAX_PRIMITIVE = prim
    return prim


def mark_jax(x: Any, role: str) -> Any:
    """``x`` marked with ``role`` (:data:`ROLES`) for tt-mlir; the identity wherever it runs."""
    if role not in ROLES:
        raise ValueError(f"unknown argument role {role!r}; choose one of {', '.join(ROLES)}")
    return _jax_primitive().bind(x, argument_type=role)


def mark_jax_arguments(forward: Callable[[dict, tuple, dict], Any],
                       roles: Mapping[str, str]) -> Callable[[dict, tuple, dict], Any]:
    """``forward(state, args, kwargs)`` (:meth:`~wan_sharding.backends.jax.JaxBackend.jax_forward`)
    with every argument marked first: each state entry with its role in ``roles`` (a name missing
    there is an error, not an input by default), every array of ``args`` / ``kwargs`` an input."""
    import jax

    def marked(state: dict, args: tuple, kwargs: dict) -> Any:
        missing = sorted(set(state) - set(roles))
        if missing:
            raise ValueError(f"no argument role for {missing[:5]}")
        state = {k: mark_jax(v, roles[k]) for k, v in state.items()}
        args, kwargs = jax.tree.map(lambda v: mark_jax(v, INPUT) if isinstance(v, jax.Array) else v, (args, kwargs))
        return forward(state, args, kwargs)

    return marked


# ----------------------------------------------------------------------------------- torch-xla


def mark_xla(tensor: torch.Tensor, role: str, name: str) -> torch.Tensor:
    """``tensor`` through ``custom_call @tt.mark_argument`` with the role and name, as tt-xla's
    ``torch.ops.tt.mark_argument_attributes`` writes it (rank < 3 reshaped to rank 3 around the call,
    a workaround tt-xla keeps for torch-xla's custom calls on small ranks; the reshapes fold)."""
    from torch_xla.experimental.stablehlo_custom_call import stablehlo_custom_call

    if role not in ROLES:
        raise ValueError(f"unknown argument role {role!r}; choose one of {', '.join(ROLES)}")
    shape = list(tensor.shape)
    x = tensor.reshape([1] * (3 - len(shape)) + shape) if len(shape) < 3 else tensor
    out = stablehlo_custom_call([x], MARK_TARGET, [x.shape], [x.dtype],
                                frontend_attributes={ARGUMENT_TYPE_ATTR: role, NAME_ATTR: name})
    return out.reshape(shape) if len(shape) < 3 else out


_IN_PLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow",
                                                "and", "or", "xor", "lshift", "rshift")} | {"__setitem__"}


def _in_place(func: Any) -> bool:
    """Whether a torch function writes into its first argument (``add_``, ``copy_``, ``+=``, ``x[i] = ...``)."""
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


class XlaArgumentMarks(torch.overrides.TorchFunctionMode):
    """Within ``with XlaArgumentMarks(model, inputs):``, every device tensor a torch-xla trace reads
    from outside the graph is marked before its first use (:func:`mark_xla`) and every later use
    reads the marked value, as tt-xla's pass does on the exported graph: ``model``'s parameters
    ``parameter``, its buffers ``constant``, ``inputs`` ``input``, and any other device data (a
    table a patch computed once and keeps on the device) ``constant``, as the export signature has
    a tensor baked into the graph.

    Tensors are marked where a torch function reads them or, for device data a torch function
    makes inside the trace (a transfer), where it is made, since its first use may be no torch
    function (a sharding constraint). A tensor read only by torch-xla's own calls and made before
    the trace would stay unmarked: :func:`argument_types` on the compiled module shows any such
    argument as an extra ``input``.

    A buffer or input changed in place is left unmarked there and listed in ``mutated`` (tt-xla
    marks a mutated buffer ``input``; the Wan DiT mutates none). ``counts``: markers by role.
    Enter it after (inside) the composites' mode, so a composite's operands are the marked values.
    """

    def __init__(self, model: torch.nn.Module, inputs: Mapping[str, Any]):
        super().__init__()
        import torch_xla

        self._id = torch_xla._XLAC._xla_get_tensor_id
        self._debug = torch_xla._XLAC._get_xla_tensor_debug_info
        self._roles: dict[int, tuple[str, str]] = {}  # tensor id -> (role, name)
        for name, t in model.named_parameters():
            self._roles[self._id(t)] = (PARAMETER, name)
        for name, t in model.named_buffers():
            self._roles[self._id(t)] = (CONSTANT, name)
        for name, value in inputs.items():
            # an input may be a structure of tensors (prompt_kv's prompt state: {block: (K, V)}),
            # each of its tensors an input, as in tt-xla's export signature
            leaves, _ = tree_flatten(value)
            for i, t in enumerate(leaves):
                self._roles[self._id(t)] = (INPUT, name if len(leaves) == 1 else f"{name}.{i}")
        self._marked: dict[int, torch.Tensor] = {}  # tensor id -> its marked value
        self._plain: set[int] = set()  # ids of tensors computed in the graph (nothing to mark)
        self.counts: Counter[str] = Counter()
        self.mutated: list[str] = []

    def _device_data(self, t: torch.Tensor) -> bool:
        # Data on the device, not a graph node: an `xla::device_data` IR node, or no IR at all.
        info = self._debug(t)
        return "xla::device_data" in info or "\nIR: None" in info

    def _marked_value(self, t: Any) -> Any:
        # Plain tensors only: torch-xla's own wrappers (XLAShardedTensor) hold no data of their own.
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "xla":
            return t
        tid = self._id(t)
        if tid in self._marked:
            return self._marked[tid]
        if tid in self._plain:
            return t
        if tid in self._roles:
            role, name = self._roles[tid]
        elif self._device_data(t):
            role, name = CONSTANT, f"constant_{self.counts[CONSTANT]}"
        else:
            self._plain.add(tid)
            return t
        out = mark_xla(t, role, name)
        self.counts[role] += 1
        self._marked[tid] = out
        self._plain.add(self._id(out))
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch.utils._pytree import tree_map

        kwargs = kwargs or {}
        if _in_place(func) and args and type(args[0]) in (torch.Tensor, torch.nn.Parameter) \
                and args[0].device.type == "xla":
            target = self._roles.get(self._id(args[0]))
            if target is not None and target[0] != PARAMETER and target[1] not in self.mutated:
                self.mutated.append(target[1])
            rest, kwargs = tree_map(self._marked_value, (args[1:], kwargs))
            return func(args[0], *rest, **kwargs)
        args, kwargs = tree_map(self._marked_value, (args, kwargs))
        # A transfer inside the trace (a table a patch moves to the device the first time) is marked
        # where it is made: its first use may be no torch function (a sharding constraint).
        return tree_map(self._marked_value, func(*args, **kwargs))


# -------------------------------------------------------------------------- what tt-mlir received

def argument_types(text: str) -> dict[str, int]:
    """``{role: count}`` over the entry function ``@main``'s arguments
    (:func:`argument_roles_by_function`): the roles tt-mlir compiled with."""
    counts = Counter(argument_roles_by_function(text).get("main", {}).values())
    return {r: counts[r] for r in ROLES if counts[r]}


def markers(stablehlo_text: str) -> dict[str, int]:
    """``{role: count}`` of the argument markers in a module as a frontend hands it over (either
    form: ``custom_call @tt.mark_argument`` or ``call @tt.mark_...``)."""
    counts: Counter[str] = Counter()
    for line in stablehlo_text.splitlines():
        if MARK_TARGET in line or f"@{MARK_FUNCTION_PREFIX}" in line and "call" in line:
            hit = re.search(r'ttcore\.argument_type = "(\w+)"', line)
            if hit:
                counts[hit.group(1)] += 1
    return {r: counts[r] for r in ROLES if counts[r]}
