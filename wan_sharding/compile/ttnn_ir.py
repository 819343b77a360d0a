"""Read the TTNN MLIR that tt-mlir exports: the package's one parser of that text.

Everything that reads a TTNN module goes through here: the compile reports and the design checks
(:mod:`wan_sharding.compile.bill`) and the planner's cost model (:mod:`wan_sharding.planner.ir_cost`).
The parser gives every op with its per-device operand and result tensor types and its integer and
boolean attributes (:class:`Op`), the collectives among them (:class:`Collective`), the op
histogram and the device mesh shape (:class:`TTNNModule`).

Facts about the text this relies on (``jax-tt-plugin`` 0.1.3; more in ``docs/tt-mlir-notes.md``):

- every op is written ``"ttnn.<name>"(operands) <{attributes}> : (operand types) -> result types``
  on one line;
- tensor types carry **per-device** shapes (``tensor<1x4096x5120xbf16, #layout>`` on an SP-8 mesh
  is 32768 tokens / 8);
- collectives name the mesh axis they run over with ``cluster_axis`` (the position in the mesh
  shape, so 0 = the SP axis and 1 = the TP axis of an ``(sp, tp)`` mesh), and the tensor dim with
  ``all_gather_dim`` / ``scatter_dim`` / ``dim``;
- tt-mlir reshapes all-reduce payloads to 4-D: the large ones are ``1x1xLxD``, the RMSNorm stats
  all-reduces ``1x1x1xL`` (one f32 per token);
- ``func.func`` lines open functions; the ``const_eval`` ones (``tt.function_type = "const_eval"``,
  named ``<entry>_const_eval_<n>``) are evaluated once when the program is loaded, not in every
  forward: what tt-mlir hoists there is computed from arguments marked ``parameter`` or
  ``constant`` alone (:mod:`.marking`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

# TTNN collective ops (tt-mlir's TTNN dialect). mesh_partition is the SP scatter (a local slice of
# a replicated tensor: no traffic, but it needs tile-aligned shards on hardware).
COLLECTIVES = (
    "all_gather", "all_reduce", "reduce_scatter", "mesh_partition", "mesh_shard", "all_to_all",
    "collective_permute", "collective_broadcast", "point_to_point",
    "distributed_rms_norm",  # RMSNorm with its statistics exchanged inside (tt-mlir's fused form)
)
# The op names worth a line of their own in reports (the padding cost shows in slice_static).
REPORTED_OPS = ("all_gather", "all_reduce", "reduce_scatter", "mesh_partition", "slice_static", "pad",
                "matmul", "linear", "softmax", "scaled_dot_product_attention", "reshape", "permute")

# Ops that compute nothing a step waits on: deallocations, buffer and trace bookkeeping, the host's
# creation of constant tensors. Left out of the "ops per block" counts (the basis of the per-block
# tables in results/hardware.json and docs/compile-hardware.md).
BOOKKEEPING_OPS = ("deallocate", "get_device", "empty", "write_tensor", "create_global_semaphore", "constant",
                   "full", "zeros", "ones", "begin_trace_capture", "end_trace_capture", "execute_trace",
                   "capture_or_execute_trace")

_DTYPE_BYTES = {
    "f64": 8, "f32": 4, "si32": 4, "ui32": 4, "i32": 4, "bf16": 2, "f16": 2, "si16": 2, "ui16": 2,
    "i16": 2, "si8": 1, "ui8": 1, "i8": 1, "i1": 1, "si64": 8, "ui64": 8, "i64": 8,
}
_OP = re.compile(r'"ttnn\.(\w+)"\(')
_TTIR_SDPA = re.compile(r'"ttir\.scaled_dot_product_attention"\(')
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)")
_INT_ATTR = re.compile(r"\b(\w+) = (-?\d+) : [su]?i\d+")
_BOOL_ATTR = re.compile(r"\b(\w+) = (true|false)\b")
_REDUCE = re.compile(r"reduce_type<(\w+)>")
_MESH_SHAPE = re.compile(r"mesh_shape (\d+(?:x\d+)*)>")
_FUNC = re.compile(r"func\.func (?:\w+ )?@([\w.$-]+)")
_SIGNATURE = re.compile(r"func\.func (?:\w+ )?@([\w.$-]+)\((.*?)\)\s*(?:->|attributes|\{)", re.S)
_ARG_TYPE = re.compile(r"ttcore\.argument_type = #ttcore\.argument_type<(\w+)>")
_RESULT = re.compile(r"^\s*(%[\w]+)(?::\d+)?\s*=")
_OPERANDS = re.compile(r'"(?:ttnn|ttir)\.\w+"\(([^)]*)\)')
_TTIR_OP = re.compile(r'"ttir\.(\w+)"\(')
_VALUE = re.compile(r"%\w+")
# Attributes that name the tensor dim a collective gathers, scatters or partitions.
_DIM_ATTRS = ("all_gather_dim", "scatter_dim", "dim", "split_dim")


class IRError(ValueError):
    """The text is not a TTNN module this parser understands."""


@dataclass(frozen=True)
class TensorType:
    """A per-device tensor type from the IR."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.elements * _DTYPE_BYTES.get(self.dtype, 4)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + ("x" if self.shape else "") + self.dtype


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def tensor_types(text: str) -> tuple[TensorType, ...]:
    """Every ``tensor<...>`` type in ``text``, in order."""
    return tuple(TensorType(tuple(int(s) for s in dims.split("x") if s), dt) for dims, dt in _TENSOR.findall(text))


def is_small(t: TensorType) -> bool:
    """A payload with no feature dim: at most ~one value per token (or per sample), like the
    RMSNorm statistics all-reduces (``1x1x1xL`` f32) or the time embedding (``1x1x1xD``).

    Rule: elements <= 4 x the largest dim, so a vector stays small up to batch 4 while a
    ``tokens x features`` payload is large. Model-agnostic on purpose (no D or L needed)."""
    return t.elements <= 4 * max(t.shape, default=1)


@dataclass(frozen=True)
class Op:
    """One TTNN op: its per-device operand and result types and its attributes.

    ``attrs`` holds the integer attributes (``cluster_axis``, ``all_gather_dim``, ...), ``flags``
    the boolean ones (``transpose_a``, ``transpose_b``, ...). ``const_eval``: the op sits in a
    function evaluated once at load time; ``function``: that function's name. ``typed``: the line
    had the ``(operands) -> results`` signature this parser expects.
    """

    name: str
    operands: tuple[TensorType, ...]
    results: tuple[TensorType, ...]
    attrs: Mapping[str, int]
    flags: Mapping[str, bool]
    line: int
    const_eval: bool = False
    typed: bool = True
    function: str = ""  # the enclosing func.func's name
    result: str | None = None  # the SSA value it defines (``%12``), within ``function``
    values: tuple[str, ...] = ()  # the SSA values it reads, in operand order (``%arg3`` for an argument)

    @property
    def transpose_a(self) -> bool:
        return bool(self.flags.get("transpose_a", False))

    @property
    def transpose_b(self) -> bool:
        return bool(self.flags.get("transpose_b", False))


def parse_op(line: str, lineno: int = 0, const_eval: bool = False, function: str = "") -> Op | None:
    """The op on one line of TTNN text, or None when the line has none."""
    m = _OP.search(line)
    if not m:
        return None
    return _typed_op(m.group(1), line, lineno, const_eval, function)


def _typed_op(name: str, line: str, lineno: int, const_eval: bool = False, function: str = "") -> Op:
    # head: `%r = "dialect.x"(%a) <{attributes}>`; only the attributes there carry `name = value`.
    head, _, tail = line.partition(" : (")
    operands_txt, arrow, results_txt = tail.partition(") -> ")
    attrs = {k: int(v) for k, v in _INT_ATTR.findall(head)}
    flags = {k: v == "true" for k, v in _BOOL_ATTR.findall(head)}
    result, operands = _RESULT.match(line), _OPERANDS.search(line)
    return Op(name, tensor_types(operands_txt), tensor_types(results_txt.split(" loc(")[0]), attrs, flags,
              lineno, const_eval, bool(arrow), function, result.group(1) if result else None,
              tuple(_VALUE.findall(operands.group(1))) if operands else ())


def ttir_attention(text: str) -> list[Op]:
    """The fused attention ops of a TTIR module (``"ttir.scaled_dot_product_attention"``), in text
    order, with their per-device operand types (query, key, value[, mask]). TTIR is the stage
    where the fused op still stands as one op: compile-only TTNN decomposes it (matmul, softmax,
    matmul)."""
    return [_typed_op("scaled_dot_product_attention", line, lineno)
            for lineno, line in enumerate(text.splitlines(), 1) if _TTIR_SDPA.search(line)]


def ttir_ops(text: str) -> list[Op]:
    """Every op of a TTIR module, in text order, with its types, integer attributes, the SSA value it
    defines and the values it reads (within its ``func.func``, ``function``)."""
    out, function = [], ""
    for lineno, line in enumerate(text.splitlines(), 1):
        f = _FUNC.search(line)
        if f:
            function = f.group(1)
        m = _TTIR_OP.search(line)
        if m:
            out.append(_typed_op(m.group(1), line, lineno, function=function))
    return out


@dataclass(frozen=True)
class Collective:
    """One collective op: per-device operand and result types and what it runs over."""

    kind: str
    operand: TensorType | None
    result: TensorType
    cluster_axis: int | None
    dim: int | None  # gather / scatter / partition dim, normalised to be >= 0
    reduce: str | None
    line: int
    # RMSNorm statistics exchanged over TP: the all_gather after ``rms_norm_pre_all_gather`` (one
    # tile of per-row sums per device) or a fused ``distributed_rms_norm``. Small by what it
    # carries (one value per row), whatever its tile-padded shape says.
    stats: bool = False

    @property
    def bytes(self) -> int:
        """Bytes per device of the result (the gathered tensor for an all-gather)."""
        return self.result.bytes

    @property
    def payload(self) -> TensorType:
        """The tensor each device contributes (operand when known)."""
        return self.operand or self.result

    @property
    def size(self) -> str:
        return "small" if self.stats or is_small(self.payload) else "large"

    def key(self) -> tuple:
        return (self.kind, self.cluster_axis, self.dim, self.payload.shape, self.payload.dtype,
                self.result.shape)


def _collective(op: Op, line: str, stats: bool = False) -> Collective:
    operands, results = op.operands, op.results
    if not op.typed:  # unexpected layout: take all types on the line, the last one is the result
        types = tensor_types(line)
        operands, results = types[:-1], types[-1:]
    if not results:
        raise IRError(f"line {op.line}: cannot read the result type of ttnn.{op.name}: {line.strip()[:200]}")
    red = _REDUCE.search(line.partition(" : (")[0])
    result = results[0]
    dim = next((op.attrs[k] for k in _DIM_ATTRS if k in op.attrs), None)
    if dim is not None and dim < 0:
        dim += len(result.shape)
    return Collective(op.name, operands[0] if operands else None, result, op.attrs.get("cluster_axis"), dim,
                      red.group(1) if red else None, op.line, stats)


@dataclass
class TTNNModule:
    """Parsed TTNN module: ``ops`` counts every ``"ttnn.<name>"(`` (const-eval functions too),
    ``collectives`` lists the collective ops in text order, ``mesh_shape`` is the device mesh and
    ``op_list`` holds every op line as an :class:`Op`, in text order."""

    ops: Counter
    collectives: list[Collective]
    mesh_shape: tuple[int, ...] | None = None
    path: str | None = None
    op_list: list[Op] = field(default_factory=list, repr=False)
    # {function: {argument index: role}} (:func:`argument_roles_by_function`)
    argument_roles: dict[str, dict[int, str | None]] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, text: str, path: str | None = None) -> "TTNNModule":
        ops: Counter = Counter()
        colls: list[Collective] = []
        op_list: list[Op] = []
        mesh_shape = None
        const_eval, function = False, ""
        previous = None  # the last op before this one, deallocations left out
        for lineno, line in enumerate(text.splitlines(), 1):
            if "func.func" in line:
                const_eval = "const_eval" in line
                m = _FUNC.search(line)
                function = m.group(1) if m else ""
            names = _OP.findall(line)
            if not names:
                continue
            ops.update(names)
            op = parse_op(line, lineno, const_eval, function)
            assert op is not None
            op_list.append(op)
            if mesh_shape is None and op.name == "get_device":
                m = _MESH_SHAPE.search(line)
                if m:
                    mesh_shape = tuple(int(s) for s in m.group(1).split("x"))
            if op.name in COLLECTIVES:
                stats = op.name == "distributed_rms_norm" or (
                    op.name == "all_gather" and previous == "rms_norm_pre_all_gather")
                colls.append(_collective(op, line, stats))
            if op.name != "deallocate":
                previous = op.name
        if not ops:
            raise IRError(f"no \"ttnn.<op>\"( in {path or 'the text'}: not a TTNN module")
        return cls(ops, colls, mesh_shape, path, op_list, argument_roles_by_function(text))

    @classmethod
    def from_file(cls, path: str | Path) -> "TTNNModule":
        return cls.parse(Path(path).read_text(), str(path))

    def runtime_ops(self, skip: Iterable[str] = ()) -> list[Op]:
        """The ops a forward runs: the const-eval functions left out, and any op named in ``skip``."""
        drop = set(skip)
        return [op for op in self.op_list if not op.const_eval and op.name not in drop]

    def program_ops(self, const_eval: bool, skip: Iterable[str] = BOOKKEEPING_OPS) -> Counter:
        """``Counter`` of op names in the const-eval functions (``const_eval=True``: run once, at
        load) or in the rest (``False``: the step's program, run every call), ``skip`` left out."""
        drop = set(skip)
        return Counter(op.name for op in self.op_list if op.const_eval == const_eval and op.name not in drop)

    def histogram(self, skip: Iterable[str] = ("deallocate",)) -> dict[str, int]:
        """``{op name: count}``, most frequent first; deallocations are skipped by default."""
        drop = set(skip)
        return {k: v for k, v in self.ops.most_common() if k not in drop}

    def collective_counts(self) -> dict[str, int]:
        return dict(Counter(c.kind for c in self.collectives))


def argument_roles_by_function(text: str) -> dict[str, dict[int, str | None]]:
    """``{function: {argument index: role}}`` for every ``func.func`` of a module after tt-xla's
    frontend pass (the plugin's ``irs/shlo_frontend_*.mlir``; tt-mlir's TTIR and TTNN keep the
    attribute, and give the functions they make out of ``@main`` roles too); ``None`` for an
    argument without one."""
    out: dict[str, dict[int, str | None]] = {}
    for m in _SIGNATURE.finditer(text):
        pieces = re.split(r"%arg(\d+):", m.group(2))[1:]  # [index, its type and attributes, ...]
        roles: dict[int, str | None] = {}
        for index, rest in zip(pieces[::2], pieces[1::2]):
            hit = _ARG_TYPE.search(rest)
            roles[int(index)] = hit.group(1) if hit else None
        out[m.group(1)] = roles
    return out


def select_ops(hist: Mapping[str, int], names: Iterable[str] = REPORTED_OPS) -> dict[str, int]:
    """The named ops of a histogram, zeros included (so a missing op reads as 0, not as absent)."""
    return {n: int(hist.get(n, 0)) for n in names}
