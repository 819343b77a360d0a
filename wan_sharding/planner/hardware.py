"""Chips and chip fabrics as data, and the topology model that costs one collective on them.

Everything the planner assumes about the hardware lives in the two tables below, each value with
where it comes from. Per-chip DRAM is read from ``wan_sharding/compile/chips.json`` (``dram_gb``),
the file the system descriptors are built from, so there is one source for it.

The collective model (:func:`collective_seconds`) routes a ring algorithm over the physical links
of one mesh axis: every device sends half of each step's chunk to its ring successor and half to
its predecessor, each logical hop is routed over the physical line or ring of that axis, and a
step lasts as long as its most loaded directed link needs. That one rule gives the textbook
results without special cases:

- ring axis (wrap-around link), n devices: ``(n-1)/n * S / (2 * links * bw)`` for an all-gather
  of ``S`` bytes (both directions of every link carry half);
- line axis: the ring's closing hop runs back over every link, so each link carries twice as much:
  ``(n-1)/n * S / (links * bw)``, twice the ring's time;
- two devices: one link group, ``S / 2 / (links * bw)``;

plus ``hop latency * hops`` per step and a fixed start-up per collective op. All-reduce is charged
as reduce-scatter + all-gather. Groups that run the same collective at the same time (every row of
the mesh does its TP all-reduce at once) add their loads to the links they share, which is how
shared-link contention enters; on an axis-aligned group on a mesh axis they share none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from ..systems import (CABLING, MULTI_GALAXY, crosses_galaxy, galaxies, ring_route, ring_step_routes,
                       segment as galaxy_segment)

_CHIPS_JSON = Path(__file__).resolve().parents[1] / "compile" / "chips.json"


class HardwareError(ValueError):
    """Unknown chip architecture or a fabric that does not fit the mesh."""


@lru_cache(maxsize=1)
def _chip_json() -> dict:
    return json.loads(_CHIPS_JSON.read_text())["chips"]


@dataclass(frozen=True)
class Chip:
    """What the cost and memory models need to know about one chip."""

    arch: str
    peak_tflops: float  # dense bf16 matmul peak
    dram_gb: float  # per-chip DRAM (GB = 1e9 bytes: the budget is checked against dram_gb * 1e9)
    dram_gbps: float  # DRAM bandwidth, GB/s
    matmul_efficiency: float  # fraction of peak a large matmul reaches
    slice_back_gbps: float  # effective rate of the slice padding mode's K/V slice-back (see below)
    source: str

    @property
    def dram_bytes(self) -> float:
        return self.dram_gb * 1e9

    @property
    def usable_dram_bytes(self) -> float:
        """What a plan may fill: DRAM less :data:`DRAM_RESERVE` for what the estimate leaves out."""
        return self.dram_bytes * (1.0 - DRAM_RESERVE)


# Share of DRAM kept free for what the memory estimate does not count: firmware and program
# binaries, CCL scratch buffers, the prompt and timestep tensors, allocator fragmentation (assumed).
DRAM_RESERVE = 0.05

# Per-chip performance; ``peak_tflops`` is the spec figure for ``peak_cores`` worker cores and
# scales with the descriptor's grid (:func:`worker_cores`), so compute follows the grid we compile
# for. Reference: docs/hardware-facts.md ("Chip figures": Tenstorrent's public
# spec pages for Wormhole n150 / Blackhole p150; the Blackhole bf16 figure is third-party).
# matmul_efficiency: tt-metal's hand-written Wan 2.2 runs 720p on a Wormhole Galaxy in ~4.4 s per
# forward for ~6.5 PFLOP, i.e. ~46 TFLOPS per chip = ~0.6 of the 74 peak (docs/hardware-facts.md); a
# compiler-generated graph is taken to do no better. The same fraction is assumed for Blackhole.
# slice_back_gbps: +3.3 s per 480p forward was measured on a Wormhole Galaxy from the slice
# padding mode's 80 K/V slice-backs (5.6 -> 8.9 s; docs/hardware-facts.md); each moves 2 x 84 MB
# (read + write of 32768 x 10 heads x 128 bf16), so such a slice runs at ~4 GB/s, far below DRAM
# speed (it cuts a length that is no longer whole tiles). Blackhole: scaled by the DRAM bandwidth ratio (assumed).
CHIP_PERF: dict[str, dict[str, float | str]] = {
    "wormhole_b0": {"peak_tflops": 74.0, "peak_cores": 64, "dram_gbps": 288.0, "matmul_efficiency": 0.6, "slice_back_gbps": 4.1,
                    "source": "Wormhole n150 spec (74 TFLOPS fp16/bf16, 288 GB/s GDDR6); efficiency and "
                              "slice-back rate calibrated from reference measurements (see planner/hardware.py)"},
    "blackhole": {"peak_tflops": 332.0, "peak_cores": 120, "dram_gbps": 512.0, "matmul_efficiency": 0.6, "slice_back_gbps": 7.3,
                  "source": "Blackhole p150 spec (512 GB/s GDDR6; ~332 TFLOPS bf16 is a third-party figure); "
                            "efficiency and slice-back rate assumed like Wormhole's"},
}
ARCHS: tuple[str, ...] = tuple(CHIP_PERF)


def worker_cores(arch: str) -> int:
    """Tensix worker cores of one chip: the system descriptor's grid (``compile/chips.json``), the
    grid tt-metal's mock device has (Wormhole n150: 8x8; Blackhole p150: 10x12)."""
    grid = _chip_json()[arch]["grid_size"]
    return int(grid["y"]) * int(grid["x"])


def chip(arch: str) -> Chip:
    """The :class:`Chip` for ``arch`` (``"wormhole_b0"`` or ``"blackhole"``)."""
    if arch not in CHIP_PERF:
        raise HardwareError(f"unknown chip arch {arch!r}; known: {', '.join(ARCHS)}")
    perf = CHIP_PERF[arch]
    return Chip(arch=arch, peak_tflops=float(perf["peak_tflops"]) * worker_cores(arch) / float(perf["peak_cores"]), dram_gb=float(_chip_json()[arch]["dram_gb"]),
                dram_gbps=float(perf["dram_gbps"]), matmul_efficiency=float(perf["matmul_efficiency"]),
                slice_back_gbps=float(perf["slice_back_gbps"]), source=str(perf["source"]))


# ------------------------------------------------------------------------------------ fabrics


@dataclass(frozen=True)
class AxisLinks:
    """The physical links along one mesh axis: ``links`` parallel Ethernet links between each pair
    of neighbours, and whether the axis closes into a ring (``wrap``) or is an open line.

    An axis that runs across several Galaxies (``segment`` > 0: chips of one Galaxy along it) has
    inter-Galaxy hops every ``segment`` chips (and its wrap-around hop), each with ``cross_links``
    links of ``cross_gbps`` and ``cross_hop_us`` latency instead (:mod:`wan_sharding.systems`).
    """

    links: int
    wrap: bool
    segment: int = 0
    cross_links: int = 0
    cross_gbps: float = 0.0
    cross_hop_us: float = 0.0


@dataclass(frozen=True)
class Fabric:
    """Chip-to-chip wiring of one machine, axis by axis in mesh order (rows, then columns)."""

    machine: str
    arch: str
    grid: tuple[int, int]
    axes: tuple[AxisLinks, AxisLinks]
    link_gbps: float  # GB/s per link per direction
    hop_latency_us: float  # per hop a message travels
    op_overhead_us: float  # fixed start-up of one collective op
    source: str

    def axis(self, index: int) -> AxisLinks:
        return self.axes[index]

    def describe(self) -> str:
        parts = []
        for n, a in zip(self.grid, self.axes):
            if n <= 1:
                continue
            text = f"{n} chips x{a.links} links {'ring' if a.wrap and n > 2 else 'line'}"
            if a.segment:
                text += (f" (Galaxy every {a.segment}: x{a.cross_links} links of {a.cross_gbps:g} GB/s "
                         "between Galaxies)")
            parts.append(text)
        return f"{self.machine}: " + ", ".join(parts) + f"; {self.link_gbps:g} GB/s per link"


# Wormhole: each Ethernet link carries 100 Gb/s = 12.5 GB/s per direction; a hop costs ~0.65 us
# (tt-metal tech report "Basic Ethernet Multichip": link speed, ring ping microbenchmark). The
# N300 joins its two chips with 2 links, the T3000 / LoudBox builds its 2x4 mesh from four N300s
# through their external ports, and a Galaxy's interior chips use all 16 links, i.e. 4 per
# neighbour (same report). A single 6U Galaxy is listed as "Torus XY" in tt-metal's scale-out
# guide; pass topology="line" for a Galaxy without its edge links cabled.
# Blackhole: p150 cards have four QSFP-DD 800G ports, taken here as 2 links of 400 Gb/s = 50 GB/s
# each (assumed split). Validated card meshes (docs.tenstorrent.com, multi-card topologies): four
# cards as a ring (two cables between neighbours), eight as a 2x4 mesh with ten cables (one per
# neighbour pair). Blackhole Galaxy runs chip-to-chip links at 200G (25 GB/s) by default
# (tt-system-firmware docs); 2 links per neighbour is an assumption.
# op_overhead_us: the start-up of one CCL op (program dispatch + handshake), assumed 10 us.
_WH_LINK, _BH_LINK, _BH_GALAXY_LINK = 12.5, 50.0, 25.0
_WH_HOP, _BH_HOP, _OVERHEAD = 0.65, 0.65, 10.0
FABRICS: dict[tuple[str, tuple[int, int]], Fabric] = {
    ("wormhole_b0", (1, 4)): Fabric("4 chips of a T3000 (line)", "wormhole_b0", (1, 4),
                                    (AxisLinks(0, False), AxisLinks(2, False)), _WH_LINK, _WH_HOP, _OVERHEAD,
                                    "T3000 links, 4 chips taken as a line"),
    ("wormhole_b0", (1, 8)): Fabric("T3000 as a ring of 8", "wormhole_b0", (1, 8),
                                    (AxisLinks(0, False), AxisLinks(2, True)), _WH_LINK, _WH_HOP, _OVERHEAD,
                                    "the 2x4 mesh walked as one ring"),
    ("wormhole_b0", (2, 4)): Fabric("T3000 / LoudBox", "wormhole_b0", (2, 4),
                                    (AxisLinks(2, False), AxisLinks(2, False)), _WH_LINK, _WH_HOP, _OVERHEAD,
                                    "2x4 mesh of four N300 boards, 2 links per neighbour"),
    ("wormhole_b0", (8, 4)): Fabric("Wormhole Galaxy (6U, torus)", "wormhole_b0", (8, 4),
                                    (AxisLinks(4, True), AxisLinks(4, True)), _WH_LINK, _WH_HOP, _OVERHEAD,
                                    "4 links per neighbour, wrap-around on both axes"),
    ("wormhole_b0", (4, 8)): Fabric("Wormhole Galaxy (6U, torus)", "wormhole_b0", (4, 8),
                                    (AxisLinks(4, True), AxisLinks(4, True)), _WH_LINK, _WH_HOP, _OVERHEAD,
                                    "4 links per neighbour, wrap-around on both axes"),
    ("blackhole", (1, 4)): Fabric("Blackhole QuietBox (ring of 4 p150)", "blackhole", (1, 4),
                                  (AxisLinks(0, False), AxisLinks(4, True)), _BH_LINK, _BH_HOP, _OVERHEAD,
                                  "four cards in a ring, two 800G cables between neighbours"),
    ("blackhole", (2, 4)): Fabric("Blackhole LoudBox (8 p150b, 2x4)", "blackhole", (2, 4),
                                  (AxisLinks(2, False), AxisLinks(2, False)), _BH_LINK, _BH_HOP, _OVERHEAD,
                                  "2x4 mesh, one 800G cable per neighbour pair"),
    ("blackhole", (8, 4)): Fabric("Blackhole Galaxy (6U, torus)", "blackhole", (8, 4),
                                  (AxisLinks(2, True), AxisLinks(2, True)), _BH_GALAXY_LINK, _BH_HOP, _OVERHEAD,
                                  "200G chip-to-chip links, 2 per neighbour (assumed), torus"),
    ("blackhole", (4, 8)): Fabric("Blackhole Galaxy (6U, torus)", "blackhole", (4, 8),
                                  (AxisLinks(2, True), AxisLinks(2, True)), _BH_GALAXY_LINK, _BH_HOP, _OVERHEAD,
                                  "200G chip-to-chip links, 2 per neighbour (assumed), torus"),
}


def _multi_galaxy(arch: str, grid: tuple[int, int]) -> Fabric:
    """A fabric of several Galaxies cabled as one grid (``wan_sharding.systems``): each axis keeps the
    Galaxy's own links, and an axis cut into Galaxies gets the inter-Galaxy cabling at each cut. Every
    axis closes into a ring, as tt-metal's quad-Galaxy descriptors (32x4, torus XY) have it."""
    cab = CABLING[arch]
    axes = []
    for i in range(2):
        seg = galaxy_segment(grid, i)
        axes.append(AxisLinks(cab.links, True, seg, cab.cross_links if seg else 0,
                              cab.cross_gbps if seg else 0.0, cab.cross_hop_latency_us if seg else 0.0))
    n = galaxies(grid)
    label = "Wormhole" if arch == "wormhole_b0" else "Blackhole"
    return Fabric(f"{n[0] * n[1]} {label} Galaxies ({grid[0]}x{grid[1]} torus)", arch, grid,  # type: ignore[index]
                  (axes[0], axes[1]), cab.link_gbps, cab.hop_latency_us, _OVERHEAD, cab.source)


FABRICS.update({(arch, grid): _multi_galaxy(arch, grid) for arch in CABLING for grid in MULTI_GALAXY})
TOPOLOGIES = ("machine", "line", "ring")


def fabric_for(arch: str, grid: Sequence[int], topology: str = "machine") -> Fabric:
    """The fabric of the machine with this ``grid`` (rows, cols) of ``arch`` chips.

    ``topology``: ``"machine"`` (the table above; a grid with no machine gets 2 links per
    neighbour as an open line), or ``"line"`` / ``"ring"`` to force every axis open or closed
    (what-if studies: a Galaxy without its wrap-around cables is ``"line"``).
    """
    chip(arch)  # unknown arch -> HardwareError
    grid = tuple(int(g) for g in grid)
    if len(grid) != 2 or any(g < 1 for g in grid):
        raise HardwareError(f"a fabric needs a 2-D grid of positive sizes, got {grid}")
    if topology not in TOPOLOGIES:
        raise HardwareError(f"unknown topology {topology!r}; choose one of {TOPOLOGIES}")
    base = FABRICS.get((arch, grid))  # type: ignore[arg-type]
    if base is None:
        link = _WH_LINK if arch == "wormhole_b0" else _BH_LINK
        base = Fabric(f"{grid[0]}x{grid[1]} {arch} mesh (generic)", arch, grid,  # type: ignore[arg-type]
                      (AxisLinks(2, False), AxisLinks(2, False)), link, _WH_HOP, _OVERHEAD,
                      "no machine known for this grid: 2 links per neighbour, open line (assumed)")
    if topology == "machine":
        return base
    wrap = topology == "ring"
    axes = tuple(replace(a, links=max(a.links, 1), wrap=wrap) for a in base.axes)
    return Fabric(f"{base.machine}, forced {topology}", arch, grid, axes, base.link_gbps,  # type: ignore[arg-type]
                  base.hop_latency_us, base.op_overhead_us, base.source + f"; every axis forced to a {topology}")


# ------------------------------------------------------------------------------- collectives

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@lru_cache(maxsize=256)
def ring_step(n: int, wrap: bool) -> tuple[float, int]:
    """For a bidirectional ring algorithm over ``n`` devices on one axis: ``(load, hops)`` where
    ``load`` is the most any directed link carries in one step, in units of the per-device chunk,
    and ``hops`` the longest route one step's message takes."""
    if n < 2:
        return 0.0, 0
    loads, routes = ring_step_routes(n, wrap)
    return max(loads.values()), max(len(r) for r in routes)


def _step_on_axis(n: int, axis: AxisLinks, fabric: Fabric) -> tuple[float, float]:
    """``(seconds per chunk byte, latency seconds)`` of one ring step over ``n`` devices on ``axis``:
    the slowest directed link's load over its bandwidth, and the slowest route's summed hop latency.
    Hops that cross a Galaxy boundary use the inter-Galaxy links (:class:`AxisLinks`)."""
    loads, routes = ring_step_routes(n, axis.wrap)
    per_byte = max(load / _hop(axis, fabric, h)[0] for h, load in loads.items())
    latency = max(sum(_hop(axis, fabric, h)[1] for h in r) for r in routes)
    return per_byte, latency


def _hop(axis: AxisLinks, fabric: Fabric, hop: tuple[int, int]) -> tuple[float, float]:
    """``(bytes per second, latency seconds)`` of one directed hop between neighbouring positions:
    the inter-Galaxy cabling where the hop crosses a Galaxy boundary, else the on-board links."""
    if crosses_galaxy(hop[0], hop[1], axis.segment):
        return axis.cross_links * axis.cross_gbps * 1e9, axis.cross_hop_us * 1e-6
    return axis.links * fabric.link_gbps * 1e9, fabric.hop_latency_us * 1e-6


@dataclass(frozen=True)
class CollectiveCost:
    """Seconds for one collective op, split into bandwidth and latency parts."""

    seconds: float
    bandwidth_seconds: float
    latency_seconds: float


def collective_seconds(kind: str, chunk_bytes: float, n: int, axis: AxisLinks, fabric: Fabric) -> CollectiveCost:
    """Time of one collective over ``n`` devices along one mesh axis.

    ``chunk_bytes`` is what one device contributes per ring step: the operand of an all-gather,
    the result of a reduce-scatter, and payload / n of an all-reduce (charged as reduce-scatter +
    all-gather, two passes). Returns zero time for ``n == 1``.
    """
    if kind not in KINDS:
        raise HardwareError(f"unknown collective {kind!r}; known: {KINDS}")
    if n <= 1:
        return CollectiveCost(0.0, 0.0, 0.0)
    if axis.links < 1 or (axis.segment and axis.segment < n and axis.cross_links < 1):
        raise HardwareError(f"{fabric.machine}: the mesh axis with {n} devices has no links")
    per_byte, step_latency = _step_on_axis(n, axis, fabric)
    passes = 2 if kind == "all_reduce" else 1
    steps = passes * (n - 1)
    bw = steps * per_byte * chunk_bytes
    lat = steps * step_latency + fabric.op_overhead_us * 1e-6
    return CollectiveCost(bw + lat, bw, lat)


def sub_axis(axis: AxisLinks, n: int, parts: int) -> AxisLinks:
    """The links of one of ``parts`` equal slices of an ``n``-long axis (each slice ``n // parts``
    long): an open line (its wrap-around belonged to the whole axis), keeping the Galaxy cuts that
    fall inside it. Used for a mesh split in halves for classifier-free guidance."""
    if parts <= 1:
        return axis
    length = n // parts
    seg = axis.segment if axis.segment and axis.segment < length else 0
    return replace(axis, wrap=False, segment=seg, cross_links=axis.cross_links if seg else 0,
                   cross_gbps=axis.cross_gbps if seg else 0.0, cross_hop_us=axis.cross_hop_us if seg else 0.0)


def sub_fabric(fabric: Fabric, axis_index: int, parts: int) -> Fabric:
    """The fabric of one of ``parts`` equal slices of ``fabric`` cut along ``axis_index``."""
    grid = list(fabric.grid)
    axes = list(fabric.axes)
    axes[axis_index] = sub_axis(axes[axis_index], grid[axis_index], parts)
    grid[axis_index] //= parts
    return replace(fabric, machine=f"1/{parts} of {fabric.machine}", grid=(grid[0], grid[1]),
                   axes=(axes[0], axes[1]))


def pair_exchange_seconds(nbytes: float, axis: AxisLinks, n: int, fabric: Fabric) -> float:
    """Seconds to swap ``nbytes`` between the devices at positions ``i`` and ``i + n/2`` of an
    ``n``-long axis (the two halves of a CFG split), all pairs at once: every pair's message goes the
    short way round, so each link carries the messages whose routes cross it; charged at the slowest
    link, plus the route's hop latency and one collective start-up."""
    half = n // 2
    loads: dict[tuple[int, int], float] = {}
    longest = 0.0
    for i in range(n):
        hops = ring_route(i, (i + half) % n, n, axis.wrap)
        for h in hops:
            loads[h] = loads.get(h, 0.0) + nbytes
        longest = max(longest, sum(_hop(axis, fabric, h)[1] for h in hops))
    bw = max((load / _hop(axis, fabric, h)[0] for h, load in loads.items()), default=0.0)
    return bw + longest + fabric.op_overhead_us * 1e-6


def chunk_for(kind: str, operand_bytes: float, result_bytes: float, n: int) -> float:
    """Per-step chunk of a collective from its per-device operand and result sizes."""
    if kind == "all_gather":
        return operand_bytes
    if kind == "reduce_scatter":
        return result_bytes
    return operand_bytes / max(n, 1)  # all_reduce: the payload travels in n pieces


def total_seconds(costs: Iterable[CollectiveCost]) -> float:
    return sum(c.seconds for c in costs)
