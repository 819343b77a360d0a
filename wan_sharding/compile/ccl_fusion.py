"""Where a compiled plan has the forms tt-mlir's coming fused collectives match.

tt-mlir's open pull requests #9028 (``all_gather_minimal_matmul_async``: all-gather + matmul) and
#9066 (``minimal_matmul_strided_reduce_scatter_async``: matmul + reduce-scatter) fuse, in TTIR,
``linear(all_gather(x, last dim), W)`` where the gather has no other use and nothing stands between
the two, and ``reduce_scatter(linear(x, W), scatter_dim = last)`` where the matmul's only use is the
reduce-scatter (docs/tt-mlir-notes.md). tt-metal's Wan block runs its projections that way, the
residual stream split on D over TP between them: the sharded-residual layout
(``ShardingPlan(layout="sharded")``), where Shardy writes exactly these pairs around every
column- and row-parallel projection.

:func:`fused_ccl_sites` reads a TTIR module and lists every all-gather and reduce-scatter on the
last dim with whether it has that form (and if not, why), so a change that breaks the form fails
a test (``tests/test_frontends.py``) before a plugin that carries the fusions would miss it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ttnn_ir import Op, ttir_ops

MATMULS = ("dot_general", "matmul", "linear")
GATHER_MATMUL = "all_gather -> matmul"
MATMUL_SCATTER = "matmul -> reduce_scatter"


@dataclass(frozen=True)
class CCLSite:
    """One last-dim all-gather or reduce-scatter of a TTIR module: which pair it would fuse into, the
    TTIR line, and ``why_not`` (None when it has the form the fusion matches)."""

    kind: str
    line: int
    gathered_or_scattered: tuple[int, ...]
    why_not: str | None

    @property
    def fusable(self) -> bool:
        return self.why_not is None


def _last_dim(op: Op, attr: str) -> bool:
    rank = len(op.operands[0].shape) if op.operands else 0
    return rank > 0 and op.attrs.get(attr, -1) % rank == rank - 1


def _contracts_last(mm: Op) -> bool:
    """A matmul of ``lhs (..., K)`` by a 2-D weight that contracts ``K``: the result keeps every
    other dim of ``lhs``."""
    if len(mm.operands) < 2 or len(mm.operands[1].shape) != 2 or not mm.results:
        return False
    return mm.results[0].shape[:-1] == mm.operands[0].shape[:-1]


def fused_ccl_sites(ttir_text: str) -> list[CCLSite]:
    """Every all-gather and reduce-scatter on the last dim in ``ttir_text``, in text order, with
    whether it has the form #9028 / #9066 fuse (see the module docstring)."""
    ops = ttir_ops(ttir_text)
    by_value = {(op.function, op.result): op for op in ops if op.result}
    users: dict[tuple[str, str], list[Op]] = {}
    for op in ops:
        for v in op.values:
            users.setdefault((op.function, v), []).append(op)
    sites = []
    for op in ops:
        if op.name == "all_gather" and _last_dim(op, "all_gather_dim"):
            uses = users.get((op.function, op.result), [])
            why = None
            if len(uses) != 1:
                why = f"{len(uses)} uses, not one"
            elif uses[0].name not in MATMULS:
                why = f"feeds {uses[0].name}, not a matmul"
            elif uses[0].values[:1] != (op.result,) or not _contracts_last(uses[0]):
                why = "the matmul does not contract the gathered dim of its first operand"
            sites.append(CCLSite(GATHER_MATMUL, op.line, op.results[0].shape, why))
        elif op.name == "reduce_scatter" and _last_dim(op, "scatter_dim"):
            src = by_value.get((op.function, op.values[0])) if op.values else None
            why = None
            if src is None or src.name not in MATMULS:
                why = f"reads {src.name if src else 'an argument'}, not a matmul"
            elif len(users.get((op.function, src.result), [])) != 1:
                why = "the matmul has other uses"
            sites.append(CCLSite(MATMUL_SCATTER, op.line, op.operands[0].shape, why))
    return sites
