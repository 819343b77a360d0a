"""Shard a whole diffusers Wan 2.2 pipeline: every expert, with the pipeline's own ``__call__``.

:func:`shard_pipeline` takes a ``WanPipeline`` or ``WanImageToVideoPipeline`` (T2V-A14B and
I2V-A14B: ``transformer`` + ``transformer_2``; TI2V-5B: ``transformer`` only), resolves the request
once (:func:`wan_sharding.compose.resolve`), checks every expert, then shards each one with
:func:`wan_sharding.compose.shard_dit` and puts a small :class:`ShardedTransformer` in the pipeline
in its place. The wrapper exposes what the pipeline's
denoising loop uses (``config``, ``dtype``, ``device``, ``cache_context``, ``forward``) and runs
the forward through the backend; inputs and outputs stay on the host, so the pipeline's latents,
CFG, scheduler and VAE run as usual. The real model is held by the wrapper but not registered as
its submodule, so ``pipe.device`` / ``pipe._execution_device`` stay the host device and
``pipe.to(...)`` cannot move the sharded weights.

Nothing on any diffusers class is replaced: components are swapped through the pipeline's own
attribute assignment (which also records them in ``pipe.config``), and the returned
:class:`PipelineHandle`'s ``remove()`` undoes each expert's sharding and puts the original objects
back.

The pieces: :mod:`.standin` (the stand-in), :mod:`.handle` (the handle and the undo),
:mod:`.stacks` (the JAX / torch-xla guard).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ..backends import Backend
from ..compose import check_dit, resolve, shard_dit
from ..dit.specs import check_wan_model
from ..hooks import has_sp
from ..lora.fuse import fuse_lora_layers
from ..specs import ShardingError
from .handle import PipelineHandle, ShardedExpert, register_handle, sharded_handle
from .stacks import diffusers_without_torch_xla, warn_if_torch_xla_in_jax_process
from .guidance import GuidancePairs
from .standin import CFG_CACHE_REFUSAL, ShardedTransformer
from .text_encoder import check_pipeline_text_encoder, shard_pipeline_text_encoder
from .vae import check_pipeline_vae, shard_pipeline_vae

if TYPE_CHECKING:
    from ..plan import ShardingPlan

__all__ = [
    "EXPERT_COMPONENTS", "SUPPORTED_PIPELINES", "PipelineHandle", "ShardedExpert", "ShardedTransformer",
    "diffusers_without_torch_xla", "shard_pipeline", "sharded", "sharded_handle",
]

EXPERT_COMPONENTS = ("transformer", "transformer_2")
LORA_MODES = ("layers", "fuse")
SUPPORTED_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")


def _is_wan_pipeline(pipe: Any) -> bool:
    return any(c.__name__ in SUPPORTED_PIPELINES and c.__module__.startswith("diffusers.")
               for c in type(pipe).__mro__)


def shard_pipeline(pipe: Any, mesh: Any = None, backend: str | Backend = "jax",
                   padding: str | None = None, keep_host_weights: bool = True,
                   patches: Sequence[str] = (), plan: "ShardingPlan | str | Path | None" = None,
                   text_encoder: bool = False, vae: bool = False, lora: str = "layers") -> PipelineHandle:
    """Shard every expert of a diffusers Wan 2.2 pipeline over ``mesh``; the pipeline is then
    called as usual (``pipe(...)``) and runs each DiT forward on the mesh.

    Args:
        pipe: a ``WanPipeline`` (T2V-A14B, TI2V-5B) or ``WanImageToVideoPipeline`` (I2V-A14B).
            ``transformer`` and ``transformer_2`` are sharded when present (``None`` is skipped).
        mesh: a preset name (``"1x4"``, ``"2x4"``, ``"8x4"``), a :class:`MeshSpec`, or the
            backend's own mesh. With ``plan``: omit it (the plan's mesh), or pass the backend's own
            mesh with the plan's shape and axis names (to choose the devices).
        backend: ``"jax"`` (torchax, the default), ``"xla"`` (torch-xla SPMD), ``"tt"``, or a
            :class:`~wan_sharding.backends.Backend` instance bound to ``mesh``.
        padding: ``"slice"``, ``"mask"`` or ``"none"`` (see :func:`apply_dit_sp_activation_sharding`);
            default: the plan's, else ``"mask"``.
        keep_host_weights: for backends that move the model to their device (``xla``, ``tt``):
            keep the original host parameter objects, so ``remove()`` puts exactly those back (no
            device-to-host copy). ``False`` frees them while sharded (host memory: one copy of each
            expert less) and ``remove()`` copies the weights back from the device instead. The
            ``jax`` backend never moves the torch model.
        patches: model rewrites (``wan_sharding.patches``, e.g. ``("rope", "qkv")``) applied to
            every expert before it is sharded; ``remove()`` undoes them too.
        plan: a :class:`~wan_sharding.plan.ShardingPlan` or the path of one (``wan-sharding plan
            --write``): its mesh and axis roles, FSDP, activation layout and padding are applied to
            every expert. An explicit ``mesh`` or ``padding`` that contradicts it is an error. A plan
            (or mesh) with a cfg axis (``ShardingPlan.from_mesh(with_cfg("2x4"))``) runs each step's
            cond and uncond calls as one program, one branch per group (:mod:`.guidance`); a step
            cache is then refused.
        text_encoder: also shard the pipeline's UMT5 text encoder on the same mesh (Megatron TP,
            :func:`wan_sharding.text_encoder.shard_text_encoder`); the prompt is then encoded there.
        vae: also put the pipeline's VAE on the mesh (:func:`wan_sharding.shard_vae`: frames split
            over H and W, a halo per conv): the decode after denoising and I2V's image encode run
            there. ``False`` (default): the VAE stays on the host.

        lora: how loaded LoRA adapters run (``docs/lora.md``): ``"layers"`` (default) keeps PEFT's
            layers, each adapter's weights split beside its base's (switchable on the mesh:
            ``pipe.set_adapters``, ``disable_lora``, ``load_lora_weights(..., hotswap=True)``);
            ``"fuse"`` merges the active adapters into the base weights first (no extra op per
            block; ``remove()`` puts the base weights back bit for bit).

    Returns:
        A :class:`PipelineHandle`; ``handle.remove()`` (or leaving a ``with`` block) restores the
        pipeline's original components exactly.

    Raises:
        ShardingError: not a Wan pipeline, no experts, already sharded, an expert that cannot be
            sharded on this mesh, or an unknown padding mode. Raised before anything is changed.
        BackendError: the backend is missing or sees a different number of devices.
    """
    if not _is_wan_pipeline(pipe):
        raise ShardingError(
            f"shard_pipeline expects a diffusers Wan 2.2 pipeline ({' or '.join(SUPPORTED_PIPELINES)}), got "
            f"{type(pipe).__name__}; for a bare WanTransformer3DModel use shard_dit"
        )
    live = sharded_handle(pipe)
    if live is not None:
        raise ShardingError(
            f"this {type(pipe).__name__} is already sharded (on {live.mesh.name}); call handle.remove() "
            "on the first handle before sharding it again"
        )
    found = [(name, getattr(pipe, name, None)) for name in EXPERT_COMPONENTS]
    found = [(name, dit) for name, dit in found if dit is not None]
    if not found:
        raise ShardingError(f"{type(pipe).__name__} has no transformer to shard (transformer and transformer_2 are None)")
    for name, dit in found:
        if isinstance(dit, ShardedTransformer):
            raise ShardingError(
                f"pipe.{name} is already a ShardedTransformer (sharded through another handle); remove that handle first"
            )
        check_wan_model(dit)
        if has_sp(dit):
            raise ShardingError(
                f"pipe.{name} already carries sequence-parallel hooks (is it shared with another sharded pipeline, or "
                "was apply_dit_sp_activation_sharding called on it?); remove those first"
            )
    if lora not in LORA_MODES:
        raise ShardingError(f"unknown lora mode {lora!r}; choose one of {', '.join(LORA_MODES)}")
    resolved = resolve(mesh, backend, padding, patches, plan=plan)  # once, for every expert and the encoder
    _validate_experts([dit for _, dit in found], resolved)
    if text_encoder:
        check_pipeline_text_encoder(pipe, resolved)
    if vae:
        check_pipeline_vae(pipe, resolved)
    cfg = resolved.mesh.cfg_axis is not None
    if cfg and any(dit.is_cache_enabled for _, dit in found):
        raise ShardingError(CFG_CACHE_REFUSAL)
    warn_if_torch_xla_in_jax_process(pipe, resolved.backend)

    handle = PipelineHandle(pipe, resolved)
    if cfg:  # both experts share it: a step runs one of them, on the call's negative prompt
        handle.pairs = GuidancePairs(pipe)
    done: dict[int, ShardedExpert] = {}
    try:
        for name, dit in found:
            entry = pipe.config.get(name)
            first = done.get(id(dit))
            if first is not None:  # the same model in both slots: one sharding, one stand-in
                handle.experts.append(ShardedExpert(name, dit, first.wrapper, None, entry))
                setattr(pipe, name, first.wrapper)
                continue
            expert = ShardedExpert(name, dit, None, None, entry)
            handle.experts.append(expert)  # from here on, remove() can undo what follows
            if lora == "fuse":
                handle.fused.append(fuse_lora_layers(dit))
            expert.sharding = shard_dit(dit, resolved=resolved, keep_host_weights=keep_host_weights)
            h = expert.sharding
            expert.wrapper = ShardedTransformer(dit, h.backend, h.placed, name, h.padding, sp=h.sp, pairs=handle.pairs,
                                                sharding=h)
            if dit.is_cache_enabled:  # a cache enabled before sharding acts on the mesh too
                expert.wrapper._adopt_cache()
            done[id(dit)] = expert
            setattr(pipe, name, expert.wrapper)
        if text_encoder:
            handle.text_encoder = shard_pipeline_text_encoder(pipe, resolved, keep_host_weights)
        if vae:
            handle.vae = shard_pipeline_vae(pipe, resolved, keep_host_weights)
    except BaseException:
        handle.remove()
        raise
    register_handle(pipe, handle)
    return handle


def _validate_experts(dits: list[Any], resolved: Any) -> None:
    """Every expert checked against the request (TP split, SP points, patches) before any expert
    is changed."""
    for dit in dict.fromkeys(dits):
        check_dit(dit, resolved)


@contextlib.contextmanager
def sharded(pipe: Any, mesh: Any = None, backend: str | Backend = "jax", padding: str | None = None,
            plan: Any = None, text_encoder: bool = False) -> Iterator[PipelineHandle]:
    """``with sharded(pipe, "2x4"): pipe(...)``: shard for the block, restore after."""
    handle = shard_pipeline(pipe, mesh, backend=backend, padding=padding, plan=plan, text_encoder=text_encoder)
    try:
        yield handle
    finally:
        handle.remove()
