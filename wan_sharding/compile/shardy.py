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

The sharding strings themselves are parsed and decoded in :mod:`.gspmd`; the converted text is
compiled by :func:`.tt_client.compile_stablehlo_text`. Text only (regex plus :mod:`.gspmd`): imports
nothing heavy, so the calling process stays free of JAX / torch-xla.
"""

from __future__ import annotations

import re

from .gspmd import (GspmdSharding, SdySpec, ShardyError, close_paren, format_sdy_sharding, mesh_op,
                    parse_gspmd_sharding, parse_sdy_sharding, sdy_spec)
from .tt_client import TextCompileResult, compile_stablehlo_text

__all__ = [
    "GspmdSharding", "ShardyError", "SdySpec", "TextCompileResult", "compile_stablehlo_text",
    "format_sdy_sharding", "gspmd_to_shardy", "mesh_op", "parse_gspmd_sharding", "parse_sdy_sharding",
    "sdy_spec",
]


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
        args_end = close_paren(line, name.end() - 1) if name else len(line)
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
