"""What to compile and what a compile gave: :class:`CompileRequest`, :class:`CompileResult`.

Plain data, shared by the caller (:mod:`wan_sharding.compile.runner`) and the worker
(:mod:`wan_sharding.compile.worker`): a request crosses the process boundary as JSON
(:meth:`CompileRequest.to_json` / :meth:`CompileRequest.from_json`), a result comes back as one
``RESULT`` line. Names follow ``wan_sharding.options``: dtypes ``fp32`` / ``bf16``, padding modes
``mask`` / ``slice`` / ``none`` (default :data:`~wan_sharding.options.DEFAULT_PADDING`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..mesh import MeshError, MeshSpec, mesh_from_preset
from ..models import FULL_CONFIGS, PROMPT_TOKENS, RESOLUTIONS, LatentShape, config_for
from ..options import DEFAULT_PADDING, DTYPES, PADDING_NAMES, dtype_name
from ..plan import ShardingPlan
from ..systems import tt_mlir_rejects

if TYPE_CHECKING:
    from .options import CompileOptions

# dtypes of the timestep input, as ``jax.numpy`` names them.
TIMESTEP_DTYPES = ("float32", "bfloat16")
# How the sharded DiT becomes the StableHLO that tt-mlir compiles:
# - "torchax": the torch module run as a JAX function (abstract weights: the whole 14B model fits);
# - "torch-xla": torch-xla SPMD's lowering, the graph Tenstorrent hardware compiles (GSPMD shardings
#   converted to Shardy); needs real weights in host memory, so keep full-width traces short.
FRONTENDS = ("torchax", "torch-xla")
# What a request compiles: the DiT (every field applies), or the UMT5 text encoder
# (``wan_sharding.compile.text_encoder``: ``blocks`` counts its layers, ``prompt_tokens`` its input;
# latent, padding, anchor, variant, timestep dtype and patches do not apply).
COMPILED_COMPONENTS = ("dit", "text-encoder")


class CompileError(RuntimeError):
    """The compile could not be set up (plugin missing, bad descriptor, bad request) or the
    worker process failed in a way that left no result."""


@dataclass(frozen=True)
class CompileRequest:
    """One compile of a (possibly shortened) Wan DiT for one mesh and latent shape.

    Attributes:
        variant: ``"t2v-a14b"``, ``"i2v-a14b"`` or ``"ti2v-5b"``.
        mesh: mesh preset (``"1x4"``, ``"2x4"``, ``"8x4"``, ...).
        latent: latent video (frames, height, width); :func:`latent_for` turns a resolution
            name into one.
        blocks: number of transformer blocks (``num_layers``); ``None`` keeps the variant's own.
        size: ``"full"`` (real widths) or ``"tiny"`` (the test configs).
        padding: SP padding mode, ``"mask"`` (the default), ``"slice"`` or ``"none"``.
        anchor: keep the replicated constraint in front of each L-on-SP split (the tt-mlir
            workaround, ``docs/tt-mlir-notes.md``). ``False`` only exists to show the workaround is
            still needed.
        dtype: ``"bf16"`` (weights and activations as ``from_pretrained(torch_dtype=bf16)`` loads
            them: the modules diffusers keeps in fp32 stay fp32) or ``"fp32"``. Aliases
            (``"f32"``, ``"float32"``, ``"bfloat16"``, a ``torch.dtype``) are normalised.
        timestep_dtype: dtype of the timestep input (``float32``, as the pipelines pass it).
        batch: batch size.
        resolution: display name of ``latent`` (e.g. ``"480p"``); informational.
        out_dir: where the compiler writes its IRs; a fresh temporary folder when ``None``.
        frontend: ``"torchax"`` (default) or ``"torch-xla"`` (:data:`FRONTENDS`).
        composites: which StableHLO composites the trace marks (:mod:`.composites`):
            ``"hardware"`` (default: what tt-xla's torch plugin marks: SDPA, RMSNorm, LayerNorm,
            GELU), ``"sdpa"`` (bf16 attention only) or ``"none"``. f32 attention stays plain math.
        compile_options: tt-mlir options (:class:`.options.CompileOptions` fields); ``None``: the
            hardware defaults (level 1, DRAM space saving, trace). The runner may lower the level
            where it cannot run here and says so in ``notes``.
        notes: one line per thing the runner changed against the request, and why.
        patches: model rewrites applied before sharding (``wan_sharding.patches``), e.g.
            ``("rope",)``.
        mark_arguments: mark every argument of the step's program with its role before tt-mlir
            sees it, as tt-xla does on hardware (:mod:`.marking`: weights ``parameter``, buffers
            and precomputed tables ``constant``, activations ``input``; tt-mlir then prepares
            weights once, in const-eval). ``False``: nothing marked, every argument an input
            (this package's compiles before issue 29).
        plan: a whole :class:`~wan_sharding.plan.ShardingPlan` (axes and order of SP / TP, FSDP,
            activation layout, padding). When given, the model is sharded through the ordinary
            API with it (``shard_dit_specs(dit, plan)``, ``apply_dit_sp_activation_sharding(...,
            plan=plan)``); ``mesh`` must then be the plan's mesh name and ``padding`` its padding
            (:meth:`for_plan` fills both). ``None``: the preset's default roles (SP on the first
            axis, TP on the second). A plan with ``cfg_axes`` (CFG parallel) compiles as one program
            on a 2-D mesh only, with an even ``batch`` (cond and uncond rows); a 3-D one compiles
            its group's program instead (:func:`.cfg.compile_request`).
        cfg_plan: the CFG-parallel plan this request compiles for, when the request was made from
            one (:func:`.cfg.compile_request`): ``plan`` itself (one program) or its group plan
            (per group). The report then counts a denoising step as one forward, not two.
        component: ``"dit"`` or ``"text-encoder"`` (:data:`COMPILED_COMPONENTS`): the UMT5 encoder,
            Megatron TP on the mesh's TP axis; ``blocks`` then counts its layers.
        prompt_tokens: the text encoder's input length (``None``: 512 full, 16 tiny, what the
            pipelines and the tiny DiTs take).
        vocab: the text encoder's vocabulary (``None``: its config's, 256384 full). The torch-xla
            frontend holds the replicated embedding once per virtual device in host memory
            (:meth:`xla_host_bytes`); a smaller table changes only the lookup's table, not a collective.
        lora_rank: the DiT carries a PEFT LoRA of this rank on every Linear a Wan LoRA targets
            (:func:`wan_sharding.lora.tiny.add_wan_lora`), split beside its bases; 0: none.
    """

    variant: str = "t2v-a14b"
    mesh: str = "8x4"
    latent: tuple[int, int, int] = (21, 60, 104)
    blocks: int | None = None
    size: str = "full"
    padding: str = DEFAULT_PADDING
    anchor: bool = True
    dtype: str = "bf16"
    timestep_dtype: str = "float32"
    batch: int = 1
    resolution: str | None = None
    out_dir: str | None = None
    frontend: str = "torchax"
    composites: str = "hardware"
    compile_options: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    patches: tuple[str, ...] = ()
    mark_arguments: bool = True
    plan: ShardingPlan | None = None
    cfg_plan: ShardingPlan | None = None
    component: str = "dit"
    prompt_tokens: int | None = None
    vocab: int | None = None
    lora_rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "patches", tuple(self.patches))
        object.__setattr__(self, "notes", tuple(self.notes))
        try:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        except ValueError:
            pass  # left as given: validate() names the choices

    @classmethod
    def for_plan(cls, plan: ShardingPlan, **fields: Any) -> "CompileRequest":
        """A request that compiles the DiT sharded by ``plan`` (its mesh and padding filled in)."""
        return cls(mesh=plan.mesh().name, padding=plan.padding, plan=plan, **fields)

    def mesh_spec(self) -> MeshSpec:
        """The mesh with its roles: the plan's when there is one, else the preset's."""
        if self.plan is not None:
            return self.plan.mesh()
        return mesh_from_preset(self.mesh)

    def validate(self) -> "CompileRequest":
        """Check every field before a subprocess is started; returns ``self``."""
        if self.component not in COMPILED_COMPONENTS:
            raise CompileError(f"unknown component {self.component!r}; choose one of {', '.join(COMPILED_COMPONENTS)}")
        if self.component == "text-encoder":
            return self._validate_text_encoder()
        config_for(self.variant, self.size)  # unknown variant / size -> ValueError
        if self.plan is not None:
            if not isinstance(self.plan, ShardingPlan):
                raise CompileError(f"plan must be a ShardingPlan, got {type(self.plan).__name__}")
            try:
                name = self.plan.mesh().name
            except MeshError as e:
                raise CompileError(f"bad plan {self.plan}: {e}") from None
            if name != self.mesh:
                raise CompileError(f"request mesh {self.mesh!r} is not the plan's mesh {name!r}; "
                                   "build the request with CompileRequest.for_plan(plan, ...)")
            if self.plan.padding != self.padding:
                raise CompileError(f"request padding {self.padding!r} is not the plan's {self.plan.padding!r}; "
                                   "build the request with CompileRequest.for_plan(plan, ...)")
            if self.plan.cfg_axes and len(self.plan.mesh_shape) > 2:
                raise CompileError(f"plan {self.plan.name!r} has a {len(self.plan.mesh_shape)}-D mesh; tt-mlir takes "
                                   "1-D and 2-D meshes only: compile its group's program "
                                   "(wan_sharding.compile.cfg.compile_request)")
            if self.plan.cfg_axes and self.batch % 2:
                raise CompileError(f"plan {self.plan.name!r} splits the batch over its cfg axis: a batch of cond "
                                   f"and uncond rows must be even, got {self.batch}")
        self._check_mesh()
        if len(self.latent) != 3 or any(int(v) < 1 for v in self.latent):
            raise CompileError(f"latent must be (frames, height, width) with positive sizes, got {self.latent}")
        patch = FULL_CONFIGS[self.variant]["patch_size"]
        if any(int(v) % p for v, p in zip(self.latent, patch)):
            raise CompileError(f"latent {self.latent} is not divisible by the patch size {patch}")
        if self.blocks is not None and self.blocks < 1:
            raise CompileError(f"blocks must be >= 1, got {self.blocks}")
        if self.padding not in PADDING_NAMES:
            raise CompileError(f"unknown padding {self.padding!r}; choose one of {sorted(PADDING_NAMES)}")
        if self.timestep_dtype not in TIMESTEP_DTYPES:
            raise CompileError(f"unknown timestep dtype {self.timestep_dtype!r}; choose one of {TIMESTEP_DTYPES}")
        from ..patches import PATCHES

        unknown = [p for p in self.patches if p not in PATCHES]
        if unknown or len(set(self.patches)) != len(self.patches):
            raise CompileError(f"patches must be distinct names from {', '.join(PATCHES)}, got {list(self.patches)}")
        return self._validate_common()

    def _check_mesh(self) -> None:
        """A known preset (a plan's mesh was checked with the plan), of a shape tt-mlir takes."""
        if self.plan is None:
            try:
                mesh_from_preset(self.mesh)
            except MeshError as e:
                raise CompileError(str(e)) from None
        rejected = tt_mlir_rejects(self.mesh_spec().shape)
        if rejected:
            raise CompileError(rejected)

    def _validate_common(self) -> "CompileRequest":
        """What every component's request must have right: batch, dtype, frontend, composites, options."""
        if self.batch < 1:
            raise CompileError(f"batch must be >= 1, got {self.batch}")
        if self.dtype not in DTYPES:
            raise CompileError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.frontend not in FRONTENDS:
            raise CompileError(f"unknown frontend {self.frontend!r}; choose one of {', '.join(FRONTENDS)}")
        from .composites import COMPOSITE_SETS

        if self.composites not in COMPOSITE_SETS:
            raise CompileError(f"unknown composite set {self.composites!r}; choose one of {', '.join(COMPOSITE_SETS)}")
        from .options import check_plugin_support
        from .sysdesc import installed_plugin_version

        try:
            check_plugin_support(self.options(), installed_plugin_version())
        except ValueError as e:
            raise CompileError(str(e)) from None
        return self

    def _validate_text_encoder(self) -> "CompileRequest":
        """The text encoder's request: its own size, layers and prompt length; the DiT's fields that
        mean nothing to it left at their defaults (a patch or plan given is refused, not ignored)."""
        from ..models import text_encoder_config

        text_encoder_config(self.size)  # unknown size -> ValueError
        if self.plan is not None or self.patches:
            raise CompileError("the text encoder compiles on a preset mesh without patches (it has no SP and none of "
                               "the DiT's rewrites); leave --plan and --patches out with --component text-encoder")
        self._check_mesh()
        for name, value in (("blocks", self.blocks), ("prompt_tokens", self.prompt_tokens), ("vocab", self.vocab)):
            if value is not None and value < 1:
                raise CompileError(f"{name} must be >= 1, got {value}")
        if self.frontend == "torch-xla" and self.xla_host_bytes() > host_memory_bytes() * 3 // 4:
            vocab = self.vocab or text_encoder_config(self.size)["vocab_size"]
            raise CompileError(
                f"the torch-xla frontend holds the text encoder's replicated {vocab} x "
                f"{text_encoder_config(self.size)['d_model']} embedding once per virtual device ({self.num_devices}) in "
                f"host memory: about {self.xla_host_bytes() / 2**30:.0f} GiB here, more than 3/4 of this host's "
                f"{host_memory_bytes() / 2**30:.0f} GiB; pass a smaller --vocab (such as 32768: only the lookup's table "
                "shrinks, no collective changes), fewer --blocks, or use --frontend torchax (abstract weights)")
        return self._validate_common()

    def xla_host_bytes(self) -> int:
        """Host memory a torch-xla trace of the text encoder holds: its CPU client keeps one copy of
        each weight's shard per virtual device, beside the host copy the weights start from and the
        whole copy a move to the device makes before the shards (the replicated embedding dominates:
        2.1 GB in bf16 per copy at the full vocabulary), and a quarter more for what the trace adds
        (measured peaks: 13.7 GB on 1x4 with 1 layer, 11.5 GB on 8x4 with 2 layers and vocab 8192;
        without that quarter this count gives 12.8 and 9.3)."""
        from ..models import text_encoder_config

        cfg = text_encoder_config(self.size)
        elem = {"bf16": 2, "fp32": 4}.get(self.dtype, 4)
        n, tp = self.num_devices, self.mesh_spec().tp
        inner = cfg["num_heads"] * cfg["d_kv"]
        layer = 4 * cfg["d_model"] * inner + 3 * cfg["d_model"] * cfg["d_ff"]
        embed = (self.vocab or cfg["vocab_size"]) * cfg["d_model"]
        return elem * (embed * (n + 2) + self.num_blocks * layer * (n // tp + 2)) * 5 // 4

    def options(self) -> "CompileOptions":
        """The tt-mlir compile options of this request (hardware's when none were given)."""
        from .options import CompileOptions

        return CompileOptions.parse(self.compile_options)

    @property
    def num_devices(self) -> int:
        return self.mesh_spec().num_devices

    @property
    def num_blocks(self) -> int:
        """Transformer blocks (the text encoder: layers) compiled."""
        if self.blocks is not None:
            return self.blocks
        if self.component == "text-encoder":
            from ..models import text_encoder_config

            return text_encoder_config(self.size)["num_layers"]
        return config_for(self.variant, self.size)["num_layers"]

    @property
    def tokens(self) -> int:
        """Flat token count L (patchified latent), before padding; the text encoder's prompt tokens."""
        if self.component == "text-encoder":
            return self.prompt_tokens if self.prompt_tokens is not None else PROMPT_TOKENS[self.size]
        return LatentShape(*self.latent).tokens(tuple(config_for(self.variant, self.size)["patch_size"]))

    def label(self) -> str:
        if self.component == "text-encoder":
            extra = (("" if self.frontend == "torchax" else f" [{self.frontend}]")
                     + ("" if self.vocab is None else f" vocab={self.vocab}")
                     + ("" if self.composites == "hardware" else f" composites={self.composites}")
                     + ("" if self.mark_arguments else " unmarked"))
            return f"text-encoder/{self.size} {self.num_blocks}layers {self.mesh} {self.tokens}tok b{self.batch}{extra}"
        lat = self.resolution or "x".join(map(str, self.latent))
        extra = (("" if self.anchor else " no-anchor") + ("" if self.frontend == "torchax" else f" [{self.frontend}]")
                 + (f" +{'+'.join(self.patches)}" if self.patches else "")
                 + ("" if self.composites == "hardware" else f" composites={self.composites}")
                 + ("" if self.mark_arguments else " unmarked"))
        if self.cfg_plan is not None and self.plan is not None and self.cfg_plan.mesh_shape != self.plan.mesh_shape:
            extra += f" (group of [{self.cfg_plan.name}])"
        if self.plan is not None:
            return f"{self.variant}/{self.size} {self.num_blocks}blk {lat} plan [{self.plan.name}]{extra}"
        return f"{self.variant}/{self.size} {self.num_blocks}blk {self.mesh} {lat} pad={self.padding}{extra}"

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["latent"] = list(self.latent)
        d["patches"] = list(self.patches)
        d["notes"] = list(self.notes)
        d["plan"] = None if self.plan is None else self.plan.to_dict()
        d["cfg_plan"] = None if self.cfg_plan is None else self.cfg_plan.to_dict()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CompileRequest":
        d = dict(d)
        if "fused_sdpa" in d:  # results written before composite sets existed
            d.setdefault("composites", "sdpa" if d.pop("fused_sdpa") else "none")
        d["latent"] = tuple(int(v) for v in d["latent"])
        for key in ("plan", "cfg_plan"):
            if d.get(key) is not None:
                d[key] = ShardingPlan.from_dict(d[key])
        return cls(**d)


def host_memory_bytes() -> int:
    """This host's physical memory."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def latent_for(resolution: str | None = None, latent: str | Sequence[int] | None = None) -> tuple[int, int, int]:
    """(frames, height, width) from a resolution name (``"480p"``, ``"720p"``, ``"704p"``) or an
    explicit ``"F,H,W"`` string / sequence (which wins when both are given)."""
    if latent is not None:
        parts = latent.replace("x", ",").split(",") if isinstance(latent, str) else list(latent)
        try:
            vals = tuple(int(p) for p in parts)
        except ValueError:
            raise CompileError(f"latent must be F,H,W integers, got {latent!r}") from None
        if len(vals) != 3:
            raise CompileError(f"latent must have three sizes F,H,W, got {latent!r}")
        return vals  # type: ignore[return-value]
    if resolution is None:
        raise CompileError("give a resolution (480p, 720p, 704p) or a latent F,H,W")
    if resolution not in RESOLUTIONS:
        raise CompileError(
            f"unknown resolution {resolution!r}; known: {', '.join(RESOLUTIONS)} (or pass a latent F,H,W)")
    r = RESOLUTIONS[resolution]
    return (r.frames, r.height, r.width)


@dataclass
class CompileResult:
    """What one compile produced. ``ok`` is False when tt-mlir rejected the graph; ``error`` then
    holds the exception text and ``diagnostics`` the compiler's error lines from the log."""

    request: CompileRequest
    ok: bool
    error: str | None = None
    diagnostics: list[str] = field(default_factory=list)
    lower_seconds: float | None = None
    compile_seconds: float | None = None
    total_seconds: float | None = None  # build + trace + lower + compile, without process start-up
    out_dir: str | None = None
    ttnn_path: str | None = None
    ttir_path: str | None = None
    frontend_ir_path: str | None = None  # the module after tt-xla's frontend pass (arguments' roles)
    tokens: int | None = None
    padded_tokens: int | None = None
    sp_points: list[str] = field(default_factory=list)  # what the SP hooks constrained
    rss_mb: float | None = None
    sdpa_fused: int | None = None  # attention calls traced as the fused SDPA composite
    sdpa_plain: int | None = None  # attention calls left as plain math (not bf16)
    composites_marked: dict[str, int] = field(default_factory=dict)  # composites the trace marked, by name
    arguments_marked: dict[str, int] = field(default_factory=dict)  # argument markers the trace wrote, by role
    options_used: dict[str, Any] | None = None  # the plugin options the compile was given
    options_note: str | None = None  # why options_used differs from the request's options
    trace_seconds: float | None = None  # torch-xla frontend: the trace in its own worker
    trace_rss_mb: float | None = None  # torch-xla frontend: peak memory of that worker
    stablehlo_path: str | None = None  # torch-xla frontend: the Shardy module tt-mlir compiled
    log: str = ""  # this request's slice of the worker log

    @property
    def failure_text(self) -> str:
        """Everything that can explain a failure, for matching in tests and reports."""
        return "\n".join([self.error or "", *self.diagnostics, self.log])

    def ttnn_text(self) -> str:
        if not self.ttnn_path:
            raise CompileError(f"{self.request.label()}: no TTNN IR (compile ok={self.ok}): {self.error}")
        return Path(self.ttnn_path).read_text()

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("request", "log")}
        d["request"] = self.request.to_json()
        return d
