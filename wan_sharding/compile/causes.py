"""Each TTNN op of the step's program, by the part of the Wan block that causes it.

The per-block tables say *which* ops a block runs (``runtime_ops_per_block_by_op``); this module
says *why*: every op of the step's program (const-eval functions and bookkeeping left out) gets
one cause of :data:`CAUSES`, read off the op's name, its operand and result shapes and the data
flow between ops (who produces and who consumes each value). Nothing here knows the Wan config:
head splits are recognised by shape (``(..., H, Dh)`` with ``H * Dh`` the flat width), RoPE by its
table broadcast over the heads, adaLN by its ``(1, 1, D)`` modulation vectors.

The rules, in the order they are applied (a rule never reassigns an op an earlier one assigned):

1. ``weight preparation``: data movement (``to_layout``, ``typecast``, ``reshape``, slices) whose
   operands are all function arguments (not marked ``input``) or other weight preparation: what
   tt-mlir hoists into const-eval once the weights are marked ``parameter``. In an unmarked
   compile every argument is an input to tt-mlir, so every argument counts as a weight here.
2. by name: norms (``rms_norm_pre_all_gather`` and its statistics ``all_gather``, ``layer_norm``,
   ``batch_norm_*``, fused ``rms_norm``/``distributed_rms_norm``), SDPA (the fused op, ``softmax``,
   ``transpose`` and the activation-by-activation ``matmul`` of a decomposed SDPA), projections
   (``linear``, a ``matmul`` by a 2-D weight, ``gelu``), collectives (every other collective:
   K/V gathers over SP, row-parallel all-reduces over TP, SP scatters).
3. the norm's post-statistics math: forward from the statistics gather up to the multiply by the
   norm's 1-D weight, and the reshape that feeds the norm.
4. RoPE: the fused ``rotary_embedding`` (and the slice tt-mlir cuts its tile padding off with); a multiply by a table broadcast over the heads (``(1, L, 1,
   Dh)`` against ``(1, L, H, Dh)``, or heads first ``(1, 1, L, Dh)`` against ``(1, H, L, Dh)``), what
   feeds only RoPE ops backwards (casts, half-dim slices, negation, concat), and the adds and scalar
   multiplies of RoPE values forwards, with the scatter or select (and its layout changes) that
   diffusers' own interleaved RoPE lowers to.
5. heads: permutes, unflattens to ``(..., H, Dh)`` or of a fused QKV, the unbind slices of it, and
   the merge back to ``(L, H * Dh)`` (a reshape, or the fused ``concatenate_heads``); SDPA: a decomposed SDPA's scale multiply and key-mask add.
6. adaLN: elementwise ops on ``(1, 1, D)``/``(1, 6, D)`` vectors (the table plus the time
   embedding, ``1 + scale``), their reshapes to ``(D,)`` (a LayerNorm's weight and bias, the
   ``adaln_norm`` patch), and the modulation of a normed activation by them.
7. residuals: the gate multiply of a block output, its scalar multiplies, the big+big adds, and the
   casts feeding them.
8. projections: reshapes next to a projection or a row-parallel all-reduce, and the bias add
   after it.
9. ``layout`` for any ``to_layout``/``typecast``/``to_memory_config`` left, ``other`` for the rest.

The rules were checked against a hand count of one block (torchax, 8x4, 480p, 190 ops; tests
in ``tests/test_frontends.py`` check the sums and the hand-checkable parts on a compiled model).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import groupby

from .ttnn_ir import BOOKKEEPING_OPS, COLLECTIVES, Op, TTNNModule

CAUSES = ("weight preparation", "norms", "RoPE", "heads", "SDPA", "projections", "adaLN", "residuals",
          "collectives", "layout", "other")

DATA_MOVEMENT = {"to_layout", "typecast", "reshape", "slice_static", "permute", "transpose", "concat",
                 "to_memory_config", "repeat", "pad"}
NORM_OPS = {"rms_norm_pre_all_gather", "rms_norm_post_all_gather", "rms_norm", "distributed_rms_norm", "layer_norm",
            "batch_norm_training", "batch_norm_inference", "group_norm"}


@dataclass
class Node:
    """One op of the step's program, linked to the ops it reads and those that read it."""

    op: Op
    inputs: list[bool]  # per operand: a function argument marked ``input``
    consumers: list["Node"] = field(default_factory=list, repr=False)
    producers: list["Node | None"] = field(default_factory=list, repr=False)  # None: a function argument
    cause: str | None = None

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def operands(self) -> tuple[str, ...]:
        return self.op.values

    @property
    def operand_types(self):
        return self.op.operands

    @property
    def out(self) -> tuple[int, ...]:
        return self.op.results[0].shape if self.op.results else ()

    def arg_shape(self, i: int) -> tuple[int, ...]:
        return self.op.operands[i].shape if i < len(self.op.operands) else ()


def step_functions(module: TTNNModule) -> list[list[Node]]:
    """The ops of each function of the step's program (const-eval functions and bookkeeping left
    out), with producers and consumers linked."""
    # the arguments marked ``input`` where the weights are marked ``parameter``: activations, never
    # weight preparation (unmarked, tt-mlir calls every argument an input)
    marked = "parameter" in module.argument_roles.get("main", {}).values()
    ops = [op for op in module.op_list if not op.const_eval and op.name not in BOOKKEEPING_OPS]
    functions = []
    for function, group in groupby(ops, key=lambda op: op.function):
        roles = module.argument_roles.get(function, {})
        inputs = {f"%arg{i}" for i, r in roles.items() if r == "input"} if marked else set()
        nodes = [Node(op, [v in inputs for v in op.values]) for op in group]
        link(nodes)
        functions.append(nodes)
    return functions


def link(nodes: list[Node]) -> None:
    """Fill each node's producers (None for a function argument or an op left out) and consumers."""
    by_value = {n.op.result: n for n in nodes if n.op.result}
    for n in nodes:
        n.producers = [by_value.get(v) for v in n.operands]
        for p in n.producers:
            if p is not None:
                p.consumers.append(n)


def _rank4_heads(shape: tuple[int, ...]) -> bool:
    return len(shape) >= 4 and shape[-2] > 1


def _vector(shape: tuple[int, ...]) -> bool:
    """A modulation vector: ``(1, 1, D)``, ``(1, 6, D)``, ``(1, D)`` or ``(D,)`` (a LayerNorm's weight or
    bias made of one): at most 6 rows of D."""
    if len(shape) == 1:
        return shape[0] > 1
    return len(shape) >= 2 and shape[-1] > 1 and all(d == 1 for d in shape[:-2]) and shape[-2] <= 6


def _table_broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """A rope table against q / k: 4-D, the same head dim, equal on the token dim and one of them 1 on
    the heads dim (``(1, L, 1, Dh)`` x ``(1, L, H, Dh)``, or heads first ``(1, 1, L, Dh)`` x ``(1, H, L,
    Dh)``)."""
    if not (len(a) == len(b) >= 4 and a[-1] == b[-1]):
        return False
    for heads, tokens in ((-2, -3), (-3, -2)):
        if a[tokens] == b[tokens] > 1 and a[heads] != b[heads] and 1 in (a[heads], b[heads]):
            return True
    return False


def _scalar(shape: tuple[int, ...]) -> bool:
    return all(d == 1 for d in shape)


def _big(shape: tuple[int, ...]) -> bool:
    """An activation: more than a handful of rows of features."""
    return len(shape) >= 2 and shape[-1] > 1 and max(shape[:-1], default=1) > 6


def _rows_cut(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    """``dst`` is ``src`` with fewer rows (dim -2) and nothing else changed."""
    return len(src) == len(dst) >= 2 and dst[-2] < src[-2] and src[:-2] + src[-1:] == dst[:-2] + dst[-1:]


def _head_split(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    """``dst`` splits ``src``'s last dim into (H, Dh) or (k, H*Dh) (an unflatten of heads or of a fused QKV)."""
    return len(dst) >= 4 and bool(src) and dst[-2] > 1 and src[-1] == dst[-1] * dst[-2]


def _head_merge(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    return len(src) >= 4 and len(dst) < len(src) and dst[-1] == src[-1] * src[-2] and src[-2] > 1


def classify(nodes: list[Node]) -> None:
    """Give every node of one function a cause (see the module's docstring for the rules)."""
    # 1. weight preparation: data movement of arguments (and of other weight preparation) only
    for n in nodes:
        if n.name in DATA_MOVEMENT and n.operands and all(
                (p is None and not is_input) or (p is not None and p.cause == "weight preparation")
                for p, is_input in zip(n.producers, n.inputs or [False] * len(n.producers))):
            n.cause = "weight preparation"
    weightish = lambda p: p is None or p.cause == "weight preparation"  # noqa: E731
    # 2. by name
    for n in nodes:
        if n.cause:
            continue
        if n.name in NORM_OPS:
            n.cause = "norms"
        elif n.name == "all_gather" and any(p is not None and p.name == "rms_norm_pre_all_gather" for p in n.producers):
            n.cause = "norms"
        elif n.name == "rotary_embedding":
            n.cause = "RoPE"
        elif n.name in ("scaled_dot_product_attention", "scaled_dot_product_attention_decode", "softmax", "transpose"):
            n.cause = "SDPA"
        elif n.name in ("linear", "matmul"):
            two_d_weight = any(len(n.arg_shape(i)) == 2 and weightish(p) for i, p in enumerate(n.producers))
            n.cause = "projections" if two_d_weight or len(n.arg_shape(1)) == 2 else "SDPA"
        elif n.name in ("gelu", "silu"):
            n.cause = "projections"
        elif n.name in COLLECTIVES:
            n.cause = "collectives"
    # 3. the norm's post-statistics math, and the reshape feeding a norm
    for n in nodes:
        if n.name == "all_gather" and n.cause == "norms":
            _norm_chain(n)
    for n in nodes:
        if n.cause is None and n.name in ("reshape", "typecast") and any(
                c.name in NORM_OPS and c.name != "layer_norm" for c in n.consumers):
            n.cause = "norms"
    # 4. RoPE: the table multiply, then backwards and forwards
    for n in nodes:
        if n.cause is None and n.name == "multiply" and len(n.operand_types) == 2:
            if _table_broadcast(n.arg_shape(0), n.arg_shape(1)):
                n.cause = "RoPE"
    changed = True
    while changed:
        changed = False
        for n in reversed(nodes):
            if n.cause is None and n.name in ("typecast", "slice_static", "concat", "multiply", "neg") and n.consumers \
                    and all(c.cause == "RoPE" for c in n.consumers) and _rank4_heads(n.out):
                n.cause, changed = "RoPE", True
        for n in nodes:
            # tt-mlir pads a rotary_embedding whose rows are not a tile multiple (S % 32) and slices
            # its output back (RotaryEmbeddingOpRewritePattern): the slice-back is RoPE's
            if n.cause is None and n.name == "slice_static" and len(n.producers) == 1 and n.producers[0] is not None \
                    and n.producers[0].name == "rotary_embedding" and _rows_cut(n.arg_shape(0), n.out):
                n.cause, changed = "RoPE", True
            # diffusers' own RoPE writes the rotated halves back interleaved: a scatter (a select on
            # torch-xla), with the layout changes around it
            if n.cause is None and n.name in ("rows_scatter", "scatter", "where", "reshape", "to_layout",
                                              "typecast") and any(p is not None and p.cause == "RoPE"
                                                                  for p in n.producers):
                n.cause, changed = "RoPE", True
        for n in nodes:
            if n.cause is None and n.name in ("add", "subtract", "multiply", "typecast") and n.producers and any(
                    p is not None and p.cause == "RoPE" for p in n.producers) and all(
                    p is None or p.cause == "RoPE" or _scalar(t.shape)
                    for p, t in zip(n.producers, n.operand_types)):
                n.cause, changed = "RoPE", True
    # 5. heads
    for n in nodes:
        if n.cause:
            continue
        src = n.arg_shape(0)
        if (n.name == "permute" and len(n.out) >= 4) or n.name in ("concatenate_heads", "nlp_create_qkv_heads"):
            n.cause = "heads"
        elif n.name == "reshape" and (_head_split(src, n.out) or _head_merge(src, n.out)):
            n.cause = "heads"
        elif n.name == "slice_static" and (len(src) >= 5 or any(
                p is not None and p.cause == "projections" for p in n.producers)):
            n.cause = "heads"  # the unbind of a fused QKV (before or after its unflatten)
        elif n.name in ("multiply", "add") and any(p is not None and p.name in ("matmul", "multiply")
                                                   and p.cause == "SDPA" for p in n.producers):
            n.cause = "SDPA"  # a decomposed SDPA's softmax scale, and the key mask added to the scores
    # 6. adaLN: the modulation vectors and what they modulate
    for n in nodes:
        if n.cause is None and n.name in ("add", "multiply", "subtract", "typecast", "slice_static", "reshape") \
                and _vector(n.out) and not all(weightish(p) for p in n.producers):
            n.cause = "adaLN"
    for n in nodes:
        if n.cause is not None or n.name not in ("add", "multiply"):
            continue
        vec = [p for p, t in zip(n.producers, n.operand_types)
               if _vector(t.shape) and p is not None and p.cause == "adaLN"]
        big = [p for p, t in zip(n.producers, n.operand_types) if _big(t.shape)]
        if vec and big and all(p is not None and (_from_norm(p) or p.cause == "adaLN") for p in big):
            n.cause = "adaLN"
    for _ in range(2):  # (D,) vectors made of modulation ones: a LayerNorm's weight (1 + scale) or bias
        for n in nodes:
            if n.cause is None and len(n.out) == 1 and n.name in ("reshape", "typecast", "add", "multiply") and any(
                    p is not None and p.cause == "adaLN" for p in n.producers):
                n.cause = "adaLN"
    for n in reversed(nodes):
        if n.cause is None and n.name == "typecast" and n.consumers and all(c.cause == "adaLN" for c in n.consumers):
            n.cause = "adaLN"
    # 7. residuals: gates, their scalar multiplies, big + big adds, casts feeding them
    for n in nodes:
        if n.cause is None and n.name == "multiply" and any(
                _big(t.shape) for t in n.operand_types) and any(
                (_vector(t.shape) and p is not None and p.cause == "adaLN") or _scalar(t.shape)
                for p, t in zip(n.producers, n.operand_types)):
            n.cause = "residuals"
        elif n.cause is None and n.name == "add" and len(n.operand_types) == 2 and all(
                _big(t.shape) for t in n.operand_types):
            n.cause = "residuals"
    for n in reversed(nodes):
        if n.cause is None and n.name == "typecast" and any(c.cause == "residuals" for c in n.consumers):
            n.cause = "residuals"
    # 8. projections: reshapes next to them, the bias add after a row-parallel all-reduce
    proj = lambda m: m is not None and (m.cause == "projections" or (m.name == "all_reduce"))  # noqa: E731
    for _ in range(2):
        for n in nodes:
            if n.cause is None and n.name == "reshape" and (
                    any(proj(p) for p in n.producers) or (n.consumers and all(proj(c) for c in n.consumers))):
                n.cause = "projections"
            elif n.cause is None and n.name == "add" and any(proj(p) or (p is not None and p.cause == "projections")
                                                             for p in n.producers):
                n.cause = "projections"
    # 9. the rest
    for n in nodes:
        if n.cause is None:
            n.cause = "layout" if n.name in ("to_layout", "typecast", "to_memory_config") else "other"


def _norm_chain(gather: Node) -> None:
    """Forward from a statistics gather through the norm's math, up to the multiply by its weight."""
    todo = [gather]
    while todo:
        n = todo.pop()
        for c in n.consumers:
            if c.cause is not None:
                continue
            c.cause = "norms"
            weight_multiply = c.name == "multiply" and any(len(t.shape) == 1 for t in c.operand_types)
            if not weight_multiply:
                todo.append(c)


def _from_norm(n: Node) -> bool:
    """``n`` is a norm's output, or a cast of one."""
    while n is not None and n.name == "typecast":
        n = n.producers[0] if n.producers else None
    return n is not None and n.name in NORM_OPS


def step_causes(module: TTNNModule) -> Counter:
    """``Counter`` of causes over every op of the step's program of a TTNN module (const-eval
    functions and bookkeeping left out)."""
    out: Counter = Counter()
    for nodes in step_functions(module):
        classify(nodes)
        out.update(n.cause for n in nodes)
    return out


def per_block_causes(shallow: TTNNModule, deep: TTNNModule, shallow_blocks: int, deep_blocks: int) -> dict[str, float]:
    """What one block adds to the step's program, by cause: the difference of two depths' counts,
    in the order of :data:`CAUSES`."""
    a, b = step_causes(shallow), step_causes(deep)
    n = deep_blocks - shallow_blocks
    return {c: round((b[c] - a[c]) / n, 3) for c in CAUSES}
