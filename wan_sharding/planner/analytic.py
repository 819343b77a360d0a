"""Stage 1: the per-block bill and time of a plan from shapes and specs alone (no compiler).

Cheap enough to run on every legal candidate; its only job is to keep the best K for stage 2.
The bill follows the design's block (``docs/design.md``; :func:`wan_sharding.compile.bill.design_bill`)
and what tt-mlir was seen to emit for the other plan shapes (2x4 proxies, compile-only):

- TP > 1, replicated D: 3 all-reduces of (Ls, D) bf16 after the row-parallel projections, and 4
  small f32 all-reduces of RMSNorm statistics (3 of Ls values, 1 of the prompt's 512);
- sharded D (tt-metal's layout): each large all-reduce becomes a reduce-scatter, plus an
  all-gather of (Ls, D/TP) before the next column-parallel projection;
- SP > 1: all-gathers of self-attention K and V over SP, (Ls, heads/TP, 128) each; with the
  mask padding mode tt-mlir gathers V in f32 (seen in the 2x4 SP 4 compile), so V counts double;
- FSDP: every large weight of the block all-gathered over SP before use;
- a role spanning two mesh axes is lowered to one collective per axis, in mesh-axis order, each
  carrying the full payload (seen for TP 8 and SP 8 on 2x4): the bill lists one entry per axis.

Compute: matmul FLOPs (linear layers and both attentions, exact for the DiT block) at the chip's
effective peak, plus the DRAM traffic of everything else, ``Ls x (261 x D + 535 x D/TP)`` bytes per
block: coefficients fitted (least squares) to the per-block TTNN programs of five compiled 2x4
proxies (SP 2/TP 4 with and without FSDP, TP 8, SP 8, SP 4/TP 2), costed as in
:mod:`~wan_sharding.planner.ir_cost`; the fit is within 1% on each. The first term is the f32 LayerNorm / adaLN work on
the residual stream, which TP does not divide in the replicated layout; the second the per-head
work (RMSNorm, RoPE) that it does. The slice padding mode adds 2 K/V slice-backs per block at the
measured slice-back rate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..plan import ShardingPlan
from ..systems import HostCuts
from .hardware import Chip, Fabric, chunk_for, collective_seconds
from .ir_cost import Cost
from .bfp8 import BYTES_FACTOR as BFP8_BYTES_FACTOR
from .workload import BF16, F32, Workload

# Bytes of DRAM traffic per block per (token x feature) element, fitted to compiled TTNN IR.
RESIDUAL_BYTES_PER_ELEMENT = 261.0
PER_HEAD_BYTES_PER_ELEMENT = 535.0


@dataclass(frozen=True)
class BillItem:
    """``count`` collectives per block of one kind on one mesh axis, ``operand`` / ``result``
    bytes per device each."""

    kind: str
    axis: str
    count: int
    operand: float
    result: float
    what: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": self.axis, "count": self.count, "operand_mb": round(self.operand / 1e6, 3),
                "result_mb": round(self.result / 1e6, 3), "what": self.what}


def _per_axis(kind: str, axes: tuple[str, ...], plan: ShardingPlan, count: int, operand: float, result: float,
              what: str) -> list[BillItem]:
    """One item per mesh axis of a role, in mesh order (how tt-mlir lowers a multi-axis role)."""
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    ordered = [a for a in plan.axis_names if a in axes and sizes[a] > 1]
    items = []
    if kind == "all_gather":  # the gathered size grows axis by axis
        cur = operand
        for a in ordered:
            items.append(BillItem(kind, a, count, cur, cur * sizes[a], what))
            cur *= sizes[a]
    elif kind == "reduce_scatter":
        cur = operand
        for a in ordered:
            items.append(BillItem(kind, a, count, cur, cur / sizes[a], what))
            cur /= sizes[a]
    else:
        items = [BillItem(kind, a, count, operand, result, what) for a in ordered]
    return items


def block_bill(work: Workload, plan: ShardingPlan) -> list[BillItem]:
    """The collectives one transformer block issues under ``plan`` (see the module docstring)."""
    m = plan.mesh()
    sp, tp = m.sp, m.tp
    ls = work.padded_tokens(sp, plan.padding) // sp
    d_local = work.dim // tp
    bill: list[BillItem] = []
    if tp > 1:
        # the row-parallel outputs (and, sharded, the gathers feeding column-parallel layers): in
        # bfp8 when the workload asks for it (tt-xla's enable_activation_dtype_lowering)
        big = ls * work.dim * BF16 * (BFP8_BYTES_FACTOR if work.bfp8_collectives else 1.0)
        if plan.layout == "sharded":
            bill += _per_axis("reduce_scatter", plan.tp_axes, plan, 3, big, big / tp, "row-parallel outputs")
            bill += _per_axis("all_gather", plan.tp_axes, plan, 3, big / tp, big, "inputs of column-parallel layers")
        else:
            bill += _per_axis("all_reduce", plan.tp_axes, plan, 3, big, big, "attn1/attn2 to_out, ffn.net.2")
        bill += _per_axis("all_reduce", plan.tp_axes, plan, 3, ls * F32, ls * F32, "RMSNorm stats (video tokens)")
        bill += _per_axis("all_reduce", plan.tp_axes, plan, 1, work.prompt_tokens * F32, work.prompt_tokens * F32,
                          "RMSNorm stats (prompt)")
    if sp > 1:
        kv = ls * d_local * BF16
        bill += _per_axis("all_gather", plan.sp_axes, plan, 1, kv, kv * sp, "self-attention K")
        v = kv * (2 if plan.padding == "mask" else 1)  # f32 V with the mask mode
        bill += _per_axis("all_gather", plan.sp_axes, plan, 1, v, v * sp, "self-attention V")
        if plan.fsdp:
            w = work.block_weight_params() // tp * BF16
            bill += _per_axis("all_gather", plan.sp_axes, plan, 1, w / sp, w, "FSDP weights of the block")
    return bill


def block_flops(work: Workload, plan: ShardingPlan) -> float:
    """Matmul FLOPs of one block on one device."""
    m = plan.mesh()
    sp, tp = m.sp, m.tp
    lp = work.padded_tokens(sp, plan.padding)
    ls, d, p = lp // sp, work.dim, work.prompt_tokens
    lkv = work.tokens if plan.padding == "slice" else lp  # slice cuts K/V back to L
    linear = 2.0 * (ls * (6 * d * d + 2 * d * work.ffn) + p * 2 * d * d) / tp
    attention = 4.0 * ls * (lkv + p) * d / tp
    return linear + attention


def block_cost(work: Workload, plan: ShardingPlan, chip: Chip, fabric: Fabric, cuts: HostCuts | None = None) -> Cost:
    """Stage-1 seconds of one block on one device, by component (same shape as a compiled cost);
    with ``cuts``, also the bytes the block's collectives move between hosts."""
    m = plan.mesh()
    sp, tp = m.sp, m.tp
    lp = work.padded_tokens(sp, plan.padding)
    ls = lp // sp
    cost = Cost()
    cost.flops = block_flops(work, plan)
    cost.matmul = cost.flops / (chip.peak_tflops * 1e12 * chip.matmul_efficiency)
    resid = RESIDUAL_BYTES_PER_ELEMENT * ls * work.dim / (tp if plan.layout == "sharded" else 1)
    per_head = PER_HEAD_BYTES_PER_ELEMENT * ls * work.dim / tp
    cost.dram_bytes = resid + per_head
    cost.memory = cost.dram_bytes / (chip.dram_gbps * 1e9)
    if plan.padding == "slice" and lp != work.tokens:
        kv_slice = 2 * (lp + work.tokens) * (work.dim // tp) * BF16  # K and V, read + write
        cost.slice_back = kv_slice / (chip.slice_back_gbps * 1e9)
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    counts: Counter = Counter()
    for item in block_bill(work, plan):
        n = sizes[item.axis]
        axis = fabric.axes[plan.axis_names.index(item.axis)]
        chunk = chunk_for(item.kind, item.operand, item.result, n)
        one = collective_seconds(item.kind, chunk, n, axis, fabric)
        if cuts is not None:
            cost.cross_host_bytes += item.count * cuts.link_bytes(item.kind, chunk, plan.axis_names.index(item.axis))
        key = f"{item.kind}@{item.axis}"
        cost.comm[key] = cost.comm.get(key, 0.0) + item.count * one.seconds
        cost.comm_bytes[key] = cost.comm_bytes.get(key, 0.0) + item.count * item.result
        counts[key] += item.count
    cost.comm_counts = counts
    return cost


@dataclass
class Estimate:
    """Stage-1 (analytic) result for one candidate."""

    per_block: Cost
    seconds_per_forward: float
    bill: list[BillItem]

    def to_json(self) -> dict[str, Any]:
        return {"seconds_per_forward": round(self.seconds_per_forward, 4), "per_block": self.per_block.to_json(),
                "bill": [b.to_json() for b in self.bill]}


def estimate(work: Workload, plan: ShardingPlan, chip: Chip, fabric: Fabric, cuts: HostCuts | None = None) -> Estimate:
    """The stage-1 estimate of ``plan``: one block's cost, scaled to the model's depth, and its bill."""
    per_block = block_cost(work, plan, chip, fabric, cuts)
    return Estimate(per_block, work.layers * per_block.total, block_bill(work, plan))


def estimate_cfg(work: Workload, plan: ShardingPlan, chip: Chip, half_fabric: Fabric, parts: int,
                 exchange_key: str, exchange_seconds: float, half_cuts: HostCuts | None = None,
                 exchange_cross_host_bytes: float = 0.0) -> Estimate:
    """The stage-1 estimate of a CFG split, per forward: ``plan`` runs on a half mesh
    (``half_fabric``) with ``parts`` forwards at once, so each forward costs 1/``parts`` of the
    half mesh's block, plus its share of exchanging the noise predictions between the halves
    (``exchange_seconds`` per step, spread over the blocks so that the total stays
    ``layers x per block``). The bill is the half mesh's own. Bytes between hosts: every half runs
    its forward at once, so a forward's are one half's (``half_cuts``), plus its share of the
    exchange's (``exchange_cross_host_bytes`` per step)."""
    half = estimate(work, plan, chip, half_fabric, half_cuts)
    per_block = half.per_block.scaled(1.0 / parts)
    per_block.cross_host_bytes = half.per_block.cross_host_bytes + exchange_cross_host_bytes / parts / work.layers
    per_block.comm[exchange_key] = per_block.comm.get(exchange_key, 0.0) + exchange_seconds / parts / work.layers
    return Estimate(per_block, work.layers * per_block.total, half.bill)
