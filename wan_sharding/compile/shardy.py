"""GSPMD -> Shardy, on StableHLO text: what Tenstorrent's torch-xla build does before tt-mlir.

Stock torch-xla lowers an SPMD graph to StableHLO with GSPMD shardings: ``mhlo.sharding =
"{devices=[...]...}"`` on function arguments (and results), ``stablehlo.custom_call @Sharding`` for
activation constraints, occasionally ``mhlo.sharding`` on other ops. The Tenstorrent PJRT plugin
rejects that form ("GSPMD presharded argument missing @Sharding custom call."); Tenstorrent's own
torch-xla converts to Shardy first, and jaxlib does not expose XLA's import pipeline. So this
module rewrites the text:

- ``sdy.mesh @mesh = <["sp"=2, "tp"=4]>`` at the top of the module body (the syntax JAX 0.7.1 emits);
- argument / result ``mhlo.sharding = "..."`` -> ``sdy.sharding = #sdy.sharding<@mesh, [{"sp"}, {}]>``;
- ``%y = stablehlo.custom_call @Sharding(%x) {mhlo.sharding = "..."}`` ->
  ``%y = sdy.sharding_constraint %x <@mesh, [...]> : tensor<...>`` (same SSA name);
- ``mhlo.sharding`` on any other op -> ``sdy.sharding = #sdy.sharding_per_value<[<@mesh, [...]>, ...]>``.

A tiled GSPMD sharding is decoded by search: every assignment of mesh axes to tensor dims is
turned into the tile-assignment device array it produces on the mesh (row-major device ids, as
``xs.Mesh(np.arange(n), shape, names)`` lays them out) and compared with the actual one; exactly
one must match. Anything Shardy on this mesh cannot say exactly (maximal, manual, a device order
no axis assignment produces) is a :class:`ShardyError`; nothing is ever silently replicated.

Text only (regex plus a small parser for the sharding strings): imports nothing heavy, so the
calling process stays free of JAX / torch-xla. :func:`compile_stablehlo_text` is the exception:
it runs inside a process that already has the Tenstorrent plugin initialised.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

__all__ = [
    "GspmdSharding", "ShardyError", "SdySpec", "TextCompileResult", "compile_stablehlo_text",
    "format_sdy_sharding", "gspmd_to_shardy", "mesh_op", "parse_gspmd_sharding", "parse_sdy_sharding",
    "sdy_spec",
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
        j = _close_paren(body, i + len("metadata="))
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


# ---------------------------------------------------------------------------------- module text

_SHARDING_ATTR = re.compile(r'mhlo\.sharding = "((?:[^"\\]|\\.)*)"')
_TENSOR = re.compile(r"tensor<((?:(?:\d+|\?)x)*)[^<>]*(?:<[^<>]*>)?[^<>]*>")
_SHARDING_CALL = re.compile(
    r"^(?P<indent>\s*)(?P<res>%[\w.$#-]+) = stablehlo\.custom_call @Sharding\((?P<arg>%[\w.$#-]+)\)\s*"
    r"\{(?P<attrs>.*)\}\s*:\s*\((?P<tin>tensor<[^()]*?>)\)\s*->\s*(?P<tout>tensor<[^()]*?>)\s*$")
_FUNC = re.compile(r"^\s*func\.func\b")
_MODULE = re.compile(r"^(\s*)module\b[^\n]*\{\s*$")


def _rank(tensor_type: str) -> int:
    m = _TENSOR.fullmatch(tensor_type.strip())
    if not m:
        raise ValueError(tensor_type)
    return m.group(1).count("x")


def _unescape(s: str) -> str:
    # MLIR string escapes (\22 for a quote, \\ ...): only metadata ever needs them.
    return re.sub(r"\\([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), s).replace('\\"', '"')


class _Converter:
    def __init__(self, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...], mesh_name: str):
        self.mesh_shape, self.axis_names, self.mesh_name = mesh_shape, axis_names, mesh_name
        self._cache: dict[tuple[str, int], SdySpec] = {}

    def spec(self, text: str, rank: int, where: str) -> str:
        key = (text, rank)
        if key not in self._cache:
            self._cache[key] = sdy_spec(self.single(text, where), rank, self.mesh_shape, self.axis_names, where)
        return format_sdy_sharding(self._cache[key], self.mesh_name)

    def single(self, text: str, where: str) -> GspmdSharding:
        parsed = parse_gspmd_sharding(_unescape(text))
        if isinstance(parsed, tuple):
            raise ShardyError(f"tuple sharding {text!r} at {where}, where one value's sharding is needed")
        return parsed

    def func_header(self, line: str, lineno: int) -> str:
        """Arguments and results of a ``func.func`` signature (one line, as MLIR prints it)."""
        name = re.search(r"@([\w.$-]+)\(", line)
        fname = name.group(1) if name else "?"
        args_end = _close_paren(line, name.end() - 1) if name else len(line)
        out, last = [], 0
        # One pass, left to right (a 14B DiT has ~1000 arguments on this one line): the type and
        # the argument name before each attribute come from the text since the previous one.
        ttype, arg, n_results = None, "?", 0
        for m in _SHARDING_ATTR.finditer(line):
            segment = line[last:m.start()]
            for t in _TENSOR.finditer(segment):
                ttype = t.group(1)
                if last + t.start() > args_end:
                    n_results += 1
            names = re.findall(r"(%[\w.$-]+)\s*:", segment)
            arg = names[-1] if names else arg
            where = (f"argument {arg} of @{fname} (line {lineno})" if m.start() < args_end
                     else f"result {n_results - 1} of @{fname} (line {lineno})")
            if ttype is None:
                raise ShardyError(f"sharding {m.group(1)!r} at {where} is not on a tensor")
            out.append(segment)
            out.append(f"sdy.sharding = #sdy.sharding{self.spec(m.group(1), ttype.count('x'), where)}")
            last = m.end()
        out.append(line[last:])
        return "".join(out)

    def sharding_call(self, m: re.Match[str], lineno: int) -> str:
        where = f"custom_call @Sharding {m.group('res')} (line {lineno})"
        attrs = _SHARDING_ATTR.findall(m.group("attrs"))
        if len(attrs) != 1:
            raise ShardyError(f"{where} has {len(attrs)} mhlo.sharding attributes, not one")
        if m.group("tin").replace(" ", "") != m.group("tout").replace(" ", ""):
            raise ShardyError(f"{where} changes type {m.group('tin')} -> {m.group('tout')}")
        spec = self.spec(attrs[0], _rank(m.group("tout")), where)
        # Same result name: every use of the custom call's value stays valid.
        return (f"{m.group('indent')}{m.group('res')} = sdy.sharding_constraint {m.group('arg')} {spec} "
                f": {m.group('tout')}")

    def op(self, line: str, lineno: int) -> str:
        """``mhlo.sharding`` on any other op: one Shardy sharding per result."""
        m = _SHARDING_ATTR.search(line)
        assert m is not None
        res = re.match(r"\s*(%[\w.$#-]+(?::\d+)?)", line)
        opname = re.search(r"=\s*\"?([\w.]+)", line)
        where = (f"op {opname.group(1) if opname else '?'} "
                 f"{res.group(1) if res else ''} (line {lineno})").replace("  ", " ")
        results = _result_types(line[m.end():])
        if results is None:
            raise ShardyError(f"sharding {m.group(1)!r} at {where}: cannot read the op's result types")
        parsed = parse_gspmd_sharding(_unescape(m.group(1)))
        values = list(parsed) if isinstance(parsed, tuple) else [parsed]
        if len(values) != len(results):
            raise ShardyError(f"sharding {m.group(1)!r} at {where} has {len(values)} entries for "
                              f"{len(results)} results")
        parts = []
        for i, (v, t) in enumerate(zip(values, results)):
            w = where if len(results) == 1 else f"{where} result {i}"
            try:
                rank = _rank(t)
            except ValueError:
                raise ShardyError(f"sharding {v.text!r} at {w} is on non-tensor type {t}") from None
            key = (v.text, rank)
            if key not in self._cache:
                self._cache[key] = sdy_spec(v, rank, self.mesh_shape, self.axis_names, w)
            parts.append(format_sdy_sharding(self._cache[key], self.mesh_name))
        new = f"sdy.sharding = #sdy.sharding_per_value<[{', '.join(parts)}]>"
        return line[:m.start()] + new + line[m.end():]


def _close_paren(s: str, i: int) -> int:
    """Index of the bracket closing the one at ``s[i]``, skipping quoted strings."""
    for j, c, depth in _walk(s, i, "([{<", ")]}>"):
        if depth == 0 and c in ")]}>":
            return j
    return len(s)


def _result_types(tail: str) -> list[str] | None:
    """Result types from the text after an op's sharding attribute: the trailing type of the op,
    ``: (A, B) -> R``, ``: (A) -> (R1, R2)``, ``: T`` or ``: T1, T2``."""
    tail = re.sub(r'"(?:[^"\\]|\\.)*"', '""', tail)  # no " : " inside strings
    if " : " not in f" {tail}":
        return None
    sig = f" {tail}".rsplit(" : ", 1)[1].strip()
    if "->" in sig:
        sig = sig.rsplit("->", 1)[1].strip()
    if sig.startswith("(") and sig.endswith(")"):
        sig = sig[1:-1]
    types = [t.group(0) for t in _TENSOR.finditer(sig)]
    rest = _TENSOR.sub("", sig).replace(",", "").strip()
    return types if types and not rest else ([sig] if sig else None)


def gspmd_to_shardy(module_text: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...],
                    mesh_name: str = "mesh") -> str:
    """Convert torch-xla's pre-partitioning StableHLO text (GSPMD shardings) to Shardy.

    Args:
        module_text: the module as ``xm.get_stablehlo`` prints it (one op per line, function
            signatures on one line).
        mesh_shape, axis_names: the mesh the shardings were made on; devices are
            ``arange(n).reshape(mesh_shape)`` (torch-xla's ``xs.Mesh(np.arange(n), ...)``).
        mesh_name: the ``sdy.mesh`` symbol.

    Returns:
        The module text with ``sdy.mesh``, ``sdy.sharding``, ``sdy.sharding_constraint`` and
        ``sdy.sharding_per_value`` in place of every GSPMD sharding; everything else unchanged.

    Raises:
        ShardyError: a sharding with no exact Shardy equivalent on this mesh (maximal, manual,
            a device order no axis assignment produces, ...), a ``@Sharding`` call in an
            unexpected form, or a module that already has this mesh.
    """
    mesh_shape, axis_names = tuple(int(s) for s in mesh_shape), tuple(axis_names)
    mesh_line = mesh_op(mesh_shape, axis_names, mesh_name)
    if re.search(rf"sdy\.mesh @{re.escape(mesh_name)}\b", module_text):
        raise ShardyError(f"module already has a Shardy mesh @{mesh_name}")
    # Module-level GSPMD shardings (XLA's HLO import writes them): converting only the per-value
    # attributes would leave them disagreeing with the Shardy ones, so refuse rather than guess.
    gspmd_module = re.search(r"mhlo\.spmd_(?:parameters_shardings|output_sharding)\b", module_text)
    if gspmd_module:
        raise ShardyError(f"module attribute {gspmd_module.group(0)} (GSPMD-only) is not converted")
    conv = _Converter(mesh_shape, axis_names, mesh_name)
    lines = module_text.split("\n")
    out: list[str] = []
    inserted = False
    for lineno, line in enumerate(lines, 1):
        if not inserted:
            mm = _MODULE.match(line)
            if mm:
                out.append(line)
                out.append(f"{mm.group(1)}  {mesh_line}")
                inserted = True
                continue
        if "@Sharding(" in line or '"Sharding"' in line:
            m = _SHARDING_CALL.match(line)
            if not m:
                raise ShardyError(f"@Sharding custom call in an unexpected form at line {lineno}: {line.strip()[:200]}")
            out.append(conv.sharding_call(m, lineno))
        elif "mhlo.sharding" not in line:
            out.append(line)
        elif _FUNC.match(line):
            out.append(conv.func_header(line, lineno))
        else:
            out.append(conv.op(line, lineno))
    if not inserted:
        raise ShardyError("no 'module ... {' line found to put the sdy.mesh in")
    text = "\n".join(out)
    left = _SHARDING_ATTR.search(text)
    if left:  # e.g. two attributes on one op line: never leave a GSPMD sharding behind
        raise ShardyError(f"GSPMD sharding {left.group(1)!r} left unconverted at offset {left.start()}")
    return text


# ------------------------------------------------------------------------- compiling the text


class TextCompileResult(NamedTuple):
    """What :func:`compile_stablehlo_text` leaves: the exported IR files (``None`` when the
    plugin wrote none) and the wall time of the compile."""

    ttnn_path: str | None
    ttir_path: str | None
    seconds: float


def _find_ir(out_dir: Path, stage: str) -> str | None:
    # The plugin writes <out>/irs/<stage>_<timestamp>.mlir ("ttnn_runtime_*" is a second dump).
    hits = sorted(p for p in (out_dir / "irs").glob(f"{stage}_*.mlir") if re.fullmatch(rf"{stage}_\d+\.mlir", p.name))
    return str(hits[-1]) if hits else None


def compile_stablehlo_text(module_text: str, num_devices: int, export_dir: str | Path) -> TextCompileResult:
    """Compile a (Shardy) StableHLO text module on the Tenstorrent PJRT client, exporting IR.

    Must run in a process where JAX sees the ``tt`` platform (``TT_COMPILE_ONLY_SYSTEM_DESC`` set
    before JAX starts, ``JAX_PLATFORMS`` unset: ``runner.worker_env``). The module is compiled
    for the first ``num_devices`` devices, one replica, ``num_devices`` partitions; the plugin
    writes its IRs to ``export_dir/irs/`` (compile option ``export_path``, as ``lowered.compile``
    passes it in :mod:`.lowering`).

    Raises:
        RuntimeError: JAX's backend is not the tt plugin or has too few devices;
        whatever the plugin raises (``XlaRuntimeError``) when tt-mlir rejects the module.
    """
    from jax._src import compiler, xla_bridge
    from jax._src.lib import xla_client as xc

    backend = xla_bridge.get_backend("tt")
    devices = backend.devices()
    if len(devices) < num_devices:
        raise RuntimeError(f"the tt backend has {len(devices)} devices; {num_devices} needed")
    devices = devices[:num_devices]
    export = Path(export_dir)
    export.mkdir(parents=True, exist_ok=True)
    # As jax.jit's compile: one replica, one partition per device, SPMD; export_path goes in as
    # an env option override (the plugin reads it from the compile options).
    opts = compiler.get_compile_options(
        num_replicas=1, num_partitions=num_devices,
        device_assignment=np.array(devices).reshape(1, num_devices),
        env_options_overrides={"export_path": str(export)}, backend=backend)
    t0 = time.perf_counter()
    backend.compile_and_load(module_text, xc.DeviceList(tuple(devices)), opts)
    return TextCompileResult(_find_ir(export, "ttnn"), _find_ir(export, "ttir"), round(time.perf_counter() - t0, 3))
