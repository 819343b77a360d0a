"""``shard_vae``: the diffusers ``AutoencoderKLWan`` on the mesh, through the one composition.

``resolve`` (mesh or plan, backend: the DiT's rules) -> the VAE's checks (nothing changed yet) ->
``compose.shard_module`` (specs -> placement -> the halo hooks), returning a :class:`VaeHandle`
whose ``decode`` / ``encode`` run the VAE's own decode / encode loop on the mesh, one program per
latent frame or time chunk (:mod:`.programs`), and return what ``vae.decode`` / ``vae.encode``
return. Each call's frame is split over H on one mesh axis and W on the other, the way round
whose halo all-gathers are smaller for that frame (:func:`.layout.plan_frame`); each step pads its
frame to the mesh (when it must) and splits it inside its program, and no halo all-gather in it
grows past the mid-block attention's K or V gather (a frame each: :func:`.layout.attention_gather`); the host
assembles the outputs and cuts them back to the logical size.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..backends import Backend
from ..compose import Resolved, ShardHandle, resolve, shard_module
from ..specs import ShardingError
from .halo import EXCHANGES
from .hooks import apply_vae_hooks
from .programs import StepPrograms, decode_steps, empty_cache, encode_steps, pad_frame
from .layout import (DEFAULT_STRATEGY, DEFAULT_VAE_PADDING, Frame, attention_gather, check_strategy, check_vae_model,
                     frame_splits, plan_frame, spatial_units, vae_specs, widest_scale)

__all__ = ["VaeHandle", "check_vae", "shard_vae"]

_SHARDED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # VAEs sharded now: a second shard_vae is refused


@dataclass(eq=False, repr=False)  # ShardHandle's short repr
class VaeHandle(ShardHandle):
    """What :func:`shard_vae` did to one VAE; ``decode`` / ``encode`` run it on the mesh,
    ``remove()`` restores it exactly."""

    padding_mode: str = "mask"
    steps: StepPrograms | None = None
    last_frame: Frame | None = None  # the frame of the latest decode or encode
    # the frame plan of each input shape and part, made once: every step of every call of that
    # shape reads the same Frame (its masks' tables are cached by size: :func:`.halo.kept_rows`)
    frames: dict = field(default_factory=dict, repr=False)

    @property
    def vae(self) -> torch.nn.Module:
        return self.model

    @property
    def strategy(self) -> str:
        return self.hooks.strategy

    def plan_decode(self, shape: tuple[int, ...]) -> Frame:
        """The frame a decode of latents of ``shape`` lies on: how it is split over the mesh (the
        orientation whose halo gathers are smallest) and padded (or refused, as ``padding`` says)."""
        return self._frame(shape, "decode")

    def plan_encode(self, shape: tuple[int, ...]) -> Frame:
        """The frame an encode of a video of ``shape`` lies on."""
        return self._frame(shape, "encode")

    def _frame(self, shape: tuple[int, ...], part: str) -> Frame:
        if len(shape) != 5:
            raise ShardingError(f"the VAE takes (batch, channels, frames, height, width), got a shape {tuple(shape)}")
        key = (part, tuple(shape[-2:]))
        if key not in self.frames:
            if self.strategy == "channels":  # the frame stays whole
                self.frames[key] = Frame(tuple(shape[-2:]), tuple(shape[-2:]))
            else:
                unit = spatial_units(self.vae)[0 if part == "decode" else 1]
                self.frames[key] = plan_frame(shape[-2], shape[-1], self.mesh, self.padding_mode, unit,
                                              "latent frame" if part == "decode" else "video frame",
                                              widest_scale(self.vae.config, part))
        return self.frames[key]

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> Any:
        """``vae.decode(z, return_dict)`` on the mesh; the same return type, on the host."""
        from diffusers.models.autoencoders.vae import DecoderOutput

        self._check_call()
        self._check_channels(z, "decode")
        frame = self.plan_decode(tuple(z.shape))  # refused here, before any program starts
        self.last_frame = frame
        out = torch.cat(self._run("decode", z, decode_steps(z.shape[2]), frame), dim=2)
        return DecoderOutput(sample=out) if return_dict else (out,)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        """``vae.encode(x, return_dict)`` on the mesh: the latent distribution's parameters are
        computed there, the distribution made on the host as the VAE makes it."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.models.modeling_outputs import AutoencoderKLOutput

        self._check_call()
        self._check_channels(x, "encode")
        frame = self.plan_encode(tuple(x.shape))
        self.last_frame = frame
        h = torch.cat(self._run("encode", x, encode_steps(x.shape[2]), frame), dim=2)
        posterior = DiagonalGaussianDistribution(h)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    def _check_channels(self, x: torch.Tensor, part: str) -> None:
        """A latent (decode) or video (encode) of another channel count than this VAE's, refused
        before anything runs (a Wan 2.2 latent into the Wan 2.1 VAE, or the other way round)."""
        cfg = self.vae.config
        want = cfg.z_dim if part == "decode" else cfg.in_channels // (cfg.patch_size or 1) ** 2
        got = x.shape[1] if x.ndim == 5 else None
        if got is not None and got != want:
            what = "latent" if part == "decode" else "video"
            which = " (Wan 2.1's latents have 16, Wan 2.2's 48: decode each with its own VAE)" if part == "decode" else ""
            raise ShardingError(f"this VAE {part}s a {what} of {want} channels, got {got} (shape {tuple(x.shape)}); "
                                f"pass a (batch, {want}, frames, height, width) {what}{which}")

    def _check_call(self) -> None:
        if self.removed:
            raise ShardingError("this VAE handle was removed; shard the VAE again to run it on the mesh")
        if getattr(self.vae, "use_tiling", False):
            raise ShardingError("the VAE has tiling enabled, which splits the frame itself; call vae.disable_tiling() "
                                "(the mesh splits the frame instead)")

    def _run(self, part: str, x: torch.Tensor, steps: list, frame: Frame) -> list[torch.Tensor]:
        """The steps in order, the cache handed from one to the next on the devices. Each step's
        input is padded on the host and uploaded split (each device gets its piece); each output
        stays split over the mesh, padded, and leaves it shard by shard (``backend.to_host``): the
        host assembles it and cuts it to the logical frame (a gather on the mesh would move a whole
        output frame, larger than anything else here)."""
        programs = self._programs()
        spec = self._spec(frame, x.ndim)
        pattern = empty_cache(self.vae, part)
        cached: tuple = ()
        outs = []
        with torch.no_grad(), self.tracing(part, frame, x.shape[0]):  # inference only
            for frames, first in steps:
                fn = programs.function(part, frame, pattern, first)
                piece = self.backend.upload(pad_frame(x[:, :, frames], frame.padded).contiguous(), spec)
                out, cached = self.backend.run_step(self.vae, self.placed, fn, piece, *cached)
                pattern = programs.next_pattern(fn)
                outs.append(_cut(self.backend.to_host(out), frame))
        return outs

    @contextlib.contextmanager
    def tracing(self, part: str, frame: Frame, batch: int = 1) -> Iterator[None]:
        """The context every step of ``part`` on ``frame`` (of ``batch`` items) runs, and is traced,
        in: the frame and the largest gather a halo may make held for the hooks, the backend's
        frontend quirks on."""
        gather = None if self.strategy == "channels" else attention_gather(self.vae, part, batch, frame)
        with self.hooks.state.holding(frame, gather), self.backend.step_quirks():
            yield

    def step_function(self, part: str = "decode", shape: tuple[int, ...] | None = None, after: Any = None) -> Any:
        """The function of ``part``'s first step for an input of ``shape`` (``after=None``, ``shape`` given: the
        first latent frame of a decode, the first video frame of an encode), or of the step that
        follows the step function ``after`` once that one has been traced (its cache's structure
        is then known); as ``decode`` / ``encode`` run them through the backend (inside
        :meth:`tracing`): ``fn(vae, x, *cache) -> (out, cache)``. The compile frontends lower them."""
        programs = self._programs()
        if after is None:
            return programs.function(part, self._frame(tuple(shape), part), empty_cache(self.vae, part), True)
        key = programs.key(after)
        return programs.function(part, key[1], programs.next_pattern(after), False)

    def _programs(self) -> StepPrograms:
        if self.steps is None:
            self.steps = StepPrograms(self._enter, self._pin)
        return self.steps

    def _spec(self, frame: Frame, ndim: int) -> tuple:
        return (None,) * ndim if frame.split is None else frame.split.frame_spec(ndim)

    def _pin(self, frame: Frame, t: torch.Tensor) -> torch.Tensor:
        """An output of a step constrained to the step's split."""
        return t if frame.split is None else self.backend.constrain(t, frame.split.frame_spec(t.ndim))

    def _enter(self, frame: Frame, x: torch.Tensor) -> torch.Tensor:
        """Inside a step's program: the input padded to its frame (when it came unpadded) and split
        over H and W (where it came split, the constraint moves nothing)."""
        return x if frame.split is None else self.backend.constrain(pad_frame(x, frame.padded), frame.split.frame_spec(x.ndim))

    def remove(self) -> None:
        super().remove()
        _SHARDED.discard(self.model)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update({"component": "vae", "padding": self.padding_mode, **self.hooks.describe()})
        if self.strategy != "channels":
            split = self.last_frame.split if self.last_frame is not None else None
            out["frame_split"] = (split.describe() if split is not None
                                  else f"per frame, H and W over {' and '.join(self.mesh.axis_names)}")
        return out


def _cut(out: torch.Tensor, frame: Frame) -> torch.Tensor:
    """A padded output cut back to ``frame``'s logical size at the output's resolution."""
    lh, lw = frame.logical_at(*out.shape[-2:])
    return out[..., :lh, :lw] if frame.is_padded else out


def check_vae(vae: torch.nn.Module, resolved: Resolved, strategy: str = DEFAULT_STRATEGY,
              padding: str = "mask") -> None:
    """Everything :func:`shard_vae` can check on the VAE as it is, changing nothing."""
    check_vae_model(vae)
    check_strategy(strategy, padding)
    if vae in _SHARDED:
        raise ShardingError("this VAE is already sharded; call its handle's remove() first")
    if resolved.patches:
        raise ShardingError(f"patches {list(resolved.patches)} are DiT rewrites; the VAE takes none")
    frame_splits(resolved.mesh)
    vae_specs(vae, resolved.mesh, strategy)


def shard_vae(vae: torch.nn.Module, mesh_or_plan: Any = None, backend: str | Backend | None = None,
              padding: str | None = None, *, strategy: str = DEFAULT_STRATEGY, exchange: str | None = None,
              keep_host_weights: bool = True,
              resolved: Resolved | None = None) -> VaeHandle:
    """Shard a diffusers ``AutoencoderKLWan`` (the Wan 2.1 VAE of the A14B pipelines or the Wan 2.2
    VAE of TI2V-5B) over the mesh: every frame split over H on one mesh axis and W on the other
    (per frame, the way round whose halo all-gathers are smaller: W on the 8-long axis of 8x4 for
    a wide video frame), each 3x3 conv's zero padding on a split dim replaced by a halo of one row
    from each neighbour. The halo moves as an all-gather of every shard's boundary rows over the
    whole mesh axis, each shard then picking its neighbours' rows from it: each chip is handed the
    axis length times the rows it needs (``compile --component vae`` reports both per step), and
    no such gather is larger than the attention's K or V gather. The mid-block attention runs each
    chip's queries (its shard's pixels) against the whole frame's keys and values, gathered: its
    scores and softmax are split over the mesh.

    Args:
        vae: the model (real weights; ``meta`` for the ``jax`` backend's compile-only lowering).
        mesh_or_plan: a preset name, a :class:`~wan_sharding.MeshSpec`, a backend's own mesh or a
            :class:`~wan_sharding.ShardingPlan` (its mesh; the VAE ignores its DiT roles).
        backend: ``"jax"`` (default), ``"xla"``, ``"tt"`` or a backend bound to the mesh.
        padding: ``"mask"`` (default: H and W the mesh does not divide are padded, the padded rows
            zeroed before every conv, the result cut back: exact) or ``"none"`` (such sizes refused).
        strategy: ``"halo"`` (default); ``"halo-permute"``, ``"annotate"`` and ``"channels"`` are the
            alternatives ``compile --component vae --strategy`` compares it with (docs/vae.md).
        exchange: how the halo rows move: ``"gather"`` (default for ``halo``), ``"permute"``
            (``halo-permute``'s), ``"none"`` (no neighbour rows: each shard convolved alone, wrong at
            the borders; what the check uses to show its grade can fail).
        keep_host_weights: as for :func:`~wan_sharding.shard_dit`.
        resolved: an already resolved request (``shard_pipeline`` resolves once for every part).

    Returns:
        A :class:`VaeHandle`: ``handle.decode(z, return_dict=...)`` and ``handle.encode(x, ...)``
        return what ``vae.decode`` / ``vae.encode`` return; ``handle.remove()`` restores the VAE.

    Raises:
        ShardingError: not an ``AutoencoderKLWan`` of the known structure, already sharded, an
            unknown strategy or a padding mode the VAE does not have, channels a mesh axis does
            not divide (``channels``). BackendError: the backend's stack is missing. All raised
            before the VAE is changed.
    """
    if resolved is None:
        resolved = resolve(mesh_or_plan, backend)  # the DiT's padding (a plan's) is not the VAE's
    elif mesh_or_plan is not None or backend is not None:
        raise ShardingError("shard_vae got a resolved request and a mesh or backend too; pass one of them")
    padding = DEFAULT_VAE_PADDING if padding is None else padding
    check_vae(vae, resolved, strategy, padding)
    if exchange is None:
        exchange = "permute" if strategy == "halo-permute" else "gather"
    elif exchange not in EXCHANGES:
        raise ShardingError(f"unknown halo exchange {exchange!r}; choose one of {', '.join(EXCHANGES)}")
    handle: VaeHandle = shard_module(  # type: ignore[assignment]
        vae, resolved, lambda m: vae_specs(m, resolved.mesh, strategy),
        hooks=lambda h: apply_vae_hooks(vae, resolved.backend, strategy, exchange),
        keep_host_weights=keep_host_weights, handle_type=VaeHandle)
    handle.padding_mode = padding
    _SHARDED.add(vae)
    return handle
