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

Each Galaxy has a host of its own, so a Galaxy cut is also a host boundary. tt-xla's distributed
runtime names whole systems by their *rank binding* (``TT_DISTRIBUTED_RANK_BINDING``):
:data:`RANK_BINDINGS` says, for each one its plugin knows, the global mesh, the MPI ranks along it
and the hosts they run on, read from tt-metal's rank-binding and mesh-graph-descriptor files
(``docs/tt-backend.md``, "Beyond one host"). :class:`HostCuts` says which axes of a mesh cross
hosts and what a collective over one of them sends across (the ring rule of
:func:`ring_step_routes`, which the planner's fabric model also costs by).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
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
    (8, 16): (1, 4),  # tt-metal's quad Wormhole Galaxy descriptor: four 8x4 Galaxies side by side
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


# ------------------------------------------------------------------------------ rank bindings


@dataclass(frozen=True)
class RankBinding:
    """A system tt-xla's distributed runtime can run, by the name its plugin takes in
    ``TT_DISTRIBUTED_RANK_BINDING``, as tt-metal's files describe it.

    ``grid`` is the global mesh (the mesh graph descriptor's ``device_topology``), ``ranks`` the
    MPI ranks along its axes (``host_topology``, one process each), ``hosts`` the machines they run
    on (1: several processes on one machine). The file paths are tt-metal's, under
    ``TT_METAL_RUNTIME_ROOT``, where the plugin looks them up (tenstorrent/tt-xla
    ``pjrt_implementation/src/api/client_instance.cc``, ``getRankBindingPath``).
    """

    name: str
    arch: str
    grid: tuple[int, int]
    ranks: tuple[int, int]
    hosts: int
    machine: str
    rank_bindings_file: str
    mesh_graph_file: str
    in_helper: bool  # one of tt-xla's topology helper's TOPOLOGIES (scripts/multihost_topology.py)
    extra_env: tuple[tuple[str, str], ...] = ()  # what that helper adds for this topology alone

    @property
    def num_ranks(self) -> int:
        return self.ranks[0] * self.ranks[1]

    @property
    def chips(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def chips_per_rank(self) -> int:
        return self.chips // self.num_ranks

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    def serves(self, grid: Sequence[int]) -> bool:
        """Whether a mesh of ``grid`` runs on this system: its global mesh, or the same chips seen
        transposed (tt-metal's Wan 2.2 opens a 4x32 mesh on the 32x4 quad Blackhole Galaxy)."""
        g = (int(grid[0]), int(grid[1]))
        return g in (self.grid, self.grid[::-1])

    def ranks_along(self, grid: Sequence[int]) -> tuple[int, int]:
        """The ranks along (rows, cols) of ``grid``, one of the two views :meth:`serves`."""
        g = (int(grid[0]), int(grid[1]))
        return self.ranks if g == self.grid else (self.ranks[1], self.ranks[0])

    @property
    def summary(self) -> str:
        """The system in words: machine, global mesh, hosts and chips."""
        per = f"{self.hosts} hosts x {self.chips_per_rank} chips" if self.multi_host else \
            f"{self.num_ranks} processes of {self.chips_per_rank} chips on one host"
        return f"{self.machine}, global mesh {self.grid[0]}x{self.grid[1]} ({per})"

    def describe(self) -> str:
        return f"{self.name}: {self.summary}"


_CONFIG = "tests/tt_metal/distributed/config/"
_MGD = "tt_metal/fabric/mesh_graph_descriptors/"
_CUSTOM_MGD = "tests/tt_metal/tt_fabric/custom_mesh_descriptors/"
# Every binding tt-xla's plugin maps to a file (client_instance.cc, getRankBindingPath), read from
# tenstorrent/tt-metal: the rank-binding file's ranks and the mesh graph descriptor it names
# (device_topology, host_topology, arch). docs/tt-backend.md lists the sources and what could not
# be confirmed at the tt-metal commit the plugin pins.
RANK_BINDINGS: Mapping[str, RankBinding] = {b.name: b for b in (
    RankBinding("quad_galaxy", "wormhole_b0", (8, 16), (1, 4), 4, "4 Wormhole Galaxies, one host each",
                _CONFIG + "quad_galaxy_rank_bindings.yaml", _MGD + "quad_galaxy_torus_xy_graph_descriptor.textproto",
                True),
    RankBinding("dual_galaxy", "wormhole_b0", (8, 8), (1, 2), 2, "2 Wormhole Galaxies, one host each",
                _CONFIG + "dual_galaxy_rank_bindings.yaml", _MGD + "dual_galaxy_mesh_graph_descriptor.yaml", True),
    RankBinding("quad_exabox_galaxy", "blackhole", (32, 4), (4, 1), 4, "4 Blackhole Galaxies, one host each",
                _CONFIG + "32x4_quad_bh_galaxy_rank_bindings.yaml",
                _MGD + "32x4_quad_bh_galaxy_torus_xy_graph_descriptor.textproto", False),
    RankBinding("dual_exabox_galaxy", "blackhole", (16, 4), (2, 1), 2, "2 Blackhole Galaxies, one host each",
                _CONFIG + "16x4_dual_bh_galaxy_rank_bindings.yaml",
                _MGD + "16x4_dual_bh_galaxy_2d_mesh_graph_descriptor.textproto", False),
    RankBinding("dual_bh_quietbox", "blackhole", (2, 4), (1, 2), 2, "2 Blackhole QuietBoxes (4 p150 each)",
                "tests/scale_out/4x_bh_quietbox/rank_bindings/2x4.yaml",
                "tests/scale_out/4x_bh_quietbox/mesh_graph_descriptors/2x4_bh_mesh_graph_descriptor.textproto", True),
    RankBinding("dual_t3k", "wormhole_b0", (1, 16), (1, 2), 2, "2 T3Ks (8 Wormhole chips each) as one line",
                _CONFIG + "dual_t3k_1x16_experimental_bigmesh_rank_bindings.yaml",
                _CUSTOM_MGD + "dual_t3k_1x16_experimental_bigmesh_mgd.textproto", True,
                (("TT_RUNTIME_USING_DUALT3K", "1"),)),
    RankBinding("dual_bh_loudbox_1x16", "blackhole", (1, 16), (1, 2), 2,
                "2 Blackhole LoudBoxes (8 p150 each) as one line", _CONFIG + "bh_lbx2_1x16_rank_bindings.yaml",
                _MGD + "bh_lbx2_1x16_mesh_graph_descriptor.textproto", True),
    RankBinding("2x4_multiprocess", "wormhole_b0", (2, 4), (1, 2), 1,
                "one T3K / LoudBox run as 2 processes of 4 chips", _CONFIG + "2x4_multiprocess_rank_bindings.yaml",
                _CUSTOM_MGD + "t3k_dual_host_mesh_graph_descriptor.yaml", True),
)}


class BindingError(ValueError):
    """An unknown rank binding, or a mesh that is not a binding's global mesh (one line, the fix)."""


def rank_binding(name: str) -> RankBinding:
    """The :class:`RankBinding` called ``name`` (BindingError naming the known ones otherwise)."""
    if name not in RANK_BINDINGS:
        raise BindingError(f"unknown rank binding {name!r}; tt-xla's plugin knows {', '.join(RANK_BINDINGS)}")
    return RANK_BINDINGS[name]


def served_presets(binding: RankBinding) -> list[str]:
    """The mesh presets whose grid is ``binding``'s global mesh (or its transpose), those tt-mlir
    compiles first."""
    from .mesh import PRESET_TABLE

    names = [n for n, row in PRESET_TABLE.items() if binding.serves(row[0])]
    return sorted(names, key=lambda n: bool(tt_mlir_rejects(PRESET_TABLE[n][0])))


def check_binding_grid(binding: RankBinding, grid: Sequence[int], what: str) -> None:
    """BindingError (one line, naming the presets that fit) unless a mesh of ``grid`` (``what``
    names it: ``"--mesh 2x4"``, ``"the plan's mesh"``) is ``binding``'s global mesh."""
    if binding.serves(grid):
        return
    presets = served_presets(binding)
    others = [b.name for b in RANK_BINDINGS.values() if b.serves(grid)]
    fix = (f"use --mesh {presets[0]}" if presets else "there is no preset for it") + \
        f", or a plan for {binding.grid[0]}x{binding.grid[1]} (wan-sharding plan --mesh " \
        f"{binding.grid[0]}x{binding.grid[1]} --arch {binding.arch} --rank-binding {binding.name} --write PLAN.json)" + \
        (f" ({int(grid[0])}x{int(grid[1])} is the mesh of {' and '.join(others)})" if others else "")
    chips = math.prod(int(g) for g in grid)
    raise BindingError(f"{what} is {int(grid[0])}x{int(grid[1])} ({chips} chip{'' if chips == 1 else 's'}), not the "
                       f"global mesh of {binding.name}: {binding.grid[0]}x{binding.grid[1]} ({binding.chips} chips, "
                       f"{binding.machine}); {fix}")


# ------------------------------------------------------------------------------ hosts on a mesh


def ring_route(a: int, b: int, n: int, wrap: bool) -> list[tuple[int, int]]:
    """Directed hops (from, to) of a message from position ``a`` to ``b`` on one axis of ``n``
    chips: the short way round a ring (``wrap``), straight along a line."""
    if a == b:
        return []
    if wrap and n > 2:
        fwd = (b - a) % n
        step = 1 if fwd <= n - fwd else -1
    else:
        step = 1 if b > a else -1
    hops, p = [], a
    while p != b:
        q = (p + step) % n
        hops.append((p, q))
        p = q
    return hops


@lru_cache(maxsize=256)
def ring_step_routes(n: int, wrap: bool) -> tuple[dict[tuple[int, int], float], tuple[tuple[tuple[int, int], ...], ...]]:
    """One step of a bidirectional ring collective over ``n`` chips on one axis: every chip sends
    half its chunk to its ring successor and half to its predecessor. Returns the load of every
    directed link (in chunks) and every message's route. Ring order is position order (what
    tt-mlir's ``cluster_axis`` collectives use)."""
    loads: dict[tuple[int, int], float] = {}
    routes = []
    for i in range(n):
        for peer in ((i + 1) % n, (i - 1) % n):  # half the chunk each way
            hops = ring_route(i, peer, n, wrap)
            routes.append(tuple(hops))
            for h in hops:
                loads[h] = loads.get(h, 0.0) + 0.5
    return loads, tuple(routes)


# Collectives whose traffic the ring rule gives; any other moving collective is charged as an
# all-gather of its operand, as the planner's cost model charges it.
RING_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class HostCuts:
    """Where the hosts of a system fall on a 2-D mesh: ``ranks`` processes along (rows, cols),
    each a host of its own, and whether each axis closes into a ring (``wraps``)."""

    grid: tuple[int, int]
    ranks: tuple[int, int]
    wraps: tuple[bool, bool]
    source: str  # "quad_galaxy" or "one host per Galaxy"

    def segment(self, axis: int) -> int:
        """Chips of one host along ``axis`` when it crosses hosts, else 0."""
        return self.grid[axis] // self.ranks[axis] if self.ranks[axis] > 1 else 0

    @property
    def hosts(self) -> int:
        return self.ranks[0] * self.ranks[1]

    def crossing_axes(self) -> tuple[int, ...]:
        return tuple(i for i in range(2) if self.segment(i))

    def link_bytes(self, kind: str, chunk: float, axis: int) -> float:
        """Bytes one collective moves over host-crossing links, all its groups together: every
        line of the mesh along ``axis`` runs it at once; ``chunk`` is what one chip contributes per
        ring step (an all-gather's operand, a reduce-scatter's result, an all-reduce's payload / n)."""
        n, seg = self.grid[axis], self.segment(axis)
        if not seg or n < 2:
            return 0.0
        loads, _ = ring_step_routes(n, self.wraps[axis])
        crossing = sum(load for (a, b), load in loads.items() if crosses_galaxy(a, b, seg))
        steps = (2 if kind == "all_reduce" else 1) * (n - 1)
        return (self.grid[0] * self.grid[1] // n) * steps * crossing * chunk

    def pair_exchange_bytes(self, nbytes: float, axis: int) -> float:
        """Bytes over host-crossing links when every chip swaps ``nbytes`` with the chip half of
        ``axis`` away (the two halves of a CFG split), every pair the short way round."""
        n, seg = self.grid[axis], self.segment(axis)
        if not seg:
            return 0.0
        crossings = sum(crosses_galaxy(a, b, seg) for i in range(n)
                        for a, b in ring_route(i, (i + n // 2) % n, n, self.wraps[axis]))
        return (self.grid[0] * self.grid[1] // n) * crossings * nbytes

    def part(self, axis: int, parts: int) -> "HostCuts | None":
        """The hosts on one of ``parts`` equal slices of the mesh cut along ``axis`` (a CFG split's
        half): that axis shortened, an open line (its wrap-around belonged to the whole); None
        when the slice is inside one host."""
        grid, ranks, wraps = list(self.grid), list(self.ranks), list(self.wraps)
        grid[axis] //= parts
        ranks[axis] = max(1, ranks[axis] // parts)
        wraps[axis] = False
        if ranks[0] * ranks[1] == 1:
            return None
        return HostCuts((grid[0], grid[1]), (ranks[0], ranks[1]), (wraps[0], wraps[1]), self.source)

    def describe(self, axis_names: Sequence[str] = ("rows", "cols")) -> str:
        axes = [f"{axis_names[i]} every {self.segment(i)} chips" for i in self.crossing_axes()]
        return f"{self.hosts} hosts ({self.source}); crossing hosts: {', '.join(axes) or 'none'}"


def host_cuts(grid: Sequence[int], binding: RankBinding | None = None,
              wraps: tuple[bool, bool] | None = None) -> HostCuts | None:
    """The hosts on a mesh of ``grid``: ``binding``'s ranks when given (a binding whose ranks share
    one host has no host cut: None), else one host per Galaxy on a multi-Galaxy grid, else None
    (one host). ``wraps``: each axis a ring or a line (default: rings on Galaxy grids, as the
    planner's fabric models them, lines elsewhere)."""
    g = (int(grid[0]), int(grid[1]))
    if binding is not None:
        if not binding.multi_host:
            return None
        ranks, source = binding.ranks_along(g), binding.name
    elif galaxies(g) is not None:
        ranks, source = galaxies(g), "one host per Galaxy"  # type: ignore[assignment]
    else:
        return None
    if wraps is None:
        ring = galaxies(g) is not None
        wraps = (ring, ring)
    return HostCuts(g, ranks, wraps, source)  # type: ignore[arg-type]
