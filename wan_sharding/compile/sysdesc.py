"""Tenstorrent system descriptors (``.ttsys``) for tt-mlir compile-only mode.

The tt PJRT plugin (``jax-tt-plugin``) compiles without hardware when
``TT_COMPILE_ONLY_SYSTEM_DESC`` points at a system descriptor: a size-prefixed
FlatBuffers buffer (file identifier ``TTSY``) describing the chips and their
wiring.  This module writes such buffers with the ``flatbuffers`` Builder API
directly (field slots follow the tt-mlir schema; see ``_ROOT``/``_SYS``/
``_CHIP`` below), and reads back the parts we need for tests and error checks.

Per-chip values come from ``chips.json`` next to this file.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import flatbuffers
from flatbuffers import encode, number_types as N
from flatbuffers.table import Table

from .. import systems
from ..workers import atomic_write

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
    "expected_schema_hash",
    "installed_plugin_version",
    "known_schema_hashes",
    "plugin_library",
    "schema_hash_candidates",
    "PLUGIN_DIST",
]

PLUGIN_DIST = "jax-tt-plugin"
FILE_IDENTIFIER = b"TTSY"
TOPOLOGIES = ("none", "line", "ring", "torus", "machine")

_CHIPS_JSON = Path(__file__).with_name("chips.json")

# Enum values from the tt-mlir schema.
_ARCH_ENUM = {"Wormhole_b0": 0, "Blackhole": 1, "Quasar": 2}
_ARCH_NAME = {v: k for k, v in _ARCH_ENUM.items()}
_CPU_ROLE = {"Host": 0, "Device": 1}
_DATA_TYPE = {
    "Float32": 0, "Float16": 1, "BFloat16": 2, "BFP_Float8": 3, "BFP_BFloat8": 4,
    "BFP_Float4": 5, "BFP_BFloat4": 6, "BFP_Float2": 7, "BFP_BFloat2": 8,
    "UInt32": 9, "UInt16": 10, "UInt8": 11, "Int32": 12,
}
_HOST_MMIO = 1  # ChipCapability bit flag

# Vtable slot numbers (slot 0 first, in schema order).
_ROOT = dict(version=0, schema_hash=1, ttmlir_git_hash=2, product_identifier=3, system_desc=4)
_SYS = dict(cpu_descs=0, chip_descs=1, chip_desc_indices=2, chip_capabilities=3,
            chip_coords=4, chip_channels=5)
_CPU = dict(role=0, target_triple=1)
# ChipDesc: (field, kind) in slot order.  Kinds: u32/u64 scalars, dim2d inline struct,
# u16vec / dim2dvec vectors.
_CHIP_FIELDS: tuple[tuple[str, str], ...] = (
    ("arch", "arch"),
    ("grid_size", "dim2d"),
    ("coord_translation_offsets", "dim2d"),
    ("l1_size", "u64"),
    ("num_dram_channels", "u32"),
    ("dram_channel_size", "u64"),
    ("noc_l1_address_align_bytes", "u32"),
    ("pcie_address_align_bytes", "u32"),
    ("noc_dram_address_align_bytes", "u32"),
    ("l1_unreserved_base", "u32"),
    ("erisc_l1_unreserved_base", "u32"),
    ("dram_unreserved_base", "u32"),
    ("dram_unreserved_end", "u32"),
    ("supported_data_types", "u16vec"),
    ("supported_tile_sizes", "dim2dvec"),
    ("dst_physical_size_tiles", "u32"),
    ("num_cbs", "u32"),
    ("num_compute_threads", "u32"),
    ("num_datamovement_threads", "u32"),
    ("dram_grid_size", "dim2d"),
    ("dram_bank_to_logical_worker_noc0", "dim2dvec"),
    ("dram_bank_to_logical_worker_noc1", "dim2dvec"),
)
_CHIP_SLOT = {name: i for i, (name, _) in enumerate(_CHIP_FIELDS)}

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


def _dim2d(b: flatbuffers.Builder, d: dict[str, int] | tuple[int, int]) -> int:
    y, x = (d["y"], d["x"]) if isinstance(d, dict) else d
    b.Prep(4, 8)
    b.PrependInt32(x)  # structs are written back to front
    b.PrependInt32(y)
    return b.Offset()


def _struct_vector(b: flatbuffers.Builder, size: int, items: list, write) -> int:
    b.StartVector(size, len(items), 4)
    for it in reversed(items):
        write(b, it)
    return b.EndVector()


def _scalar_vector(b: flatbuffers.Builder, prepend, size: int, items: list[int]) -> int:
    b.StartVector(size, len(items), size)
    for v in reversed(items):
        prepend(v)
    return b.EndVector()


def _offset_vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for o in reversed(offsets):
        b.PrependUOffsetTRelative(o)
    return b.EndVector()


def _write_chip_desc(b: flatbuffers.Builder, chip: dict[str, Any]) -> int:
    # Vectors must be finished before the table is started.
    vecs = {}
    for name, kind in _CHIP_FIELDS:
        if kind == "u16vec":
            vecs[name] = _scalar_vector(
                b, b.PrependUint16, 2, [_DATA_TYPE[t] for t in chip[name]]
            )
        elif kind == "dim2dvec":
            vecs[name] = _struct_vector(b, 8, chip[name], _dim2d)
    b.StartObject(len(_CHIP_FIELDS))
    for slot, (name, kind) in enumerate(_CHIP_FIELDS):
        v = chip[name]
        if kind == "arch":
            b.PrependUint32Slot(slot, _ARCH_ENUM[v], 0)
        elif kind == "u32":
            b.PrependUint32Slot(slot, v, 0)
        elif kind == "u64":
            b.PrependUint64Slot(slot, v, 0)
        elif kind == "dim2d":
            # An inline struct must be placed immediately before its slot entry.
            b.PrependStructSlot(slot, _dim2d(b, v), 0)
        else:
            b.PrependUOffsetTRelativeSlot(slot, vecs[name], 0)
    return b.EndObject()


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
    chip = _chip(arch)
    if num_chips < 1:
        raise ValueError(f"num_chips must be >= 1, got {num_chips}")
    grid = tuple(grid) if grid is not None else default_grid(num_chips)
    if len(grid) != 2 or grid[0] * grid[1] != num_chips or min(grid) < 1:
        raise ValueError(f"grid {grid} does not hold exactly {num_chips} chips")
    channels = _channels(arch, grid, topology)
    roots = _data()["root_defaults"]

    b = flatbuffers.Builder(4096)

    # One ChipDesc per chip: a single shared ChipDesc (all indices 0) is known to
    # crash the compiler.  FlatBuffers could share the table, but don't.
    chip_offs = [_write_chip_desc(b, chip) for _ in range(num_chips)]

    cpu_offs = []
    for cpu in roots["cpu_descs"]:
        triple = b.CreateString(cpu["target_triple"])
        b.StartObject(len(_CPU))
        b.PrependUint8Slot(_CPU["role"], _CPU_ROLE[cpu["role"]], 0)
        b.PrependUOffsetTRelativeSlot(_CPU["target_triple"], triple, 0)
        cpu_offs.append(b.EndObject())

    cpu_vec = _offset_vector(b, cpu_offs)
    chip_vec = _offset_vector(b, chip_offs)
    idx_vec = _scalar_vector(b, b.PrependUint32, 4, list(range(num_chips)))
    cap_vec = _scalar_vector(b, b.PrependUint32, 4, [_HOST_MMIO] * num_chips)

    def coord(b: flatbuffers.Builder, yx: tuple[int, int]) -> None:
        # ChipCoord {rack, shelf, y, x}: single rack and shelf.
        b.Prep(4, 16)
        b.PrependUint32(yx[1])
        b.PrependUint32(yx[0])
        b.PrependUint32(0)
        b.PrependUint32(0)

    rows, cols = grid
    coords = [(i // cols, i % cols) for i in range(num_chips)]
    coord_vec = _struct_vector(b, 16, coords, coord)

    def channel(b: flatbuffers.Builder, ch) -> None:
        # ChipChannel {device_id0, ethernet_core_coord0, device_id1, ethernet_core_coord1}
        d0, c0, d1, c1 = ch
        b.Prep(4, 24)
        _dim2d(b, c1)
        b.PrependUint32(d1)
        _dim2d(b, c0)
        b.PrependUint32(d0)

    chan_vec = _struct_vector(b, 24, channels, channel)

    b.StartObject(len(_SYS))
    b.PrependUOffsetTRelativeSlot(_SYS["cpu_descs"], cpu_vec, 0)
    b.PrependUOffsetTRelativeSlot(_SYS["chip_descs"], chip_vec, 0)
    b.PrependUOffsetTRelativeSlot(_SYS["chip_desc_indices"], idx_vec, 0)
    b.PrependUOffsetTRelativeSlot(_SYS["chip_capabilities"], cap_vec, 0)
    b.PrependUOffsetTRelativeSlot(_SYS["chip_coords"], coord_vec, 0)
    # Always emit the (possibly empty) vector so readers see a list, not absence.
    b.PrependUOffsetTRelativeSlot(_SYS["chip_channels"], chan_vec, 0)
    sys_off = b.EndObject()

    hash_s = b.CreateString(schema_hash if schema_hash is not None else _default_schema_hash())
    git_s = b.CreateString(roots["ttmlir_git_hash"])
    prod_s = b.CreateString(roots["product_identifier"])

    ver = roots["version"]
    b.StartObject(len(_ROOT))
    b.Prep(4, 8)  # Version {major: u16, minor: u16, patch: u32}
    b.PrependUint32(ver["patch"])
    b.PrependUint16(ver["minor"])
    b.PrependUint16(ver["major"])
    b.PrependStructSlot(_ROOT["version"], b.Offset(), 0)
    b.PrependUOffsetTRelativeSlot(_ROOT["schema_hash"], hash_s, 0)
    b.PrependUOffsetTRelativeSlot(_ROOT["ttmlir_git_hash"], git_s, 0)
    b.PrependUOffsetTRelativeSlot(_ROOT["product_identifier"], prod_s, 0)
    b.PrependUOffsetTRelativeSlot(_ROOT["system_desc"], sys_off, 0)
    root = b.EndObject()

    b.FinishSizePrefixed(root, file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


def write_system_descriptor(
    path: str | os.PathLike[str], arch: str, num_chips: int, **kw: Any
) -> Path:
    """Build a descriptor (see :func:`build_system_descriptor`) and write it to ``path``.

    Parent directories are created; the file is written through a temporary name and a rename
    (:func:`wan_sharding.workers.atomic_write`), so it is never seen half-written.  Returns the
    path written.
    """
    return atomic_write(path, build_system_descriptor(arch, num_chips, **kw))


# ------------------------------------------------------------------------- reader


def _field(t: Table, slot: int) -> int:
    return t.Offset(4 + 2 * slot)  # vtable entries follow the 2 header voffsets


def _sub_table(t: Table, slot: int) -> Table | None:
    o = _field(t, slot)
    return Table(t.Bytes, t.Indirect(t.Pos + o)) if o else None


def _string(t: Table, slot: int) -> str | None:
    o = _field(t, slot)
    return t.String(t.Pos + o).decode() if o else None


def _scalar(t: Table, slot: int, flags) -> int:
    o = _field(t, slot)
    return t.Get(flags, t.Pos + o) if o else 0


def _vector(t: Table, slot: int) -> tuple[int, int]:
    """(start of element data, length); (0, 0) if absent."""
    o = _field(t, slot)
    return (t.Vector(o), t.VectorLen(o)) if o else (0, 0)


def _read_dim2d(t: Table, pos: int) -> tuple[int, int]:
    return t.Get(N.Int32Flags, pos), t.Get(N.Int32Flags, pos + 4)


def _read_chip(t: Table) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for slot, (name, kind) in enumerate(_CHIP_FIELDS):
        o = _field(t, slot)
        if kind == "arch":
            v = _scalar(t, slot, N.Uint32Flags)
            out[name] = _ARCH_NAME.get(v, v)
        elif kind == "u32":
            out[name] = _scalar(t, slot, N.Uint32Flags)
        elif kind == "u64":
            out[name] = _scalar(t, slot, N.Uint64Flags)
        elif kind == "dim2d":
            out[name] = _read_dim2d(t, t.Pos + o) if o else (0, 0)
        else:
            start, n = _vector(t, slot)
            if kind == "u16vec":
                out[name] = [t.Get(N.Uint16Flags, start + 2 * i) for i in range(n)]
            else:
                out[name] = [_read_dim2d(t, start + 8 * i) for i in range(n)]
    return out


def read_system_descriptor(data: bytes) -> dict[str, Any]:
    """Decode the parts of a ``.ttsys`` buffer that matter here.

    Returns a dict with ``version`` (major, minor, patch), ``schema_hash``,
    ``ttmlir_git_hash``, ``product_identifier``, ``num_chips``, ``archs`` (arch
    name per chip), ``chip_desc_indices``, ``chip_capabilities``, ``coords``
    ((y, x) per chip), ``channels`` ((dev0, (y, x), dev1, (y, x)) per link),
    ``cpus`` ((role, triple)) and ``chips`` (decoded ChipDesc dicts).

    Raises SystemDescriptorError if the buffer is not a size-prefixed ``TTSY`` buffer.
    """
    buf = bytes(data)
    if len(buf) < 12:
        raise SystemDescriptorError(f"not a system descriptor: only {len(buf)} bytes")
    size = encode.Get(N.Int32Flags.packer_type, buf, 0)
    ident = buf[8:12]
    if ident != FILE_IDENTIFIER or size != len(buf) - 4:
        raise SystemDescriptorError(
            "not a size-prefixed TTSY system descriptor "
            f"(identifier {ident!r}, size prefix {size}, {len(buf)} bytes). "
            "Fix: regenerate it with wan_sharding.compile.sysdesc.write_system_descriptor."
        )
    root_pos = 4 + encode.Get(N.UOffsetTFlags.packer_type, buf, 4)
    root = Table(buf, root_pos)

    vo = _field(root, _ROOT["version"])
    version = (
        (root.Get(N.Uint16Flags, root.Pos + vo), root.Get(N.Uint16Flags, root.Pos + vo + 2),
         root.Get(N.Uint32Flags, root.Pos + vo + 4))
        if vo else (0, 0, 0)
    )
    out: dict[str, Any] = {
        "version": version,
        "schema_hash": _string(root, _ROOT["schema_hash"]),
        "ttmlir_git_hash": _string(root, _ROOT["ttmlir_git_hash"]),
        "product_identifier": _string(root, _ROOT["product_identifier"]),
    }
    sysd = _sub_table(root, _ROOT["system_desc"])
    if sysd is None:
        raise SystemDescriptorError("system descriptor has no system_desc table")

    start, n = _vector(sysd, _SYS["cpu_descs"])
    cpus = []
    for i in range(n):
        t = Table(buf, sysd.Indirect(start + 4 * i))
        role = _scalar(t, _CPU["role"], N.Uint8Flags)
        cpus.append(({v: k for k, v in _CPU_ROLE.items()}.get(role, role),
                     _string(t, _CPU["target_triple"])))

    start, n = _vector(sysd, _SYS["chip_descs"])
    chips = [_read_chip(Table(buf, sysd.Indirect(start + 4 * i))) for i in range(n)]

    start, n = _vector(sysd, _SYS["chip_desc_indices"])
    indices = [sysd.Get(N.Uint32Flags, start + 4 * i) for i in range(n)]
    start, n = _vector(sysd, _SYS["chip_capabilities"])
    caps = [sysd.Get(N.Uint32Flags, start + 4 * i) for i in range(n)]
    start, n = _vector(sysd, _SYS["chip_coords"])
    coords = []
    for i in range(n):
        p = start + 16 * i  # rack, shelf, y, x
        coords.append((sysd.Get(N.Uint32Flags, p + 8), sysd.Get(N.Uint32Flags, p + 12)))
    start, n = _vector(sysd, _SYS["chip_channels"])
    channels = []
    for i in range(n):
        p = start + 24 * i
        channels.append((sysd.Get(N.Uint32Flags, p), _read_dim2d(sysd, p + 4),
                         sysd.Get(N.Uint32Flags, p + 12), _read_dim2d(sysd, p + 16)))

    out.update(
        num_chips=len(indices),
        # Our arch keys ("wormhole_b0"), not the schema enum names ("Wormhole_b0").
        archs=[_ARCH_KEY.get(chips[i]["arch"]) if i < len(chips) else None for i in indices],
        chip_desc_indices=indices,
        chip_capabilities=caps,
        coords=coords,
        channels=channels,
        cpus=cpus,
        chips=chips,
    )
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
