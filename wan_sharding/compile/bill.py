"""Read a parsed TTNN module against the design: per-block collective bill, tile alignment, what
padding costs.

The parsing is :mod:`wan_sharding.compile.ttnn_ir`'s; this module interprets what it found:

- the **per-block bill**: source locations in the TTNN text are Python call sites, not module
  names, so collectives cannot be attributed to a block by reading one module. :func:`per_block_bill`
  takes the difference of two compiles that differ only in the number of blocks;
- the **design bill** (:func:`design_bill`, ``docs/design.md``) and how a measured bill departs
  from it (:func:`bill_problems`);
- **tile alignment** of the per-device token dims split over SP (:func:`tile_alignment`,
  ``docs/tt-mlir-notes.md``);
- **what padding costs**: op counts split into per block and once per forward (:func:`split_ops`),
  and the padded graph against the same graph unpadded (:func:`padding_cost`);
- **what crosses hosts** on a mesh of several (:func:`host_link_bytes`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..mesh import TILE, MeshSpec, as_mesh_spec
from ..systems import RING_KINDS, HostCuts
from .ttnn_ir import Collective, Op, TTNNModule, format_bytes, ttir_attention

# Ops that only move data (no arithmetic): what a padding mode may add.
DATA_MOVEMENT_OPS = ("slice_static", "pad", "concat", "reshape", "permute", "repeat", "to_layout",
                     "typecast", "where", "full", "rows_scatter", "embedding", "transpose")


def axis_name(axis: int | None, names: tuple[str, ...] | None) -> str | None:
    """The mesh axis name for a ``cluster_axis`` (``"axis<i>"`` when the names are not known)."""
    if axis is None:
        return None
    return names[axis] if names is not None and axis < len(names) else f"axis{axis}"


def _names(mesh: MeshSpec | str | None) -> tuple[str, ...] | None:
    return as_mesh_spec(mesh).axis_names if mesh is not None else None


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


def _whole(x: float, digits: int | None = None) -> float:
    """``x`` as an int when it is whole, else as it is (rounded to ``digits`` when given)."""
    if x == int(x):
        return int(x)
    return round(x, digits) if digits is not None else x


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
    names = _names(mesh)
    a = Counter(c.key() for c in shallow.collectives)
    b = Counter(c.key() for c in deep.collectives)
    sample = {c.key(): c for c in [*shallow.collectives, *deep.collectives]}
    entries, irregular = [], []
    for key in sorted(set(a) | set(b), key=str):
        diff = b[key] - a[key]
        c = sample[key]
        what = f"{c.kind} {c.payload} on {axis_name(c.cluster_axis, names)}"
        if diff < 0:
            irregular.append(f"{what}: {a[key]} with {shallow_blocks} blocks but {b[key]} with {deep_blocks}")
            continue
        if diff == 0:
            continue
        if diff % n:
            irregular.append(f"{what}: +{diff} over {n} blocks is not a whole number per block")
        entries.append(BillEntry(c.kind, axis_name(c.cluster_axis, names), c.size, _whole(diff / n),
                                 str(c.payload), c.bytes))
    entries.sort(key=lambda e: (e.kind, e.size, -e.bytes))
    ops = {}
    for name in set(shallow.ops) | set(deep.ops):
        if name == "deallocate":
            continue
        d = (deep.ops[name] - shallow.ops[name]) / n
        if d:
            ops[name] = _whole(d, 3)
    return BlockBill(entries, (shallow_blocks, deep_blocks), dict(sorted(ops.items(), key=lambda kv: -kv[1])),
                     irregular)


def base_depth(blocks: int) -> int:
    """The shallow depth compiled next to ``blocks`` for the per-block difference."""
    return 1 if blocks > 1 else 2


def no_bill(blocks: int, base: Any, unit: str = "block") -> dict[str, Any]:
    """A report's bill fields when the shallow twin (``base``, a CompileResult or ``None``) of a
    ``blocks``-deep compile did not compile: no bill, and why."""
    why = "was not run" if base is None else f"failed: {base.error}"
    return {"per_block": {}, "bill_ok": False,
            "bill_problems": [f"no per-{unit} bill: the {base_depth(blocks)}-{unit} compile {why}"]}


def bill_from_files(shallow_path: str | Path, deep_path: str | Path, shallow_blocks: int, deep_blocks: int,
                    mesh: MeshSpec | str | None = None) -> BlockBill:
    """:func:`per_block_bill` on two exported TTNN files."""
    return per_block_bill(TTNNModule.from_file(shallow_path), TTNNModule.from_file(deep_path),
                          shallow_blocks, deep_blocks, mesh)


def design_bill(mesh: MeshSpec | str, prompt_kv: bool = False, lora_rank: int = 0) -> dict[tuple[str, str, str | None], int]:
    """The design's per-block bill (``docs/design.md``) as ``{(kind, size, axis): count}``.

    TP all-reduces after attn1.to_out, attn2.to_out and ffn.net[2] (3 large) and the RMSNorm stats
    all-reduces of norm_q / norm_k in both attentions (4 small); with SP > 1 also the all-gathers
    of self-attention K and V over SP (2 large): 3 large + 4 small on 1x4, 5 large + 4 small on
    2x4 and 8x4. ``prompt_kv``: the step of a model with that patch, whose cross-attention
    ``norm_k`` runs once per prompt instead (3 small). ``lora_rank``: a LoRA on the three
    row-parallel Linears adds their rank-sized partial sums (3 more all-reduces over TP, tokens x
    rank: small up to rank 4 by :func:`~.ttnn_ir.is_small`'s rule, large above; ``docs/lora.md``).
    """
    m = as_mesh_spec(mesh)
    bill: dict[tuple[str, str, str | None], int] = {}
    if m.tp > 1:
        bill[("all_reduce", "large", m.tp_axis)] = 3
        bill[("all_reduce", "small", m.tp_axis)] = 3 if prompt_kv else 4
        if lora_rank:
            key = ("all_reduce", "small" if lora_rank <= 4 else "large", m.tp_axis)
            bill[key] += 3
    if m.sp > 1:
        bill[("all_gather", "large", m.sp_axis)] = 2
    return bill


@dataclass(frozen=True)
class DesignBytes:
    """What the design's large collectives move, per device, in the model's compute dtype.

    ``sp_gather``: the result of one K or V all-gather over SP, (B, heads / TP, padded L, head_dim);
    ``tp_reduce``: one large all-reduce over TP, (B, padded L / SP, D). A collective that moves more
    (an f32 gather where bf16 was designed, a gather of something larger) costs hardware time that
    the counts alone do not show.
    """

    sp_gather: int
    tp_reduce: int
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"sp_gather": self.sp_gather, "tp_reduce": self.tp_reduce, "dtype": self.dtype}


def design_bytes(config: Mapping[str, Any], mesh: MeshSpec | str, padded_tokens: int, batch: int = 1,
                 dtype: str = "bf16") -> DesignBytes:
    """:class:`DesignBytes` for a model config (``models.config_for``), mesh and padded token count."""
    m = as_mesh_spec(mesh)
    elem = {"bf16": 2, "fp32": 4}[dtype]
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    return DesignBytes(sp_gather=batch * (heads // m.tp) * padded_tokens * head_dim * elem,
                       tp_reduce=batch * (padded_tokens // m.sp) * heads * head_dim * elem, dtype=dtype)


# Forms of the small per-block RMSNorm statistics collective over TP (see bill_problems).
NORM_STATS_KINDS = ("all_reduce", "all_gather", "distributed_rms_norm")


def bill_problems(bill: BlockBill, mesh: MeshSpec | str, budget: DesignBytes | None = None, lora_rank: int = 0,
                  prompt_kv: bool = False) -> list[str]:
    """Differences between a measured bill and :func:`design_bill` (``prompt_kv``: that patch's
    step); empty when they agree.

    With ``budget``, also every large SP all-gather or TP all-reduce that moves more bytes per
    device than the design's. The 4 small TP collectives of the RMSNorm statistics count in any of
    the forms :data:`NORM_STATS_KINDS` (the hardware composite set makes them tt-mlir's
    ``distributed_rms_norm``).
    """
    m = as_mesh_spec(mesh)
    want = design_bill(m, prompt_kv, lora_rank)
    got: Counter = Counter()
    for (kind, size, axis), n in bill.by_class().items():
        # The RMSNorm statistics over TP, in whichever form tt-mlir wrote them (plain math: an
        # all-reduce; its distributed RMSNorm: a stats all-gather or the fused op), are one class.
        if size == "small" and axis == m.tp_axis and kind in NORM_STATS_KINDS:
            kind = "all_reduce"
        got[(kind, size, axis)] += n
    problems = list(bill.irregular)
    for key in sorted(set(want) | set(got), key=str):
        w, g = want.get(key, 0), got.get(key, 0)
        if w != g:
            kind, size, axis = key
            problems.append(f"{size} {kind} over {axis}: {g:g} per block, design says {w}")
    if budget is not None:
        limits = {("all_gather", m.sp_axis): budget.sp_gather, ("all_reduce", m.tp_axis): budget.tp_reduce}
        for e in bill.entries:
            limit = limits.get((e.kind, e.axis))
            if e.size == "large" and limit is not None and e.bytes > limit:
                problems.append(f"large {e.kind} over {e.axis} moves {format_bytes(e.bytes)} per device "
                                f"({e.payload}); the design's {budget.dtype} minimum is {format_bytes(limit)}")
    return problems


def bill_ok(bill: BlockBill, mesh: MeshSpec | str, budget: DesignBytes | None = None) -> bool:
    """True when the measured per-block bill is exactly the design's (and within ``budget``)."""
    return not bill_problems(bill, mesh, budget)


def collective_table(module: TTNNModule, mesh: MeshSpec | str | None = None) -> list[dict[str, Any]]:
    """All collectives of a module grouped by kind, axis and per-device types, with counts."""
    names = _names(mesh)
    groups: dict[tuple, list[Collective]] = {}
    for c in module.collectives:
        groups.setdefault(c.key(), []).append(c)
    rows = []
    for cs in groups.values():
        c = cs[0]
        rows.append({"kind": c.kind, "axis": axis_name(c.cluster_axis, names), "size": c.size, "count": len(cs),
                     "payload": str(c.payload), "result": str(c.result), "bytes": c.bytes})
    rows.sort(key=lambda r: (r["kind"], -r["count"], -r["bytes"]))
    return rows


# ------------------------------------------------------------------------------ hosts


def host_link_bytes(collectives: Iterable[Collective], cuts: HostCuts) -> float:
    """Bytes the collectives move over the links between hosts, the whole mesh together
    (:meth:`~wan_sharding.systems.HostCuts.link_bytes`). The SP scatter moves nothing; an RMSNorm's
    statistics exchanged inside ``distributed_rms_norm`` (a value per row) are left out; a
    collective of another kind counts as an all-gather of its operand, as the planner charges it."""
    total = 0.0
    for c in collectives:
        if c.kind in ("mesh_partition", "distributed_rms_norm") or c.cluster_axis is None:
            continue
        if c.cluster_axis >= len(cuts.grid):
            continue
        n = cuts.grid[c.cluster_axis]
        kind = c.kind if c.kind in RING_KINDS else "all_gather"
        chunk = {"reduce_scatter": c.result.bytes, "all_reduce": c.payload.bytes / max(n, 1)}.get(kind, c.payload.bytes)
        total += cuts.link_bytes(kind, chunk, c.cluster_axis)
    return total


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

    On hardware the SP scatter needs whole 32-row tiles per device (unpadded 720p is rejected on a
    Galaxy; ``docs/tt-mlir-notes.md``); compile-only tt-mlir accepts any size, so this is the check
    that stands in for it. Vacuously aligned when nothing is split over SP (SP = 1).
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


# --------------------------------------------------------------------------- what padding costs


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
            per_block[name] = _whole(b, 3)
        if f:
            per_forward[name] = _whole(f, 3)
    return per_block, per_forward


def _minus(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -abs(kv[1])) if v}


def padding_cost(padded: tuple[TTNNModule, TTNNModule], unpadded: tuple[TTNNModule, TTNNModule],
                 blocks: tuple[int, int], fused_masks_per_block: float = 0) -> dict[str, dict[str, float]]:
    """Ops present only because of padding: the padded graph against the same graph unpadded, each
    compiled at the two depths ``blocks`` (shallow, deep). Per-block and per-forward op-count
    differences; a negative count is an op the padded graph has fewer of.

    ``fused_masks_per_block``: masked fused-attention calls per block (:func:`masked_attention_per_block`).
    Compile-only TTNN decomposes the fused SDPA, so each mask there is one ``add``; on hardware the
    mask is an operand of the one fused op. Those adds are reported apart, under ``in_fused_attention``.
    """
    pb_pad, pf_pad = split_ops(*padded, *blocks)
    pb_raw, pf_raw = split_ops(*unpadded, *blocks)
    per_block = _minus(pb_pad, pb_raw)
    inside: dict[str, float] = {}
    if fused_masks_per_block and per_block.get("add", 0) >= fused_masks_per_block:
        inside = {"add": fused_masks_per_block}
        per_block = _minus(per_block, inside)
    return {"per_block": per_block, "per_forward": _minus(pf_pad, pf_raw), "in_fused_attention": inside}


def program_split(shallow: TTNNModule, deep: TTNNModule, shallow_blocks: int, deep_blocks: int) -> dict[str, Any]:
    """What one block adds to the step's program (run every call) and to the const-eval functions
    (run once, at load), from the difference of two depths, with :data:`~.ttnn_ir.BOOKKEEPING_OPS`
    left out: ``runtime_ops_per_block`` / ``const_eval_ops_per_block`` (totals) and the same
    ``..._by_op``."""
    n = deep_blocks - shallow_blocks
    out: dict[str, Any] = {}
    for key, const_eval in (("runtime_ops_per_block", False), ("const_eval_ops_per_block", True)):
        a, b = shallow.program_ops(const_eval), deep.program_ops(const_eval)
        by_op = {k: _whole((b[k] - a[k]) / n, 3) for k in set(a) | set(b)}
        out[key] = _whole((sum(b.values()) - sum(a.values())) / n, 3)
        out[key + "_by_op"] = dict(sorted(((k, v) for k, v in by_op.items() if v), key=lambda kv: -kv[1]))
    return out


def masked_attention_per_block(shallow_ttir: str, deep_ttir: str, blocks: tuple[int, int]) -> float:
    """Fused attention calls with a mask operand that one block adds (two TTIR texts, two depths)."""
    masked = [sum(1 for op in ttir_attention(text) if len(op.operands) > 3) for text in (shallow_ttir, deep_ttir)]
    return _whole((masked[1] - masked[0]) / (blocks[1] - blocks[0]), 3)


# ------------------------------------------------------------------------------ fused attention


def attention_report(ops: Iterable[Op], mesh: MeshSpec | str, padded_tokens: int | None) -> dict[str, Any]:
    """The fused attention calls of a TTIR module against the design: Q split over SP (each device
    attends for its own L / SP queries), only K and V whole. ``calls`` groups them by per-device
    Q / K / V / mask types; ``q_split`` is False when some call has Q at another length than
    padded L / SP (e.g. gathered: the compiler would run full attention on every SP device)."""
    m = as_mesh_spec(mesh)
    groups: Counter = Counter()
    q_lengths = set()
    for op in ops:
        q, k, v, *mask = op.operands
        groups[(str(q), str(k), str(v), str(mask[0]) if mask else None)] += 1
        q_lengths.add(q.shape[-2])
    want = None if padded_tokens is None else padded_tokens // m.sp
    calls = [{"q": q, "k": k, "v": v, "mask": mask, "count": n} for (q, k, v, mask), n in groups.items()]
    q_split = want is None or q_lengths <= {want}
    return {"count": sum(groups.values()), "calls": calls, "q_tokens_per_device": sorted(q_lengths),
            "q_tokens_expected": want, "q_split": q_split}
