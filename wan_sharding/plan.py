"""The Wan 2.2 DiT parallelism plan, as plain data. Imports no backend.

Tensor parallelism uses the vocabulary of diffusers' ``_tp_plan``: a module-path pattern
(``*`` matches one path component,
a trailing ``**`` any sub-path including none) mapped to a style. Every parameter of the model must be
owned by a module that some pattern names; an unnamed parameter is an error, never a silent
replication, so a diffusers release that adds a layer is caught by ``shard_dit_specs``.

Sequence parallelism follows ``WanTransformer3DModel._cp_plan``, which has four entries: the rope
tables and the block-stack entry (split L), ``proj_out`` (gather L), and the model input
``timestep`` (split L: Wan 2.2 TI2V's per-token timesteps). This plan has the first three. The
fourth is handled differently on purpose: the per-token timestep embeddings that the condition
embedder makes from it (``temb`` (B, L, D), ``timestep_proj`` (B, L, 6D)) are padded with the hidden
states on the replicated tensor and get no constraint of their own; the partitioner splits them
over SP where they meet the L-sharded hidden states. Exact (``tests/test_pcc.py`` runs TI2V-5B
padded and aligned on every mesh), but the condition embedder then runs on all L tokens on every
device once per forward, which diffusers' split of the timestep input avoids
(``docs/design.md``, "TI2V-5B's per-token timesteps").
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Mapping

from .options import DEFAULT_PADDING, PADDING_NAMES  # DEFAULT_PADDING re-exported: a plan's default padding

# ---- tensor-parallel styles ------------------------------------------------------------------
COLWISE = "colwise"  # Linear split on its output features: no collective
ROWWISE = "rowwise"  # Linear split on its input features: one all-reduce of the partial sums
NORM_COLWISE = "norm_colwise"  # norm weight following a colwise split: one small stats all-reduce
# nn.Embedding split on its embedding dim (torch's ColwiseParallel on an embedding: Shard(1)); its
# output stays split like a colwise Linear's, no collective (UMT5's per-head relative attention bias)
EMBEDDING_COLWISE = "embedding_colwise"
REPLICATE = "replicate"  # full copy on every device: no collective
STYLES = (COLWISE, ROWWISE, NORM_COLWISE, EMBEDDING_COLWISE, REPLICATE)

# Megatron pairs (colwise then rowwise) keep the activation TP-sharded across the nonlinearity,
# so each pair costs one all-reduce. Head-aligned: 40 heads / TP 4 = 10 whole heads per device.
WAN_TP_TABLE: Mapping[str, str] = {
    # -- boundary layers: replicated (entry conv, output projection, final adaLN table) --
    "patch_embedding": REPLICATE,
    "proj_out": REPLICATE,  # small (D -> 64); its output is gathered to replicated
    "norm_out": REPLICATE,  # non-affine in Wan; listed so an affine variant is still covered
    "": REPLICATE,  # the model's own scale_shift_table (1, 2, D)
    # -- condition embedder: two Megatron pairs --
    "condition_embedder.time_embedder.linear_1": COLWISE,
    "condition_embedder.time_embedder.linear_2": ROWWISE,  # 1 all-reduce per forward
    "condition_embedder.text_embedder.linear_1": COLWISE,
    "condition_embedder.text_embedder.linear_2": ROWWISE,  # 1 all-reduce per forward
    # A lone colwise time_proj would need an all-gather in every block; keep it whole.
    "condition_embedder.time_proj": REPLICATE,
    "condition_embedder.image_embedder.**": REPLICATE,  # Wan 2.1 I2V only; small, once per forward
    # -- transformer blocks: three Megatron pairs each --
    "blocks.*": REPLICATE,  # scale_shift_table (1, 6, D)
    "blocks.*.norm1": REPLICATE,
    "blocks.*.norm2": REPLICATE,  # affine LayerNorm on the TP-replicated residual stream
    "blocks.*.norm3": REPLICATE,
    "blocks.*.attn1.to_q": COLWISE,
    "blocks.*.attn1.to_k": COLWISE,
    "blocks.*.attn1.to_v": COLWISE,
    "blocks.*.attn1.norm_q": NORM_COLWISE,  # RMSNorm across all heads: stats all-reduce
    "blocks.*.attn1.norm_k": NORM_COLWISE,
    "blocks.*.attn1.to_out.0": ROWWISE,  # all-reduce
    # the ``qkv`` patch's fused projections (wan_sharding.patches.qkv): rows interleaved per TP
    # shard, so the plain colwise split gives every device whole heads of q, k and v
    "blocks.*.attn1.to_qkv": COLWISE,
    "blocks.*.attn2.to_kv": COLWISE,
    "blocks.*.attn2.to_q": COLWISE,
    "blocks.*.attn2.to_k": COLWISE,  # K/V from the SP-replicated prompt: no SP all-gather
    "blocks.*.attn2.to_v": COLWISE,
    "blocks.*.attn2.norm_q": NORM_COLWISE,
    "blocks.*.attn2.norm_k": NORM_COLWISE,
    "blocks.*.attn2.add_k_proj": COLWISE,  # image K/V (Wan 2.1 I2V)
    "blocks.*.attn2.add_v_proj": COLWISE,
    "blocks.*.attn2.norm_added_k": NORM_COLWISE,
    "blocks.*.attn2.to_out.0": ROWWISE,  # all-reduce
    "blocks.*.ffn.net.0.proj": COLWISE,
    "blocks.*.ffn.net.2": ROWWISE,  # all-reduce
}


# ---- sequence-parallel points ------------------------------------------------------------------
@dataclass(frozen=True)
class SPSplit:
    """Split the flat token dim of a module's input (``arg``) or of its outputs (``arg=None``)."""

    module: str
    dim: int
    arg: str | None = None


@dataclass(frozen=True)
class SPGather:
    """Gather a module's output back to replicated along the token dim."""

    module: str
    dim: int


# Three of the four entries of diffusers' WanTransformer3DModel._cp_plan (a test checks they
# agree); its fourth, TI2V's per-token ``timestep``, is not a split point here (module docstring).
WAN_SP_POINTS: tuple[SPSplit | SPGather, ...] = (
    SPSplit("rope", dim=1),  # both rope tables, (1, L, 1, head_dim)
    SPSplit("blocks.0", dim=1, arg="hidden_states"),  # (B, L, D) entering the block stack
    SPGather("proj_out", dim=1),  # (B, L, C) before unpatchify
)

# Attention modules whose keys and values come from the video tokens (self-attention). These see
# padded keys when L is padded and must keep attention exact.
SELF_ATTENTION = "blocks.*.attn1"


# ---- a whole sharding plan -----------------------------------------------------------------------
LAYOUTS = ("replicated", "sharded")


# Plan fields a plan file may leave out (they came later; leaving one out means its default).
OPTIONAL_FIELDS = ("cfg_axes", "rank_binding")


class PlanError(ValueError):
    """A sharding plan with a field of the wrong type or value (one line naming the field)."""


@dataclass(frozen=True)
class ShardingPlan:
    """Everything that decides how one DiT is sharded on one mesh, as plain data.

    - ``mesh_shape`` / ``axis_names``: the device mesh; ``sp_axes`` / ``tp_axes``: which mesh axes
      carry sequence and tensor parallelism (empty: that role is unused). Axis order is part of the
      plan: the same degrees on different axes land on different physical links.
    - ``fsdp``: also shard every large weight over the SP axes (FSDP-style, gathered before use), so
      that both A14B experts fit on a 12 GB Wormhole chip.
    - ``layout``: the activation between Megatron pairs: ``"replicated"`` D (the residual stream is
      (B, L/sp, D) per device, D whole, between blocks; ``docs/design.md``) or ``"sharded"`` D
      (tt-metal's: kept TP-sharded between blocks).
    - ``padding``: how the token dim is padded and attention kept exact.
    - ``cfg_axes``: the mesh axes the two guidance branches are split over (CFG parallel, size 2 in
      all; empty: none). Weights are whole across them and split within each group as the plan says;
      a forward's batch of (cond, uncond) halves runs as one program, one half per group.
    - ``rank_binding``: the multi-host system the plan is for, by the name tt-xla's distributed
      runtime takes (``quad_galaxy``, ...; :data:`wan_sharding.systems.RANK_BINDINGS`); its mesh must
      then be that system's global mesh. Empty: no binding (one host, or not said). A ``--backend tt``
      command run with the plan launches on that binding.

    ``shard_dit_specs(dit, plan.mesh(), fsdp=plan.fsdp)`` and ``apply_dit_sp_activation_sharding(dit,
    plan.mesh(), plan=plan)`` apply it; ``save``/``load`` write it as JSON.
    """

    mesh_shape: tuple[int, ...] = (2, 4)
    axis_names: tuple[str, ...] = ("sp", "tp")
    sp_axes: tuple[str, ...] = ("sp",)
    tp_axes: tuple[str, ...] = ("tp",)
    fsdp: bool = False
    layout: str = "replicated"
    padding: str = DEFAULT_PADDING
    cfg_axes: tuple[str, ...] = ()
    rank_binding: str = ""

    def __post_init__(self) -> None:
        # Every field checked for type and value: a plan comes from JSON files people edit, where
        # "false" is a truthy string and a misspelt padding would otherwise load.
        for name in ("mesh_shape", "axis_names", "sp_axes", "tp_axes", "cfg_axes"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                raise PlanError(f"plan field {name!r} must be a list, got {value!r}"
                                + (f"; write [{value!r}]" if isinstance(value, str) else ""))
            object.__setattr__(self, name, tuple(value))
        if not self.mesh_shape or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1
                                      for s in self.mesh_shape):
            raise PlanError(f"plan field 'mesh_shape' must be positive integers such as [2, 4], got {list(self.mesh_shape)}")
        object.__setattr__(self, "mesh_shape", tuple(int(s) for s in self.mesh_shape))
        if any(not isinstance(a, str) or not a for a in self.axis_names) or len(set(self.axis_names)) != len(self.axis_names):
            raise PlanError(f"plan field 'axis_names' must be distinct non-empty names, got {list(self.axis_names)}")
        if len(self.axis_names) != len(self.mesh_shape):
            raise PlanError(f"plan has {len(self.mesh_shape)} mesh sizes {list(self.mesh_shape)} but "
                            f"{len(self.axis_names)} axis names {list(self.axis_names)}; give one name per size")
        for name in ("sp_axes", "tp_axes", "cfg_axes"):
            axes = getattr(self, name)
            unknown = [a for a in axes if a not in self.axis_names]
            if unknown:
                raise PlanError(f"plan field {name!r} names {unknown}, not axes of this mesh; "
                                f"use names from axis_names {list(self.axis_names)}")
            if len(set(axes)) != len(axes):
                raise PlanError(f"plan field {name!r} repeats an axis: {list(axes)}")
        for a, b in (("sp", "tp"), ("cfg", "sp"), ("cfg", "tp")):
            shared = sorted(set(getattr(self, f"{a}_axes")) & set(getattr(self, f"{b}_axes")))
            if shared:
                raise PlanError(f"plan gives axis {shared} both {a.upper()} and {b.upper()}; each mesh axis carries one role")
        cfg = 1
        for a in self.cfg_axes:
            cfg *= self.mesh_shape[self.axis_names.index(a)]
        if self.cfg_axes and cfg != 2:
            raise PlanError(f"plan field 'cfg_axes' {list(self.cfg_axes)} spans {cfg} devices; classifier-free guidance "
                            "has 2 branches, so the cfg axes must span 2")
        if type(self.fsdp) is not bool:
            raise PlanError(f"plan field 'fsdp' must be true or false (a JSON boolean), got {self.fsdp!r}")
        if self.layout not in LAYOUTS:
            raise PlanError(f"unknown layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        if self.padding not in PADDING_NAMES:
            raise PlanError(f"unknown padding {self.padding!r}; choose one of {', '.join(PADDING_NAMES)}")
        if not isinstance(self.rank_binding, str):
            raise PlanError(f"plan field 'rank_binding' must be a name such as 'quad_galaxy', got {self.rank_binding!r}")
        if self.rank_binding:
            from .systems import BindingError, check_binding_grid, rank_binding

            try:
                check_binding_grid(rank_binding(self.rank_binding), self.mesh().grid, "the plan's mesh")
            except BindingError as e:
                raise PlanError(f"plan field 'rank_binding': {e}") from None

    def mesh(self):
        """The :class:`~wan_sharding.mesh.MeshSpec` with this plan's roles."""
        from .mesh import MeshSpec

        role = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))  # noqa: E731
        return MeshSpec(self.mesh_shape, self.axis_names,
                        {"sp": role(self.sp_axes), "tp": role(self.tp_axes), "cfg": role(self.cfg_axes)})

    @classmethod
    def from_mesh(cls, mesh, padding: str = DEFAULT_PADDING, fsdp: bool = False, layout: str = "replicated") -> "ShardingPlan":
        """The plan of a :class:`~wan_sharding.mesh.MeshSpec` (a preset's, or one
        :func:`~wan_sharding.mesh.with_cfg` cut into guidance groups) with its roles as they are."""
        from .mesh import axes_of

        return cls(mesh.shape, mesh.axis_names, axes_of(mesh.sp_axis), axes_of(mesh.tp_axis), fsdp, layout, padding,
                   axes_of(mesh.cfg_axis))

    @property
    def name(self) -> str:
        m = self.mesh()
        axes = lambda a: "+".join(a) or "-"  # noqa: E731
        cfg = f" cfg{m.cfg}[{axes(self.cfg_axes)}]" if self.cfg_axes else ""
        return (f"{m.name}{cfg} sp{m.sp}[{axes(self.sp_axes)}] tp{m.tp}[{axes(self.tp_axes)}]"
                f"{' fsdp' if self.fsdp else ''} {self.layout}-D {self.padding}")

    def to_dict(self) -> dict:
        """The plan's fields as JSON values (``rank_binding`` only when there is one)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()
                if k != "rank_binding" or v}

    @classmethod
    def from_dict(cls, data: Mapping) -> "ShardingPlan":
        """The plan ``to_dict`` wrote: every field present, no other key, each of the right type
        and value (:class:`PlanError`, a ValueError, naming the field otherwise)."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a JSON object with the fields {', '.join(cls.__dataclass_fields__)}, "
                            f"got {type(data).__name__}")
        fields = list(cls.__dataclass_fields__)
        unknown = [k for k in data if k not in fields]
        # cfg_axes came later: a plan file written before it has none, and means none
        missing = [k for k in fields if k not in data and k not in OPTIONAL_FIELDS]
        if unknown or missing:
            raise PlanError("plan " + "; ".join(
                ([f"has unknown field(s) {unknown}"] if unknown else [])
                + ([f"lacks field(s) {missing}"] if missing else [])) + f"; a plan has exactly {fields}")
        return cls(**{k: data[k] for k in fields if k in data})

    def save(self, path) -> None:
        import json
        from pathlib import Path

        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> "ShardingPlan":
        """Read a plan file written by :meth:`save`; :class:`PlanError` (one line) when it cannot
        be read, is not JSON, or a field is wrong."""
        import json
        from pathlib import Path

        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"cannot read plan file {str(path)!r}: {e.strerror if isinstance(e, OSError) else e}") from None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise PlanError(f"plan file {str(path)!r} is not JSON ({e}); write it with ShardingPlan.save "
                            "or `wan-sharding plan --write`") from None
        try:
            return cls.from_dict(data)
        except PlanError as e:
            raise PlanError(f"plan file {str(path)!r}: {e}") from None
