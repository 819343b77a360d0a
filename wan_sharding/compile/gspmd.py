"""GSPMD sharding strings and their Shardy equivalents: parsing, decoding, formatting.

The pieces :mod:`.shardy` needs to rewrite a module: :func:`parse_gspmd_sharding` reads one
``HloSharding::ToString`` text (``{devices=[2,4]<=[8]}``, ``{replicated}``, tuples ...),
:func:`sdy_spec` decodes a tiled one into mesh axes per tensor dim by search (every assignment of
mesh axes to tensor dims is turned into the tile-assignment device array it produces on the mesh,
row-major device ids as ``xs.Mesh(np.arange(n), shape, names)`` lays them out, and compared with
the actual one; exactly one must match), and :func:`format_sdy_sharding` / :func:`mesh_op` write
Shardy's syntax. Anything Shardy on the mesh cannot say exactly is a :class:`ShardyError`.

Text only: imports nothing heavy.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "GspmdSharding", "ShardyError", "SdySpec", "close_paren", "format_sdy_sharding", "mesh_op",
    "parse_gspmd_sharding", "parse_sdy_sharding", "sdy_spec",
]

# Per tensor dim, the mesh axes it is split over, major to minor; () = replicated dim.
SdySpec = tuple[tuple[str, ...], ...]


class ShardyError(ValueError):
    """A sharding the converter cannot express exactly in Shardy on the given mesh.

    The message is one line naming the sharding string and where it is (argument, result, op).
    """


@dataclass(frozen=True)
class GspmdSharding:
    """One (non-tuple) GSPMD sharding, as parsed from its ``HloSharding::ToString`` text.

    ``kind`` is ``"replicated"``, ``"tiled"``, ``"maximal"``, ``"manual"`` or ``"unknown"``.
    For ``"tiled"``: ``tile_shape`` has one entry per tensor dim; ``replication`` is the size of
    the trailing replicated tile dim (1 without ``last_tile_dim_replicate``); ``devices`` is the
    tile assignment flattened row-major over ``tile_shape + (replication,)``. ``subgroups`` are the
    ``last_tile_dims`` kinds (``"replicated"``, ``"manual"``, ...), in order.
    """

    text: str
    kind: str
    tile_shape: tuple[int, ...] = ()
    replication: int = 1
    devices: tuple[int, ...] = ()
    subgroups: tuple[str, ...] = ()
    maximal_device: int | None = None


# ----------------------------------------------------------------------------- sharding strings


def _strip_metadata(body: str) -> str:
    """Drop ``metadata={...}`` (op names and source lines: no meaning for the partitioning)."""
    while True:
        i = body.find("metadata={")
        if i < 0:
            return body
        j = close_paren(body, i + len("metadata="))
        body = (body[:i] + body[j + 1:]).strip()


def _walk(s: str, i: int = 0, opens: str = "{[(", closes: str = "}])"):
    """Yield ``(index, char, depth after it)`` for the characters of ``s`` from ``i`` that lie outside
    quoted strings, counting bracket depth (``->`` is an arrow, not a closing ``>``)."""
    depth, in_str = 0, False
    while i < len(s):
        c = s[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        else:
            if c in opens:
                depth += 1
            elif c in closes and not (c == ">" and s[i - 1] == "-"):
                depth -= 1
            yield i, c, depth
        i += 1


def _split_top(body: str) -> list[str]:
    """Split a tuple sharding's body at commas outside braces/brackets/strings."""
    parts, start = [], 0
    for i, c, depth in _walk(body):
        if c == "," and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return parts


_INTS = r"\d+(?:\s*,\s*\d+)*"
_TILED = re.compile(
    rf"devices=\[(?P<dims>{_INTS})\]\s*"
    rf"(?:<=\[(?P<iota>{_INTS})\](?:T\((?P<perm>{_INTS})\))?|(?P<list>{_INTS}))"
    r"(?P<rest>.*)\Z", re.S)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(","))


def _parse_single(text: str, body: str) -> GspmdSharding:
    body = _strip_metadata(body).strip()
    if body == "replicated":
        return GspmdSharding(text, "replicated")
    if body == "manual":
        return GspmdSharding(text, "manual")
    m = re.fullmatch(r"maximal\s+device=(\d+)", body)
    if m:
        return GspmdSharding(text, "maximal", maximal_device=int(m.group(1)))
    m = _TILED.match(body)
    if not m:
        return GspmdSharding(text, "unknown")
    dims = _ints(m.group("dims"))
    if m.group("iota"):
        # Iota form: arange, reshaped, transposed, flattened (XLA's IotaTileAssignment).
        reshape = _ints(m.group("iota"))
        perm = _ints(m.group("perm")) if m.group("perm") else tuple(range(len(reshape)))
        if sorted(perm) != list(range(len(reshape))):
            raise ShardyError(f"bad iota transpose in GSPMD sharding {text!r}")
        devices = tuple(int(d) for d in np.arange(math.prod(reshape)).reshape(reshape).transpose(perm).ravel())
    else:
        devices = _ints(m.group("list"))
    if len(devices) != math.prod(dims):
        raise ShardyError(f"GSPMD sharding {text!r} lists {len(devices)} devices for tile shape {list(dims)}")
    rest = m.group("rest").strip()
    subgroups: tuple[str, ...] = ()
    if rest == "last_tile_dim_replicate":
        subgroups = ("replicated",)
    elif rest:
        sm = re.fullmatch(r"last_tile_dims=\{([a-z_,\s]*)\}", rest)
        if not sm:
            return GspmdSharding(text, "unknown")
        subgroups = tuple(s.strip() for s in sm.group(1).split(",") if s.strip())
    if len(subgroups) > len(dims):
        raise ShardyError(f"GSPMD sharding {text!r} has more subgroup dims than tile dims")
    n_tiled = len(dims) - len(subgroups)
    # Only a single trailing "replicated" subgroup is expressible; the caller rejects the rest.
    replication = math.prod(dims[n_tiled:]) if subgroups else 1
    return GspmdSharding(text, "tiled", tile_shape=dims[:n_tiled], replication=replication,
                         devices=devices, subgroups=subgroups)


def parse_gspmd_sharding(text: str) -> GspmdSharding | tuple[GspmdSharding, ...]:
    """Parse a GSPMD sharding string (``mhlo.sharding`` value); a tuple sharding
    ``{{...}, {...}}`` gives a tuple, anything else one :class:`GspmdSharding`.

    Unsupported kinds (maximal, manual, unknown syntax) are returned, not raised: :func:`sdy_spec`
    refuses them with the place they occur. Raises :class:`ShardyError` only for text that is not
    a sharding at all.
    """
    s = text.strip()
    if not (s.startswith("{") and s.endswith("}")):
        raise ShardyError(f"not a GSPMD sharding: {text!r}")
    body = s[1:-1].strip()
    if body.startswith("{"):
        return tuple(_parse_single(p, p.strip()[1:-1]) for p in _split_top(body))
    if body == "":  # "{}": an empty tuple
        return ()
    return _parse_single(s, body)


def _candidate_specs(tile_shape: Sequence[int], axes: Sequence[tuple[str, int]]):
    """Every assignment of distinct mesh axes (ordered, major to minor) to tensor dims whose
    sizes multiply to each dim's tile count."""
    def rec(d: int, free: tuple[int, ...]):
        if d == len(tile_shape):
            yield ()
            return
        for k in range(len(free) + 1):
            for combo in itertools.permutations(free, k):
                if math.prod(axes[i][1] for i in combo) == tile_shape[d]:
                    rest = tuple(i for i in free if i not in combo)
                    for tail in rec(d + 1, rest):
                        yield (combo,) + tail
    yield from rec(0, tuple(range(len(axes))))


def sdy_spec(sharding: GspmdSharding | str, rank: int, mesh_shape: Sequence[int],
             axis_names: Sequence[str], where: str = "") -> SdySpec:
    """The Shardy dim shardings of one GSPMD sharding on a tensor of ``rank`` dims.

    Mesh devices are ``arange(n).reshape(mesh_shape)`` (torch-xla's ``xs.Mesh`` over
    ``np.arange(n)``). Axes of size 1 never appear in the result (they split nothing, and any
    spec could carry them). Raises :class:`ShardyError` naming the string and ``where`` for
    anything not expressible exactly.
    """
    if isinstance(sharding, str):
        parsed = parse_gspmd_sharding(sharding)
        if isinstance(parsed, tuple):
            raise ShardyError(f"tuple sharding {sharding!r} where one value's sharding is needed{_at(where)}")
        sharding = parsed
    text = sharding.text
    if sharding.kind == "replicated":
        return ((),) * rank
    if sharding.kind != "tiled":
        why = {"maximal": "maximal (single-device) sharding", "manual": "manual sharding"}.get(
            sharding.kind, "unrecognised sharding")
        raise ShardyError(f"{why} {text!r}{_at(where)} has no Shardy equivalent on the mesh")
    if any(g != "replicated" for g in sharding.subgroups) or len(sharding.subgroups) > 1:
        raise ShardyError(f"GSPMD sharding {text!r}{_at(where)} has subgroups {list(sharding.subgroups)}; "
                          "only one trailing 'replicated' subgroup is supported")
    if len(sharding.tile_shape) != rank:
        raise ShardyError(f"GSPMD sharding {text!r}{_at(where)} tiles {len(sharding.tile_shape)} dims of a "
                          f"rank-{rank} tensor")
    n = math.prod(mesh_shape)
    if len(sharding.devices) != n or sorted(sharding.devices) != list(range(n)):
        raise ShardyError(f"GSPMD sharding {text!r}{_at(where)} does not use each of the mesh's {n} devices once")
    # Size-1 axes are left out: with or without them the device array is the same.
    axes = [(a, s) for a, s in zip(axis_names, mesh_shape) if s > 1]
    mesh = np.arange(n).reshape([s for _, s in axes] or [1])
    actual = np.sort(np.asarray(sharding.devices).reshape(*sharding.tile_shape, sharding.replication), axis=-1)
    matches = []
    for cand in _candidate_specs(sharding.tile_shape, axes):
        used = [i for dim in cand for i in dim]
        rep = [i for i in range(len(axes)) if i not in used]
        if math.prod(axes[i][1] for i in rep) != sharding.replication:
            continue
        if axes:
            arr = mesh.transpose(used + rep).reshape(*sharding.tile_shape, sharding.replication)
        else:
            arr = mesh.reshape(*sharding.tile_shape, 1)
        # The replicated group is a set of devices: compare it sorted, not in GSPMD's order.
        if np.array_equal(np.sort(arr, axis=-1), actual):
            matches.append(tuple(tuple(axes[i][0] for i in dim) for dim in cand))
    if len(matches) != 1:
        what = "matches no" if not matches else f"matches {len(matches)}"
        raise ShardyError(f"GSPMD sharding {text!r}{_at(where)} {what} assignment of mesh axes "
                          f"{dict(zip(axis_names, mesh_shape))} (row-major device ids) to tensor dims")
    return matches[0]


def _at(where: str) -> str:
    return f" at {where}" if where else ""


def format_sdy_sharding(spec: SdySpec, mesh_name: str = "mesh") -> str:
    """``<@mesh, [{"sp"}, {}]>``: a tensor sharding without its ``#sdy.sharding`` prefix."""
    dims = ", ".join("{" + ", ".join(f'"{a}"' for a in dim) + "}" for dim in spec)
    return f"<@{mesh_name}, [{dims}]>"


def parse_sdy_sharding(text: str) -> SdySpec:
    """The dim shardings of ``<@mesh, [{"sp"}, {}]>`` / ``#sdy.sharding<@mesh, [...]>`` (closed
    dims only: what this module writes). Inverse of :func:`format_sdy_sharding`."""
    m = re.fullmatch(r"\s*(?:#sdy\.sharding)?<@[\w.$-]+,\s*\[(.*)\]\s*>\s*", text, re.S)
    if not m:
        raise ShardyError(f"not a Shardy tensor sharding: {text!r}")
    dims = re.findall(r"\{([^{}]*)\}", m.group(1))
    return tuple(tuple(re.findall(r'"([^"]+)"', d)) for d in dims)


def mesh_op(mesh_shape: Sequence[int], axis_names: Sequence[str], mesh_name: str = "mesh") -> str:
    """``sdy.mesh @mesh = <["sp"=2, "tp"=4]>`` (iota device order, the default)."""
    if len(mesh_shape) != len(axis_names) or len(set(axis_names)) != len(axis_names):
        raise ShardyError(f"mesh shape {tuple(mesh_shape)} and axis names {tuple(axis_names)} do not fit")
    return f"sdy.mesh @{mesh_name} = <[" + ", ".join(f'"{a}"={s}' for a, s in zip(axis_names, mesh_shape)) + "]>"


def close_paren(s: str, i: int) -> int:
    """Index of the bracket closing the one at ``s[i]``, skipping quoted strings."""
    for j, c, depth in _walk(s, i, "([{<", ")]}>"):
        if depth == 0 and c in ")]}>":
            return j
    return len(s)
