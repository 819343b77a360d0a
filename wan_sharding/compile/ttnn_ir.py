"""Read the TTNN MLIR that tt-mlir exports: op histogram, collectives, per-block bill, tiles.

Facts about the text this relies on (``jax-tt-plugin`` 0.1.3):

- every op is written ``"ttnn.<name>"(operands) <{attributes}> : (operand types) -> result types``
  on one line;
- tensor types carry **per-device** shapes (``tensor<1x4096x5120xbf16, #layout>`` on an SP-8 mesh
  is 32768 tokens / 8);
- collectives name the mesh axis they run over with ``cluster_axis`` (the position in the mesh
  shape, so 0 = the SP axis and 1 = the TP axis of an ``(sp, tp)`` mesh), and the tensor dim with
  ``all_gather_dim`` / ``scatter_dim`` / ``dim``;
- tt-mlir reshapes all-reduce payloads to 4-D: the large ones are ``1x1xLxD``, the RMSNorm stats
  all-reduces ``1x1x1xL`` (one f32 per token).

Source locations are Python call sites, not module names, so collectives cannot be attributed to
a block by reading one module: :func:`per_block_bill` takes the difference of two compiles that
differ only in the number of blocks.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..mesh import TILE, MeshSpec, as_mesh_spec

# TTNN collective ops (tt-mlir's TTNN dialect). mesh_partition is the SP scatter (a local slice of
# a replicated tensor: no traffic, but it needs tile-aligned shards on hardware).
COLLECTIVES = (
    "all_gather", "all_reduce", "reduce_scatter", "mesh_partition", "mesh_shard", "all_to_all",
    "collective_permute", "collective_broadcast", "point_to_point",
)
# The op names worth a line of their own in reports (the padding cost shows in slice_static).
REPORTED_OPS = ("all_gather", "all_reduce", "reduce_scatter", "mesh_partition", "slice_static", "pad",
                "matmul", "linear", "softmax", "scaled_dot_product_attention", "reshape", "permute")

_DTYPE_BYTES = {
    "f64": 8, "f32": 4, "si32": 4, "ui32": 4, "i32": 4, "bf16": 2, "f16": 2, "si16": 2, "ui16": 2,
    "i16": 2, "si8": 1, "ui8": 1, "i8": 1, "i1": 1, "si64": 8, "ui64": 8, "i64": 8,
}
_OP = re.compile(r'"ttnn\.(\w+)"\(')
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)")
_ATTRS = re.compile(r"<\{(.*?)\}>")
_INT_ATTR = re.compile(r"\b(\w+) = (-?\d+) : [su]?i\d+")
_REDUCE = re.compile(r"reduce_type<(\w+)>")


class IRError(ValueError):
    """The text is not a TTNN module this parser understands."""


@dataclass(frozen=True)
class TensorType:
    """A per-device tensor type from the IR."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bytes(self) -> int:
        return self.elements * _DTYPE_BYTES.get(self.dtype, 4)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + ("x" if self.shape else "") + self.dtype


def _tensor_types(text: str) -> list[TensorType]:
    return [TensorType(tuple(int(s) for s in dims.split("x") if s), dt) for dims, dt in _TENSOR.findall(text)]


def is_small(t: TensorType) -> bool:
    """A payload with no feature dim: at most ~one value per token (or per sample), like the
    RMSNorm statistics all-reduces (``1x1x1xL`` f32) or the time embedding (``1x1x1xD``).

    Rule: elements <= 4 x the largest dim, so a vector stays small up to batch 4 while a
    ``tokens x features`` payload is large. Model-agnostic on purpose (no D or L needed)."""
    return t.elements <= 4 * max(t.shape, default=1)


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
        return "small" if is_small(self.payload) else "large"

    def key(self) -> tuple:
        return (self.kind, self.cluster_axis, self.dim, self.payload.shape, self.payload.dtype,
                self.result.shape)


@dataclass
class TTNNModule:
    """Parsed TTNN module: ``ops`` counts every ``"ttnn.<name>"(`` (const-eval functions too),
    ``collectives`` lists the collective ops in text order, ``mesh_shape`` is the device mesh."""

    ops: Counter
    collectives: list[Collective]
    mesh_shape: tuple[int, ...] | None = None
    path: str | None = None

    @classmethod
    def parse(cls, text: str, path: str | None = None) -> "TTNNModule":
        ops: Counter = Counter()
        colls: list[Collective] = []
        mesh_shape = None
        for lineno, line in enumerate(text.splitlines(), 1):
            names = _OP.findall(line)
            if not names:
                continue
            ops.update(names)
            kind = names[0]
            if mesh_shape is None and kind == "get_device":
                m = re.search(r"mesh_shape (\d+(?:x\d+)*)>", line)
                if m:
                    mesh_shape = tuple(int(s) for s in m.group(1).split("x"))
            if kind in COLLECTIVES:
                colls.append(_collective(kind, line, lineno))
        if not ops:
            raise IRError(f"no \"ttnn.<op>\"( in {path or 'the text'}: not a TTNN module")
        return cls(ops, colls, mesh_shape, path)

    @classmethod
    def from_file(cls, path: str | Path) -> "TTNNModule":
        return cls.parse(Path(path).read_text(), str(path))

    def histogram(self, skip: Iterable[str] = ("deallocate",)) -> dict[str, int]:
        """``{op name: count}``, most frequent first; deallocations are skipped by default."""
        drop = set(skip)
        return {k: v for k, v in self.ops.most_common() if k not in drop}

    def collective_counts(self) -> dict[str, int]:
        return dict(Counter(c.kind for c in self.collectives))


def _collective(kind: str, line: str, lineno: int) -> Collective:
    head, _, tail = line.partition(" : (")
    operands_txt, _, results_txt = tail.partition(") -> ")
    if not results_txt:  # unexpected layout: take all types on the line, last one is the result
        types = _tensor_types(line)
        operands, results = types[:-1], types[-1:]
    else:
        operands, results = _tensor_types(operands_txt), _tensor_types(results_txt)
    if not results:
        raise IRError(f"line {lineno}: cannot read the result type of ttnn.{kind}: {line.strip()[:200]}")
    attrs_m = _ATTRS.search(head)
    attrs = dict((k, int(v)) for k, v in _INT_ATTR.findall(attrs_m.group(1))) if attrs_m else {}
    red = _REDUCE.search(head)
    result = results[0]
    dim = next((attrs[k] for k in ("all_gather_dim", "scatter_dim", "dim", "split_dim") if k in attrs), None)
    if dim is not None and dim < 0:
        dim += len(result.shape)
    return Collective(kind, operands[0] if operands else None, result, attrs.get("cluster_axis"), dim,
                      red.group(1) if red else None, lineno)


# ------------------------------------------------------------------------------ per-block bill


@dataclass(frozen=True)
class BillEntry:
    """One kind of collective a block issues: ``count`` of them per block, each ``bytes`` per device."""

    kind: str
    axis: str | None  # mesh axis name ("sp", "tp"), from cluster_axis
    size: str  # "large" or "small"
    count: float
    payload: str  # per-device operand type, e.g. "1x4096x10x128xbf16"
    bytes: int  # per device, of the result

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": self.axis, "size": self.size, "count": self.count,
                "payload": self.payload, "bytes": self.bytes}


@dataclass
class BlockBill:
    """Collectives per transformer block, from two compiles of ``shallow`` and ``deep`` blocks.

    ``irregular`` lists differences that are not a whole multiple of the block difference or that
    shrink with depth: something other than the blocks changed between the two graphs.
    """

    entries: list[BillEntry]
    blocks: tuple[int, int]
    ops: dict[str, float] = field(default_factory=dict)  # every op name per block (deallocs skipped)
    irregular: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, float]:
        """``{collective kind: count per block}``, e.g. ``{'all_gather': 2, 'all_reduce': 7}``."""
        out: Counter = Counter()
        for e in self.entries:
            out[e.kind] += e.count
        return dict(out)

    def by_class(self) -> dict[tuple[str, str, str | None], float]:
        """``{(kind, size, axis): count per block}``: what :func:`bill_problems` compares."""
        out: Counter = Counter()
        for e in self.entries:
            out[(e.kind, e.size, e.axis)] += e.count
        return dict(out)

    def totals(self) -> dict[str, float]:
        """Large and small collectives per block: ``{'large': 5, 'small': 4}``."""
        out: Counter = Counter({"large": 0, "small": 0})
        for e in self.entries:
            out[e.size] += e.count
        return dict(out)

    def to_json(self) -> dict[str, Any]:
        return {"blocks": list(self.blocks), "counts": self.counts(), "totals": self.totals(),
                "entries": [e.to_json() for e in self.entries], "ops": self.ops, "irregular": self.irregular}


def _axis_name(axis: int | None, names: tuple[str, ...] | None) -> str | None:
    if axis is None:
        return None
    return names[axis] if names is not None and axis < len(names) else f"axis{axis}"


def per_block_bill(shallow: TTNNModule, deep: TTNNModule, shallow_blocks: int, deep_blocks: int,
                   mesh: MeshSpec | str | None = None) -> BlockBill:
    """The collectives one block adds: (deep - shallow) / (deep_blocks - shallow_blocks).

    Both modules must come from the same model, mesh, latent and padding with only the number of
    blocks changed. Collectives are matched by kind, axis, dim and per-device types.
    """
    if deep_blocks == shallow_blocks:
        raise ValueError("the two compiles need different block counts")
    if deep_blocks < shallow_blocks:
        shallow, deep, shallow_blocks, deep_blocks = deep, shallow, deep_blocks, shallow_blocks
    n = deep_blocks - shallow_blocks
    names = as_mesh_spec(mesh).axis_names if mesh is not None else None
    a = Counter(c.key() for c in shallow.collectives)
    b = Counter(c.key() for c in deep.collectives)
    sample = {c.key(): c for c in [*shallow.collectives, *deep.collectives]}
    entries, irregular = [], []
    for key in sorted(set(a) | set(b), key=str):
        diff = b[key] - a[key]
        c = sample[key]
        what = f"{c.kind} {c.payload} on {_axis_name(c.cluster_axis, names)}"
        if diff < 0:
            irregular.append(f"{what}: {a[key]} with {shallow_blocks} blocks but {b[key]} with {deep_blocks}")
            continue
        if diff == 0:
            continue
        if diff % n:
            irregular.append(f"{what}: +{diff} over {n} blocks is not a whole number per block")
        count = diff / n
        entries.append(BillEntry(c.kind, _axis_name(c.cluster_axis, names), c.size,
                                 int(count) if count == int(count) else count, str(c.payload), c.bytes))
    entries.sort(key=lambda e: (e.kind, e.size, -e.bytes))
    ops = {}
    for name in set(shallow.ops) | set(deep.ops):
        if name == "deallocate":
            continue
        d = (deep.ops[name] - shallow.ops[name]) / n
        if d:
            ops[name] = int(d) if d == int(d) else round(d, 3)
    return BlockBill(entries, (shallow_blocks, deep_blocks), dict(sorted(ops.items(), key=lambda kv: -kv[1])),
                     irregular)


def bill_from_files(shallow_path: str | Path, deep_path: str | Path, shallow_blocks: int, deep_blocks: int,
                    mesh: MeshSpec | str | None = None) -> BlockBill:
    """:func:`per_block_bill` on two exported TTNN files."""
    return per_block_bill(TTNNModule.from_file(shallow_path), TTNNModule.from_file(deep_path),
                          shallow_blocks, deep_blocks, mesh)


def design_bill(mesh: MeshSpec | str) -> dict[tuple[str, str, str | None], int]:
    """The design seed's per-block bill as ``{(kind, size, axis): count}``.

    TP all-reduces after attn1.to_out, attn2.to_out and ffn.net[2] (3 large) and the RMSNorm stats
    all-reduces of norm_q / norm_k in both attentions (4 small); with SP > 1 also the all-gathers
    of self-attention K and V over SP (2 large): 3 large + 4 small on 1x4, 5 large + 4 small on
    2x4 and 8x4.
    """
    m = as_mesh_spec(mesh)
    bill: dict[tuple[str, str, str | None], int] = {}
    if m.tp > 1:
        bill[("all_reduce", "large", m.tp_axis)] = 3
        bill[("all_reduce", "small", m.tp_axis)] = 4
    if m.sp > 1:
        bill[("all_gather", "large", m.sp_axis)] = 2
    return bill


def bill_problems(bill: BlockBill, mesh: MeshSpec | str) -> list[str]:
    """Differences between a measured bill and :func:`design_bill`; empty when they agree."""
    want = design_bill(mesh)
    got = bill.by_class()
    problems = list(bill.irregular)
    for key in sorted(set(want) | set(got), key=str):
        w, g = want.get(key, 0), got.get(key, 0)
        if w != g:
            kind, size, axis = key
            problems.append(f"{size} {kind} over {axis}: {g:g} per block, design says {w}")
    return problems


def bill_ok(bill: BlockBill, mesh: MeshSpec | str) -> bool:
    """True when the measured per-block bill is exactly the design's."""
    return not bill_problems(bill, mesh)


# ------------------------------------------------------------------------------ tile alignment


@dataclass(frozen=True)
class TokenDim:
    """A per-device token count where the IR splits or gathers the token dim over SP."""

    op: str
    size: int
    line: int

    @property
    def aligned(self) -> bool:
        return self.size % TILE == 0


def sp_token_dims(module: TTNNModule, mesh: MeshSpec | str) -> list[TokenDim]:
    """Per-device token dims of the SP-sharded tensors, read where they meet a collective over SP:
    the result of each ``mesh_partition`` (the scatter of ``(B, L, D)`` and the rope tables), the
    operand of each ``all_gather`` (K, V, the exit gather) and the result of each
    ``reduce_scatter``. Empty when the mesh has no SP axis larger than 1."""
    m = as_mesh_spec(mesh)
    if m.sp <= 1:
        return []
    sp_index = m.axis_names.index(m.sp_axis)
    out = []
    for c in module.collectives:
        if c.cluster_axis != sp_index or c.dim is None:
            continue
        if c.kind in ("mesh_partition", "reduce_scatter"):
            out.append(TokenDim(c.kind, c.result.shape[c.dim], c.line))
        elif c.kind == "all_gather" and c.operand is not None:
            out.append(TokenDim(c.kind, c.operand.shape[c.dim], c.line))
    return out


def tile_alignment(module: TTNNModule, mesh: MeshSpec | str) -> dict[str, Any]:
    """``{'aligned': bool, 'token_dims': sorted sizes, 'misaligned': [...], 'checked': n}``.

    On hardware the SP scatter needs whole 32-row tiles per device (the design seed: unpadded
    720p is rejected on Galaxy); compile-only tt-mlir accepts any size, so this is the check that
    stands in for it. Vacuously aligned when nothing is split over SP (SP = 1).
    """
    dims = sp_token_dims(module, mesh)
    bad = [d for d in dims if not d.aligned]
    return {
        "aligned": not bad,
        "token_dims": sorted({d.size for d in dims}),
        "misaligned": [f"{d.op} at line {d.line}: {d.size} tokens per device ({d.size % TILE} past a tile)"
                       for d in bad],
        "checked": len(dims),
    }


def collective_table(module: TTNNModule, mesh: MeshSpec | str | None = None) -> list[dict[str, Any]]:
    """All collectives of a module grouped by kind, axis and per-device types, with counts."""
    names = as_mesh_spec(mesh).axis_names if mesh is not None else None
    groups: dict[tuple, list[Collective]] = {}
    for c in module.collectives:
        groups.setdefault(c.key(), []).append(c)
    rows = []
    for key, cs in groups.items():
        c = cs[0]
        rows.append({"kind": c.kind, "axis": _axis_name(c.cluster_axis, names), "size": c.size, "count": len(cs),
                     "payload": str(c.payload), "result": str(c.result), "bytes": c.bytes})
    rows.sort(key=lambda r: (r["kind"], -r["count"], -r["bytes"]))
    return rows


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def select_ops(hist: Mapping[str, int], names: Iterable[str] = REPORTED_OPS) -> dict[str, int]:
    """The named ops of a histogram, zeros included (so a missing op reads as 0, not as absent)."""
    return {n: int(hist.get(n, 0)) for n in names}


# --------------------------------------------------------------------------- what padding costs

# Ops that only move data (no arithmetic): what a padding mode may add.
DATA_MOVEMENT_OPS = ("slice_static", "pad", "concat", "reshape", "permute", "repeat", "to_layout",
                     "typecast", "where", "full", "rows_scatter", "embedding", "transpose")


def split_ops(shallow: TTNNModule, deep: TTNNModule, shallow_blocks: int, deep_blocks: int,
              skip: Iterable[str] = ("deallocate",)) -> tuple[dict[str, float], dict[str, float]]:
    """``(per_block, per_forward)`` op counts: per block from the difference of two depths, per
    forward what the shallow graph has beyond its blocks. Deallocations are left out."""
    drop, n = set(skip), deep_blocks - shallow_blocks
    per_block, per_forward = {}, {}
    for name in (set(shallow.ops) | set(deep.ops)) - drop:
        b = (deep.ops[name] - shallow.ops[name]) / n
        f = shallow.ops[name] - shallow_blocks * b
        if b:
            per_block[name] = int(b) if b == int(b) else round(b, 3)
        if f:
            per_forward[name] = int(f) if f == int(f) else round(f, 3)
    return per_block, per_forward


def _minus(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -abs(kv[1])) if v}


def padding_cost(padded: tuple[TTNNModule, TTNNModule], unpadded: tuple[TTNNModule, TTNNModule],
                 blocks: tuple[int, int]) -> dict[str, dict[str, float]]:
    """Ops present only because of padding: the padded graph against the same graph unpadded, each
    compiled at the two depths ``blocks`` (shallow, deep). Per-block and per-forward op-count
    differences; a negative count is an op the padded graph has fewer of."""
    pb_pad, pf_pad = split_ops(*padded, *blocks)
    pb_raw, pf_raw = split_ops(*unpadded, *blocks)
    return {"per_block": _minus(pb_pad, pb_raw), "per_forward": _minus(pf_pad, pf_raw)}
