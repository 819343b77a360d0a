"""Multi-Galaxy systems as data: how Galaxies tile a chip grid and how they are cabled together.

One Galaxy is 32 chips, an 8x4 grid (or its 4x8 view). Systems of several Galaxies are cabled as
one longer grid: tt-metal's quad-Galaxy descriptors are a 32x4 torus (four 8x4 Galaxies along the
32-long axis, one host each), and its dual Blackhole Galaxy is carried as a 16x4 mesh
(tenstorrent/tt-metal ``tt_metal/fabric/mesh_graph_descriptors/32x4_quad_galaxy_torus_xy_graph_descriptor.textproto``
(Wormhole, 4 channels per neighbour), ``32x4_quad_bh_galaxy_torus_xy_graph_descriptor.textproto`` and
``16x4_dual_bh_galaxy_2d_mesh_graph_descriptor.textproto`` (Blackhole, 2 channels per neighbour)).

Inside a Galaxy, neighbours share several Ethernet links on the board; between Galaxies they are
joined by cables. This module says which hops of a grid cross a Galaxy boundary and what such a hop
carries. The system descriptors (:mod:`wan_sharding.compile.sysdesc`) and the planner's fabric model
(:mod:`wan_sharding.planner.hardware`) both read it, so the two tell the same story.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

GALAXY_CHIPS = 32


@dataclass(frozen=True)
class Cabling:
    """Links per neighbour pair inside a Galaxy and between two Galaxies, and their speeds."""

    links: int  # parallel Ethernet links between two neighbours on one Galaxy
    link_gbps: float  # GB/s per link per direction inside a Galaxy
    hop_latency_us: float
    cross_links: int  # links between the facing chips of two cabled Galaxies
    cross_gbps: float  # GB/s per inter-Galaxy link per direction
    cross_hop_latency_us: float
    source: str


# Inside a Galaxy: Wormhole 4 links per neighbour at 100 Gb/s (tt-metal tech report "Basic Ethernet
# Multichip"); Blackhole 2 per neighbour (the channel count of tt-metal's Blackhole Galaxy mesh
# descriptors) at 200 Gb/s (docs/hardware-facts.md). Between Galaxies: no public figure for the
# number or speed of the inter-Galaxy cables was found; tt-metal's quad descriptors ask for the same
# channel count everywhere, the Blackhole one under a RELAXED policy (it tolerates fewer). ASSUMED
# here: half the links of an on-board neighbour pair, Blackhole cables at 100 Gb/s (half the on-board
# 200G), Wormhole at its one 100G link speed, and twice the hop latency (retimed cables, a host
# boundary). These are the numbers to change when a measurement exists.
CABLING: Mapping[str, Cabling] = {
    "wormhole_b0": Cabling(4, 12.5, 0.65, 2, 12.5, 1.3,
                           "inside: 4 x 100G per neighbour (tt-metal Ethernet report); between Galaxies: "
                           "2 x 100G, 2x hop latency (no public source; assumption)"),
    "blackhole": Cabling(2, 25.0, 0.65, 1, 12.5, 1.3,
                         "inside: 2 x 200G per neighbour (tt-metal BH Galaxy descriptors); between Galaxies: "
                         "1 x 100G, 2x hop latency (no public source; assumption)"),
}

# Chip grid -> Galaxies along (rows, cols). A Galaxy is 8x4 in the "rows" layouts and 4x8 in the
# tt-metal view (SP on the long axis as its sp_axis=1), so a boundary falls every 8 chips of the long
# axis. 8x8 is tt-metal's dual-Galaxy torus (two 8x4 Galaxies side by side, host topology 1x2).
MULTI_GALAXY: Mapping[tuple[int, int], tuple[int, int]] = {
    (16, 4): (2, 1),
    (32, 4): (4, 1),
    (4, 16): (1, 2),
    (4, 32): (1, 4),
    (8, 8): (1, 2),
}


def galaxies(grid: Sequence[int]) -> tuple[int, int] | None:
    """Galaxies along (rows, cols) of a multi-Galaxy ``grid``, or None for a single machine."""
    return MULTI_GALAXY.get((int(grid[0]), int(grid[1])))


def segment(grid: Sequence[int], axis: int) -> int:
    """Chips of one Galaxy along ``axis`` of ``grid`` when that axis crosses Galaxies, else 0."""
    split = galaxies(grid)
    if split is None or split[axis] == 1:
        return 0
    return int(grid[axis]) // split[axis]


def crosses_galaxy(position: int, nxt: int, seg: int) -> bool:
    """Whether the hop between neighbours ``position`` and ``nxt`` on an axis cut into Galaxies of
    ``seg`` chips (0: not cut) is an inter-Galaxy cable. The wrap-around hop of a cut axis is one."""
    if not seg:
        return False
    return position // seg != nxt // seg


# Mesh shapes the installed tt-mlir (jax-tt-plugin 0.1.3) was seen to reject with "Mesh is not valid"
# (it accepts only a fixed list of shapes; tt-mlir's StableHLO sharding utilities carry it). Measured
# here with tiny-config compiles: 4x16, 4x32, 8x8 and 8x16 are accepted; these are not. A rejected
# shape whose transpose is accepted gets that view named as the fix.
TT_MLIR_REJECTED: frozenset[tuple[int, int]] = frozenset({(16, 4), (32, 4), (2, 16), (2, 32), (64, 2)})
TT_MLIR_VIEWS: Mapping[tuple[int, int], str] = {(16, 4): "4x16-tt-metal", (32, 4): "4x32-tt-metal"}


def tt_mlir_rejects(shape: Sequence[int]) -> str:
    """Why the installed tt-mlir will not compile a mesh of ``shape`` (empty when it is not known to
    refuse it), naming the view of the same chips that compiles where there is one."""
    key = (int(shape[0]), int(shape[1]))
    if key not in TT_MLIR_REJECTED:
        return ""
    view = TT_MLIR_VIEWS.get(key)
    fix = (f"use --mesh {view} (the same chips and links seen as {key[1]}x{key[0]}, same roles)" if view
           else "use a mesh shape tt-mlir accepts (e.g. 4x16, 4x32, 8x8)")
    return f"tt-mlir in jax-tt-plugin 0.1.3 rejects a {key[0]}x{key[1]} mesh ('Mesh is not valid'); {fix}"


def galaxy_links(arch: str, grid: Sequence[int]) -> tuple[int, int] | None:
    """(links per on-board neighbour pair, links per inter-Galaxy pair) of a Galaxy-based ``grid``
    (one Galaxy, 8x4 or 4x8, or a multi-Galaxy grid), None for other machines."""
    key = (int(grid[0]), int(grid[1]))
    if key not in MULTI_GALAXY and key not in ((8, 4), (4, 8)):
        return None
    cab = CABLING[arch]
    return cab.links, cab.cross_links
