"""Plan + model + mesh -> a partition spec for every parameter. Pure: never changes the model.

Works on a ``meta``-device model (only names and shapes are read), so the full 14B DiT can be
planned and compiled without weights. The machinery is generic over models (a TP table in the
``plan.py`` vocabulary, :func:`table_specs`); ``wan_sharding.dit.specs.shard_dit_specs`` is the DiT's
use of it, and ``wan_sharding.text_encoder.specs`` the UMT5 encoder's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .lora_layers import LoraError, lora_spec, parameter_role
from .mesh import MeshSpec, as_mesh_spec
from .plan import COLWISE, EMBEDDING_COLWISE, NORM_COLWISE, REPLICATE, ROWWISE, STYLES, WAN_TP_TABLE

Spec = tuple  # one entry per tensor dim: None or a mesh axis name


class ShardingError(ValueError):
    """The model, mesh or plan cannot be combined; raised before anything is changed."""


class LoraShardingError(ShardingError, LoraError):
    """A loaded LoRA adapter that cannot be split exactly (a variant, an Embedding LoRA, a LoRA on
    a module no Linear rule covers); both a ShardingError and a LoraError."""


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A plan pattern (``*``: one path component, trailing ``**``: any sub-path) as a regex on module names."""
    if pattern == "":
        return re.compile(r"\A\Z")
    parts = pattern.split(".")
    tail_any = parts[-1] == "**"
    if tail_any:
        parts = parts[:-1]
    body = r"\.".join(r"[^.]+" if p == "*" else re.escape(p) for p in parts)
    return re.compile(rf"\A{body}(?:\..+)?\Z" if tail_any else rf"\A{body}\Z")


def resolve_styles(dit: torch.nn.Module, tp_table: Mapping[str, str] = WAN_TP_TABLE,
                   written_for: str = "the Wan 2.2 DiT") -> dict[str, str]:
    """Map every parameter name to the style of the TP table pattern that names its owner module.

    Raises :class:`ShardingError` for a parameter no pattern covers (``written_for`` names the model
    the table was written for), or two patterns that disagree. PEFT's LoRA layers are matched by the
    Linear they wrap: ``<path>.base_layer.weight`` and ``<path>.lora_A.<adapter>.weight`` are owned
    by ``<path>`` (``wan_sharding.lora_layers``).
    """
    for pattern, style in tp_table.items():
        if style not in STYLES:
            raise ShardingError(f"plan entry {pattern!r} has unknown style {style!r}; known: {STYLES}")
    compiled = [(p, pattern_regex(p), s) for p, s in tp_table.items()]
    styles: dict[str, str] = {}
    uncovered: list[str] = []
    for name, _ in dit.named_parameters():
        try:
            owner = parameter_role(name)[0]
        except LoraError as e:
            raise LoraShardingError(str(e)) from None
        hits = {s for p, rx, s in compiled if rx.match(owner)}
        if not hits:
            uncovered.append(name)
        elif len(hits) > 1:
            raise ShardingError(f"parameter {name!r} is named by plan patterns with different styles {sorted(hits)}")
        else:
            styles[name] = hits.pop()
    if uncovered:
        shown = ", ".join(uncovered[:5]) + (" ..." if len(uncovered) > 5 else "")
        raise ShardingError(
            f"{len(uncovered)} parameters are not covered by the TP plan ({shown}); this model differs "
            f"from {written_for} the plan was written for: add a pattern for them to the plan"
        )
    return styles


# FSDP shards only weights at least this large: small ones (norms, biases, tables) cost more in
# gathers than they save in memory.
FSDP_MIN_NUMEL = 1 << 20


def fsdp_min_numel(dit: torch.nn.Module) -> int:
    """The FSDP size floor for ``dit``: ``FSDP_MIN_NUMEL``, or a quarter of a D x D projection when
    that is smaller. Every full-size Wan 2.2 DiT (D >= 3072) gets ``FSDP_MIN_NUMEL``; a tiny test
    config with the same structure then shards the same weights (the projections), not none."""
    cfg = dit.config
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    return min(FSDP_MIN_NUMEL, inner * inner // 4)


def _add_fsdp(spec: Spec, shape: torch.Size, mesh: MeshSpec, min_numel: int = FSDP_MIN_NUMEL) -> Spec:
    """Also split the first free dim that the SP axes divide (weights gathered before use)."""
    sp = mesh.sp_axis
    if sp is None or mesh.sp == 1 or shape.numel() < min_numel:
        return spec
    for dim, axis in enumerate(spec):
        if axis is None and shape[dim] % mesh.sp == 0:
            return spec[:dim] + (sp,) + spec[dim + 1:]
    return spec


def _spec_for(style: str, shape: torch.Size, tp: Any) -> Spec:
    ndim = len(shape)
    replicated = (None,) * ndim
    if style == REPLICATE or tp is None:
        return replicated
    if style == COLWISE:  # nn.Linear weight is (out, in): split out; bias (out,) follows it
        return (tp, None) if ndim == 2 else (tp,)
    if style == ROWWISE:  # split in; the bias is added once, after the all-reduce
        return (None, tp) if ndim == 2 else replicated
    if style == NORM_COLWISE:
        return (tp,) + (None,) * (ndim - 1)
    if style == EMBEDDING_COLWISE:  # nn.Embedding weight is (num_embeddings, embedding_dim): split the latter
        return (None, tp) if ndim == 2 else replicated
    raise ShardingError(f"unknown style {style!r}")


def _check_divisible(name: str, shape: torch.Size, spec: Spec, mesh: MeshSpec) -> None:
    for dim, axis in enumerate(spec):
        if axis is not None and shape[dim] % mesh.axis_size(axis):
            raise ShardingError(
                f"{name}: dim {dim} of size {shape[dim]} is not divisible by mesh axis {axis!r} "
                f"of size {mesh.axis_size(axis)}; choose a mesh whose TP size divides it"
            )


def check_tp_divides(count: int, what: str, mesh: MeshSpec, why: str = "head-aligned") -> None:
    """One line, before anything is changed, when TP does not divide ``count`` of ``what`` (``40
    attention heads``, ``10240 FFN channels``): the mesh's TP size must divide it."""
    if count % mesh.tp:
        divisors = [d for d in range(1, count + 1) if count % d == 0 and d <= 128]
        raise ShardingError(
            f"{count} {what} are not divisible by TP={mesh.tp} (mesh {mesh.name}); "
            f"TP must be {why}: use a mesh whose TP axis is one of {divisors}"
        )


class ShardSpecs(Mapping):
    """``{parameter tensor: spec}`` for every parameter, replicated ones spelled out.

    A drop-in for the reference loop ``for tensor, spec in specs.items(): xs.mark_sharding(tensor,
    mesh, spec)``. ``by_name()`` gives ``{parameter name: spec}``; ``str(specs)`` prints them.
    """

    def __init__(self, entries: list[tuple[str, torch.Tensor, Spec, str]], mesh: MeshSpec):
        self._entries = entries
        self._by_id = {id(t): (n, t, s, st) for n, t, s, st in entries}
        self.mesh = mesh

    def __getitem__(self, tensor: torch.Tensor) -> Spec:
        try:
            return self._by_id[id(tensor)][2]
        except KeyError:
            raise KeyError("tensor is not a parameter of the model these specs were made for") from None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (t for _, t, _, _ in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def by_name(self) -> dict[str, Spec]:
        return {n: s for n, _, s, _ in self._entries}

    def styles(self) -> dict[str, str]:
        return {n: st for n, _, _, st in self._entries}

    def bytes_per_device(self, dtype_bytes: int | None = None) -> int:
        """Weight bytes one device holds under these specs (``dtype_bytes`` overrides the
        parameters' own element size, e.g. 2 for a bf16 deployment of a meta model)."""
        total = 0
        for _, t, spec, _ in self._entries:
            split = 1
            for axis in spec:
                split *= self.mesh.axis_size(axis)
            total += -(-t.numel() // split) * (dtype_bytes or t.element_size())
        return total

    def counts(self) -> dict[str, int]:
        """How many parameters each style got, e.g. ``{'colwise': 28, 'rowwise': 14, ...}``: the
        four DiT styles always, ``embedding_colwise`` when some parameter has it."""
        out = {s: 0 for s in (COLWISE, ROWWISE, NORM_COLWISE, REPLICATE)}
        for _, _, spec, style in self._entries:
            # A rowwise bias is replicated; count what the tensor actually gets.
            key = style if any(a is not None for a in spec) else REPLICATE
            out[key] = out.get(key, 0) + 1
        return out

    def __str__(self) -> str:
        width = max((len(n) for n, *_ in self._entries), default=0)
        lines = [f"{n:<{width}}  {tuple(t.shape)!s:<16} {s}" for n, t, s, _ in self._entries]
        return f"ShardSpecs on {self.mesh}\n" + "\n".join(lines)

    __repr__ = __str__


def spec_mesh(mesh_or_plan: Any, plan: Any = None, fsdp: bool = False) -> tuple[MeshSpec, bool]:
    """The mesh with its roles, and whether FSDP applies, from what a specs function was given: a
    mesh (a preset, a :class:`MeshSpec`, a backend's own mesh) or a plan, or a mesh with a plan
    beside it (which must be for that mesh's shape)."""
    from .plan import ShardingPlan

    mesh = mesh_or_plan
    if isinstance(mesh, ShardingPlan):  # specs(model, plan)
        mesh, plan = mesh.mesh(), mesh
    if plan is not None:
        if as_mesh_spec(mesh).shape != plan.mesh_shape:
            raise ShardingError(f"plan is for mesh {plan.mesh().name}, not {as_mesh_spec(mesh).name}")
        mesh, fsdp = plan.mesh(), plan.fsdp or fsdp
    return as_mesh_spec(mesh), fsdp


def table_specs(model: torch.nn.Module, mesh: MeshSpec, tp_table: Mapping[str, str], *, fsdp: bool = False,
                fsdp_floor: int = FSDP_MIN_NUMEL, written_for: str = "the Wan 2.2 DiT") -> ShardSpecs:
    """Every parameter of ``model`` with the spec of its style in ``tp_table`` on ``mesh``'s TP axis
    (and, with ``fsdp``, each weight of at least ``fsdp_floor`` elements also split over SP), each
    sharded dim checked against the mesh: the part of a specs function that is the same for every
    model. Pure; ``written_for`` names the model the table was written for in its errors."""
    styles = resolve_styles(model, tp_table, written_for)
    entries = []
    for name, param in model.named_parameters():
        try:  # a LoRA parameter follows its base's style (lora_layers); never FSDP-split: rank-sized
            spec = lora_spec(styles[name], parameter_role(name)[1], param.ndim, mesh.tp_axis)
        except LoraError as e:
            raise LoraShardingError(f"{name}: {e}") from None
        if spec is None:
            spec = _spec_for(styles[name], param.shape, mesh.tp_axis)
            if fsdp:
                spec = _add_fsdp(spec, param.shape, mesh, fsdp_floor)
        _check_divisible(name, param.shape, spec, mesh)
        entries.append((name, param, spec, styles[name]))
    return ShardSpecs(entries, mesh)


def replicated_specs(dit: torch.nn.Module, mesh: Any = (1, 1)) -> ShardSpecs:
    """Every parameter replicated: the unsharded baseline, in the same form as
    :func:`~wan_sharding.dit.specs.shard_dit_specs` (so a backend places it the same way)."""
    spec_mesh = as_mesh_spec(mesh)
    return ShardSpecs([(n, p, (None,) * p.ndim, REPLICATE) for n, p in dit.named_parameters()], spec_mesh)
