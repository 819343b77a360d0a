"""Cost a compiled TTNN module, op by op, on a chip and its fabric.

tt-mlir's TTNN module is a straight sequence of ops per device with per-device tensor types, and
it has no asynchronous collectives: every CCL is an op between two compute ops. So a forward's
time is charged as the sum of its ops (no overlap of communication with compute; this is where the
model departs from the throughput bound of ``docs/design.md``, which assumes async collectives).
The module is read by the package's one TTNN parser (:mod:`wan_sharding.compile.ttnn_ir`):

- ``matmul`` / ``linear``: roofline, ``max(FLOPs / (peak x efficiency), bytes / DRAM bandwidth)``
  with FLOPs = 2 x (result elements) x (contracted size);
- collectives: the topology model of :mod:`wan_sharding.planner.hardware` on the mesh axis named
  by ``cluster_axis``; on a mesh that spans several hosts also the bytes each moves over the
  links between hosts (:meth:`wan_sharding.systems.HostCuts.link_bytes`);
- everything else (norms, adaLN, RoPE, softmax pieces, layout changes): DRAM traffic, operand
  plus result bytes over the DRAM bandwidth; reshapes that keep the two tile dims are views (free);
- the slice padding mode's K/V slice-back (``slice_static`` from the padded to the valid token
  count): its bytes at the measured slice-back rate (``Chip.slice_back_gbps``).

Attention scores: the compile-only path (torchax -> JAX) decomposes SDPA into matmul, softmax
pieces and matmul, so the TTNN module materialises a (heads, L/SP, L) score tensor per device. A
480p self-attention on 2x4 would need ~21 GB for it, more than a chip has, yet that mesh ran on
hardware (``docs/hardware-facts.md``): there attention does not materialise whole scores. With ``attention="fused"``
(the default) score-shaped tensors are therefore taken to stay on chip (a flash-style kernel): their
bytes are not charged, their FLOPs are. ``attention="materialised"`` charges them as written.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..compile.ttnn_ir import COLLECTIVES, IRError, Op, TensorType, TTNNModule
from ..systems import HostCuts
from .hardware import Chip, Fabric, chunk_for, collective_seconds

# Ops that do no work on device data.
_FREE = {"deallocate", "get_device", "constant", "empty"}
MATMULS = ("matmul", "linear")
ATTENTION_MODES = ("fused", "materialised")


class IRCostError(IRError):
    """A TTNN module this cost model cannot read."""


def op_flops(op: Op) -> float:
    """Multiply-add FLOPs of a matmul / linear (0 for other ops)."""
    if op.name not in MATMULS or not op.results or not op.operands:
        return 0.0
    a = op.operands[0].shape
    if len(a) < 2:
        return 0.0
    k = a[-2] if op.transpose_a else a[-1]
    return 2.0 * op.results[0].elements * k


def is_view(op: Op) -> bool:
    """A reshape that keeps the last two dims (the 32x32 tile dims) only renames leading dims of
    tiled data: no data moves. Anything else (a permute, a reshape across the tile dims) does."""
    if op.name != "reshape" or not op.operands or not op.results:
        return False
    a, r = op.operands[0].shape, op.results[0].shape
    return len(a) >= 2 and len(r) >= 2 and a[-2:] == r[-2:]


def parse_ops(text: str | TTNNModule) -> list[Op]:
    """The ops of a TTNN module's run-time functions (parsed by :mod:`wan_sharding.compile.ttnn_ir`).
    Left out: deallocations and other free ops, and the ``const_eval`` functions (evaluated once
    when the program is loaded, not in every forward)."""
    try:
        module = text if isinstance(text, TTNNModule) else TTNNModule.parse(text)
    except IRError:
        module = None
    ops = module.runtime_ops(_FREE) if module is not None else []
    if not ops:
        raise IRCostError("no TTNN ops found: not a TTNN module")
    return ops


@dataclass(frozen=True)
class Shapes:
    """Token counts that let the cost model recognise attention scores and K/V slice-backs."""

    tokens: int  # valid L
    padded_tokens: int  # L after padding (== tokens when unpadded)
    sp: int
    prompt_tokens: int

    @property
    def local_queries(self) -> set[int]:
        out = {self.padded_tokens // self.sp}
        if self.tokens % self.sp == 0:
            out.add(self.tokens // self.sp)
        return out

    @property
    def key_lengths(self) -> set[int]:
        return {self.tokens, self.padded_tokens, self.prompt_tokens}

    def is_score(self, t: TensorType) -> bool:
        """(…, queries on this device, keys): an attention score / probability tensor."""
        return len(t.shape) >= 2 and t.shape[-2] in self.local_queries and t.shape[-1] in self.key_lengths

    def is_slice_back(self, op: Op) -> bool:
        """A ``slice_static`` cutting the padded token count back to the valid one."""
        if op.name != "slice_static" or self.tokens == self.padded_tokens or not op.operands or not op.results:
            return False
        a, r = op.operands[0].shape, op.results[0].shape
        return len(a) == len(r) and any(x == self.padded_tokens and y == self.tokens for x, y in zip(a, r))


@dataclass
class Cost:
    """Seconds of one program (or of the difference of two), by component, plus what made them.

    ``comm`` is keyed ``"<kind>@<axis>"`` (e.g. ``"all_reduce@cols"``). ``cross_host_bytes``: what
    the collectives move over the links between hosts, the whole mesh together (0 on one host).
    """

    matmul: float = 0.0
    memory: float = 0.0
    slice_back: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0
    dram_bytes: float = 0.0
    comm_bytes: dict[str, float] = field(default_factory=dict)
    comm_counts: Counter = field(default_factory=Counter)
    score_bytes_max: float = 0.0  # largest attention-score tensor on one device
    cross_host_bytes: float = 0.0

    @property
    def compute(self) -> float:
        return self.matmul + self.memory + self.slice_back

    @property
    def communication(self) -> float:
        return sum(self.comm.values())

    @property
    def total(self) -> float:
        return self.compute + self.communication

    def scaled(self, k: float) -> "Cost":
        return Cost(self.matmul * k, self.memory * k, self.slice_back * k, {a: v * k for a, v in self.comm.items()},
                    self.flops * k, self.dram_bytes * k, {a: v * k for a, v in self.comm_bytes.items()},
                    Counter({a: v * k for a, v in self.comm_counts.items()}), self.score_bytes_max,
                    self.cross_host_bytes * k)

    def minus(self, other: "Cost") -> "Cost":
        keys = set(self.comm) | set(other.comm)
        return Cost(self.matmul - other.matmul, self.memory - other.memory, self.slice_back - other.slice_back,
                    {a: self.comm.get(a, 0.0) - other.comm.get(a, 0.0) for a in keys},
                    self.flops - other.flops, self.dram_bytes - other.dram_bytes,
                    {a: self.comm_bytes.get(a, 0.0) - other.comm_bytes.get(a, 0.0) for a in keys},
                    Counter({a: self.comm_counts.get(a, 0) - other.comm_counts.get(a, 0)
                             for a in set(self.comm_counts) | set(other.comm_counts)}),
                    max(self.score_bytes_max, other.score_bytes_max), self.cross_host_bytes - other.cross_host_bytes)

    def plus(self, other: "Cost") -> "Cost":
        return self.minus(other.scaled(-1.0))

    def to_json(self) -> dict[str, Any]:
        return {"seconds": round(self.total, 6), "compute_seconds": round(self.compute, 6),
                "matmul_seconds": round(self.matmul, 6), "memory_seconds": round(self.memory, 6),
                "slice_back_seconds": round(self.slice_back, 6),
                "comm_seconds": {k: round(v, 6) for k, v in sorted(self.comm.items())},
                "tflop": round(self.flops / 1e12, 4), "dram_gb": round(self.dram_bytes / 1e9, 4),
                "comm_gb": {k: round(v / 1e9, 5) for k, v in sorted(self.comm_bytes.items())},
                "comm_counts": {k: round(v, 3) for k, v in sorted(self.comm_counts.items())},
                "cross_host_gb": round(self.cross_host_bytes / 1e9, 5)}


def cost_ops(ops: Iterable[Op], *, chip: Chip, fabric: Fabric, mesh_shape: tuple[int, ...],
             axis_names: tuple[str, ...], shapes: Shapes, attention: str = "fused",
             cuts: HostCuts | None = None) -> Cost:
    """Charge every op of a TTNN module (see the module docstring for the rules). ``cuts``: where
    the hosts fall on the mesh (None: one host)."""
    if attention not in ATTENTION_MODES:
        raise IRCostError(f"unknown attention mode {attention!r}; choose one of {ATTENTION_MODES}")
    fused = attention == "fused"
    peak = chip.peak_tflops * 1e12 * chip.matmul_efficiency
    dram = chip.dram_gbps * 1e9
    cost = Cost()

    def counted(types: Iterable[TensorType]) -> float:
        total = 0.0
        for t in types:
            if shapes.is_score(t):
                cost.score_bytes_max = max(cost.score_bytes_max, t.bytes)
                if fused:
                    continue
            total += t.bytes
        return total

    for op in ops:
        if op.name in COLLECTIVES and op.name != "mesh_partition":
            axis = op.attrs.get("cluster_axis")
            kind = op.name if op.name in ("all_gather", "reduce_scatter", "all_reduce") else "all_gather"
            operand = op.operands[0].bytes if op.operands else op.results[0].bytes
            result = op.results[0].bytes if op.results else operand
            if axis is None or axis >= len(mesh_shape):
                # A collective over the whole mesh: charged on the slower axis with every device.
                n, name = math.prod(mesh_shape), "mesh"
                axis_index = min(range(len(mesh_shape)), key=lambda i: fabric.axes[i].links or 99)
                links = fabric.axes[axis_index]
            else:
                n, links, name = mesh_shape[axis], fabric.axes[axis], axis_names[axis]
            key = f"{op.name}@{name}"
            chunk = chunk_for(kind, operand, result, n)
            c = collective_seconds(kind, chunk, n, links, fabric)
            if cuts is not None and name != "mesh":
                cost.cross_host_bytes += cuts.link_bytes(kind, chunk, axis)
            cost.comm[key] = cost.comm.get(key, 0.0) + c.seconds
            cost.comm_bytes[key] = cost.comm_bytes.get(key, 0.0) + result
            cost.comm_counts[key] += 1
            continue
        if op.name in MATMULS:
            nbytes = counted(op.operands) + counted(op.results)
            flops = op_flops(op)
            cost.flops += flops
            cost.dram_bytes += nbytes
            cost.matmul += max(flops / peak, nbytes / dram)
            continue
        if is_view(op):
            continue
        if shapes.is_slice_back(op):
            nbytes = sum(t.bytes for t in (*op.operands, *op.results))
            cost.dram_bytes += nbytes
            cost.slice_back += nbytes / (chip.slice_back_gbps * 1e9)
            continue
        nbytes = counted(op.operands) + counted(op.results)
        cost.dram_bytes += nbytes
        cost.memory += nbytes / dram
    return cost


def cost_file(path: str | Path, **kwargs: Any) -> Cost:
    """:func:`cost_ops` on an exported TTNN file."""
    return cost_ops(parse_ops(TTNNModule.from_file(path)), **kwargs)
