"""Tenstorrent system descriptors (``.ttsys``) for tt-mlir compile-only mode.

The tt PJRT plugin (``jax-tt-plugin``) compiles without hardware when
``TT_COMPILE_ONLY_SYSTEM_DESC`` points at a system descriptor: a size-prefixed
FlatBuffers buffer (file identifier ``TTSY``) describing the chips and their
wiring. This module decides what a descriptor holds (the chips of ``chips.json`` next to this
file, their grid and ethernet links, the schema hash the installed plugin accepts) and checks a
descriptor against the plugin and a mesh; :mod:`.ttsys` encodes and decodes the format.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import systems
from ..runtime.workers import atomic_write
from . import ttsys

__all__ = [
    "ARCHS",
    "TOPOLOGIES",
    "SystemDescriptorError",
    "build_system_descriptor",
    "write_system_descriptor",
    "read_system_descriptor",
    "check_plugin_schema",
    "check_chip_count",
    "inter_galaxy_channels",
    "default_grid",
    "worker_grid",
    "expected_schema_hash",
    "installed_plugin_version",
    "known_schema_hashes",
    "plugin_library",
    "schema_hash_candidates",
    "PLUGIN_DIST",
]

PLUGIN_DIST = "jax-tt-plugin"
TOPOLOGIES = ("none", "line", "ring", "torus", "machine")

_CHIPS_JSON = Path(__file__).with_name("chips.json")

# Ethernet cores used for chip-to-chip links, one per grid direction, given as
# logical ethernet-core coordinates (y = ethernet channel, x = 0).  These are
# NOMINAL: they only have to be distinct per chip so that each link has its own
# core; they are not read off a real board's wiring.  Compile-only descriptors
# are known to compile with no channels at all (topology="none").
_ETH_CORE_BY_DIR: dict[str, dict[str, tuple[int, int]]] = {
    # Wormhole has 16 ethernet channels, Blackhole 14; use the first four.
    "wormhole_b0": {"east": (0, 0), "west": (1, 0), "south": (2, 0), "north": (3, 0)},
    "blackhole": {"east": (0, 0), "west": (1, 0), "south": (2, 0), "north": (3, 0)},
}

# Physical grid (rows, cols) for the usual machine sizes (n150/n300, QuietBox,
# T3K/LoudBox, Galaxy 8x4 as tt-xla lays it out).
_DEFAULT_GRIDS = {1: (1, 1), 2: (1, 2), 4: (1, 4), 8: (2, 4), 32: (8, 4), 64: (16, 4), 128: (32, 4)}


class SystemDescriptorError(RuntimeError):
    """A system descriptor does not fit the installed plugin or the requested mesh."""


# --------------------------------------------------------------------------- data


@lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    with open(_CHIPS_JSON) as f:
        return json.load(f)


def _known_archs() -> tuple[str, ...]:
    return tuple(_data()["chips"])


ARCHS: tuple[str, ...] = _known_archs()
_ARCH_KEY = {c["arch"]: k for k, c in _data()["chips"].items()}  # "Wormhole_b0" -> key


def _chip(arch: str) -> dict[str, Any]:
    chips = _data()["chips"]
    if arch not in chips:
        raise ValueError(f"unknown Tenstorrent arch {arch!r}; known: {', '.join(chips)}")
    return chips[arch]


def worker_grid(arch: str, num_chips: int) -> tuple[int, int]:
    """The (y, x) compute-with-storage grid a descriptor of ``num_chips`` ``arch`` chips gives each chip.

    At optimization level >= 1 tt-mlir's op model opens tt-metal's mock board for the descriptor's
    chip count and refuses a descriptor whose grid differs from that board's. The boards differ:
    a Blackhole p150 of the 1-, 2- and 4-chip boards has two of its 14 Tensix columns harvested, of
    the 8-chip and Galaxy boards one, and the command-queue dispatch takes one more column (10x11
    vs 10x12; docs/hardware-facts.md, "The worker grid"). ``grid_size_by_chips`` in ``chips.json``
    holds the counts that differ from ``grid_size``."""
    chip = _chip(arch)
    grid = chip.get("grid_size_by_chips", {}).get(str(num_chips), chip["grid_size"])
    return int(grid["y"]), int(grid["x"])


def _chip_for(arch: str, num_chips: int) -> dict[str, Any]:
    y, x = worker_grid(arch, num_chips)
    return {**_chip(arch), "grid_size": {"y": y, "x": x}}


def known_schema_hashes() -> dict[str, str]:
    """Plugin version -> schema hash, for every ``jax-tt-plugin`` version we carry."""
    return dict(_data()["schema_hashes"][PLUGIN_DIST])


def installed_plugin_version() -> str | None:
    """Version of the installed ``jax-tt-plugin`` distribution, or None if absent."""
    try:
        return importlib.metadata.version(PLUGIN_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def expected_schema_hash(plugin_version: str | None = None) -> str:
    """Schema hash the given (default: installed) plugin version accepts.

    Raises SystemDescriptorError if the plugin is missing or its version is not one
    whose hash ``chips.json`` carries.
    """
    version = plugin_version or installed_plugin_version()
    known = known_schema_hashes()
    if version is None:
        raise SystemDescriptorError(
            f"{PLUGIN_DIST} is not installed, so there is no schema hash to check against. "
            f"Fix: pip install '{PLUGIN_DIST}=={_newest(known)}'."
        )
    if version not in known:
        raise SystemDescriptorError(
            f"{PLUGIN_DIST}=={version} is installed, but wan_sharding only carries the system "
            f"descriptor schema hash for version(s) {', '.join(sorted(known))}. "
            f"Fix: pip install '{PLUGIN_DIST}=={_newest(known)}', or add the new plugin's hash to "
            f"{_CHIPS_JSON} (it is one of schema_hash_candidates(), the 64-hex-digit strings in "
            "the plugin's libtt.so; exactly one of them compiles)."
        )
    return known[version]


def plugin_library() -> Path | None:
    """Path of the installed plugin's ``libtt.so`` (found via package metadata), or None."""
    try:
        files = importlib.metadata.files(PLUGIN_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "libtt.so":
            return Path(f.locate())
    return None


def schema_hash_candidates(lib_path: str | os.PathLike[str] | None = None) -> list[str]:
    """64-hex-digit strings in the plugin's ``libtt.so``: one of them is its schema hash.

    For adding a new plugin version to ``chips.json``: build a descriptor with each
    candidate and keep the one that compiles.  Scans ~140 MB (several seconds).
    """
    import mmap
    import re

    path = Path(lib_path) if lib_path is not None else plugin_library()
    if path is None:
        raise SystemDescriptorError(f"{PLUGIN_DIST} is not installed; no libtt.so to scan")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        found = re.findall(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])", m)
    return sorted({h.decode() for h in found})


def _newest(versions) -> str:
    # Numeric compare, so that 0.1.10 sorts after 0.1.9.
    return max(versions, key=lambda v: tuple(int(p) if p.isdigit() else 0 for p in v.split(".")))


def _default_schema_hash() -> str:
    # Building must work where the plugin is absent or newer (e.g. to ship a file
    # elsewhere); fall back to the newest hash we carry and let
    # check_plugin_schema() complain where it matters.
    known = known_schema_hashes()
    version = installed_plugin_version()
    return known.get(version or "", known[_newest(known)])


def default_grid(num_chips: int) -> tuple[int, int]:
    """Physical (rows, cols) grid for ``num_chips``: the usual machine shape, else 1xN."""
    return _DEFAULT_GRIDS.get(num_chips, (1, num_chips))


# ----------------------------------------------------------------------- topology


def _channels(
    arch: str, grid: tuple[int, int], topology: str
) -> list[tuple[int, tuple[int, int], int, tuple[int, int]]]:
    """Ethernet links (dev0, core0, dev1, core1) between neighbours on a row-major grid.

    line:  open 2-D mesh (a plain line on a 1xN grid).
    ring:  line, plus a wrap-around link closing every row (the x axis, along which
           device ids are consecutive) into a ring.
    torus: line, plus wrap-around links on both axes.
    machine: the cabling of a Galaxy-based grid (:mod:`wan_sharding.systems`): a torus with the
           Galaxy's links per on-board neighbour pair and fewer links on every hop that crosses
           from one Galaxy to the next (the wrap-around of a multi-Galaxy axis is such a hop).
    A wrap link is only added on an axis longer than 2 (on length 2 it would just
    duplicate the neighbour link). Link k of a direction uses Ethernet channel
    ``direction + 4 k`` (all distinct on one chip).
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
    if topology == "none":
        return []
    rows, cols = grid
    links, cross = 1, 1
    seg_y = seg_x = 0
    if topology == "machine":
        counts = systems.galaxy_links(arch, grid)
        if counts is None:
            raise ValueError(f"topology 'machine' is known for Galaxy grids (8x4, 4x8 and the multi-Galaxy "
                             f"{', '.join(f'{r}x{c}' for r, c in systems.MULTI_GALAXY)}), not {rows}x{cols}; "
                             "choose line, ring or torus")
        links, cross = counts
        seg_y, seg_x = systems.segment(grid, 0), systems.segment(grid, 1)
    eth = _ETH_CORE_BY_DIR[arch]
    dev = lambda r, c: r * cols + c  # noqa: E731  (row-major device id)
    core = lambda d, k: (eth[d][0] + 4 * k, eth[d][1])  # noqa: E731
    wrap_x = topology in ("ring", "torus", "machine") and cols > 2
    wrap_y = topology in ("torus", "machine") and rows > 2
    out = []

    def add(a: int, b: int, out_dir: str, in_dir: str, crossing: bool) -> None:
        for k in range(cross if crossing else links):
            out.append((a, core(out_dir, k), b, core(in_dir, k)))

    for r in range(rows):
        for c in range(cols):
            if c + 1 < cols or wrap_x:  # east neighbour
                n = (c + 1) % cols
                add(dev(r, c), dev(r, n), "east", "west", systems.crosses_galaxy(c, n, seg_x))
            if r + 1 < rows or wrap_y:  # south neighbour
                n = (r + 1) % rows
                add(dev(r, c), dev(n, c), "south", "north", systems.crosses_galaxy(r, n, seg_y))
    # Drop self-links (a 1-wide axis) just in case of a degenerate grid.
    return [ch for ch in out if ch[0] != ch[2]]


# ------------------------------------------------------------------------- writer


def build_system_descriptor(
    arch: str,
    num_chips: int,
    *,
    grid: tuple[int, int] | None = None,
    topology: str = "none",
    schema_hash: str | None = None,
) -> bytes:
    """Build a ``.ttsys`` system descriptor for ``num_chips`` chips of ``arch``.

    Args:
        arch: ``"wormhole_b0"`` or ``"blackhole"`` (keys of ``chips.json``).
        num_chips: number of chips, i.e. the number of devices JAX will see.
        grid: physical (rows, cols) layout; defaults to :func:`default_grid`.
            Chip coords are row-major on this grid.
        topology: ethernet links to list: ``"none"`` (empty list; what is known to
            compile), ``"line"``, ``"ring"``, ``"torus"`` or ``"machine"`` (a Galaxy-based
            grid as cabled, inter-Galaxy hops with fewer links; see :func:`_channels`).
            Ethernet core coordinates in the links are nominal.
        schema_hash: override the schema hash (default: the installed plugin's, or
            the newest one carried if the plugin is absent or unknown).

    Returns:
        The size-prefixed FlatBuffers bytes, file identifier ``TTSY``.
    """
    if num_chips < 1:
        raise ValueError(f"num_chips must be >= 1, got {num_chips}")
    chip = _chip_for(arch, num_chips)
    grid = tuple(grid) if grid is not None else default_grid(num_chips)
    if len(grid) != 2 or grid[0] * grid[1] != num_chips or min(grid) < 1:
        raise ValueError(f"grid {grid} does not hold exactly {num_chips} chips")
    channels = _channels(arch, grid, topology)
    return ttsys.encode_descriptor(chip, num_chips, grid, channels, _data()["root_defaults"],
                                   schema_hash if schema_hash is not None else _default_schema_hash())


def write_system_descriptor(
    path: str | os.PathLike[str], arch: str, num_chips: int, **kw: Any
) -> Path:
    """Build a descriptor (see :func:`build_system_descriptor`) and write it to ``path``.

    Parent directories are created; the file is written through a temporary name and a rename
    (:func:`wan_sharding.runtime.workers.atomic_write`), so it is never seen half-written.  Returns the
    path written.
    """
    return atomic_write(path, build_system_descriptor(arch, num_chips, **kw))


# ------------------------------------------------------------------------- reader


def read_system_descriptor(data: bytes) -> dict[str, Any]:
    """Decode the parts of a ``.ttsys`` buffer that matter here.

    Returns a dict with ``version`` (major, minor, patch), ``schema_hash``,
    ``ttmlir_git_hash``, ``product_identifier``, ``num_chips``, ``archs`` (arch
    name per chip), ``chip_desc_indices``, ``chip_capabilities``, ``coords``
    ((y, x) per chip), ``channels`` ((dev0, (y, x), dev1, (y, x)) per link),
    ``cpus`` ((role, triple)) and ``chips`` (decoded ChipDesc dicts).

    Raises SystemDescriptorError if the buffer is not a size-prefixed ``TTSY`` buffer.
    """
    try:
        out = ttsys.decode(data)
    except ttsys.FormatError as e:
        raise SystemDescriptorError(
            f"{e}. Fix: regenerate it with wan_sharding.compile.sysdesc.write_system_descriptor.") from None
    out["archs"] = [_ARCH_KEY.get(a) for a in out["archs"]]  # our keys ("wormhole_b0"), not the schema's names
    return out


# ------------------------------------------------------------------------- checks


def check_plugin_schema(data: bytes, plugin_version: str | None = None) -> str:
    """Check that the descriptor's schema hash is the one the plugin accepts.

    ``plugin_version`` defaults to the installed ``jax-tt-plugin``.  The plugin itself
    only notices a mismatch when it compiles; this catches it before JAX starts.
    Returns the hash; raises SystemDescriptorError naming the problem and the fix.
    """
    version = plugin_version or installed_plugin_version()
    want = expected_schema_hash(version)
    got = read_system_descriptor(data)["schema_hash"]
    if got != want:
        raise SystemDescriptorError(
            f"system descriptor schema hash {got!r} does not match the hash {want!r} that "
            f"{PLUGIN_DIST}=={version} was built with (the plugin would fail with "
            "'system desc schema mismatch'). Fix: regenerate the descriptor with "
            "wan_sharding.compile.sysdesc.write_system_descriptor under this plugin version."
        )
    return got


def inter_galaxy_channels(desc: dict[str, Any], grid: tuple[int, int]) -> int:
    """How many of a read descriptor's links join two different Galaxies of ``grid`` (0 for a
    grid that is not several Galaxies)."""
    split = systems.galaxies(grid)
    if split is None:
        return 0
    per = (grid[0] // split[0], grid[1] // split[1])
    which = lambda yx: (yx[0] // per[0], yx[1] // per[1])  # noqa: E731  (the Galaxy a chip is on)
    coords = desc["coords"]
    return sum(1 for d0, _, d1, _ in desc["channels"] if which(coords[d0]) != which(coords[d1]))


def check_chip_count(data: bytes, mesh_shape: tuple[int, ...] | int) -> int:
    """Check that the descriptor has at least as many chips as ``mesh_shape`` needs.

    Returns the chip count; raises SystemDescriptorError otherwise.
    """
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    need = 1
    for s in shape:
        need *= int(s)
    have = read_system_descriptor(data)["num_chips"]
    if have < need:
        raise SystemDescriptorError(
            f"mesh {'x'.join(map(str, shape))} needs {need} chips but the system descriptor "
            f"has {have}. Fix: write a descriptor with num_chips >= {need} "
            f"(e.g. write_system_descriptor(path, arch, {need})) and point "
            "TT_COMPILE_ONLY_SYSTEM_DESC at it."
        )
    return have
