"""The ``.ttsys`` system descriptor format: a size-prefixed FlatBuffers buffer (file identifier
``TTSY``) that tt-mlir reads, written with the ``flatbuffers`` Builder API directly and read back.

The field slots and enum values follow tt-mlir's schema (``include/ttmlir/Target/Common/
system_desc.fbs`` and ``types.fbs`` in tenstorrent/tt-mlir): slot 0 first, in schema order. What
goes into a descriptor (which chips, their coordinates and links, the schema hash) is
:mod:`.sysdesc`'s business; this module only encodes and decodes.
"""

from __future__ import annotations

from typing import Any

import flatbuffers
from flatbuffers import encode, number_types as N
from flatbuffers.table import Table

__all__ = ["ARCH_ENUM", "CHIP_FIELDS", "DATA_TYPE", "FILE_IDENTIFIER", "FormatError", "decode", "encode_descriptor"]

FILE_IDENTIFIER = b"TTSY"


class FormatError(ValueError):
    """A buffer that is not a size-prefixed ``TTSY`` system descriptor."""


# Enum values from the tt-mlir schema.
ARCH_ENUM = {"Wormhole_b0": 0, "Blackhole": 1, "Quasar": 2}
ARCH_NAME = {v: k for k, v in ARCH_ENUM.items()}
CPU_ROLE = {"Host": 0, "Device": 1}
DATA_TYPE = {
    "Float32": 0, "Float16": 1, "BFloat16": 2, "BFP_Float8": 3, "BFP_BFloat8": 4,
    "BFP_Float4": 5, "BFP_BFloat4": 6, "BFP_Float2": 7, "BFP_BFloat2": 8,
    "UInt32": 9, "UInt16": 10, "UInt8": 11, "Int32": 12,
}
HOST_MMIO = 1  # ChipCapability bit flag

# Vtable slot numbers (slot 0 first, in schema order).
ROOT_SLOTS = dict(version=0, schema_hash=1, ttmlir_git_hash=2, product_identifier=3, system_desc=4)
SYSTEM_SLOTS = dict(cpu_descs=0, chip_descs=1, chip_desc_indices=2, chip_capabilities=3,
            chip_coords=4, chip_channels=5)
CPU_SLOTS = dict(role=0, target_triple=1)
# ChipDesc: (field, kind) in slot order.  Kinds: u32/u64 scalars, dim2d inline struct,
# u16vec / dim2dvec vectors.
CHIP_FIELDS: tuple[tuple[str, str], ...] = (
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
CHIP_SLOT = {name: i for i, (name, _) in enumerate(CHIP_FIELDS)}


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
    for name, kind in CHIP_FIELDS:
        if kind == "u16vec":
            vecs[name] = _scalar_vector(
                b, b.PrependUint16, 2, [DATA_TYPE[t] for t in chip[name]]
            )
        elif kind == "dim2dvec":
            vecs[name] = _struct_vector(b, 8, chip[name], _dim2d)
    b.StartObject(len(CHIP_FIELDS))
    for slot, (name, kind) in enumerate(CHIP_FIELDS):
        v = chip[name]
        if kind == "arch":
            b.PrependUint32Slot(slot, ARCH_ENUM[v], 0)
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


def encode_descriptor(chip: dict[str, Any], num_chips: int, grid: tuple[int, int], channels: list,
                      roots: dict[str, Any], schema_hash: str) -> bytes:
    """The descriptor of ``num_chips`` chips described by ``chip`` (one ``chips.json`` entry), row-major
    on ``grid``, linked by ``channels`` ((dev0, (y, x), dev1, (y, x)) each), with the root fields
    ``roots`` (``chips.json``'s ``root_defaults``) and ``schema_hash``: size-prefixed, ``TTSY``."""
    b = flatbuffers.Builder(4096)

    # One ChipDesc per chip: a single shared ChipDesc (all indices 0) is known to
    # crash the compiler.  FlatBuffers could share the table, but don't.
    chip_offs = [_write_chip_desc(b, chip) for _ in range(num_chips)]

    cpu_offs = []
    for cpu in roots["cpu_descs"]:
        triple = b.CreateString(cpu["target_triple"])
        b.StartObject(len(CPU_SLOTS))
        b.PrependUint8Slot(CPU_SLOTS["role"], CPU_ROLE[cpu["role"]], 0)
        b.PrependUOffsetTRelativeSlot(CPU_SLOTS["target_triple"], triple, 0)
        cpu_offs.append(b.EndObject())

    cpu_vec = _offset_vector(b, cpu_offs)
    chip_vec = _offset_vector(b, chip_offs)
    idx_vec = _scalar_vector(b, b.PrependUint32, 4, list(range(num_chips)))
    cap_vec = _scalar_vector(b, b.PrependUint32, 4, [HOST_MMIO] * num_chips)

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

    b.StartObject(len(SYSTEM_SLOTS))
    b.PrependUOffsetTRelativeSlot(SYSTEM_SLOTS["cpu_descs"], cpu_vec, 0)
    b.PrependUOffsetTRelativeSlot(SYSTEM_SLOTS["chip_descs"], chip_vec, 0)
    b.PrependUOffsetTRelativeSlot(SYSTEM_SLOTS["chip_desc_indices"], idx_vec, 0)
    b.PrependUOffsetTRelativeSlot(SYSTEM_SLOTS["chip_capabilities"], cap_vec, 0)
    b.PrependUOffsetTRelativeSlot(SYSTEM_SLOTS["chip_coords"], coord_vec, 0)
    # Always emit the (possibly empty) vector so readers see a list, not absence.
    b.PrependUOffsetTRelativeSlot(SYSTEM_SLOTS["chip_channels"], chan_vec, 0)
    sys_off = b.EndObject()

    hash_s = b.CreateString(schema_hash)
    git_s = b.CreateString(roots["ttmlir_git_hash"])
    prod_s = b.CreateString(roots["product_identifier"])

    ver = roots["version"]
    b.StartObject(len(ROOT_SLOTS))
    b.Prep(4, 8)  # Version {major: u16, minor: u16, patch: u32}
    b.PrependUint32(ver["patch"])
    b.PrependUint16(ver["minor"])
    b.PrependUint16(ver["major"])
    b.PrependStructSlot(ROOT_SLOTS["version"], b.Offset(), 0)
    b.PrependUOffsetTRelativeSlot(ROOT_SLOTS["schema_hash"], hash_s, 0)
    b.PrependUOffsetTRelativeSlot(ROOT_SLOTS["ttmlir_git_hash"], git_s, 0)
    b.PrependUOffsetTRelativeSlot(ROOT_SLOTS["product_identifier"], prod_s, 0)
    b.PrependUOffsetTRelativeSlot(ROOT_SLOTS["system_desc"], sys_off, 0)
    root = b.EndObject()

    b.FinishSizePrefixed(root, file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


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
    for slot, (name, kind) in enumerate(CHIP_FIELDS):
        o = _field(t, slot)
        if kind == "arch":
            v = _scalar(t, slot, N.Uint32Flags)
            out[name] = ARCH_NAME.get(v, v)
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


def decode(data: bytes) -> dict[str, Any]:
    """Decode a ``.ttsys`` buffer: ``version`` (major, minor, patch), ``schema_hash``,
    ``ttmlir_git_hash``, ``product_identifier``, ``num_chips``, ``archs`` (the schema's arch name per
    chip), ``chip_desc_indices``, ``chip_capabilities``, ``coords`` ((y, x) per chip), ``channels``
    ((dev0, (y, x), dev1, (y, x)) per link), ``cpus`` ((role, triple)) and ``chips`` (ChipDesc dicts).

    Raises FormatError if the buffer is not a size-prefixed ``TTSY`` buffer."""
    buf = bytes(data)
    if len(buf) < 12:
        raise FormatError(f"not a system descriptor: only {len(buf)} bytes")
    size = encode.Get(N.Int32Flags.packer_type, buf, 0)
    ident = buf[8:12]
    if ident != FILE_IDENTIFIER or size != len(buf) - 4:
        raise FormatError(
            "not a size-prefixed TTSY system descriptor "
            f"(identifier {ident!r}, size prefix {size}, {len(buf)} bytes)"
        )
    root_pos = 4 + encode.Get(N.UOffsetTFlags.packer_type, buf, 4)
    root = Table(buf, root_pos)

    vo = _field(root, ROOT_SLOTS["version"])
    version = (
        (root.Get(N.Uint16Flags, root.Pos + vo), root.Get(N.Uint16Flags, root.Pos + vo + 2),
         root.Get(N.Uint32Flags, root.Pos + vo + 4))
        if vo else (0, 0, 0)
    )
    out: dict[str, Any] = {
        "version": version,
        "schema_hash": _string(root, ROOT_SLOTS["schema_hash"]),
        "ttmlir_git_hash": _string(root, ROOT_SLOTS["ttmlir_git_hash"]),
        "product_identifier": _string(root, ROOT_SLOTS["product_identifier"]),
    }
    sysd = _sub_table(root, ROOT_SLOTS["system_desc"])
    if sysd is None:
        raise FormatError("system descriptor has no system_desc table")

    start, n = _vector(sysd, SYSTEM_SLOTS["cpu_descs"])
    cpus = []
    for i in range(n):
        t = Table(buf, sysd.Indirect(start + 4 * i))
        role = _scalar(t, CPU_SLOTS["role"], N.Uint8Flags)
        cpus.append(({v: k for k, v in CPU_ROLE.items()}.get(role, role),
                     _string(t, CPU_SLOTS["target_triple"])))

    start, n = _vector(sysd, SYSTEM_SLOTS["chip_descs"])
    chips = [_read_chip(Table(buf, sysd.Indirect(start + 4 * i))) for i in range(n)]

    start, n = _vector(sysd, SYSTEM_SLOTS["chip_desc_indices"])
    indices = [sysd.Get(N.Uint32Flags, start + 4 * i) for i in range(n)]
    start, n = _vector(sysd, SYSTEM_SLOTS["chip_capabilities"])
    caps = [sysd.Get(N.Uint32Flags, start + 4 * i) for i in range(n)]
    start, n = _vector(sysd, SYSTEM_SLOTS["chip_coords"])
    coords = []
    for i in range(n):
        p = start + 16 * i  # rack, shelf, y, x
        coords.append((sysd.Get(N.Uint32Flags, p + 8), sysd.Get(N.Uint32Flags, p + 12)))
    start, n = _vector(sysd, SYSTEM_SLOTS["chip_channels"])
    channels = []
    for i in range(n):
        p = start + 24 * i
        channels.append((sysd.Get(N.Uint32Flags, p), _read_dim2d(sysd, p + 4),
                         sysd.Get(N.Uint32Flags, p + 12), _read_dim2d(sysd, p + 16)))

    out.update(
        num_chips=len(indices),
        archs=[chips[i]["arch"] if i < len(chips) else None for i in indices],  # schema enum names
        chip_desc_indices=indices,
        chip_capabilities=caps,
        coords=coords,
        channels=channels,
        cpus=cpus,
        chips=chips,
    )
    return out
