"""Logical device meshes and the one table that maps parallelism roles to mesh axes.

A :class:`MeshSpec` is backend-neutral: a shape, axis names and which axis plays which role.
Backends (``wan_sharding.backends``) turn it into a real ``torch_xla`` or ``jax`` mesh.

Words: an *axis* is a mesh axis, a *dim* a tensor dimension. A *spec* is a tuple with one
entry per tensor dim, each ``None`` (replicated) or a mesh axis name, as in
``xs.mark_sharding`` and JAX's ``PartitionSpec``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# Tenstorrent tensor tiles are 32x32: a per-device token count that is a multiple of this
# keeps the SP scatter (ttnn.mesh_partition) tile-aligned.
TILE = 32

# Role -> position of the mesh axis that carries it. SP on the first axis and TP on the
# second, as the reference recipe lays out its ("batch", "model") mesh.
DEFAULT_ROLES: Mapping[str, int] = {"sp": 0, "tp": 1}
# Every role a mesh axis can carry. ``cfg``: classifier-free guidance parallel, the two branches of
# a denoising step (cond, uncond) on two groups of devices, the batch dim split over it.
ROLES: tuple[str, ...] = ("sp", "tp", "cfg")
# CFG has exactly two branches, so a cfg role spans exactly two groups.
CFG_BRANCHES = 2
DEFAULT_AXIS_NAMES: tuple[str, str] = ("sp", "tp")
# A planner decides the roles itself, so it names the physical axes by position instead.
PHYSICAL_AXIS_NAMES: tuple[str, str] = ("rows", "cols")

# The one preset table: name -> (mesh shape, position of the SP axis, position of the TP axis,
# machine). A preset named "AxB" has SP on its first axis; a variant with other roles says so in
# its name.
PRESET_TABLE: Mapping[str, tuple[tuple[int, int], int, int, str]] = {
    "1x1": ((1, 1), 0, 1, "single card"),  # one n150 / p150 card
    "1x2": ((1, 2), 0, 1, "n300/p300"),
    "1x4": ((1, 4), 0, 1, "QuietBox"),  # Blackhole QuietBox, TP only
    "1x8": ((1, 8), 0, 1, "QuietBox/T3K (line)"),  # Wormhole QuietBox / T3K as one line
    "2x4": ((2, 4), 0, 1, "LoudBox/T3K"),
    # Galaxy with TP over the 8-long axis (SP 4 / TP 8: 5 of Wan's 40 heads per device).
    "4x8": ((4, 8), 0, 1, "Galaxy (SP 4 / TP 8)"),
    # Galaxy as tt-metal's Wan 2.2 lays it out: a 4x8 view with SP on the 8-long axis (its
    # sp_axis=1) and TP on the 4-long one. The same roles on the same links as "8x4".
    "4x8-tt-metal": ((4, 8), 1, 0, "Galaxy (tt-metal layout)"),
    "8x4": ((8, 4), 0, 1, "Galaxy"),  # tt-xla's layout: SP 8 / TP 4
    # Several Galaxies cabled along the 8-long axis (tt-metal's 16x4 dual and 32x4 quad Galaxy
    # descriptors; wan_sharding/systems.py): SP over every Galaxy, TP 4 inside each one.
    "16x4": ((16, 4), 0, 1, "2 Galaxies (SP 16 / TP 4)"),
    "32x4": ((32, 4), 0, 1, "4 Galaxies (SP 32 / TP 4)"),
    # Two Galaxies in tt-metal's view (SP 16 on the long axis, TP 4): what tt-mlir compiles for 64
    # chips, where it rejects 16x4 (see wan_sharding/systems.py, TT_MLIR_REJECTED).
    "4x16-tt-metal": ((4, 16), 1, 0, "2 Galaxies (tt-metal layout)"),
    # The quad Galaxy as tt-metal's Wan 2.2 runs it: a 4x32 view, SP 32 on the long axis (its
    # sp_axis=1), TP 4 on the short one. The same roles on the same links as "32x4".
    "4x32-tt-metal": ((4, 32), 1, 0, "4 Galaxies (tt-metal layout)"),
    # tt-xla's multi-host Wormhole Galaxy systems (rank bindings dual_galaxy and quad_galaxy;
    # wan_sharding/systems.py): 8x4 Galaxies side by side along the long axis, one host each. SP
    # over the long axis, which crosses the hosts; TP 8 on the 8-long axis, inside every Galaxy.
    "8x8-dual-galaxy": ((8, 8), 1, 0, "2 Galaxies, 2 hosts (dual_galaxy)"),
    "8x16-quad-galaxy": ((8, 16), 1, 0, "4 Galaxies, 4 hosts (quad_galaxy)"),
}
# name -> (sp, tp) sizes, for listings and older callers.
PRESETS: Mapping[str, tuple[int, int]] = {
    name: (shape[sp], shape[tp]) for name, (shape, sp, tp, _) in PRESET_TABLE.items()
}
PRESET_MACHINES: Mapping[str, str] = {name: row[3] for name, row in PRESET_TABLE.items()}
# Device count -> preset used when the mesh comes from the number of visible devices.
BY_DEVICE_COUNT: Mapping[int, str] = {1: "1x1", 2: "1x2", 4: "1x4", 8: "2x4", 32: "8x4"}


class MeshError(ValueError):
    """A mesh that cannot be used: unknown preset, wrong device count, unknown axis."""


@dataclass(frozen=True)
class MeshSpec:
    """A 2-D logical mesh: ``shape[i]`` devices along axis ``axis_names[i]``.

    ``roles`` maps the parallelism roles ``"sp"`` and ``"tp"`` to an axis name, a tuple of axis
    names (the role spans several axes, e.g. TP 8 over both axes of a 2x4 mesh) or ``None``
    (the role is unused: size 1). Spec entries carry the role's value as it is, which both
    ``xs.mark_sharding`` and JAX's ``PartitionSpec`` accept.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = DEFAULT_AXIS_NAMES
    roles: Mapping[str, str | tuple[str, ...] | None] | None = None
    preset: str | None = None  # the preset this mesh was made from, if any (its name)

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        names = tuple(self.axis_names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        if len(shape) != len(names):
            raise MeshError(f"mesh shape {shape} has {len(shape)} axes but axis_names {names} has {len(names)}")
        if any(s < 1 for s in shape):
            raise MeshError(f"mesh shape {shape} must have positive sizes")
        if len(set(names)) != len(names):
            raise MeshError(f"mesh axis names {names} must be distinct")
        roles = dict(self.roles) if self.roles is not None else {
            role: names[pos] for role, pos in DEFAULT_ROLES.items() if pos < len(names)
        }
        used: list[str] = []
        for role, axis in list(roles.items()):
            if role not in ROLES:
                raise MeshError(f"unknown role {role!r}; known roles: {', '.join(ROLES)}")
            if isinstance(axis, (list, tuple)):
                axis = tuple(axis) if len(axis) != 1 else axis[0]
                roles[role] = axis
            for a in axes_of(axis):
                if a not in names:
                    raise MeshError(
                        f"role {role!r} names axis {a!r}, which is not a mesh axis {names}; "
                        "pass roles={'sp': <axis>, 'tp': <axis>} with names from axis_names"
                    )
                if a in used:
                    raise MeshError(f"mesh axis {a!r} is given two roles in {roles}")
                used.append(a)
        object.__setattr__(self, "roles", roles)
        cfg = math.prod(shape[names.index(a)] for a in axes_of(roles.get("cfg")))
        if roles.get("cfg") is not None and cfg != CFG_BRANCHES:
            raise MeshError(f"the cfg role spans {cfg} devices; classifier-free guidance has {CFG_BRANCHES} branches, "
                            f"so its axis must have {CFG_BRANCHES}")

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axis: str | tuple[str, ...] | None) -> int:
        """Devices along ``axis`` (a name, a tuple of names: their product, or None: 1)."""
        for a in axes_of(axis):
            if a not in self.axis_names:
                raise MeshError(f"unknown mesh axis {a!r}; this mesh has axes {self.axis_names}")
        return math.prod(self.shape[self.axis_names.index(a)] for a in axes_of(axis))

    @property
    def sp_axis(self) -> str | tuple[str, ...] | None:
        return self.roles.get("sp")

    @property
    def tp_axis(self) -> str | tuple[str, ...] | None:
        return self.roles.get("tp")

    @property
    def cfg_axis(self) -> str | tuple[str, ...] | None:
        """The axis the two guidance branches are split over (``None``: no CFG parallel)."""
        return self.roles.get("cfg")

    @property
    def sp(self) -> int:
        return self.axis_size(self.sp_axis)

    @property
    def cfg(self) -> int:
        """Guidance branches run side by side: 2 on a cfg mesh, else 1."""
        return self.axis_size(self.cfg_axis)

    @property
    def group_devices(self) -> int:
        """Devices that run one guidance branch (the whole mesh without CFG parallel)."""
        return self.num_devices // self.cfg

    def batch_spec(self, shape: Sequence[int]) -> tuple:
        """The spec of an activation or input whose leading dim is the batch: on a cfg mesh a batch
        of cond and uncond halves (``2k`` rows) is split over the cfg axis, anything else (a batch of
        one: a step without guidance, a rope table) stays whole on every group."""
        spec: list = [None] * len(shape)
        if self.cfg_axis is not None and len(shape) > 0 and shape[0] % self.cfg == 0:
            spec[0] = self.cfg_axis
        return tuple(spec)

    @property
    def tp(self) -> int:
        return self.axis_size(self.tp_axis)

    @property
    def seq_multiple(self) -> int:
        """What the flat token count L is padded to: SP x tile, so every SP shard is whole tiles."""
        return self.sp * TILE

    def padded_tokens(self, tokens: int) -> int:
        """``tokens`` padded up to :attr:`seq_multiple`."""
        return padded_length(tokens, self.seq_multiple)

    @property
    def grid(self) -> tuple[int, ...]:
        """The chip grid the mesh covers: its shape, with a cfg axis that was cut out of the axis
        after it (:func:`with_cfg`, the planner's CFG splits) merged back into that axis."""
        shape = list(self.shape)
        cfg = axes_of(self.cfg_axis)
        if len(shape) > 2 and len(cfg) == 1 and self.axis_names.index(cfg[0]) + 1 < len(shape):
            i = self.axis_names.index(cfg[0])
            shape[i:i + 2] = [shape[i] * shape[i + 1]]
        return tuple(shape)

    @property
    def name(self) -> str:
        """The preset's name, else the shape (``"2x4"``); ``-cfg2`` after it on a cfg mesh."""
        shape = list(self.shape)
        cfg = self.cfg_axis
        if self.preset is None and cfg == "cfg":  # cut by with_cfg: the grid it came from, cfg x SP as one axis
            i = self.axis_names.index(cfg)
            if i + 1 < len(shape) and self.axis_names[i + 1] == self.sp_axis:
                shape[i:i + 2] = [shape[i] * shape[i + 1]]
        base = self.preset or "x".join(str(s) for s in shape)
        return f"{base}-cfg{self.cfg}" if cfg is not None else base

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        cfg = f", cfg={self.cfg_axis}" if self.cfg_axis is not None else ""
        return f"MeshSpec({self.name}: {axes}; sp={self.sp_axis}, tp={self.tp_axis}{cfg})"


def with_cfg(mesh: "MeshSpec | str", cfg: int = CFG_BRANCHES) -> MeshSpec:
    """``mesh`` with its SP axis cut into ``cfg`` groups, one per guidance branch (MeshError, one
    line, when it cannot be).

    The SP axis is the one cut: TP stays whole inside each group, so each group holds the whole
    expert at the TP width it had. An SP axis of 2 becomes the cfg axis (2x4 -> 2 groups of 1x4,
    TP 4 each, no SP); a longer one becomes two axes, cfg outside SP (8x4 -> cfg 2 x SP 4 x TP 4:
    rows 0-3 one branch, rows 4-7 the other; 4x16-tt-metal -> each Galaxy one branch). Device ids
    keep their row-major order, so a group is a contiguous block of the original grid.
    """
    spec = mesh_from_preset(mesh) if isinstance(mesh, str) else mesh
    if cfg == 1:
        return spec
    if cfg != CFG_BRANCHES:
        raise MeshError(f"--cfg {cfg}: classifier-free guidance has {CFG_BRANCHES} branches (cond, uncond); "
                        f"use --cfg {CFG_BRANCHES}, or 1 for none")
    if spec.cfg_axis is not None:
        raise MeshError(f"mesh {spec.name} already splits the guidance branches over {spec.cfg_axis!r}")
    sp = spec.sp_axis
    if sp is None or spec.sp == 1:
        raise MeshError(f"mesh {spec.name} has no SP axis to cut into {cfg} guidance groups (its devices all "
                        f"carry TP {spec.tp}); use a mesh with an even SP axis such as 2x4 or 8x4")
    if isinstance(sp, tuple):
        raise MeshError(f"mesh {spec.name} spans SP over several axes {sp}; give a plan with a cfg axis instead")
    size = spec.axis_size(sp)
    if size % cfg:
        raise MeshError(f"mesh {spec.name}: its SP axis {sp!r} has {size} devices, an odd count that does not cut "
                        f"into {cfg} guidance groups; use a mesh whose SP axis is even")
    if "cfg" in spec.axis_names:
        raise MeshError(f"mesh {spec.name} already has an axis named 'cfg'; rename it")
    pos = spec.axis_names.index(sp)
    names = list(spec.axis_names)
    roles = dict(spec.roles)
    if size == cfg:
        names[pos] = "cfg"
        roles.update(sp=None, cfg="cfg")
        shape = list(spec.shape)
    else:
        names[pos:pos + 1] = ["cfg", sp]
        roles["cfg"] = "cfg"
        shape = [*spec.shape[:pos], cfg, size // cfg, *spec.shape[pos + 1:]]
    return MeshSpec(tuple(shape), tuple(names), roles, preset=spec.preset)


def padded_length(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def axes_of(axis: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes a role's value names: ``None`` -> none, one name, or a tuple of names."""
    if axis is None:
        return ()
    return axis if isinstance(axis, tuple) else (axis,)


def preset_key(name: str) -> str:
    """A preset name as the table spells it (``"2 x 4"``, ``"(2,4)"`` -> ``"2x4"``); MeshError if unknown."""
    key = str(name).lower().replace("(", "").replace(")", "").replace(",", "x").replace(" ", "")
    if key not in PRESET_TABLE:
        same = [n for n, row in PRESET_TABLE.items() if "x".join(map(str, row[0])) == key]  # "4x32": a grid, not a name
        hint = f"the presets of that grid: {', '.join(same)}; " if same else ""
        raise MeshError(f"unknown mesh {name!r}; {hint}known presets: {', '.join(PRESET_TABLE)}")
    return key


def mesh_from_preset(name: str, axis_names: tuple[str, str] | None = None,
                     roles: Mapping[str, str] | None = None) -> MeshSpec:
    """The named preset (``"1x4"``, ``"2x4"``, ``"8x4"``, ...) as a :class:`MeshSpec`.

    Axes are named after their role (``"sp"``, ``"tp"``) unless ``axis_names`` says otherwise;
    the roles follow the preset's table row either way.
    """
    key = preset_key(name)
    shape, sp_pos, tp_pos, _ = PRESET_TABLE[key]
    if axis_names is None:
        names = ["", ""]
        names[sp_pos], names[tp_pos] = "sp", "tp"
        axis_names = (names[0], names[1])
    if roles is None:
        roles = {"sp": axis_names[sp_pos], "tp": axis_names[tp_pos]}
    return MeshSpec(shape, tuple(axis_names), roles, preset=key)


def parse_mesh_shape(value: str | Sequence[int]) -> tuple[int, int]:
    """A mesh's shape from a preset name (``"8x4"``, ``"4x8-tt-metal"``), a ``"ROWSxCOLS"`` string
    or a pair of sizes; MeshError naming the expected form otherwise."""
    if isinstance(value, str):
        try:
            return PRESET_TABLE[preset_key(value)][0]
        except MeshError:
            pass
        parts = value.lower().replace(",", "x").split("x")
        try:
            shape = tuple(int(p) for p in parts)
        except ValueError:
            raise MeshError(f"mesh must be a preset ({', '.join(PRESET_TABLE)}) or ROWSxCOLS such as 8x4, "
                            f"got {value!r}") from None
    else:
        shape = tuple(int(s) for s in value)
    if len(shape) != 2 or min(shape) < 1:
        raise MeshError(f"mesh must be two positive sizes ROWSxCOLS (e.g. 8x4), got {value!r}")
    return shape  # type: ignore[return-value]


def mesh_for_device_count(n: int) -> MeshSpec:
    """The reference recipe's mesh for ``n`` devices (32 -> 8x4, 8 -> 2x4, 4 -> 1x4, ...)."""
    if n not in BY_DEVICE_COUNT:
        raise MeshError(
            f"no mesh preset for {n} devices; supported counts: {sorted(BY_DEVICE_COUNT)}. "
            "Build one explicitly with MeshSpec((sp, tp))."
        )
    return mesh_from_preset(BY_DEVICE_COUNT[n])


def _roles_by_name(names: tuple[str, ...]) -> dict[str, str | None] | None:
    """Roles of a backend mesh whose axes are named after them (``"sp"``, ``"tp"``, ``"cfg"``, in
    any order); ``None`` (roles by position) for any other names."""
    if "tp" not in names or not ({"sp", "cfg"} & set(names)):
        return None
    return {role: (role if role in names else None) for role in ROLES}


def as_mesh_spec(mesh: Any) -> MeshSpec:
    """Accept a :class:`MeshSpec`, a preset name, a ``(sp, tp)`` tuple, a ``torch_xla`` mesh or a
    ``jax.sharding.Mesh`` and return the :class:`MeshSpec` it describes.

    Backend meshes keep their own axis names; roles then follow the default axis order
    (first axis SP, second TP), so a reference-style ``("batch", "model")`` mesh works as is.
    """
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, str):
        return mesh_from_preset(mesh)
    if isinstance(mesh, tuple) and all(isinstance(s, int) for s in mesh):
        return MeshSpec(mesh, DEFAULT_AXIS_NAMES[: len(mesh)])
    # torch_xla.distributed.spmd.Mesh: mesh_shape + axis_names
    if hasattr(mesh, "mesh_shape") and hasattr(mesh, "axis_names"):
        names = tuple(mesh.axis_names) if mesh.axis_names else DEFAULT_AXIS_NAMES[: len(mesh.mesh_shape)]
        return MeshSpec(tuple(mesh.mesh_shape), names, _roles_by_name(names))
    # jax.sharding.Mesh: devices array + axis_names
    if hasattr(mesh, "devices") and hasattr(mesh, "axis_names") and hasattr(mesh.devices, "shape"):
        names = tuple(mesh.axis_names)
        return MeshSpec(tuple(mesh.devices.shape), names, _roles_by_name(names))
    raise MeshError(
        f"cannot use {type(mesh).__name__} as a mesh; pass a preset name ('1x4', '2x4', '8x4'), "
        "a MeshSpec, a torch_xla Mesh or a jax Mesh"
    )
