"""The halo exchange, written in the global view: any partitioner runs it shard-local.

A frame ``(..., H, W)`` lies on the mesh with H split ``nh`` ways on one axis and W ``nw`` ways on
the other (:class:`FrameSplit`). A convolution whose window crosses a shard boundary needs a few
rows of the neighbouring shard (its halo). Shardy (tt-mlir's partitioner) has no halo exchange for
a convolution and gathers its split input whole, so the exchange is spelled out here with ops
every partitioner keeps local, plus one collective per split dim:

1. ``exchange``: the boundary rows of every shard (``lo`` last, ``hi`` first rows) are constrained
   replicated (one small all-gather), shifted by one shard on the replicated copy (shard ``p``
   takes shard ``p-1``'s last rows and shard ``p+1``'s first; the outermost get zeros, the conv's
   own zero padding), constrained back to one piece per shard (a local slice) and concatenated
   onto each shard's rows. H first, then W on the H-extended rows, so the corners come along.
   The all-gather hands every chip of the axis every shard's boundary rows (``n x 2`` rows on an
   ``n``-long axis, where a chip needs its two neighbours'): tt-mlir takes no gather over part of
   an axis, and lowers the neighbour-only forms to serial point-to-point chains (``docs/vae.md``).
   Given ``max_gather`` (the handle passes the values of the mid-block attention's K or V gather,
   the collectives a step needs the size of a frame), a larger gather is cut into pieces along
   the leading channels x frames dim: the same bytes, no piece larger than that frame.
2. ``fold``: the ``nh x nw`` shards move into the batch dim: ``(nh*nw*B, ..., h+lo+hi, w+lo+hi)``
   split over both axes on dim 0. The conv then runs with padding 0 on H and W, which is a
   batch-parallel op for any partitioner.
3. ``unfold``: back to ``(..., H, W)`` with H and W split.

``mode="permute"`` does the shift on the split copy instead (no gather): the partitioner then
emits a ``collective-permute`` per shift, which tt-mlir lowers to a serial chain of point-to-point
transfers (``docs/vae.md`` compares the two).

Rows past the frame's logical size (the padding when the mesh does not divide H or W) are zeroed
before every exchange (:func:`mask_logical`), so they read as the conv's zero padding did.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

Constrain = Callable[[torch.Tensor, tuple], torch.Tensor]
# gather: the package's; permute: the shift as collective-permutes; none: no neighbour rows at all
# (each shard convolved alone, as naive tiling would: wrong at every shard border; the check's
# case that shows its grade can fail)
EXCHANGES = ("gather", "permute", "none")


@dataclass(frozen=True)
class FrameSplit:
    """How a frame lies on the mesh: H over ``h_axis`` in ``nh`` pieces, W over ``w_axis`` in ``nw``."""

    h_axis: str
    w_axis: str
    nh: int
    nw: int

    @property
    def shards(self) -> int:
        return self.nh * self.nw

    def frame_spec(self, ndim: int) -> tuple:
        """The spec of a ``(..., H, W)`` tensor split over the mesh."""
        return (None,) * (ndim - 2) + (self.h_axis, self.w_axis)

    def folded_spec(self, ndim: int) -> tuple:
        """The spec of a folded ``(nh*nw*B, ...)`` tensor: the shards on dim 0."""
        return ((self.h_axis, self.w_axis),) + (None,) * (ndim - 1)

    def describe(self) -> str:
        return f"H/{self.nh} on {self.h_axis}, W/{self.nw} on {self.w_axis}"


@functools.lru_cache(maxsize=None)
def kept_rows(size: int, logical: int) -> tuple[bool, ...]:
    """Which of ``size`` rows (or columns) lie inside the logical ``logical``: built once per frame
    plan and size, read by every step (``kept_rows.cache_info()`` counts the builds)."""
    return tuple(r < logical for r in range(size))


@functools.lru_cache(maxsize=None)
def selection(n: int, step: int) -> tuple[tuple[float, ...], ...]:
    """The 0/1 matrix ``S[p, q] = 1`` where ``q == p - step`` (:func:`_select`), once per size."""
    return tuple(tuple(1.0 if q == p - step else 0.0 for q in range(n)) for p in range(n))


def mask_logical(x: torch.Tensor, logical_h: int, logical_w: int) -> torch.Tensor:
    """``x`` with every row at or past ``logical_h`` and column at or past ``logical_w`` zeroed
    (unchanged when it has no padding)."""
    h, w = x.shape[-2:]
    if logical_h >= h and logical_w >= w:
        return x
    # constants of the program, one per dim (the rows and columns kept, tables cached per frame
    # plan), their outer product in it: no integer arithmetic (torchax would make int64 of it, which
    # JAX without x64 truncates with a warning) and no host work per pixel at any step
    rows = torch.tensor(kept_rows(h, logical_h), device=x.device)
    cols = torch.tensor(kept_rows(w, logical_w), device=x.device)
    keep = rows[:, None] & cols[None, :]
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _with(spec: tuple, dim: int, axis: str | None) -> tuple:
    out = list(spec)
    out[dim] = axis
    return tuple(out)


def _shift(rows: torch.Tensor, dim: int, step: int, spec: tuple, constrain: Constrain) -> torch.Tensor:
    """Along the shard dim ``dim``: shard ``p`` gets what shard ``p - step`` had (``step`` +1 or -1);
    the shard with no such neighbour gets zeros. Every value is pinned to ``spec``: a partitioner
    propagates shardings both ways, and an unpinned slice or zero block between two constraints
    takes the split of its user (a collective-permute or all-to-all where none is needed)."""
    n = rows.shape[dim]
    zero = constrain(torch.zeros_like(rows.narrow(dim, 0, 1)), spec)
    if n == 1:
        return zero
    kept = constrain(rows.narrow(dim, 0, n - 1) if step > 0 else rows.narrow(dim, 1, n - 1), spec)
    return constrain(torch.cat([zero, kept] if step > 0 else [kept, zero], dim), spec)


def _select(rows: torch.Tensor, dim: int, step: int, spec: tuple, constrain: Constrain) -> torch.Tensor:
    """:func:`_shift` of gathered rows written as a sum over a constant 0/1 selection
    (``out[p] = sum_q S[p, q] rows[q]``, ``S[p, p - step] = 1``): elementwise products and a sum
    over the replicated dim, no reshape and no concatenate on the shard dim, so each device computes
    its own shard's rows from what it holds and no partitioner finds a shift to turn into a
    collective (tt-mlir's Shardy made point-to-point chains of the concatenate form, and an
    all-to-all of a matmul's flattening). Exact in any dtype: each output is one value times 1
    plus zeros."""
    n = rows.shape[dim]
    select = torch.tensor(selection(n, step), dtype=rows.dtype, device=rows.device)  # [p, q], a constant
    select = select.reshape([1] * dim + [n, n] + [1] * (rows.ndim - dim - 1))
    return (rows.unsqueeze(dim) * select).sum(dim + 1)


def gather_pieces(rows: torch.Tensor, dim: int, spec: tuple, max_gather: int | None) -> int:
    """How many all-gathers the boundary ``rows`` (shard dim ``dim``) move in: one, or as many as keep
    each one's gathered copy (what it hands each chip: every shard of ``dim``'s axis) within
    ``max_gather`` values, cut along the leading dim (channels x frames)."""
    if max_gather is None:
        return 1
    others = math.prod([rows.shape[d] for d, axis in enumerate(spec) if axis is not None and d != dim])
    return gather_pieces_for(rows.numel() // others, max_gather, rows.shape[0])


def gather_pieces_for(per_chip: float, limit: float, most: int) -> int:
    """The one cutting rule (the handle's and the planner's): a gather handing each chip
    ``per_chip`` (values or bytes) goes in as many pieces as keep each within ``limit``, at most
    ``most`` (one per leading row: channels x frames), at least one."""
    return int(max(1, min(most, -(-per_chip // limit))))


def exchange(x: torch.Tensor, dim: int, axis: str, lo: int, hi: int, spec: tuple, constrain: Constrain,
             mode: str = "gather", max_gather: int | None = None) -> torch.Tensor:
    """Extend every shard along rows dim ``dim + 1`` by ``lo`` rows of the previous shard and ``hi``
    of the next one; ``dim`` is the shard dim (split over ``axis``), ``spec`` ``x``'s spec. With
    ``max_gather``, the gather is cut into pieces along dim 0 (:func:`gather_pieces`), one
    all-gather each: the same bytes, none of them larger than that."""
    if not lo and not hi:
        return x
    s = x.shape[dim + 1]
    if max(lo, hi) > s:
        raise ValueError(f"a halo of {max(lo, hi)} rows needs shards of at least that many rows, got {s}")
    if mode == "none":
        zeros = lambda k: [constrain(torch.zeros_like(x.narrow(dim + 1, 0, k)), spec)] if k else []  # noqa: E731
        return constrain(torch.cat([*zeros(lo), x, *zeros(hi)], dim + 1), spec)
    ends = [x.narrow(dim + 1, s - lo, lo)] if lo else []
    ends += [x.narrow(dim + 1, 0, hi)] if hi else []
    rows = constrain(torch.cat(ends, dim + 1) if len(ends) > 1 else ends[0], spec)  # one collective for both ends
    # gather: the shift runs on a replicated copy (after the all-gathers); permute: on the split rows
    shift_spec = _with(spec, dim, None) if mode == "gather" else spec
    pieces = gather_pieces(rows, dim, spec, max_gather) if mode == "gather" else 1
    if pieces > 1:  # each piece pinned split, then replicated: one all-gather each
        rows = torch.cat([constrain(constrain(c, spec), shift_spec) for c in rows.tensor_split(pieces, 0)], 0)
    rows = constrain(rows, shift_spec)
    move = _select if mode == "gather" else _shift
    parts = []
    if lo:
        parts.append(constrain(move(constrain(rows.narrow(dim + 1, 0, lo), shift_spec), dim, +1, shift_spec, constrain), spec))
    parts.append(x)
    if hi:
        parts.append(constrain(move(constrain(rows.narrow(dim + 1, lo, hi), shift_spec), dim, -1, shift_spec, constrain), spec))
    return constrain(torch.cat(parts, dim + 1), spec)


def fold(x: torch.Tensor, split: FrameSplit, constrain: Constrain, halo: tuple[int, int] = (0, 0),
         mode: str = "gather", max_gather: int | None = None) -> torch.Tensor:
    """``(B, *rest, H, W)`` split over the mesh -> ``(nh*nw*B, *rest, h + lo + hi, w + lo + hi)``
    with each shard's halo of ``halo = (lo, hi)`` rows and columns (no all-gather larger than
    ``max_gather`` values per chip, :func:`exchange`); the shards on dim 0.

    The unsplit leading dims travel as one (``B * prod(rest)``), so no value has more than five
    dims: torch-xla 2.9 builds a wrong device assignment for a partly replicated sharding of a
    tensor of more (``tile_assignment ranks > 5``)."""
    b, *rest, hgt, wid = x.shape
    nh, nw = split.nh, split.nw
    lead = b * math.prod(rest)
    x = x.reshape(lead, nh, hgt // nh, nw, wid // nw)
    spec = (None, split.h_axis, None, split.w_axis, None)
    x = constrain(x, spec)
    lo, hi = halo
    x = exchange(x, 1, split.h_axis, lo, hi, spec, constrain, mode, max_gather)  # H first
    x = exchange(x, 3, split.w_axis, lo, hi, spec, constrain, mode, max_gather)  # then W, corners included
    sh, sw = x.shape[2], x.shape[4]
    x = constrain(x.permute(1, 3, 0, 2, 4), (split.h_axis, split.w_axis, None, None, None))  # (nh, nw, lead, sh, sw)
    x = x.reshape(nh * nw * b, *rest, sh, sw)
    return constrain(x, split.folded_spec(x.ndim))


def unfold(y: torch.Tensor, split: FrameSplit, constrain: Constrain) -> torch.Tensor:
    """The inverse of :func:`fold` without the halo: ``(nh*nw*B, *rest, h, w)`` -> ``(B, *rest, H, W)``."""
    nh, nw = split.nh, split.nw
    n, *rest, sh, sw = y.shape
    b = n // (nh * nw)
    lead = b * math.prod(rest)
    y = constrain(y, split.folded_spec(y.ndim))
    y = constrain(y.reshape(nh, nw, lead, sh, sw), (split.h_axis, split.w_axis, None, None, None))
    y = constrain(y.permute(2, 0, 3, 1, 4), (None, split.h_axis, None, split.w_axis, None))  # (lead, nh, sh, nw, sw)
    y = y.reshape(b, *rest, nh * sh, nw * sw)
    return constrain(y, split.frame_spec(y.ndim))
